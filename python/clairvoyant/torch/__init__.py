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

from ._dropin import DataLoader
from ._job_loader import ImageFolder, JobLoader, LoaderError, pil_loader

__all__ = ["DataLoader", "ImageFolder", "JobLoader", "LoaderError", "pil_loader"]
