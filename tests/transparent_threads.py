"""A plain multi-threaded program that knows nothing of clairvoyant: per epoch, THREADS threads
each read every file under a directory in an order of their own (so the same files and distinct
files are opened at the same time), with Python's open/read; writes each file's CRC per epoch as
JSON, and whether every thread saw the same bytes. Used under `clairvoyant run` by the tests."""

import argparse
import json
import os
import random
import threading
import zlib


def files(root):
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.join(d, n) for n in names if not n.startswith(".")]
    return sorted(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    paths = files(a.root)
    result = {"epochs": [], "agree": True}
    for e in range(a.epochs):
        seen = [dict() for _ in range(a.threads)]
        start = threading.Barrier(a.threads)

        def reader(t, seen=seen, start=start, e=e):
            order = list(paths)
            random.Random(e * 1000 + t // 2).shuffle(order)  # pairs of threads share an order
            start.wait()
            for path in order:
                with open(path, "rb") as f:
                    seen[t][os.path.relpath(path, a.root)] = zlib.crc32(f.read())

        threads = [threading.Thread(target=reader, args=(t,)) for t in range(a.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["agree"] = result["agree"] and all(s == seen[0] for s in seen)
        result["epochs"].append(seen[0])
    with open(a.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
