"""The native decode path of ``clairvoyant.torch.DataLoader`` (docs/decode.md, "Used automatically").

When the dataset is torchvision's own ``ImageFolder``/``DatasetFolder`` (or a ``Subset`` of one)
with Pillow's loader, its transform is a ``Compose`` of transforms :func:`native_plan` knows, and
the loader batches with torch's default collate, the loader's iterator is a :class:`NativeIter`
instead of torch's: no worker processes; each batch's bytes (from clairvoyant's cache) are
decoded and transformed by ``_native.DecodePipeline`` on ``max(1, num_workers)`` Rust threads,
written straight into one batch tensor (pinned when ``pin_memory=True`` and an accelerator is
present), and yielded as ``[images, labels]``, what the default collate makes of
``(image, target)`` items.

The batches hold the same samples in the same order as the worker path's, and the iterator
draws from torch's generators exactly what torch's iterator draws (its base seed, the sampler's
draws), so a training loop's own random numbers are unchanged. The random augmentations draw
from per-sample streams keyed by (the iterator's base seed, the epoch, the sample index): a run
is reproducible under ``torch.manual_seed`` but the crops are not those torch would draw.

Threads: one Python thread per iterator runs the pipeline (the GIL is released while the Rust
threads decode); sampling, dispatch and everything that touches torch's random generators stay
on the training thread. At most ``depth`` batches are in flight.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .. import _native, _samplers, _settings
from ..errors import CorruptError

__all__ = ["NativeIter", "native_choice", "NativeSetup"]

# How long one wait for a batch lasts before the decode thread's liveness is checked again.
_POLL_S = 1.0

# The loaders' threads still running (decoding, receiving workers' batches). At exit they are
# stopped and joined before the interpreter finalizes: a daemon thread inside a torch call that
# releases the GIL is ended by the interpreter mid-call, and C++ aborts the process
# ("terminate called without an active exception").
_LIVE: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()
_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()


def stop_at_exit(stop: threading.Event, thread: threading.Thread) -> None:
    """Stop (set ``stop``) and join ``thread`` at exit, before the interpreter finalizes."""
    _LIVE.add(stop)
    _THREADS.add(thread)


@atexit.register
def _stop_all() -> None:
    for stop in list(_LIVE):
        stop.set()
    for thread in list(_THREADS):
        if thread is not threading.current_thread():
            thread.join(timeout=10)


def _env_off() -> bool:
    return _settings.get("CLAIRVOYANT_NATIVE_DECODE", True) is False


def _names(transform: Any) -> str:
    members = getattr(transform, "transforms", None)
    if members is None:
        return type(transform).__name__
    return f"{type(transform).__name__}[{', '.join(_names(t) for t in members)}]"


class NativeSetup:
    """What the native path needs of one loader: the folder, the plan, the decode pipeline."""

    def __init__(self, folder, plan, threads: int):
        self.folder, self.plan, self.threads = folder, plan, threads
        self.pid = os.getpid()
        self.pipe = _native.DecodePipeline(list(plan.ops), plan.output, list(plan.mean), list(plan.std), False, threads)

    def describe(self) -> str:
        return (
            f"{type(self.folder).__name__} decoded natively on {self.threads} thread(s) "
            f"({_names(self.folder.transform)}); crops and flips drawn from the loader's seed, pixels within "
            "docs/decode.md's tolerance of Pillow's; native_decode=False gives torch's exact batches"
        )


def native_choice(loader, requested: Optional[bool]) -> tuple:
    """(NativeSetup or None, reason the native path is not taken or ""). The reason is None
    when the dataset is no folder of files at all (no notice is due then)."""
    from torch.utils.data._utils.collate import default_collate

    from . import _datasets
    from ._native_pipeline import native_plan

    folder, _ = _samplers.folder_root(loader.dataset)
    if folder is None:
        return None, None
    if requested is False:
        return None, "native_decode=False"
    if _env_off():
        return None, f"CLAIRVOYANT_NATIVE_DECODE={_settings.raw('CLAIRVOYANT_NATIVE_DECODE')}"
    try:
        from torchvision.datasets import DatasetFolder
    except ImportError:  # pragma: no cover - a folder root implies torchvision
        return None, "torchvision is not importable"
    if type(folder).__getitem__ is not DatasetFolder.__getitem__:
        return None, f"{type(folder).__name__} overrides __getitem__"
    if _datasets._byte_decoder(folder.loader) is not _datasets._pil_decode:
        return None, f"{type(folder).__name__}'s loader is not Pillow's"
    if not loader._auto_collation:
        return None, "no automatic batching (batch_size=None)"
    if loader.collate_fn is not default_collate:
        return None, "a collate_fn of its own"
    if loader.worker_init_fn is not None:
        return None, "a worker_init_fn (it expects worker processes)"
    plan = native_plan(folder.transform)
    if plan is None:
        return None, f"its transform {_names(folder.transform)} has a step the native path does not know"
    return NativeSetup(folder, plan, max(1, int(loader.num_workers))), ""


class _Buffers:
    """Batch tensors reused batch after batch: a buffer is taken again only when nothing outside
    this ring holds it (no reference to the tensor, no view of its storage), so a batch the
    training loop keeps is never overwritten. Pinned buffers come from torch's caching host
    allocator instead, which reuses a freed block only once the copies from it have completed.
    One ring serves all of a loader's iterators (epoch after epoch, no new allocations)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, pinned: bool, size: int):
        self.shape, self.dtype, self.pinned, self.size = shape, dtype, pinned, size
        self._ring: dict = {}
        self._base: dict = {}
        self._lock = threading.Lock()  # two iterators of one loader may decode at once
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)

    @classmethod
    def of(cls, loader, shape: tuple, dtype: torch.dtype, pinned: bool, size: int) -> "_Buffers":
        """The loader's ring for this batch layout (a new one when the layout changed)."""
        key = (shape, dtype, pinned, size)
        got = loader.__dict__.get("_cv_buffers")
        if got is None or got[0] != key:
            got = (key, cls(shape, dtype, pinned, size))
            loader.__dict__["_cv_buffers"] = got
        return got[1]

    def _counts(self, n: int, i: int) -> tuple:
        t = self._ring[n][i]
        uses = self._use_count(t.untyped_storage()._cdata) if self._use_count is not None else 0
        return sys.getrefcount(t), uses

    def take(self, n: int) -> torch.Tensor:
        if self.pinned:
            return torch.empty((n, *self.shape), dtype=self.dtype, pin_memory=True)
        with self._lock:  # the returned tensor's reference marks it taken before the lock opens
            return self._take(n)

    def _take(self, n: int) -> torch.Tensor:
        ring = self._ring.setdefault(n, [])
        base = self._base.setdefault(n, [])
        for i in range(len(ring)):
            if self._counts(n, i) == base[i]:
                return ring[i]
        if len(ring) < self.size:
            ring.append(torch.empty((n, *self.shape), dtype=self.dtype))
            base.append(self._counts(n, len(ring) - 1))
            return ring[-1]
        return torch.empty((n, *self.shape), dtype=self.dtype)  # every buffer is held: a fresh one


