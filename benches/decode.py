"""Decode benchmark (``python -m benches --only decode``).

ImageNet-like JPEGs (500x375, quality 90, about 107 KB, generated in memory so that no I/O is
timed) through decode + RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize:

- native: ``BatchDecoder`` with 1 and with 2 decode threads, batches of 64;
- native decode alone: the same decoder with CenterCrop(224) to uint8 (a 224x224 copy, the
  smallest plan that collates), the "raw decode" reference;
- torchvision + Pillow in DataLoader worker processes (1 and 2 workers), batch 64, the same
  pipeline as a ``transforms.Compose``.

Per-core rates divide by the threads or workers used. Each figure is the best of ``passes`` passes
over the corpus (the machine is shared; the best pass is the least disturbed one).

End to end (:func:`bench_dropin`): the demo's training setup (its generated ImageFolder of 2,000
JPEGs, its transform RandomResizedCrop(64) + flip + ToTensor, 2 ranks, DistributedSampler, batch
32, 1 decode worker per rank, the emulated accelerator at the demo's speed) with a torchvision
``ImageFolder`` read from local files, through ``clairvoyant.torch.DataLoader`` twice per round:
``native_decode=False`` (the worker path: Pillow + torchvision in a worker process per rank) and
the native path (1 decode thread per rank). Rounds alternate the two so that a shared machine's
load falls on both.
"""

from __future__ import annotations

import io
import os
import time
from typing import Callable, Optional

import numpy as np

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _jpeg(seed: int, w: int = 500, h: int = 375) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 37 + c + seed) * np.cos(y / 23 - c) for c in (0, 1, 2)], -1)
    noise = rng.normal(0, 24, (h // 2 + 1, w // 2 + 1, 3)).repeat(2, 0).repeat(2, 1)[:h, :w]
    b = io.BytesIO()
    Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB").save(b, "JPEG", quality=90)
    return b.getvalue()


class _Encoded:
    """A map-style dataset of in-memory JPEGs decoded by Pillow and transformed by torchvision."""

    def __init__(self, data: list, transform):
        self.data, self.transform = data, transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.open(io.BytesIO(self.data[i])).convert("RGB"))


def _proc_cpu(pids: list) -> float:
    """CPU seconds (user + system) used so far by other processes, from /proc."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def _best(passes: int, n: int, fn: Callable[[], None], pids: Callable[[], list] = list) -> tuple:
    """(images/s of the fastest pass, images per CPU-second of the thriftiest pass): the second
    counts this process's threads and the processes in ``pids()``, so it holds on a busy machine."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(passes):
        c0, t = time.process_time() + _proc_cpu(pids()), time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() + _proc_cpu(pids()) - c0)
    return n / best, n / best_cpu


def _pillow_workers(data: list, transform, workers: int, batch: int, passes: int) -> tuple:
    import torch

    loader = torch.utils.data.DataLoader(
        _Encoded(data, transform), batch_size=batch, num_workers=workers, persistent_workers=True, prefetch_factor=2
    )
    return _loader_rates(loader, len(data), passes)


def _loader_rates(loader, n: int, passes: int) -> tuple:
    """_best over passes of a persistent-worker loader, after one pass that starts its workers."""

    def run() -> None:
        for _ in loader:
            pass

    run()
    return _best(passes, n, run, lambda: [w.pid for w in loader._iterator._workers if hasattr(w, "pid")])


def _dataloaders(data: list, batch: int, passes: int, log) -> dict:
    """The same pipeline on an ImageFolder of these JPEGs through a DataLoader with 1 worker:
    torch's, clairvoyant's drop-in with ``native_decode=False`` (Python decode from the cache in
    a worker process), and the drop-in's native path (1 decode thread in the training process)."""
    import tempfile

    import torch
    from torchvision import datasets
    from torchvision import transforms as T

    import clairvoyant.torch as ctorch
    members = [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="cv-decode-bench-") as root:
        for k, b in enumerate(data):
            d = os.path.join(root, f"c{k % 2}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{k}.jpg"), "wb") as f:
                f.write(b)
        cases = (
            ("torch_loader", torch.utils.data.DataLoader, {}),
            ("dropin_python", ctorch.DataLoader, {"native_decode": False}),
            ("dropin_native", ctorch.DataLoader, {}),
        )
        for name, Loader, kw in cases:
            ds = datasets.ImageFolder(root, T.Compose(members))
            loader = Loader(ds, batch_size=batch, shuffle=True, num_workers=1, persistent_workers=True, **kw)
            # The first pass starts the worker (and fills the drop-in's cache).
            out[name], out[name + "_cpu"] = _loader_rates(loader, len(data), passes)
            if hasattr(loader, "close"):
                loader.close()
            del loader
            log(f"  DataLoader ({name}), 1 worker: {out[name]:.0f} images/s ({out[name + '_cpu']:.0f} per CPU-s)")
    return out


