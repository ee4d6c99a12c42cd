//! The discrete-event core: one run of one policy, per worker and per sample.
//!
//! Every worker has `p_0` staging threads that bring its access stream, in order, into a staging
//! buffer of `d_0` bytes; some policies add per-node class prefetchers (fill threads) that copy
//! samples into storage classes. The threads of a worker (or of a fill list) form one actor on
//! one event heap, keyed by the time its first thread is free; events are processed in time
//! order. A thread that takes a sample decides where to read it from, and the sample is ready
//! in staging at
//!
//!   t + fetch (from that location) + max(s/β, s/(w_0(p_0)/p_0))      (preprocess, store)
//!
//! where fetch is s/(r_j(p_j)/p_j) from a local class, s/min(b_c, r_j(p_j)/p_j) from another
//! node's class, and from the PFS the open latency plus s/(t(γ)/γ), γ being the transfers in
//! flight when it starts (its rate is fixed then), no earlier than its bytes clear the
//! aggregate rate t(γ) behind the bytes already admitted. Training is synchronous: iteration j of every
//! worker starts when its batch is in staging and iteration j-1 has ended on all workers, and
//! takes (batch bytes)/c; iteration j ends when the slowest worker is done:
//!
//!   E_j = max_w( max(E_{j-1}, R_w(j)) + C_w(j) ) = max( E_{j-1} + max_w C_w(j), max_w (R_w(j) + C_w(j)) )
//!
//! A batch's staging space is freed when its iteration ends; a staging thread that needs space
//! waits for that (the current batch may always be fetched, so a buffer smaller than one batch
//! does not deadlock).

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtOrd};
use std::sync::Arc;

use clairvoyant_core::mem::{huge_vec, prefetch};
use clairvoyant_core::model::format_bytes;
use clairvoyant_core::plan::{AccessCounts, Placement, UNCACHED};
use clairvoyant_core::schedule::{epoch_permutation, splitmix64, Layout, RankEpoch, Schedule};
use clairvoyant_core::{Error, Result};
use rayon::prelude::*;

use crate::policy::Policy;
use crate::scenario::Scenario;

mod heap;
mod order;
mod setup;

use heap::{argmin, min_time, Ev, MinHeap};
use order::{locality_reassign, substitute_pick};
use setup::{cache_setup, fill_slots, iters_per_epoch, Rates, Setup};

/// Progress of a simulation, shared with whoever shows it; `cancel` stops it.
#[derive(Debug, Default)]
pub struct Progress {
    /// Samples simulated so far (all policies).
    pub done: AtomicU64,
    /// Samples to simulate in all.
    pub total: AtomicU64,
    /// Set to stop the simulation early (it then fails with `Error::Cancelled`).
    pub cancel: AtomicBool,
}

/// How one policy did.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyResult {
    /// The policy these figures are for.
    pub policy: Policy,
    /// Wall time of the whole run (preloading included); None when the policy cannot run.
    pub total_seconds: Option<f64>,
    /// Time before training starts (parallel staging, LBANN preloading).
    pub preload_seconds: f64,
    /// Sum over iterations of the slowest worker's compute time.
    pub compute_seconds: f64,
    /// total - preload - compute: time the accelerators waited for data.
    pub stall_seconds: f64,
    /// Duration of each epoch (epoch 0 includes preloading).
    pub epoch_seconds: Vec<f64>,
    /// Thread-seconds the staging threads spent fetching, by location name.
    pub fetch_seconds: Vec<(String, f64)>,
    /// Samples brought into staging, by location name.
    pub samples_by_location: Vec<(String, u64)>,
    /// Bytes read from the PFS (all threads).
    pub pfs_bytes: u64,
    /// Whether every epoch visits the whole dataset in the shuffled order.
    pub full_randomization: bool,
    /// Why the policy could not run (e.g. the dataset exceeds aggregate memory); None if it ran.
    pub error: Option<String>,
}

impl PolicyResult {
    fn failed(policy: Policy, error: String, full_randomization: bool) -> Self {
        PolicyResult {
            policy,
            total_seconds: None,
            preload_seconds: 0.0,
            compute_seconds: 0.0,
            stall_seconds: 0.0,
            epoch_seconds: Vec::new(),
            fetch_seconds: Vec::new(),
            samples_by_location: Vec::new(),
            pfs_bytes: 0,
            full_randomization,
            error: Some(error),
        }
    }

    /// The lower bound: every batch ready when needed, E_j = E_{j-1} + max_w C_w(j).
    fn perfect(epoch_seconds: Vec<f64>) -> Self {
        let total: f64 = epoch_seconds.iter().sum();
        PolicyResult {
            policy: Policy::Perfect,
            total_seconds: Some(total),
            preload_seconds: 0.0,
            compute_seconds: total,
            stall_seconds: 0.0,
            epoch_seconds,
            fetch_seconds: Vec::new(),
            samples_by_location: Vec::new(),
            pfs_bytes: 0,
            full_randomization: true,
            error: None,
        }
    }

    /// The total split over locations in proportion to fetch time (what Figure 8's stacked bars
    /// show); a policy that fetched nothing is all "staging".
    pub fn seconds_by_location(&self) -> Vec<(String, f64)> {
        let Some(total) = self.total_seconds else {
            return Vec::new();
        };
        let sum: f64 = self.fetch_seconds.iter().map(|(_, s)| s).sum();
        if sum <= 0.0 {
            return vec![("staging".into(), total)];
        }
        self.fetch_seconds
            .iter()
            .filter(|(_, s)| *s > 0.0)
            .map(|(n, s)| (n.clone(), total * s / sum))
            .collect()
    }
}

/// Everything the policies share: the scenario, sample sizes, and the shuffle.
pub struct Run<'a> {
    /// The scenario being simulated.
    pub scenario: &'a Scenario,
    /// Size in bytes of each sample.
    pub sizes: &'a [u64],
    /// Every worker's access stream, shuffled from the scenario's seed.
    pub schedule: Schedule,
    /// Where the simulated samples are counted and cancellation is read.
    pub progress: &'a Progress,
    /// Every sample size fits in 32 bits (epochs' sizes are then kept in 4 bytes each).
    narrow_sizes: bool,
}

impl<'a> Run<'a> {
    /// Prepares to simulate `scenario` with the sample sizes `sizes`; refuses a scenario whose
    /// schedule is invalid.
    pub fn new(scenario: &'a Scenario, sizes: &'a [u64], progress: &'a Progress) -> Result<Self> {
        let schedule = Schedule::shuffle(
            scenario.samples,
            scenario.workers,
            scenario.batch_size,
            scenario.epochs,
            scenario.seed,
            scenario.drop_last,
        )?;
        Ok(Run {
            scenario,
            sizes,
            schedule,
            progress,
            narrow_sizes: sizes.iter().all(|&s| s <= u32::MAX as u64),
        })
    }

    /// Samples the staging threads of all workers bring in over the run, for progress.
    pub fn samples_per_run(&self) -> u64 {
        let layout = self.layout();
        let per_epoch: u64 = (0..self.scenario.workers)
            .flat_map(|r| layout.rank_batches(r))
            .map(|b| b.end - b.start)
            .sum();
        per_epoch * self.scenario.epochs as u64
    }

    fn layout(&self) -> Layout {
        self.schedule.layout(0).expect("validated layout")
    }

    fn all_ranks(&self) -> Vec<u32> {
        (0..self.scenario.workers).collect()
    }

    /// Simulate one policy. A policy that cannot run the scenario gives a result with `error`.
    pub fn simulate(&self, policy: Policy) -> Result<PolicyResult> {
        Ok(self.simulate_all(&[policy])?.remove(0))
    }

