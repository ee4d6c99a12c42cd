"""Open MPI for real: ``mpirun`` starts 4 ranks as 2 emulated nodes x 2 ranks. Rank and world
size come from Open MPI's variables, the nodes meet and share the job secret through MPI
(mpi4py), their peer servers serve each other, the file system is read once, and every sample
is delivered once per epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from benches.emulation import memory_config
from launchers import clean_env, need_command, need_module

HERE = os.path.dirname(os.path.abspath(__file__))
INSTALL = "./dev test installs Open MPI (apt-get install openmpi-bin libopenmpi-dev, as root) and mpi4py"
N_FILES = 240
EPOCHS = 2
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]


def need_mpi() -> None:
    need_command("mpirun", install=INSTALL)
    need_module("mpi4py.MPI", install=INSTALL)


def mpirun(n: int, argv: list, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [*MPIRUN, "-n", str(n), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return proc


def test_mpirun_two_nodes_read_once(tmp_path):
    need_mpi()
    rng = np.random.default_rng(11)
    paths, total = [], 0
    for k in range(N_FILES):
        data = rng.integers(0, 256, size=int(rng.integers(800, 3000)), dtype=np.uint8).tobytes()
        p = tmp_path / f"s{k:04d}.bin"
        p.write_bytes(data)
        paths.append(str(p))
        total += len(data)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\t{k % 3}\n" for k, p in enumerate(paths)))
    # Each node holds 60 % of the dataset: together they hold all of it.
    config = memory_config(tmp_path / "system.toml", int(total * 0.6))
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, os.path.join(HERE, "launcher_rank.py"), str(listing), config, str(out), str(EPOCHS)]
    mpirun(4, [*argv, "--nodes", "2", "--shm", str(tmp_path / "shm")], clean_env())

    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    for r, res in enumerate(ranks):
        assert (res["rank"], res["world"]) == (r, 4), "rank and world size from Open MPI's variables"
        assert res["backend"] == "mpi", f"rank {r} met the others through {res['backend']}"
        assert res["local_ranks"] == [r - r % 2, r - r % 2 + 1]
        assert res["bad"] == 0, f"rank {r}: bytes of no sample"
        assert res["peers"] is not None, "two nodes turn peers on"
    for e in range(EPOCHS):
        everything = sorted(k for res in ranks for k in res["seen"][e])
        assert everything == list(range(N_FILES)), f"epoch {e}: every sample once across the ranks"
    fs = sum(s["pfs_bytes_read"] for res in ranks for s in res["stats"])
    peer = sum(s["sources"]["peer"]["samples"] for res in ranks for s in res["stats"])
    print(f"file-system bytes {fs} of {total}; samples from peers {peer}")
    assert fs <= total * 1.02, f"the cluster read {fs / total:.3f}x the dataset"
    servers = [res["peers"]["server"] for res in ranks if "server" in res["peers"]]
    assert len(servers) == 2, "one server per node"
    assert all(s["served"] > 0 for s in servers), "each node's server served the other node"
    assert peer > 0


def test_mpirun_dropin_on_two_nodes(tmp_path):
    """The example training script with the drop-in, under mpirun as 2 emulated nodes x 2 ranks:
    no torch launcher variable, no shared directory, no secret; rank, world size and local ranks
    from Open MPI's variables, the nodes meet through MPI."""
    need_mpi()
    from test_examples import EXAMPLES, check_logs, write_imagenet

    data = write_imagenet(tmp_path / "imagenet")
    log = tmp_path / "log"
    script = [
        str(EXAMPLES / "train_imagenet.py"),
        "--data",
        str(data),
        "--epochs",
        "2",
        "--workers",
        "0",
        "--batch-size",
        "4",
        "--image-size",
        "32",
    ]
    proc = mpirun(
        4, [sys.executable, os.path.join(HERE, "mpi_node.py"), "2", str(tmp_path / "shm"), *script, "--record", str(log)], clean_env()
    )
    check_logs(log, 4, 2, "OMPI_COMM_WORLD_RANK")
    assert "not cached" not in proc.stderr, proc.stderr[-2000:]
