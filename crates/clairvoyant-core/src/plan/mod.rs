//! Access frequencies and placement (NoPFS Sec. 3.1 and 5.1): how often the node's ranks will
//! read each sample over the whole run, and which storage class caches which samples: the most
//! frequently read go to the fastest class, until every class is full.

use std::collections::BTreeMap;

use rayon::prelude::*;

use crate::error::Result;
use crate::schedule::Schedule;

mod cluster;
mod shared;
mod spec;
pub use cluster::*;
pub use shared::*;
pub use spec::ReportSpec;

/// Samples in order of need (then index): the order to fill a class in.
fn by_need(mut keyed: Vec<(u64, u32)>) -> Vec<u32> {
    keyed.par_sort_unstable();
    keyed.into_iter().map(|(_, k)| k).collect()
}

/// Sentinel for "not cached in any class".
pub const UNCACHED: u8 = u8::MAX;

/// Per-sample access counts of a set of ranks over the whole run, and when each sample is first
/// needed by any of them (`epoch << 32 | position in that rank's epoch stream`; `u64::MAX` if
/// never). Ranks advance in lock step, so positions of different ranks are comparable.
#[derive(Clone, Debug)]
pub struct AccessCounts {
    /// Reads of each sample over the whole run, indexed by sample.
    pub counts: Vec<u32>,
    /// When each sample is first needed (`epoch << 32 | position`; `u64::MAX`: never).
    pub first_need: Vec<u64>,
}

impl AccessCounts {
    /// Count the accesses of `ranks` (one rank, or all ranks of a node) over every epoch.
    /// One shuffle per epoch, epochs in parallel, per-thread counters merged at the end.
    pub fn compute(schedule: &Schedule, ranks: &[u32]) -> Result<Self> {
        Self::compute_from(schedule, ranks, 0)
    }

    /// No sample read yet, over `samples` samples.
    pub fn empty(samples: usize) -> Self {
        AccessCounts {
            counts: crate::mem::huge_vec(samples, 0),
            first_need: crate::mem::huge_vec(samples, u64::MAX),
        }
    }

    /// Count one rank's stream of `epoch`.
    #[inline]
    pub fn add_stream(&mut self, epoch: u32, samples: &[u32]) {
        for (pos, &k) in samples.iter().enumerate() {
            self.counts[k as usize] += 1;
            let slot = &mut self.first_need[k as usize];
            *slot = (*slot).min(((epoch as u64) << 32) | pos as u64);
        }
    }

    /// The counts of both (per-thread counters merged).
    fn merge(mut self, other: Self) -> Self {
        for (x, y) in self.counts.iter_mut().zip(other.counts) {
            *x += y;
        }
        for (x, y) in self.first_need.iter_mut().zip(other.first_need) {
            *x = (*x).min(y);
        }
        self
    }

    /// Like [`AccessCounts::compute`] over epochs `first..` only (a resumed run).
    pub fn compute_from(schedule: &Schedule, ranks: &[u32], first: u32) -> Result<Self> {
        let f = schedule.num_samples() as usize;
        for e in 0..schedule.epochs {
            schedule.layout(e)?;
        }
        (first.min(schedule.epochs)..schedule.epochs)
            .into_par_iter()
            .try_fold(
                || Self::empty(f),
                |mut acc, e| -> Result<AccessCounts> {
                    let global = schedule.global_order(e);
                    for stream in schedule.split(e, &global, ranks)? {
                        acc.add_stream(e, &stream.samples);
                    }
                    Ok(acc)
                },
            )
            .try_reduce(|| Self::empty(f), |a, b| Ok(a.merge(b)))
    }

    /// The counts of given streams: `streams[e][i]` is rank i's stream in epoch `first + e`.
    pub fn from_streams(samples: usize, first: u32, streams: &[Vec<crate::schedule::RankEpoch>]) -> Self {
        streams
            .par_iter()
            .enumerate()
            .fold(
                || Self::empty(samples),
                |mut acc, (e, ranks)| {
                    for stream in ranks {
                        acc.add_stream(first + e as u32, &stream.samples);
                    }
                    acc
                },
            )
            .reduce(|| Self::empty(samples), Self::merge)
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
        let mut out: Vec<AccessCounts> = groups.iter().map(|_| Self::empty(f)).collect();
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
                            acc.add_stream(e, &stream.samples);
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
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    /// Per sample, the index of the class caching it, or [`UNCACHED`].
    pub class_of: Vec<u8>,
    /// Per sample, its byte offset inside its class (unused where uncached).
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
            *list = by_need(list.iter().map(|&k| (access.first_need[k as usize], k)).collect());
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

/// The `plan` report: measured and expected access-count histograms of `ranks` and the
/// placement of their samples into `classes` (name, capacity in bytes; fastest first).
pub fn report(
    schedule: &Schedule,
    ranks: &[u32],
    size: impl Fn(u32) -> u64,
    classes: &[(String, u64)],
) -> Result<serde_json::Value> {
    let t0 = std::time::Instant::now();
    let f = schedule.num_samples() as u64;
    check_plan_memory(f, false, &format!("{f} samples"))?;
    let access = AccessCounts::compute(schedule, ranks)?;
    let capacities: Vec<u64> = classes.iter().map(|c| c.1).collect();
    let placement = Placement::compute(&access, &size, &capacities);
    let seconds = t0.elapsed().as_secs_f64();
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
