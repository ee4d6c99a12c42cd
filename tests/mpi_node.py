"""Emulated nodes under ``mpirun`` on one machine: ``python mpi_node.py NODES SHM SCRIPT ARGS...``
places this rank as a real mpirun over NODES hosts with the ranks in blocks would, then runs
SCRIPT with ARGS as ``__main__``. Each block of ranks gets its own node id and shared-memory
directory under SHM, Open MPI's local rank and local size become those of its block, and peer
servers listen on loopback."""

from __future__ import annotations

import os
import runpy
import sys


def emulate_node(nodes: int, shm: str) -> None:
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    world = int(os.environ["OMPI_COMM_WORLD_SIZE"])
    if nodes < 1 or world % nodes:
        raise SystemExit(f"{world} ranks cannot be split into {nodes} equal nodes")
    per_node = world // nodes
    node = rank // per_node
    os.environ["OMPI_COMM_WORLD_LOCAL_RANK"] = str(rank % per_node)
    os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"] = str(per_node)
    os.environ["CLAIRVOYANT_NODE_ID"] = f"node{node}"
    os.environ["CLAIRVOYANT_SHM_DIR"] = os.path.join(shm, f"node{node}")
    os.environ["CLAIRVOYANT_LISTEN"] = "127.0.0.1"
    os.makedirs(os.environ["CLAIRVOYANT_SHM_DIR"], exist_ok=True)


if __name__ == "__main__":
    emulate_node(int(sys.argv[1]), sys.argv[2])
    script = sys.argv[3]
    sys.argv = sys.argv[3:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
