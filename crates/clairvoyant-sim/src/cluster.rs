//! Cluster-wide placement: which node keeps which sample in which storage class, exactly as the
//! engine places it (`clairvoyant_core::plan::ClusterPlacement`, see its documentation):
//! coverage first (each sample on the node that uses it most, with room), then replication of
//! each node's own most used samples. The node chosen first is the sample's *home* (the engine's
//! primary): the one node that reads it from the file system; the others get it from there.

use clairvoyant_core::plan::{AccessCounts, ClusterPlacement, NO_NODE};

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

/// Cluster-wide placement of the samples that nodes `counts[n]` access, into classes of
/// `capacities` bytes (the same on every node, fastest first). Deterministic.
pub fn cluster_placement(counts: &[AccessCounts], size: impl Fn(u32) -> u64 + Sync, capacities: &[u64]) -> ClusterPlan {
    let caps: Vec<Vec<u64>> = counts.iter().map(|_| capacities.to_vec()).collect();
    let p = ClusterPlacement::compute(counts, size, &caps);
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
    use clairvoyant_core::plan::UNCACHED;

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