    /// Simulate several policies side by side: each epoch's order is shuffled once and handed
    /// to every policy. Policies are set up and advanced, an epoch at a time, on all cores; a
    /// policy may run one epoch ahead of the slowest (so at most two epochs' orders are held at
    /// a time, and a long set-up does not leave a core idle).
    pub fn simulate_all(&self, policies: &[Policy]) -> Result<Vec<PolicyResult>> {
        let slots: Vec<PolicySlot> = policies
            .iter()
            .map(|&p| match p {
                Policy::Perfect => PolicySlot::Perfect,
                _ => PolicySlot::Pending(p),
            })
            .collect();
        let want_perfect = slots.iter().any(|s| matches!(s, PolicySlot::Perfect));
        let (slots, perfect) = self.run_epochs(slots, want_perfect)?;
        slots
            .into_iter()
            .map(|slot| match slot {
                PolicySlot::Sim(sim) => sim.finish(),
                PolicySlot::Done(r) => Ok(r),
                PolicySlot::Perfect => Ok(PolicyResult::perfect(perfect.clone())),
                PolicySlot::Pending(_) => unreachable!("every policy was set up"),
            })
            .collect()
    }

    /// Every epoch through every slot that simulates, on all cores; returns the slots and
    /// Perfect's epoch times (when `want_perfect`).
    fn run_epochs<'r>(
        &'r self,
        slots: Vec<PolicySlot<'r, 'a>>,
        want_perfect: bool,
    ) -> Result<(Vec<PolicySlot<'r, 'a>>, Vec<f64>)> {
        let layout = self.layout();
        let batches: Vec<Vec<std::ops::Range<u64>>> =
            (0..self.scenario.workers).map(|r| layout.rank_batches(r)).collect();
        let per_epoch: u64 = batches.iter().flatten().map(|b| b.end - b.start).sum();
        let epochs = self.scenario.epochs;
        // No more threads than tasks that can run at once: every policy, and one shuffle.
        let busy = slots.iter().filter(|s| matches!(s, PolicySlot::Pending(_))).count();
        let threads = rayon::current_num_threads().clamp(1, busy + 1);
        let board = std::sync::Mutex::new(Board::new(slots, epochs, want_perfect));
        let changed = std::sync::Condvar::new();
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    let _unwind = Unwind {
                        board: &board,
                        changed: &changed,
                    };
                    let lock = || board.lock().unwrap_or_else(|e| e.into_inner());
                    let mut b = lock();
                    loop {
                        if let Err(e) = check_cancel(self.progress) {
                            b.error.get_or_insert(e);
                        }
                        if b.error.is_some() || b.panicked || b.finished() {
                            break;
                        }
                        let Some(task) = b.pick() else {
                            b = changed.wait(b).unwrap_or_else(|e| e.into_inner());
                            continue;
                        };
                        drop(b);
                        match task {
                            Task::Prepare(e) => {
                                let data = EpochData::new(self, e);
                                let seconds =
                                    want_perfect.then(|| data.perfect_seconds(&batches, self.scenario.compute_bps()));
                                b = lock();
                                if let Some(s) = seconds {
                                    b.perfect[e as usize] = s;
                                    self.progress.done.fetch_add(per_epoch, AtOrd::Relaxed);
                                }
                                b.data.insert(e, Arc::new(data));
                                b.preparing = false;
                            }
                            Task::Advance(i, mut slot, e, data) => {
                                let ran = data.is_some();
                                let r = slot.build(self).and_then(|()| match (&mut slot, data) {
                                    (PolicySlot::Sim(sim), Some(data)) => sim.advance(e, data),
                                    _ => Ok(()),
                                });
                                b = lock();
                                b.next[i] = match slot {
                                    PolicySlot::Sim(_) if ran => e + 1,
                                    PolicySlot::Sim(_) => e, // set up only: its epoch's order was not ready
                                    _ => epochs,             // could not run: nothing more to do
                                };
                                b.slots[i] = Some(slot);
                                b.running -= 1;
                                if let Err(e) = r {
                                    b.error.get_or_insert(e);
                                }
                            }
                        }
                        changed.notify_all();
                    }
                    drop(b);
                    changed.notify_all();
                });
            }
        });
        let mut b = board.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = b.error.take() {
            return Err(e);
        }
        let mut slots: Vec<PolicySlot> = b
            .slots
            .into_iter()
            .map(|s| s.expect("every task returned its slot"))
            .collect();
        // Without epochs nothing was advanced: set up what is left (for its errors).
        slots
            .par_iter_mut()
            .with_max_len(1)
            .try_for_each(|slot| slot.build(self))?;
        Ok((slots, b.perfect))
    }
}

/// How many epochs a policy may run ahead of the slowest: an epoch's order is shuffled when
/// the slowest policy is at most this many epochs before it, and dropped once every policy
/// has taken it.
const LEAD: u32 = 1;

/// Stops the other threads of [`Run::run_epochs`] when this one unwinds from a panic (they would
/// otherwise wait for its task forever); the scope then raises the panic.
struct Unwind<'b, 'r, 'a> {
    board: &'b std::sync::Mutex<Board<'r, 'a>>,
    changed: &'b std::sync::Condvar,
}

impl Drop for Unwind<'_, '_, '_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.board.lock().unwrap_or_else(|e| e.into_inner()).panicked = true;
            self.changed.notify_all();
        }
    }
}

/// What a thread of [`Run::run_epochs`] does next.
enum Task<'r, 'a> {
    /// Shuffle epoch e's order.
    Prepare(u32),
    /// Set slot i (taken from the board meanwhile) up if it is not, and run it through epoch e
    /// when its order is given.
    Advance(usize, PolicySlot<'r, 'a>, u32, Option<Arc<EpochData>>),
}

/// The shared state of [`Run::run_epochs`]: which policy is where, and the epochs' orders.
struct Board<'r, 'a> {
    /// Every slot; None while a thread advances it.
    slots: Vec<Option<PolicySlot<'r, 'a>>>,
    /// Per slot, the epoch it runs next (or is running); `epochs` when it has nothing to do.
    next: Vec<u32>,
    epochs: u32,
    /// Orders prepared and not yet taken by every policy.
    data: std::collections::BTreeMap<u32, Arc<EpochData>>,
    /// Epochs whose order is prepared or being prepared.
    prepared: u32,
    preparing: bool,
    running: usize,
    /// Perfect's epoch times, when it is asked for (every epoch's order is then shuffled).
    want_perfect: bool,
    perfect: Vec<f64>,
    error: Option<Error>,
    /// A thread panicked: the others stop.
    panicked: bool,
}

impl<'r, 'a> Board<'r, 'a> {
    fn new(slots: Vec<PolicySlot<'r, 'a>>, epochs: u32, want_perfect: bool) -> Self {
        let next = slots
            .iter()
            .map(|s| if matches!(s, PolicySlot::Pending(_)) { 0 } else { epochs })
            .collect();
        Board {
            slots: slots.into_iter().map(Some).collect(),
            next,
            epochs,
            data: Default::default(),
            prepared: 0,
            preparing: false,
            running: 0,
            want_perfect,
            perfect: vec![0.0; epochs as usize],
            error: None,
            panicked: false,
        }
    }

    /// Every policy has run every epoch (and Perfect has every epoch's time).
    fn finished(&self) -> bool {
        self.running == 0
            && !self.preparing
            && self.next.iter().all(|&e| e >= self.epochs)
            && (!self.want_perfect || self.prepared == self.epochs)
    }

