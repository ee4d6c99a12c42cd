"""Many store ranks in one process, one thread each, every thread with its own TCPStore client
(as every rank of a job has): run by tests/test_cluster_rendezvous.py, several processes at once.

argv[1]: JSON {"port", "world", "ranks": [first, end), "size", "run", "timeout", "rounds" (default
1)}. Prints "ready" once every thread is connected; then per round starts on a line on stdin and
prints one JSON line: the ranks that got every payload right, the errors, and the slowest and
median rank's seconds.
"""

import datetime
import hashlib
import json
import sys
import threading
import time

from torch.distributed import TCPStore

from clairvoyant import _cluster

a = json.loads(sys.argv[1])
world, size = a["world"], a["size"]
first, end = a["ranks"]
local = threading.local()


def payload(rank: int) -> bytes:
    """Like the record each rank announces when nodes meet (8 ranks a node), padded with
    pseudo-random hex digits to at least ``size`` bytes."""
    node = rank // 8
    record = {
        "rank": rank,
        "node": f"gpu-{node:04d}/{hashlib.sha256(str(node).encode()).hexdigest()[:36]}/803",
        "local_ranks": list(range(node * 8, node * 8 + 8)),
        "address": f"10.1.{node // 256}.{node % 256}:{40000 + node}" if rank % 8 == 0 else "",
        "capacities": [["dram", 68719476736], ["ssd", 1099511627776]],
        "agree": "9f3c2a7d1e5b4c60",
    }
    text = json.dumps(record)
    pad = hashlib.sha256(f"pad{rank}".encode()).hexdigest() * (1 + size // 64)
    return (text + pad[: max(0, size - len(text))]).encode()


def thread_store(rank, timeout):
    return local.store, f"127.0.0.1:{a['port']}"


_cluster._store = thread_store
# Computed once: checking what a rank got is then one list comparison.
EXPECTED = [payload(r) for r in range(world)]
rounds = a.get("rounds", 1)
connected = threading.Barrier(end - first + 1)
go = [threading.Event() for _ in range(rounds)]
done = threading.Barrier(end - first + 1)
results = [{} for _ in range(rounds)]


def rank_main(rank: int) -> None:
    try:
        local.store = TCPStore("127.0.0.1", a["port"], is_master=False, timeout=datetime.timedelta(seconds=a["timeout"]))
    finally:
        connected.wait()
    for n in range(rounds):
        go[n].wait()
        t0 = time.monotonic()
        try:
            got = _cluster._allgather_store(payload(rank), rank, world, a["run"], n, a["timeout"])
            took = time.monotonic() - t0
            results[n][rank] = (got == EXPECTED, None, took)
        except Exception as e:  # reported, not raised: the parent names the ranks
            results[n][rank] = (False, f"{type(e).__name__}: {e}", time.monotonic() - t0)
        done.wait()


threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(first, end)]
for t in threads:
    t.start()
connected.wait()
print("ready", flush=True)
for n in range(rounds):
    sys.stdin.readline()
    go[n].set()
    done.wait()
    times = sorted(s for _, _, s in results[n].values())
    print(
        json.dumps(
            {
                "ok": sorted(r for r, (ok, _, _) in results[n].items() if ok),
                "errors": {r: e for r, (_, e, _) in results[n].items() if e},
                "slowest": times[-1],
                "median": times[len(times) // 2],
            }
        ),
        flush=True,
    )
for t in threads:
    t.join()
