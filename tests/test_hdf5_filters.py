"""HDF5 datasets whose samples are not byte ranges: gzip, shuffle and fletcher32-filtered chunks,
chunks of several rows, rows split across chunks, CosmoFlow files with compressed samples. Read
by decoding the chunks in Rust (no HDF5 library after indexing); every sample must be
byte-identical to h5py's ``ds[i].tobytes()``. Filters the reader cannot undo, unwritten chunks
and damaged chunks are errors naming the file, the dataset (or record) and what to do."""

import os
import threading

import numpy as np
import pytest

import clairvoyant

h5py = pytest.importorskip("h5py", reason="the h5py package is not installed (pip install h5py)")


def _write(path, arr, **kw):
    labels = np.arange(arr.shape[0], dtype=np.int64) % 7
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=arr, **kw)
        f.create_dataset("labels", data=labels)
    return labels


def _same_as_h5py(src, path, name="data"):
    with h5py.File(path, "r") as f:
        d = f[name]
        assert len(src) == d.shape[0]
        for k in range(d.shape[0]):
            want = d[k].tobytes()
            assert src.size(k) == len(want), k
            assert src.read(k) == want, k


LAYOUTS = {
    "gzip": dict(chunks=(4, 3, 16, 16), compression="gzip"),
    "shuffle+gzip": dict(chunks=(4, 3, 16, 16), compression="gzip", shuffle=True),
    "gzip, chunks of 9 rows (partial edge chunk)": dict(chunks=(9, 3, 16, 16), compression="gzip", compression_opts=9),
    "rows split across chunks, no filter": dict(chunks=(1, 3, 8, 8)),
    "rows split across chunks + shuffle+gzip+fletcher32": dict(chunks=(5, 2, 7, 16), compression="gzip", shuffle=True, fletcher32=True),
    "fletcher32 only": dict(chunks=(2, 3, 16, 16), fletcher32=True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", ["uint8", "<i4", ">i2", "<f8"])
def test_filtered_and_split_rows_match_h5py(tmp_path, layout, dtype):
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 1000, size=(33, 3, 16, 16)).astype(dtype)
    p = tmp_path / "a.h5"
    labels = _write(p, arr, **LAYOUTS[layout])
    src = clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")
    _same_as_h5py(src, p)
    assert [int(x) for x in src.labels] == labels.tolist()
    assert src.paths[5].endswith("a.h5#data[5]")
    assert src.dtype == np.dtype(dtype) and src.sample_shape == (3, 16, 16)
    # Reopened from the index (no h5py): the same bytes.
    again = clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")
    assert again.read(32) == src.read(32)


def test_one_dimensional_rows_many_per_chunk(tmp_path):
    arr = np.arange(1000, dtype=np.float32)
    p = tmp_path / "v.h5"
    _write(p, arr, chunks=(64,), compression="gzip", shuffle=True)
    src = clairvoyant.Hdf5(p, dataset="data", index_dir=tmp_path / "ix")
    _same_as_h5py(src, p)


def test_threads_read_in_random_order(tmp_path):
    rng = np.random.default_rng(2)
    arr = rng.integers(0, 255, size=(200, 4, 8, 8)).astype(np.uint8)
    p = tmp_path / "t.h5"
    _write(p, arr, chunks=(8, 4, 4, 8), compression="gzip", shuffle=True)
    src = clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")
    errors = []

    def work(seed):
        order = np.random.default_rng(seed).permutation(200)
        for k in order:
            if src.read(int(k)) != arr[k].tobytes():
                errors.append(int(k))

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in ts)
    assert errors == []


