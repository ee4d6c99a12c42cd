"""clairvoyant.torch.DataLoader in one process: same batches as torch's DataLoader, the
sampler's order read without disturbing it, peeks, resume, fallbacks, rank checks, the dataset
protocol, and forked workers that cannot hurt the job."""

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import plain_files
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
from PIL import Image  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchvision import transforms as T  # noqa: E402

import clairvoyant  # noqa: E402
import clairvoyant.torch as ct  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(7)
    for c in range(3):
        (root / f"class{c}").mkdir()
        for i in range(15):
            h, w = rng.integers(12, 40, 2)
            Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.jpg")
    return str(root)


def _tf():
    return T.Compose([T.RandomResizedCrop(12), T.RandomHorizontalFlip(), T.ToTensor()])


def _digest(batch) -> str:
    x, y = batch
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16] + "|" + ",".join(map(str, y.tolist()))


def _run(DL, folder, epochs=3, sampler="dist", workers=0, peek=False, **kw):
    torch.manual_seed(0)
    ds = torchvision.datasets.ImageFolder(folder, _tf())
    if sampler == "dist":
        s = DistributedSampler(ds, num_replicas=2, rank=1, seed=3)
        kw["sampler"] = s
    elif sampler == "gen":
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(5))
    elif sampler == "global":
        kw.update(shuffle=True)
    if DL is ct.DataLoader:
        kw.setdefault("native_decode", False)  # torch's exact batches (these transforms are native otherwise)
    loader = DL(ds, batch_size=4, num_workers=workers, **kw)
    out = []
    for e in range(epochs):
        torch.manual_seed(100 + e)  # as a script that restores its RNG would be, run after run
        if sampler == "dist":
            s.set_epoch(e)
        if peek:
            out.append(("peek", _digest(next(iter(loader)))))
        out += [(e, _digest(b)) for b in loader]
    if isinstance(loader, ct.DataLoader):
        loader.close()
    return out


@pytest.mark.parametrize("sampler", ["dist", "gen", "global", "sequential"])
@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_as_torch(folder, sampler, workers):
    ref = _run(torch.utils.data.DataLoader, folder, sampler=sampler, workers=workers)
    got = _run(ct.DataLoader, folder, sampler=sampler, workers=workers)
    assert got == ref


@pytest.mark.parametrize("sampler,early", [("dist", True), ("sequential", True), ("gen", False), ("global", False)])
def test_a_first_epoch_known_without_drawing_starts_the_job_before_the_workers_fork(folder, monkeypatch, sampler, early):
    """A DistributedSampler's or SequentialSampler's first epoch is known without drawing from a
    generator: the engine reads while torch's workers start. A random sampler's is drawn by
    torch's iterator after the fork (drawing it earlier would shift torch's generator)."""
    from clairvoyant.torch import _dropin

    started = []
    init = _dropin._Iter.__init__

    def spy(self, view):
        started.append(view._index_sampler._feed.job is not None)
        init(self, view)

    monkeypatch.setattr(_dropin._Iter, "__init__", spy)
    got = _run(ct.DataLoader, folder, epochs=2, sampler=sampler, workers=2)
    assert started == [early, True]
    assert got == _run(torch.utils.data.DataLoader, folder, epochs=2, sampler=sampler, workers=2)


def test_peeking_restarts_the_epoch_as_torch_does(folder):
    ref = _run(torch.utils.data.DataLoader, folder, peek=True, workers=2)
    got = _run(ct.DataLoader, folder, peek=True, workers=2)
    assert got == ref
    # A peek consumes nothing: the epoch that follows is the whole epoch.
    assert [d for e, d in got if e == 0] == [d for e, d in ref if e == 0]


def test_persistent_workers_and_an_unknown_number_of_epochs(folder):
    ref = _run(torch.utils.data.DataLoader, folder, epochs=4, workers=2, persistent_workers=True)
    got = _run(ct.DataLoader, folder, epochs=4, workers=2, persistent_workers=True)
    assert got == ref


def test_the_bytes_come_from_clairvoyant(folder):
    ds = torchvision.datasets.ImageFolder(folder, _tf())
    loader = ct.DataLoader(ds, batch_size=5, shuffle=True, num_workers=0)
    n = sum(len(y) for _, y in loader)
    stats = loader._cv.job.stats()
    assert loader.peer_stats() is None  # one node: no peers
    loader.close()
    assert n == len(ds)
    assert stats[0]["samples"] == len(ds)  # every sample went through the engine
    assert loader.peer_stats() is None


