"""The examples in examples/, each in its one-machine form: the ImageNet-style training script
under ``mpirun`` (the drop-in with rank and world size from Open MPI's variables, no torch
launcher variable), under torchrun, and under ``clairvoyant run`` (transparent mode). Every
run delivers every image once per epoch across its ranks (one image per class: a label names
its image). The Slurm batch script and ``srun`` are run in tests/test_launchers_slurm.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launchers import clean_env, need_command, need_module

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
IMAGES = 24
TIMEOUT = float(os.environ.get("CV_TEST_TIMEOUT", 600))


def write_imagenet(root: Path, images: int = IMAGES) -> Path:
    """ImageFolder layout, one image per class."""
    from PIL import Image

    rng = np.random.default_rng(8)
    for c in range(images):
        d = root / "train" / f"n{c:05d}"
        d.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, size=(40, 48, 3), dtype=np.uint8)).save(d / "img.jpg")
    return root


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory) -> Path:
    return write_imagenet(tmp_path_factory.mktemp("examples") / "imagenet")


def example_env(**extra) -> dict:
    bindir = os.path.dirname(sys.executable)
    return clean_env(PYTHON=sys.executable, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), **extra)


def run_example(argv: list, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


def check_logs(log: Path, world: int, epochs: int, launcher: str | None, images: int = IMAGES) -> list:
    ranks = [json.loads((log / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"], res["launcher"]) == (r, world, launcher), res
    for e in range(epochs):
        everything = sorted(label for res in ranks for label in res["labels"][e])
        assert everything == list(range(images)), f"epoch {e}: every image once across the {world} ranks"
    return ranks


def test_mpirun_line_runs_the_dropin(imagenet, tmp_path):
    install = "./dev test installs Open MPI (apt-get install openmpi-bin libopenmpi-dev, as root) and mpi4py"
    need_command("mpirun", install=install)
    need_module("mpi4py.MPI", install=install)
    log = tmp_path / "log"
    env = example_env(DATA=str(imagenet), NODES="1", PER_NODE="4")
    out = run_example(
        [EXAMPLES / "mpirun_train.sh", "--epochs", "2", "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log],
        env,
        tmp_path,
    )
    check_logs(log, 4, 2, "OMPI_COMM_WORLD_RANK")
    assert "not cached" not in out.stderr, out.stderr[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_line(imagenet, tmp_path):
    log = tmp_path / "log"
    env = example_env(DATA=str(imagenet), NODES="1", PER_NODE="2", HEAD="127.0.0.1", PORT=str(_free_port()), JOB_ID="example")
    run_example(
        [EXAMPLES / "torchrun_train.sh", "--epochs", "2", "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log],
        env,
        tmp_path,
    )
    check_logs(log, 2, 2, "RANK")


def test_transparent_line(imagenet, tmp_path):
    log = tmp_path / "log"
    clairvoyant = Path(sys.executable).with_name("clairvoyant")
    env = example_env(DATA=str(imagenet), CLAIRVOYANT=str(clairvoyant))
    out = run_example(
        [EXAMPLES / "transparent_train.sh", "--epochs", "2", "--workers", "0", "--batch-size", "4", "--image-size", "32", "--record", log],
        env,
        tmp_path,
    )
    check_logs(log, 1, 2, None)
    assert "epoch 1: 24 images" in out.stdout
