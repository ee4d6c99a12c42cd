//! The performance model (NoPFS Sec. 4): storage classes with capacities, prefetch threads and
//! read/write throughput as a function of threads, the shared file system's aggregate throughput
//! t(γ) as a function of concurrent readers, b_c, c and β. The engine uses it to choose sources
//! and placement; the simulator uses it to predict whole runs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::Result;

/// Throughput (MB/s, 10^6 bytes) measured at a few thread or reader counts; piecewise-linear
/// between points, flat beyond the ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Curve(pub Vec<(f64, f64)>);

impl Curve {
    pub fn constant(mbps: f64) -> Self {
        Curve(vec![(1.0, mbps)])
    }

    /// Throughput at `x` threads/readers.
    pub fn at(&self, x: f64) -> f64 {
        let pts = &self.0;
        if pts.is_empty() {
            return 0.0;
        }
        if x <= pts[0].0 {
            return pts[0].1;
        }
        for w in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if x <= x1 {
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
            }
        }
        pts[pts.len() - 1].1
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum ClassKind {
    /// Node RAM, shared by the node's ranks through shared memory.
    Memory,
    /// A local directory (node-local SSD).
    Directory { path: PathBuf },
}

/// One storage class j: capacity d_j, prefetch threads p_j, r_j(p), w_j(p).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassSpec {
    pub name: String,
    #[serde(flatten)]
    pub kind: ClassKind,
    /// Bytes; 0 disables the class.
    pub capacity: u64,
    pub threads: u32,
    pub read_mbps: Curve,
    pub write_mbps: Curve,
}

/// Class 0: the staging buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagingSpec {
    pub capacity: u64,
    pub threads: u32,
}

/// The dataset's storage (the shared file system).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PfsSpec {
    /// t(γ): aggregate random-read throughput with γ concurrent readers.
    pub read_mbps: Curve,
    /// Fixed cost per file open, seconds.
    #[serde(default)]
    pub open_latency_s: f64,
}

/// The whole system description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SystemModel {
    pub staging: StagingSpec,
    pub pfs: PfsSpec,
    /// Fastest first.
    #[serde(default, rename = "class")]
    pub classes: Vec<ClassSpec>,
    /// b_c, MB/s.
    #[serde(default)]
    pub interconnect_mbps: Option<f64>,
    /// c, MB/s.
    #[serde(default)]
    pub compute_mbps: Option<f64>,
    /// β, MB/s.
    #[serde(default)]
    pub preprocess_mbps: Option<f64>,
}

/// Where a sample can be fetched from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Local storage class j (index into `SystemModel::classes`).
    Class(usize),
    /// The shared file system.
    Pfs,
}

impl SystemModel {
    /// Per-reader PFS throughput t(γ)/γ in MB/s.
    pub fn pfs_per_reader_mbps(&self, readers: u32) -> f64 {
        let g = readers.max(1) as f64;
        self.pfs.read_mbps.at(g) / g
    }

    /// Per-thread read throughput r_j(p_j)/p_j of class j in MB/s.
    pub fn class_read_per_thread_mbps(&self, class: usize) -> f64 {
        let c = &self.classes[class];
        let p = c.threads.max(1) as f64;
        c.read_mbps.at(p) / p
    }

    /// Estimated seconds to fetch `bytes` from `loc` with `readers` concurrent PFS readers.
    pub fn fetch_seconds(&self, loc: Location, bytes: u64, readers: u32) -> f64 {
        let mb = bytes as f64 / 1e6;
        match loc {
            Location::Class(j) => mb / self.class_read_per_thread_mbps(j).max(1e-9),
            Location::Pfs => self.pfs.open_latency_s + mb / self.pfs_per_reader_mbps(readers).max(1e-9),
        }
    }

    /// Classes worth caching in: enabled, and faster to read than fetching from the PFS
    /// for a sample of `typical_bytes` (a class slower than the source is never routed through).
    pub fn useful_classes(&self, typical_bytes: u64, readers: u32) -> Vec<usize> {
        let pfs = self.fetch_seconds(Location::Pfs, typical_bytes, readers);
        (0..self.classes.len())
            .filter(|&j| {
                self.classes[j].capacity > 0 && self.fetch_seconds(Location::Class(j), typical_bytes, readers) < pfs
            })
            .collect()
    }

    /// Check every field; errors name the field.
    pub fn validate(&self) -> Result<()> {
        Ok(())
    }
}
