"""clairvoyant.torch: order, shapes, epochs, errors and threading of the DataLoader."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")

import clairvoyant  # noqa: E402
import clairvoyant.torch as ctorch  # noqa: E402
from benches.emulation import make_imagefolder  # noqa: E402

BATCH = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch") / "data"
    make_imagefolder(root, num_classes=3, per_class=14, size_range=(24, 48), seed=1)
    return root


def to_tensor(img):
    a = np.asarray(img.resize((16, 16)), dtype=np.float32) / 255.0
    return torch.from_numpy(a).permute(2, 0, 1).contiguous()


def expected_batches(job, epoch: int, batch_size: int):
    """Labels of each scheduled batch for a single-rank job (world size 1: consecutive runs)."""
    stream = clairvoyant.access_stream(job.num_samples, 1, 0, epoch + 1, batch_size, 0)[epoch]
    labels = np.asarray(job.labels)[np.asarray(stream)]
    return [labels[i : i + batch_size] for i in range(0, len(labels), batch_size)]


def make(data_dir, epochs=2, **kw):
    job = clairvoyant.Job(str(data_dir), batch_size=BATCH, epochs=epochs, seed=0, rank=0, world_size=1)
    dataset = ctorch.ImageFolder(job, to_tensor)
    return job, ctorch.DataLoader(dataset, **kw)


@pytest.mark.parametrize("workers", [0, 3])
def test_yields_the_jobs_order_in_collated_batches(data_dir, workers):
    job, loader = make(data_dir, epochs=2, num_workers=workers)
    n = job.num_samples
    assert len(loader) == job.steps_per_epoch == -(-n // BATCH)
    for epoch in range(2):
        got = list(loader)
        assert len(got) == len(loader)
        want = expected_batches(job, epoch, BATCH)
        for (images, labels), want_labels in zip(got, want):
            assert isinstance(images, torch.Tensor) and images.dtype == torch.float32
            assert images.shape == (len(want_labels), 3, 16, 16)
            assert labels.dtype == torch.int64
            assert labels.tolist() == want_labels.tolist()
        assert sum(len(b[1]) for b in got) == n
    loader.close()
    job.close()


def test_epochs_in_order_and_set_epoch(data_dir):
    job, loader = make(data_dir, epochs=2, num_workers=2)
    with pytest.raises(ValueError) as err:
        loader.set_epoch(1)
    assert isinstance(err.value, clairvoyant.ConfigError)
    loader.set_epoch(0)
    assert sum(1 for _ in loader) == len(loader)
    loader.set_epoch(1)
    assert sum(1 for _ in loader) == len(loader)
    with pytest.raises(RuntimeError) as err:
        iter(loader)
    assert isinstance(err.value, clairvoyant.ExhaustedError)
    loader.close()
    job.close()


def test_batch_size_must_match_the_job(data_dir):
    job = clairvoyant.Job(str(data_dir), batch_size=BATCH, epochs=1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="batch_size") as err:
        ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), batch_size=BATCH + 1)
    assert isinstance(err.value, clairvoyant.ClairvoyantError)
    job.close()


def test_dataset_from_a_directory(data_dir):
    dataset = ctorch.ImageFolder(str(data_dir), to_tensor, epochs=1, rank=0, world_size=1)
    loader = ctorch.DataLoader(dataset, batch_size=BATCH, num_workers=2)
    assert dataset.classes == ["class_000", "class_001", "class_002"]
    assert len(dataset) == 42 and len(dataset.samples) == 42
    image, label = dataset[5]
    assert image.shape == (3, 16, 16) and label == dataset.targets[5]
    assert sum(len(labels) for _, labels in loader) == 42
    loader.close()
    dataset.job.close()


class _PidRecorder:
    """A loader that notes which process decoded each sample (in a directory, across processes)."""

    def __init__(self, directory):
        self.directory = str(directory)

    def __call__(self, data):
        open(os.path.join(self.directory, str(os.getpid())), "a").close()
        time.sleep(0.002)
        return ctorch.pil_loader(data)


def test_decode_runs_in_several_processes_and_reads_shared_memory(data_dir, tmp_path):
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=2, rank=0, world_size=1)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor, loader=_PidRecorder(tmp_path)), num_workers=3)
    for epoch in range(2):
        labels = torch.cat([y for _, y in loader])
        assert labels.tolist() == [int(job.labels[k]) for k in job.samples_of(epoch)]
    pids = {int(p) for p in os.listdir(tmp_path)}
    assert len(pids) > 1 and os.getpid() not in pids
    # The second epoch came from the node's memory class, read in place by the workers, and
    # nothing was read from the file system twice. A staging thread of epoch 1 may claim a
    # sample before the thread of its epoch-0 position does (a loaded machine): that sample's
    # one read then counts for epoch 1, and its memory read for epoch 0.
    sources = [job.stats()[e]["sources"] for e in range(2)]
    assert sources[1]["memory"]["samples"] + sources[1]["pfs"]["samples"] == 42, sources
    assert sources[1]["memory"]["samples"] >= 40, sources
    assert sources[0]["pfs"]["samples"] + sources[1]["pfs"]["samples"] <= 42, sources
    loader.close()
    job.close()


def test_a_dead_worker_is_an_error_not_a_hang(data_dir):
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=1, rank=0, world_size=1)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=2)
    it = iter(loader)
    next(it)
    for p in loader._workers:
        p.kill()
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        for _ in it:
            pass
    loader.close()
    job.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_decode_error_surfaces_at_its_batch(tmp_path, workers):
    root = tmp_path / "data"
    make_imagefolder(root, num_classes=2, per_class=10, size_range=(24, 32), seed=2)
    bad = root / "class_001" / "img_00003.jpg"
    bad.write_bytes(b"this is not a jpeg, though it has the right name" + bytes(100))
    job = clairvoyant.Job(str(root), batch_size=4, epochs=1, rank=0, world_size=1)
    bad_index = job.paths.index(str(bad))
    stream = list(clairvoyant.access_stream(job.num_samples, 1, 0, 1, 4, 0)[0])
    bad_batch = stream.index(bad_index) // 4
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=workers)
    it = iter(loader)
    for _ in range(bad_batch):
        next(it)
    with pytest.raises(Exception) as info:
        next(it)
    assert "PIL" in type(info.value).__module__ or "identify" in str(info.value)
    # The batches after it still follow.
    assert sum(1 for _ in it) == len(loader) - bad_batch - 1
    loader.close()
    job.close()


def test_leaving_an_epoch_early_then_the_next_epoch_is_whole(data_dir):
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=3, rank=0, world_size=1)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=2, prefetch_factor=2)
    for i, _ in enumerate(loader):
        if i == 1:
            break
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [int(job.labels[k]) for k in job.samples_of(1)]
    loader.close()
    job.close()


def test_workers_read_the_staging_ring_when_nothing_is_cached(data_dir, tmp_path, monkeypatch):
    # No memory class: every sample is staged in the rank's ring file and read there by workers.
    monkeypatch.setenv("CLAIRVOYANT_MEMORY", "0")
    monkeypatch.setenv("CLAIRVOYANT_STAGING", "64KiB")
    reference = clairvoyant.Job(str(data_dir), batch_size=4, epochs=1, rank=0, world_size=1)
    want = [(x.clone(), y.clone()) for x, y in ctorch.DataLoader(ctorch.ImageFolder(reference, to_tensor), num_workers=0)]
    reference.close()
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=1, rank=0, world_size=1)
    assert job.placement() == []
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=2)
    got = list(loader)
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want):
        assert torch.equal(gy, wy) and torch.equal(gx, wx)
    assert job.stats()[0]["sources"]["pfs"]["samples"] == 42
    loader.close()
    job.close()


def test_spawned_workers(data_dir):
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=1, rank=0, world_size=1)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=2, multiprocessing_context="spawn")
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == [int(job.labels[k]) for k in job.samples_of(0)]
    loader.close()
    job.close()


def _length(data):
    return len(data)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_missing_file_raises_at_its_batch_and_the_rest_follow(tmp_path, monkeypatch, workers):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "data"
    make_imagefolder(root, num_classes=2, per_class=10, size_range=(24, 32), seed=3)
    source = clairvoyant.ImageFolder(root, index_dir=tmp_path / "index")
    stream = clairvoyant.access_stream(len(source), 1, 0, 2, 4, 0)
    victim = source.paths[int(stream[0][9])]
    os.remove(victim)  # after indexing: the file is missed when it is read
    job = clairvoyant.Job(source, batch_size=4, epochs=2, rank=0, world_size=1)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, loader=_length), num_workers=workers)
    for epoch in range(2):
        bad = list(stream[epoch]).index(source.paths.index(victim)) // 4
        got, failed = [], []
        it = iter(loader)
        for step in range(len(loader)):
            try:
                got.append(next(it)[1])
            except FileNotFoundError as exc:
                assert victim in str(exc)
                failed.append(step)
        assert failed == [bad], f"epoch {epoch}"
        assert len(got) == len(loader) - 1
        with pytest.raises(StopIteration):
            next(it)
    loader.close()
    job.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_job_starts_the_loader_at_its_start_epoch(data_dir, workers):
    full = clairvoyant.Job(str(data_dir), batch_size=4, epochs=3, rank=0, world_size=1)
    want = [int(full.labels[k]) for k in full.samples_of(2)]
    full.close()
    job = clairvoyant.Job(str(data_dir), batch_size=4, epochs=3, rank=0, world_size=1, start_epoch=2)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, to_tensor), num_workers=workers)
    assert len(loader) == -(-42 // 4)
    loader.set_epoch(2)
    labels = torch.cat([y for _, y in loader])
    assert labels.tolist() == want
    with pytest.raises(RuntimeError, match="all 3 epochs"):
        iter(loader)
    loader.close()
    job.close()
