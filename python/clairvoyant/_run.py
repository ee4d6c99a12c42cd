"""``clairvoyant run --dataset ROOT -- COMMAND ...``: run an unmodified program with its reads of
files under ROOT served from the node's cache (transparent mode, docs/transparent.md).

Per node, the first launcher of a job starts the node agent (:mod:`clairvoyant._agent`) under
a lock; every launcher of the job on the node attaches to it and the agent exits when the last
has gone. The program runs with the interposed library preloaded (``LD_PRELOAD``), the dataset
root and the agent's socket in its environment; its children inherit all three."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

try:
    from _blake2 import blake2b  # hashlib's own, without loading OpenSSL (2 ms of a launcher's start)
except ImportError:  # an interpreter built without it
    from hashlib import blake2b

from . import _native, _settings
from ._dirs import private_dir, temp_dir, user_runtime_dir
from ._env import _first_int

#: How long a launcher waits for the node agent to index the dataset and start.
START_TIMEOUT = 600.0
#: How often a launcher connects (starting an agent where none answers) before it gives up,
#: when an agent answers and then fails to attach it.
ATTACH_TRIES = 3


def nodes_of(env, nodes=None, node=None) -> tuple:
    """(nodes, this node's index) from the arguments, else the launcher's variables:
    ``CLAIRVOYANT_NODES``/``CLAIRVOYANT_NODE_RANK``, Slurm, torchrun (``--no-python``), Open MPI."""
    if nodes is not None:
        return nodes, node or 0
    n = _first_int(("CLAIRVOYANT_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"), env)
    i = _first_int(("CLAIRVOYANT_NODE_RANK", "SLURM_NODEID", "GROUP_RANK"), env)
    if n is None:
        world = _first_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), env)
        local = _first_int(("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"), env)
        if world and local and world > local and world % local == 0:
            n = world // local
            if i is None:
                rank = _first_int(("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), env) or 0
                i = rank // local
    n = n or 1
    i = i or 0
    if not 0 <= i < n:
        raise _native.ConfigError(f"this node's index {i} is outside the job's {n} nodes")
    return n, i


def reports_stats(env) -> bool:
    """Whether this launcher prints the ``--stats`` lines: the figures are the node agent's, so
    of the launchers a launcher such as torchrun starts on a node (one per local rank), only
    the first (local rank 0, or a launcher started alone) prints them."""
    local = _first_int(("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"), env)
    return local is None or local == 0


def run_id_of(env) -> str:
    for k in ("CLAIRVOYANT_RUN_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"):
        v = env.get(k, "").strip()
        if v and v != "none":
            return v
    return ""


def agent_key(root: str, run: str, nodes: int, node: int, order_file, config, lazy: bool) -> str:
    """The name shared by the launchers of one job on a node: their agent's folder is
    ``agent-<key>`` (:func:`_short_dir`)."""
    facts = json.dumps([root, run, nodes, node, order_file, config, lazy], sort_keys=True).encode()
    return blake2b(facts, digest_size=8).hexdigest()


def reclaim_agent_dirs(base: str | None = None, top: str | None = None) -> int:
    """Remove the folders of agents that are gone, in both places a folder can be: ``agent-*``
    in the user's runtime folder ``base`` and ``a-*`` in ``top`` (see :func:`_short_dir`); how
    many were removed."""
    base = user_runtime_dir() if base is None else base
    top = os.path.join(temp_dir(), f"clairvoyant-{os.geteuid()}") if top is None else top
    removed = _reclaim_agent_dirs(base, "agent-")
    if os.path.isdir(top) and not os.path.islink(top):
        removed += _reclaim_agent_dirs(top, "a-")
    return removed


def _short_dir(key: str) -> str:
    """A private directory with a short path for the socket (Unix socket paths are limited to
    107 bytes). Folders of agents that are gone, in both places, are removed first."""
    base = user_runtime_dir()
    top = os.path.join(temp_dir(), f"clairvoyant-{os.geteuid()}")
    reclaim_agent_dirs(base, top)
    d = os.path.join(base, f"agent-{key}")
    if len(os.path.join(d, "agent.sock")) > 100:
        try:
            os.mkdir(top, 0o700)
        except FileExistsError:
            pass
        private_dir(top, create=False)
        d = os.path.join(top, f"a-{key}")
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    return private_dir(d, create=False)


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def _still_linked(fd: int, path: str) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (a folder removed while we waited for
    its lock leaves us holding a lock on a file nobody else will open)."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _answers(sock: str) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(sock)
            return True
        except OSError:
            return False


def reclaim_agent_dir(d: str) -> bool:
    """Remove the agent folder ``d`` when no launcher is in it (its ``agent.lock`` is free) and
    no agent answers on its socket; whether it was removed. A launcher waiting for the lock
    meanwhile finds the lock file unlinked and starts over (:class:`Agent`)."""
    try:
        private_dir(d, create=False)
        lock = _open_lock(os.path.join(d, "agent.lock"))
    except (OSError, _native.ConfigError):
        return False
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a launcher is starting or attaching to this folder's agent
        if not _still_linked(lock, os.path.join(d, "agent.lock")) or _answers(os.path.join(d, "agent.sock")):
            return False
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        return not os.path.lexists(d)
    finally:
        os.close(lock)


def _reclaim_agent_dirs(base: str, prefix: str) -> int:
    """Remove the ``prefix*`` folders under ``base`` of agents that are gone (killed, or failed
    after starting: what a crashed run left); how many were removed."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return 0
    return sum(reclaim_agent_dir(os.path.join(base, name)) for name in names)


class Agent:
    """This launcher's attachment to the node agent (started here when none runs).

    ``meanwhile(agent)``, when given, is called once this launcher holds the lock of the agent's
    folder, or would wait for it (another launcher is starting the agent), and before the agent
    is started: the program starts while the agent does. The interposed library waits at its
    first dataset open until that lock is let go (docs/transparent.md, "Start-up")."""

    def __init__(
        self, root: str, *, order_file=None, nodes=1, node=0, config=None, env=None, timeout=START_TIMEOUT, lazy=False, meanwhile=None
    ):
        env = os.environ if env is None else env
        self.root = root
        run = run_id_of(env)
        if nodes > 1 and not run:
            raise _native.ConfigError(
                "several nodes need a run id shared by every node's launcher: set CLAIRVOYANT_RUN_ID (Slurm's job id is used when set)"
            )
        key = agent_key(root, run, nodes, node, order_file, config, lazy)
        self.started = False
        self.dir = f"agent-{key}"
        for _ in range(100):
            try:
                # Another launcher may reclaim a folder made a moment ago (nobody holds its lock
                # yet): then it is gone before it is checked or its lock opened. Start over.
                self.dir = _short_dir(key)
                self.socket = os.path.join(self.dir, "agent.sock")
                self.log = os.path.join(self.dir, "agent.log")
                lock = _open_lock(os.path.join(self.dir, "agent.lock"))
            except FileNotFoundError:
                continue  # the folder was reclaimed just now
            try:
                meanwhile = self._lock(lock, meanwhile)
            except BaseException:
                os.close(lock)
                raise
            if _still_linked(lock, os.path.join(self.dir, "agent.lock")):
                break
            os.close(lock)  # its agent left and removed the folder while we waited: start over
        else:
            raise _native.ConfigError(f"cannot take the lock in the agent folder {self.dir}: it keeps being removed")
        try:
            if meanwhile is not None:
                meanwhile(self)
            for attempt in range(ATTACH_TRIES):
                try:
                    self.client = _native.AgentClient(self.socket)
                except ConnectionError:
                    self._start(run, order_file, nodes, node, config, env, timeout, lazy)
                    self.client = _native.AgentClient(self.socket)
                    self.started = True
                try:
                    self.client.attach()
                    break
                except ConnectionError:
                    # The agent answered, then went (killed, or it failed): an agent that leaves
                    # of its own accord waits for this lock, so the next try starts a new one.
                    self.client.close()
                    if attempt + 1 == ATTACH_TRIES:
                        raise
        finally:
            os.close(lock)

    def _lock(self, lock: int, meanwhile):
        """Take the folder's lock; when another launcher holds it (it is starting the agent),
        call ``meanwhile`` first. Returns ``meanwhile`` when it is still to be called."""
        if meanwhile is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return meanwhile
            except BlockingIOError:
                meanwhile(self)  # the program's first dataset open waits for this lock
        fcntl.flock(lock, fcntl.LOCK_EX)
        return None

    def _start(self, run, order_file, nodes, node, config, env, timeout, lazy):
        # Directory files of agents that were killed (a live agent's is in use: only this lock
        # holder starts one, and none answered).
        for name in os.listdir(self.dir):
            if name.startswith("dir-"):
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
        directory = os.path.join(self.dir, f"dir-{os.getpid()}")
        args = [
            sys.executable, "-m", "clairvoyant._agent", "--root", self.root, "--socket", self.socket,
            "--dir", directory, "--nodes", str(nodes), "--node", str(node), "--run-id", run,
        ]  # fmt: skip
        if order_file:
            args += ["--order-file", order_file]
        if config:
            args += ["--config", config]
        if lazy:
            args += ["--lazy"]
        r, w = os.pipe()
        args += ["--ready-fd", str(w)]
        child_env = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "CLAIRVOYANT_AGENT", "CLAIRVOYANT_ROOT")}
        if _settings.get("CLAIRVOYANT_AGENT_LOG", None, env):
            # Kept: the agent's folder (with the default log) goes when the agent exits.
            logs = private_dir(_settings.get("CLAIRVOYANT_AGENT_LOG", None, env))
            self.log = os.path.join(logs, f"{os.path.basename(self.dir)}.{os.getpid()}.log")
        with open(self.log, "wb") as log:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env,
                start_new_session=True, pass_fds=(w,), close_fds=True,
            )  # fmt: skip
        os.close(w)
        try:
            deadline = time.monotonic() + timeout
            ready = False
            while not ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    raise _native.ConfigError(
                        f"the node agent did not start within {timeout:.0f} s (indexing {self.root}?); its log: {self.log}"
                    )
                rl, _, _ = select.select([r], [], [], min(left, 1.0))
                if rl:
                    ready = os.read(r, 1) == b"1"
                    if not ready:
                        break
            if not ready:
                code = proc.wait(timeout=10)
                raise _native.ConfigError(f"the node agent exited ({code}) before it was ready:\n{_tail(self.log)}")
            # What the agent left out of the dataset (loops, sockets, ...) and what it could not
            # have as configured (a shared memory too small for the memory class, ...) are the
            # user's to know.
            try:
                with open(self.log, errors="replace") as f:
                    for line in f:
                        if line.startswith(("clairvoyant agent: skipping", "clairvoyant: warning:")):
                            print(line.rstrip("\n"), file=sys.stderr, flush=True)
            except OSError:
                pass
        finally:
            os.close(r)

    def stats(self) -> dict:
        return self.client.stats()

    def close(self):
        self.client.close()


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return f"(no log at {path})"


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_stats(s: dict, prev: dict | None, elapsed: float) -> str:
    """One line of figures since ``prev`` (or since the start)."""
    p = prev or {}
    reads, preads = s.get("reads", {}), p.get("reads", {})

    def d(key, inner=True):
        if inner:
            return reads.get(key, 0) - preads.get(key, 0)
        return s.get(key, 0) - p.get(key, 0)

    return (
        f"clairvoyant run: {elapsed:7.1f} s: node cache {d('cached_reads'):,} reads ({_mb(d('cached_bytes'))}), "
        f"peers {d('inline_reads'):,} ({_mb(d('inline_bytes'))}), "
        f"file system {d('direct_reads'):,} direct ({_mb(d('direct_bytes'))}; {d('fills'):,} files read by programs for the cache) "
        f"+ {_mb(d('pfs_bytes', False))} by the agent; "
        f"fallbacks {d('fallbacks')}, corrupt {d('corrupt')}, stale {d('stale')}; agent CPU {d('agent_cpu_s', False):.2f} s"
    )


