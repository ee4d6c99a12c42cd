"""clairvoyant.torch.DataLoader decodes an ImageFolder natively when its transforms are known.

The native path (python/clairvoyant/torch/_native_loader.py) must yield the same samples in the
same order as the worker path, pixels within docs/decode.md's tolerance of torchvision's, leave
torch's random generators as torch's iterator leaves them, resume exactly, and raise a decode
error at its batch naming the file; anything it does not know keeps torch's exact batches.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tv = pytest.importorskip("torchvision")
from PIL import Image  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402
from torchvision import transforms as T  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import clairvoyant  # noqa: E402
import clairvoyant.torch as ct  # noqa: E402
from clairvoyant.torch._native_loader import NativeIter  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
# JPEG decode (docs/decode.md: <= 6 levels) then resampling (<= 2), after Normalize's 1/std.
TOL = 8 / 255 / min(STD) + 1e-5


def natural(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 37 + c + seed) * np.cos(y / 23 - c) for c in (0, 1, 2)], -1)
    noise = rng.normal(0, 12, (h // 4 + 1, w // 4 + 1, 3)).repeat(4, 0).repeat(4, 1)[:h, :w]
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("native-folder")
    for c in range(3):
        (root / f"c{c}").mkdir()
        for j in range(9):
            natural(50 + 7 * j, 40 + 5 * j, seed=10 * c + j).save(root / f"c{c}" / f"{j}.jpg", quality=92)
    return str(root)


def val_tf():
    return T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(), T.Normalize(MEAN, STD)])


def train_tf(kind: str = "v1"):
    if kind == "v2":
        return v2.Compose(
            [v2.RandomResizedCrop(24), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
        )
    return T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])


@pytest.fixture(autouse=True)
def _quiet_and_no_env(monkeypatch):
    monkeypatch.delenv("CLAIRVOYANT_NATIVE_DECODE", raising=False)


def batches(loader, epochs: int = 1, sampler=None, seed_each_epoch: bool = True) -> tuple:
    """(per-batch (images, labels) clones, iterator types, torch's global draws after each epoch)."""
    out, kinds, after = [], [], []
    for e in range(epochs):
        if seed_each_epoch:
            torch.manual_seed(100 + e)
        if sampler is not None:
            sampler.set_epoch(e)
        it = iter(loader)
        kinds.append(type(it))
        out += [(x.clone(), y.clone()) for x, y in it]
        after.append(torch.randint(0, 2**31, (4,)).tolist())  # what the training loop would draw next
    if hasattr(loader, "close"):
        loader.close()
    return out, kinds, after


@pytest.mark.parametrize("workers", [0, 2])
def test_known_transforms_are_decoded_natively_within_tolerance(folder, workers):
    ds = tv.datasets.ImageFolder(folder, val_tf())
    loader = ct.DataLoader(ds, batch_size=4, num_workers=workers)
    ours, kinds, _ = batches(loader)
    theirs, _, _ = batches(torch.utils.data.DataLoader(ds, batch_size=4))
    assert kinds == [NativeIter]
    assert loader._cv_native.threads == max(1, workers)  # num_workers -> decode threads (0 -> 1)
    assert len(ours) == len(theirs) == len(loader)
    for (a, ya), (b, yb) in zip(ours, theirs):
        assert torch.equal(ya, yb) and ya.dtype == torch.int64
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        assert (a - b).abs().max().item() <= TOL


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda: T.Compose([T.CenterCrop(32), T.PILToTensor()]), id="v1_uint8"),
        pytest.param(lambda: v2.Compose([v2.CenterCrop(32), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]), id="v2_float"),
    ],
)
def test_uint8_and_v2_outputs(folder, transform):
    ds = tv.datasets.ImageFolder(folder, transform())
    ours, kinds, _ = batches(ct.DataLoader(ds, batch_size=5))
    theirs, _, _ = batches(torch.utils.data.DataLoader(ds, batch_size=5))
    assert kinds == [NativeIter]
    for (a, _), (b, _) in zip(ours, theirs):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert (a.double() - b.double()).abs().max().item() <= (6 if a.dtype == torch.uint8 else 6 / 255 + 1e-6)


