"""A small training-style script run once with torch's DataLoader and once with clairvoyant's.

Its structure follows a typical ImageNet training script (argument parsing, an ``ImageFolder``
with transforms, an optional ``DistributedSampler``, an epoch loop calling
``sampler.set_epoch(epoch)``, a ``validate()`` that reads ``val_loader.sampler``, checkpoints and
``--resume``), without a model: what is compared is the data. The one line where the two runs
differ is where ``DataLoader`` is chosen in :func:`main_worker`.

Every batch the loaders yield is written to ``OUT/rank{r}.jsonl`` as one JSON object::

    {"epoch": 0, "step": 3, "split": "train", "n": 8,
     "digest": "<sha256 of every tensor's dtype, shape and bytes, in order>",
     "labels": "<sha256 of the batch's labels>"}

``split`` is ``train``, ``val``, ``val_aux`` (the remainder a distributed validation leaves out,
as the ImageNet script evaluates it) or ``peek`` (``--peek``: ``next(iter(loader))`` before each
epoch's loop).

Resume: ``--stop-after EPOCH:STEP`` stops after STEP batches of epoch EPOCH (``STEP`` 0: before
the epoch starts) and writes ``OUT/checkpoint_rank{r}.pt``; ``--resume PATH`` (``{rank}`` in it is
replaced by the rank) continues from it. With clairvoyant's DataLoader the checkpoint of a
mid-epoch stop holds ``train_loader.state_dict()`` and the resumed run calls
``load_state_dict()``; torch's DataLoader has no state, so the resumed run iterates the epoch's
first STEP batches again without recording them (the reference). A stop at an epoch boundary
holds only the epoch, as the ImageNet script's checkpoints do, and the resumed run just calls
``sampler.set_epoch(epoch)``. Both save torch's global random state (at the stop for
clairvoyant, at the start of the interrupted epoch for torch, which iterates the epoch again) so
that a resumed run continues exactly as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data
import torchvision
from torch.utils.data.distributed import DistributedSampler

import clairvoyant.torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loader", choices=["torch", "clairvoyant"], default="torch")
    p.add_argument("--data", metavar="DIR", help="ImageNet layout: DIR/train and DIR/val")
    p.add_argument("--out", metavar="DIR", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default=None)
    p.add_argument("--persistent", action="store_true", help="persistent_workers=True")
    p.add_argument("--prefetch-factor", type=int, default=None)
    p.add_argument("--worker-init", action="store_true", help="a worker_init_fn that reseeds torch")
    p.add_argument("--generator", action="store_true", help="generator=torch.Generator() seeded with --seed")
    p.add_argument("--sampler", choices=["distributed", "none"], default="none")
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--transforms", choices=["v1", "v2", "eval"], default="v1")
    p.add_argument("--collate", choices=["default", "custom"], default="default")
    p.add_argument("--fake", action="store_true", help="torchvision FakeData instead of ImageFolder")
    p.add_argument("--fake-size", type=int, default=40)
    p.add_argument("--val", action="store_true", help="also run a validation loader each epoch")
    p.add_argument("--peek", action="store_true", help="next(iter(loader)) before each epoch")
    p.add_argument("--launch", choices=["none", "spawn"], default="none")
    p.add_argument("--nprocs", type=int, default=2, help="processes for --launch spawn")
    p.add_argument("--stop-after", metavar="EPOCH:STEP", default=None)
    p.add_argument("--resume", metavar="CKPT", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.fake and not args.data:
        p.error("--data is required unless --fake")
    if args.stop_after is not None:
        try:
            e, s = (int(x) for x in args.stop_after.split(":"))
        except ValueError:
            p.error(f"--stop-after {args.stop_after!r}: expected EPOCH:STEP")
        args.stop_after = (e, s)
    return args


# --- transforms, collate, worker init: module level so spawned and forkserver workers find them


def train_transform(kind: str):
    if kind == "v1":
        from torchvision import transforms as T

        return T.Compose(
            [
                T.RandomResizedCrop(32, antialias=True),
                T.RandomHorizontalFlip(),
                T.ToTensor(),
                T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ]
        )
    if kind == "v2":
        from torchvision.transforms import v2

        return v2.Compose(
            [
                v2.RandomResizedCrop(32, antialias=True),
                v2.RandomHorizontalFlip(),
                v2.ToImage(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
            ]
        )
    return eval_transform()


def eval_transform():
    from torchvision import transforms as T

    return T.Compose(
        [
            T.Resize(36, antialias=True),
            T.CenterCrop(32),
            T.ToTensor(),
            T.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]),
        ]
    )


def dict_collate(samples):
    """A user's own collate: a dict, labels first, and a per-batch statistic."""
    images = torch.stack([s[0] for s in samples])
    return {
        "label": torch.tensor([int(s[1]) for s in samples], dtype=torch.int64),
        "image": images,
        "mean": images.mean(dim=(1, 2, 3)),
    }


def reseed_worker(worker_id: int) -> None:
    """Makes the augmentations depend on worker_init_fn being called in each worker."""
    torch.manual_seed((torch.initial_seed() * 31 + 7 + worker_id) % (2**63))


# --- what is recorded


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in obj:
            yield from tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors(x)
    else:
        yield torch.as_tensor(obj)


def digest(obj) -> str:
    h = hashlib.sha256()
    for t in tensors(obj):
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def labels_of(batch):
    if isinstance(batch, dict):
        return batch["label"]
    return batch[1]