def _command(args) -> list:
    """The program to run: what follows ``--``."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise _native.ConfigError("nothing to run: give the command after --, e.g. clairvoyant run --dataset D -- python train.py")
    return command


def _dataset_root(args) -> str:
    """``--dataset`` as an absolute path: a directory whose path is UTF-8 text."""
    root = os.path.abspath(args.dataset)
    if not os.path.isdir(root):
        raise _native.ConfigError(f"--dataset {args.dataset}: not a directory")
    try:
        root.encode("utf-8")
    except UnicodeEncodeError:
        raise _native.ConfigError(
            f"--dataset {os.fsencode(root)!r}: transparent mode needs a dataset folder whose path is UTF-8 text "
            "(names below it may be any bytes); use a symbolic link with a UTF-8 name"
        ) from None
    return root


def _program_env(args, root: str, agent, lib, nodes: int) -> dict:
    """The program's environment: the interposed library and its agent, and with
    ``--sampler-order`` the start-up hook that hands the sampler's order to the agent."""
    from ._preload import preload_env

    env = preload_env(root, agent.socket, library=lib)
    if _settings.get("CLAIRVOYANT_VERIFY", None, env) == "process":
        print(
            "clairvoyant run: CLAIRVOYANT_VERIFY=process: each cached copy is checked once per process; "
            "later opens of it are unchecked (bytes damaged in the cache afterwards are served as they are)",
            file=sys.stderr,
        )
    if args.sampler_order:
        hook = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_hook")
        env["PYTHONPATH"] = os.pathsep.join(x for x in (hook, env.get("PYTHONPATH", "")) if x)
        env["CLAIRVOYANT_SAMPLER_ORDER"] = "1"
        env["CLAIRVOYANT_NODES"] = str(nodes)
    return env


