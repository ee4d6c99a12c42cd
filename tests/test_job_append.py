"""Passes appended to a running Job: served with their batches, skipped unread, dropped once
consumed, refused with the argument named."""

import os

import numpy as np
import pytest

import clairvoyant


def expected_bytes(k: int, size: int) -> np.ndarray:
    return ((k * 31 + np.arange(size)) % 256).astype(np.uint8)


def sizes(n):
    return [200 + (k * 53) % 700 for k in range(n)]


@pytest.fixture
def uncached(tmp_path, monkeypatch):
    """A small staging ring and no node cache: every byte served was read by staging."""
    cfg = tmp_path / "system.toml"
    cfg.write_text("[staging]\ncapacity = 4096\nthreads = 2\n[pfs]\nread_mbps = [[1, 100.0]]\n")
    monkeypatch.setenv("CLAIRVOYANT_MEMORY", "0")
    return cfg


def test_appended_passes_are_served_by_every_iterator():
    n = 60
    src = clairvoyant.Synthetic(sizes(n), [k % 7 for k in range(n)])
    with clairvoyant.Job(src, batch_size=4, epochs=1, seed=5) as job:
        first = job.samples_of(0).tolist()
        passes = [[59, 0, 0, 31, 7, 8, 2, 44], list(range(10, 20)), np.arange(30, 42, dtype=np.int64)]
        sizes_of = [[3, 3, 2], [10], [5, 5, 2]]
        for p, bs in zip(passes, sizes_of):
            assert job.append_epoch(p, bs) == job.epochs - 1
        assert job.epochs == 4
        assert job.batch_sizes(1).tolist() == [3, 3, 2]
        assert job.samples_of(3).tolist() == list(range(30, 42))

        served = [bytes(s) for b, _ in job.batches(0) for s in b]
        assert served == [expected_bytes(k, sizes(n)[k]).tobytes() for k in first]
        got = [(bytes(s), int(label)) for s, label in job.epoch(1)]
        assert got == [(expected_bytes(k, sizes(n)[k]).tobytes(), k % 7) for k in passes[0]]
        batches = list(job.batches(2))
        assert [len(b) for b, _ in batches] == [10]
        for s, k in zip(batches[0][0], passes[1]):
            np.testing.assert_array_equal(s, expected_bytes(k, sizes(n)[k]))
        shared = list(job.shared_batches(3))
        assert [len(d) for _, d, _, _ in shared] == [5, 5, 2]
        assert [int(x) for _, _, labels, _ in shared for x in labels] == [k % 7 for k in range(30, 42)]
        with pytest.raises(clairvoyant.ExhaustedError):
            job.epoch(4)
        stats = job.stats()
    assert [s["samples"] for s in stats] == [n, 8, 10, 12]


def test_a_consumed_pass_is_dropped_but_its_batches_stay():
    src = clairvoyant.Synthetic(sizes(20))
    with clairvoyant.Job(src, batch_size=5, epochs=1) as job:
        first = job.samples_of(0).tolist()
        job.append_epoch(list(range(20)), [5] * 4)
        job.append_epoch(list(range(19, -1, -1)), [10, 10])
        assert job._engine.held_samples == 60
        assert sum(1 for _ in job.epoch(0)) == 20
        assert job._engine.held_samples == 40
        # An epoch of the job's own schedule is derived again.
        assert job.samples_of(0).tolist() == first
        assert sum(1 for _ in job.epoch(1)) == 20
        with pytest.raises(clairvoyant.EpochConsumedError, match="epoch 1 were dropped"):
            job.samples_of(1)
        assert job.batch_sizes(1).tolist() == [5, 5, 5, 5]
        assert job.samples_of(2).tolist() == list(range(19, -1, -1))


def test_skipping_to_an_appended_pass_reads_nothing_of_the_rest(tmp_path, uncached):
    n = 2000
    src = clairvoyant.Synthetic(sizes(n))
    with clairvoyant.Job(src, batch_size=10, epochs=1, order=[list(range(1000))], config=uncached) as job:
        assert job.placement() == []
        job.append_epoch(list(range(1000, 2000)), [10] * 100)
        it = job.epoch(0)
        for _ in range(5):
            next(it)
        del it
        got = [(k, bytes(s)) for k, (s, _) in zip(range(1000, 2000), job.epoch(1))]
        assert len(got) == 1000
        for k, b in got:
            assert b == expected_bytes(k, sizes(n)[k]).tobytes()
        stats = job.stats()
    assert stats[0]["samples"] == 5
    # Staging runs a few samples ahead of the consumer, never the rest of the skipped epoch.
    read = stats[0]["pfs_files_read"] + stats[1]["pfs_files_read"]
    assert 1005 <= read < 1100, stats


