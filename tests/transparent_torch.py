"""An unmodified PyTorch training-data script: torchvision ImageFolder, DistributedSampler and
DataLoader with worker processes, a few epochs; writes a checksum of every batch's tensors per
epoch as JSON. Nothing in it knows about clairvoyant."""

import argparse
import json
import time
import zlib

import torch
import torchvision
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dataset = torchvision.datasets.ImageFolder(a.root, transforms.Compose([transforms.CenterCrop(64), transforms.PILToTensor()]))
    sampler = DistributedSampler(dataset, num_replicas=a.world_size, rank=a.rank, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=a.workers)
    out = {"epochs": [], "seconds": []}
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        sums = []
        for images, labels in loader:
            sums.append(zlib.crc32(images.numpy().tobytes()) ^ zlib.crc32(labels.numpy().tobytes()))
        out["seconds"].append(time.perf_counter() - t0)
        out["epochs"].append(sums)
    with open(a.out, "w") as f:
        json.dump(out, f)
    _ = torch


if __name__ == "__main__":
    main()