def _dropin_rank(ctx, cfg: dict) -> dict:
    """One rank of one end-to-end run: per epoch its time, compute (emulated accelerator) and
    stall (time waiting for a batch), and this process's CPU seconds (decode threads included;
    the worker path's worker process's CPU is added from /proc)."""
    import torch
    from torch.utils.data import DistributedSampler
    from torchvision import datasets

    import clairvoyant.torch as ctorch

    from .emulation import EmulatedAccelerator
    from .demo import _transform

    torch.set_num_threads(1)
    acc = EmulatedAccelerator(cfg["compute_bytes_per_second_per_rank"])
    dataset = datasets.ImageFolder(cfg["root"], _transform())
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    workers = cfg["num_workers"]
    ctx.sync()
    start = time.perf_counter()
    loader = ctorch.DataLoader(
        dataset,
        batch_size=cfg["batch_size"],
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        native_decode=cfg["native"],
    )
    rows = []
    for epoch in range(cfg["epochs"]):
        if epoch > 0:
            ctx.sync()
            start = time.perf_counter()
        sampler.set_epoch(epoch)
        compute0, stall, n = acc.compute_seconds, 0.0, 0
        it = iter(loader)
        pids = [w.pid for w in getattr(it, "_workers", []) if hasattr(w, "pid")]
        cpu0 = time.process_time() + _proc_cpu(pids)
        for _ in range(len(loader)):
            t = time.perf_counter()
            _, labels = next(it)
            stall += time.perf_counter() - t
            n += len(labels)
            acc.step(len(labels) * cfg["mean_bytes"])
            ctx.sync()  # the gradient all-reduce
        rows.append(
            {
                "epoch_seconds": time.perf_counter() - start,
                "compute_seconds": acc.compute_seconds - compute0,
                "stall_seconds": stall,
                "cpu_seconds": time.process_time() + _proc_cpu(pids) - cpu0,
                "samples": n,
            }
        )
    loader.close()
    return {"rank": ctx.rank, "epochs": rows}


def bench_dropin(log, rounds: int = 2, epochs: int = 3, ranks: int = 2, root: Optional[str] = None, speeds: tuple = (1.0, 4.0)) -> dict:
    """The end-to-end target: the demo's setup with decoding on, the drop-in's native path
    against its worker path in the same run (see the module docstring). ``speeds``: accelerator
    speeds as multiples of the demo's (1.0: the demo's; 4.0: an accelerator fast enough that the
    2-core host's decoding limits the worker path)."""
    import tempfile
    import uuid

    from . import demo
    from .emulation import list_imagefolder, make_imagefolder, run_ranks

    tmp = None
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="cv-decode-e2e-")
        root = tmp.name
    runs: dict = {(sp, name): [] for sp in speeds for name in ("worker", "native")}
    try:
        per_class = demo.DEFAULT_SAMPLES // demo.DEFAULT_CLASSES
        dataset_bytes = make_imagefolder(root, demo.DEFAULT_CLASSES, per_class, seed=0)
        paths, _, _ = list_imagefolder(root)
        demo_compute = demo.DEFAULT_COMPUTE_RATIO * demo.DEFAULT_BANDWIDTH_MBPS * 1e6 / ranks
        cfg = {"root": root, "epochs": epochs, "batch_size": 32, "num_workers": 1, "mean_bytes": dataset_bytes / len(paths)}
        log(
            f"decode end to end: {len(paths)} JPEGs ({dataset_bytes / 1e6:.1f} MB, page-cached files), {ranks} ranks, "
            f"batch 32, 1 decode worker/thread per rank, accelerator {demo_compute / 1e6:.1f} MB/s per rank x {speeds} "
            f"(the demo's x1: compute {dataset_bytes / (demo_compute * ranks):.2f} s/epoch), {epochs} epochs x {rounds} rounds"
        )
        for r in range(rounds):
            for sp in speeds:
                for name in ("worker", "native") if r % 2 == 0 else ("native", "worker"):
                    env = {"CLAIRVOYANT_RUN_ID": f"decode-e2e-{name}-{uuid.uuid4().hex[:12]}", "OMP_NUM_THREADS": "1", "CLAIRVOYANT_QUIET": "1"}
                    run_cfg = {**cfg, "native": name == "native", "compute_bytes_per_second_per_rank": demo_compute * sp}
                    per_rank = run_ranks(_dropin_rank, ranks, args=(run_cfg,), env=env)
                    rows = []
                    for e in range(epochs):
                        eps = [pr["epochs"][e] for pr in per_rank]
                        t = max(x["epoch_seconds"] for x in eps)
                        c = sum(x["compute_seconds"] for x in eps) / len(eps)
                        rows.append(
                            {
                                "epoch_seconds": t,
                                "utilization": min(1.0, c / t),
                                "stall_seconds": max(x["stall_seconds"] for x in eps),
                                "cpu_seconds": sum(x["cpu_seconds"] for x in eps),
                                "samples": sum(x["samples"] for x in eps),
                            }
                        )
                    runs[(sp, name)].append(rows)
                    log(
                        f"  round {r}, accelerator x{sp:g}, {name}: "
                        + "; ".join(
                            f"epoch {e} {x['epoch_seconds']:.2f} s util {x['utilization']:.3f} cpu {x['cpu_seconds']:.1f} s" for e, x in enumerate(rows)
                        )
                    )
    finally:
        if tmp is not None:
            tmp.cleanup()

    def mean(key: tuple, e: int, field: str) -> float:
        return sum(run[e][field] for run in runs[key]) / len(runs[key])

    out: dict = {"rounds": rounds, "epochs": epochs, "ranks": ranks, "images": len(paths), "mb": dataset_bytes / 1e6, "speeds": {}}
    fields = ("epoch_seconds", "utilization", "stall_seconds", "cpu_seconds", "samples")
    for sp in speeds:
        d: dict = {"compute_epoch_s": dataset_bytes / (demo_compute * sp * ranks), "runs": {n: runs[(sp, n)] for n in ("worker", "native")}}
        for name in ("worker", "native"):
            d[name] = [{f: mean((sp, name), e, f) for f in fields} for e in range(epochs)]
        d["epoch0_native_over_worker"] = d["native"][0]["epoch_seconds"] / d["worker"][0]["epoch_seconds"]
        later = range(1, epochs)
        d["util_later_native"] = min(d["native"][e]["utilization"] for e in later) if epochs > 1 else None
        d["util_later_worker"] = min(d["worker"][e]["utilization"] for e in later) if epochs > 1 else None
        out["speeds"][sp] = d
    return out


