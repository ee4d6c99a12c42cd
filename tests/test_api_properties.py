"""Property tests of the public Python API's edges: any arguments either work or raise a
clairvoyant error, ValueError or TypeError that names the argument; never a Rust panic."""

from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import clairvoyant  # noqa: E402
from clairvoyant import _native  # noqa: E402

QUICK = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

JOB_ARGS = ("batch_size", "epochs", "seed", "drop_last", "rank", "world_size", "local_ranks", "order", "start_epoch", "epoch")
SCHEDULE_ARGS = (
    "num_samples", "world_size", "rank", "epochs", "batch_size", "seed", "drop_last", "orders", "order", "ranks",
    "sample_bytes", "classes",
)

# Integers around every edge: negative, zero, small, the 32- and 64-bit limits and beyond.
edges = st.sampled_from([-(2**70), -(2**64), -(2**31), -1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 2**64, 2**70])
small = st.integers(min_value=-2, max_value=5)
not_ints = st.sampled_from([1.5, "3", None, [1], True, np.float64(2.0)])


def arg(base):
    return st.one_of(base, base, base, edges, not_ints)


def is_panic(exc: BaseException) -> bool:
    return type(exc).__name__ == "PanicException"


def check_raised(exc: BaseException, names) -> None:
    """A panic, or an error of another kind or naming no argument, fails the test."""
    assert not is_panic(exc), f"a Rust panic reached Python: {exc!r}"
    assert isinstance(exc, (clairvoyant.ClairvoyantError, ValueError, TypeError)), f"unexpected {exc!r}"
    message = str(exc)
    assert any(name in message for name in names), f"{type(exc).__name__} names no argument: {message}"


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)


@QUICK
@given(
    sizes=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=12),
    batch_size=arg(small),
    epochs=st.one_of(st.none(), arg(st.integers(min_value=-1, max_value=3))),
    seed=arg(st.integers(min_value=-3, max_value=2**64 + 3)),
    drop_last=st.one_of(st.booleans(), st.sampled_from([0, 1, "yes", None])),
    rank=st.one_of(st.none(), arg(small)),
    world_size=st.one_of(st.none(), arg(small)),
    local_ranks=st.one_of(st.none(), st.lists(arg(small), max_size=4)),
    order=st.one_of(
        st.none(),
        st.lists(st.lists(st.integers(min_value=-2, max_value=14), max_size=14), max_size=3),
        st.lists(st.lists(edges, min_size=1, max_size=2), min_size=1, max_size=2),
        st.sampled_from(["01", [[0.5]], [None], 3]),
    ),
    start_epoch=arg(st.integers(min_value=-1, max_value=3)),
    repair=st.booleans(),
)
def test_job_arguments_work_or_raise_a_named_error(
    sizes, batch_size, epochs, seed, drop_last, rank, world_size, local_ranks, order, start_epoch, repair
):
    if repair:  # half of the examples: types and ranges right, so that jobs run and combinations meet
        def fix(v, lo, hi):
            return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi else lo

        batch_size, seed, start_epoch = fix(batch_size, 1, 6), fix(seed, 0, 2**64 - 1), fix(start_epoch, 0, 3)
        drop_last = bool(drop_last) if isinstance(drop_last, bool) else False
        world_size = fix(world_size, 1, 4)
        rank = fix(rank, 0, 4) % world_size
        if isinstance(local_ranks, list):
            local_ranks = sorted({fix(r, 0, 4) % world_size for r in local_ranks} | {rank})
        if not isinstance(order, list) or not all(isinstance(o, list) for o in order) or not order:
            order = None
        else:
            order = [[fix(k, 0, 2**32) % len(sizes) for k in o] for o in order]
        epochs = None if order is not None else fix(epochs, 1, 3)
    kwargs = dict(
        batch_size=batch_size, epochs=epochs, seed=seed, drop_last=drop_last, rank=rank, world_size=world_size,
        local_ranks=local_ranks, order=order, start_epoch=start_epoch,
    )
    try:
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes), **kwargs)
    except BaseException as exc:  # noqa: BLE001 - a panic is a BaseException
        check_raised(exc, JOB_ARGS)
        return
    try:
        assert job.epochs >= 1
        if order is not None:
            assert job.epochs == len(order), "explicit orders define the epochs"
        else:
            assert job.epochs == epochs
        if job.local_ranks == [job.rank]:  # alone on the node: consume a whole epoch
            e = job.start_epoch
            got = [int(k) for k in job.samples_of(e)]
            n = sum(len(samples) for samples, _ in job.batches(e))
            assert n == len(got)
            assert all(0 <= k < len(sizes) for k in got)
    except BaseException as exc:  # noqa: BLE001
        check_raised(exc, JOB_ARGS)
    finally:
        job.close()


