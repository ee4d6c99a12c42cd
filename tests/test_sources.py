"""Real files: ImageFolder order, bytes, the index cache, the emulated file system, and every
failure mode a dataset can have (missing, changed, foreign index)."""

import multiprocessing as mp
import os
import subprocess
import sys

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
    lst.write_text("# path label\n" + "".join(f"{p} {int(label)}\n" for p, label in zip(src.paths, src.labels)))
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


def _rank(rank, root, state, cache, q, done):
    os.environ["CLAIRVOYANT_CACHE_DIR"] = cache
    try:
        fs = clairvoyant.EmulatedFs(state, open_latency_ms=0.5, bandwidth_mbps=100)
        job = clairvoyant.Job(clairvoyant.ImageFolder(root, emulated=fs), batch_size=2, epochs=3, rank=rank, world_size=2, local_ranks=[0, 1])
        n = sum(1 for e in range(3) for _ in job.epoch(e))
        # Ranks leave together, as a training's do: a rank started late on a loaded machine then
        # still finds the other's node cache (it may have read the whole dataset meanwhile).
        done.wait(timeout=60)
        job.close()
        q.put((rank, n))
    except Exception as e:  # pragma: no cover
        q.put((rank, repr(e)))


def test_two_rank_processes_read_the_dataset_once(tmp_path, tree):
    state = str(tmp_path / "fs.state")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    done = ctx.Barrier(2)
    ps = [ctx.Process(target=_rank, args=(r, str(tree), state, str(tmp_path / "cache"), q, done)) for r in range(2)]
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


def test_file_names_that_are_not_utf8_work_as_in_torchvision(tmp_path):
    # Bytes that are not UTF-8 in a file name and in a class directory: torchvision reaches them
    # through os.scandir as str with surrogateescape; so does clairvoyant.
    root = tmp_path / "data"
    odd_class = os.fsdecode(b"cl\xe4ss")
    odd_file = os.fsdecode(b"caf\xe9.jpg")
    for c in ("b", odd_class, "\u00e9t\u00e9"):
        (root / c).mkdir(parents=True)
        (root / c / odd_file).write_bytes(c.encode("utf-8", "surrogateescape") * 3)
        (root / c / "z.png").write_bytes(b"z" + c.encode("utf-8", "surrogateescape"))
    age_directories(root)
    src = clairvoyant.ImageFolder(root)
    assert odd_class in src.classes and len(src) == 6
    assert all(isinstance(p, str) for p in src.paths)
    datasets = pytest.importorskip("torchvision.datasets", reason="torchvision is needed for the reference order")
    ref = datasets.ImageFolder(str(root), loader=lambda p: p)
    assert src.classes == ref.classes
    assert src.paths == [p for p, _ in ref.samples]
    assert src.labels.tolist() == [label for _, label in ref.samples]
    # A reused index gives the same names back.
    again = clairvoyant.ImageFolder(root)
    assert again.index_reused and again.paths == src.paths and again.classes == src.classes
    with clairvoyant.Job(again, batch_size=2, epochs=1) as job:
        seen = 0
        for (sample, label), k in zip(job.epoch(0), job.samples_of(0)):
            with open(src.paths[k], "rb") as f:
                assert bytes(sample) == f.read()
            assert label == src.labels[k]
            seen += 1
    assert seen == len(src)


def test_file_list_with_a_name_that_is_not_utf8(tmp_path):
    odd = tmp_path / os.fsdecode(b"caf\xe9 1.bin")
    odd.write_bytes(b"coffee")
    (tmp_path / "list.txt").write_bytes(b"caf\xe9 1.bin 4\n")
    src = clairvoyant.FileList(tmp_path / "list.txt")
    assert src.paths == [str(odd)] and src.labels.tolist() == [4]
    with clairvoyant.Job(src, batch_size=1, epochs=1) as job:
        assert [bytes(s) for s, _ in job.epoch(0)] == [b"coffee"]


def test_the_session_keeps_the_user_cache_untouched(tmp_path):
    # The guard in conftest.py: a session whose test writes to ~/.cache/clairvoyant fails.
    home = tmp_path / "home"
    (home / ".cache" / "clairvoyant").mkdir(parents=True)
    tests = tmp_path / "t"
    tests.mkdir()
    (tests / "conftest.py").write_text(open(os.path.join(os.path.dirname(__file__), "conftest.py")).read())
    (tests / "test_writes_home.py").write_text(
        "import os\n"
        "import clairvoyant\n"
        "def make(tmp_path):\n"
        "    (tmp_path / 'd' / 'c').mkdir(parents=True)\n"
        "    (tmp_path / 'd' / 'c' / '1.jpg').write_bytes(b'1')\n"
        "    return clairvoyant.ImageFolder(tmp_path / 'd')\n"
        "def test_index_goes_to_the_session_dir(tmp_path):\n"
        "    assert make(tmp_path).index_path.startswith(os.environ['CLAIRVOYANT_CACHE_DIR'])\n"
        "def test_writes_home(tmp_path, monkeypatch):\n"
        "    monkeypatch.delenv('CLAIRVOYANT_CACHE_DIR')\n"
        "    assert '.cache/clairvoyant' in make(tmp_path).index_path\n"
    )
    env = {**os.environ, "HOME": str(home)}
    env.pop("XDG_CACHE_HOME", None)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tests,
    )
    assert r.returncode != 0 and "wrote to the user's cache directory" in r.stdout, r.stdout + r.stderr
    assert "2 passed" in r.stdout and "1 error" in r.stdout, r.stdout
    # A file another run of the same user writes there meanwhile is noted, not blamed.
    (tests / "test_writes_home.py").write_text(
        "from pathlib import Path\n"
        "def test_other_run_writes_home():\n"
        "    (Path.home() / '.cache' / 'clairvoyant' / 'index-0.cvidx').write_bytes(b'CVINDEX dir:/elsewhere')\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tests)],
        capture_output=True, text=True, timeout=120, env=env, cwd=tests,
    )
    assert r.returncode == 0 and "none naming it" in r.stdout, r.stdout + r.stderr
