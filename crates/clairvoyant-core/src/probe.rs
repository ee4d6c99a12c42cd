//! Short benchmarks that fill in a [`SystemModel`] for this machine and dataset, within a time
//! budget:
//!
//! - the dataset's storage (the "PFS"): whole-file reads (up to 16 MiB each) of up to
//!   `max_files` files found under the dataset, in random order, with each thread count →
//!   t(γ) ([`PfsSpec::read_mbps`]) and the mean open latency. Each thread count reads its own
//!   files, so no count reads what another just brought into the page cache. Files that were
//!   already in the page cache measure the cache, and that is intended: when the source is that
//!   fast, the model must not route samples through slower tiers;
//! - memory: parallel copies between 64 MiB of buffers with each thread count → r(p) and w(p)
//!   of the memory class and w_0(p) of the staging buffer;
//! - the SSD directory, when given: files of the dataset's mean size written with each thread
//!   count (each fsync'ed), then read back after dropping them from the page cache → r(p), w(p)
//!   of the directory class. Everything written is deleted afterwards.
//!
//! Everything else (capacities, thread counts) comes from [`SystemModel::detect`].

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::model::{ClassKind, Curve, PfsSpec, SystemModel, MAX_THREADS};
use crate::sysinfo::{defaults, free_space};

/// Most bytes read from one dataset file.
const MAX_READ_PER_FILE: usize = 16 << 20;
/// Total bytes of the memory-copy buffers (split over the threads, at least 8 MiB each).
const MEMCPY_BYTES: usize = 64 << 20;
/// Files the dataset walk looks at before it stops (besides its time limit).
const WALK_MAX_ENTRIES: usize = 200_000;

/// What [`probe`] measures and for how long.
pub struct ProbeOptions<'a> {
    /// Directory on the local disk to measure as the "ssd" class; None skips it.
    pub ssd_dir: Option<PathBuf>,
    /// Most dataset files read.
    pub max_files: usize,
    /// Thread (and reader) counts measured; the curves' x values.
    pub threads: Vec<u32>,
    /// Total time budget, seconds (walk, storage, memory and SSD together).
    pub budget_s: f64,
    /// Called with a line of progress now and then.
    pub progress: Option<&'a dyn Fn(&str)>,
}

impl Default for ProbeOptions<'_> {
    fn default() -> Self {
        ProbeOptions {
            ssd_dir: None,
            max_files: 256,
            threads: vec![1, 2, 4, 8],
            budget_s: 10.0,
            progress: None,
        }
    }
}

impl std::fmt::Debug for ProbeOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeOptions")
            .field("ssd_dir", &self.ssd_dir)
            .field("max_files", &self.max_files)
            .field("threads", &self.threads)
            .field("budget_s", &self.budget_s)
            .field("progress", &self.progress.map(|_| "Fn"))
            .finish()
    }
}

impl ProbeOptions<'_> {
    fn say(&self, msg: &str) {
        if let Some(f) = self.progress {
            f(msg);
        }
    }
}

/// Measure the dataset's storage, memory and (optionally) an SSD directory; see the module docs.
/// Takes about `opts.budget_s` seconds. The result is validated.
pub fn probe(dataset: &Path, opts: &ProbeOptions) -> Result<SystemModel> {
    let start = Instant::now();
    let threads = check_options(opts)?;
    let budget = Duration::from_secs_f64(opts.budget_s);
    let (storage_share, memory_share) = if opts.ssd_dir.is_some() {
        (0.5, 0.15)
    } else {
        (0.8, 0.2)
    };
    let storage_end = start + budget.mul_f64(storage_share);
    let memory_end = storage_end + budget.mul_f64(memory_share);
    let end = start + budget;

    // The dataset.
    opts.say(&format!("probe: looking for files under {}", dataset.display()));
    let walk_end = start + budget.mul_f64(storage_share * 0.25);
    let (files, mean_size) = probe_files(dataset, opts.max_files, walk_end)?;

    let mut base = SystemModel::detect();
    base.pfs = probe_storage(&files, &threads, storage_end, opts)?;
    set_memory_curves(&mut base, probe_memory(&threads, memory_end, opts));
    if let Some(dir) = &opts.ssd_dir {
        let size = (mean_size as usize).clamp(4 << 10, 8 << 20);
        let (read, write) = probe_dir(dir, size, &threads, end, opts)?;
        set_directory_class(&mut base, dir, read, write)?;
    }

    opts.say(&format!("probe: done in {:.1} s", start.elapsed().as_secs_f64()));
    base.validate()?;
    Ok(base)
}

