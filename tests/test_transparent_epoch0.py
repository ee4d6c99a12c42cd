"""Epoch 0 under `clairvoyant run` on the FUSE emulation of a shared file system: a miss costs one
read of the file system. Many threads (and processes) of an unmodified program open the same and
distinct files at once; the emulation's per-file counters must show every file opened and read
exactly once over two epochs, and every thread must read the file system's bytes. With the order
unknown the one access is the first opener's own read (it claims the file in the shared
directory, reads it as it would directly and hands the bytes to the agent; other opens of the
file wait for that copy). With a known order the agent's prefill is that one access, and what it
fills is published in the shared directory."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest

from benches import emulation as emu

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "transparent_threads.py")
N_FILES = 80

REASON = emu.fuse_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"FUSE emulation unavailable: {REASON}")


@pytest.fixture
def mounted(tmp_path):
    try:
        from clairvoyant import _preload

        _preload.preload_library()
    except Exception as e:  # noqa: BLE001 - any reason the library is unusable is a skip reason
        pytest.skip(f"the interposed library is not available: {e}")
    rng = np.random.default_rng(11)
    back = tmp_path / "back"
    crcs, sizes = {}, {}
    for k in range(N_FILES):
        rel = f"c{k % 5}/f{k:03d}.bin"
        data = rng.integers(0, 256, size=int(rng.integers(3000, 40_000)), dtype=np.uint8).tobytes()
        (back / rel).parent.mkdir(parents=True, exist_ok=True)
        (back / rel).write_bytes(data)
        crcs[rel], sizes[rel] = zlib.crc32(data), len(data)
    # Opens take a while, so that concurrent opens of one file overlap the agent's fill.
    with emu.FuseMount(back, tmp_path / "mnt", open_latency_ms=5, bandwidth=2000) as m:
        yield m, crcs, sizes


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["CLAIRVOYANT_SHM_DIR"] = str(tmp_path / "shm")
    env["CLAIRVOYANT_CACHE_DIR"] = str(tmp_path / "cache")
    env["CLAIRVOYANT_AGENT_LINGER"] = "20"
    os.makedirs(env["CLAIRVOYANT_SHM_DIR"], exist_ok=True)
    return env


def _run(tmp_path, mnt, extra, epochs, processes=1, env=None):
    """Run ``processes`` copies of the threaded reader at once under one ``clairvoyant run``."""
    outs, stats = [tmp_path / f"out{i}.json" for i in range(processes)], tmp_path / "stats.json"
    program = [sys.executable, PROGRAM, str(mnt), "--epochs", str(epochs), "--threads", "8", "--out"]
    script = " & ".join(" ".join([*program, str(o)]) for o in outs) + "; wait"
    r = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", str(mnt), *extra, "--stats-json", str(stats), "--",
         "sh", "-c", script],
        env={**_env(tmp_path), **(env or {})}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = [json.loads(o.read_text()) for o in outs]
    return (got[0] if processes == 1 else got), json.loads(stats.read_text())


def _check(got, crcs, epochs):
    assert got["agree"], "threads of one program read different bytes"
    assert len(got["epochs"]) == epochs
    for e, seen in enumerate(got["epochs"]):
        assert seen == crcs, f"epoch {e}: bytes differ from the file system"


def _per_file(fs, sizes):
    files = fs.stats()["files"]
    return {rel: (files.get(rel, {}).get("opens", 0), files.get(rel, {}).get("bytes", 0)) for rel in sizes}


def _program_filled(s, sizes):
    """Every file read once by a program (its claim) and kept by the node cache; none by the agent."""
    reads = s["reads"]
    assert reads["fallbacks"] == 0 and reads["corrupt"] == 0 and reads["stale"] == 0, s
    assert reads["fills"] == N_FILES and reads["fill_bytes"] == sum(sizes.values()), s
    assert s["program_fills"] == N_FILES and s["program_fills_kept"] == N_FILES, s
    assert s["pfs_files"] == 0 and s["cached_files"] == N_FILES, s
    # What the programs read from the file system: each file once (the claimer's reads).
    assert reads["direct_bytes"] == sum(sizes.values()), s


def test_order_unknown_every_file_is_opened_and_read_once_under_concurrent_opens(tmp_path, mounted):
    fs, crcs, sizes = mounted
    got, s = _run(tmp_path, fs.path, [], epochs=2)
    _check(got, crcs, 2)
    once = {rel: (1, n) for rel, n in sizes.items()}
    assert _per_file(fs, sizes) == once, "each file opened and read exactly once over both epochs"
    _program_filled(s, sizes)


@pytest.mark.parametrize("standin", ["auto", "0"])
def test_order_unknown_processes_opening_the_same_files_at_once_read_each_once(tmp_path, mounted, standin):
    """Three processes of 8 threads each open the same files in the same order at the same time:
    one claim per file across all of them; the others wait for its copy and never read it too.
    With stand-ins (auto: the FUSE root gets them) every other open is a stand-in: one open per
    file; without, every open is a real open of the file (3 x 8 x 2 per file) but its bytes are
    read from the file system once."""
    fs, crcs, sizes = mounted
    got, s = _run(tmp_path, fs.path, [], epochs=2, processes=3, env={"CLAIRVOYANT_STANDIN": standin})
    for g in got:
        _check(g, crcs, 2)
    opens = 1 if standin == "auto" else 3 * 8 * 2
    once = {rel: (opens, n) for rel, n in sizes.items()}
    assert _per_file(fs, sizes) == once, "each file's bytes read once by all processes over both epochs"
    _program_filled(s, sizes)
    if standin == "0":
        assert s["reads"]["standins"] == 0, s


def _agent_pid(shm, root) -> int | None:
    """The live agent serving ``root`` (its folder under ``shm``, or under the temporary
    directory when that path is too long for a socket)."""
    found = glob.glob(os.path.join(str(shm), "clairvoyant-*", "*", "agent.pid"))
    found += glob.glob(os.path.join(tempfile.gettempdir(), f"clairvoyant-{os.geteuid()}", "*", "agent.pid"))
    for p in found:
        try:
            pid = int(open(p).read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if os.fsencode(str(root)) in args and b"clairvoyant._agent" in args:
                return pid
        except (OSError, ValueError):
            pass
    return None


def test_the_agent_killed_while_programs_fill_leaves_them_reading_the_right_bytes(tmp_path, mounted):
    """Three processes of 8 threads fill the node cache (order unknown); the agent is killed -9
    once some files have been read. Claims in progress, waiters on them and later opens all end
    in the file system's bytes, and nothing hangs."""
    fs, crcs, sizes = mounted
    outs = [tmp_path / f"out{i}.json" for i in range(3)]
    # Killed once some files have been read by the programs.
    returncode, err = _kill_agent_during(tmp_path, fs, [], outs, epochs=3, opened=N_FILES // 4)
    assert returncode == 0, err
    for o in outs:
        _check(json.loads(o.read_text()), crcs, 3)


def _kill_agent_during(tmp_path, fs, extra, outs, epochs, opened, after=0.0):
    """Run the threaded reader (one process per ``outs``) under ``clairvoyant run`` with
    ``extra`` on mount ``fs``; kill the agent -9 ``after`` seconds after the file system has seen
    ``opened`` opens. Returns the run's exit code and its stderr."""
    env = _env(tmp_path)
    program = [sys.executable, PROGRAM, str(fs.path), "--epochs", str(epochs), "--threads", "8", "--out"]
    script = " & ".join(" ".join([*program, str(o)]) for o in outs) + "; wait"
    proc = subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", str(fs.path), *extra, "--", "sh", "-c", script],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        seen = sum(f.get("opens", 0) for f in fs.stats()["files"].values())
        pid = _agent_pid(env["CLAIRVOYANT_SHM_DIR"], fs.path)
        if pid is not None and seen >= opened:
            time.sleep(after)
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    else:
        proc.kill()
        proc.communicate()
        pytest.fail("the agent never started reading, or the programs finished before it could be killed")
    _, err = proc.communicate(timeout=180)
    return proc.returncode, err


def test_order_known_the_prefill_is_the_only_read_and_is_published(tmp_path, mounted):
    fs, crcs, sizes = mounted
    order = tmp_path / "order.txt"
    rels = sorted(sizes)
    with open(order, "w") as f:
        for e in range(2):
            random.Random(e).shuffle(rels)
            f.write("\n".join(rels) + "\n\n")
    got, s = _run(tmp_path, fs.path, ["--order-file", str(order)], epochs=2)
    _check(got, crcs, 2)
    once = {rel: (1, n) for rel, n in sizes.items()}
    assert _per_file(fs, sizes) == once, "each file opened and read exactly once over both epochs"
    assert s["pfs_files"] == N_FILES and s["cached_files"] == N_FILES, s
    assert s["reads"]["direct_bytes"] == 0, s


def test_order_known_an_open_of_a_file_being_filled_waits_in_the_directory(tmp_path, mounted):
    """The agent holds the claim of each file its prefill reads: an open of such a file waits on
    the claim and takes the entry once it is settled, without asking the agent. Opens take
    100 ms here, and the order's first epoch is the order of the program's first pair of
    threads, so their first opens find files the agent is reading."""
    _, crcs, sizes = mounted
    back = tmp_path / "back"
    rels = sorted(sizes)
    random.Random(0).shuffle(rels)  # what transparent_threads.py's threads 0 and 1 read in epoch 0
    order = tmp_path / "order.txt"
    order.write_text("\n".join(rels) + "\n\n" + "\n".join(sorted(sizes)) + "\n")
    with emu.FuseMount(back, tmp_path / "slow", open_latency_ms=100, bandwidth=2000) as slow:
        got, s = _run(tmp_path, slow.path, ["--order-file", str(order)], epochs=2)
        _check(got, crcs, 2)
        once = {rel: (1, n) for rel, n in sizes.items()}
        assert _per_file(slow, sizes) == once, "each file opened and read exactly once over both epochs"
    reads = s["reads"]
    assert reads["direct_bytes"] == 0 and reads["fallbacks"] == 0 and reads["corrupt"] == 0, s
    assert reads["fill_waits"] >= 1, f"no open waited in the directory for the agent's fill: {s}"
    # An open that waited there asked the agent nothing: every open is one or the other, or found
    # the file published.
    assert reads["fill_waits"] + reads["lookups"] <= reads["opens"], s


def test_order_known_the_agent_killed_while_programs_wait_on_its_fills(tmp_path, mounted):
    """The agent is killed -9 while its prefill holds claims that programs' opens wait on (opens
    take 100 ms): the waiters notice it is gone and read the file system, and every thread gets
    the file system's bytes; nothing hangs."""
    _, crcs, sizes = mounted
    back = tmp_path / "back"
    rels = sorted(sizes)
    random.Random(0).shuffle(rels)  # the order of the programs' first two threads in epoch 0
    order = tmp_path / "order.txt"
    order.write_text("\n".join(rels) + "\n")
    outs = [tmp_path / "out0.json"]
    with emu.FuseMount(back, tmp_path / "slow", open_latency_ms=100, bandwidth=2000) as slow:
        # Killed while the prefill's first reads are in progress, programs waiting on them.
        extra = ["--order-file", str(order)]
        returncode, err = _kill_agent_during(tmp_path, slow, extra, outs, epochs=1, opened=1, after=0.05)
    assert returncode == 0, err
    for o in outs:
        _check(json.loads(o.read_text()), crcs, 1)
