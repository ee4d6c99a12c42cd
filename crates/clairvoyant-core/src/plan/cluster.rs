//! Placement across the nodes of a cluster (NoPFS Sec. 4; Lemma 1 makes the nodes' most
//! frequently used samples largely complementary), in memory that grows with the samples and
//! the nodes, never with their product: a process of a 1,024-node job keeps one small record
//! per sample for the whole cluster ([`SampleSummary`]) and full detail only for its own node.
//!
//! The placement is computed the same way on every node from the same inputs, with no
//! communication: every node streams over the run's epochs once ([`ClusterAccess::compute`]),
//! then places the samples ([`ClusterPlacement::compute`]):
//!
//! 1. **Coverage.** Every sample some rank reads goes to one node, its *primary*: the node that
//!    reads it most (by the per-sample summary below), or, when that node is full, the next of
//!    its top readers with room, or else the node with the most room left. Samples go in order of
//!    their highest count (descending), then first need, then index, each into the fastest class
//!    with room. So the cluster caches the whole dataset whenever the sum of the nodes'
//!    capacities allows, and with less the storage is read the minimum S + (E-1)(S-C).
//! 2. **Replication.** The room a node has left takes its own most frequently read samples it
//!    does not hold yet (by its own exact counts, which only that node computes).
//!
//! The primary is the one node that reads a sample from the dataset's storage; every other node
//! gets it from the primary, so with enough aggregate capacity the dataset is read once per run.
//!
//! "The node that reads it most" would need a count per node and sample. Instead each sample
//! keeps a Space-Saving summary (Metwally et al., 2005) of its readers: [`TOP`] slots of (node,
//! count), updated in epoch order. It is exact whenever at most [`TOP`] nodes read a sample (so
//! for clusters of up to four nodes it is the exact per-node count), always names nodes that
//! read the sample, and keeps every node that reads it more than E/[`TOP`] times. Ties between
//! nodes are broken by a hash of (sample, node), which spreads ties evenly over the nodes.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use rayon::prelude::*;

use super::{AccessCounts, Placement, UNCACHED};
use crate::error::{Error, Result};
use crate::mem::{huge_vec, prefetch};
use crate::schedule::{splitmix64, Schedule};

/// Sentinel for "no node holds it" in [`ClusterPlacement::primary`].
pub const NO_NODE: u16 = u16::MAX;

/// Reader slots kept per sample.
pub const TOP: usize = 4;

/// What the cluster placement knows of one sample, over every node of the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct SampleSummary {
    /// Earliest need by any node (`epoch << 32 | position in that rank's epoch stream`;
    /// `u64::MAX`: never read).
    pub first_need: u64,
    /// Reads by all nodes over the run (saturating).
    pub total: u32,
    /// Its most frequent readers (Space-Saving summary): node and count; count 0 is an empty
    /// slot. Counts are exact while at most [`TOP`] nodes read the sample, else upper bounds.
    pub node: [u16; TOP],
    /// Reads by `node[i]` in slot `i` (saturating; 0: empty slot).
    pub count: [u16; TOP],
}

impl SampleSummary {
    /// The summary of a sample nobody reads.
    pub const EMPTY: SampleSummary = SampleSummary {
        first_need: u64::MAX,
        total: 0,
        node: [NO_NODE; TOP],
        count: [0; TOP],
    };

    /// Record `weight` reads by `node`, the first of them at `need`.
    #[inline]
    pub fn add(&mut self, node: u16, weight: u16, need: u64) {
        self.total = self.total.saturating_add(weight as u32);
        self.first_need = self.first_need.min(need);
        if let Some(i) = (0..TOP).find(|&i| self.count[i] > 0 && self.node[i] == node) {
            self.count[i] = self.count[i].saturating_add(weight);
            return;
        }
        // An empty slot, else the slot with the least count (the first of equals) is taken
        // over and keeps its count as the newcomer's error bound.
        let mut slot = 0;
        for i in 1..TOP {
            if self.count[i] < self.count[slot] {
                slot = i;
            }
        }
        self.node[slot] = node;
        self.count[slot] = self.count[slot].saturating_add(weight);
    }

    /// The slots in order of preference: highest count first, ties by a hash of (sample, node).
    pub fn ranked(&self, sample: u32) -> impl Iterator<Item = (u16, u16)> + '_ {
        let mut tried = 0u8;
        std::iter::from_fn(move || {
            let i = self.next_slot(sample, tried)?;
            tried |= 1 << i;
            Some((self.node[i], self.count[i]))
        })
    }

    /// The first node in [`SampleSummary::ranked`] order that `ok` accepts.
    #[inline]
    pub fn first_ranked(&self, sample: u32, ok: impl Fn(u16) -> bool) -> Option<u16> {
        let mut tried = 0u8;
        while let Some(i) = self.next_slot(sample, tried) {
            if ok(self.node[i]) {
                return Some(self.node[i]);
            }
            tried |= 1 << i;
        }
        None
    }

    /// The most preferred slot not in `tried` (a bit per slot); hashes only to break ties.
    #[inline]
    fn next_slot(&self, sample: u32, tried: u8) -> Option<usize> {
        let mut best: Option<usize> = None;
        for i in 0..TOP {
            if self.count[i] == 0 || tried & (1 << i) != 0 {
                continue;
            }
            best = match best {
                Some(b)
                    if self.count[i] < self.count[b]
                        || (self.count[i] == self.count[b]
                            && tie(sample, self.node[i]) > tie(sample, self.node[b])) =>
                {
                    Some(b)
                }
                _ => Some(i),
            };
        }
        best
    }

    /// The highest count of any node.
    pub fn top_count(&self) -> u16 {
        self.count.iter().copied().max().unwrap_or(0)
    }
}

fn tie(sample: u32, node: u16) -> u64 {
    splitmix64(((sample as u64) << 32) | node as u64)
}

/// Per sample, its [`SampleSummary`] over every node of the cluster.
#[derive(Clone, Debug)]
pub struct ClusterAccess {
    /// One summary per sample, indexed by sample.
    pub samples: Vec<SampleSummary>,
}

/// A run of consecutive positions of an epoch's global order that one rank reads.
#[derive(Clone, Copy)]
struct Segment {
    start: u32,
    end: u32,
    node: u16,
    /// Position of `start` in the rank's epoch stream.
    pos: u32,
}

fn segments(schedule: &Schedule, epoch: u32, node_of_rank: &[u16]) -> Result<Vec<Segment>> {
    let layout = schedule.layout(epoch)?;
    let mut out = Vec::new();
    for (r, &node) in node_of_rank.iter().enumerate() {
        let mut pos = 0u32;
        for b in layout.rank_batches(r as u32) {
            out.push(Segment {
                start: b.start as u32,
                end: b.end as u32,
                node,
                pos,
            });
            pos += (b.end - b.start) as u32;
        }
    }
    out.sort_unstable_by_key(|s| s.start);
    Ok(out)
}

