//! What the engine's integration tests share (feature `test-support`, never in a build that
//! ships): a dataset whose bytes follow from (sample, position) and count their reads, and small
//! system models of one fast storage class.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::model::{ClassKind, ClassSpec, Curve, PfsSpec, StagingSpec, SystemModel};
use crate::source::Source;
use crate::Result;

/// A dataset held nowhere: sample `k`'s byte `i` is [`PatternSource::byte`]`(k, i)`; every read
/// is counted per sample and may take a fixed time.
#[derive(Debug)]
pub struct PatternSource {
    sizes: Vec<u64>,
    reads: Vec<AtomicU64>,
    fingerprint: u64,
    prefix: String,
    delay: Duration,
}

impl PatternSource {
    /// Samples of `sizes` bytes, named `<prefix>/<k>`, with the dataset fingerprint `fingerprint`
    /// (it keys the node cache: tests running at once take different ones).
    pub fn new(sizes: Vec<u64>, prefix: &str, fingerprint: u64) -> PatternSource {
        PatternSource {
            reads: sizes.iter().map(|_| AtomicU64::new(0)).collect(),
            sizes,
            fingerprint,
            prefix: prefix.into(),
            delay: Duration::ZERO,
        }
    }

    /// The same, each read taking `delay` first (a file system slow enough to be worth caching).
    pub fn with_read_delay(mut self, delay: Duration) -> PatternSource {
        self.delay = delay;
        self
    }

    /// Byte `i` of sample `k`.
    pub fn byte(k: u32, i: usize) -> u8 {
        (k as usize * 131 + i * 7) as u8
    }

    /// Sample `k`'s bytes.
    pub fn bytes(&self, k: u32) -> Vec<u8> {
        (0..self.sizes[k as usize] as usize).map(|i| Self::byte(k, i)).collect()
    }

    /// How often sample `k` was read.
    pub fn reads(&self, k: u32) -> u64 {
        self.reads[k as usize].load(Ordering::Relaxed)
    }

    /// Samples read, all reads counted.
    pub fn files_read(&self) -> u64 {
        self.reads.iter().map(|r| r.load(Ordering::Relaxed)).sum()
    }

    /// Bytes read, all reads counted.
    pub fn bytes_read(&self) -> u64 {
        (0..self.sizes.len() as u32)
            .map(|k| self.reads(k) * self.sizes[k as usize])
            .sum()
    }

    /// The dataset's size in bytes.
    pub fn total(&self) -> u64 {
        self.sizes.iter().sum()
    }
}

impl Source for PatternSource {
    fn len(&self) -> usize {
        self.sizes.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.sizes[k as usize]
    }
    fn label(&self, k: u32) -> i64 {
        k as i64 % 10
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("{}/{k}", self.prefix))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        self.reads[k as usize].fetch_add(1, Ordering::Relaxed);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Self::byte(k, i);
        }
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// A storage class named `name` of `kind` holding `capacity` bytes, with 2 threads at 10 GB/s.
pub fn fast_class(name: &str, kind: ClassKind, capacity: u64) -> ClassSpec {
    ClassSpec {
        name: name.into(),
        kind,
        capacity,
        threads: 2,
        read_mbps: Curve::constant(10_000.0),
        write_mbps: Curve::constant(10_000.0),
    }
}

/// A file system reading `mbps` MB/s at any concurrency, `open_latency_s` per open.
pub fn pfs(mbps: f64, open_latency_s: f64) -> PfsSpec {
    PfsSpec {
        read_mbps: Curve::constant(mbps),
        open_latency_s,
    }
}

/// A system of one storage class `class` over the file system `pfs`, staging through `staging`.
pub fn one_class_model(class: ClassSpec, staging: StagingSpec, pfs: PfsSpec) -> SystemModel {
    SystemModel {
        staging,
        pfs,
        classes: vec![class],
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

/// [`one_class_model`] of a memory class of `capacity` bytes.
pub fn memory_model(capacity: u64, staging: StagingSpec, pfs: PfsSpec) -> SystemModel {
    one_class_model(fast_class("memory", ClassKind::Memory, capacity), staging, pfs)
}

/// Invert the byte at `at` of the file `path` (a cache file damaged under the engine).
pub fn flip_byte(path: &std::path::Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0xff;
    f.write_all_at(&b, at).unwrap();
}