    /// The next task, or None when every task possible now is taken: first the next epoch's
    /// order (when the slowest policy is near enough), then the policy furthest behind (the
    /// costliest first, so that none starts last and runs alone), else the set-up of a policy
    /// whose first epoch's order is not ready yet.
    fn pick(&mut self) -> Option<Task<'r, 'a>> {
        let slowest = self.next.iter().copied().min().unwrap_or(self.epochs);
        while self.data.first_key_value().is_some_and(|(&e, _)| e < slowest) {
            self.data.pop_first();
        }
        if !self.preparing && self.prepared < self.epochs && self.prepared <= slowest + LEAD {
            self.preparing = true;
            self.prepared += 1;
            return Some(Task::Prepare(self.prepared - 1));
        }
        let (i, ready) = (0..self.slots.len())
            .filter(|&i| self.next[i] < self.epochs)
            .filter_map(|i| {
                self.slots[i]
                    .as_ref()
                    .map(|s| (i, s, self.data.contains_key(&self.next[i])))
            })
            .filter(|&(_, s, ready)| ready || matches!(s, PolicySlot::Pending(_)))
            .min_by_key(|&(i, s, ready)| (!ready, self.next[i], std::cmp::Reverse(crate::cost(s.policy())), i))
            .map(|(i, _, ready)| (i, ready))?;
        let e = self.next[i];
        self.running += 1;
        let data = ready.then(|| self.data[&e].clone());
        Some(Task::Advance(i, self.slots[i].take()?, e, data))
    }
}

/// One policy in [`Run::simulate_all`], from set-up to result.
enum PolicySlot<'r, 'a> {
    /// Set up when first advanced (so that the longest set-up overlaps the other policies'
    /// first epoch instead of holding them back).
    Pending(Policy),
    Sim(Box<Sim<'r, 'a>>),
    Done(PolicyResult),
    Perfect,
}

impl<'r, 'a> PolicySlot<'r, 'a> {
    fn build(&mut self, run: &'r Run<'a>) -> Result<()> {
        if let PolicySlot::Pending(p) = *self {
            *self = match Sim::build(run, p)? {
                Ok(sim) => PolicySlot::Sim(Box::new(sim)),
                Err(reason) => PolicySlot::Done(PolicyResult::failed(p, reason, p != Policy::ParallelStaging)),
            };
        }
        Ok(())
    }

    fn policy(&self) -> Policy {
        match self {
            PolicySlot::Pending(p) => *p,
            PolicySlot::Sim(sim) => sim.policy,
            PolicySlot::Done(r) => r.policy,
            PolicySlot::Perfect => Policy::Perfect,
        }
    }
}

/// One epoch's global order and the sizes in that order, shared by all policies.
pub struct EpochData {
    order: Vec<u32>,
    sizes: EpochSizes,
}

/// Sizes in an epoch's order: 4 bytes each when every size fits.
enum EpochSizes {
    Narrow(Vec<u32>),
    Wide(Vec<u64>),
}

impl EpochSizes {
    /// Append the sizes of positions `lo..hi`.
    #[inline]
    fn extend_into(&self, out: &mut Vec<u64>, lo: usize, hi: usize) {
        match self {
            EpochSizes::Narrow(v) => out.extend(v[lo..hi].iter().map(|&s| s as u64)),
            EpochSizes::Wide(v) => out.extend_from_slice(&v[lo..hi]),
        }
    }

    /// The sum of the sizes of positions `lo..hi`.
    fn sum(&self, lo: usize, hi: usize) -> u64 {
        match self {
            EpochSizes::Narrow(v) => v[lo..hi].iter().map(|&s| s as u64).sum(),
            EpochSizes::Wide(v) => v[lo..hi].iter().sum(),
        }
    }
}

impl EpochData {
    fn new(run: &Run, e: u32) -> Self {
        let order = run.schedule.global_order(e);
        let sizes = if run.narrow_sizes {
            EpochSizes::Narrow(order.iter().map(|&k| run.sizes[k as usize] as u32).collect())
        } else {
            EpochSizes::Wide(order.iter().map(|&k| run.sizes[k as usize]).collect())
        };
        EpochData { order, sizes }
    }

    /// The epoch with no stalls: the sum over iterations of the largest batch's compute time.
    fn perfect_seconds(&self, batches: &[Vec<std::ops::Range<u64>>], compute_bps: f64) -> f64 {
        let nb = batches.first().map_or(0, |b| b.len());
        (0..nb)
            .map(|i| {
                batches
                    .iter()
                    .map(|b| self.sizes.sum(b[i].start as usize, b[i].end as usize))
                    .max()
                    .unwrap_or(0) as f64
                    / compute_bps
            })
            .sum()
    }
}

/// What an actor does after a step.
enum Step {
    /// Its next thread is free at this time.
    At(f64),
    /// Nothing more for now (done, or waiting to be woken).
    Retire,
    /// It needs an epoch the driver has not handed in: stop the loop, keep the event.
    Pause,
}

fn check_cancel(p: &Progress) -> Result<()> {
    if p.cancel.load(AtOrd::Relaxed) {
        return Err(Error::Cancelled);
    }
    Ok(())
}

const NONE: u32 = u32::MAX;
const LOC_PFS: usize = 0;
const LOC_REMOTE: usize = 1;
const LOC_CLASS: usize = 2;

/// When a single-copy cache takes a sample it has just read from the PFS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admit {
    Never,
    FirstEpoch,
    Always,
}

/// Where samples are cached.
enum Cache {
    None,
    /// Every sample is already in this class on every node (the staging buffer reads from it).
    Everywhere(usize),
    /// One copy per sample (`held`), filled on first read (`admit`) or preassigned and
    /// preloaded; under the opportunistic order (its substitutes are drawn from them),
    /// `cached[n]` lists the samples node n has taken, in the order it took them.
    Single {
        held: Vec<Held>,
        cached: Vec<Vec<Taken>>,
        /// Bytes used, per node and class.
        used: Vec<Vec<u64>>,
        /// Classes a read sample may be admitted to, in order.
        admit_to: Vec<usize>,
        admit: Admit,
        remote: bool,
    },
    /// Clairvoyant placement: per node and sample its class and when it is there; per sample
    /// the earliest copy anywhere (for peers). Each is one small record, so a lookup touches
    /// one cache line.
    Placed {
        local: Vec<Vec<Slot>>,
        first: Vec<Copy>,
    },
}

/// A sample's place in a node: its class (or UNCACHED) and from when it is there (infinite
/// until written or being written). Packed to 12 bytes: one per node and sample.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Slot {
    avail: f64,
    class: u8,
}

/// The one copy of a sample under a single-copy cache: its node (NONE: not cached), class,
/// and from when it is there (infinite until written). Packed to 12 bytes (node and class in
/// one word): one per sample.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Held {
    avail: f64,
    /// `node << 8 | class`, the node's 24 bits all set for NONE.
    place: u32,
}

/// A sample in a node's list of those it has taken (`Cache::Single::cached`): its number, size
/// (`u32::MAX`: look it up, it does not fit), class, and from when it is there, as in its
/// `Held` (kept equal to it: set when the sample is taken and when its copy is written). A
/// substitute drawn from the list is decided from this one record, without the lookups of its
/// entry and size in the big per-sample tables.
#[derive(Clone, Copy, Debug)]
#[repr(C, packed(4))]
struct Taken {
    avail: f64,
    k: u32,
    size: u32,
    class: u8,
}

impl Taken {
    #[inline]
    fn size(self, sizes: &[u64]) -> u64 {
        match self.size {
            u32::MAX => sizes[self.k as usize],
            s => s as u64,
        }
    }
}

/// Nodes a `Held` can name (its 24 bits, all set meaning none).
const MAX_NODES: usize = (1 << 24) - 1;

impl Held {
    #[inline]
    fn new(avail: f64, owner: u32, class: u8) -> Held {
        Held {
            avail,
            place: (owner << 8) | class as u32,
        }
    }

    #[inline]
    fn owner(self) -> u32 {
        match self.place >> 8 {
            o if o as usize == MAX_NODES => NONE,
            o => o,
        }
    }

    #[inline]
    fn class(self) -> u8 {
        self.place as u8
    }

