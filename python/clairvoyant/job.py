"""The Job: one training (or validation) pass over a dataset, on this rank, for all its epochs."""

from __future__ import annotations

import contextlib
import gc
import operator
import os
import weakref
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import _env, _native, _peers
from .sources import FileList, ImageFolder, as_source

_U32 = 2**32 - 1
_U64 = 2**64 - 1
# A TypeError that is also a ClairvoyantError where the native module defines one.
_TypeError = getattr(_native, "ArgumentTypeError", TypeError)


def _int_arg(name: str, value, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``lo..=hi``: TypeError naming ``name`` for a non-integer,
    ConfigError naming it for an integer out of range."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        raise _TypeError(f"'{name}' must be an integer, not {type(value).__name__}")
    v = operator.index(value)
    if not lo <= v <= hi:
        raise _native.ConfigError(f"invalid value for '{name}': must be in {lo}..={hi}, got {v}")
    return v


def _ids(name: str, where: str, seq, num_samples: int) -> np.ndarray:
    """Sample ids of one pass as an int64 array, each checked against the dataset; errors name
    ``name`` (and ``where``: which epoch) and the position."""
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
        raise _TypeError(f"'{name}'{where}: must be a sequence of sample ids, not {type(seq).__name__}")
    a = np.asarray(seq if hasattr(seq, "__len__") else list(seq))
    if a.ndim != 1:
        raise _native.ConfigError(f"invalid value for '{name}':{where} must be a flat sequence of sample ids")
    if a.size and a.dtype.kind not in "iu":
        if a.dtype.kind != "O":
            raise _TypeError(f"'{name}'{where}: sample ids must be integers, not {a.dtype}")
        ids = a.tolist()  # Python ints beyond 64 bits, or a mixture
        for i, k in enumerate(ids):
            if isinstance(k, (bool, np.bool_)) or not hasattr(type(k), "__index__"):
                raise _TypeError(f"'{name}'{where} position {i}: sample ids must be integers, not {type(k).__name__}")
        a = np.asarray([operator.index(k) for k in ids], dtype=object)
    if a.size:
        bad = np.flatnonzero((a < 0) | (a >= num_samples))
        if bad.size:
            pos = int(bad[0])
            raise _native.ConfigError(
                f"invalid value for '{name}':{where} position {pos}: sample {a[pos]} is outside "
                f"the dataset of {num_samples} samples"
            )
    return a.astype(np.int64) if a.size else np.zeros(0, dtype=np.int64)


def _orders(order, num_samples: int) -> list:
    """Explicit per-epoch orders as int64 arrays (the engine reads them in place), every id
    checked against the dataset."""
    if isinstance(order, (str, bytes)) or not hasattr(order, "__iter__"):
        raise _TypeError(f"'order' must be a sequence of per-epoch sequences of sample ids, not {type(order).__name__}")
    out = []
    for e, epoch_order in enumerate(order):
        out.append(_ids("order", f" epoch {e}", epoch_order, num_samples))
    if not out:
        raise _native.ConfigError("invalid value for 'order': must hold at least one epoch")
    return out


def _schedule_args(batch_size, epochs, order, seed, drop_last, start_epoch) -> tuple:
    """The schedule's arguments of :class:`Job`, checked (each error names its argument)."""
    batch_size = _int_arg("batch_size", batch_size, 1, _U32)
    if epochs is not None:
        epochs = _int_arg("epochs", epochs, 1, _U32)
    elif order is None:
        raise _native.ConfigError("invalid value for 'epochs': required unless 'order' gives the epochs")
    seed = _int_arg("seed", seed, 0, _U64)
    if not isinstance(drop_last, (bool, np.bool_)):
        raise _TypeError(f"'drop_last' must be a bool, not {type(drop_last).__name__}")
    start_epoch = _int_arg("start_epoch", start_epoch, 0, _U32)
    return batch_size, epochs, seed, bool(drop_last), start_epoch


def _rank_args(rank, world_size, local_ranks) -> tuple:
    """The placement arguments of :class:`Job`, checked (each error names its argument)."""
    if rank is not None:
        rank = _int_arg("rank", rank, 0, _U32 - 1)
    if world_size is not None:
        world_size = _int_arg("world_size", world_size, 1, _U32)
    if local_ranks is not None:
        if isinstance(local_ranks, (str, bytes)) or not hasattr(local_ranks, "__iter__"):
            raise _TypeError(f"'local_ranks' must be a sequence of ranks, not {type(local_ranks).__name__}")
        local_ranks = [_int_arg("local_ranks", r, 0, _U32 - 1) for r in local_ranks]
        if len(set(local_ranks)) != len(local_ranks):
            raise _native.ConfigError(f"invalid value for 'local_ranks': {local_ranks} names a rank twice")
    return rank, world_size, local_ranks


def _detect(rank, world_size, local_ranks):
    """This rank's place (the arguments completed from the launcher's variables); local ranks
    must lie within the world size."""
    where = _env.detect(rank, world_size, local_ranks)
    outside = [r for r in where.local_ranks if not 0 <= r < where.world_size]
    if outside:
        raise _native.ConfigError(
            f"invalid value for 'local_ranks': {outside} outside world size {where.world_size} "
            f"(ranks are 0..{where.world_size - 1})"
        )
    return where


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for the block (as it was after it)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Job:
    """Clairvoyant data loading for one rank.

    ``for sample, label in job.epoch(e)`` yields each sample's bytes as a read-only uint8 numpy
    array that views the staging buffer or the node's shared memory (no copy), with its integer
    label, in the scheduled order. Epochs are consumed in order: starting epoch ``e`` ends every
    earlier epoch's iterator, which then raises :class:`ExhaustedError` naming both epochs instead
    of yielding samples of another epoch (an iterator that was run to its end keeps stopping).
    ``job.batches(e)`` yields one (list of arrays, int64 labels) per scheduled batch.

    Every rank derives the same access streams from ``seed`` without communicating (seed 0 by
    default, as DistributedSampler). Ranks on one machine share one node cache.

    ``order`` replaces the seeded shuffle with explicit global orders, one per epoch (any
    sampler, materialised ahead): the orders define the epochs, so ``epochs`` may be left out and,
    when given, must equal ``len(order)``. ``start_epoch`` resumes a run: epochs before it are
    neither served nor fetched, and later epochs are exactly those of an uninterrupted run.
    ``run_id`` tells concurrent runs on one machine apart (default: the launcher's run id).
    ``peers``: whether this job's nodes cooperate (one cache across nodes, samples fetched from
    other nodes; see ``docs/cluster.md``). The default turns it on when the launcher describes
    several nodes (``WORLD_SIZE`` above ``LOCAL_WORLD_SIZE``, Slurm or MPI alike) or
    ``CLAIRVOYANT_PEERS`` is set; the nodes then meet through the launcher's own machinery.

    Arguments are checked before anything starts: a value of the wrong type raises TypeError, one
    out of range :class:`ConfigError`, each naming the argument (``seed`` is 0..2**64-1; counts,
    ranks and sample ids fit 32 bits; ``local_ranks`` lie within ``world_size``).

    ``close()`` (or leaving a ``with`` block) stops the job at once: iterators of this job raise
    :class:`CancelledError`, DataLoaders built on it stop their workers, and the job's shared
    memory files are removed (views still held keep only their own mapping). :meth:`stats` still
    answers after ``close()``.
    """

    def __init__(
        self,
        source,
        batch_size: int,
        epochs: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        config: str | os.PathLike | None = None,
        order: Sequence[Sequence[int]] | None = None,
        local_ranks: Sequence[int] | None = None,
        start_epoch: int = 0,
        run_id: str | None = None,
        peers: bool | None = None,
    ):
        self._closed = True  # until the engine exists (close() and __del__ must not fail)
        self._engine = None
        self._peers = None
        batch_size, epochs, seed, drop_last, start_epoch = _schedule_args(batch_size, epochs, order, seed, drop_last, start_epoch)
        if run_id is not None and not isinstance(run_id, str):
            raise _TypeError(f"'run_id' must be a string, not {type(run_id).__name__}")
        rank, world_size, local_ranks = _rank_args(rank, world_size, local_ranks)
        self.source = as_source(source)
        where = _detect(rank, world_size, local_ranks)
        orders = None if order is None else _orders(order, len(self.source))
        if orders is not None and epochs is not None and epochs != len(orders):
            raise _native.ConfigError(
                f"invalid value for 'epochs': {epochs}, but 'order' gives {len(orders)} epoch(s); "
                "explicit orders define the epochs (leave 'epochs' out or make it len(order))"
            )
        self.rank, self.world_size, self.local_ranks = where.rank, where.world_size, where.local_ranks
        self.batch_size, self.seed, self.drop_last = batch_size, seed, drop_last
        from . import config as _config

        model = _config.resolve(config)
        self.config_path = model.path
        if peers is not None and not isinstance(peers, (bool, np.bool_)):
            raise _TypeError(f"'peers' must be a bool or None, not {type(peers).__name__}")
        run = where.run_id if run_id is None else run_id
        cluster = None
        # Meeting the other nodes and starting the engine allocate (imports, the cluster's
        # records): with torch loaded, that can set off a full collection of every object in the
        # process (0.15 s idle, 0.7 s with 8 ranks starting on 2 cores) before the engine reads
        # anything. Paused, the collection comes later, while the engine's threads read.
        with _collector_paused():
            if _peers.wanted(peers, where.world_size, where.local_ranks):
                facts = {
                    "batch_size": batch_size,
                    "epochs": epochs,
                    "seed": seed,
                    "drop_last": drop_last,
                    "start_epoch": start_epoch,
                    "orders": None if orders is None else _peers.job_id(orders=[list(map(int, o)) for o in orders]),
                }
                self._peers = _peers.setup(
                    source=self.source,
                    model=model,
                    rank=where.rank,
                    world_size=where.world_size,
                    local_ranks=where.local_ranks,
                    run_id=run,
                    facts=facts,
                )
                cluster = self._peers.cluster
            self._attach_engine(batch_size, epochs, orders, seed, drop_last, run, model, start_epoch, cluster)
        self.epochs = self._engine.epochs
        self.start_epoch = start_epoch
        self._steps = len(self._engine.batch_ends(start_epoch))
        self._live = None  # weak reference to the iterator of the current epoch
        self._loaders: list = []  # weak references to DataLoaders built on this job
        self._final_stats = None
        self._closed = False

    def _attach_engine(self, batch_size, epochs, orders, seed, drop_last, run, model, start_epoch, cluster) -> None:
        """Start the engine and hand it to this job's peer server (closed when the engine fails)."""
        try:
            self._engine = self._start_engine(
                batch_size, epochs, orders, seed, drop_last, run, model, start_epoch, cluster
            )
        except BaseException:
            if self._peers is not None and self._peers.server is not None:
                self._peers.server.close()
            raise
        if self._peers is not None and self._peers.server is not None:
            self._peers.server.attach(self._engine)

    def _start_engine(self, batch_size, epochs, orders, seed, drop_last, run, model, start_epoch, cluster):
        return _native.Engine(
            self.source._native,
            batch_size,
            len(orders) if orders is not None else epochs,
            seed,
            drop_last,
            self.rank,
            self.world_size,
            self.local_ranks,
            run,
            model,
            orders,
            start_epoch,
            cluster,
        )

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
        return list(self.source.classes)

    @property
    def steps_per_epoch(self) -> int:
        """Batches in the job's first epoch (every epoch of a seeded job)."""
        return self._steps

    def samples_of(self, epoch: int) -> np.ndarray:
        """This rank's sample indices of ``epoch`` in access order. The job drops a pass's
        samples once it is consumed or skipped: asking for them then raises
        :class:`EpochConsumedError`."""
        return self._open_engine().epoch_samples(self._epoch_arg(epoch))

    def append_epoch(self, samples, batch_sizes) -> int:
        """Append a pass over ``samples`` (this rank's sample ids, in access order) served in
        batches of ``batch_sizes`` (positive, adding up to ``len(samples)``) as the job's next
        epoch, and return its index. The job stages into it as soon as it is appended; epochs
        are still consumed in order, and beginning a later epoch skips the rest unread."""
        engine = self._open_engine()
        ids = _ids("samples", "", samples, len(self.source))
        if ids.size == 0:
            raise _native.ConfigError("invalid value for 'samples': an epoch needs at least one sample")
        if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__iter__"):
            raise _TypeError(f"'batch_sizes' must be a sequence of batch sizes, not {type(batch_sizes).__name__}")
        sizes = [_int_arg("batch_sizes", b, 1, _U32) for b in batch_sizes]
        if sum(sizes) != ids.size:
            raise _native.ConfigError(
                f"invalid value for 'batch_sizes': the sizes add up to {sum(sizes)} but 'samples' holds {ids.size}"
            )
        epoch = engine.append_epoch(ids, sizes)
        self.epochs = engine.epochs
        return epoch

    def batch_sizes(self, epoch: int) -> np.ndarray:
        ends = self._open_engine().batch_ends(self._epoch_arg(epoch))
        return np.diff(np.concatenate([[0], ends]))

    def placement(self) -> list:
        """(class, samples, bytes) of this node's cache plan."""
        return self._open_engine().placement()

    # -- consumption ---------------------------------------------------------------------
    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, int]]:
        """Iterate over ``epoch``'s samples as (uint8 view, label)."""
        epoch = self._begin(epoch)
        ends = self._engine.batch_ends(epoch)
        return self._track(_SampleIter(self._engine, epoch, int(ends[-1]) if len(ends) else 0))

    def batches(self, epoch: int) -> Iterator[tuple[list, np.ndarray]]:
        """Iterate over ``epoch``'s batches as (list of uint8 views, int64 labels)."""
        epoch = self._begin(epoch)
        return self._track(_BatchIter(self._engine, epoch, [int(n) for n in self.batch_sizes(epoch)], "next_batch"))

    def shared_batches(self, epoch: int) -> Iterator[tuple]:
        """Iterate over ``epoch``'s batches for worker processes: (lease, [(region, offset,
        length)], int64 labels, {index: bytes}). Regions index :attr:`segments`; the bytes stay
        valid while ``lease`` is referenced."""
        epoch = self._begin(epoch)
        sizes = [int(n) for n in self.batch_sizes(epoch)]
        return self._track(_BatchIter(self._engine, epoch, sizes, "next_batch_shared"))

    @property
    def segments(self) -> tuple:
        """(staging ring file, memory arena file or None): shared files holding staged bytes."""
        return self._open_engine().segments

    def _open_engine(self):
        engine = self._engine
        if engine is None or self._closed:
            raise _native.CancelledError("the job is closed")
        return engine

    def _epoch_arg(self, epoch) -> int:
        if isinstance(epoch, (bool, np.bool_)) or not hasattr(type(epoch), "__index__"):
            raise _TypeError(f"'epoch' must be an integer, not {type(epoch).__name__}")
        epoch = operator.index(epoch)
        if epoch < 0:
            raise _native.ConfigError(f"invalid value for 'epoch': must be at least 0, got {epoch}")
        return min(epoch, _U32)  # the engine says which epochs the job has

    def _begin(self, epoch) -> int:
        engine = self._open_engine()
        epoch = self._epoch_arg(epoch)
        engine.begin_epoch(epoch)
        live = self._live() if self._live is not None else None
        if live is not None:
            live._end(
                _native.ExhaustedError(
                    f"this iterator of epoch {live.epoch} was left unfinished when epoch {epoch} began; "
                    "epochs are consumed in order"
                )
            )
        self._live = None
        return epoch

    def _track(self, it):
        self._live = weakref.ref(it)
        return it

    def _add_loader(self, loader) -> None:
        """Close ``loader`` (its workers map this job's shared memory) when the job closes."""
        self._loaders = [r for r in self._loaders if r() is not None] + [weakref.ref(loader)]

    def stats(self) -> list:
        """Per-epoch figures: samples, bytes, stall_seconds, samples/bytes per source (``peer``:
        from other nodes' caches), file-system bytes and files read, ``peer_misses`` (a peer
        could not answer: not filled yet, not held, wrong bytes) and ``peer_fallbacks`` (a peer
        was down) for multi-node jobs."""
        if self._closed and self._final_stats is not None:
            return self._final_stats
        return self._open_engine().stats()

    def peer_stats(self) -> dict | None:
        """For a multi-node job: this node's index and the nodes' ranks, the peer client's
        counters (``fetched``, ``bytes``, ``not_yet``, ``not_held``, ``peer_down``, ``corrupt``,
        ``down_events`` per node) and, on the node's first local rank, its server's (``served``,
        ``bytes``, ``rejected_connections``, ``cpu_seconds``, ...). None for a one-node job."""
        if self._peers is None:
            return None
        if self._closed:
            return getattr(self, "_final_peer_stats", None)
        return self._peer_stats(self._open_engine())

    def _peer_stats(self, engine) -> dict | None:
        if self._peers is None:
            return None
        out = {"node": self._peers.node, "nodes": self._peers.nodes, "client": engine.peer_stats()}
        if self._peers.server is not None:
            out["server"] = self._peers.server.stats()
        return out

    def close(self) -> None:
        """Stop the job and release its shared memory now (see the class documentation)."""
        if self._closed:
            return
        self._closed = True
        for ref in self._loaders:
            loader = ref()
            if loader is not None:
                loader.close()
        self._loaders = []
        live = self._live() if self._live is not None else None
        if live is not None:
            live._end(_native.CancelledError(f"the job was closed during epoch {live.epoch}"))
        self._live = None
        engine, self._engine = self._engine, None
        try:
            self._final_stats = engine.stats()
            self._final_peer_stats = self._peer_stats(engine)
        finally:
            engine.close()
            if self._peers is not None and self._peers.server is not None:
                self._peers.server.close()

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
    __slots__ = ("_engine", "_left", "epoch", "_error", "__weakref__")

    def __init__(self, engine, epoch: int, left: int):
        self._engine, self.epoch, self._left, self._error = engine, epoch, left, None

    def __iter__(self):
        return self

    def __len__(self):
        return self._left

    def _end(self, error: BaseException) -> None:
        """Another epoch began or the job closed: drop the engine, raise ``error`` from now on."""
        self._engine, self._error = None, error

    def __next__(self):
        if self._left <= 0:
            raise StopIteration
        engine = self._engine
        if engine is None:
            raise self._error
        self._left -= 1
        return engine.next_sample()


