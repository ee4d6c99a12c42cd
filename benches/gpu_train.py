"""Real training on a GPU: a torchvision model (ResNet-18 by default) on an ImageFolder of JPEGs read through the emulated shared
file system, once with PyTorch's DataLoader (+ DistributedSampler semantics, one rank) and once
with clairvoyant. Reports per epoch: time, GPU busy time (CUDA events around each step), GPU
utilization = busy / epoch time, time the loop waited for data, and bytes read from the file
system. Not part of the test suite; needs CUDA.

    python -m benches.gpu_train --samples 20000 --epochs 3 --workers 8 --bandwidth-mbps 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch


def build_pytorch(args, paths, labels, transform):
    from torch.utils.data import DataLoader, DistributedSampler

    from benches.demo import FsImageFolder

    ds = FsImageFolder(paths, labels, (args.fs_state, args.latency_ms, args.bandwidth_mbps), transform)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, persistent_workers=True, prefetch_factor=4)
    return loader, sampler.set_epoch, None


def build_clairvoyant(args, transform):
    import clairvoyant
    import clairvoyant.torch as ctorch

    fs = clairvoyant.EmulatedFs(args.fs_state, args.latency_ms, args.bandwidth_mbps)
    job = clairvoyant.Job(clairvoyant.ImageFolder(args.data, emulated=fs), batch_size=args.batch_size, epochs=args.epochs)
    loader = ctorch.DataLoader(ctorch.ImageFolder(job, transform), num_workers=args.workers, pin_memory=True, prefetch_factor=4)
    return loader, loader.set_epoch, job


def train(args, name, loader, set_epoch, job, fs):
    import torchvision

    model = getattr(torchvision.models, args.arch)(num_classes=args.classes).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    rows = []
    for epoch in range(args.epochs):
        set_epoch(epoch)
        fs0 = fs.bytes_read
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        wait = 0.0
        events = []
        it = iter(loader)
        n = 0
        while True:
            tw = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - tw
            x = batch[0].cuda(non_blocking=True).to(memory_format=torch.channels_last)
            y = batch[1].cuda(non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            end.record()
            events.append((start, end))
            n += len(y)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        busy = sum(s.elapsed_time(e) for s, e in events) / 1e3
        row = {"epoch": epoch, "epoch_seconds": seconds, "gpu_busy_seconds": busy, "gpu_utilization": busy / seconds,
               "data_wait_seconds": wait, "samples": n, "fs_bytes_read": fs.bytes_read - fs0}
        if job is not None:
            row["samples_by_source"] = {k: v["samples"] for k, v in job.stats()[epoch]["sources"].items()}
        rows.append(row)
        print(f"{name:>11} epoch {epoch}: {seconds:6.1f} s  gpu busy {busy:5.1f} s  util {busy / seconds:.2f}  "
              f"waited {wait:5.1f} s  fs {row['fs_bytes_read'] / 1e6:7.1f} MB", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="out/gpu/data")
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--bandwidth-mbps", type=float, default=60.0)
    ap.add_argument("--latency-ms", type=float, default=2.0)
    ap.add_argument("--image-size", type=int, default=112)
    ap.add_argument("--arch", default="resnet18", help="a torchvision.models constructor")
    ap.add_argument("--out", default="out/gpu_bench.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available; this benchmark needs a GPU", file=sys.stderr)
        return 2
    from torchvision import transforms as T

    import clairvoyant
    from benches.emulation import list_imagefolder, make_imagefolder

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    t = time.perf_counter()
    total = make_imagefolder(args.data, args.classes, args.samples // args.classes)
    print(f"dataset: {args.samples} JPEGs, {total / 1e6:.0f} MB ({time.perf_counter() - t:.0f} s)", flush=True)
    paths, labels, _ = list_imagefolder(args.data)
    args.fs_state = os.path.join(os.path.dirname(args.out) or ".", "gpu_fs.state")
    fs = clairvoyant.EmulatedFs(args.fs_state, args.latency_ms, args.bandwidth_mbps)
    transform = T.Compose([T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.PILToTensor(),
                           T.ConvertImageDtype(torch.float32)])
    result = {"device": torch.cuda.get_device_name(0), "cpus": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "dataset_bytes": total, "args": {k: v for k, v in vars(args).items()}}
    loader, set_epoch, job = build_pytorch(args, paths, labels, transform)
    result["pytorch"] = train(args, "pytorch", loader, set_epoch, None, fs)
    del loader
    loader, set_epoch, job = build_clairvoyant(args, transform)
    result["clairvoyant"] = train(args, "clairvoyant", loader, set_epoch, job, fs)
    loader.close()
    job.close()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for e in range(args.epochs):
        p, c = result["pytorch"][e], result["clairvoyant"][e]
        print(f"epoch {e}: clairvoyant {p['epoch_seconds'] / c['epoch_seconds']:.2f}x faster "
              f"(GPU utilization {c['gpu_utilization']:.2f} vs {p['gpu_utilization']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
