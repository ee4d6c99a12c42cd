"""Store rendezvous with many ranks: hosts a TCPStore, starts processes of rank threads
(tests/rendezvous_ranks.py, each thread its own store client), connects them all, then times
several rounds of allgather (the time from the start signal until the slowest rank returned).

    python benches/rendezvous_store.py [--world 1024] [--procs 8] [--size 256] [--rounds 5] [--tree DIR]

``--tree`` takes clairvoyant's Python package from another checkout (to compare versions).
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from torch.distributed import TCPStore

ROOT = Path(__file__).resolve().parents[1]
p = argparse.ArgumentParser()
p.add_argument("--world", type=int, default=1024)
p.add_argument("--procs", type=int, default=8)
p.add_argument("--size", type=int, default=256)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--tree", default=str(ROOT))
a = p.parse_args()
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
env = dict(os.environ, PYTHONPATH=str(Path(a.tree) / "python"))
per = a.world // a.procs
t0 = time.monotonic()
procs = [
    subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "rendezvous_ranks.py"),
         json.dumps({"port": store.port, "world": a.world, "ranks": [i * per, (i + 1) * per], "size": a.size,
                     "run": f"bench{os.getpid()}", "timeout": 120.0, "rounds": a.rounds})],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    for i in range(a.procs)
]
for q in procs:
    assert q.stdout.readline().strip() == "ready"
print(f"{a.world} ranks connected in {time.monotonic() - t0:.1f} s ({a.procs} processes, tree {a.tree})", flush=True)
for n in range(a.rounds):
    t = time.monotonic()
    for q in procs:
        q.stdin.write("go\n")
        q.stdin.flush()
    outs = [json.loads(q.stdout.readline()) for q in procs]
    took = time.monotonic() - t
    ok = sum(len(o["ok"]) for o in outs)
    med = sorted(o["median"] for o in outs)[len(outs) // 2]
    print(f"round {n}: {took:.2f} s, every payload at {ok} of {a.world} ranks, median rank {med:.2f} s", flush=True)
for q in procs:
    q.wait(timeout=60)
