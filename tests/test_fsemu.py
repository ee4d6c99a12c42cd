"""The FUSE-mounted emulated shared file system (crates/clairvoyant-fsemu): mounting, per-open
latency, aggregate bandwidth t(γ) shared by concurrent readers, no page cache, per-file counters,
clean unmount. Skipped, with the reason printed, where FUSE cannot be mounted."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from benches import emulation as emu

REASON = emu.fuse_unavailable()
if REASON is not None:
    print(f"test_fsemu: skipped: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"FUSE emulation unavailable: {REASON}")


def _tree(root, files: dict[str, int]) -> dict[str, bytes]:
    out = {}
    for name, size in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        data = os.urandom(size)
        p.write_bytes(data)
        out[name] = data
    return out


def _read(path, buf=None) -> int:
    with open(path, "rb", buffering=0) as f:
        if buf is None:
            return len(f.read())
        n = 0
        while True:
            k = f.readinto(memoryview(buf)[n:])
            if not k:
                return n
            n += k


def test_mount_serves_the_backing_tree_read_only_and_unmounts(tmp_path):
    data = _tree(tmp_path / "back", {"a/x.bin": 1000, "a/y.bin": 0, "b.bin": 300_000})
    mnt = tmp_path / "mnt"
    with emu.FuseMount(tmp_path / "back", mnt, open_latency_ms=0, bandwidth=10_000) as m:
        assert emu.is_mounted(mnt)
        assert sorted(os.listdir(mnt)) == [".fsemu-stats", "a", "b.bin"]
        assert sorted(os.listdir(mnt / "a")) == ["x.bin", "y.bin"]
        for name, want in data.items():
            assert (mnt / name).read_bytes() == want, name
            assert os.stat(mnt / name).st_size == len(want)
        with pytest.raises(OSError) as e:
            open(mnt / "b.bin", "r+b")
        assert e.value.errno in (30, 13), e.value  # EROFS (or EACCES from the read-only mode)
        with pytest.raises(FileNotFoundError):
            open(mnt / "missing.bin", "rb")
        stats = m.stats()
        assert stats["open_latency_ms"] == 0
    # SIGTERM unmounted it and the process exited cleanly.
    assert not emu.is_mounted(mnt)
    assert m.proc.returncode == 0
    assert os.listdir(mnt) == []


def test_every_open_costs_the_latency_and_concurrent_opens_overlap(tmp_path):
    _tree(tmp_path / "back", {f"f{i}": 10 for i in range(8)})
    with emu.FuseMount(tmp_path / "back", tmp_path / "mnt", open_latency_ms=25, bandwidth=10_000) as m:
        paths = [m.path / f"f{i}" for i in range(8)]
        t = time.perf_counter()
        for p in paths:
            _read(p)
        sequential = time.perf_counter() - t
        # 8 opens of 25 ms one after the other: 0.2 s (no page cache: a second read pays again).
        assert 0.19 < sequential < 0.2 + 0.15, sequential
        t = time.perf_counter()
        for p in paths[:4]:
            _read(p)
        assert time.perf_counter() - t > 0.095
        threads = [threading.Thread(target=_read, args=(p,)) for p in paths]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        concurrent = time.perf_counter() - t
        assert concurrent < 0.12, f"8 concurrent opens took {concurrent:.3f} s: latencies do not overlap"
        assert m.stats()["opens"] == 8 + 4 + 8


def _throughput(mnt, names, readers: int, size: int) -> float:
    """MB/s of `readers` threads reading `names` (split between them) through the mount."""
    shares = [names[i::readers] for i in range(readers)]

    def work(share):
        buf = bytearray(size)
        for n in share:
            assert _read(mnt / n, buf) == size

    threads = [threading.Thread(target=work, args=(s,)) for s in shares]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return len(names) * size / 1e6 / (time.perf_counter() - t)


def test_aggregate_bandwidth_follows_the_table(tmp_path):
    size = 4_000_000
    names = [f"f{i}" for i in range(8)]
    _tree(tmp_path / "back", {n: size for n in names})
    table = emu.FSEMU_DEFAULT_BANDWIDTH
    with emu.FuseMount(tmp_path / "back", tmp_path / "mnt", open_latency_ms=0, bandwidth=table) as m:
        one = _throughput(m.path, names[:3], 1, size)  # 12 MB at t(1) = 60 MB/s: 0.2 s
        four = _throughput(m.path, names, 4, size)  # 32 MB at t(4) = 160 MB/s: 0.2 s
        stats = m.stats()
    print(f"t(1) measured {one:.1f} MB/s, t(4) measured {four:.1f} MB/s")
    # A lone reader also pays the FUSE round trip between requests: a busy machine measures less.
    assert 0.7 < one / emu.curve_at(table, 1) < 1.15, one
    # Between one request and the next a reader is briefly not transferring (γ dips), so the
    # measured figure sits a little below t(4).
    assert 0.75 < four / emu.curve_at(table, 4) < 1.1, four
    assert four / one > 2.0
    assert stats["bytes"] == 11 * size
    assert stats["max_in_progress"] >= 4


def test_counters_count_per_file(tmp_path):
    _tree(tmp_path / "back", {"a.bin": 200_000, "d/b.bin": 1000, "c.bin": 5})
    with emu.FuseMount(tmp_path / "back", tmp_path / "mnt", open_latency_ms=0, bandwidth=10_000) as m:
        for _ in range(3):
            _read(m.path / "a.bin")
        _read(m.path / "d" / "b.bin")
        os.stat(m.path / "c.bin")  # metadata only: not a read
        s = m.stats()
    files = s["files"]
    assert set(files) == {"a.bin", "d/b.bin"}
    assert files["a.bin"]["opens"] == 3 and files["a.bin"]["bytes"] == 600_000
    assert files["a.bin"]["reads"] >= 3
    assert files["d/b.bin"] == {"opens": 1, "reads": files["d/b.bin"]["reads"], "bytes": 1000}
    assert s["opens"] == 4 and s["bytes"] == 601_000


def test_bad_arguments_name_the_flag(tmp_path):
    (tmp_path / "mnt").mkdir()
    r = subprocess.run(
        [str(emu.fsemu_binary()), str(tmp_path), str(tmp_path / "mnt"), "--bandwidth", "1:60,1:70"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0 and "--bandwidth" in r.stderr and "strictly increasing" in r.stderr, r.stderr
    r = subprocess.run(
        [str(emu.fsemu_binary()), str(tmp_path / "nope"), str(tmp_path / "mnt")], capture_output=True, text=True, timeout=30
    )
    assert r.returncode != 0 and str(tmp_path / "nope") in r.stderr, r.stderr
    with pytest.raises(RuntimeError, match="could not mount"):
        emu.FuseMount(tmp_path / "nope", tmp_path / "mnt", open_latency_ms=0)
    assert not emu.is_mounted(tmp_path / "mnt")


def test_mmap_files_makes_files_mappable_and_page_faults_are_reads(tmp_path):
    import mmap

    data = _tree(tmp_path / "back", {"db.bin": 1 << 20})["db.bin"]
    # By default files are opened with direct I/O: the kernel refuses to map them.
    with emu.FuseMount(tmp_path / "back", tmp_path / "mnt", open_latency_ms=0, bandwidth=10_000):
        with open(tmp_path / "mnt" / "db.bin", "rb") as f:
            with pytest.raises(OSError):
                mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    with emu.FuseMount(tmp_path / "back", tmp_path / "mnt2", open_latency_ms=0, bandwidth=10_000, mmap_files=True) as m:
        with open(tmp_path / "mnt2" / "db.bin", "rb") as f:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                # Touch one byte per 64 KiB: every touch faults pages in through the file system.
                got = bytes(mm[k] for k in range(0, len(data), 65536))
                assert got == data[::65536]
                assert mm[1000:2000] == data[1000:2000]
        s = m.stats()
        assert s["reads"] >= 1, s
        assert 16 * 4096 <= s["bytes"] <= len(data), s
