"""The Job API on synthetic sources: order, zero-copy views, stats, several jobs, errors."""

import multiprocessing as mp

import numpy as np
import pytest

import clairvoyant


def expected_bytes(k: int, size: int) -> np.ndarray:
    return ((k * 31 + np.arange(size)) % 256).astype(np.uint8)


def sizes(n):
    return [200 + (k * 53) % 700 for k in range(n)]


def test_samples_in_scheduled_order_with_labels_and_bytes():
    n = 300
    src = clairvoyant.Synthetic(sizes(n), [k % 5 for k in range(n)])
    with clairvoyant.Job(src, batch_size=8, epochs=2, seed=3) as job:
        for e in range(2):
            expect = clairvoyant.access_stream(n, 1, 0, 2, 8, 3)[e]
            got = []
            for sample, label in job.epoch(e):
                k = int(expect[len(got)])
                assert sample.dtype == np.uint8 and not sample.flags.writeable
                assert label == k % 5
                np.testing.assert_array_equal(sample, expected_bytes(k, sizes(n)[k]))
                got.append(k)
            assert got == expect.tolist()
        stats = job.stats()
    assert [s["samples"] for s in stats] == [n, n]
    assert stats[1]["sources"]["memory"]["samples"] == n
    assert set(stats[0]["sources"]) == {"staging", "memory", "ssd", "pfs", "peer"}
    assert stats[0]["pfs_bytes_read"] == sum(sizes(n))


def test_batches_follow_schedule_and_views_outlive_the_iteration():
    n = 100
    src = clairvoyant.Synthetic(sizes(n))
    job = clairvoyant.Job(src, batch_size=16, epochs=1)
    kept = []
    order = job.samples_of(0).tolist()
    for samples, labels in job.batches(0):
        assert labels.dtype == np.int64
        kept.extend(samples)
    assert len(kept) == n == len(order)
    for k, s in zip(order, kept):
        np.testing.assert_array_equal(s, expected_bytes(k, sizes(n)[k]))
    job.close()


def test_two_jobs_in_one_process():
    train = clairvoyant.Job(clairvoyant.Synthetic(sizes(50)), batch_size=4, epochs=2, seed=1)
    val = clairvoyant.Job(clairvoyant.Synthetic(sizes(20)), batch_size=4, epochs=2, seed=1)
    for e in range(2):
        assert sum(1 for _ in train.epoch(e)) == 50
        assert sum(1 for _ in val.epoch(e)) == 20
    train.close()
    val.close()


def test_epochs_in_order_and_past_the_end():
    job = clairvoyant.Job(clairvoyant.Synthetic(sizes(10)), batch_size=2, epochs=2)
    list(job.epoch(0))
    with pytest.raises(clairvoyant.ExhaustedError, match="already consumed"):
        job.epoch(0)
    list(job.epoch(1))
    with pytest.raises(clairvoyant.ExhaustedError, match="past the job's last epoch"):
        job.epoch(2)
    it = job.epoch  # the iterator of a finished epoch just stops
    job.close()
    with pytest.raises(clairvoyant.CancelledError):
        it(1)


def test_bad_arguments_name_the_field():
    src = clairvoyant.Synthetic(sizes(10))
    with pytest.raises(clairvoyant.ConfigError, match="batch_size"):
        clairvoyant.Job(src, batch_size=0, epochs=1)
    with pytest.raises(ValueError, match="rank 3 is outside world size 2"):
        clairvoyant.Job(src, batch_size=1, epochs=1, rank=3, world_size=2)


def test_staging_too_small_names_the_sample(tmp_path):
    cfg = tmp_path / "system.toml"
    cfg.write_text(
        """
[staging]
capacity = 100
threads = 1
[pfs]
read_mbps = [[1, 100.0]]
"""
    )
    with pytest.raises(clairvoyant.CapacityError, match=r"synthetic/\d+.*staging"):
        clairvoyant.Job(clairvoyant.Synthetic(sizes(10)), batch_size=1, epochs=1, config=cfg)


