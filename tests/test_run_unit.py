"""`clairvoyant run`'s launcher logic without starting anything: nodes and run ids from each
launcher's variables, order files, access counts, the stats line and who prints it, the
sampler hook's notices."""

from __future__ import annotations

import os
import time

import numpy as np

import pytest

from clairvoyant import _native
from clairvoyant._agent import access_counts, read_order_file, relative
from clairvoyant._run import format_stats, nodes_of, reports_stats, run_id_of


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, (1, 0)),
        ({"SLURM_NNODES": "4", "SLURM_NODEID": "2"}, (4, 2)),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "3"}, (4, 3)),
        ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2", "RANK": "5"}, (4, 2)),
        ({"OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_RANK": "4"}, (2, 1)),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "3"}, (1, 0)),
        ({"CLAIRVOYANT_NODES": "3", "CLAIRVOYANT_NODE_RANK": "1", "SLURM_NNODES": "9"}, (3, 1)),
    ],
)
def test_nodes_come_from_the_launchers_variables(env, want):
    assert nodes_of(env) == want


def test_explicit_nodes_win_and_a_bad_index_is_an_error():
    assert nodes_of({"SLURM_NNODES": "4", "SLURM_NODEID": "1"}, 2, 1) == (2, 1)
    with pytest.raises(_native.ConfigError, match="outside the job's 2 nodes"):
        nodes_of({"CLAIRVOYANT_NODES": "2", "CLAIRVOYANT_NODE_RANK": "2"})


def test_run_id_precedence():
    assert run_id_of({}) == ""
    assert run_id_of({"TORCHELASTIC_RUN_ID": "none"}) == ""
    assert run_id_of({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "77"}) == "77"
    assert run_id_of({"CLAIRVOYANT_RUN_ID": "mine", "SLURM_JOB_ID": "77"}) == "mine"


def test_relative_paths_stay_inside_the_root(tmp_path):
    root = str(tmp_path)
    assert relative(f"{root}/a/b.jpg", root) == "a/b.jpg"
    assert relative("a/./c/../b.jpg", root) == "a/b.jpg"
    assert relative(f"{root}/../x", root) is None
    assert relative(root, root) is None


def test_order_files_and_access_counts(tmp_path):
    order = tmp_path / "order.txt"
    order.write_text("b\na\n\n# epoch 1\nc\nb\n")
    epochs = read_order_file(str(order), str(tmp_path), {"a": 0, "b": 1, "c": 2})
    assert [list(e) for e in epochs] == [[1, 0], [2, 1]]
    counts, first = access_counts(epochs, 4)
    assert counts.tolist() == [1, 2, 1, 0]
    assert first[1] == 0 and first[0] == 1 and first[2] == (1 << 32) and first[3] == np.iinfo(np.uint64).max
    # Absolute or relative, spelled as listed or not: the same ids; outside the root: an error.
    order.write_text(f"{tmp_path}/b\n./a\n{tmp_path}/c/../a\n\nc\n{tmp_path}//c\n")
    assert [list(e) for e in read_order_file(str(order), str(tmp_path), {"a": 0, "b": 1, "c": 2})] == [[1, 0, 0], [2, 2]]
    order.write_text(f"a\n{tmp_path}/../x\n")
    with pytest.raises(_native.ConfigError, match="line 2"):
        read_order_file(str(order), str(tmp_path), {"a": 0})
    order.write_text("\n\n")
    with pytest.raises(_native.ConfigError, match="names no files"):
        read_order_file(str(order), str(tmp_path), {})


def test_the_stats_line_shows_each_source_since_the_last():
    prev = {"reads": {"cached_reads": 1, "cached_bytes": 10}, "pfs_bytes": 5, "agent_cpu_s": 0.5}
    now = {
        "reads": {"cached_reads": 4, "cached_bytes": 3_000_010, "inline_reads": 2, "inline_bytes": 2_000_000, "direct_reads": 1},
        "pfs_bytes": 1_000_005,
        "agent_cpu_s": 1.25,
    }
    line = format_stats(now, prev, 12.0)
    assert "node cache 3 reads (3.0 MB)" in line and "peers 2 (2.0 MB)" in line
    assert "file system 1 direct" in line and "+ 1.0 MB by the agent" in line and "agent CPU 0.75 s" in line


