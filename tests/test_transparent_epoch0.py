"""Epoch 0 under `clairvoyant run` on the FUSE emulation of a shared file system: a miss costs one
read of the file system. Many threads of one unmodified program open the same and distinct files
at once; the emulation's per-file counters must show every file opened and read exactly once
(the agent's fill is the only access; the program's open waits for it and never opens the file
itself), and every thread must read the file system's bytes. With a known order the agent's
prefill is that one access, and what it fills is published in the shared directory."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
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


def _run(tmp_path, mnt, extra, epochs):
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    r = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", str(mnt), *extra, "--stats-json", str(stats), "--",
         sys.executable, PROGRAM, str(mnt), "--epochs", str(epochs), "--threads", "8", "--out", str(out)],
        env=_env(tmp_path), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), json.loads(stats.read_text())


def _check(got, crcs, epochs):
    assert got["agree"], "threads of one program read different bytes"
    assert len(got["epochs"]) == epochs
    for e, seen in enumerate(got["epochs"]):
        assert seen == crcs, f"epoch {e}: bytes differ from the file system"


def _per_file(fs, sizes):
    files = fs.stats()["files"]
    return {rel: (files.get(rel, {}).get("opens", 0), files.get(rel, {}).get("bytes", 0)) for rel in sizes}


def test_order_unknown_every_file_is_opened_and_read_once_under_concurrent_opens(tmp_path, mounted):
    fs, crcs, sizes = mounted
    got, s = _run(tmp_path, fs.path, [], epochs=2)
    _check(got, crcs, 2)
    once = {rel: (1, n) for rel, n in sizes.items()}
    assert _per_file(fs, sizes) == once, "each file opened and read exactly once over both epochs"
    reads = s["reads"]
    assert reads["direct_bytes"] == 0 and reads["fallbacks"] == 0 and reads["corrupt"] == 0, s
    assert s["pfs_files"] == N_FILES and s["cached_files"] == N_FILES, s


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
