"""A small ImageNet-style training script: an ``ImageFolder`` with the usual augmentations, a
``DistributedSampler`` when there are several ranks, an epoch loop with ``set_epoch`` and a
small convolutional model trained with SGD.

Its data loader is clairvoyant's drop-in (``--loader clairvoyant``, the default) or torch's own
(``--loader torch``, e.g. under ``clairvoyant run``, which caches the files it opens without a
change to the script). It runs under torchrun, ``srun``, ``mpirun`` or alone: rank and world
size come from torchrun's variables (then a process group is initialized), else from Slurm's
or Open MPI's, else it is one process. ``--record DIR`` writes ``DIR/rank<r>.json`` with the
labels each epoch delivered and the losses (what the example tests check).

    python examples/train_imagenet.py --data /pfs/imagenet --epochs 90 --batch-size 256 --workers 8
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils.data
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets
from torchvision import transforms as T

LAUNCHERS = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))


def launcher_rank() -> tuple:
    """(rank, world size, launcher) from the launcher's environment."""
    for rank, world in LAUNCHERS:
        if os.environ.get(rank) and os.environ.get(world):
            return int(os.environ[rank]), int(os.environ[world]), rank
    return 0, 1, None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, metavar="DIR", help="DIR/train in ImageFolder layout (class folders of images)")
    p.add_argument("--loader", choices=["clairvoyant", "torch"], default="clairvoyant")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--record", metavar="DIR", default=None, help="write DIR/rank<r>.json")
    return p.parse_args(argv)


def model_for(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, classes),
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    rank, world, launcher = launcher_rank()
    if launcher == "RANK":  # torchrun: a process group for the sampler and the gradients
        dist.init_process_group("gloo")
    if args.loader == "clairvoyant":
        import clairvoyant.torch

        DataLoader = clairvoyant.torch.DataLoader
    else:
        DataLoader = torch.utils.data.DataLoader

    normalize = T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = datasets.ImageFolder(
        os.path.join(args.data, "train"),
        T.Compose([T.RandomResizedCrop(args.image_size, antialias=True), T.RandomHorizontalFlip(), T.ToTensor(), normalize]),
    )
    sampler = None
    if world > 1:
        # Without a process group (srun, mpirun) the sampler is told the rank and world size.
        sampler = (
            DistributedSampler(train, seed=args.seed) if dist.is_initialized() else DistributedSampler(train, world, rank, seed=args.seed)
        )
    loader = DataLoader(
        train,
        batch_size=args.batch_size,
        shuffle=sampler is None,
        sampler=sampler,
        num_workers=args.workers,
        drop_last=False,
    )
    model = model_for(len(train.classes))
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    labels, losses = [], []
    for epoch in range(args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        start, seen, total = time.perf_counter(), [], 0.0
        model.train()
        for images, target in loader:
            loss = loss_fn(model(images), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += target.tolist()
            total += loss.item() * len(target)
        labels.append(seen)
        losses.append(total / max(1, len(seen)))
        print(
            f"rank {rank}/{world} epoch {epoch}: {len(seen)} images, loss {losses[-1]:.3f}, {time.perf_counter() - start:.1f} s", flush=True
        )
    if args.record:
        os.makedirs(args.record, exist_ok=True)
        with open(os.path.join(args.record, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": world, "launcher": launcher, "labels": labels, "losses": losses}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
