//! The engine of one job on one rank: it computes the rank's access stream and the node's
//! placement, attaches to the node cache, runs the class prefetchers and the staging
//! prefetcher, and hands samples to the consumer strictly in access order as zero-copy leases.
//!
//! Staging is a byte ring filled in access order by `p_0` threads. Samples placed in the node's
//! memory class take no ring space: the consumer reads them in place in shared memory. Every
//! queue is bounded, every wait is on a condition variable or futex (no polling), and an error
//! while fetching a sample is raised when the consumer reaches that sample.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::clock::{Clock, RealClock};
use crate::error::{Error, Result};
use crate::model::{ClassKind, SystemModel};
use crate::plan::{AccessCounts, ClusterAccess, NodePlan, UNCACHED};
use crate::readahead::Gate;
use crate::schedule::Schedule;
use crate::source::Source;
use crate::tier::{ClassRequest, NodeCache};

mod checker;
mod claims;
mod key;
mod local;
mod node_plan;
mod peer;
mod pid;
mod prefetch;
mod reuse;
mod spec;
mod staging;
mod stats;

use key::node_key;
pub use local::{Adopted, Local, Prefill, Prefilled};
use node_plan::shared_plan;
pub use node_plan::PlanOrigin;
use peer::ClusterShare;
pub use peer::{
    ClusterSpec, PeerFetch, PeerReply, PeerService, Serve, PEER_DEADLINE_CEILING, PEER_DEADLINE_FACTOR,
    PEER_DEADLINE_FLOOR, PEER_NOT_YET_ASKS,
};
pub use spec::{
    batch_ends, AgentDesc, ClusterDesc, EngineSpec, PeersDesc, DEFAULT_PEER_CONNECTIONS, DEFAULT_PEER_WAIT,
};
use staging::{Group, RingBuf, StagingState};
pub use stats::EpochStats;

/// Where the consumer's copy of a sample came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Src {
    /// Already present in this rank's staging buffer.
    Staging = 0,
    /// The node's memory class (read in place, zero-copy).
    Memory = 1,
    /// A node-local directory class.
    Ssd = 2,
    /// The dataset's storage (the shared file system).
    Pfs = 3,
    /// Another node's cache.
    Peer = 4,
}

/// Display names of the [`Src`] variants, indexed by their discriminant.
pub const SOURCE_NAMES: [&str; 5] = ["staging", "memory", "ssd", "pfs", "peer"];

/// The memory region a lease's bytes live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Region {
    /// This rank's staging ring buffer.
    Ring = 0,
    /// The node's memory arena (the memory class, read in place).
    Arena = 1,
    /// Private memory of this process (zero-length samples, overflow).
    Private = 2,
}

/// Identity of a job on a node: everything that decides its placement.
#[derive(Clone, Debug)]
pub struct JobSpec {
    /// The job's access stream: dataset size, ranks, epochs, batch size and shuffle seed.
    pub schedule: Schedule,
    /// This process's global rank.
    pub rank: u32,
    /// The ranks sharing this node's cache (including `rank`).
    pub local_ranks: Vec<u32>,
    /// The launcher's run id: same on every local rank of one run; empty when there is none
    /// (`none`, as torchrun without `--standalone` sets it, counts as none). Only tells
    /// concurrent runs apart: local ranks find their node cache without it.
    pub run_id: String,
    /// First epoch to serve (a resumed run); earlier epochs are neither fetched nor cached for.
    pub first_epoch: u32,
    /// The other nodes of a multi-node job (None: this node alone).
    pub cluster: Option<ClusterSpec>,
    /// A node agent's job (transparent mode): it consumes nothing itself and serves the node's
    /// programs through [`Engine::local`] (None: a rank that consumes its stream).
    pub agent: Option<AgentSpec>,
}

/// How a node agent places and fills (see [`JobSpec::agent`]).
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// Access counts to place by instead of the schedule's (transparent mode without a known
    /// order places by these).
    pub counts: Option<AgentCounts>,
    /// Fill the placed samples ahead of use, in order of first need (the order is known); else
    /// each is filled when a program first reads it.
    pub prefill: bool,
    /// Samples filled only when a program first reads them, even with `prefill`: their time of
    /// need is not known (files outside a predicted order, [`crate::plan::PartialOrder`]).
    /// Empty: none.
    pub fill_on_read: Vec<bool>,
}

/// The access counts a node agent places by: its node's own, and on a cluster the summaries
/// of every node's (see [`crate::plan::ClusterAccess`]).
#[derive(Clone, Debug)]
pub struct AgentCounts {
    /// Per-sample access counts of this node's programs.
    pub own: AccessCounts,
    /// Every node's access summary on a multi-node job (None: this node alone).
    pub cluster: Option<Arc<ClusterAccess>>,
}

/// A consumed sample: valid until released.
#[derive(Debug)]
pub struct Lease {
    /// Position of the sample in this rank's stream over the whole run (the key to release it).
    pub pos: u64,
    /// Index of the sample in the dataset.
    pub sample: u32,
    /// The sample's class label, as the source gives it.
    pub label: i64,
    /// Where the bytes are: the staging ring or the node's memory arena (both shared files that
    /// other processes can map, see [`Engine::segments`]) or private memory, at `offset`.
    pub region: Region,
    /// Byte offset of the sample in `region` (0 for private memory).
    pub offset: u64,
    /// Address of the sample's first byte in this process's mapping of `region`.
    pub ptr: *const u8,
    /// Length of the sample in bytes.
    pub len: usize,
    /// Where the sample's bytes were found when it was staged.
    pub source: Src,
}

// SAFETY: a lease points into memory kept alive by the engine's shared state until released.
unsafe impl Send for Lease {}
/// How a class hands out bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ClassStore {
    /// A shared mapping (the memory class): consumers read in place.
    Mapped,
    /// Copied into the staging ring (directory classes).
    Copy,
}

/// The node cache and the placement that lays it out. Every job of this process over the same
/// dataset (train and validation, say) uses the first one's, so the same bytes are not cached
/// twice on a machine: the later jobs claim, fill and read through it like another local rank,
/// and run no class prefetchers of their own.
struct NodeShare {
    cache: NodeCache,
    class_of: Vec<u8>,
    offset: Vec<u64>,
    stores: Vec<ClassStore>,
    summary: Vec<(String, u64, u64)>,
    fingerprint: u64,
    /// The ranks sharing this node's cache: jobs over other ranks (another node simulated in
    /// the same process) keep their own.
    local_ranks: Vec<u32>,
    /// The local ranks of this process's jobs using it (several ranks may run in one process).
    ranks: Mutex<Vec<u32>>,
    /// Engines using it; the last to shut down leaves the node cache.
    engines: AtomicUsize,
    /// The cluster-wide placement's view from this node (multi-node jobs).
    cluster: Option<ClusterShare>,
}

