"""Where HDF5 samples lie in their files, found with h5py once per node when the index of an
:class:`clairvoyant.Hdf5` source is built. h5py's wheels carry libhdf5, so no system HDF5 is
needed; reading the samples afterwards needs neither (positioned reads of the byte ranges)."""

from __future__ import annotations

import os

import numpy as np

from .errors import ConfigError


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


def _ranges(d, where: str) -> list:
    """(row start, byte offset, rows) runs of a dataset's rows in its file."""
    h5py = _h5py()
    rows = d.shape[0] if d.ndim else 1
    row_bytes = d.dtype.itemsize * int(np.prod(d.shape[1:], dtype=np.int64)) if d.ndim else d.dtype.itemsize
    plist = d.id.get_create_plist()
    layout = plist.get_layout()
    what = f"dataset {d.name!r} of {where}"
    if layout == h5py.h5d.CONTIGUOUS:
        off = d.id.get_offset()
        if off is None:
            raise ConfigError(f"invalid value for 'dataset': {what} has no storage allocated (never written)")
        return [(0, off, rows, row_bytes)]
    if layout == h5py.h5d.CHUNKED:
        if plist.get_nfilters():
            raise ConfigError(
                f"invalid value for 'dataset': {what} is chunked with filters (compression): samples are not byte ranges; "
                "rewrite it without compression (h5py: compression=None) to read it with clairvoyant"
            )
        chunks = d.chunks
        if d.ndim and tuple(chunks[1:]) != tuple(d.shape[1:]):
            raise ConfigError(
                f"invalid value for 'dataset': {what} has chunks {chunks} that split a sample of shape {d.shape[1:]}; "
                "chunks must span whole rows"
            )
        out = []
        for i in range(d.id.get_num_chunks()):
            info = d.id.get_chunk_info(i)
            start = info.chunk_offset[0] if d.ndim else 0
            n = min(chunks[0] if d.ndim else 1, rows - start)
            out.append((start, info.byte_offset, n, row_bytes))
        covered = sum(r[2] for r in out)
        if covered != rows:
            raise ConfigError(f"invalid value for 'dataset': {what} has {rows - covered} rows in unallocated chunks")
        return sorted(out)
    raise ConfigError(f"invalid value for 'dataset': {what} has a layout (compact or virtual) that is not a byte range")


def layout(path: str, dataset: str | None, labels: str | None) -> tuple:
    """The index columns :func:`clairvoyant._native.hdf5` expects: files, directories, then per
    record its file, offset, length, label and name."""
    h5py = _h5py()
    files = _files(path)
    per_file = os.path.isdir(path)
    file_idx, offsets, lens, labs, names = [], [], [], [], []
    for k, fp in enumerate(files):
        with h5py.File(fp, "r") as f:
            name = _pick_dataset(f, dataset, fp)
            d = f[name]
            lname = _pick_labels(f, labels)
            lab = None if lname is None else np.asarray(f[lname][()])
            if lab is not None and not np.issubdtype(lab.dtype, np.integer):
                raise ConfigError(f"invalid value for 'labels': {lname!r} in {fp} is {lab.dtype}, not integers")
            if per_file:
                runs = _ranges(d, fp)
                if len(runs) != 1 and d.ndim:
                    raise ConfigError(f"invalid value for 'dataset': {name!r} of {fp} is stored in {len(runs)} chunks, not one range")
                nbytes = d.dtype.itemsize * int(np.prod(d.shape, dtype=np.int64))
                file_idx.append(k)
                offsets.append(int(runs[0][1]))
                lens.append(nbytes)
                labs.append(0 if lab is None else int(lab.reshape(-1)[0]))
                names.append(f"{name}")
                continue
            if lab is not None and lab.reshape(-1).shape[0] != d.shape[0]:
                raise ConfigError(f"invalid value for 'labels': {lname!r} has {lab.size} labels for {d.shape[0]} rows of {name!r} in {fp}")
            lab = None if lab is None else lab.reshape(-1)
            for start, off, n, row_bytes in _ranges(d, fp):
                for r in range(n):
                    file_idx.append(k)
                    offsets.append(int(off) + r * row_bytes)
                    lens.append(row_bytes)
                    labs.append(0 if lab is None else int(lab[start + r]))
                    names.append(f"{name}[{start + r}]")
    dirs = [path] if per_file else []
    return files, dirs, file_idx, offsets, lens, labs, names


def sample_meta(path: str, dataset: str | None) -> tuple:
    """(numpy dtype, shape) of one sample."""
    h5py = _h5py()
    fp = _files(path)[0]
    with h5py.File(fp, "r") as f:
        d = f[_pick_dataset(f, dataset, fp)]
        shape = tuple(d.shape) if os.path.isdir(path) else tuple(d.shape[1:])
        return d.dtype, shape
