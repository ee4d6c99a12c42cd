"""Writes the LMDB fixture of tests/source_conformance.rs (run from this directory with the
`lmdb` package): 300 small Caffe Datums (inline values, several leaf pages under a branch page)
and 5 large ones (overflow pages). Datum k: key b"%08d" % k, shape (1, 4, 4) or (3, 40, 40),
data byte i = (7 k + i) % 256, label k % 3 except label -1 for k = 5."""

import os
import sys

import lmdb

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "python"))
from clairvoyant.datasets import encode_datum  # noqa: E402

path = "caffe.lmdb"
os.makedirs(path, exist_ok=True)
for f in ("data.mdb", "lock.mdb"):
    if os.path.exists(os.path.join(path, f)):
        os.remove(os.path.join(path, f))
env = lmdb.open(path, map_size=1 << 24)
with env.begin(write=True) as txn:
    for k in range(305):
        c, h, w = (1, 4, 4) if k < 300 else (3, 40, 40)
        data = bytes((7 * k + i) % 256 for i in range(c * h * w))
        label = -1 if k == 5 else k % 3
        txn.put(b"%08d" % k, encode_datum(c, h, w, data, label))
env.close()
os.remove(os.path.join(path, "lock.mdb"))