static NODE_SHARES: Mutex<Vec<std::sync::Weak<NodeShare>>> = Mutex::new(Vec::new());

/// `names` joined by ", ", or "none".
fn names_or_none<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    let joined = names.into_iter().collect::<Vec<_>>().join(", ");
    if joined.is_empty() {
        "none".into()
    } else {
        joined
    }
}

/// A node share of this process for the dataset `fingerprint` of `samples` samples on the same
/// local ranks, counted as used by one more engine.
fn join_share(fingerprint: u64, samples: usize, local_ranks: &[u32]) -> Option<Arc<NodeShare>> {
    let mut shares = NODE_SHARES.lock().unwrap_or_else(|p| p.into_inner());
    shares.retain(|w| w.strong_count() > 0);
    shares.iter().filter_map(|w| w.upgrade()).find(|n| {
        n.fingerprint == fingerprint
            && n.class_of.len() == samples
            && n.local_ranks == local_ranks
            && n.engines
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| (c > 0).then_some(c + 1))
                .is_ok()
    })
}

struct Inner {
    source: Arc<dyn Source>,
    /// End (within the epoch) of each batch, per epoch; grows when a pass is appended. The
    /// stream itself and the epochs' start positions live in the staging state.
    batch_ends: RwLock<Vec<Arc<[u32]>>>,
    /// Serialises appends (stats, stream and batch ends grow together).
    appending: Mutex<()>,
    node: Arc<NodeShare>,
    /// This engine has left `node` (shutdown ran).
    left: AtomicBool,
    /// The dataset has files whose stamps are recorded and checked.
    stamps: bool,
    /// Per sample, the newest `round` in which this job checked its dataset stamp (or filled
    /// it); 0: never.
    checked: Vec<AtomicU32>,
    /// The epoch the consumer is in, plus one: a cached copy checked in an earlier round is
    /// checked against its file again before it is handed out.
    round: AtomicU32,
    ring: RingBuf,
    /// How many times the ring was found truncated (its staged samples marked lost).
    ring_losses: AtomicU64,
    ring_cap: u64,
    /// Most ring bytes staged ahead of the consumer (see `staging::Inner::slot_for`): the
    /// read-concurrency controller's far mark in typical samples, within the ring.
    ring_lead: u64,
    max_entries: usize,
    st: Mutex<StagingState>,
    produced: Condvar,
    freed: Condvar,
    /// Producers at the end of the stream wait here for a pass to be appended.
    grown: Condvar,
    /// The checker (`checker.rs`) waits here for the consumer to enter another epoch.
    round_moved: Condvar,
    /// The staging position the checker goes on from when it is behind the consumer (see
    /// [`Inner::current_at`]).
    check_from: AtomicU64,
    shutdown: AtomicBool,
    /// Every prefetch thread has exited (after shutdown): nothing writes into the ring any more.
    producers_gone: AtomicBool,
    /// How long a fill by this process is waited for (another process's: [`Inner::claim_wait`]).
    fill_timeout: Duration,
    /// Other local processes whose fill claims outlasted their deadline.
    slow_claimants: claims::SlowClaimants,
    /// What the waits for claims are measured by (`claims.rs`).
    clock: Arc<dyn Clock>,
    stats: Mutex<Vec<EpochStats>>,
    pfs_bytes: AtomicU64,
    pfs_files: AtomicU64,
    pfs_at_epoch_start: Mutex<(u64, u64)>,
    owner_pid: u32,
    /// How many staging fetches run at once.
    readahead: Gate,
    /// The model says a peer's cache is faster than the dataset's storage.
    peer_faster: bool,
    /// The dataset's storage for one reader by the model: open latency (s), bytes per second
    /// (bounds how long a peer fetch may take).
    pfs_speed: (f64, f64),
    /// Bytes fetched from peers; fetches a peer could not answer (not yet filled, not held,
    /// corrupt); fetches not sent because the peer was down; corrupt replies.
    peer_bytes: AtomicU64,
    peer_misses: AtomicU64,
    peer_fallbacks: AtomicU64,
    peer_corrupt: AtomicU64,
    peer_at_epoch_start: Mutex<(u64, u64)>,
    /// Served to peers (by this process).
    served_samples: AtomicU64,
    served_bytes: AtomicU64,
    /// Told of each sample a node agent's prefill reads and fills ([`Engine::on_prefilled`]).
    prefilled: std::sync::OnceLock<local::Prefilled>,
}

// SAFETY: the ring is written only in byte ranges allocated to one producer under the staging
// lock and read by the consumer only after the entry is marked ready under the same lock.
unsafe impl Sync for Inner {}
// SAFETY: sending moves no thread-bound state: the ring is raw shared memory whose ranges are handed out
// under the staging lock, as for Sync above.
unsafe impl Send for Inner {}

/// One job on one rank.
pub struct Engine {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    placement_summary: Vec<(String, u64, u64)>,
    plan_origin: PlanOrigin,
    first_epoch: u32,
    /// The schedule the job started with and this rank: its epochs' samples can be derived again
    /// once dropped from the stream (appended passes cannot).
    schedule: Schedule,
    rank: u32,
}

impl Engine {
    /// Starts a job on this rank: checks it against its source and model, joins (or creates)
    /// the node's cache and plan, opens the staging ring and starts the prefetch threads.
    pub fn start(source: Arc<dyn Source>, model: &SystemModel, spec: JobSpec) -> Result<Engine> {
        check_job(source.as_ref(), model, &spec)?;
        let f = source.len();
        let total_bytes = source.total_bytes();
        let typical = if f == 0 { 0 } else { total_bytes / f as u64 };
        let useful = model.useful_classes(typical.max(1), spec.local_ranks.len() as u32);
        // What every wait of this engine on other local processes is measured by.
        let clock: Arc<dyn Clock> = Arc::new(RealClock);
        let Joined {
            node,
            fill_order,
            mine,
            origin: plan_origin,
        } = Self::share_for(&source, model, &spec, &useful, total_bytes, &*clock)?;
        // This rank's stream over the whole run: from the node's plan, else shuffled here.
        let streams = match mine {
            Some(s) => Ok(s),
            None => rank_streams(&spec),
        };
        let ring_cap = if spec.agent.is_some() {
            4096
        } else {
            model.staging.capacity
        };
        let ring = streams.and_then(|s| Ok((s, open_ring(&node, spec.rank, ring_cap)?)));
        let (streams, ring) = match ring {
            Ok(r) => r,
            Err(e) => {
                // This engine will not use the share it joined or created.
                leave_share(&node);
                return Err(e);
            }
        };
        let placement_summary = node.summary.clone();
        let prepared = Prepared {
            node,
            ring,
            ring_cap,
            stream: StreamParts::new(streams, spec.first_epoch),
            typical,
            clock,
        };
        let inner = Arc::new(Inner::new(source, model, &spec, prepared));
        let filler = Filler::of(&spec.local_ranks, spec.rank, spec.agent.as_ref());
        // The engine exists before its threads: if one cannot start (a thread or process
        // limit), dropping it stops and joins those already running.
        let engine = Engine {
            inner,
            threads: Mutex::new(Vec::new()),
            placement_summary,
            plan_origin,
            first_epoch: spec.first_epoch,
            schedule: spec.schedule,
            rank: spec.rank,
        };
        engine.spawn_prefetchers(model, &useful, fill_order, &filler)?;
        Ok(engine)
    }

