//! Other nodes as one more source (NoPFS Sec. 4 and 5.2): the cluster-wide placement names,
//! for every cached sample, the one node (its primary) that reads it from the dataset's storage
//! and serves it; every other node's ranks and fill threads fetch it from that node instead.
//! The transport is not this crate's business: the engine asks a [`PeerFetch`] (the peer
//! client of `clairvoyant-net`, or an in-process fake in tests) and answers peers through
//! [`PeerService`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::{ClassStore, Inner, Src};
use crate::error::Result;
use crate::plan::{NO_NODE, UNCACHED};
use crate::tier::{Acquire, Verified, READY};

/// A peer fetch (or a wait for another local process's fill of the sample, `engine/claims.rs`)
/// may take this many times the model's time to read the sample from the dataset's storage
/// before that storage is read instead (and the peer is taken off the data path, the local
/// claimant read around until it makes progress).
pub const PEER_DEADLINE_FACTOR: f64 = 2.0;
/// The shortest deadline of a peer fetch or of a wait for a local claimant: a peer or local
/// process that is alive delivers a small sample well within it even on a loaded node; a
/// stopped one costs the data path about this much once.
pub const PEER_DEADLINE_FLOOR: Duration = Duration::from_secs(2);
/// The longest deadline of a peer fetch (or of a wait for a local claimant), whatever the model
/// says of a large sample.
pub const PEER_DEADLINE_CEILING: Duration = Duration::from_secs(5);

/// How many times a fetch asks a peer that answers "not yet" (each ask lets the peer wait for
/// the fill in progress, up to the fetch's `wait`) before the dataset's storage is read instead:
/// the fill is a read of that storage already under way, and a second read would only slow it.
pub const PEER_NOT_YET_ASKS: u32 = 4;

/// What a peer answered to a fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerReply {
    /// The destination holds the sample's bytes, checked against the checksum the peer sent.
    Got,
    /// The peer holds the sample but has not filled it yet.
    NotYet,
    /// The peer does not cache the sample.
    NotHeld,
    /// The peer is not reachable (dead, stalled, refused us): not asked again for a while.
    Down,
    /// The bytes did not match their checksum.
    Corrupt,
}

/// Fetches samples from other nodes' servers by node index and sample id.
pub trait PeerFetch: Send + Sync {
    /// Fetch `sample` (exactly `dst.len()` bytes) from node `node`, letting it wait at most
    /// `wait` for a fill in progress, all within `within`: a peer that has not answered by then
    /// answers `Down` (and is not asked again until it answers a probe), and a reply that comes
    /// later is discarded, never written into `dst` after the call returned.
    fn fetch(&self, node: usize, sample: u32, wait: Duration, within: Duration, dst: &mut [u8]) -> PeerReply;
    /// Whether `node` is known to be down (so it is not asked).
    fn is_down(&self, node: usize) -> bool;
}

/// This node's part of a cluster-wide job.
#[derive(Clone)]
pub struct ClusterSpec {
    /// Every node's ranks, by node index; `nodes[node]` are the job's local ranks.
    pub nodes: Vec<Vec<u32>>,
    /// This node's index.
    pub node: usize,
    /// Every node's class capacities in bytes (the classes this job caches in, fastest first), as
    /// agreed when the nodes met: every node computes the same placement from them.
    pub capacities: Vec<Vec<u64>>,
    /// How to reach the other nodes (None: peers are never asked; every node still caches only
    /// its part).
    pub peers: Option<Arc<dyn PeerFetch>>,
    /// How long a peer may wait for a fill in progress before it answers "not yet".
    pub peer_wait: Duration,
}

impl std::fmt::Debug for ClusterSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSpec")
            .field("nodes", &self.nodes)
            .field("node", &self.node)
            .field("capacities", &self.capacities)
            .field("peers", &self.peers.is_some())
            .field("peer_wait", &self.peer_wait)
            .finish()
    }
}

/// The node's view of the cluster, kept with its node cache.
pub(super) struct ClusterShare {
    pub(super) node: usize,
    pub(super) primary: Vec<u16>,
    pub(super) peers: Option<Arc<dyn PeerFetch>>,
    pub(super) peer_wait: Duration,
}

