"""Multi-node benchmarks (``python -m benches --only cluster``), on one machine:

- (a) 4 emulated nodes x 2 ranks, each node's memory 30 % of the dataset (120 % in all), 4
  epochs, the demo's training loop (decode, DistributedSampler, the drop-in DataLoader) on the
  emulated shared file system: file-system bytes over the run, accelerator utilization on epochs
  >= 1, epoch 0 against max(compute, dataset / bandwidth); PyTorch's DataLoader beside it.
- (b) the same at 12.5 % per node (50 % in all): file-system bytes against the minimum
  S + (E-1)(S-C).
- (c) peer fetch throughput of the transport (``peerbench``: 4 servers on loopback, 100 KB
  samples) against a plain socket copy in the same run.
- (d) one node killed with SIGKILL in epoch 2 of 4 nodes x 1 rank: the others finish; their
  stall after the kill beyond that of the same run without a kill.
- (e) set-up (rendezvous, index, plan) of 8 ranks on 4 nodes over 100,000 files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import demo
from .emulation import node_env

# Accelerator / file-system speed. On 2 cores, 8 ranks and their decode workers share the CPU:
# faster accelerators make the run CPU-bound for every loader (at the demo's 1.6 clairvoyant's
# epochs >= 1 take ~3.0 s of CPU for 2.45 s of compute), which is not what this measures.
CLUSTER_COMPUTE_RATIO = 0.8
CLUSTER_NODES, CLUSTER_RANKS_PER_NODE, CLUSTER_EPOCHS = 4, 2, 4


def bench_cluster_training(out: Path, log, progress: str = "stdout", samples: int = demo.DEFAULT_SAMPLES) -> dict:
    """(a) and (b)."""
    ranks = CLUSTER_NODES * CLUSTER_RANKS_PER_NODE
    figures: dict = {}
    for name, fraction, loaders in (("large", 0.30, ("pytorch", "clairvoyant")), ("small", 0.125, ("clairvoyant",))):
        result = demo.run_comparison(
            out / "bench" / f"cluster-{name}",
            out / "bench" / "cluster-data",
            samples=samples,
            epochs=CLUSTER_EPOCHS,
            ranks=ranks,
            nodes=CLUSTER_NODES,
            node_memory=fraction,
            compute_ratio=CLUSTER_COMPUTE_RATIO,
            loaders=loaders,
            log=log,
            progress=progress,
        )
        c = result["clairvoyant"]
        s = result["dataset_bytes"]
        cfg = result["config"]
        bandwidth = cfg["bandwidth_mbps"] * 1e6
        bound0 = max(c[0]["compute_seconds"], s / bandwidth)
        cached = min(s, CLUSTER_NODES * cfg["node_memory_bytes"])
        minimum = s + (CLUSTER_EPOCHS - 1) * (s - cached)
        fs = sum(r["fs_bytes_read"] for r in c)
        fig = {
            "node_memory_fraction": fraction,
            "dataset_bytes": s,
            "config": cfg,
            "fs_bytes": {k: sum(r["fs_bytes_read"] for r in result[k]) for k in loaders},
            "fs_vs_dataset": {k: sum(r["fs_bytes_read"] for r in result[k]) / s for k in loaders},
            "fs_minimum_bytes": minimum,
            "fs_vs_minimum": fs / minimum,
            "utilization": {k: [r["accelerator_utilization"] for r in result[k]] for k in loaders},
            "epoch_seconds": {k: [r["epoch_seconds"] for r in result[k]] for k in loaders},
            "epoch0_bound_seconds": bound0,
            "epoch0_vs_bound": c[0]["epoch_seconds"] / bound0,
            "samples_by_source": [r["samples_by_source"] for r in c],
            "every_sample_once": all(r["every_sample_once"] for k in loaders for r in result[k]),
            "raw": result,
        }
        fig["predicted"] = _predict(result, fraction, log)
        figures[name] = fig
        log(
            f"cluster {name} ({fraction:.1%} per node): fs {fig['fs_vs_dataset']}, vs minimum {fig['fs_vs_minimum']:.3f}, "
            f"utilization {fig['utilization']['clairvoyant']}, epoch 0 / bound {fig['epoch0_vs_bound']:.2f}"
        )
    return figures


def _predict(result: dict, fraction: float, log) -> dict | None:
    """The simulator's prediction of this run (clairvoyant), from the run's own parameters and a
    measured decode rate: predicted against measured epoch times and file-system bytes."""
    try:
        from clairvoyant import simulator

        from . import validate
        from .emulation import list_imagefolder
    except ImportError as e:  # tomllib needs Python 3.11
        log(f"cluster prediction skipped: {e}")
        return None
    cfg = result["config"]
    paths, _, _ = list_imagefolder(cfg.get("root") or "")
    sizes = [os.path.getsize(p) for p in paths]
    beta = validate.measure_decode_mbps(paths)
    mean = sum(sizes) / len(sizes)
    b = cfg["batch_size"]
    predicted = simulator.predict_cluster(
        sizes=sizes,
        nodes=cfg["nodes"],
        ranks_per_node=cfg["ranks"] // cfg["nodes"],
        memory_per_node=cfg["node_memory_bytes"],
        epochs=cfg["epochs"],
        batch_size=b,
        seed=cfg["seed"],
        fs_bandwidth=cfg["bandwidth_mbps"] * 1e6,
        fs_latency=cfg["open_latency_ms"] / 1000,
        compute_per_batch=b * mean / cfg["compute_bytes_per_second_per_rank"],
        cores=os.cpu_count(),
        preprocess_mbps=beta,
        processes_per_rank=1 + cfg["num_workers_per_rank"],
    )
    measured = [r["epoch_seconds"] for r in result["clairvoyant"]]
    out = {
        "beta_mbps": beta,
        "epoch_seconds": predicted["epoch_seconds"],
        "measured_epoch_seconds": measured,
        "error": [p / m - 1 for p, m in zip(predicted["epoch_seconds"], measured)],
        "fs_bytes": predicted["fs_bytes"],
        "measured_fs_bytes": sum(r["fs_bytes_read"] for r in result["clairvoyant"]),
    }
    log(
        f"cluster at {fraction:.1%}: predicted epochs {[round(x, 2) for x in out['epoch_seconds']]} s against measured "
        f"{[round(x, 2) for x in measured]} s; file-system bytes predicted {out['fs_bytes']:,} measured {out['measured_fs_bytes']:,}"
    )
    return out


def _peerbench_binary() -> Path:
    root = Path(__file__).resolve().parents[1]
    return root / "target" / "release" / "examples" / "peerbench"


def bench_peer_transport(log) -> dict:
    """(c): the transport's own benchmark, built by ``./dev build``."""
    exe = _peerbench_binary()
    if not exe.exists():
        root = exe.parents[3]
        subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "clairvoyant-net", "--examples"], cwd=root, check=True)
    r = subprocess.run([str(exe), "--json"], capture_output=True, text=True, timeout=600, check=True)
    fig = json.loads(r.stdout)
    log(f"peer transport: {json.dumps(fig)}")
    return fig