    /// This process's node share for the dataset, joined if there is one, else created (see
    /// [`Engine::node_share`]) and registered.
    fn share_for(
        source: &Arc<dyn Source>,
        model: &SystemModel,
        spec: &JobSpec,
        useful: &[usize],
        total_bytes: u64,
        clock: &dyn Clock,
    ) -> Result<Joined> {
        if let Some(node) = join_share(source.fingerprint(), source.len(), &spec.local_ranks) {
            // The share's classes: those its placement summary names (one per class it asked for).
            let theirs = node.summary.iter().map(|(name, _, _)| name.as_str());
            let asked = useful.iter().map(|&j| model.classes[j].name.as_str());
            if !theirs.clone().eq(asked.clone()) {
                crate::tier::warn_once(
                    &format!("joined-classes:{:016x}", source.fingerprint()),
                    &format!(
                        "this job shares the node cache of another open job of this process over the \
                         same dataset, so it caches in that job's classes ({}), not in its own ({}); \
                         close the other job first to cache differently",
                        names_or_none(theirs),
                        names_or_none(asked)
                    ),
                );
            }
            let mut ranks = node.ranks.lock().unwrap_or_else(|p| p.into_inner());
            if !ranks.contains(&spec.rank) {
                ranks.push(spec.rank);
            }
            drop(ranks);
            return Ok(Joined {
                node,
                fill_order: None,
                mine: None,
                origin: PlanOrigin::Process,
            });
        }
        let (node, fill_order, mine, origin) = Self::node_share(source, model, spec, useful, total_bytes, clock)?;
        let node = Arc::new(node);
        NODE_SHARES
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::downgrade(&node));
        Ok(Joined {
            node,
            fill_order: Some(fill_order),
            mine,
            origin,
        })
    }

    /// Start the class prefetchers (with the node's fill orders, held by the engine that made
    /// the node's share) and the staging prefetchers.
    fn spawn_prefetchers(
        &self,
        model: &SystemModel,
        useful: &[usize],
        fill_order: Option<Vec<Vec<u32>>>,
        filler: &Filler<'_>,
    ) -> Result<()> {
        if let (Some(fill_order), true) = (&fill_order, filler.prefill) {
            for (i, &j) in useful.iter().enumerate() {
                let share = Arc::new(filler.share_of(&fill_order[i]));
                // A node agent's prefill runs at the read-concurrency controller's pace (it
                // stages nothing, its gate is free for this); a rank's at the class's thread
                // count.
                let count = if filler.agent {
                    self.inner.readahead.max_threads()
                } else {
                    model.classes[j].threads.max(1) as usize
                };
                self.spawn_class(i, share, count, filler.agent)?;
            }
        }
        // A node agent stages nothing: programs read the node cache through `local`.
        let staging_threads = if filler.agent {
            0
        } else {
            self.inner.readahead.max_threads()
        };
        for t in 0..staging_threads {
            let inner = self.inner.clone();
            self.spawn(format!("cv-staging-{t}"), Box::new(move || inner.staging_prefetch()))?;
        }
        // Cached copies of dataset files are checked against them ahead of staging.
        if staging_threads > 0 && self.inner.stamps {
            let inner = self.inner.clone();
            self.spawn("cv-checker".into(), Box::new(move || inner.check_ahead()))?;
        }
        Ok(())
    }

    /// Start `count` threads filling class `i` with `share` (a node agent's prefill, or a
    /// rank's class prefetch).
    fn spawn_class(&self, i: usize, share: Arc<Vec<u32>>, count: usize, agent: bool) -> Result<()> {
        let next = Arc::new(AtomicUsize::new(0));
        for t in 0..count {
            let (inner, share, next) = (self.inner.clone(), share.clone(), next.clone());
            self.spawn(
                format!("cv-class{i}-{t}"),
                Box::new(move || {
                    if agent {
                        inner.agent_prefill(i, &share, &next)
                    } else {
                        inner.class_prefetch(i, &share, &next)
                    }
                }),
            )?;
        }
        Ok(())
    }

    /// Start a named thread that the engine joins when it shuts down.
    fn spawn(&self, name: String, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        let handle = std::thread::Builder::new().name(name.clone()).spawn(f).map_err(|e| {
            Error::config(
                "threads",
                format!(
                    "cannot start thread {name}: {e} (a limit on threads or processes, such as \
                     ulimit -u; fewer class or staging threads need fewer)"
                ),
            )
        })?;
        self.threads.lock().unwrap_or_else(|p| p.into_inner()).push(handle);
        Ok(())
    }

    /// Answers other nodes' requests for this node's cached samples.
    pub fn peer_service(&self) -> PeerService {
        PeerService {
            inner: self.inner.clone(),
        }
    }

    /// Attach to this run's node cache, agree on capacities and get the node's plan: the first
    /// local rank computes it and shares it through the node cache; the others read it.
    /// Returns the share, the fill orders and this rank's stream when the plan carried it.
    #[allow(clippy::type_complexity)]
    fn node_share(
        source: &Arc<dyn Source>,
        model: &SystemModel,
        spec: &JobSpec,
        useful: &[usize],
        total_bytes: u64,
        clock: &dyn Clock,
    ) -> Result<(
        NodeShare,
        Vec<Vec<u32>>,
        Option<Vec<crate::schedule::RankEpoch>>,
        PlanOrigin,
    )> {
        // The node cache: every local rank derives the same key, agrees on the capacities the
        // first rank decided, and so shares the very same plan.
        let f = source.len();
        let requests = node_requests(model, spec, useful, total_bytes);
        let specs: Vec<&crate::model::ClassSpec> = useful.iter().map(|&j| &model.classes[j]).collect();
        let key = node_key(spec, source.fingerprint(), &specs);
        let rank_index = spec.local_ranks.iter().position(|&r| r == spec.rank).unwrap();
        let mut cache = NodeCache::attach(&format!("{key:016x}"), f, rank_index, spec.local_ranks.len() as u32)?;
        let ring_reserve = if spec.agent.is_some() {
            0
        } else {
            check_ring_room(model, &cache)?;
            model.staging.capacity.saturating_mul(spec.local_ranks.len() as u64)
        };
        let capacities = cache.setup(&requests, ring_reserve)?;
        if let Some(c) = &spec.cluster {
            check_cluster_capacities(c, &requests, &capacities)?;
        }
        let (plan, mine, origin) = shared_plan(&cache, source, spec, &capacities, clock)?;
        let NodePlan { placement, primary, .. } = plan;
        let cluster = spec.cluster.as_ref().map(|c| ClusterShare {
            node: c.node,
            primary: primary.unwrap_or_default(),
            peers: c.peers.clone(),
            peer_wait: c.peer_wait,
        });
        let (stores, placement_summary) = stores_and_summary(&cache, &requests, &placement);
        // The rank that set the cache up takes over what a dead run left (local rank 0 unless
        // it came late); the layout every rank computes alike is written once.
        if cache.set_up_here() {
            if let Some(mem) = stores.iter().position(|s| *s == ClassStore::Mapped) {
                reuse::record_and_reuse(&cache, source.as_ref(), mem, &placement.class_of, &placement.offset);
            }
        }
        let node = NodeShare {
            cache,
            class_of: placement.class_of,
            offset: placement.offset,
            stores,
            summary: placement_summary,
            fingerprint: source.fingerprint(),
            local_ranks: spec.local_ranks.clone(),
            ranks: Mutex::new(vec![spec.rank]),
            engines: AtomicUsize::new(1),
            cluster,
        };
        Ok((node, placement.fill_order, mine, origin))
    }

    /// Samples of `epoch` for this rank, in order. The stream drops a pass's samples once it is
    /// consumed (or skipped): an epoch of the schedule the job started with is then derived from
    /// it again; asking for an appended pass then is an error.
    pub fn epoch_samples(&self, epoch: u32) -> Result<Vec<u32>> {
        let epochs = self.epochs();
        if epoch >= epochs {
            return Err(Error::EpochPastEnd {
                epoch,
                last: epochs.saturating_sub(1),
            });
        }
        let st = self.inner.lock();
        let (a, b) = (st.epoch_starts[epoch as usize], st.epoch_starts[epoch as usize + 1]);
        if a == b {
            return Ok(Vec::new());
        }
        if a < st.stream_base {
            if epoch < self.schedule.epochs {
                drop(st);
                return Ok(self.schedule.rank_epoch(self.rank, epoch)?.samples);
            }
            return Err(Error::EpochDropped {
                epoch,
                next: st.epoch_of(st.next_consume),
            });
        }
        let base = st.stream_base;
        Ok(st
            .stream
            .range((a - base) as usize..(b - base) as usize)
            .copied()
            .collect())
    }

    /// Epochs of the job: those of the schedule, then the appended passes.
    pub fn epochs(&self) -> u32 {
        self.inner.batch_ends.read().unwrap_or_else(|p| p.into_inner()).len() as u32
    }

    /// End position (within the epoch) of each batch of `epoch`.
    pub fn batch_ends(&self, epoch: u32) -> Arc<[u32]> {
        self.inner.batch_ends.read().unwrap_or_else(|p| p.into_inner())[epoch as usize].clone()
    }

    /// Samples of the stream this engine still holds (passes not yet consumed).
    pub fn held_samples(&self) -> usize {
        self.inner.lock().stream.len()
    }

    /// Append a pass over `samples` (batches ending at `batch_ends`, within the pass) as the
    /// job's next epoch, returned. Staging goes on into it as soon as it is appended; the
    /// placement of the node cache stays the one computed at start.
    pub fn append_epoch(&self, samples: Vec<u32>, batch_ends: Vec<u32>) -> Result<u32> {
        self.inner.check_pid()?;
        let n = self.inner.source.len() as u64;
        if samples.is_empty() {
            return Err(Error::config("samples", "an epoch needs at least one sample"));
        }
        if let Some((i, k)) = samples.iter().enumerate().find(|(_, &k)| k as u64 >= n) {
            return Err(Error::config(
                "samples",
                format!("position {i}: sample {k} is outside the dataset of {n} samples"),
            ));
        }
        let mut prev = 0u32;
        for (i, &end) in batch_ends.iter().enumerate() {
            if end <= prev {
                return Err(Error::config(
                    "batch_ends",
                    format!("batch {i} is empty or out of order (ends at {end}, after {prev})"),
                ));
            }
            prev = end;
        }
        if prev as usize != samples.len() {
            return Err(Error::config(
                "batch_ends",
                format!("the batches end at {prev} but the epoch has {} samples", samples.len()),
            ));
        }
        let _appending = self.inner.appending.lock().unwrap_or_else(|p| p.into_inner());
        if self.inner.shutdown.load(Ordering::Relaxed) {
            return Err(Error::Cancelled);
        }
        let epoch = self.epochs();
        if epoch == u32::MAX {
            return Err(Error::config("samples", "the job has as many epochs as it can hold"));
        }
        // Stats first: the consumer records into an epoch's figures as soon as it can reach it.
        self.inner
            .stats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(EpochStats {
                epoch,
                ..Default::default()
            });
        {
            let mut st = self.inner.lock();
            let end = st.total() + samples.len() as u64;
            st.stream.extend(samples);
            st.epoch_starts.push(end);
            // Producers that reached the old end sleep until now.
            self.inner.grown.notify_all();
        }
        self.inner
            .batch_ends
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::from(batch_ends));
        Ok(epoch)
    }

    /// The shared files holding staged samples: (staging ring, memory arena if any). A worker
    /// process maps them read-only to read a lease's bytes at its [`Lease::offset`].
    pub fn segments(&self) -> (std::path::PathBuf, Option<std::path::PathBuf>) {
        (
            self.inner.ring.path.clone(),
            self.inner.node.cache.arena_path().map(|p| p.to_path_buf()),
        )
    }

    /// Where this rank's plan came from (the node's first rank computes it; the others read it).
    pub fn plan_origin(&self) -> PlanOrigin {
        self.plan_origin
    }

    /// (class name, samples, bytes) placed per class on this node.
    pub fn placement_summary(&self) -> &[(String, u64, u64)] {
        &self.placement_summary
    }

    /// Position (in the whole run) of the next sample to consume.
    pub fn position(&self) -> u64 {
        self.inner.lock().next_consume
    }

    /// Start position of `epoch` in the whole run.
    pub fn epoch_start(&self, epoch: u32) -> u64 {
        self.inner.lock().epoch_starts[epoch as usize]
    }

    /// Make `epoch` the current one: it must not be behind the consumer; the rest of an
    /// unfinished earlier epoch (and any epoch in between) is skipped: what was not fetched yet
    /// is never fetched, what was staged is released unseen.
    pub fn begin_epoch(&self, epoch: u32) -> Result<()> {
        self.inner.check_pid()?;
        let epochs = self.epochs();
        if epoch >= epochs {
            return Err(Error::EpochPastEnd {
                epoch,
                last: epochs.saturating_sub(1),
            });
        }
        if epoch < self.first_epoch {
            return Err(Error::EpochBeforeStart {
                epoch,
                first: self.first_epoch,
            });
        }
        let mut st = self.inner.lock();
        let start = st.epoch_starts[epoch as usize];
        let pos = st.next_consume;
        if pos > start {
            let cur = st.epoch_of(pos);
            return Err(Error::EpochConsumed {
                epoch,
                next: if st.epoch_starts[cur as usize] == pos {
                    cur
                } else {
                    cur + 1
                },
            });
        }
        if pos < start {
            self.inner.skip_to(&mut st, start);
        }
        Ok(())
    }

    /// The next sample in access order, waiting up to `timeout` for it (None on time-out, so a
    /// caller can check for interrupts and call again). Errors from fetching this sample are
    /// returned here; the consumer then moves on to the following sample.
    pub fn next(&self, timeout: Duration) -> Result<Option<Lease>> {
        self.inner.check_pid()?;
        self.inner.next(timeout, &mut Group::default())
    }

    /// Up to `n` next samples in access order, appended to `out`, as one hand-out call: the
    /// shared segments' sizes are read once for the call (a truncation before the call is always
    /// seen), every sample's checksum is checked. Stops early, returning Ok, when a sample is not
    /// ready within `timeout` (so a caller can check for interrupts and call again); an error
    /// fetching a sample is returned at once (that sample is consumed, those before it are in
    /// `out`).
    pub fn next_many(&self, n: usize, timeout: Duration, out: &mut Vec<Lease>) -> Result<()> {
        self.take_many(n, timeout, timeout, out)
    }

    /// [`Engine::next_many`] that waits (up to `timeout`) only for the first sample: the
    /// samples after it are taken while they are ready at once, so a consumer can start on the
    /// first part of a batch whose last samples are still being read.
    pub fn next_ready(&self, n: usize, timeout: Duration, out: &mut Vec<Lease>) -> Result<()> {
        self.take_many(n, timeout, Duration::ZERO, out)
    }

    /// One hand-out call of up to `n` samples: waits up to `first` for the first, `rest` for
    /// each one after it (see [`Engine::next_many`]).
    fn take_many(&self, n: usize, first: Duration, rest: Duration, out: &mut Vec<Lease>) -> Result<()> {
        self.inner.check_pid()?;
        let mut group = Group::default();
        for i in 0..n {
            match self.inner.next(if i == 0 { first } else { rest }, &mut group)? {
                Some(l) => out.push(l),
                None => break,
            }
        }
        Ok(())
    }

    /// Give a consumed sample's staging space back.
    pub fn release(&self, pos: u64) {
        self.inner.release(&[pos]);
    }

    /// Give several consumed samples' staging space back, by their positions.
    pub fn release_many(&self, pos: &[u64]) {
        self.inner.release(pos);
    }

    /// The class label of dataset sample `sample`, as the source gives it.
    pub fn label(&self, sample: u32) -> i64 {
        self.inner.source.label(sample)
    }

    /// Per-epoch figures. In a forked child (where a thread of the parent may have held the
    /// engine's locks at the fork) only what can be read without waiting: the figures as last
    /// recorded, or none.
    pub fn stats(&self) -> Vec<EpochStats> {
        if pid::current() != self.inner.owner_pid {
            return self.inner.stats.try_lock().map(|s| s.clone()).unwrap_or_default();
        }
        let (pos, total, e) = {
            let st = self.inner.lock();
            (st.next_consume, st.total(), st.epoch_of(st.next_consume) as usize)
        };
        let mut s = self.inner.stats.lock().unwrap().clone();
        // The current epoch's PFS figures so far.
        if pos < total {
            let base = *self.inner.pfs_at_epoch_start.lock().unwrap();
            s[e].pfs_bytes_read = self.inner.pfs_bytes.load(Ordering::Relaxed) - base.0;
            s[e].pfs_files_read = self.inner.pfs_files.load(Ordering::Relaxed) - base.1;
        } else if let Some(last) = s.last_mut() {
            // Reads that ended after the last epoch closed (a class prefetcher filling samples
            // for another local rank) belong to the last epoch.
            let base = *self.inner.pfs_at_epoch_start.lock().unwrap();
            last.pfs_bytes_read += self.inner.pfs_bytes.load(Ordering::Relaxed) - base.0;
            last.pfs_files_read += self.inner.pfs_files.load(Ordering::Relaxed) - base.1;
        }
        s
    }

    /// Stop all threads; waiting consumers get `Error::Cancelled`. Idempotent.
    pub fn shutdown(&self) {
        // A forked child has none of the parent's threads and must not touch its cache.
        if pid::current() != self.inner.owner_pid {
            return;
        }
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.readahead.close();
        {
            let _g = self.inner.lock();
            self.inner.produced.notify_all();
            self.inner.freed.notify_all();
            self.inner.grown.notify_all();
            self.inner.round_moved.notify_all();
        }
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        let joined = threads.iter().all(|t| t.thread().id() != std::thread::current().id());
        for t in threads {
            let _ = t.join();
        }
        // Release the shared memory now: the ring's file goes at once, its mapping when the last
        // lease is released or the engine is dropped (a consumer thread may still be reading a
        // sample it was handed while another thread shuts down), never while a producer may still
        // be writing into it (a sample skipped while its fetch was in flight, say).
        self.inner.ring.unlink();
        if joined {
            self.inner.producers_gone.store(true, Ordering::Release);
            let st = self.inner.lock();
            self.inner.unmap_if_idle(&st);
        }
        // Leave the node cache now rather than when the last lease is garbage collected, so a
        // job started next attaches to a fresh cache; mappings stay valid for live leases. The
        // last job of this process using it leaves it.
        if !self.inner.left.swap(true, Ordering::AcqRel) && self.inner.node.engines.fetch_sub(1, Ordering::AcqRel) == 1
        {
            // The attachment served every local rank of this process that joined the share.
            let ranks = self.inner.node.ranks.lock().unwrap_or_else(|p| p.into_inner()).len() as u32;
            self.inner.node.cache.detach_ranks(ranks);
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if pid::current() != self.inner.owner_pid {
            // A forked child: the threads belong to the parent and do not exist here; dropping
            // their handles would detach thread ids that name nothing in this process.
            let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
            std::mem::forget(threads);
            return;
        }
        self.shutdown();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, StagingState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_pid(&self) -> Result<()> {
        let me = pid::current();
        if me != self.owner_pid {
            return Err(Error::config(
                "job",
                format!(
                    "created in process {} and used in forked process {me}; create the job in the process that uses it",
                    self.owner_pid
                ),
            ));
        }
        Ok(())
    }

    fn ring_ptr(&self, start: u64) -> *mut u8 {
        // SAFETY: the offset is reduced modulo the ring's length.
        unsafe { self.ring.ptr.add((start % self.ring_cap) as usize) }
    }

    fn store_of(&self, sample: u32) -> Option<(usize, ClassStore)> {
        let c = self.node.class_of[sample as usize];
        (c != UNCACHED).then(|| (c as usize, self.node.stores[c as usize]))
    }
}

/// Rank, world size and local ranks must describe one machine of the run.
fn validate_ranks(spec: &JobSpec) -> Result<()> {
    let world = spec.schedule.world_size;
    if spec.rank >= world {
        return Err(Error::config(
            "rank",
            format!("{} is outside world size {world}", spec.rank),
        ));
    }
    if let Some(r) = spec.local_ranks.iter().find(|&&r| r >= world) {
        return Err(Error::config(
            "local_ranks",
            format!("{:?} holds rank {r}, outside world size {world}", spec.local_ranks),
        ));
    }
    let mut sorted = spec.local_ranks.clone();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::config(
            "local_ranks",
            format!("{:?} names a rank twice", spec.local_ranks),
        ));
    }
    if !spec.local_ranks.contains(&spec.rank) {
        return Err(Error::config(
            "local_ranks",
            format!("{:?} must include this rank {}", spec.local_ranks, spec.rank),
        ));
    }
    if spec.local_ranks.len() > crate::tier::state::MAX_LOCAL_RANKS {
        return Err(Error::config(
            "local_ranks",
            format!(
                "{} local ranks; at most {} share one node cache",
                spec.local_ranks.len(),
                crate::tier::state::MAX_LOCAL_RANKS
            ),
        ));
    }
    if let Some(c) = &spec.cluster {
        let Some(mine) = c.nodes.get(c.node) else {
            return Err(Error::config(
                "cluster.node",
                format!("node {} of {} nodes", c.node, c.nodes.len()),
            ));
        };
        if *mine != spec.local_ranks {
            return Err(Error::config(
                "cluster.nodes",
                format!(
                    "node {} has ranks {mine:?} but this node's local ranks are {:?}",
                    c.node, spec.local_ranks
                ),
            ));
        }
        let mut all: Vec<u32> = c.nodes.iter().flatten().copied().collect();
        all.sort_unstable();
        if all != (0..world).collect::<Vec<u32>>() {
            return Err(Error::config(
                "cluster.nodes",
                format!(
                    "the nodes' ranks {:?} are not each rank of world size {world} once",
                    c.nodes
                ),
            ));
        }
        if c.capacities.len() != c.nodes.len() || c.nodes.len() >= crate::plan::NO_NODE as usize {
            return Err(Error::config(
                "cluster.capacities",
                format!("{} capacity lists for {} nodes", c.capacities.len(), c.nodes.len()),
            ));
        }
    }
    Ok(())
}

