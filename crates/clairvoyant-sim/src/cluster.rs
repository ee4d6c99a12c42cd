//! Cluster-wide placement: which node keeps which sample in which storage class.
//!
//! SIMULATOR-SIDE COPY, to be replaced: the engine is getting the same placement as
//! `clairvoyant_core::plan::ClusterPlacement`. Until it is there, [`cluster_placement`] is the
//! one function that computes it; once it is, that function should call core's and convert.
//!
//! The rule (NoPFS Sec. 3.1, Lemma 1: the nodes' most used samples are largely complementary):
//!
//! 1. **Coverage.** Samples are taken in order of how much their most frequent user needs them
//!    (access count descending, then earliest first need, then sample id). Each goes to one
//!    node only: the node that uses it most (ties: the node that needs it first, then the lowest
//!    node), or, when that node is full, the next node in that order with room; within a node
//!    the fastest class with room. Whenever the aggregate capacity allows, every sample used at
//!    all is cached exactly once in the cluster.
//! 2. **Replication.** Capacity left over then takes each node's own most used samples that it
//!    does not hold yet (count descending, first need, id), fastest class first.
//!
//! Each node fills each class in the order its own workers first need the samples. The node
//! chosen in step 1 is the sample's *home*: while nobody holds a copy yet, the node that reads
//! the sample from the file system first hands it on to its home, so the file system is read
//! once per cached sample across the cluster.

use clairvoyant_core::plan::{AccessCounts, UNCACHED};
use rayon::prelude::*;

/// Where every node keeps what.
pub struct ClusterPlan {
    /// Per node and sample: its class there, or `UNCACHED`.
    pub class_of: Vec<Vec<u8>>,
    /// Per node and class: the samples to fill it with, in the order the node first needs them.
    pub fill_order: Vec<Vec<Vec<u32>>>,
    /// Per sample: its home node (`u32::MAX`: cached nowhere).
    pub home: Vec<u32>,
    /// Bytes placed per node and class.
    pub used: Vec<Vec<u64>>,
}

/// Room left in a node's classes; a class that cannot take even a tiny sample more is full.
struct Room {
    used: Vec<u64>,
    full: Vec<bool>,
}

impl Room {
    /// The fastest class with room for `s` bytes, taking them.
    fn take(&mut self, s: u64, caps: &[u64]) -> Option<usize> {
        for (j, &cap) in caps.iter().enumerate() {
            if self.full[j] {
                continue;
            }
            if self.used[j] + s <= cap {
                self.used[j] += s;
                return Some(j);
            }
            if cap - self.used[j] < 64 {
                self.full[j] = true;
            }
        }
        None
    }

    fn is_full(&self) -> bool {
        self.full.iter().all(|&f| f)
    }
}

