"""clairvoyant.torch.DataLoader is a torch.utils.data.DataLoader with torch's constructor.

Each check builds torch's DataLoader and clairvoyant's with the same arguments and compares what
torch defines: the signature, the attributes, ``len()``, the exceptions for invalid arguments,
a framework's rebuild with an injected DistributedSampler, and pickling of the dataset.
"""

from __future__ import annotations

import inspect
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")
pytest.importorskip("PIL")

import clairvoyant.torch as ctorch  # noqa: E402
from torch.utils.data import (  # noqa: E402
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

COUNTS = (7, 5, 6, 5)  # 23 images


class TorchsOwn(DataLoader):
    """Stands in for clairvoyant's DataLoader when ``CLAIRVOYANT_DROPIN_LOADER=torch``: the suite
    then checks itself against a bare subclass of torch's."""


Loader = TorchsOwn if os.environ.get("CLAIRVOYANT_DROPIN_LOADER") == "torch" else ctorch.DataLoader


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("dropin-api") / "train"
    rng = np.random.default_rng(3)
    for c, n in enumerate(COUNTS):
        (root / f"c{c}").mkdir(parents=True)
        for j in range(n):
            h, w = (int(x) for x in rng.integers(16, 40, size=2))
            Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{j}.png")
    return root


def to_tensor(img):
    """Deterministic, module level (picklable)."""
    a = np.asarray(img.convert("RGB").resize((8, 8)), dtype=np.float32) / 255.0
    return torch.from_numpy(a).permute(2, 0, 1).contiguous()


def collate_labels(samples):
    return torch.tensor([s[1] for s in samples])


def init_worker(worker_id):
    pass


@pytest.fixture
def dataset(image_dir):
    return torchvision.datasets.ImageFolder(str(image_dir), to_tensor)


ATTRS = (
    "batch_size",
    "drop_last",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "pin_memory_device",
    "timeout",
    "worker_init_fn",
    "persistent_workers",
    "in_order",
    "collate_fn",
    "generator",
)


def sampler_summary(s):
    """What identifies a sampler: its class and, where it has them, its settings."""
    keys = ("num_replicas", "rank", "shuffle", "drop_last", "seed", "batch_size", "replacement", "num_samples")
    out = {"type": type(s)}
    for k in keys:
        if hasattr(s, k):
            try:
                out[k] = getattr(s, k)
            except (TypeError, ValueError):  # e.g. RandomSampler.num_samples with no data
                pass
    if isinstance(s, BatchSampler):
        out["sampler"] = sampler_summary(s.sampler)
    return out


def assert_like_torch(ours, theirs, given_sampler=None, given_batch_sampler=None):
    assert isinstance(ours, DataLoader)
    assert ours.dataset is theirs.dataset
    for name in ATTRS:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    assert sampler_summary(ours.sampler) == sampler_summary(theirs.sampler)
    if theirs.batch_sampler is None:
        assert ours.batch_sampler is None
    else:
        assert sampler_summary(ours.batch_sampler) == sampler_summary(theirs.batch_sampler)
        assert len(ours.batch_sampler) == len(theirs.batch_sampler)
    if given_sampler is not None:
        assert ours.sampler is given_sampler
    if given_batch_sampler is not None:
        assert ours.batch_sampler is given_batch_sampler
    assert (ours.multiprocessing_context is None) == (theirs.multiprocessing_context is None)
    if theirs.multiprocessing_context is not None:
        assert ours.multiprocessing_context.get_start_method() == theirs.multiprocessing_context.get_start_method()


COMBOS = {
    "defaults": lambda ds: {},
    "batch8_shuffle": lambda ds: {"batch_size": 8, "shuffle": True},
    "batch7_drop_last": lambda ds: {"batch_size": 7, "drop_last": True},
    "batch7_keep_last": lambda ds: {"batch_size": 7, "shuffle": False},
    "no_batching": lambda ds: {"batch_size": None},
    "sequential_sampler": lambda ds: {"sampler": SequentialSampler(ds), "batch_size": 5},
    "distributed_sampler": lambda ds: {
        "sampler": DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=4),
        "batch_size": 4,
        "drop_last": True,
    },
    "distributed_sampler_drop_last": lambda ds: {
        "sampler": DistributedSampler(ds, num_replicas=3, rank=2, drop_last=True),
        "batch_size": 3,
    },
    "random_sampler_replacement": lambda ds: {
        "sampler": RandomSampler(ds, replacement=True, num_samples=10),
        "batch_size": 4,
    },
    "batch_sampler": lambda ds: {"batch_sampler": BatchSampler(RandomSampler(ds), 6, False)},
    "workers": lambda ds: {
        "batch_size": 4,
        "num_workers": 2,
        "prefetch_factor": 3,
        "persistent_workers": True,
        "multiprocessing_context": "spawn",
        "worker_init_fn": init_worker,
        "collate_fn": collate_labels,
        "timeout": 7,
        "in_order": False,
    },
    "generator": lambda ds: {"batch_size": 4, "shuffle": True, "generator": torch.Generator().manual_seed(1)},
}


