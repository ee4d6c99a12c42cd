"""Dataset sources a Job can read: an ImageFolder directory, a list of files with labels,
synthetic bytes, or a container (an LMDB database, HDF5 files, tar shards). Any of them can be
read through an emulated shared file system."""

from __future__ import annotations

import errno
import numbers
import operator
import os

from . import _native
from .errors import ArgumentTypeError, ConfigError, os_error

# Not `from typing import TYPE_CHECKING`: a node agent imports this module at its start.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Sequence

    import numpy as np  # imported at first use: a node agent serving an unknown order needs none


_I64 = (-(2**63), 2**63 - 1)
_U64 = (0, 2**64 - 1)


def _ints(values, name: str, bounds) -> list:
    """`values` as a list of ints within `bounds`, or ConfigError/ArgumentTypeError naming `name`
    (rather than an OverflowError from the native layer that names nothing)."""
    out = []
    for k, v in enumerate(_iterable(values, name)):
        try:
            i = operator.index(v)
        except TypeError:
            raise ArgumentTypeError(f"invalid value for '{name}': item {k} is {type(v).__name__}, not an integer") from None
        if not bounds[0] <= i <= bounds[1]:
            raise ConfigError(f"invalid value for '{name}': item {k} is {i}, outside {bounds[0]}..{bounds[1]}")
        out.append(i)
    return out


class _Source:
    _native: "_native.Source"

    def __len__(self) -> int:
        return len(self._native)

    @property
    def labels(self) -> np.ndarray:
        if getattr(self, "_labels", None) is None:
            import numpy as np

            self._labels = np.asarray(self._native.labels(), dtype=np.int64)
        return self._labels

    @property
    def paths(self) -> list:
        if getattr(self, "_paths", None) is None:
            self._paths = self._native.paths()
        return self._paths

    @property
    def classes(self) -> list:
        return list(getattr(self, "_classes", []) or [])

    def size(self, sample: int) -> int:
        return self._native.size(sample)

    @property
    def total_bytes(self) -> int:
        return self._native.total_bytes()

    @property
    def index_path(self) -> str | None:
        """The cached index file (None for synthetic sources)."""
        return self._native.index_path

    @property
    def index_reused(self) -> bool:
        """True when the cached index was reused instead of rescanning the dataset."""
        return self._native.index_reused

    def read(self, sample: int) -> bytes:
        """The bytes of ``sample``, read from the source (no cache, no prefetch)."""
        return self._native.read(sample)


class ImageFolder(_Source):
    """A directory with one sub-directory per class (torchvision's ImageFolder layout): labels
    are class positions in sorted order, files sorted as torchvision does. The index is built
    once and cached (``index_dir`` or the default cache directory)."""

    def __init__(self, root: str | os.PathLike, emulated: "EmulatedFs | None" = None, index_dir=None, index_path=None):
        self.root = _fspath(root, "root")
        self._native = _native.image_folder(
            self.root,
            None if index_dir is None else _fspath(index_dir, "index_dir"),
            emulated,
            None if index_path is None else _fspath(index_path, "index_path"),
        )
        self._classes = self._native.classes()

    def __repr__(self):
        return f"ImageFolder({self.root!r}, {len(self)} samples, {len(self._classes)} classes)"


class FileList(_Source):
    """A plain list of files with integer labels (or a text file of ``<path> <label>`` lines)."""

    def __init__(self, paths: Sequence | str | os.PathLike, labels: Sequence[int] | None = None, emulated=None, index_dir=None):
        if labels is None:
            if not isinstance(paths, (str, os.PathLike)):
                raise ConfigError("invalid value for 'labels': required unless 'paths' is a list file")
            paths, labels = _native.parse_list_file(os.fspath(paths))
        elif isinstance(paths, (str, bytes, os.PathLike)):
            raise ConfigError("invalid value for 'labels': a list file carries its own labels; pass labels only with a list of paths")
        paths = [_fspath(p, "paths") for p in _iterable(paths, "paths")]
        labels = _ints(labels, "labels", _I64)
        self._native = _native.file_list(paths, labels, None if index_dir is None else _fspath(index_dir, "index_dir"), emulated)

    def __repr__(self):
        return f"FileList({len(self)} samples)"


class Synthetic(_Source):
    """Deterministic in-memory samples of the given sizes; no storage underneath."""

    def __init__(self, sizes: Sequence[int], labels: Sequence[int] | None = None):
        sizes = _ints(sizes, "sizes", _U64)
        if labels is not None:
            labels = _ints(labels, "labels", _I64)
            if len(labels) != len(sizes):
                raise ConfigError(f"invalid value for 'labels': {len(labels)} labels for {len(sizes)} sizes")
        self._native = _native.synthetic_source(sizes, labels)

    def __repr__(self):
        return f"Synthetic({len(self)} samples)"