impl ClusterAccess {
    /// Stream over epochs `first..` of `schedule` (rank `r` lives on node `node_of_rank[r]`),
    /// one epoch at a time: the next epochs are shuffled while this one is counted, and
    /// `visit(epoch, global order)` sees every epoch in order (for the node's own streams and
    /// counts). Memory: one summary per sample and a few epochs' orders.
    pub fn compute(
        schedule: &Schedule,
        node_of_rank: &[u16],
        first: u32,
        mut visit: impl FnMut(u32, &[u32]) -> Result<()> + Send,
    ) -> Result<ClusterAccess> {
        if node_of_rank.len() != schedule.world_size as usize {
            return Err(Error::config(
                "nodes",
                format!(
                    "{} ranks placed on nodes, but the world size is {}",
                    node_of_rank.len(),
                    schedule.world_size
                ),
            ));
        }
        if node_of_rank.contains(&NO_NODE) {
            return Err(Error::config("nodes", format!("at most {} nodes", NO_NODE)));
        }
        let f = schedule.num_samples() as usize;
        for e in 0..schedule.epochs {
            schedule.layout(e)?;
        }
        let mut out = huge_vec(f, SampleSummary::EMPTY);
        let distinct = matches!(schedule.order, crate::schedule::Order::Shuffle { .. });
        let ahead = rayon::current_num_threads().saturating_sub(1).max(1) as u32;
        let shuffle = |from: u32| -> Vec<(u32, Vec<u32>)> {
            (from..(from + ahead).min(schedule.epochs))
                .into_par_iter()
                .map(|e| (e, schedule.global_order(e)))
                .collect()
        };
        let mut segs: Option<(u64, Vec<Segment>)> = None;
        let mut next = first.min(schedule.epochs);
        let mut batch = shuffle(next);
        next += batch.len() as u32;
        while !batch.is_empty() {
            // Shuffle the next epochs while counting these.
            let (upcoming, counted) = rayon::join(
                || shuffle(next),
                || -> Result<()> {
                    for (e, global) in &batch {
                        let len = global.len() as u64;
                        if segs.as_ref().is_none_or(|s| s.0 != len) {
                            segs = Some((len, segments(schedule, *e, node_of_rank)?));
                        }
                        let segs = &segs.as_ref().expect("just set").1;
                        count_epoch(&mut out, *e, global, segs, distinct);
                        visit(*e, global)?;
                    }
                    Ok(())
                },
            );
            counted?;
            next += upcoming.len() as u32;
            batch = upcoming;
        }
        Ok(ClusterAccess { samples: out })
    }

    /// From every node's exact counts (node by node, in index order), for placements given
    /// counts rather than a schedule.
    pub fn from_nodes(access: &[AccessCounts]) -> Result<ClusterAccess> {
        if access.len() >= NO_NODE as usize {
            return Err(Error::config("nodes", format!("at most {} nodes", NO_NODE)));
        }
        let f = access.first().map_or(0, |a| a.counts.len());
        if let Some(i) = access
            .iter()
            .position(|a| a.counts.len() != f || a.first_need.len() != f)
        {
            return Err(Error::config(
                "counts",
                format!("node {i}'s counts do not cover the {f} samples of node 0's"),
            ));
        }
        let mut out = huge_vec(f, SampleSummary::EMPTY);
        out.par_iter_mut().enumerate().for_each(|(k, s)| {
            for (n, a) in access.iter().enumerate() {
                let c = a.counts[k];
                if c > 0 {
                    s.add(n as u16, c.min(u16::MAX as u32) as u16, a.first_need[k]);
                }
            }
        });
        Ok(ClusterAccess { samples: out })
    }

    /// Bytes the dataset's storage is expected to deliver over the run with `primary`: a cached
    /// sample once (by its primary), an uncached one at every access.
    pub fn expected_storage_bytes(&self, primary: &[u16], size: impl Fn(u32) -> u64 + Sync) -> u64 {
        self.samples
            .par_iter()
            .zip(primary)
            .enumerate()
            .map(|(k, (s, &p))| {
                if p != NO_NODE {
                    size(k as u32)
                } else {
                    s.total as u64 * size(k as u32)
                }
            })
            .sum()
    }
}

/// Count one epoch into the summaries. An update depends on the updates of the same sample
/// before it, so a sample's updates must be applied in order. Where every sample occurs at most
/// once in the epoch (`distinct`: a permutation), the positions are split among the threads:
/// disjoint positions name disjoint samples, and the result is the sequential one. Otherwise
/// one thread counts the positions in order.
fn count_epoch(out: &mut [SampleSummary], epoch: u32, global: &[u32], segs: &[Segment], distinct: bool) {
    let parts = if distinct {
        rayon::current_num_threads().max(1)
    } else {
        1
    };
    if parts == 1 {
        count_segments(out.as_mut_ptr(), out.len(), epoch, global, segs);
        return;
    }
    struct Table(*mut SampleSummary, usize);
    // SAFETY: shared among the threads below, which write disjoint elements (see there).
    unsafe impl Sync for Table {}
    let table = Table(out.as_mut_ptr(), out.len());
    let table = &table;
    segs.par_chunks(segs.len().div_ceil(parts).max(1)).for_each(|chunk| {
        // Each chunk holds disjoint positions of a permutation, so no two threads write the
        // same summary; the epoch ends (the join) before the next epoch's updates start.
        count_segments(table.0, table.1, epoch, global, chunk);
    });
}

/// Count the positions of `segs` into the `len` summaries at `out`. The caller guarantees that
/// no other thread writes the summaries of the samples at these positions meanwhile.
fn count_segments(out: *mut SampleSummary, len: usize, epoch: u32, global: &[u32], segs: &[Segment]) {
    const AHEAD: usize = 32;
    let base = (epoch as u64) << 32;
    for s in segs {
        for p in s.start..s.end {
            let p = p as usize;
            if let Some(&ahead) = global.get(p + AHEAD) {
                if (ahead as usize) < len {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: a prefetch hint for an address inside the table; it changes nothing.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch(
                            out.add(ahead as usize) as *const i8,
                            std::arch::x86_64::_MM_HINT_T0,
                        );
                    }
                }
            }
            let k = global[p] as usize;
            assert!(k < len, "sample {k} outside the {len} summaries");
            // SAFETY: in bounds (checked), and no other thread writes this summary now (the
            // caller's guarantee).
            let slot = unsafe { &mut *out.add(k) };
            slot.add(s.node, 1, base | (s.pos + (p as u32 - s.start)) as u64);
        }
    }
}