/// A sample's bytes as served to a peer.
pub enum Serve {
    /// The bytes (borrowed from the node cache where it is a shared mapping) and the checksum
    /// recorded when they were read from the dataset.
    Ready {
        /// The sample's whole contents.
        bytes: Box<dyn AsRef<[u8]> + Send>,
        /// xxh3 checksum of `bytes`, recorded when they were read from the dataset.
        checksum: u64,
    },
    /// This node caches the sample but has not filled it yet (another fill holds it).
    NotYet,
    /// This node does not hold the sample (not placed here, no space, or not current).
    NotHeld,
    /// Reading it failed (the message names the sample's file).
    Failed(String),
}

/// Answers other nodes' requests from this node's cache. Holds the engine's shared state: the
/// node cache stays mapped while a service or a served view lives.
#[derive(Clone)]
pub struct PeerService {
    pub(super) inner: Arc<Inner>,
}

/// Bytes of the mapped memory class, kept valid by the engine state it holds.
struct Mapped {
    _keep: Arc<Inner>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is into the shared arena, mapped while `_keep` lives; bytes are only read.
unsafe impl Send for Mapped {}

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: see the Send impl; READY samples are not rewritten except to repair a copy
        // whose checksum failed, which the receiver's check would catch.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl PeerService {
    /// Serve `sample` to a peer: from this node's cache if it holds it; a sample this node is
    /// the primary of and has not filled yet is read from the dataset now (the peer would
    /// otherwise read it itself: the dataset would be read twice); one being filled is waited
    /// for at most `wait`.
    pub fn serve(&self, sample: u32, wait: Duration) -> Serve {
        self.inner.serve(sample, wait)
    }

    /// Samples and bytes served to peers so far.
    pub fn served(&self) -> (u64, u64) {
        (
            self.inner.served_samples.load(Ordering::Relaxed),
            self.inner.served_bytes.load(Ordering::Relaxed),
        )
    }
}

impl Inner {
    fn cluster(&self) -> Option<&ClusterShare> {
        self.node.cluster.as_ref()
    }