def test_is_a_torch_dataloader_with_torchs_attributes(folder):
    ds = torchvision.datasets.ImageFolder(folder)
    for kw in [dict(batch_size=4), dict(batch_size=4, shuffle=True, drop_last=True), dict(batch_size=None)]:
        a, b = torch.utils.data.DataLoader(ds, **kw), ct.DataLoader(ds, **kw)
        assert isinstance(b, torch.utils.data.DataLoader)
        assert (len(a), a.batch_size, a.drop_last, type(a.sampler), type(a.batch_sampler)) == (
            len(b),
            b.batch_size,
            b.drop_last,
            type(b.sampler),
            type(b.batch_sampler),
        )
        assert b.dataset is ds
    with pytest.raises(ValueError):  # torch's own check
        ct.DataLoader(ds, shuffle=True, sampler=torch.utils.data.SequentialSampler(ds))


def test_an_unpredictable_sampler_is_said_once(folder, capfd):
    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    loader = ct.DataLoader(ds, batch_size=8, shuffle=True)  # torch's global generator
    for _ in range(2):
        assert sum(len(y) for _, y in loader) == len(ds)
    loader.close()
    err = capfd.readouterr().err
    assert err.count("RandomSampler's future order cannot be known") == 1
    assert "generator=" in err


def test_fakedata_falls_back_with_a_notice(capfd):
    ds = torchvision.datasets.FakeData(size=12, image_size=(3, 6, 6), transform=T.ToTensor())
    torch.manual_seed(1)
    ref = [_digest(b) for b in torch.utils.data.DataLoader(ds, batch_size=5, shuffle=True)]
    torch.manual_seed(1)
    loader = ct.DataLoader(ds, batch_size=5, shuffle=True)
    got = [_digest(b) for b in loader]
    assert got == ref
    err = capfd.readouterr().err
    assert err.count("clairvoyant: not cached: FakeData") == 1


def test_a_loader_that_reads_files_itself_falls_back(folder, capfd):
    def my_loader(path):
        return Image.open(path).convert("RGB")

    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]), loader=my_loader)
    got = [_digest(b) for b in ct.DataLoader(ds, batch_size=8)]
    ref = [_digest(b) for b in torch.utils.data.DataLoader(ds, batch_size=8)]
    assert got == ref
    assert "reads files itself" in capfd.readouterr().err


class _Protocol(torch.utils.data.Dataset):
    """Any dataset can be cached: it names each sample's file and computes the item from bytes."""

    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as f:
            return self.__clairvoyant_getitem__(i, f.read())

    def __clairvoyant_files__(self):
        return self.files

    def __clairvoyant_getitem__(self, i, data):
        return torch.tensor([i, len(data), sum(bytes(data[:64]))])


def test_dataset_protocol(folder):
    files = sorted(str(p) for p in __import__("pathlib").Path(folder).rglob("*.jpg"))
    ds = _Protocol(files)
    torch.manual_seed(3)
    ref = [b.tolist() for b in torch.utils.data.DataLoader(ds, batch_size=6, shuffle=True, num_workers=2)]
    torch.manual_seed(3)
    loader = ct.DataLoader(ds, batch_size=6, shuffle=True, num_workers=2)
    got = [b.tolist() for b in loader]
    assert loader._cv.job is not None
    loader.close()
    assert got == ref


def test_subset_of_an_imagefolder_is_cached(folder):
    ds = torch.utils.data.Subset(torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()])), list(range(3, 40, 2)))
    got = [_digest(b) for b in ct.DataLoader(ds, batch_size=4, native_decode=False)]
    ref = [_digest(b) for b in torch.utils.data.DataLoader(ds, batch_size=4)]
    assert got == ref