def test_unknown_transforms_and_opt_outs_keep_torchs_exact_batches(folder, monkeypatch):
    def same_as_torch(ds, **kw):
        ours, kinds, _ = batches(ct.DataLoader(ds, batch_size=4, **kw))
        theirs, _, _ = batches(torch.utils.data.DataLoader(ds, batch_size=4, **{k: v for k, v in kw.items() if k != "native_decode"}))
        assert kinds[0] is not NativeIter
        assert len(ours) == len(theirs)
        for (a, ya), (b, yb) in zip(ours, theirs):
            assert torch.equal(a, b) and torch.equal(ya, yb)

    same_as_torch(tv.datasets.ImageFolder(folder, T.Compose([T.CenterCrop(32), T.ColorJitter(0.2), T.ToTensor()])))
    same_as_torch(tv.datasets.ImageFolder(folder, val_tf()), native_decode=False)
    same_as_torch(tv.datasets.ImageFolder(folder, val_tf()), collate_fn=lambda items: torch.utils.data.default_collate(items))

    class Mine(tv.datasets.ImageFolder):
        def __getitem__(self, i):
            return super().__getitem__(i)

    same_as_torch(Mine(folder, val_tf()))
    monkeypatch.setenv("CLAIRVOYANT_NATIVE_DECODE", "0")
    same_as_torch(tv.datasets.ImageFolder(folder, val_tf()))
    with pytest.raises(TypeError, match="native_decode"):
        ct.DataLoader(tv.datasets.ImageFolder(folder, val_tf()), native_decode="yes")


def test_one_notice_says_which_path_runs(folder, capfd, monkeypatch):
    monkeypatch.delenv("CLAIRVOYANT_QUIET", raising=False)
    batches(ct.DataLoader(tv.datasets.ImageFolder(folder, val_tf()), batch_size=8), epochs=2)
    err = capfd.readouterr().err
    assert err.count("decoded natively on 1 thread") == 1, err
    assert "native_decode=False" in err
    jitter = T.Compose([T.CenterCrop(32), T.ColorJitter(0.2), T.ToTensor()])
    batches(ct.DataLoader(tv.datasets.ImageFolder(folder, jitter), batch_size=8), epochs=2)
    err = capfd.readouterr().err
    assert err.count("decoded as torch's DataLoader decodes it") == 1 and "ColorJitter" in err, err


def _sampler_kw(kind: str, ds) -> dict:
    if kind == "distributed":
        return {"sampler": DistributedSampler(ds, num_replicas=2, rank=1, seed=3)}
    if kind == "generator":
        return {"shuffle": True, "generator": torch.Generator().manual_seed(5)}
    if kind == "global":
        return {"shuffle": True}
    return {}


