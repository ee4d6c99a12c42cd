//! An emulated shared file system: per-open latency plus an aggregate bandwidth cap shared by every
//! process on the machine through a small mmap'ed state file, so that ranks and DataLoader workers
//! of any loader see the same slow storage in benchmarks. `Throttled` wraps any `Source` in it.
//!
//! Model. A read of `s` bytes first sleeps `open_latency_s`; latencies of concurrent readers
//! overlap (as round trips to a file server do). It then reserves transfer time `s / bandwidth` on
//! one virtual timeline shared by all readers: `next_free_ns` on CLOCK_MONOTONIC (system-wide, so
//! comparable across processes), advanced with a compare-and-swap to `max(now, next_free) + d`,
//! and sleeps until the reservation ends. Long transfers reserve in slices of at least 10 ms so
//! that concurrent readers interleave rather than queue behind one large file. Hence with γ
//! concurrent readers of files of `s` bytes the aggregate throughput is about
//! `min(bandwidth, γ·s / (latency + s/bandwidth))`: it grows with γ until the bandwidth caps it,
//! which is the t(γ) shape of a parallel file system. The real bytes are read during the first
//! slice, so the real read's own time is hidden whenever it is shorter than the emulated one.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memmap2::MmapMut;
use serde::{Deserialize, Serialize};

use super::index::{read_exact_file, Fnv1a};
use super::Source;
use crate::error::{Error, Result};

/// Size of the state file; only the first four u64 slots are used, the rest is reserved.
const STATE_LEN: u64 = 64;
const SLOT_BOOT: usize = 0;
const SLOT_NEXT_FREE: usize = 1;
const SLOT_BYTES: usize = 2;
const SLOT_FILES: usize = 3;
/// Shortest bandwidth reservation: finer slices only add sleep overhead.
const MIN_SLICE_NS: u64 = 10_000_000;

/// Parameters of the emulated file system.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmulatedSpec {
    /// Latency of each file open, in seconds; overlaps between concurrent readers.
    pub open_latency_s: f64,
    /// Aggregate bandwidth over all readers on the machine, MB/s (1 MB = 1e6 bytes). Infinity
    /// means unlimited.
    pub bandwidth_mbps: f64,
}

impl EmulatedSpec {
    fn validate(&self) -> Result<()> {
        if !(self.open_latency_s.is_finite() && self.open_latency_s >= 0.0) {
            return Err(Error::config(
                "open_latency_s",
                format!("must be a finite number >= 0, got {}", self.open_latency_s),
            ));
        }
        if self.bandwidth_mbps.is_nan() || self.bandwidth_mbps <= 0.0 {
            return Err(Error::config(
                "bandwidth_mbps",
                format!("must be > 0, got {}", self.bandwidth_mbps),
            ));
        }
        Ok(())
    }

    /// Emulated transfer time of `bytes`, in ns.
    fn transfer_ns(&self, bytes: u64) -> u64 {
        (bytes as f64 / (self.bandwidth_mbps * 1e6) * 1e9) as u64
    }
}

/// A handle on the emulated file system; handles on the same state file share its bandwidth and
/// counters, across threads, processes and `fork` (the mapping is MAP_SHARED).
pub struct EmulatedFs {
    spec: EmulatedSpec,
    state_path: PathBuf,
    map: MmapMut,
}

impl std::fmt::Debug for EmulatedFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedFs")
            .field("spec", &self.spec)
            .field("state_path", &self.state_path)
            .finish()
    }
}

impl EmulatedFs {
    /// Maps the state file at `state_path`, creating it (zeroed) if missing. All users of one
    /// state file should pass the same spec; the bandwidth timeline is shared, the spec is not.
    pub fn open(spec: EmulatedSpec, state_path: &Path) -> Result<Arc<EmulatedFs>> {
        spec.validate()?;
        let io = |e| Error::io(state_path, e);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(state_path)
            .map_err(io)?;
        // Growing only: a concurrent opener may already be using the counters.
        if file.metadata().map_err(io)?.len() < STATE_LEN {
            file.set_len(STATE_LEN).map_err(io)?;
        }
        // SAFETY: the file is at least STATE_LEN bytes and is only ever accessed through the
        // atomics below (never truncated by us), so concurrent writers from other processes are
        // the intended shared-memory use rather than a data race on plain memory.
        let map = unsafe { memmap2::MmapOptions::new().len(STATE_LEN as usize).map_mut(&file) }.map_err(io)?;
        let fs = EmulatedFs {
            spec,
            state_path: state_path.to_path_buf(),
            map,
        };
        // CLOCK_MONOTONIC restarts at boot: a timeline left by a previous boot could lie far in the
        // future and stall every reader, so reset it when the boot differs.
        let boot = boot_id();
        if fs.slot(SLOT_BOOT).swap(boot, Ordering::AcqRel) != boot {
            fs.slot(SLOT_NEXT_FREE).store(0, Ordering::Release);
        }
        Ok(Arc::new(fs))
    }