/// The classes a job on this node caches in, with the capacities it proposes: configured (or
/// detected) capacities, at most the dataset's size, directory classes at most their free space.
fn class_requests(model: &SystemModel, useful: &[usize], total_bytes: u64) -> Vec<ClassRequest> {
    useful
        .iter()
        .map(|&j| {
            let c = &model.classes[j];
            let mut capacity = c.capacity.min(total_bytes);
            if let ClassKind::Directory { path } = &c.kind {
                capacity = crate::model::clamp_to_free(&format!("class.{}.capacity", c.name), capacity, path);
            }
            ClassRequest {
                name: c.name.clone(),
                kind: c.kind.clone(),
                capacity,
            }
        })
        .collect()
}

/// The capacities this node would cache `source` in for `local_ranks` ranks (fastest class
/// first), as announced to the other nodes of a multi-node job before it starts.
pub fn node_capacities(source: &dyn Source, model: &SystemModel, local_ranks: u32) -> Vec<(String, u64)> {
    let f = source.len();
    let total_bytes = source.total_bytes();
    let typical = if f == 0 { 0 } else { total_bytes / f as u64 };
    let useful = model.useful_classes(typical.max(1), local_ranks);
    class_requests(model, &useful, total_bytes)
        .into_iter()
        .map(|r| (r.name, r.capacity))
        .collect()
}

