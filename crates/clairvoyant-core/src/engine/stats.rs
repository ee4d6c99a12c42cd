//! Per-epoch statistics of one rank.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Inner, Src};

/// Per-epoch figures of one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpochStats {
    /// The epoch these figures are for (0-based).
    pub epoch: u32,
    /// Samples this rank consumed in the epoch.
    pub samples: u64,
    /// Bytes of the samples this rank consumed in the epoch.
    pub bytes: u64,
    /// Seconds the consumer waited for a sample that was not staged yet.
    pub stall_seconds: f64,
    /// (samples, bytes) per [`Src`], in the order of [`super::SOURCE_NAMES`].
    pub by_source: [(u64, u64); 5],
    /// Bytes this rank read from the dataset's storage while the epoch was consumed
    /// (staging and class prefetchers together).
    pub pfs_bytes_read: u64,
    /// Files this rank read from the dataset's storage while the epoch was consumed.
    pub pfs_files_read: u64,
    /// Bytes staged outside the ring because the consumer still held every staged sample.
    pub overflow_bytes: u64,
    /// Samples whose cached copy was wrong (checksum mismatch or short) and that were read
    /// again from the dataset.
    pub corrupt: u64,
    /// Fetches from a peer that it could not answer (not filled yet, not held, corrupt): read
    /// from the dataset instead. Counted while the epoch was consumed, like `pfs_bytes_read`.
    pub peer_misses: u64,
    /// Fetches not sent to a peer because it was down: read from the dataset instead.
    pub peer_fallbacks: u64,
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
            let mut base = self.peer_at_epoch_start.lock().unwrap();
            let (m, d) = (
                self.peer_misses.load(Ordering::Relaxed),
                self.peer_fallbacks.load(Ordering::Relaxed),
            );
            s.peer_misses = m - base.0;
            s.peer_fallbacks = d - base.1;
            *base = (m, d);
        }
    }
}
