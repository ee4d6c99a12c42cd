"""Where HDF5 samples lie in their files, found with h5py once per node when the index of an
:class:`clairvoyant.Hdf5` source is built: byte ranges of contiguous or unfiltered row-chunked
datasets, else the dataset's chunk table (each stored chunk's offset, size, filter mask and
position; Rust decodes the chunks). h5py's wheels carry libhdf5, so no system HDF5 is needed;
reading the samples afterwards needs neither."""

from __future__ import annotations

import os

import numpy as np

from .errors import ConfigError, CorruptError


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ConfigError("invalid value for 'path': reading HDF5 needs h5py (pip install h5py)") from None
    return h5py


def _files(path: str) -> list:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.lower().endswith((".h5", ".hdf5")))
        if not files:
            raise ConfigError(f"invalid value for 'path': no .h5/.hdf5 files in {path}")
        return files
    return [path]


def _open(h5py, fp: str):
    try:
        return h5py.File(fp, "r")
    except FileNotFoundError:
        raise
    except OSError as e:  # a truncated or damaged file: HDF5 says why
        raise CorruptError(f"{fp}: record (the file's superblock): HDF5 cannot open it: {e}") from None


def _pick_dataset(f, dataset: str | None, where: str):
    h5py = _h5py()
    if dataset is not None:
        if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
            raise ConfigError(f"invalid value for 'dataset': {where} has no dataset {dataset!r}")
        return dataset
    found = []
    f.visititems(lambda name, obj: found.append((obj.nbytes, name)) if isinstance(obj, h5py.Dataset) else None)
    if not found:
        raise ConfigError(f"invalid value for 'dataset': {where} holds no dataset")
    return max(found)[1]


def _pick_labels(f, labels: str | None):
    if labels is not None:
        return labels
    for name in ("labels", "label"):
        if name in f:
            return name
    return None


def _chunked(d, k: int, what: str) -> tuple:
    """The chunk table of a chunked dataset, as :func:`clairvoyant._native.hdf5` expects it: file
    index, name, shape, chunk shape, item size, filters (id, params) in pipeline order, stored
    chunks (file offset, stored size, filter mask, coordinates). The Rust reader refuses filters
    it cannot undo, naming the dataset and the filter."""
    plist = d.id.get_create_plist()
    filters = []
    for i in range(plist.get_nfilters()):
        fid, _flags, params, _name = plist.get_filter(i)
        filters.append((int(fid), [int(v) for v in params]))
    chunks = []

    def one(info):
        chunks.append((int(info.byte_offset), int(info.size), int(info.filter_mask), [int(x) for x in info.chunk_offset]))

    try:
        d.id.chunk_iter(one)  # one pass over the chunk B-tree (HDF5 >= 1.12.3)
    except (AttributeError, NotImplementedError, RuntimeError):
        chunks.clear()
        for i in range(d.id.get_num_chunks()):
            one(d.id.get_chunk_info(i))
    if any(c[0] is None or c[0] < 0 for c in chunks):
        raise ConfigError(f"invalid value for 'dataset': {what} has chunks without file storage")
    return (k, d.name, [int(x) for x in d.shape], [int(x) for x in d.chunks], int(d.dtype.itemsize), filters, chunks)


def _ranges(d, where: str, k: int):
    """(row start, byte offset, rows, row bytes) runs of a dataset's rows in its file, or, where
    its rows are not byte ranges (filtered chunks, chunks that split a row), its chunk table."""
    h5py = _h5py()
    rows = d.shape[0] if d.ndim else 1
    row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64)) if d.ndim else d.dtype.itemsize
    plist = d.id.get_create_plist()
    layout = plist.get_layout()
    what = f"dataset {d.name!r} of {where}"
    if d.dtype.hasobject or d.dtype.itemsize == 0 or h5py.check_vlen_dtype(d.dtype) is not None:
        raise ConfigError(f"invalid value for 'dataset': {what} has variable-length elements ({d.dtype}), not fixed-size rows")
    if layout == h5py.h5d.CONTIGUOUS:
        off = d.id.get_offset()
        if off is None:
            raise ConfigError(f"invalid value for 'dataset': {what} has no storage allocated (never written)")
        return [(0, off, rows, row_bytes)]
    if layout == h5py.h5d.CHUNKED:
        chunks = d.chunks
        if plist.get_nfilters() or tuple(chunks[1:]) != tuple(d.shape[1:]):
            return _chunked(d, k, what)
        out = []
        for i in range(d.id.get_num_chunks()):
            info = d.id.get_chunk_info(i)
            start = info.chunk_offset[0]
            n = min(chunks[0], rows - start)
            out.append((start, info.byte_offset, n, row_bytes))
        covered = sum(r[2] for r in out)
        if covered != rows:
            raise ConfigError(f"invalid value for 'dataset': {what} has {rows - covered} rows in unallocated chunks")
        return sorted(out)
    raise ConfigError(f"invalid value for 'dataset': {what} has a layout (compact or virtual) that is not a byte range")