/// Whether fetching a typical sample from a peer's memory beats the dataset's storage by the
/// model (fetch_{i,1,j} against the storage's per-reader rate and latency). Without a configured
/// interconnect, peers are assumed faster: reading the dataset once is the point.
fn peer_faster(model: &SystemModel, typical: u64, readers: u32) -> bool {
    let local = model.memory_class().unwrap_or(0);
    if model.classes.is_empty() {
        return true;
    }
    match model.remote_fetch_seconds(local, typical.max(1)) {
        Some(peer) => peer <= model.fetch_seconds(crate::model::Location::Pfs, typical.max(1), readers.max(1)),
        None => true,
    }
}

/// A node share this engine uses: joined, or created by it (then with the node's fill orders
/// and, when the node's plan carried it, this rank's stream).
struct Joined {
    node: Arc<NodeShare>,
    fill_order: Option<Vec<Vec<u32>>>,
    mine: Option<Vec<crate::schedule::RankEpoch>>,
    origin: PlanOrigin,
}

/// A rank's stream laid out for the staging state.
struct StreamParts {
    /// The samples of every epoch served, in order.
    stream: VecDeque<u32>,
    /// Start position of each epoch, then the stream's end.
    epoch_starts: Vec<u64>,
    /// Each epoch's batch ends (empty before the first epoch served).
    batch_ends: Vec<Arc<[u32]>>,
}

