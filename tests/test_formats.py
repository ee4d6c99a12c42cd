"""Container sources from Python: LMDB of Caffe Datums, HDF5 (sample axis and one file per
sample), tar shards. Exact bytes and labels against what the generators wrote, the library's own
reading as a second reference, Job and clairvoyant.torch on top, errors that name the container
and the record, changed-container detection, pickling for DataLoader workers."""

import os
import pickle

import numpy as np
import pytest

import clairvoyant
from clairvoyant import datasets as ds


def _needs(mod):
    return pytest.importorskip(mod, reason=f"the {mod} package is not installed (pip install {mod})")


def _backdate(root):
    """Sets mtimes a minute back, so that an index built now is not racy (a file modified within
    2 s of indexing is re-indexed on the next open, as its change could have gone unseen)."""
    t = os.stat(root).st_mtime - 60
    for d, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(d, f), (t, t))
        os.utime(d, (t, t))


def _check(src, expected):
    assert len(src) == len(expected)
    for k, (data, label) in enumerate(expected):
        assert src.size(k) == len(data), k
        assert src.read(k) == data, k
        assert int(src.labels[k]) == label, k


def _job_samples(path_or_source):
    with clairvoyant.Job(path_or_source, batch_size=4, epochs=2, seed=3) as job:
        out = []
        for e in range(2):
            out.append(sorted((bytes(x), int(y)) for x, y in job.epoch(e)))
        return out


# -- LMDB --------------------------------------------------------------------------------------


def test_lmdb_bytes_labels_shapes_match_the_library(tmp_path):
    lmdb = _needs("lmdb")
    expected = ds.make_lmdb(tmp_path / "db", 300, shape=(3, 20, 20))  # 1200 B: inline values
    big = ds.make_lmdb(tmp_path / "big", 20, shape=(3, 64, 64))  # overflow pages
    for path, exp in ((tmp_path / "db", expected), (tmp_path / "big", big)):
        src = clairvoyant.Lmdb(path)
        _check(src, exp)
        env = lmdb.open(str(path), readonly=True, lock=False)
        with env.begin() as txn:
            for k, (key, value) in enumerate(txn.cursor()):
                d = ds.decode_datum(bytes(value))
                assert src.read(k) == d["data"] and src.labels[k] == d["label"]
                assert src.shape(k) == [d["channels"], d["height"], d["width"], 0]
                assert src.paths[k].endswith("data.mdb#" + key.decode())
        env.close()
    # Raw values (caffe=False): whole Datums.
    raw = clairvoyant.Lmdb(tmp_path / "big", caffe=False)
    assert ds.decode_datum(raw.read(3))["data"] == big[3][0]
    _backdate(tmp_path / "db")
    assert not clairvoyant.Lmdb(tmp_path / "db").index_reused  # the mtime changed
    assert clairvoyant.Lmdb(tmp_path / "db").index_reused


def test_lmdb_through_job_path_and_torch(tmp_path):
    _needs("lmdb")
    expected = ds.make_lmdb(tmp_path / "db", 64, shape=(1, 8, 8))
    want = sorted(expected)
    got = _job_samples(str(tmp_path / "db"))
    assert got == [want, want]
    assert type(clairvoyant.sources.as_source(str(tmp_path / "db"))).__name__ == "Lmdb"
    assert type(clairvoyant.sources.as_source(str(tmp_path / "db" / "data.mdb"))).__name__ == "Lmdb"


