//! Access frequencies and placement (NoPFS Sec. 3.1 and 5.1): how often the node's ranks will
//! read each sample over the whole run, and which storage class caches which samples: the most
//! frequently read go to the fastest class, until every class is full.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::error::Result;
use crate::schedule::Schedule;

/// Sentinel for "not cached in any class".
pub const UNCACHED: u8 = u8::MAX;

/// Per-sample access counts of a set of ranks over the whole run, and when each sample is first
/// needed by any of them (`epoch << 32 | position in that rank's epoch stream`; `u64::MAX` if
/// never). Ranks advance in lock step, so positions of different ranks are comparable.
#[derive(Clone, Debug)]
pub struct AccessCounts {
    pub counts: Vec<u32>,
    pub first_need: Vec<u64>,
}

impl AccessCounts {
    /// Count the accesses of `ranks` (one rank, or all ranks of a node) over every epoch.
    /// One shuffle per epoch, epochs in parallel, per-thread counters merged at the end.
    pub fn compute(schedule: &Schedule, ranks: &[u32]) -> Result<Self> {
        Self::compute_from(schedule, ranks, 0)
    }

    /// Like [`AccessCounts::compute`] over epochs `first..` only (a resumed run).
    pub fn compute_from(schedule: &Schedule, ranks: &[u32], first: u32) -> Result<Self> {
        let f = schedule.num_samples() as usize;
        for e in 0..schedule.epochs {
            schedule.layout(e)?;
        }
        let empty = || AccessCounts {
            counts: vec![0; f],
            first_need: vec![u64::MAX; f],
        };
        let merged = (first.min(schedule.epochs)..schedule.epochs)
            .into_par_iter()
            .try_fold(empty, |mut acc, e| -> Result<AccessCounts> {
                let global = schedule.global_order(e);
                for stream in schedule.split(e, &global, ranks)? {
                    for (pos, &k) in stream.samples.iter().enumerate() {
                        acc.counts[k as usize] += 1;
                        let t = ((e as u64) << 32) | pos as u64;
                        let slot = &mut acc.first_need[k as usize];
                        *slot = (*slot).min(t);
                    }
                }
                Ok(acc)
            })
            .try_reduce(empty, |mut a, b| {
                for (x, y) in a.counts.iter_mut().zip(b.counts) {
                    *x += y;
                }
                for (x, y) in a.first_need.iter_mut().zip(b.first_need) {
                    *x = (*x).min(y);
                }
                Ok(a)
            })?;
        Ok(merged)
    }

    /// [`AccessCounts::compute`] for several groups of ranks at once (for example every node of a
    /// cluster), shuffling each epoch once for all groups: `out[i]` belongs to `groups[i]`.
    /// Epochs are generated a few at a time in parallel, then every group counts them in parallel.
    pub fn compute_groups(schedule: &Schedule, groups: &[Vec<u32>]) -> Result<Vec<Self>> {
        Self::compute_groups_from(schedule, groups, 0)
    }

    /// [`AccessCounts::compute_groups`] over epochs `first..` only (a resumed run).
    pub fn compute_groups_from(schedule: &Schedule, groups: &[Vec<u32>], first: u32) -> Result<Vec<Self>> {
        let f = schedule.num_samples() as usize;
        for e in 0..schedule.epochs {
            schedule.layout(e)?;
        }
        let mut out: Vec<AccessCounts> = groups
            .iter()
            .map(|_| AccessCounts {
                counts: vec![0; f],
                first_need: vec![u64::MAX; f],
            })
            .collect();
        let chunk = rayon::current_num_threads().max(1) as u32;
        let mut first = first.min(schedule.epochs);
        while first < schedule.epochs {
            let epochs: Vec<u32> = (first..(first + chunk).min(schedule.epochs)).collect();
            let orders: Vec<Vec<u32>> = epochs.par_iter().map(|&e| schedule.global_order(e)).collect();
            out.par_iter_mut()
                .zip(groups)
                .try_for_each(|(acc, ranks)| -> Result<()> {
                    for (&e, global) in epochs.iter().zip(&orders) {
                        for stream in schedule.split(e, global, ranks)? {
                            for (pos, &k) in stream.samples.iter().enumerate() {
                                acc.counts[k as usize] += 1;
                                let slot = &mut acc.first_need[k as usize];
                                *slot = (*slot).min(((e as u64) << 32) | pos as u64);
                            }
                        }
                    }
                    Ok(())
                })?;
            first += chunk;
        }
        Ok(out)
    }