    #[inline]
    fn set(&mut self, owner: u32, class: u8) {
        self.place = (owner << 8) | class as u32;
    }
}

/// The earliest copy of a sample on any node.
#[derive(Clone, Copy, Debug)]
struct Copy {
    avail: f64,
    node: u32,
    class: u8,
}

/// How each epoch's per-worker streams are made.
enum Order {
    /// The shuffled global order split among workers (the engine's layout).
    Global,
    /// Global, but from epoch 1 samples cached nowhere are replaced by cached ones.
    Opportunistic,
    /// Global batches kept, samples moved to the worker whose node caches them.
    Locality,
    /// Each worker shuffles its own stored shard; `len` samples per worker per epoch.
    Shards { stored: Vec<Vec<u32>>, len: usize },
}

/// A list of samples a group of fill threads copies into a class of a node.
struct FillList {
    node: u32,
    class: usize,
    order: Vec<u32>,
    /// For a list in first-need order: each sample's first need by the node's workers
    /// (`epoch << 32 | position`). Samples the workers have already passed were read (and
    /// kept) by them, so the list skips them without a lookup.
    need: Vec<u64>,
    cursor: usize,
}

/// Where a worker's samples for one epoch come from.
enum Source {
    /// Its batches (`Sim::batches`) of the epoch's global order, which all policies share.
    Global(Arc<EpochData>),
    /// A list of its own (a reordered or sharded stream).
    Own(Vec<u32>),
}

/// How many positions of a stream are gathered at a time.
const WINDOW: usize = 2048;

/// One worker's stream for one epoch. The next `WINDOW` positions are gathered at a time:
/// samples, sizes and cache entries in access order (the event loop then reads them
/// sequentially; gathering many at once overlaps the cache misses), so a stream holds no
/// per-sample table of its own beyond an `Own` list.
struct Stream {
    src: Source,
    batch_ends: Vec<u32>,
    /// The window holds positions `lo..lo + samples.len()`.
    lo: usize,
    samples: Vec<u32>,
    sizes: Vec<u64>,
    /// Per position of the window, the sample's cache entry as it was when the window was
    /// gathered (empty for policies without a cache). An entry with a finite `avail` is final
    /// (a copy, once written, stays, and a final entry decides a fetch as the live cache
    /// would), so most lookups need not touch the cache's big random-access arrays.
    known: Vec<Held>,
}

impl Stream {
    fn new(src: Source, batch_ends: Vec<u32>) -> Self {
        Stream {
            src,
            batch_ends,
            lo: 0,
            samples: Vec::new(),
            sizes: Vec::new(),
            known: Vec::new(),
        }
    }
}

/// Where a staging read comes from (see `Sim::fetch`).
enum Decision {
    /// Read from a class (local or a peer's): the location and when the read ends.
    Done(usize, f64),
    /// Read from the PFS; keep the copy in this class when given.
    Pfs(Option<usize>),
    /// Read from a peer or the PFS; keep the copy in this class when given.
    Elsewhere(Option<usize>),
}

/// The staging side of one worker.
struct Fetcher {
    epoch: u32,
    stream: Option<Box<Stream>>,
    pos: usize,
    batch: usize,
    iter_base: usize,
    batch_ready: f64,
    batch_bytes: u64,
    inflight: u64,
    /// Iterations with samples in staging, oldest first, and their bytes.
    outstanding: VecDeque<(usize, u64)>,
}

/// Per iteration: workers reported, max_w C_w, max_w (R_w + C_w).
#[derive(Clone, Copy, Default)]
struct IterAcc {
    reported: u32,
    max_c: f64,
    max_rc: f64,
}

struct Sim<'r, 'a> {
    run: &'r Run<'a>,
    policy: Policy,
    workers: usize,
    wpn: usize,
    threads: usize,
    staging_cap: u64,
    // Seconds per byte.
    write_spb: f64,
    compute_spb: f64,
    class_read_spb: Vec<f64>,
    class_write_spb: Vec<f64>,
    remote_spb: Vec<Option<f64>>,
    /// Latency of one peer fetch, seconds.
    peer_latency: f64,
    pfs_latency: f64,
    /// The file system serves transfers one after another on one timeline (`pfs_sharing = "fifo"`).
    pfs_fifo: bool,
    /// `pfs_spb[γ]`: seconds per byte for one of γ concurrent readers.
    pfs_spb: Vec<f64>,
    /// When each thread is free next: worker w's staging threads are slots
    /// `w*threads..(w+1)*threads`, fill list i's threads `fill_slots[i]`.
    free: Vec<f64>,
    /// Per worker, its staging thread that is free first (the argmin of its `free` slots,
    /// kept up to date whenever they change: one scan per sample instead of two).
    next_thread: Vec<usize>,
    /// End times of the PFS transfers in progress (f64 bit patterns).
    pfs_active: MinHeap<u64>,
    /// Until when the bytes admitted so far keep the PFS busy at its aggregate rate.
    pfs_pipe: f64,
    cache: Cache,
    order: Order,
    fills: Vec<FillList>,
    /// The thread slots of each fill list.
    fill_slots: Vec<std::ops::Range<usize>>,
    /// Epoch streams made and not yet taken by their workers.
    streams: HashMap<u32, Vec<Option<Box<Stream>>>>,
    /// Every worker's batches (ranges of an epoch's global order) under the engine's layout.
    batches: Vec<Vec<std::ops::Range<u64>>>,
    /// Epochs' global orders handed in by the driver and not yet made into streams.
    epoch_data: HashMap<u32, Arc<EpochData>>,
    started: bool,
    finished: bool,
    iters_per_epoch: usize,
    fetchers: Vec<Fetcher>,
    iters: Vec<IterAcc>,
    ends: Vec<f64>,
    finalized: usize,
    parked: HashMap<usize, Vec<u32>>,
    t0: f64,
    /// Time of the last event processed.
    clock: f64,
    /// One entry per actor ([`Ev::key`]): the earliest first, ties by lowest id.
    heap: MinHeap<u128>,
    /// Threads woken during a step, pushed after it.
    woken: Vec<Ev>,
    loc_seconds: Vec<f64>,
    loc_samples: Vec<u64>,
    pfs_bytes: u64,
    substituted: u64,
    full_randomization: bool,
    pending_progress: u64,
}

impl Fetcher {
    fn new() -> Fetcher {
        Fetcher {
            epoch: 0,
            stream: None,
            pos: 0,
            batch: 0,
            iter_base: 0,
            batch_ready: 0.0,
            batch_bytes: 0,
            inflight: 0,
            outstanding: VecDeque::new(),
        }
    }
}

