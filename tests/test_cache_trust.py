"""The node cache as an adversary sees it: other local users, corrupted and stale bytes, crashed
ranks, a small /dev/shm, a full disk, odd launchers, several jobs in one process.

Each test runs its jobs in fresh Python processes (a SIGBUS or a hang must fail the test, not
kill the test session) with the node-shared directory redirected to a temporary directory by
``CLAIRVOYANT_SHM_DIR`` (the per-user cache directory is created inside it), so that tests never
meet caches of other runs on this machine. Tests that act as another local user or mount a
small tmpfs need root and skip with a printed reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root (setpriv to another user, mount namespaces)")

PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    import clairvoyant

    def expected(k, size):
        return ((k * 31 + np.arange(size)) % 256).astype(np.uint8)

    def sizes(n, base=2000, spread=3000):
        return [base + (k * 7919) % spread for k in range(n)]

    def check_epoch(job, e, n_sizes):
        wrong = 0
        count = 0
        for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)):
            count += 1
            if not np.array_equal(s, expected(k, n_sizes[k])):
                wrong += 1
        return count, wrong

    def emit(**kw):
        print("RESULT " + json.dumps(kw), flush=True)
    """
)


def memory_config(path: Path, memory: str = "64 MiB", staging: str = "8 MiB", extra: str = "") -> Path:
    path.write_text(
        textwrap.dedent(
            f"""
            [staging]
            capacity = "{staging}"
            threads = 2
            [pfs]
            read_mbps = 50.0
            open_latency_ms = 1.0
            [[class]]
            name = "memory"
            kind = "memory"
            capacity = "{memory}"
            threads = 2
            read_mbps = 5000.0
            write_mbps = 4000.0
            """
        )
        + extra
    )
    return path


def ssd_config(path: Path, ssd_dir: Path, capacity: str = "64 MiB", staging: str = "8 MiB") -> Path:
    path.write_text(
        textwrap.dedent(
            f"""
            [staging]
            capacity = "{staging}"
            threads = 2
            [pfs]
            read_mbps = 50.0
            open_latency_ms = 1.0
            [[class]]
            name = "ssd"
            kind = "directory"
            path = "{ssd_dir}"
            capacity = "{capacity}"
            threads = 2
            read_mbps = 1000.0
            write_mbps = 800.0
            """
        )
    )
    return path


@pytest.fixture
def shm():
    """A stand-in for /dev/shm, world-writable with the sticky bit like the real one, where other
    users can reach it (pytest's own temporary directories are private to their owner)."""
    d = Path(tempfile.mkdtemp(prefix="clairvoyant-test-shm-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def base_env(shm: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAIRVOYANT_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(CLAIRVOYANT_SHM_DIR=str(shm), PYTHONUNBUFFERED="1")
    if "CLAIRVOYANT_CACHE_DIR" in os.environ:  # the session's (tests/conftest.py)
        env["CLAIRVOYANT_CACHE_DIR"] = os.environ["CLAIRVOYANT_CACHE_DIR"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / f"{name}.py"
    p.write_text(PRELUDE + textwrap.dedent(body))
    return p


def run(path: Path, env: dict, timeout: float = 120, args: tuple = ()) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=timeout)


def result(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "panicked" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :])


def files_under(d: Path) -> list:
    return [Path(r) / f for r, _, fs in os.walk(d) for f in fs]


# -- isolation ------------------------------------------------------------------------------


def test_node_shared_files_are_private(tmp_path, shm):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = memory_config(
        tmp_path / "system.toml",
        memory="100 KiB",
        extra=textwrap.dedent(
            f"""
            [[class]]
            name = "ssd"
            kind = "directory"
            path = "{ssd}"
            capacity = "64 MiB"
            threads = 2
            read_mbps = 1000.0
            write_mbps = 800.0
            """
        ),
    )
    s = script(
        tmp_path,
        "private",
        f"""
        n = 200
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=8, epochs=2, config={str(cfg)!r})
        check_epoch(job, 0, sizes(n))
        modes = {{}}
        for top in ({str(shm)!r}, {str(ssd)!r}):
            for root, dirs, files in os.walk(top):
                for name in dirs + files:
                    p = os.path.join(root, name)
                    st = os.lstat(p)
                    modes[p] = [st.st_mode, st.st_uid]
        emit(modes=modes, uid=os.geteuid())
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert out["modes"], "the job created no node-shared file"
    leaks = sorted(f"{p} {oct(m)}" for p, (m, uid) in out["modes"].items() if m & 0o077 or uid != out["uid"])
    assert not leaks, f"{len(leaks)} node-shared files reachable by other users, e.g. {leaks[:3]}"
    assert any(stat.S_ISREG(m) for m, _ in out["modes"].values())


@needs_root
def test_files_planted_by_another_user_are_never_used(tmp_path, shm):
    """User nobody pre-creates the per-user directory and files in it (mode 0777/0666), and a
    symlink to a root-only file: the job must not read, write or follow any of them."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's secret")
    os.chmod(victim, 0o600)
    plant = textwrap.dedent(
        f"""
        import os
        d = os.path.join({str(shm)!r}, "clairvoyant-{os.geteuid()}")
        os.mkdir(d, 0o777); os.chmod(d, 0o777)
        for name in ("a.state", "a.mem", "x"):
            with open(os.path.join(d, name), "wb") as f:
                f.write(b"\\xff" * 65536)
            os.chmod(os.path.join(d, name), 0o666)
        os.symlink({str(victim)!r}, os.path.join(d, "link.mem"))
        """
    )
    subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", plant], check=True
    )
    planted = {p: p.read_bytes() if not p.is_symlink() else None for p in (shm / f"clairvoyant-{os.geteuid()}").iterdir()}
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "planted",
        f"""
        n = 300
        try:
            job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=8, epochs=2, config={str(cfg)!r})
        except OSError as exc:
            emit(refused=str(exc)); sys.exit(0)
        got = [check_epoch(job, e, sizes(n)) for e in range(2)]
        emit(epochs=got)
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    if "refused" in out:
        assert f"clairvoyant-{os.geteuid()}" in out["refused"], "the error names the path"
    else:
        assert out["epochs"] == [[300, 0], [300, 0]]
    assert victim.read_bytes() == b"root's secret"
    for p, content in planted.items():
        if content is not None:
            assert p.read_bytes() == content, f"{p} was written"


@needs_root
def test_another_user_reads_nothing(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "hold",
        f"""
        n = 200
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=8, epochs=2, config={str(cfg)!r})
        check_epoch(job, 0, sizes(n))
        print(json.dumps([p for p in job.segments if p]), flush=True)
        sys.stdin.readline()
        job.close()
        emit(ok=True)
        """,
    )
    holder = subprocess.Popen([sys.executable, str(s)], env=base_env(shm), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        segments = json.loads(holder.stdout.readline())
        assert segments
        spy = textwrap.dedent(
            f"""
            import os
            paths = [os.path.join(root, f) for root, _, files in os.walk({str(shm)!r}) for f in files]
            got = 0
            for p in paths + {segments!r}:
                try:
                    with open(p, "rb") as fh:
                        got += len(fh.read())
                except OSError:
                    pass
            print(got)
            """
        )
        out = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", spy],
            capture_output=True,
            text=True,
            check=True,
        )
        assert int(out.stdout) == 0, "another user read bytes of the node cache"
    finally:
        holder.communicate("\n", timeout=60)


# -- integrity ------------------------------------------------------------------------------


def test_overwritten_memory_segment_is_detected(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "overwrite",
        f"""
        n = 3000
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=16, epochs=3, config={str(cfg)!r})
        first = check_epoch(job, 0, sizes(n))
        arena = job.segments[1]
        assert arena is not None, "no memory class"
        with open(arena, "r+b") as f:
            f.seek(0)
            f.write(os.urandom(4 << 20))
        later = [check_epoch(job, e, sizes(n)) for e in (1, 2)]
        emit(first=first, later=later, corrupt=[s.get("corrupt") for s in job.stats()])
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert out["first"] == [3000, 0]
    assert out["later"] == [[3000, 0], [3000, 0]], "silently wrong samples after the overwrite"
    assert out["corrupt"][1] and out["corrupt"][1] > 0, "corrupt samples are counted"