/// Cluster-wide placement of the samples that nodes `counts[n]` access, into classes of
/// `capacities` bytes (the same on every node, fastest first). Deterministic.
pub fn cluster_placement(counts: &[AccessCounts], size: impl Fn(u32) -> u64 + Sync, capacities: &[u64]) -> ClusterPlan {
    assert!(capacities.len() < UNCACHED as usize);
    let nodes = counts.len();
    let f = counts.first().map_or(0, |c| c.counts.len());
    // Each sample's preferred node: most accesses, then earliest first need, then lowest node,
    // found in one sequential pass. Key: (its count descending, its first need, sample, node).
    let rank = |ku: usize, n: usize| (std::cmp::Reverse(counts[n].counts[ku]), counts[n].first_need[ku], n);
    let mut keyed: Vec<(std::cmp::Reverse<u32>, u64, u32, u32)> = (0..f as u32)
        .into_par_iter()
        .filter_map(|k| {
            let ku = k as usize;
            let (c, need, n) = (0..nodes).map(|n| rank(ku, n)).min()?;
            (c.0 > 0).then_some((c, need, k, n as u32))
        })
        .collect();
    keyed.par_sort_unstable();
    let mut room: Vec<Room> = (0..nodes)
        .map(|_| Room {
            used: vec![0; capacities.len()],
            full: vec![false; capacities.len()],
        })
        .collect();
    let mut class_of = vec![vec![UNCACHED; f]; nodes];
    let mut home = vec![u32::MAX; f];
    let mut order: Vec<usize> = Vec::with_capacity(nodes);
    let mut full_nodes = 0;
    for &(_, _, k, best) in &keyed {
        if full_nodes == nodes {
            break;
        }
        let ku = k as usize;
        let s = size(k);
        let mut try_node = |n: usize, room: &mut Vec<Room>| {
            let was_full = room[n].is_full();
            let got = room[n].take(s, capacities);
            if !was_full && room[n].is_full() {
                full_nodes += 1;
            }
            got.map(|j| {
                class_of[n][ku] = j as u8;
                home[ku] = n as u32;
            })
        };
        if try_node(best as usize, &mut room).is_some() {
            continue;
        }
        // The preferred node is full: the next in the same order (rare; looked up only now).
        order.clear();
        order.extend((0..nodes).filter(|&n| n != best as usize && counts[n].counts[ku] > 0));
        order.sort_by_key(|&n| rank(ku, n));
        for &n in &order {
            if try_node(n, &mut room).is_some() {
                break;
            }
        }
    }
    drop(keyed);
    // Replication: each node's own most used samples it does not hold, while room is left.
    let placed: Vec<(Vec<u8>, Room)> = class_of
        .into_par_iter()
        .zip(room)
        .enumerate()
        .map(|(n, (mut mine, mut room))| {
            if room.is_full() {
                return (mine, room);
            }
            let acc = &counts[n];
            let mut keyed: Vec<(std::cmp::Reverse<u32>, u64, u32)> = (0..f as u32)
                .filter(|&k| acc.counts[k as usize] > 0 && mine[k as usize] == UNCACHED)
                .map(|k| (std::cmp::Reverse(acc.counts[k as usize]), acc.first_need[k as usize], k))
                .collect();
            keyed.sort_unstable();
            for (_, _, k) in keyed {
                if room.is_full() {
                    break;
                }
                if let Some(j) = room.take(size(k), capacities) {
                    mine[k as usize] = j as u8;
                }
            }
            (mine, room)
        })
        .collect();
    let mut class_of = Vec::with_capacity(nodes);
    let mut used = Vec::with_capacity(nodes);
    let mut fill_order = Vec::with_capacity(nodes);
    for (n, (mine, room)) in placed.into_iter().enumerate() {
        let acc = &counts[n];
        let mut lists: Vec<Vec<(u64, u32)>> = vec![Vec::new(); capacities.len()];
        for (k, &j) in mine.iter().enumerate() {
            if j != UNCACHED {
                lists[j as usize].push((acc.first_need[k], k as u32));
            }
        }
        fill_order.push(
            lists
                .into_iter()
                .map(|mut l| {
                    l.par_sort_unstable();
                    l.into_iter().map(|(_, k)| k).collect()
                })
                .collect(),
        );
        class_of.push(mine);
        used.push(room.used);
    }
    ClusterPlan {
        class_of,
        fill_order,
        home,
        used,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(counts: Vec<u32>, first_need: Vec<u64>) -> AccessCounts {
        AccessCounts { counts, first_need }
    }

    #[test]
    fn covers_first_then_replicates() {
        // 4 samples of 10 bytes, two nodes of 20 bytes each: aggregate 40 = the dataset, so
        // every sample is held exactly once, by the node that uses it most.
        let a = acc(vec![3, 1, 2, 2], vec![0, 5, 1, 9]);
        let b = acc(vec![1, 3, 2, 2], vec![2, 0, 4, 3]);
        let p = cluster_placement(&[a, b], |_| 10, &[20]);
        assert_eq!(p.home, vec![0, 1, 0, 1], "ties: the node that needs it first");
        for k in 0..4 {
            let holders = (0..2).filter(|&n| p.class_of[n][k] != UNCACHED).count();
            assert_eq!(holders, 1, "sample {k} held once");
        }
        assert_eq!(p.fill_order[0][0], vec![0, 2], "first-need order of node 0");
        assert_eq!(p.fill_order[1][0], vec![1, 3]);

        // Twice the room: coverage, then each node adds its own most used samples.
        let a = acc(vec![3, 1, 2, 2], vec![0, 5, 1, 9]);
        let b = acc(vec![1, 3, 2, 2], vec![2, 0, 4, 3]);
        let p = cluster_placement(&[a, b], |_| 10, &[30]);
        assert_eq!(p.home, vec![0, 1, 0, 1]);
        assert_eq!(p.class_of[0][3], 0, "node 0 replicates its next most used (count 2)");
        assert_eq!(p.class_of[1][2], 0);
        assert_eq!(p.used, vec![vec![30], vec![30]]);
    }

    #[test]
    fn a_full_node_passes_samples_to_the_next() {
        // Node 0 uses everything most but holds only one sample: the rest go to node 1.
        let a = acc(vec![5, 5, 5], vec![0, 1, 2]);
        let b = acc(vec![1, 1, 1], vec![0, 1, 2]);
        let p = cluster_placement(&[a, b], |_| 10, &[10]);
        assert_eq!(p.home[0], 0);
        assert_eq!(p.home[1], 1);
        assert_eq!(p.home[2], u32::MAX, "aggregate capacity is two samples");
    }
}