@pytest.mark.parametrize("combo", list(COMBOS), ids=list(COMBOS))
def test_attributes_and_len_as_torch(combo, dataset):
    kwargs = COMBOS[combo](dataset)
    theirs = DataLoader(dataset, **kwargs)
    ours = Loader(dataset, **kwargs)
    assert_like_torch(ours, theirs, kwargs.get("sampler"), kwargs.get("batch_sampler"))


def test_any_map_style_dataset(dataset):
    ds = TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10))
    for kwargs in ({}, {"batch_size": 3, "shuffle": True}, {"batch_size": 3, "drop_last": True}):
        assert_like_torch(Loader(ds, **kwargs), DataLoader(ds, **kwargs))


def test_is_a_torch_dataloader(dataset):
    assert issubclass(Loader, DataLoader)
    assert isinstance(Loader(dataset), DataLoader)


def torch_parameters():
    return list(inspect.signature(DataLoader.__init__).parameters.values())[1:]  # without self


def test_signature_is_torchs_plus_keyword_only_extras():
    theirs = torch_parameters()
    ours = list(inspect.signature(Loader.__init__).parameters.values())[1:]
    by_name = {p.name: p for p in ours}
    for p in theirs:
        assert p.name in by_name, f"clairvoyant's DataLoader lacks torch's argument {p.name!r}"
        q = by_name[p.name]
        assert q.kind == p.kind, f"{p.name}: {q.kind} (torch: {p.kind})"
        assert q.default == p.default or (q.default is None and p.default is None), p.name
    # torch's arguments first, in torch's order; anything more is keyword-only with a default.
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    for q in ours[len(theirs) :]:
        assert q.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD), q.name
        assert q.kind == inspect.Parameter.VAR_KEYWORD or q.default is not inspect.Parameter.empty, q.name


def every_argument(dataset):
    """Every torch argument with a value other than its default (where a valid one exists)."""
    return {
        "dataset": dataset,
        "batch_size": 4,
        "shuffle": True,
        "sampler": None,
        "batch_sampler": None,
        "num_workers": 1,
        "collate_fn": collate_labels,
        "pin_memory": False,
        "drop_last": True,
        "timeout": 3,
        "worker_init_fn": init_worker,
        "multiprocessing_context": "forkserver",
        "generator": torch.Generator().manual_seed(2),
        "prefetch_factor": 4,
        "persistent_workers": True,
        "pin_memory_device": "",
        "in_order": False,
    }


def test_every_argument_by_keyword(dataset):
    kwargs = every_argument(dataset)
    assert set(kwargs) == {p.name for p in torch_parameters()}
    assert_like_torch(Loader(**kwargs), DataLoader(**kwargs))


