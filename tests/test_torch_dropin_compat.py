"""clairvoyant.torch.DataLoader behaves as torch's where torch's own DataLoader tests look:
checkpoints that torch.load accepts with its defaults, resume exact across epochs, typing,
samplers yielding lists of indices, get_worker_info(), and the life of persistent workers."""

import gc
import hashlib
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from PIL import Image  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchvision import transforms as T  # noqa: E402

import clairvoyant.torch as ct  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(11)
    for c in range(3):
        (root / f"class{c}").mkdir()
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return str(root)


def _digest(batch) -> str:
    x, y = batch
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12] + "|" + ",".join(map(str, y.tolist()))


def _augmenting():
    # Random transforms in the workers: their random states are part of the checkpoint.
    return T.Compose([T.RandomResizedCrop(6), T.RandomHorizontalFlip(), T.ToTensor()])


class _Setup:
    """A loader as a training script builds it, run after run."""

    def __init__(self, folder, sampler: str, workers: int):
        self.folder, self.sampler, self.workers = folder, sampler, workers

    def build(self):
        ds = torchvision.datasets.ImageFolder(self.folder, _augmenting())
        kw = {}
        self.dist = None
        if self.sampler == "generator":
            kw.update(shuffle=True, generator=torch.Generator().manual_seed(5))
        elif self.sampler == "global":
            kw.update(shuffle=True)
        else:
            self.dist = kw["sampler"] = DistributedSampler(ds, num_replicas=2, rank=1, seed=3)
        return ct.DataLoader(ds, batch_size=4, num_workers=self.workers, native_decode=False, **kw)

    def begin(self, e: int) -> None:
        if self.dist is not None:
            self.dist.set_epoch(e)


def _torch_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # torch's default: weights_only=True


@pytest.mark.parametrize("sampler", ["generator", "global", "distributed"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_a_torch_checkpoint_is_exact_for_the_epoch_and_the_next_two(folder, sampler, workers):
    setup = _Setup(folder, sampler, workers)
    torch.manual_seed(1)
    loader = setup.build()
    ref = []
    for e in range(3):
        setup.begin(e)
        ref += [(e, _digest(b)) for b in loader]
    loader.close()

    torch.manual_seed(1)
    loader = setup.build()
    setup.begin(0)
    got = []
    it = iter(loader)
    for _ in range(3):
        got.append((0, _digest(next(it))))
    # What a script checkpoints: the loader's state and the training process's random state.
    ckpt = _torch_roundtrip({"loader": loader.state_dict(), "rng": torch.get_rng_state()})
    del it
    loader.close()

    torch.manual_seed(999)  # the new process's own state, replaced by the checkpoint's
    loader = setup.build()
    loader.load_state_dict(ckpt["loader"])
    torch.set_rng_state(ckpt["rng"])
    for e in range(3):
        setup.begin(e)
        got += [(e, _digest(b)) for b in loader]
    loader.close()
    assert got == ref


@pytest.mark.parametrize("generator", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_state_dict_holds_only_what_torch_load_accepts_by_default(folder, workers, generator):
    ds = torchvision.datasets.ImageFolder(folder, _augmenting())
    kw = {"generator": torch.Generator().manual_seed(5)} if generator else {}
    loader = ct.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, native_decode=False, **kw)
    states = [loader.state_dict()]  # before any epoch
    it = iter(loader)
    next(it)
    states.append(loader.state_dict())  # mid-epoch
    for _ in it:
        pass
    states.append(loader.state_dict())  # at the end of the epoch
    del it
    loader.close()
    if workers:
        assert states[1]["workers"] is not None  # the workers' random states are kept
    for state in states:
        back = _torch_roundtrip(state)
        assert back.keys() == state.keys()
        other = ct.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers, native_decode=False, **kw)
        other.load_state_dict(back)
        other.close()


def test_a_state_of_the_first_format_still_loads(folder):
    """States saved before they became torch.load-friendly (numpy arrays in the workers'
    random states) resume as well."""
    from clairvoyant.torch import _datasets

    ds = torchvision.datasets.ImageFolder(folder, _augmenting())
    loader = ct.DataLoader(ds, batch_size=4, num_workers=2, native_decode=False)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = [_digest(b) for b in it]
    del it
    loader.close()
    old = dict(state, version=1, workers=[_datasets.rng_state_from_plain(w) for w in state["workers"]])
    assert isinstance(old["workers"][0][2][1], np.ndarray)
    loader = ct.DataLoader(ds, batch_size=4, num_workers=2, native_decode=False)
    loader.load_state_dict(old)
    assert [_digest(b) for b in loader] == rest
    loader.close()


def test_subscriptable_as_torchs():
    from typing import List

    def make(is_train: bool) -> ct.DataLoader[List[torch.Tensor]]:  # noqa: ARG001
        return None

    assert ct.DataLoader[int] is not None
    assert make.__annotations__["return"].__origin__ is ct.DataLoader
    assert issubclass(ct.DataLoader, torch.utils.data.dataloader.DataLoader)


class _Counting(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        if isinstance(index, list):  # a whole batch at once, as samplers of lists ask
            return torch.tensor(index)
        return index


class _ListSampler(torch.utils.data.Sampler):
    def __init__(self, n, size):
        self.n, self.size = n, size

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(3)).tolist()
        return iter([order[i : i + self.size] for i in range(0, self.n, self.size)])

    def __len__(self):
        return (self.n + self.size - 1) // self.size


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_yielding_lists_without_automatic_batching(workers):
    ds = _Counting(35)
    kw = dict(batch_size=None, sampler=_ListSampler(35, 4), num_workers=workers)
    want = [b.tolist() for b in torch.utils.data.dataloader.DataLoader(ds, **kw)]
    loader = ct.DataLoader(ds, **kw)
    assert not loader._auto_collation
    got = [b.tolist() for b in loader]
    loader.close()
    assert got == want
    assert sorted(i for b in got for i in b) == list(range(35))


class _InfoDataset(torch.utils.data.Dataset):
    """Records what get_worker_info() says, in worker_init_fn and in __getitem__."""

    def __init__(self, folder):
        self.inner = torchvision.datasets.ImageFolder(folder, T.ToTensor())
        self.opened = None

    def __clairvoyant_files__(self):
        return [p for p, _ in self.inner.samples]

    def __clairvoyant_getitem__(self, index, data):
        return self[index]

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        info = torch.utils.data.get_worker_info()
        return (info.dataset is self, info.dataset.opened == f"handle {info.id}", type(info.dataset).__name__)


def _open_handle(worker_id):
    # The common pattern: a per-worker handle opened on the worker's copy of the dataset.
    info = torch.utils.data.get_worker_info()
    info.dataset.opened = f"handle {worker_id}"


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_get_worker_info_names_the_users_dataset(folder, context):
    ds = _InfoDataset(folder)
    loader = ct.DataLoader(ds, batch_size=5, num_workers=2, worker_init_fn=_open_handle, multiprocessing_context=context, collate_fn=list)
    got = [x for b in loader for x in b]
    assert loader._cv.adapter is not None  # served through clairvoyant's dataset in the workers
    loader.close()
    assert got == [(True, True, "_InfoDataset")] * len(ds)


def test_dropping_the_iterator_of_persistent_workers_stops_them(folder):
    """As torch's: the workers exit when the iterator is deleted (no wait for the cyclic
    garbage collector), also while its epoch is unfinished and the loader is gone."""
    for ds in (torch.utils.data.TensorDataset(torch.arange(40)), torchvision.datasets.ImageFolder(folder, T.ToTensor())):
        gc.collect()
        gc.disable()
        try:
            it = iter(ct.DataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True))
            workers = list(it._workers)
            for i, _ in enumerate(it):
                if i == 3:
                    break
            del it
            for w in workers:
                w.join(30)
                assert not w.is_alive(), "a persistent worker outlived its iterator"
        finally:
            gc.enable()


