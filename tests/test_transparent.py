"""Transparent mode end to end: unmodified programs under `clairvoyant run` read exactly the
file system's bytes, the node agent reads the dataset once, keeps a fixed subset when its cache
is smaller than the dataset, places by the order when an order file gives it, aggregates the
caches of two emulated nodes, and a killed agent (this node's or a peer's) leaves the program
finishing on direct reads."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest

from benches.emulation import memory_config, node_env
from test_cache_trust import in_small_tmpfs

HERE = os.path.dirname(os.path.abspath(__file__))
READER = os.path.join(HERE, "transparent_reader.py")
N_FILES = 120


def _preload_or_skip():
    try:
        from clairvoyant import _preload

        return _preload.preload_library()
    except Exception as e:  # noqa: BLE001 - any reason the library is unusable is a skip reason
        pytest.skip(f"the interposed library is not available: {e}")


@pytest.fixture
def dataset(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "data"
    crcs, total = {}, 0
    for k in range(N_FILES):
        d = root / f"class_{k % 4}"
        d.mkdir(parents=True, exist_ok=True)
        data = rng.integers(0, 256, size=int(rng.integers(2000, 9000)), dtype=np.uint8).tobytes()
        (d / f"f{k:04d}.bin").write_bytes(data)
        crcs[f"class_{k % 4}/f{k:04d}.bin"] = zlib.crc32(data)
        total += len(data)
    return str(root), crcs, total


def _env(tmp_path, extra=None) -> dict:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["CLAIRVOYANT_SHM_DIR"] = str(tmp_path / "shm")
    env["CLAIRVOYANT_CACHE_DIR"] = str(tmp_path / "cache")
    env["CLAIRVOYANT_AGENT_LINGER"] = "20"
    env["CLAIRVOYANT_AGENT_LOG"] = str(tmp_path / "agent-logs")  # an agent's folder goes with it
    os.makedirs(env["CLAIRVOYANT_SHM_DIR"], exist_ok=True)
    env.update(extra or {})
    return env


def _config(path, memory: int) -> str:
    return memory_config(path, memory)


def _run(args, env, timeout=180, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clairvoyant", "run", *args], env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def _check_reads(out_path, crcs, epochs):
    with open(out_path) as f:
        got = json.load(f)
    assert len(got["epochs"]) == epochs
    for e, seen in enumerate(got["epochs"]):
        assert seen == {k: v for k, v in crcs.items() if k in seen}, f"epoch {e}: bytes differ from the file system"
    return got


def test_reads_are_the_file_systems_bytes_and_the_dataset_is_read_once(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, total = dataset
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    r = _run(
        ["--dataset", root, "--stats", "--stats-interval", "0.5", "--stats-json", str(stats), "--",
         sys.executable, READER, root, "--epochs", "2", "--out", str(out)],
        _env(tmp_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = _check_reads(out, crcs, 2)
    assert all(len(e) == N_FILES for e in got["epochs"])
    s = json.loads(stats.read_text())
    reads = s["reads"]
    # The order is not known: in epoch 0 the program read each file once itself (as it would
    # directly) and handed it to the node cache; epoch 1 came from the node cache alone.
    assert reads["cached_bytes"] == total, s
    assert reads["direct_bytes"] == total and reads["fill_bytes"] == total, s
    assert s["program_fill_bytes_kept"] == total and s["pfs_bytes"] == 0, s
    assert reads["fallbacks"] == 0 and reads["corrupt"] == 0, s
    assert "clairvoyant run:" in r.stderr and "total" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a small tmpfs in a private mount namespace)")
def test_a_shared_memory_with_no_room_caches_in_a_disk_file_and_says_so(tmp_path, dataset):
    # A container's /dev/shm (64 MB by default) can hold nothing for the node cache: the
    # memory class becomes a file on disk (the page cache keeps it in memory), and the launcher
    # repeats the agent's warnings, so the user knows why.
    _preload_or_skip()
    root, crcs, total = dataset
    shm = tmp_path / "small-shm"
    shm.mkdir()
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    env = _env(tmp_path, {"CLAIRVOYANT_SHM_DIR": str(shm)})
    r = in_small_tmpfs(
        str(shm), "8m",
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", root, "--stats-json", str(stats), "--",
         sys.executable, READER, root, "--epochs", "2", "--out", str(out)],
        env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    _check_reads(out, crcs, 2)
    assert "is a file on disk" in r.stderr and f"{shm}" in r.stderr, r.stderr
    s = json.loads(stats.read_text())
    assert s["reads"]["cached_bytes"] == total, s  # epoch 1 from the node cache


def test_shell_tools_read_identical_bytes(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, _ = dataset
    files = sorted(glob.glob(os.path.join(root, "*", "*.bin")))[:5]
    script = "; ".join([f"md5sum {f}; cat {f} | md5sum; dd if={f} bs=7 status=none | md5sum" for f in files])
    plain = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout
    # Twice within one run: the second reads come from the cache.
    r = _run(["--dataset", root, "--", "sh", "-c", f"{script}; {script}"], _env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == plain + plain


def test_a_cache_half_the_dataset_keeps_a_fixed_subset(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, total = dataset
    cfg = _config(tmp_path / "half.toml", total // 2)
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    r = _run(
        ["--dataset", root, "--config", cfg, "--stats-json", str(stats), "--",
         sys.executable, READER, root, "--epochs", "3", "--out", str(out)],
        _env(tmp_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    _check_reads(out, crcs, 3)
    s = json.loads(stats.read_text())
    reads = s["reads"]
    # The subset the cache keeps, read once by the program in epoch 0 and handed over.
    filled = s["program_fill_bytes_kept"]
    assert 0.35 * total <= filled <= 0.5 * total and s["pfs_bytes"] == 0, s
    # Epochs 1 and 2 hit exactly that subset: the byte hit rate is what the cache holds.
    later_hits = reads["cached_bytes"]
    assert later_hits == 2 * filled, s
    assert later_hits / (2 * total) >= 0.35, s
    # Epoch 0 read everything from the file system, epochs 1 and 2 what the cache does not hold.
    assert reads["direct_bytes"] == total + 2 * (total - filled), s


def _order_file(path, root, epochs, seed=0):
    from transparent_reader import files  # noqa: E402 - the program's own listing

    with open(path, "w") as f:
        for e in range(epochs):
            order = list(files(root))
            random.Random(seed * 1000 + e).shuffle(order)
            f.write("\n".join(order) + "\n\n")
    return str(path)


def test_a_known_order_reads_the_minimum(tmp_path, dataset):
    _preload_or_skip()
    sys.path.insert(0, HERE)
    root, crcs, total = dataset
    capacity = total // 2
    cfg = _config(tmp_path / "half.toml", capacity)
    order = _order_file(tmp_path / "order.txt", root, 3)
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    r = _run(
        ["--dataset", root, "--config", cfg, "--order-file", order, "--stats-json", str(stats), "--",
         sys.executable, READER, root, "--epochs", "3", "--out", str(out)],
        _env(tmp_path),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    _check_reads(out, crcs, 3)
    s = json.loads(stats.read_text())
    fs = s["pfs_bytes"] + s["reads"]["direct_bytes"]
    minimum = total + 2 * (total - capacity)
    assert fs <= 1.05 * minimum, (fs, minimum, s)


def test_a_bad_order_file_names_the_line(tmp_path, dataset):
    _preload_or_skip()
    root, _, _ = dataset
    order = tmp_path / "order.txt"
    order.write_text("class_0/f0000.bin\nnot/there.bin\n")
    r = _run(["--dataset", root, "--order-file", str(order), "--", "true"], _env(tmp_path))
    assert r.returncode != 0
    assert "line 2" in r.stderr and "not/there.bin" in r.stderr, r.stderr


def _agent_pids(shm, root) -> list:
    """Live agents serving ``root`` (their directory is under ``shm``, or in the short-path
    fallback under the temporary directory). A pid file left by an earlier run may name a pid
    the system has given to another process since (the launcher or the program of this run,
    whose command lines name ``root`` too): only an agent's own command line counts."""
    pids = []
    for p in glob.glob(os.path.join(shm, "clairvoyant-*", "*", "agent.pid")) + glob.glob(
        os.path.join(tempfile.gettempdir(), f"clairvoyant-{os.geteuid()}", "*", "agent.pid")
    ):
        try:
            pid = int(open(p).read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
                if os.fsencode(root) in args and b"clairvoyant._agent" in args:
                    pids.append(pid)
        except (OSError, ValueError):
            pass
    return pids


def test_the_agent_killed_mid_run_leaves_the_program_reading_directly(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, _ = dataset
    env = _env(tmp_path)
    out = tmp_path / "out.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", root, "--",
         sys.executable, READER, root, "--epochs", "3", "--delay", "0.01", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    pids = []
    while not pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = _agent_pids(env["CLAIRVOYANT_SHM_DIR"], root)
    assert pids, "no agent started"
    time.sleep(1.0)  # mid epoch 0 or 1
    os.kill(pids[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    _check_reads(out, crcs, 3)


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] in "ZX"
    except (OSError, IndexError):
        return True


def test_a_launcher_killed_with_sigkill_takes_its_program_and_then_its_agent(tmp_path, dataset):
    # A rank is its launcher and its program: killing the launcher with -9 (a user, or a job
    # launcher stopping its ranks) must not leave the program running unattended.
    _preload_or_skip()
    root, _, _ = dataset
    env = _env(tmp_path, {"CLAIRVOYANT_AGENT_LINGER": "0"})
    launcher = subprocess.Popen(
        [sys.executable, "-m", "clairvoyant", "run", "--dataset", root, "--",
         sys.executable, READER, root, "--epochs", "1000", "--delay", "0.01", "--out", str(tmp_path / "out.json")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    program, agents = [], []
    while not (program and agents) and time.monotonic() < deadline:
        time.sleep(0.2)
        program = [c for c in _children(launcher.pid) if b"transparent_reader.py" in open(f"/proc/{c}/cmdline", "rb").read()]
        agents = _agent_pids(env["CLAIRVOYANT_SHM_DIR"], root)
    assert program and agents, "the program or its agent did not start"
    time.sleep(1.0)  # the program reads
    assert not _gone(program[0])
    launcher.kill()
    launcher.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not _gone(program[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = not _gone(program[0])
    if alive:
        os.kill(program[0], signal.SIGKILL)
    assert not alive, "the program outlived its launcher"
    # With no launcher and no program left, the agent leaves too (and removes its folder).
    deadline = time.monotonic() + 30
    while not all(_gone(a) for a in agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(a) for a in agents), "the agent outlived its launcher and program"


def _two_nodes(tmp_path, root, memory, program, extra_args=(), kill_node=None, run_args=()):
    """Run `program` (args after it get --rank/--world-size or --shard) under `clairvoyant run`
    on two emulated nodes; returns (per-node stats, per-node output path)."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700, exist_ok=True)
    cfg = _config(tmp_path / "node.toml", memory)
    procs, outs, stats = [], [], []
    for i in range(2):
        shm = tmp_path / f"shm{i}"
        shm.mkdir(exist_ok=True)
        env = _env(tmp_path, node_env(i, str(shm), str(shared), "transparent-test"))
        env["CLAIRVOYANT_SHM_DIR"] = str(shm)
        out, st = tmp_path / f"out{i}.json", tmp_path / f"stats{i}.json"
        outs.append(out)
        stats.append(st)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "clairvoyant", "run", "--dataset", root, "--config", cfg,
                 "--nodes", "2", "--node-rank", str(i), "--stats-json", str(st), *run_args, "--",
                 *program(i), "--out", str(out), *extra_args],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        )
    if kill_node is not None:
        shm = str(tmp_path / f"shm{kill_node}")
        deadline = time.monotonic() + 60
        pids = []
        while not pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = _agent_pids(shm, root)
        assert pids, "no agent on the node to kill"
        time.sleep(1.5)
        os.kill(pids[0], signal.SIGKILL)
    results = []
    for p in procs:
        _, err = p.communicate(timeout=300)
        results.append((p.returncode, err))
    for code, err in results:
        assert code == 0, err
    return [json.loads(s.read_text()) if s.exists() else None for s in stats], outs


def test_two_nodes_read_the_dataset_once_between_them(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, total = dataset
    stats, outs = _two_nodes(
        tmp_path, root, int(total * 0.6), lambda i: [sys.executable, READER, root, "--shard", f"{i}/2"], ("--epochs", "3")
    )
    for out in outs:
        _check_reads(out, crcs, 3)
    fs = sum(s["pfs_bytes"] + s["reads"]["direct_bytes"] for s in stats)
    assert fs <= 1.05 * total, (fs, total, stats)
    # Each node took part of its reads from the other's cache.
    assert all(s["reads"]["inline_bytes"] > 0 for s in stats), stats


def test_a_peer_agent_killed_mid_run_leaves_both_programs_finishing(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, total = dataset
    stats, outs = _two_nodes(
        tmp_path,
        root,
        int(total * 0.6),
        lambda i: [sys.executable, READER, root, "--shard", f"{i}/2", "--delay", "0.01"],
        ("--epochs", "3"),
        kill_node=1,
    )
    for out in outs:
        _check_reads(out, crcs, 3)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exits_within(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not a child of ours: the agent runs in its own session) exits
    within ``timeout`` seconds, awaited on a process descriptor."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _agent_dirs(*bases) -> set:
    """Every agent folder (``agent-*`` in a runtime folder, ``a-*`` in the short-path fallback)
    under ``bases``."""
    out = set()
    for b in bases:
        out |= set(glob.glob(os.path.join(b, "clairvoyant-*", "agent-*")))
        out |= set(glob.glob(os.path.join(b, "clairvoyant-*", "a-*")))
    return out


@pytest.mark.parametrize("killed", ["agent", "launcher"])
def test_a_killed_node_lets_the_agents_leave_at_once_and_the_ports_serve_a_relaunch(tmp_path, dataset, killed):
    """Node 1's agent killed: the surviving agent does not wait out CLAIRVOYANT_AGENT_LINGER
    (600 s here) for it. Node 1's launcher killed: its agent sees it detach and both agents
    leave together once node 0's program is done. Either way node 0's folder and the rendezvous
    leave nothing of the run, and a relaunch on the same ports starts at once (and reclaims a
    killed agent's folder)."""
    _preload_or_skip()
    root, crcs, _ = dataset
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    cfg = _config(tmp_path / "node.toml", 1 << 20)
    ports = [_free_port(), _free_port()]
    # A short temporary folder of this test's own: agent folders move there when the runtime
    # folder's path is too long for a socket.
    tmp = tempfile.mkdtemp(prefix="cv-")
    try:
        shms = [tmp_path / "shm0", tmp_path / "shm1"]

        def launch(run_id):
            procs = []
            for i in range(2):
                shms[i].mkdir(exist_ok=True)
                env = _env(tmp_path, node_env(i, str(shms[i]), str(shared), run_id))
                env.update(CLAIRVOYANT_PORT=str(ports[i]), CLAIRVOYANT_AGENT_LINGER="600", TMPDIR=tmp)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "clairvoyant",
                            "run",
                            "--dataset",
                            root,
                            "--config",
                            cfg,
                            "--nodes",
                            "2",
                            "--node-rank",
                            str(i),
                            "--",
                            sys.executable,
                            READER,
                            root,
                            "--shard",
                            f"{i}/2",
                            "--epochs",
                            "2",
                            "--delay",
                            "0.005",
                            "--out",
                            str(tmp_path / f"{run_id}-{i}.json"),
                        ],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                    )  # fmt: skip
                )
            return procs

        def agents():
            deadline = time.monotonic() + 120
            pids = [[], []]
            while not all(pids) and time.monotonic() < deadline:
                time.sleep(0.2)
                pids = [_agent_pids(str(shms[i]), root) + _agent_pids_under(tmp, root, i) for i in range(2)]
            assert all(pids), f"agents: {pids}"
            return [p[0] for p in pids]

        before = _agent_dirs(tmp, *map(str, shms))
        procs = launch("life-1")
        a0, a1 = agents()
        os.kill(a1 if killed == "agent" else procs[1].pid, signal.SIGKILL)
        for i, p in enumerate(procs):
            _, err = p.communicate(timeout=300)
            assert p.returncode == (-signal.SIGKILL if killed == "launcher" and i == 1 else 0), err
        assert _exits_within(a0, 120), "node 0's agent waits for the killed one"
        _check_reads(tmp_path / "life-1-0.json", crcs, 2)
        if killed == "agent":
            _check_reads(tmp_path / "life-1-1.json", crcs, 2)
        else:
            assert _exits_within(a1, 120), "node 1's agent outlives its killed launcher"
        left = _agent_dirs(tmp, *map(str, shms)) - before
        # The killed agent's folder (reclaimed by the next launcher), nothing of an agent that left.
        assert len(left) == (1 if killed == "agent" else 0), left
        assert not list(shared.glob("rdv-*")), list(shared.iterdir())

        # The same ports at once; the killed agent's folder is reclaimed by the next launcher.
        procs = launch("life-2")
        b0, b1 = agents()
        for p in procs:
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        assert _exits_within(b0, 120) and _exits_within(b1, 120)
        assert _agent_dirs(tmp, *map(str, shms)) - before == set()
        assert not list(shared.glob("rdv-*")), list(shared.iterdir())
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _agent_pids_under(tmp, root, node) -> list:
    """Live agents of emulated node ``node`` serving ``root`` whose folder is under ``tmp``."""
    pids = []
    for p in glob.glob(os.path.join(tmp, "clairvoyant-*", "*", "agent.pid")):
        try:
            pid = int(open(p).read())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if os.fsencode(root) in args and b"clairvoyant._agent" in args and args[args.index(b"--node") + 1] == str(node).encode():
                pids.append(pid)
        except (OSError, ValueError):
            pass
    return pids


def _imagefolder(root, classes=3, per_class=24):
    from benches.emulation import make_imagefolder

    return make_imagefolder(root, classes, per_class, size_range=(72, 120))


@pytest.mark.parametrize("order", ["unknown", "sampler"])
def test_an_unmodified_torch_script_on_two_nodes(tmp_path, order):
    _preload_or_skip()
    pytest.importorskip("torchvision")
    root = str(tmp_path / "images")
    total = _imagefolder(root)
    script = os.path.join(HERE, "transparent_torch.py")
    plain = []
    for i in range(2):
        out = tmp_path / f"plain{i}.json"
        subprocess.run(
            [sys.executable, script, root, "--rank", str(i), "--world-size", "2", "--epochs", "2", "--out", str(out)],
            check=True,
            env=_env(tmp_path),
            timeout=300,
        )
        plain.append(json.loads(out.read_text())["epochs"])
    stats, outs = _two_nodes(
        tmp_path,
        root,
        int(total * 0.6),
        lambda i: [sys.executable, script, root, "--rank", str(i), "--world-size", "2"],
        ("--epochs", "2"),
        run_args=("--sampler-order",) if order == "sampler" else (),
    )
    if order == "sampler":
        logs = _agent_logs(str(tmp_path), root)
        assert logs.count("placing by the order in") >= 2 and "no order came before the first read" not in logs, logs
    for i, out in enumerate(outs):
        assert json.loads(out.read_text())["epochs"] == plain[i], f"node {i}: batches differ"
    fs = sum(s["pfs_bytes"] + s["reads"]["direct_bytes"] for s in stats)
    assert fs <= 1.05 * total, (fs, total, stats)


def _agent_logs(tmp_path, root) -> str:
    """The logs of the agents that served ``root`` (kept in ``CLAIRVOYANT_AGENT_LOG``)."""
    text = ""
    for p in sorted(glob.glob(os.path.join(tmp_path, "agent-logs", "*.log"))):
        log = open(p, errors="replace").read()
        if f"files under {root}," in log:
            text += log
    return text


def test_the_sampler_order_reaches_the_agent(tmp_path):
    _preload_or_skip()
    pytest.importorskip("torchvision")
    root = str(tmp_path / "images")
    total = _imagefolder(root)
    script = os.path.join(HERE, "transparent_torch.py")
    plain = tmp_path / "plain.json"
    subprocess.run([sys.executable, script, root, "--epochs", "2", "--out", str(plain)], check=True, env=_env(tmp_path), timeout=300)
    out, stats = tmp_path / "out.json", tmp_path / "stats.json"
    env = _env(tmp_path, {"CLAIRVOYANT_EPOCHS": "2"})
    r = _run(
        ["--dataset", root, "--sampler-order", "--config", _config(tmp_path / "half.toml", total // 2),
         "--stats-json", str(stats), "--", sys.executable, script, root, "--epochs", "2", "--out", str(out)],
        env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "places by the sampler's order" in r.stderr, r.stderr
    assert json.loads(out.read_text())["epochs"] == json.loads(plain.read_text())["epochs"]
    s = json.loads(stats.read_text())
    # Placed by the order (prefilled, not only what was read), the minimum read.
    fs = s["pfs_bytes"] + s["reads"]["direct_bytes"]
    assert fs <= 1.05 * (total + (total - total // 2)), s
    assert "placing by the order in" in _agent_logs(str(tmp_path), root)


def test_ranks_of_a_torchrun_launch_share_one_agent(tmp_path, dataset):
    _preload_or_skip()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip(f"no torchrun next to {sys.executable}")
    root, crcs, total = dataset
    env = _env(tmp_path)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    out = tmp_path / "out"
    r = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", "clairvoyant", "run", "--dataset", root,
         "--stats-json", str(tmp_path / "stats.json"), "--", "sh", "-c",
         f"{sys.executable} {READER} {root} --epochs 2 --out {out}$RANK.json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for rank in range(2):
        _check_reads(f"{out}{rank}.json", crcs, 2)
    s = json.loads((tmp_path / "stats.json").read_text())  # the node's figures, written by the last launcher
    # One agent for both ranks: the dataset read once (by whichever rank opened a file first),
    # every other read served from the node cache.
    assert s["pfs_bytes"] + s["reads"]["direct_bytes"] == total, s


ODD_READER = """
import json, os, sys, zlib
root = os.fsencode(sys.argv[1])
out = {}
for d, dirs, files in os.walk(root):
    for f in files:
        p = os.path.join(d, f)
        try:
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root).hex()] = zlib.crc32(fh.read())
        except OSError as e:
            out[os.path.relpath(p, root).hex()] = e.errno
print(json.dumps(out, sort_keys=True))
"""


def test_names_that_are_not_utf8_and_symlink_loops_are_read_identically(tmp_path, dataset):
    _preload_or_skip()
    import socket

    root, _, _ = dataset
    broot = os.fsencode(root)
    with open(os.path.join(broot, b"class_0", b"caf\xe9-\xff.bin"), "wb") as f:
        f.write(os.urandom(5000))
    os.mkdir(os.path.join(broot, b"dir-\xfe"))
    with open(os.path.join(broot, b"dir-\xfe", b"x.bin"), "wb") as f:
        f.write(os.urandom(3000))
    os.symlink("loop-b", os.path.join(root, "class_1", "loop-a"))
    os.symlink("loop-a", os.path.join(root, "class_1", "loop-b"))
    os.symlink("missing", os.path.join(root, "class_2", "dangling"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(root, "class_3", "s.sock"))
    reader = tmp_path / "odd_reader.py"
    reader.write_text(ODD_READER)
    plain = subprocess.run([sys.executable, str(reader), root], capture_output=True, text=True, check=True).stdout
    try:
        r = _run(["--dataset", root, "--", sys.executable, str(reader), root], _env(tmp_path))
    finally:
        sock.close()
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == plain, "bytes differ from the file system"
    got = json.loads(r.stdout)
    assert b"class_0/caf\xe9-\xff.bin".hex() in got and len(got) >= N_FILES + 2
    assert "skipping 2 symbolic links that cannot be followed" in r.stderr, r.stderr
    assert "skipping 1 sockets" in r.stderr and "not UTF-8" not in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a folder of another user)")
def test_a_runtime_folder_taken_by_another_user_moves_to_a_fresh_name(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, _ = dataset
    env = _env(tmp_path)
    taken = os.path.join(env["CLAIRVOYANT_SHM_DIR"], f"clairvoyant-{os.geteuid()}")
    os.mkdir(taken, 0o777)
    os.chown(taken, 65534, 65534)
    out = tmp_path / "out.json"
    r = _run(["--dataset", root, "--", sys.executable, READER, root, "--epochs", "1", "--out", str(out)], env)
    assert r.returncode == 0, r.stderr
    _check_reads(out, crcs, 1)
    assert f"refusing {taken}" in r.stderr and "using another name" in r.stderr, r.stderr
    assert os.listdir(taken) == [], "something was created in the other user's folder"


def test_verify_per_process_is_named_unchecked(tmp_path, dataset):
    _preload_or_skip()
    root, crcs, _ = dataset
    out = tmp_path / "out.json"
    env = _env(tmp_path, {"CLAIRVOYANT_VERIFY": "process"})
    r = _run(["--dataset", root, "--", sys.executable, READER, root, "--epochs", "1", "--out", str(out)], env)
    assert r.returncode == 0, r.stderr
    _check_reads(out, crcs, 1)
    assert "CLAIRVOYANT_VERIFY=process" in r.stderr and "unchecked" in r.stderr, r.stderr
    plain = _run(["--dataset", root, "--", "true"], _env(tmp_path / "b"))
    assert "unchecked" not in plain.stderr


@pytest.mark.parametrize("lazy", [False, True], ids=["order-unknown", "sampler-order"])
def test_launchers_that_start_together_as_others_end_all_attach(tmp_path, dataset, lazy):
    """Launchers of a node that start together (one per local rank) while the programs of the
    first ones already end: the agent leaves only when no launcher is attached or attaching, so
    none of them fails to attach, and a launcher that comes after it left starts a new one."""
    _preload_or_skip()
    root, _, _ = dataset
    env = _env(tmp_path, {"CLAIRVOYANT_RUN_ID": "together"})
    cmd = [sys.executable, "-m", "clairvoyant", "run", "--dataset", root, *(["--sampler-order"] if lazy else []), "--", sys.executable, "-c", "pass"]
    for attempt in range(6):
        procs = [
            subprocess.Popen(cmd, env=dict(env, LOCAL_RANK=str(i)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for i in range(4)
        ]
        results = [(p.communicate(timeout=120)[1], p.returncode) for p in procs]
        for i, (err, code) in enumerate(results):
            assert code == 0 and "error" not in err, f"attempt {attempt}, launcher {i}: exit {code}: {err}"


def test_an_agent_that_goes_as_a_launcher_attaches_is_replaced(tmp_path, dataset):
    """An agent that answers a launcher and is gone before it attaches it (killed at that
    moment): the launcher starts the next agent, and the program it already started runs to its
    end with the dataset's bytes, not stopped as for an agent that cannot start."""
    _preload_or_skip()
    import socket
    import threading

    root, crcs, _ = dataset
    env = _env(tmp_path, {"CLAIRVOYANT_RUN_ID": "replaced"})
    probe = "from clairvoyant import _run; import sys; print(_run._short_dir(_run.agent_key(sys.argv[1], 'replaced', 1, 0, None, None, False)))"
    folder = subprocess.run([sys.executable, "-c", probe, root], env=env, capture_output=True, text=True, check=True).stdout.strip()
    path = os.path.join(folder, "agent.sock")
    # The doomed agent: it answers probes (a connection that sends nothing), and at the first
    # request (the launcher's attach) its socket goes and the connection drops unanswered.
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(8)
    asked = threading.Event()

    def doomed():
        while True:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(30)
                if conn.recv(1):
                    os.unlink(path)
                    srv.close()
                    asked.set()
                    return

    t = threading.Thread(target=doomed, daemon=True)
    t.start()
    out = tmp_path / "out.json"
    stats = tmp_path / "stats.json"
    r = _run(["--dataset", root, "--stats-json", str(stats), "--", sys.executable, READER, root, "--epochs", "2", "--out", str(out)], env)
    assert asked.is_set(), "the launcher never asked the doomed agent"
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    got = _check_reads(out, crcs, 2)
    assert all(len(e) == N_FILES for e in got["epochs"])
    # The next agent served the program: epoch 1 came from its cache.
    assert json.loads(stats.read_text())["reads"]["cached_bytes"] > 0


@pytest.mark.parametrize("lazy", [False, True], ids=["order-unknown", "sampler-order"])
def test_an_agent_for_an_unknown_order_starts_without_numpy(tmp_path, dataset, lazy):
    """The node agent starts while the programs do, on the same cores: serving an order it does
    not know needs no numpy (about 60 ms of a start here), so it does not load it; an agent that
    may receive the sampler's order loads it once it is ready, before the order comes."""
    _preload_or_skip()
    root, crcs, _ = dataset
    out = tmp_path / "out.json"
    check = (
        "import os, sys, time\n"
        "d = os.path.dirname(os.environ['CLAIRVOYANT_AGENT'])\n"
        "t = time.monotonic()\n"  # the program starts while the agent does
        "while not os.path.exists(os.path.join(d, 'agent.pid')) and time.monotonic() - t < 60:\n"
        "    time.sleep(0.02)\n"
        "pid = open(os.path.join(d, 'agent.pid')).read().strip()\n"
        # A lazy agent imports numpy once it is ready: looked for over 1 s (30 s when expected).
        f"t, wait = time.monotonic(), {30.0 if lazy else 1.0}\n"
        "while True:\n"
        "    loaded = '_multiarray_umath' in open(f'/proc/{pid}/maps').read()\n"
        "    if loaded or time.monotonic() - t > wait:\n"
        "        break\n"
        "    time.sleep(0.05)\n"
        "print('numpy loaded' if loaded else 'numpy not loaded')\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    r = _run(
        ["--dataset", root, *(["--sampler-order"] if lazy else []), "--",
         sys.executable, "-c", check, READER, root, "--epochs", "2", "--out", str(out)],
        _env(tmp_path, {"CLAIRVOYANT_RUN_ID": f"numpy-{lazy}"}),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert ("numpy loaded" if lazy else "numpy not loaded") in r.stdout, r.stdout
    got = _check_reads(out, crcs, 2)
    assert all(len(e) == N_FILES for e in got["epochs"])