def markdown_dropin(d: dict, command: str) -> list:
    lines = [
        f"End to end, the demo's setup with decoding on ({d['images']} JPEGs, {d['mb']:.1f} MB, page-cached; "
        f"{d['ranks']} ranks; batch 32; 1 decode worker / thread per rank), mean of {d['rounds']} alternating rounds. "
        f"`{command}`",
        "",
        "| accelerator | epoch | worker path s | worker path utilization | native s | native utilization | worker path CPU s | native CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sp, x in d["speeds"].items():
        for e, (w, n) in enumerate(zip(x["worker"], x["native"])):
            label = f"demo's x{sp:g} ({x['compute_epoch_s']:.2f} s/epoch)" if e == 0 else ""
            lines.append(
                f"| {label} | {e} | {w['epoch_seconds']:.2f} | {w['utilization']:.3f} | {n['epoch_seconds']:.2f} | {n['utilization']:.3f} "
                f"| {w['cpu_seconds']:.1f} | {n['cpu_seconds']:.1f} |"
            )
    lines.append("")
    for sp, x in d["speeds"].items():
        lines.append(
            f"- accelerator x{sp:g}: epoch 0 native / worker path {x['epoch0_native_over_worker']:.2f} (target <= 1); "
            f"utilization epochs >= 1 (min) native {x['util_later_native']:.3f} vs worker path {x['util_later_worker']:.3f} "
            "(target: native higher)."
        )
    return lines


def bench_decode(log, count: int = 256, batch: int = 64, passes: int = 3, dropin: bool = True) -> dict:
    import torch
    from torchvision import transforms as T

    from clairvoyant.torch._native_pipeline import BatchDecoder, native_plan

    data = [_jpeg(s) for s in range(count)]
    mean_kb = sum(map(len, data)) / count / 1e3
    log(f"decode: {count} JPEGs 500x375, mean {mean_kb:.0f} KB, batch {batch}")
    train = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])
    plan = native_plan(train)
    assert plan is not None, "the standard training pipeline must be recognised"
    raw_plan = native_plan(T.Compose([T.CenterCrop(224), T.PILToTensor()]))
    out: dict = {"images": count, "mean_kb": mean_kb, "batch": batch, "passes": passes}

    def native(p, threads: int) -> float:
        dec = BatchDecoder(p, threads, pin_memory=False)
        ids = list(range(count))

        def run():
            for k in range(0, count, batch):
                dec.decode(data[k : k + batch], ids[k : k + batch], seed=0, epoch=0)

        run()  # warm the pool and the buffers
        return _best(passes, count, run)

    for threads in (1, 2):
        out[f"native_{threads}t"], out[f"native_{threads}t_cpu"] = native(plan, threads)
        out[f"native_raw_{threads}t"], out[f"native_raw_{threads}t_cpu"] = native(raw_plan, threads)
        log(
            f"  native, {threads} thread(s): {out[f'native_{threads}t']:.0f} images/s "
            f"({out[f'native_{threads}t_cpu']:.0f} per CPU-s); decode alone {out[f'native_raw_{threads}t']:.0f} "
            f"({out[f'native_raw_{threads}t_cpu']:.0f} per CPU-s)"
        )

    def pil_inline() -> None:
        ds = _Encoded(data, train)
        for i in range(count):
            ds[i]

    # One intra-op thread, as in a DataLoader worker (torch's own pool would compete otherwise).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out["pil_inline"], out["pil_inline_cpu"] = _best(passes, count, pil_inline)
    finally:
        torch.set_num_threads(threads)
    for workers in (1, 2):
        out[f"pil_{workers}w"], out[f"pil_{workers}w_cpu"] = _pillow_workers(data, train, workers, batch, passes)
        log(
            f"  torchvision + Pillow, {workers} DataLoader worker(s): {out[f'pil_{workers}w']:.0f} images/s "
            f"({out[f'pil_{workers}w_cpu']:.0f} per CPU-s)"
        )
    out.update(_dataloaders(data, batch, passes, log))
    # Per core: images per CPU-second (robust to other load), and the 1-thread / 1-worker rates.
    out["ratio_vs_pil"] = out["native_1t_cpu"] / out["pil_1w_cpu"]
    out["ratio_wall_1_vs_1"] = out["native_1t"] / out["pil_1w"]
    out["raw_over_pipeline"] = out["native_raw_1t_cpu"] / out["native_1t_cpu"]
    if dropin:
        out["dropin_e2e"] = bench_dropin(log)
    return out


