"""The Job: one training (or validation) pass over a dataset, on this rank, for all its epochs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _env, _native
from .sources import FileList, ImageFolder, as_source


class Job:
    """Clairvoyant data loading for one rank.

    ``for sample, label in job.epoch(e)`` yields each sample's bytes as a read-only uint8 numpy
    array that views the staging buffer or the node's shared memory (no copy), with its integer
    label, in the scheduled order. Epochs are consumed in order. ``job.batches(e)`` yields one
    (list of arrays, int64 labels) per scheduled batch.

    Every rank derives the same access streams from ``seed`` without communicating (seed 0 by
    default, as DistributedSampler). Ranks on one machine share one node cache.

    ``order`` replaces the seeded shuffle with explicit global orders, one per epoch (any
    sampler, materialised ahead). ``start_epoch`` resumes a run: epochs before it are neither
    served nor fetched, and later epochs are exactly those of an uninterrupted run.
    """

    def __init__(
        self,
        source,
        batch_size: int,
        epochs: int,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        config: str | os.PathLike | None = None,
        order: Sequence[Sequence[int]] | None = None,
        local_ranks: Sequence[int] | None = None,
        start_epoch: int = 0,
    ):
        if batch_size < 1:
            raise _native.ConfigError(f"invalid value for 'batch_size': must be at least 1, got {batch_size}")
        if order is None and epochs < 1:
            raise _native.ConfigError(f"invalid value for 'epochs': must be at least 1, got {epochs}")
        self.source = as_source(source)
        where = _env.detect(rank, world_size, local_ranks)
        self.rank, self.world_size, self.local_ranks = where.rank, where.world_size, where.local_ranks
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        from . import config as _config

        self.config_path, model_toml = _config.resolve(config)
        orders = None if order is None else [[int(k) for k in epoch_order] for epoch_order in order]
        self._engine = _native.Engine(
            self.source._native,
            batch_size,
            len(orders) if orders is not None else epochs,
            seed,
            drop_last,
            self.rank,
            self.world_size,
            self.local_ranks,
            where.run_id,
            model_toml,
            orders,
            start_epoch,
        )
        self.epochs = self._engine.epochs
        self._closed = False

    # -- dataset facts -------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self.source)

    @property
    def labels(self) -> np.ndarray:
        return self.source.labels

    @property
    def paths(self) -> list:
        return self.source.paths

    @property
    def classes(self) -> list:
        return self.source.classes

    @property
    def steps_per_epoch(self) -> int:
        return len(self._engine.batch_ends(0))

    def samples_of(self, epoch: int) -> np.ndarray:
        """This rank's sample indices of ``epoch`` in access order."""
        return self._engine.epoch_samples(epoch)

    def batch_sizes(self, epoch: int) -> np.ndarray:
        ends = self._engine.batch_ends(epoch)
        return np.diff(np.concatenate([[0], ends]))

    def placement(self) -> list:
        """(class, samples, bytes) of this node's cache plan."""
        return self._engine.placement()

    # -- consumption ---------------------------------------------------------------------
    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        """Iterate over ``epoch``'s samples as (uint8 view, label)."""
        self._begin(epoch)
        remaining = len(self._engine.epoch_samples(epoch))
        return _SampleIter(self._engine, remaining)

    def batches(self, epoch: int) -> Iterator[tuple[list, np.ndarray]]:
        """Iterate over ``epoch``'s batches as (list of uint8 views, int64 labels)."""
        self._begin(epoch)
        return _BatchIter(self._engine, [int(n) for n in self.batch_sizes(epoch)])

    def shared_batches(self, epoch: int) -> Iterator[tuple]:
        """Iterate over ``epoch``'s batches for worker processes: (lease, [(region, offset,
        length)], int64 labels, {index: bytes}). Regions index :attr:`segments`; the bytes stay
        valid while ``lease`` is referenced."""
        self._begin(epoch)
        engine = self._engine
        for n in self.batch_sizes(epoch):
            yield engine.next_batch_shared(int(n))

    @property
    def segments(self) -> tuple:
        """(staging ring file, memory arena file or None): shared files holding staged bytes."""
        return self._engine.segments

    def _begin(self, epoch: int) -> None:
        if self._closed:
            raise _native.CancelledError("the job is closed")
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise _native.ConfigError(f"invalid value for 'epoch': {epoch!r}")
        self._engine.begin_epoch(int(epoch))

    def stats(self) -> list:
        """Per-epoch figures: samples, bytes, stall_seconds, and samples/bytes per source."""
        return self._engine.stats()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"Job({self.num_samples} samples, batch_size={self.batch_size}, epochs={self.epochs}, "
            f"rank={self.rank}/{self.world_size}, local_ranks={self.local_ranks})"
        )


class _SampleIter:
    __slots__ = ("_engine", "_left")

    def __init__(self, engine, left: int):
        self._engine, self._left = engine, left

    def __iter__(self):
        return self

    def __len__(self):
        return self._left

    def __next__(self):
        if self._left <= 0:
            raise StopIteration
        self._left -= 1
        return self._engine.next_sample()


class _BatchIter:
    __slots__ = ("_engine", "_sizes", "_i")

    def __init__(self, engine, sizes):
        self._engine, self._sizes, self._i = engine, sizes, 0

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._sizes) - self._i

    def __next__(self):
        if self._i >= len(self._sizes):
            raise StopIteration
        n = self._sizes[self._i]
        self._i += 1
        return self._engine.next_batch(n)


__all__ = ["Job", "ImageFolder", "FileList", "Path"]
