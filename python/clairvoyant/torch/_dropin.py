"""``clairvoyant.torch.DataLoader``: torch's DataLoader, with clairvoyant reading the bytes.

The loader is a ``torch.utils.data.DataLoader`` (a subclass, built by torch's own constructor:
every argument, attribute, check and error is torch's). Iterating it runs torch's own
single-process or multi-process iterator, so worker seeding, ``worker_init_fn``, start methods,
persistent workers, pinning, ``in_order`` and time-outs behave as they do in torch. Two things
differ, both invisible in the batches:

- the iterator draws indices from clairvoyant's index sampler, which draws the user's sampler
  for the whole epoch at the epoch's first draw (exactly the draws torch would make; see
  ``_order``), has the job's engine serve those samples in that order, and hands each batch of
  indices to torch together with where its bytes lie in shared memory;
- the dataset in the workers is a ``CachedDataset`` around the user's, which computes
  ``dataset[i]`` from those bytes (see ``_datasets``).

The engine's access stream is a queue of passes: the epochs the loader predicted (placement is
planned over them) and the epochs it actually served. An epoch that was predicted is served
from the prefetched pass; one that was not (a peek restarting an epoch, a resume, an
unpredictable sampler) is appended and the passes before it are skipped unread.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Optional, TypeVar

import numpy as np
import torch
from torch.utils.data import BatchSampler, DistributedSampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from .. import _env, _settings
from ..errors import ArgumentTypeError, CancelledError, ConfigError, EpochConsumedError, ExhaustedError
from .. import _samplers
from . import _ahead, _datasets, _job_loader, _native_loader, _rank, _tickets

__all__ = ["DataLoader"]

# Epochs planned ahead when the run's length is not given.
_HORIZON = 2
# Bytes kept per batch for a worker's random state (torch, random and numpy generators).
_STATE_BYTES = 16384
_STATE_VERSION = 2
# States of these versions load (1: worker random states held numpy arrays, which
# torch.load(weights_only=True) refuses).
_STATE_VERSIONS = (1, 2)


def _notice(message: str) -> None:
    if _settings.get("CLAIRVOYANT_QUIET", False):
        return
    print(f"clairvoyant: {message}", file=sys.stderr)


def _epochs_arg(epochs) -> Optional[int]:
    if epochs is None:
        epochs = _settings.get("CLAIRVOYANT_EPOCHS", None)
        if epochs is None:
            return None
    if isinstance(epochs, bool) or not isinstance(epochs, int):
        raise ArgumentTypeError(f"'epochs' must be an integer, not {type(epochs).__name__}")
    if epochs < 1:
        raise ConfigError(f"invalid value for 'epochs': must be at least 1, got {epochs}")
    return epochs


# torch's class, whatever ``torch.utils.data.DataLoader`` names later (see ``patch``).
_TorchDataLoader = torch.utils.data.dataloader.DataLoader
_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(_TorchDataLoader[_T_co]):
    """``torch.utils.data.DataLoader`` with clairvoyant's prefetching and node cache.

    Takes torch's arguments with torch's meaning and yields exactly the batches torch's
    DataLoader yields for them, in the same order. When the dataset's samples are stored files
    clairvoyant knows how to read (torchvision ``DatasetFolder``/``ImageFolder``, or the dataset
    protocol in ``clairvoyant.torch``), their bytes come from clairvoyant: read ahead in the
    sampler's order, cached on the node, shared by the ranks of the machine. Otherwise the
    batches are loaded as torch loads them, with a one-line notice.

    ``epochs`` (or ``CLAIRVOYANT_EPOCHS``) optionally names the run's number of epochs so that the
    node cache is planned over the whole run; without it, it is planned over the next few epochs.

    ``state_dict()`` / ``load_state_dict()`` resume a run exactly: after loading a state saved
    mid-epoch, the next ``iter()`` continues with the very next batch (also with another
    ``num_workers``; with the same ``num_workers`` random transforms in the workers also repeat
    exactly).

    Native decode (docs/decode.md): over a torchvision ``ImageFolder``/``DatasetFolder`` whose
    transform is a ``Compose`` of transforms clairvoyant knows (RandomResizedCrop,
    RandomHorizontalFlip, Resize, CenterCrop, ToTensor, PILToTensor/ToImage + ToDtype, Normalize)
    and with the default collate, batches are decoded in Rust threads (``max(1, num_workers)`` of
    them, no worker processes) straight into one batch tensor, pinned with ``pin_memory=True``:
    the same samples in the same order as torch's, pixels within a tested tolerance of Pillow's,
    random crops and flips drawn from per-sample streams of the loader's seed (not torch's
    draws). ``native_decode=False`` (or ``CLAIRVOYANT_NATIVE_DECODE=0``) keeps torch's exact
    batches. A one-line notice says which path runs.

    A ``clairvoyant.torch.ImageFolder`` over a :class:`clairvoyant.Job` is served in the job's own
    order (see :class:`clairvoyant.torch.JobLoader`).
    """

    def __init__(
        self,
        dataset,
        batch_size: Optional[int] = 1,
        shuffle: Optional[bool] = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: Optional[int] = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        epochs: Optional[int] = None,
        native_decode: Optional[bool] = None,
    ):
        if native_decode is not None and not isinstance(native_decode, bool):
            raise ArgumentTypeError(f"'native_decode' must be True, False or None, not {type(native_decode).__name__}")
        self._cv_native_decode = native_decode
        self._cv_native = None  # the native path's NativeSetup, once chosen
        self._cv_native_reason: Optional[str] = None
        self._job_loader = None
        self._cv = None
        self._cv_reason: Optional[str] = None
        self._resume: Optional[dict] = None
        if isinstance(dataset, _job_loader.ImageFolder):
            jl = _job_loader.JobLoader(
                dataset,
                batch_size=None if batch_size in (None, 1) else batch_size,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                drop_last=None if not drop_last else True,
                prefetch_factor=prefetch_factor,
                timeout=timeout,
                multiprocessing_context=multiprocessing_context,
            )
            super().__init__(
                dataset,
                batch_size=jl.batch_size,
                drop_last=jl.drop_last,
                num_workers=num_workers,
                collate_fn=collate_fn,
                pin_memory=pin_memory,
                timeout=timeout,
                prefetch_factor=jl.prefetch_factor if num_workers > 0 else None,
            )
            self._job_loader = jl
            return
        super().__init__(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self.epochs = _epochs_arg(epochs)

    # -- the job-backed dataset of clairvoyant.torch.ImageFolder ---------------------------
    def __getattr__(self, name):
        jl = self.__dict__.get("_job_loader")
        if jl is not None and not name.startswith("__"):
            return getattr(jl, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        if self._job_loader is not None:
            return len(self._job_loader)
        return super().__len__()

    def __iter__(self):
        if self._job_loader is not None:
            return iter(self._job_loader)
        return super().__iter__()

    # -- torch's iterators over clairvoyant's sampler and dataset --------------------------
    def _get_iterator(self):
        held, feed = _HEAP.hold(), None  # before the first allocations of the job's start (see _Heap)
        try:
            feed = self._feed()
        finally:
            if held and (feed is None or feed.holds_heap):
                _HEAP.release()  # not cached, or this loader holds it already
            elif held:
                feed.holds_heap = True
        if feed is None:
            return super()._get_iterator()
        view = _View(self, feed)
        native = self._native_setup()
        # Worker processes take tickets: the sampler does not wait for the batch's bytes (a
        # loader given workers only after its first epoch has no board, and hands out leases).
        feed.ticketed = native is None and self.num_workers > 0 and feed.board is not None
        if feed.ticketed and _ahead.wanted(self):
            view.collate_fn = _ahead.Collate(self.collate_fn)
        # A resumed epoch was begun by the interrupted run, which drew its iterator's base seed
        # then: creating this iterator must not draw another from the user's generator, or the
        # epochs after the resumed one would be drawn from a shifted generator.
        resuming = feed.resumes(self)
        gen = self.generator
        saved = (gen.get_state() if gen is not None else torch.get_rng_state()) if resuming else None
        drawn = feed.count
        try:
            if native is not None:
                it = _native_loader.NativeIter(view, native)
            elif self.num_workers == 0:
                it = _SingleProcessDataLoaderIter(view)
            else:
                self.check_worker_number_rationality()
                feed.start_early(self)
                it = _Iter(view)
        finally:
            # Worker processes make torch's iterator draw the epoch while it is created: the
            # resumed epoch's redraw then left the sampler's generator where that epoch's draws
            # left it, which is where the next epoch starts from.
            redrawn = feed.count != drawn and gen is not None and gen is getattr(self.sampler, "generator", None)
            if saved is not None and not redrawn:
                gen.set_state(saved) if gen is not None else torch.set_rng_state(saved)
        feed.serving(it)
        return it

    def _native_setup(self):
        """The native decode path's setup when it applies to this loader (decided once, with a
        one-line notice), else None."""
        if self._cv_native_reason is None:
            setup, reason = _native_loader.native_choice(self, self._cv_native_decode)
            self._cv_native_reason = "" if setup is not None else (reason or "not a folder of files")
            self._cv_native = setup
            if setup is not None:
                _notice(setup.describe())
            elif reason is not None:
                _notice(f"{type(self.dataset).__name__} decoded as torch's DataLoader decodes it: {reason}")
        setup = self._cv_native
        if setup is not None and setup.pid != os.getpid():  # a forked process: the pool's threads are gone
            setup = self._cv_native = _native_loader.NativeSetup(setup.folder, setup.plan, setup.threads)
        return setup

    def _feed(self) -> Optional["_Feed"]:
        if self._cv is None and self._cv_reason is None:
            if isinstance(self.dataset, torch.utils.data.IterableDataset):
                self._cv_reason = f"{type(self.dataset).__name__} is an iterable-style dataset"
                _notice(f"not cached: {self._cv_reason} (no sample indices to read ahead); batches are loaded as torch's DataLoader loads them")
            else:
                self._cv = _Feed(self)
        return self._cv

    def _index_sampler_of_user(self):
        return _TorchDataLoader._index_sampler.fget(self)

    # -- exact resume ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the loader is: the epoch, the batches the training loop has received in it,
        the sampler's generator state at the epoch's start and the workers' random states
        (small: no orders). ``load_state_dict`` of it makes the next ``iter()`` continue with
        the next batch."""
        if self._job_loader is not None:
            raise ConfigError("state_dict() is for DataLoaders over a torch dataset; a clairvoyant.Job resumes with start_epoch=")
        feed = self._feed()
        if feed is None:
            raise ConfigError(f"state_dict(): {self._cv_reason}; resuming it is not supported")
        return feed.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch with its
        next batch (when the sampler is on that epoch; a sampler moved to another epoch starts
        that one from its beginning, with a warning if the saved epoch was unfinished)."""
        if self._job_loader is not None:
            raise ConfigError("load_state_dict() is for DataLoaders over a torch dataset")
        if not isinstance(state, dict):
            raise ArgumentTypeError(f"load_state_dict() takes a dict from state_dict(), not {type(state).__name__}")
        missing = [k for k in ("version", "epoch", "yielded", "total", "num_workers", "generator", "workers") if k not in state]
        if missing:
            raise ConfigError(f"load_state_dict(): the state lacks {missing} (was it made by clairvoyant.torch.DataLoader.state_dict()?)")
        if state["version"] not in _STATE_VERSIONS:
            raise ConfigError(f"load_state_dict(): state version {state['version']} is not one of {list(_STATE_VERSIONS)}")
        for k in ("yielded", "total", "num_workers"):
            if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0:
                raise ConfigError(f"load_state_dict(): '{k}' must be a non-negative integer, got {state[k]!r}")
        gen = state["generator"]
        if gen is not None and not (
            isinstance(gen, (list, tuple)) and len(gen) == 2 and gen[0] in ("global", "generator") and isinstance(gen[1], torch.Tensor)
        ):
            raise ConfigError(f"load_state_dict(): 'generator' must be None or [kind, state tensor], got {type(gen).__name__}")
        state = dict(state)
        if state["workers"] is not None:
            try:
                state["workers"] = [_datasets.rng_state_from_plain(w) for w in state["workers"]]
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"load_state_dict(): 'workers' does not hold workers' random states ({e})") from None
        self._resume = state
        feed = self._feed()
        if feed is not None and isinstance(state["epoch"], int) and _samplers.epoch_of(self.sampler) is None:
            feed.count = state["epoch"]

    def stats(self) -> list:
        """Per epoch served (in the order served; a peeked epoch appears twice): samples,
        bytes, stall_seconds and samples/bytes per source, as :meth:`clairvoyant.Job.stats`,
        with ``epoch`` the sampler's epoch. Empty when nothing is cached."""
        if self._job_loader is not None:
            return self._job_loader.job.stats()
        feed = self.__dict__.get("_cv")
        return [] if feed is None else feed.stats()

    def peer_stats(self) -> Optional[dict]:
        """For a job that spans nodes, its peer counters as :meth:`clairvoyant.Job.peer_stats`
        gives them (this node's client, and its server on the node's first local rank), also
        after :meth:`close`; None when the job is one node's or nothing is cached."""
        if self._job_loader is not None:
            return self._job_loader.job.peer_stats()
        feed = self.__dict__.get("_cv")
        return None if feed is None else feed.peer_stats()

    def close(self) -> None:
        """Stop the workers and the job now and release clairvoyant's shared memory (also done
        when the loader is garbage collected)."""
        if self._job_loader is not None:
            self._job_loader.close()
            return
        it = self.__dict__.get("_iterator")
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        feed = self.__dict__.get("_cv")
        if feed is not None:
            native = feed._iter() if feed._iter is not None else None
            if getattr(native, "_cv_native", False):
                native._shutdown_workers()  # its decode thread reads the job's shared memory
            feed.close()


