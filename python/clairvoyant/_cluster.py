"""Rendezvous on the launcher's own machinery, the job secret, and where this node listens.

Nothing here starts a service: every function reuses what the launcher already runs.

- :func:`allgather` hands every rank's payload to every rank. Backends, the first that applies
  (or ``backend=``, or ``CLAIRVOYANT_RENDEZVOUS=store|mpi|file``):

  ``store``  a TCPStore client on ``MASTER_ADDR:MASTER_PORT`` when torchrun's agent hosts one
             there (``TORCHELASTIC_USE_AGENT_STORE=True``), else the store of an initialized
             ``torch.distributed`` process group. This process hosts the store itself only
             when ``CLAIRVOYANT_STORE_MASTER=1``, it is rank 0 and nothing listens on that port
             yet (a later ``init_process_group`` on the same port would then fail, hence opt-in).
             Keys live under ``clairvoyant/<run>/<generation>/``: every rank writes its own,
             rank 0 gathers them into one value that the others read (a constant number of
             requests per rank); rank 0 and the last rank to read delete them.
  ``mpi``    ``mpi4py`` is importable, an MPI launcher started this process (or ``mpi4py.MPI`` is
             already imported) and ``COMM_WORLD`` has this rank and world size.
  ``file``   a shared directory: ``CLAIRVOYANT_SHARED_DIR``, else ``~/.cache/clairvoyant/rendezvous``
             under Slurm (``SLURM_JOB_ID`` set). It must be a 0700 directory owned by this user;
             payloads are written to a temporary file and renamed (mode 0600).

  ``generation`` counts the calls of one run in this process (every rank calls in the same order,
  so the counts agree); a torchrun restart (``TORCHELASTIC_RESTART_COUNT``) is part of the run.
- :func:`job_secret` is the per-job secret that authenticates peers. It never travels through
  the store (which anyone who can reach the port can read).
- :func:`listen_address` is the local address of the interface that reaches the other nodes.
- :func:`node_id` tells which node a process is on.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import re
import secrets
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

from . import _native, _settings
from ._dirs import private_dir as _private_dir
from ._dirs import user_runtime_dir as _user_runtime_dir
from .errors import ClairvoyantError, ConfigError, CorruptError

BACKENDS = ("store", "mpi", "file")
SECRET_BYTES = 32
# After this long a waiting rank says once, on stderr, which ranks it still waits for.
PROGRESS_AFTER_S = 5.0
# Polling a shared directory backs off from 1 ms to this (no busy loop; NFS has no inotify).
_MAX_SLEEP_S = 0.05
# Each pause of a poll is this much longer than the one before.
_SLEEP_GROWTH = 1.25
_MPI_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_MAGIC = b"CVRDV1\0\0"
_HEADER = struct.Struct("<8sQQQ")  # magic, rank, world size, payload length
_SECRET_DOMAIN = b"clairvoyant job secret v1\0"


def _pauses():
    """The pauses of a poll for what another process will do: 1 ms, then each a quarter longer
    than the last, up to _MAX_SLEEP_S. A wait then overshoots the moment it could end by at most
    a quarter of its length (doubling let it overshoot by its whole length: 30 ms on a 30 ms
    rendezvous), for about ten more polls in its first 0.2 s."""
    pause = 0.001
    while True:
        yield pause
        pause = min(pause * _SLEEP_GROWTH, _MAX_SLEEP_S)

_generations: dict = {}
_stores: dict = {}


class RendezvousError(ClairvoyantError, RuntimeError):
    """Ranks could not meet: some did not show up in time, or the meeting place is unusable.

    ``missing`` lists the ranks that did not show up (empty when unknown), ``backend`` names the
    backend and ``where`` the store address, key prefix or directory."""

    def __init__(self, message: str, *, missing=(), backend: str = "", where: str = "", timeout: float | None = None):
        super().__init__(message)
        self.missing = list(missing)
        self.backend = backend
        self.where = where
        self.timeout = timeout


# -- helpers -----------------------------------------------------------------------------------


def _env():
    return os.environ


def _ranks_text(ranks: list, world_size: int) -> str:
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(str(r) for r in ranks)} of {world_size}"


def _run_segment(run_id: str) -> str:
    """The run's part of key and file names: the run id (``default`` when empty) and torchrun's
    restart count, restricted to characters safe in a file name."""
    # Without a run id, PMIx's namespace (Open MPI 5, Slurm with PMIx) still tells runs apart.
    run = run_id or _env().get("PMIX_NAMESPACE") or "default"
    restart = _env().get("TORCHELASTIC_RESTART_COUNT", "")
    if restart not in ("", "0"):
        run = f"{run}.restart{restart}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", run)


def _next_generation(run: str) -> int:
    g = _generations.get(run, 0)
    _generations[run] = g + 1
    return g


def _check_args(rank: int, world_size: int, timeout: float) -> None:
    if world_size < 1:
        raise ConfigError(f"invalid value for 'world_size': {world_size} (at least 1)")
    if not 0 <= rank < world_size:
        raise ConfigError(f"invalid value for 'rank': {rank} is outside world size {world_size}")
    if not timeout > 0:
        raise ConfigError(f"invalid value for 'timeout': {timeout} s (must be positive)")


class _Progress:
    """Says once, after PROGRESS_AFTER_S, who is still missing."""

    def __init__(self, rank: int, world_size: int, backend: str, where: str):
        self.start = time.monotonic()
        self.said = False
        self.rank, self.world_size, self.backend, self.where = rank, world_size, backend, where

    def tick(self, missing) -> None:
        if self.said or time.monotonic() - self.start < PROGRESS_AFTER_S:
            return
        self.said = True
        print(
            f"clairvoyant: rank {self.rank}: waiting for {_ranks_text(list(missing), self.world_size)} "
            f"(backend {self.backend} at {self.where})",
            file=sys.stderr,
            flush=True,
        )


def _timeout_error(missing, world_size, timeout, backend, where) -> RendezvousError:
    missing = sorted(missing)
    who = _ranks_text(missing, world_size) if missing else "some ranks"
    return RendezvousError(
        f"{who} did not join within {timeout:g} s (backend {backend} at {where})",
        missing=missing,
        backend=backend,
        where=where,
        timeout=timeout,
    )


# -- backend choice ------------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _process_group_store():
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a torch without this private accessor
        return None


def _store_applies(rank: int) -> bool:
    if _process_group_store() is not None:
        return True
    env = _env()
    if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        return False
    return _truthy(env.get("TORCHELASTIC_USE_AGENT_STORE")) or _settings.get("CLAIRVOYANT_STORE_MASTER", False, env)


def _mpi_comm(rank: int, world_size: int):
    """MPI's COMM_WORLD when MPI started this process with this rank and world size, else None."""
    env = _env()
    if "mpi4py.MPI" not in sys.modules and not any(env.get(v) for v in _MPI_LAUNCH_VARS):
        return None
    try:
        from mpi4py import MPI  # optional; imported only under an MPI launcher
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != world_size or comm.Get_rank() != rank:
        return None
    return comm


