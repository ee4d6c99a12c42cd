//! Cluster-wide placement: which node keeps which sample in which storage class, exactly as the
//! engine places it (`clairvoyant_core::plan::ClusterPlacement`, see its documentation):
//! coverage first (each sample on the node that uses it most, with room), then replication of
//! each node's own most used samples. The node chosen first is the sample's *home* (the engine's
//! primary): the one node that reads it from the file system; the others get it from there.

use clairvoyant_core::error::Result;
use clairvoyant_core::plan::{node_of_rank, AccessCounts, ClusterAccess, ClusterPlacement, NO_NODE, TOP};
use clairvoyant_core::schedule::Schedule;

/// Where every node keeps what.
pub struct ClusterPlan {
    /// Per node and sample: its class there, or `UNCACHED`.
    pub class_of: Vec<Vec<u8>>,
    /// Per node and class: the samples to fill it with, in the order they are needed (by any
    /// node for those it is home to, by itself for replicas).
    pub fill_order: Vec<Vec<Vec<u32>>>,
    /// Per sample: its home node (`u32::MAX`: cached nowhere).
    pub home: Vec<u32>,
    /// Bytes placed per node and class.
    pub used: Vec<Vec<u64>>,
}

/// Cluster-wide placement of the samples that nodes `counts[n]` (node n's ranks: `groups[n]`)
/// access in `schedule`, into classes of `capacities` bytes (the same on every node, fastest
/// first). Deterministic, and the engine's: each node's placement is the one that node computes.
pub fn cluster_placement(
    schedule: &Schedule,
    groups: &[Vec<u32>],
    counts: &[AccessCounts],
    size: impl Fn(u32) -> u64 + Sync,
    capacities: &[u64],
) -> Result<ClusterPlan> {
    // Up to TOP nodes the summaries hold every node's exact count either way, so they are
    // built from the counts at hand instead of streaming over the epochs again.
    let access = if counts.len() <= TOP {
        ClusterAccess::from_nodes(counts)?
    } else {
        ClusterAccess::compute(schedule, &node_of_rank(groups, schedule.world_size)?, 0, |_, _| Ok(()))?
    };
    let caps: Vec<Vec<u64>> = counts.iter().map(|_| capacities.to_vec()).collect();
    let detail: Vec<(usize, &AccessCounts)> = counts.iter().enumerate().collect();
    let p = ClusterPlacement::compute_classes(&access, size, &caps, &detail);
    let home = p
        .primary
        .iter()
        .map(|&n| if n == NO_NODE { u32::MAX } else { n as u32 })
        .collect();
    let mut class_of = Vec::with_capacity(p.nodes.len());
    let mut fill_order = Vec::with_capacity(p.nodes.len());
    let mut used = Vec::with_capacity(p.nodes.len());
    for n in p.nodes {
        class_of.push(n.class_of);
        fill_order.push(n.fill_order);
        used.push(n.used);
    }
    Ok(ClusterPlan {
        class_of,
        fill_order,
        home,
        used,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clairvoyant_core::plan::UNCACHED;

    fn acc(counts: Vec<u32>, first_need: Vec<u64>) -> AccessCounts {
        AccessCounts { counts, first_need }
    }

    fn place(counts: &[AccessCounts], capacity: u64) -> ClusterPlan {
        // Up to four nodes the placement comes from the counts alone (the schedule is not read).
        let schedule = Schedule::shuffle(counts[0].counts.len() as u64, 1, 1, 1, 0, false).unwrap();
        let groups: Vec<Vec<u32>> = (0..counts.len() as u32)
            .map(|n| if n == 0 { vec![0] } else { vec![] })
            .collect();
        cluster_placement(&schedule, &groups, counts, |_| 10, &[capacity]).unwrap()
    }

    #[test]
    fn covers_first_then_replicates() {
        // 4 samples of 10 bytes, two nodes of 20 bytes each: aggregate 40 = the dataset, so
        // every sample is held exactly once, by the node that uses it most where it is clear.
        let a = acc(vec![3, 1, 2, 2], vec![0, 5, 1, 9]);
        let b = acc(vec![1, 3, 2, 2], vec![2, 0, 4, 3]);
        let p = place(&[a.clone(), b.clone()], 20);
        assert_eq!(&p.home[..2], &[0, 1], "the node that uses it most");
        assert_ne!(p.home[2], p.home[3], "ties are spread over the nodes");
        for k in 0..4 {
            let holders = (0..2).filter(|&n| p.class_of[n][k] != UNCACHED).count();
            assert_eq!(holders, 1, "sample {k} held once");
        }
        // Fill orders: by first need over the nodes.
        for n in 0..2 {
            let order = &p.fill_order[n][0];
            let need = |k: u32| a.first_need[k as usize].min(b.first_need[k as usize]);
            assert!(order.windows(2).all(|w| need(w[0]) <= need(w[1])), "{order:?}");
        }

        // Twice the room: coverage, then each node adds its own most used samples.
        let p = place(&[a, b], 30);
        assert_eq!(&p.home[..2], &[0, 1]);
        let held: Vec<usize> = (0..2)
            .map(|n| (0..4).filter(|&k| p.class_of[n][k] != UNCACHED).count())
            .collect();
        assert_eq!(held, vec![3, 3], "each node replicates its next most used");
        assert_eq!(p.class_of[0][1], UNCACHED, "node 0's least used stays with node 1");
        assert_eq!(p.used, vec![vec![30], vec![30]]);
    }

    #[test]
    fn a_full_node_passes_samples_to_the_next() {
        // Node 0 uses everything most but holds only one sample: the rest go to node 1.
        let a = acc(vec![5, 5, 5], vec![0, 1, 2]);
        let b = acc(vec![1, 1, 1], vec![0, 1, 2]);
        let p = place(&[a, b], 10);
        assert_eq!(p.home[0], 0);
        assert_eq!(p.home[1], 1);
        assert_eq!(p.home[2], u32::MAX, "aggregate capacity is two samples");
    }
}
