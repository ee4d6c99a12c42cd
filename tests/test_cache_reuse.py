"""A run killed with SIGKILL leaves its node cache; the next run over the same dataset on this
machine (a restart, here with another world size and batch size) copies what it can use instead
of reading the dataset again, and every byte is still checked."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, zlib
    import clairvoyant
    list_file, config, world, batch, die = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "die"
    rank, local = int(sys.argv[6]), int(sys.argv[7])
    crcs = set(json.loads(open(list_file + ".crc").read()))
    job = clairvoyant.Job(clairvoyant.FileList(list_file), batch_size=batch, epochs=2, seed=3, rank=rank,
                          world_size=world, local_ranks=list(range(local)), config=config)
    bad = 0
    for views, _ in job.batches(0):
        bad += sum(zlib.crc32(bytes(v)) not in crcs for v in views)
    s = job.stats()[0]
    print(json.dumps({"bad": bad, "fs": s["pfs_bytes_read"], "memory": s["sources"]["memory"]["samples"]}), flush=True)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    job.close()
    """
)


def _run(tmp_path, env, world, batch, die, rank=0, local=1):
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            str(tmp_path / "list.txt"),
            str(tmp_path / "system.toml"),
            str(world),
            str(batch),
            "die" if die else "live",
            str(rank),
            str(local),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    import json

    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, r.stderr
    return json.loads(lines[-1]), r


def _dataset(tmp_path) -> int:
    import json

    rng = np.random.default_rng(5)
    paths, crcs, total = [], [], 0
    for k in range(300):
        data = rng.integers(0, 256, size=int(rng.integers(1000, 5000)), dtype=np.uint8).tobytes()
        p = tmp_path / f"{k:04d}.bin"
        p.write_bytes(data)
        paths.append(p)
        crcs.append(zlib.crc32(data))
        total += len(data)
    (tmp_path / "list.txt").write_text("".join(f"{p}\t0\n" for p in paths))
    (tmp_path / "list.txt.crc").write_text(json.dumps(crcs))
    (tmp_path / "system.toml").write_text(
        f'[staging]\ncapacity = "1 MiB"\nthreads = 2\n[[class]]\nname = "memory"\nkind = "memory"\ncapacity = {2 * total}\nthreads = 1\n'
    )
    return total


