"""LMDB layouts beyond Caffe's: the keys of named sub-databases are no samples, and the library
fallback's counters (DUPSORT databases, whose values it reads, are tested in Rust,
crates/clairvoyant-core/tests/lmdb_fallback.rs: py-lmdb cannot set flags on the main database)."""

import os
import shutil

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


FIXTURE = os.path.join(os.path.dirname(__file__), "..", "crates", "clairvoyant-core", "tests", "data", "dupsort.lmdb")


def test_dupsort_duplicates_match_py_lmdb_and_are_counted(tmp_path):
    # A DUPSORT main database (written by crates/clairvoyant-core/tests/lmdb_fallback.rs with
    # heed): its duplicates are read through the library; py-lmdb's cursor is the reference.
    db = tmp_path / "db"
    db.mkdir()
    shutil.copy(os.path.join(FIXTURE, "data.mdb"), db / "data.mdb")
    _backdate(db)
    env = lmdb.open(str(db), readonly=True, lock=False)
    with env.begin() as txn:
        expected = list(txn.cursor().iternext())
    env.close()
    assert len(expected) == 119  # 100 + 4 * 3 duplicates, 7 single values
    src = clairvoyant.Lmdb(db, caffe=False, index_dir=tmp_path / "ix")
    assert len(src) == len(expected)
    assert src.fallback_records == 112
    assert src.fallback_reads == 0
    for i, (key, value) in enumerate(expected):
        assert src.read(i) == value, i
        assert src.paths[i].endswith("data.mdb#" + key.decode()), src.paths[i]
    assert src.fallback_reads == 112
    # Through Job and its prefetch threads: every sample once, the library's bytes.
    with clairvoyant.Job(src, batch_size=16, epochs=1, seed=3) as job:
        got = sorted(bytes(x) for x, _ in job.epoch(0))
    assert got == sorted(v for _, v in expected)
