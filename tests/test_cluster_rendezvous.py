"""Rendezvous (allgather), the job secret, listen_address and node_id (clairvoyant._cluster).

Every multi-rank case runs its ranks as separate processes, as a launcher would.
"""

import datetime
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clairvoyant import _cluster
from clairvoyant.errors import AccessDeniedError, ConfigError, CorruptError

ROOT = Path(__file__).resolve().parents[1]

# One rank: a list of steps, each `calls` allgathers of payloads (rank, call, size) and
# optionally the secret; a step may name the ranks that take part, a world size and
# environment overrides. The rank says "ready" once imported and starts when told "go", so that
# time-outs do not count the others' start-up. Prints one JSON line: per step, the sha256 of every
# gathered payload per call, or the error.
WORKER = r"""
import hashlib, json, os, sys, time
from clairvoyant import _cluster
a = json.loads(sys.argv[1])
rank = a["rank"]
if a.get("torch"):
    import datetime, torch.distributed as dist
if "progress_after" in a:
    _cluster.PROGRESS_AFTER_S = a["progress_after"]
print("ready", flush=True)
sys.stdin.readline()
if a.get("pg"):
    dist.init_process_group("gloo", rank=rank, world_size=a["world"], timeout=datetime.timedelta(seconds=30))
results = []
for step in a["steps"]:
    if rank not in step.get("ranks", range(a["world"])):
        results.append(None)
        continue
    os.environ.update(step.get("env", {}))
    world = step.get("world", a["world"])
    out = {"rank": rank, "calls": []}
    t0 = time.monotonic()
    try:
        if step.get("listen"):
            me = _cluster.listen_address() + "|" + _cluster.node_id()
            got = _cluster.allgather(me.encode(), rank=rank, world_size=world, run_id=step.get("run", "r1"),
                                     timeout=step.get("timeout", 10.0), backend=step.get("backend"))
            out["listen"] = [g.decode() for g in got]
        for call in range(step.get("calls", 1)):
            sizes = step.get("sizes", [64])
            payload = bytes([(rank * 7 + call) % 251]) * sizes[call % len(sizes)]
            got = _cluster.allgather(payload, rank=rank, world_size=world, run_id=step.get("run", "r1"),
                                     timeout=step.get("timeout", 10.0), backend=step.get("backend"))
            out["calls"].append([hashlib.sha256(g).hexdigest() for g in got])
        if step.get("secret"):
            out["secret"] = _cluster.job_secret(rank=rank, world_size=world, run_id=step.get("run", "r1"),
                                                timeout=step.get("timeout", 10.0), single_host=step.get("single_host", False)).hex()
    except Exception as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
        out["missing"] = getattr(e, "missing", None)
    out["elapsed"] = time.monotonic() - t0
    results.append(out)
if a.get("pg"):
    dist.destroy_process_group()
print(json.dumps(results), flush=True)
"""


