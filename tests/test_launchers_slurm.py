"""Slurm for real: a one-machine Slurm of 2 emulated nodes (munged, slurmctld and a slurmd per
node from Debian's slurm-wlm and munge, configured in a temporary directory and stopped
afterwards, as root: tests/slurm_cluster.py) runs a Job, the PyTorch drop-in and ``clairvoyant
run`` under ``srun -n 4`` (2 nodes x 2 ranks), and the example batch script under ``sbatch``.
Rank, world size and local ranks come from Slurm's variables; the nodes meet in the shared
directory. Without root or the packages the tests skip with the reason (on CI they fail)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benches.emulation import memory_config
from launchers import missing
from slurm_cluster import Slurm, unavailable
from test_examples import EXAMPLES, check_logs, example_env, write_imagenet

TIMEOUT = float(os.environ.get("CV_TEST_TIMEOUT", 600))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    why = unavailable()
    if why:
        missing(f"no one-machine Slurm: {why}")
    cluster = Slurm(tmp_path_factory.mktemp("slurm") / "cluster")
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.stop()
        missing(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory) -> Path:
    return write_imagenet(tmp_path_factory.mktemp("slurm-data") / "imagenet")


def slurm_env(slurm, tmp_path, **extra) -> dict:
    shared = tmp_path / "rendezvous"
    shared.mkdir(mode=0o700)
    return example_env(CLAIRVOYANT_SHARED_DIR=str(shared), **slurm.env, **extra)


def run(slurm, argv, env, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, argv))} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}\n{slurm.logs()}"
    )
    return proc


def test_srun_job_on_two_nodes_reads_once(slurm, tmp_path):
    rng = np.random.default_rng(12)
    paths, total = [], 0
    for k in range(160):
        data = rng.integers(0, 256, size=int(rng.integers(800, 3000)), dtype=np.uint8).tobytes()
        (tmp_path / f"s{k:03d}.bin").write_bytes(data)
        paths.append(tmp_path / f"s{k:03d}.bin")
        total += len(data)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\t{k % 3}\n" for k, p in enumerate(paths)))
    config = memory_config(tmp_path / "system.toml", int(total * 0.6))
    rank_script = Path(__file__).with_name("launcher_rank.py")
    out = tmp_path / "out"
    out.mkdir()
    env = slurm_env(slurm, tmp_path)
    run(slurm, ["srun", "-N", "2", "-n", "4", sys.executable, rank_script, listing, config, out, "2"], env, tmp_path)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"], res["local_ranks"]) == (r, 4, [r - r % 2, r - r % 2 + 1]), "from Slurm's variables"
        assert res["backend"] == "file", f"rank {r} met the others through {res['backend']}"
        assert res["bad"] == 0, f"rank {r}: bytes of no sample"
    for e in range(2):
        everything = sorted(k for res in ranks for k in res["seen"][e])
        assert everything == list(range(160)), f"epoch {e}: every sample once across the ranks"
    fs = sum(s["pfs_bytes_read"] for res in ranks for s in res["stats"])
    peer = sum(s["sources"]["peer"]["samples"] for res in ranks for s in res["stats"])
    print(f"file-system bytes {fs} of {total}; samples from peers {peer}")
    assert fs <= total * 1.02, f"the cluster read {fs / total:.3f}x the dataset"
    servers = [res["peers"]["server"] for res in ranks if "server" in res["peers"]]
    assert len(servers) == 2 and all(s["served"] > 0 for s in servers), "each node's server served the other node"
    left = sorted(os.listdir(tmp_path / "rendezvous"))
    assert left == [], f"the run left {left} in the shared directory"


def test_srun_runs_the_dropin(slurm, imagenet, tmp_path):
    log = tmp_path / "log"
    env = slurm_env(slurm, tmp_path)
    out = run(slurm, ["srun", "-N", "2", "-n", "4", sys.executable, EXAMPLES / "train_imagenet.py", "--data", imagenet, "--epochs", "2",
                      "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log], env, tmp_path)  # fmt: skip
    check_logs(log, 4, 2, "SLURM_PROCID")
    assert "not cached" not in out.stderr, out.stderr[-2000:]


def test_srun_runs_clairvoyant_run(slurm, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(6)
    for k in range(8):  # the dataset the agents share; the task reads one of its files
        (data / f"f{k}.bin").write_bytes(rng.integers(0, 256, size=20_000 + k, dtype=np.uint8).tobytes())
    payload = (data / "f3.bin").read_bytes()
    clairvoyant = Path(sys.executable).with_name("clairvoyant")
    env = slurm_env(slurm, tmp_path)
    argv = [
        "srun",
        "-N",
        "2",
        "-n",
        "4",
        "-o",
        tmp_path / "task%t.out",
        "-e",
        tmp_path / "task%t.err",
        clairvoyant,
        "run",
        "--dataset",
        data,
    ]
    proc = subprocess.run(
        [str(a) for a in [*argv, "--", "cat", data / "f3.bin"]], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT
    )
    errors = "".join(
        f"--- task {t}\n" + (tmp_path / f"task{t}.err").read_text(errors="replace")[-1500:]
        for t in range(4)
        if (tmp_path / f"task{t}.err").exists()
    )
    assert proc.returncode == 0, f"srun ... clairvoyant run -- cat failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n{errors}"
    for t in range(4):
        got = (tmp_path / f"task{t}.out").read_bytes()
        assert got == payload, f"task {t} wrote {len(got)} bytes, not the file's {len(payload)}:\n{errors}"


def test_sbatch_runs_the_example_script(slurm, imagenet, tmp_path):
    log = tmp_path / "log"
    env = slurm_env(slurm, tmp_path, DATA=str(imagenet), EXAMPLES=str(EXAMPLES))
    # The script asks for 2 nodes x 4 tasks; the emulated nodes have 2 CPUs: 2 tasks each.
    run(slurm, ["sbatch", "--wait", "--nodes", "2", "--ntasks-per-node", "2", "-o", tmp_path / "job.out", EXAMPLES / "slurm_train.sbatch",
                "--epochs", "2", "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log], env, tmp_path)  # fmt: skip
    output = (tmp_path / "job.out").read_text()
    assert output.count("epoch 1: 6 images") == 4, output[-3000:]
    check_logs(log, 4, 2, "SLURM_PROCID")
