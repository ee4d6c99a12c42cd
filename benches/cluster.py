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
- (f) ``fuse``: 4 nodes x 2 ranks, each node's memory class 30 % of the dataset, the Job API on
  the FUSE emulation of a shared file system (t(γ), 2 ms opens, no page cache), 3 epochs with a
  training step and a barrier per step: epoch 0 against max(compute, dataset / t(γ)) and against
  a plain reader pool in the order NoPFS reads (4 threads per rank, two batches ahead), epochs
  >= 1 against the no-I/O floor (their compute), and where the samples came from (a sample
  another node holds comes from that node, not from the file system again).

``python -m benches --only cluster --cluster-parts fuse`` runs one part (comma-separated:
training, peer, kill, setup, fuse).
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
from .emulation import node_env, shm_folder

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
    with shm_folder(f"cv-{tag}-") as shm_root:  # the nodes' node-shared memory, removed at the end
        procs, outs = [], []
        for i in range(nodes):
            shm = shm_root / f"node{i}"
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


# -- (f) on the FUSE emulation --------------------------------------------------------------------
FUSE_FILES = 8000
FUSE_EPOCHS = 3
FUSE_NODE_MEMORY = 0.30
# Accelerators in all / the file system's peak t(γ): compute per epoch is half of reading the
# dataset once, so epoch 0 is bound by the file system and epochs >= 1 by compute.
FUSE_COMPUTE_RATIO = 2.0


def _fs_counters(mnt: str) -> dict:
    """The FUSE emulation's counters: uptime, bytes read, seconds spent in opens and transfers."""
    with open(os.path.join(mnt, ".fsemu-stats"), "rb") as f:
        s = json.loads(f.read())
    return {k: s[k] for k in ("uptime_s", "bytes", "open_seconds", "transfer_seconds")}


def _in_flight(a: dict, b: dict) -> float:
    """Mean opens and transfers in progress on the file system between two counter readings."""
    return ((b["open_seconds"] - a["open_seconds"]) + (b["transfer_seconds"] - a["transfer_seconds"])) / max(
        1e-9, b["uptime_s"] - a["uptime_s"]
    )


def _fuse_rank(ctx, mnt: str, rel: list, labels: list, compute_bps: float, epochs: int, batch: int) -> dict:
    """One rank of the Job API on the FUSE mount: every epoch in steps of ``batch`` samples, a
    training step (slept) and a barrier per step. Each epoch's time ends at its last step; epoch
    0's starts before the job is created (its prefetchers start with it), a later one at a
    barrier after rank 0 has read the file system's byte counter for the one before."""
    import clairvoyant

    from .emulation import EmulatedAccelerator

    source = clairvoyant.FileList([os.path.join(mnt, r) for r in rel], labels)
    accel = EmulatedAccelerator(compute_bps)
    # Rank 0 reads the file system's counters outside the epochs' times (before the clock starts
    # and between epochs, all ranks waiting for it at a barrier), as the plain pool's run does.
    fs = [_fs_counters(mnt) if ctx.rank == 0 else None]
    ctx.sync()
    starts, ends, computes = [time.perf_counter()], [], []
    waits: list = []  # per epoch: seconds waiting for a batch, seconds in the barrier
    cpu = [time.process_time()]  # this process's CPU time, all its threads (the peer server's too)
    job = clairvoyant.Job(source, batch_size=batch, epochs=epochs)
    setup = time.perf_counter() - starts[0]
    for e in range(epochs):
        if e:
            ctx.sync()
            starts.append(time.perf_counter())
        before, data, sync = accel.compute_seconds, 0.0, 0.0
        t = time.perf_counter()
        for samples, _labels in job.batches(e):
            data += time.perf_counter() - t
            accel.step(sum(len(x) for x in samples))
            t = time.perf_counter()
            ctx.sync()
            sync += time.perf_counter() - t
            t = time.perf_counter()
        ends.append(time.perf_counter())
        computes.append(accel.compute_seconds - before)
        waits.append((data, sync))
        cpu.append(time.process_time())
        fs.append(_fs_counters(mnt) if ctx.rank == 0 else None)
    stats, peers = job.stats(), job.peer_stats()
    job.close()
    return {
        "epoch_seconds": [b - a for a, b in zip(starts, ends)],
        "compute_seconds": computes,
        "data_seconds": [d for d, _ in waits],
        "barrier_seconds": [b for _, b in waits],
        "setup_seconds": setup,
        "cpu_seconds": [b - a for a, b in zip(cpu, cpu[1:])],
        "fs_bytes": [b["bytes"] - a["bytes"] for a, b in zip(fs, fs[1:])] if ctx.rank == 0 else None,
        "reads_in_flight": [_in_flight(a, b) for a, b in zip(fs, fs[1:])] if ctx.rank == 0 else None,
        "stats": stats,
        "peer_stats": peers,
    }