def expected(rank, call, size):
    return hashlib.sha256(bytes([(rank * 7 + call) % 251]) * size).hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAIRVOYANT_", "SLURM_", "MASTER_", "TORCHELASTIC_"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["CLAIRVOYANT_CACHE_DIR"] = os.environ.get("CLAIRVOYANT_CACHE_DIR", "")
    if "CLAIRVOYANT_SHM_DIR" in os.environ:  # the session's (tests/conftest.py)
        env["CLAIRVOYANT_SHM_DIR"] = os.environ["CLAIRVOYANT_SHM_DIR"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_steps(ranks, world, env, steps, wall=60, spawn=subprocess.Popen, **kw):
    """Per step, the outputs of the ranks that took part, as (output, stderr) in rank order.
    ``spawn(rank, argv, env=, **popen_kw)`` starts a rank (default: a plain process)."""
    if spawn is subprocess.Popen:
        spawn = lambda _rank, argv, **k: subprocess.Popen(argv, **k)  # noqa: E731
    procs = []
    try:
        for r in ranks:
            args = {"rank": r, "world": world, "steps": steps, **kw}
            procs.append(
                spawn(
                    r,
                    [sys.executable, "-c", WORKER, json.dumps(args)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=wall)
            assert p.returncode == 0, stderr
            outs.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [[(o[i], err) for o, err in outs if o[i] is not None] for i in range(len(steps))]


def run_ranks(ranks, world, env, **step):
    """One step on `ranks`."""
    kw = {k: step.pop(k) for k in ("torch", "pg", "wall", "spawn", "progress_after") if k in step}
    return run_steps(ranks, world, env, [step], **kw)[0]


def check_all(outs, world, calls, sizes):
    for out, _ in outs:
        assert "error" not in out, out
        assert len(out["calls"]) == calls
        for call, got in enumerate(out["calls"]):
            size = sizes[call % len(sizes)]
            assert got == [expected(r, call, size) for r in range(world)], f"rank {out['rank']} call {call}"


@pytest.fixture
def shared(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o700)
    return d


# -- store ---------------------------------------------------------------------------------------


@pytest.fixture
def tcp_store():
    torch_dist = pytest.importorskip("torch.distributed")
    port = free_port()
    store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    yield store, port


def test_store_backend(tcp_store, shared):
    """One launch of 3 ranks (torch takes seconds to import): repeated allgathers with payloads
    up to 1 MB on torchrun's agent store, missing ranks, the secret kept out of the store, an
    unreachable store, and rank 0 hosting the store when told to."""
    store, port = tcp_store
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True", CLAIRVOYANT_SHARED_DIR=shared)
    sizes = [16, 1 << 20, 0]
    own = free_port()
    steps = [
        {"calls": 3, "sizes": sizes},
        {"run": "miss", "ranks": [0], "timeout": 2.0},
        {"run": "sec", "secret": True, "calls": 1},
        {"run": "dead", "ranks": [1], "timeout": 1.0, "env": {"MASTER_PORT": str(free_port())}},
        {
            "run": "own",
            "ranks": [0, 1],
            "world": 2,
            "calls": 2,
            "env": {"MASTER_PORT": str(own), "CLAIRVOYANT_STORE_MASTER": "1", "TORCHELASTIC_USE_AGENT_STORE": "0"},
        },
    ]
    t0 = time.monotonic()
    repeated, missing, secret, dead, hosted = run_steps(range(3), 3, env, steps, torch=True)
    print(f"3 store ranks, 5 steps: {time.monotonic() - t0:.1f} s")

    check_all(repeated, 3, 3, sizes)
    for g in range(3):  # the last reader of each call deleted its keys
        assert not store.check([f"clairvoyant/r1/{g}/0"])

    assert len(missing) == 1
    for out, _ in missing:
        assert out["error"] == "RendezvousError"
        assert out["missing"] == [1, 2]
        assert "ranks 1, 2 of 3 did not join within 2 s" in out["message"]
        assert f"127.0.0.1:{port}" in out["message"] and "key clairvoyant/miss/0/" in out["message"]
        assert 1.9 <= out["elapsed"] < 6.0

    check_all(secret, 3, 1, [64])
    assert len({out["secret"] for out, _ in secret}) == 1
    assert (shared / "secret-sec").read_bytes().hex() == secret[0][0]["secret"]
    left = [k for k in ("clairvoyant/sec/0/0", "clairvoyant/sec/0/done") if store.check([k])]
    assert left == []

    ((out, _),) = dead
    assert out["error"] == "RendezvousError" and "could not reach the store" in out["message"]

    check_all(hosted, 2, 2, [64])


def test_store_backend_under_torchrun(tmp_path):
    """The agent store of a real torchrun (TORCHELASTIC_USE_AGENT_STORE), found on its own, before
    and after the ranks initialize a process group."""
    pytest.importorskip("torch.distributed")
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, json\n"
        "from clairvoyant import _cluster, _env\n"
        "p = _env.detect()\n"
        "b = _cluster.choose_backend(p.rank, p.world_size)\n"
        "def ag(i):\n"
        "    return _cluster.allgather(f'{p.rank}:{i}'.encode() * 1000, rank=p.rank, world_size=p.world_size, run_id=p.run_id, timeout=30)\n"
        "outs = [ag(0)]\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "outs.append(ag(1))\n"
        "dist.destroy_process_group()\n"
        # One file per rank: torchrun interleaves the ranks' standard output.
        f"open({str(tmp_path)!r} + f'/result-{{p.rank}}.json', 'w').write(json.dumps([p.rank, b, [[o.decode()[:3] for o in out] for out in outs]]))\n"
    )
    env = clean_env()
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    results = sorted(json.loads(f.read_text()) for f in tmp_path.glob("result-*.json"))
    assert len(results) == 2, r.stdout + r.stderr
    assert [rank for rank, _, _ in results] == [0, 1]
    for _, backend, outs in results:
        assert backend == "store"
        assert outs == [["0:0", "1:0"], ["0:1", "1:1"]]


def test_store_backend_through_an_initialized_gloo_process_group():
    pytest.importorskip("torch.distributed")
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port())
    outs = run_ranks(range(2), 2, env, calls=2, sizes=[1000], torch=True, pg=True)
    check_all(outs, 2, 2, [1000])


# -- file ----------------------------------------------------------------------------------------


def test_file_backend_repeated_and_1mb(shared):
    env = clean_env(CLAIRVOYANT_SHARED_DIR=shared)
    sizes = (10, 1 << 20, 3, 0, 5)
    outs = run_ranks(range(4), 4, env, calls=5, sizes=list(sizes))
    check_all(outs, 4, 5, sizes)
    # Each call's folder went with its last reader, and the run's with the last call's.
    assert list(shared.iterdir()) == []


def test_file_backend_folders_and_files_are_private(shared, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_SHARED_DIR", str(shared))
    monkeypatch.setattr(_cluster, "_generation_read", lambda *a: None)  # keep the call's files
    assert _cluster.allgather(b"x", rank=0, world_size=1, run_id="modes", backend="file") == [b"x"]
    run_dir = shared / "rdv-modes"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for gen in run_dir.iterdir():
        assert stat.S_IMODE(gen.stat().st_mode) == 0o700, gen
        for f in gen.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_file_backend_a_cancelled_call_takes_its_file_back(shared, monkeypatch):
    import threading

    monkeypatch.setenv("CLAIRVOYANT_SHARED_DIR", str(shared))
    cancel, errors = threading.Event(), []

    def wait():
        try:
            _cluster.allgather(b"x", rank=0, world_size=2, run_id="alone", timeout=600, backend="file", cancel=cancel)
        except _cluster.RendezvousError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    cancel.set()
    t.join(timeout=60)
    assert not t.is_alive()
    assert errors and errors[0].missing == [1], errors
    assert list(shared.iterdir()) == []


def test_file_backend_removes_a_crashed_runs_folder_once_stale(shared, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_SHARED_DIR", str(shared))
    old, recent = shared / "rdv-crashed" / "0", shared / "rdv-running" / "0"
    for d in (old, recent):
        d.mkdir(parents=True, mode=0o700)
        (d / "rank-1").write_bytes(b"")
    stale = time.time() - _cluster.RENDEZVOUS_STALE_S - 60
    for p in (old / "rank-1", old, old.parent):
        os.utime(p, (stale, stale))
    assert _cluster.allgather(b"x", rank=0, world_size=1, run_id="next", backend="file") == [b"x"]
    assert sorted(p.name for p in shared.iterdir()) == ["rdv-running"]


def test_file_backend_missing_ranks_are_named(shared):
    env = clean_env(CLAIRVOYANT_SHARED_DIR=shared)
    outs = run_ranks([1, 2], 4, env, timeout=1.5, run="miss")
    for out, _ in outs:
        assert out["error"] == "RendezvousError", out
        assert out["missing"] == [0, 3]
        assert "ranks 0, 3 of 4 did not join within 1.5 s" in out["message"]
        assert str(shared / "rdv-miss" / "0") in out["message"]
        assert 1.4 <= out["elapsed"] < 5.0


def test_file_backend_says_once_who_is_missing(shared):
    # After PROGRESS_AFTER_S (5 s; 0.3 s here).
    env = clean_env(CLAIRVOYANT_SHARED_DIR=shared)
    (out, stderr), = run_ranks([0], 2, env, timeout=1.5, run="slow", progress_after=0.3)
    assert out["missing"] == [1]
    assert "rank 0: waiting for rank 1 of 2 (backend file" in stderr
    assert stderr.count("waiting for") == 1


def test_file_backend_refuses_a_directory_others_can_enter(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    env = clean_env(CLAIRVOYANT_SHARED_DIR=d)
    (out, _), = run_ranks([0], 2, env)
    assert out["error"] == "AccessDeniedError"
    assert str(d) in out["message"] and "0755" in out["message"]


def test_file_backend_refuses_a_stale_file_of_the_same_run(shared):
    env = clean_env(CLAIRVOYANT_SHARED_DIR=shared)
    # A finished run leaves nothing: the same id can be used again.
    check_all(run_ranks(range(2), 2, env, run="again"), 2, 1, (64,))
    check_all(run_ranks(range(2), 2, env, run="again"), 2, 1, (64,))
    # A run whose rank 1 never came (a crash) left rank 0's file: refused, not overwritten.
    ((out, _),) = run_ranks([0], 2, env, run="again", timeout=0.5)
    assert out["error"] == "RendezvousError" and "did not join" in out["message"], out
    ((out, _),) = run_ranks([0], 2, env, run="again", timeout=1.0)
    assert out["error"] == "RendezvousError" and "earlier run with the same run id" in out["message"]


def test_one_rank_needs_no_backend():
    assert _cluster.allgather(b"abc", rank=0, world_size=1, run_id="x") == [b"abc"]


def test_no_backend_is_a_config_error(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("CLAIRVOYANT_", "SLURM_", "MASTER_", "TORCHELASTIC_", "OMPI_", "PMI")):
            monkeypatch.delenv(k)
    with pytest.raises(ConfigError, match="CLAIRVOYANT_SHARED_DIR"):
        _cluster.allgather(b"x", rank=0, world_size=2, run_id="x")
    with pytest.raises(ConfigError, match="'backend'"):
        _cluster.allgather(b"x", rank=0, world_size=2, run_id="x", backend="carrier-pigeon")


def test_mpi_backend():
    from launchers import need_command, need_module

    install = "./dev test installs Open MPI (apt-get install openmpi-bin libopenmpi-dev, as root) and mpi4py"
    need_command("mpirun", install=install)
    need_module("mpi4py.MPI", install=install)
    env = clean_env(CLAIRVOYANT_RENDEZVOUS="mpi")
    code = (
        "from mpi4py import MPI; from clairvoyant import _cluster; c = MPI.COMM_WORLD; "
        "o = _cluster.allgather(bytes([c.rank]) * (c.rank + 1), rank=c.rank, world_size=c.size, run_id='m'); "
        "assert o == [bytes([r]) * (r + 1) for r in range(c.size)], o; "
        "s = _cluster.job_secret(rank=c.rank, world_size=c.size, run_id='m'); "
        "assert c.allgather(s) == [s] * c.size; print('ok')"
    )
    r = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.count("ok") == 2, r.stderr


class _FakeRequest:
    def __init__(self, done):
        self.done = done

    def Test(self):  # noqa: N802 (mpi4py's name)
        return self.done


class _FakeComm:
    """COMM_WORLD of rank 0 of 2 whose peer sent `peer`; `hang` never completes a request."""

    def __init__(self, peer=b"", hang=False):
        self.peer, self.hang = peer, hang

    def Get_size(self):  # noqa: N802
        return 2

    def Get_rank(self):  # noqa: N802
        return 0

    def Iallgather(self, send, recv):  # noqa: N802
        recv[0], recv[1] = send[0], len(self.peer)
        return _FakeRequest(not self.hang)

    def Iallgatherv(self, send, spec):  # noqa: N802
        import numpy as np

        recv, sizes, displs, _ = spec
        recv[displs[0] : displs[0] + sizes[0]] = send
        recv[displs[1] : displs[1] + sizes[1]] = np.frombuffer(self.peer, dtype=np.uint8)
        return _FakeRequest(True)

    def Ibcast(self, buf, root):  # noqa: N802
        return _FakeRequest(not self.hang)


def _fake_mpi(monkeypatch, comm):
    import types

    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD, mpi.BYTE = comm, object()
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    for k in ("CLAIRVOYANT_SECRET", "CLAIRVOYANT_RENDEZVOUS", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")


def test_mpi_backend_buffers_with_a_fake_mpi4py(monkeypatch):
    """The size exchange and displacements of the MPI path (mpi4py itself is not installed here)."""
    _fake_mpi(monkeypatch, _FakeComm(peer=b"x" * 1000))
    assert _cluster.choose_backend(0, 2) == "mpi"
    assert _cluster._mpi_comm(1, 2) is None  # COMM_WORLD says rank 0: not this launch
    assert _cluster.allgather(b"abc", rank=0, world_size=2, run_id="m") == [b"abc", b"x" * 1000]
    secret = _cluster.job_secret(rank=0, world_size=2, run_id="m")
    assert len(secret) == 32 and secret != bytes(32)


def test_mpi_backend_times_out(monkeypatch):
    _fake_mpi(monkeypatch, _FakeComm(hang=True))
    t0 = time.monotonic()
    with pytest.raises(_cluster.RendezvousError, match="did not complete within 0.3 s .backend mpi"):
        _cluster.allgather(b"abc", rank=0, world_size=2, run_id="m", timeout=0.3)
    with pytest.raises(_cluster.RendezvousError, match="MPI broadcast of the job secret"):
        _cluster.job_secret(rank=0, world_size=2, run_id="m", timeout=0.3)
    assert time.monotonic() - t0 < 2


# -- the job secret ------------------------------------------------------------------------------


def no_sources(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("CLAIRVOYANT_SECRET", "CLAIRVOYANT_SHARED_DIR", "SLURM_", "OMPI_", "PMI")):
            monkeypatch.delenv(k)


def test_secret_from_the_environment(monkeypatch):
    no_sources(monkeypatch)
    monkeypatch.setenv("CLAIRVOYANT_SECRET", "0123456789abcdef0123")
    a = _cluster.job_secret(rank=3, world_size=8, run_id="x")
    assert len(a) == 32 and a == _cluster.job_secret(rank=0, world_size=8, run_id="y")
    monkeypatch.setenv("CLAIRVOYANT_SECRET", "0123456789abcdef0124")
    assert _cluster.job_secret(rank=3, world_size=8, run_id="x") != a
    monkeypatch.setenv("CLAIRVOYANT_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        _cluster.job_secret(rank=0, world_size=2, run_id="x")


def test_secret_through_the_shared_directory(shared):
    env = clean_env(CLAIRVOYANT_SHARED_DIR=shared)
    outs = run_ranks(range(3), 3, env, calls=0, secret=True, run="sec")
    secrets_ = {out["secret"] for out, _ in outs}
    assert len(secrets_) == 1 and len(bytes.fromhex(secrets_.pop())) == 32
    f = shared / "secret-sec"
    st = f.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert [p.name for p in shared.iterdir() if p.name.startswith(".secret")] == []  # no temporary left


def test_secret_single_host_uses_a_private_shm_dir(tmp_path):
    env = clean_env(CLAIRVOYANT_SHM_DIR=tmp_path)
    outs = run_ranks(range(2), 2, env, calls=0, secret=True, single_host=True, run="one")
    assert len({out["secret"] for out, _ in outs}) == 1
    d = tmp_path / f"clairvoyant-{os.geteuid()}"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "secret-one").stat().st_mode) == 0o600


def _secret_as_rank1(monkeypatch, shared):
    no_sources(monkeypatch)
    monkeypatch.setenv("CLAIRVOYANT_SHARED_DIR", str(shared))
    return _cluster.job_secret(rank=1, world_size=2, run_id="bad", timeout=2.0)


def test_secret_group_readable_file_is_refused(monkeypatch, shared):
    f = shared / "secret-bad"
    f.write_bytes(os.urandom(32))
    os.chmod(f, 0o640)
    with pytest.raises(AccessDeniedError, match=f"refusing {f}: has mode 0640"):
        _secret_as_rank1(monkeypatch, shared)


def test_secret_symlink_is_refused(monkeypatch, shared, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(os.urandom(32))
    os.chmod(target, 0o600)
    os.symlink(target, shared / "secret-bad")
    with pytest.raises(AccessDeniedError, match=f"refusing {shared / 'secret-bad'}: is a symbolic link"):
        _secret_as_rank1(monkeypatch, shared)


def test_secret_foreign_owned_file_is_refused(monkeypatch, shared):
    if os.geteuid() != 0:
        pytest.skip("making a file owned by another user needs root")
    f = shared / "secret-bad"
    f.write_bytes(os.urandom(32))
    os.chmod(f, 0o600)
    os.chown(f, 65534, 65534)
    with pytest.raises(AccessDeniedError, match=f"refusing {f}: is owned by uid 65534"):
        _secret_as_rank1(monkeypatch, shared)


def test_a_waiting_rank_notices_what_it_waits_for_within_a_quarter_of_the_wait():
    """Polls pause 1 ms at first, each pause a quarter longer than the last, at most 50 ms: what
    appears after t seconds is seen by t * 1.25 + 1 ms (doubling saw it as late as 2t)."""
    pauses = _cluster._pauses()
    first = [next(pauses) for _ in range(40)]
    assert first[0] == 0.001 and max(first) == _cluster._MAX_SLEEP_S
    assert all(b <= a * 1.25 + 1e-12 for a, b in zip(first, first[1:]))
    for k in range(1, 4000):
        appears = k * 0.0025  # up to 10 s
        pauses, slept = _cluster._pauses(), 0.0
        while slept < appears:
            slept += next(pauses)
        assert slept <= appears * 1.26 + 0.001, (appears, slept)


def test_secret_rank0_never_showing_up_times_out(monkeypatch, shared):
    t0 = time.monotonic()
    with pytest.raises(_cluster.RendezvousError, match="rank 0 of 2 did not create the job secret"):
        no_sources(monkeypatch)
        monkeypatch.setenv("CLAIRVOYANT_SHARED_DIR", str(shared))
        _cluster.job_secret(rank=1, world_size=2, run_id="late", timeout=0.5)
    assert time.monotonic() - t0 < 3


def test_secret_without_any_source_is_a_config_error(monkeypatch):
    no_sources(monkeypatch)
    with pytest.raises(ConfigError) as e:
        _cluster.job_secret(rank=0, world_size=4, run_id="x")
    assert "CLAIRVOYANT_SECRET" in str(e.value) and "CLAIRVOYANT_SHARED_DIR" in str(e.value)


# -- listen_address and node_id ------------------------------------------------------------------


def _is_ip(s):
    import ipaddress

    return ipaddress.ip_address(s)


def test_listen_address_never_a_wildcard(monkeypatch):
    for k in ("CLAIRVOYANT_LISTEN", "MASTER_ADDR", "CLAIRVOYANT_PEERS", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    assert _cluster.listen_address() == "127.0.0.1"
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _cluster.listen_address() == "127.0.0.1"
    addr = _cluster.listen_address(peers_hint=["localhost:1234"])
    assert not _is_ip(addr).is_unspecified
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")
    assert not _is_ip(_cluster.listen_address()).is_unspecified
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    assert _cluster.listen_address() == "127.0.0.1"


def test_listen_address_reaches_a_non_loopback_master(monkeypatch):
    # The address of a real interface, if this machine has one: the route to it starts there.
    names = [n for _, n in socket.if_nameindex() if n != "lo"]
    addrs = []
    for n in names:
        try:
            monkeypatch.setenv("CLAIRVOYANT_LISTEN", n)
            addrs.append(_cluster.listen_address())
        except ConfigError:
            pass
    monkeypatch.delenv("CLAIRVOYANT_LISTEN")
    if not addrs:
        pytest.skip("no interface with an address besides lo")
    monkeypatch.setenv("MASTER_ADDR", addrs[0])
    assert _cluster.listen_address() == addrs[0]


def test_listen_address_honours_clairvoyant_listen(monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_LISTEN", "127.0.0.5")
    assert _cluster.listen_address() == "127.0.0.5"
    monkeypatch.setenv("CLAIRVOYANT_LISTEN", "lo")
    assert _cluster.listen_address() == "127.0.0.1"
    for bad in ("0.0.0.0", "::"):
        monkeypatch.setenv("CLAIRVOYANT_LISTEN", bad)
        with pytest.raises(ConfigError, match="every interface"):
            _cluster.listen_address()
    monkeypatch.setenv("CLAIRVOYANT_LISTEN", "nosuchif0")
    with pytest.raises(ConfigError, match="'nosuchif0' is neither an IP address nor an interface"):
        _cluster.listen_address()


def test_node_id(monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_NODE_ID", "node7")
    assert _cluster.node_id() == "node7"
    monkeypatch.delenv("CLAIRVOYANT_NODE_ID")
    a = _cluster.node_id()
    assert a.startswith(socket.gethostname() + "/") and a == _cluster.node_id()


# -- across emulated nodes (tests/netns.py) -----------------------------------------------------

sys.path.insert(0, os.path.dirname(__file__))
import netns  # noqa: E402

_NO_NETNS = netns.netns_unavailable()


@pytest.mark.parametrize(
    "kind",
    [pytest.param("loopback"), pytest.param("netns", marks=pytest.mark.skipif(_NO_NETNS is not None, reason=str(_NO_NETNS)))],
)
def test_rendezvous_across_emulated_nodes(kind, shared):
    """Each rank on its own node learns every node's listen address and id; under namespaces
    the store is hosted by rank 0 on node 0's address and reached from the other nodes."""
    n = 3
    with netns.Nodes(n) if kind == "netns" else netns.LoopbackNodes(n) as nodes:
        env = clean_env(CLAIRVOYANT_SHARED_DIR=shared, MASTER_ADDR=nodes.addresses[0], MASTER_PORT=free_port())
        steps = [{"listen": True, "backend": "file", "calls": 2, "sizes": [1 << 20]}]
        if kind == "netns":
            steps.append({"run": "store", "listen": True, "calls": 2, "env": {"CLAIRVOYANT_STORE_MASTER": "1"}})
        results = run_steps(range(n), n, env, steps, spawn=nodes.popen, torch=kind == "netns")
    want = [f"{nodes.addresses[i]}|node{i}" for i in range(n)]
    for outs in results:
        check_all(outs, n, 2, [1 << 20] if outs is results[0] else [64])
        for out, _ in outs:
            assert out["listen"] == want


def test_listen_address_when_the_master_name_resolves_to_loopback(monkeypatch, capsys):
    """On the master, its own host name often resolves to 127.0.1.1 (Debian's /etc/hosts): the
    other nodes cannot reach that, so the default route's interface is taken instead."""
    import ipaddress

    host = socket.gethostname()
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"this host's name {host} does not resolve")
    if not ipaddress.ip_address(resolved).is_loopback:
        pytest.skip(f"this host's name resolves to {resolved}, not to loopback")
    for k in ("CLAIRVOYANT_LISTEN", "CLAIRVOYANT_PEERS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MASTER_ADDR", host)
    default = _cluster._route_source("192.0.2.1")
    addr = _cluster.listen_address()
    if default is None:
        assert addr == resolved
    else:
        assert addr == default and not ipaddress.ip_address(addr).is_loopback
        assert "set CLAIRVOYANT_LISTEN" in capsys.readouterr().err


def test_store_backend_1024_ranks(tcp_store):
    """1,024 ranks (8 processes of 128 threads, each thread its own TCPStore client, as every rank
    of a job has) meet through one real TCPStore: every rank gets every payload. Prints the time
    from the start signal until the slowest rank returned."""
    store, port = tcp_store
    world, procs_n, size = 1024, 8, 256
    per = world // procs_n
    env = clean_env()
    procs = []
    try:
        for p in range(procs_n):
            args = {"port": port, "world": world, "ranks": [p * per, (p + 1) * per], "size": size, "run": "scale", "timeout": 120.0}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "tests" / "rendezvous_ranks.py"), json.dumps(args)],
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [json.loads(p.stdout.readline()) for p in procs]
        took = time.monotonic() - t0
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    errors = {r: e for o in outs for r, e in o["errors"].items()}
    assert errors == {}
    assert sorted(r for o in outs for r in o["ok"]) == list(range(world)), "every rank got every payload"
    assert not store.check(["clairvoyant/scale/0/0"]), "the last reader removed the keys"
    print(f"{world} store ranks ({procs_n} processes x {per} threads, {size}-byte payloads): {took:.2f} s, slowest rank {max(o['slowest'] for o in outs):.2f} s")


class _DictStore:
    """The part of TCPStore's interface the store backend uses, in memory, thread-safe; counts
    the keys each rank's requests name."""

    def __init__(self):
        import threading

        self.data, self.cv, self.requests = {}, threading.Condition(), {}

    def _count(self, keys=1):
        import threading

        name = threading.current_thread().name
        self.requests[name] = self.requests.get(name, 0) + keys

    def set(self, k, v):
        with self.cv:
            self._count()
            self.data[k] = bytes(v)
            self.cv.notify_all()

    def get(self, k):
        with self.cv:
            self._count()
            return self.data[k]

    def multi_get(self, keys):
        with self.cv:
            self._count(len(keys))
            return [self.data[k] for k in keys]

    def check(self, keys):
        with self.cv:
            self._count(len(keys))
            return all(k in self.data for k in keys)

    def wait(self, keys, timeout):
        with self.cv:
            self._count(len(keys))
            if not self.cv.wait_for(lambda: all(k in self.data for k in keys), timeout.total_seconds()):
                raise RuntimeError("wait timed out")

    def add(self, k, n):
        with self.cv:
            self._count()
            self.data[k] = str(int(self.data.get(k, b"0")) + n).encode()
            return int(self.data[k])

    def delete_key(self, k):
        with self.cv:
            self._count()
            return self.data.pop(k, None) is not None


def _threads_allgather(store, ranks, world, timeout, monkeypatch):
    import threading

    monkeypatch.setattr(_cluster, "_store", lambda rank, timeout: (store, "memory"))
    out = {}

    def one(r):
        try:
            out[r] = _cluster._allgather_store(f"p{r}".encode() * 3, r, world, "mem", 0, timeout)
        except Exception as e:
            out[r] = e

    threads = [threading.Thread(target=one, args=(r,), name=f"rank-{r}") for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_store_backend_requests_per_rank_do_not_grow_with_the_world(monkeypatch):
    """Rank 0 gathers, the others read one value: a rank other than 0 names the same few keys in
    its requests whatever the world size (not every other rank's); every key is gone afterwards."""
    for world in (4, 64):
        store = _DictStore()
        out = _threads_allgather(store, range(world), world, 10.0, monkeypatch)
        for r in range(world):
            assert out[r] == [f"p{x}".encode() * 3 for x in range(world)], r
        others = {n for r, n in store.requests.items() if r != "rank-0"}
        assert max(others) <= 6, store.requests  # set, wait, get, add (+ 2 deletes by the last)
        assert store.data == {}


def test_store_backend_names_rank_0_when_it_never_publishes(monkeypatch):
    """Every rank wrote its key but rank 0 (the one gathering) never published: the others say so."""
    store = _DictStore()
    store.set("clairvoyant/mem/0/0", b"x")
    out = _threads_allgather(store, [1, 2], 3, 0.5, monkeypatch)
    for r in (1, 2):
        assert isinstance(out[r], _cluster.RendezvousError), out[r]
        assert out[r].missing == [0] and "rank 0 of 3 did not join" in str(out[r])
    out = _threads_allgather(_DictStore(), [0, 2], 3, 0.5, monkeypatch)
    for r in (0, 2):
        assert isinstance(out[r], _cluster.RendezvousError) and out[r].missing == [1], out[r]


def test_store_backend_combined_value_round_trips_compressible_or_not():
    for values in ([b"same record " * 20] * 50, [os.urandom(n) for n in (0, 1, 100, 5000)], [b""]):
        blob = _cluster._pack(values)
        assert blob[:1] in (b"z", b"r")
        assert _cluster._unpack(blob, len(values)) == values
    assert _cluster._pack([b"same record " * 20] * 50)[:1] == b"z"
    assert _cluster._pack([os.urandom(5000)])[:1] == b"r"
    with pytest.raises(CorruptError, match="2 payloads for world size 3"):
        _cluster._unpack(_cluster._pack([b"a", b"b"]), 3)
