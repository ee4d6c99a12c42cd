"""Transparent mode with a predicted order that covers only part of the dataset, and names
that are not UTF-8: what the order leaves out (an ImageNet layout's ``val/`` beside ``train/``)
is cached when first read, as without an order, so the file system reads the dataset once;
a file whose name is not UTF-8 is cached like any other; an iterable-style dataset under
``--sampler-order`` gets its notice; under torchrun the node's figures and notices come once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _preload_or_skip():
    try:
        from clairvoyant import _preload

        return _preload.preload_library()
    except Exception as e:  # noqa: BLE001 - any reason the library is unusable is a skip reason
        pytest.skip(f"the interposed library is not available: {e}")


def _env(tmp_path, extra=None) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "CLAIRVOYANT_QUIET"):
        env.pop(k, None)
    env["CLAIRVOYANT_SHM_DIR"] = str(tmp_path / "shm")
    env["CLAIRVOYANT_CACHE_DIR"] = str(tmp_path / "cache")
    env["CLAIRVOYANT_AGENT_LINGER"] = "20"
    env["CLAIRVOYANT_AGENT_LOG"] = str(tmp_path / "agent-logs")  # an agent's folder goes with it
    os.makedirs(env["CLAIRVOYANT_SHM_DIR"], exist_ok=True)
    env.update(extra or {})
    return env


def _run(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clairvoyant", "run", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _agent_log(logs, root) -> str:
    """The logs of the agents that served ``root`` (kept in ``CLAIRVOYANT_AGENT_LOG``)."""
    import glob

    text = ""
    for p in sorted(glob.glob(os.path.join(logs, "*.log"))):
        log = open(p, errors="replace").read()
        if f"files under {root}," in log:
            text += log
    return text


def _write(root, rel: bytes, rng) -> int:
    path = os.path.join(os.fsencode(root), rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = rng.integers(0, 256, size=int(rng.integers(2000, 9000)), dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


# An unmodified training script of the ImageNet layout: a DistributedSampler over train/, and
# all of val/ read after every epoch. Writes every batch's checksums and val's per epoch.
TRAIN_AND_VAL = """
import json, os, sys, zlib
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import DatasetFolder

root, epochs, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def load(path):
    with open(path, "rb") as f:
        return zlib.crc32(f.read())

train = DatasetFolder(os.path.join(root, "train"), loader=load, extensions=(".bin",))
sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=3)
loader = DataLoader(train, batch_size=8, sampler=sampler, num_workers=2)
got = []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    batches = [[x.tolist(), y.tolist()] for x, y in loader]
    val = {}
    for d, _, names in os.walk(os.path.join(root, "val")):
        for n in sorted(names):
            val[os.path.relpath(os.path.join(d, n), root)] = load(os.path.join(d, n))
    got.append({"train": batches, "val": val})
with open(out, "w") as f:
    json.dump(got, f)
with open(out + ".modules", "w") as f:
    json.dump(sorted(m for m in sys.modules if m.startswith("clairvoyant")), f)
"""


def test_files_outside_the_sampler_order_are_cached_on_first_read(tmp_path):
    _preload_or_skip()
    pytest.importorskip("torchvision")
    rng = np.random.default_rng(11)
    root = str(tmp_path / "imagenet")
    total, n_train, n_val = 0, 0, 0
    for k in range(48):
        total += _write(root, f"train/c{k % 3}/t{k:03d}.bin".encode(), rng)
        n_train += 1
    for k in range(24):
        total += _write(root, f"val/c{k % 3}/v{k:03d}.bin".encode(), rng)
        n_val += 1
    # Names that are not UTF-8 travel through the order files too.
    total += _write(root, b"train/c0/caf\xe9.bin", rng) + _write(root, b"val/c1/\xff.bin", rng)
    n_train, n_val = n_train + 1, n_val + 1
    program = tmp_path / "train_and_val.py"
    program.write_text(TRAIN_AND_VAL)
    plain = tmp_path / "plain.json"
    subprocess.run([sys.executable, str(program), root, "2", str(plain)], check=True, env=_env(tmp_path), timeout=300)
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    env = _env(tmp_path, {"CLAIRVOYANT_EPOCHS": "2"})
    r = _run(
        ["--dataset", root, "--sampler-order", "--stats-json", str(stats), "--",
         sys.executable, str(program), root, "2", str(out)],
        env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # The program's bytes are the file system's, train and val, both epochs.
    assert json.loads(out.read_text()) == json.loads(plain.read_text())
    s = json.loads(stats.read_text())
    reads = s["reads"]
    # Every file read from the file system exactly once (by the agent): 1.00x the dataset.
    assert s["pfs_bytes"] == total and s["pfs_files"] == n_train + n_val, s
    assert reads["direct_reads"] == 0 and reads["direct_bytes"] == 0, s
    assert reads["cached_bytes"] + reads["inline_bytes"] == 2 * total, s
    # What was predicted, once: the order's files, the others cached when first read.
    note = (
        f"the order covers {n_train} files, under train/, of the {n_train + n_val} files of the dataset; "
        f"files outside it: {n_val} (val/), cached when first read"
    )
    assert r.stderr.count(note) == 1, r.stderr
    log = _agent_log(env["CLAIRVOYANT_AGENT_LOG"], root)
    assert "placing by the order in" in log and f"files outside it: {n_val}, placed by hashed owners" in log, log
    # The hook read the order without importing the drop-in (its import was most of the
    # first iter()'s cost under the hook).
    modules = json.loads((tmp_path / "out.json.modules").read_text())
    assert "clairvoyant._samplers" in modules and "clairvoyant.torch" not in modules, modules


# Reads every file under the root (names as bytes) for some epochs; checksums per epoch.
BYTES_READER = """
import json, os, sys, zlib
root, epochs = os.fsencode(sys.argv[1]), int(sys.argv[2])
got = []
for _ in range(epochs):
    seen = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                seen[os.path.relpath(p, root).hex()] = zlib.crc32(f.read())
    got.append(seen)
