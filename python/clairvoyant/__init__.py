"""clairvoyant: clairvoyant prefetching and node-level caching for machine-learning training I/O.

    job = clairvoyant.Job("/data/imagenet/train", batch_size=64, epochs=90)
    for sample, label in job.epoch(0):
        ...
"""

from . import errors
from .errors import (
    AccessDeniedError,
    AlreadyExistsError,
    ArgumentTypeError,
    CancelledError,
    CapacityError,
    ClairvoyantError,
    ClairvoyantOSError,
    ConfigError,
    ConnectionFailedError,
    CorruptError,
    DatasetChangedError,
    EpochConsumedError,
    EpochOutOfRangeError,
    ExhaustedError,
    IndexMismatchError,
    IsDirectoryError,
    NotDirectoryError,
    NotFoundError,
    OutOfRangeError,
    SimulationStalledError,
    TimedOutError,
)

# After .errors: the native module imports it and re-exports those classes.
from ._native import access_stream, access_stream_from_order

# Not `from typing import TYPE_CHECKING`: importing typing costs every start of the package
# (`clairvoyant run` included) about 7 ms, and type checkers read this name as true.
TYPE_CHECKING = False

if TYPE_CHECKING:
    from ._preload import preload_library
    from .job import Job
    from .simulator import SimulationResult, SweepResult, simulate
    from .sources import EmulatedFs, FileList, Hdf5, ImageFolder, Lmdb, Synthetic, TarShards

    __version__: str

# Imported at first use: `clairvoyant run`, the agent and the sampler hook import the package
# for a few of its modules, and the rest (the job, numpy, the simulator) would cost every one of
# them 0.1 s before the program starts.
_LAZY = {
    "Job": ".job",
    "preload_library": "._preload",
    "SimulationResult": ".simulator",
    "SweepResult": ".simulator",
    "simulate": ".simulator",
    "EmulatedFs": ".sources",
    "FileList": ".sources",
    "ImageFolder": ".sources",
    "Synthetic": ".sources",
    "Hdf5": ".sources",
    "Lmdb": ".sources",
    "TarShards": ".sources",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clairvoyant")
    except PackageNotFoundError:  # a source tree on sys.path without an installed distribution
        return "0.1.0"

__all__ = [
    "Job",
    "preload_library",
    "ImageFolder",
    "FileList",
    "Synthetic",
    "Lmdb",
    "Hdf5",
    "TarShards",
    "EmulatedFs",
    "simulate",
    "SimulationResult",
    "SweepResult",
    "access_stream",
    "access_stream_from_order",
    "errors",
    "ClairvoyantError",
    "ConfigError",
    "CapacityError",
    "ArgumentTypeError",
    "OutOfRangeError",
    "DatasetChangedError",
    "IndexMismatchError",
    "CorruptError",
    "ExhaustedError",
    "EpochOutOfRangeError",
    "EpochConsumedError",
    "CancelledError",
    "SimulationStalledError",
    "ClairvoyantOSError",
    "NotFoundError",
    "AccessDeniedError",
    "IsDirectoryError",
    "NotDirectoryError",
    "AlreadyExistsError",
    "TimedOutError",
    "ConnectionFailedError",
]


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name == "__version__":
        value = _version()
    elif not name.startswith("__"):
        # A submodule (`clairvoyant.torch` without importing torch for users who do not need it,
        # `clairvoyant.sources`, ...), as if the package had imported it.
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'clairvoyant' has no attribute {name!r}") from None
        return value
    else:
        raise AttributeError(f"module 'clairvoyant' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"__version__"})
