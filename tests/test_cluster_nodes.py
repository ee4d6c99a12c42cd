"""Several emulated nodes (separate caches, one dataset): the nodes meet through a shared
directory, every rank gets every one of its samples with the right bytes, the cluster reads the
dataset once when the sum of the nodes' memory holds it, a rank takes most of its samples from
other nodes, and a node killed or stopped mid-run leaves the others training. On loopback
everywhere; in network namespaces (private /dev/shm, a rate-limited link per node) as root."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest

import clairvoyant
from benches.emulation import memory_config, node_env, run_ranks

sys.path.insert(0, os.path.dirname(__file__))  # the emulated-node harness (tests/netns.py)

N_FILES = 480
EPOCHS = 3


def _write_dataset(root) -> tuple[list, int]:
    rng = np.random.default_rng(3)
    paths, total = [], 0
    for k in range(N_FILES):
        data = rng.integers(0, 256, size=int(rng.integers(800, 4000)), dtype=np.uint8).tobytes()
        p = os.path.join(root, f"s{k:04d}.bin")
        with open(p, "wb") as f:
            f.write(data)
        paths.append(p)
        total += len(data)
    return paths, total


def _config(path, memory: int, staging: str = "4 MiB") -> str:
    return memory_config(path, memory, staging)


def _rank(ctx, list_file, config, expect_crc):
    src = clairvoyant.FileList(list_file)
    job = clairvoyant.Job(src, batch_size=8, epochs=EPOCHS, seed=9, config=config)
    assert job.peer_stats() is not None, "a multi-node launch turns peers on"
    seen = []
    for e in range(EPOCHS):
        ids = []
        for views, _labels in job.batches(e):
            for v in views:
                data = bytes(v)
                crc = zlib.crc32(data)
                assert crc in expect_crc, f"rank {ctx.rank} epoch {e}: bytes of no sample"
                ids.append(expect_crc[crc])
        seen.append(ids)
        ctx.sync()
    stats = job.stats()
    peers = job.peer_stats()
    engine = job._open_engine()
    plan = {"origin": engine.plan_origin(), "placement": engine.placement()}
    ctx.sync()  # every node is done before any server stops
    job.close()
    return {"seen": seen, "stats": stats, "peers": peers, "plan": plan}


def _run(tmp_path, nodes, per_node, fraction):
    paths, total = _write_dataset(tmp_path)
    list_file = tmp_path / "list.txt"
    list_file.write_text("".join(f"{p}\t{k % 5}\n" for k, p in enumerate(paths)))
    crc = {}
    for k, p in enumerate(paths):
        with open(p, "rb") as f:
            crc[zlib.crc32(f.read())] = k
    config = _config(tmp_path / "system.toml", int(total * fraction))
    cache = tmp_path / "index-cache"
    out = run_ranks(
        _rank,
        nodes * per_node,
        args=(str(list_file), config, crc),
        nodes=nodes,
        env={"CLAIRVOYANT_CACHE_DIR": str(cache)},
        timeout=float(os.environ.get("CV_TEST_TIMEOUT", 240)),
    )
    return out, total


def _check_exactly_once(out, world):
    for e in range(EPOCHS):
        everything = sorted(k for r in range(world) for k in out[r]["seen"][e])
        assert everything == list(range(N_FILES)), f"epoch {e}: every sample once across the ranks"


def _check_read_once(out, total, nodes, peer_share):
    """The cluster read the dataset once, at least `peer_share` of the samples came from other
    nodes, and each node ran one server; returns the servers' figures and the peer samples."""
    _check_exactly_once(out, len(out))
    fs = sum(s["pfs_bytes_read"] for r in out for s in r["stats"])
    peer = sum(s["sources"]["peer"]["samples"] for r in out for s in r["stats"])
    samples = sum(s["samples"] for r in out for s in r["stats"])
    print(f"{nodes} nodes: file-system bytes {fs} of {total} ({fs / total:.3f}x); from peers {peer} of {samples} samples")
    assert fs <= total * 1.02, f"the cluster read {fs / total:.3f}x the dataset"
    assert peer >= samples * peer_share, "most samples of a rank are on other nodes"
    servers = [r["peers"]["server"] for r in out if "server" in r["peers"]]
    assert len(servers) == nodes, "one server per node"
    return servers, peer