/// The probe's thread counts, sorted and without repeats, once the options are checked.
fn check_options(opts: &ProbeOptions) -> Result<Vec<u32>> {
    let mut threads = opts.threads.clone();
    threads.sort_unstable();
    threads.dedup();
    if threads.is_empty() || threads[0] == 0 || threads[threads.len() - 1] > MAX_THREADS {
        return Err(Error::config(
            "threads",
            format!(
                "is {:?}; give one or more thread counts in 1..={MAX_THREADS}",
                opts.threads
            ),
        ));
    }
    if !(opts.budget_s.is_finite() && opts.budget_s > 0.0) {
        return Err(Error::config(
            "budget_s",
            format!("is {}; give a positive number of seconds", opts.budget_s),
        ));
    }
    if opts.max_files == 0 {
        return Err(Error::config("max_files", "is 0; at least 1 file must be read"));
    }
    Ok(threads)
}

/// Up to `max_files` of the dataset's non-empty files found by `walk_end`, in a fixed random
/// order, and the mean size of all files found.
fn probe_files(dataset: &Path, max_files: usize, walk_end: Instant) -> Result<(Vec<(PathBuf, u64)>, u64)> {
    let mut files = walk(dataset, max_files.saturating_mul(16).max(1024), walk_end)?;
    if files.is_empty() {
        return Err(Error::config(
            "dataset",
            format!("{}: no non-empty files found to measure", dataset.display()),
        ));
    }
    let mean_size = files.iter().map(|f| f.1).sum::<u64>() / files.len() as u64;
    shuffle(&mut files, 0x5eed_c1a1_4701_a417);
    files.truncate(max_files);
    Ok((files, mean_size))
}

/// Storage: t(γ) and the open latency, each thread count reading its own files by `end`.
fn probe_storage(files: &[(PathBuf, u64)], threads: &[u32], end: Instant, opts: &ProbeOptions) -> Result<PfsSpec> {
    let mut points = Vec::new();
    let (mut open_total, mut opens) = (Duration::ZERO, 0u64);
    let groups = split_files(files, threads.len());
    for (k, &p) in threads.iter().enumerate() {
        let left = threads.len() - k;
        let deadline = Instant::now() + end.saturating_duration_since(Instant::now()) / left as u32;
        let r = read_files(&groups[k], p, deadline)?;
        open_total += r.open_time;
        opens += r.opens;
        let io = r.elapsed.saturating_sub(r.open_time / p).max(r.elapsed.mul_f64(0.05));
        let mbps = rate(r.bytes, io);
        opts.say(&format!(
            "probe: storage, {p} readers: {mbps:.1} MB/s ({} files)",
            r.opens
        ));
        points.push((p as f64, mbps));
    }
    let open_latency_s = if opens > 0 {
        round_sig(open_total.as_secs_f64() / opens as f64, 3)
    } else {
        0.0
    };
    opts.say(&format!("probe: storage open latency {:.3} ms", open_latency_s * 1e3));
    Ok(PfsSpec {
        read_mbps: Curve(points),
        open_latency_s,
    })
}

/// Memory: the copy rate with each thread count, by `end`.
fn probe_memory(threads: &[u32], end: Instant, opts: &ProbeOptions) -> Curve {
    let mut points = Vec::new();
    for (k, &p) in threads.iter().enumerate() {
        let left = threads.len() - k;
        let deadline = Instant::now() + end.saturating_duration_since(Instant::now()) / left as u32;
        let mbps = memcpy_rate(p, deadline);
        opts.say(&format!("probe: memory copy, {p} threads: {mbps:.0} MB/s"));
        points.push((p as f64, mbps));
    }
    Curve(points)
}