impl<'r, 'a> Sim<'r, 'a> {
    /// Set up `policy`; `Ok(Err(reason))` when the policy cannot run this scenario.
    fn build(run: &'r Run<'a>, policy: Policy) -> Setup<Self> {
        let sc = run.scenario;
        let m = &sc.system;
        let workers = sc.workers as usize;
        let nodes = sc.nodes() as usize;
        if nodes > MAX_NODES {
            return Err(Error::config(
                "workers",
                format!("{nodes} nodes; the simulator models at most {MAX_NODES}"),
            ));
        }
        let (threads, staging_cap) = match policy {
            Policy::Naive => (1, 0),
            _ => (m.staging.threads.max(1) as usize, m.staging.capacity),
        };
        let rates = Rates::of(sc);
        let setup = match cache_setup(run, policy, threads)? {
            Ok(setup) => setup,
            Err(reason) => return Ok(Err(reason)),
        };
        let (fill_slots, slots) = fill_slots(sc, &setup.fills, workers * threads);
        let iters_per_epoch = iters_per_epoch(run, &setup.order);
        let total_iters = iters_per_epoch * sc.epochs as usize;
        let pfs_spb: Vec<f64> = (0..=slots + 1)
            .map(|g| 1e-6 / m.pfs_per_reader_mbps(g.max(1) as u32).max(1e-12))
            .collect();
        let locs = LOC_CLASS + m.classes.len();
        let layout = run.layout();
        Ok(Ok(Sim {
            run,
            policy,
            workers,
            wpn: sc.workers_per_node as usize,
            threads,
            staging_cap,
            write_spb: rates.write_spb,
            compute_spb: 1.0 / sc.compute_bps(),
            class_read_spb: rates.class_read_spb,
            class_write_spb: rates.class_write_spb,
            remote_spb: rates.remote_spb,
            peer_latency: sc.peer_latency_s,
            pfs_latency: m.pfs.open_latency_s,
            pfs_fifo: sc.pfs_sharing == crate::scenario::PfsSharing::Fifo,
            pfs_spb,
            free: vec![0.0; slots],
            next_thread: (0..workers).map(|w| w * threads).collect(),
            pfs_active: MinHeap::default(),
            pfs_pipe: 0.0,
            cache: setup.cache,
            order: setup.order,
            fills: setup.fills,
            fill_slots,
            streams: HashMap::new(),
            epoch_data: HashMap::new(),
            batches: (0..sc.workers).map(|r| layout.rank_batches(r)).collect(),
            started: false,
            finished: false,
            iters_per_epoch,
            fetchers: (0..workers).map(|_| Fetcher::new()).collect(),
            iters: vec![IterAcc::default(); total_iters],
            ends: vec![f64::NAN; total_iters],
            finalized: 0,
            parked: HashMap::new(),
            t0: 0.0,
            clock: 0.0,
            heap: MinHeap::default(),
            woken: Vec::new(),
            loc_seconds: vec![0.0; locs],
            loc_samples: vec![0; locs],
            pfs_bytes: 0,
            substituted: 0,
            full_randomization: setup.full_randomization,
            pending_progress: 0,
        }))
    }

    /// Put the fill threads to work (and, for preloading policies, run them to the end), then
    /// the staging threads.
    fn start(&mut self) -> Result<()> {
        self.started = true;
        let preload = matches!(self.policy, Policy::ParallelStaging | Policy::LbannPreloading);
        for i in 0..self.fills.len() {
            self.heap.push(
                Ev {
                    t: 0.0,
                    id: (self.workers + i) as u32,
                }
                .key(),
            );
        }
        if preload {
            self.event_loop()?;
            self.t0 = self.clock;
        }
        for w in 0..self.workers {
            self.enter_epoch(w, 0);
            for slot in w * self.threads..(w + 1) * self.threads {
                self.free[slot] = self.t0;
            }
            self.next_thread[w] = w * self.threads;
            self.heap.push(
                Ev {
                    t: self.t0,
                    id: w as u32,
                }
                .key(),
            );
        }
        Ok(())
    }

    /// Hand in epoch `e`'s order and simulate until a worker needs the next one (or the end).
    fn advance(&mut self, e: u32, data: Arc<EpochData>) -> Result<()> {
        self.epoch_data.insert(e, data);
        if !self.started {
            self.start()?;
        }
        if !self.finished {
            self.finished = self.event_loop()?;
        }
        Ok(())
    }

    fn finish(mut self) -> Result<PolicyResult> {
        self.flush_progress(true)?;
        if self.finalized < self.ends.len() {
            return Err(Error::SimulationStalled {
                policy: self.policy.to_string(),
                iteration: self.finalized as u64,
                iterations: self.ends.len() as u64,
            });
        }
        let total = self.ends.last().copied().unwrap_or(self.t0);
        let compute: f64 = self.iters.iter().map(|a| a.max_c).sum();
        let mut epoch_seconds = Vec::new();
        let mut prev = 0.0;
        for e in 0..self.run.scenario.epochs as usize {
            let end = self.ends[(e + 1) * self.iters_per_epoch - 1];
            epoch_seconds.push(end - prev);
            prev = end;
        }
        let m = &self.run.scenario.system;
        let mut names = vec!["pfs".to_string(), "remote".to_string()];
        names.extend(m.classes.iter().map(|c| c.name.clone()));
        // Local classes first (fastest first), then peers, then the PFS.
        let order: Vec<usize> = (LOC_CLASS..names.len()).chain([LOC_REMOTE, LOC_PFS]).collect();
        let fetch_seconds = order
            .iter()
            .filter(|&&i| self.loc_samples[i] > 0)
            .map(|&i| (names[i].clone(), self.loc_seconds[i]))
            .collect();
        let samples_by_location = order
            .iter()
            .filter(|&&i| self.loc_samples[i] > 0)
            .map(|&i| (names[i].clone(), self.loc_samples[i]))
            .collect();
        Ok(PolicyResult {
            policy: self.policy,
            total_seconds: Some(total),
            preload_seconds: self.t0,
            compute_seconds: compute,
            stall_seconds: (total - self.t0 - compute).max(0.0),
            epoch_seconds,
            fetch_seconds,
            samples_by_location,
            pfs_bytes: self.pfs_bytes,
            full_randomization: self.full_randomization && self.substituted == 0,
            error: None,
        })
    }
}

impl Sim<'_, '_> {
    /// Process events until none are left (`Ok(true)`) or a worker needs an epoch the driver
    /// has not handed in yet (`Ok(false)`; its event stays on the heap).
    fn event_loop(&mut self) -> Result<bool> {
        // The heap holds one entry per actor (a worker's staging threads, a fill list's
        // threads); a step moves its actor's entry in place, which costs little when the
        // actor stays near the top.
        while let Some(Ev { t, id }) = self.heap.peek().map(Ev::from_key) {
            self.clock = self.clock.max(t);
            let a = id as usize;
            let next = if a < self.workers {
                self.staging_step(a, t)?
            } else {
                match self.fill_step(a - self.workers, t) {
                    Some(t) => Step::At(t),
                    None => Step::Retire,
                }
            };
            match next {
                Step::At(next) => self.heap.replace_top(Ev { t: next, id }.key()),
                Step::Retire => {
                    self.heap.pop();
                }
                Step::Pause => return Ok(false),
            }
            while let Some(ev) = self.woken.pop() {
                self.heap.push(ev.key());
            }
        }
        Ok(true)
    }

    fn flush_progress(&mut self, force: bool) -> Result<()> {
        if force || self.pending_progress >= 1 << 16 {
            self.run.progress.done.fetch_add(self.pending_progress, AtOrd::Relaxed);
            self.pending_progress = 0;
            check_cancel(self.run.progress)?;
        }
        Ok(())
    }

    /// Start worker `w` on epoch `e` (or mark it finished after the last epoch).
    fn enter_epoch(&mut self, w: usize, e: u32) {
        let f = &mut self.fetchers[w];
        if f.stream.take().is_some() {
            f.iter_base += self.iters_per_epoch;
        }
        f.epoch = e;
        f.pos = 0;
        f.batch = 0;
    }

    /// Give worker `w` its stream for its current epoch; false when the driver has not handed
    /// that epoch in yet.
    fn load_stream(&mut self, w: usize) -> bool {
        let e = self.fetchers[w].epoch;
        if !self.streams.contains_key(&e) {
            let Some(data) = self.epoch_data.remove(&e) else {
                return false;
            };
            let streams = self.make_epoch(e, data);
            // Boxed: a worker's stream moves out of and back into its fetcher every step.
            self.streams
                .insert(e, streams.into_iter().map(|s| Some(Box::new(s))).collect());
        }
        let pending = self.streams.get_mut(&e).expect("made");
        self.fetchers[w].stream = pending[w].take();
        if pending.iter().all(Option::is_none) {
            self.streams.remove(&e);
        }
        true
    }