def test_four_nodes_read_the_dataset_once(tmp_path):
    out, total = _run(tmp_path, nodes=4, per_node=2, fraction=0.30)
    servers, peer = _check_read_once(out, total, 4, 1 / 3)
    assert sum(s["served"] for s in servers) >= peer


def test_sixteen_nodes_read_the_dataset_once(tmp_path):
    # 16 nodes at 10 % of the dataset each (160 % in all): every sample covered by one node,
    # the file system read once over the run, most samples from other nodes.
    out, total = _run(tmp_path, nodes=16, per_node=1, fraction=0.10)
    _check_read_once(out, total, 16, 1 / 2)


def test_one_plan_per_node(tmp_path):
    # 2 nodes x 3 ranks: on each node one rank computes the node's plan, the others read it,
    # and all three hold the same placement.
    out, total = _run(tmp_path, nodes=2, per_node=3, fraction=0.6)
    _check_exactly_once(out, 6)
    for node in range(2):
        ranks = out[node * 3 : node * 3 + 3]
        origins = sorted(r["plan"]["origin"] for r in ranks)
        assert origins == ["computed", "shared", "shared"], origins
        assert all(r["plan"]["placement"] == ranks[0]["plan"]["placement"] for r in ranks)
    fs = sum(s["pfs_bytes_read"] for r in out for s in r["stats"])
    assert fs <= total * 1.02, f"the cluster read {fs / total:.3f}x the dataset"


def test_two_nodes_below_the_dataset_read_the_minimum(tmp_path):
    out, total = _run(tmp_path, nodes=2, per_node=1, fraction=0.25)
    _check_exactly_once(out, 2)
    fs = sum(s["pfs_bytes_read"] for r in out for s in r["stats"])
    # Half the dataset cached in all: S + (E-1)(S-C) is the least the storage can deliver.
    minimum = total + (EPOCHS - 1) * (total - 0.5 * total)
    print(f"file-system bytes {fs}, minimum {minimum:.0f} ({fs / minimum:.3f}x)")
    assert fs <= minimum * 1.05


def _spawn_nodes(
    tmp_path, nodes: int, epochs: int, step: float, fraction: float, staging: str = "4 MiB", harness=None, together: bool = False
):
    """One rank per node, each its own process (as a launcher would start them): on loopback
    with a shared-memory directory per node, or in ``harness``'s network namespaces. With
    ``together``, ranks stop only once all have ended (as a training's ranks do); without, a rank
    that ends early stops serving the others, which then read its samples themselves."""
    import subprocess
    import sys

    paths, total = _write_dataset(tmp_path)
    list_file = tmp_path / "list.txt"
    list_file.write_text("".join(f"{p}\t{k % 5}\n" for k, p in enumerate(paths)))
    config = _config(tmp_path / "system.toml", int(total * fraction), staging)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    procs, outs = [], []
    script = os.path.join(os.path.dirname(__file__), "cluster_rank.py")
    for i in range(nodes):
        out = tmp_path / f"rank{i}.jsonl"
        shm = tmp_path / f"node{i}"
        shm.mkdir(mode=0o700)
        run = f"nodes-{os.getpid()}-{tmp_path.name}"
        env = {
            **os.environ,
            "RANK": str(i),
            "WORLD_SIZE": str(nodes),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "CLAIRVOYANT_CACHE_DIR": str(tmp_path / "index-cache"),
            **node_env(i, shm, shared, run, "127.0.0.1" if harness is None else harness.addresses[i]),
        }
        argv = [sys.executable, script, str(list_file), config, str(out), str(epochs), str(step)]
        if together:
            argv.append("together")
        if harness is None:
            procs.append(subprocess.Popen(argv, env=env))
        else:
            # A node's own /dev/shm (its mount namespace) holds its cache.
            del env["CLAIRVOYANT_SHM_DIR"]
            procs.append(harness.popen(i, argv, env=env))
        outs.append(out)
    return procs, outs, total


