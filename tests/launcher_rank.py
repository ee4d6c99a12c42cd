"""One rank of a Job started by a launcher (tests/test_launchers_mpi.py, tests/test_launchers_slurm.py):
rank, world size and local ranks come from the launcher's variables (Open MPI's, Slurm's), the
nodes meet and share the job secret the launcher's way (MPI through mpi4py, a shared directory
under Slurm), and no torch launcher variable is set. Before its Job closes (and its node's peer
server with it) every rank waits for all the others, as the end of a training loop does.

``--nodes N`` emulates N nodes on this machine under mpirun (tests/mpi_node.py).

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
    p.add_argument("--shm", default=None)
    a = p.parse_args()
    if a.nodes > 1:
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
    }
    # Every node is done before any peer server stops.
    _cluster.allgather(b"done", rank=where.rank, world_size=where.world_size, run_id=where.run_id)
    # Taken once every node is done: a node that ends first has not served the others yet.
    result["peers"] = job.peer_stats()
    job.close()
    with open(os.path.join(a.out, f"rank{where.rank}.json"), "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