def make_tree(root, classes=3, per_class=40):
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            (d / f"img{i:03d}.png").write_bytes(bytes([c, i]) * (40 + 7 * i))
    t = os.path.getmtime(root) - 60  # an index only trusts directories still for a while
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))
    return root


def test_image_folder_append_and_skip_serve_the_files_bytes(tmp_path, monkeypatch, uncached):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path / "cache"))
    root = make_tree(tmp_path / "data")
    fs = clairvoyant.EmulatedFs(str(tmp_path / "fs.state"), open_latency_ms=0.2, bandwidth_mbps=500)
    src = clairvoyant.ImageFolder(root, emulated=fs)
    n = len(src)
    rng = np.random.default_rng(1)
    with clairvoyant.Job(src, batch_size=8, epochs=1, config=uncached) as job:
        later = rng.permutation(n)
        assert job.append_epoch(later[:50], [8] * 6 + [2]) == 1
        assert job.append_epoch(later, [n]) == 2
        first = job.batches(0)
        next(first)  # one batch of epoch 0, the rest skipped
        for e, order in ((1, later[:50]), (2, later)):
            got = [bytes(s) for b, _ in job.batches(e) for s in b]
            want = [open(src.paths[k], "rb").read() for k in order]
            assert got == want
        stats = job.stats()
    assert [s["samples"] for s in stats] == [8, 50, n]
    # Epoch 0's rest was never read: staging ran only a ring's worth ahead of the first batch.
    assert fs.files_read < 8 + 40 + 50 + n


def test_bad_passes_name_the_argument():
    src = clairvoyant.Synthetic(sizes(10))
    with clairvoyant.Job(src, batch_size=2, epochs=1) as job:
        cases = [
            (("abc", [3]), TypeError, "'samples'"),
            ((3, [3]), TypeError, "'samples'"),
            (([1.5, 2.0], [2]), TypeError, "'samples'"),
            (([1, 2, 10], [3]), clairvoyant.ConfigError, r"'samples'.*position 2: sample 10"),
            (([1, -1], [2]), clairvoyant.ConfigError, r"'samples'.*position 1: sample -1"),
            (([[1, 2]], [2]), clairvoyant.ConfigError, "'samples'"),
            (([], []), clairvoyant.ConfigError, "'samples'.*at least one"),
            (([1, 2, 3], 3), TypeError, "'batch_sizes'"),
            (([1, 2, 3], [2, 0, 1]), clairvoyant.ConfigError, "'batch_sizes'"),
            (([1, 2, 3], [2, 2]), clairvoyant.ConfigError, "'batch_sizes'.*add up to 4"),
            (([1, 2, 3], [1.0, 2]), TypeError, "'batch_sizes'"),
            (([1, 2, 3], [True, 2]), TypeError, "'batch_sizes'"),
        ]
        for args, exc, match in cases:
            with pytest.raises(exc, match=match):
                job.append_epoch(*args)
        assert job.epochs == 1
        # The native checks behind the Job's own.
        with pytest.raises(clairvoyant.ConfigError, match="'batch_sizes'"):
            job._engine.append_epoch([1, 2], [1, 0, 1])
        with pytest.raises(clairvoyant.ConfigError, match="'samples'.*position 1"):
            job._engine.append_epoch(np.array([1, 99], dtype=np.int64), [2])
        assert job._engine.epochs == 1
    with pytest.raises(clairvoyant.CancelledError):
        job.append_epoch([1], [1])


def test_shared_batches_in_parts_cover_each_batch_in_order_and_leave_a_sample_that_cannot_be_read(tmp_path):
    n, bad = 12, 5
    files = []
    for k in range(n):
        p = tmp_path / f"{k}.bin"
        p.write_bytes(expected_bytes(k, 100 + k).tobytes())
        files.append(str(p))
    src = clairvoyant.FileList(files, [k % 3 for k in range(n)], index_dir=tmp_path / "index")
    os.remove(files[bad])  # indexed, then gone: its read fails
    with clairvoyant.Job(src, batch_size=4, epochs=1, seed=3) as job:
        order = job.samples_of(0).tolist()
        segments = job.segments
        it = job.shared_batches(0)
        got, leases = [], []
        for _ in range(3):
            taken = 0
            for lease, where, labels, private, failed in it.next_parts():
                leases.append(lease)
                assert len(where) == len(labels) and 1 <= len(where) + failed <= 4 - taken
                for j, (region, off, size) in enumerate(where):
                    if j in private:
                        got.append((bytes(private[j]), int(labels[j])))
                        continue
                    with open(segments[region], "rb") as f:
                        f.seek(off)
                        got.append((f.read(size), int(labels[j])))
                if failed:
                    got.append(None)
                taken += len(where) + failed
            assert taken == 4, "a batch's parts end with the batch"
        with pytest.raises(StopIteration):
            it.next_parts()
    want = [None if k == bad else (expected_bytes(k, 100 + k).tobytes(), k % 3) for k in order]
    assert got == want
