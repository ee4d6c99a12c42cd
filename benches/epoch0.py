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

Printed per program: seconds per epoch both ways and the program's own floor (the same
program handed zeros of each file's size: no file opened), epoch 0's ratio, the file system's
bytes against the dataset's and its mean reads in flight during epoch 0, and per epoch the CPU
microseconds per sample of the programs (their processes, launchers apart) and of the node
agent, sampled from /proc and set against each epoch's start and end. ``--epoch0-job`` also
runs each program as a 1-epoch job each way and splits its wall time: start (to the program's
first line: with clairvoyant the launcher and, where the program waits for it, the agent),
setup (imports, process group, listing), epoch 0, end (to the last exit). The bound for epoch 0
is max(compute, dataset / 200 MB/s)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
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


def _proc_stat(pid: int):
    """(parent pid, CPU seconds) of a live process from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class CpuSampler(threading.Thread):
    """CPU seconds of the processes started as ``roots`` and all their descendants, every
    ``interval`` seconds on the monotonic clock, by kind: ``agent`` (the node agent),
    ``launcher`` (``clairvoyant run`` itself) and ``program`` (the rest: the ranks and their
    workers). A process that exits keeps the CPU last seen of it (up to one interval of its
    last CPU is missed)."""

    def __init__(self, roots, launchers: bool, interval: float = 0.1):
        super().__init__(name="epoch0-cpu", daemon=True)
        self.roots, self.launchers, self.interval = set(roots), launchers, interval
        self.kind: dict = {}
        self.last: dict = {}
        self.samples: list = []
        self.stop = threading.Event()

    def _kind_of(self, pid: int) -> str:
        if pid in self.roots:
            return "launcher" if self.launchers else "program"
        return "agent" if b"clairvoyant._agent" in _cmdline(pid) else "program"

    def sample(self) -> None:
        stats = {int(d): s for d in os.listdir("/proc") if d.isdigit() and (s := _proc_stat(int(d))) is not None}
        members = set(self.kind)
        grown = True
        while grown:  # descendants of the roots (the agent is a child of a launcher)
            new = {p for p, (pp, _) in stats.items() if p not in members and (p in self.roots or pp in members)}
            grown = bool(new)
            members |= new
        for p in members:
            # Asked again until it is the agent: a child seen between its fork and its exec
            # still has its parent's command line.
            if p in stats and self.kind.get(p) != "agent":
                self.kind[p] = self._kind_of(p)
        for p in members:
            if p in stats:
                self.last[p] = max(self.last.get(p, 0.0), stats[p][1])
        by_kind = {"agent": 0.0, "launcher": 0.0, "program": 0.0}
        for p, cpu in self.last.items():
            by_kind[self.kind[p]] += cpu
        self.samples.append((time.monotonic(), by_kind))

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()

    def finish(self) -> list:
        self.stop.set()
        self.join()
        self.sample()
        return self.samples


def cpu_between(samples: list, kind: str, t0: float, t1: float) -> float:
    """CPU seconds of ``kind`` between the monotonic times ``t0`` and ``t1``, interpolated
    linearly between the samples ``(time, {kind: cumulative seconds})`` around each end."""

    def at(t: float) -> float:
        if not samples or t <= samples[0][0]:
            return samples[0][1][kind] if samples else 0.0
        for (ta, a), (tb, b) in zip(samples, samples[1:]):
            if t <= tb:
                w = (t - ta) / (tb - ta) if tb > ta else 1.0
                return a[kind] + w * (b[kind] - a[kind])
        return samples[-1][1][kind]

    return max(0.0, at(t1) - at(t0))


def per_epoch_cpu(samples: list, ranks: list) -> dict:
    """Per epoch, CPU microseconds per sample of the node agent and of the programs (epoch
    ``e`` runs from the first rank's start to the last rank's end; samples: all ranks')."""
    out: dict = {"agent_us_per_sample": [], "program_us_per_sample": [], "launcher_us_per_sample": []}
    for e in range(len(ranks[0]["epoch_bounds"])):
        t0 = min(r["epoch_bounds"][e][0] for r in ranks)
        t1 = max(r["epoch_bounds"][e][1] for r in ranks)
        n = max(1, sum(r["samples"][e] for r in ranks))
        for kind in ("agent", "program", "launcher"):
            out[f"{kind}_us_per_sample"].append(cpu_between(samples, kind, t0, t1) / n * 1e6)
    return out


def phases(ranks: list, spawned: float, ended: float) -> dict:
    """Where a job's wall time went (seconds): ``start`` from starting the commands to the last
    rank's first line (with clairvoyant: the launcher, the node agent and its index, then the
    program's interpreter), ``setup`` from there to epoch 0 (imports, process group, listing
    the files), the epochs, and ``end`` from the last epoch to the last process's exit."""
    started = max(r["started"] for r in ranks)
    first = min(r["epoch_bounds"][0][0] for r in ranks)
    last = max(r["epoch_bounds"][-1][1] for r in ranks)
    return {"start": started - spawned, "setup": first - started, "epochs": last - first, "end": ended - last, "job": ended - spawned}


def _run(name: str, clairvoyant: bool, mnt: Path, work: Path, shm: Path, fs, epochs: int = EPOCHS, no_io: bool = False) -> dict:
    """One job of RANKS ranks; per-epoch seconds (the slowest rank's), file system figures. ``shm``:
    the node-shared memory folder (a tmpfs, as on a real node)."""
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
            "CLAIRVOYANT_SHM_DIR": str(shm),
            "CLAIRVOYANT_CACHE_DIR": str(work / "cache"),
            "CLAIRVOYANT_CONFIG": "",
            "CLAIRVOYANT_QUIET": "1",
            "OMP_NUM_THREADS": "1",
        }
    )
    stats = work / f"{tag}-agent.json"
    procs, outs = [], []
    before = fs.stats()
    cpu0 = _cpu_of_children()
    t, spawned = time.perf_counter(), time.monotonic()
    for r in range(RANKS):
        out = work / f"{tag}-{r}.json"
        cmd = [sys.executable, prog, str(mnt), *args, "--epochs", str(epochs), "--batch", str(BATCH),
               "--compute-mbps", str(COMPUTE_MBPS), "--out", str(out), *(["--no-io"] if no_io else [])]  # fmt: skip
        if clairvoyant and run_args is None:
            cmd.insert(3, "--patch")
        elif clairvoyant:
            cmd = [sys.executable, "-m", "clairvoyant", "run", "--dataset", str(mnt), *run_args,
                   "--stats-json", str(stats), "--", *cmd]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE, text=True))
        outs.append(out)
    sampler = CpuSampler([p.pid for p in procs], launchers=clairvoyant and run_args is not None)
    sampler.start()
    errors = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}: {err[-2000:]}")
    wall, ended = time.perf_counter() - t, time.monotonic()
    samples = sampler.finish()
    if errors:
        raise RuntimeError(f"epoch-0 benchmark, {name} ({'clairvoyant' if clairvoyant else 'direct'}):\n" + "\n".join(errors))
    after = fs.stats()
    ranks = [json.loads(o.read_text()) for o in outs]
    res = {
        "seconds": [max(r["seconds"][e] for r in ranks) for e in range(epochs)],
        "first_iter_seconds": [max(r["first_iter_seconds"][e] for r in ranks) for e in range(epochs)]
        if ranks[0]["first_iter_seconds"]
        else None,
        "job_seconds": wall,
        "fs_bytes": after["bytes"] - before["bytes"],
        "fs_opens": after["opens"] - before["opens"],
        # Mean opens and transfers in progress on the file system over the whole job.
        "reads_in_flight": ((after["open_seconds"] - before["open_seconds"]) + (after["transfer_seconds"] - before["transfer_seconds"]))
        / max(1e-9, after["uptime_s"] - before["uptime_s"]),
        "cpu_seconds": _cpu_of_children() - cpu0,
        "phases": phases(ranks, spawned, ended),
        **per_epoch_cpu(samples, ranks),
    }
    if clairvoyant and run_args is not None and stats.exists():
        s = json.loads(stats.read_text())
        res["agent_cpu_seconds"] = s.get("agent_cpu_s")
        res["agent"] = {k: s.get(k) for k in ("lookups", "cached", "inline", "direct", "pfs_bytes", "pfs_files")}
    return res


