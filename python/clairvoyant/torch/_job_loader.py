"""PyTorch integration: a dataset and a DataLoader on top of :class:`clairvoyant.Job`.

Moving a training script to clairvoyant changes three lines. Plain PyTorch::

    dataset = torchvision.datasets.ImageFolder(root, transform)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler, num_workers=4)

clairvoyant::

    job = clairvoyant.Job(root, batch_size=64, epochs=E)
    dataset = clairvoyant.torch.ImageFolder(job, transform)
    loader = clairvoyant.torch.DataLoader(dataset, num_workers=4)

and the loop stays as it is::

    for epoch in range(E):
        loader.set_epoch(epoch)            # optional, as with DistributedSampler
        for images, labels in loader:
            ...

The job decides the order (every rank derives its access stream from the seed) and delivers
each sample's bytes in that order; the DataLoader decodes and transforms them in ``num_workers``
worker processes (so decoding is not serialised by the GIL), keeps a bounded number of batches in
flight and yields them in order, collated. Workers read the bytes in place from the shared files
that hold them (the rank's staging ring and the node's memory class): no sample is copied or
pickled on its way to a worker. Each ``iter(loader)`` consumes the job's next epoch.
"""

from __future__ import annotations

import io
import mmap
import os
import queue
import threading
import time
from typing import Any, Callable, Iterator, Optional

import torch as _torch
from torch.utils.data import default_collate

from ..errors import ArgumentTypeError, ClairvoyantError, ConfigError, ExhaustedError

__all__ = ["ImageFolder", "JobLoader", "LoaderError", "pil_loader"]


class LoaderError(ClairvoyantError, RuntimeError):
    """The DataLoader cannot go on: it has no job yet, a worker died, or it timed out (a
    RuntimeError, as torch's DataLoader raises in these cases)."""


def pil_loader(data: Any):
    """Decode image bytes (a uint8 array, bytes or memoryview) into an RGB PIL image."""
    from PIL import Image

    img = Image.open(io.BytesIO(memoryview(data)))
    return img.convert("RGB")


