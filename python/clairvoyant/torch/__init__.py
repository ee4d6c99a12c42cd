"""PyTorch integration.

The one-line change: replace ``torch.utils.data.DataLoader`` with
``clairvoyant.torch.DataLoader``, with the same arguments::

    dataset = torchvision.datasets.ImageFolder(root, transform)
    sampler = DistributedSampler(dataset)
    loader = clairvoyant.torch.DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=4)

It yields exactly the batches torch's DataLoader yields, and reads their bytes ahead in the
sampler's order through clairvoyant's node cache (see :class:`DataLoader` and the dataset
protocol in ``clairvoyant.torch._datasets``).

:class:`ImageFolder` over a :class:`clairvoyant.Job` serves the job's own seeded order instead
(the Job API); ``DataLoader`` over it is a :class:`JobLoader`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._dropin import DataLoader
    from ._job_loader import ImageFolder, JobLoader, LoaderError, pil_loader

__all__ = ["DataLoader", "ImageFolder", "JobLoader", "LoaderError", "pil_loader"]

# Where each name is defined. The loaders are imported when first named: `clairvoyant run
# --sampler-order` imports only the order predictor and the dataset helpers of this package,
# at the program's first iter(), and needs neither loader.
_DEFINED_IN = {
    "DataLoader": "._dropin",
    "ImageFolder": "._job_loader",
    "JobLoader": "._job_loader",
    "LoaderError": "._job_loader",
    "pil_loader": "._job_loader",
}


def __getattr__(name: str):
    where = _DEFINED_IN.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