@QUICK
@given(
    num_samples=arg(st.integers(min_value=-1, max_value=20)),
    world_size=arg(small),
    rank=arg(small),
    epochs=arg(st.integers(min_value=-1, max_value=3)),
    batch_size=arg(small),
    seed=arg(st.integers(min_value=-2, max_value=2**64)),
    drop_last=st.booleans(),
)
def test_access_stream_works_or_raises_a_named_error(num_samples, world_size, rank, epochs, batch_size, seed, drop_last):
    try:
        streams = clairvoyant.access_stream(num_samples, world_size, rank, epochs, batch_size, seed, drop_last)
    except BaseException as exc:  # noqa: BLE001
        check_raised(exc, SCHEDULE_ARGS)
        return
    assert len(streams) == epochs
    for s in streams:
        assert all(0 <= k < num_samples for k in s.tolist())


@QUICK
@given(
    num_samples=arg(st.integers(min_value=-1, max_value=12)),
    orders=st.one_of(
        st.lists(st.lists(st.integers(min_value=-2, max_value=14), max_size=12), max_size=3),
        st.lists(st.lists(edges, min_size=1, max_size=2), min_size=1, max_size=2),
        st.sampled_from(["01", [[0.5]], [None], 3, [[True]]]),
    ),
    world_size=arg(small),
    rank=arg(small),
    batch_size=arg(small),
    drop_last=st.booleans(),
)
def test_access_stream_from_order_works_or_raises_a_named_error(num_samples, orders, world_size, rank, batch_size, drop_last):
    try:
        streams = clairvoyant.access_stream_from_order(num_samples, orders, world_size, rank, batch_size, drop_last)
    except BaseException as exc:  # noqa: BLE001
        check_raised(exc, SCHEDULE_ARGS)
        return
    assert len(streams) == len(orders)


@QUICK
@given(
    num_samples=arg(st.integers(min_value=-1, max_value=20)),
    world_size=arg(small),
    epochs=arg(st.integers(min_value=-1, max_value=3)),
    batch_size=arg(small),
    seed=arg(st.integers(min_value=-2, max_value=2**64)),
    ranks=st.one_of(st.lists(arg(small), max_size=3), not_ints),
    sample_bytes=st.one_of(st.lists(arg(st.integers(min_value=-1, max_value=100)), max_size=3), not_ints),
    classes=st.lists(st.tuples(st.sampled_from(["memory", "ssd"]), arg(st.integers(min_value=-1, max_value=10**4))), max_size=2),
    drop_last=st.booleans(),
)
def test_plan_report_works_or_raises_a_named_error(num_samples, world_size, epochs, batch_size, seed, ranks, sample_bytes, classes, drop_last):
    try:
        report = _native.plan_report(num_samples, world_size, epochs, batch_size, seed, ranks, sample_bytes, classes, drop_last)
    except BaseException as exc:  # noqa: BLE001
        check_raised(exc, SCHEDULE_ARGS)
        return
    assert "samples" in report


# -- the cases found by hand, one test each ---------------------------------------------------

SIZES = [100] * 20


def test_negative_seed_names_seed():
    with pytest.raises(clairvoyant.ConfigError, match="'seed'"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=1, seed=-1)
    with pytest.raises(clairvoyant.ConfigError, match="'seed'"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=1, seed=2**64)
    with pytest.raises(clairvoyant.ConfigError, match="'seed'"):
        clairvoyant.access_stream(20, 1, 0, 1, 4, -1)
    with pytest.raises(TypeError, match="'seed'"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=1, seed=1.5)


def test_a_negative_or_too_large_id_in_order_names_order():
    with pytest.raises(clairvoyant.ConfigError, match="'order': epoch 0 position 2: sample -1"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, order=[[0, 1, -1]])
    with pytest.raises(clairvoyant.ConfigError, match="'order': epoch 1 position 0: sample 20 is outside"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, order=[[0], [20]])
    with pytest.raises(clairvoyant.ConfigError, match="'order'"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, order=[[2**70]])
    with pytest.raises(TypeError, match="'order' epoch 0: sample ids must be integers"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, order=[[0.5]])
    with pytest.raises(clairvoyant.ConfigError, match=r"'orders\[0\]\[1\]'"):
        clairvoyant.access_stream_from_order(20, [[0, -3]], 1, 0, 4)


def test_epochs_must_match_an_explicit_order():
    src = clairvoyant.Synthetic(SIZES)
    with pytest.raises(clairvoyant.ConfigError, match="'epochs': 5, but 'order' gives 1 epoch"):
        clairvoyant.Job(src, batch_size=4, epochs=5, order=[list(range(20))])
    with clairvoyant.Job(src, batch_size=4, order=[list(range(20))] * 2) as job:
        assert job.epochs == 2
    with clairvoyant.Job(src, batch_size=4, epochs=2, order=[list(range(20))] * 2) as job:
        assert job.epochs == 2
    with pytest.raises(clairvoyant.ConfigError, match="'epochs': required unless 'order'"):
        clairvoyant.Job(src, batch_size=4)


def test_local_ranks_outside_the_world_size_are_rejected():
    with pytest.raises(clairvoyant.ConfigError, match=r"'local_ranks': .*5.* outside world size 2"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=2, epochs=1, rank=0, world_size=2, local_ranks=[0, 5])
    with pytest.raises(clairvoyant.ConfigError, match="'local_ranks'"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=2, epochs=1, rank=0, world_size=2, local_ranks=[0, -1])
    with pytest.raises(clairvoyant.ConfigError, match="names a rank twice"):
        clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=2, epochs=1, rank=0, world_size=2, local_ranks=[0, 0])