    fn slot(&self, k: usize) -> &AtomicU64 {
        debug_assert!((k + 1) * 8 <= STATE_LEN as usize);
        // SAFETY: the mapping is page-aligned, at least STATE_LEN bytes and lives as long as
        // `self`; AtomicU64 has the size and alignment of u64, and every access goes through it.
        unsafe { &*(self.map.as_ptr().add(k * 8) as *const AtomicU64) }
    }

    /// The latency and bandwidth this file system emulates.
    pub fn spec(&self) -> EmulatedSpec {
        self.spec
    }

    /// The shared state file (timeline and counters) this handle maps.
    pub fn state_path(&self) -> &Path {
        &self.state_path
    }

    /// Bytes read through every handle on this state file since the last reset.
    pub fn bytes_read(&self) -> u64 {
        self.slot(SLOT_BYTES).load(Ordering::Relaxed)
    }

    /// Files read through every handle on this state file since the last reset.
    pub fn files_read(&self) -> u64 {
        self.slot(SLOT_FILES).load(Ordering::Relaxed)
    }

    /// Zeroes the counters (not the bandwidth timeline, which readers may be sleeping on).
    pub fn reset_counters(&self) {
        self.slot(SLOT_BYTES).store(0, Ordering::Relaxed);
        self.slot(SLOT_FILES).store(0, Ordering::Relaxed);
    }

    /// Charges one file read of `bytes` (latency, then bandwidth) and runs `read`, which does the
    /// real I/O, inside the first bandwidth slice. An error from `read` is returned at once and
    /// not counted.
    pub fn charge<T>(&self, bytes: u64, read: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.spec.open_latency_s > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(self.spec.open_latency_s));
        }
        let total = self.spec.transfer_ns(bytes);
        let slice = MIN_SLICE_NS.max(self.spec.transfer_ns(1_000_000));
        let mut read = Some(read);
        let mut value = None;
        let mut left = total;
        loop {
            let d = left.min(slice);
            let end = self.reserve(d);
            if let Some(r) = read.take() {
                value = Some(r()?);
            }
            sleep_until(end);
            left -= d;
            if left == 0 {
                break;
            }
        }
        self.slot(SLOT_BYTES).fetch_add(bytes, Ordering::Relaxed);
        self.slot(SLOT_FILES).fetch_add(1, Ordering::Relaxed);
        Ok(value.expect("the read runs in the first slice"))
    }

    /// Reserves `d` ns on the shared timeline; returns the end of the reservation.
    fn reserve(&self, d: u64) -> u64 {
        let next = self.slot(SLOT_NEXT_FREE);
        let mut cur = next.load(Ordering::Acquire);
        loop {
            let end = cur.max(monotonic_ns()) + d;
            match next.compare_exchange_weak(cur, end, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return end,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Reads the whole file at `path` through the emulation. Any failure, a missing file included
    /// (`io::ErrorKind::NotFound`), is `Error::Io` naming the path.
    pub fn read_file(&self, path: &Path) -> Result<Vec<u8>> {
        let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
        let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
        self.charge(size, || {
            let mut v = Vec::with_capacity(size as usize);
            f.read_to_end(&mut v).map_err(|e| Error::io(path, e))?;
            Ok(v)
        })
    }

    /// Reads `path`, which must be exactly `buf.len()` bytes, through the emulation, with the
    /// rules of `FileSource::read_into`: missing is `NotFound { sample, path }`, another size is
    /// `Changed`.
    pub fn read_into(&self, sample: u64, path: &Path, buf: &mut [u8]) -> Result<()> {
        self.charge(buf.len() as u64, || {
            read_exact_file(sample, path, buf, Path::new("(none: the size was given by the caller)"))
        })
    }
}

/// A `Source` whose reads go through an `EmulatedFs`; the bytes still come from `inner`.
#[derive(Clone)]
pub struct Throttled {
    /// The source the bytes, sizes and labels come from.
    pub inner: Arc<dyn Source>,
    /// The emulated file system every read is charged to.
    pub fs: Arc<EmulatedFs>,
}

impl Throttled {
    /// Wraps `inner` so that its reads pay `fs`'s latency and share its bandwidth.
    pub fn new(inner: Arc<dyn Source>, fs: Arc<EmulatedFs>) -> Throttled {
        Throttled { inner, fs }
    }
}

impl std::fmt::Debug for Throttled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Throttled")
            .field("len", &self.inner.len())
            .field("fs", &self.fs)
            .finish()
    }
}