    /// The node to fetch `sample` from instead of the dataset: its primary, when that is another
    /// node, reachable, and not slower than the dataset's storage by the model.
    pub(super) fn peer_of(&self, sample: u32) -> Option<(usize, &Arc<dyn PeerFetch>)> {
        let c = self.cluster()?;
        let p = *c.primary.get(sample as usize)?;
        if p == NO_NODE || p as usize == c.node || !self.peer_faster {
            return None;
        }
        let peers = c.peers.as_ref()?;
        if peers.is_down(p as usize) {
            self.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some((p as usize, peers))
    }

    /// How long a fetch of `bytes` from a peer may take before the dataset's storage is read
    /// instead: [`PEER_DEADLINE_FACTOR`] times the model's time to read it there (one reader),
    /// within [`PEER_DEADLINE_FLOOR`] (scheduling noise on a loaded node is not a stall) and
    /// [`PEER_DEADLINE_CEILING`].
    pub(super) fn peer_deadline(&self, bytes: u64) -> Duration {
        storage_deadline(self.pfs_speed, bytes)
    }

    /// Read `sample` from where it originates for this node: its primary node if that is
    /// another one and it answers (asked again while it answers "not yet", [`PEER_NOT_YET_ASKS`]
    /// times in all), else the dataset's storage.
    pub(super) fn read_origin(&self, sample: u32, buf: &mut [u8]) -> Result<Src> {
        if let Some((p, peers)) = self.peer_of(sample) {
            let within = self.peer_deadline(buf.len() as u64);
            // The peer answers "not yet" before this fetch's deadline of silence, so that a
            // sample it is still filling is asked for again, not taken for the peer being down.
            let wait = self.cluster().map_or(Duration::ZERO, |c| c.peer_wait).min(within / 2);
            let mut reply = peers.fetch(p, sample, wait, within, buf);
            for _ in 1..PEER_NOT_YET_ASKS {
                if reply != PeerReply::NotYet {
                    break;
                }
                reply = peers.fetch(p, sample, wait, within, buf);
            }
            match reply {
                PeerReply::Got => {
                    self.peer_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    return Ok(Src::Peer);
                }
                PeerReply::Corrupt => {
                    self.peer_misses.fetch_add(1, Ordering::Relaxed);
                    self.peer_corrupt.fetch_add(1, Ordering::Relaxed);
                }
                PeerReply::Down => {
                    self.peer_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                PeerReply::NotYet | PeerReply::NotHeld => {
                    self.peer_misses.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.read_source(sample, buf)?;
        Ok(Src::Pfs)
    }

    fn serve(self: &Arc<Self>, sample: u32, wait: Duration) -> Serve {
        if sample as usize >= self.node.class_of.len() {
            return Serve::NotHeld;
        }
        let class = self.node.class_of[sample as usize];
        if class == UNCACHED {
            return Serve::NotHeld;
        }
        let class = class as usize;
        let primary = self
            .cluster()
            .is_some_and(|c| c.primary[sample as usize] as usize == c.node);
        let state = self.node.cache.state();
        let ready = match state.acquire(sample, wait) {
            Acquire::Ready => true,
            Acquire::Claimed if primary => {
                // Nobody has read it yet and the asking node would read it itself: read it now.
                let mut buf = Vec::new();
                match self.fill_claimed(class, sample, &mut buf) {
                    Ok(_) => state.state(sample) == READY,
                    Err(e) => return Serve::Failed(e.to_string()),
                }
            }
            Acquire::Claimed => {
                state.abandon(sample);
                false
            }
            Acquire::Busy => return Serve::NotYet,
            Acquire::NoSpace => return Serve::NotHeld,
        };
        if !ready || !self.current(sample) {
            return Serve::NotHeld;
        }
        let place = self.node.offset[sample as usize];
        let len = self.source.size(sample);
        let (checksum, _) = state.record(sample);
        let bytes: Box<dyn AsRef<[u8]> + Send> = match self.node.stores[class] {
            // Sent unchecked: the receiver checks every reply against `checksum` (the one
            // recorded at the fill) and reads a damaged sample elsewhere.
            ClassStore::Mapped => match self.node.cache.view(class, place, len) {
                Ok(Some(ptr)) => Box::new(Mapped {
                    _keep: self.clone(),
                    ptr,
                    len: len as usize,
                }),
                _ => return Serve::NotHeld,
            },
            ClassStore::Copy => {
                let mut buf = vec![0u8; len as usize];
                if self.node.cache.read_verified(class, sample, place, &mut buf) != Verified::Good {
                    return Serve::NotHeld;
                }
                Box::new(buf)
            }
        };
        self.served_samples.fetch_add(1, Ordering::Relaxed);
        self.served_bytes.fetch_add(len, Ordering::Relaxed);
        Serve::Ready { bytes, checksum }
    }
}

/// The deadline rule of [`Inner::peer_deadline`] and [`Inner::claim_wait`]:
/// [`PEER_DEADLINE_FACTOR`] times the model's time to read `bytes` from the dataset's storage,
/// `(latency, bytes_per_second)`, within [`PEER_DEADLINE_FLOOR`] and [`PEER_DEADLINE_CEILING`].
pub(super) fn storage_deadline((latency, bytes_per_second): (f64, f64), bytes: u64) -> Duration {
    let fs = latency + bytes as f64 / bytes_per_second.max(1.0);
    let d = Duration::try_from_secs_f64(fs * PEER_DEADLINE_FACTOR).unwrap_or(PEER_DEADLINE_CEILING);
    d.clamp(PEER_DEADLINE_FLOOR, PEER_DEADLINE_CEILING)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_deadline_follows_the_file_system_within_floor_and_ceiling() {
        let fs = (0.01, 100e6); // 10 ms to open, 100 MB/s
        assert_eq!(
            storage_deadline(fs, 4096),
            PEER_DEADLINE_FLOOR,
            "a small sample: the floor"
        );
        // 200 MB: 2.01 s on the file system, twice that from a peer.
        let big = storage_deadline(fs, 200_000_000);
        assert!((big.as_secs_f64() - 4.02).abs() < 1e-6, "{big:?}");
        assert_eq!(storage_deadline(fs, 10_000_000_000), PEER_DEADLINE_CEILING);
        assert_eq!(
            storage_deadline((f64::NAN, 0.0), 1),
            PEER_DEADLINE_CEILING,
            "a nonsense model: the ceiling"
        );
        assert_eq!(storage_deadline((0.0, f64::INFINITY), u64::MAX), PEER_DEADLINE_FLOOR);
    }
}