# -- (d) a node killed mid-run ------------------------------------------------------------------
_RANK_SCRIPT = r"""
import json, sys, time
import clairvoyant
list_file, config, out, epochs, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
job = clairvoyant.Job(clairvoyant.FileList(list_file), batch_size=8, epochs=epochs, seed=4, config=config)
with open(out, "a") as log:
    for e in range(epochs):
        t = time.perf_counter()
        n = 0
        for views, _ in job.batches(e):
            n += len(views)
            time.sleep(step)
        s = job.stats()[e]
        log.write(json.dumps({"epoch": e, "samples": n, "seconds": time.perf_counter() - t, "stall": s["stall_seconds"],
                              "fallbacks": s["peer_fallbacks"], "misses": s["peer_misses"]}) + "\n")
        log.flush()
job.close()
"""


def _kill_run(work: Path, list_file: Path, total: int, kill: bool, nodes: int, epochs: int, step: float) -> list:
    config = work / "system.toml"
    config.write_text(
        f'[staging]\ncapacity = "256 KiB"\nthreads = 2\n[[class]]\nname = "memory"\nkind = "memory"\n'
        f"capacity = {int(total * 0.4)}\nthreads = 1\n"
    )
    script = work / "rank.py"
    script.write_text(_RANK_SCRIPT)
    tag = f"{'kill' if kill else 'base'}-{os.getpid()}-{time.monotonic_ns()}"
    shared = work / f"shared-{tag}"
    shared.mkdir(mode=0o700)
    procs, outs = [], []
    for i in range(nodes):
        shm = work / f"shm-{tag}-{i}"
        shm.mkdir(mode=0o700)
        out = work / f"{tag}-rank{i}.jsonl"
        env = {
            **os.environ,
            "RANK": str(i),
            "WORLD_SIZE": str(nodes),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            **node_env(i, shm, shared, tag),
        }
        argv = [sys.executable, str(script), str(list_file), str(config), str(out), str(epochs), str(step)]
        procs.append(subprocess.Popen(argv, env=env))
        outs.append(out)

    def lines(p):
        try:
            return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        except FileNotFoundError:
            return []

    victim = 1
    try:
        if kill:
            deadline = time.monotonic() + 300
            # Epoch 2 has begun once epoch 1 is logged; kill a little into it.
            while len(lines(outs[victim])) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.3)
            procs[victim].send_signal(signal.SIGKILL)
        for i, p in enumerate(procs):
            if kill and i == victim:
                p.wait()
                continue
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"rank {i} failed in the kill benchmark")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [lines(o) for o in outs]


