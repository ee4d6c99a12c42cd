"""Emulation helpers for the demo, the benchmarks and the tests.

- :func:`make_imagefolder` writes a deterministic ImageFolder of real JPEGs whose sizes vary.
- :class:`EmulatedAccelerator` stands in for a GPU: a training step takes ``bytes / rate``
  seconds, slept (so it costs no CPU), and the compute time is accumulated.
- :func:`run_ranks` runs one function in N rank processes on this host (multiprocessing spawn),
  each with the launcher variables torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE) and a shared barrier so that ranks advance step by step as with DDP.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

# Bumped whenever the generated images change, so a stale dataset is regenerated.
_FORMAT = 1
_MARKER = ".clairvoyant-dataset.json"


def make_imagefolder(
    root: str | os.PathLike,
    num_classes: int,
    per_class: int,
    size_range: tuple[int, int] = (112, 208),
    seed: int = 0,
    quality: int = 90,
) -> int:
    """Write ``num_classes * per_class`` JPEGs under ``root/class_<i>/img_<j>.jpg`` (zero-padded indices).

    Each image is a colour gradient with noise; side lengths are drawn from ``size_range`` so
    file sizes vary (about 10-45 KB for the default range). The output depends only on the
    arguments. When ``root`` already holds a dataset made with the same arguments it is reused.
    Returns the total size of the files in bytes.
    """
    from PIL import Image

    root = Path(root)
    params = {
        "format": _FORMAT,
        "num_classes": num_classes,
        "per_class": per_class,
        "size_range": list(size_range),
        "seed": seed,
        "quality": quality,
    }
    marker = root / _MARKER
    if marker.exists():
        try:
            recorded = json.loads(marker.read_text())
            total = int(recorded["total_bytes"])
            # Reused only while every file is there: a folder whose files were removed (a
            # clean-up that kept the marker) is made again.
            files = list(root.glob("class_*/img_*.jpg"))
            if recorded.get("params") == params and len(files) == num_classes * per_class:
                if sum(p.stat().st_size for p in files) == total:
                    return total
        except (ValueError, KeyError, OSError):
            pass
    if root.exists():
        shutil.rmtree(root)
    tmp = root.with_name(root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    lo, hi = size_range
    total = 0
    for c in range(num_classes):
        class_dir = tmp / f"class_{c:03d}"
        class_dir.mkdir(parents=True)
        for i in range(per_class):
            rng = np.random.default_rng([seed, c, i])
            w, h = (int(x) for x in rng.integers(lo, hi + 1, size=2))
            colour0, colour1 = rng.uniform(0, 255, size=(2, 3))
            t = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]
            img = colour0 * (1 - t) + colour1 * t + rng.normal(0, rng.uniform(40, 120), size=(h, w, 3))
            buf = io.BytesIO()
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
            data = buf.getvalue()
            (class_dir / f"img_{i:05d}.jpg").write_bytes(data)
            total += len(data)
    (tmp / _MARKER).write_text(json.dumps({"params": params, "total_bytes": total}))
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(root)
    return total


def list_imagefolder(root: str | os.PathLike) -> tuple[list[str], list[int], list[str]]:
    """(paths, labels, classes) of an ImageFolder directory, in torchvision's order: classes
    sorted, files sorted within each class. Hidden files are skipped."""
    root = Path(root)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            if f.is_file() and not f.name.startswith("."):
                paths.append(str(f))
                labels.append(label)
    return paths, labels, classes


def fingerprint(data: bytes | memoryview | np.ndarray) -> int:
    """A cheap content fingerprint (CRC-32) that identifies a sample by its bytes."""
    return zlib.crc32(data)


class EmulatedAccelerator:
    """A stand-in for a GPU that processes ``bytes_per_second`` bytes of samples per second.

    ``step(batch_bytes)`` sleeps ``batch_bytes / bytes_per_second`` seconds, as a training step
    on a real accelerator takes time without using the host CPU; ``compute_seconds`` is the
    total time stepped.
    """

    def __init__(self, bytes_per_second: float):
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second}")
        self.bytes_per_second = float(bytes_per_second)
        self.compute_seconds = 0.0

    def step(self, batch_bytes: float) -> float:
        """Run one step on ``batch_bytes`` bytes; returns the seconds it took."""
        seconds = batch_bytes / self.bytes_per_second
        start = time.perf_counter()
        deadline = start + seconds
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            time.sleep(left)
        took = time.perf_counter() - start
        self.compute_seconds += took
        return took


@dataclass
class RankContext:
    """What :func:`run_ranks` hands to each rank's function."""

    rank: int
    world_size: int
    barrier: Any  # multiprocessing.Barrier shared by all ranks

    def sync(self) -> None:
        """Wait until every rank reaches this point (one DDP all-reduce)."""
        self.barrier.wait()


