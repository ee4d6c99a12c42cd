"""Several emulated nodes on loopback (separate caches, one dataset): the nodes meet through a
shared directory, every rank gets every one of its samples with the right bytes, the cluster
reads the dataset once when the sum of the nodes' memory holds it, and a rank takes most of its
samples from other nodes. Runs everywhere (no root)."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

import clairvoyant
from clairvoyant._emulation import run_ranks

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


def _config(path, memory: int) -> str:
    with open(path, "w") as f:
        f.write(
            f"""
[staging]
capacity = "4 MiB"
threads = 2
[pfs]
read_mbps = 200.0
open_latency_ms = 0.5
[[class]]
name = "memory"
kind = "memory"
capacity = {memory}
threads = 1
read_mbps = 5000.0
write_mbps = 5000.0
"""
        )
    return str(path)


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
    ctx.sync()  # every node is done before any server stops
    job.close()
    return {"seen": seen, "stats": stats, "peers": peers}


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
        timeout=240,
    )
    return out, total


def _check_exactly_once(out, world):
    for e in range(EPOCHS):
        everything = sorted(k for r in range(world) for k in out[r]["seen"][e])
        assert everything == list(range(N_FILES)), f"epoch {e}: every sample once across the ranks"


def test_four_nodes_read_the_dataset_once(tmp_path):
    out, total = _run(tmp_path, nodes=4, per_node=2, fraction=0.30)
    _check_exactly_once(out, 8)
    fs = sum(s["pfs_bytes_read"] for r in out for s in r["stats"])
    peer = sum(s["sources"]["peer"]["samples"] for r in out for s in r["stats"])
    samples = sum(s["samples"] for r in out for s in r["stats"])
    print(f"file-system bytes {fs} of {total} ({fs / total:.3f}x); from peers {peer} of {samples} samples")
    assert fs <= total * 1.02, f"the cluster read {fs / total:.3f}x the dataset"
    assert peer >= samples // 3, "most samples of a rank are on other nodes"
    servers = [r["peers"]["server"] for r in out if "server" in r["peers"]]
    assert len(servers) == 4, "one server per node"
    assert sum(s["served"] for s in servers) >= peer


def test_two_nodes_below_the_dataset_read_the_minimum(tmp_path):
    out, total = _run(tmp_path, nodes=2, per_node=1, fraction=0.25)
    _check_exactly_once(out, 2)
    fs = sum(s["pfs_bytes_read"] for r in out for s in r["stats"])
    # Half the dataset cached in all: S + (E-1)(S-C) is the least the storage can deliver.
    minimum = total + (EPOCHS - 1) * (total - 0.5 * total)
    print(f"file-system bytes {fs}, minimum {minimum:.0f} ({fs / minimum:.3f}x)")
    assert fs <= minimum * 1.05