def test_non_integer_arguments_are_type_errors_naming_them():
    src = clairvoyant.Synthetic(SIZES)
    for name, value in [("batch_size", 2.0), ("epochs", "3"), ("start_epoch", None), ("rank", 0.0), ("world_size", [2])]:
        kwargs = dict(batch_size=2, epochs=1, rank=0, world_size=1)
        kwargs[name] = value
        with pytest.raises(TypeError, match=f"'{name}'"):
            clairvoyant.Job(src, **kwargs)
    with pytest.raises(TypeError, match="'drop_last' must be a bool"):
        clairvoyant.Job(src, batch_size=2, epochs=1, drop_last="no")
    with pytest.raises(TypeError, match="'batch_size'"):
        clairvoyant.access_stream(20, 1, 0, 1, 2.5, 0)
    with clairvoyant.Job(src, batch_size=2, epochs=2) as job:
        with pytest.raises(TypeError, match="'epoch'"):
            job.epoch(1.0)
        with pytest.raises(clairvoyant.ConfigError, match="'epoch'"):
            job.batches(-1)
        with pytest.raises(clairvoyant.ExhaustedError, match="past the job's last epoch"):
            job.samples_of(2)


def test_plan_report_checks_sizes_and_ranks():
    with pytest.raises(clairvoyant.ConfigError, match="'sample_bytes': 2 sizes for 10 samples"):
        _native.plan_report(10, 1, 1, 2, 0, [0], [5, 6], [("memory", 100)])
    with pytest.raises(clairvoyant.ConfigError, match="'ranks': rank 3 is outside world size 2"):
        _native.plan_report(10, 2, 1, 2, 0, [0, 3], [5], [("memory", 100)])


def test_an_unfinished_iterator_of_an_earlier_epoch_raises():
    src = clairvoyant.Synthetic(SIZES)
    with clairvoyant.Job(src, batch_size=4, epochs=3) as job:
        first = job.epoch(0)
        next(first)
        second = job.batches(1)
        with pytest.raises(clairvoyant.ExhaustedError, match="epoch 0 was left unfinished when epoch 1 began"):
            next(first)
        assert sum(len(s) for s, _ in second) == 20
        # An iterator run to its end keeps stopping after the next epoch begins.
        third = job.epoch(2)
        assert list(second) == []
        assert sum(1 for _ in third) == 20


def test_a_failed_begin_leaves_the_current_iterator_usable():
    with clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=2) as job:
        it = job.epoch(1)
        next(it)
        with pytest.raises(clairvoyant.ExhaustedError, match="already consumed"):
            job.epoch(0)
        assert sum(1 for _ in it) == 19


def test_iterators_of_a_closed_job_raise_cancelled():
    job = clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=2)
    it = job.epoch(0)
    next(it)
    stats_before = job.stats()
    job.close()
    with pytest.raises(clairvoyant.CancelledError, match="closed during epoch 0"):
        next(it)
    with pytest.raises(clairvoyant.CancelledError, match="the job is closed"):
        job.epoch(1)
    with pytest.raises(clairvoyant.CancelledError, match="the job is closed"):
        job.samples_of(1)
    assert job.stats()[0]["samples"] >= stats_before[0]["samples"]
    job.close()  # idempotent


def _listing(dirs) -> set:
    return {os.path.join(d, f) for d in dirs for f in os.listdir(d)}


def _run_and_close(hold_a_batch: bool):
    """Files that a job created next to its shared segments and that remain after close()."""
    dirs = {"/dev/shm"}
    before = _listing(dirs)
    job = clairvoyant.Job(clairvoyant.Synthetic(SIZES), batch_size=4, epochs=2)
    # The staging ring has no name in a directory: it is opened through this process's descriptor.
    segments = [p for p in job.segments if p and not p.startswith("/proc/")]
    dirs |= {os.path.dirname(p) for p in segments}
    it = job.batches(0)
    held = next(it)
    if not hold_a_batch:
        del held
    # This job's files share its cache key (other processes may use the directory meanwhile).
    keys = {os.path.basename(p).split(".")[0] for p in segments}
    created = {p for p in _listing(dirs) - before if os.path.basename(p).split(".")[0] in keys}
    assert set(segments) <= created, "the job's shared files exist while it runs"
    job.close()  # `job` and `it` are still referenced
    left = sorted(p for p in created if os.path.lexists(p) and not os.path.isdir(p))
    return left, it


def test_close_removes_the_jobs_shared_memory_at_once():
    left, it = _run_and_close(hold_a_batch=False)
    assert not left, f"left after close(): {left}"
    with pytest.raises(clairvoyant.CancelledError):
        next(it)


def test_close_removes_the_jobs_shared_memory_while_a_batch_is_held():
    left, _ = _run_and_close(hold_a_batch=True)
    assert not left, f"left after close(): {left}"