class _Result:
    __slots__ = ("gen", "indices", "images", "targets", "failed", "error", "token")

    def __init__(self, gen: int, token: Optional[int], indices: list):
        self.gen, self.token, self.indices = gen, token, indices
        self.images = self.targets = self.error = None
        self.failed: list = []  # (position, native error, bytes) the dataset's own path decodes


class _Decoder:
    """The decode thread's work (holds no reference to the iterator, so that dropping the
    iterator stops the thread)."""

    def __init__(self, setup: NativeSetup, cached, buffers: _Buffers):
        self.setup, self.cached, self.buffers = setup, cached, buffers
        self.folder = setup.folder

    def root(self, index: int) -> int:
        d = self.cached.dataset
        while isinstance(d, torch.utils.data.Subset):
            index = d.indices[index]
            d = d.dataset
        return index

    def path(self, index: int) -> str:
        return os.fsdecode(self.folder.samples[self.root(index)][0])

    def data(self, req, k: int) -> Any:
        data = None if req.where is None else self.cached._bytes(k, req.segments, req.where, req.private)
        if data is not None:
            return data
        with open(self.path(req[k]), "rb") as f:  # not cached: read as torch's loader would
            return f.read()

    def __call__(self, task) -> _Result:
        gen, req, seed, epoch = task
        token = getattr(req, "token", None)
        indices = [int(i) for i in req]
        res = _Result(gen, token, indices)
        try:
            paths = [self.path(i) for i in indices]
            datas = [self.data(req, k) for k in range(len(indices))]
            arrays = [d if isinstance(d, bytes) else np.frombuffer(d, dtype=np.uint8) for d in datas]
            out = self.buffers.take(len(indices))
            pipe = self.setup.pipe
            try:
                pipe.run(arrays, indices, seed, epoch, out.numpy(), paths)
            except CorruptError:  # which samples? one by one; the dataset's own path tries those
                for k in range(len(indices)):
                    try:
                        pipe.run([arrays[k]], [indices[k]], seed, epoch, out[k : k + 1].numpy(), [paths[k]])
                    except CorruptError as e:
                        res.failed.append((k, e, datas[k]))
            tt = self.folder.target_transform
            targets = [self.folder.samples[self.root(i)][1] for i in indices]
            res.images, res.targets = out, [t if tt is None else tt(t) for t in targets]
        except Exception as e:
            res.error = e
        if not res.failed:
            self.release(token)
        return res

    def release(self, token: Optional[int]) -> None:
        """The batch's bytes are no longer needed: the loader may let the cache reuse them."""
        if token is not None:
            done = self.cached.done
            done[token % done.numel()] = token + 1