def _log_run(log, name: str, how: str, r: dict, total: int, files: int) -> None:
    us = lambda k: " / ".join(f"{x:.0f}" for x in r[k])  # noqa: E731
    ph = r["phases"]
    log(
        f"epoch 0: {name:<7} {how:<12} epochs {' / '.join(f'{x:.2f}' for x in r['seconds'])} s, "
        f"file system {r['fs_bytes'] / total:.2f}x the dataset, {r['fs_opens'] / files:.2f} opens per file, "
        f"{r['reads_in_flight']:.1f} reads in flight; CPU per sample: program {us('program_us_per_sample')} µs, "
        f"agent {us('agent_us_per_sample')} µs; job {ph['job']:.2f} s (start {ph['start']:.2f}, setup {ph['setup']:.2f}, "
        f"epochs {ph['epochs']:.2f}, end {ph['end']:.2f})"
    )


def _program_runs(name: str, repeats: int, one_epoch: bool, fs, work: Path, shm: Path, log, total: int, files: int) -> dict:
    """The program ``name`` run ``repeats`` times each way, alternated; for the reader pool and
    the DataLoader also without I/O (``floor``: the program's own cost with every sample in
    memory); with ``one_epoch`` also as a 1-epoch job each way (``job_direct``,
    ``job_clairvoyant``: the whole job's wall time, agent start-up included)."""
    kinds = ["direct", "clairvoyant"] + (["floor"] if name != "dropin" else [])
    if one_epoch:
        kinds += ["job_direct", "job_clairvoyant"]
    runs: dict = {k: [] for k in kinds}
    for _ in range(repeats):
        for how in kinds:
            r = _run(
                name,
                how in ("clairvoyant", "job_clairvoyant"),
                fs.path,
                work,
                shm,
                fs,
                epochs=1 if how.startswith("job") else EPOCHS,
                no_io=how == "floor",
            )
            runs[how].append(r)
            _log_run(log, name, how, r, total, files)
    return runs