def test_damaged_memory_copies_are_repaired_on_the_next_read(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "repair",
        f"""
        n = 3000
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=16, epochs=3, config={str(cfg)!r})
        check_epoch(job, 0, sizes(n))
        with open(job.segments[1], "r+b") as f:
            f.seek(0)
            f.write(os.urandom(4 << 20))
        later = [check_epoch(job, e, sizes(n)) for e in (1, 2)]
        stats = job.stats()
        emit(later=later, corrupt=[s.get("corrupt") or 0 for s in stats], pfs=[s["pfs_files_read"] for s in stats])
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert out["later"] == [[3000, 0], [3000, 0]]
    assert out["corrupt"][1] > 0, "the damage was seen"
    assert out["corrupt"][2] == 0 and out["pfs"][2] == 0, f"damaged copies were not repaired: {out}"


def test_truncated_memory_segment_does_not_crash(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "truncate",
        f"""
        n = 1000
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=16, epochs=2, config={str(cfg)!r})
        check_epoch(job, 0, sizes(n))
        os.truncate(job.segments[1], 0)
        emit(later=check_epoch(job, 1, sizes(n)))
        job.close()
        """,
    )
    proc = run(s, base_env(shm))
    assert proc.returncode != -signal.SIGBUS, "SIGBUS on a truncated segment"
    assert result(proc)["later"] == [1000, 0]


def test_flipped_bytes_in_ssd_files_are_detected(tmp_path, shm):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # A small staging buffer, so that later epochs read the SSD files after they were damaged.
    cfg = ssd_config(tmp_path / "system.toml", ssd, staging="64 KiB")
    s = script(
        tmp_path,
        "flip",
        f"""
        n = 600
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=16, epochs=3, config={str(cfg)!r})
        first = check_epoch(job, 0, sizes(n))
        time.sleep(0.5)
        flipped = 0
        for root, _, files in os.walk({str(ssd)!r}):
            for f in files:
                p = os.path.join(root, f)
                with open(p, "r+b") as fh:
                    data = bytearray(fh.read())
                    if len(data) < 8:
                        continue
                    for i in (0, len(data) // 3, len(data) // 2, len(data) - 1):
                        data[i] ^= 0x5A
                    fh.seek(0); fh.write(data)
                flipped += 1
        later = [check_epoch(job, e, sizes(n)) for e in (1, 2)]
        emit(first=first, flipped=flipped, later=later, corrupt=[s.get("corrupt") for s in job.stats()],
             ssd=[s["sources"]["ssd"]["samples"] for s in job.stats()])
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert out["flipped"] > 100, "the SSD class was not used"
    assert out["later"] == [[600, 0], [600, 0]], "silently wrong samples from flipped SSD files"
    assert (out["corrupt"][1] or 0) > 0, "corrupt samples are counted"
    assert out["ssd"][2] > 0, "damaged files are repaired and served again"


def test_dataset_rewritten_in_place_is_not_served_from_the_cache(tmp_path, shm):
    data = tmp_path / "data"
    data.mkdir()
    paths = []
    for k in range(100):
        p = data / f"{k:03d}.bin"
        p.write_bytes(bytes([1]) * 4096)
        paths.append(str(p))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p} 0\n" for p in paths))
    cfg = memory_config(tmp_path / "system.toml")
    body = f"""
        job = clairvoyant.Job(clairvoyant.FileList({str(listing)!r}), batch_size=10, epochs=2, config={str(cfg)!r})
        firsts = sorted(set(int(s[0]) for s, _ in job.epoch(0)))
        print("READY", flush=True)
        if len(sys.argv) > 1:
            sys.stdin.readline()
        emit(firsts=firsts)
        job.close()
        """
    s = script(tmp_path, "stale", body)
    env = base_env(shm, CLAIRVOYANT_RUN_ID="same-run", CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
    holder = subprocess.Popen([sys.executable, str(s), "hold"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "READY"
        for p in paths:  # rewrite every file in place, same size
            with open(p, "r+b") as f:
                f.write(bytes([2]) * 4096)
        second = result(run(s, env))
    finally:
        holder.communicate("\n", timeout=60)
    assert second["firsts"] == [2], "old bytes served after the dataset changed"


@pytest.mark.parametrize("tier", ["memory", "ssd"])
def test_a_file_changed_between_epochs_is_never_served_stale(tmp_path, shm, tier):
    """Epoch 0 caches every sample; then one file is rewritten with other bytes of the same
    size (epoch 1 must deliver the new bytes, as for a sample that is not cached) and another
    grows (epoch 2 raises DatasetChangedError naming it at that sample, as for a sample that is
    not cached). The changed samples are the last of their epochs, so they are staged after the
    change (samples staged ahead of a change may hold bytes read before it, cached or not)."""
    data = tmp_path / "data"
    data.mkdir()
    paths = []
    for k in range(60):
        p = data / f"{k:03d}.bin"
        p.write_bytes(bytes([k]) * 4096)
        paths.append(str(p))
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p} 0\n" for p in paths))
    if tier == "memory":
        cfg = memory_config(tmp_path / "system.toml", staging="64 KiB")
    else:
        (tmp_path / "ssd").mkdir()
        cfg = ssd_config(tmp_path / "system.toml", tmp_path / "ssd", staging="64 KiB")
    body = f"""
        paths = {paths!r}
        job = clairvoyant.Job(clairvoyant.FileList({str(listing)!r}), batch_size=4, epochs=3, config={str(cfg)!r})
        def firsts(e):
            return [(k, int(s[0]), len(s)) for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e))]
        e0 = firsts(0)
        same = int(job.samples_of(1)[-1])
        time.sleep(0.05)  # a last change later than the fills began, whatever the clock's grain
        with open(paths[same], "r+b") as f:
            f.write(bytes([200]) * 4096)
        e1 = firsts(1)
        grown = int(job.samples_of(2)[-1])
        with open(paths[grown], "ab") as f:
            f.write(b"more")
        got, error = [], None
        try:
            for k, (s, _) in zip(job.samples_of(2).tolist(), job.epoch(2)):
                got.append((k, int(s[0])))
        except clairvoyant.DatasetChangedError as err:
            error = str(err)
        stats = job.stats()
        emit(e0=e0, e1=e1, same=same, grown=grown, got=got, error=error,
             cached=[s["sources"][{tier!r}]["samples"] for s in stats])
        job.close()
        """
    out = result(run(script(tmp_path, "changed", body), base_env(shm, CLAIRVOYANT_CACHE_DIR=tmp_path / "index")))
    assert all(b == k and n == 4096 for k, b, n in out["e0"])
    assert out["cached"][1] > 0, f"epoch 1 was served from the {tier} class"
    wrong = [(k, b) for k, b, _ in out["e1"] if b != (200 if k == out["same"] else k)]
    assert wrong == [], "epoch 1: old bytes of the rewritten file (or wrong bytes of another)"
    assert out["error"] is not None and os.path.basename(paths[out["grown"]]) in out["error"], out["error"]
    assert len(out["got"]) >= 56 and out["grown"] not in [k for k, _ in out["got"]], "epoch 2: up to the grown file's batch"
    assert all(b == (200 if k == out["same"] else k) for k, b in out["got"]), "epoch 2: bytes before the error"


# -- crash recovery -------------------------------------------------------------------------

RANK_SCRIPT = """
    n = 400
    listing = sys.argv[1]
    fs = clairvoyant.EmulatedFs(sys.argv[2], open_latency_ms=15.0, bandwidth_mbps=200.0)
    src = clairvoyant.FileList(listing, emulated=fs)
    job = clairvoyant.Job(src, batch_size=8, epochs=2, config=sys.argv[3])
    step = float(os.environ.get("CV_STEP_SECONDS", 0))
    t0 = time.monotonic()
    wrong = 0
    for e in range(2):
        for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)):
            if int(s[0]) != k % 251:
                wrong += 1
            if job.rank == 1 and e == 0:
                print("CONSUMING", flush=True)
                time.sleep(10)
            elif step:
                time.sleep(step)  # a training step per sample (CV_STEP_SECONDS)
    emit(wrong=wrong, seconds=time.monotonic() - t0, stall=[s["stall_seconds"] for s in job.stats()],
         samples=[s["samples"] for s in job.stats()])
    job.close()
    """


def file_dataset(tmp_path: Path, n: int, size: int = 8192) -> Path:
    data = tmp_path / "files"
    data.mkdir(exist_ok=True)
    lines = []
    for k in range(n):
        p = data / f"{k:04d}.bin"
        p.write_bytes(bytes([k % 251]) * size)
        lines.append(f"{p} {k % 10}\n")
    listing = tmp_path / "files.txt"
    listing.write_text("".join(lines))
    return listing


def test_killed_rank_does_not_stall_the_survivor(tmp_path, shm):
    listing = file_dataset(tmp_path, 400)
    cfg = memory_config(tmp_path / "system.toml")
    s = script(tmp_path, "rank", RANK_SCRIPT)

    def launch(rank, run_id):
        env = base_env(
            shm, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2, CLAIRVOYANT_RUN_ID=run_id,
            CLAIRVOYANT_CACHE_DIR=tmp_path / "index",
        )
        return subprocess.Popen(
            [sys.executable, str(s), str(listing), str(tmp_path / f"fs-{run_id}"), str(cfg)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    # The same two ranks, once with rank 1 killed while the node cache fills.
    victim = launch(1, "killed")
    assert victim.stdout.readline().strip() == "CONSUMING"
    survivor = launch(0, "killed")
    time.sleep(0.3)
    victim.kill()
    victim.wait()
    out, err = survivor.communicate(timeout=120)
    killed = result(subprocess.CompletedProcess(survivor.args, survivor.returncode, out, err))
    assert killed["wrong"] == 0 and killed["samples"] == [200, 200]
    # A lone rank 0 in a run where rank 1 never fills anything: the survivor's stall bound.
    alone = launch(0, "alone")
    out, err = alone.communicate(timeout=120)
    lone = result(subprocess.CompletedProcess(alone.args, alone.returncode, out, err))
    extra = sum(killed["stall"]) - sum(lone["stall"])
    assert extra <= 1.0, f"the survivor stalled {extra:.2f} s more because of the killed rank"


def test_stopped_rank_costs_the_survivor_one_deadline(tmp_path, shm):
    """Rank 1 is stopped (SIGSTOP) in epoch 0 while its fill threads hold claims on samples of
    the shared node cache (each read takes 15 ms), for ``CV_STOP_SECONDS`` (default 20) or until
    rank 0 is done, whichever comes first. Rank 0 waits for a stopped claimant about one deadline
    (2 s here), not the 30 s fill time-out per claim, reads those samples itself and gets every
    sample of both epochs once, in order, with the right bytes. Its extra stall is printed.
    ``CV_STEP_SECONDS`` (default 0) is rank 0's training step per sample: 0.1 makes its run
    (about 40 s) outlast a 30 s stop, which then ends while rank 0 trains."""
    stop_seconds = float(os.environ.get("CV_STOP_SECONDS", 20))
    step = os.environ.get("CV_STEP_SECONDS", "0")
    listing = file_dataset(tmp_path, 400)
    cfg = memory_config(tmp_path / "system.toml")
    s = script(tmp_path, "rank", RANK_SCRIPT)

    def launch(rank, run_id):
        env = base_env(
            shm,
            RANK=rank,
            WORLD_SIZE=2,
            LOCAL_RANK=rank,
            LOCAL_WORLD_SIZE=2,
            CLAIRVOYANT_RUN_ID=run_id,
            CLAIRVOYANT_CACHE_DIR=tmp_path / "index",
            CV_STEP_SECONDS=step,
        )
        return subprocess.Popen(
            [sys.executable, str(s), str(listing), str(tmp_path / f"fs-{run_id}"), str(cfg)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    victim = launch(1, "stopped")
    try:
        assert victim.stdout.readline().strip() == "CONSUMING"
        victim.send_signal(signal.SIGSTOP)  # its fill threads are mid-read, holding claims
        t0 = time.monotonic()
        survivor = launch(0, "stopped")
        try:
            survivor.wait(timeout=stop_seconds)
        except subprocess.TimeoutExpired:
            pass
        stopped_for = time.monotonic() - t0
        victim.send_signal(signal.SIGCONT)
        out, err = survivor.communicate(timeout=120)
    finally:
        victim.kill()
        victim.wait()
    stopped = result(subprocess.CompletedProcess(survivor.args, survivor.returncode, out, err))
    assert stopped["wrong"] == 0 and stopped["samples"] == [200, 200]
    # A lone rank 0 in a run where rank 1 never fills anything: the survivor's stall without
    # a stopped sibling.
    alone = launch(0, "alone")
    out, err = alone.communicate(timeout=120)
    lone = result(subprocess.CompletedProcess(alone.args, alone.returncode, out, err))
    extra = sum(stopped["stall"]) - sum(lone["stall"])
    print(
        f"rank 1 stopped {stopped_for:.1f} s (limit {stop_seconds:g} s): rank 0 took {stopped['seconds']:.2f} s, "
        f"stalled {sum(stopped['stall']):.2f} s; alone {lone['seconds']:.2f} s, stalled {sum(lone['stall']):.2f} s; "
        f"extra stall {extra:.2f} s"
    )
    assert extra < 15, f"the survivor stalled {extra:.2f} s more because of the stopped rank"


def test_rerun_after_a_crash_gets_a_clean_cache(tmp_path, shm):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    listing = file_dataset(tmp_path, 300)
    cfg = ssd_config(tmp_path / "system.toml", ssd)
    s = script(
        tmp_path,
        "crash",
        f"""
        src = clairvoyant.FileList({str(listing)!r})
        job = clairvoyant.Job(src, batch_size=10, epochs=2, config={str(cfg)!r})
        wrong = 0
        for e in range(2):
            for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)):
                wrong += int(s[0]) != k % 251
                if len(sys.argv) > 1 and e == 0:
                    print("FILLING", flush=True)
                    time.sleep(60)
        emit(wrong=wrong, pfs=[s["pfs_files_read"] for s in job.stats()])
        job.close()
        """,
    )
    env = base_env(shm, TORCHELASTIC_RUN_ID="none", CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
    crashed = subprocess.Popen([sys.executable, str(s), "crash"], env=env, stdout=subprocess.PIPE, text=True)
    assert crashed.stdout.readline().strip() == "FILLING"
    time.sleep(0.5)
    crashed.kill()
    crashed.wait()
    assert files_under(ssd), "the crashed job had cached something on the SSD"
    t0 = time.monotonic()
    out = result(run(s, env))
    assert out["wrong"] == 0
    assert time.monotonic() - t0 < 30
    assert not files_under(shm), f"left in shm after a clean exit: {files_under(shm)}"
    left = files_under(ssd)
    assert not left, f"{len(left)} of the crashed job's SSD files were not removed, e.g. {left[:3]}"


def test_forked_child_leaves_the_parents_cache_alone(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "fork",
        f"""
        n = 500
        job = clairvoyant.Job(clairvoyant.Synthetic(sizes(n)), batch_size=10, epochs=2, config={str(cfg)!r})
        it = job.epoch(0)
        head = [next(it) for _ in range(20)]
        del head
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal interpreter exit in the child: finalizers run
        _, status = os.waitpid(pid, 0)
        arena = job.segments[1]
        rest = sum(1 for _ in it)
        later = check_epoch(job, 1, sizes(n))
        emit(child_status=status, rest=rest, later=later, arena_exists=os.path.exists(arena))
        job.close()
        """,
    )
    proc = run(s, base_env(shm))
    out = result(proc)
    assert out["child_status"] == 0
    assert out["rest"] == 480 and out["later"] == [500, 0]
    assert out["arena_exists"], "the child's exit removed the parent's memory segment"


# -- capacity limits ------------------------------------------------------------------------


def in_small_tmpfs(target: str, size: str, command: list, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    shell = f"mount -t tmpfs -o size={size},mode=1777 tmpfs {target} && exec \"$@\""
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh", *command],
        env=env, capture_output=True, text=True, timeout=timeout,
    )


SHM_BODY = """
    n = 3000
    sz = sizes(n, base=30000, spread=20000)  # ~120 MB in all
    job = clairvoyant.Job(clairvoyant.Synthetic(sz), batch_size=16, epochs=2)
    got = [check_epoch(job, e, sz) for e in range(2)]
    emit(epochs=got)
    job.close()
    """


@needs_root
@pytest.mark.parametrize("size,memory", [("64m", None), ("16m", "0")])
def test_small_dev_shm_loses_no_sample(tmp_path, size, memory):
    s = script(tmp_path, "smallshm", SHM_BODY)
    env = base_env(tmp_path, CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
    env.pop("CLAIRVOYANT_SHM_DIR")  # the real /dev/shm, inside a private mount namespace
    if memory is not None:
        env["CLAIRVOYANT_MEMORY"] = memory
    proc = in_small_tmpfs("/dev/shm", size, [sys.executable, str(s)], env)
    assert proc.returncode != -signal.SIGBUS
    assert "Bad address" not in proc.stderr + proc.stdout
    assert result(proc)["epochs"] == [[3000, 0], [3000, 0]]


FILLED_SHM_BODY = """
    import pathlib
    root = pathlib.Path(sys.argv[1])
    paths = sorted(str(p) for p in root.iterdir())
    # Read at 40 MB/s: the job fills its classes over seconds.
    slow = clairvoyant.EmulatedFs(str(root.parent / "fs.state"), 0.0, 40.0)
    job = clairvoyant.Job(clairvoyant.FileList(paths, [0] * len(paths), emulated=slow), batch_size=16, epochs=2)
    # Another program takes what shared memory has left after the job started.
    filler = 0
    with open("/dev/shm/filler", "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
                filler += 1
        except OSError:
            pass
    got = []
    for e in range(2):
        wrong = sum(bytes(s) != open(paths[k], "rb").read() for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)))
        got.append([len(paths), wrong])
    emit(epochs=got, filler_mb=filler)
    job.close()
    """


@needs_root
def test_dev_shm_filled_after_the_start_loses_no_sample(tmp_path):
    # The memory class's blocks are reserved as samples are written: when shared memory is
    # taken by another program meanwhile, the class is full, not a SIGBUS.
    data = tmp_path / "data"
    data.mkdir()
    for k in range(600):
        (data / f"{k:04d}.bin").write_bytes(bytes([k % 251]) * (40_000 + 97 * k))  # ~41 MB in all
    s = script(tmp_path, "filledshm", FILLED_SHM_BODY)
    env = base_env(tmp_path, CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
    env.pop("CLAIRVOYANT_SHM_DIR")  # the real /dev/shm, inside a private mount namespace
    proc = in_small_tmpfs("/dev/shm", "300m", [sys.executable, str(s), str(data)], env)
    assert proc.returncode != -signal.SIGBUS, proc.stderr[-2000:]
    assert "Bad address" not in proc.stderr + proc.stdout
    r = result(proc)
    assert r["filler_mb"] > 0
    assert r["epochs"] == [[600, 0], [600, 0]], proc.stderr[-2000:]
    # Whatever was not reserved before the filler came is staged and served anyway.
    assert "storage class 'memory' is full" in proc.stderr, proc.stderr[-2000:]
    assert "staged in process memory" in proc.stderr, proc.stderr[-2000:]


@needs_root
def test_ssd_class_on_a_full_disk(tmp_path, shm):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    cfg = ssd_config(tmp_path / "system.toml", ssd, capacity="1 GiB")
    s = script(
        tmp_path,
        "fulldisk",
        f"""
        n = 1500
        sz = sizes(n, base=30000, spread=20000)  # ~60 MB, on a 20 MB disk
        job = clairvoyant.Job(clairvoyant.Synthetic(sz), batch_size=16, epochs=2, config={str(cfg)!r})
        got = [check_epoch(job, e, sz) for e in range(2)]
        tmp = [f for r, _, fs in os.walk({str(ssd)!r}) for f in fs if f.endswith(".tmp")]
        emit(epochs=got, tmp=tmp, ssd=[s["sources"]["ssd"]["samples"] for s in job.stats()])
        job.close()
        """,
    )
    proc = in_small_tmpfs(str(ssd), "20m", [sys.executable, str(s)], base_env(shm))
    out = result(proc)
    assert out["epochs"] == [[1500, 0], [1500, 0]]
    assert out["tmp"] == [], "temporary files left on the full disk"
    assert out["ssd"][1] > 0, "what fitted is still served from the SSD"
    warnings = [line for line in proc.stderr.splitlines() if "ssd" in line.lower() and ("full" in line.lower() or "space" in line.lower() or "capacity" in line.lower())]
    assert 1 <= len(warnings) <= 3, f"expected one warning about the disk, got: {proc.stderr[-2000:]}"


def test_sample_larger_than_a_class_is_just_not_cached_there(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml", memory="4 MiB", staging="32 MiB")
    s = script(
        tmp_path,
        "large",
        f"""
        sz = [6 << 20] + [10000] * 50
        job = clairvoyant.Job(clairvoyant.Synthetic(sz), batch_size=4, epochs=2, config={str(cfg)!r})
        got = [check_epoch(job, e, sz) for e in range(2)]
        emit(epochs=got, memory=[s["sources"]["memory"]["samples"] for s in job.stats()])
        job.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert out["epochs"] == [[51, 0], [51, 0]]
    assert out["memory"][1] >= 50, "the small samples are still cached"


# -- cache identity -------------------------------------------------------------------------

IDENTITY_BODY = """
    listing, fs_state, cfg = sys.argv[1:4]
    fs = clairvoyant.EmulatedFs(fs_state, open_latency_ms=2.0, bandwidth_mbps=400.0)
    job = clairvoyant.Job(clairvoyant.FileList(listing, emulated=fs), batch_size=8, epochs=2, config=cfg)
    print("ATTACHED", flush=True)
    sys.stdin.readline()  # the test's go: every rank of the run is attached
    wrong = 0
    for e in range(2):
        for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)):
            wrong += int(s[0]) != k % 251
    emit(wrong=wrong, files=sum(s["pfs_files_read"] for s in job.stats()), rank=job.rank)
    job.close()
    """


def go(procs: list, release: bool = True) -> None:
    """Wait until every rank in `procs` (running IDENTITY_BODY, not yet waited for) holds its node
    cache, then (`release`) let them read. Without this a rank starved of CPU can start after its
    partner finished both epochs and left, and then reads the dataset alone."""
    for p in procs:
        if not getattr(p, "attached", False):
            line = p.stdout.readline().strip()
            assert line == "ATTACHED", f"a rank did not start: {line!r} {p.stderr.read() if not line else ''}"
            p.attached = True
    if release:
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.close()


def test_ranks_started_by_wrapper_scripts_share_one_cache(tmp_path, shm):
    listing = file_dataset(tmp_path, 300)
    cfg = memory_config(tmp_path / "system.toml")
    s = script(tmp_path, "wrapped", IDENTITY_BODY)
    procs = []
    for rank in range(2):
        env = base_env(shm, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2, CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
        # Each rank's own wrapper shell: different parent processes, no run id.
        cmd = f"{sys.executable} {s} {listing} {tmp_path / 'fs'} {cfg}; exit $?"
        procs.append(
            subprocess.Popen(["sh", "-c", cmd], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    go(procs)
    outs = [result(subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.stdout.read(), p.stderr.read())) for p in procs]
    assert all(o["wrong"] == 0 for o in outs)
    files = sum(o["files"] for o in outs)
    # Reads a prefetcher finishes after its rank took its statistics may go uncounted (a few).
    assert 285 <= files <= 300, f"the dataset was read {files / 300:.2f} times by two ranks over two epochs"
    assert not files_under(shm), f"left after a clean exit: {files_under(shm)}"


def test_unrelated_runs_with_run_id_none_do_not_share(tmp_path, shm):
    listing = file_dataset(tmp_path, 300)
    with_memory = memory_config(tmp_path / "a.toml")
    without = tmp_path / "b.toml"
    without.write_text("[staging]\ncapacity = \"8 MiB\"\nthreads = 2\n[pfs]\nread_mbps = 50.0\n")
    s = script(tmp_path, "unrelated", IDENTITY_BODY)
    procs = []
    # Run b starts once run a's ranks hold their node cache: two runs whose caches have the same
    # name (no run id, equal classes) are told apart by which local ranks are taken; ranks of
    # both starting at the same instant can pair across the runs (docs/architecture.md).
    for run_name, cfg in (("a", with_memory), ("b", without)):
        go(procs, release=False)
        for rank in range(2):
            env = base_env(
                shm, RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=2, TORCHELASTIC_RUN_ID="none",
                CLAIRVOYANT_CACHE_DIR=tmp_path / "index",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(s), str(listing), str(tmp_path / f"fs-{run_name}"), str(cfg)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
            )
    go(procs[2:])
    go(procs[:2])
    # Read through the file objects: the line read above may have buffered the RESULT line too,
    # which `communicate()` (reading the descriptors) would not see.
    outs = [result(subprocess.CompletedProcess(p.args, p.wait(timeout=120), p.stdout.read(), p.stderr.read())) for p in procs]
    assert all(o["wrong"] == 0 for o in outs)
    run_a = sum(o["files"] for o in outs[:2])
    # Reads a prefetcher finishes after its rank took its statistics may go uncounted (a few).
    assert 285 <= run_a <= 300, f"run a read the dataset {run_a / 300:.2f} times (its cache was taken or shared)"


def test_train_and_validation_jobs_in_one_process_cache_once(tmp_path, shm):
    cfg = memory_config(tmp_path / "system.toml")
    s = script(
        tmp_path,
        "trainval",
        f"""
        n = 500
        sz = sizes(n)
        src = clairvoyant.Synthetic(sz)
        train = clairvoyant.Job(src, batch_size=10, epochs=2, seed=1, config={str(cfg)!r})
        val = clairvoyant.Job(src, batch_size=25, epochs=2, order=[list(range(n))] * 2, config={str(cfg)!r})
        got = []
        for e in range(2):
            got.append(check_epoch(train, e, sz))
            got.append(check_epoch(val, e, sz))
        allocated = sum(os.lstat(p).st_blocks * 512 for p in
                        (os.path.join(r, f) for r, _, fs in os.walk({str(shm)!r}) for f in fs)
                        if not p.endswith(".ring"))
        emit(got=got, allocated=allocated, total=sum(sz),
             pfs=sum(s["pfs_files_read"] for j in (train, val) for s in j.stats()))
        train.close(); val.close()
        """,
    )
    out = result(run(s, base_env(shm)))
    assert all(g == [500, 0] for g in out["got"])
    assert out["pfs"] == 500, f"two jobs read {out['pfs']} samples from the dataset (500 samples)"
    assert out["allocated"] < 1.5 * out["total"], f"{out['allocated']} bytes cached for a {out['total']}-byte dataset"


# -- the folder of indexes and system.toml ----------------------------------------------------

SECRET = b"root's secret " * 64


def _fnv(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def planted_index(root: Path, entry: str) -> tuple:
    """(file name, bytes) of a well-formed, fresh-looking index of the ImageFolder at ``root``
    whose every sample is ``entry`` (relative to the root), as another user would write it."""
    import struct

    def s(b: bytes) -> bytes:
        return struct.pack("<I", len(b)) + b

    root = root.resolve()
    identity = b"dir:" + bytes(root)
    dirs = [root, root / "a"]
    now = time.time_ns()
    body = b"CVINDEX\0" + struct.pack("<I", 1) + s(identity)
    body += struct.pack("<Q", 1) + s(b"a")
    body += struct.pack("<Q", len(dirs)) + b"".join(s(bytes(d)) + struct.pack("<q", os.stat(d).st_mtime_ns) for d in dirs)
    body += struct.pack("<Q", 4) + b"".join(s(entry.encode()) + struct.pack("<Qq", len(SECRET), 0) for _ in range(4))
    body += struct.pack("<qq", now, now)
    return f"index-{_fnv(identity):016x}.cvidx", body + struct.pack("<Q", _fnv(body))


def as_nobody(code: str) -> None:
    subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", code], check=True)


def image_dataset(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    for k in range(4):
        (data / "a" / f"{k}.jpg").write_bytes(bytes([k + 1]) * 500)
    os.utime(data / "a", ns=(0, 10**18))  # an old mtime, so that an index of it counts as fresh
    os.utime(data, ns=(0, 10**18))
    return data


CACHE_BODY = """
    try:
        job = clairvoyant.Job(clairvoyant.ImageFolder(sys.argv[1]), batch_size=2, epochs=1, config=sys.argv[2])
    except OSError as exc:
        emit(refused=str(exc)); sys.exit(0)
    got = sorted(bytes(s.tobytes()[:4]).hex() for s, _ in job.epoch(0))
    emit(got=got)
    job.close()
    """


@needs_root
@pytest.mark.parametrize("layout", ["folder-of-another-user", "sticky-folder", "file-of-another-user"])
def test_planted_index_is_never_served(tmp_path, shm, layout):
    """Another user plants an index whose entries lead to a root-only file, and a symlink where
    the index lock goes: no secret is served and nothing is created through the symlink."""
    data = image_dataset(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(SECRET)
    os.chmod(victim, 0o600)
    name, index = planted_index(data, os.path.relpath(victim, data.resolve()))
    created = shm / "created-through-link"
    cache = shm / "cache"
    plant = f"""
import os
d = {str(cache)!r}
os.makedirs(d, exist_ok=True)
with open(os.path.join(d, {name!r}), "wb") as f:
    f.write({index!r})
os.symlink({str(created)!r}, os.path.join(d, {name + ".lock"!r}))
"""
    if layout == "folder-of-another-user":
        as_nobody(plant)
    elif layout == "sticky-folder":
        cache.mkdir()
        os.chmod(cache, 0o1777)
        as_nobody(plant)
    else:
        cache.mkdir(mode=0o700)
        exec(plant)
        os.chown(cache / name, 65534, 65534)
        os.lchown(cache / (name + ".lock"), 65534, 65534)
    cfg = memory_config(tmp_path / "system.toml")
    s = script(tmp_path, "planted_index", CACHE_BODY)
    out = result(run(s, base_env(shm, CLAIRVOYANT_CACHE_DIR=cache), args=(str(data), str(cfg))))
    assert not created.exists(), "a file was created through a planted symlink"
    assert victim.read_bytes() == SECRET
    if layout == "sticky-folder":
        assert "refused" not in out, out
        assert out["got"] == sorted((bytes([k + 1]) * 4).hex() for k in range(4)), "the samples are the dataset's"
        private = cache / f"clairvoyant-{os.geteuid()}"
        assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
        for p in files_under(private):
            assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600, p
    else:
        assert "refused" in out, f"the planted index was used: {out}"
        named = str(cache) if layout == "folder-of-another-user" else name
        assert named in out["refused"] and "uid 65534" in out["refused"], out["refused"]


@needs_root
@pytest.mark.parametrize("owner", ["folder", "file"])
def test_planted_system_description_is_refused(tmp_path, shm, owner):
    cache = shm / "cache"
    plant = f"""
import os
os.makedirs({str(cache)!r}, exist_ok=True)
with open(os.path.join({str(cache)!r}, "system.toml"), "w") as f:
    f.write('[staging]\\ncapacity = "1 MiB"\\n')
"""
    if owner == "folder":
        as_nobody(plant)
    else:
        exec(plant)
        os.chown(cache / "system.toml", 65534, 65534)
    body = """
    try:
        job = clairvoyant.Job(clairvoyant.Synthetic([100] * 8), batch_size=2, epochs=1)
    except OSError as exc:
        emit(refused=str(exc)); sys.exit(0)
    emit(staging=job.segments and 1)
    job.close()
    """
    out = result(run(script(tmp_path, "planted_toml", body), base_env(shm, CLAIRVOYANT_CACHE_DIR=cache)))
    assert "refused" in out, f"a planted system.toml was used: {out}"
    assert "uid 65534" in out["refused"], out["refused"]
    assert (str(cache) if owner == "folder" else "system.toml") in out["refused"]


def test_index_files_are_private(tmp_path, shm):
    data = image_dataset(tmp_path)
    cache = tmp_path / "new" / "cache"
    cfg = memory_config(tmp_path / "system.toml")
    s = script(tmp_path, "private_index", CACHE_BODY)
    out = result(run(s, base_env(shm, CLAIRVOYANT_CACHE_DIR=cache), args=(str(data), str(cfg))))
    assert len(out["got"]) == 4
    for d in (tmp_path / "new", cache):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d
    files = files_under(cache)
    assert any(p.name.endswith(".cvidx") for p in files), files
    for p in files:
        assert stat.S_IMODE(os.lstat(p).st_mode) == 0o600, p


# -- class faults: missing, read-only, full are handled one way --------------------------------

CLASS_BODY = """
    listing, fs_state, cfg = sys.argv[1:4]
    # A slow dataset (5 ms per open), so that the class is still filling when it turns read-only.
    fs = clairvoyant.EmulatedFs(fs_state, open_latency_ms=5.0, bandwidth_mbps=400.0)
    job = clairvoyant.Job(clairvoyant.FileList(listing, emulated=fs), batch_size=8, epochs=2, config=cfg)
    if len(sys.argv) > 4:  # made read-only during the run
        import subprocess, time
        # The kernel refuses the remount (busy) while a file on it is open for writing: a fill
        # of the class in progress. Try again until the moment falls between two fills.
        for _ in range(400):
            if subprocess.run(["mount", "-o", "remount,ro", sys.argv[4]], capture_output=True).returncode == 0:
                break
            time.sleep(0.005)
        else:
            subprocess.run(["mount", "-o", "remount,ro", sys.argv[4]], check=True)
    got = []
    for e in range(2):
        wrong = 0
        count = 0
        for k, (s, _) in zip(job.samples_of(e).tolist(), job.epoch(e)):
            count += 1
            wrong += int(s[0]) != k % 251
        got.append([count, wrong])
    emit(epochs=got, ssd=[s["sources"]["ssd"]["samples"] for s in job.stats()])
    job.close()
    """


def class_args(tmp_path: Path, ssd: Path) -> list:
    listing = file_dataset(tmp_path, 300)
    cfg = ssd_config(tmp_path / "system.toml", ssd, staging="64 KiB")
    return [str(listing), str(tmp_path / "fs-state"), str(cfg)]


def test_a_missing_class_directory_is_created_private(tmp_path, shm):
    ssd = tmp_path / "not" / "yet" / "ssd"
    env = base_env(shm, CLAIRVOYANT_CACHE_DIR=tmp_path / "index")
    proc = run(script(tmp_path, "missing_class", CLASS_BODY), env, args=tuple(class_args(tmp_path, ssd)))
    out = result(proc)
    assert out["epochs"] == [[300, 0], [300, 0]]
    assert out["ssd"][1] > 0, "the created class is used"
    for d in (tmp_path / "not", tmp_path / "not" / "yet", ssd):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700, d


@needs_root
@pytest.mark.parametrize("when", ["at-start", "during-the-run"])
def test_a_read_only_class_is_dropped_with_one_warning(tmp_path, shm, when):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    s = script(tmp_path, "ro_class", CLASS_BODY)
    command = [sys.executable, str(s), *class_args(tmp_path, ssd)]
    if when == "at-start":
        shell = f"mount -t tmpfs -o size=64m,ro tmpfs {ssd} && exec \"$@\""
    else:
        shell = f"mount -t tmpfs -o size=64m,mode=0755 tmpfs {ssd} && exec \"$@\""
        command.append(str(ssd))
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh", *command],
        env=base_env(shm, CLAIRVOYANT_CACHE_DIR=tmp_path / "index"), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = result(proc)
    assert out["epochs"] == [[300, 0], [300, 0]], "samples lost or wrong"
    warnings = [line for line in proc.stderr.splitlines() if "storage class 'ssd'" in line]
    assert len(warnings) == 1, f"expected one warning about the class, got: {proc.stderr[-2000:]}"
    assert "class.ssd.path" in warnings[0] and "Read-only" in warnings[0], warnings[0]


@needs_root
def test_a_thread_limit_is_a_config_error_not_a_panic(tmp_path, shm):
    work = shm / "threads"  # reachable by user nobody
    work.mkdir()
    os.chmod(work, 0o777)
    cfg = work / "system.toml"
    cfg.write_text(
        textwrap.dedent(
            """
            [staging]
            capacity = "8 MiB"
            threads = 2
            [pfs]
            read_mbps = 50.0
            [[class]]
            name = "memory"
            kind = "memory"
            capacity = "16 MiB"
            threads = 48
            read_mbps = 5000.0
            write_mbps = 4000.0
            """
        )
    )
    s = work / "threads.py"
    s.write_text(
        PRELUDE
        + textwrap.dedent(
            f"""
            import resource
            resource.setrlimit(resource.RLIMIT_NPROC, (24, 24))
            try:
                job = clairvoyant.Job(clairvoyant.Synthetic(sizes(400)), batch_size=8, epochs=1, config={str(cfg)!r})
            except clairvoyant.ConfigError as exc:
                emit(error=str(exc)); sys.exit(0)
            emit(started=True)
            job.close()
            """
        )
    )
    os.chmod(s, 0o644)
    os.chmod(cfg, 0o644)
    env = base_env(shm, OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, CLAIRVOYANT_CACHE_DIR=work / "cache")
    proc = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, str(s)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = result(proc)
    assert "error" in out, f"48 threads started under a limit of 24: {out}"
    assert "'threads'" in out["error"] and "cannot start thread" in out["error"], out["error"]