def _report_stats(agent, lock: threading.Lock, stop: threading.Event, interval: float, started: float) -> None:
    """``--stats``: a line of the agent's figures every ``interval`` seconds until ``stop``."""
    prev = None
    while not stop.wait(interval):
        try:
            with lock:
                s = agent.stats()
        except (ConnectionError, OSError):
            print("clairvoyant run: the node agent is gone; the program reads the file system directly", file=sys.stderr)
            return
        print(format_stats(s, prev, time.monotonic() - started), file=sys.stderr, flush=True)
        prev = s


def _final_stats(args, agent, lock: threading.Lock, show: bool, started: float) -> None:
    """The totals (``--stats``) and the figures file (``--stats-json``) at the end."""
    if not (show or args.stats_json):
        return
    try:
        with lock:
            s = agent.stats()
        if show:
            print(format_stats(s, None, time.monotonic() - started).replace(":", ": total:", 1), file=sys.stderr)
        if args.stats_json:
            tmp = f"{args.stats_json}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(s, f, indent=1)
            os.replace(tmp, args.stats_json)  # launchers of one node may share the name
    except (ConnectionError, OSError) as e:
        print(f"clairvoyant run: no figures from the node agent: {e}", file=sys.stderr)


def _start_program(command: list, env: dict) -> subprocess.Popen:
    """The program, killed with this launcher: a launcher killed with SIGKILL (by a user, or by a
    job launcher that stops its ranks) takes the program with it, as killing the program alone
    would. Launchers that stop normally (SIGTERM, SIGINT, SIGHUP) forward the signal instead."""
    parent = os.getpid()
    try:
        return subprocess.Popen(command, env=env, preexec_fn=lambda: _native.die_with_launcher(parent))
    except OSError as e:
        raise _native.ConfigError(f"cannot run {command[0]}: {e.strerror}") from e