def test_rank_contradiction_is_an_error(folder, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = torchvision.datasets.ImageFolder(folder, T.ToTensor())
    s = DistributedSampler(ds, num_replicas=2, rank=0)
    loader = ct.DataLoader(ds, batch_size=4, sampler=s)
    with pytest.raises(clairvoyant.ConfigError, match="rank 0 of 2.*rank 1 of 4"):
        next(iter(loader))


@pytest.mark.parametrize("workers,workers_after", [(2, 2), (2, 3), (0, 0)])
def test_resume_mid_epoch_continues_with_the_next_batch(folder, workers, workers_after):
    ref = _run(ct.DataLoader, folder, epochs=2, workers=workers)
    ds = torchvision.datasets.ImageFolder(folder, _tf())
    s = DistributedSampler(ds, num_replicas=2, rank=1, seed=3)
    torch.manual_seed(100)
    loader = ct.DataLoader(ds, batch_size=4, sampler=s, num_workers=workers, native_decode=False)
    got = []
    for k, b in enumerate(loader):
        got.append((0, _digest(b)))
        if k == 2:
            state = loader.state_dict()
            break
    loader.close()
    assert state["yielded"] == 3 and state["epoch"] == 0
    assert len(__import__("pickle").dumps(state)) < 100_000  # positions and seeds, not orders
    ds = torchvision.datasets.ImageFolder(folder, _tf())
    s = DistributedSampler(ds, num_replicas=2, rank=1, seed=3)
    loader = ct.DataLoader(ds, batch_size=4, sampler=s, num_workers=workers_after, native_decode=False)
    loader.load_state_dict(state)
    for e in range(2):
        torch.manual_seed(100 + e)
        s.set_epoch(e)
        got += [(e, _digest(b)) for b in loader]
    loader.close()
    if workers == workers_after and workers > 0:
        assert got == ref  # with the same workers random transforms repeat too
    else:
        # The same samples in the same batches; augmentations are seeded per worker (or, with
        # no workers, drawn from the training process's generator, which the script restores).
        assert [(e, d.split("|")[1]) for e, d in got] == [(e, d.split("|")[1]) for e, d in ref]


def test_load_state_dict_rejects_what_is_not_a_state():
    ds = torchvision.datasets.FakeData(size=4)
    loader = ct.DataLoader(ds)
    with pytest.raises(clairvoyant.ConfigError, match="lacks"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(TypeError):
        loader.load_state_dict([1, 2])


def test_a_forked_worker_closing_the_job_does_not_hurt_the_parent(folder):
    """Whatever a forked worker garbage collects (the job, the loader), the parent's run goes on."""

    def init(_):
        import gc

        for obj in gc.get_objects():
            if isinstance(obj, (clairvoyant.Job, ct.DataLoader)):
                obj.close()
        gc.collect()

    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    loader = ct.DataLoader(ds, batch_size=4, num_workers=2, worker_init_fn=init, multiprocessing_context="fork")
    for _ in range(2):
        assert sum(len(y) for _, y in loader) == len(ds)
    loader.close()


def test_spawned_torch_workers_over_a_job_dataset(folder, tmp_path):
    """torch's own DataLoader with spawned workers over clairvoyant.torch.ImageFolder(job)."""
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch, clairvoyant, clairvoyant.torch as ct, torchvision.transforms as T
            if __name__ == "__main__":
                job = clairvoyant.Job({folder!r}, batch_size=4, epochs=1)
                ds = ct.ImageFolder(job, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
                loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
                print(sum(len(y) for _, y in loader))
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "45"


def test_a_worker_killed_with_sigkill_is_an_error_and_the_next_epoch_runs(folder):
    """As with torch: the iterator raises (no hang); the loader's next iter() starts afresh
    and the bytes of the abandoned batches are released."""
    import signal
    import time

    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    loader = ct.DataLoader(ds, batch_size=3, num_workers=2, timeout=20, native_decode=False)  # worker processes
    it = iter(loader)
    next(it)
    # Killed once idle, blocked on its index queue: a worker killed while it holds the lock of
    # torch's shared done event (it checks the event between tasks) leaves that lock taken, and
    # the iterator's own check of the event then waits forever (seen once under load).
    time.sleep(1.0)
    os.kill(it._workers[0].pid, signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly|killed"):
        for _ in it:
            pass
    assert time.monotonic() - t < 30
    del it
    assert sum(len(y) for _, y in loader) == len(ds)
    assert len(loader._cv.leases) <= 2 * 2 * 2  # only the new epoch's batches in flight
    loader.close()


class _Reversing(torch.utils.data.Sampler):
    """A deterministic sampler that tells its future through the protocol."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __clairvoyant_order__(self, epoch):
        order = list(range(self.n))
        return order[epoch % self.n :] + order[: epoch % self.n]

    def __iter__(self):
        return iter(self.__clairvoyant_order__(self.epoch))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("kind", ["distributed", "protocol", "generator"])
def test_predicted_epochs_are_served_from_the_prefetched_passes(folder, kind):
    """Clairvoyance: every epoch after the first was appended to the engine's stream before it
    began (the pass served is the predicted one, not one appended on demand)."""
    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    kw = {}
    if kind == "distributed":
        s = kw["sampler"] = DistributedSampler(ds, num_replicas=1, rank=0)
    elif kind == "protocol":
        s = kw["sampler"] = _Reversing(len(ds))
    else:
        s = None
        kw.update(shuffle=True, generator=torch.Generator().manual_seed(2))
    ref = torch.utils.data.DataLoader(ds, batch_size=4, **{**kw, "generator": torch.Generator().manual_seed(2)} if s is None else kw)
    loader = ct.DataLoader(ds, batch_size=4, **kw)
    got, want = [], []
    for e in range(4):
        if s is not None:
            s.set_epoch(e)
        got += [y.tolist() for _, y in loader]
        want += [y.tolist() for _, y in ref]
    served = loader._cv.served
    loader.close()
    assert got == want
    assert served == [(e, e) for e in range(4)]


def test_the_users_dataset_is_left_as_it_was(folder):
    """A single-process loader runs the dataset in the training process: its loader attribute
    must be the user's again after every item (another loader over it, a Subset, sees it)."""
    import torchvision.datasets.folder as tvf

    ds = torchvision.datasets.ImageFolder(folder, T.Compose([T.Resize((8, 8)), T.ToTensor()]))
    loader = ct.DataLoader(ds, batch_size=4)
    for _ in loader:
        assert ds.loader is tvf.default_loader
    aux = ct.DataLoader(torch.utils.data.Subset(ds, range(5)), batch_size=4)
    assert [len(y) for _, y in aux] == [4, 1]
    assert aux._cv.adapter is not None  # cached too
    loader.close()
    aux.close()


def test_no_pass_is_read_ahead_past_the_last_epoch(folder):
    # With the run's epochs known, the last epoch predicts no further pass: reading one ahead
    # would read samples from the file system that no epoch uses.
    ds = torchvision.datasets.ImageFolder(folder, _tf())
    s = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = ct.DataLoader(ds, batch_size=4, sampler=s, epochs=3)
    for e in range(3):
        s.set_epoch(e)
        sum(len(y) for _, y in loader)
    passes = loader._cv.job.epochs
    loader.close()
    assert passes == 3
    # Without a known end, the next epoch is read ahead.
    loader = ct.DataLoader(ds, batch_size=4, sampler=s)
    for e in range(3):
        s.set_epoch(e)
        sum(len(y) for _, y in loader)
    passes = loader._cv.job.epochs
    loader.close()
    assert passes == 4


def test_classifying_a_plain_dataset_imports_no_torchvision(tmp_path):
    """A dataset cannot be torchvision's when torchvision is not imported, so the drop-in does not
    import it (seconds per rank) to find out; the dataset is still cached and served."""
    script = tmp_path / "s.py"
    script.write_text(
        plain_files.make(tmp_path / "d")
        + textwrap.dedent(
            """
            import sys, clairvoyant.torch as ct

            loader = ct.DataLoader(Plain(files), batch_size=4)
            got = sorted(tuple(x) for b in loader for x in b.tolist())
            assert got == EXPECTED, got
            assert loader._cv.job is not None, "the dataset was not cached"
            loader.close()
            print("torchvision" in sys.modules)
            """
        )
    )
    env = dict(os.environ)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", out.stderr


def test_an_empty_jpeg_names_its_file(tmp_path):
    root = tmp_path / "imgs"
    (root / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(root / "a" / "good.jpg")
    (root / "a" / "empty.jpg").write_bytes(b"")
    ds = torchvision.datasets.ImageFolder(str(root), T.ToTensor())
    loader = ct.DataLoader(ds, batch_size=1, native_decode=False)
    try:
        with pytest.raises(Exception, match="empty.jpg") as info:
            for _ in loader:
                pass
        assert "BytesIO" not in str(info.value).split("): ")[0]
    finally:
        loader.close()
