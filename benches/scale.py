"""Scale benchmark (``python -m benches --only scale``): how the cost of planning and
starting grows with the cluster, for 1 to 1,024 nodes of 4 ranks, ImageNet-1k and ImageNet-22k
sizes, 90 epochs, batch 32, a 64 GiB class per node:

- (a) the cluster-wide ``clairvoyant plan`` (the coverage of every node, node 0's placement);
- (b) one rank's start-up to its first sample, over a synthetic dataset with peers not
  contacted: the node's first rank (computes the node's plan) and, once it is up, the node's
  other ranks (read the plan);
- (c) the simulator, where its whole-cluster model fits the machine.

Each figure is a fresh process: wall seconds and its own peak resident memory (``wait4``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

DATASETS = {"imagenet-1k": 1_281_167, "imagenet-22k": 14_197_122}
NODES = (1, 4, 16, 64, 256, 1024)
RANKS_PER_NODE = 4
EPOCHS = 90

# Targets (2-core machine): seconds and bytes.
PLAN_TARGET = {"seconds": 60.0, "bytes": 4e9}  # 256 nodes x ImageNet-22k
FIRST_TARGET = {"seconds": 60.0, "bytes": 4e9}  # 256 x 4, ImageNet-22k
OTHER_TARGET = {"seconds": 2.0}
BIG_FIRST_TARGET = {"seconds": 120.0, "bytes": 6e9}  # 1,024 x 8, ImageNet-22k
SIM_TARGET = {"seconds": 60.0, "bytes": 4e9}  # --scenario imagenet-22k


# Each figure over its target: <= 1 is met.
TARGETS = {
    name: 1.0
    for name in (
        "scale_plan_seconds_ratio",
        "scale_plan_memory_ratio",
        "scale_first_seconds_ratio",
        "scale_first_memory_ratio",
        "scale_other_seconds_ratio",
        "scale_big_first_seconds_ratio",
        "scale_big_first_memory_ratio",
        "scale_sim_seconds_ratio",
        "scale_sim_memory_ratio",
    )
}
LABELS = {
    "scale_plan_seconds_ratio": "plan, 256 nodes x ImageNet-22k: seconds / 60",
    "scale_plan_memory_ratio": "plan, 256 nodes x ImageNet-22k: peak bytes / 4 GB",
    "scale_first_seconds_ratio": "first rank start-up, 256 x 4 x ImageNet-22k: seconds / 60",
    "scale_first_memory_ratio": "first rank start-up, 256 x 4 x ImageNet-22k: peak bytes / 4 GB",
    "scale_other_seconds_ratio": "other ranks' start-up, 256 x 4 x ImageNet-22k: seconds / 2",
    "scale_big_first_seconds_ratio": "first rank start-up, 1,024 x 8 x ImageNet-22k: seconds / 120",
    "scale_big_first_memory_ratio": "first rank start-up, 1,024 x 8 x ImageNet-22k: peak bytes / 6 GB",
    "scale_sim_seconds_ratio": "simulator --scenario imagenet-22k: seconds / 60",
    "scale_sim_memory_ratio": "simulator --scenario imagenet-22k: peak bytes / 4 GB",
}


def _measure(argv: list, env: Optional[dict] = None) -> dict:
    """Run argv to its end: stdout, the end of stderr, exit code, wall seconds and its peak
    resident bytes. A forked child's peak starts at its parent's size (the kernel keeps the
    larger of the two across exec), so the peak comes from GNU time's small process where it
    is installed, else from wait4 (then it is at least this process's size)."""
    timer = shutil.which("time") or ("/usr/bin/time" if os.path.exists("/usr/bin/time") else None)
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as peak_file:
        wrapped = [timer, "-f", "%M", "-o", peak_file.name, *argv] if timer else argv
        t = time.perf_counter()
        p = subprocess.Popen(wrapped, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env)
        out = p.stdout.read()
        p.stdout.close()
        code, peak = _reap(p)
        seconds = time.perf_counter() - t
        if timer:
            text = peak_file.read().strip().splitlines()
            peak = int(text[-1]) * 1024 if text and text[-1].isdigit() else None
        err.seek(0)
        return {"stdout": out.decode(), "stderr": err.read().decode()[-800:], "code": code, "seconds": seconds, "peak_bytes": peak}


def _reap(p: subprocess.Popen) -> tuple:
    """Wait for p; its exit status and peak resident bytes (see `_measure` on what that is)."""
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss * 1024


def plan(samples: int, nodes: int) -> dict:
    r = _measure([sys.executable, "-m", "clairvoyant", "plan", "--samples", str(samples), "--world-size", str(nodes * RANKS_PER_NODE),
                  "--nodes", str(nodes), "--epochs", str(EPOCHS), "--batch-size", "32", "--memory", "64GiB", "--json"])
    if r["code"] != 0:
        return {"error": r["stderr"]}
    rep = json.loads(r["stdout"])
    return {
        "seconds": r["seconds"],
        "peak_bytes": r["peak_bytes"],
        "plan_seconds": rep["seconds"],
        "coverage": rep["coverage"],
        "expected_fs_bytes": rep["expected_fs_bytes"],
        "minimum_fs_bytes": rep["minimum_fs_bytes"],
    }


def startup(binary: str, samples: int, nodes: int, per_node: int, others: int = 2) -> dict:
    """The node's first rank, then (while it holds the node cache) `others` of its other ranks.
    Node-shared memory goes to a folder of its own, removed after: only some of the node's
    ranks attach, so the last expected one never leaves to remove the node's files."""
    from .emulation import shm_folder

    ssd = tempfile.mkdtemp(prefix="clairvoyant-scale-")
    run = f"scale-{os.getpid()}-{nodes}-{per_node}-{samples}"
    try:
        with shm_folder("clairvoyant-scale-shm-") as shm:
            env = {**os.environ, "CLAIRVOYANT_SHM_DIR": str(shm)}
            err = tempfile.TemporaryFile()
            first = subprocess.Popen([binary, str(samples), str(nodes), str(per_node), str(EPOCHS), "0", run, ssd],
                                     stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE, env=env)
            line = first.stdout.readline()
            if not line:
                _reap(first)
                err.seek(0)
                return {"error": err.read().decode()[-800:]}
            got = json.loads(line)
            rest = []
            for i in range(1, min(per_node, others + 1)):
                r = _measure([binary, str(samples), str(nodes), str(per_node), str(EPOCHS), str(i), run, ssd], env=env)
                if r["code"] == 0 and r["stdout"].strip():
                    rest.append(json.loads(r["stdout"].splitlines()[0]))
                else:
                    rest.append({"error": r["stderr"], "seconds": float("nan"), "origin": "error"})
            first.stdin.close()
            first.stdout.close()
            err.close()
            _reap(first)
            return {"first": got, "others": rest}
    finally:
        shutil.rmtree(ssd, ignore_errors=True)


def simulator(args: list) -> dict:
    r = _measure([sys.executable, "-m", "clairvoyant", "simulate", *args, "--json", "--no-progress"])
    if r["code"] != 0:
        return {"args": args, "error": r["stderr"]}
    return {"args": args, "seconds": r["seconds"], "peak_bytes": r["peak_bytes"]}


def _binary(name: str) -> Optional[str]:
    root = Path(__file__).resolve().parents[1]
    path = root / "target" / "release" / "examples" / name
    if path.exists():
        return str(path)
    build = subprocess.run(["cargo", "build", "--release", "-q", "-p", "clairvoyant-core", "--example", name], cwd=root)
    return str(path) if build.returncode == 0 and path.exists() else None


def bench_scale(out: Path, log, nodes=NODES, datasets=tuple(DATASETS)) -> dict:
    figures: dict = {"nodes": list(nodes), "ranks_per_node": RANKS_PER_NODE, "epochs": EPOCHS, "plan": {}, "startup": {}, "simulator": []}
    binary = _binary("startup_scale")
    for name in datasets:
        samples = DATASETS[name]
        for n in nodes:
            log(f"scale: plan {name} x {n} nodes ...")
            r = plan(samples, n)
            figures["plan"][f"{name}/{n}"] = r
            log(f"scale: plan {name} x {n} nodes: " + (r.get("error") or f"{r['seconds']:.1f} s, {r['peak_bytes'] / 1e9:.2f} GB"))
            if binary is None:
                continue
            log(f"scale: start-up {name} x {n} nodes ...")
            s = startup(binary, samples, n, RANKS_PER_NODE)
            figures["startup"][f"{name}/{n}"] = s
            if "error" in s:
                log(f"scale: start-up {name} x {n} nodes: {s['error']}")
            else:
                log(f"scale: start-up {name} x {n} nodes: first {s['first']['seconds']:.1f} s {s['first']['peak_bytes'] / 1e9:.2f} GB, "
                    + ", ".join(f"other {o['seconds']:.2f} s ({o['origin']})" for o in s["others"]))
    if binary is not None and "imagenet-22k" in datasets:
        log("scale: start-up imagenet-22k x 1024 nodes x 8 ranks ...")
        s = startup(binary, DATASETS["imagenet-22k"], 1024, 8)
        figures["startup"]["imagenet-22k/1024x8"] = s
        if "error" not in s:
            log(f"scale: 1024 x 8: first {s['first']['seconds']:.1f} s {s['first']['peak_bytes'] / 1e9:.2f} GB")
    # The simulator models every node's cache (memory grows with nodes x samples): run where it fits.
    sim_runs = [["--scenario", "imagenet-1k", "--workers", str(4 * n), "--set", "workers_per_node=4", "--epochs", str(EPOCHS), "--policy", "clairvoyant"]
                for n in nodes if n <= 64]
    sim_runs.append(["--scenario", "imagenet-22k"])
    for args in sim_runs:
        log("scale: simulate " + " ".join(args) + " ...")
        r = simulator(args)
        figures["simulator"].append(r)
        log("scale: simulate: " + (r.get("error") or f"{r['seconds']:.1f} s, {r['peak_bytes'] / 1e9:.2f} GB"))
    _plot(figures, out / "bench" / "scale.png")
    return figures


def _plot(figures: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    for name in DATASETS:
        xs, plan_t, plan_m, first_t, first_m, other_t = [], [], [], [], [], []
        for n in figures["nodes"]:
            p = figures["plan"].get(f"{name}/{n}")
            s = figures["startup"].get(f"{name}/{n}")
            if not p or "error" in p:
                continue
            xs.append(n)
            plan_t.append(p["seconds"])
            plan_m.append(p["peak_bytes"] / 1e9)
            ok = s and "error" not in s
            first_t.append(s["first"]["seconds"] if ok else float("nan"))
            first_m.append(s["first"]["peak_bytes"] / 1e9 if ok else float("nan"))
            other_t.append(max((o["seconds"] for o in s["others"]), default=float("nan")) if ok else float("nan"))
        if not xs:
            continue
        ax_t.plot(xs, plan_t, "o-", label=f"plan, {name}")
        ax_t.plot(xs, first_t, "s--", label=f"first rank, {name}")
        ax_t.plot(xs, other_t, "^:", label=f"other ranks, {name}")
        ax_m.plot(xs, plan_m, "o-", label=f"plan, {name}")
        ax_m.plot(xs, first_m, "s--", label=f"first rank, {name}")
    for ax, label in ((ax_t, "seconds"), (ax_m, "peak resident GB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes (4 ranks each)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Planning and start-up cost against cluster size ({EPOCHS} epochs, batch 32, 64 GiB per node)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def evaluate(figures: dict, target) -> list:
    """Targets as (name, value, at_least) through the bench's `target` helper."""
    out = []
    p = figures["plan"].get("imagenet-22k/256")
    if p and "error" not in p:
        out.append(target("scale_plan_seconds_ratio", p["seconds"] / PLAN_TARGET["seconds"], at_least=False))
        out.append(target("scale_plan_memory_ratio", p["peak_bytes"] / PLAN_TARGET["bytes"], at_least=False))
    s = figures["startup"].get("imagenet-22k/256")
    if s and "error" not in s:
        out.append(target("scale_first_seconds_ratio", s["first"]["seconds"] / FIRST_TARGET["seconds"], at_least=False))
        out.append(target("scale_first_memory_ratio", s["first"]["peak_bytes"] / FIRST_TARGET["bytes"], at_least=False))
        worst = max((o["seconds"] for o in s["others"]), default=None)
        if worst is not None:
            out.append(target("scale_other_seconds_ratio", worst / OTHER_TARGET["seconds"], at_least=False))
    s = figures["startup"].get("imagenet-22k/1024x8")
    if s and "error" not in s:
        out.append(target("scale_big_first_seconds_ratio", s["first"]["seconds"] / BIG_FIRST_TARGET["seconds"], at_least=False))
        out.append(target("scale_big_first_memory_ratio", s["first"]["peak_bytes"] / BIG_FIRST_TARGET["bytes"], at_least=False))
    sim = [r for r in figures["simulator"] if r["args"] == ["--scenario", "imagenet-22k"] and "error" not in r]
    if sim:
        out.append(target("scale_sim_seconds_ratio", sim[0]["seconds"] / SIM_TARGET["seconds"], at_least=False))
        out.append(target("scale_sim_memory_ratio", sim[0]["peak_bytes"] / SIM_TARGET["bytes"], at_least=False))
    return out


def markdown(figures: dict) -> list:
    gb = 1e9
    lines = ["| dataset | nodes | plan s | plan GB | first rank s | first rank GB | other ranks s | coverage | FS reads / minimum |", "|---|---|---|---|---|---|---|---|---|"]
    for name in DATASETS:
        for n in figures["nodes"]:
            p = figures["plan"].get(f"{name}/{n}")
            if not p:
                continue
            s = figures["startup"].get(f"{name}/{n}") or {}
            if "error" in p:
                lines.append(f"| {name} | {n} | error: {p['error'][:60]} | | | | | | |")
                continue
            first = s.get("first")
            others = s.get("others") or []
            lines.append(
                f"| {name} | {n} | {p['seconds']:.1f} | {p['peak_bytes'] / gb:.2f} | "
                + (f"{first['seconds']:.1f} | {first['peak_bytes'] / gb:.2f} | " if first else "n/a | n/a | ")
                + (", ".join(f"{o['seconds']:.2f}" for o in others) or "n/a")
                + f" | {p['coverage']:.3f} | {p['expected_fs_bytes'] / max(p['minimum_fs_bytes'], 1):.4f} |"
            )
    big = figures["startup"].get("imagenet-22k/1024x8")
    if big and "error" not in big:
        lines.append("")
        lines.append(
            f"1,024 nodes x 8 ranks, ImageNet-22k: first rank {big['first']['seconds']:.1f} s, {big['first']['peak_bytes'] / gb:.2f} GB; "
            f"other ranks " + ", ".join(f"{o['seconds']:.2f} s" for o in big["others"])
        )
    if figures["simulator"]:
        lines.append("")
        lines.append("| simulator run | s | peak GB |")
        lines.append("|---|---|---|")
        for r in figures["simulator"]:
            cmd = "clairvoyant simulate " + " ".join(r["args"])
            lines.append(f"| `{cmd}` | " + ("error | |" if "error" in r else f"{r['seconds']:.1f} | {r['peak_bytes'] / gb:.2f} |"))
    return lines
