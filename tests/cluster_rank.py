"""One rank of an emulated multi-node job, run as its own process by the cluster tests: it
consumes every epoch of a Job over a file list, checks every sample's bytes against the file's
CRC, optionally sleeps per batch (a training step), and appends one JSON line per epoch to its
output file (flushed, so a test can watch progress and kill a node mid-run). Given "together"
as a sixth argument, ranks leave together, as ranks of a training do (their collectives keep them
within a step): each meets the others (clairvoyant's own rendezvous) before it stops serving them."""

from __future__ import annotations

import json
import sys
import time
import zlib

import clairvoyant


def main(list_file: str, config: str, out: str, epochs: int, step_seconds: float, together: bool = False) -> int:
    src = clairvoyant.FileList(list_file)
    crc = {}
    for k, p in enumerate(src.paths):
        with open(p, "rb") as f:
            crc[zlib.crc32(f.read())] = k
    job = clairvoyant.Job(src, batch_size=4, epochs=epochs, seed=21, config=config)
    with open(out, "a") as log:
        for e in range(epochs):
            ids, bad = [], 0
            start = time.perf_counter()
            for views, _labels in job.batches(e):
                for v in views:
                    k = crc.get(zlib.crc32(bytes(v)))
                    if k is None:
                        bad += 1
                    ids.append(k)
                time.sleep(step_seconds)
            expected = [int(k) for k in job.samples_of(e)]
            stats = job.stats()[e]
            log.write(
                json.dumps(
                    {
                        "epoch": e,
                        "ok": ids == expected and bad == 0,
                        "samples": len(ids),
                        "seconds": time.perf_counter() - start,
                        "stall": stats["stall_seconds"],
                        "peer": stats["sources"]["peer"]["samples"],
                        "fallbacks": stats["peer_fallbacks"],
                        "misses": stats["peer_misses"],
                        "fs_bytes": stats["pfs_bytes_read"],
                        "down_events": (job.peer_stats() or {}).get("client", {}).get("down_events"),
                    }
                )
                + "\n"
            )
            log.flush()
    if together:
        from clairvoyant import _cluster, _env

        where = _env.detect()
        _cluster.allgather(b"done", rank=where.rank, world_size=where.world_size, run_id=where.run_id)
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6:7] == ["together"]))
