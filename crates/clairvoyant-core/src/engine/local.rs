//! Random access to the node cache for a node agent (transparent mode): a program on this node
//! opens a dataset file, the agent asks [`Engine::local`] where its bytes are. The engine fills a
//! placed sample on first request (from its primary node or the dataset's storage), hands out
//! where it lies in the shared memory arena (the program copies from its own mapping of the
//! arena: no bytes through a socket), and fetches a sample another node caches into private
//! memory. Everything else the program reads from the dataset itself.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{ClassStore, Engine, Src};
use crate::plan::UNCACHED;
use crate::tier::{checksum, Acquire, Filled, Verified, READY};

/// Where a program on this node finds a dataset file's bytes.
#[derive(Debug)]
pub enum Local {
    /// In the memory arena (the file [`Engine::segments`] names) at `offset`, `len` bytes,
    /// whose xxh3 checksum (recorded when they were read from their origin) is `checksum`.
    Mapped {
        /// Byte offset of the file's bytes in the memory arena.
        offset: u64,
        /// Length of the file in bytes.
        len: u64,
        /// xxh3 checksum of the bytes, recorded when they were read from their origin.
        checksum: u64,
    },
    /// A copy in private memory: from a directory class of this node, or from the node that
    /// caches it.
    Bytes {
        /// The file's whole contents.
        bytes: Vec<u8>,
        /// xxh3 checksum of `bytes`, recorded when they were read from their origin.
        checksum: u64,
        /// Where the copy came from (a directory class of this node, or a peer).
        source: Src,
    },
    /// Neither this node nor a reachable peer holds it: read the dataset's file.
    Direct,
    /// Reading it from its origin failed (the message names the file).
    Failed(String),
}

/// What became of the bytes a program handed to the node cache ([`Engine::adopt`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adopted {
    /// In the memory arena, as for [`Local::Mapped`].
    Mapped {
        /// Byte offset of the adopted bytes in the memory arena.
        offset: u64,
        /// Length of the adopted bytes.
        len: u64,
        /// xxh3 checksum of the adopted bytes.
        checksum: u64,
    },
    /// In a class that is not mapped (a directory): [`Engine::local`] hands out a copy.
    Stored,
    /// This node does not cache the sample (placed elsewhere, or its class is full).
    NotCached,
    /// Not kept now: the file changed or has another size, or another fill holds the sample.
    Refused,
}

/// What a node agent's prefill tells of a sample (see [`Engine::on_prefilled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefill {
    /// Its read starts: this prefill thread holds the sample until one of the two below.
    Started,
    /// Filled and published in the node cache.
    Filled,
    /// The read failed: the sample is not filled, and a program's open reads it another way.
    Failed,
}

/// What a node agent runs for the samples its prefill fills (see [`Engine::on_prefilled`]).
pub type Prefilled = Box<dyn Fn(u32, Prefill) + Send + Sync>;

impl Engine {
    /// Run `f(sample, event)` on the prefill thread as a node agent's prefill (known order)
    /// starts each sample's read and once it has filled and published it in the node cache (or
    /// failed), from now on (a read in progress when it is set is told of its end only); the
    /// first call only (false when one was set already). Samples filled before: see
    /// [`Engine::filled`].
    pub fn on_prefilled(&self, f: Prefilled) -> bool {
        self.inner.prefilled.set(f).is_ok()
    }

    /// Whether `sample` is filled in this node's cache (readable now without a fill).
    pub fn filled(&self, sample: u32) -> bool {
        let inner = &self.inner;
        inner
            .node
            .class_of
            .get(sample as usize)
            .is_some_and(|&c| c != UNCACHED && inner.node.cache.state().state(sample) == READY)
    }

    /// Where `sample`'s bytes are for a program on this node, filling it now when it is placed
    /// on this node and not yet filled; a fill in progress elsewhere is waited for at most
    /// `wait` (then: [`Local::Direct`]).
    pub fn local(&self, sample: u32, wait: Duration) -> Local {
        let Some(&class) = self.inner.node.class_of.get(sample as usize) else {
            return Local::Direct;
        };
        if class == UNCACHED {
            return self.local_elsewhere(sample);
        }
        let class = class as usize;
        let filled_here = match self.local_fill(class, sample, wait) {
            Ok(Some(f)) => f,
            Ok(None) => return Local::Direct,
            Err(failed) => return failed,
        };
        self.local_cached(class, sample, filled_here)
    }

    /// A sample placed on no class of this node: from the node that caches it (or the
    /// dataset, if that node could not answer), else read directly by the program.
    fn local_elsewhere(&self, sample: u32) -> Local {
        let inner = &self.inner;
        if inner.peer_of(sample).is_none() {
            return Local::Direct;
        }
        let mut bytes = vec![0u8; inner.source.size(sample) as usize];
        match inner.read_origin(sample, &mut bytes) {
            Ok(Src::Peer) => {
                let sum = checksum(&bytes);
                Local::Bytes {
                    bytes,
                    checksum: sum,
                    source: Src::Peer,
                }
            }
            // The peer could not answer and the dataset was read instead: hand those bytes
            // over rather than have the program read them again.
            Ok(source) => {
                let sum = checksum(&bytes);
                Local::Bytes {
                    bytes,
                    checksum: sum,
                    source,
                }
            }
            Err(e) => Local::Failed(e.to_string()),
        }
    }