    /// Every worker's stream for epoch `e` under this policy's order.
    fn make_epoch(&mut self, e: u32, data: Arc<EpochData>) -> Vec<Stream> {
        let run = self.run;
        let sc = run.scenario;
        let ranks = run.all_ranks();
        let own = |streams: Vec<RankEpoch>| -> Vec<Stream> {
            streams
                .into_iter()
                .map(|r| Stream::new(Source::Own(r.samples), r.batch_ends))
                .collect()
        };
        match &self.order {
            Order::Global | Order::Opportunistic => self
                .batches
                .iter()
                .map(|rank| {
                    let mut end = 0u32;
                    let batch_ends = rank
                        .iter()
                        .map(|b| {
                            end += (b.end - b.start) as u32;
                            end
                        })
                        .collect();
                    Stream::new(Source::Global(data.clone()), batch_ends)
                })
                .collect(),

            Order::Locality => {
                let streams = run.schedule.split(e, &data.order, &ranks).expect("validated layout");
                let Cache::Single { held, .. } = &self.cache else {
                    return own(streams);
                };
                own(locality_reassign(&streams, held, self.wpn))
            }
            Order::Shards { stored, len } => {
                let b = sc.batch_size as usize;
                let n_batches = self.iters_per_epoch;
                stored
                    .iter()
                    .enumerate()
                    .map(|(w, shard)| {
                        let perm = epoch_permutation(shard.len() as u32, sc.seed ^ splitmix64(w as u64 + 1), e as u64);
                        let samples: Vec<u32> = perm[..*len].iter().map(|&i| shard[i as usize]).collect();
                        let used = if n_batches * b < *len { n_batches * b } else { *len };
                        let batch_ends = (1..=n_batches).map(|i| (i * b).min(used) as u32).collect();
                        let mut samples = samples;
                        samples.truncate(used);
                        Stream::new(Source::Own(samples), batch_ends)
                    })
                    .collect()
            }
        }
    }

    /// A staging thread of worker `w` is free at `t`: it takes the worker's next sample (the
    /// threads take samples in access order). Returns when a thread of the worker is free next,
    /// None when the worker is done or waits for an iteration to end.
    fn staging_step(&mut self, w: usize, t: f64) -> Result<Step> {
        if self.fetchers[w].stream.is_none() {
            if self.fetchers[w].epoch >= self.run.scenario.epochs {
                return Ok(Step::Retire); // the worker has fetched its whole run
            }
            if !self.load_stream(w) {
                return Ok(Step::Pause);
            }
        }
        let mut stream = self.fetchers[w].stream.take().expect("loaded");
        let pos = self.fetchers[w].pos;
        if pos >= stream.lo + stream.samples.len() {
            self.gather(w, &mut stream);
        }
        let r = self.stage_one(w, t, &stream);
        self.fetchers[w].stream = Some(stream);
        let (step, finished_epoch) = r?;
        if let Some(epoch) = finished_epoch {
            self.enter_epoch(w, epoch + 1);
        }
        Ok(step)
    }

    /// The body of [`Sim::staging_step`] for worker `w` reading `mine`; also returns the epoch
    /// the worker has just finished fetching, if it has.
    fn stage_one(&mut self, w: usize, t: f64, mine: &Stream) -> Result<(Step, Option<u32>)> {
        let slots = w * self.threads..(w + 1) * self.threads;
        let id = self.next_thread[w];
        let (epoch, pos) = (self.fetchers[w].epoch, self.fetchers[w].pos);
        let at = pos - mine.lo;
        let (mut k, mut s) = (mine.samples[at], mine.sizes[at]);
        let mut known = mine.known.get(at).copied();
        self.prefetch_ahead(w, mine, at);
        if epoch > 0 && matches!(self.order, Order::Opportunistic) {
            if let Some((other, size, entry)) = self.substitute(w / self.wpn, k, s, epoch, pos, known) {
                (k, s, known) = (other, size, Some(entry));
                self.substituted += 1;
            }
        }
        let f = &mut self.fetchers[w];
        let iter = f.iter_base + f.batch;
        // Room in staging: free batches whose iteration has ended; wait for the oldest otherwise.
        while f.inflight + s > self.staging_cap {
            let Some(&(oldest, bytes)) = f.outstanding.front() else {
                break;
            };
            if oldest == iter {
                break; // only the current batch is held: it may always be fetched
            }
            let end = self.ends[oldest];
            if end.is_nan() {
                self.parked.entry(oldest).or_default().push(w as u32);
                return Ok((Step::Retire, None));
            }
            if end > t {
                return Ok((Step::At(end), None));
            }
            f.inflight -= bytes;
            f.outstanding.pop_front();
        }
        f.inflight += s;
        match f.outstanding.back_mut() {
            Some((i, b)) if *i == iter => *b += s,
            _ => f.outstanding.push_back((iter, s)),
        }
        let epoch = f.epoch;
        let node = w / self.wpn;
        let (loc, fetched) = match known.and_then(|h| self.fetch_known(node, h, s, t)) {
            Some(done) => done,
            None => self.fetch(node, k, s, t, epoch),
        };
        self.loc_seconds[loc] += fetched - t;
        self.loc_samples[loc] += 1;
        let done = fetched + s as f64 * self.write_spb;
        let f = &mut self.fetchers[w];
        f.batch_ready = f.batch_ready.max(done);
        f.batch_bytes += s;
        f.pos += 1;
        let mut finished_epoch = None;
        if f.pos == mine.batch_ends[f.batch] as usize {
            let c = f.batch_bytes as f64 * self.compute_spb;
            let ready = f.batch_ready;
            f.batch_ready = 0.0;
            f.batch_bytes = 0;
            f.batch += 1;
            let epoch_done = f.batch == mine.batch_ends.len();
            self.report(iter, ready, c);
            if epoch_done {
                finished_epoch = Some(epoch);
            }
        }
        self.pending_progress += 1;
        self.flush_progress(false)?;
        self.free[id] = done;
        let (i, next) = argmin(&self.free[slots.clone()]);
        self.next_thread[w] = slots.start + i;
        Ok((Step::At(next), finished_epoch))
    }

    /// Worker reports iteration `iter` ready at `ready` with compute time `c`; end iterations
    /// whose every worker has reported, and wake threads waiting for them.
    fn report(&mut self, iter: usize, ready: f64, c: f64) {
        let a = &mut self.iters[iter];
        a.reported += 1;
        a.max_c = a.max_c.max(c);
        a.max_rc = a.max_rc.max(ready + c);
        while self.finalized < self.iters.len() && self.iters[self.finalized].reported as usize == self.workers {
            let j = self.finalized;
            let prev = if j == 0 { self.t0 } else { self.ends[j - 1] };
            let a = self.iters[j];
            let end = (prev + a.max_c).max(a.max_rc);
            self.ends[j] = end;
            if let Some(ids) = self.parked.remove(&j) {
                self.woken.extend(ids.into_iter().map(|id| Ev { t: end, id }));
            }
            self.finalized += 1;
        }
    }

    /// A PFS read of `s` bytes starting at `t`; returns when it ends.
    fn pfs_read(&mut self, t: f64, s: u64) -> f64 {
        let (end, pipe) = self.pfs_timing(t, s);
        self.pfs_pipe = pipe;
        self.pfs_active.push(end.to_bits());
        self.pfs_bytes += s;
        end
    }

    /// Seconds a PFS read of `s` bytes starting at `t` would take.
    fn pfs_estimate(&mut self, t: f64, s: u64) -> f64 {
        self.pfs_timing(t, s).0 - t
    }