def _lines(path) -> list:
    import json

    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def test_a_node_killed_mid_run_leaves_the_others_training(tmp_path):
    import signal
    import time

    # A small staging buffer: a rank cannot have fetched its later epochs before the kill.
    procs, outs, _ = _spawn_nodes(tmp_path, nodes=3, epochs=4, step=0.02, fraction=0.4, staging="48 KiB")
    try:
        # Kill node 1 with SIGKILL once it finished its first epoch (so, during its second).
        deadline = time.monotonic() + 120
        while not _lines(outs[1]) and time.monotonic() < deadline:
            assert procs[1].poll() is None, "node 1 exited early"
            time.sleep(0.02)
        assert _lines(outs[1]), "node 1 made no progress"
        procs[1].send_signal(signal.SIGKILL)
        for i in (0, 2):
            assert procs[i].wait(timeout=180) == 0, f"node {i} failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i in (0, 2):
        epochs = _lines(outs[i])
        assert [x["epoch"] for x in epochs] == [0, 1, 2, 3]
        assert all(x["ok"] for x in epochs), f"node {i}: every sample once per epoch, right bytes"
        fell_back = sum(x["fallbacks"] + x["misses"] for x in epochs)
        print(f"node {i}: " + ", ".join(f"epoch {x['epoch']} {x['seconds']:.2f} s stall {x['stall']:.2f} s" for x in epochs) + f"; fell back {fell_back}")
        assert fell_back > 0, "samples node 1 served are read around it"


def test_a_stalled_node_is_detected_and_read_around(tmp_path):
    import signal
    import time

    procs, outs, _ = _spawn_nodes(tmp_path, nodes=3, epochs=3, step=0.02, fraction=0.4, staging="48 KiB")
    try:
        deadline = time.monotonic() + 120
        while not _lines(outs[1]) and time.monotonic() < deadline:
            time.sleep(0.02)
        procs[1].send_signal(signal.SIGSTOP)  # alive, connected, silent
        for i in (0, 2):
            assert procs[i].wait(timeout=180) == 0, f"node {i} failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    for i in (0, 2):
        epochs = _lines(outs[i])
        assert [x["epoch"] for x in epochs] == [0, 1, 2]
        assert all(x["ok"] for x in epochs)
        stall = sum(x["stall"] for x in epochs[1:])
        print(f"node {i}: stall after the stop {stall:.2f} s; fell back {sum(x['fallbacks'] for x in epochs)}")
        # Detected once per peer (the client's I/O time-out), not once per sample.
        assert stall < 30, f"node {i} stalled {stall:.1f} s"


def test_a_node_stopped_for_seconds_costs_the_other_one_deadline(tmp_path):
    """Node 1 is stopped (SIGSTOP) mid-run for a few seconds (``CV_STOP_SECONDS``; 0: no
    stop, the baseline), then continued: node 0 fetches its samples from node 1 until then, so
    it waits on it once, up to the peer deadline (the file system's time for the sample, at
    least 0.5 s), and reads the file system around it afterwards. Both nodes get every sample
    of every epoch once, in order, with the right bytes. The stall is printed, not asserted."""
    import signal

    stop_seconds = float(os.environ.get("CV_STOP_SECONDS", 4))
    procs, outs, _ = _spawn_nodes(tmp_path, nodes=2, epochs=4, step=0.03, fraction=0.45, staging="48 KiB")
    try:
        deadline = time.monotonic() + 120
        # Both nodes have finished epoch 0 (every node's primary samples are cached): node 0 is
        # fetching node 1's samples from it.
        while (not _lines(outs[0]) or not _lines(outs[1])) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a node exited early"
            time.sleep(0.01)
        assert _lines(outs[0]) and _lines(outs[1]), "the nodes made no progress"
        if stop_seconds > 0:
            procs[1].send_signal(signal.SIGSTOP)
            time.sleep(stop_seconds)
            procs[1].send_signal(signal.SIGCONT)
        for i, p in enumerate(procs):
            assert p.wait(timeout=240) == 0, f"node {i} failed"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    for i in (0, 1):
        epochs = _lines(outs[i])
        assert [x["epoch"] for x in epochs] == [0, 1, 2, 3]
        assert all(x["ok"] for x in epochs), f"node {i}: every sample once per epoch, in order, right bytes"
    epochs = _lines(outs[0])
    stall = sum(x["stall"] for x in epochs[1:])
    print(
        f"node 1 stopped {stop_seconds:g} s: node 0's stall in epochs 1-3 {stall:.3f} s ("
        + ", ".join(f"{x['stall']:.3f}" for x in epochs[1:])
        + f"); peer samples {[x['peer'] for x in epochs]}, fell back {[x['fallbacks'] for x in epochs]}, "
        f"down events {epochs[-1]['down_events']}"
    )
    assert sum(x["peer"] for x in epochs) > 0, "node 0 fetched from node 1"


def _netns_or_skip():
    from netns import netns_unavailable

    why = netns_unavailable()
    if why:
        pytest.skip(why)


