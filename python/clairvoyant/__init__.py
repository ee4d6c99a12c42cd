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
from .job import Job
from ._preload import preload_library
from .simulator import SimulationResult, SweepResult, simulate
from .sources import EmulatedFs, FileList, ImageFolder, Synthetic
from .sources import Hdf5, Lmdb, TarShards

try:
    from importlib.metadata import PackageNotFoundError as _NoMetadata
    from importlib.metadata import version as _version

    __version__ = _version("clairvoyant")
except _NoMetadata:  # a source tree on sys.path without an installed distribution
    __version__ = "0.1.0"

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
    # `clairvoyant.torch` without importing torch for users who do not need it.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'clairvoyant' has no attribute {name!r}")
