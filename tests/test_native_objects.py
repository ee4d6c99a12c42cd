"""Results cross the native boundary as Python objects (dicts and lists, not JSON text), and
orders and per-node counts go in as numpy arrays read in place (lists still work), checked with
errors that name the argument.

``data/plan_reports.json`` holds plan reports as the native module gave them when they were JSON
text (``json.loads`` of it, the time taken left out): the objects must hold exactly that."""

import json
from pathlib import Path

import numpy as np
import pytest

import clairvoyant
from clairvoyant import _native

REPORTS = json.loads((Path(__file__).parent / "data" / "plan_reports.json").read_text())


@pytest.mark.parametrize("case", REPORTS, ids=lambda c: f"{c['function']}-{c['args'][0]}")
def test_plan_reports_are_the_documents_the_json_text_held(case):
    args = list(case["args"])
    args[7] = [tuple(c) for c in args[7]]
    report = getattr(_native, case["function"])(*args)
    assert type(report) is dict
    assert isinstance(report.pop("seconds"), float)
    assert report == case["report"]
    # The same keys in the same order, and numbers of the same types (ints stay ints).
    assert json.dumps(report) == json.dumps(case["report"])


def test_plan_report_takes_numpy_arrays_for_ranks_and_sizes():
    sizes = [10 + k % 7 for k in range(40)]
    want = _native.plan_report(40, 4, 2, 2, 3, [0, 1], sizes, [("memory", 150)])
    got = _native.plan_report(40, 4, 2, 2, 3, np.array([0, 1], dtype=np.uint32), np.array(sizes, dtype=np.int64), [("memory", 150)])
    want.pop("seconds"), got.pop("seconds")
    assert got == want


ORDERS = [[5, 3, 0, 7, 1, 2, 6, 4], [0, 1, 2, 3, 4, 5, 6, 7], [7, 7, 6, 6, 5, 5, 4, 4]]


@pytest.mark.parametrize(
    "orders",
    [
        [np.array(o, dtype=np.uint32) for o in ORDERS],
        [np.array(o, dtype=np.int64) for o in ORDERS],
        [np.array(o, dtype=np.uint64) for o in ORDERS],
        [np.array(o, dtype=np.int16) for o in ORDERS],
        [np.array(o, dtype=">i8") for o in ORDERS],  # another byte order
        np.array(ORDERS, dtype=np.uint32),  # one row per epoch
        np.array(ORDERS, dtype=np.int64)[:, ::-1][:, ::-1],  # a strided view
        [ORDERS[0], np.array(ORDERS[1]), tuple(ORDERS[2])],
    ],
    ids=["uint32", "int64", "uint64", "int16", "big-endian", "2d", "strided", "mixed"],
)
def test_orders_as_arrays_give_the_streams_of_lists(orders):
    for rank in range(2):
        want = clairvoyant.access_stream_from_order(8, ORDERS, 2, rank, 2)
        got = clairvoyant.access_stream_from_order(8, orders, 2, rank, 2)
        assert [s.tolist() for s in got] == [s.tolist() for s in want]


def _consume(engine, epochs: int, batch: int) -> list:
    """Every epoch's samples as (bytes, label) in the order the engine hands them out."""
    out = []
    for e in range(epochs):
        engine.begin_epoch(e)
        n = len(engine.epoch_samples(e))
        while n:
            views, labels = engine.next_batch(min(batch, n))
            out.append([(bytes(v), int(k)) for v, k in zip(views, labels)])
            n -= len(views)
    return out


def _engine(orders, run):
    src = _native.synthetic_source([16 + k for k in range(8)], list(range(100, 108)))
    return _native.Engine(src, 2, len(ORDERS), 0, False, 0, 1, [0], run, None, orders)


