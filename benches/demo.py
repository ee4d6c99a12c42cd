"""Demo: PyTorch's DataLoader and clairvoyant side by side on an emulated shared file system.

``python -m benches.demo`` (or ``./dev demo``) generates a small ImageFolder of real JPEGs
under ``out/demo/data`` (reused when present), emulates a shared file system with a per-open
latency and an aggregate bandwidth shared by all ranks, and trains with an emulated accelerator
on 2 rank processes for 3 epochs, twice:

- PyTorch: a torchvision-style ImageFolder whose loader reads the file bytes through the
  emulated file system, a DistributedSampler and ``torch.utils.data.DataLoader``.
- clairvoyant: the same dataset, the same DistributedSampler and ``clairvoyant.torch.DataLoader``
  (the one-line change); the dataset tells clairvoyant its files through the emulated file
  system (``__clairvoyant_source__``) and how to make an item from bytes.

Both decode with PIL and apply the same transforms with one worker per rank (the same CPU
budget). The accelerator's aggregate speed is ``--compute-ratio`` times the file
system's bandwidth (default 1.6); calibrated so that PyTorch's DataLoader, which reads the whole
dataset every epoch, keeps the accelerator about half busy.

Per epoch it prints time, accelerator utilization (compute time / epoch time), stall time (time
the training loop waited for data), samples by source and bytes read from the emulated file
system, and writes ``out/demo.json`` and ``out/demo.png``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from . import report
import clairvoyant.torch as ctorch
from .emulation import EmulatedAccelerator, RankContext, fingerprint, list_imagefolder, make_imagefolder, run_ranks

DEFAULT_SAMPLES = 2000
DEFAULT_CLASSES = 10
DEFAULT_BANDWIDTH_MBPS = 12.0
DEFAULT_LATENCY_MS = 2.0
# Accelerator speed / file system bandwidth. Both loaders keep their worker processes across
# epochs (persistent_workers) and ranks fork their workers as under torchrun, so what differs is
# I/O: at this ratio PyTorch's DataLoader, which reads the whole dataset every epoch, keeps the
# accelerator about half busy (0.43-0.47 on 2 cores; at 0.8 it is I/O-bound no longer, 0.8-0.9).
DEFAULT_COMPUTE_RATIO = 1.6
# With --nodes: each node's memory as a fraction of the dataset (their sum is above it).
DEFAULT_NODE_MEMORY = 0.3
IMAGE_SIZE = 64


def _transform():
    from torchvision import transforms as T

    return T.Compose([T.RandomResizedCrop(IMAGE_SIZE, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), T.ToTensor()])


class FsImageFolder:
    """torchvision's ImageFolder, except that files are read through the emulated file system.

    Items are ``(image, label, fingerprint of the bytes)`` so that the demo can check which
    samples each epoch saw. The EmulatedFs is opened lazily in each process that reads (the
    DataLoader's worker processes included).
    """

    def __init__(self, paths, labels, fs_args: tuple, transform=None):
        self.paths, self.labels, self.fs_args, self.transform = list(paths), list(labels), fs_args, transform
        self._fs = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fs"] = None
        return state

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        from clairvoyant.torch import pil_loader

        if self._fs is None:
            import clairvoyant

            self._fs = clairvoyant.EmulatedFs(*self.fs_args)
        data = self._fs.read(self.paths[index])
        img = pil_loader(data)
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[index], fingerprint(data)


class CachedFsImageFolder(FsImageFolder):
    """:class:`FsImageFolder` with clairvoyant's dataset protocol: the samples are its files,
    read through the same emulated file system, and an item is computed from a file's bytes
    exactly as ``__getitem__`` computes it."""

    def __clairvoyant_source__(self):
        import clairvoyant

        return clairvoyant.FileList(self.paths, self.labels, emulated=clairvoyant.EmulatedFs(*self.fs_args))

    def __clairvoyant_getitem__(self, index: int, data):
        from clairvoyant.torch import pil_loader

        img = pil_loader(data)
        if self.transform is not None:
            img = self.transform(img)
        return img, self.labels[index], fingerprint(data)


def _train_rank(ctx: RankContext, cfg: dict) -> dict:
    """One rank of one run: build the loader, train ``epochs`` epochs, report per-epoch figures."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    import clairvoyant


    torch.set_num_threads(1)
    transform = _transform()  # imports torchvision outside the timed region
    fs_args = (cfg["fs_state"], cfg["latency_ms"], cfg["bandwidth_mbps"])
    fs = clairvoyant.EmulatedFs(*fs_args)
    acc = EmulatedAccelerator(cfg["compute_bytes_per_second_per_rank"])
    index_of = {fp: k for k, fp in enumerate(cfg["fingerprints"])}
    mean_bytes = cfg["dataset_bytes"] / len(cfg["fingerprints"])
    epochs, batch_size, workers = cfg["epochs"], cfg["batch_size"], cfg["num_workers"]
    cached = cfg["loader"] != "pytorch"
    # The imports leave a full collection of the collector due (0.6 s when 8 ranks walk at once
    # on 2 cores); where a loader's allocations set it off is chance. Run here, it leaves no
    # loader's timed region.
    gc.collect()

    ctx.sync()
    start = time.perf_counter()
    # The two runs differ in one line: which DataLoader.
    Loader: Any = ctorch.DataLoader if cached else DataLoader
    dataset = (CachedFsImageFolder if cached else FsImageFolder)(cfg["paths"], cfg["labels"], fs_args, transform)
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=cfg["seed"])
    loader = Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, persistent_workers=workers > 0)
    setup_seconds = time.perf_counter() - start

    out = []
    for epoch in range(epochs):
        if epoch > 0:
            ctx.sync()
            start = time.perf_counter()
        sampler.set_epoch(epoch)
        compute0 = acc.compute_seconds
        stall = 0.0
        first_batch = None
        fingerprints: list = []
        it = iter(loader)
        for _ in range(len(loader)):
            t = time.perf_counter()
            batch = next(it)
            stall += time.perf_counter() - t
            if first_batch is None:
                first_batch = time.perf_counter() - start
            labels = batch[1]
            if len(batch) > 2:
                # The demo's own check of which samples the epoch saw, in one call. Converting
                # the tensor element by element gives up the GIL once per sample, and on 2 cores
                # getting it back waited 4-8 ms at about a fifth of the steps, charged to the
                # loader (docs/benchmarks.md, "The demo's own bookkeeping in the timed step").
                fingerprints.extend(batch[2].tolist())
            acc.step(len(labels) * mean_bytes)
            ctx.sync()  # the gradient all-reduce: ranks advance together
        epoch_seconds = time.perf_counter() - start
        ctx.sync()
        if ctx.rank == 0 and cfg.get("progress"):
            stream = sys.stderr if cfg["progress"] == "stderr" else sys.stdout
            print(f"  {cfg['loader']}: epoch {epoch} took {epoch_seconds:.1f} s", file=stream, flush=True)
        row = {
            "epoch": epoch,
            "epoch_seconds": epoch_seconds,
            "setup_seconds": setup_seconds if epoch == 0 else 0.0,
            "compute_seconds": acc.compute_seconds - compute0,
            "stall_seconds": stall,
            "first_batch_seconds": first_batch or 0.0,
            "fs_bytes_read_total": fs.bytes_read,
            "samples": [index_of.get(fp, -1) for fp in fingerprints],
        }
        if cached:
            stats = loader.stats()[-1]
            row["samples_by_source"] = {k: v["samples"] for k, v in stats["sources"].items()}
            row["peer"] = {k: stats[k] for k in ("peer_misses", "peer_fallbacks")}
        out.append(row)
    peers = None
    if cached:
        peers = loader.peer_stats()
        loader.close()
    return {"rank": ctx.rank, "epochs": out, "peers": peers}