    /// When a PFS read of `s` bytes starting at `t` ends, and the file system's new aggregate
    /// horizon. The read waits out the open latency (using no bandwidth), then transfers at
    /// t(γ)/γ, γ being the transfers in progress when it starts, this one included. Its bytes
    /// are also queued behind all bytes already admitted at the aggregate rate t(γ) (the
    /// horizon), so that readers that start later and overlap it cannot push the aggregate past
    /// t(γ): the read ends at the later of the two. Reads start in time order (events are
    /// processed in time order), so transfers that ended before `t` can be dropped for good.
    fn pfs_timing(&mut self, t: f64, s: u64) -> (f64, f64) {
        let at = t + self.pfs_latency;
        // Ends are non-negative, so their bit patterns order like the numbers.
        let at_bits = at.to_bits();
        while self.pfs_active.peek().is_some_and(|e| e <= at_bits) {
            self.pfs_active.pop();
        }
        let busy = self.pfs_active.len();
        let g = (busy + 1).min(self.pfs_spb.len() - 1);
        let sf = s as f64;
        // Per reader: its share t(γ)/γ, or under a FIFO file system what one reader alone gets.
        let own = at + sf * self.pfs_spb[if self.pfs_fifo { 1 } else { g }];
        let pipe = self.pfs_pipe.max(at) + sf * self.pfs_spb[g] / g as f64;
        (own.max(pipe), pipe)
    }

    /// Bring sample `k` (`s` bytes) for a worker of `node` starting at `t`: where it was read
    /// from and when the read ended.
    fn fetch(&mut self, node: usize, k: u32, s: u64, t: f64, epoch: u32) -> (usize, f64) {
        let (loc, end, keep) = match self.decide(node, k, s, t, epoch) {
            Decision::Done(loc, end) => return (loc, end),
            Decision::Pfs(keep) => (LOC_PFS, self.pfs_read(t, s), keep),
            Decision::Elsewhere(keep) => {
                let (loc, end) = self.fetch_elsewhere(node, k, s, t);
                (loc, end, keep)
            }
        };
        if let Some(j) = keep {
            self.publish(node, k, j, end + s as f64 * self.class_write_spb[j]);
        }
        (loc, end)
    }

    /// Where a worker of `node` reads `k` from at `t`, decided with the cache borrowed; a
    /// policy whose workers keep what they read admits `k` to a class here.
    fn decide(&mut self, node: usize, k: u32, s: u64, t: f64, epoch: u32) -> Decision {
        let ku = k as usize;
        let sf = s as f64;
        let lists = matches!(self.order, Order::Opportunistic);
        match &mut self.cache {
            Cache::None => Decision::Pfs(None),
            Cache::Everywhere(j) => Decision::Done(LOC_CLASS + *j, t + sf * self.class_read_spb[*j]),
            Cache::Single {
                held,
                cached,
                used,
                admit_to,
                admit,
                remote,
            } => {
                let h = held[ku];
                let remote_spb = if h.owner() != NONE && *remote && h.avail <= t {
                    self.remote_spb[h.class() as usize]
                } else {
                    None
                };
                if h.owner() == node as u32 {
                    let j = h.class() as usize;
                    Decision::Done(LOC_CLASS + j, t.max(h.avail) + sf * self.class_read_spb[j])
                } else if let Some(spb) = remote_spb {
                    Decision::Done(LOC_REMOTE, t + self.peer_latency + sf * spb)
                } else {
                    let admit_now = h.owner() == NONE
                        && match admit {
                            Admit::Never => false,
                            Admit::FirstEpoch => epoch == 0,
                            Admit::Always => true,
                        };
                    let caps = &self.run.scenario.system.classes;
                    let slot = admit_to
                        .iter()
                        .copied()
                        .find(|&j| admit_now && used[node][j] + s <= caps[j].capacity);
                    if let Some(j) = slot {
                        used[node][j] += s;
                        held[ku].set(node as u32, j as u8);
                        if lists {
                            cached[node].push(Taken {
                                avail: f64::INFINITY,
                                k,
                                size: u32::try_from(s).unwrap_or(u32::MAX),
                                class: j as u8,
                            });
                        }
                    }
                    Decision::Pfs(slot)
                }
            }
            Cache::Placed { local, .. } => {
                let Slot { avail: a, class: j } = local[node][ku];
                if j == UNCACHED {
                    Decision::Elsewhere(None)
                } else if a.is_finite() {
                    // In the class, or being written there: read it (after the write).
                    let j = j as usize;
                    Decision::Done(LOC_CLASS + j, t.max(a) + sf * self.class_read_spb[j])
                } else {
                    // Not here yet: this read also writes it to its local class (the node
                    // reads each sample once).
                    Decision::Elsewhere(Some(j as usize))
                }
            }
        }
    }

    /// Read `k` for `node` from a peer that has it by `t` when that is faster, else from the PFS.
    fn fetch_elsewhere(&mut self, node: usize, k: u32, s: u64, t: f64) -> (usize, f64) {
        let ku = k as usize;
        if let Cache::Placed { first, .. } = &self.cache {
            let c = first[ku];
            if c.node != NONE && c.node != node as u32 {
                if let Some(spb) = self.remote_spb[c.class as usize] {
                    let transfer = self.peer_latency + s as f64 * spb;
                    if c.avail.is_finite() {
                        // A copy is there, or being written: read it (after the write) when
                        // that is faster than the PFS.
                        let remote = t.max(c.avail) + transfer - t;
                        // Faster than the PFS with no other reader: no need to count readers.
                        let pfs_best = self.pfs_latency + s as f64 * self.pfs_spb[1];
                        if remote < pfs_best || remote < self.pfs_estimate(t, s) {
                            return (LOC_REMOTE, t + remote);
                        }
                    } else {
                        // Nobody holds it yet: this node reads it from the PFS and hands it on
                        // to its home, which will not read it from the PFS again.
                        let end = self.pfs_read(t, s);
                        let j = c.class as usize;
                        self.publish(
                            c.node as usize,
                            k,
                            j,
                            end + transfer + s as f64 * self.class_write_spb[j],
                        );
                        return (LOC_PFS, end);
                    }
                }
            }
        }
        (LOC_PFS, self.pfs_read(t, s))
    }

    /// Fill `st`'s window with the positions from worker `w`'s current one on: samples and
    /// sizes in access order, and their cache entries for the worker's node now (gathered in
    /// one pass, which overlaps the memory accesses).
    fn gather(&self, w: usize, st: &mut Stream) {
        let pos = self.fetchers[w].pos;
        let end = (pos + WINDOW).min(st.batch_ends.last().map_or(0, |&e| e as usize));
        st.lo = pos;
        st.samples.clear();
        st.sizes.clear();
        match &st.src {
            Source::Global(data) => {
                // From the current batch on, batch by batch.
                let mut b = self.fetchers[w].batch;
                let mut at = pos;
                while at < end {
                    let first = if b == 0 { 0 } else { st.batch_ends[b - 1] as usize };
                    let range = &self.batches[w][b];
                    let lo = range.start as usize + (at - first);
                    let hi = lo + (st.batch_ends[b] as usize).min(end) - at;
                    st.samples.extend_from_slice(&data.order[lo..hi]);
                    data.sizes.extend_into(&mut st.sizes, lo, hi);
                    at += hi - lo;
                    b += 1;
                }
            }
            Source::Own(list) => {
                st.samples.extend_from_slice(&list[pos..end]);
                let sizes = self.run.sizes;
                st.sizes.extend(st.samples.iter().map(|&k| sizes[k as usize]));
            }
        }
        let node = w / self.wpn;
        st.known.clear();
        match &self.cache {
            Cache::Single { held, .. } => st.known.extend(st.samples.iter().map(|&k| held[k as usize])),
            Cache::Placed { local, .. } => st.known.extend(st.samples.iter().map(|&k| {
                let slot = local[node][k as usize];
                Held::new(slot.avail, node as u32, slot.class)
            })),
            _ => {}
        }
    }