def _fuse_pool_rank(ctx, mnt: str, rel: list, labels: list, compute_bps: float, epochs: int, batch: int) -> dict:
    """Epoch 0 of one rank with the plain reader pool of the single-node FUSE benchmark."""
    from .bench import _epoch0_rank

    return _epoch0_rank(ctx, "threadpool", mnt, rel, labels, compute_bps, epochs)


def _floor_rank(ctx, data: str, rel: list, labels: list, compute_bps: float, epochs: int, batch: int) -> dict:
    """The no-I/O floor: the same loop (a training step and a barrier per step, the same batches
    in the same order) with no data to load; each epoch's time."""
    import clairvoyant

    from .emulation import EmulatedAccelerator

    sizes = [os.path.getsize(os.path.join(data, r)) for r in rel]
    streams = clairvoyant.access_stream(len(rel), ctx.world_size, ctx.rank, epochs, batch, 0)
    accel = EmulatedAccelerator(compute_bps)
    ctx.sync()
    marks = [time.perf_counter()]
    for e in range(epochs):
        order = streams[e]
        for b in range(0, len(order), batch):
            accel.step(sum(sizes[int(i)] for i in order[b : b + batch]))
            ctx.sync()
        marks.append(time.perf_counter())
    return {"epoch_seconds": [b - a for a, b in zip(marks, marks[1:])]}


def _fuse_summary(per_rank: list, total: int) -> dict:
    """One run's figures: per epoch the slowest rank's time and compute, the file system's bytes,
    and the samples by source, stalls and peer misses over all ranks."""
    epochs = len(per_rank[0]["epoch_seconds"])
    sources: list = []
    for e in range(epochs):
        by: dict = {}
        for r in per_rank:
            for name, x in r["stats"][e]["sources"].items():
                by[name] = by.get(name, 0) + x["samples"]
        sources.append(by)
    seconds = [max(r["epoch_seconds"][e] for r in per_rank) for e in range(epochs)]
    compute = [max(r["compute_seconds"][e] for r in per_rank) for e in range(epochs)]
    return {
        "epoch_seconds": seconds,
        "compute_seconds": compute,
        "floor_over_epoch": [c / s for c, s in zip(compute, seconds)],
        "fs_vs_dataset": [b / total for b in per_rank[0]["fs_bytes"]],
        "reads_in_flight": per_rank[0]["reads_in_flight"],
        "setup_seconds": max(r["setup_seconds"] for r in per_rank),
        # CPU seconds of all rank processes together, per epoch (the machine's cores x the epoch bound it).
        "cpu_seconds": [sum(r["cpu_seconds"][e] for r in per_rank) for e in range(epochs)],
        "samples_by_source": sources,
        "stall_seconds": [sum(r["stats"][e]["stall_seconds"] for r in per_rank) for e in range(epochs)],
        # Per epoch and rank: (waiting for data, stepping, in barriers, the epoch).
        "per_rank": [
            [(r["data_seconds"][e], r["compute_seconds"][e], r["barrier_seconds"][e], r["epoch_seconds"][e]) for r in per_rank]
            for e in range(epochs)
        ],
        # Per epoch, the most any rank spent waiting for its batches / in the per-step barrier.
        "data_seconds": [max(r["data_seconds"][e] for r in per_rank) for e in range(epochs)],
        "barrier_seconds": [max(r["barrier_seconds"][e] for r in per_rank) for e in range(epochs)],
        "peer_misses": [sum(r["stats"][e]["peer_misses"] + r["stats"][e]["peer_fallbacks"] for r in per_rank) for e in range(epochs)],
        "peer_stats": [r["peer_stats"] for r in per_rank],
    }