/// Owners for a job whose order is not known (transparent mode): every node reads every sample
/// once per pass in some random order. Each sample's owner among `nodes` nodes is chosen by
/// rendezvous (highest-random-weight) hashing of its key (a hash of its path): no metadata
/// server, every node computes the same owners, and adding or removing a node moves only the
/// samples it owns.
pub fn hashed_owners(keys: &[u64], nodes: usize) -> Vec<u16> {
    let nodes = nodes.clamp(1, NO_NODE as usize - 1);
    keys.par_iter()
        .map(|&k| {
            (0..nodes)
                .max_by_key(|&n| (splitmix64(k ^ splitmix64(n as u64 + 1)), n))
                .unwrap_or(0) as u16
        })
        .collect()
}

/// The summaries of hashed ownership: the owner counts each sample twice, every node once, so
/// coverage puts each sample on its owner while the owner has room, then on the node with most
/// room. Ties in need are broken by the key, so which samples a full cache keeps is a fixed,
/// pseudo-random subset: for uniformly random orders every subset of the same size has the same
/// expected hit rate, and a fixed one does not thrash as LRU does.
pub fn hashed_access(keys: &[u64], owners: &[u16], nodes: usize) -> ClusterAccess {
    let samples = keys
        .par_iter()
        .zip(owners)
        .map(|(&k, &o)| {
            let mut s = SampleSummary::EMPTY;
            s.add(o, 2, splitmix64(k) >> 1);
            s.total = nodes as u32 + 1;
            s
        })
        .collect();
    ClusterAccess { samples }
}

/// Node `node`'s own counts under hashed ownership (see [`hashed_access`]).
pub fn hashed_counts(keys: &[u64], owners: &[u16], node: usize) -> AccessCounts {
    AccessCounts {
        counts: owners.iter().map(|&o| if o as usize == node { 2 } else { 1 }).collect(),
        first_need: keys.iter().map(|&k| splitmix64(k) >> 1).collect(),
    }
}

/// The first need of a sample an order leaves out (see [`order_with_hashed_rest`]): after every
/// sample the order places (those needs are `epoch << 32 | position`, far below), and still a
/// pseudo-random tie-break among themselves.
pub const NEED_NOT_KNOWN: u64 = 1 << 63;

/// Placement counts for an order that covers only part of the dataset (transparent mode: the
/// program's sampler order covers `train/`, the program also reads `val/`).
#[derive(Clone, Debug)]
pub struct PartialOrder {
    /// Every node's counts: the order's, and for the samples it leaves out those of hashed
    /// ownership ([`hashed_counts`]), ranked below every ordered sample.
    pub nodes: Vec<AccessCounts>,
    /// The cluster's summaries (several nodes): the order's, and hashed ownership's
    /// ([`hashed_access`]) for the samples it leaves out.
    pub cluster: Option<ClusterAccess>,
    /// The samples no node's order reads: their time of need is not known, so they are filled
    /// when first read, never ahead.
    pub outside: Vec<bool>,
}

/// Counts that place the samples `orders` (one per node) read as the orders say, and every
/// sample no node's order reads (count 0 on every node) as with an unknown order: its owner by
/// rendezvous hashing of its key ([`hashed_owners`]), the owner counting it twice and every
/// other node once. Known reads go first: every ordered count is raised by 2 when some sample
/// is left out, so a cache too small for both keeps the ordered samples (their order among
/// themselves unchanged) and the rest fill the room left by hashed owners. With no sample
/// left out the orders come back unchanged.
pub fn order_with_hashed_rest(mut orders: Vec<AccessCounts>, keys: &[u64]) -> Result<PartialOrder> {
    let m = orders.len();
    let f = keys.len();
    if m == 0 || m >= NO_NODE as usize {
        return Err(Error::config("nodes", format!("{m} nodes; 1 to {}", NO_NODE - 1)));
    }
    if let Some(i) = orders
        .iter()
        .position(|a| a.counts.len() != f || a.first_need.len() != f)
    {
        return Err(Error::config(
            "counts",
            format!("node {i}'s counts do not cover the {f} samples of the dataset"),
        ));
    }
    let outside: Vec<bool> = (0..f)
        .into_par_iter()
        .map(|k| orders.iter().all(|a| a.counts[k] == 0))
        .collect();
    if !outside.contains(&true) {
        let cluster = (m > 1).then(|| ClusterAccess::from_nodes(&orders)).transpose()?;
        return Ok(PartialOrder {
            nodes: orders,
            cluster,
            outside,
        });
    }
    let owners = hashed_owners(keys, m);
    let need = |k: usize| NEED_NOT_KNOWN | (splitmix64(keys[k]) >> 1);
    for (n, a) in orders.iter_mut().enumerate() {
        a.counts
            .par_iter_mut()
            .zip(a.first_need.par_iter_mut())
            .enumerate()
            .for_each(|(k, (c, t))| {
                if outside[k] {
                    *c = if owners[k] as usize == n { 2 } else { 1 };
                    *t = need(k);
                } else if *c > 0 {
                    *c = c.saturating_add(2);
                }
            });
    }
    let cluster = if m > 1 {
        let mut access = ClusterAccess::from_nodes(&orders)?;
        access.samples.par_iter_mut().enumerate().for_each(|(k, s)| {
            if outside[k] {
                *s = SampleSummary::EMPTY;
                s.add(owners[k], 2, need(k));
                s.total = m as u32 + 1;
            }
        });
        Some(access)
    } else {
        None
    };
    Ok(PartialOrder {
        nodes: orders,
        cluster,
        outside,
    })
}

/// Approximate peak bytes of computing one node's plan for `samples` samples with `threads`
/// shuffling threads: the node's own counts, sort keys and placement and the epochs' orders in
/// flight, and for a cluster (`cluster`) the summaries and the primary table.
pub fn plan_memory(samples: u64, threads: usize, cluster: bool) -> u64 {
    let mut per_sample = 12 // own counts and first needs
        + 16 // sort keys (at most one per sample)
        + 1 + 8 + 4 // class, offset, fill order
        + 4 * (threads as u64 + 2); // epoch orders in flight
    if cluster {
        per_sample += std::mem::size_of::<SampleSummary>() as u64 + 16 + 2; // summaries, coverage keys, primary
    }
    samples * per_sample
}