impl StreamParts {
    /// Lay out `streams`, the rank's epochs from `first_epoch` on.
    fn new(streams: Vec<crate::schedule::RankEpoch>, first_epoch: u32) -> StreamParts {
        let mut stream = VecDeque::new();
        let mut epoch_starts = vec![0u64; first_epoch as usize + 1];
        let mut batch_ends: Vec<Arc<[u32]>> = vec![Arc::from(Vec::new()); first_epoch as usize];
        for e in streams {
            stream.extend(e.samples.iter().copied());
            epoch_starts.push(stream.len() as u64);
            batch_ends.push(Arc::from(e.batch_ends));
        }
        StreamParts {
            stream,
            epoch_starts,
            batch_ends,
        }
    }
}

/// What a starting engine has gathered before it builds its shared state.
struct Prepared {
    node: Arc<NodeShare>,
    ring: RingBuf,
    ring_cap: u64,
    stream: StreamParts,
    /// The dataset's mean sample size.
    typical: u64,
    /// What the engine's waits on other local processes are measured by.
    clock: Arc<dyn Clock>,
}

/// How this rank fills the node's classes, from its job's spec.
struct Filler<'a> {
    local_index: usize,
    local_count: usize,
    /// A node agent's job.
    agent: bool,
    /// Placed samples are filled ahead of use.
    prefill: bool,
    /// Samples filled only when first read.
    on_read: &'a [bool],
}