def bench_epoch0(out: Path, log, files: int = FILES, repeats: int = 1, programs=tuple(PROGRAMS), one_epoch: bool = False) -> dict:
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
    with emulation.FuseMount(data, work / "mnt") as fs, emulation.shm_folder("cv-epoch0-") as shm:
        for name in programs:
            runs = _program_runs(name, repeats, one_epoch, fs, work, shm, log, total, files)
            best = {k: min(v, key=lambda r: r["seconds"][0]) for k, v in runs.items()}
            res["programs"][name] = {
                "runs": runs,
                "best": best,
                "epoch0_ratio": best["clairvoyant"]["seconds"][0] / best["direct"]["seconds"][0],
            }
            if one_epoch:
                jobs = {k: min(r["job_seconds"] for r in runs[k]) for k in ("job_direct", "job_clairvoyant")}
                res["programs"][name]["job_ratio"] = jobs["job_clairvoyant"] / jobs["job_direct"]
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
        f"bound for epoch 0 {res['bound_seconds']:.2f} s (compute alone {res['compute_seconds']:.2f} s), seconds per epoch "
        "(floor: the same program handed zeros, no file opened); CPU per sample in µs per epoch:",
        "",
        "| program | directly | with clairvoyant | floor | epoch 0 ratio | file system (direct -> clairvoyant) | reads in flight "
        "| CPU s (program + agent) | CPU µs per sample, direct | with clairvoyant: program; agent |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = res["dataset_bytes"] * EPOCHS
    fmt = lambda r: " / ".join(f"{x:.2f}" for x in r["seconds"])  # noqa: E731
    us = lambda r, k: " / ".join(f"{x:.0f}" for x in r.get(k, []))  # noqa: E731
    for k, v in res["programs"].items():
        d, c = v["best"]["direct"], v["best"]["clairvoyant"]
        floor = v["best"].get("floor")
        agent = c.get("agent_cpu_seconds")
        lines.append(
            f"| {names[k]} | {fmt(d)} | {fmt(c)} | {fmt(floor) if floor else '-'} | {v['epoch0_ratio']:.2f}x | "
            f"{d['fs_bytes'] / total * EPOCHS:.2f}x -> {c['fs_bytes'] / total * EPOCHS:.2f}x | "
            f"{d['reads_in_flight']:.1f} -> {c['reads_in_flight']:.1f} | "
            f"{d['cpu_seconds']:.0f} -> {c['cpu_seconds']:.0f}{'' if agent is None else f' (agent {agent:.1f})'} | "
            f"{us(d, 'program_us_per_sample')} | {us(c, 'program_us_per_sample')}; {us(c, 'agent_us_per_sample')} |"
        )
    jobs = {k: v for k, v in res["programs"].items() if "job_ratio" in v}
    if jobs:
        lines += [
            "",
            "A 1-epoch job end to end (best of each way), seconds: start (to the program's first line: with clairvoyant the "
            "launcher and the node agent's start), setup (to epoch 0), epoch 0, end (to the last exit):",
            "",
            "| program | directly: job (start / setup / epoch 0 / end) | with clairvoyant | ratio |",
            "|---|---|---|---|",
        ]
        for k, v in jobs.items():
            ph = lambda r: "{job:.2f} ({start:.2f} / {setup:.2f} / {epochs:.2f} / {end:.2f})".format(**r["phases"])  # noqa: E731
            d = min(v["runs"]["job_direct"], key=lambda r: r["job_seconds"])
            c = min(v["runs"]["job_clairvoyant"], key=lambda r: r["job_seconds"])
            lines.append(f"| {names[k]} | {ph(d)} | {ph(c)} | {v['job_ratio']:.3f}x |")
    return lines