def test_nodes_in_network_namespaces(tmp_path):
    """Three nodes, each its own network namespace (1 Gbit/s links) and /dev/shm: they share
    nothing but the dataset's directory; the cluster reads it once and every sample arrives."""
    _netns_or_skip()
    from netns import Nodes

    with Nodes(3, rate="1gbit", delay="0.5ms") as harness:
        procs, outs, total = _spawn_nodes(tmp_path, nodes=3, epochs=3, step=0.0, fraction=0.4, harness=harness, together=True)
        for i, p in enumerate(procs):
            assert p.wait(timeout=180) == 0, f"node {i} failed"
    for i in range(3):
        epochs = _lines(outs[i])
        assert [x["epoch"] for x in epochs] == [0, 1, 2] and all(x["ok"] for x in epochs), f"node {i}"
        assert sum(x["peer"] for x in epochs) > 0, f"node {i} took samples from other nodes"
    fs = sum(x["fs_bytes"] for i in range(3) for x in _lines(outs[i]))
    misses = [(x["misses"], x["fallbacks"], x["down_events"]) for i in range(3) for x in _lines(outs[i])]
    print(f"file-system bytes {fs} of {total} ({fs / total:.3f}x); peer misses and fall-backs per rank and epoch {misses}")
    assert fs <= total * 1.02


def test_a_node_killed_in_its_namespace(tmp_path):
    _netns_or_skip()
    from netns import Nodes

    with Nodes(3, rate="1gbit") as harness:
        procs, outs, _ = _spawn_nodes(tmp_path, nodes=3, epochs=4, step=0.02, fraction=0.4, staging="48 KiB", harness=harness)
        deadline = time.monotonic() + 120
        while not _lines(outs[1]) and time.monotonic() < deadline:
            time.sleep(0.02)
        harness.kill(1)
        for i in (0, 2):
            assert procs[i].wait(timeout=180) == 0, f"node {i} failed"
    for i in (0, 2):
        epochs = _lines(outs[i])
        assert [x["epoch"] for x in epochs] == [0, 1, 2, 3] and all(x["ok"] for x in epochs), f"node {i}"


def _dies_before_the_barrier(ctx):
    if ctx.rank == 1:
        os._exit(3)  # as a rank killed with -9: nothing reported
    ctx.sync()
    return ctx.rank


def _gives_up_quickly(rank_fn, error, match: str, **kw) -> None:
    """Two ranks of ``rank_fn`` end in ``error`` (matching ``match``) within 20 s."""
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        run_ranks(rank_fn, 2, **kw)
    took = time.monotonic() - t0
    assert took < 20, f"run_ranks took {took:.1f} s to give up"


def test_a_rank_that_dies_without_reporting_stops_the_others_at_once():
    # Rank 0 waited at the barrier: it is let go, not left to the 30 s join and a terminate.
    _gives_up_quickly(_dies_before_the_barrier, RuntimeError, "rank 1 exited with code 3 without reporting", timeout=120)


def _exits_quietly(ctx):
    if ctx.rank == 1:
        os._exit(0)  # a library that ends the process: exit code 0, nothing reported
    ctx.sync()
    return ctx.rank


def test_a_rank_that_exits_cleanly_without_reporting_is_not_waited_for():
    _gives_up_quickly(_exits_quietly, RuntimeError, "rank 1 exited with code 0 without reporting")


def _hangs(ctx):
    if ctx.rank == 1:
        time.sleep(3600)  # as a rank deadlocked in its training loop
    ctx.sync()
    return ctx.rank


def test_ranks_that_hang_are_stopped_at_the_timeout_not_waited_for():
    # The hung rank is terminated after a short grace, not joined for 30 s per rank.
    _gives_up_quickly(_hangs, TimeoutError, "did not finish within 3", timeout=3)


def test_ranks_that_die_while_starting_are_reported_not_hung_on(tmp_path):
    # A script without a __main__ guard: each spawned rank re-runs it while starting, fails
    # there (a process may not start others while it starts) and exits before it has read what
    # it was to run. With arguments larger than a pipe holds, the parent must not block.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from benches.emulation import run_ranks\n"
        "from tests.test_cluster_nodes import _exits_quietly\n"
        "run_ranks(_exits_quietly, 2, args=('x' * 1_000_000,), timeout=60)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert "without reporting" in r.stderr, r.stderr[-2000:]
    assert took < 60, f"took {took:.1f} s"
