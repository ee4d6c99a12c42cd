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
each sample's bytes in that order; the DataLoader decodes and transforms them on a pool of
``num_workers`` threads (PIL decoding and torch operations release the GIL, so the threads use
several cores), keeps a bounded number of batches in flight and yields them in order, collated.
Each ``iter(loader)`` consumes the job's next epoch.
"""

from __future__ import annotations

import io
import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator, Optional

import torch as _torch
from torch.utils.data import default_collate

__all__ = ["ImageFolder", "DataLoader", "pil_loader"]


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
                raise TypeError(f"Job arguments {sorted(job_kwargs)} are only accepted with a directory, not with a Job")
            self.job = root_or_job
            self.root = None
            self._job_kwargs = {}

    def _ensure_job(self, batch_size: Optional[int], drop_last: Optional[bool]):
        if self.job is not None:
            return self.job
        import clairvoyant

        if batch_size is None:
            raise ValueError("batch_size is required when the dataset was made from a directory")
        kwargs = dict(self._job_kwargs)
        if "epochs" not in kwargs:
            raise ValueError("pass epochs=... to ImageFolder(root, ...) (or pass a clairvoyant.Job)")
        if drop_last is not None:
            kwargs["drop_last"] = drop_last
        self.job = clairvoyant.Job(self.root, batch_size=batch_size, **kwargs)
        return self.job

    def _require_job(self):
        if self.job is None:
            raise RuntimeError("the dataset has no job yet; wrap it in clairvoyant.torch.DataLoader first")
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


class _Failure:
    """A failure of the batch source, delivered in order."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class DataLoader:
    """Iterates over a clairvoyant-backed dataset in the job's scheduled batches.

    Keeps ``torch.utils.data.DataLoader`` semantics where they apply: iterating yields
    ``collate_fn([dataset.decode(bytes, label) for each sample of the batch])``, i.e. an
    ``(images, labels)`` pair of tensors with the default collate; ``len(loader)`` is the number
    of batches per epoch (the same on every rank). Each ``iter(loader)`` consumes the job's next
    epoch; ``set_epoch(e)`` may be called first, as with DistributedSampler, and must name it.

    ``num_workers`` threads decode and transform; ``0`` does it in the iterating thread. At most
    ``prefetch_factor * num_workers`` batches are in flight. An exception raised while decoding
    a sample surfaces from ``next()`` at the batch the sample belongs to. ``pin_memory`` pins
    batches when CUDA is available. ``batch_size`` and ``drop_last`` belong to the job; passing
    values that differ from the job's is an error (shuffling and sampling are the job's too).
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
    ):
        if num_workers < 0:
            raise ValueError(f"num_workers must be non-negative, got {num_workers}")
        if timeout < 0:
            raise ValueError(f"timeout must be non-negative, got {timeout}")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be at least 1, got {prefetch_factor}")
        self.dataset = dataset
        self.job = dataset._ensure_job(batch_size, drop_last)
        job_batch = getattr(self.job, "batch_size", None)
        if batch_size is not None and job_batch is not None and batch_size != job_batch:
            raise ValueError(f"batch_size={batch_size} differs from the job's batch_size={job_batch}")
        job_drop = getattr(self.job, "drop_last", None)
        if drop_last is not None and job_drop is not None and bool(drop_last) != bool(job_drop):
            raise ValueError(f"drop_last={drop_last} differs from the job's drop_last={job_drop}")
        self.batch_size = job_batch if job_batch is not None else batch_size
        self.drop_last = job_drop if job_drop is not None else bool(drop_last)
        self.num_workers = int(num_workers)
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.pin_memory = bool(pin_memory) and _torch.cuda.is_available()
        self.prefetch_factor = prefetch_factor if prefetch_factor is not None else 2
        self.timeout = float(timeout)
        self._next_epoch = 0
        self._pool: Optional[ThreadPoolExecutor] = None
        self._current: Optional[_EpochIterator] = None

    @property
    def epochs(self) -> int:
        return int(self.job.epochs)

    def __len__(self) -> int:
        return int(self.job.steps_per_epoch)

    def set_epoch(self, epoch: int) -> None:
        """Declare the epoch the next ``iter()`` consumes; epochs are consumed in order."""
        if int(epoch) != self._next_epoch:
            raise ValueError(
                f"set_epoch({epoch}): clairvoyant consumes epochs in order and the next one is {self._next_epoch}"
            )

    def __iter__(self) -> Iterator:
        if self._current is not None:
            self._current.close()
            self._current = None
        epochs = getattr(self.job, "epochs", None)
        if epochs is not None and self._next_epoch >= epochs:
            raise RuntimeError(f"all {epochs} epochs of the job have been consumed")
        epoch = self._next_epoch
        self._next_epoch += 1
        if self.num_workers > 0 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="clairvoyant-decode")
        self._current = _EpochIterator(self, epoch)
        return self._current

    def _process(self, samples, labels):
        decode = self.dataset.decode
        items = [decode(s, label) for s, label in zip(samples, labels)]
        # Drop the views so that their staging slots are released as soon as possible.
        del samples
        batch = self.collate_fn(items)
        if self.pin_memory:
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch)
        return batch

    def close(self) -> None:
        """Stop the current epoch's read-ahead and the decode threads."""
        if self._current is not None:
            self._current.close()
            self._current = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"clairvoyant.torch.DataLoader(batch_size={self.batch_size}, num_workers={self.num_workers}, steps={len(self)})"