@pytest.mark.parametrize(
    "env, prints",
    [
        ({}, True),
        ({"LOCAL_RANK": "0", "RANK": "4"}, True),
        ({"LOCAL_RANK": "1", "RANK": "5"}, False),
        ({"SLURM_LOCALID": "3"}, False),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, True),
    ],
)
def test_one_launcher_per_node_prints_the_stats(env, prints):
    # torchrun starting one launcher per local rank: the node agent's figures once per node.
    assert reports_stats(env) is prints


def test_the_sampler_order_notice_says_what_the_order_leaves_out(tmp_path):
    from clairvoyant._sampler_hook import _coverage

    for d in ("train/a", "train/b", "val/a"):
        (tmp_path / d).mkdir(parents=True)
    files = {str(tmp_path / "train" / c / f"{i}.jpg") for c in "ab" for i in range(3)}
    note = _coverage(str(tmp_path), files, 9)
    assert "6 files, under train/, of the 9 files" in note, note
    assert "files outside it: 3 (val/), cached when first read" in note, note
    # Without the agent's count: the top-level entries the order leaves out.
    assert "val/ of the root are not in it" in _coverage(str(tmp_path), files, None)
    # The order covers the whole root.
    assert "outside" not in _coverage(str(tmp_path / "train"), files, 6)


def test_the_order_files_are_written_once_per_node(tmp_path):
    # The node's first rank writes them and leaves a mark; the others wait for the mark; a rank
    # whose first rank never comes writes them itself; a mark left by an earlier run stands.
    import threading

    from clairvoyant._sampler_hook import _orders_once

    pattern, writes = str(tmp_path / "order-k-node{node}.txt"), []

    def write(who):
        def run():
            time.sleep(0.05)  # the others are waiting meanwhile
            (tmp_path / "order-k-node0.txt").write_text("a\n")
            writes.append(who)
            return {who}

        return run

    got = {}
    others = [threading.Thread(target=lambda r=r: got.__setitem__(r, _orders_once(pattern, False, write(r)))) for r in (1, 2, 3)]
    for t in others:
        t.start()
    got[0] = _orders_once(pattern, True, write(0))
    for t in others:
        t.join()
    assert writes == [0] and got == {0: {0}, 1: None, 2: None, 3: None}
    assert (tmp_path / "order-k-nodewritten.txt").exists()
    # An earlier run's mark: nobody writes.
    assert _orders_once(pattern, True, write(9)) is None and writes == [0]
    # The first rank never comes: the waiting rank writes after its patience.
    alone = str(tmp_path / "order-j-node{node}.txt")
    assert _orders_once(alone, False, write(5), patience=0.2) == {5} and writes == [0, 5]
    assert not (tmp_path / "order-j-nodewritten.txt").exists()


def test_the_sampler_hook_says_an_iterable_dataset_has_no_order(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from clairvoyant import _sampler_hook

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    monkeypatch.setenv("CLAIRVOYANT_ROOT", "/nonexistent")
    monkeypatch.setenv("CLAIRVOYANT_AGENT", "/nonexistent/agent.sock")
    monkeypatch.delenv("CLAIRVOYANT_QUIET", raising=False)
    loader = torch.utils.data.dataloader.DataLoader(Stream(), batch_size=2)
    assert _sampler_hook.plan(loader) is False
    err = capsys.readouterr().err
    assert "Stream is an iterable-style dataset" in err and "hashed owners" in err


def test_a_launcher_starts_over_when_its_new_agent_folder_is_reclaimed_at_once(tmp_path, monkeypatch):
    # Another launcher on the node may reclaim a folder made a moment ago (nobody holds its lock
    # yet): the check of the folder then finds it gone. The launcher starts over instead of failing.
    from clairvoyant import _cluster, _run

    real = _run._short_dir
    calls = []

    def racing(key):
        calls.append(key)
        if len(calls) == 1:
            d = os.path.join(_cluster._user_runtime_dir(), f"agent-{key}")
            os.mkdir(d, 0o700)
            os.rmdir(d)  # reclaimed by the other launcher between its creation and its check
            return _cluster._private_dir(d, create=False)
        return real(key)

    class Client:
        def __init__(self, socket):
            self.socket = socket

        def attach(self):
            pass

    monkeypatch.setattr(_run, "_short_dir", racing)
    monkeypatch.setattr(_native, "AgentClient", Client)
    agent = _run.Agent(str(tmp_path), env={})
    assert len(calls) == 2 and os.path.isdir(agent.dir) and agent.client.socket == agent.socket