def shared_dir() -> str | None:
    """The shared directory for the file backend and the job secret: ``CLAIRVOYANT_SHARED_DIR``,
    else ``~/.cache/clairvoyant/rendezvous`` under Slurm, else None."""
    env = _env()
    if _settings.get("CLAIRVOYANT_SHARED_DIR", None, env):
        return _settings.get("CLAIRVOYANT_SHARED_DIR", None, env)
    if env.get("SLURM_JOB_ID"):
        return os.path.join(os.path.expanduser("~"), ".cache", "clairvoyant", "rendezvous")
    return None


def choose_backend(rank: int, world_size: int, backend: str | None = None) -> str:
    """The backend :func:`allgather` uses: ``backend``, else ``CLAIRVOYANT_RENDEZVOUS``, else
    the first of store, mpi, file that applies; ``"local"`` for one rank."""
    chosen = backend or _env().get("CLAIRVOYANT_RENDEZVOUS") or None
    if chosen is not None:
        if chosen not in BACKENDS:
            raise ConfigError(
                f"invalid value for 'backend' (or CLAIRVOYANT_RENDEZVOUS): {chosen!r}; expected one of {', '.join(BACKENDS)}"
            )
        return chosen
    if world_size == 1:
        return "local"
    if _store_applies(rank):
        return "store"
    if _mpi_comm(rank, world_size) is not None:
        return "mpi"
    if shared_dir() is not None:
        return "file"
    raise ConfigError(
        f"rank {rank} of {world_size}: no way for the ranks to meet: no initialized torch.distributed "
        "process group, no torchrun agent store (MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE), "
        "no MPI launch with mpi4py, and no shared directory (CLAIRVOYANT_SHARED_DIR, or Slurm's SLURM_JOB_ID); "
        "set one, or CLAIRVOYANT_RENDEZVOUS=store|mpi|file"
    )