def _rank_main(rank, q, done):
    try:
        src = clairvoyant.Synthetic(sizes(400))
        job = clairvoyant.Job(src, batch_size=8, epochs=3, rank=rank, world_size=2, local_ranks=[0, 1])
        order = []
        for e in range(3):
            order.append([int(np.frombuffer(s, dtype=np.uint8)[0]) for s, _ in job.epoch(e)])
        # A rank's class prefetchers may still fill samples for the other rank after its own
        # last epoch: count reads once both ranks consumed everything (then every fill ended).
        done.wait(timeout=60)
        q.put((rank, job.stats(), job.samples_of(0).tolist()))
        job.close()
    except Exception as e:  # pragma: no cover - reported to the parent
        q.put((rank, repr(e), None))


def test_two_ranks_on_one_node_read_each_sample_once():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Barrier(2)
    procs = [ctx.Process(target=_rank_main, args=(r, q, done)) for r in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    for rank, stats, _ in results:
        assert isinstance(stats, list), f"rank {rank}: {stats}"
    files = sum(s["pfs_files_read"] for _, stats, _ in results for s in stats)
    assert files == 400, "one read per sample across both ranks and three epochs"
    union = sorted(k for _, _, order in results for k in order)
    assert union == list(range(400))


def test_job_cannot_be_used_after_fork():
    job = clairvoyant.Job(clairvoyant.Synthetic(sizes(10)), batch_size=2, epochs=1)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def child():
        try:
            list(job.epoch(0))
            q.put("no error")
        except clairvoyant.ConfigError as e:
            q.put(str(e))

    p = ctx.Process(target=child)
    p.start()
    msg = q.get(timeout=30)
    p.join()
    assert "forked process" in msg
    assert sum(1 for _ in job.epoch(0)) == 10
    job.close()


def test_resume_reproduces_the_uninterrupted_run():
    n = 90
    full = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=4, epochs=4, seed=9, rank=1, world_size=2, local_ranks=[1])
    want = {e: [bytes(s) for s, _ in full.epoch(e)] for e in range(4)}
    full.close()
    resumed = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=4, epochs=4, seed=9, rank=1, world_size=2, local_ranks=[1], start_epoch=2)
    with pytest.raises(clairvoyant.ExhaustedError, match="start epoch"):
        resumed.epoch(1)
    for e in (2, 3):
        assert [bytes(s) for s, _ in resumed.epoch(e)] == want[e]
    assert resumed.stats()[0]["samples"] == 0
    resumed.close()


def test_explicit_order_job():
    n = 12
    orders = [list(range(n)), list(reversed(range(n)))]
    job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=3, epochs=2, order=orders)
    assert job.epochs == 2
    assert job.samples_of(1).tolist() == list(reversed(range(n)))
    got = [int(np.frombuffer(s, np.uint8)[0]) for s, _ in job.epoch(0)]
    assert got == [(k * 31) % 256 for k in range(n)]
    job.close()


def test_a_closed_job_leaves_the_node_cache_at_once(monkeypatch):
    src = clairvoyant.Synthetic(sizes(30))
    monkeypatch.setenv("CLAIRVOYANT_MEMORY", "0")
    first = clairvoyant.Job(src, batch_size=3, epochs=1)
    assert first.placement() == []
    sum(1 for _ in first.epoch(0))
    first.close()  # still referenced: closing alone must release the cache
    monkeypatch.delenv("CLAIRVOYANT_MEMORY")
    second = clairvoyant.Job(src, batch_size=3, epochs=1)
    assert [name for name, _, _ in second.placement()] == ["memory"]
    assert sum(1 for _ in second.epoch(0)) == 30
    second.close()
    del first


def test_starting_a_job_pauses_the_collector_and_restores_it():
    import gc

    src = clairvoyant.Synthetic(sizes(20), [0] * 20)
    seen = []
    original = clairvoyant.Job._attach_engine

    def attach(self, *a, **k):
        seen.append(gc.isenabled())
        return original(self, *a, **k)

    clairvoyant.Job._attach_engine = attach
    try:
        assert gc.isenabled()
        with clairvoyant.Job(src, batch_size=4, epochs=1):
            assert gc.isenabled()
        gc.disable()
        try:
            clairvoyant.Job(src, batch_size=4, epochs=1).close()
            assert not gc.isenabled()  # left as the program had it
        finally:
            gc.enable()
        with pytest.raises(clairvoyant.ConfigError):
            clairvoyant.Job(src, batch_size=0, epochs=1)
        assert gc.isenabled()
    finally:
        clairvoyant.Job._attach_engine = original
    assert seen == [False, False]