def test_an_engine_on_array_orders_behaves_as_on_list_orders():
    lists = _engine(ORDERS, "orders-lists")
    try:
        want_samples = [lists.epoch_samples(e).tolist() for e in range(3)]
        want = _consume(lists, 3, 2)
    finally:
        lists.close()
    for i, orders in enumerate([[np.array(o, dtype=np.uint32) for o in ORDERS], np.array(ORDERS, dtype=np.int64)]):
        engine = _engine(orders, f"orders-arrays-{i}")
        try:
            assert [engine.epoch_samples(e).tolist() for e in range(3)] == want_samples == ORDERS
            assert _consume(engine, 3, 2) == want
        finally:
            engine.close()


def test_a_job_on_array_orders_reads_what_it_reads_on_lists():
    src = clairvoyant.Synthetic([32] * 8)
    got = {}
    for name, order in [("lists", ORDERS), ("arrays", [np.array(o, dtype=np.uint32) for o in ORDERS])]:
        with clairvoyant.Job(src, batch_size=3, order=order) as job:
            got[name] = [(job.samples_of(e).tolist(), [[bytes(s) for s in samples] for samples, _ in job.batches(e)]) for e in range(3)]
    assert got["arrays"] == got["lists"]


@pytest.mark.parametrize(
    "bad, cls, match",
    [
        ([np.array([0, 1, -3], dtype=np.int64)], clairvoyant.ConfigError, r"'orders\[0\]\[2\]': must be in 0\.\.=4294967295, got -3"),
        ([np.array([0]), np.array([2**32], dtype=np.uint64)], clairvoyant.ConfigError, r"'orders\[1\]\[0\]'.*got 4294967296"),
        ([np.array([0.0, 1.0])], clairvoyant.ArgumentTypeError, r"'orders\[0\]' must be an array of integers, not of dtype float64"),
        ([np.array([True, False])], clairvoyant.ArgumentTypeError, r"'orders\[0\]'.*dtype bool"),
        (np.zeros((1, 2, 2), dtype=np.uint32), clairvoyant.ConfigError, r"'orders\[0\]': must be a 1-D array.*2-D"),
        (np.array([1, 2], dtype=np.uint32), clairvoyant.ArgumentTypeError, r"'orders\[0\]' must be a sequence of integers"),
        ("0123", clairvoyant.ArgumentTypeError, r"'orders' must be a sequence of sequences of sample ids, not str"),
        ([[0, -1]], clairvoyant.ConfigError, r"'orders\[0\]\[1\]'"),
        ([[0, 1.5]], clairvoyant.ArgumentTypeError, r"'orders\[0\]\[1\]' must be an integer, not float"),
    ],
)
def test_bad_orders_are_errors_of_ours_naming_the_argument(bad, cls, match):
    with pytest.raises(cls, match=match) as info:
        clairvoyant.access_stream_from_order(8, bad, 1, 0, 1)
    assert isinstance(info.value, clairvoyant.ClairvoyantError)
    with pytest.raises(cls, match=match):
        _engine(bad, "bad-orders")


def test_bad_sizes_array_names_sample_bytes():
    with pytest.raises(clairvoyant.ConfigError, match=r"'sample_bytes\[1\]'.*got -5"):
        _native.plan_report(10, 1, 1, 2, 0, [0], np.array([5, -5]), [("memory", 100)])
    with pytest.raises(clairvoyant.ArgumentTypeError, match=r"'ranks' must be an array of integers"):
        _native.plan_report(10, 1, 1, 2, 0, np.array([0.0]), [5], [("memory", 100)])


# -- a node agent's per-node counts ---------------------------------------------------------------

SIZES = [40 + k for k in range(8)]
COUNTS = [3, 0, 1, 2, 5, 1, 0, 4]
FIRST = [2, 2**64 - 1, 7, 1, 0, 3, 2**64 - 1, 5]


def _agent_engine(counts, run):
    src = _native.synthetic_source(SIZES, None)
    return _native.Engine(src, 1, 1, 0, True, 0, 1, [0], run, None, None, 0, None, {"prefill": False, "counts": counts})