class _Iter(_MultiProcessingDataLoaderIter):
    """torch's multi-process iterator, receiving the workers' results on a thread as torch does
    when it pins memory: rebuilding a batch's shared tensors costs a round trip to the worker
    that sent it, and the training loop should find the batch ready instead of paying that per
    step. What arrives and in which order is unchanged."""

    def __init__(self, loader) -> None:
        super().__init__(loader)
        self._cv_thread = None
        if self._pin_memory:
            return  # torch's pin-memory thread does this already
        import queue
        import threading

        src, dst = self._worker_result_queue, queue.Queue()
        stop = self._cv_stop = threading.Event()

        def receive() -> None:
            while not stop.is_set():
                try:
                    item = src.get(timeout=0.1)
                except queue.Empty:
                    continue
                except (EOFError, OSError, ValueError):  # closed: the workers are gone
                    return
                dst.put(item)
                del item

        self._cv_thread = threading.Thread(target=receive, name="clairvoyant-receive", daemon=True)
        self._cv_thread.start()
        _native_loader.stop_at_exit(stop, self._cv_thread)
        self._data_queue = dst

    def _shutdown_workers(self) -> None:
        try:
            super()._shutdown_workers()
        finally:
            thread = getattr(self, "_cv_thread", None)
            if thread is not None:
                self._cv_stop.set()
                thread.join(timeout=5)
                self._cv_thread = None