# -- allgather ---------------------------------------------------------------------------------


def allgather(
    payload: bytes,
    *,
    rank: int,
    world_size: int,
    run_id: str,
    timeout: float = 120.0,
    backend: str | None = None,
    cancel=None,
) -> list:
    """Every rank's ``payload``, indexed by rank. Every rank of the run must call it, in the same
    order as its other calls. Raises :class:`RendezvousError` naming the ranks that did not
    show up within ``timeout`` seconds. ``cancel`` (a :class:`threading.Event`, file backend):
    once set, the call gives up at once (RendezvousError) and takes this rank's file back."""
    _check_args(rank, world_size, timeout)
    payload = bytes(payload)
    chosen = choose_backend(rank, world_size, backend)
    if chosen == "local":
        return [payload]
    run = _run_segment(run_id)
    generation = _next_generation(run)
    if chosen == "store":
        return _allgather_store(payload, rank, world_size, run, generation, timeout)
    if chosen == "mpi":
        return _allgather_mpi(payload, rank, world_size, timeout)
    return _allgather_file(payload, rank, world_size, run, generation, timeout, cancel)


# store ----------------------------------------------------------------------------------------


def _store(rank: int, timeout: float):
    """(store, description) for the store backend. torchrun's agent store comes first, also when
    a process group is initialized: the group's store is that store behind a prefix, and ranks
    that call before and after initializing must meet under the same keys."""
    env = _env()
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    agent = _truthy(env.get("TORCHELASTIC_USE_AGENT_STORE")) and addr and port
    pg = None if agent else _process_group_store()
    if pg is not None:
        return pg, "the torch.distributed process group"
    if not (addr and port):
        raise ConfigError(
            "the store rendezvous needs an initialized torch.distributed process group or MASTER_ADDR and MASTER_PORT"
        )
    try:
        port_n = int(port)
    except ValueError as exc:
        raise ConfigError(f"environment variable MASTER_PORT={port!r} is not a port number") from exc
    where = f"{addr}:{port_n}"
    key = (os.getpid(), addr, port_n)
    if key in _stores:
        return _stores[key], where
    from torch.distributed import TCPStore

    store = None
    if rank == 0 and _settings.get("CLAIRVOYANT_STORE_MASTER", False, env) and not _truthy(env.get("TORCHELASTIC_USE_AGENT_STORE")):
        try:
            store = TCPStore(addr, port_n, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout))
        except Exception:  # the port is taken: a store exists already; join it as a client
            store = None
    if store is None:
        try:
            store = TCPStore(addr, port_n, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:
            raise RendezvousError(
                f"rank {rank}: could not reach the store at {where} within {timeout:g} s ({exc}); "
                "is torchrun's agent store there (TORCHELASTIC_USE_AGENT_STORE), or set CLAIRVOYANT_STORE_MASTER=1 "
                "so that rank 0 hosts one",
                backend="store",
                where=where,
                timeout=timeout,
            ) from exc
    _stores[key] = store
    return store, where


def _wait_keys(store, keys, deadline, step_done, on_timeout):
    """Wait until every key of ``keys`` exists, in steps of at most PROGRESS_AFTER_S: after each
    step that times out ``step_done()`` may say the wait is over, else ``on_timeout(left)``
    reports progress (or raises). One ``wait`` request covers all the keys."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            on_timeout(0.0)
            return
        try:
            store.wait(keys, datetime.timedelta(seconds=min(left, PROGRESS_AFTER_S)))
            return
        except Exception:  # timed out (or the store went away: on_timeout's checks say which)
            if step_done():
                return
            on_timeout(deadline - time.monotonic())


def _pack(values: list) -> bytes:
    """Payloads in one value: count, lengths, bytes (little-endian 64-bit integers), deflated
    (zlib level 1) when that is smaller: every rank reads this value, so the store sends it
    world_size times. The first byte says which."""
    raw = struct.pack(f"<Q{len(values)}Q", len(values), *(len(v) for v in values)) + b"".join(values)
    packed = zlib.compress(raw, 1)
    return b"z" + packed if len(packed) < len(raw) else b"r" + raw


def _unpack(blob: bytes, world_size: int) -> list:
    kind, blob = blob[:1], blob[1:]
    if kind == b"z":
        blob = zlib.decompress(blob)
    elif kind != b"r":
        raise CorruptError(f"a rendezvous value in an unknown encoding {kind!r}")
    view = memoryview(blob)
    (n,) = struct.unpack_from("<Q", view)
    if n != world_size:
        raise CorruptError(f"a rendezvous value of {n} payloads for world size {world_size}")
    lengths = struct.unpack_from(f"<{n}Q", view, 8)
    out, at = [], 8 + 8 * n
    for length in lengths:
        out.append(bytes(view[at : at + length]))
        at += length
    if at != len(blob):
        raise CorruptError(f"a rendezvous value of {len(blob)} bytes, the lengths announce {at}")
    return out


class _StoreRound:
    """One allgather through a store: its keys (``clairvoyant/<run>/<generation>/<rank>``, the
    combined ``.../all``), deadline and progress."""

    def __init__(self, rank, world_size, run, generation, timeout):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.deadline = time.monotonic() + timeout
        self.store, self.place = _store(rank, timeout)
        self.prefix = f"clairvoyant/{run}/{generation}/"
        self.where = f"{self.place}, key {self.prefix}"
        self.keys = [f"{self.prefix}{r}" for r in range(world_size)]
        self.combined = f"{self.prefix}all"
        self.progress = _Progress(rank, world_size, "store", self.where)

    def lost(self, exc, what) -> RendezvousError:
        return RendezvousError(f"rank {self.rank}: lost the store at {self.place} while {what}: {exc}", backend="store", where=self.where)

    def missing_ranks(self) -> list:
        # Only after a step timed out: one request per rank, to name who is missing.
        return [r for r in range(self.world_size) if r != self.rank and not self.store.check([self.keys[r]])]

    def on_timeout(self, left, what: str, stuck: list) -> None:
        """A wait step timed out: say who is missing (``stuck`` when nobody is), or fail once
        no time is ``left``."""
        try:
            missing = self.missing_ranks()
        except Exception as exc:
            raise self.lost(exc, what) from exc
        missing = missing or stuck
        if left <= 0:
            raise _timeout_error(missing, self.world_size, self.timeout, "store", self.where)
        self.progress.tick(missing)

    def gather(self) -> list:
        """Rank 0: wait for every rank's key, publish them as one value, remove the keys."""
        store, keys, rank = self.store, self.keys, self.rank
        _wait_keys(store, keys, self.deadline, lambda: False, lambda left: self.on_timeout(left, "waiting for the other ranks", []))
        try:
            values = [bytes(v) for v in store.multi_get(keys)] if hasattr(store, "multi_get") else [bytes(store.get(k)) for k in keys]
            store.set(self.combined, _pack(values))
        except Exception as exc:
            raise RendezvousError(f"rank {rank}: could not gather {self.prefix}* at {self.place}: {exc}", backend="store", where=self.where) from exc
        # Nobody reads the per-rank keys any more: remove them (a store without delete_key keeps them).
        try:
            for k in keys:
                store.delete_key(k)
        except Exception:
            pass
        return values

    def read(self) -> list:
        """Every other rank: wait for rank 0's combined value and read it."""
        store, combined = self.store, self.combined

        def published() -> bool:
            try:
                return store.check([combined])
            except Exception:
                return False

        # Everyone wrote, yet nothing was published: rank 0, the one gathering, is stuck.
        _wait_keys(store, [combined], self.deadline, published, lambda left: self.on_timeout(left, "waiting for rank 0 to gather every rank", [0]))
        try:
            return _unpack(bytes(store.get(combined)), self.world_size)
        except Exception as exc:
            raise RendezvousError(f"rank {self.rank}: could not read {combined} from {self.place}: {exc}", backend="store", where=self.where) from exc

    def finish(self) -> None:
        """The last rank to have read removes the combined value, so a long run does not fill the store."""
        try:
            if self.store.add(f"{self.prefix}done", 1) == self.world_size:
                self.store.delete_key(self.combined)
                self.store.delete_key(f"{self.prefix}done")
        except Exception:  # a store without delete_key keeps them; harmless
            pass


def _allgather_store(payload, rank, world_size, run, generation, timeout):
    """Every rank writes its key; rank 0 waits for all of them (one ``wait`` on every key), reads
    them with one ``multi_get``, publishes them as one value (``all``) and removes the per-rank
    keys; every other rank waits for and reads that one value. Per rank a constant number of
    requests, instead of every rank asking for every other rank's key; the store serves
    world_size values once, and the combined value world_size times."""
    r = _StoreRound(rank, world_size, run, generation, timeout)
    try:
        r.store.set(r.keys[rank], payload)
    except Exception as exc:
        raise RendezvousError(f"rank {rank}: could not write {r.keys[rank]} to {r.place}: {exc}", backend="store", where=r.where) from exc
    values = r.gather() if rank == 0 else r.read()
    values[rank] = payload
    r.finish()
    return values


# mpi ------------------------------------------------------------------------------------------


def _mpi_wait(request, deadline, timeout, what):
    pauses = _pauses()
    while not request.Test():
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{what} did not complete within {timeout:g} s (backend mpi, COMM_WORLD; MPI does not tell which ranks are missing)",
                backend="mpi",
                where="COMM_WORLD",
                timeout=timeout,
            )
        time.sleep(next(pauses))


