"""The simulator against the training benchmark: predict the benchmark's epoch times from its
configuration and compare them with what was measured.

The mapping (nothing is fitted to the measured times):
- the emulated file system is the PFS: t(γ) = its shared bandwidth for any γ, and its per-read
  latency as measured (single reads, minus the transfer time), as `clairvoyant probe` would
  measure a real file system;
- the accelerator is c = the benchmark's bytes per second per rank;
- β is measured here, on this machine, on the benchmark's own JPEGs in one process: for
  clairvoyant decode + transform (what its decode workers do), for PyTorch its DataLoader
  pipeline over a file system without latency or bandwidth limit (decode, transform, Python
  per-sample work, collation);
- PyTorch's DataLoader with one worker process per rank and ``prefetch_factor`` 2 is the
  StagingBuffer policy with one thread that reads and decodes each sample, and room for the
  batch in use plus two prefetched ones;
- clairvoyant (two ranks sharing one node cache) is the Clairvoyant policy with
  ``workers_per_node`` 2 and the engine's configuration (staging buffer, threads, memory
  class); its decode runs in one worker process per rank beside the staging threads, so β is
  spread over the staging threads (β / threads each);
- the emulated file system serves transfers on one timeline, latencies overlapping other
  readers' transfers: ``pfs_sharing = "fifo"`` (each transfer at the full bandwidth, queued
  behind the bytes admitted before it), as its implementation does;
- CPU contention: the benchmark's ranks and their processes share this machine's cores
  (``os.cpu_count()``): each rank runs its training process and ``num_workers`` decode processes,
  so ``[cpu]`` says ``processes_per_worker = 1 + num_workers`` on ``cores`` cores, all ranks on one
  machine. When more processes than cores compete, preprocessing runs at cores/processes of the
  measured β (every process counted busy: a bound, not a fit).
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Optional

DECODE_SAMPLE = 400  # JPEGs decoded to measure β


def measure_decode_mbps(paths: list, seed: int = 0) -> float:
    """β: MB/s of reading + decoding + transforming the benchmark's JPEGs in one process
    (files read from the page cache; the transform of the benchmark)."""
    from . import demo
    from clairvoyant.torch import pil_loader

    transform = demo._transform()
    pick = random.Random(seed).sample(list(paths), min(DECODE_SAMPLE, len(paths)))
    blobs = [Path(p).read_bytes() for p in pick]
    for b in blobs[:20]:  # warm up imports and caches
        transform(pil_loader(b))
    t = time.perf_counter()
    for b in blobs:
        transform(pil_loader(b))
    return sum(len(b) for b in blobs) / (time.perf_counter() - t) / 1e6


def measure_open_latency_ms(paths: list, cfg: dict, state: Path, seed: int = 0) -> float:
    """The emulated file system's effective per-read latency, measured as a user would measure
    their storage: mean time of single reads minus the transfer time at its bandwidth (sleeps
    overshoot on a busy or virtual machine, so this exceeds the nominal latency)."""
    import clairvoyant

    fs = clairvoyant.EmulatedFs(str(state), open_latency_ms=cfg["open_latency_ms"], bandwidth_mbps=cfg["bandwidth_mbps"])
    pick = random.Random(seed).sample(list(paths), min(200, len(paths)))
    t = time.perf_counter()
    n = sum(len(fs.read(p)) for p in pick)
    took = time.perf_counter() - t
    return max(0.0, (took - n / (cfg["bandwidth_mbps"] * 1e6)) / len(pick) * 1e3)


def measure_pytorch_mbps(paths: list, labels: list, state: Path, batch_size: int, seed: int = 0) -> float:
    """β of PyTorch's pipeline: MB/s of its DataLoader in one process over the benchmark's
    dataset class with a file system of no latency and unbounded bandwidth: decode, transform,
    per-sample Python work and collation, no waiting for I/O."""
    from torch.utils.data import DataLoader, Subset

    from . import demo

    pick = random.Random(seed).sample(range(len(paths)), min(DECODE_SAMPLE, len(paths)))
    dataset = demo.FsImageFolder(paths, labels, (str(state), 0.0, 1e9), demo._transform())
    loader = DataLoader(Subset(dataset, pick), batch_size=batch_size, num_workers=0)
    for i, _ in enumerate(loader):  # warm up: imports, the file system state, page cache
        if i == 1:
            break
    t = time.perf_counter()
    for _ in loader:
        pass
    return sum(Path(paths[k]).stat().st_size for k in pick) / (time.perf_counter() - t) / 1e6


def _scenario(name: str, cfg: dict, sizes: list, beta: float, system: dict, workers_per_node: int, latency_ms: float) -> dict:
    """The simulator scenario of one loader of the training benchmark (the sizes go separately)."""
    nodes = cfg["ranks"] // workers_per_node
    return {
        "name": name,
        "workers": cfg["ranks"],
        "workers_per_node": workers_per_node,
        "epochs": cfg["epochs"],
        "batch_size": cfg["batch_size"],
        "seed": cfg["seed"],
        "pfs_sharing": "fifo",
        "cpu": {"cores": os.cpu_count() or 1, "nodes_per_machine": nodes, "processes_per_worker": 1 + cfg["num_workers_per_rank"]},
        "dataset": {"samples": len(sizes), "mean": 1},
        "system": {
            "compute_mbps": cfg["compute_bytes_per_second_per_rank"] / 1e6,
            "preprocess_mbps": beta,
            **system,
            "pfs": {"read_mbps": float(cfg["bandwidth_mbps"]), "open_latency_ms": latency_ms},
        },
    }


def predict(training: dict, data_dir: Path, out_dir: Path, log=print) -> dict:
    """Simulated and measured epoch times of both loaders of a training benchmark result."""
    from clairvoyant import config, simulator
    from clairvoyant.sources import ImageFolder

    cfg = training["config"]
    src = ImageFolder(data_dir)
    sizes = [src.size(k) for k in range(len(src))]
    paths = src.paths
    log("validation: measuring preprocessing throughput (beta) of both pipelines on the benchmark's JPEGs ...")
    beta = measure_decode_mbps(paths)
    beta_pytorch = measure_pytorch_mbps(paths, list(src.labels), out_dir / "validate-fs.state", cfg["batch_size"])
    latency_ms = measure_open_latency_ms(paths, cfg, out_dir / "validate-latency.state")
    mean = sum(sizes) / len(sizes)
    batch_bytes = mean * cfg["batch_size"]
    workers = cfg["num_workers_per_rank"]
    engine = config.resolve(None)
    threads = engine.staging_threads
    memory = engine.memory_class()

    pytorch_system = {
        "class": [],
        "staging": {"capacity": int(batch_bytes * (1 + 2 * workers)), "threads": workers, "write_mbps": 100000.0},
    }
    clairvoyant_system = {
        "staging": {
            "capacity": simulator.size_value(engine.staging_capacity),
            "threads": threads,
            "write_mbps": simulator.curve_value(engine.staging_write_mbps),
        },
    }
    if memory is not None:
        clairvoyant_system["class"] = [
            {
                "name": "memory",
                "kind": "memory",
                "capacity": simulator.size_value(memory.capacity),
                "threads": memory.threads,
                "read_mbps": simulator.curve_value(memory.read_mbps),
                "write_mbps": simulator.curve_value(memory.write_mbps),
            }
        ]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for loader, policy, system, wpn, b in (
        ("pytorch", "staging-buffer", pytorch_system, 1, beta_pytorch),
        ("clairvoyant", "clairvoyant", clairvoyant_system, cfg["ranks"], beta * workers / threads),
    ):
        scenario = _scenario(f"bench-{loader}", cfg, sizes, b, system, wpn, latency_ms)
        path = out_dir / f"validate-{loader}.toml"
        path.write_text(simulator.scenario_toml(scenario))  # kept with the results, to rerun
        r = simulator.simulate(scenario, [policy], sizes=sizes, progress=False)
        predicted = r.data["policies"][policy]["epoch_seconds"]
        measured = training["epoch_seconds"][loader]
        rows[loader] = {
            "policy": policy,
            "scenario_file": str(path),
            "predicted": predicted,
            "measured": measured,
            "error": [p / m - 1 for p, m in zip(predicted, measured)],
        }
    return {
        "beta_mbps": beta,
        "beta_pytorch_mbps": beta_pytorch,
        "open_latency_ms": latency_ms,
        "cores": os.cpu_count() or 1,
        "mean_sample_bytes": mean,
        "loaders": rows,
    }


def markdown(v: dict) -> str:
    from . import report

    rows = []
    for loader, r in v["loaders"].items():
        for e, (p, m, err) in enumerate(zip(r["predicted"], r["measured"], r["error"])):
            rows.append([f"{loader} (simulated as {r['policy']})", e, m, p, f"{err:+.1%}"])
    worst: Optional[float] = max((abs(e) for r in v["loaders"].values() for e in r["error"]), default=None)
    return "\n".join(
        [
            f"Simulator against the measured run. β measured on this machine in one process: decode + transform "
            f"{v['beta_mbps']:.1f} MB/s (clairvoyant's decode workers), PyTorch's DataLoader pipeline without I/O "
            f"{v['beta_pytorch_mbps']:.1f} MB/s; file system latency per read {v['open_latency_ms']:.2f} ms (measured; "
            f"nominal 2 ms); mean sample {v['mean_sample_bytes'] / 1e3:.1f} kB; CPU contention on "
            f"{v.get('cores', '?')} cores. "
            f"Largest error {worst:.1%} (target 15%).",
            "",
            report.markdown_table(["loader", "epoch", "measured s", "simulated s", "error"], rows),
        ]
    )