class ImageFolder:
    """A dataset of images whose bytes come from a :class:`clairvoyant.Job`.

    ``root_or_job`` is a Job or an ImageFolder directory. With a directory, the job is created
    when the DataLoader is (its ``batch_size`` is needed); pass ``epochs`` and any other
    :class:`clairvoyant.Job` arguments as keywords here.

    Mirrors torchvision's ImageFolder: ``classes``, ``class_to_idx``, ``samples``, ``targets``,
    ``transform``, ``target_transform`` and ``loader`` (called with the sample's bytes instead of
    a path). ``dataset[i]`` reads sample ``i`` directly from its file (random access, e.g. for
    inspection); training goes through :class:`DataLoader`, which follows the job's schedule.
    """

    def __init__(
        self,
        root_or_job: Any,
        transform: Optional[Callable] = None,
        target_transform: Optional[Callable] = None,
        loader: Optional[Callable[[Any], Any]] = None,
        **job_kwargs: Any,
    ):
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader if loader is not None else pil_loader
        if isinstance(root_or_job, (str, os.PathLike)):
            self.job = None
            self.root: Optional[str] = os.fspath(root_or_job)
            self._job_kwargs = job_kwargs
        else:
            if job_kwargs:
                raise ArgumentTypeError(f"Job arguments {sorted(job_kwargs)} are only accepted with a directory, not with a Job")
            self.job = root_or_job
            self.root = None
            self._job_kwargs = {}

    def _ensure_job(self, batch_size: Optional[int], drop_last: Optional[bool]):
        if self.job is not None:
            return self.job
        import clairvoyant

        if batch_size is None:
            raise ConfigError("batch_size is required when the dataset was made from a directory")
        kwargs = dict(self._job_kwargs)
        if "epochs" not in kwargs and "order" not in kwargs:
            raise ConfigError("pass epochs=... to ImageFolder(root, ...) (or pass a clairvoyant.Job)")
        if drop_last is not None:
            kwargs["drop_last"] = drop_last
        self.job = clairvoyant.Job(self.root, batch_size=batch_size, **kwargs)
        return self.job

    def _require_job(self):
        if self.job is None:
            facts = self.__dict__.get("_facts")
            if facts is not None:  # a copy in another process: the job's facts travelled
                return facts
            raise LoaderError("the dataset has no job yet; wrap it in clairvoyant.torch.DataLoader first")
        return self.job

    # -- torchvision-compatible facts ---------------------------------------------------
    @property
    def classes(self) -> list:
        return list(self._require_job().classes)

    @property
    def class_to_idx(self) -> dict:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def targets(self) -> list:
        return [int(x) for x in self._require_job().labels]

    @property
    def samples(self) -> list:
        job = self._require_job()
        return list(zip(job.paths, (int(x) for x in job.labels)))

    imgs = samples

    def __len__(self) -> int:
        return int(self._require_job().num_samples)

    def __getitem__(self, index: int):
        job = self._require_job()
        with open(job.paths[index], "rb") as f:
            data = f.read()
        return self.decode(data, int(job.labels[index]))

    def __getstate__(self):
        # Worker processes need the decoding, not the job (which stays in the training process).
        state = dict(self.__dict__)
        job = state["job"]
        if job is not None:
            # What dataset[i] and the torchvision attributes need, without the job (which stays
            # in the training process): torch's own DataLoader may pickle this dataset to its
            # workers.
            state["_facts"] = _Facts(list(job.paths), [int(x) for x in job.labels], list(job.classes))
        state["job"] = None
        return state

    # -- the per-sample work -----------------------------------------------------------
    def decode(self, data: Any, label: int):
        """Bytes and label of one sample -> (transformed image, transformed target)."""
        img = self.loader(data)
        if self.transform is not None:
            img = self.transform(img)
        target = int(label)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __repr__(self) -> str:
        where = self.root if self.job is None else repr(self.job)
        return f"clairvoyant.torch.ImageFolder({where}, transform={self.transform!r})"


class _Facts:
    """A job's dataset facts (paths, labels, classes), for a dataset copied to another process."""

    def __init__(self, paths: list, labels: list, classes: list):
        self.paths, self.labels, self.classes = paths, labels, classes

    @property
    def num_samples(self) -> int:
        return len(self.paths)