/// The memory copy rate as the staging buffer's write rate and the memory class's rates (a
/// memory class is added first if the model has none).
fn set_memory_curves(base: &mut SystemModel, mem: Curve) {
    base.staging.write_mbps = mem.clone();
    match base.memory_class() {
        Some(j) => {
            base.classes[j].read_mbps = mem.clone();
            base.classes[j].write_mbps = mem;
        }
        None => {
            let mut c = defaults::memory_class(0);
            c.read_mbps = mem.clone();
            c.write_mbps = mem;
            base.classes.insert(0, c);
        }
    }
}

/// The SSD directory's measured rates and capacity on its class (the class on `dir`, else the
/// one named "ssd", else a new one).
fn set_directory_class(base: &mut SystemModel, dir: &Path, read: Curve, write: Curve) -> Result<()> {
    let j = base
        .classes
        .iter()
        .position(|c| matches!(&c.kind, ClassKind::Directory { path } if path == dir))
        .or_else(|| base.class_index("ssd"));
    let j = match j {
        Some(j) => j,
        None => {
            base.classes
                .push(defaults::directory_class("ssd", dir.to_path_buf(), Some(0)));
            base.classes.len() - 1
        }
    };
    let c = &mut base.classes[j];
    c.kind = ClassKind::Directory {
        path: dir.to_path_buf(),
    };
    c.capacity = defaults::round_mib((free_space(dir)? as f64 * defaults::DISK_SHARE) as u64);
    c.read_mbps = read;
    c.write_mbps = write;
    Ok(())
}

/// MB/s for `bytes` in `t` to 4 significant digits (measurements are not more precise, and the
/// saved file stays readable), never 0 (curves need y > 0).
fn rate(bytes: u64, t: Duration) -> f64 {
    let s = t.as_secs_f64().max(1e-6);
    round_sig((bytes as f64 / 1e6 / s).max(1e-3), 4)
}

/// `x` rounded to `digits` significant decimal digits.
fn round_sig(x: f64, digits: i32) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(digits - 1 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

/// Non-empty regular files under `root` (or `root` itself when it is a file), with sizes; stops
/// after `max` files, [`WALK_MAX_ENTRIES`] entries or at `deadline`. Symbolic links to files count.
fn walk(root: &Path, max: usize, deadline: Instant) -> Result<Vec<(PathBuf, u64)>> {
    let meta = std::fs::metadata(root).map_err(|e| Error::io(root, e))?;
    if meta.is_file() {
        return Ok(if meta.len() > 0 {
            vec![(root.to_path_buf(), meta.len())]
        } else {
            vec![]
        });
    }
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    let mut seen = 0usize;
    while let Some(dir) = stack.pop() {
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if dir == root => return Err(Error::io(root, e)),
            Err(_) => continue, // unreadable subdirectory: skip
        };
        let mut entries: Vec<_> = rd.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            seen += 1;
            if out.len() >= max || seen >= WALK_MAX_ENTRIES || Instant::now() >= deadline {
                return Ok(out);
            }
            let Ok(ft) = e.file_type() else { continue };
            let path = e.path();
            if ft.is_dir() {
                stack.push(path);
            } else if let Ok(m) = std::fs::metadata(&path) {
                if m.is_file() && m.len() > 0 {
                    out.push((path, m.len()));
                }
            }
        }
    }
    Ok(out)
}

/// Deterministic Fisher-Yates with splitmix64.
fn shuffle<T>(v: &mut [T], seed: u64) {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}

/// `n` disjoint groups of files (round-robin); when there are fewer files than groups, every
/// group gets all of them.
fn split_files(files: &[(PathBuf, u64)], n: usize) -> Vec<Vec<PathBuf>> {
    if files.len() < n {
        return vec![files.iter().map(|f| f.0.clone()).collect(); n];
    }
    let mut g = vec![Vec::new(); n];
    for (i, f) in files.iter().enumerate() {
        g[i % n].push(f.0.clone());
    }
    g
}