class _EpochIterator:
    """One epoch: a feeder thread pulls batches from the job and submits them to the pool in
    order; ``__next__`` waits for the oldest one. A semaphore bounds the batches in flight."""

    def __init__(self, loader: DataLoader, epoch: int):
        self.epoch = epoch
        self._loader = loader
        self._left = len(loader)
        self._source = iter(loader.job.batches(epoch))
        self._stop = threading.Event()
        self._done = False
        self._feeder: Optional[threading.Thread] = None
        if loader.num_workers > 0:
            self._queue: "queue.Queue[Any]" = queue.Queue()
            self._slots = threading.Semaphore(loader.prefetch_factor * loader.num_workers)
            self._feeder = threading.Thread(target=self._feed, name=f"clairvoyant-feed-{epoch}", daemon=True)
            self._feeder.start()

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._left

    def _feed(self) -> None:
        pool = self._loader._pool
        assert pool is not None
        try:
            while not self._stop.is_set():
                while not self._slots.acquire(timeout=0.1):
                    if self._stop.is_set():
                        return
                try:
                    samples, labels = next(self._source)
                except StopIteration:
                    self._slots.release()
                    self._queue.put(_END)
                    return
                self._queue.put(pool.submit(self._loader._process, samples, labels))
                del samples, labels
        except BaseException as exc:  # delivered to the consumer at this position
            self._queue.put(_Failure(exc))

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._feeder is None:
            try:
                samples, labels = next(self._source)
            except StopIteration:
                self._finish()
                raise
            except BaseException:
                self._finish()
                raise
            self._left -= 1
            return self._loader._process(samples, labels)
        timeout = self._loader.timeout or None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"DataLoader timed out after {self._loader.timeout} seconds") from None
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            # The job itself failed: the rest of the epoch cannot be delivered.
            self._finish()
            raise item.exc
        fut: Future = item
        self._left -= 1
        try:
            # A decode error is raised here, at its batch; later batches still follow.
            return fut.result(timeout=timeout)
        except FutureTimeout:
            raise RuntimeError(f"DataLoader timed out after {self._loader.timeout} seconds") from None
        finally:
            self._slots.release()

    def _finish(self) -> None:
        self._done = True
        self._left = 0
        self._stop.set()

    def close(self) -> None:
        """Stop reading ahead; waits for the feeder (it finishes the batch it is fetching)."""
        self._stop.set()
        if self._feeder is not None and self._feeder.is_alive() and self._feeder is not threading.current_thread():
            self._feeder.join()
        if self._feeder is not None:
            # Wait for decodes already submitted, so the next epoch starts from a quiet pool.
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Future):
                    item.cancel() or item.exception()

    def __del__(self):
        try:
            self._stop.set()
        except Exception:
            pass