def _allgather_mpi(payload, rank, world_size, timeout):
    import numpy as np
    from mpi4py import MPI

    comm = _mpi_comm(rank, world_size)
    if comm is None:
        raise ConfigError(
            f"the mpi rendezvous needs mpi4py and an MPI launch whose COMM_WORLD is rank {rank} of {world_size}"
        )
    deadline = time.monotonic() + timeout
    sizes = np.zeros(world_size, dtype=np.int64)
    _mpi_wait(comm.Iallgather(np.array([len(payload)], dtype=np.int64), sizes), deadline, timeout, "MPI allgather of sizes")
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    recv = np.empty(int(sizes.sum()), dtype=np.uint8)
    send = np.frombuffer(payload, dtype=np.uint8)
    _mpi_wait(comm.Iallgatherv(send, [recv, sizes, displs, MPI.BYTE]), deadline, timeout, "MPI allgather")
    out = [recv[displs[r] : displs[r] + sizes[r]].tobytes() for r in range(world_size)]
    out[rank] = payload
    return out


# file -----------------------------------------------------------------------------------------


def _write_atomic(path: str, data: bytes) -> None:
    """``data`` into ``path`` in one step: a temporary file in the same directory, 0600, renamed."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_private(path: str) -> bytes:
    """A file's bytes, refused (``AccessDeniedError``) unless it is a regular file owned by this
    user with mode 0600, never followed through a symbolic link (the core's rule)."""
    return _native.read_private(path)


def _allgather_file(payload, rank, world_size, run, generation, timeout, cancel=None):
    base = shared_dir()
    if base is None:
        raise ConfigError("the file rendezvous needs a shared directory: set CLAIRVOYANT_SHARED_DIR (or run under Slurm)")
    deadline = time.monotonic() + timeout
    base = _private_dir(base)
    _reclaim_stale_rendezvous(base)
    run_dir = os.path.join(base, f"rdv-{run}")
    for _ in range(8):  # the last reader of another call may remove run_dir just as it is made
        try:
            _private_dir(run_dir)
            gen_dir = _private_dir(os.path.join(run_dir, str(generation)))
            break
        except OSError:
            if os.path.lexists(run_dir):
                raise
    else:
        gen_dir = _private_dir(os.path.join(run_dir, str(generation)))
    where = gen_dir
    mine = os.path.join(gen_dir, f"rank-{rank}")
    if os.path.lexists(mine):
        raise RendezvousError(
            f"rank {rank}: {mine} exists already, left by an earlier run with the same run id '{run}'; "
            f"give each run its own id (CLAIRVOYANT_RUN_ID) or remove {run_dir}",
            backend="file",
            where=where,
        )
    _write_atomic(mine, _HEADER.pack(_MAGIC, rank, world_size, len(payload)) + payload)
    progress = _Progress(rank, world_size, "file", where)
    names = {r: f"rank-{r}" for r in range(world_size) if r != rank}
    pauses = _pauses()
    while True:
        present = set(os.listdir(gen_dir))
        missing = [r for r, n in names.items() if n not in present]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise _timeout_error(missing, world_size, timeout, "file", where)
        progress.tick(missing)
        pause = min(next(pauses), max(0.0, deadline - time.monotonic()))
        if cancel is not None and cancel.wait(pause):
            # The caller gave up (a member is gone): nobody alive waits for this file.
            _remove_generation_file(mine, gen_dir, run_dir)
            raise RendezvousError(
                f"rank {rank}: gave up waiting for {_ranks_text(missing, world_size)}", missing=missing, backend="file", where=where
            )
        if cancel is None:
            time.sleep(pause)
    out = []
    for r in range(world_size):
        if r == rank:
            out.append(payload)
            continue
        path = os.path.join(gen_dir, f"rank-{r}")
        data = _read_private(path)
        if len(data) < _HEADER.size:
            raise RendezvousError(f"rank {rank}: {path} is truncated", backend="file", where=where)
        magic, their_rank, their_world, length = _HEADER.unpack_from(data)
        if magic != _MAGIC or their_rank != r or length != len(data) - _HEADER.size:
            raise RendezvousError(f"rank {rank}: {path} is not a rendezvous file of rank {r} (damaged?)", backend="file", where=where)
        if their_world != world_size:
            raise RendezvousError(
                f"rank {rank}: rank {r} runs with world size {their_world} but this rank with {world_size} ({path})",
                backend="file",
                where=where,
            )
        out.append(data[_HEADER.size :])
    _generation_read(gen_dir, run_dir, rank, world_size)
    return out


#: A rendezvous folder none of whose entries changed for this long is a crashed run's: removed.
RENDEZVOUS_STALE_S = 24 * 3600.0


def _generation_read(gen_dir: str, run_dir: str, rank: int, world_size: int) -> None:
    """This rank has read every file of the call in ``gen_dir``: mark it so (``read-<rank>``);
    the rank that completes the set removes the call's folder, and the run's once empty, so a
    finished run leaves nothing in the shared directory."""
    try:
        _write_atomic(os.path.join(gen_dir, f"read-{rank}"), b"")
        present = set(os.listdir(gen_dir))
    except OSError:
        return
    if all(f"read-{r}" in present for r in range(world_size)):
        shutil.rmtree(gen_dir, ignore_errors=True)
        try:
            os.rmdir(run_dir)  # fails while another call's folder is in it
        except OSError:
            pass


def _remove_generation_file(mine: str, gen_dir: str, run_dir: str) -> None:
    for path, remove in ((mine, os.unlink), (gen_dir, os.rmdir), (run_dir, os.rmdir)):
        try:
            remove(path)
        except OSError:
            return


def _reclaim_stale_rendezvous(base: str) -> None:
    """Remove ``rdv-*`` folders of runs that crashed mid-rendezvous (nothing in them changed
    for :data:`RENDEZVOUS_STALE_S`); a live rendezvous changes within its time-out."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("rdv-")]
    except OSError:
        return
    now = time.time()
    for name in names:
        path = os.path.join(base, name)
        try:
            newest = os.lstat(path).st_mtime
            for entry, _, files in os.walk(path):
                for n in files:
                    newest = max(newest, os.lstat(os.path.join(entry, n)).st_mtime)
                newest = max(newest, os.lstat(entry).st_mtime)
        except OSError:
            continue
        if now - newest > RENDEZVOUS_STALE_S:
            shutil.rmtree(path, ignore_errors=True)


# -- the job secret ----------------------------------------------------------------------------


def _secret_from_text(text: str) -> bytes:
    """32 bytes from ``CLAIRVOYANT_SECRET``: SHA-256 of a fixed prefix and the UTF-8 text, so any
    string (hex or not) of 16 characters or more gives a key of full length."""
    return hashlib.sha256(_SECRET_DOMAIN + text.encode("utf-8")).digest()


def _secret_file(directory: str, rank: int, world_size: int, run: str, timeout: float) -> bytes:
    path = os.path.join(directory, f"secret-{run}")
    if rank == 0:
        fd, tmp = None, os.path.join(directory, f".secret-{run}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.fchmod(fd, 0o600)  # whatever the umask
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
            os.close(fd)
            fd = None
            try:
                os.link(tmp, path)  # exclusive: an existing file (a restart of this run) is kept
            except FileExistsError:
                pass
        finally:
            if fd is not None:
                os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    deadline = time.monotonic() + timeout
    progress = _Progress(rank, world_size, "file", path)
    pauses = _pauses()
    while not os.path.lexists(path):
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank {rank}: rank 0 of {world_size} did not create the job secret {path} within {timeout:g} s",
                missing=[0],
                backend="file",
                where=path,
                timeout=timeout,
            )
        progress.tick([0])
        time.sleep(next(pauses))
    data = _read_private(path)
    if len(data) < SECRET_BYTES:
        raise ConfigError(f"refusing {path}: {len(data)} bytes, a job secret has {SECRET_BYTES}")
    _secret_files[run] = path
    return data


# Secret files this process read, by run segment: rank 0 removes its run's once every rank
# has it (:func:`release_job_secret`).
_secret_files: dict = {}


def release_job_secret(*, rank: int, run_id: str) -> None:
    """Remove the run's ``secret-<run>`` file once every rank holds the secret (call after a
    collective that every rank enters only with the secret in hand). Rank 0 removes it; the
    others forget its path. Nothing happens for a secret from the environment or MPI. A run
    killed before this point leaves the file, and a restart with the same run id uses it."""
    path = _secret_files.pop(_run_segment(run_id), None)
    if rank != 0 or path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def job_secret(*, rank: int, world_size: int, run_id: str, timeout: float = 120.0, single_host: bool = False) -> bytes:
    """The secret every member of the job shares (32 bytes), for authenticating peers.

    In order: ``CLAIRVOYANT_SECRET`` from the launcher's environment (16 characters or more);
    else, under MPI, rank 0 draws one and broadcasts it; else rank 0 creates it in the shared
    directory (``CLAIRVOYANT_SHARED_DIR``, or ``~/.cache/clairvoyant/rendezvous`` under Slurm) as
    ``secret-<run>`` (0600, created exclusively, never through a symbolic link) and the others
    read it; with ``single_host=True`` or one rank, that directory is a per-user one in
    /dev/shm (or ``CLAIRVOYANT_SHM_DIR``). Otherwise a ConfigError says how to provide one."""
    _check_args(rank, world_size, timeout)
    env = _env()
    text = _settings.raw("CLAIRVOYANT_SECRET", env)
    if text is not None:
        if len(text) < 16:
            raise ConfigError(f"invalid value for CLAIRVOYANT_SECRET: {len(text)} characters, at least 16 are needed")
        return _secret_from_text(text)
    run = _run_segment(run_id)
    if world_size > 1 and not single_host:
        comm = _mpi_comm(rank, world_size)
        if comm is not None:
            buf = bytearray(secrets.token_bytes(SECRET_BYTES) if rank == 0 else SECRET_BYTES)
            _mpi_wait(comm.Ibcast(buf, root=0), time.monotonic() + timeout, timeout, "MPI broadcast of the job secret")
            return bytes(buf)
        base = shared_dir()
        if base is None:
            raise ConfigError(
                f"rank {rank} of {world_size}: no job secret: set CLAIRVOYANT_SECRET (16 characters or more, the same on "
                "every rank, e.g. CLAIRVOYANT_SECRET=$(openssl rand -hex 32) in the launch script) or CLAIRVOYANT_SHARED_DIR "
                "(a directory every node sees, private to this user) so that rank 0 can create one; under MPI, install mpi4py"
            )
        return _secret_file(_private_dir(base), rank, world_size, run, timeout)
    return _secret_file(_user_runtime_dir(), rank, world_size, run, timeout)


# -- where this node listens, and which node this is ---------------------------------------------


def _is_wildcard(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_unspecified
    except ValueError:
        return False


def _interface_address(name: str) -> str:
    """The IPv4 address of interface ``name`` (ioctl SIOCGIFADDR), else its first global IPv6
    address from ``ip -j addr``."""
    names = [n for _, n in socket.if_nameindex()]
    if name not in names:
        raise ConfigError(f"invalid value for CLAIRVOYANT_LISTEN: {name!r} is neither an IP address nor an interface ({', '.join(names)})")
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name.encode()[:15])
            res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            return socket.inet_ntoa(res[20:24])
    except OSError:
        pass
    ip = shutil.which("ip")
    if ip:
        try:
            import json

            out = subprocess.run([ip, "-j", "addr", "show", "dev", name], capture_output=True, text=True, timeout=5).stdout
            for link in json.loads(out or "[]"):
                for a in link.get("addr_info", []):
                    if a.get("scope") == "global" and a.get("local"):
                        return a["local"]
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    raise ConfigError(f"invalid value for CLAIRVOYANT_LISTEN: interface {name!r} has no address")


def _route_source(host: str) -> str | None:
    """The source address the kernel picks to reach ``host`` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                addr = s.getsockname()[0]
        except OSError:
            continue
        if not _is_wildcard(addr):
            return addr
    return None