def _stop_program(proc: subprocess.Popen) -> None:
    """The program started beside an agent that could not start: stopped (SIGTERM, then SIGKILL
    after 10 s), as if it had not run."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(args) -> int:
    command = _command(args)
    root = _dataset_root(args)
    order_file = os.path.abspath(args.order_file) if args.order_file else None
    nodes, node = nodes_of(os.environ, args.nodes, args.node_rank)
    from ._preload import preload_library

    lib = preload_library()
    if order_file and args.sampler_order:
        raise _native.ConfigError("--order-file and --sampler-order both give the order: use one")
    started = time.monotonic()
    program = []
    try:
        # The program starts while the agent starts (its first dataset open waits for it).
        agent = Agent(
            root, order_file=order_file, nodes=nodes, node=node, config=args.config, lazy=args.sampler_order,
            meanwhile=lambda a: program.append(_start_program(command, _program_env(args, root, a, lib, nodes))),
        )  # fmt: skip
    except BaseException:
        for proc in program:
            _stop_program(proc)
        raise
    (proc,) = program
    # One line per node, not one per launcher (see reports_stats).
    show = args.stats and reports_stats(os.environ)
    stop = threading.Event()
    lock = threading.Lock()
    forwarded = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        forwarded[sig] = signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    reporter = None
    if show:
        reporter = threading.Thread(target=_report_stats, args=(agent, lock, stop, args.stats_interval, started), name="clairvoyant-stats", daemon=True)
        reporter.start()
    try:
        code = proc.wait()
    finally:
        stop.set()
        if reporter is not None:
            reporter.join(timeout=5)
        _final_stats(args, agent, lock, show, started)
        agent.close()
        for sig, old in forwarded.items():
            signal.signal(sig, old)
    return code if code >= 0 else 128 - code
