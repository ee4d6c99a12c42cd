"""Exceptions clairvoyant raises.

Every one derives from :class:`ClairvoyantError` and from the built-in that matches it, so both
``except clairvoyant.ClairvoyantError`` and ``except FileNotFoundError`` (or ``ValueError``, ...)
work::

    ClairvoyantError
    ├── ConfigError                (ValueError)         an invalid argument or setting; names it
    ├── CapacityError              (ValueError)         a sample does not fit a buffer
    ├── ArgumentTypeError          (TypeError)          an argument of the wrong type
    ├── OutOfRangeError            (IndexError)         a sample number past the dataset
    ├── DatasetChangedError        (RuntimeError)       a file changed after it was indexed
    ├── IndexMismatchError         (RuntimeError)       an index file of another dataset, or damaged
    ├── CorruptError               (RuntimeError)       cached bytes do not match their checksum
    ├── ExhaustedError             (RuntimeError)       every epoch of the job was consumed
    │   ├── EpochOutOfRangeError   (IndexError)         an epoch the job does not have
    │   └── EpochConsumedError                          an epoch that was already consumed
    ├── CancelledError             (RuntimeError)       the job was closed while waiting
    ├── SimulationStalledError     (RuntimeError)       a simulated run could not make progress
    └── ClairvoyantOSError         (OSError)            I/O, with ``errno`` and ``filename`` set
        ├── NotFoundError          (FileNotFoundError)
        ├── AccessDeniedError      (PermissionError)
        ├── IsDirectoryError       (IsADirectoryError)
        ├── NotDirectoryError      (NotADirectoryError)
        ├── AlreadyExistsError     (FileExistsError)
        ├── TimedOutError          (TimeoutError)
        └── ConnectionFailedError  (ConnectionError)    a node agent or peer could not be reached

The native module raises these very classes (``clairvoyant._native.ConfigError`` is
``clairvoyant.ConfigError``).
"""

from __future__ import annotations

import errno as _errno


class ClairvoyantError(Exception):
    """Base class of every exception clairvoyant raises."""


class ConfigError(ClairvoyantError, ValueError):
    """An invalid configuration value or argument; the message names the field."""


class CapacityError(ClairvoyantError, ValueError):
    """A sample is larger than a buffer it must pass through."""


class ArgumentTypeError(ClairvoyantError, TypeError):
    """An argument of a type clairvoyant does not accept."""


class OutOfRangeError(ClairvoyantError, IndexError):
    """A sample number outside the dataset."""


class DatasetChangedError(ClairvoyantError, RuntimeError):
    """The dataset changed after it was indexed."""


class IndexMismatchError(ClairvoyantError, RuntimeError):
    """An index file belongs to another dataset or is damaged."""


class CorruptError(ClairvoyantError, RuntimeError):
    """Bytes from a cache tier do not match the checksum recorded when the sample was read, or a
    container (LMDB, HDF5, tar) is damaged or truncated (the message names it and the record)."""


class ExhaustedError(ClairvoyantError, RuntimeError):
    """Consumption went past the end of the job: every epoch was consumed."""


class EpochOutOfRangeError(ExhaustedError, IndexError):
    """An epoch the job does not have: past its last epoch or before its start epoch."""


class EpochConsumedError(ExhaustedError):
    """An epoch that was already consumed (epochs are consumed in order)."""


class CancelledError(ClairvoyantError, RuntimeError):
    """The job was closed while waiting."""


class SimulationStalledError(ClairvoyantError, RuntimeError):
    """A simulated run stopped because no simulated thread could make progress."""


class ClairvoyantOSError(ClairvoyantError, OSError):
    """Reading or writing a file failed; ``errno`` and ``filename`` are set."""

    def __str__(self):
        # The message already names the file; OSError's own format would repeat it.
        return self.strerror if self.strerror is not None else super().__str__()


class NotFoundError(ClairvoyantOSError, FileNotFoundError):
    """A file (a sample, a dataset, an index) does not exist."""


class AccessDeniedError(ClairvoyantOSError, PermissionError):
    """Permission to a file was denied."""


class IsDirectoryError(ClairvoyantOSError, IsADirectoryError):
    """A directory where a file was expected."""


class NotDirectoryError(ClairvoyantOSError, NotADirectoryError):
    """A file where a directory was expected."""


class AlreadyExistsError(ClairvoyantOSError, FileExistsError):
    """A file exists where clairvoyant must create its own."""


class TimedOutError(ClairvoyantOSError, TimeoutError):
    """Waiting on a file or another process timed out."""


class ConnectionFailedError(ClairvoyantOSError, ConnectionError):
    """A node agent or a peer could not be reached, or its connection broke."""


_BY_ERRNO = {
    _errno.ENOENT: NotFoundError,
    _errno.EACCES: AccessDeniedError,
    _errno.EPERM: AccessDeniedError,
    _errno.EISDIR: IsDirectoryError,
    _errno.ENOTDIR: NotDirectoryError,
    _errno.EEXIST: AlreadyExistsError,
    _errno.ETIMEDOUT: TimedOutError,
    _errno.ECONNREFUSED: ConnectionFailedError,
    _errno.ECONNRESET: ConnectionFailedError,
    _errno.ECONNABORTED: ConnectionFailedError,
    _errno.ENOTCONN: ConnectionFailedError,
    _errno.EPIPE: ConnectionFailedError,
}


def os_error(code: int | None, message: str, filename=None) -> ClairvoyantOSError:
    """The clairvoyant exception for an OS error number (as ``OSError(errno, ...)`` picks a
    subclass), with ``errno``, ``strerror`` and ``filename`` set; ``str()`` is ``message``."""
    cls = _BY_ERRNO.get(code, ClairvoyantOSError) if code is not None else ClairvoyantOSError
    e = cls(code, message)
    if filename is not None:
        e.filename = filename
    return e


__all__ = [
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
    "os_error",
]