def _decode_loop(work: _Decoder, tasks: queue.Queue, results: queue.Queue, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            continue
        if task is None:
            return
        results.put(work(task))


class NativeIter(_BaseDataLoaderIter):
    """torch's iterator protocol (length, ``_num_yielded``, ``_reset`` for persistent workers)
    over clairvoyant's index sampler, decoding natively instead of in worker processes."""

    _cv_native = True

    def __init__(self, view, setup: NativeSetup) -> None:
        super().__init__(view)
        self._cv_loader = view._loader
        self._setup = setup
        self._depth = max(2, int(view.prefetch_factor or 2))
        plan = setup.plan
        dtype = torch.float32 if plan.output == "float32_chw" else torch.uint8
        buffers = _Buffers.of(self._cv_loader, tuple(setup.pipe.sample_shape), dtype, self._pin_memory, self._depth + 2)
        self._work = _Decoder(setup, view.dataset, buffers)
        self._tasks: queue.Queue = queue.Queue(maxsize=self._depth + 1)
        self._results: queue.Queue = queue.Queue(maxsize=self._depth + 1)
        self._stop = threading.Event()
        thread = threading.Thread(
            target=_decode_loop, args=(self._work, self._tasks, self._results, self._stop), name="clairvoyant-decode", daemon=True
        )
        self._workers = [thread]  # what the loader's epoch change and close() look for
        stop_at_exit(self._stop, thread)
        self._gen = 0
        self._sent = self._rcvd = 0
        self._exhausted = False
        thread.start()
        self._reset(view._loader, first_iter=True)

    # -- epochs --------------------------------------------------------------------------
    def _reset(self, loader, first_iter: bool = False) -> None:
        self._drain()
        super()._reset(loader, first_iter)
        loader = getattr(loader, "_loader", loader)
        feed = loader.__dict__.get("_cv")
        r = loader._resume
        if r is not None and feed is not None and feed.resumes(loader) and isinstance(r.get("native_seed"), int):
            self._base_seed = r["native_seed"]  # the interrupted epoch's draws continue
        self._gen += 1
        self._exhausted = False
        self._dispatch()

    def _drain(self) -> None:
        """Wait for (and drop) the batches still being decoded: their bytes' leases are about
        to be released."""
        while self._rcvd < self._sent:
            res = self._wait()
            self._rcvd += 1
            if res.failed:
                self._work.release(res.token)

    # -- batches ---------------------------------------------------------------------------
    def _epoch(self) -> int:
        feed = self._cv_loader.__dict__.get("_cv")
        cur = feed.current if feed is not None else None
        key = cur.key if cur is not None else 0
        return key if isinstance(key, int) and key >= 0 else 0

    def _dispatch(self) -> None:
        while not self._exhausted and self._sent - self._rcvd < self._depth:
            try:
                req = self._next_index()
            except StopIteration:
                self._exhausted = True
                return
            self._tasks.put((self._gen, req, int(self._base_seed) & (2**64 - 1), self._epoch()), timeout=60)
            self._sent += 1

    def _wait(self) -> _Result:
        waited = 0.0
        while True:
            try:
                return self._results.get(timeout=_POLL_S)
            except queue.Empty:
                waited += _POLL_S
            thread = self._workers[0] if self._workers else None
            if thread is None or not thread.is_alive():
                raise RuntimeError("clairvoyant: the native decode thread exited unexpectedly")  # as torch's DataLoader
            if self._timeout and waited >= self._timeout:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds (waiting for a natively decoded batch)")  # as torch's DataLoader

    def _next_data(self) -> Any:
        while True:
            if self._rcvd == self._sent:
                self._dispatch()
                if self._rcvd == self._sent:
                    raise StopIteration
            res = self._wait()
            self._rcvd += 1
            if res.gen != self._gen:  # an abandoned epoch's batch
                if res.failed:
                    self._work.release(res.token)
                continue
            self._dispatch()
            return self._finish(res)

    def _finish(self, res: _Result) -> list:
        if res.error is not None:
            if res.failed:
                self._work.release(res.token)
            raise res.error
        if res.failed:
            try:
                self._fallback(res)
            finally:
                self._work.release(res.token)
        labels = torch.utils.data.default_collate(res.targets)
        if self._pin_memory and isinstance(labels, torch.Tensor):
            labels = labels.pin_memory()
        return [res.images, labels]

    def _fallback(self, res: _Result) -> None:
        """Samples the native decoder refused (a BMP, a JPEG coding it lacks): the dataset's own
        Python path, on the training thread (it draws from torch's generator as torch would)."""
        work = self._work
        for k, native_error, data in res.failed:
            sample = res.indices[k]
            try:
                image, target = work.cached._item(sample, data)
            except Exception as e:
                raise CorruptError(f"{work.path(sample)}: cannot decode ({native_error}; Pillow: {e})") from e
            if not isinstance(image, torch.Tensor) or tuple(image.shape) != tuple(res.images.shape[1:]):
                raise CorruptError(f"{work.path(sample)}: the Python path gave {type(image).__name__} of another shape")
            res.images[k].copy_(image)
            res.targets[k] = target

    # -- shutdown ----------------------------------------------------------------------------
    def _shutdown_workers(self) -> None:
        workers, self._workers = self._workers, []
        if not workers:
            return
        try:
            self._drain()
        except Exception:
            pass
        self._stop.set()
        for t in workers:
            if t is not threading.current_thread():
                t.join(timeout=10)

    def __del__(self):
        try:
            self._stop.set()
        except Exception:
            pass