    /// Number of samples accessed exactly `c` times, for every `c` that occurs.
    pub fn histogram(&self) -> BTreeMap<u32, u64> {
        let mut h = BTreeMap::new();
        for &c in &self.counts {
            *h.entry(c).or_insert(0) += 1;
        }
        h
    }
}

/// The analytic expectation of the histogram (Sec. 3.1): a sample is read by a given rank in an
/// epoch with probability 1/N, so by `local_ranks` ranks with p = local_ranks/N, and its count
/// over E epochs is Binomial(E, p). Entry c is F * P(X = c).
pub fn expected_histogram(num_samples: u64, epochs: u32, world_size: u32, local_ranks: u32) -> BTreeMap<u32, f64> {
    let p = (local_ranks as f64 / world_size.max(1) as f64).min(1.0);
    let f = num_samples as f64;
    let mut out = BTreeMap::new();
    if p >= 1.0 {
        out.insert(epochs, f);
        return out;
    }
    // pmf(0) = (1-p)^E; pmf(c+1) = pmf(c) * (E-c)/(c+1) * p/(1-p). Computed in log space so
    // that large E does not underflow the first terms.
    let (lp, lq) = (p.ln(), (1.0 - p).ln());
    let mut log_binom = 0.0f64;
    for c in 0..=epochs {
        if c > 0 {
            log_binom += ((epochs - c + 1) as f64).ln() - (c as f64).ln();
        }
        let v = f * (log_binom + c as f64 * lp + (epochs - c) as f64 * lq).exp();
        if v >= 1e-3 {
            out.insert(c, v);
        }
    }
    out
}

/// Where every sample is cached: `class_of[k]` is an index into the capacities given to
/// [`Placement::compute`] (fastest first) or [`UNCACHED`]; `offset[k]` is the sample's byte
/// offset inside its class (classes are laid out statically, as sizes are known in advance).
#[derive(Clone, Debug)]
pub struct Placement {
    pub class_of: Vec<u8>,
    pub offset: Vec<u64>,
    /// Bytes used per class.
    pub used: Vec<u64>,
    /// Samples per class.
    pub samples: Vec<u64>,
    /// Per class, its samples in the order they are first needed: the order to fill it in.
    pub fill_order: Vec<Vec<u32>>,
}

impl Placement {
    /// Greedy placement: samples sorted by access count (descending), ties by first need, then
    /// by index; each goes to the fastest class with room left. Samples never accessed stay
    /// uncached. Deterministic for equal inputs.
    pub fn compute(access: &AccessCounts, size: impl Fn(u32) -> u64, capacities: &[u64]) -> Placement {
        assert!(capacities.len() < UNCACHED as usize);
        let f = access.counts.len();
        // Sort keys built up front (not looked up per comparison: that would be a cache miss
        // each time at millions of samples).
        let mut keyed: Vec<(std::cmp::Reverse<u32>, u64, u32)> = (0..f as u32)
            .filter(|&k| access.counts[k as usize] > 0)
            .map(|k| {
                (
                    std::cmp::Reverse(access.counts[k as usize]),
                    access.first_need[k as usize],
                    k,
                )
            })
            .collect();
        keyed.par_sort_unstable();
        let order: Vec<u32> = keyed.into_iter().map(|(_, _, k)| k).collect();
        let mut class_of = vec![UNCACHED; f];
        let mut offset = vec![0u64; f];
        let mut used = vec![0u64; capacities.len()];
        let mut samples = vec![0u64; capacities.len()];
        let mut full = vec![false; capacities.len()];
        for &k in &order {
            if full.iter().all(|&x| x) {
                break;
            }
            let s = size(k);
            for (j, &cap) in capacities.iter().enumerate() {
                if full[j] {
                    continue;
                }
                if used[j] + s <= cap {
                    class_of[k as usize] = j as u8;
                    offset[k as usize] = used[j];
                    used[j] += s;
                    samples[j] += 1;
                    break;
                }
                // A class that cannot take even a tiny sample more is treated as full.
                if cap - used[j] < 64 {
                    full[j] = true;
                }
            }
        }
        let mut fill_order: Vec<Vec<u32>> = vec![Vec::new(); capacities.len()];
        for &k in &order {
            let j = class_of[k as usize];
            if j != UNCACHED {
                fill_order[j as usize].push(k);
            }
        }
        for list in &mut fill_order {
            let mut keyed: Vec<(u64, u32)> = list.iter().map(|&k| (access.first_need[k as usize], k)).collect();
            keyed.par_sort_unstable();
            *list = keyed.into_iter().map(|(_, k)| k).collect();
        }
        Placement {
            class_of,
            offset,
            used,
            samples,
            fill_order,
        }
    }
}

