"""LMDB layouts beyond Caffe's: the keys of named sub-databases are no samples, and the library
fallback's counters (DUPSORT databases, whose values it reads, are tested in Rust,
crates/clairvoyant-core/tests/lmdb_fallback.rs: py-lmdb cannot set flags on the main database)."""

import os

import pytest

import clairvoyant

lmdb = pytest.importorskip("lmdb", reason="the lmdb package is not installed (pip install lmdb)")


def _backdate(root):
    t = os.stat(root).st_mtime - 60
    for d, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(d, f), (t, t))
        os.utime(d, (t, t))


def _value(k, d, n):
    return bytes((k * 7 + d * 13 + i) % 251 for i in range(n))


def test_named_sub_database_names_are_not_samples(tmp_path):
    path = tmp_path / "db"
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=2)
    sub = env.open_db(b"other")
    with env.begin(write=True) as txn:
        for k in range(30):
            txn.put(b"m%03d" % k, _value(k, 0, 100))
            txn.put(b"s%03d" % k, b"elsewhere", db=sub)
    env.close()
    _backdate(path)
    src = clairvoyant.Lmdb(path, caffe=False, index_dir=tmp_path / "ix")
    assert len(src) == 30
    assert src.fallback_records == 0
    assert [src.read(k) for k in range(30)] == [_value(k, 0, 100) for k in range(30)]
    assert src.fallback_reads == 0
    assert src.paths[0].endswith("data.mdb#m000"), src.paths[0]
