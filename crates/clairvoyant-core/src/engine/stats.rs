//! Per-epoch statistics of one rank.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Inner, Src};

/// Per-epoch figures of one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpochStats {
    pub epoch: u32,
    pub samples: u64,
    pub bytes: u64,
    pub stall_seconds: f64,
    pub by_source: [(u64, u64); 4],
    /// Bytes this rank read from the dataset's storage while the epoch was consumed
    /// (staging and class prefetchers together).
    pub pfs_bytes_read: u64,
    pub pfs_files_read: u64,
    /// Bytes staged outside the ring because the consumer still held every staged sample.
    pub overflow_bytes: u64,
    /// Samples whose cached copy was wrong (checksum mismatch or short) and that were read
    /// again from the dataset.
    pub corrupt: u64,
}

/// How one consumed sample was served.
pub(super) struct Served {
    pub(super) bytes: u64,
    pub(super) src: Src,
    /// Staged outside the ring.
    pub(super) overflow: bool,
    /// Its cached copy was wrong.
    pub(super) corrupt: bool,
}

impl Inner {
    pub(super) fn add_stall(&self, epoch: u32, d: Duration) {
        self.stats.lock().unwrap()[epoch as usize].stall_seconds += d.as_secs_f64();
    }

    /// Count a consumed sample of `epoch`; `closes`: it was the epoch's last.
    pub(super) fn record(&self, epoch: u32, closes: bool, stalled: Duration, served: Served) {
        let Served {
            bytes,
            src,
            overflow,
            corrupt,
        } = served;
        let mut stats = self.stats.lock().unwrap();
        let s = &mut stats[epoch as usize];
        s.stall_seconds += stalled.as_secs_f64();
        s.samples += 1;
        s.bytes += bytes;
        s.by_source[src as usize].0 += 1;
        s.by_source[src as usize].1 += bytes;
        if overflow {
            s.overflow_bytes += bytes;
        }
        if corrupt {
            s.corrupt += 1;
        }
        if closes {
            // Close the epoch's PFS figures.
            let mut base = self.pfs_at_epoch_start.lock().unwrap();
            let (b, f) = (
                self.pfs_bytes.load(Ordering::Relaxed),
                self.pfs_files.load(Ordering::Relaxed),
            );
            s.pfs_bytes_read = b - base.0;
            s.pfs_files_read = f - base.1;
            *base = (b, f);
        }
    }
}