@pytest.mark.parametrize(
    "kw",
    [
        dict(chunks=(2, 8, 8, 16), compression="gzip", shuffle=True),  # compressed, split along every axis
        dict(chunks=(2, 16, 16, 16)),  # unfiltered but in two chunks: not one byte range
    ],
)
def test_cosmoflow_chunked_one_sample_per_file(tmp_path, kw):
    root = tmp_path / "cosmo"
    root.mkdir()
    rng = np.random.default_rng(3)
    expected = []
    for k in range(6):
        full = rng.integers(-100, 100, size=(4, 16, 16, 16)).astype(np.int16)
        with h5py.File(root / f"univ_{k:05d}.h5", "w") as f:
            f.create_dataset("full", data=full, **kw)
            f.create_dataset("unitPar", data=rng.random(4).astype(np.float32))
            f.create_dataset("label", data=np.int64(k % 3))
        expected.append((full.tobytes(), k % 3))
    src = clairvoyant.Hdf5(root, dataset="full", labels="label", index_dir=tmp_path / "ix")
    assert len(src) == 6
    for k, (data, label) in enumerate(expected):
        assert src.read(k) == data and int(src.labels[k]) == label
    assert src.paths[2].endswith("univ_00002.h5#full")
    with clairvoyant.Job(str(root), batch_size=2, epochs=1, seed=0) as job:
        got = sorted((bytes(x), int(y)) for x, y in job.epoch(0))
    assert got == sorted(expected)


def test_unknown_filter_is_named_with_a_fix(tmp_path):
    p = tmp_path / "lzf.h5"
    _write(p, np.zeros((10, 3, 16, 16), np.uint8), chunks=(2, 3, 16, 16), compression="lzf")
    with pytest.raises(clairvoyant.ConfigError, match=r"'/data' of .*lzf\.h5 uses HDF5 filter 32000 \(lzf\).*h5repack -f NONE"):
        clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")


def test_unwritten_chunks_are_named(tmp_path):
    p = tmp_path / "holes.h5"
    with h5py.File(p, "w") as f:
        d = f.create_dataset("data", shape=(10, 4), dtype="u1", chunks=(2, 4), compression="gzip")
        d[0:4] = 1  # chunks 2..4 never written
    with pytest.raises(clairvoyant.ConfigError, match=r"'/data' of .*holes\.h5 has 2 of its 5 chunks stored"):
        clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")


def _backdated(p):
    t = os.stat(p).st_mtime - 60
    os.utime(p, (t, t))
    return t


def test_damaged_compressed_chunk_names_file_and_record(tmp_path):
    arr = np.random.default_rng(4).integers(0, 255, size=(20, 3, 16, 16)).astype(np.uint8)
    p = tmp_path / "z.h5"
    _write(p, arr, chunks=(4, 3, 16, 16), compression="gzip")
    t = _backdated(p)
    src = clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")
    with h5py.File(p, "r") as f:
        info = f["data"].id.get_chunk_info(2)  # rows 8..11
    raw = bytearray(p.read_bytes())
    cut = info.byte_offset + info.size // 2
    raw[cut : info.byte_offset + info.size] = bytes(info.byte_offset + info.size - cut)
    p.write_bytes(bytes(raw))
    os.utime(p, (t, t))  # same size and mtime: only the chunk's bytes tell
    with pytest.raises(clairvoyant.CorruptError, match=r"z\.h5: record data\[9\] \(sample 9\): chunk \[8, 0, 0, 0\].*deflate"):
        src.read(9)
    assert src.read(0) == arr[0].tobytes()


def test_truncated_file_is_named(tmp_path):
    arr = np.random.default_rng(5).integers(0, 255, size=(20, 3, 16, 16)).astype(np.uint8)
    p = tmp_path / "cut.h5"
    _write(p, arr, chunks=(4, 3, 16, 16), compression="gzip")
    src = clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) * 2 // 3])
    with pytest.raises(clairvoyant.DatasetChangedError, match=r"cut\.h5.*record data\[19\]"):
        src.read(19)
    with pytest.raises((clairvoyant.CorruptError, clairvoyant.ConfigError), match=r"cut\.h5"):
        clairvoyant.Hdf5(p, index_dir=tmp_path / "ix")


def test_compressed_rows_through_clairvoyant_torch(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import clairvoyant.torch as ct
    from clairvoyant import datasets as ds

    arr = np.random.default_rng(6).integers(0, 255, size=(40, 2, 4, 4)).astype(np.uint8)
    p = tmp_path / "t.h5"
    _write(p, arr, chunks=(3, 2, 2, 4), compression="gzip", shuffle=True)
    dataset = ds.ContainerDataset(
        clairvoyant.Hdf5(p, index_dir=tmp_path / "ix"), decode=lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    )
    loader = ct.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2)
    got = sorted(bytes(x.numpy()) for xs, _ in loader for x in xs)
    loader.close()
    assert got == sorted(arr[k].tobytes() for k in range(40))