impl Source for Throttled {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn size(&self, sample: u32) -> u64 {
        self.inner.size(sample)
    }
    fn label(&self, sample: u32) -> i64 {
        self.inner.label(sample)
    }
    fn path(&self, sample: u32) -> PathBuf {
        self.inner.path(sample)
    }
    fn read_into(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        self.fs.charge(buf.len() as u64, || self.inner.read_into(sample, buf))
    }
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
    fn largest(&self) -> Option<(u32, u64)> {
        self.inner.largest()
    }
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we pass; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn sleep_until(end_ns: u64) {
    let now = monotonic_ns();
    if end_ns > now {
        std::thread::sleep(Duration::from_nanos(end_ns - now));
    }
}

/// Identifies the current boot (Linux); 1 elsewhere, where the state file should be fresh per boot.
fn boot_id() -> u64 {
    match std::fs::read("/proc/sys/kernel/random/boot_id") {
        Ok(b) => {
            let mut h = Fnv1a::default();
            h.write(&b);
            h.finish() | 1
        }
        Err(_) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const SPEC: EmulatedSpec = EmulatedSpec {
        open_latency_s: 0.0,
        bandwidth_mbps: 10.0,
    };

    #[test]
    fn spec_is_validated() {
        let d = tempfile::tempdir().unwrap();
        let st = d.path().join("state");
        let bad = EmulatedSpec {
            open_latency_s: -1.0,
            bandwidth_mbps: 1.0,
        };
        assert!(matches!(EmulatedFs::open(bad, &st), Err(Error::Config { .. })));
        let bad = EmulatedSpec {
            open_latency_s: 0.0,
            bandwidth_mbps: 0.0,
        };
        assert!(matches!(EmulatedFs::open(bad, &st), Err(Error::Config { .. })));
        let unlimited = EmulatedSpec {
            open_latency_s: 0.0,
            bandwidth_mbps: f64::INFINITY,
        };
        let fs = EmulatedFs::open(unlimited, &st).unwrap();
        assert_eq!(fs.charge(1 << 30, || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn latency_overlaps_between_readers() {
        let d = tempfile::tempdir().unwrap();
        let spec = EmulatedSpec {
            open_latency_s: 0.1,
            bandwidth_mbps: f64::INFINITY,
        };
        let fs = EmulatedFs::open(spec, &d.path().join("state")).unwrap();
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| fs.charge(10, || Ok(())).unwrap());
            }
        });
        let el = t.elapsed().as_secs_f64();
        assert!((0.1..0.5).contains(&el), "8 overlapping 0.1 s opens took {el}");
        assert_eq!(fs.files_read(), 8);
        assert_eq!(fs.bytes_read(), 80);
    }

    #[test]
    fn failed_reads_are_not_counted() {
        let d = tempfile::tempdir().unwrap();
        let fs = EmulatedFs::open(SPEC, &d.path().join("state")).unwrap();
        let err = fs.read_file(&d.path().join("missing")).unwrap_err();
        assert!(
            matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{err}"
        );
        let mut buf = [0u8; 4];
        let err = fs.read_into(3, &d.path().join("missing"), &mut buf).unwrap_err();
        assert!(matches!(err, Error::NotFound { sample: 3, .. }), "{err}");
        assert_eq!(fs.files_read(), 0);
    }
}
