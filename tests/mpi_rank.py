"""One rank of a Job started by ``mpirun`` (tests/test_launchers.py): rank and world size come
from Open MPI's variables, the nodes meet and share the job secret through MPI (mpi4py), and
no torch launcher variable, shared directory or secret is set.

``--nodes N`` emulates N nodes on this machine (tests/mpi_node.py).

argv: LIST CONFIG OUT EPOCHS --nodes N --shm DIR. Writes OUT/rank<r>.json: the sample ids of
every epoch, the Job's per-epoch statistics, its peer statistics and the backend chosen."""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

from mpi_node import emulate_node


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("list")
    p.add_argument("config")
    p.add_argument("out")
    p.add_argument("epochs", type=int)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--shm", required=True)
    a = p.parse_args()
    emulate_node(a.nodes, a.shm)

    import clairvoyant
    from clairvoyant import _cluster, _env

    where = _env.detect()
    backend = _cluster.choose_backend(where.rank, where.world_size)
    src = clairvoyant.FileList(a.list)
    crc = {}
    for k, path in enumerate(src.paths):
        with open(path, "rb") as f:
            crc[zlib.crc32(f.read())] = k
    job = clairvoyant.Job(src, batch_size=8, epochs=a.epochs, seed=5, config=a.config)
    seen, bad = [], 0
    for e in range(a.epochs):
        ids = []
        for views, _labels in job.batches(e):
            for v in views:
                k = crc.get(zlib.crc32(bytes(v)))
                bad += k is None
                ids.append(k)
        seen.append(ids)
    result = {
        "rank": where.rank,
        "world": where.world_size,
        "local_ranks": where.local_ranks,
        "backend": backend,
        "seen": seen,
        "bad": bad,
        "stats": job.stats(),
        "peers": job.peer_stats(),
    }
    # Every node is done before any peer server stops.
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
    job.close()
    with open(os.path.join(a.out, f"rank{where.rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