def _with_pythonpath(path: str | None, fn):
    """``fn()`` with ``path`` first on PYTHONPATH, so that the rank processes it spawns import
    the ``clairvoyant`` package found there (another build, for a comparison in the same run)."""
    if path is None:
        return fn()
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(Path(path).resolve()) + ("" if before is None else os.pathsep + before)
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def bench_cluster_fuse(out: Path, log, files: int = FUSE_FILES, repeats: int = 2, baseline: str | None = None) -> dict:
    """(f): clairvoyant, the plain pool and the loop without data, alternated ``repeats`` times on
    one FUSE mount; every ratio is between runs of this invocation (best epoch 0 of each; epochs
    >= 1 of every run). ``baseline``: a directory holding another build of the ``clairvoyant``
    package, run the same way beside this one ("baseline" in the figures)."""
    from . import emulation as _emulation
    from .bench import FUSE_BATCH, make_fuse_dataset

    reason = _emulation.fuse_unavailable()
    if reason is not None:
        log(f"cluster on FUSE: skipped: {reason}")
        return {"skipped": reason}
    rel, labels, total = make_fuse_dataset(out / "bench" / "fuse-data", files)
    table = _emulation.FSEMU_DEFAULT_BANDWIDTH
    peak = max(y for _, y in table) * 1e6
    ranks = CLUSTER_NODES * CLUSTER_RANKS_PER_NODE
    compute_bps = FUSE_COMPUTE_RATIO * peak / ranks
    cache = (out / "bench" / "fuse-cache").resolve()
    cache.mkdir(parents=True, exist_ok=True)
    env = {"CLAIRVOYANT_CONFIG": "", "CLAIRVOYANT_CACHE_DIR": str(cache), "CLAIRVOYANT_MEMORY": str(int(FUSE_NODE_MEMORY * total))}
    mnt = out / "bench" / "fuse-mnt"
    runs: dict = {"clairvoyant": [], "pool": [], "floor": [], "baseline": []}
    args = (rel, labels, compute_bps, FUSE_EPOCHS, FUSE_BATCH)
    with _emulation.FuseMount(out / "bench" / "fuse-data", mnt, _emulation.FSEMU_DEFAULT_LATENCY_MS, table):
        m = str(mnt.resolve())
        for _ in range(repeats):
            per = _emulation.run_ranks(_floor_rank, ranks, args=(str((out / "bench" / "fuse-data").resolve()), *args), timeout=600)
            runs["floor"].append({"epoch_seconds": [max(r["epoch_seconds"][e] for r in per) for e in range(FUSE_EPOCHS)]})
            if baseline is not None:
                per = _with_pythonpath(
                    baseline, lambda: _emulation.run_ranks(_fuse_rank, ranks, args=(m, *args), env=env, timeout=600, nodes=CLUSTER_NODES)
                )
                runs["baseline"].append(_fuse_summary(per, total))
                b = runs["baseline"][-1]
                log(
                    f"cluster on FUSE: baseline epochs {[round(x, 2) for x in b['epoch_seconds']]} s, reads in flight "
                    f"{[round(x, 1) for x in b['reads_in_flight']]}, waits for data {[round(x, 2) for x in b['data_seconds']]} s, CPU s of the ranks "
                    f"{[round(x, 2) for x in b['cpu_seconds']]}"
                )
            per = _emulation.run_ranks(_fuse_rank, ranks, args=(m, *args), env=env, timeout=600, nodes=CLUSTER_NODES)
            runs["clairvoyant"].append(_fuse_summary(per, total))
            per = _emulation.run_ranks(_fuse_pool_rank, ranks, args=(m, *args), env=env, timeout=600, nodes=CLUSTER_NODES)
            runs["pool"].append(
                {"epoch_seconds": [max(r["seconds"] for r in per)], "compute_seconds": [max(r["compute_seconds"] for r in per)]}
            )
            c, p = runs["clairvoyant"][-1], runs["pool"][-1]
            log(
                f"cluster on FUSE: clairvoyant epochs {[round(x, 2) for x in c['epoch_seconds']]} s (floor / epoch "
                f"{[round(x, 3) for x in c['floor_over_epoch']]}), fs {[round(x, 3) for x in c['fs_vs_dataset']]}x, "
                f"sources {c['samples_by_source']}, waits for data {[round(x, 2) for x in c['data_seconds']]} s, "
                f"in barriers {[round(x, 2) for x in c['barrier_seconds']]} s, set-up {c['setup_seconds']:.2f} s, reads in flight "
                f"{[round(x, 1) for x in c['reads_in_flight']]}, CPU s of the ranks {[round(x, 2) for x in c['cpu_seconds']]}; pool epoch 0 {p['epoch_seconds'][0]:.2f} s; no-I/O loop "
                f"{[round(x, 2) for x in runs['floor'][-1]['epoch_seconds']]} s"
            )
    c0 = min(r["epoch_seconds"][0] for r in runs["clairvoyant"])
    p0 = min(r["epoch_seconds"][0] for r in runs["pool"])
    bound = max(max(r["compute_seconds"][0] for r in runs["clairvoyant"]), total / peak)
    later = [x for r in runs["clairvoyant"] for x in r["floor_over_epoch"][1:]]
    if runs["baseline"]:
        b0 = min(r["epoch_seconds"][0] for r in runs["baseline"])
        b_later = [x for r in runs["baseline"] for x in r["epoch_seconds"][1:]]
        c_later = [x for r in runs["clairvoyant"] for x in r["epoch_seconds"][1:]]
        log(
            f"cluster on FUSE: against the baseline build: epoch 0 {c0 / b0:.3f}x (best of each), epochs >= 1 "
            f"{sum(c_later) / sum(b_later):.3f}x (sum of all)"
        )
    # The same loop with no data, run beside them: what barriers and stepping cost on this machine.
    loop = [f / c for r, fl in zip(runs["clairvoyant"], runs["floor"]) for c, f in zip(r["epoch_seconds"][1:], fl["epoch_seconds"][1:])]
    return {
        "files": files,
        "dataset_bytes": total,
        "nodes": CLUSTER_NODES,
        "ranks": ranks,
        "node_memory_fraction": FUSE_NODE_MEMORY,
        "batch_size": FUSE_BATCH,
        "compute_mbps_per_rank": compute_bps / 1e6,
        "bound_seconds": bound,
        "runs": runs,
        "epoch0_vs_bound": c0 / bound,
        "epoch0_vs_pool": c0 / p0,
        "floor_over_epoch_ge1_min": min(later),
        "floor_over_epoch_ge1_mean": sum(later) / len(later),
        "loop_over_epoch_ge1_min": min(loop),
        "loop_over_epoch_ge1_mean": sum(loop) / len(loop),
        "fs_vs_dataset": max(sum(r["fs_vs_dataset"]) for r in runs["clairvoyant"]),
        "baseline": baseline,
    }


