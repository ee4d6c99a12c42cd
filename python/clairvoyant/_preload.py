"""The interposed I/O library of transparent mode (``libclairvoyant_preload.so``, docs/transparent.md).

A program started with ``LD_PRELOAD=<preload_library()>``, ``CLAIRVOYANT_ROOT=<dataset root>`` and
``CLAIRVOYANT_AGENT=<agent socket>`` reads the files under the root from the node agent's cache;
everything else it does goes to libc unchanged. ``preload_env`` builds that environment.
"""

from __future__ import annotations

import errno
import os

from . import _native
from .errors import os_error

LIBRARY_NAME = "libclairvoyant_preload.so"
ENV_ROOT = "CLAIRVOYANT_ROOT"
ENV_AGENT = "CLAIRVOYANT_AGENT"
ENV_TIMEOUT_MS = "CLAIRVOYANT_AGENT_TIMEOUT_MS"

# Order of the counters in the agent's shared directory and in clairvoyant_preload_counter(i)
# (`clairvoyant_agent::dir::counter::NAMES`).
COUNTERS = tuple(_native.AGENT_COUNTERS)


def preload_library() -> str:
    """Absolute path of ``libclairvoyant_preload.so`` shipped next to this module.

    Raises ``NotFoundError`` (a ``FileNotFoundError``) naming the expected path when it was not built (``./dev build`` builds
    and installs it there)."""
    path = os.path.join(os.path.dirname(os.path.realpath(__file__)), LIBRARY_NAME)
    if not os.path.isfile(path):
        raise os_error(
            errno.ENOENT,
            f"{path}: the interposed I/O library is not installed; build it with ./dev build "
            f"(or: cargo build --release -p clairvoyant-preload && cp target/release/{LIBRARY_NAME} {path})",
            path,
        )
    return path


def preload_env(root: str | os.PathLike, agent: str | os.PathLike, env: dict | None = None, library: str | None = None) -> dict:
    """A copy of ``env`` (default: ``os.environ``) that runs programs under the interposed library:
    ``LD_PRELOAD`` gains the library (kept first), ``CLAIRVOYANT_ROOT`` and ``CLAIRVOYANT_AGENT`` are set."""
    out = dict(os.environ if env is None else env)
    lib = library or preload_library()
    others = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split() if p and p != lib]
    out["LD_PRELOAD"] = " ".join([lib, *others])
    out[ENV_ROOT] = os.path.abspath(os.fspath(root))
    out[ENV_AGENT] = os.fspath(agent)
    return out


def read_counters(dir_path: str | os.PathLike) -> dict:
    """The shared counters of an agent's directory file (summed over every interposed process);
    ValueError naming the file when it is not one."""
    return dict(_native.agent_dir_counters(os.fspath(dir_path)))