class Recorder:
    def __init__(self, path: Path):
        self.f = open(path, "w")

    def __call__(self, epoch: int, step: int, split: str, batch) -> None:
        labels = labels_of(batch)
        rec = {
            "epoch": epoch,
            "step": step,
            "split": split,
            "n": len(labels),
            "digest": digest(batch),
            "labels": digest(labels),
        }
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


# --- the script


def main(argv=None):
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.launch == "spawn":
        init_file = Path(args.out).resolve() / "pg_init"
        if init_file.exists():
            init_file.unlink()
        args.init_method = f"file://{init_file}"
        args.world_size = args.nprocs
        mp.spawn(main_worker, nprocs=args.nprocs, args=(args,))
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # torchrun (or any launcher setting the usual variables)
        args.init_method = "env://"
        args.world_size = int(os.environ["WORLD_SIZE"])
        main_worker(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), args)
    else:
        args.init_method = None
        args.world_size = 1
        main_worker(0, args)


def main_worker(local_rank: int, args) -> None:
    torch.set_num_threads(1)
    distributed = args.init_method is not None
    if distributed:
        if args.init_method == "env://":
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=args.init_method, world_size=args.world_size, rank=local_rank)
        rank = dist.get_rank()
    else:
        rank = 0
    torch.manual_seed(args.seed)

    # The one line that differs between the two runs.
    # native_decode=False: torch's exact batches (these transforms would be decoded natively).
    DataLoader = functools.partial(clairvoyant.torch.DataLoader, native_decode=False) if args.loader == "clairvoyant" else torch.utils.data.DataLoader

    if args.fake:
        train_dataset = torchvision.datasets.FakeData(args.fake_size, (3, 40, 48), 4, train_transform(args.transforms), random_offset=0)
        val_dataset = torchvision.datasets.FakeData(args.fake_size // 2, (3, 40, 48), 4, eval_transform(), random_offset=args.fake_size)
    else:
        train_dataset = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_transform(args.transforms))
        val_dataset = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), eval_transform())

    if args.sampler == "distributed":
        if distributed:
            train_sampler = DistributedSampler(train_dataset, shuffle=args.shuffle, seed=args.seed)
            val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
        else:
            train_sampler = DistributedSampler(train_dataset, num_replicas=1, rank=0, shuffle=args.shuffle, seed=args.seed)
            val_sampler = None
    else:
        train_sampler = val_sampler = None

    workers = {}
    if args.workers > 0:
        workers = {
            "multiprocessing_context": args.start_method,
            "persistent_workers": args.persistent,
            "prefetch_factor": args.prefetch_factor,
            "worker_init_fn": reseed_worker if args.worker_init else None,
        }
    generator = torch.Generator().manual_seed(args.seed) if args.generator else None
    collate_fn = dict_collate if args.collate == "custom" else None

    train_loader = DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=(args.shuffle if train_sampler is None else None),
        sampler=train_sampler,
        num_workers=args.workers,
        collate_fn=collate_fn,
        pin_memory=False,
        drop_last=args.drop_last,
        generator=generator,
        **workers,
    )
    val_loader = DataLoader(
        val_dataset,
        batch_size=args.batch_size,
        shuffle=False,
        sampler=val_sampler,
        num_workers=args.workers,
        collate_fn=collate_fn,
        **workers,
    )

    record = Recorder(Path(args.out) / f"rank{rank}.jsonl")

    start_epoch, skip = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume.replace("{rank}", str(rank)), weights_only=False)
        start_epoch, skip = ckpt["epoch"], ckpt["step"]
        torch.set_rng_state(ckpt["rng"])
        if "loader" in ckpt:
            train_loader.load_state_dict(ckpt["loader"])

    def checkpoint(epoch: int, step: int, rng) -> None:
        state = {"epoch": epoch, "step": step, "rng": rng}
        if step > 0 and args.loader == "clairvoyant":
            state["loader"] = train_loader.state_dict()
        torch.save(state, Path(args.out) / f"checkpoint_rank{rank}.pt")
        record.close()
        if distributed:
            dist.barrier()
            dist.destroy_process_group()

    for epoch in range(start_epoch, args.epochs):
        resumed = args.resume is not None and epoch == start_epoch
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
        if args.stop_after == (epoch, 0):
            checkpoint(epoch, 0, torch.get_rng_state())
            return
        if args.peek and not resumed:
            record(epoch, 0, "peek", next(iter(train_loader)))
        rng_at_start = torch.get_rng_state()
        first = skip if resumed else 0
        for i, batch in enumerate(train_loader, start=first if args.loader == "clairvoyant" else 0):
            if i < first:
                continue  # torch's DataLoader: iterate the batches done before the checkpoint
            record(epoch, i, "train", batch)
            if args.stop_after == (epoch, i + 1):
                rng = torch.get_rng_state() if args.loader == "clairvoyant" else rng_at_start
                checkpoint(epoch, i + 1, rng)
                return
        if args.val:
            validate(DataLoader, val_loader, val_dataset, epoch, args, distributed, record)

    record.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def validate(DataLoader, val_loader, val_dataset, epoch, args, distributed, record) -> None:
    for i, batch in enumerate(val_loader):
        record(epoch, i, "val", batch)
    # As the ImageNet script: what the distributed sampler dropped is evaluated on every rank.
    covered = len(val_loader.sampler) * (dist.get_world_size() if distributed else 1)
    if distributed and covered < len(val_loader.dataset):
        aux = torch.utils.data.Subset(val_dataset, range(covered, len(val_dataset)))
        aux_loader = DataLoader(aux, batch_size=args.batch_size, shuffle=False, num_workers=0)
        for i, batch in enumerate(aux_loader):
            record(epoch, i, "val_aux", batch)


if __name__ == "__main__":
    sys.exit(main())
