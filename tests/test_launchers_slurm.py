"""Slurm for real: a one-machine Slurm (munged, slurmctld, slurmd from Debian's slurm-wlm and
munge, configured in a temporary directory and stopped afterwards, as root) runs the PyTorch
drop-in and ``clairvoyant run`` under ``srun -n 4``, and the example batch script under
``sbatch``. Rank and world size come from Slurm's variables; the ranks meet in the shared
directory. Without root or the packages the tests skip with the reason (on CI they fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def test_srun_runs_the_dropin(slurm, imagenet, tmp_path):
    log = tmp_path / "log"
    env = slurm_env(slurm, tmp_path)
    out = run(slurm, ["srun", "-n", "4", sys.executable, EXAMPLES / "train_imagenet.py", "--data", imagenet, "--epochs", "2",
                      "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log], env, tmp_path)  # fmt: skip
    check_logs(log, 4, 2, "SLURM_PROCID")
    assert "not cached" not in out.stderr, out.stderr[-2000:]


def test_srun_runs_clairvoyant_run(slurm, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    payload = np.random.default_rng(6).integers(0, 256, size=90_000, dtype=np.uint8).tobytes()
    (data / "f.bin").write_bytes(payload)
    clairvoyant = Path(sys.executable).with_name("clairvoyant")
    env = slurm_env(slurm, tmp_path)
    run(
        slurm,
        ["srun", "-n", "4", "-o", tmp_path / "task%t.out", clairvoyant, "run", "--dataset", data, "--", "cat", data / "f.bin"],
        env,
        tmp_path,
    )
    for t in range(4):
        assert (tmp_path / f"task{t}.out").read_bytes() == payload, f"task {t} read other bytes through clairvoyant run"


def test_sbatch_runs_the_example_script(slurm, imagenet, tmp_path):
    log = tmp_path / "log"
    env = slurm_env(slurm, tmp_path, DATA=str(imagenet), EXAMPLES=str(EXAMPLES))
    # The script asks for 2 nodes x 4 tasks; on one machine: 1 node x 4 tasks.
    run(slurm, ["sbatch", "--wait", "--nodes", "1", "--ntasks-per-node", "4", "-o", tmp_path / "job.out", EXAMPLES / "slurm_train.sbatch",
                "--epochs", "2", "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log], env, tmp_path)  # fmt: skip
    output = (tmp_path / "job.out").read_text()
    assert output.count("epoch 1: 6 images") == 4, output[-3000:]
    check_logs(log, 4, 2, "SLURM_PROCID")