class _Container(_Source):
    """A container source; reopened from its arguments when pickled (DataLoader workers)."""

    _args: tuple

    def __reduce__(self):
        args, emulated = self._args[:-1], self._args[-1]
        if emulated is not None:
            emulated = (emulated.state_path, emulated.open_latency_ms, emulated.bandwidth_mbps)
        return (_reopen, (type(self), args, emulated))

    def shape(self, sample: int) -> list:
        """The record's shape where the container has one, else ``[]``."""
        return self._native.shape(sample)


def _reopen(cls, args, emulated):
    if emulated is not None:
        emulated = EmulatedFs(*emulated)
    return cls(*args, emulated=emulated)


class Lmdb(_Container):
    """An LMDB database (the environment directory holding ``data.mdb``, or that file), read
    without its memory map: one indexing pass per node walks the B+tree with positioned reads
    and records where each value lies; samples are then read with one ``pread`` each.

    With ``caffe=True`` (the default) each value is a Caffe ``Datum``: a sample's bytes are its
    ``data`` field (raw pixels, channel-major, or the encoded image when ``encoded`` is set), its
    label the Datum's ``label``, and ``shape(i)`` gives ``[channels, height, width, encoded]``.
    With ``caffe=False`` a sample is the whole value, label 0.

    Values the walk cannot place (duplicates in a DUPSORT database) are read through the LMDB
    library and counted: ``fallback_records``, ``fallback_reads``."""

    def __init__(self, path, caffe: bool = True, index_dir=None, index_path=None, emulated=None):
        self.path = _fspath(path, "path")
        if not isinstance(caffe, bool):
            raise ArgumentTypeError(f"invalid value for 'caffe': expected a bool, not {type(caffe).__name__}")
        index_dir = None if index_dir is None else _fspath(index_dir, "index_dir")
        index_path = None if index_path is None else _fspath(index_path, "index_path")
        self._args = (self.path, caffe, index_dir, index_path, emulated)
        self._native = _native.lmdb(self.path, caffe, index_dir, emulated, index_path)

    def __repr__(self):
        return f"Lmdb({self.path!r}, {len(self)} samples)"

    @property
    def fallback_records(self) -> int:
        """Records the page walk could not place (the duplicates of a key in a DUPSORT
        database): they are read through the LMDB library."""
        return self._native.fallback_records

    @property
    def fallback_reads(self) -> int:
        """Reads of this source (in this process) that went through the LMDB library."""
        return self._native.fallback_reads


class TarShards(_Container):
    """WebDataset-style tar shards: ``paths`` is a ``.tar`` file, a directory of them, or a list
    of either. Members are grouped into samples by key (the member path up to the first dot of its
    file name); a sample's bytes are its ``data_ext`` member (default: the first member that is
    not ``.cls``/``.json``), its label the integer in its ``.cls`` member, else the ``label`` (or
    ``cls``) field of its ``.json`` member, else 0. Samples are read by byte range in any order
    across all shards."""

    def __init__(self, paths, data_ext: str | None = None, index_dir=None, index_path=None, emulated=None):
        if isinstance(paths, (str, bytes, os.PathLike)):
            paths = [paths]
        paths = [_fspath(p, "paths") for p in _iterable(paths, "paths")]
        if data_ext is not None and not isinstance(data_ext, str):
            raise ArgumentTypeError(f"invalid value for 'data_ext': expected a str, not {type(data_ext).__name__}")
        index_dir = None if index_dir is None else _fspath(index_dir, "index_dir")
        index_path = None if index_path is None else _fspath(index_path, "index_path")
        self.shards = paths
        self._args = (paths, data_ext, index_dir, index_path, emulated)
        self._native = _native.tar_shards(paths, data_ext, index_dir, emulated, index_path)

    def __repr__(self):
        return f"TarShards({len(self.shards)} paths, {len(self)} samples)"