def _node(tmp_path) -> tuple:
    """This machine's shared-memory directory for the runs, and their environment (run "first")."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    env = {**os.environ, "CLAIRVOYANT_SHM_DIR": str(shm), "CLAIRVOYANT_CACHE_DIR": str(tmp_path / "idx"), "CLAIRVOYANT_RUN_ID": "first"}
    return shm, env


def test_a_restart_reuses_what_the_killed_run_cached(tmp_path):
    total = _dataset(tmp_path)
    shm, env = _node(tmp_path)
    first, r1 = _run(tmp_path, env, world=2, batch=8, die=True)
    assert r1.returncode == -9 and first["bad"] == 0
    assert any(n.endswith(".layout") for n in os.listdir(shm / f"clairvoyant-{os.getuid()}")), "the killed run left its layout"
    # The restart: one rank where there were two, another batch size, another run id.
    env["CLAIRVOYANT_RUN_ID"] = "second"
    second, r2 = _run(tmp_path, env, world=1, batch=4, die=False)
    assert r2.returncode == 0, r2.stderr
    assert second["bad"] == 0
    assert "reused" in r2.stderr, r2.stderr
    # The killed rank read its half of the dataset; the restart reads only the other half.
    print(f"first run read {first['fs']} bytes, the restart {second['fs']} of {total}")
    assert second["fs"] <= total - first["fs"] + total * 0.02
    assert second["memory"] > 0
    # Nothing salvaged is left behind once reused.
    assert not [n for n in os.listdir(shm / f"clairvoyant-{os.getuid()}") if n.startswith("salvage-")]


def test_the_rank_that_sets_the_cache_up_reuses_it_whichever_it_is(tmp_path):
    # The restart's local rank 1 comes first (rank 0 is late, or never comes): it sets the node
    # cache up and takes over what the killed run cached.
    total = _dataset(tmp_path)
    shm, env = _node(tmp_path)
    first, r1 = _run(tmp_path, env, world=1, batch=8, die=True)
    assert r1.returncode == -9 and first["bad"] == 0 and first["fs"] == total
    env["CLAIRVOYANT_RUN_ID"] = "second"
    second, r2 = _run(tmp_path, env, world=2, batch=8, die=False, rank=1, local=2)
    assert r2.returncode == 0, r2.stderr
    assert second["bad"] == 0
    assert "reused" in r2.stderr, r2.stderr
    assert second["fs"] <= total * 0.02, f"local rank 1 read {second['fs']} of {total} bytes again"
    assert not [n for n in os.listdir(shm / f"clairvoyant-{os.getuid()}") if n.startswith("salvage-")]


def test_a_changed_file_is_not_reused(tmp_path):
    import json

    paths, crcs = [], []
    for k in range(40):
        p = tmp_path / f"{k:04d}.bin"
        data = bytes([k]) * (1000 + k)
        p.write_bytes(data)
        paths.append(p)
        crcs.append(zlib.crc32(data))
    (tmp_path / "list.txt").write_text("".join(f"{p}\t0\n" for p in paths))
    (tmp_path / "system.toml").write_text(
        '[staging]\ncapacity = "1 MiB"\nthreads = 2\n[[class]]\nname = "memory"\nkind = "memory"\ncapacity = 1000000\nthreads = 1\n'
    )
    # The restart must see sample 0's new bytes (same size, so the index stays valid).
    new0 = bytes([200]) * 1000
    (tmp_path / "list.txt.crc").write_text(json.dumps(crcs))
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    env = {**os.environ, "CLAIRVOYANT_SHM_DIR": str(shm), "CLAIRVOYANT_CACHE_DIR": str(tmp_path / "idx"), "CLAIRVOYANT_RUN_ID": "a"}
    _run(tmp_path, env, world=1, batch=4, die=True)
    paths[0].write_bytes(new0)
    (tmp_path / "list.txt.crc").write_text(json.dumps(crcs[1:] + [zlib.crc32(new0)]))
    second, r2 = _run(tmp_path, env, world=1, batch=4, die=False)
    assert r2.returncode == 0, r2.stderr
    assert second["bad"] == 0, "the old bytes of the changed file were served"
    assert second["fs"] == 1000, "only the changed file is read again"


HOLD = textwrap.dedent(
    """
    import sys, time
    import clairvoyant
    job = clairvoyant.Job(clairvoyant.FileList(sys.argv[1]), batch_size=8, epochs=2, seed=3, config=sys.argv[2])
    for _ in job.batches(0):
        pass
    print("ready", flush=True)
    time.sleep(120)
    """
)


@contextlib.contextmanager
def _running_job(tmp_path, env):
    """A job that runs all along beside the test's, under its own run id and with its own folder
    for the disk fallback (``env["TMPDIR"]``, set here). Started before a job that is killed: one
    that starts after it would reuse its cache."""
    env["TMPDIR"] = str(tmp_path / "tmp")
    os.makedirs(env["TMPDIR"])
    hold = tmp_path / "hold.py"
    hold.write_text(HOLD)
    live = subprocess.Popen(
        [sys.executable, str(hold), str(tmp_path / "list.txt"), str(tmp_path / "system.toml")],
        env={**env, "CLAIRVOYANT_RUN_ID": "live"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert live.stdout.readline().strip() == "ready", live.stderr.read() if live.poll() is not None else ""
        yield
    finally:
        live.kill()
        live.communicate()


def _clean(env, *args):
    return subprocess.run([sys.executable, "-m", "clairvoyant", "clean", *args], env=env, capture_output=True, text=True, timeout=60)


def test_clean_removes_what_killed_runs_left_and_keeps_a_running_jobs_cache(tmp_path):
    _dataset(tmp_path)
    shm, env = _node(tmp_path)
    mine = shm / f"clairvoyant-{os.getuid()}"
    with _running_job(tmp_path, env):
        running = set(os.listdir(mine))
        assert any(n.endswith(".state") for n in running), running
        first, r1 = _run(tmp_path, env, world=2, batch=8, die=True)
        assert r1.returncode == -9 and first["bad"] == 0
        left = sorted(set(os.listdir(mine)) - running)
        assert any(n.endswith(".mem") for n in left), left
        r = _clean(env)
        assert r.returncode == 0, r.stderr
        assert "clairvoyant clean: removed" in r.stdout and "MB" in r.stdout, r.stdout
        after = set(os.listdir(mine))
        # Every file of the killed run is gone (its copies kept for reuse included) ...
        assert not [n for n in left if n in after], (left, after)
        assert not [n for n in after if n.startswith("salvage-")], after
        # ... and the running job's are all there.
        assert running <= after
        again = _clean(env)
        assert "nothing to remove" in again.stdout, again.stdout


def test_clean_empties_the_directory_classes_a_killed_job_filled(tmp_path):
    total = _dataset(tmp_path)
    (tmp_path / "system.toml").write_text(
        '[staging]\ncapacity = "1 MiB"\nthreads = 2\n'
        f'[[class]]\nname = "memory"\nkind = "memory"\ncapacity = {total // 4}\nthreads = 1\n'
        f'[[class]]\nname = "ssd"\nkind = "directory"\npath = "ssd"\ncapacity = {2 * total}\nthreads = 1\n'
    )  # fmt: skip
    shm, env = _node(tmp_path)
    env.pop("CLAIRVOYANT_CONFIG", None)
    ssd = tmp_path / "ssd" / f"clairvoyant-{os.getuid()}"

    def caches():
        return {d: sorted(os.listdir(ssd / d)) for d in os.listdir(ssd)} if ssd.is_dir() else {}

    with _running_job(tmp_path, env):
        running = caches()
        assert len(running) == 1 and any(running.values()), running
        first, r1 = _run(tmp_path, env, world=1, batch=8, die=True)
        assert r1.returncode == -9 and first["bad"] == 0
        killed = {d: f for d, f in caches().items() if d not in running}
        assert len(killed) == 1 and any(killed.values()), caches()
        # Without the description, only the node's memory is cleaned ...
        r = _clean(env)
        assert r.returncode == 0, r.stderr
        assert set(killed) <= set(caches())
        # ... with it, the killed job's folder in the directory class goes too, and the running job's stays.
        r = _clean(env, "--config", str(tmp_path / "system.toml"))
        assert r.returncode == 0, r.stderr
        assert f"removed {len(next(iter(killed.values())))} file(s)" in r.stdout, (r.stdout, killed)
        assert caches() == running
        # A description that cannot be read is an error naming it, and removes nothing.
        bad = tmp_path / "bad.toml"
        bad.write_text("[[class]]\nkind = 3\n")
        r = _clean(env, "--config", str(bad))
        assert r.returncode == 1 and "bad.toml" in r.stderr, r.stderr
        assert caches() == running