/// Sentinel for "no node holds it" in [`ClusterPlacement::primary`].
pub const NO_NODE: u16 = u16::MAX;

/// Access counts for a job whose order is not known (transparent mode): every node reads every
/// sample once per pass in some random order. Each sample's owner among `nodes` nodes is chosen
/// by rendezvous (highest-random-weight) hashing of its key (a hash of its path): no metadata
/// server, every node computes the same owners, and adding or removing a node moves only the
/// samples it owns. The owner counts the sample twice and the others once, so the cluster-wide
/// placement (coverage first) puts each sample on its owner while the owner has room, then on
/// the next node with room. Ties in need are broken by the key, so which samples a full cache
/// keeps is a fixed, pseudo-random subset: for uniformly random orders every subset of the
/// same size has the same expected hit rate, and a fixed one does not thrash as LRU does.
pub fn hashed_counts(keys: &[u64], nodes: usize) -> Vec<AccessCounts> {
    let nodes = nodes.max(1);
    let owners: Vec<usize> = keys
        .par_iter()
        .map(|&k| {
            (0..nodes)
                .max_by_key(|&n| {
                    (
                        crate::schedule::splitmix64(k ^ crate::schedule::splitmix64(n as u64 + 1)),
                        n,
                    )
                })
                .unwrap_or(0)
        })
        .collect();
    (0..nodes)
        .map(|n| AccessCounts {
            counts: owners.iter().map(|&o| if o == n { 2 } else { 1 }).collect(),
            first_need: keys.iter().map(|&k| crate::schedule::splitmix64(k) >> 1).collect(),
        })
        .collect()
}

/// Placement across the nodes of a cluster (NoPFS Sec. 4; Lemma 1 makes the nodes' most
/// frequently used samples largely complementary). Two passes:
///
/// 1. **Coverage.** Every sample some rank reads goes to one node: the node that reads it most
///    (ties: the one that needs it first, then the lowest node), or, when that node is full, the
///    node with the most room left; samples in order of that highest count (descending), then
///    first need, then index, each into the fastest class with room. So the cluster caches the
///    whole dataset whenever the sum of the nodes' capacities allows, and the samples several
///    nodes want are spread over their users.
/// 2. **Replication.** Room left on a node takes its own most frequently read samples it does not
///    hold yet.
///
/// The node a sample went to in the first pass is its `primary`: the one node that reads it
/// from the dataset's storage; every other node (a replica or a rank that needs it) gets it
/// from the primary, so with enough aggregate capacity the dataset is read once per run.
#[derive(Clone, Debug)]
pub struct ClusterPlacement {
    /// Per node, its classes' contents and layout (fill orders: by first need across the nodes
    /// it serves, see [`ClusterPlacement::compute`]).
    pub nodes: Vec<Placement>,
    /// Per sample, the node that reads it from the dataset and serves it ([`NO_NODE`]: none
    /// caches it; every rank reads it from the dataset).
    pub primary: Vec<u16>,
}