def test_a_persistent_iterator_outliving_its_loader_finishes_its_epoch(folder):
    ds = torchvision.datasets.ImageFolder(folder, T.ToTensor())
    want = [y.tolist() for _, y in torch.utils.data.dataloader.DataLoader(ds, batch_size=4)]
    it = iter(ct.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True))
    gc.collect()
    assert [y.tolist() for _, y in it] == want


def test_spawned_ranks_exiting_without_close_leave_no_staging_ring(folder, tmp_path):
    """Two spawned ranks (as ``mp.spawn`` runs them) read a few batches with worker processes
    and end with ``os._exit``: no staging ring remains in the shared-memory directory, nor was
    one ever named there (the ring goes with its process)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    shm = tmp_path / "shm"
    shm.mkdir()
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys
            import torch, torch.multiprocessing as mp, torchvision
            import torchvision.transforms as T
            import clairvoyant.torch.patch
            from torch.utils.data import DataLoader, DistributedSampler

            def rank(r, out):
                ds = torchvision.datasets.ImageFolder({folder!r}, T.ToTensor())
                s = DistributedSampler(ds, num_replicas=2, rank=r)
                loader = DataLoader(ds, batch_size=3, sampler=s, num_workers=2, native_decode=False)
                it = iter(loader)
                next(it); next(it)
                rings = [f for _, _, fs in os.walk({str(shm)!r}) for f in fs if f.endswith(".ring")]
                segments = list(loader._cv.job.segments)
                with open(os.path.join(out, f"rank{{r}}.json"), "w") as f:
                    json.dump(dict(rings=rings, ring=segments[0], readable=os.path.getsize(segments[0])), f)
                os._exit(0)  # no close(), no interpreter shutdown

            if __name__ == "__main__":
                mp.spawn(rank, args=(sys.argv[1],), nprocs=2)
            """
        )
    )
    env = dict(os.environ, CLAIRVOYANT_SHM_DIR=str(shm), CLAIRVOYANT_QUIET="1")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["rings"] == [], f"rank {r} named its ring in the directory: {seen['rings']}"
        assert seen["readable"] > 0  # workers open it by the rank's descriptor
    left = sorted(str(p.relative_to(shm)) for p in shm.rglob("*.ring"))
    assert left == [], f"staging rings left by ranks that are gone: {left}"


def test_an_iterable_dataset_is_loaded_as_torch_loads_it_with_a_notice(capfd, monkeypatch):
    monkeypatch.delenv("CLAIRVOYANT_QUIET", raising=False)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    loader = ct.DataLoader(Stream(), batch_size=2)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    err = capfd.readouterr().err
    assert err.count("not cached: Stream is an iterable-style dataset") == 1, err
