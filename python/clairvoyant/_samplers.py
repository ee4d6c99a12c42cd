"""Reading a sampler's order, now and ahead, without disturbing it (the drop-in's, and that of
``clairvoyant run --sampler-order``, which imports this module without importing the drop-in:
that import is a training program's first ``iter()`` otherwise).

Now: at the start of each epoch the loader draws the user's batch sampler to its end, exactly
as torch's iterator would draw it (the same calls, in the same order, with the same random
number generators), and serves those batches. So the batches are torch's by construction,
whatever the sampler.

Ahead: to prefetch across epoch boundaries and to place samples in the node cache, the loader
also predicts upcoming epochs, on copies (the user's sampler and generators are never
advanced by a prediction):

- ``DistributedSampler``: a pure function of (seed, epoch, rank); epoch ``e + 1`` follows
  ``e``, as training loops call ``set_epoch``; every rank's order is known, so ranks sharing a
  node plan one cache.
- ``SequentialSampler``: the same order every epoch.
- ``RandomSampler`` with a ``generator`` (``shuffle=True`` with ``generator=``): the
  generator's state is copied and the next epoch's draws replayed on the copy.
- a sampler with a method ``__clairvoyant_order__(epoch) -> Sequence[int] | None`` (the
  indices it will yield in that epoch; None when it cannot tell).

Other samplers (``RandomSampler`` drawing from torch's global generator, which the training
loop also draws from) are read at the start of each epoch only; a wrong prediction costs some
prefetching, never a wrong batch.
"""

from __future__ import annotations

import copy
import numbers
import sys
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

__all__ = ["drain", "Predictor", "epoch_of"]


def drain(index_sampler, batched: bool = True) -> list:
    """Every batch (list of indices) or index the sampler yields this epoch, as torch's
    iterator would draw them. Without automatic batching (``batched=False``) an index that is
    not an integer (a list of indices, a key) is kept as the sampler gave it."""
    if batched:
        return [list(b) if not isinstance(b, int) else int(b) for b in index_sampler]
    return [int(b) if isinstance(b, numbers.Integral) and not isinstance(b, bool) else b for b in index_sampler]


def integer_indices(batches: list, batched: bool) -> bool:
    """Whether every index of these batches (``batched``) or indices is an integer, as
    clairvoyant's cache needs them; a sampler may yield lists of indices, or keys, to the
    dataset instead."""

    def ok(i) -> bool:
        return isinstance(i, numbers.Integral) and not isinstance(i, bool)

    if batched:
        return all(ok(i) for b in batches for i in b)
    return all(ok(b) for b in batches)


def epoch_of(sampler) -> Optional[int]:
    """The epoch a sampler with ``set_epoch`` is on (None for samplers without epochs)."""
    e = getattr(sampler, "epoch", None)
    return int(e) if isinstance(e, int) else None


class Predictor:
    """Future orders of one loader's sampler: ``batches(epoch, rank)`` -> the batches rank
    ``rank`` will draw in ``epoch`` (a sampler-epoch number for samplers with ``set_epoch``,
    else the count of epochs drawn so far), or None when they cannot be known."""

    def __init__(self, loader):
        self.sampler = loader.sampler
        self.batch_sampler = loader.batch_sampler
        self.generator = loader.generator
        self.kind = self._kind()

    def _kind(self) -> str:
        s = self.sampler
        if hasattr(s, "__clairvoyant_order__"):
            return "protocol"
        if type(s) is DistributedSampler or (isinstance(s, DistributedSampler) and type(s).__iter__ is DistributedSampler.__iter__):
            return "distributed"
        if type(s) is SequentialSampler:
            return "sequential"
        if type(s) is RandomSampler:
            return "random" if s.generator is not None else "unknown"
        return "unknown"

    @property
    def all_ranks(self) -> bool:
        """Every rank's order is known (ranks on a node can plan one cache)."""
        return self.kind == "distributed"

    def _batches(self, sampler) -> Optional[list]:
        bs = self.batch_sampler
        if bs is None:
            return [int(i) for i in sampler]
        if type(bs) is not BatchSampler:
            return None  # a custom batch sampler: its grouping cannot be replayed
        clone = BatchSampler(sampler, bs.batch_size, bs.drop_last)
        return [list(b) for b in clone]

    def batches(self, epoch: int, rank: Optional[int] = None, draw_base_seed: bool = True) -> Optional[list]:
        s = self.sampler
        if self.kind == "distributed":
            c = copy.copy(s)
            c.epoch = epoch
            if rank is not None:
                c.rank = rank
            return self._batches(c)
        if self.kind == "sequential":
            return self._batches(s)
        if self.kind == "random":
            g = torch.Generator()
            g.set_state(s.generator.get_state())
            if draw_base_seed and self.generator is s.generator:
                # torch's iterator draws its workers' base seed from the loader's generator
                # before the sampler's first draw.
                torch.empty((), dtype=torch.int64).random_(generator=g)
            c = copy.copy(s)
            c.generator = g
            return self._batches(c)
        if self.kind == "protocol":
            order = s.__clairvoyant_order__(epoch)
            if order is None:
                return None
            return self._batches(_Fixed(order))
        return None


class _Fixed(torch.utils.data.Sampler):
    def __init__(self, order):
        self.order = [int(i) for i in order]

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def generator_state(loader) -> Optional[Any]:
    """The state of the generator the sampler draws from, before an epoch's draws (a seed in
    effect: enough to redraw the epoch)."""
    s = loader.sampler
    g = getattr(s, "generator", None) if isinstance(s, RandomSampler) else None
    if isinstance(s, RandomSampler) and g is None:
        return ("global", torch.get_rng_state())
    if g is not None:
        return ("generator", g.get_state())
    return None


def redraw(loader, state) -> list:
    """The batches the sampler drew in an epoch that began with generator state ``state``
    (see :func:`generator_state`); the user's global generator is left as it is, a sampler's own
    generator is left where that epoch's draws left it."""
    kind, value = state
    if kind == "global":
        saved = torch.get_rng_state()
        torch.set_rng_state(value)
        try:
            return drain(loader._index_sampler_of_user(), loader._auto_collation)
        finally:
            torch.set_rng_state(saved)
    loader.sampler.generator.set_state(value)
    return drain(loader._index_sampler_of_user(), loader._auto_collation)


def folder_root(dataset):
    """(DatasetFolder, index map or None) when ``dataset`` is a DatasetFolder or a (nested)
    Subset of one."""
    # An instance of DatasetFolder means its module is imported; without it there is none to find.
    tvf = sys.modules.get("torchvision.datasets.folder")
    if tvf is None:
        return None, None
    DatasetFolder = tvf.DatasetFolder
    indices = None
    d = dataset
    while isinstance(d, torch.utils.data.Subset):
        idx = list(d.indices)
        indices = idx if indices is None else [idx[i] for i in indices]
        d = d.dataset
    if isinstance(d, DatasetFolder):
        return d, indices
    return None, None