@pytest.mark.parametrize("kind", ["distributed", "generator", "global", "sequential"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_same_samples_in_the_same_order_as_the_worker_path(folder, kind, workers, persistent):
    """Labels of every batch over 2 epochs equal the worker path's, and (with workers) the
    training loop's own draws from torch's global generator after each epoch are the same too."""

    def run(native: bool) -> tuple:
        ds = tv.datasets.ImageFolder(folder, train_tf("v2" if workers else "v1"))
        kw = _sampler_kw(kind, ds)
        loader = ct.DataLoader(ds, batch_size=4, num_workers=workers, persistent_workers=persistent, native_decode=native, **kw)
        n = len(loader)
        got, kinds, after = batches(loader, epochs=2, sampler=kw.get("sampler"))
        return [y for _, y in got], kinds, after, n, [x.shape for x, _ in got]

    labels, kinds, after, n, shapes = run(True)
    want, wkinds, wafter, wn, wshapes = run(False)
    assert set(kinds) == {NativeIter} and NativeIter not in wkinds
    assert n == wn and len(labels) == len(want) == 2 * n
    assert all(torch.equal(a, b) for a, b in zip(labels, want))
    assert shapes == wshapes
    if workers > 0:
        # torch's generators advanced exactly as with torch's iterator. (With num_workers=0
        # torch's random transforms draw from the training process's generator; native ones do not.)
        assert after == wafter


def test_crops_follow_the_seed_and_are_reproducible(folder):
    def run(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        ds = tv.datasets.ImageFolder(folder, train_tf())
        got, _, _ = batches(ct.DataLoader(ds, batch_size=9, shuffle=True), epochs=2, seed_each_epoch=False)
        return torch.cat([x for x, _ in got])

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # A flip and a crop happen: not every sample is its unflipped centre.
    assert a.std() > 0


@pytest.mark.parametrize("workers,workers_after", [(0, 0), (2, 2), (2, 0)])
def test_resume_mid_epoch_continues_with_the_next_batch_exactly(folder, workers, workers_after):
    def make(w):
        ds = tv.datasets.ImageFolder(folder, train_tf())
        s = DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
        return ct.DataLoader(ds, batch_size=4, sampler=s, num_workers=w), s

    loader, s = make(workers)
    ref, _, _ = batches(loader, epochs=2, sampler=s)
    loader, s = make(workers)
    torch.manual_seed(100)
    got = []
    for k, (x, y) in enumerate(loader):
        got.append((x.clone(), y.clone()))
        if k == 2:
            state = loader.state_dict()
            break
    loader.close()
    assert state["yielded"] == 3 and isinstance(state["native_seed"], int)
    loader, s = make(workers_after)
    loader.load_state_dict(state)
    more, _, _ = batches(loader, epochs=2, sampler=s)
    got += more
    assert len(got) == len(ref)
    for (a, ya), (b, yb) in zip(got, ref):
        assert torch.equal(ya, yb)
        assert torch.equal(a, b)  # the crops of the resumed epoch are the interrupted run's


def test_a_corrupt_jpeg_raises_at_its_batch_naming_the_file(tmp_path):
    root = tmp_path / "corrupt"
    (root / "a").mkdir(parents=True)
    for j in range(4):
        natural(50, 50, j).save(root / "a" / f"{j}_good.jpg")
    data = (root / "a" / "0_good.jpg").read_bytes()
    (root / "a" / "5_bad.jpg").write_bytes(data[: len(data) // 3])
    natural(50, 50, 9).save(root / "a" / "6_good.jpg")
    ds = tv.datasets.ImageFolder(str(root), val_tf())
    for workers in (0, 2):
        loader = ct.DataLoader(ds, batch_size=4, num_workers=workers)
        it = iter(loader)
        assert type(it) is NativeIter
        x, y = next(it)  # the first batch is whole
        assert x.shape == (4, 3, 32, 32)
        with pytest.raises(clairvoyant.CorruptError, match="5_bad.jpg"):
            next(it)
        loader.close()


def test_formats_the_native_decoder_refuses_go_through_pillow(tmp_path):
    root = tmp_path / "mixed"
    (root / "a").mkdir(parents=True)
    natural(50, 50, 1).save(root / "a" / "x.jpg")
    natural(50, 50, 2).save(root / "a" / "y.bmp")
    ds = tv.datasets.ImageFolder(str(root), val_tf())
    ours, kinds, _ = batches(ct.DataLoader(ds, batch_size=2))
    theirs, _, _ = batches(torch.utils.data.DataLoader(ds, batch_size=2))
    assert kinds == [NativeIter]
    assert (ours[0][0][1] - theirs[0][0][1]).abs().max() <= 1e-5  # the BMP went through Pillow
    assert (ours[0][0][0] - theirs[0][0][0]).abs().max() <= TOL


def test_kept_batches_are_never_overwritten_and_dropped_ones_are_reused(folder):
    ds = tv.datasets.ImageFolder(folder, val_tf())
    loader = ct.DataLoader(ds, batch_size=3, shuffle=False)
    kept = [(x, x.clone()) for x, _ in loader]  # the loop keeps every batch tensor
    assert all(torch.equal(a, b) for a, b in kept)
    assert len({a.data_ptr() for a, _ in kept}) == len(kept)
    del kept  # every batch is dropped from here on: the ring's buffers are free again
    ptrs = set()
    for _ in range(2):
        for x, _ in loader:
            ptrs.add(x.data_ptr())
            del x
    loader.close()
    assert len(ptrs) <= 4, ptrs  # a ring of depth + 2 buffers, reused


def test_subset_and_peek(folder):
    base = tv.datasets.ImageFolder(folder, val_tf())
    ds = torch.utils.data.Subset(base, list(range(2, 27, 2)))
    loader = ct.DataLoader(ds, batch_size=4)
    first = next(iter(loader))  # a peek, then the whole epoch
    ours, kinds, _ = batches(loader)
    theirs, _, _ = batches(torch.utils.data.DataLoader(ds, batch_size=4))
    assert kinds == [NativeIter]
    assert torch.equal(first[1], theirs[0][1])
    assert [y.tolist() for _, y in ours] == [y.tolist() for _, y in theirs]


def test_pin_memory(folder):
    ds = tv.datasets.ImageFolder(folder, val_tf())
    if not torch.cuda.is_available():
        # No accelerator: plain memory (torch warns that it cannot pin, as with its own loader).
        with pytest.warns(UserWarning, match="pin_memory"):
            got, kinds, _ = batches(ct.DataLoader(ds, batch_size=4, pin_memory=True))
        assert kinds == [NativeIter] and not got[0][0].is_pinned()
        pytest.skip("no CUDA device: pinned batches not checked (plain memory checked)")
    loader = ct.DataLoader(ds, batch_size=4, pin_memory=True, num_workers=2)
    n = 0
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        x.to("cuda", non_blocking=True)
        n += len(y)
    loader.close()
    assert n == len(ds)


def test_no_stray_decode_threads_after_close(folder):
    import threading

    before = {t for t in threading.enumerate() if t.name == "clairvoyant-decode"}
    loader = ct.DataLoader(tv.datasets.ImageFolder(folder, val_tf()), batch_size=4)
    it = iter(loader)
    next(it)
    loader.close()
    it._shutdown_workers()
    del it
    left = {t for t in threading.enumerate() if t.name == "clairvoyant-decode"} - before
    for t in left:
        t.join(timeout=5)
    assert not [t for t in left if t.is_alive()]
