//! Sources: where the dataset lives. One small trait, one file per backend; wrappers such as
//! the emulated shared file system compose around any source.

use std::path::PathBuf;

use crate::error::Result;

pub mod container;
pub mod dir;
pub mod emulated;
pub mod hdf5;
pub mod index;
pub mod list;
pub mod lmdb;
pub mod synthetic;
pub mod tar;

pub use dir::{image_folder, image_folder_with_index};
pub use emulated::{EmulatedFs, EmulatedSpec, Throttled};
pub use index::{default_index_dir, FileSource, Index, IndexEntry};
pub use list::{file_list, file_list_with_index, parse_list_file};
// Containers: many samples as byte ranges of a few large files.
pub use self::hdf5::{hdf5, Hdf5Layout};
pub use self::lmdb::{lmdb, Datum, LmdbRecords};
pub use self::tar::tar_shards;
pub use container::{ContainerFile, ContainerIndex, ContainerSource, Record};

/// When a dataset file last changed, in ns since the Unix epoch: the later of its modification
/// (a rewrite) and status change (a replacement by rename, a new inode) times. A cached copy
/// filled before this instant is stale.
pub fn last_change_ns(m: &std::fs::Metadata) -> i128 {
    use std::os::unix::fs::MetadataExt;
    let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
    ns(m.mtime(), m.mtime_nsec()).max(ns(m.ctime(), m.ctime_nsec()))
}

/// A dataset of `len()` samples with known sizes and integer labels.
pub trait Source: Send + Sync {
    /// Number of samples.
    fn len(&self) -> usize;
    /// True when the dataset has no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Size in bytes of `sample`, as indexed.
    fn size(&self, sample: u32) -> u64;
    /// Integer label of `sample`.
    fn label(&self, sample: u32) -> i64;
    /// Where `sample` lives (named in every error about it).
    fn path(&self, sample: u32) -> PathBuf;
    /// Read the whole of `sample` into `buf`, whose length is `size(sample)`. A missing file is
    /// `Error::NotFound`; a file whose size differs from the index is `Error::Changed`.
    fn read_into(&self, sample: u32, buf: &mut [u8]) -> Result<()>;
    /// Identifies the dataset and its index contents: equal fingerprints mean equal samples.
    fn fingerprint(&self) -> u64;
    /// Largest sample, as (sample, size); None when empty.
    fn largest(&self) -> Option<(u32, u64)> {
        (0..self.len() as u32)
            .map(|k| (k, self.size(k)))
            .max_by_key(|&(k, s)| (s, std::cmp::Reverse(k)))
    }
    /// Sum of all sample sizes.
    fn total_bytes(&self) -> u64 {
        (0..self.len() as u32).map(|k| self.size(k)).sum()
    }
}