def _rank_main(call: str, rank, world_size, barrier, results, env):
    with open(call, "rb") as f:
        fn, args = pickle.load(f)
    os.environ.update(env)
    # A spawned process defaults to spawning its own children; a rank started by torchrun,
    # srun or mpirun forks them (the platform default), and so must these: otherwise every
    # DataLoader worker re-imports torch at every epoch (about 2 s each on 2 cores).
    if "fork" in mp.get_all_start_methods():
        mp.set_start_method("fork", force=True)
    try:
        out = fn(RankContext(rank, world_size, barrier), *args)
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, then let the others go
        barrier.abort()
        results.put((rank, False, traceback.format_exc()))


def memory_config(path, memory: int, staging: str = "4 MiB", pfs_mbps="200.0", open_latency_ms: float = 0.5, threads: int = 1) -> str:
    """Write a system description with one memory class of ``memory`` bytes (tests and
    benchmarks that fix the cache's size); returns its path."""
    with open(path, "w") as f:
        f.write(
            f"""
[staging]
capacity = "{staging}"
threads = 2
[pfs]
read_mbps = {pfs_mbps}
open_latency_ms = {open_latency_ms}
[[class]]
name = "memory"
kind = "memory"
capacity = {memory}
threads = {threads}
read_mbps = 5000.0
write_mbps = 5000.0
"""
        )
    return str(path)


def shm_root() -> str | None:
    """Where emulated nodes keep their node-shared memory: ``/dev/shm`` (a tmpfs, as on a real
    node) when this machine has it, else the temp dir (None). A folder on a disk's file system
    would make every cached sample a dirty page the kernel writes back to disk."""
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK) else None