struct ReadStats {
    bytes: u64,
    opens: u64,
    open_time: Duration,
    elapsed: Duration,
}

/// Read `files` (each up to [`MAX_READ_PER_FILE`]) with `p` threads until done or `deadline`.
fn read_files(files: &[PathBuf], p: u32, deadline: Instant) -> Result<ReadStats> {
    let next = AtomicUsize::new(0);
    let bytes = AtomicU64::new(0);
    let opens = AtomicU64::new(0);
    let open_ns = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..p)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let mut buf = vec![0u8; 1 << 20];
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= files.len() || Instant::now() >= deadline {
                            return Ok(());
                        }
                        let path = &files[i];
                        let t = Instant::now();
                        let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
                        open_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        opens.fetch_add(1, Ordering::Relaxed);
                        let mut got = 0usize;
                        while got < MAX_READ_PER_FILE {
                            let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
                            if n == 0 {
                                break;
                            }
                            got += n;
                            if Instant::now() >= deadline {
                                break;
                            }
                        }
                        bytes.fetch_add(got as u64, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().expect("probe reader panicked")?;
        }
        Ok(())
    })?;
    Ok(ReadStats {
        bytes: bytes.into_inner(),
        opens: opens.into_inner(),
        open_time: Duration::from_nanos(open_ns.into_inner()),
        elapsed: start.elapsed(),
    })
}

/// Aggregate memory-copy throughput (MB/s copied) of `p` threads until `deadline` (at least one
/// copy each).
fn memcpy_rate(p: u32, deadline: Instant) -> f64 {
    let per = (MEMCPY_BYTES / p as usize).max(8 << 20);
    let barrier = Barrier::new(p as usize + 1);
    let copied = AtomicU64::new(0);
    let elapsed = std::thread::scope(|s| {
        for _ in 0..p {
            s.spawn(|| {
                let src = vec![0x5au8; per];
                let mut dst = vec![0u8; per];
                barrier.wait();
                loop {
                    dst.copy_from_slice(std::hint::black_box(&src));
                    std::hint::black_box(&mut dst);
                    copied.fetch_add(per as u64, Ordering::Relaxed);
                    if Instant::now() >= deadline {
                        break;
                    }
                }
                barrier.wait();
            });
        }
        barrier.wait();
        let t = Instant::now();
        barrier.wait();
        t.elapsed()
    });
    rate(copied.into_inner(), elapsed)
}

/// Removes the probe directory when dropped.
/// The probe's private scratch folder in a measured directory: an unpredictable name, mode 0700
/// (`tempfile`), removed with everything in it when dropped.
struct Scratch(tempfile::TempDir);

#[cfg(target_os = "linux")]
fn drop_from_cache(f: &File) {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a valid open descriptor; advice only.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_from_cache(_: &File) {}

/// (read, write) curves of directory `dir` with files of `size` bytes.
fn probe_dir(dir: &Path, size: usize, threads: &[u32], end: Instant, opts: &ProbeOptions) -> Result<(Curve, Curve)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let scratch = Scratch(
        tempfile::Builder::new()
            .prefix(".clairvoyant-probe-")
            .tempdir_in(dir)
            .map_err(|e| Error::io(dir, e))?,
    );
    // Never write more than a tenth of the free space, nor 1 GiB, per thread count.
    let cap_bytes = (free_space(dir)? / 10).min(1 << 30).max(size as u64);
    let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(7)).collect();
    let (mut rp, mut wp) = (Vec::new(), Vec::new());
    for (k, &p) in threads.iter().enumerate() {
        let slice = end.saturating_duration_since(Instant::now()) / (threads.len() - k) as u32;
        let write_end = Instant::now() + slice / 2;
        let max_files = (cap_bytes / size as u64).max(p as u64) as usize;
        let start = Instant::now();
        let written = write_files(scratch.0.path(), &data, p, max_files, write_end)?;
        let n: usize = written.iter().map(Vec::len).sum();
        let w = rate(n as u64 * size as u64, start.elapsed());
        // Read back, each thread its own files.
        let read_end = Instant::now() + slice / 2;
        let start = Instant::now();
        let got = read_back(&written, size, read_end)?;
        let r = rate(got, start.elapsed());
        for path in written.iter().flatten() {
            let _ = std::fs::remove_file(path);
        }
        opts.say(&format!(
            "probe: {} with {p} threads: write {w:.0} MB/s, read {r:.0} MB/s ({n} files)",
            dir.display()
        ));
        wp.push((p as f64, w));
        rp.push((p as f64, r));
    }
    drop(scratch);
    Ok((Curve(rp), Curve(wp)))
}

