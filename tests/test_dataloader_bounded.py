"""clairvoyant.torch.DataLoader keeps at most prefetch_factor x num_workers decoded batches, with
a slow training step, across epoch boundaries, when an epoch is left early and at close."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import clairvoyant  # noqa: E402
import clairvoyant.torch as ctorch  # noqa: E402

BATCH = 4


def _label_only(data):
    return int(len(data))


class CountingCollate:
    """Counts, in memory shared with the parent, every batch a worker has made."""

    def __init__(self, made, payload_bytes: int = 0):
        self.made, self.payload_bytes = made, payload_bytes

    def __call__(self, items):
        with self.made.get_lock():
            self.made.value += 1
        labels = [t for _, t in items]
        if self.payload_bytes:
            # A decoded batch that lives in the training process once received (pickled), like
            # decoded images: np.ones touches every page.
            return np.ones(self.payload_bytes, dtype=np.uint8), labels
        return labels


def make_loader(n: int, epochs: int, made, workers=2, prefetch=2, payload=0):
    job = clairvoyant.Job(clairvoyant.Synthetic([64] * n), batch_size=BATCH, epochs=epochs, rank=0, world_size=1)
    dataset = ctorch.ImageFolder(job, loader=_label_only)
    loader = ctorch.DataLoader(
        dataset, num_workers=workers, prefetch_factor=prefetch, collate_fn=CountingCollate(made, payload),
        multiprocessing_context="fork",
    )
    return job, loader


def test_slow_consumer_never_has_more_than_the_bound_decoded():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=160, epochs=3, made=made, workers=2, prefetch=2)
    bound = 2 * 2
    steps = len(loader)
    taken, worst, worst_credit = 0, 0, 0
    made_at_last_of_epoch0 = None
    for epoch in range(3):
        for step, _ in enumerate(loader):
            taken += 1
            # Batches made but not yet taken (the one just taken no longer counts).
            worst = max(worst, made.value - taken)
            worst_credit = max(worst_credit, loader.in_flight)
            if epoch == 0 and step == steps - 1:
                made_at_last_of_epoch0 = made.value
            time.sleep(0.01)  # a slow training step
    assert taken == 3 * steps
    assert worst <= bound, f"{worst} decoded batches waited; the bound is {bound}"
    assert worst_credit <= bound
    assert worst >= bound - 1, "the workers kept batches ready ahead of the slow step"
    # The next epoch's first batches were decoded before this epoch's last one was taken.
    assert made_at_last_of_epoch0 > steps
    loader.close()
    job.close()


def test_one_worker_with_prefetch_one_decodes_one_batch_ahead():
    # With one worker and prefetch 1, exactly one batch may be decoded ahead: after a long pause
    # the counter shows it, and not more.
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=80, epochs=1, made=made, workers=1, prefetch=1)
    it = iter(loader)
    next(it)
    time.sleep(0.5)
    assert made.value - 1 <= 1
    assert loader.in_flight <= 1
    assert sum(1 for _ in it) == len(loader) - 1
    loader.close()
    job.close()


def test_an_epoch_left_early_is_not_decoded_further_and_the_next_is_whole():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=200, epochs=2, made=made, workers=2, prefetch=2)
    steps = len(loader)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    time.sleep(0.3)  # the workers would run ahead here if credits leaked
    labels = [x for batch in loader for x in batch]
    assert len(labels) == job.num_samples
    assert loader.in_flight == 0, "every credit came back at the end of the run"
    # Epoch 0: 3 taken plus at most the bound ahead (twice: before and after the break).
    assert made.value <= steps + 3 + 2 * 4, f"{made.value} batches made for {steps} + 3 used"
    loader.close()
    job.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_unfinished_iterator_of_an_earlier_epoch_raises(workers):
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=40, epochs=3, made=made, workers=workers)
    first = iter(loader)
    next(first)
    second = iter(loader)
    with pytest.raises(clairvoyant.ExhaustedError, match="epoch 0 was left unfinished when epoch 1 began"):
        next(first)
    assert sum(1 for _ in second) == len(loader)
    # An iterator run to its end just keeps stopping.
    third = iter(loader)
    assert sum(1 for _ in third) == len(loader)
    assert list(second) == []
    loader.close()
    job.close()


def test_close_with_a_full_pipeline_returns_promptly_and_the_iterator_raises():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=200, epochs=2, made=made, workers=2, prefetch=2)
    it = iter(loader)
    next(it)
    time.sleep(0.3)  # the feeder is now waiting for credits
    workers = list(loader._workers)
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 5
    assert not any(p.is_alive() for p in workers)
    with pytest.raises(clairvoyant.CancelledError, match="DataLoader was closed"):
        next(it)
    job.close()


def test_closing_the_job_stops_its_loaders():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=80, epochs=2, made=made, workers=2)
    it = iter(loader)
    next(it)
    workers = list(loader._workers)
    job.close()
    assert not any(p.is_alive() for p in workers)
    with pytest.raises(clairvoyant.CancelledError):
        next(it)


def test_a_consumer_blocked_in_next_is_released_by_close():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=40, epochs=1, made=made, workers=1, prefetch=1)
    it = iter(loader)
    pipeline = loader._pipeline
    errors = []

    def consume():
        try:
            # Ask for a batch the feeder will never send (nothing past the end).
            pipeline.get(10**9)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    time.sleep(0.2)
    loader.close()
    t.join(timeout=5)
    assert not t.is_alive()
    assert isinstance(errors[0], clairvoyant.CancelledError)
    del it
    job.close()


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return 0
    return 0


def test_resident_memory_stays_flat_with_a_slow_consumer():
    payload = 1 << 20  # 1 MiB per decoded batch
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=240, epochs=3, made=made, workers=2, prefetch=2, payload=payload)

    def rss_mib() -> float:
        pids = [os.getpid()] + [p.pid for p in loader._workers]
        return sum(_rss_kib(p) for p in pids) / 1024

    samples = []
    for _epoch in range(3):
        for step, (data, _) in enumerate(loader):
            assert data.nbytes == payload
            del data
            if not samples:
                samples.append(rss_mib())  # the workers have made about one batch so far
            time.sleep(0.02)  # a slow training step: decoding is several times faster
            if step % 10 == 9:
                samples.append(rss_mib())
    growth = max(samples) - samples[0]
    print(f"resident memory growth {growth:.1f} MiB over {len(samples)} samples")
    # 180 batches of 1 MiB: piling up adds about 100 MiB in the first second; the bound is 4.
    assert growth < 24, f"resident memory grew by {growth:.0f} MiB: {[round(s) for s in samples]}"
    assert made.value <= 3 * len(loader)
    loader.close()
    job.close()


def test_closing_the_job_mid_epoch_removes_its_shared_files():
    made = mp.get_context("fork").Value("l", 0)
    job, loader = make_loader(n=200, epochs=2, made=made, workers=2, prefetch=2)
    segments = [p for p in job.segments if p]
    it = iter(loader)
    next(it)
    time.sleep(0.2)  # workers hold leases and map the segments
    assert all(os.path.exists(p) for p in segments)
    job.close()  # `loader` and `it` are still referenced
    left = [p for p in segments if os.path.exists(p)]
    assert not left, f"left after close(): {left}"


def _labels(items):
    return [t for _, t in items]


_DECODE_LOG: list = [None]  # the file the workers (forked) append their decode intervals to


def _logged_decode(data):
    t0 = time.monotonic()
    time.sleep(0.002)  # decoding emulated by sleeping: independent of the machine's load
    with open(_DECODE_LOG[0], "a") as f:
        f.write(f"{os.getpid()} {t0} {time.monotonic()}\n")
    return len(data)


def _intervals(path) -> list:
    with open(path) as f:
        rows = [line.split() for line in f if line.strip()]
    return [(int(p), float(a), float(b)) for p, a, b in rows]


def _overlap(a0, a1, b0, b1) -> bool:
    return a0 < b1 and b0 < a1


def test_the_bound_does_not_serialise_decoding_with_training(tmp_path):
    """Both workers decode at once, and decoding goes on while the training step runs. Checked
    on the order of events (each worker logs when its decodes ran, the loop when its steps ran
    on the same monotonic clock), not against a time limit."""
    steps, batch = 40, 8
    job = clairvoyant.Job(clairvoyant.Synthetic([64] * (steps * batch)), batch_size=batch, epochs=2, rank=0, world_size=1)
    loader = ctorch.DataLoader(
        ctorch.ImageFolder(job, loader=_logged_decode), num_workers=2, prefetch_factor=2, collate_fn=_labels,
        multiprocessing_context="fork",
    )
    decode = batch * 0.002
    _DECODE_LOG[0] = str(tmp_path / "decodes.log")  # before the workers start (forked)
    assert sum(1 for _ in loader) == steps  # a fast training loop: both workers busy
    spans = []
    for _ in loader:  # a training step as long as half a worker's batch: decoding overlaps it
        t0 = time.monotonic()
        time.sleep(decode / 2)
        spans.append((t0, time.monotonic()))
    loader.close()
    job.close()
    decodes = _intervals(_DECODE_LOG[0])
    assert len(decodes) == 2 * steps * batch
    assert len({p for p, _, _ in decodes}) == 2, "both workers decoded"
    # Parallel workers: most decodes overlap one of the other worker's.
    by = {}
    for p, a, b in decodes:
        by.setdefault(p, []).append((a, b))
    (p1, one), (p2, two) = by.items()
    shared = sum(any(_overlap(a, b, c, d) for c, d in two) for a, b in one)
    assert shared >= len(one) // 2, f"{shared} of worker {p1}'s {len(one)} decodes overlap worker {p2}'s: not in parallel"
    # Decoding during training: most steps see a decode running.
    busy = sum(any(_overlap(s0, s1, a, b) for _, a, b in decodes) for s0, s1 in spans)
    assert busy >= len(spans) // 2, f"decoding ran during {busy} of {len(spans)} training steps: it waited for them"