class _Heap:
    """Keeps the training process's objects out of its collector's full walks while a loader is
    open.

    With torch loaded a process holds some 350,000 objects, and a full collection of Python's
    cyclic collector walks them all: 0.15 s on an idle core, 0.6 s when 8 ranks start at once on
    2 cores. The import of torch and torchvision leaves one due, and the allocations of an
    iterator's creation (the job's start, the workers' fork) set it off before the engine has
    read anything, in every rank at once. The objects the process holds when its first loader
    creates an iterator (modules, the model) are frozen then (``gc.freeze``, as Python's
    documentation recommends before forking), and unfrozen when the last open loader closes or
    at exit, so that a cycle among them that became garbage meanwhile is collected then. Objects
    created later are collected as always. A program that froze objects itself, or runs with the
    collector off, is left as it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    def hold(self) -> bool:
        with self._lock:
            if self._holders == 0:
                if not gc.isenabled() or gc.get_freeze_count():
                    return False
                gc.freeze()
            self._holders += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._holders == 0:  # (released at exit already)
                return
            self._holders -= 1
            if self._holders == 0:
                gc.unfreeze()

    def release_all(self) -> None:
        with self._lock:
            if self._holders:
                self._holders = 0
                gc.unfreeze()


_HEAP = _Heap()
atexit.register(_HEAP.release_all)  # the collection at exit then finalizes them


class _View:
    """The loader as torch's iterator sees it: the user's loader, but with clairvoyant's
    dataset and index sampler."""

    def __init__(self, loader: DataLoader, feed: "_Feed"):
        self._loader = loader
        self.dataset = feed.dataset
        self._index_sampler = _Sampler(feed)
        self.worker_init_fn = _WorkerInit(loader.worker_init_fn)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _WorkerInit:
    """Runs first in each worker process: freezes the inherited objects (``gc.freeze``),
    ``get_worker_info().dataset`` names the user's
    dataset (torch names the dataset the workers were given, clairvoyant's wrapper of it),
    then the user's ``worker_init_fn``."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, worker_id: int) -> None:
        import gc

        # The objects this worker inherited at the fork (all of torch's) are moved out of the
        # collector's reach, as Python's documentation recommends for forked processes: the
        # worker's first full collection would otherwise walk them all (0.15 s of CPU per
        # worker with torch and torchvision loaded) and copy the pages it touches.
        gc.freeze()
        info = torch.utils.data.get_worker_info()
        if info is not None and isinstance(info.dataset, _datasets.CachedDataset):
            object.__setattr__(info, "dataset", info.dataset.dataset)  # WorkerInfo is frozen after init
        if self.fn is not None:
            self.fn(worker_id)


class _Sampler:
    """clairvoyant's index sampler: the user's batches, each with where its bytes are."""

    def __init__(self, feed: "_Feed"):
        self._feed = feed

    def __len__(self) -> int:
        return len(self._feed.loader._index_sampler_of_user())

    def __iter__(self):
        # torch calls this while creating or resetting an iterator, when the loader is alive.
        # The generator holds the loader until the epoch is drawn, then the feed only: an
        # iterator that a loader with persistent workers keeps must not keep the loader (a
        # cycle), so that dropping the iterator shuts its workers down at once, as torch's.
        return self._feed.epoch(self._feed.loader)


class _Current:
    """The epoch being served: what ``state_dict`` needs."""

    def __init__(self, key, total: int, skip: int, first_token: int, gstate):
        self.key, self.total, self.skip, self.first_token, self.gstate = key, total, skip, first_token, gstate
        self.plain = False  # indices passed to the dataset as they are: no worker records their states
        self.last: Optional[int] = None  # the epoch's last token, when workers decode ahead after it


class _Feed:
    """One loader's link to its job: plans the job at the first epoch, serves each epoch's
    batches from it, keeps each batch's bytes leased until the process decoding it is done."""

    def __init__(self, loader: DataLoader):
        self._loader = weakref.ref(loader)
        self.pid = os.getpid()
        self.adapter, why = _datasets.adapter_for(loader.dataset)
        self.reason = why
        self.predictor = _samplers.Predictor(loader)
        self.job = None
        self.started = False
        self.next_pass = 0
        self.count = 0
        self.token = 0
        self.leases: dict = {}
        self.lock = threading.Lock()  # guards leases (the feeder adds to them)
        self.feeder: Optional[_tickets.Feeder] = None
        self.ticketed = False
        self.ahead_gen = 0  # generations of batches taken ahead
        self.current: Optional[_Current] = None
        self.served: list = []  # (epoch key, engine pass) of every epoch served
        self._job_stats = None
        self._peer_stats = None
        self._iter = None
        self.holds_heap = False  # this loader's hold on the frozen heap (_Heap)
        workers = loader.num_workers
        depth = (loader.prefetch_factor or 2) * max(1, workers)
        slots = 4 * depth + 16
        self.done = torch.zeros(slots, dtype=torch.int64).share_memory_()
        self.states = torch.zeros((slots if workers > 0 else 0, _STATE_BYTES), dtype=torch.uint8).share_memory_()
        self.segments: tuple = ()
        # A slot holds a batch of the loader's size (256 for a batch sampler's; wider ones spill).
        width = (loader.batch_size or 256) if loader._auto_collation else 1
        self.board = _tickets.Board(slots, width) if workers > 0 else None
        self.dataset = _datasets.CachedDataset(
            loader.dataset, self.adapter.kind if self.adapter else "none", self.done, self.states, self.board
        )

    def __del__(self):
        # The last of the loader and its iterators is gone: release the job's shared memory.
        try:
            self.close()
        except Exception:
            pass

    @property
    def loader(self) -> DataLoader:
        loader = self._loader()
        if loader is None:
            raise ExhaustedError("the DataLoader this iterator belongs to was garbage collected")
        return loader

    def resumes(self, loader: DataLoader) -> bool:
        """The next epoch continues an interrupted one (a loaded state applies to it)."""
        r = loader._resume
        if r is None or r["yielded"] >= r["total"]:
            return False
        return r["epoch"] == self._epoch_key(loader)

    def serving(self, it) -> None:
        self._iter = weakref.ref(it)

    def _notice(self, message: str) -> None:
        _notice(message)

    # -- planning ------------------------------------------------------------------------
    def _start(self, loader: DataLoader, key, batches: list) -> None:
        """Create the job at the first epoch: plan over the predicted epochs of every rank of
        this machine."""
        self.started = True
        if self.adapter is None:
            self._notice(f"not cached: {self.reason}; batches are loaded as torch's DataLoader loads them")
            return
        flat = _flatten(batches)
        if len(flat) == 0:
            return
        sampler = loader.sampler
        if self.predictor.kind == "unknown":
            self._notice_unknown_order(sampler)
        distributed = self.predictor.all_ranks and isinstance(sampler, DistributedSampler)
        where = _rank.resolve((sampler.rank, sampler.num_replicas) if distributed else None)
        b, dl = _batch_shape(loader)
        horizon = _HORIZON
        if loader.epochs is not None and isinstance(key, int):
            horizon = max(1, loader.epochs - key)
        import clairvoyant

        source = self.adapter.source or clairvoyant.FileList(self.adapter.files, self.adapter.labels)
        if distributed and b is not None:
            self.job = self._ranks_job(source, where, key, batches, b, dl, horizon)
        if self.job is None:
            self.job = self._own_job(source, where, key, flat, b, dl, horizon)
        self.segments = tuple(self.job.segments)

    def start_early(self, loader: DataLoader) -> None:
        """Start the job before torch's iterator forks its workers (it draws the first epoch
        after), when that epoch's batches are known without drawing from any generator: a
        DistributedSampler's or a SequentialSampler's. The engine then reads while the workers
        start (0.05-0.1 s per rank when 8 start at once on 2 cores)."""
        if self.started or loader._resume is not None or self.predictor.kind not in ("distributed", "sequential"):
            return
        key = self._epoch_key(loader)
        batches = self.predictor.batches(key)
        if batches and _samplers.integer_indices(batches, loader._auto_collation):
            self._start(loader, key, batches)

    def _epoch_key(self, loader: DataLoader):
        """The epoch the next iteration draws: the sampler's epoch number, else the count of
        epochs drawn so far."""
        key = _samplers.epoch_of(loader.sampler)
        return self.count if key is None else key

    def _notice_unknown_order(self, sampler) -> None:
        hint = (
            " (pass a seeded generator= to read epochs ahead)"
            if isinstance(sampler, torch.utils.data.RandomSampler)
            else " (a sampler can tell it with __clairvoyant_order__(epoch))"
        )
        self._notice(
            f"{type(sampler).__name__}'s future order cannot be known: each epoch is read ahead "
            f"from its start, not across epochs{hint}"
        )

    def _ranks_job(self, source, where, key, batches: list, b: int, dl: bool, horizon: int):
        """A DistributedSampler's job: the global orders of the epochs whose every rank's
        batches can be predicted (None when not even the first can)."""
        import clairvoyant
        from clairvoyant import _peers

        # A node of several computes every rank's stream (the nodes plan one cache across
        # them and must agree on it); a node alone needs its own ranks' only.
        multi = _peers.wanted(None, where.world_size, where.local_ranks)
        ranks = range(where.world_size) if multi else where.local_ranks
        orders = []
        for h in range(horizon):
            e = key + h
            streams = {}
            for r in ranks:
                got = batches if (h == 0 and r == where.rank) else self.predictor.batches(e, r)
                if got is None:
                    break
                streams[r] = got
            else:
                order = _interleave(streams, where.world_size, b, dl)
                if order is not None:
                    orders.append(order)
                    continue
            break
        if not orders:
            return None
        return clairvoyant.Job(
            source,
            batch_size=b,
            order=orders,
            drop_last=dl,
            rank=where.rank,
            world_size=where.world_size,
            local_ranks=where.local_ranks,
        )

    def _own_job(self, source, where, key, flat, b, dl: bool, horizon: int):
        """This rank's own order only: a node cache of its own."""
        import clairvoyant

        orders = [flat]
        # A generator's next epoch can be replayed; the ones after it depend on draws
        # made meanwhile (the base seeds of iterators), so one epoch ahead only.
        ahead = horizon if self.predictor.kind in ("distributed", "sequential", "protocol") else min(horizon, 2)
        for h in range(1, ahead):
            got = self.predictor.batches(key + h if isinstance(key, int) else h, None, draw_base_seed=self._draws_base_seed())
            if got is None:
                break
            orders.append(_flatten(got))
        run = _env.run_id()
        return clairvoyant.Job(
            source,
            batch_size=b or 1,
            order=orders,
            drop_last=dl if b else False,
            rank=0,
            world_size=1,
            local_ranks=[0],
            run_id=f"{run}/rank{where.rank}" if where.world_size > 1 else None,
        )

    def _draws_base_seed(self) -> bool:
        loader = self.loader
        return not (loader.persistent_workers and loader.num_workers > 0)

    # -- serving -------------------------------------------------------------------------
    def _pass_for(self, samples: np.ndarray, sizes: list) -> int:
        """The engine pass that serves exactly these samples in these batches: a predicted
        one if it matches, else a new one appended."""
        job = self.job
        for p in range(self.next_pass, job.epochs):
            try:
                if list(job.batch_sizes(p)) == sizes and np.array_equal(job.samples_of(p), samples):
                    return p
            except EpochConsumedError:  # dropped from the stream: not a candidate
                continue
        return job.append_epoch(samples, sizes)

    def _predict_after(self, key, p: int, last: Optional[int], rank: Optional[int], draws: bool) -> None:
        """Append the next epoch's predicted pass when none follows ``p`` yet (``last``: the
        loader's ``epochs``; ``rank`` and ``draws``: see ``Predictor.batches``)."""
        job = self.job
        if job.epochs > p + 1 or not isinstance(key, int):
            return
        if last is not None and key + 1 >= last:
            # The run ends with this epoch: reading ahead into one more would only cost reads.
            return
        got = self.predictor.batches(key + 1, rank, draw_base_seed=draws)
        if not got:
            return
        flat = _flatten(got)
        if len(flat):
            job.append_epoch(flat, _sizes(got))

    def _rank_for_prediction(self):
        s = self.loader.sampler
        return s.rank if isinstance(s, DistributedSampler) else None

    def _retire(self) -> None:
        """A new epoch: the previous one's batches are no longer wanted. A previous iterator
        still running workers is shut down before its bytes are released."""
        old = self._iter() if self._iter is not None else None
        if old is not None and not getattr(old, "_persistent_workers", False):
            if hasattr(old, "_shutdown_workers") and getattr(old, "_workers", None):
                old._shutdown_workers()
        # Batches the workers are done with are released first: a take ahead may wait for room.
        self._sweep()
        ahead = self._stop_feeder()
        with self.lock:
            self.leases.clear()
        return ahead

    def _stop_feeder(self, patience: Optional[float] = None) -> Optional[_tickets.Ahead]:
        """Stop the feeder; what it took ahead of the next epoch, if anything."""
        feeder, self.feeder = self.feeder, None
        if feeder is not None:
            feeder.stop(patience)
        if self.board is not None:
            self.board.clean()  # spilled posts no stopped worker read
        return feeder.ahead if feeder is not None else None

    def _sweep(self) -> None:
        done = self.done
        with self.lock:
            for t in [t for t in self.leases if int(done[t % done.numel()]) == t + 1]:
                del self.leases[t]

    def _epoch_batches(self, loader: DataLoader, key, resume, gstate) -> tuple:
        """The epoch's batches and where in them to start: a loaded state of this epoch resumes
        it (its batches redrawn, those it yielded skipped, the workers' states restored).
        Returns (batches, skip, generator state, workers' states or None)."""
        if resume is not None and resume["yielded"] < resume["total"] and resume["epoch"] == key:
            batches = (
                _samplers.redraw(loader, resume["generator"])
                if resume["generator"] is not None
                else _samplers.drain(loader._index_sampler_of_user(), loader._auto_collation)
            )
            if len(batches) != resume["total"]:
                raise ConfigError(
                    f"load_state_dict(): the saved epoch {key} had {resume['total']} batches but the sampler now gives "
                    f"{len(batches)}; the dataset or the sampler changed"
                )
            restore = None
            if resume["num_workers"] == loader.num_workers and loader.num_workers > 0:
                restore = resume["workers"]
            return batches, resume["yielded"], resume["generator"], restore
        if resume is not None and resume["yielded"] < resume["total"]:
            warnings.warn(
                f"clairvoyant: the loaded state is {resume['yielded']} batches into epoch {resume['epoch']}, "
                f"but the sampler is on epoch {key}: starting epoch {key} from its beginning",
                stacklevel=4,  # where the epoch's iteration was started
            )
        return _samplers.drain(loader._index_sampler_of_user(), loader._auto_collation), 0, gstate, None

    def _serve_pass(self, key, tail: list, cacheable: bool, ahead: Optional[_tickets.Ahead]):
        """The engine pass that serves ``tail``, its batches and those already taken of them
        (None, None, () when not cached). Batches taken ahead are adopted when they are this
        pass's first; otherwise the pass begun for them is skipped."""
        job = self.job
        adoptable = job is not None and tail and cacheable and self.ticketed
        if ahead is not None and not (adoptable and ahead.intact and ahead.first == self.token):
            # Its pass was begun: the search for this epoch's pass starts after it.
            self.next_pass = max(self.next_pass, ahead.pass_ + 1)
            ahead = None
        if job is None or not tail or not cacheable:
            return None, None, ()
        p = self._pass_for(_flatten(tail), _sizes(tail))  # the pass taken ahead, or a later one
        self.served.append((key, p))
        self.next_pass = p + 1
        if ahead is not None and p == ahead.pass_:
            self.board.adopt(ahead.gen)
            return p, ahead.src, ahead.taken
        return p, job.shared_batches(p), ()

    def _plan_ahead(self, p: int, depth: int, first: int) -> Optional[_tickets.Ahead]:
        """(In the feeder's thread, every batch of pass ``p`` posted.) The next epoch's first
        ``depth`` batches to take ahead, when its pass is predicted; None otherwise."""
        job = self.job
        if job is None or job.epochs <= p + 1 or self.next_pass != p + 1:
            return None
        q = p + 1
        try:
            sizes = [int(n) for n in job.batch_sizes(q)][:depth]
            samples = job.samples_of(q)
        except EpochConsumedError:
            return None
        bounds = np.cumsum([0] + sizes)
        batches = [samples[bounds[j] : bounds[j + 1]].tolist() for j in range(len(sizes))]
        self.ahead_gen += 1
        return _tickets.Ahead(self.ahead_gen, q, job.shared_batches(q), batches, first)

    def _item(self, b, src, batched: bool, state):
        """What the sampler yields for batch (or index) ``b``: where its bytes are, leased until
        the consumer is done with it (for workers, a ticket: see ``_tickets``)."""
        token = self.token
        self.token += 1
        where, private, lease = None, {}, None
        if src is not None and self.feeder is not None:
            got = self.feeder.hand()
            assert got == token, (got, token)
            where = _tickets.TICKET
        elif src is not None:
            try:
                lease, where, _labels, private = next(src)
                private = dict(private)
            except (CancelledError, ExhaustedError):
                raise
            except Exception:
                # clairvoyant could not read a sample of this batch: the dataset reads the
                # batch itself, as with torch's DataLoader (and fails as it would).
                where = None
        self._sweep()
        if lease is not None:
            with self.lock:
                self.leases[token] = lease
        if batched:
            return _datasets.Batch(b, token, self.segments, where, private, state, self.current.last)
        if not isinstance(b, int):
            return b
        return _datasets.Index(b, token, self.segments, where, private, state)

    def epoch(self, loader: DataLoader):
        """The generator torch's iterator draws indices from, one epoch."""
        ahead = self._retire()
        key = self._epoch_key(loader)
        self.count += 1
        gstate = _samplers.generator_state(loader)
        resume, loader._resume = loader._resume, None
        batches, skip, gstate, restore = self._epoch_batches(loader, key, resume, gstate)
        self.current = _Current(key, len(batches), skip, self.token, gstate)
        batched = loader._auto_collation
        # Indices that are not integers (a sampler yielding lists of indices without automatic
        # batching, or keys) are passed to the dataset as torch passes them, uncached.
        cacheable = _samplers.integer_indices(batches, batched)
        self.current.plain = not cacheable and not batched
        if not self.started and cacheable:
            self._start(loader, key, batches)
        tail = batches[skip:]
        p, src, pre = self._serve_pass(key, tail, cacheable, ahead)
        del ahead
        # Persistent workers decode the next epoch's first batches while they would idle (see
        # _ahead); torch dispatches an epoch's first prefetch_factor x num_workers batches at once.
        ahead_fn = None
        if src is not None and self.ticketed and _ahead.wanted(loader):
            depth = (loader.prefetch_factor or 2) * loader.num_workers
            ahead_fn = functools.partial(self._plan_ahead, p, depth)
            self.current.last = self.token + len(tail) - 1
        if src is not None and self.ticketed:
            engine = self.job._engine
            self.feeder = _tickets.Feeder(
                self.board, src, self.token, len(tail), self.leases, self.lock, f"epoch {key}", engine, pre, ahead_fn
            )
        # The next epoch's prediction is appended once the first batches are on their way
        # (torch dispatches prefetch_factor x num_workers of them when the epoch starts), not
        # before: the epoch's first batch should not wait for it.
        predict_at = min(len(tail) - 1, (loader.prefetch_factor or 1) * max(1, loader.num_workers))
        ahead = (loader.epochs, self._rank_for_prediction(), self._draws_base_seed())
        del loader  # the epoch is drawn: see _Sampler.__iter__
        for k, b in enumerate(tail):
            if k == predict_at and src is not None:
                self._predict_after(key, p, *ahead)
            yield self._item(b, src, batched, restore[k] if restore is not None and k < len(restore) else None)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        loader = self.loader
        cur = self.current
        it = self._iter() if self._iter is not None else None
        state = {
            "version": _STATE_VERSION,
            "epoch": None if cur is None else cur.key,
            "yielded": 0,
            "total": 0,
            "num_workers": loader.num_workers,
            "generator": None,
            "workers": None,
        }
        if cur is None or it is None:
            return state
        got = int(getattr(it, "_num_yielded", 0))
        yielded = cur.skip + got
        state.update(yielded=yielded, total=cur.total, generator=None if cur.gstate is None else list(cur.gstate))
        if getattr(it, "_cv_native", False):
            # The native path: no worker states; the epoch's crops and flips follow its seed.
            state["native_seed"] = int(it._base_seed)
        elif loader.num_workers > 0 and yielded < cur.total and not cur.plain:
            first = cur.first_token + got
            tokens = range(first, first + min(loader.num_workers, cur.total - yielded))
            states = []
            deadline = time.monotonic() + 10
            for t in tokens:
                s = _datasets.read_state(self.states, t)
                while s is None and time.monotonic() < deadline:
                    time.sleep(0.001)
                    s = _datasets.read_state(self.states, t)
                states.append(s)
            # Only what torch.load(weights_only=True) accepts: no numpy arrays.
            state["workers"] = [_datasets.plain_rng_state(s) for s in states] if all(s is not None for s in states) else None
        return state

    def close(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked worker: the job and its shared memory are the parent's
        if self.holds_heap:
            self.holds_heap = False
            _HEAP.release()
        self._stop_feeder(patience=0)
        with self.lock:
            self.leases.clear()
        job, self.job = self.job, None
        if job is not None:
            job.close()
            self._job_stats = job.stats()
            self._peer_stats = job.peer_stats()

    def peer_stats(self) -> Optional[dict]:
        return self.job.peer_stats() if self.job is not None else self._peer_stats

    def stats(self) -> list:
        job_stats = self.job.stats() if self.job is not None else self._job_stats
        if not job_stats:
            return []
        return [dict(job_stats[p], epoch=key) for key, p in self.served if p < len(job_stats)]


def _flatten(batches: list) -> np.ndarray:
    if not batches:
        return np.zeros(0, dtype=np.int64)
    if isinstance(batches[0], list):
        return np.fromiter((i for b in batches for i in b), dtype=np.int64)
    return np.asarray(batches, dtype=np.int64)


def _sizes(batches: list) -> list:
    """The size of each batch (1 for each index without automatic batching)."""
    return [len(b) if isinstance(b, list) else 1 for b in batches]


def _batch_shape(loader) -> tuple:
    """(batch size, drop_last) of the loader's batching, (None, False) for a custom batch
    sampler; (1, False) without automatic batching."""
    bs = loader.batch_sampler
    if bs is None:
        return 1, False
    if type(bs) is BatchSampler:
        return bs.batch_size, bs.drop_last
    return None, False


def _interleave(streams: dict, world: int, b: int, drop_last: bool) -> Optional[np.ndarray]:
    """The global order whose split among ``world`` ranks (the engine's layout, batch size
    ``b``) gives each rank in ``streams`` exactly its batches. Ranks not on this machine get a
    placeholder of the right length (their streams do not affect this machine's cache).
    None when the streams are not regular batches of ``b`` of equal lengths."""
    lengths = set()
    flat = {}
    for r, batches in streams.items():
        f = _flatten(batches)
        sizes = _sizes(batches)
        n = len(f)
        full, rem = divmod(n, b)
        want = [b] * full + ([rem] if rem and not drop_last else [])
        if sizes != want:
            return None
        lengths.add(n)
        flat[r] = f
    if len(lengths) != 1:
        return None
    n = lengths.pop()
    if n == 0:
        return None
    rows = np.zeros((world, n), dtype=np.int64)
    for r, f in flat.items():
        rows[r] = f
    full, rem = divmod(n, b)
    head = rows[:, : full * b].reshape(world, full, b).transpose(1, 0, 2).reshape(-1)
    if rem and not drop_last:
        head = np.concatenate([head, rows[:, full * b :].reshape(-1)])
    return head