print(json.dumps(got, sort_keys=True))
"""


def test_a_name_that_is_not_utf8_is_cached(tmp_path):
    _preload_or_skip()
    rng = np.random.default_rng(12)
    root = str(tmp_path / "data")
    names = [b"caf\xe9.bin", b"dir-\xfe/x\xff.bin", b"plain/a.bin", b"plain/b.bin"]
    total = sum(_write(root, n, rng) for n in names)
    reader = tmp_path / "reader.py"
    reader.write_text(BYTES_READER)
    plain = subprocess.run([sys.executable, str(reader), root, "2"], capture_output=True, text=True, check=True).stdout
    stats = tmp_path / "stats.json"
    r = _run(["--dataset", root, "--stats-json", str(stats), "--", sys.executable, str(reader), root, "2"], _env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain, "bytes differ from the file system"
    got = json.loads(r.stdout)
    assert all(n.hex() in epoch for n in names for epoch in got)
    assert "not UTF-8" not in r.stderr, r.stderr
    s = json.loads(stats.read_text())
    reads = s["reads"]
    # Read from the file system once each (epoch 0, by the program, handed to the node cache:
    # the names travel as bytes); epoch 1 all from the cache.
    assert s["program_fills_kept"] == len(names) and s["program_fill_bytes_kept"] == total, s
    assert s["pfs_files"] == 0 and reads["direct_bytes"] == total, s
    assert reads["cached_bytes"] == total, s
    assert s["cached_files"] == len(names), s


ITERABLE = """
import os, sys, zlib
import torch
from torch.utils.data import DataLoader, IterableDataset

root = sys.argv[1]

class Files(IterableDataset):
    def __iter__(self):
        for d, _, names in sorted(os.walk(root)):
            for n in sorted(names):
                with open(os.path.join(d, n), "rb") as f:
                    yield zlib.crc32(f.read())

print(sum(int(x) for b in DataLoader(Files(), batch_size=4) for x in b))
"""


def test_an_iterable_dataset_under_the_sampler_order_gets_a_notice(tmp_path):
    _preload_or_skip()
    pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    root = str(tmp_path / "data")
    for k in range(12):
        _write(root, f"c{k % 2}/f{k}.bin".encode(), rng)
    program = tmp_path / "iterable.py"
    program.write_text(ITERABLE)
    plain = subprocess.run([sys.executable, str(program), root], capture_output=True, text=True, check=True, env=_env(tmp_path)).stdout
    env = _env(tmp_path)
    r = _run(["--dataset", root, "--sampler-order", "--", sys.executable, str(program), root], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain
    assert r.stderr.count("Files is an iterable-style dataset: its order cannot be known ahead") == 1, r.stderr
    assert "hashed owners (no order came before the first read)" in _agent_log(env["CLAIRVOYANT_AGENT_LOG"], root)


def test_a_torchrun_launch_prints_the_nodes_figures_and_notices_once(tmp_path):
    _preload_or_skip()
    pytest.importorskip("torchvision")
    pytest.importorskip("torch.distributed.run")
    from benches.emulation import make_imagefolder

    root = str(tmp_path / "images")
    make_imagefolder(root, 2, 12, size_range=(72, 100))
    script = os.path.join(HERE, "transparent_torch.py")
    env = _env(tmp_path, {"CLAIRVOYANT_EPOCHS": "1"})
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python", "clairvoyant", "run", "--dataset", root,
         "--sampler-order", "--stats", "--stats-interval", "0.2", "--", "sh", "-c",
         f"{sys.executable} {script} {root} --epochs 1 --workers 0 --rank $RANK --world-size 2 --out {tmp_path}/out$RANK.json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("clairvoyant run: total:") == 1, r.stderr
    assert r.stderr.count("the node agent places by the sampler's order") == 1, r.stderr