/// Fail before allocating when a plan of `samples` samples would not fit the memory available.
pub fn check_plan_memory(samples: u64, cluster: bool, what: &str) -> Result<()> {
    let need = plan_memory(samples, rayon::current_num_threads(), cluster);
    let available = crate::sysinfo::Machine::detect().mem_available;
    match available {
        Some(a) if need > a => Err(Error::PlanTooLarge {
            what: what.to_string(),
            need,
            available: a,
            hint: "run fewer processes per machine, free memory, or plan on a machine with more".into(),
        }),
        _ => Ok(()),
    }
}

/// Where every sample is cached across the cluster, and the detail of the nodes asked for.
#[derive(Clone, Debug)]
pub struct ClusterPlacement {
    /// Per sample, the node that reads it from the dataset and serves it ([`NO_NODE`]: no node
    /// covers it; a node may still keep a replica it reads itself).
    pub primary: Vec<u16>,
    /// Per node, bytes per class of the samples it is primary for.
    pub coverage_used: Vec<Vec<u64>>,
    /// Per node, samples it is primary for.
    pub primary_samples: Vec<u64>,
    /// The placements of the nodes asked for (coverage and replicas), in the order asked: classes'
    /// contents, offsets and fill orders (a node fills what it serves by the earliest need of any
    /// node, its replicas by its own first need).
    pub nodes: Vec<Placement>,
}

impl ClusterPlacement {
    /// `capacities[i]`: node i's classes (fastest first). `detail`: the nodes whose placement
    /// to lay out, each with its own exact access counts. Deterministic: every node computes
    /// the same primaries and the same placement for itself as any other node computes for it.
    pub fn compute(
        access: &ClusterAccess,
        size: impl Fn(u32) -> u64 + Sync,
        capacities: &[Vec<u64>],
        detail: &[(usize, &AccessCounts)],
    ) -> ClusterPlacement {
        Self::compute_with(access, size, capacities, detail, true)
    }

    /// [`ClusterPlacement::compute`] without the samples' offsets (each detail node's
    /// `Placement::offset` left empty): the same classes and fill orders, for a model of the
    /// placement that never writes the classes (8 bytes per sample and detail node less).
    pub fn compute_classes(
        access: &ClusterAccess,
        size: impl Fn(u32) -> u64 + Sync,
        capacities: &[Vec<u64>],
        detail: &[(usize, &AccessCounts)],
    ) -> ClusterPlacement {
        Self::compute_with(access, size, capacities, detail, false)
    }

    fn compute_with(
        access: &ClusterAccess,
        size: impl Fn(u32) -> u64 + Sync,
        capacities: &[Vec<u64>],
        detail: &[(usize, &AccessCounts)],
        offsets: bool,
    ) -> ClusterPlacement {
        let m = capacities.len();
        assert!(m < NO_NODE as usize);
        let keyed = coverage_order(access);
        let mut cover = Coverage::new(capacities, access.samples.len(), detail, offsets);
        const AHEAD: usize = 8;
        for (at, &(_, _, k)) in keyed.iter().enumerate() {
            if let Some(&(_, _, ahead)) = keyed.get(at + AHEAD) {
                prefetch(&access.samples, ahead as usize);
                prefetch(&cover.primary, ahead as usize);
            }
            let s = size(k);
            let summary = &access.samples[k as usize];
            // Its top readers, most first, then the node with the most room left.
            let mut chosen = summary
                .first_ranked(k, |n| (n as usize) < m && cover.fits(n as usize, s))
                .map(|n| n as usize);
            let from_heap = chosen.is_none();
            if from_heap {
                chosen = cover.roomiest(s);
            }
            if let Some(i) = chosen {
                cover.assign(k, i, s, from_heap);
            }
        }
        drop(keyed);
        let Coverage {
            used,
            primary_samples,
            primary,
            class_of,
            offset,
            ..
        } = cover;
        let nodes = detail
            .iter()
            .zip(class_of)
            .zip(offset)
            .map(|((&(i, own), class_of), offset)| {
                let part = Placement {
                    class_of,
                    offset,
                    used: used[i].clone(),
                    samples: Vec::new(),
                    fill_order: Vec::new(),
                };
                complete_node(access, &size, &capacities[i], &primary, (i, own), part)
            })
            .collect();
        ClusterPlacement {
            primary,
            coverage_used: used,
            primary_samples,
            nodes,
        }
    }

    /// Bytes of distinct samples the cluster covers (each counted once).
    pub fn covered_bytes(&self, size: impl Fn(u32) -> u64 + Sync) -> u64 {
        self.primary
            .par_iter()
            .enumerate()
            .filter(|(_, &n)| n != NO_NODE)
            .map(|(k, _)| size(k as u32))
            .sum()
    }
}

/// The samples some node reads, in the order coverage takes them: most reads by one node
/// first, then earliest need, then sample.
fn coverage_order(access: &ClusterAccess) -> Vec<(Reverse<u16>, u64, u32)> {
    let mut keyed: Vec<(Reverse<u16>, u64, u32)> = access
        .samples
        .par_iter()
        .enumerate()
        .filter(|(_, s)| s.total > 0)
        .map(|(k, s)| (Reverse(s.top_count()), s.first_need, k as u32))
        .collect();
    keyed.par_sort_unstable();
    keyed
}

/// The cluster-wide coverage as it is built: every node's classes filled so far, each
/// sample's primary, and the detail nodes' class and offset per sample.
struct Coverage<'a> {
    capacities: &'a [Vec<u64>],
    used: Vec<Vec<u64>>,
    primary_samples: Vec<u64>,
    primary: Vec<u16>,
    /// Per node, its index among the detail nodes (`usize::MAX`: not one).
    slot_of: Vec<usize>,
    class_of: Vec<Vec<u8>>,
    offset: Vec<Vec<u64>>,
    /// Nodes by room left (max first), refreshed lazily.
    by_room: BinaryHeap<(u64, Reverse<u16>)>,
}