impl ClusterPlacement {
    /// `access[i]` are node i's access counts; `capacities[i]` its classes' capacities (fastest
    /// first). Deterministic for equal inputs: every node computes the same result.
    pub fn compute(
        access: &[AccessCounts],
        size: impl Fn(u32) -> u64 + Sync,
        capacities: &[Vec<u64>],
    ) -> ClusterPlacement {
        let m = access.len();
        assert_eq!(m, capacities.len());
        assert!(m < NO_NODE as usize);
        let f = access.first().map_or(0, |a| a.counts.len());
        // Per sample: the best node (highest count, then earliest need, then lowest index), its
        // count, and the earliest need over all nodes.
        let best: Vec<(u32, u64, u16, u64)> = (0..f)
            .into_par_iter()
            .map(|k| {
                let mut top = (0u32, u64::MAX, NO_NODE);
                let mut first = u64::MAX;
                for (i, a) in access.iter().enumerate() {
                    let (c, t) = (a.counts[k], a.first_need[k]);
                    first = first.min(t);
                    if c > 0 && (c > top.0 || (c == top.0 && t < top.1)) {
                        top = (c, t, i as u16);
                    }
                }
                (top.0, top.1, top.2, first)
            })
            .collect();
        let mut keyed: Vec<(std::cmp::Reverse<u32>, u64, u32)> = (0..f as u32)
            .filter(|&k| best[k as usize].0 > 0)
            .map(|k| (std::cmp::Reverse(best[k as usize].0), best[k as usize].3, k))
            .collect();
        keyed.par_sort_unstable();

        let classes: Vec<usize> = capacities.iter().map(|c| c.len()).collect();
        let mut class_of: Vec<Vec<u8>> = (0..m).map(|_| vec![UNCACHED; f]).collect();
        let mut offset: Vec<Vec<u64>> = (0..m).map(|_| vec![0u64; f]).collect();
        let mut used: Vec<Vec<u64>> = classes.iter().map(|&n| vec![0u64; n]).collect();
        let mut samples: Vec<Vec<u64>> = classes.iter().map(|&n| vec![0u64; n]).collect();
        let mut primary = vec![NO_NODE; f];
        let room = |used: &[u64], caps: &[u64]| -> u64 { caps.iter().zip(used).map(|(c, u)| c - u).sum() };
        // Nodes by room left (max first), updated lazily.
        let mut by_room: std::collections::BinaryHeap<(u64, std::cmp::Reverse<u16>)> = (0..m)
            .map(|i| (room(&used[i], &capacities[i]), std::cmp::Reverse(i as u16)))
            .collect();
        let fits = |i: usize, s: u64, used: &[Vec<u64>]| capacities[i].iter().zip(&used[i]).any(|(c, u)| u + s <= *c);
        let place = |i: usize,
                     k: u32,
                     s: u64,
                     used: &mut [Vec<u64>],
                     samples: &mut [Vec<u64>],
                     class_of: &mut [Vec<u8>],
                     offset: &mut [Vec<u64>]|
         -> bool {
            for (j, &cap) in capacities[i].iter().enumerate() {
                if used[i][j] + s <= cap {
                    class_of[i][k as usize] = j as u8;
                    offset[i][k as usize] = used[i][j];
                    used[i][j] += s;
                    samples[i][j] += 1;
                    return true;
                }
            }
            false
        };
        for &(_, _, k) in &keyed {
            let s = size(k);
            let home = best[k as usize].2 as usize;
            if place(home, k, s, &mut used, &mut samples, &mut class_of, &mut offset) {
                primary[k as usize] = home as u16;
                continue;
            }
            // Another node that reads it, the one reading it most with room for it (ties: the
            // lowest node)...
            let mut other: Option<(u32, usize)> = None;
            for (i, a) in access.iter().enumerate() {
                let c = a.counts[k as usize];
                if i != home && c > 0 && other.is_none_or(|(oc, _)| c > oc) && fits(i, s, &used) {
                    other = Some((c, i));
                }
            }
            if let Some((_, i)) = other {
                if place(i, k, s, &mut used, &mut samples, &mut class_of, &mut offset) {
                    primary[k as usize] = i as u16;
                    continue;
                }
            }
            // ... else the node with the most room left (entries are refreshed when stale).
            while let Some((r, std::cmp::Reverse(i))) = by_room.pop() {
                let now = room(&used[i as usize], &capacities[i as usize]);
                if now != r {
                    by_room.push((now, std::cmp::Reverse(i)));
                    continue;
                }
                let ok = now >= s && place(i as usize, k, s, &mut used, &mut samples, &mut class_of, &mut offset);
                let after = room(&used[i as usize], &capacities[i as usize]);
                by_room.push((after, std::cmp::Reverse(i)));
                if ok {
                    primary[k as usize] = i;
                }
                break;
            }
        }
        // Replication: each node's own most used samples it does not hold yet.
        for i in 0..m {
            let a = &access[i];
            let mut own: Vec<(std::cmp::Reverse<u32>, u64, u32)> = (0..f as u32)
                .filter(|&k| a.counts[k as usize] > 0 && class_of[i][k as usize] == UNCACHED)
                .map(|k| (std::cmp::Reverse(a.counts[k as usize]), a.first_need[k as usize], k))
                .collect();
            own.par_sort_unstable();
            for (_, _, k) in own {
                if room(&used[i], &capacities[i]) == 0 {
                    break;
                }
                if place(i, k, size(k), &mut used, &mut samples, &mut class_of, &mut offset)
                    && primary[k as usize] == NO_NODE
                {
                    primary[k as usize] = i as u16;
                }
            }
        }
        // Fill orders: a node fills what it serves by the earliest need of any node, its
        // replicas by its own first need.
        let nodes = (0..m)
            .map(|i| {
                let mut fill_order: Vec<Vec<(u64, u32)>> = vec![Vec::new(); classes[i]];
                for k in 0..f {
                    let j = class_of[i][k];
                    if j != UNCACHED {
                        let t = if primary[k] as usize == i {
                            best[k].3
                        } else {
                            access[i].first_need[k]
                        };
                        fill_order[j as usize].push((t, k as u32));
                    }
                }
                let fill_order = fill_order
                    .into_iter()
                    .map(|mut v| {
                        v.par_sort_unstable();
                        v.into_iter().map(|(_, k)| k).collect()
                    })
                    .collect();
                Placement {
                    class_of: std::mem::take(&mut class_of[i]),
                    offset: std::mem::take(&mut offset[i]),
                    used: std::mem::take(&mut used[i]),
                    samples: std::mem::take(&mut samples[i]),
                    fill_order,
                }
            })
            .collect();
        ClusterPlacement { nodes, primary }
    }