def _merge(per_rank: list, loader: str, num_samples: int, fs_before: int) -> list:
    """Per-epoch figures across ranks: the slowest rank's time, mean compute, summed counts."""
    rows = []
    prev = fs_before
    for e in range(len(per_rank[0]["epochs"])):
        eps = [r["epochs"][e] for r in per_rank]
        epoch_seconds = max(x["epoch_seconds"] for x in eps)
        compute = sum(x["compute_seconds"] for x in eps) / len(eps)
        fs_total = max(x["fs_bytes_read_total"] for x in eps)
        counts = collections.Counter(k for x in eps for k in x["samples"])
        if loader == "pytorch":
            by_source = {"pfs": sum(len(x["samples"]) for x in eps)}
        else:
            by_source = collections.Counter()
            for x in eps:
                by_source.update(x.get("samples_by_source", {}))
            by_source = dict(by_source)
        peer = collections.Counter()
        for x in eps:
            peer.update(x.get("peer", {}))
        rows.append(
            {
                "epoch": e,
                "epoch_seconds": round(epoch_seconds, 4),
                "setup_seconds": round(max(x["setup_seconds"] for x in eps), 4),
                "compute_seconds": round(compute, 4),
                "accelerator_utilization": round(min(1.0, compute / epoch_seconds), 4),
                "stall_seconds": round(max(x["stall_seconds"] for x in eps), 4),
                "first_batch_seconds": round(max(x["first_batch_seconds"] for x in eps), 4),
                "fs_bytes_read": fs_total - prev,
                "samples_by_source": by_source,
                **({"peer_misses": peer["peer_misses"], "peer_fallbacks": peer["peer_fallbacks"]} if peer else {}),
                "samples_seen": sum(counts.values()),
                "unique_samples_seen": len([k for k in counts if k >= 0]),
                "every_sample_once": sum(counts.values()) == num_samples
                and len(counts) == num_samples
                and all(0 <= k < num_samples and c == 1 for k, c in counts.items()),
            }
        )
        prev = fs_total
    return rows