def _slurm_first_node() -> str | None:
    env = _env()
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    scontrol = shutil.which("scontrol")
    if not (nodelist and scontrol):
        return None
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.split()
    return first[0] if first else None


def _strip_port(entry: str) -> str:
    entry = entry.strip()
    if entry.startswith("["):  # [v6]:port
        return entry[1:].split("]")[0]
    if entry.count(":") == 1:
        return entry.split(":")[0]
    return entry


def listen_address(*, peers_hint: list | None = None) -> str:
    """The local IP address on which this node's server should listen: the one that reaches the
    other nodes. ``CLAIRVOYANT_LISTEN`` (an IP address or an interface name), else the source
    address the kernel picks to reach ``MASTER_ADDR`` (or the first of ``peers_hint``, of
    ``CLAIRVOYANT_PEERS``, or Slurm's first node), else 127.0.0.1. Never a wildcard address."""
    env = _env()
    chosen = _settings.get("CLAIRVOYANT_LISTEN", "", env)
    if chosen:
        try:
            ip = ipaddress.ip_address(chosen)
        except ValueError:
            return _interface_address(chosen)
        if ip.is_unspecified:
            raise ConfigError(
                f"invalid value for CLAIRVOYANT_LISTEN: {chosen} listens on every interface; name one address or interface"
            )
        return str(ip)
    targets = []
    if env.get("MASTER_ADDR"):
        targets.append(env["MASTER_ADDR"])
    targets += [_strip_port(p) for p in (peers_hint or [])[:1]]
    peers = [p for p in re.split(r"[,\s]+", _settings.get("CLAIRVOYANT_PEERS", "", env)) if p]
    targets += [_strip_port(p) for p in peers[:1]]
    loopback, named = None, None
    for target in targets:
        addr = _route_source(target)
        if addr is None:
            continue
        if not ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return addr
        loopback = loopback or addr
        if named is None and not _names_loopback(target):
            named = target
    if not targets:
        first = _slurm_first_node()
        if first:
            addr = _route_source(first)
            if addr:
                return addr
    if named is not None:
        # This host's own name resolving to loopback (Debian's 127.0.1.1): this is the master,
        # and the others cannot reach it there. Take the interface of the default route (a UDP
        # connect to a documentation address sends nothing).
        addr = _route_source("192.0.2.1")
        if addr is not None and not ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            print(
                f"clairvoyant: {named} resolves to {loopback} on this host; listening on {addr} "
                "(the default route's interface); set CLAIRVOYANT_LISTEN to choose another",
                file=sys.stderr,
            )
            return addr
    return loopback or "127.0.0.1"


def _names_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_id() -> str:
    """Which node this process runs on: ``CLAIRVOYANT_NODE_ID``, else the host name, the boot id
    and the device of the shared-memory directory (so two containers with one host name on
    different machines, or with separate /dev/shm on one machine, differ)."""
    env = _env()
    if _settings.get("CLAIRVOYANT_NODE_ID", None, env):
        return _settings.get("CLAIRVOYANT_NODE_ID", None, env)
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        pass
    shm = _settings.get("CLAIRVOYANT_SHM_DIR", None, env) or "/dev/shm"
    try:
        parts.append(f"{os.stat(shm).st_dev:x}")
    except OSError:
        pass
    return "/".join(parts)


__all__ = [
    "RendezvousError",
    "allgather",
    "job_secret",
    "listen_address",
    "node_id",
    "choose_backend",
    "shared_dir",
]