def _worker_loop(decoder: Callable, collate_fn: Callable, segments: tuple, tasks, results, worker_id: int) -> None:
    """A decode worker: maps the shared segments read-only, decodes and collates each batch it is
    given, and sends back the batch (tensors travel through shared memory) or the exception."""
    import gc

    from torch.utils.data._utils.worker import ExceptionWrapper

    gc.freeze()  # what was inherited at the fork stays out of the collector's walks (see _dropin)
    _torch.set_num_threads(1)
    maps: dict = {}

    def region(r: int):
        if r not in maps:
            with open(segments[r], "rb") as f:
                maps[r] = memoryview(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
        return maps[r]

    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() == 1:  # the parent died
                return
            continue
        if task is None:
            return
        index, descriptors, labels, private = task
        try:
            items = [
                decoder(private[i] if i in private else region(r)[off : off + n], label)
                for i, ((r, off, n), label) in enumerate(zip(descriptors, labels))
            ]
            results.put((index, collate_fn(items), None))
        except Exception:
            results.put((index, None, ExceptionWrapper(where=f"in clairvoyant DataLoader worker {worker_id}")))
        del task


class JobLoader:
    """Iterates over a clairvoyant-backed dataset in the job's scheduled batches.

    Keeps ``torch.utils.data.DataLoader`` semantics where they apply: iterating yields
    ``collate_fn([dataset.decode(bytes, label) for each sample of the batch])``, i.e. an
    ``(images, labels)`` pair of tensors with the default collate; ``len(loader)`` is the number
    of batches per epoch (the same on every rank). Each ``iter(loader)`` consumes the job's next
    epoch; ``set_epoch(e)`` may be called first, as with DistributedSampler, and must name it.
    Starting the next epoch ends the previous epoch's iterator: if it was left unfinished, using
    it again raises :class:`clairvoyant.ExhaustedError` naming both epochs.

    ``num_workers`` processes decode and transform (started once, kept across epochs); ``0``
    does it in the iterating thread. Memory is bounded: at most ``prefetch_factor *
    num_workers`` decoded batches exist at any time (being decoded, decoded and waiting, or being
    handed out); a batch's credit returns when ``next()`` hands it to the training loop, so a
    slow training step holds the workers back instead of piling batches up. The next epoch's
    first batches are decoded while this epoch's last ones are trained on. :attr:`in_flight`
    tells how many credits are taken. ``prefetch_factor`` defaults to 4.

    An exception raised while reading or decoding a sample surfaces from ``next()`` at the batch
    the sample belongs to, and later batches still follow; a worker that dies is an error, not a
    hang. ``close()`` (also called when the job closes) stops the workers and drops every
    reference to the job's shared memory; an iterator used after it raises
    :class:`clairvoyant.CancelledError`. ``pin_memory`` pins batches when CUDA is available.
    ``batch_size`` and ``drop_last`` belong to the job; passing values that differ from the job's
    is an error (shuffling and sampling are the job's too).
    """

    def __init__(
        self,
        dataset: ImageFolder,
        batch_size: Optional[int] = None,
        num_workers: int = 0,
        collate_fn: Optional[Callable] = None,
        pin_memory: bool = False,
        drop_last: Optional[bool] = None,
        prefetch_factor: Optional[int] = None,
        timeout: float = 0,
        multiprocessing_context: Any = None,
    ):
        if num_workers < 0:
            raise ConfigError(f"num_workers must be non-negative, got {num_workers}")
        if timeout < 0:
            raise ConfigError(f"timeout must be non-negative, got {timeout}")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ConfigError(f"prefetch_factor must be at least 1, got {prefetch_factor}")
        self._workers: list = []
        self._tasks: list = []
        self._pipeline: Optional[_Pipeline] = None
        self._current: Optional[_EpochIterator] = None
        self.dataset = dataset
        self.job = dataset._ensure_job(batch_size, drop_last)
        job_batch = getattr(self.job, "batch_size", None)
        if batch_size is not None and job_batch is not None and batch_size != job_batch:
            raise ConfigError(f"batch_size={batch_size} differs from the job's batch_size={job_batch}")
        job_drop = getattr(self.job, "drop_last", None)
        if drop_last is not None and job_drop is not None and bool(drop_last) != bool(job_drop):
            raise ConfigError(f"drop_last={drop_last} differs from the job's drop_last={job_drop}")
        self.batch_size = job_batch if job_batch is not None else batch_size
        self.drop_last = job_drop if job_drop is not None else bool(drop_last)
        self.num_workers = int(num_workers)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.pin_memory = bool(pin_memory) and _torch.cuda.is_available()
        self.prefetch_factor = int(prefetch_factor) if prefetch_factor is not None else 4
        self.timeout = float(timeout)
        self.multiprocessing_context = multiprocessing_context
        self._next_epoch = int(getattr(self.job, "start_epoch", 0))
        self._results: Any = None
        if hasattr(self.job, "_add_loader"):
            self.job._add_loader(self)

    @property
    def epochs(self) -> int:
        return int(self.job.epochs)

    @property
    def in_flight(self) -> int:
        """Batches holding a prefetch credit: sent to a worker, decoded and waiting, or being
        handed out by ``next()``. Never above ``prefetch_factor * num_workers``."""
        pipeline = self._pipeline
        return 0 if pipeline is None else pipeline.outstanding

    def __len__(self) -> int:
        return int(self.job.steps_per_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Declare the epoch the next ``iter()`` consumes; epochs are consumed in order."""
        if int(epoch) != self._next_epoch:
            raise ConfigError(
                f"set_epoch({epoch}): clairvoyant consumes epochs in order and the next one is {self._next_epoch}"
            )

    def __iter__(self) -> Iterator:
        epochs = getattr(self.job, "epochs", None)
        if epochs is not None and self._next_epoch >= epochs:
            raise ExhaustedError(f"all {epochs} epochs of the job have been consumed")
        epoch = self._next_epoch
        if self._current is not None:
            self._current._end(_exhausted(self._current.epoch, epoch))
            self._current = None
        if self.num_workers > 0 and self._pipeline is None:
            self._start_workers()
            self._pipeline = _Pipeline(self, epoch)
        self._current = _EpochIterator(self, epoch)
        self._next_epoch += 1
        return self._current

    def _start_workers(self) -> None:
        import torch.multiprocessing as mp

        ctx = self.multiprocessing_context
        if ctx is None:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        elif isinstance(ctx, str):
            ctx = mp.get_context(ctx)
        decoder = self.dataset.decode  # the dataset travels without its job (see __getstate__)
        self._results = ctx.Queue()
        for w in range(self.num_workers):
            tasks = ctx.Queue()
            p = ctx.Process(
                target=_worker_loop,
                args=(decoder, self.collate_fn, tuple(self.job.segments), tasks, self._results, w),
                name=f"clairvoyant-decode-{w}",
                daemon=True,
            )
            p.start()
            self._tasks.append(tasks)
            self._workers.append(p)

    def _finish_batch(self, batch):
        if self.pin_memory:
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch)
        return batch

    def _process(self, samples, labels):
        decode = self.dataset.decode
        items = [decode(s, label) for s, label in zip(samples, labels)]
        # Drop the views so that their staging slots are released as soon as possible.
        del samples
        return self._finish_batch(self.collate_fn(items))

    def close(self) -> None:
        """Stop the read-ahead and the worker processes; drop every lease on the job's memory.
        Idempotent; a later ``iter()`` starts workers again (if the job is still open)."""
        current, self._current = self._current, None
        if current is not None:
            current._end(_cancelled("the DataLoader was closed"))
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self._workers:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for q in self._tasks + ([self._results] if self._results is not None else []):
            try:
                q.cancel_join_thread()  # never block on a pipe that no process reads any more
                q.close()
            except Exception:
                pass
        self._workers, self._tasks, self._results = [], [], None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"clairvoyant.torch.JobLoader(batch_size={self.batch_size}, num_workers={self.num_workers}, steps={len(self)})"


def _exhausted(epoch: int, began: int) -> BaseException:
    from clairvoyant import ExhaustedError

    return ExhaustedError(
        f"this DataLoader iterator of epoch {epoch} was left unfinished when epoch {began} began; "
        "epochs are consumed in order"
    )


def _cancelled(message: str) -> BaseException:
    from clairvoyant import CancelledError

    return CancelledError(message)


class _Raise:
    """An error met while taking a batch from the job, delivered at that batch."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc

    def reraise(self):
        raise self.exc


class _Pipeline:
    """Feeds the decode workers for the rest of the run, across epoch boundaries: the order of
    every later batch is known, so the next epoch's first batches are decoded while this epoch's
    last ones are trained on (no bubble at epoch starts). A feeder thread takes the job's batches
    in order as leases (the bytes stay in shared memory) and hands their locations to the workers
    round-robin. A collector thread receives the decoded batches (rebuilding shared tensors costs
    a round trip to the worker, kept off the training loop's path) and releases each batch's
    lease once its worker has answered.

    Credits bound memory: the feeder takes one per batch before sending it, at most
    ``prefetch_factor * num_workers``; the consumer returns it when ``next()`` hands the batch
    out, and a batch nobody will take (an epoch left early, a closed loader) returns it when it
    is dropped. An epoch left early is not decoded further: the feeder moves to the epoch the
    consumer is on. Batch ``(epoch, step)`` has the run-wide index ``base[epoch] + step``."""

    def __init__(self, loader: JobLoader, first_epoch: int):
        self.loader = loader
        job = loader.job
        self.first_epoch = first_epoch
        self.epochs = int(job.epochs)
        self.base: dict = {}
        self.steps: dict = {}
        total = 0
        for e in range(first_epoch, self.epochs):
            self.base[e], self.steps[e] = total, len(job.batch_sizes(e))
            total += self.steps[e]
        self.limit = loader.prefetch_factor * loader.num_workers
        self.outstanding = 0  # credits taken
        self.floor = 0  # results below this index are no longer wanted
        self._leases: dict = {}
        self._ready: dict = {}
        self._sent = 0
        self._feed_error: Optional[BaseException] = None
        self._worker_error: Optional[BaseException] = None
        self._shut = False
        self._cond = threading.Condition()
        self._stop = threading.Event()  # stops the feeder
        self._closed = threading.Event()  # stops the collector
        self._feeder = threading.Thread(target=self._feed, name="clairvoyant-feed", daemon=True)
        self._collector = threading.Thread(target=self._collect, name="clairvoyant-collect", daemon=True)
        self._feeder.start()
        self._collector.start()

    def index(self, epoch: int, step: int) -> int:
        return self.base[epoch] + step

    def _epoch_of(self, index: int) -> int:
        for e in range(self.epochs - 1, self.first_epoch - 1, -1):
            if self.base[e] <= index:
                return e
        return self.first_epoch

    def _reserve(self, index: int):
        """Take a credit for batch ``index``: True; None when stopping; or the floor (an int)
        when the consumer has moved past ``index``."""
        with self._cond:
            while True:
                if self._stop.is_set():
                    return None
                if index < self.floor:
                    return self.floor
                if self.outstanding < self.limit:
                    self.outstanding += 1
                    return True
                self._cond.wait(timeout=0.5)

    def release(self, n: int = 1) -> None:
        """Return ``n`` credits (batches handed out or dropped)."""
        with self._cond:
            self.outstanding -= n
            self._cond.notify_all()

    def _feed(self) -> None:
        from clairvoyant import CancelledError, ExhaustedError

        loader = self.loader
        epoch = self.first_epoch
        try:
            while epoch < self.epochs:
                source = loader.job.shared_batches(epoch)
                jump = None
                for step in range(self.steps[epoch]):
                    index = self.index(epoch, step)
                    got = self._reserve(index)
                    if got is None:
                        return
                    if got is not True:  # the consumer left this epoch: skip to where it is
                        jump = got
                        break
                    try:
                        lease, descriptors, labels, private = next(source)
                    except (CancelledError, ExhaustedError):
                        self.release()
                        raise
                    except Exception as exc:  # a sample failed: raised at its batch, the rest follow
                        with self._cond:
                            self._sent = index + 1
                            if index >= self.floor:
                                self._ready[index] = (None, _Raise(exc))
                            else:  # the consumer moved on meanwhile
                                self.outstanding -= 1
                            self._cond.notify_all()
                        continue
                    with self._cond:
                        self._leases[index] = lease
                        self._sent = index + 1
                    loader._tasks[index % loader.num_workers].put((index, descriptors, labels.tolist(), dict(private)))
                    del lease
                del source
                if jump is None:
                    epoch += 1
                elif jump >= sum(self.steps.values()):
                    return
                else:
                    epoch = max(epoch + 1, self._epoch_of(jump))
        except BaseException as exc:  # delivered to the consumer at this position
            with self._cond:
                self._feed_error = exc
                self._cond.notify_all()

    def _collect(self) -> None:
        loader = self.loader
        while not self._closed.is_set():
            try:
                got, batch, error = loader._results.get(timeout=0.5)
            except (queue.Empty, OSError, EOFError, ValueError) as exc:
                if self._closed.is_set():
                    return
                # A worker killed while answering can leave the queue broken: report the death.
                dead = [p.name for p in loader._workers if not p.is_alive()]
                if dead or not isinstance(exc, queue.Empty):
                    time.sleep(0.05)
                    dead = [p.name for p in loader._workers if not p.is_alive()]
                    with self._cond:
                        self._worker_error = LoaderError(
                            f"DataLoader worker(s) {', '.join(dead) or '?'} exited unexpectedly"
                            + ("" if dead else f" ({exc!r})")
                        )
                        self._cond.notify_all()
                    return
                continue
            with self._cond:
                self._leases.pop(got, None)  # the worker is done with the bytes
                if got >= self.floor:
                    self._ready[got] = (batch, error)
                else:  # nobody will take it
                    self.outstanding -= 1
                self._cond.notify_all()
            del batch, error

    def get(self, index: int):
        """(batch, error) of batch ``index``, waiting for it. Its credit stays taken until the
        caller returns it with :meth:`release`."""
        timeout = self.loader.timeout or None
        with self._cond:
            while index not in self._ready:
                if self._shut:
                    raise _cancelled("the DataLoader was closed")
                if self._feed_error is not None and index >= self._sent:
                    raise self._feed_error
                if self._worker_error is not None:
                    raise self._worker_error
                if not self._cond.wait(timeout=timeout) and timeout is not None:
                    raise LoaderError(f"DataLoader timed out after {self.loader.timeout} seconds")
            return self._ready.pop(index)

    def skip_to(self, index: int) -> None:
        """Drop results before ``index`` (an epoch left before its end) and their credits."""
        with self._cond:
            self.floor = max(self.floor, index)
            dropped = [k for k in self._ready if k < index]
            for k in dropped:
                del self._ready[k]
            self.outstanding -= len(dropped)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop feeding, wait for the batches still in flight, stop collecting."""
        with self._cond:
            self._shut = True
            self._stop.set()
            self._cond.notify_all()
        if self._feeder.is_alive() and self._feeder is not threading.current_thread():
            self._feeder.join()
        deadline = time.monotonic() + 10
        with self._cond:
            self.floor = float("inf")
            while self._leases and self._worker_error is None and self._collector.is_alive():
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() > deadline:
                    break
            self._leases.clear()
            self._ready.clear()
            self.outstanding = 0
        self._closed.set()
        if self._collector.is_alive() and self._collector is not threading.current_thread():
            self._collector.join(timeout=2)


class _EpochIterator:
    """One epoch: batches in order, from the pipeline (workers) or decoded here (no workers)."""

    def __init__(self, loader: JobLoader, epoch: int):
        self.epoch = epoch
        self._loader = loader
        self._pipeline = loader._pipeline if loader.num_workers > 0 else None
        self._error: Optional[BaseException] = None
        if self._pipeline is None:
            self._source = iter(loader.job.batches(epoch))
            self._left = len(self._source)
        else:
            self._source = None
            self._left = self._pipeline.steps[epoch]
            self._pipeline.skip_to(self._pipeline.index(epoch, 0))
        self._step = 0

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._left

    def _end(self, error: BaseException) -> None:
        """Another epoch began or the loader closed: drop the job's objects, raise from now on."""
        if self._left > 0 and self._error is None:
            self._error = error
        self._pipeline = self._source = None

    def __next__(self):
        if self._left <= 0:
            raise StopIteration
        if self._error is not None:
            raise self._error
        loader = self._loader
        if self._pipeline is None:
            self._left -= 1
            samples, labels = next(self._source)  # a failed batch raises; the next ones follow
            return loader._process(samples, labels)
        pipeline = self._pipeline
        try:
            batch, error = pipeline.get(pipeline.index(self.epoch, self._step))
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            # The job or a worker failed: the rest of the epoch cannot be delivered.
            self._error = exc
            raise
        self._step += 1
        self._left -= 1
        try:
            if error is not None:
                error.reraise()  # a read or decode error, at its batch; later batches still follow
            return loader._finish_batch(batch)
        finally:
            del batch
            pipeline.release()  # the batch is the training loop's now: its credit returns