def bench_kill(out: Path, log, files: int = 3000, nodes: int = 4, epochs: int = 4) -> dict:
    """(d): the same run with and without a SIGKILL of node 1 early in epoch 2."""
    import numpy as np

    work = (out / "bench" / "cluster-kill").resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    list_file = work / "list.txt"
    if not list_file.exists():
        data.mkdir(exist_ok=True)
        rng = np.random.default_rng(0)
        with open(list_file, "w") as f:
            for k in range(files):
                p = data / f"{k:05d}.bin"
                p.write_bytes(rng.integers(0, 256, size=int(rng.integers(20_000, 60_000)), dtype=np.uint8).tobytes())
                f.write(f"{p}\t{k % 10}\n")
    total = sum(os.path.getsize(line.split("\t")[0]) for line in list_file.read_text().splitlines())
    step = 0.01
    base = _kill_run(work, list_file, total, False, nodes, epochs, step)
    killed = _kill_run(work, list_file, total, True, nodes, epochs, step)
    survivors = [i for i in range(nodes) if i != 1]
    extra = []
    for i in survivors:
        after = sum(x["stall"] for x in killed[i][2:])
        before = sum(x["stall"] for x in base[i][2:])
        extra.append(after - before)
    fig = {
        "nodes": nodes,
        "epochs": epochs,
        "files": files,
        "survivors_completed": all(len(killed[i]) == epochs for i in survivors),
        "extra_stall_seconds": extra,
        "max_extra_stall_seconds": max(extra),
        "fallbacks": [sum(x["fallbacks"] + x["misses"] for x in killed[i]) for i in survivors],
        "epoch_seconds_killed": [[round(x["seconds"], 3) for x in killed[i]] for i in survivors],
        "epoch_seconds_base": [[round(x["seconds"], 3) for x in base[i]] for i in survivors],
    }
    log(f"kill -9 of a node in epoch 2: survivors' extra stall {[round(x, 3) for x in extra]} s, completed {fig['survivors_completed']}")
    return fig


# -- (e) set-up time -----------------------------------------------------------------------------
def _setup_rank(ctx, list_file: str) -> dict:
    import clairvoyant

    ctx.sync()
    t = time.perf_counter()
    job = clairvoyant.Job(clairvoyant.FileList(list_file), batch_size=32, epochs=4, seed=1)
    seconds = time.perf_counter() - t
    nodes = job.peer_stats()["nodes"] if job.peer_stats() else None
    ctx.sync()
    job.close()
    return {"seconds": seconds, "nodes": nodes}


