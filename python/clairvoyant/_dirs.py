"""This user's private folders on the machine: the one implementation is the core's
(``tier::secure``); this module only names it, and imports nothing else, so that a launcher
(``clairvoyant run``) finds its agent's folder without importing the cluster's modules."""

from __future__ import annotations

import os

from . import _native


def user_runtime_dir() -> str:
    """A per-user private directory on this machine: ``clairvoyant-<uid>`` under
    ``CLAIRVOYANT_SHM_DIR``, else /dev/shm, else the temporary directory. If another user took
    that name (or planted a symlink or a file there), the next of ``clairvoyant-<uid>.1``,
    ``.2``, ... that is ours is used with a warning naming the refused path, as the Job API does
    (every process of this user walks the same sequence, so they still meet); after 8 refusals
    the error names the first (``tier::secure::private_dir``)."""
    return os.fsdecode(_native.user_runtime_dir())


def temp_dir() -> str:
    """The temporary directory as :func:`tempfile.gettempdir` finds it (``TMPDIR``, ``TEMP``,
    ``TMP``, then /tmp, /var/tmp, /usr/tmp, the current folder: the first this user may write
    in), without importing :mod:`tempfile` (with :mod:`shutil` and :mod:`random`, 3 ms of a
    launcher's start)."""
    names = [os.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")]
    for d in [*(n for n in names if n), "/tmp", "/var/tmp", "/usr/tmp", os.curdir]:
        if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return os.path.abspath(d)
    raise _native.ConfigError("no usable temporary directory: set TMPDIR to a folder this user may write in")


def private_dir(path: str, create: bool = True, tighten: bool = False) -> str:
    """``path`` (made absolute) as a directory owned by this user with no group or other
    permissions: created so, parents included, when missing and ``create``; anything else (a
    symlink, a file, a directory of another user, one of ours others may enter unless
    ``tighten``, which closes it) is refused with ``AccessDeniedError`` naming it (the core's
    rule, ``tier::secure::private_dir_at``)."""
    return os.fsdecode(_native.private_dir(os.path.abspath(path), create, tighten))
