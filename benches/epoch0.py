"""Epoch 0 against reading directly (``python -m benches --only epoch0``).

The programs of ``tests/epoch0_program.py`` (4 ranks on this machine, batch 32, an emulated accelerator
of 64 MB/s per rank with a barrier per step, 3 epochs) read 6,000 files of ~110 KB on the FUSE
emulation of a shared file system (2 ms opens, 60/100/160/200 MB/s at 1/2/4/8 readers, no page
cache), each run directly and with clairvoyant, alternated:

| program | with clairvoyant |
|---|---|
| 4-thread reader pool per rank | ``clairvoyant run`` (order unknown) |
| DataLoader + DistributedSampler, 2 workers | ``clairvoyant run --sampler-order`` (order known) |
| the same with ``import clairvoyant.torch.patch`` | the drop-in (the direct run is torch's) |

Printed per program: seconds per epoch both ways, epoch 0's ratio, the file system's bytes
against the dataset's and its mean reads in flight during epoch 0, the agent's CPU seconds
beside the program's. The bound for epoch 0 is max(compute, dataset / 200 MB/s)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RANKS = 4
BATCH = 32
EPOCHS = 3
COMPUTE_MBPS = 64.0
FILES = 6000
MEAN_BYTES = 110_000

TARGETS = {
    "epoch0_unknown_vs_direct": 1.05,  # at most: clairvoyant run's epoch 0 / the direct run's
    "epoch0_known_vs_direct": 1.0,  # at most: clairvoyant run --sampler-order's epoch 0 / direct
    "epoch0_dropin_vs_torch": 1.0,  # at most: the drop-in's epoch 0 / torch's
}

LABELS = {
    "epoch0_unknown_vs_direct": "4-thread pool under clairvoyant run (order unknown): epoch 0 / direct",
    "epoch0_known_vs_direct": "DataLoader under clairvoyant run --sampler-order: epoch 0 / direct",
    "epoch0_dropin_vs_torch": "import clairvoyant.torch.patch: epoch 0 / torch's DataLoader",
}

PROGRAMS = {
    # name: (program arguments, clairvoyant run arguments or None for the drop-in)
    "pool": (["--program", "pool"], []),
    "torch": (["--program", "torch"], ["--sampler-order"]),
    "dropin": (["--program", "torch"], None),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_of_children() -> float:
    """CPU seconds of this process's reaped children (the ranks and their launchers)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def _run(name: str, clairvoyant: bool, mnt: Path, work: Path, fs) -> dict:
    """One job of RANKS ranks; per-epoch seconds (the slowest rank's), file system figures."""
    args, run_args = PROGRAMS[name]
    prog = str(Path(__file__).resolve().parents[1] / "tests" / "epoch0_program.py")
    tag = f"{name}-{'cv' if clairvoyant else 'direct'}-{time.monotonic_ns()}"
    port = _free_port()
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(RANKS),
            "LOCAL_WORLD_SIZE": str(RANKS),
            "CLAIRVOYANT_NODES": "1",
            "CLAIRVOYANT_NODE_RANK": "0",
            "CLAIRVOYANT_RUN_ID": tag,
            "CLAIRVOYANT_SHM_DIR": str(work / "shm"),
            "CLAIRVOYANT_CACHE_DIR": str(work / "cache"),
            "CLAIRVOYANT_CONFIG": "",
            "CLAIRVOYANT_QUIET": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    (work / "shm").mkdir(parents=True, exist_ok=True)
    stats = work / f"{tag}-agent.json"
    procs, outs = [], []
    before = fs.stats()
    cpu0 = _cpu_of_children()
    t = time.perf_counter()
    for r in range(RANKS):
        out = work / f"{tag}-{r}.json"
        cmd = [sys.executable, prog, str(mnt), *args, "--epochs", str(EPOCHS), "--batch", str(BATCH),
               "--compute-mbps", str(COMPUTE_MBPS), "--out", str(out)]  # fmt: skip
        if clairvoyant and run_args is None:
            cmd.insert(3, "--patch")
        elif clairvoyant:
            cmd = [sys.executable, "-m", "clairvoyant", "run", "--dataset", str(mnt), *run_args,
                   "--stats-json", str(stats), "--", *cmd]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    errors = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}: {err[-2000:]}")
    wall = time.perf_counter() - t
    if errors:
        raise RuntimeError(f"epoch-0 benchmark, {name} ({'clairvoyant' if clairvoyant else 'direct'}):\n" + "\n".join(errors))
    after = fs.stats()
    ranks = [json.loads(o.read_text()) for o in outs]
    res = {
        "seconds": [max(r["seconds"][e] for r in ranks) for e in range(EPOCHS)],
        "first_iter_seconds": [max(r["first_iter_seconds"][e] for r in ranks) for e in range(EPOCHS)]
        if ranks[0]["first_iter_seconds"]
        else None,
        "job_seconds": wall,
        "fs_bytes": after["bytes"] - before["bytes"],
        "fs_opens": after["opens"] - before["opens"],
        # Mean opens and transfers in progress on the file system over the whole job.
        "reads_in_flight": ((after["open_seconds"] - before["open_seconds"]) + (after["transfer_seconds"] - before["transfer_seconds"]))
        / max(1e-9, after["uptime_s"] - before["uptime_s"]),
        "cpu_seconds": _cpu_of_children() - cpu0,
    }
    if clairvoyant and run_args is not None and stats.exists():
        s = json.loads(stats.read_text())
        res["agent_cpu_seconds"] = s.get("agent_cpu_s")
        res["agent"] = {k: s.get(k) for k in ("lookups", "cached", "inline", "direct", "pfs_bytes", "pfs_files")}
    return res