def bench_setup(out: Path, log, files: int = 100_000) -> dict:
    """(e): Job() on 8 ranks of 4 nodes over ``files`` files (each node indexes them)."""
    from .emulation import run_ranks

    work = (out / "bench" / "cluster-setup").resolve()
    list_file = work / "list.txt"
    data = work / "data"
    if not list_file.exists() or len(list_file.read_text().splitlines()) != files:
        data.mkdir(parents=True, exist_ok=True)
        with open(list_file, "w") as f:
            for k in range(files):
                d = data / f"{k // 1000:03d}"
                if k % 1000 == 0:
                    d.mkdir(exist_ok=True)
                p = d / f"{k:06d}.bin"
                if not p.exists():
                    p.write_bytes(k.to_bytes(4, "little") * 64)
                f.write(f"{p}\t{k % 100}\n")
    cache = work / "index-cache"
    runs = []
    for fresh in (True, False):
        if fresh:
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
        per = run_ranks(
            _setup_rank,
            8,
            args=(str(list_file),),
            nodes=4,
            env={"CLAIRVOYANT_CACHE_DIR": str(cache), "CLAIRVOYANT_EPOCHS": "4"},
            timeout=600,
        )
        runs.append({"index": "built" if fresh else "reused", "max_seconds": max(r["seconds"] for r in per)})
    log(f"set-up of 8 ranks on 4 nodes, {files:,} files: {runs}")
    return {"files": files, "ranks": 8, "nodes": 4, "runs": runs, "seconds": runs[0]["max_seconds"]}


def bench_cluster(out: Path, log, progress: str = "stdout") -> dict:
    return {
        "training": bench_cluster_training(out, log, progress),
        "peer_transport": bench_peer_transport(log),
        "kill": bench_kill(out, log),
        "setup": bench_setup(out, log),
    }


def markdown(cluster: dict) -> str:
    """The cluster figures as the tables of docs/benchmarks.md."""
    lines = []
    for name in ("large", "small"):
        f = cluster["training"][name]
        cfg = f["config"]
        lines.append(
            f"**{cfg['nodes']} nodes x {cfg['ranks'] // cfg['nodes']} ranks, memory {f['node_memory_fraction']:.1%} of the dataset "
            f"per node** ({f['dataset_bytes'] / 1e6:.1f} MB, {cfg['epochs']} epochs, compute ratio {cfg['compute_ratio']}):"
        )
        lines.append("")
        lines.append("| loader | epoch s | utilization | fs bytes / dataset |")
        lines.append("|---|---|---|---|")
        for loader, secs in f["epoch_seconds"].items():
            util = ", ".join(f"{u:.3f}" for u in f["utilization"][loader])
            lines.append(f"| {loader} | {', '.join(f'{s:.2f}' for s in secs)} | {util} | {f['fs_vs_dataset'][loader]:.3f} |")
        lines.append("")
        lines.append(
            f"Epoch 0 / max(compute, dataset / bandwidth): {f['epoch0_vs_bound']:.3f}; file-system bytes / "
            f"(S + (E-1)(S-C)): {f['fs_vs_minimum']:.3f}."
        )
        p = f.get("predicted")
        if p:
            err = ", ".join(f"{e:+.1%}" for e in p["error"])
            lines.append(
                f"Simulator (measured decode rate {p['beta_mbps']:.1f} MB/s): epochs "
                f"{', '.join(f'{x:.2f}' for x in p['epoch_seconds'])} s predicted (error {err}); file-system bytes "
                f"{p['fs_bytes']:,} predicted, {p['measured_fs_bytes']:,} measured."
            )
        lines.append("")
    peer = cluster["peer_transport"]
    lines.append(
        f"Peer transport (`peerbench`): {peer['peer_gbps']:.2f} GB/s aggregate, plain socket copy {peer['plain_socket_gbps']:.2f} "
        f"GB/s (ratio {peer['peer_over_plain']:.2f}); server CPU {peer['server_cpu_us_per_sample']:.0f} µs per 100 KB sample."
    )
    k = cluster["kill"]
    lines.append(
        f"Node killed in epoch 2 ({k['nodes']} nodes x 1 rank, {k['epochs']} epochs): survivors completed "
        f"{k['survivors_completed']}, extra stall {', '.join(f'{x:.2f}' for x in k['extra_stall_seconds'])} s, "
        f"samples read around the dead node {k['fallbacks']}."
    )
    s = cluster["setup"]
    lines.append(
        f"Set-up of {s['ranks']} ranks on {s['nodes']} nodes over {s['files']:,} files: "
        + ", ".join(f"{r['max_seconds']:.2f} s (index {r['index']})" for r in s["runs"])
        + "."
    )
    return "\n".join(lines)
