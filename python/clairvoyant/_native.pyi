"""Type stubs of the private native module. Use the public API in `clairvoyant` instead."""

from typing import Callable, Optional, Sequence

import numpy as np
import numpy.typing as npt

# The exception classes are those of clairvoyant.errors, re-exported.
from .errors import (
    AccessDeniedError as AccessDeniedError,
    AlreadyExistsError as AlreadyExistsError,
    ArgumentTypeError as ArgumentTypeError,
    CancelledError as CancelledError,
    CapacityError as CapacityError,
    ClairvoyantError as ClairvoyantError,
    ClairvoyantOSError as ClairvoyantOSError,
    ConfigError as ConfigError,
    CorruptError as CorruptError,
    DatasetChangedError as DatasetChangedError,
    EpochConsumedError as EpochConsumedError,
    EpochOutOfRangeError as EpochOutOfRangeError,
    ExhaustedError as ExhaustedError,
    IndexMismatchError as IndexMismatchError,
    IsDirectoryError as IsDirectoryError,
    NotDirectoryError as NotDirectoryError,
    NotFoundError as NotFoundError,
    OutOfRangeError as OutOfRangeError,
    SimulationStalledError as SimulationStalledError,
    TimedOutError as TimedOutError,
    os_error as os_error,
)

def access_stream(
    num_samples: int, world_size: int, rank: int, epochs: int, batch_size: int, seed: int, drop_last: bool = False
) -> list[npt.NDArray[np.int64]]: ...
def access_stream_from_order(
    num_samples: int, orders: Sequence[Sequence[int]], world_size: int, rank: int, batch_size: int, drop_last: bool = False
) -> list[npt.NDArray[np.int64]]: ...
def plan_report(
    num_samples: int,
    world_size: int,
    epochs: int,
    batch_size: int,
    seed: int,
    ranks: Sequence[int],
    sample_bytes: Sequence[int],
    classes: Sequence[tuple[str, int]],
    drop_last: bool = False,
) -> str: ...

class Source:
    def __len__(self) -> int: ...
    def size(self, sample: int) -> int: ...
    def label(self, sample: int) -> int: ...
    def path(self, sample: int) -> str: ...
    def total_bytes(self) -> int: ...
    def labels(self) -> list[int]: ...
    def paths(self) -> list[str]: ...
    def classes(self) -> list[str]: ...
    @property
    def fingerprint(self) -> int: ...
    def read(self, sample: int) -> bytes: ...
    def shape(self, sample: int) -> list[int]: ...

def synthetic_source(sizes: Sequence[int], labels: Optional[Sequence[int]] = None) -> Source: ...
def image_folder(root: str, index_dir: Optional[str] = None, emulated: Optional["EmulatedFs"] = None) -> Source: ...
def file_list(
    paths: Sequence[str], labels: Sequence[int], index_dir: Optional[str] = None, emulated: Optional["EmulatedFs"] = None
) -> Source: ...
def parse_list_file(path: str) -> tuple[list[str], list[int]]: ...
def lmdb(
    path: str,
    caffe: bool = True,
    index_dir: Optional[str] = None,
    emulated: Optional["EmulatedFs"] = None,
    index_path: Optional[str] = None,
) -> Source: ...
def tar_shards(
    paths: Sequence[str],
    data_ext: Optional[str] = None,
    index_dir: Optional[str] = None,
    emulated: Optional["EmulatedFs"] = None,
    index_path: Optional[str] = None,
) -> Source: ...
def hdf5(
    path: str,
    options: str,
    layout: Callable[[], tuple],
    index_dir: Optional[str] = None,
    emulated: Optional["EmulatedFs"] = None,
    index_path: Optional[str] = None,
) -> Source: ...
def default_index_dir() -> str: ...

class EmulatedFs:
    def __init__(self, state_path: str, open_latency_ms: float, bandwidth_mbps: float) -> None: ...
    def read(self, path: str) -> bytes: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def files_read(self) -> int: ...
    def reset(self) -> None: ...

class Engine:
    def __init__(
        self,
        source: Source,
        batch_size: int,
        epochs: int,
        seed: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        local_ranks: Sequence[int],
        run_id: str,
        model_toml: Optional[str] = None,
        orders: Optional[Sequence[Sequence[int]]] = None,
    ) -> None: ...
    def begin_epoch(self, epoch: int) -> None: ...
    def next_sample(self) -> tuple[npt.NDArray[np.uint8], int]: ...
    def next_batch(self, n: int) -> tuple[list[npt.NDArray[np.uint8]], npt.NDArray[np.int64]]: ...
    def epoch_samples(self, epoch: int) -> npt.NDArray[np.int64]: ...
    def batch_ends(self, epoch: int) -> npt.NDArray[np.int64]: ...
    def append_epoch(self, samples: npt.ArrayLike, batch_sizes: Sequence[int]) -> int: ...
    @property
    def held_samples(self) -> int: ...
    @property
    def epochs(self) -> int: ...
    @property
    def position(self) -> int: ...
    def epoch_start(self, epoch: int) -> int: ...
    def placement(self) -> list[tuple[str, int, int]]: ...
    def stats(self) -> list[dict]: ...
    def close(self) -> None: ...

# -- simulator ---------------------------------------------------------------------------------

def sim_presets() -> list[str]: ...
def sim_policies() -> list[str]: ...
def sim_scenario_toml(scenario: str, sets: Sequence[tuple[str, str]] = ...) -> str: ...

class Simulation:
    """A simulation running on its own thread; the result is JSON text."""

    def __init__(
        self,
        scenario: str,
        policies: Sequence[str] = ...,
        sets: Sequence[tuple[str, str]] = ...,
        sizes: Optional[Sequence[int]] = None,
        sweep: Sequence[tuple[str, Sequence[str]]] = ...,
    ) -> None: ...
    def progress(self) -> tuple[int, int]: ...
    def finished(self) -> bool: ...
    def cancel(self) -> None: ...
    def result(self, timeout: Optional[float] = None) -> Optional[str]: ...

# Native decode (crate clairvoyant-decode); see docs/decode.md. ops are tuples:
# ("random_resized_crop", h, w, (scale_lo, scale_hi), (ratio_lo, ratio_hi), interpolation),
# ("hflip", p), ("resize", [size] | [h, w], max_size | None, interpolation), ("center_crop", h, w);
# interpolation "bilinear" | "bicubic".
class DecodePipeline:
    def __init__(
        self,
        ops: Sequence[tuple],
        output: str,  # "uint8_hwc" | "uint8_chw" | "float32_chw"
        mean: Optional[Sequence[float]] = None,
        std: Optional[Sequence[float]] = None,
        exif_orientation: bool = False,
        threads: int = 0,
    ) -> None: ...
    @property
    def sample_shape(self) -> tuple[int, int, int]: ...
    @property
    def threads(self) -> int: ...
    def run(
        self,
        inputs: Sequence[bytes | npt.NDArray[np.uint8]],
        samples: Sequence[int],
        seed: int,
        epoch: int,
        out: npt.NDArray[np.uint8] | npt.NDArray[np.float32],
        names: Optional[Sequence[str]] = None,
    ) -> None: ...

def random_resized_crop_params(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], seed: int, epoch: int, sample: int
) -> tuple[int, int, int, int]: ...
