"""clairvoyant: clairvoyant prefetching and node-level caching for machine-learning training I/O.

    job = clairvoyant.Job("/data/imagenet/train", batch_size=64, epochs=90)
    for sample, label in job.epoch(0):
        ...
"""

from . import _native
from ._native import (
    CancelledError,
    CapacityError,
    ClairvoyantError,
    ConfigError,
    DatasetChangedError,
    ExhaustedError,
    IndexMismatchError,
    access_stream,
    access_stream_from_order,
)
from .job import Job
from .simulator import SimulationResult, SweepResult, simulate
from .sources import EmulatedFs, FileList, ImageFolder, Synthetic

__version__ = "0.1.0"

__all__ = [
    "Job",
    "ImageFolder",
    "FileList",
    "Synthetic",
    "EmulatedFs",
    "simulate",
    "SimulationResult",
    "SweepResult",
    "access_stream",
    "access_stream_from_order",
    "ClairvoyantError",
    "ConfigError",
    "CapacityError",
    "DatasetChangedError",
    "IndexMismatchError",
    "ExhaustedError",
    "CancelledError",
]


def __getattr__(name):
    # `clairvoyant.torch` without importing torch for users who do not need it.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'clairvoyant' has no attribute {name!r}")