    /// Bytes of distinct samples the cluster caches (each counted once).
    pub fn covered_bytes(&self, size: impl Fn(u32) -> u64) -> u64 {
        (0..self.primary.len() as u32)
            .filter(|&k| self.primary[k as usize] != NO_NODE)
            .map(size)
            .sum()
    }

    /// Bytes the dataset's storage is expected to deliver over the run: a cached sample once (by
    /// its primary), an uncached one at every access (`access[i]` as given to `compute`).
    pub fn expected_storage_bytes(&self, access: &[AccessCounts], size: impl Fn(u32) -> u64) -> u64 {
        (0..self.primary.len())
            .map(|k| {
                if self.primary[k] != NO_NODE {
                    size(k as u32)
                } else {
                    access.iter().map(|a| a.counts[k] as u64).sum::<u64>() * size(k as u32)
                }
            })
            .sum()
    }
}

/// The `plan` report: measured and expected access-count histograms of `ranks` and the
/// placement of their samples into `classes` (name, capacity in bytes; fastest first).
pub fn report(
    schedule: &Schedule,
    ranks: &[u32],
    size: impl Fn(u32) -> u64,
    classes: &[(String, u64)],
) -> Result<serde_json::Value> {
    let t0 = std::time::Instant::now();
    let access = AccessCounts::compute(schedule, ranks)?;
    let capacities: Vec<u64> = classes.iter().map(|c| c.1).collect();
    let placement = Placement::compute(&access, &size, &capacities);
    let seconds = t0.elapsed().as_secs_f64();
    let f = schedule.num_samples() as u64;
    let measured: serde_json::Map<String, serde_json::Value> = access
        .histogram()
        .into_iter()
        .map(|(c, n)| (c.to_string(), n.into()))
        .collect();
    let expected: serde_json::Map<String, serde_json::Value> =
        expected_histogram(f, schedule.epochs, schedule.world_size, ranks.len() as u32)
            .into_iter()
            .map(|(c, x)| (c.to_string(), ((x * 10.0).round() / 10.0).into()))
            .collect();
    let total_bytes: u64 = (0..f as u32).map(&size).sum();
    let placed: Vec<serde_json::Value> = classes
        .iter()
        .enumerate()
        .map(|(j, (name, cap))| {
            serde_json::json!({"class": name, "capacity": cap, "samples": placement.samples[j], "bytes": placement.used[j]})
        })
        .collect();
    let cached_samples: u64 = placement.samples.iter().sum();
    let cached_bytes: u64 = placement.used.iter().sum();
    let accesses: u64 = access.counts.iter().map(|&c| c as u64).sum();
    let cached_accesses: u64 = (0..f as usize)
        .filter(|&k| placement.class_of[k] != UNCACHED)
        .map(|k| access.counts[k] as u64)
        .sum();
    Ok(serde_json::json!({
        "samples": f,
        "world_size": schedule.world_size,
        "epochs": schedule.epochs,
        "batch_size": schedule.batch_size,
        "drop_last": schedule.drop_last,
        "ranks": ranks,
        "dataset_bytes": total_bytes,
        "accesses": accesses,
        "mean_accesses_per_sample": accesses as f64 / f.max(1) as f64,
        "frequency_histogram": measured,
        "expected_histogram": expected,
        "placement": placed,
        "uncached": {"samples": f - cached_samples, "bytes": total_bytes - cached_bytes},
        "accesses_served_from_cache": cached_accesses,
        "seconds": seconds,
    }))
}

