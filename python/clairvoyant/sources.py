"""Dataset sources a Job can read: an ImageFolder directory, a list of files with labels, or
synthetic bytes. Any of them can be read through an emulated shared file system."""

from __future__ import annotations

import errno
import numbers
import operator
import os
from typing import Sequence

import numpy as np

from . import _native
from .errors import ArgumentTypeError, ConfigError, os_error


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


def as_source(source) -> _Source:
    if isinstance(source, _Source):
        return source
    if isinstance(source, (str, os.PathLike)):
        if os.path.isdir(source):
            return ImageFolder(source)
        if os.path.isfile(source):
            return FileList(source)
        raise os_error(errno.ENOENT, f"dataset {os.fspath(source)!r} does not exist", os.fspath(source))
    raise ArgumentTypeError(
        f"invalid value for 'source': a path, ImageFolder, FileList or Synthetic, not {type(source).__name__}"
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