@contextlib.contextmanager
def shm_folder(prefix: str):
    """A fresh folder under :func:`shm_root` for a run's node-shared memory
    (``CLAIRVOYANT_SHM_DIR``), removed when the block ends."""
    d = tempfile.mkdtemp(prefix=prefix, dir=shm_root())
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def node_env(node: int, shm: str, shared: str, run_id: str, listen: str = "127.0.0.1") -> dict:
    """The variables that make a process part of emulated node ``node`` on this machine: its node
    id, its own shared-memory directory ``shm`` (nodes share no cache), the directory ``shared``
    where the nodes meet and find the job secret, the address its peer server listens on, and the
    run id every node of the job shares."""
    return {
        "CLAIRVOYANT_NODE_ID": f"node{node}",
        "CLAIRVOYANT_SHM_DIR": str(shm),
        "CLAIRVOYANT_SHARED_DIR": str(shared),
        "CLAIRVOYANT_RENDEZVOUS": "file",
        "CLAIRVOYANT_LISTEN": listen,
        "CLAIRVOYANT_RUN_ID": run_id,
    }


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    nodes: int = 1,
    per_node_env: Callable[[int], dict] | None = None,
) -> list[Any]:
    """Run ``fn(RankContext, *args)`` in ``world_size`` spawned processes on this host and return
    their results in rank order. ``fn`` must be importable (a module-level function).

    Each process gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE plus ``env``. With
    ``nodes`` > 1 the ranks are split into that many emulated nodes (contiguous blocks): each
    node has its own node id and its own shared-memory directory (so nodes share no cache),
    the nodes meet through a private shared directory, and servers listen on loopback
    (:func:`node_env`); ``per_node_env(i)`` adds variables for node i. If any rank fails, the barrier is broken so the
    others stop too, and a RuntimeError carrying the failing rank's traceback is raised; a rank
    that exits without reporting (killed, or failed before it ran) raises one naming it.

    ``fn`` and ``args`` reach the ranks through a file, not the start-up pipe: a child that
    dies while starting (its main module re-run without a ``__main__`` guard, an import that
    fails) leaves the parent blocked for ever writing more than a pipe holds into it (the
    parent keeps the pipe's read end open while it writes).
    """
    if nodes < 1 or world_size % nodes:
        raise ValueError(f"{world_size} ranks cannot be split into {nodes} equal nodes")
    per_node = world_size // nodes
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(world_size)
    results = ctx.Queue()
    procs = []
    scratch = tempfile.mkdtemp(prefix="clairvoyant-nodes-", dir=shm_root()) if nodes > 1 else None
    calls = tempfile.mkdtemp(prefix="clairvoyant-ranks-")
    outs: dict[int, Any] = {}
    errors: list[str] = []
    reported: set[int] = set()
    deadline = None if timeout is None else time.monotonic() + timeout
    # Ranks that outlived the timeout are hung: a few seconds to exit, then terminated.
    grace = 30.0
    try:
        call = os.path.join(calls, "call.pickle")
        with open(call, "wb") as f:
            pickle.dump((fn, tuple(args)), f)
        for rank in range(world_size):
            node = rank // per_node
            penv = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank % per_node),
                "LOCAL_WORLD_SIZE": str(per_node),
                "MASTER_ADDR": "127.0.0.1",
            }
            if scratch is not None:
                shm = os.path.join(scratch, f"node{node}")
                os.makedirs(shm, mode=0o700, exist_ok=True)
                os.makedirs(os.path.join(scratch, "shared"), mode=0o700, exist_ok=True)
                penv.update(node_env(node, shm, os.path.join(scratch, "shared"), f"emulated-{os.getpid()}-{os.path.basename(scratch)}"))
                penv.update(per_node_env(node) if per_node_env else {})
            penv.update(env or {})
            p = ctx.Process(target=_rank_main, args=(call, rank, world_size, barrier, results, penv), daemon=False)
            p.start()
            procs.append(p)
        while len(reported) < world_size:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            # A rank's report is in the queue before the rank has exited: one that had exited
            # before a wait that then found the queue empty sent none.
            gone = [(r, p) for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            try:
                rank, ok, value = results.get(timeout=min(wait, 1.0) if wait is not None else 1.0)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    barrier.abort()  # ranks waiting at it stop rather than hold the joins below
                    grace = 5.0
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
                if gone:
                    barrier.abort()
                    r, p = gone[0]
                    raise RuntimeError(f"rank {r} exited with code {p.exitcode} without reporting (killed, or failed before it ran)")
                continue
            reported.add(rank)
            if ok:
                outs[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        # One grace period for all ranks, not one each.
        until = time.monotonic() + grace
        for p in procs:
            p.join(timeout=max(0.0, until - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(calls, ignore_errors=True)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [outs[r] for r in range(world_size)]


# -- an emulated shared file system mounted through FUSE ---------------------------------------
# The in-process emulation above (and the core's `Throttled` source) charges reads inside the
# loader; this one is a real file system (crates/clairvoyant-fsemu), so any reader (PyTorch's
# DataLoader, plain threads, clairvoyant) meets the same latency and shared bandwidth t(γ), and
# nothing comes from the page cache.

FSEMU_DEFAULT_LATENCY_MS = 2.0
FSEMU_DEFAULT_BANDWIDTH = ((1, 60.0), (2, 100.0), (4, 160.0), (8, 200.0))


def fsemu_binary() -> Path:
    """The ``clairvoyant-fsemu`` binary: ``$CLAIRVOYANT_FSEMU`` or the workspace's release build
    (``./dev build`` builds it)."""
    env = os.environ.get("CLAIRVOYANT_FSEMU")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "target" / "release" / "clairvoyant-fsemu"


def fuse_unavailable() -> str | None:
    """Why a FUSE emulation cannot be mounted here, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE in this kernel or container)"
    if not fsemu_binary().is_file():
        return f"{fsemu_binary()} is not built (./dev build builds it)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None and shutil.which("fusermount") is None:
        return "not root and no fusermount3 (apt-get install fuse3)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    return None


def _curve_arg(bandwidth) -> str:
    if isinstance(bandwidth, (int, float)):
        return f"{float(bandwidth):g}"
    return ",".join(f"{x:g}:{y:g}" for x, y in bandwidth)


def curve_at(bandwidth, readers: float) -> float:
    """t(γ) of a bandwidth table ((readers, MB/s), ...) or a constant, as the emulation
    interpolates it (linear between points, flat beyond the ends)."""
    if isinstance(bandwidth, (int, float)):
        return float(bandwidth)
    pts = list(bandwidth)
    if readers <= pts[0][0]:
        return float(pts[0][1])
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if readers <= x1:
            return y0 + (y1 - y0) * (readers - x0) / (x1 - x0)
    return float(pts[-1][1])


class FuseMount:
    """A running ``clairvoyant-fsemu``: ``backing`` exposed read-only at ``path``.

    Use as a context manager; leaving it sends SIGTERM, which unmounts. ``stats()`` reads the
    counters (JSON) from the mount's ``.fsemu-stats`` file. ``mmap_files=True`` opens files
    through the page cache instead of with direct I/O, so that they can be memory-mapped (each
    page fault is a read of the emulated file system).
    """

    def __init__(
        self,
        backing: str | os.PathLike,
        mountpoint: str | os.PathLike,
        open_latency_ms: float = FSEMU_DEFAULT_LATENCY_MS,
        bandwidth=FSEMU_DEFAULT_BANDWIDTH,
        timeout: float = 20.0,
        mmap_files: bool = False,
    ):
        import subprocess

        self.backing, self.path = Path(backing), Path(mountpoint)
        self.open_latency_ms, self.bandwidth = open_latency_ms, bandwidth
        self.path.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(fsemu_binary()),
            str(self.backing),
            str(self.path),
            "--open-latency-ms",
            f"{open_latency_ms:g}",
            "--bandwidth",
            _curve_arg(bandwidth),
        ] + (["--mmap-files"] if mmap_files else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # "mounted PATH" once it answers
        if not line.startswith("mounted"):
            err = self.proc.stderr.read() if self.proc.wait(timeout=timeout) is not None else ""
            raise RuntimeError(f"clairvoyant-fsemu could not mount {self.path}: {(line + err).strip()}")

    def stats(self) -> dict:
        with open(self.path / ".fsemu-stats", "rb") as f:
            return json.loads(f.read())

    def close(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if is_mounted(self.path):  # killed before it could unmount
            subprocess.run(["umount", "-l", str(self.path)], check=False)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()

    def __enter__(self) -> "FuseMount":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def is_mounted(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a mount point in /proc/self/mounts."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f if len(line.split()) > 1)
    except OSError:
        return False