    /// A fetch decided from a final cache entry alone (see `Stream::known`): a local copy, or
    /// a peer's copy under a single-copy cache with peers. None: look at the live cache.
    #[inline]
    fn fetch_known(&self, node: usize, h: Held, s: u64, t: f64) -> Option<(usize, f64)> {
        if !h.avail.is_finite() {
            return None;
        }
        let sf = s as f64;
        let j = h.class() as usize;
        if h.owner() == node as u32 {
            return Some((LOC_CLASS + j, t.max(h.avail) + sf * self.class_read_spb[j]));
        }
        match &self.cache {
            Cache::Single { remote: true, .. } if h.avail <= t => {
                self.remote_spb[j].map(|spb| (LOC_REMOTE, t + self.peer_latency + sf * spb))
            }
            _ => None,
        }
    }

    /// How far the workers of `node` have all fetched: `epoch << 32 | position`.
    fn node_front(&self, node: usize) -> u64 {
        self.fetchers[node * self.wpn..(node + 1) * self.wpn]
            .iter()
            .map(|f| ((f.epoch as u64) << 32) | f.pos as u64)
            .min()
            .unwrap_or(0)
    }

    /// DeepIO's opportunistic mode: once `node`'s memory is full, a sample no memory can serve
    /// (cached nowhere, or on another node without an interconnect) is replaced by one that can
    /// (any node's, or only this node's without an interconnect), chosen by a hash of epoch,
    /// node and position: the PFS is not read again.
    /// `known` is the sample's entry when the stream was made (see `Stream::known`). Returns the
    /// substitute, its size and its entry as its node's list holds it.
    fn substitute(
        &self,
        node: usize,
        k: u32,
        s: u64,
        epoch: u32,
        pos: usize,
        known: Option<Held>,
    ) -> Option<(u32, u64, Held)> {
        let Cache::Single {
            held,
            cached,
            used,
            admit_to,
            ..
        } = &self.cache
        else {
            return None;
        };
        let caps = &self.run.scenario.system.classes;
        if admit_to.iter().any(|&j| used[node][j] + s <= caps[j].capacity) {
            return None; // room left: the sample is read and kept
        }
        // A final known entry spares the lookup in the cache (an owner, once set, stays).
        let owner = match known {
            Some(h) if h.avail.is_finite() => h.owner(),
            _ => held[k as usize].owner(),
        };
        let peers = self.run.scenario.system.interconnect_mbps.is_some();
        if owner == node as u32 || (owner != NONE && peers) {
            return None;
        }
        let (owner, list, i) = substitute_pick(cached, peers, node, epoch, pos)?;
        let e = list[i];
        Some((e.k, e.size(self.run.sizes), Held::new(e.avail, owner as u32, e.class)))
    }

    /// Start loading what staging the sample `ahead` positions after worker `w`'s current one
    /// will look up: its cache entry when the window's is not final, and under the
    /// opportunistic order the record of the sample that would replace it (a hint: the choice
    /// is made again when the sample is staged).
    #[inline(always)]
    fn prefetch_ahead(&self, w: usize, mine: &Stream, at: usize) {
        let i = at + PREFETCH_AHEAD;
        let Some(&k) = mine.samples.get(i) else {
            return;
        };
        if mine.known.get(i).is_some_and(|h| h.avail.is_finite()) {
            return;
        }
        let node = w / self.wpn;
        self.prefetch_cache(node, k);
        let epoch = self.fetchers[w].epoch;
        if epoch == 0 || !matches!(self.order, Order::Opportunistic) {
            return;
        }
        let Cache::Single { cached, .. } = &self.cache else {
            return;
        };
        let peers = self.run.scenario.system.interconnect_mbps.is_some();
        if let Some((_, list, j)) = substitute_pick(cached, peers, node, epoch, mine.lo + i) {
            prefetch(list, j);
        }
    }

    /// Start loading the cache entries a fetch of `k` by `node` will read.
    #[inline(always)]
    fn prefetch_cache(&self, node: usize, k: u32) {
        let k = k as usize;
        match &self.cache {
            Cache::Single { held, .. } => prefetch(held, k),
            Cache::Placed { local, first } => {
                prefetch(&local[node], k);
                prefetch(first, k);
            }
            _ => {}
        }
    }

    /// Sample `k` is in class `j` of `node` from time `at`.
    fn publish(&mut self, node: usize, k: u32, j: usize, at: f64) {
        let ku = k as usize;
        let lists = matches!(self.order, Order::Opportunistic);
        match &mut self.cache {
            Cache::Placed { local, first } => {
                local[node][ku].avail = at;
                if at < first[ku].avail {
                    first[ku] = Copy {
                        avail: at,
                        node: node as u32,
                        class: j as u8,
                    };
                }
            }
            Cache::Single { held, cached, .. } => {
                held[ku].avail = at;
                // A sample is written right after it is taken: its record is its node's last.
                if let Some(e) = cached[node].last_mut().filter(|e| lists && e.k == k) {
                    e.avail = at;
                }
            }
            _ => {}
        }
    }

    /// A thread of fill list `li` is free at `t`: copy the list's next sample into its class.
    /// Returns when a thread of the list is free next; None when the list is done.
    fn fill_step(&mut self, li: usize, t: f64) -> Option<f64> {
        let slots = self.fill_slots[li].clone();
        let id = slots.clone().min_by(|&a, &b| self.free[a].total_cmp(&self.free[b]))? as u32;
        let (node, class) = (self.fills[li].node as usize, self.fills[li].class);
        if let Some(&ahead) = self.fills[li].order.get(self.fills[li].cursor + PREFETCH_AHEAD) {
            self.prefetch_cache(node, ahead);
            prefetch(self.run.sizes, ahead as usize);
        }
        if !self.fills[li].need.is_empty() {
            let front = self.node_front(node);
            let fl = &mut self.fills[li];
            while fl.need.get(fl.cursor).is_some_and(|&n| n < front) {
                fl.cursor += 1;
            }
        }
        let k = loop {
            let fl = &mut self.fills[li];
            let Some(&k) = fl.order.get(fl.cursor) else {
                // List done: the thread retires, and the list's memory goes.
                fl.order = Vec::new();
                fl.need = Vec::new();
                return None;
            };
            fl.cursor += 1;
            let taken = match &self.cache {
                Cache::Placed { local, .. } => local[node][k as usize].avail.is_finite(),
                Cache::Single { held, .. } => held[k as usize].avail.is_finite(),
                _ => true,
            };
            if !taken {
                break k;
            }
        };
        let s = self.run.sizes[k as usize];
        let (_, end) = self.fetch_elsewhere(node, k, s, t);
        let done = end + s as f64 * self.class_write_spb[class];
        self.publish(node, k, class, done);
        self.free[id as usize] = done;
        Some(min_time(&self.free[slots]))
    }
}

/// How many samples ahead of a thread the cache entries of its next samples are prefetched.
const PREFETCH_AHEAD: usize = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_panics_mid_task_wakes_the_others() {
        // A task in progress never ends when its thread panics: the threads waiting for it are
        // woken and stop instead of waiting forever.
        let board = std::sync::Mutex::new(Board::new(Vec::new(), 1, false));
        board.lock().unwrap().running = 1;
        let changed = std::sync::Condvar::new();
        let stopped = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| {
                let mut b = board.lock().unwrap_or_else(|e| e.into_inner());
                while !b.panicked && !b.finished() {
                    b = changed.wait(b).unwrap_or_else(|e| e.into_inner());
                }
                b.panicked
            });
            let worker = scope.spawn(|| {
                let _unwind = Unwind {
                    board: &board,
                    changed: &changed,
                };
                std::thread::sleep(std::time::Duration::from_millis(20));
                panic!("a bug in a task");
            });
            assert!(worker.join().is_err());
            waiter.join().unwrap()
        });
        assert!(stopped);
    }
}
