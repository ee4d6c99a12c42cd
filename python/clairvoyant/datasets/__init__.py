"""Small container datasets for tests, demos and benchmarks (no downloads), and
:class:`ContainerDataset`, a map-style dataset over any clairvoyant container source that
``clairvoyant.torch.DataLoader`` caches and prefetches (it implements ``__clairvoyant_source__``).

- :func:`make_lmdb`: an LMDB database of Caffe ``Datum`` records (needs the ``lmdb`` package).
- :func:`make_hdf5`: one HDF5 file with a leading sample axis and a ``labels`` dataset (h5py).
- :func:`make_cosmoflow`: a directory of HDF5 files, one sample per file, as CosmoFlow (h5py).
- :func:`make_tar_shards`: WebDataset-style tar shards with ``.bin`` data and ``.cls`` labels.

Every generator is deterministic in its arguments and returns the expected samples as a list of
``(bytes, label)``, so tests compare what a source reads with what was written.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import CorruptError

__all__ = [
    "ContainerDataset",
    "decode_datum",
    "encode_datum",
    "make_cosmoflow",
    "make_hdf5",
    "make_lmdb",
    "make_tar_shards",
]


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative int32 values are encoded as 10-byte two's complement
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_datum(channels: int, height: int, width: int, data: bytes, label: int, encoded: bool = False) -> bytes:
    """Caffe's ``Datum`` message (caffe.proto) in protobuf wire format, fields in Caffe's order."""
    out = bytearray()
    for tag, v in ((1, channels), (2, height), (3, width)):
        out += _varint(tag << 3) + _varint(v)
    out += _varint(4 << 3 | 2) + _varint(len(data)) + data
    out += _varint(5 << 3) + _varint(label)
    if encoded:
        out += _varint(7 << 3) + _varint(1)
    return bytes(out)


def decode_datum(value: bytes) -> dict:
    """The fields of a ``Datum`` (channels, height, width, data, label, encoded)."""
    out = {"channels": 0, "height": 0, "width": 0, "data": b"", "label": 0, "encoded": False}
    names = {1: "channels", 2: "height", 3: "width", 5: "label", 7: "encoded"}
    pos = 0
    mv = memoryview(value)

    def varint():
        nonlocal pos
        shift = result = 0
        while True:
            b = mv[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return result

    while pos < len(mv):
        key = varint()
        tag, wire = key >> 3, key & 7
        if wire == 0:
            v = varint()
            if tag in names:
                v = v - (1 << 64) if v >= 1 << 63 else v
                out[names[tag]] = bool(v) if tag == 7 else v
        elif wire == 2:
            n = varint()
            if tag == 4:
                out["data"] = bytes(mv[pos : pos + n])
            pos += n
        elif wire == 5:
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise CorruptError(f"not a Datum: wire type {wire} at byte {pos}")
    return out


def _payload(rng: np.random.Generator, n: int) -> bytes:
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def make_lmdb(
    path: str | os.PathLike,
    count: int,
    shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    seed: int = 0,
    keep: bool = True,
    collect: bool = True,
) -> list:
    """An LMDB environment at ``path`` of ``count`` Caffe Datums with raw ``shape`` (c, h, w)
    uint8 data, keys ``%08d`` (as Caffe's convert_imageset writes them), labels ``k %
    num_classes``. Returns [(data bytes, label)] in key order (empty unless ``collect``: a large
    database need not fit in memory). With ``keep`` and a matching ``.clairvoyant-made`` marker,
    an existing database is reused."""
    import lmdb

    path = Path(path)
    c, h, w = (int(x) for x in shape)
    per = c * h * w
    marker = path / ".clairvoyant-made"
    want = f"lmdb {count} {c}x{h}x{w} {num_classes} {seed}"
    rng = np.random.default_rng(seed)
    samples = []
    exists = keep and marker.exists() and marker.read_text() == want
    if exists and not collect:
        return samples
    env = None
    if not exists:
        path.mkdir(parents=True, exist_ok=True)
        for f in ("data.mdb", "lock.mdb"):
            (path / f).unlink(missing_ok=True)
        env = lmdb.open(str(path), map_size=max(1 << 24, int(count * (per + 64) * 1.5) + (1 << 20)), sync=False)
    txn = None if env is None else env.begin(write=True)
    for k in range(count):
        data = _payload(rng, per)
        label = k % num_classes
        if collect:
            samples.append((data, label))
        if txn is not None:
            txn.put(b"%08d" % k, encode_datum(c, h, w, data, label))
            if k % 1000 == 999:
                txn.commit()
                txn = env.begin(write=True)
    if env is not None:
        txn.commit()
        env.sync()
        env.close()
        marker.write_text(want)
    return samples


def make_hdf5(
    path: str | os.PathLike,
    count: int,
    shape: Sequence[int] = (3, 16, 16),
    num_classes: int = 10,
    seed: int = 0,
    chunks: Optional[Sequence[int]] = None,
    compression: Optional[str] = None,
    dtype: str = "uint8",
) -> list:
    """An HDF5 file with ``data`` (count, *shape) and ``labels`` (count,) int64. ``chunks``
    (e.g. (4, *shape)) makes ``data`` chunked; ``compression`` filters it. Returns [(row bytes,
    label)]."""
    import h5py

    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 100, size=(count, *shape)).astype(dtype)
    labels = np.arange(count, dtype=np.int64) % num_classes
    with h5py.File(path, "w") as f:
        f.create_dataset("data", data=arr, chunks=None if chunks is None else tuple(chunks), compression=compression)
        f.create_dataset("labels", data=labels)
    return [(arr[k].tobytes(), int(labels[k])) for k in range(count)]


def make_cosmoflow(
    root: str | os.PathLike,
    count: int,
    shape: Sequence[int] = (4, 16, 16, 16),
    num_classes: int = 4,
    seed: int = 0,
) -> list:
    """A directory of ``count`` HDF5 files ``univ_<k>.h5``, each one sample as in CosmoFlow:
    ``full`` (int16, ``shape``), ``unitPar`` (4 float32 targets) and an integer ``label``.
    Returns [(``full`` bytes, label)] in file-name order."""
    import h5py

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        full = rng.integers(-100, 100, size=tuple(shape)).astype(np.int16)
        label = k % num_classes
        with h5py.File(root / f"univ_{k:05d}.h5", "w") as f:
            f.create_dataset("full", data=full)
            f.create_dataset("unitPar", data=rng.random(4).astype(np.float32))
            f.create_dataset("label", data=np.int64(label))
        out.append((full.tobytes(), label))
    return out


def make_tar_shards(
    root: str | os.PathLike,
    count: int,
    shards: int = 4,
    size_range: tuple = (100, 2000),
    num_classes: int = 10,
    seed: int = 0,
    label_member: str = "cls",
    prefix: str = "shard",
) -> list:
    """``shards`` tar files ``<prefix>-%05d.tar`` in ``root`` holding ``count`` samples in
    order, each ``<key>.bin`` (random bytes, sizes in ``size_range``) plus ``<key>.cls`` (the
    label as text) or, with ``label_member="json"``, ``<key>.json`` (``{"label": n}``). Returns
    [(bytes, label)] in sample order (shard by shard)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    samples = []
    per = -(-count // shards)
    for s in range(shards):
        with tarfile.open(root / f"{prefix}-{s:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tf:
            for k in range(s * per, min(count, (s + 1) * per)):
                data = _payload(rng, int(rng.integers(size_range[0], size_range[1] + 1)))
                label = k % num_classes
                samples.append((data, label))
                key = f"sample{k:07d}"
                meta = str(label).encode() if label_member == "cls" else b'{"label": %d}' % label
                for name, body in ((f"{key}.bin", data), (f"{key}.{label_member}", meta)):
                    info = tarfile.TarInfo(name)
                    info.size = len(body)
                    info.mtime = 0
                    tf.addfile(info, io.BytesIO(body))
    return samples


try:  # a torch Dataset when torch is there, so DataLoader's type checks pass
    from torch.utils.data import Dataset as _Base
except ImportError:  # pragma: no cover - torch is optional
    _Base = object


class ContainerDataset(_Base):
    """``dataset[i] = (decode(data), label)`` for sample ``i`` of a clairvoyant ``source`` (any
    source; made for ``Lmdb``, ``Hdf5`` and ``TarShards``). ``decode`` defaults to a read-only
    uint8 numpy array of the bytes; ``transform`` then applies to what it returns.
    ``clairvoyant.torch.DataLoader`` reads, caches and prefetches the bytes through
    ``__clairvoyant_source__`` and calls ``__clairvoyant_getitem__`` in the workers; a plain
    ``torch.utils.data.DataLoader`` calls ``__getitem__``, which reads the source directly."""

    def __init__(self, source, decode: Optional[Callable] = None, transform: Optional[Callable] = None):
        self.source = source
        self.decode = decode
        self.transform = transform
        self.targets = [int(x) for x in source.labels]

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int):
        return self.__clairvoyant_getitem__(index, self.source.read(index))

    def __clairvoyant_source__(self):
        return self.source

    def __clairvoyant_getitem__(self, index: int, data):
        x = self.decode(data) if self.decode is not None else np.frombuffer(bytes(data), dtype=np.uint8)
        if self.transform is not None:
            x = self.transform(x)
        return x, self.targets[index]