def layout(path: str, dataset: str | None, labels: str | None) -> tuple:
    """The index columns :func:`clairvoyant._native.hdf5` expects: files, directories, then per
    record its file, offset, length, label, name and ``via`` (-1: ``length`` bytes at ``offset``
    of the file; else ``length`` bytes from row ``offset`` of the chunked dataset ``via``), then
    the chunked datasets (:func:`_chunked`)."""
    h5py = _h5py()
    files = _files(path)
    per_file = os.path.isdir(path)
    file_idx, offsets, lens, labs, names, via, chunked = [], [], [], [], [], [], []
    for k, fp in enumerate(files):
        with _open(h5py, fp) as f:
            name = _pick_dataset(f, dataset, fp)
            d = f[name]
            lname = _pick_labels(f, labels)
            lab = None if lname is None else np.asarray(f[lname][()])
            if lab is not None and not np.issubdtype(lab.dtype, np.integer):
                raise ConfigError(f"invalid value for 'labels': {lname!r} in {fp} is {lab.dtype}, not integers")
            runs = _ranges(d, fp, k)
            if isinstance(runs, tuple):
                chunked.append(runs)
            if per_file:
                nbytes = d.dtype.itemsize * int(np.prod(d.shape, dtype=np.int64))
                if isinstance(runs, tuple):
                    offsets.append(0)
                    via.append(len(chunked) - 1)
                elif len(runs) == 1:
                    offsets.append(int(runs[0][1]))
                    via.append(-1)
                else:  # several unfiltered chunks along the first axis: decode them like split rows
                    chunked.append(_chunked(d, k, f"dataset {name!r} of {fp}"))
                    offsets.append(0)
                    via.append(len(chunked) - 1)
                file_idx.append(k)
                lens.append(nbytes)
                labs.append(0 if lab is None else int(lab.reshape(-1)[0]))
                names.append(f"{name}")
                continue
            if lab is not None and lab.reshape(-1).shape[0] != d.shape[0]:
                raise ConfigError(f"invalid value for 'labels': {lname!r} has {lab.size} labels for {d.shape[0]} rows of {name!r} in {fp}")
            lab = None if lab is None else lab.reshape(-1)
            if isinstance(runs, tuple):
                row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64))
                for r in range(d.shape[0]):
                    file_idx.append(k)
                    offsets.append(r)
                    lens.append(row_bytes)
                    labs.append(0 if lab is None else int(lab[r]))
                    names.append(f"{name}[{r}]")
                    via.append(len(chunked) - 1)
                continue
            for start, off, n, row_bytes in runs:
                for r in range(n):
                    file_idx.append(k)
                    offsets.append(int(off) + r * row_bytes)
                    lens.append(row_bytes)
                    labs.append(0 if lab is None else int(lab[start + r]))
                    names.append(f"{name}[{start + r}]")
                    via.append(-1)
    dirs = [path] if per_file else []
    return files, dirs, file_idx, offsets, lens, labs, names, via, chunked


def sample_meta(path: str, dataset: str | None) -> tuple:
    """(numpy dtype, shape) of one sample."""
    h5py = _h5py()
    fp = _files(path)[0]
    with h5py.File(fp, "r") as f:
        d = f[_pick_dataset(f, dataset, fp)]
        shape = tuple(d.shape) if os.path.isdir(path) else tuple(d.shape[1:])
        return d.dtype, shape
