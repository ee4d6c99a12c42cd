"""Real files: ImageFolder order, bytes, the index cache, the emulated file system, and every
failure mode a dataset can have (missing, changed, foreign index)."""

import multiprocessing as mp
import os

import numpy as np
import pytest

import clairvoyant


def make_tree(root, classes=("b_cls", "a_cls", "c_cls"), per_class=7):
    for ci, c in enumerate(classes):
        d = root / c / "sub"
        d.mkdir(parents=True)
        for i in range(per_class):
            name = f"img{i:02d}.JPG" if i % 3 == 0 else f"img{i:02d}.png"
            (d.parent if i % 2 else d).joinpath(name).write_bytes(bytes([ci, i]) * (50 + 13 * i))
        (root / c / "notes.txt").write_text("not an image")
    age_directories(root)
    return root


def age_directories(root, seconds=60):
    """Date directories back: an index only trusts directories that have been still for a while."""
    t = os.path.getmtime(root) - seconds
    for d, _, _ in os.walk(root):
        os.utime(d, (t, t))


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "data")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path / "cache"))


def test_order_and_labels_match_torchvision(tree):
    datasets = pytest.importorskip("torchvision.datasets", reason="torchvision is needed for the reference order")
    ref = datasets.ImageFolder(str(tree), loader=lambda p: p)
    src = clairvoyant.ImageFolder(tree)
    assert src.classes == ref.classes
    assert src.paths == [p for p, _ in ref.samples]
    assert src.labels.tolist() == [label for _, label in ref.samples]


def test_job_reads_file_bytes_and_reuses_the_index(tree):
    first = clairvoyant.ImageFolder(tree)
    assert not first.index_reused and os.path.exists(first.index_path)
    src = clairvoyant.ImageFolder(tree)
    assert src.index_reused
    with clairvoyant.Job(src, batch_size=4, epochs=2) as job:
        for e in range(2):
            for (sample, label), k in zip(job.epoch(e), job.samples_of(e)):
                with open(src.paths[k], "rb") as f:
                    assert bytes(sample) == f.read()
                assert label == src.labels[k]


def test_added_file_rebuilds_the_index(tree):
    clairvoyant.ImageFolder(tree)
    (tree / "a_cls" / "new.jpg").write_bytes(b"x" * 10)
    src = clairvoyant.ImageFolder(tree)
    assert not src.index_reused
    assert any(p.endswith("new.jpg") for p in src.paths)


def test_removed_file_rebuilds_the_index_without_it(tree):
    src = clairvoyant.ImageFolder(tree)
    victim = src.paths[4]
    os.remove(victim)
    src2 = clairvoyant.ImageFolder(tree)
    assert not src2.index_reused and victim not in src2.paths and len(src2) == len(src) - 1
    with clairvoyant.Job(src2, batch_size=3, epochs=1) as job:
        assert sum(1 for _ in job.epoch(0)) == len(src2)


def test_file_removed_after_indexing_raises_file_not_found(tree):
    src = clairvoyant.ImageFolder(tree)
    order = clairvoyant.access_stream(len(src), 1, 0, 1, 2, 0)[0]
    victim = src.paths[int(order[5])]
    os.remove(victim)
    # The index was loaded before the removal: the file is missed when it is read.
    job = clairvoyant.Job(src, batch_size=2, epochs=1)
    got, errs = [], []
    it = job.epoch(0)
    for _ in range(len(src)):
        try:
            got.append(next(it)[1])
        except FileNotFoundError as e:
            errs.append(str(e))
    assert len(errs) == 1 and victim in errs[0] and f"sample {int(order[5])}" in errs[0]
    assert len(got) == len(src) - 1
    job.close()


def test_file_changed_after_indexing_raises_dataset_changed(tree):
    src = clairvoyant.ImageFolder(tree)
    victim = src.paths[3]
    with open(victim, "ab") as f:
        f.write(b"more bytes")
    job = clairvoyant.Job(src, batch_size=2, epochs=1)
    with pytest.raises(clairvoyant.DatasetChangedError, match=os.path.basename(victim)):
        for _ in job.epoch(0):
            pass
    job.close()


def test_index_of_another_dataset_is_refused(tmp_path, tree):
    other = make_tree(tmp_path / "other", classes=("x",))
    idx = clairvoyant.ImageFolder(other).index_path
    with pytest.raises(clairvoyant.IndexMismatchError, match="other"):
        clairvoyant.ImageFolder(tree, index_path=idx)


def test_file_list_source(tmp_path, tree):
    src = clairvoyant.ImageFolder(tree)
    lst = tmp_path / "list.txt"
    lst.write_text("# path label\n" + "".join(f"{p} {int(l)}\n" for p, l in zip(src.paths, src.labels)))
    fl = clairvoyant.FileList(lst)
    assert fl.paths == src.paths and fl.labels.tolist() == src.labels.tolist()
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{src.paths[0]} 0\n{src.paths[1]} notalabel\n")
    with pytest.raises(clairvoyant.ConfigError, match="bad.txt.*2"):
        clairvoyant.FileList(bad)
    with pytest.raises(FileNotFoundError):
        clairvoyant.Job(tmp_path / "nope", batch_size=1, epochs=1)


def test_emulated_fs_counts_one_read_per_sample_over_the_run(tmp_path, tree):
    fs = clairvoyant.EmulatedFs(tmp_path / "fs.state", open_latency_ms=0.5, bandwidth_mbps=200)
    src = clairvoyant.ImageFolder(tree, emulated=fs)
    with clairvoyant.Job(src, batch_size=4, epochs=3) as job:
        for e in range(3):
            assert sum(1 for _ in job.epoch(e)) == len(src)
        stats = job.stats()
    assert fs.files_read == len(src)
    assert fs.bytes_read == src.total_bytes
    assert stats[2]["sources"]["memory"]["samples"] == len(src)


def _rank(rank, root, state, cache, q):
    os.environ["CLAIRVOYANT_CACHE_DIR"] = cache
    try:
        fs = clairvoyant.EmulatedFs(state, open_latency_ms=0.5, bandwidth_mbps=100)
        job = clairvoyant.Job(clairvoyant.ImageFolder(root, emulated=fs), batch_size=2, epochs=3, rank=rank, world_size=2, local_ranks=[0, 1])
        n = sum(1 for e in range(3) for _ in job.epoch(e))
        job.close()
        q.put((rank, n))
    except Exception as e:  # pragma: no cover
        q.put((rank, repr(e)))


def test_two_rank_processes_read_the_dataset_once(tmp_path, tree):
    state = str(tmp_path / "fs.state")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, str(tree), state, str(tmp_path / "cache"), q)) for r in range(2)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=120) for _ in ps)
    for p in ps:
        p.join(timeout=30)
    src = clairvoyant.ImageFolder(tree)
    assert res[0] + res[1] == 3 * len(src), res
    fs = clairvoyant.EmulatedFs(state, 0, 100)
    assert fs.files_read == len(src)
    assert fs.bytes_read == src.total_bytes