impl<'a> Filler<'a> {
    /// The filling role of `rank` among `local_ranks` (a node agent's with `agent`).
    fn of(local_ranks: &[u32], rank: u32, agent: Option<&'a AgentSpec>) -> Filler<'a> {
        Filler {
            local_index: local_ranks.iter().position(|&r| r == rank).unwrap(),
            local_count: local_ranks.len(),
            agent: agent.is_some(),
            prefill: agent.is_none_or(|a| a.prefill),
            on_read: agent.map_or(&[][..], |a| &a.fill_on_read[..]),
        }
    }

    /// This rank's share of a class's fill order: every `local_count`-th sample filled ahead.
    fn share_of(&self, fill_order: &[u32]) -> Vec<u32> {
        fill_order
            .iter()
            .filter(|&&k| !self.on_read.get(k as usize).copied().unwrap_or(false))
            .enumerate()
            .filter(|(n, _)| n % self.local_count == self.local_index)
            .map(|(_, &k)| k)
            .collect()
    }
}

impl Inner {
    /// The engine's shared state, before any thread runs.
    fn new(source: Arc<dyn Source>, model: &SystemModel, spec: &JobSpec, p: Prepared) -> Inner {
        let f = source.len();
        let stamps = f > 0 && std::fs::metadata(source.path(0)).is_ok_and(|m| m.is_file());
        let readers = spec.local_ranks.len() as u32;
        let (fs_readers, fs_index) = fs_readers(spec);
        let readahead = crate::readahead::staging_gate(model, p.typical, fs_readers, fs_index);
        Inner {
            source,
            batch_ends: RwLock::new(p.stream.batch_ends),
            appending: Mutex::new(()),
            node: p.node,
            left: AtomicBool::new(false),
            stamps,
            checked: (0..f).map(|_| AtomicU32::new(0)).collect(),
            round: AtomicU32::new(1),
            ring: p.ring,
            ring_losses: AtomicU64::new(0),
            ring_cap: p.ring_cap,
            ring_lead: (readahead.far() * p.typical.max(1)).min(p.ring_cap),
            // Entries bound the look-ahead in samples (bytes are bounded by the ring). Samples
            // served from the memory class take no ring space, so this must cover every batch a
            // consumer keeps in flight (e.g. decode workers x prefetch depth x batch size) or
            // the staging prefetcher stalls behind them; an entry costs ~48 bytes.
            max_entries: 1 << 16,
            st: Mutex::new(StagingState::new(p.stream.stream, p.stream.epoch_starts)),
            produced: Condvar::new(),
            freed: Condvar::new(),
            grown: Condvar::new(),
            round_moved: Condvar::new(),
            check_from: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            producers_gone: AtomicBool::new(false),
            fill_timeout: Duration::from_secs(30),
            slow_claimants: claims::SlowClaimants::new(),
            clock: p.clock,
            stats: Mutex::new(
                (0..spec.schedule.epochs)
                    .map(|epoch| EpochStats {
                        epoch,
                        ..Default::default()
                    })
                    .collect(),
            ),
            pfs_bytes: AtomicU64::new(0),
            pfs_files: AtomicU64::new(0),
            pfs_at_epoch_start: Mutex::new((0, 0)),
            peer_faster: peer_faster(model, p.typical, readers),
            pfs_speed: (model.pfs.open_latency_s, model.pfs_per_reader_mbps(1) * 1e6),
            peer_bytes: AtomicU64::new(0),
            peer_misses: AtomicU64::new(0),
            peer_fallbacks: AtomicU64::new(0),
            peer_corrupt: AtomicU64::new(0),
            peer_at_epoch_start: Mutex::new((0, 0)),
            served_samples: AtomicU64::new(0),
            served_bytes: AtomicU64::new(0),
            prefilled: std::sync::OnceLock::new(),
            owner_pid: pid::current(),
            readahead,
        }
    }
}

/// The ranks that read the file system this rank reads, and this rank's number among them:
/// every rank of the job, on every node (nodes share the file system; the model's t(γ) counts
/// the readers of all of them).
fn fs_readers(spec: &JobSpec) -> (u32, u32) {
    let ranks = spec.schedule.world_size.max(spec.local_ranks.len() as u32).max(1);
    (ranks, spec.rank % ranks)
}

/// Give up this engine's use of `node` (starting failed): the last user leaves the node cache.
fn leave_share(node: &NodeShare) {
    if node.engines.fetch_sub(1, Ordering::AcqRel) == 1 {
        node.cache.detach();
    }
}

/// This rank's epochs from the job's first epoch on, shuffled here.
fn rank_streams(spec: &JobSpec) -> Result<Vec<crate::schedule::RankEpoch>> {
    let s = spec.schedule.streams_from(&[spec.rank], spec.first_epoch)?;
    Ok(s.into_iter().map(|e| e.into_iter().next().expect("one rank")).collect())
}

/// Create and map this rank's staging ring of `ring_cap` bytes in the node cache.
fn open_ring(node: &NodeShare, rank: u32, ring_cap: u64) -> Result<RingBuf> {
    node.cache
        .create_ring(rank, ring_cap.max(1))
        .and_then(|(path, file, reserved)| RingBuf::new(file, path, reserved))
}

/// The job fits its source and model: sample counts agree, ranks describe one machine, the
/// largest sample fits the staging ring, and the first epoch is one of the job's.
fn check_job(source: &dyn Source, model: &SystemModel, spec: &JobSpec) -> Result<()> {
    model.validate()?;
    let sched = &spec.schedule;
    if source.len() as u64 != sched.num_samples() as u64 {
        return Err(Error::config(
            "num_samples",
            format!(
                "the schedule has {} samples but the source has {}",
                sched.num_samples(),
                source.len()
            ),
        ));
    }
    validate_ranks(spec)?;
    let (largest, largest_size) = source.largest().unwrap_or((0, 0));
    // A node agent stages nothing; a file too large for its classes is read directly.
    if spec.agent.is_none() && largest_size > model.staging.capacity {
        return Err(Error::TooLarge {
            sample: largest as u64,
            path: source.path(largest).display().to_string(),
            size: largest_size,
            what: "the staging buffer (staging.capacity)".into(),
            capacity: model.staging.capacity,
        });
    }
    // A sample larger than a storage class is simply not placed there (see `plan`).
    if spec.first_epoch >= sched.epochs {
        return Err(Error::config(
            "start_epoch",
            format!("{} is not below the job's {} epochs", spec.first_epoch, sched.epochs),
        ));
    }
    Ok(())
}

/// The classes this node caches in, with the capacities it announced to the other nodes on a
/// cluster (they place samples by them).
fn node_requests(model: &SystemModel, spec: &JobSpec, useful: &[usize], total_bytes: u64) -> Vec<ClassRequest> {
    let mut requests = class_requests(model, useful, total_bytes);
    if let Some(c) = &spec.cluster {
        for (r, &cap) in requests.iter_mut().zip(&c.capacities[c.node]) {
            r.capacity = cap;
        }
    }
    requests
}

/// A staging ring lives in shared memory or, when that is too small, on disk: one that fits
/// neither is a configuration error now, before any class is sized by it.
fn check_ring_room(model: &SystemModel, cache: &NodeCache) -> Result<()> {
    let free = |p: &std::path::Path| crate::sysinfo::free_space(p).unwrap_or(u64::MAX);
    let (shm, disk) = (cache.dir().to_path_buf(), crate::tier::secure::disk_base());
    let room = free(&shm).max(free(&disk));
    if model.staging.capacity > room {
        return Err(Error::config(
            "staging.capacity",
            format!(
                "a staging ring of {} per rank fits neither in shared memory ({}, {} free) nor on disk \
                 ({}, {} free); lower staging.capacity (or CLAIRVOYANT_STAGING)",
                crate::model::human_bytes(model.staging.capacity),
                shm.display(),
                crate::model::human_bytes(free(&shm)),
                disk.display(),
                crate::model::human_bytes(free(&disk))
            ),
        ));
    }
    Ok(())
}

/// Warn of classes that got less than this node announced to the others, and refuse more
/// nodes than a placement can name.
fn check_cluster_capacities(c: &ClusterSpec, requests: &[ClassRequest], capacities: &[u64]) -> Result<()> {
    for (r, &got) in requests.iter().zip(capacities) {
        if got < r.capacity {
            crate::tier::warn_once(
                &format!("cluster-capacity:{}", r.name),
                &format!(
                    "storage class '{}' got {} of the {} this node announced; samples that do not fit are read from their origin",
                    r.name,
                    crate::model::format_bytes(got),
                    crate::model::format_bytes(r.capacity)
                ),
            );
        }
    }
    if c.nodes.len() >= crate::plan::NO_NODE as usize {
        return Err(Error::config(
            "nodes",
            format!("{} nodes; at most {}", c.nodes.len(), crate::plan::NO_NODE - 1),
        ));
    }
    Ok(())
}

/// How each class hands out bytes, and the placement's summary per class (name, samples, bytes).
#[allow(clippy::type_complexity)]
fn stores_and_summary(
    cache: &NodeCache,
    requests: &[ClassRequest],
    placement: &crate::plan::Placement,
) -> (Vec<ClassStore>, Vec<(String, u64, u64)>) {
    let mut stores = Vec::new();
    let mut summary = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        summary.push((r.name.clone(), placement.samples[i], placement.used[i]));
        stores.push(if cache.tier(i).shared_path().is_some() {
            ClassStore::Mapped
        } else {
            ClassStore::Copy
        });
    }
    (stores, summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::RankEpoch;

    #[test]
    fn local_ranks_fill_each_sample_once_skipping_those_filled_on_read() {
        let order: Vec<u32> = (0..10).rev().collect();
        let ranks = [3u32, 5, 7];
        let agent = AgentSpec {
            counts: None,
            prefill: true,
            fill_on_read: (0..10).map(|k| k % 4 == 0).collect(),
        };
        let shares: Vec<Vec<u32>> = ranks
            .iter()
            .map(|&r| Filler::of(&ranks, r, Some(&agent)).share_of(&order))
            .collect();
        // Filled ahead, in the order's order: 9 7 6 5 3 2 1, dealt out round robin.
        assert_eq!(shares, vec![vec![9, 5, 1], vec![7, 3], vec![6, 2]]);
        let f = Filler::of(&ranks, 5, Some(&agent));
        assert!(f.agent && f.prefill);
    }

    #[test]
    fn every_rank_of_the_job_reads_the_file_system() {
        // Rank 5 of 8, on a node of ranks 4 and 5: the file system is shared by all 8, so the
        // read-concurrency controller divides the file system's reads by 8, not by 2.
        let spec = JobSpec {
            schedule: crate::schedule::Schedule::shuffle(64, 8, 2, 1, 0, false).unwrap(),
            rank: 5,
            local_ranks: vec![4, 5],
            run_id: String::new(),
            first_epoch: 0,
            cluster: None,
            agent: None,
        };
        assert_eq!(fs_readers(&spec), (8, 5));
        let alone = JobSpec {
            schedule: crate::schedule::Schedule::shuffle(64, 1, 2, 1, 0, false).unwrap(),
            rank: 0,
            local_ranks: vec![0],
            ..spec
        };
        assert_eq!(fs_readers(&alone), (1, 0));
    }

    #[test]
    fn a_rank_alone_fills_its_whole_order() {
        let f = Filler::of(&[0], 0, None);
        assert!(!f.agent && f.prefill);
        assert_eq!(f.share_of(&[4, 1, 3]), vec![4, 1, 3]);
    }

    #[test]
    fn a_resumed_stream_starts_at_its_first_epoch() {
        let e = |s: &[u32], b: &[u32]| RankEpoch {
            samples: s.to_vec(),
            batch_ends: b.to_vec(),
        };
        let p = StreamParts::new(vec![e(&[4, 2, 0], &[2, 3]), e(&[1, 3], &[2])], 2);
        assert_eq!(p.stream, [4, 2, 0, 1, 3]);
        assert_eq!(p.epoch_starts, vec![0, 0, 0, 3, 5]);
        assert_eq!(p.batch_ends.len(), 4);
        assert!(p.batch_ends[..2].iter().all(|b| b.is_empty()));
        assert_eq!(&*p.batch_ends[2], &[2, 3]);
        assert_eq!(&*p.batch_ends[3], &[2]);
        let st = StagingState::new(p.stream, p.epoch_starts);
        // The round a position is allocated and fetched in: its epoch plus one.
        assert_eq!([0, 2, 3, 4].map(|pos| st.epoch_of(pos) + 1), [3, 3, 4, 4]);
        assert_eq!((st.base(), st.total()), (0, 5));
    }
}