def bench_epoch0(out: Path, log, files: int = FILES, repeats: int = 1, programs=tuple(PROGRAMS)) -> dict:
    from . import emulation
    from .bench import make_fuse_dataset

    why = emulation.fuse_unavailable()
    if why:
        log(f"epoch 0: skipped ({why})")
        return {"skipped": why}
    data = out / "bench" / "epoch0-data"
    log(f"epoch 0: {files:,} files of ~{MEAN_BYTES // 1000} KB ...")
    _, _, total = make_fuse_dataset(data, files, MEAN_BYTES)
    peak = max(y for _, y in emulation.FSEMU_DEFAULT_BANDWIDTH) * 1e6
    compute = total / RANKS / (COMPUTE_MBPS * 1e6)
    res: dict = {
        "files": files,
        "dataset_bytes": total,
        "ranks": RANKS,
        "batch_size": BATCH,
        "compute_mbps_per_rank": COMPUTE_MBPS,
        "compute_seconds": compute,
        "bound_seconds": max(compute, total / peak),
        "repeats": repeats,
        "programs": {},
    }
    work = Path(tempfile.mkdtemp(prefix="cv-epoch0-", dir=out)).resolve()
    with emulation.FuseMount(data, work / "mnt") as fs:
        for name in programs:
            runs: dict = {"direct": [], "clairvoyant": []}
            for _ in range(repeats):
                for how in ("direct", "clairvoyant"):
                    r = _run(name, how == "clairvoyant", fs.path, work, fs)
                    runs[how].append(r)
                    log(
                        f"epoch 0: {name:<7} {how:<12} epochs {' / '.join(f'{x:.2f}' for x in r['seconds'])} s, "
                        f"file system {r['fs_bytes'] / total:.2f}x the dataset, {r['fs_opens'] / files:.2f} opens per file, "
                        f"{r['reads_in_flight']:.1f} reads in flight"
                    )
            best = {k: min(v, key=lambda r: r["seconds"][0]) for k, v in runs.items()}
            res["programs"][name] = {
                "runs": runs,
                "best": best,
                "epoch0_ratio": best["clairvoyant"]["seconds"][0] / best["direct"]["seconds"][0],
            }
    return res


def evaluate(res: dict, target) -> list:
    p = res.get("programs", {})
    keys = {"pool": "epoch0_unknown_vs_direct", "torch": "epoch0_known_vs_direct", "dropin": "epoch0_dropin_vs_torch"}
    return [target(keys[k], v["epoch0_ratio"], False) for k, v in p.items() if k in keys]


def markdown(res: dict) -> list:
    if "skipped" in res:
        return [f"Epoch 0 against reading directly: skipped ({res['skipped']})"]
    names = {
        "pool": "4-thread reader pool per rank, unmodified, under `clairvoyant run`",
        "torch": "torch DataLoader + DistributedSampler, 2 workers, under `clairvoyant run --sampler-order`",
        "dropin": "the same program with `import clairvoyant.torch.patch` (dataset protocol, LOCAL_RANK set)",
    }
    lines = [
        f"Epoch 0 against reading directly: {res['files']:,} files, {res['dataset_bytes'] / 1e6:.0f} MB, {res['ranks']} ranks, "
        f"batch {res['batch_size']}, accelerator {res['compute_mbps_per_rank']:.0f} MB/s per rank; "
        f"bound for epoch 0 {res['bound_seconds']:.2f} s (compute alone {res['compute_seconds']:.2f} s), seconds per epoch:",
        "",
        "| program | directly | with clairvoyant | epoch 0 ratio | file system (direct -> clairvoyant) | reads in flight | CPU s (program + agent) |",
        "|---|---|---|---|---|---|---|",
    ]
    total = res["dataset_bytes"] * EPOCHS
    for k, v in res["programs"].items():
        d, c = v["best"]["direct"], v["best"]["clairvoyant"]
        fmt = lambda r: " / ".join(f"{x:.2f}" for x in r["seconds"])  # noqa: E731
        agent = c.get("agent_cpu_seconds")
        lines.append(
            f"| {names[k]} | {fmt(d)} | {fmt(c)} | {v['epoch0_ratio']:.2f}x | "
            f"{d['fs_bytes'] / total * EPOCHS:.2f}x -> {c['fs_bytes'] / total * EPOCHS:.2f}x | "
            f"{d['reads_in_flight']:.1f} -> {c['reads_in_flight']:.1f} | "
            f"{d['cpu_seconds']:.0f} -> {c['cpu_seconds']:.0f}{'' if agent is None else f' (agent {agent:.1f})'} |"
        )
    return lines