def test_every_positional_argument_positionally(dataset):
    kwargs = every_argument(dataset)
    positional = [p.name for p in torch_parameters() if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    args = [kwargs.pop(name) for name in positional]
    assert_like_torch(Loader(*args, **kwargs), DataLoader(*args, **kwargs))


INVALID = {
    "shuffle_with_sampler": lambda ds: {"shuffle": True, "sampler": SequentialSampler(ds)},
    "batch_sampler_with_batch_size": lambda ds: {"batch_sampler": BatchSampler(SequentialSampler(ds), 2, False), "batch_size": 2},
    "batch_sampler_with_shuffle": lambda ds: {"batch_sampler": BatchSampler(SequentialSampler(ds), 2, False), "shuffle": True},
    "batch_sampler_with_drop_last": lambda ds: {"batch_sampler": BatchSampler(SequentialSampler(ds), 2, False), "drop_last": True},
    "batch_sampler_with_sampler": lambda ds: {
        "batch_sampler": BatchSampler(SequentialSampler(ds), 2, False),
        "sampler": SequentialSampler(ds),
    },
    "no_batching_with_drop_last": lambda ds: {"batch_size": None, "drop_last": True},
    "negative_workers": lambda ds: {"num_workers": -1},
    "negative_timeout": lambda ds: {"timeout": -1},
    "prefetch_factor_without_workers": lambda ds: {"prefetch_factor": 2},
    "persistent_workers_without_workers": lambda ds: {"persistent_workers": True},
    "unknown_start_method": lambda ds: {"num_workers": 1, "multiprocessing_context": "no-such-method"},
    "start_method_without_workers": lambda ds: {"multiprocessing_context": "spawn"},
    "unknown_argument": lambda ds: {"no_such_argument": 1},
}


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_arguments_raise_as_torch(case, dataset):
    kwargs = INVALID[case](dataset)
    with pytest.raises(Exception) as theirs:
        DataLoader(dataset, **kwargs)
    with pytest.raises(Exception) as ours:
        Loader(dataset, **kwargs)
    assert isinstance(ours.value, type(theirs.value)), (
        f"{case}: clairvoyant raised {type(ours.value).__name__}: {ours.value}; torch raises {type(theirs.value).__name__}: {theirs.value}"
    )


@pytest.mark.parametrize(
    "name,value", [("batch_size", 3), ("sampler", None), ("batch_sampler", None), ("drop_last", True), ("dataset", None)]
)
def test_attributes_fixed_after_construction_as_torch(name, value, dataset):
    theirs = DataLoader(dataset, batch_size=4)
    with pytest.raises(Exception) as err:
        setattr(theirs, name, value)
    ours = Loader(dataset, batch_size=4)
    with pytest.raises(type(err.value)):
        setattr(ours, name, value)


def rebuild(loader, sampler):
    """A framework's way (as Lightning does) of injecting a sampler: read the constructor's
    arguments back from the loader's attributes and construct its class again."""
    skip = {"self", "dataset", "sampler", "batch_sampler", "shuffle"}
    kwargs = {}
    for p in inspect.signature(type(loader).__init__).parameters.values():
        if p.name in skip or p.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL):
            continue
        if hasattr(loader, p.name):
            kwargs[p.name] = getattr(loader, p.name)
    return type(loader)(loader.dataset, sampler=sampler, shuffle=False, **kwargs)


@pytest.mark.parametrize("workers", [0, 2])
def test_framework_rebuild_with_distributed_sampler(workers, dataset):
    kw = {"batch_size": 4, "shuffle": True, "num_workers": workers}
    theirs = rebuild(DataLoader(dataset, **kw), DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=False)
    ours = rebuild(Loader(dataset, **kw), sampler)
    assert type(ours) is Loader
    assert_like_torch(ours, theirs, given_sampler=sampler)
    got = [labels.tolist() for _, labels in ours]
    want = [labels.tolist() for _, labels in theirs]
    assert got == want


def test_dataset_pickles(dataset):
    loader = Loader(dataset, batch_size=4, shuffle=True)
    iter(loader)  # whatever the loader attaches to the dataset when it starts
    restored = pickle.loads(pickle.dumps(loader.dataset))
    assert len(restored) == len(dataset)
    for i in (0, 11, len(dataset) - 1):
        img, label = restored[i]
        want_img, want_label = dataset[i]
        assert label == want_label
        assert torch.equal(img, want_img)
    sampler = pickle.loads(pickle.dumps(loader.sampler))
    assert type(sampler) is type(loader.sampler)


def test_a_run_leaves_nothing_behind(image_dir, tmp_path):
    """A training script's run through the drop-in ends normally: its shared-memory and
    temporary folders hold no file of it, and the cache folder only the dataset's index."""
    import subprocess
    import sys
    import textwrap

    shm, tmp, cache = tmp_path / "shm", tmp_path / "tmp", tmp_path / "cache"
    for d in (shm, tmp):
        d.mkdir()
    script = textwrap.dedent(
        f"""
        import torch, torchvision
        import clairvoyant.torch as ctorch

        def to_tensor(img):
            return torch.zeros(1)

        ds = torchvision.datasets.ImageFolder({str(image_dir)!r}, to_tensor)
        loader = ctorch.DataLoader(ds, batch_size=4, shuffle=True)
        for epoch in range(2):
            assert sum(len(y) for _, y in loader) == len(ds)
        """
    )
    env = {**os.environ, "CLAIRVOYANT_SHM_DIR": str(shm), "TMPDIR": str(tmp), "CLAIRVOYANT_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (shm / f"clairvoyant-{os.geteuid()}").is_dir(), "the run used this shared-memory folder"
    for d in (shm, tmp):
        left = [os.path.join(p, f) for p, _, fs in os.walk(d) for f in fs]
        assert left == [], left
    kept = [f for _, _, fs in os.walk(cache) for f in fs]
    assert kept and not [f for f in kept if f.endswith(".lock")], kept
