//! The performance model (NoPFS Sec. 4): storage classes with capacities, prefetch threads and
//! read/write throughput as a function of threads, the shared file system's aggregate throughput
//! t(γ) as a function of concurrent readers, b_c, c and β. The engine uses it to choose sources
//! and placement; the simulator uses it to predict whole runs.
//!
//! # Notation (paper symbol → field or method)
//!
//! | paper        | meaning                                               | here                                              |
//! |--------------|-------------------------------------------------------|---------------------------------------------------|
//! | c            | compute throughput of training, MB/s                  | [`SystemModel::compute_mbps`]                     |
//! | β            | preprocessing rate, MB/s                              | [`SystemModel::preprocess_mbps`]                  |
//! | b_c          | inter-worker network bandwidth, MB/s                  | [`SystemModel::interconnect_mbps`]                |
//! | t(γ)         | aggregate random-read throughput of the PFS, γ readers| [`PfsSpec::read_mbps`] (`x` = γ)                  |
//! | t(γ)/γ       | per-reader PFS throughput                             | [`SystemModel::pfs_per_reader_mbps`]              |
//! | class 0      | the staging buffer                                    | [`SystemModel::staging`] ([`StagingSpec`])        |
//! | d_0, p_0     | staging capacity and prefetch threads                 | [`StagingSpec::capacity`], [`StagingSpec::threads`]|
//! | w_0(p)       | staging write throughput with p threads               | [`StagingSpec::write_mbps`]                       |
//! | class j ≥ 1  | a storage class (RAM, SSD, ...)                       | [`SystemModel::classes`]`[j - 1]` ([`ClassSpec`]) |
//! | d_j          | capacity of class j (bytes here, MB in the paper)     | [`ClassSpec::capacity`]                           |
//! | p_j          | prefetch threads of class j                           | [`ClassSpec::threads`]                            |
//! | r_j(p), w_j(p)| aggregate read/write throughput of class j, p threads| [`ClassSpec::read_mbps`], [`ClassSpec::write_mbps`]|
//! | r_j(p_j)/p_j | per-thread read throughput of class j                 | [`SystemModel::class_read_per_thread_mbps`]       |
//! | D = Σ d_j    | total local storage of a worker                       | [`SystemModel::local_capacity`]                   |
//! | s_k          | size of sample k                                      | the `bytes` argument                              |
//! | fetch_{i,0,0}(k) = s_k/(t(γ)/γ)        | fetch from the PFS          | [`SystemModel::fetch_seconds`]`(Location::Pfs, ..)` (+ open latency) |
//! | fetch_{i,1,j}(k) = s_k/min(b_c, r_j(p_j)/p_j) | fetch from a peer's class j | [`SystemModel::remote_fetch_seconds`]      |
//! | fetch_{i,2,j}(k) = s_k/(r_j(p_j)/p_j)  | fetch from the local class j | [`SystemModel::fetch_seconds`]`(Location::Class(j), ..)` |
//! | write_i(k) = max(s_k/β, s_k/(w_0(p_0)/p_0)) | preprocess + store in staging | [`SystemModel::write_seconds`]       |
//! | read_i(k) = fetch_i(k) + write_i(k)     | time to bring k into staging | [`SystemModel::read_seconds`]               |
//!
//! Throughput is in MB/s with MB = 10^6 bytes; capacities are bytes. Class indices used by
//! [`Location::Class`] index [`SystemModel::classes`] (0-based; the paper's class 0, the staging
//! buffer, is kept apart in [`SystemModel::staging`]).
//!
//! # Configuration file
//!
//! A TOML file (see [`SystemModel::from_toml_str`]) with human-friendly values:
//!
//! ```toml
//! interconnect_mbps = 10000.0      # optional: b_c
//! compute_mbps = 800.0             # optional: c
//! preprocess_mbps = 1500.0         # optional: β
//!
//! [staging]
//! capacity = "256 MiB"             # integer bytes or "512MiB", "8 GiB", "1.5GB"
//! threads = 4
//! write_mbps = [[1, 4000.0], [4, 16000.0]]   # optional
//!
//! [pfs]
//! read_mbps = [[1, 200.0], [10, 2000.0]]     # [[readers, MB/s], ...] or one number
//! open_latency_ms = 1.0
//!
//! [[class]]
//! name = "memory"
//! kind = "memory"
//! capacity = "8 GiB"
//! threads = 2
//! read_mbps = [[1, 5000.0], [4, 20000.0]]    # [[threads, MB/s], ...] or one number
//! write_mbps = 4000.0
//!
//! [[class]]
//! name = "ssd"
//! kind = "directory"
//! path = "/local/scratch/clairvoyant"        # relative paths are relative to the file
//! capacity = "200GB"                         # "0" or 0 disables the class
//! ```
//!
//! Missing sections and fields take the values [`SystemModel::detect`] finds on this machine; a
//! file without any `[[class]]` keeps the detected classes, `class = []` means no storage classes.
//!
//! # Layout
//!
//! One file per job: `curve` (piecewise-linear throughput tables, also the emulated file
//! system's t(γ)), `perf` (the model's estimates), `validate` (the rules, checked once),
//! `bytes` (byte sizes as people write them) and `file` (the TOML file, read and written with
//! serde).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::sysinfo::defaults;

mod bytes;
mod curve;
mod file;
mod perf;
#[cfg(test)]
mod test_support;
mod validate;

pub use bytes::{clamp_to_free, format_bytes, human_bytes, parse_bytes};
pub use curve::Curve;
pub use file::{describe_toml, deserialize_toml};

/// Most prefetch threads a class or the staging buffer may have.
pub const MAX_THREADS: u32 = 1024;

/// What a storage class is backed by.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum ClassKind {
    /// Node RAM, shared by the node's ranks through shared memory.
    Memory,
    /// A local directory (node-local SSD).
    Directory {
        /// Where the class keeps its files.
        path: PathBuf,
    },
}

/// One storage class j: capacity d_j, prefetch threads p_j, r_j(p), w_j(p).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassSpec {
    /// Unique name (`[A-Za-z0-9_-]+`), used in error keys (`class.<name>.capacity`).
    pub name: String,
    /// Memory or a directory.
    #[serde(flatten)]
    pub kind: ClassKind,
    /// Bytes; 0 disables the class.
    pub capacity: u64,
    /// p_j: prefetch threads.
    pub threads: u32,
    /// r_j(p): aggregate read throughput with p threads.
    pub read_mbps: Curve,
    /// w_j(p): aggregate write throughput with p threads.
    pub write_mbps: Curve,
}

impl ClassSpec {
    /// Enabled: capacity > 0.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }
}

fn default_staging_write() -> Curve {
    defaults::dram_write()
}

/// Class 0: the staging buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagingSpec {
    /// d_0, bytes.
    pub capacity: u64,
    /// p_0: prefetch threads.
    pub threads: u32,
    /// w_0(p): write throughput into the staging buffer with p threads (a memory copy).
    #[serde(default = "default_staging_write")]
    pub write_mbps: Curve,
}

impl StagingSpec {
    /// A staging buffer with the default (DRAM) write curve.
    pub fn new(capacity: u64, threads: u32) -> Self {
        StagingSpec {
            capacity,
            threads,
            write_mbps: default_staging_write(),
        }
    }
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
    /// Class 0, the staging buffer.
    pub staging: StagingSpec,
    /// The dataset's storage.
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
