"""The container-format benchmark of ``python -m benches --only formats``.

4 processes (ranks of one machine) each read their share of one epoch in a random order
(clairvoyant's access stream, the same for every reader of a comparison), timed from a barrier to
the last sample; throughput is the bytes of all ranks over the slowest rank's time. Context
switches per sample are ``getrusage`` (all threads of the process, voluntary + involuntary).

- LMDB (Caffe Datums): clairvoyant's ``Job`` over ``clairvoyant.Lmdb`` (positioned reads by
  prefetch threads) against the LMDB library (py-lmdb) reading the same records through its
  memory map, one reader per process as in Caffe. The target pair runs on the FUSE emulation:
  py-lmdb on a mount with ``--mmap-files`` (files opened without direct I/O, so the kernel can map
  them; every page fault is a read of the emulated file system), clairvoyant on the default
  direct-I/O mount (and, for reference, on the ``--mmap-files`` mount too). The page cache is
  dropped before each timed run (``/proc/sys/vm/drop_caches``, as root; otherwise the pair is
  skipped with the reason). The same pair on the plain local file (its cache evicted with
  ``posix_fadvise(DONTNEED)``) is reported as well.
- HDF5 (sample axis, contiguous): ``Job`` over ``clairvoyant.Hdf5`` against h5py reading the same
  rows, and against raw ``os.pread`` of the same byte ranges, all on the FUSE emulation.
- HDF5, gzip-compressed (one row per chunk, as sample-indexed training sets are usually written,
  and 8 rows per chunk): ``Job`` over ``clairvoyant.Hdf5`` (chunks read by ``pread`` and inflated
  in Rust by the prefetch threads) against h5py reading the same rows (the HDF5 library inflates
  them, under its global lock within a process), on the FUSE emulation.
- Tar shards: ``Job`` over ``clairvoyant.TarShards`` against ``Job`` over the same members as
  loose files (``clairvoyant.FileList``), on the FUSE emulation.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np

RANKS = 4
BATCH = 32

TARGETS = {
    "lmdb_vs_mmap": 5.0,  # clairvoyant / LMDB library through its memory map, throughput (at least)
    "hdf5_vs_h5py": 3.0,  # clairvoyant / h5py, throughput (at least; or the next one)
    "hdf5_vs_pread": 1 / 1.2,  # clairvoyant / raw positioned reads of the same bytes (at least)
    "hdf5_gzip_vs_h5py": 3.0,  # the HDF5 target on gzip-compressed rows, one row per chunk (at least)
    "tar_vs_loose": 1 / 1.2,  # clairvoyant on tar shards / on the same members as loose files (at least)
}

LABELS = {
    "lmdb_vs_mmap": "LMDB, 4 processes, random order on FUSE: clairvoyant / LMDB library through its mmap",
    "hdf5_vs_h5py": "HDF5, 4 processes, random order on FUSE: clairvoyant / h5py",
    "hdf5_vs_pread": "HDF5 on FUSE: clairvoyant / raw pread of the same bytes",
    "hdf5_gzip_vs_h5py": "HDF5 gzip (1 row/chunk), 4 processes, random order on FUSE: clairvoyant / h5py",
    "tar_vs_loose": "tar shards on FUSE, full random order: clairvoyant / same members as loose files",
}


def _drop_cache(root: Path) -> None:
    """Evicts the page cache of every file below ``root`` (only those files, no root needed)."""
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _drop_page_cache() -> str | None:
    """Drops the whole page cache (root only); returns why not where it cannot."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return f"cannot drop the page cache ({e}); run as root"
    return None


