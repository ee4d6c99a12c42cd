"""A plain program that knows nothing of clairvoyant: reads every file under a directory once
per epoch in a seeded random order (optionally its share of nodes) with Python's open/read, and
writes each file's CRC per epoch as JSON. Used under `clairvoyant run` by the tests and the
benchmark."""

import argparse
import json
import os
import random
import time
import zlib


def files(root):
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if not n.startswith(".")]
    return sorted(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--delay", type=float, default=0.0, help="seconds to sleep after each file")
    p.add_argument("--shard", default="0/1", help="i/n: read every n-th file of the order from i")
    a = p.parse_args()
    i, n = map(int, a.shard.split("/"))
    paths = files(a.root)
    result = {"epochs": [], "seconds": []}
    for e in range(a.epochs):
        order = list(paths)
        random.Random(a.seed * 1000 + e).shuffle(order)
        crcs, t0 = {}, time.perf_counter()
        for path in order[i::n]:
            with open(path, "rb") as f:
                crcs[os.path.relpath(path, a.root)] = zlib.crc32(f.read())
            if a.delay:
                time.sleep(a.delay)
        result["seconds"].append(time.perf_counter() - t0)
        result["epochs"].append(crcs)
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