CLUSTER_PARTS = ("training", "peer", "kill", "setup", "fuse")


def bench_cluster(out: Path, log, progress: str = "stdout", parts: tuple = CLUSTER_PARTS, baseline: str | None = None) -> dict:
    """The parts of the cluster benchmark named in ``parts``; the others are None. ``baseline``:
    see :func:`bench_cluster_fuse`."""
    return {
        "training": bench_cluster_training(out, log, progress) if "training" in parts else None,
        "peer_transport": bench_peer_transport(log) if "peer" in parts else None,
        "kill": bench_kill(out, log) if "kill" in parts else None,
        "setup": bench_setup(out, log) if "setup" in parts else None,
        "fuse": bench_cluster_fuse(out, log, baseline=baseline) if "fuse" in parts else None,
    }


def markdown(cluster: dict) -> str:
    """The cluster figures as the tables of docs/benchmarks.md."""
    lines = []
    for name in ("large", "small") if cluster.get("training") else ():
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
    peer = cluster.get("peer_transport")
    if peer:
        lines.append(
            f"Peer transport (`peerbench`): {peer['peer_gbps']:.2f} GB/s aggregate, plain socket copy {peer['plain_socket_gbps']:.2f} "
            f"GB/s (ratio {peer['peer_over_plain']:.2f}); server CPU {peer['server_cpu_us_per_sample']:.0f} µs per 100 KB sample."
        )
    k = cluster.get("kill")
    if k:
        lines.append(
            f"Node killed in epoch 2 ({k['nodes']} nodes x 1 rank, {k['epochs']} epochs): survivors completed "
            f"{k['survivors_completed']}, extra stall {', '.join(f'{x:.2f}' for x in k['extra_stall_seconds'])} s, "
            f"samples read around the dead node {k['fallbacks']}."
        )
    s = cluster.get("setup")
    if s:
        lines.append(
            f"Set-up of {s['ranks']} ranks on {s['nodes']} nodes over {s['files']:,} files: "
            + ", ".join(f"{r['max_seconds']:.2f} s (index {r['index']})" for r in s["runs"])
            + "."
        )
    if cluster.get("fuse"):
        lines += fuse_markdown(cluster["fuse"])
    return "\n".join(lines)