impl<'a> Coverage<'a> {
    /// Nothing covered yet, over `f` samples; `offsets`: lay out the detail nodes' offsets.
    fn new(capacities: &'a [Vec<u64>], f: usize, detail: &[(usize, &AccessCounts)], offsets: bool) -> Coverage<'a> {
        let m = capacities.len();
        let used: Vec<Vec<u64>> = capacities.iter().map(|c| vec![0u64; c.len()]).collect();
        let mut slot_of = vec![usize::MAX; m];
        for (d, &(i, _)) in detail.iter().enumerate() {
            slot_of[i] = d;
        }
        let by_room = (0..m)
            .map(|i| (room(&used[i], &capacities[i]), Reverse(i as u16)))
            .collect();
        Coverage {
            capacities,
            used,
            primary_samples: vec![0u64; m],
            primary: huge_vec(f, NO_NODE),
            slot_of,
            class_of: detail.iter().map(|_| huge_vec(f, UNCACHED)).collect(),
            offset: detail
                .iter()
                .map(|_| if offsets { huge_vec(f, 0u64) } else { Vec::new() })
                .collect(),
            by_room,
        }
    }

    /// Whether a sample of `s` bytes fits one of node `i`'s classes.
    fn fits(&self, i: usize, s: u64) -> bool {
        self.capacities[i].iter().zip(&self.used[i]).any(|(c, u)| u + s <= *c)
    }

    /// The node with the most room left that can take `s` bytes, taken off the heap (it goes
    /// back when assigned); None: not even the roomiest node can.
    fn roomiest(&mut self, s: u64) -> Option<usize> {
        // The heap holds one entry per node; an entry gone stale (the node took samples since)
        // is refreshed when it comes to the top.
        let mut chosen = None;
        while let Some((r, Reverse(i))) = self.by_room.pop() {
            let now = room(&self.used[i as usize], &self.capacities[i as usize]);
            if now == r && self.fits(i as usize, s) {
                chosen = Some(i as usize);
            }
            let stale = now != r;
            if !stale && chosen.is_none() {
                // Not even the roomiest node can take it: keep the node for smaller samples.
                self.by_room.push((now, Reverse(i)));
                break;
            }
            if stale {
                self.by_room.push((now, Reverse(i)));
                continue;
            }
            break;
        }
        chosen
    }

    /// Make node `i` sample `k`'s primary, in its fastest class with room for `s` bytes.
    fn assign(&mut self, k: u32, i: usize, s: u64, from_heap: bool) {
        let j = self.capacities[i]
            .iter()
            .zip(&self.used[i])
            .position(|(c, u)| u + s <= *c)
            .expect("fits");
        if self.slot_of[i] != usize::MAX {
            self.class_of[self.slot_of[i]][k as usize] = j as u8;
            if let Some(o) = self.offset[self.slot_of[i]].get_mut(k as usize) {
                *o = self.used[i][j];
            }
        }
        self.used[i][j] += s;
        self.primary[k as usize] = i as u16;
        self.primary_samples[i] += 1;
        if from_heap {
            self.by_room
                .push((room(&self.used[i], &self.capacities[i]), Reverse(i as u16)));
        }
    }
}

/// Bytes left in a node's classes.
fn room(used: &[u64], caps: &[u64]) -> u64 {
    caps.iter().zip(used).map(|(c, u)| c - u).sum()
}

/// A detail node's placement from its coverage part (`part`: classes, offsets and bytes used
/// by the samples it is primary for): its own most used samples it does not hold yet added as
/// replicas, and its classes' fill orders.
fn complete_node(
    access: &ClusterAccess,
    size: &(impl Fn(u32) -> u64 + Sync),
    caps: &[u64],
    primary: &[u16],
    (i, own): (usize, &AccessCounts),
    mut part: Placement,
) -> Placement {
    part.samples = vec![0u64; caps.len()];
    for &c in part.class_of.iter() {
        if c != UNCACHED {
            part.samples[c as usize] += 1;
        }
    }
    add_replicas(own, size, caps, &mut part);
    let mut fill: Vec<Vec<(u64, u32)>> = vec![Vec::new(); caps.len()];
    for (k, &j) in part.class_of.iter().enumerate() {
        if j != UNCACHED {
            let t = if primary[k] as usize == i {
                access.samples[k].first_need
            } else {
                own.first_need[k]
            };
            fill[j as usize].push((t, k as u32));
        }
    }
    part.fill_order = fill.into_iter().map(super::by_need).collect();
    part
}

/// Replication: place a node's own most used samples it does not hold yet in the room left.
fn add_replicas(own: &AccessCounts, size: &(impl Fn(u32) -> u64 + Sync), caps: &[u64], p: &mut Placement) {
    let f = p.class_of.len();
    let mut replicas: Vec<(Reverse<u32>, u64, u32)> = (0..f as u32)
        .into_par_iter()
        .filter(|&k| own.counts[k as usize] > 0 && p.class_of[k as usize] == UNCACHED)
        .map(|k| (Reverse(own.counts[k as usize]), own.first_need[k as usize], k))
        .collect();
    replicas.par_sort_unstable();
    let mut left = room(&p.used, caps);
    for (_, _, k) in replicas {
        if left == 0 {
            break;
        }
        let s = size(k);
        if let Some(j) = caps.iter().zip(&p.used).position(|(c, u)| u + s <= *c) {
            p.class_of[k as usize] = j as u8;
            if let Some(o) = p.offset.get_mut(k as usize) {
                *o = p.used[j];
            }
            p.used[j] += s;
            p.samples[j] += 1;
            left -= s;
        }
    }
}

/// Each node's part of a cluster: `node_of_rank[r]` from every node's ranks.
pub fn node_of_rank(nodes: &[Vec<u32>], world_size: u32) -> Result<Vec<u16>> {
    if nodes.len() >= NO_NODE as usize {
        return Err(Error::config(
            "nodes",
            format!("{} nodes; at most {}", nodes.len(), NO_NODE - 1),
        ));
    }
    let mut out = vec![NO_NODE; world_size as usize];
    for (i, ranks) in nodes.iter().enumerate() {
        for &r in ranks {
            match out.get_mut(r as usize) {
                Some(slot) if *slot == NO_NODE => *slot = i as u16,
                Some(_) => return Err(Error::config("nodes", format!("rank {r} is on two nodes"))),
                None => {
                    return Err(Error::config(
                        "nodes",
                        format!("rank {r} is outside world size {world_size}"),
                    ))
                }
            }
        }
    }
    if let Some(r) = out.iter().position(|&n| n == NO_NODE) {
        return Err(Error::config("nodes", format!("rank {r} is on no node")));
    }
    Ok(out)
}

/// One node's plan from the schedule: the cluster summaries, the node's own counts and the
/// streams of `keep` ranks (epochs `first..`), in one pass over the epochs.
pub fn node_access(
    schedule: &Schedule,
    nodes: &[Vec<u32>],
    node: usize,
    first: u32,
    keep: &[u32],
) -> Result<(ClusterAccess, AccessCounts, Vec<Vec<crate::schedule::RankEpoch>>)> {
    let owner = node_of_rank(nodes, schedule.world_size)?;
    let f = schedule.num_samples() as usize;
    let mut own = AccessCounts::empty(f);
    let mine = &nodes[node];
    let mut streams = Vec::new();
    let access = ClusterAccess::compute(schedule, &owner, first, |e, global| {
        let split = schedule.split(e, global, mine)?;
        for stream in &split {
            own.add_stream(e, &stream.samples);
        }
        if !keep.is_empty() {
            streams.push(
                split
                    .into_iter()
                    .zip(mine)
                    .filter(|(_, r)| keep.contains(r))
                    .map(|(s, _)| s)
                    .collect(),
            );
        }
        Ok(())
    })?;
    Ok((access, own, streams))
}

/// The cluster `plan` report: `nodes` (each node's ranks) caching in `classes` (name and
/// capacity per node, fastest first): coverage and the file-system reads expected over the run
/// with the cluster-wide placement, every node's primary share, and node `detail`'s full
/// placement (replicas included) as that node computes it at start.
pub fn cluster_report(
    schedule: &Schedule,
    nodes: &[Vec<u32>],
    detail: usize,
    size: impl Fn(u32) -> u64 + Sync,
    classes: &[(String, u64)],
) -> Result<serde_json::Value> {
    let t0 = std::time::Instant::now();
    if detail >= nodes.len() {
        return Err(Error::config(
            "node",
            format!("node {detail} is outside the {} nodes", nodes.len()),
        ));
    }
    let f = schedule.num_samples() as usize;
    check_plan_memory(f as u64, true, &format!("{f} samples on {} nodes", nodes.len()))?;
    let (access, own, _) = node_access(schedule, nodes, detail, 0, &[])?;
    let capacities: Vec<Vec<u64>> = nodes.iter().map(|_| classes.iter().map(|c| c.1).collect()).collect();
    let cluster = ClusterPlacement::compute(&access, &size, &capacities, &[(detail, &own)]);
    let seconds = t0.elapsed().as_secs_f64();
    let total: u64 = (0..f as u32).into_par_iter().map(&size).sum();
    let covered = cluster.covered_bytes(&size);
    let fs_cluster = access.expected_storage_bytes(&cluster.primary, &size);
    let mine = &cluster.nodes[0];
    let fs_alone = storage_bytes_alone(&own, &size, &capacities[detail]);
    let primary_bytes: Vec<u64> = cluster.coverage_used.iter().map(|u| u.iter().sum()).collect();
    let per_node = per_node_report(nodes, &capacities, &cluster, &primary_bytes);
    let held = mine.used.iter().sum::<u64>();
    Ok(serde_json::json!({
        "samples": f,
        "world_size": schedule.world_size,
        "epochs": schedule.epochs,
        "nodes": nodes.len(),
        "dataset_bytes": total,
        "aggregate_capacity": capacities.iter().flatten().sum::<u64>(),
        "coverage": if total == 0 { 1.0 } else { covered as f64 / total as f64 },
        "covered_bytes": covered,
        "expected_fs_bytes": fs_cluster,
        "minimum_fs_bytes": total + (schedule.epochs as u64).saturating_sub(1) * (total - covered.min(total)),
        "per_node": per_node,
        "node": {
            "node": detail,
            "ranks": nodes[detail],
            "samples": mine.samples.iter().sum::<u64>(),
            "bytes": held,
            "primary_samples": cluster.primary_samples[detail],
            "primary_bytes": primary_bytes[detail],
            "replica_bytes": held - primary_bytes[detail],
            "expected_fs_bytes_alone": fs_alone,
            "classes": classes.iter().enumerate().map(|(j, (name, cap))| serde_json::json!({"class": name, "capacity": cap, "samples": mine.samples[j], "bytes": mine.used[j]})).collect::<Vec<_>>(),
        },
        "estimated_memory_bytes": plan_memory(f as u64, rayon::current_num_threads(), true),
        "seconds": seconds,
    }))
}

/// The file-system bytes a node reads over the run caching alone in `capacities`: what it
/// caches once, the rest at every access.
fn storage_bytes_alone(own: &AccessCounts, size: &(impl Fn(u32) -> u64 + Sync), capacities: &[u64]) -> u64 {
    let alone = Placement::compute(own, size, capacities);
    (0..own.counts.len())
        .into_par_iter()
        .map(|k| {
            let n = own.counts[k] as u64;
            if n == 0 {
                0
            } else if alone.class_of[k] != UNCACHED {
                size(k as u32)
            } else {
                n * size(k as u32)
            }
        })
        .sum()
}

/// Every node's line of the cluster report: its ranks, what it is primary for and the room
/// left for replicas.
fn per_node_report(
    nodes: &[Vec<u32>],
    capacities: &[Vec<u64>],
    cluster: &ClusterPlacement,
    primary_bytes: &[u64],
) -> Vec<serde_json::Value> {
    (0..nodes.len())
        .map(|i| {
            let cap: u64 = capacities[i].iter().sum();
            serde_json::json!({
                "node": i,
                "ranks": nodes[i],
                "primary_samples": cluster.primary_samples[i],
                "primary_bytes": primary_bytes[i],
                "replica_room_bytes": cap - primary_bytes[i],
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(nodes: u32, per_node: u32) -> Vec<Vec<u32>> {
        (0..nodes)
            .map(|i| (i * per_node..(i + 1) * per_node).collect())
            .collect()
    }

    /// Every node's detail, as a small cluster's tests want it.
    fn cluster(
        n: u64,
        nodes: u32,
        per_node: u32,
        epochs: u32,
        seed: u64,
        cap: u64,
    ) -> (Vec<AccessCounts>, ClusterAccess, ClusterPlacement) {
        let s = Schedule::shuffle(n, nodes * per_node, 4, epochs, seed, false).unwrap();
        let g = groups(nodes, per_node);
        let access = AccessCounts::compute_groups(&s, &g).unwrap();
        let (summary, own0, _) = node_access(&s, &g, 0, 0, &[]).unwrap();
        assert_eq!(own0.counts, access[0].counts);
        assert_eq!(own0.first_need, access[0].first_need);
        let caps = vec![vec![cap]; nodes as usize];
        let detail: Vec<(usize, &AccessCounts)> = access.iter().enumerate().collect();
        let p = ClusterPlacement::compute(&summary, |_| 100, &caps, &detail);
        (access, summary, p)
    }

    #[test]
    fn summary_is_exact_up_to_four_readers() {
        let mut s = SampleSummary::EMPTY;
        for (n, w) in [(3u16, 1u16), (1, 2), (3, 1), (7, 1), (0, 4)] {
            s.add(n, w, 10);
        }
        let ranked: Vec<(u16, u16)> = s.ranked(5).collect();
        assert_eq!(ranked[0], (0, 4));
        assert!(ranked.contains(&(3, 2)) && ranked.contains(&(1, 2)) && ranked.contains(&(7, 1)));
        assert_eq!(s.total, 9);
        // A fifth reader takes over the least slot and keeps its count as an upper bound.
        s.add(9, 1, 2);
        assert_eq!(s.first_need, 2);
        assert!(s.ranked(5).any(|x| x == (9, 2)));
        assert!(!s.ranked(5).any(|(n, _)| n == 7));
    }

    #[test]
    fn summaries_match_exact_counts_for_four_nodes() {
        let s = Schedule::shuffle(3000, 8, 4, 6, 5, false).unwrap();
        let g = groups(4, 2);
        let exact = AccessCounts::compute_groups(&s, &g).unwrap();
        let (summary, _, _) = node_access(&s, &g, 2, 0, &[]).unwrap();
        let from = ClusterAccess::from_nodes(&exact).unwrap();
        for k in 0..3000usize {
            let top = exact.iter().map(|a| a.counts[k]).max().unwrap();
            let first = exact.iter().map(|a| a.first_need[k]).min().unwrap();
            let sm = &summary.samples[k];
            assert_eq!(sm.top_count() as u32, top, "sample {k}");
            assert_eq!(sm.first_need, first);
            assert_eq!(sm.total, 6);
            for (n, c) in sm.ranked(k as u32) {
                assert_eq!(exact[n as usize].counts[k], c as u32);
            }
            assert_eq!(from.samples[k].top_count(), sm.top_count());
        }
    }

    #[test]
    fn cluster_covers_the_dataset_when_capacity_allows() {
        // 4 nodes at 30 % of 2,000 samples each: 120 % in all.
        let (access, summary, p) = cluster(2000, 4, 2, 4, 7, 600 * 100);
        assert!(p.primary.iter().all(|&n| n != NO_NODE), "every sample has a primary");
        for (i, node) in p.nodes.iter().enumerate() {
            assert!(node.used[0] <= 600 * 100);
            for k in 0..2000 {
                if p.primary[k] == i as u16 {
                    assert_ne!(node.class_of[k], UNCACHED, "a primary holds its sample");
                }
                if node.class_of[k] != UNCACHED && p.primary[k] != i as u16 {
                    assert!(access[i].counts[k] > 0, "a replica is a sample the node reads");
                }
            }
        }
        // The room beyond coverage holds replicas of each node's own frequent samples.
        let held: u64 = p.nodes.iter().map(|n| n.samples[0]).sum();
        assert!(held > 2000 && held <= 2400, "{held}");
        assert_eq!(summary.expected_storage_bytes(&p.primary, |_| 100), 2000 * 100);
        assert_eq!(p.covered_bytes(|_| 100), 2000 * 100);
        assert_eq!(p.primary_samples.iter().sum::<u64>(), 2000);
    }

    #[test]
    fn cluster_below_dataset_reaches_the_minimum_storage_reads() {
        // 4 nodes at 12.5 %: half the dataset cached; S + (E-1)(S-C) is the least the storage
        // can deliver over E epochs.
        let (access, summary, p) = cluster(2000, 4, 2, 4, 3, 250 * 100);
        assert_eq!(p.covered_bytes(|_| 100), 1000 * 100);
        let (s, c, e) = (2000u64 * 100, 1000u64 * 100, 4u64);
        assert_eq!(
            summary.expected_storage_bytes(&p.primary, |_| 100),
            s + (e - 1) * (s - c)
        );
        // The primary of a cached sample is a node that reads it, mostly one that reads it most.
        let (mut cached, mut top_count) = (0, 0);
        for k in 0..2000usize {
            let n = p.primary[k];
            if n != NO_NODE {
                let top = access.iter().map(|a| a.counts[k]).max().unwrap();
                assert!(access[n as usize].counts[k] > 0, "sample {k}");
                cached += 1;
                top_count += (access[n as usize].counts[k] == top) as u32;
            }
        }
        assert!(top_count as f64 >= 0.9 * cached as f64, "{top_count} of {cached}");
    }

    #[test]
    fn many_nodes_cover_and_place_on_readers() {
        // 40 nodes (more than the summary's slots) at 3 % each: 120 % in all.
        let (access, summary, p) = cluster(4000, 40, 1, 5, 13, 120 * 100);
        assert!(p.primary.iter().all(|&n| n != NO_NODE));
        assert_eq!(summary.expected_storage_bytes(&p.primary, |_| 100), 4000 * 100);
        let on_reader = (0..4000)
            .filter(|&k| access[p.primary[k] as usize].counts[k] > 0)
            .count();
        assert!(on_reader >= 3600, "{on_reader} of 4000 primaries read their sample");
        // Primaries are spread: no node serves more than its capacity, none is idle.
        assert!(
            p.primary_samples.iter().all(|&n| (1..=120).contains(&n)),
            "{:?}",
            p.primary_samples
        );
    }

    #[test]
    fn every_node_computes_the_same_plan_for_itself() {
        // Node 1's placement as node 1 computes it (own detail only) equals its placement in a
        // computation that lays out every node.
        let (_, _, all) = cluster(1500, 3, 2, 3, 11, 400 * 100);
        let s = Schedule::shuffle(1500, 6, 4, 3, 11, false).unwrap();
        let g = groups(3, 2);
        let (summary, own, streams) = node_access(&s, &g, 1, 0, &[2, 3]).unwrap();
        let one = ClusterPlacement::compute(&summary, |_| 100, &vec![vec![400 * 100]; 3], &[(1, &own)]);
        assert_eq!(one.primary, all.primary);
        assert_eq!(one.nodes[0].class_of, all.nodes[1].class_of);
        assert_eq!(one.nodes[0].offset, all.nodes[1].offset);
        assert_eq!(one.nodes[0].fill_order, all.nodes[1].fill_order);
        // The streams kept are the ranks' own.
        assert_eq!(streams.len(), 3);
        assert_eq!(streams[1][1], s.rank_epoch(3, 1).unwrap());
    }

    #[test]
    fn a_placement_without_offsets_has_the_same_classes_and_fill_orders() {
        // Two classes (a sample's size varies) so that replicas and coverage both fill both.
        let s = Schedule::shuffle(1800, 6, 4, 3, 17, false).unwrap();
        let g = groups(3, 2);
        let access = AccessCounts::compute_groups(&s, &g).unwrap();
        let summary = ClusterAccess::from_nodes(&access).unwrap();
        let caps = vec![vec![150 * 100, 300 * 100]; 3];
        let detail: Vec<(usize, &AccessCounts)> = access.iter().enumerate().collect();
        let size = |k: u32| 60 + (k as u64 * 37) % 80;
        let full = ClusterPlacement::compute(&summary, size, &caps, &detail);
        let classes = ClusterPlacement::compute_classes(&summary, size, &caps, &detail);
        assert_eq!(classes.primary, full.primary);
        assert_eq!(classes.coverage_used, full.coverage_used);
        for (c, f) in classes.nodes.iter().zip(&full.nodes) {
            assert!(c.offset.is_empty());
            assert_eq!(f.offset.len(), 1800);
            assert_eq!((&c.class_of, &c.used, &c.samples), (&f.class_of, &f.used, &f.samples));
            assert_eq!(c.fill_order, f.fill_order);
            assert!(f.used.iter().all(|&u| u > 0), "both classes are used: {:?}", f.used);
        }
    }

    #[test]
    fn one_node_matches_placement() {
        let s = Schedule::shuffle(1500, 2, 4, 3, 5, false).unwrap();
        let acc = AccessCounts::compute(&s, &[0, 1]).unwrap();
        let one = Placement::compute(&acc, |_| 100, &[300 * 100]);
        let (summary, own, _) = node_access(&s, &[vec![0, 1]], 0, 0, &[]).unwrap();
        let c = ClusterPlacement::compute(&summary, |_| 100, &[vec![300 * 100]], &[(0, &own)]);
        let set = |cl: &[u8]| -> Vec<usize> { (0..cl.len()).filter(|&k| cl[k] != UNCACHED).collect() };
        assert_eq!(set(&one.class_of), set(&c.nodes[0].class_of));
    }

    #[test]
    fn hashed_owners_are_spread_and_stable() {
        let keys: Vec<u64> = (0..4000u64).map(|i| splitmix64(i * 7 + 1)).collect();
        let owners = hashed_owners(&keys, 4);
        let access = hashed_access(&keys, &owners, 4);
        let p = ClusterPlacement::compute(&access, |_| 10, &vec![vec![20_000]; 4], &[]);
        assert_eq!(p.primary, owners, "each file on its owner while it has room");
        // Removing node 3 moves only its files.
        let three = hashed_owners(&keys, 3);
        assert!((0..4000).all(|k| owners[k] == 3 || three[k] == owners[k]));
    }

    fn order_of(f: usize, reads: &[u32]) -> AccessCounts {
        let mut a = AccessCounts::empty(f);
        a.add_stream(0, reads);
        a.add_stream(1, reads);
        a
    }

    #[test]
    fn an_order_covering_everything_comes_back_unchanged() {
        let keys: Vec<u64> = (0..10u64).map(splitmix64).collect();
        let a = order_of(10, &(0..10).rev().collect::<Vec<_>>());
        let p = order_with_hashed_rest(vec![a.clone()], &keys).unwrap();
        assert_eq!(p.nodes[0].counts, a.counts);
        assert_eq!(p.nodes[0].first_need, a.first_need);
        assert!(p.outside.iter().all(|&o| !o) && p.cluster.is_none());
    }

    #[test]
    fn samples_outside_an_order_are_placed_by_hashed_owners_after_the_ordered_ones() {
        // Samples 0..6 are ordered (train/), 6..10 read at times the order does not say (val/).
        let f = 10;
        let keys: Vec<u64> = (0..f as u64).map(|i| splitmix64(i + 100)).collect();
        let ordered: Vec<u32> = vec![5, 3, 1, 0, 2, 4];
        let p = order_with_hashed_rest(vec![order_of(f, &ordered)], &keys).unwrap();
        let own = &p.nodes[0];
        assert_eq!(p.outside, (0..f).map(|k| k >= 6).collect::<Vec<_>>());
        // One node owns everything: hashed counts 2, ranked below every ordered sample.
        assert!((6..f).all(|k| own.counts[k] == 2 && own.first_need[k] >= NEED_NOT_KNOWN));
        assert!((0..6).all(|k| own.counts[k] == 4 && own.first_need[k] < NEED_NOT_KNOWN));
        // Room for everything: every sample placed, the ordered ones filled first, in order.
        let all = Placement::compute(own, |_| 10, &[100]);
        assert!(all.class_of.iter().all(|&c| c != UNCACHED));
        assert_eq!(&all.fill_order[0][..6], &ordered[..]);
        // Room for 7: the ordered six and one of the rest.
        let seven = Placement::compute(own, |_| 10, &[70]);
        assert!((0..6).all(|k| seven.class_of[k] != UNCACHED));
        assert_eq!((6..f).filter(|&k| seven.class_of[k] != UNCACHED).count(), 1);
    }

    #[test]
    fn on_several_nodes_the_rest_goes_to_its_hashed_owner() {
        let f = 400;
        let keys: Vec<u64> = (0..f as u64).map(|i| splitmix64(i * 3 + 7)).collect();
        // Node 0 reads 0..100, node 1 reads 100..200; 200..400 neither.
        let a = order_of(f, &(0..100).collect::<Vec<_>>());
        let b = order_of(f, &(100..200).collect::<Vec<_>>());
        let p = order_with_hashed_rest(vec![a, b], &keys).unwrap();
        let owners = hashed_owners(&keys, 2);
        let hashed = hashed_access(&keys, &owners, 2);
        let access = p.cluster.as_ref().unwrap();
        for (k, &owner) in owners.iter().enumerate().skip(200) {
            assert!(p.outside[k]);
            assert_eq!(access.samples[k].node, hashed.samples[k].node, "sample {k}");
            assert_eq!(access.samples[k].count, hashed.samples[k].count, "sample {k}");
            for (n, own) in p.nodes.iter().enumerate() {
                assert_eq!(own.counts[k], if owner as usize == n { 2 } else { 1 });
            }
        }
        assert!(p.outside[..200].iter().all(|&o| !o));
        // Ordered samples keep their reader; room for all: each on its reader or hashed owner.
        let c = ClusterPlacement::compute(access, |_| 10, &vec![vec![10_000]; 2], &[]);
        assert!((0..100).all(|k| c.primary[k] == 0) && (100..200).all(|k| c.primary[k] == 1));
        assert!((200..f).all(|k| c.primary[k] == owners[k]));
        // A node's own counts of the wrong length name the node.
        let err = order_with_hashed_rest(vec![order_of(f, &[1]), order_of(f - 1, &[1])], &keys).unwrap_err();
        assert!(err.to_string().contains("node 1"), "{err}");
    }

    #[test]
    fn node_table_errors_name_the_rank() {
        assert!(node_of_rank(&[vec![0, 1], vec![1]], 2)
            .unwrap_err()
            .to_string()
            .contains("rank 1 is on two nodes"));
        assert!(node_of_rank(&[vec![0]], 2)
            .unwrap_err()
            .to_string()
            .contains("rank 1 is on no node"));
        assert!(node_of_rank(&[vec![0, 5]], 2)
            .unwrap_err()
            .to_string()
            .contains("rank 5 is outside"));
    }
}