/// The cluster `plan` report: `nodes` (each node's ranks) caching in `classes` (name and
/// capacity per node, fastest first): coverage, replication and the file-system reads expected
/// over the run with the cluster-wide placement, against each node caching alone.
pub fn cluster_report(
    schedule: &Schedule,
    nodes: &[Vec<u32>],
    size: impl Fn(u32) -> u64 + Sync,
    classes: &[(String, u64)],
) -> Result<serde_json::Value> {
    let t0 = std::time::Instant::now();
    let access = AccessCounts::compute_groups(schedule, nodes)?;
    let capacities: Vec<Vec<u64>> = nodes.iter().map(|_| classes.iter().map(|c| c.1).collect()).collect();
    let cluster = ClusterPlacement::compute(&access, &size, &capacities);
    let seconds = t0.elapsed().as_secs_f64();
    let f = schedule.num_samples() as usize;
    let total: u64 = (0..f as u32).map(&size).sum();
    let covered = cluster.covered_bytes(&size);
    let held: u64 = cluster.nodes.iter().flat_map(|p| p.used.iter()).sum();
    let fs_cluster = cluster.expected_storage_bytes(&access, &size);
    // Each node alone: a sample it caches is read once by it, the others at every access.
    let fs_alone: u64 = access
        .iter()
        .map(|a| {
            let p = Placement::compute(a, &size, &capacities[0]);
            (0..f)
                .map(|k| {
                    let n = a.counts[k] as u64;
                    if n == 0 {
                        0
                    } else if p.class_of[k] != UNCACHED {
                        size(k as u32)
                    } else {
                        n * size(k as u32)
                    }
                })
                .sum::<u64>()
        })
        .sum();
    let per_node: Vec<serde_json::Value> = cluster
        .nodes
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let primary = cluster.primary.iter().filter(|&&n| n as usize == i).count();
            serde_json::json!({
                "node": i,
                "ranks": nodes[i],
                "samples": p.samples.iter().sum::<u64>(),
                "bytes": p.used.iter().sum::<u64>(),
                "primary_samples": primary,
                "classes": classes.iter().enumerate().map(|(j, (name, cap))| serde_json::json!({"class": name, "capacity": cap, "samples": p.samples[j], "bytes": p.used[j]})).collect::<Vec<_>>(),
            })
        })
        .collect();
    Ok(serde_json::json!({
        "samples": f,
        "world_size": schedule.world_size,
        "epochs": schedule.epochs,
        "nodes": nodes.len(),
        "dataset_bytes": total,
        "aggregate_capacity": capacities.iter().flatten().sum::<u64>(),
        "coverage": if total == 0 { 1.0 } else { covered as f64 / total as f64 },
        "covered_bytes": covered,
        "replication": if covered == 0 { 0.0 } else { held as f64 / covered as f64 },
        "expected_fs_bytes": fs_cluster,
        "expected_fs_bytes_nodes_alone": fs_alone,
        "minimum_fs_bytes": total + (schedule.epochs as u64).saturating_sub(1) * (total - covered.min(total)),
        "per_node": per_node,
        "seconds": seconds,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn counts_sum_to_epochs_over_all_ranks() {
        let s = Schedule::shuffle(1000, 4, 8, 5, 3, false).unwrap();
        let all = AccessCounts::compute(&s, &[0, 1, 2, 3]).unwrap();
        assert!(all.counts.iter().all(|&c| c == 5));
        let one = AccessCounts::compute(&s, &[1]).unwrap();
        assert_eq!(one.counts.iter().map(|&c| c as u64).sum::<u64>(), 5 * 250);
        // first need matches the stream.
        let e0 = s.rank_epoch(1, 0).unwrap();
        assert_eq!(one.first_need[e0.samples[0] as usize], 0);
        assert_eq!(one.first_need[e0.samples[7] as usize], 7);
    }

    #[test]
    fn groups_agree_with_one_group_at_a_time() {
        let s = Schedule::shuffle(997, 4, 8, 5, 11, false).unwrap();
        let groups = vec![vec![0, 1], vec![2], vec![3]];
        let all = AccessCounts::compute_groups(&s, &groups).unwrap();
        for (g, acc) in groups.iter().zip(&all) {
            let one = AccessCounts::compute(&s, g).unwrap();
            assert_eq!(acc.counts, one.counts);
            assert_eq!(acc.first_need, one.first_need);
        }
    }

    #[test]
    fn expectation_matches_paper_example() {
        // ImageNet-1k, N=16, E=90: ~31,635 samples are read more than 10 times by one worker.
        let h = expected_histogram(1_281_167, 90, 16, 1);
        let above: f64 = h.iter().filter(|(&c, _)| c > 10).map(|(_, v)| v).sum();
        assert!((above - 31_635.0).abs() < 400.0, "{above}");
        let total: f64 = h.values().sum();
        assert!((total - 1_281_167.0).abs() < 1.0);
    }

    #[test]
    fn most_frequent_go_to_fastest_class() {
        let access = AccessCounts {
            counts: vec![1, 5, 3, 0, 5],
            first_need: vec![4, 3, 2, 1, 0],
        };
        let p = Placement::compute(&access, |_| 100, &[200, 100]);
        assert_eq!(p.class_of, vec![UNCACHED, 0, 1, UNCACHED, 0]);
        assert_eq!(p.fill_order[0], vec![4, 1]);
        assert_eq!(p.offset[4], 0);
        assert_eq!(p.offset[1], 100);
    }

    fn cluster(
        n: u64,
        nodes: u32,
        per_node: u32,
        epochs: u32,
        seed: u64,
        cap: u64,
    ) -> (Vec<AccessCounts>, ClusterPlacement) {
        let world = nodes * per_node;
        let s = Schedule::shuffle(n, world, 4, epochs, seed, false).unwrap();
        let groups: Vec<Vec<u32>> = (0..nodes)
            .map(|i| (i * per_node..(i + 1) * per_node).collect())
            .collect();
        let access = AccessCounts::compute_groups(&s, &groups).unwrap();
        let caps = vec![vec![cap]; nodes as usize];
        let p = ClusterPlacement::compute(&access, |_| 100, &caps);
        (access, p)
    }

    #[test]
    fn cluster_covers_the_dataset_when_capacity_allows() {
        // 4 nodes at 30 % of 2,000 samples each: 120 % in all.
        let (access, p) = cluster(2000, 4, 2, 4, 7, 600 * 100);
        assert!(p.primary.iter().all(|&n| n != NO_NODE), "every sample has a primary");
        for (i, node) in p.nodes.iter().enumerate() {
            assert!(node.used[0] <= 600 * 100);
            for k in 0..2000 {
                if p.primary[k] == i as u16 {
                    assert_ne!(node.class_of[k], UNCACHED, "a primary holds its sample");
                }
            }
        }
        // The room beyond coverage holds replicas of each node's own frequent samples.
        let held: u64 = p.nodes.iter().map(|n| n.samples[0]).sum();
        assert!(held > 2000 && held <= 2400, "{held}");
        assert_eq!(p.expected_storage_bytes(&access, |_| 100), 2000 * 100);
        assert_eq!(p.covered_bytes(|_| 100), 2000 * 100);
    }

    #[test]
    fn cluster_below_dataset_reaches_the_minimum_storage_reads() {
        // 4 nodes at 12.5 %: half the dataset cached; S + (E-1)(S-C) is the least the storage
        // can deliver over E epochs.
        let (access, p) = cluster(2000, 4, 2, 4, 3, 250 * 100);
        assert_eq!(p.covered_bytes(|_| 100), 1000 * 100);
        let (s, c, e) = (2000u64 * 100, 1000u64 * 100, 4u64);
        assert_eq!(p.expected_storage_bytes(&access, |_| 100), s + (e - 1) * (s - c));
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
    fn cluster_placement_is_deterministic_and_one_node_matches_placement() {
        let (_, a) = cluster(1500, 3, 2, 3, 11, 400 * 100);
        let (_, b) = cluster(1500, 3, 2, 3, 11, 400 * 100);
        assert_eq!(a.primary, b.primary);
        for (x, y) in a.nodes.iter().zip(&b.nodes) {
            assert_eq!(x.class_of, y.class_of);
            assert_eq!(x.offset, y.offset);
            assert_eq!(x.fill_order, y.fill_order);
        }
        // One node: the same samples as the one-node placement.
        let s = Schedule::shuffle(1500, 2, 4, 3, 5, false).unwrap();
        let acc = AccessCounts::compute(&s, &[0, 1]).unwrap();
        let one = Placement::compute(&acc, |_| 100, &[300 * 100]);
        let c = ClusterPlacement::compute(std::slice::from_ref(&acc), |_| 100, &[vec![300 * 100]]);
        let set = |cl: &[u8]| -> Vec<usize> { (0..cl.len()).filter(|&k| cl[k] != UNCACHED).collect() };
        assert_eq!(set(&one.class_of), set(&c.nodes[0].class_of));
    }

    proptest! {
        #[test]
        fn capacity_never_exceeded(sizes in proptest::collection::vec(1u64..5000, 1..300), caps in proptest::collection::vec(0u64..100_000, 0..4), seed: u64) {
            let s = Schedule::shuffle(sizes.len() as u64, 2, 3, 3, seed, false);
            prop_assume!(s.is_ok());
            let access = AccessCounts::compute(&s.unwrap(), &[0]).unwrap();
            let p = Placement::compute(&access, |k| sizes[k as usize], &caps);
            for (j, &cap) in caps.iter().enumerate() {
                prop_assert!(p.used[j] <= cap);
                let members: Vec<u32> = (0..sizes.len() as u32).filter(|&k| p.class_of[k as usize] == j as u8).collect();
                prop_assert_eq!(members.iter().map(|&k| sizes[k as usize]).sum::<u64>(), p.used[j]);
                // Non-overlapping static layout.
                let mut spans: Vec<(u64, u64)> = members.iter().map(|&k| (p.offset[k as usize], p.offset[k as usize] + sizes[k as usize])).collect();
                spans.sort();
                prop_assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0));
                prop_assert!(spans.last().is_none_or(|s| s.1 <= cap));
            }
        }
    }
}