def test_lmdb_errors_name_the_container_and_record(tmp_path):
    _needs("lmdb")
    ds.make_lmdb(tmp_path / "db", 200, shape=(3, 16, 16))
    data = tmp_path / "db" / "data.mdb"
    src = clairvoyant.Lmdb(tmp_path / "db")
    # Changed in place after indexing: the read says which container and which record.
    with open(data, "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(clairvoyant.DatasetChangedError, match=r"data\.mdb.*record 00000007 \(sample 7\)"):
        src.read(7)
    # Truncated: indexing fails naming the file and the page or key.
    raw = data.read_bytes()
    data.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(clairvoyant.CorruptError, match=r"data\.mdb: record "):
        clairvoyant.Lmdb(tmp_path / "db", index_dir=tmp_path / "ix2")
    # Not an LMDB at all.
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data.mdb").write_bytes(b"x" * 10000)
    with pytest.raises(clairvoyant.CorruptError, match="meta page 0"):
        clairvoyant.Lmdb(tmp_path / "junk")
    with pytest.raises(clairvoyant.ConfigError, match="without data.mdb"):
        clairvoyant.Lmdb(tmp_path)


# -- tar shards --------------------------------------------------------------------------------


@pytest.mark.parametrize("label_member", ["cls", "json"])
def test_tar_shards_bytes_and_labels(tmp_path, label_member):
    expected = ds.make_tar_shards(tmp_path / "s", 50, shards=4, label_member=label_member)
    src = clairvoyant.TarShards(tmp_path / "s")
    _check(src, expected)
    # A list of shard files is the same dataset in the same order.
    files = sorted(str(p) for p in (tmp_path / "s").glob("*.tar"))
    _check(clairvoyant.TarShards(files), expected)
    assert src.paths[0].endswith("shard-00000.tar#sample0000000.bin")


def test_tar_full_random_order_across_shards(tmp_path):
    expected = ds.make_tar_shards(tmp_path / "s", 40, shards=4, size_range=(10, 20))
    index = {d: k for k, (d, _) in enumerate(expected)}
    with clairvoyant.Job(str(tmp_path / "s"), batch_size=4, epochs=1, seed=1) as job:
        order = [index[bytes(x)] for x, _ in job.epoch(0)]
    assert sorted(order) == list(range(40))
    # Not shard-local: consecutive samples jump between shards (10 samples per shard).
    jumps = sum(1 for a, b in zip(order, order[1:]) if a // 10 != b // 10)
    assert jumps > 20, order


def test_tar_errors_name_shard_and_member(tmp_path):
    ds.make_tar_shards(tmp_path / "s", 20, shards=2)
    shard = tmp_path / "s" / "shard-00001.tar"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(clairvoyant.CorruptError, match=r"shard-00001\.tar: record "):
        clairvoyant.TarShards(tmp_path / "s")
    shard.write_bytes(raw)
    src = clairvoyant.TarShards(tmp_path / "s")
    with open(shard, "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(clairvoyant.DatasetChangedError, match=r"shard-00001\.tar.*record sample0000015\.bin"):
        src.read(15)
    assert not clairvoyant.TarShards(tmp_path / "s").index_reused


# -- HDF5 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunks", [None, (1, 3, 16, 16), (6, 3, 16, 16)])
def test_hdf5_rows_match_h5py(tmp_path, chunks):
    h5py = _needs("h5py")
    expected = ds.make_hdf5(tmp_path / "a.h5", 33, chunks=chunks)
    src = clairvoyant.Hdf5(tmp_path / "a.h5")
    _check(src, expected)
    with h5py.File(tmp_path / "a.h5") as f:
        for k in (0, 7, 32):
            assert np.array_equal(np.frombuffer(src.read(k), src.dtype).reshape(src.sample_shape), f["data"][k])
    assert src.paths[5].endswith("a.h5#data[5]")


def test_hdf5_cosmoflow_one_sample_per_file(tmp_path):
    _needs("h5py")
    expected = ds.make_cosmoflow(tmp_path / "cosmo", 12)
    src = clairvoyant.Hdf5(tmp_path / "cosmo", dataset="full", labels="label")
    _check(src, expected)
    assert src.dtype == np.int16 and src.sample_shape == (4, 16, 16, 16)
    assert _job_samples(str(tmp_path / "cosmo"))[1] == sorted(expected)
    # A file added to the directory is a new dataset: re-indexed.
    ds.make_cosmoflow(tmp_path / "more", 1)
    os.rename(tmp_path / "more" / "univ_00000.h5", tmp_path / "cosmo" / "univ_99999.h5")
    again = clairvoyant.Hdf5(tmp_path / "cosmo", dataset="full", labels="label")
    assert len(again) == 13 and not again.index_reused


def test_hdf5_compressed_and_split_rows_and_unsupported_layouts(tmp_path):
    h5py = _needs("h5py")
    # Compressed chunks and chunks that split a sample are decoded (tests/test_hdf5_filters.py
    # has the full matrix); here through Job.
    for name, kw in (("z.h5", dict(chunks=(2, 3, 16, 16), compression="gzip")), ("p.h5", dict(chunks=(2, 3, 8, 8)))):
        expected = ds.make_hdf5(tmp_path / name, 10, **kw)
        _check(clairvoyant.Hdf5(tmp_path / name), expected)
        assert _job_samples(str(tmp_path / name))[0] == sorted(expected)
    ds.make_hdf5(tmp_path / "lzf.h5", 10, chunks=(2, 3, 16, 16), compression="lzf")
    with pytest.raises(clairvoyant.ConfigError, match=r"'/data' of .*lzf\.h5 uses HDF5 filter 32000 \(lzf\)"):
        clairvoyant.Hdf5(tmp_path / "lzf.h5")
    with h5py.File(tmp_path / "compact.h5", "w") as f:
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_layout(h5py.h5d.COMPACT)
        h5py.h5d.create(f.id, b"data", h5py.h5t.NATIVE_UINT8, h5py.h5s.create_simple((4, 4)), dcpl=dcpl)
    with pytest.raises(clairvoyant.ConfigError, match=r"'/data' of .*compact\.h5 has a layout \(compact or virtual\)"):
        clairvoyant.Hdf5(tmp_path / "compact.h5")
    ds.make_hdf5(tmp_path / "ok.h5", 10)
    with pytest.raises(clairvoyant.ConfigError, match="no dataset 'nope'"):
        clairvoyant.Hdf5(tmp_path / "ok.h5", dataset="nope")


# -- torch, pickling ---------------------------------------------------------------------------


def test_sources_pickle_by_reopening(tmp_path):
    expected = ds.make_tar_shards(tmp_path / "s", 10, shards=2)
    _backdate(tmp_path / "s")
    src = clairvoyant.TarShards(tmp_path / "s")
    back = pickle.loads(pickle.dumps(src))
    assert back.read(4) == expected[4][0] and back.index_reused


def test_container_dataset_through_clairvoyant_torch(tmp_path):
    torch = pytest.importorskip("torch")
    import clairvoyant.torch as ct

    _needs("lmdb")
    expected = ds.make_lmdb(tmp_path / "db", 48, shape=(1, 4, 4))
    dataset = ds.ContainerDataset(clairvoyant.Lmdb(tmp_path / "db"), decode=lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8))
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    ref = [(x.clone(), y.clone()) for x, y in torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)]
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    loader = ct.DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2)
    got = list(loader)
    stats = loader.stats()
    loader.close()
    assert len(got) == len(ref) == 6
    for (a, b), (c, d) in zip(got, ref):
        assert torch.equal(a, c) and torch.equal(b, d)
    assert stats and sum(s["samples"] for s in stats) == 48, stats
    assert sorted(bytes(x.numpy()) for b in got for x in b[0]) == sorted(d for d, _ in expected)


def test_containers_read_through_the_in_process_emulation(tmp_path):
    expected = ds.make_tar_shards(tmp_path / "s", 12, shards=3)
    fs = clairvoyant.EmulatedFs(tmp_path / "state", open_latency_ms=0.0, bandwidth_mbps=1000.0)
    src = clairvoyant.TarShards(tmp_path / "s", emulated=fs)
    _check(src, expected)
    assert fs.files_read == 12 and fs.bytes_read == sum(len(d) for d, _ in expected)
    back = pickle.loads(pickle.dumps(src))  # the emulation travels with the source
    assert back.read(0) == expected[0][0] and fs.files_read == 13