def run_comparison(
    out_dir: str | os.PathLike,
    data_dir: str | os.PathLike,
    *,
    samples: int = DEFAULT_SAMPLES,
    classes: int = DEFAULT_CLASSES,
    epochs: int = 3,
    ranks: int = 2,
    batch_size: int = 32,
    num_workers: int = 1,
    bandwidth_mbps: float = DEFAULT_BANDWIDTH_MBPS,
    latency_ms: float = DEFAULT_LATENCY_MS,
    compute_ratio: float = DEFAULT_COMPUTE_RATIO,
    seed: int = 0,
    loaders: Optional[tuple] = None,
    log=print,
    progress: Optional[str] = "stdout",
    nodes: int = 1,
    node_memory: float = DEFAULT_NODE_MEMORY,
) -> dict:
    """Generate (or reuse) the dataset and train with each loader; returns the result dict that
    ``out/demo.json`` holds.

    With ``nodes`` > 1 the ranks are split into that many emulated nodes (each its own node id
    and shared memory, all reading one emulated file system), each node's memory class holds
    ``node_memory`` of the dataset, and three loaders run: PyTorch's, clairvoyant with every
    node on its own (``one-node``), and clairvoyant with the nodes cooperating."""
    if loaders is None:
        loaders = ("pytorch", "one-node", "clairvoyant") if nodes > 1 else ("pytorch", "clairvoyant")
    import clairvoyant

    out_dir, data_dir = Path(out_dir), Path(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dataset_bytes, paths, labels, fingerprints = _dataset(data_dir, samples, classes, seed, log)

    bandwidth = bandwidth_mbps * 1e6
    compute_per_rank = compute_ratio * bandwidth / ranks
    fs_state = str(out_dir / "emulated-fs.state")
    fs = clairvoyant.EmulatedFs(fs_state, open_latency_ms=latency_ms, bandwidth_mbps=bandwidth_mbps)
    _log_setup(log, bandwidth_mbps, latency_ms, compute_per_rank, ranks, dataset_bytes)
    result: dict = {
        "dataset_bytes": dataset_bytes,
        "num_samples": len(paths),
        "config": {
            "epochs": epochs,
            "ranks": ranks,
            "batch_size": batch_size,
            "num_workers_per_rank": num_workers,
            "bandwidth_mbps": bandwidth_mbps,
            "open_latency_ms": latency_ms,
            "compute_bytes_per_second_per_rank": compute_per_rank,
            "compute_ratio": compute_ratio,
            "seed": seed,
            "nodes": nodes,
            "root": str(data_dir),
        },
    }
    node_env = _node_env(result["config"], out_dir, dataset_bytes, node_memory, log) if nodes > 1 else {}
    base = {
        "root": str(data_dir),
        "paths": paths,
        "labels": labels,
        "fingerprints": fingerprints,
        "dataset_bytes": dataset_bytes,
        "fs_state": fs_state,
        "latency_ms": latency_ms,
        "bandwidth_mbps": bandwidth_mbps,
        "compute_bytes_per_second_per_rank": compute_per_rank,
        "epochs": epochs,
        "batch_size": batch_size,
        "num_workers": num_workers,
        "seed": seed,
        "progress": progress,
    }
    for loader in loaders:
        result[loader] = _train(loader, {"loader": loader, **base}, fs, ranks, nodes, node_env, log)
    return result


def _dataset(data_dir: Path, samples: int, classes: int, seed: int, log) -> tuple[int, list, list, list]:
    """Generate (or reuse) the ImageFolder; returns its bytes, paths, labels and the files'
    fingerprints (distinct, so that an epoch's samples can be told apart)."""
    per_class = max(1, -(-samples // classes))
    t = time.perf_counter()
    log(f"dataset: {classes} classes x {per_class} JPEGs in {data_dir} ...")
    dataset_bytes = make_imagefolder(data_dir, classes, per_class, seed=seed)
    paths, labels, _ = list_imagefolder(data_dir)
    with_data = [Path(p).read_bytes() for p in paths]
    fingerprints = [fingerprint(b) for b in with_data]
    del with_data
    if len(set(fingerprints)) != len(fingerprints):
        raise RuntimeError("two generated samples have the same fingerprint; change the seed")
    log(f"dataset: {len(paths)} files, {report.mb(dataset_bytes):.1f} MB ({time.perf_counter() - t:.1f} s)")
    return dataset_bytes, paths, labels, fingerprints


def _log_setup(log, bandwidth_mbps: float, latency_ms: float, compute_per_rank: float, ranks: int, dataset_bytes: int) -> None:
    bandwidth = bandwidth_mbps * 1e6
    compute_epoch = dataset_bytes / (compute_per_rank * ranks)
    log(
        f"emulated file system: {bandwidth_mbps:g} MB/s shared, {latency_ms:g} ms per open; accelerator: "
        f"{compute_per_rank / 1e6:.1f} MB/s per rank x {ranks} ranks (compute {compute_epoch:.1f} s/epoch, "
        f"reading the dataset once {dataset_bytes / bandwidth:.1f} s)"
    )


def _node_env(config: dict, out_dir: Path, dataset_bytes: int, node_memory: float, log) -> dict:
    """With several emulated nodes: every node's system description (a memory class of
    ``node_memory`` of the dataset), recorded in ``config``; returns the ranks' variables."""
    nodes, ranks, epochs = config["nodes"], config["ranks"], config["epochs"]
    memory = int(dataset_bytes * node_memory)
    config["node_memory_bytes"] = memory
    path = out_dir / "node-system.toml"
    path.write_text(
        "# every emulated node's storage: a memory class of a fraction of the dataset\n"
        f'[[class]]\nname = "memory"\nkind = "memory"\ncapacity = {memory}\nthreads = 2\n'
    )
    log(
        f"{nodes} emulated nodes x {ranks // nodes} ranks, memory {report.mb(memory):.1f} MB per node "
        f"({node_memory:.0%} of the dataset; {nodes * node_memory:.0%} in all)"
    )
    return {"CLAIRVOYANT_CONFIG": str(path), "CLAIRVOYANT_EPOCHS": str(epochs)}


def _train(loader: str, cfg: dict, fs, ranks: int, nodes: int, node_env: dict, log) -> list:
    """One loader's run on ``ranks`` rank processes; returns its per-epoch rows."""
    fs.reset()
    before = fs.bytes_read
    log(f"training with {loader} ({ranks} ranks, {cfg['epochs']} epochs) ...")
    t = time.perf_counter()
    env = {"CLAIRVOYANT_RUN_ID": f"demo-{loader}-{uuid.uuid4().hex[:12]}", "OMP_NUM_THREADS": "1", **node_env}
    if loader == "one-node":
        env["CLAIRVOYANT_PEERS"] = "off"
    # A healthy run reads the dataset at most once an epoch from the emulated file system; one
    # that takes 20 times that, after 5 minutes to start, is hung: stopped and named.
    patience = 300 + 20 * cfg["epochs"] * cfg["dataset_bytes"] / (cfg["bandwidth_mbps"] * 1e6)
    try:
        per_rank = run_ranks(_train_rank, ranks, args=(cfg,), env=env, nodes=nodes, timeout=patience)
    except TimeoutError as e:
        raise RuntimeError(
            f"the {loader} run's {ranks} ranks did not finish within {patience:.0f} s ({e}); they were stopped"
        ) from e
    rows = _merge(per_rank, loader, len(cfg["paths"]), before)
    if loader == "clairvoyant" and nodes > 1:
        # Every rank's peer client counters (and its node's server's, on the first local rank).
        rows[-1]["peer_stats"] = [r.get("peers") for r in per_rank]
    log(epoch_table(loader, rows))
    log(f"{loader}: {time.perf_counter() - t:.1f} s in all\n")
    return rows


def epoch_table(loader: str, rows: list) -> str:
    headers = ["epoch", "time s", "compute s", "utilization", "stall s", "first batch s", "fs MB read", "samples by source", "each once"]
    body = [
        [
            r["epoch"],
            r["epoch_seconds"],
            r["compute_seconds"],
            r["accelerator_utilization"],
            r["stall_seconds"],
            r["first_batch_seconds"],
            report.mb(r["fs_bytes_read"]),
            report.sources_text(r["samples_by_source"]),
            "yes" if r["every_sample_once"] else "NO",
        ]
        for r in rows
    ]
    return f"{loader}\n" + report.text_table(headers, body)


def summary(result: dict) -> str:
    lines = []
    p, c, one = result.get("pytorch"), result.get("clairvoyant"), result.get("one-node")
    if p and c:
        for r_p, r_c in zip(p, c):
            lines.append(
                f"epoch {r_p['epoch']}: clairvoyant {r_p['epoch_seconds'] / r_c['epoch_seconds']:.2f}x faster "
                f"(utilization {r_c['accelerator_utilization']:.2f} vs {r_p['accelerator_utilization']:.2f})"
            )
        total_c = sum(r["fs_bytes_read"] for r in c)
        total_p = sum(r["fs_bytes_read"] for r in p)
        text = f"bytes read from the emulated file system: clairvoyant {total_c / result['dataset_bytes']:.2f}x the dataset, "
        if one:
            total_1 = sum(r["fs_bytes_read"] for r in one)
            text += f"one-node {total_1 / result['dataset_bytes']:.2f}x, "
        lines.append(text + f"pytorch {total_p / result['dataset_bytes']:.2f}x")
        if any("peer_misses" in r for r in c):
            lines.append(
                "peers could not serve (not filled yet, not held, corrupt) / were taken off the data path: "
                + ", ".join(f"epoch {r['epoch']} {r.get('peer_misses', 0)} / {r.get('peer_fallbacks', 0)}" for r in c)
            )
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benches.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=None, help="ranks in all (default 2, or 2 per node)")
    ap.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="number of images (default %(default)s)")
    ap.add_argument("--classes", type=int, default=DEFAULT_CLASSES)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1, help="decode workers per rank, both loaders")
    ap.add_argument("--bandwidth-mbps", type=float, default=DEFAULT_BANDWIDTH_MBPS, help="emulated file system, MB/s shared")
    ap.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_MS, help="emulated per-open latency")
    ap.add_argument(
        "--compute-ratio", type=float, default=DEFAULT_COMPUTE_RATIO, help="accelerator speed / file system bandwidth"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--nodes", type=int, default=1, help="emulated nodes (default %(default)s); ranks default to 2 per node"
    )
    ap.add_argument(
        "--node-memory",
        type=float,
        default=DEFAULT_NODE_MEMORY,
        help="each node's memory as a fraction of the dataset, with --nodes (default %(default)s)",
    )
    ap.add_argument("--out", default="out", help="output directory (default %(default)s)")
    ap.add_argument("--data", default=None, help="dataset directory (default OUT/demo/data)")
    args = ap.parse_args(argv)
    if args.nodes < 1:
        ap.error("--nodes must be at least 1")
    ranks = args.ranks if args.ranks is not None else 2 * args.nodes
    if ranks % args.nodes:
        ap.error(f"--ranks {ranks} is not a multiple of --nodes {args.nodes}")
    out = Path(args.out)
    data = Path(args.data) if args.data else out / "demo" / "data"
    t = time.perf_counter()
    result = run_comparison(
        out / "demo",
        data,
        samples=args.samples,
        classes=args.classes,
        epochs=args.epochs,
        ranks=ranks,
        batch_size=args.batch_size,
        num_workers=args.workers,
        bandwidth_mbps=args.bandwidth_mbps,
        latency_ms=args.latency_ms,
        compute_ratio=args.compute_ratio,
        seed=args.seed,
        nodes=args.nodes,
        node_memory=args.node_memory,
    )
    print(summary(result))
    name = "demo" if args.nodes == 1 else f"demo-{args.nodes}-nodes"
    json_path = report.write_json(out / f"{name}.json", result)
    title = "PyTorch DataLoader vs clairvoyant (emulated file system)"
    if args.nodes > 1:
        title = f"{args.nodes} emulated nodes, memory {args.node_memory:.0%} of the dataset each"
    png = report.plot_epochs(result, out / f"{name}.png", title=title)
    print(f"wrote {json_path}" + (f" and {png}" if png else " (matplotlib missing: no chart)"))
    print(f"demo took {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