def _read_ahead_kb(path: Path):
    """The kernel's readahead window of the file system at ``path`` (its backing device info)."""
    st = os.stat(path)
    try:
        with open(f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb") as f:
            return int(f.read())
    except OSError:
        return None


def _fuse_line(name: str, r: dict) -> str:
    return (
        f"formats: LMDB on FUSE, {r['ranks']} processes, {name:<21} {r['mbps']:7.1f} MB/s, {r['csw_per_sample']:6.2f} context switches/sample, "
        f"{r['major_faults']} major faults; FUSE: {r.get('fuse_reads', 0):,} reads of {r.get('fuse_read_kb', 0):.0f} KB, "
        f"{r.get('fuse_mean_transfers', 0):.1f} transfers in progress"
    )


def _csw() -> tuple:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nvcsw + r.ru_nivcsw, r.ru_majflt


def _order(n: int, ctx) -> list:
    import clairvoyant

    return [int(i) for i in clairvoyant.access_stream(n, ctx.world_size, ctx.rank, 1, BATCH, 0)[0]]


def _rank(ctx, kind: str, path: str, extra) -> dict:
    """One reader process; ``kind`` names the reader, ``path`` the dataset."""
    import clairvoyant

    nbytes = n = 0
    deadline = extra.get("deadline_s", 1e9)
    if kind.startswith("cv-"):
        fmt = kind[3:]
        if fmt == "lmdb":
            src = clairvoyant.Lmdb(path)
        elif fmt in ("hdf5", "hdf5gz"):
            src = clairvoyant.Hdf5(path, dataset="data", labels="labels")
        elif fmt == "tar":
            src = clairvoyant.TarShards(path)
        else:
            src = clairvoyant.FileList([os.path.join(path, r) for r in extra["files"]], [0] * len(extra["files"]))
        ctx.sync()
        c0, f0 = _csw()
        t = time.perf_counter()
        job = clairvoyant.Job(src, batch_size=BATCH, epochs=1, seed=0)
        for samples, _ in job.batches(0):
            n += len(samples)
            nbytes += sum(len(x) for x in samples)
        seconds = time.perf_counter() - t
        job.close()
    elif kind == "lmdb-mmap":
        import lmdb

        env = lmdb.open(path, readonly=True, lock=False)
        count = env.stat()["entries"]
        order = _order(count, ctx)
        ctx.sync()
        c0, f0 = _csw()
        t = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for i in order:
                v = txn.get(b"%08d" % i)
                nbytes += len(bytes(v))  # touches every page of the value
                n += 1
                if time.perf_counter() - t > deadline:
                    break
        seconds = time.perf_counter() - t
        env.close()
    elif kind in ("h5py", "pread"):
        import h5py

        with h5py.File(path, "r") as f:
            d = f["data"]
            count = d.shape[0]
            row = d.dtype.itemsize * int(np.prod(d.shape[1:]))
            offset = d.id.get_offset() if kind == "pread" else None
            order = _order(count, ctx)
            ctx.sync()
            c0, f0 = _csw()
            t = time.perf_counter()
            if kind == "h5py":
                for i in order:
                    nbytes += len(d[i].tobytes())
                    n += 1
            else:
                fd = os.open(path, os.O_RDONLY)
                for i in order:
                    nbytes += len(os.pread(fd, row, offset + i * row))
                    n += 1
                os.close(fd)
            seconds = time.perf_counter() - t
    else:
        raise ValueError(kind)
    c1, f1 = _csw()
    return {"seconds": seconds, "samples": n, "bytes": nbytes, "csw": c1 - c0, "majflt": f1 - f0}


def _run(kind: str, path: Path, env: dict, extra=None, ranks: int = RANKS, mount=None) -> dict:
    """``ranks`` processes of reader ``kind``; with ``mount`` (a FuseMount) also what the emulated
    file system served during the run: its reads, bytes, mean read size and mean transfers in
    progress (the γ its bandwidth curve saw)."""
    from . import emulation

    before = mount.stats() if mount is not None else None
    t0 = time.perf_counter()
    per = emulation.run_ranks(_rank, ranks, args=(kind, str(path), extra or {}), env=env, timeout=900)
    wall = time.perf_counter() - t0
    seconds = max(r["seconds"] for r in per)
    total = sum(r["bytes"] for r in per)
    samples = sum(r["samples"] for r in per)
    fs = {}
    if before is not None:
        after = mount.stats()
        reads, fbytes = after["reads"] - before["reads"], after["bytes"] - before["bytes"]
        fs = {
            "fuse_reads": reads,
            "fuse_bytes": fbytes,
            "fuse_read_kb": fbytes / max(reads, 1) / 1024,
            # transfer seconds over the run's wall time (process start-up included: a lower bound)
            "fuse_mean_transfers": (after["transfer_seconds"] - before["transfer_seconds"]) / wall,
        }
    return {
        **fs,
        "ranks": ranks,
        "reader": kind,
        "seconds": seconds,
        "samples": samples,
        "bytes": total,
        "mbps": total / seconds / 1e6,
        "csw_per_sample": sum(r["csw"] for r in per) / max(samples, 1),
        "major_faults": sum(r["majflt"] for r in per),
    }


def _env_factory(cache: Path):
    """The environment of each run: no configuration file, the index cache, a fresh run id."""
    seq = iter(range(1_000_000))

    def env() -> dict:
        return {
            "CLAIRVOYANT_CONFIG": "",
            "CLAIRVOYANT_CACHE_DIR": str(cache.resolve()),
            "CLAIRVOYANT_RUN_ID": f"formats-{os.getpid()}-{next(seq)}",
            "CLAIRVOYANT_MEMORY": str(256 << 20),
            "CLAIRVOYANT_QUIET": "1",
        }

    return env


def _bench_lmdb(root: Path, data: Path, cache: Path, env, lmdb_mb: int, log, lmdb_ranks: int, fuse_why) -> dict:
    """The LMDB pair: a cold local file, then (where FUSE mounts and the page cache can be
    dropped) on the emulation."""
    import clairvoyant
    from clairvoyant import datasets

    shape = (3, 256, 256)
    count = max(64, lmdb_mb * 1_000_000 // (3 * 256 * 256))
    db = data / "lmdb"
    log(f"formats: LMDB of {count:,} Caffe Datums {shape} ({count * 3 * 256 * 256 / 1e9:.2f} GB) ...")
    datasets.make_lmdb(db, count, shape=shape, collect=False)
    t = time.perf_counter()
    _drop_cache(db)
    clairvoyant.Lmdb(db, index_dir=cache)
    index_s = time.perf_counter() - t
    runs = {}
    for kind in ("cv-lmdb", "lmdb-mmap"):
        _drop_cache(db)
        runs[kind] = _run(kind, db, {**env(), "CLAIRVOYANT_CACHE_DIR": str(cache.resolve())}, {"deadline_s": 120})
        r = runs[kind]
        log(f"formats: LMDB cold local file {kind:<10} {r['mbps']:7.1f} MB/s, {r['csw_per_sample']:6.2f} context switches/sample, {r['major_faults']} major faults")
    res = {
        "records": count,
        "bytes": count * 3 * 256 * 256,
        "index_seconds_cold": index_s,
        "runs": runs,
        "local_ratio": runs["cv-lmdb"]["mbps"] / runs["lmdb-mmap"]["mbps"],
    }
    why = fuse_why or _drop_page_cache()
    if why is not None:
        res["fuse_skipped"] = why
        log(f"formats: LMDB on FUSE skipped: {why}")
    else:
        _bench_lmdb_fuse(res, root, data, cache, env, log, lmdb_ranks)
    return res


def _bench_lmdb_fuse(res: dict, root: Path, data: Path, cache: Path, env, log, lmdb_ranks: int) -> None:
    """The LMDB pair on the FUSE emulation, page cache dropped before each run; into ``res``."""
    import clairvoyant

    from . import emulation

    fuse_runs = {}
    # py-lmdb maps data.mdb through the mount: each page fault is an emulated read.
    with emulation.FuseMount(data, root / "mnt-mmap", mmap_files=True) as m:
        clairvoyant.Lmdb(m.path / "lmdb", index_dir=cache)  # indexed before the cache is dropped
        for kind, name in (("lmdb-mmap", "lmdb-mmap"), ("cv-lmdb", "cv-lmdb (mmap mount)")):
            _drop_page_cache()
            fuse_runs[name] = r = _run(kind, m.path / "lmdb", env(), {"deadline_s": 300}, lmdb_ranks, m)
            log(_fuse_line(name, r))
        res["fuse_read_ahead_kb"] = _read_ahead_kb(m.path)
    with emulation.FuseMount(data, root / "mnt") as m:
        clairvoyant.Lmdb(m.path / "lmdb", index_dir=cache)
        _drop_page_cache()
        fuse_runs["cv-lmdb"] = r = _run("cv-lmdb", m.path / "lmdb", env(), None, lmdb_ranks, m)
        log(_fuse_line("cv-lmdb", r))
    res["fuse_runs"] = fuse_runs
    res["ratio"] = fuse_runs["cv-lmdb"]["mbps"] / fuse_runs["lmdb-mmap"]["mbps"]


def _bench_hdf5(data: Path, mnt: Path, cache: Path, env, lmdb_mb: int, log) -> dict:
    """Rows of one uncompressed HDF5 file on FUSE: clairvoyant, h5py and plain preads."""
    import clairvoyant
    from clairvoyant import datasets

    rows = max(64, lmdb_mb * 1_000_000 // 4 // (3 * 128 * 128))
    h5 = data / "rows.h5"
    marker = data / f".rows-{rows}"
    if not marker.exists():
        log(f"formats: HDF5 of {rows:,} rows of 3x128x128 ...")
        datasets.make_hdf5(h5, rows, shape=(3, 128, 128), dtype="uint8")
        marker.write_text("")
    clairvoyant.Hdf5(mnt / "rows.h5", dataset="data", labels="labels", index_dir=cache)
    runs = {k: _run(k, mnt / "rows.h5", env()) for k in ("cv-hdf5", "h5py", "pread")}
    for k, r in runs.items():
        log(f"formats: HDF5 on FUSE {k:<8} {r['mbps']:7.1f} MB/s, {r['csw_per_sample']:6.2f} context switches/sample")
    return {
        "rows": rows,
        "runs": runs,
        "vs_h5py": runs["cv-hdf5"]["mbps"] / runs["h5py"]["mbps"],
        "vs_pread": runs["cv-hdf5"]["mbps"] / runs["pread"]["mbps"],
    }


def _bench_hdf5_gzip(data: Path, mnt: Path, cache: Path, env, lmdb_mb: int, log) -> dict:
    """Gzip-compressed HDF5 on FUSE with 1 and 8 rows per chunk: clairvoyant against h5py."""
    import h5py

    import clairvoyant
    from clairvoyant import datasets

    rows = max(64, lmdb_mb * 1_000_000 // 4 // (3 * 128 * 128))
    gz = {}
    for per_chunk in (1, 8):
        name = f"rows-gzip{per_chunk}.h5"
        marker = data / f".rows-gzip{per_chunk}-{rows}"
        if not marker.exists():
            log(f"formats: HDF5 of {rows:,} rows of 3x128x128, gzip, {per_chunk} rows per chunk ...")
            datasets.make_hdf5(data / name, rows, shape=(3, 128, 128), dtype="uint8", chunks=(per_chunk, 3, 128, 128), compression="gzip")
            marker.write_text("")
        with h5py.File(data / name, "r") as f:
            stored = f["data"].id.get_storage_size()
        clairvoyant.Hdf5(mnt / name, dataset="data", labels="labels", index_dir=cache)
        runs = {k: _run(k, mnt / name, env()) for k in ("cv-hdf5gz", "h5py")}
        for k, r in runs.items():
            log(f"formats: HDF5 gzip ({per_chunk} rows/chunk) on FUSE {k:<9} {r['mbps']:7.1f} MB/s (decoded), {r['csw_per_sample']:6.2f} context switches/sample")
        gz[f"rows_per_chunk_{per_chunk}"] = {
            "rows": rows,
            "stored_bytes": stored,
            "runs": runs,
            "vs_h5py": runs["cv-hdf5gz"]["mbps"] / runs["h5py"]["mbps"],
        }
    return gz


def _bench_tar(data: Path, mnt: Path, cache: Path, env, lmdb_mb: int, log) -> dict:
    """~100 KB samples in 16 tar shards against the same samples as loose files, on FUSE."""
    import clairvoyant
    from clairvoyant import datasets

    count = max(64, lmdb_mb * 1_000_000 // 4 // 100_000)
    tars = data / "tars"
    loose = data / "loose"
    marker = data / f".tars-{count}"
    if not marker.exists():
        log(f"formats: {count:,} samples of ~100 KB in 16 tar shards and as loose files ...")
        samples = datasets.make_tar_shards(tars, count, shards=16, size_range=(50_000, 150_000))
        loose.mkdir(parents=True, exist_ok=True)
        for k, (b, _) in enumerate(samples):
            (loose / f"{k:07d}.bin").write_bytes(b)
        marker.write_text("")
    files = [f"loose/{k:07d}.bin" for k in range(count)]
    clairvoyant.TarShards(mnt / "tars", index_dir=cache)
    runs = {"cv-tar": _run("cv-tar", mnt / "tars", env()), "cv-loose": _run("cv-loose", mnt, env(), {"files": files})}
    for k, r in runs.items():
        log(f"formats: tar on FUSE {k:<9} {r['mbps']:7.1f} MB/s, {r['csw_per_sample']:6.2f} context switches/sample")
    return {"samples": count, "runs": runs, "ratio": runs["cv-tar"]["mbps"] / runs["cv-loose"]["mbps"]}


def _missing(module: str, why: str):
    """None when ``module`` imports, else ``{"skipped": why}``."""
    try:
        __import__(module)
    except ImportError:
        return {"skipped": why}
    return None


def bench_formats(out: Path, lmdb_mb: int, log, parts=("lmdb", "hdf5", "tar"), lmdb_ranks: int = RANKS) -> dict:
    """Runs the three comparisons (those in ``parts``); returns their figures (a comparison whose
    package is missing is skipped with the reason). ``lmdb_ranks`` sets the processes of the LMDB
    pair on FUSE (the target's setting is 4)."""
    from . import emulation

    root = out / "bench" / "formats"
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    cache = root / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    env = _env_factory(cache)

    res: dict = {"ranks": RANKS, "batch_size": BATCH}
    fuse_why = emulation.fuse_unavailable()
    if "lmdb" in parts:
        res["lmdb"] = _missing("lmdb", "the lmdb package is not installed") or _bench_lmdb(root, data, cache, env, lmdb_mb, log, lmdb_ranks, fuse_why)
    if fuse_why is not None:
        res["fuse"] = {"skipped": fuse_why}
        return res
    if "hdf5" not in parts and "tar" not in parts:
        return res
    mnt = root / "mnt"
    with emulation.FuseMount(data, mnt):
        if "hdf5" in parts:
            no_h5py = _missing("h5py", "h5py is not installed")
            res["hdf5"] = no_h5py or _bench_hdf5(data, mnt, cache, env, lmdb_mb, log)
            if no_h5py is None:
                res["hdf5_gzip"] = _bench_hdf5_gzip(data, mnt, cache, env, lmdb_mb, log)
        if "tar" in parts:
            res["tar"] = _bench_tar(data, mnt, cache, env, lmdb_mb, log)
    return res


def evaluate(res: dict, target) -> list:
    out = []
    if "ratio" in res.get("lmdb", {}):
        out.append(target("lmdb_vs_mmap", res["lmdb"]["ratio"], True))
    if "vs_h5py" in res.get("hdf5", {}):
        out.append(target("hdf5_vs_h5py", res["hdf5"]["vs_h5py"], True))
        out.append(target("hdf5_vs_pread", res["hdf5"]["vs_pread"], True))
    if "vs_h5py" in res.get("hdf5_gzip", {}).get("rows_per_chunk_1", {}):
        out.append(target("hdf5_gzip_vs_h5py", res["hdf5_gzip"]["rows_per_chunk_1"]["vs_h5py"], True))
    if "ratio" in res.get("tar", {}):
        out.append(target("tar_vs_loose", res["tar"]["ratio"], True))
    return out


def markdown(res: dict) -> list:
    lines = ["Container formats (4 processes, one epoch in random order):", ""]
    rows = []
    for fmt, setting in (("lmdb", "cold local file"), ("hdf5", "FUSE"), ("tar", "FUSE")):
        part = res.get(fmt, {})
        if "skipped" in part:
            lines.append(f"- {fmt}: skipped ({part['skipped']})")
            continue
        for k, r in part.get("runs", {}).items():
            rows.append(f"| {fmt} | {setting} | {k} | {r['mbps']:.1f} | {r['csw_per_sample']:.2f} |")
        if fmt == "hdf5":
            for layout, g in res.get("hdf5_gzip", {}).items():
                for k, r in g["runs"].items():
                    rows.append(f"| hdf5 gzip, {layout.replace('_', ' ')} | FUSE | {k} | {r['mbps']:.1f} | {r['csw_per_sample']:.2f} |")
        if fmt == "lmdb":
            for k, r in part.get("fuse_runs", {}).items():
                rows.append(f"| lmdb | FUSE, page cache dropped | {k} | {r['mbps']:.1f} | {r['csw_per_sample']:.2f} |")
    lines += ["| format | storage | reader | MB/s | context switches / sample |", "|---|---|---|---|---|", *rows, ""]
    return lines