def fuse_markdown(f: dict) -> list:
    """Part (f) as a table per run and its ratios."""
    if "skipped" in f:
        return [f"Cluster on FUSE: skipped ({f['skipped']})."]
    lines = [
        "",
        f"**{f['nodes']} nodes x {f['ranks'] // f['nodes']} ranks on the FUSE emulation**, memory {f['node_memory_fraction']:.0%} "
        f"of the dataset per node ({f['files']:,} files, {f['dataset_bytes'] / 1e6:.0f} MB), accelerator "
        f"{f['compute_mbps_per_rank']:.0f} MB/s per rank, bound of epoch 0 {f['bound_seconds']:.2f} s:",
        "",
        "| run | clairvoyant epoch s | compute / epoch (>= 1) | same loop without data, s | fs bytes / dataset per epoch | samples: staging/memory/pfs/peer (epochs >= 1) | pool epoch 0 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (c, p, fl) in enumerate(zip(f["runs"]["clairvoyant"], f["runs"]["pool"], f["runs"]["floor"])):
        later = [sum(by.get(k, 0) for by in c["samples_by_source"][1:]) for k in ("staging", "memory", "pfs", "peer")]
        lines.append(
            f"| {i + 1} | {', '.join(f'{x:.2f}' for x in c['epoch_seconds'])} | {', '.join(f'{x:.3f}' for x in c['floor_over_epoch'][1:])} "
            f"| {', '.join(f'{x:.2f}' for x in fl['epoch_seconds'])} "
            f"| {', '.join(f'{x:.3f}' for x in c['fs_vs_dataset'])} | {'/'.join(map(str, later))} | {p['epoch_seconds'][0]:.2f} |"
        )
    lines += [
        "",
        f"Epoch 0 / bound {f['epoch0_vs_bound']:.3f}, / plain pool {f['epoch0_vs_pool']:.3f} (best of each); no-I/O floor / "
        f"epoch, epochs >= 1: min {f['floor_over_epoch_ge1_min']:.3f}, mean {f['floor_over_epoch_ge1_mean']:.3f} (the same loop "
        f"without data, run beside it / epoch: min {f['loop_over_epoch_ge1_min']:.3f}, mean {f['loop_over_epoch_ge1_mean']:.3f}); file-system "
        f"bytes over the run {f['fs_vs_dataset']:.3f}x the dataset.",
    ]
    return lines
