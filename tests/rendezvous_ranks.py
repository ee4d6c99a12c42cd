"""Many store ranks in one process, one thread each, every thread with its own TCPStore client
(as every rank of a job has): run by tests/test_cluster_rendezvous.py, several processes at once.

argv[1]: JSON {"port", "world", "ranks": [first, end), "size", "run", "timeout"}. Prints "ready"
once every thread is connected, starts on a line on stdin, then prints one JSON line: the ranks
that got every payload right, the errors, and the slowest rank's seconds.
"""

import datetime
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
    return f"{rank:08d}".encode() * (size // 8) + bytes([rank % 251]) * (size % 8)


def thread_store(rank, timeout):
    return local.store, f"127.0.0.1:{a['port']}"


_cluster._store = thread_store
connected = threading.Barrier(end - first + 1)
go = threading.Event()
results = {}


def rank_main(rank: int) -> None:
    try:
        local.store = TCPStore("127.0.0.1", a["port"], is_master=False, timeout=datetime.timedelta(seconds=a["timeout"]))
    finally:
        connected.wait()
    go.wait()
    t0 = time.monotonic()
    try:
        got = _cluster._allgather_store(payload(rank), rank, world, a["run"], 0, a["timeout"])
        ok = len(got) == world and all(got[r] == payload(r) for r in range(world))
        results[rank] = (ok, None, time.monotonic() - t0)
    except Exception as e:  # reported, not raised: the parent names the ranks
        results[rank] = (False, f"{type(e).__name__}: {e}", time.monotonic() - t0)


threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(first, end)]
for t in threads:
    t.start()
connected.wait()
print("ready", flush=True)
sys.stdin.readline()
go.set()
for t in threads:
    t.join()
print(
    json.dumps(
        {
            "ok": sorted(r for r, (ok, _, _) in results.items() if ok),
            "errors": {r: e for r, (_, e, _) in results.items() if e},
            "slowest": max(s for _, _, s in results.values()),
        }
    ),
    flush=True,
)
