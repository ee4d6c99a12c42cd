"""One rank of the training programs of the epoch-0 benchmark (``python -m benches --only epoch0``), run as a
script: nothing in it knows about clairvoyant unless ``--patch`` imports the drop-in.

- ``pool``: a pool of 4 reader threads, two batches of look-ahead, consumed in order;
- ``torch``: torch's DataLoader with a DistributedSampler and 2 worker processes;
- ``torch --patch``: the same after ``import clairvoyant.torch.patch`` (the dataset speaks
  clairvoyant's dataset protocol).

Every rank reads its DistributedSampler share of every file under ROOT (seed 0), steps an
emulated accelerator (a sleep of batch bytes / ``--compute-mbps``) per batch and meets the other
ranks at a barrier per step (torch.distributed, gloo), as data-parallel training does. Writes
``{"seconds": [...], "samples": [...], "first_iter_seconds": [...]}`` to ``--out``, with the
phases of the job on the machine's monotonic clock (``started``: the program's first line,
``epoch_bounds``: each epoch's start and end, ``finished``) and this process's CPU seconds per
epoch (``cpu_seconds``; threads included, worker processes not), so that a harness can set
other processes' CPU against the same epochs. ``--no-io`` hands out zeros of each file's size
instead of reading it (sizes taken before the first epoch): the program's own floor."""

from __future__ import annotations

import time

STARTED = time.monotonic()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402


def files_under(root: str) -> list:
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out += [os.path.join(d, n) for n in sorted(names) if not n.startswith(".")]
    return out


class Files:
    """Each sample is one file's bytes (the dataset protocol too, for the drop-in)."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            return f.read()

    def __clairvoyant_files__(self):
        return self.files

    def __clairvoyant_getitem__(self, i, data):
        return bytes(data)


class Zeros(Files):
    """Each sample is zeros of its file's size: no file is opened while epochs run."""

    def __init__(self, files):
        super().__init__(files)
        self.sizes = [os.stat(f).st_size for f in files]

    def __getitem__(self, i):
        return bytes(self.sizes[i])


def as_list(batch):
    return batch


def step(nbytes: int, bps: float) -> None:
    deadline = time.perf_counter() + nbytes / bps
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("--program", choices=["pool", "torch"], required=True)
    p.add_argument("--patch", action="store_true")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--compute-mbps", type=float, default=64.0)
    p.add_argument("--out", required=True)
    p.add_argument("--no-io", action="store_true", help="zeros of each file's size instead of its bytes")
    a = p.parse_args()
    if a.patch:
        import clairvoyant.torch.patch  # noqa: F401
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bps = a.compute_mbps * 1e6
    files = files_under(a.root)
    dataset = Zeros(files) if a.no_io else Files(files)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    res: dict = {"seconds": [], "samples": [], "first_iter_seconds": [], "epoch_bounds": [], "cpu_seconds": [], "started": STARTED}
    loader = None
    if a.program == "torch":
        loader = DataLoader(dataset, batch_size=a.batch, sampler=sampler, num_workers=2, collate_fn=as_list)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        t, t_mono, cpu = time.perf_counter(), time.monotonic(), time.process_time()
        n = 0
        if loader is not None:
            it = iter(loader)
            res["first_iter_seconds"].append(time.perf_counter() - t)
            for batch in it:
                n += len(batch)
                step(sum(map(len, batch)), bps)
                dist.barrier()
        else:
            order = list(sampler)
            with ThreadPoolExecutor(4) as pool:
                ahead = 2 * a.batch
                futures = [pool.submit(dataset.__getitem__, i) for i in order[:ahead]]
                nxt = len(futures)
                for b in range(0, len(order), a.batch):
                    end = min(b + a.batch, len(order))
                    batch = [futures[k].result() for k in range(b, end)]
                    for k in range(b, end):
                        futures[k] = None
                    while nxt < len(order) and nxt < end + ahead:
                        futures.append(pool.submit(dataset.__getitem__, order[nxt]))
                        nxt += 1
                    n += len(batch)
                    step(sum(map(len, batch)), bps)
                    dist.barrier()
        res["seconds"].append(time.perf_counter() - t)
        res["epoch_bounds"].append([t_mono, time.monotonic()])
        res["cpu_seconds"].append(time.process_time() - cpu)
        res["samples"].append(n)
    del loader
    dist.destroy_process_group()
    res["finished"] = time.monotonic()
    with open(a.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