def markdown(d: dict, command: str, machine: dict, date: str) -> list:
    machine_s = f"{machine.get('cpus')} CPUs, {machine.get('memory_gib')} GiB"
    return [
        f"Decode + RandomResizedCrop(224) + flip + ToTensor + Normalize, {d['images']} JPEGs 500x375 "
        f"(~{d['mean_kb']:.0f} KB), batch {d['batch']}, best of {d['passes']} passes. `{command}`, {machine_s}, {date}.",
        "",
        "| pipeline | images per CPU-second (1 thread/worker) | 1 thread/worker, images/s | 2 threads/workers, images/s |",
        "|---|---|---|---|",
        f"| clairvoyant native | {d['native_1t_cpu']:.0f} | {d['native_1t']:.0f} | {d['native_2t']:.0f} |",
        f"| clairvoyant native, decode + 224 crop only (raw decode) | {d['native_raw_1t_cpu']:.0f} | {d['native_raw_1t']:.0f} | {d['native_raw_2t']:.0f} |",
        f"| torchvision + Pillow, DataLoader workers | {d['pil_1w_cpu']:.0f} | {d['pil_1w']:.0f} | {d['pil_2w']:.0f} |",
        f"| torchvision + Pillow, in the main process | {d['pil_inline_cpu']:.0f} | {d['pil_inline']:.0f} | |",
        f"| ImageFolder, torch's DataLoader, 1 worker | {d['torch_loader_cpu']:.0f} | {d['torch_loader']:.0f} | |",
        f"| ImageFolder, clairvoyant DataLoader, native_decode=False (worker path), 1 worker | {d['dropin_python_cpu']:.0f} | {d['dropin_python']:.0f} | |",
        f"| ImageFolder, clairvoyant DataLoader, native path, num_workers=1 (1 decode thread) | {d['dropin_native_cpu']:.0f} | {d['dropin_native']:.0f} | |",
        "",
        f"Per core (images per CPU-second, workers' CPU included): native / Pillow workers "
        f"{d['ratio_vs_pil']:.2f}x; raw decode / native pipeline {d['raw_over_pipeline']:.2f}x.",
    ] + (["", *markdown_dropin(d["dropin_e2e"], command)] if d.get("dropin_e2e") else [])


def main(argv: Optional[list] = None) -> int:
    """``python -m benches.decode [--part per-core|e2e|all]``: one part of the decode
    benchmark, with its markdown (``python -m benches --only decode`` runs both)."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    p.add_argument("--part", choices=["per-core", "e2e", "all"], default="all")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--root", help="end to end: where the demo's ImageFolder is made (reused when present)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    command = "python -m benches.decode " + " ".join(argv if argv is not None else sys.argv[1:])

    def log(m: str) -> None:
        print(m, flush=True)

    if args.part == "e2e":
        d = bench_dropin(log, rounds=args.rounds, root=args.root)
        print("\n".join(markdown_dropin(d, command.strip())))
    else:
        d = bench_decode(log, dropin=args.part == "all")
        machine = {"cpus": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
        print("\n".join(markdown(d, command.strip(), machine, time.strftime("%Y-%m-%d"))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(d, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