class Hdf5(_Container):
    """HDF5 samples read as byte ranges, with no HDF5 lock between readers.

    - ``path`` a file: ``dataset`` has a leading sample axis, one sample = one row (slab) of it;
      ``labels`` names an integer dataset with one label per row.
    - ``path`` a directory of ``*.h5``/``*.hdf5`` files, one sample per file (CosmoFlow):
      ``dataset`` names the sample inside each file; ``labels`` an integer scalar in each file.

    ``dataset=None`` takes the largest dataset of the (first) file; ``labels=None`` takes a
    dataset named ``labels`` or ``label`` when there is one (else labels are 0). The layout is
    found with h5py when the index is built, once per node: contiguous rows and unfiltered chunks
    spanning whole rows are byte ranges; other chunked datasets (gzip, shuffle, fletcher32, chunks
    that split a row) are read chunk by chunk and decoded in Rust. Other filters (lzf, szip,
    blosc, ...), compact and virtual layouts are a ConfigError naming the dataset. A sample's
    bytes are the row as stored (``ds[i].tobytes()``): decode with
    ``numpy.frombuffer(data, source.dtype).reshape(source.sample_shape)``."""

    def __init__(self, path, dataset: str | None = None, labels: str | None = None, index_dir=None, index_path=None, emulated=None):
        self.path = _fspath(path, "path")
        for name, v in (("dataset", dataset), ("labels", labels)):
            if v is not None and not isinstance(v, str):
                raise ArgumentTypeError(f"invalid value for '{name}': expected a str, not {type(v).__name__}")
        index_dir = None if index_dir is None else _fspath(index_dir, "index_dir")
        index_path = None if index_path is None else _fspath(index_path, "index_path")
        self.dataset, self.label_dataset = dataset, labels
        self._args = (self.path, dataset, labels, index_dir, index_path, emulated)
        from . import _hdf5

        options = f"{dataset or ''}|{labels or ''}"
        self._native = _native.hdf5(
            self.path, options, lambda: _hdf5.layout(self.path, dataset, labels), index_dir, emulated, index_path
        )

    @property
    def dtype(self) -> np.dtype:
        """The stored element type of a sample (numpy)."""
        return self._meta()[0]

    @property
    def sample_shape(self) -> tuple:
        """The shape of one sample."""
        return self._meta()[1]

    def _meta(self):
        if getattr(self, "_dtype_shape", None) is None:
            from . import _hdf5

            self._dtype_shape = _hdf5.sample_meta(self.path, self.dataset)
        return self._dtype_shape

    def __repr__(self):
        return f"Hdf5({self.path!r}, {len(self)} samples)"


def _container_kind(path: str) -> str | None:
    """Which container ``path`` is, judged by its name and (for directories) its files."""
    low = path.lower()
    if os.path.isfile(path):
        if low.endswith(".mdb"):
            return "lmdb"
        if low.endswith(".tar"):
            return "tar"
        if low.endswith((".h5", ".hdf5")):
            return "hdf5"
        return None
    if os.path.isfile(os.path.join(path, "data.mdb")):
        return "lmdb"
    try:
        names = [e.name for e in os.scandir(path) if e.is_file()]
        has_dirs = any(e.is_dir() for e in os.scandir(path))
    except OSError:
        return None
    if names and not has_dirs:
        if all(n.endswith(".tar") for n in names):
            return "tar"
        if all(n.lower().endswith((".h5", ".hdf5")) for n in names):
            return "hdf5"
    return None


def as_source(source) -> _Source:
    if isinstance(source, _Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        kind = _container_kind(os.fspath(source))
        if kind is not None:
            return {"lmdb": Lmdb, "tar": TarShards, "hdf5": Hdf5}[kind](source)
        if os.path.isdir(source):
            return ImageFolder(source)
        if os.path.isfile(source):
            return FileList(source)
        raise os_error(errno.ENOENT, f"dataset {os.fspath(source)!r} does not exist", os.fspath(source))
    raise ArgumentTypeError(
        f"invalid value for 'source': a path, ImageFolder, FileList, Synthetic, Lmdb, Hdf5 or TarShards, not {type(source).__name__}"
    )


def EmulatedFs(state_path, open_latency_ms: float = 0.0, bandwidth_mbps: float = 100.0):
    """An emulated shared file system: per-open latency and an aggregate bandwidth shared by every
    process that opens the same ``state_path``. Pass it as ``emulated=`` to a source."""
    return _native.EmulatedFs(_fspath(state_path, "state_path"), _number(open_latency_ms, "open_latency_ms"), _number(bandwidth_mbps, "bandwidth_mbps"))


def _iterable(values, name: str):
    try:
        return iter(values)
    except TypeError:
        raise ArgumentTypeError(f"invalid value for '{name}': expected a sequence, not {type(values).__name__}") from None


def _fspath(value, name: str) -> str:
    """os.fspath(value) as str (bytes decoded as os.fsdecode does), or ArgumentTypeError naming
    the argument."""
    try:
        return os.fsdecode(value)
    except TypeError:
        raise ArgumentTypeError(f"invalid value for '{name}': expected a path, not {type(value).__name__}") from None


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"invalid value for '{name}': expected a number, not {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"invalid value for '{name}': {value} is too large") from None