/// Write up to `max_files` copies of `data` into `scratch` with `p` threads, each fsync'ed and
/// dropped from the page cache, until `write_end` (each thread writes at least one): the files
/// each thread wrote.
fn write_files(scratch: &Path, data: &[u8], p: u32, max_files: usize, write_end: Instant) -> Result<Vec<Vec<PathBuf>>> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| -> Result<Vec<Vec<PathBuf>>> {
        let workers: Vec<_> = (0..p)
            .map(|t| {
                let next = &next;
                s.spawn(move || -> Result<Vec<PathBuf>> {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= max_files || (!mine.is_empty() && Instant::now() >= write_end) {
                            return Ok(mine);
                        }
                        let path = scratch.join(format!("p{p}-t{t}-{i}"));
                        let mut f = crate::tier::secure::create_new(&path).map_err(|e| Error::io(&path, e))?;
                        f.write_all(data).map_err(|e| Error::io(&path, e))?;
                        f.sync_all().map_err(|e| Error::io(&path, e))?;
                        drop_from_cache(&f);
                        mine.push(path);
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("probe writer panicked"))
            .collect()
    })
}

/// Read the files of `size` bytes back, one thread per writer's files, until `read_end` (each
/// thread reads at least one): the bytes read.
fn read_back(written: &[Vec<PathBuf>], size: usize, read_end: Instant) -> Result<u64> {
    let got = AtomicU64::new(0);
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = written
            .iter()
            .map(|mine| {
                let got = &got;
                s.spawn(move || -> Result<()> {
                    let mut buf = vec![0u8; size];
                    for (i, path) in mine.iter().enumerate() {
                        if i > 0 && Instant::now() >= read_end {
                            break;
                        }
                        let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
                        f.read_exact(&mut buf).map_err(|e| Error::io(path, e))?;
                        got.fetch_add(size as u64, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("probe reader panicked")?;
        }
        Ok(())
    })?;
    Ok(got.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysinfo::ENV_LOCK;

    fn dataset(dir: &Path, n: usize, size: usize) {
        for i in 0..n {
            let sub = dir.join(format!("class{}", i % 3));
            std::fs::create_dir_all(&sub).unwrap();
            std::fs::write(sub.join(format!("{i}.bin")), vec![i as u8; size + i]).unwrap();
        }
        std::fs::write(dir.join("empty"), b"").unwrap();
    }

    fn check_curve(c: &Curve) {
        assert!(!c.0.is_empty());
        assert!(c.0.iter().all(|&(x, y)| x >= 1.0 && y > 0.0 && y.is_finite()), "{c:?}");
        assert!(c.0.windows(2).all(|w| w[0].0 < w[1].0), "{c:?}");
    }

    #[test]
    fn probed_model_validates_and_round_trips() {
        let _g = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let data = tempfile::tempdir().unwrap();
        let ssd = tempfile::tempdir().unwrap();
        dataset(data.path(), 40, 32 << 10);
        let lines = std::cell::RefCell::new(Vec::<String>::new());
        let log = |s: &str| lines.borrow_mut().push(s.to_string());
        let opts = ProbeOptions {
            ssd_dir: Some(ssd.path().to_path_buf()),
            max_files: 32,
            threads: vec![4, 1, 2],
            budget_s: 1.0,
            progress: Some(&log),
        };
        let t = Instant::now();
        let m = probe(data.path(), &opts).unwrap();
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        m.validate().unwrap();
        check_curve(&m.pfs.read_mbps);
        assert_eq!(
            m.pfs.read_mbps.0.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![1.0, 2.0, 4.0]
        );
        assert!(m.pfs.open_latency_s >= 0.0);
        check_curve(&m.staging.write_mbps);
        for c in &m.classes {
            check_curve(&c.read_mbps);
            check_curve(&c.write_mbps);
        }
        let j = m.class_index("ssd").unwrap();
        assert_eq!(
            m.classes[j].kind,
            ClassKind::Directory {
                path: ssd.path().to_path_buf()
            }
        );
        // Nothing left behind in the SSD directory.
        assert_eq!(std::fs::read_dir(ssd.path()).unwrap().count(), 0);
        assert!(lines.borrow().iter().any(|l| l.contains("storage")));

        let out = tempfile::tempdir().unwrap();
        let path = out.path().join("system.toml");
        m.save(&path).unwrap();
        let loaded = SystemModel::load(&path).unwrap();
        // The open latency is written in ms and read back divided by 1000, which can move the
        // last bit of an arbitrary measured value; everything else loads back equal.
        assert!((loaded.pfs.open_latency_s - m.pfs.open_latency_s).abs() <= 1e-12);
        let mut same = loaded.clone();
        same.pfs.open_latency_s = m.pfs.open_latency_s;
        assert_eq!(same, m);
    }

    #[test]
    fn probe_without_ssd_and_single_file() {
        let _g = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let data = tempfile::tempdir().unwrap();
        let f = data.path().join("one.bin");
        std::fs::write(&f, vec![1u8; 100_000]).unwrap();
        let opts = ProbeOptions {
            budget_s: 0.3,
            ..Default::default()
        };
        let m = probe(&f, &opts).unwrap();
        m.validate().unwrap();
        check_curve(&m.pfs.read_mbps);
        assert_eq!(m.pfs.read_mbps.0.len(), 4);
    }

    #[test]
    fn probe_option_errors() {
        let data = tempfile::tempdir().unwrap();
        let key = |r: Result<SystemModel>| match r {
            Err(Error::Config { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        let o = ProbeOptions {
            threads: vec![],
            ..Default::default()
        };
        assert_eq!(key(probe(data.path(), &o)), "threads");
        let o = ProbeOptions {
            threads: vec![0, 2],
            ..Default::default()
        };
        assert_eq!(key(probe(data.path(), &o)), "threads");
        let o = ProbeOptions {
            budget_s: 0.0,
            ..Default::default()
        };
        assert_eq!(key(probe(data.path(), &o)), "budget_s");
        let o = ProbeOptions {
            max_files: 0,
            ..Default::default()
        };
        assert_eq!(key(probe(data.path(), &o)), "max_files");
        // No files to read.
        let o = ProbeOptions {
            budget_s: 0.2,
            ..Default::default()
        };
        assert_eq!(key(probe(data.path(), &o)), "dataset");
        assert!(matches!(probe(&data.path().join("missing"), &o), Err(Error::Io { .. })));
    }

    /// Prints a probed model of this machine (the workspace sources as the dataset, a temporary
    /// SSD directory): `cargo test --release -p clairvoyant-core probe_report -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn probe_report() {
        let ssd = tempfile::tempdir().unwrap();
        let log = |s: &str| eprintln!("{s}");
        let opts = ProbeOptions {
            ssd_dir: Some(ssd.path().to_path_buf()),
            budget_s: 6.0,
            progress: Some(&log),
            ..Default::default()
        };
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let m = probe(&root, &opts).unwrap();
        println!("{}", m.to_toml_string());
    }

    #[test]
    fn rounding() {
        assert_eq!(round_sig(2069.4727502482565, 4), 2069.0);
        assert_eq!(round_sig(0.00492595703125, 3), 0.00493);
        assert_eq!(round_sig(13137.79, 4), 13140.0);
        assert_eq!(rate(0, Duration::from_secs(1)), 1e-3);
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v: Vec<u32> = (0..100).collect();
        shuffle(&mut v, 7);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        v.sort_unstable();
        assert_eq!(v, (0..100).collect::<Vec<_>>());
    }
}