    /// Have a sample placed in `class` filled (by this call if no one else has): whether this
    /// call filled it; None: not ready in time, or its file changed since it was filled.
    fn local_fill(&self, class: usize, sample: u32, wait: Duration) -> Result<Option<bool>, Local> {
        let inner = &self.inner;
        let state = inner.node.cache.state();
        let mut filled_here = false;
        let ready = match state.acquire(sample, wait) {
            Acquire::Ready => true,
            Acquire::Claimed => {
                let mut scratch = Vec::new();
                match inner.fill_claimed(class, sample, &mut scratch) {
                    Ok(_) => {
                        filled_here = state.state(sample) == READY;
                        filled_here
                    }
                    Err(e) => return Err(Local::Failed(e.to_string())),
                }
            }
            Acquire::Busy | Acquire::NoSpace => false,
        };
        Ok((ready && inner.current(sample)).then_some(filled_here))
    }

    /// Where a filled sample of `class` is handed out from: in place in the memory arena (its
    /// bytes verified unless this call just filled them), or a verified copy of a directory
    /// class's.
    fn local_cached(&self, class: usize, sample: u32, filled_here: bool) -> Local {
        let inner = &self.inner;
        let len = inner.source.size(sample);
        let place = inner.node.offset[sample as usize];
        let (sum, _) = inner.node.cache.state().record(sample);
        match inner.node.stores[class] {
            // Just read from its origin into the arena, its checksum computed from those bytes:
            // hashing them again here would only cost time (the program verifies its copy).
            ClassStore::Mapped if filled_here => Local::Mapped {
                offset: place,
                len,
                checksum: sum,
            },
            ClassStore::Mapped => match inner.node.cache.view_verified(class, sample, place, len) {
                Ok(Some(_)) => Local::Mapped {
                    offset: place,
                    len,
                    checksum: sum,
                },
                _ => Local::Direct,
            },
            ClassStore::Copy => {
                let mut bytes = vec![0u8; len as usize];
                if inner.node.cache.read_verified(class, sample, place, &mut bytes) != Verified::Good {
                    return Local::Direct;
                }
                Local::Bytes {
                    bytes,
                    checksum: sum,
                    source: Src::Ssd,
                }
            }
        }
    }

    /// Keep `bytes`, which a program on this node has just read from `sample`'s dataset file (a
    /// miss it read itself, as it would directly), in the node cache where the sample is placed,
    /// as a fill from the dataset would, without reading the file again. `unchanged` is asked
    /// once the fill's stamp is taken, before anything is kept: whether the file is still the
    /// one the program read (its size and last change), so a copy of an older file is never kept.
    /// The bytes are the program's: the checksum recorded is computed from them here.
    pub fn adopt(&self, sample: u32, bytes: &[u8], unchanged: impl FnOnce() -> bool) -> Adopted {
        let inner = &self.inner;
        let Some(&class) = inner.node.class_of.get(sample as usize) else {
            return Adopted::NotCached;
        };
        if class == UNCACHED {
            return Adopted::NotCached;
        }
        if inner.source.size(sample) != bytes.len() as u64 {
            return Adopted::Refused;
        }
        let state = inner.node.cache.state();
        match state.acquire(sample, Duration::ZERO) {
            Acquire::Claimed => {}
            Acquire::Ready => {
                return match self.local(sample, Duration::ZERO) {
                    Local::Mapped { offset, len, checksum } => Adopted::Mapped { offset, len, checksum },
                    Local::Bytes { .. } => Adopted::Stored,
                    _ => Adopted::Refused,
                }
            }
            Acquire::NoSpace => return Adopted::NotCached,
            Acquire::Busy => return Adopted::Refused,
        }
        let class = class as usize;
        let place = inner.node.offset[sample as usize];
        let stamp = inner.stamp();
        if !unchanged() {
            state.abandon(sample);
            return Adopted::Refused;
        }
        match inner.node.cache.fill(class, sample, place, bytes, stamp, false) {
            Filled::Ready => inner.mark_checked(sample),
            Filled::NoSpace => return Adopted::NotCached,
            Filled::Failed(_) => return Adopted::Refused,
        }
        match inner.node.stores[class] {
            ClassStore::Mapped => Adopted::Mapped {
                offset: place,
                len: bytes.len() as u64,
                checksum: state.record(sample).0,
            },
            ClassStore::Copy => Adopted::Stored,
        }
    }

    /// Totals since the engine started: (dataset bytes, dataset files, bytes from peers,
    /// samples served to peers, bytes served to peers).
    pub fn io_totals(&self) -> [u64; 5] {
        let i = &self.inner;
        [
            i.pfs_bytes.load(Ordering::Relaxed),
            i.pfs_files.load(Ordering::Relaxed),
            i.peer_bytes.load(Ordering::Relaxed),
            i.served_samples.load(Ordering::Relaxed),
            i.served_bytes.load(Ordering::Relaxed),
        ]
    }
}