def test_agent_counts_as_arrays_place_as_lists_do():
    placed = []
    for i, counts in enumerate(
        [
            [(COUNTS, FIRST)],
            [(np.array(COUNTS, dtype=np.uint32), np.array(FIRST, dtype=np.uint64))],
            [[np.array(COUNTS, dtype=np.int64), np.array(FIRST, dtype=np.uint64)]],
        ]
    ):
        engine = _agent_engine(counts, f"agent-counts-{i}")
        try:
            placed.append(engine.placement())
        finally:
            engine.close()
    assert placed[1] == placed[0] and placed[2] == placed[0]
    assert sum(n for _, n, _ in placed[0]) > 0


@pytest.mark.parametrize(
    "counts, cls, match",
    [
        ([(np.array([1, -1] + [0] * 6), FIRST)], clairvoyant.ConfigError, r"'agent\.counts\[0\]\.counts\[1\]'.*got -1"),
        ([(COUNTS, np.array([0] * 7 + [-2], dtype=np.int64))], clairvoyant.ConfigError, r"'agent\.counts\[0\]\.first_need\[7\]'"),
        (
            [(np.array(COUNTS, dtype=np.float32), FIRST)],
            clairvoyant.ArgumentTypeError,
            r"'agent\.counts\[0\]\.counts' must be an array of integers",
        ),
        ([(COUNTS,)], clairvoyant.ArgumentTypeError, r"'agent\.counts\[0\]': expected a \(counts, first_need\) pair"),
        (5, clairvoyant.ArgumentTypeError, r"'agent\.counts': expected a sequence of \(counts, first_need\) pairs, not int"),
        ([(COUNTS[:7], FIRST)], clairvoyant.ConfigError, r"'agent\.counts'"),
    ],
)
def test_bad_agent_counts_name_the_field(counts, cls, match):
    with pytest.raises(cls, match=match):
        _agent_engine(counts, "agent-bad-counts")


# -- a node agent's statistics ----------------------------------------------------------------------


def test_agent_statistics_are_dicts(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x" * 10)
    sock = str(tmp_path / "agent.sock")
    server = _native.AgentServer(None, sock, str(tmp_path), ["a", "b"], str(tmp_path / "dir"))
    try:
        mine = server.stats()
        client = _native.AgentClient(sock)
        try:
            theirs = client.stats()
        finally:
            client.close()
    finally:
        server.close()
    for s in (mine, theirs):
        assert type(s) is dict
        assert s["files"] == 2 and s["lookups"] == 0 and s["placed_files"] == 0
        assert set(s["reads"]) == set(_native.AGENT_COUNTERS)
        assert all(type(v) is int for k, v in s.items() if k not in ("reads", "agent_cpu_s"))
        assert isinstance(s["agent_cpu_s"], float)
    assert list(mine) == list(theirs)  # keys in the agent's order
    assert list(mine)[:3] == ["files", "attached", "lookups"]


def test_the_stubs_say_the_reports_are_dicts_and_take_the_native_parameters():
    import ast
    import inspect

    stub = ast.parse((Path(_native.__file__).parent / "_native.pyi").read_text())
    defs = {n.name: n for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for name in ("plan_report", "cluster_plan_report", "access_stream_from_order"):
        fn = defs[name]
        assert [a.arg for a in fn.args.args] == list(inspect.signature(getattr(_native, name)).parameters), name
    for name in ("plan_report", "cluster_plan_report"):
        assert ast.unparse(defs[name].returns).startswith("dict"), name
    for cls in ("AgentServer", "AgentClient"):
        stats = next(n for n in defs[cls].body if isinstance(n, ast.FunctionDef) and n.name == "stats")
        assert ast.unparse(stats.returns).startswith("dict"), cls
    engine_init = next(n for n in defs["Engine"].body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    orders = next(a for a in engine_init.args.args if a.arg == "orders")
    assert "_Orders" in ast.unparse(orders.annotation)