# A batch reaches its worker in at most this many parts (see _BatchIter.next_parts).
_PARTS = 8


class _BatchIter:
    __slots__ = ("_engine", "_sizes", "_i", "_take", "_part", "epoch", "_error", "__weakref__")

    def __init__(self, engine, epoch: int, sizes, method: str):
        self._engine, self.epoch, self._sizes, self._i, self._error = engine, epoch, sizes, 0, None
        self._take = getattr(engine, method)
        self._part = engine.next_part_shared if method == "next_batch_shared" else None

    def __iter__(self):
        return self

    def __len__(self):
        return len(self._sizes) - self._i

    def _end(self, error: BaseException) -> None:
        self._engine, self._take, self._part, self._error = None, None, None, error

    def __next__(self):
        if self._i >= len(self._sizes):
            raise StopIteration
        take = self._take
        if take is None:
            raise self._error
        n = self._sizes[self._i]
        self._i += 1
        return take(n)

    def next_parts(self) -> Iterator[tuple]:
        """The next batch (of :meth:`Job.shared_batches`) in parts, each as soon as its samples
        are staged (an eighth of the batch at least, or what is left of it): (lease, [(region,
        offset, length)], int64 labels, {index: bytes}, failed), where ``failed`` says one more
        sample, after the part's, could not be read. Every part must be taken before the next
        batch."""
        if self._i >= len(self._sizes):
            raise StopIteration
        if self._part is None:
            raise self._error if self._error is not None else TypeError("batches in parts are for worker processes")
        n = self._sizes[self._i]
        self._i += 1
        return self._parts(n)

    def _parts(self, left: int) -> Iterator[tuple]:
        # Parts of a few samples at least: each costs its worker a wait.
        step = -(-left // _PARTS)
        while left > 0:
            take = self._part
            if take is None:
                raise self._error
            part = take(left, min(step, left))
            left -= len(part[1]) + part[4]
            yield part


__all__ = ["Job", "ImageFolder", "FileList", "Path"]
