//! What starting an engine takes, as one typed value: a caller (the Python bindings, a test, a
//! host process) fills an [`EngineSpec`] once, and [`EngineSpec::into_job`] checks it (every
//! error names the field) and turns it into the engine's [`JobSpec`]. The peer transport is not
//! this crate's business: the caller connects [`PeersDesc`] and hands the client in.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{AgentCounts, AgentSpec, ClusterSpec, JobSpec, PeerFetch};
use crate::error::{Error, Result};
use crate::plan::{hashed_access, hashed_counts, hashed_owners, order_with_hashed_rest, AccessCounts, ClusterAccess};
use crate::schedule::Schedule;
use crate::source::Source;

/// How long a peer may wait for a fill in progress when [`ClusterDesc::peer_wait`] is not given.
pub const DEFAULT_PEER_WAIT: Duration = Duration::from_secs(2);
/// Connections per peer when [`PeersDesc::connections`] is not given.
pub const DEFAULT_PEER_CONNECTIONS: usize = 4;

/// One job on one rank as its caller describes it (the arguments of `clairvoyant._native.Engine`).
#[derive(Clone, Debug, Default)]
pub struct EngineSpec {
    /// Samples per batch on each rank.
    pub batch_size: u32,
    /// Epochs of a shuffled schedule (ignored with `orders`).
    pub epochs: u32,
    /// Seed of a shuffled schedule.
    pub seed: u64,
    /// Whether each epoch's last partial global batch is dropped.
    pub drop_last: bool,
    /// This rank.
    pub rank: u32,
    /// Ranks of the job.
    pub world_size: u32,
    /// The ranks sharing this node's cache (including `rank`).
    pub local_ranks: Vec<u32>,
    /// The launcher's run id (see [`JobSpec::run_id`]).
    pub run_id: String,
    /// Explicit per-epoch global orders (any sampler, materialised) instead of a shuffle.
    pub orders: Option<Vec<Vec<u32>>>,
    /// First epoch to serve (a resumed run).
    pub start_epoch: u32,
    /// The other nodes of a multi-node job.
    pub cluster: Option<ClusterDesc>,
    /// A node agent's placement and fill (transparent mode).
    pub agent: Option<AgentDesc>,
}

/// A multi-node job's part (the `cluster` dict).
#[derive(Clone, Debug, Default)]
pub struct ClusterDesc {
    /// Every node's ranks, by node index.
    pub nodes: Vec<Vec<u32>>,
    /// This node's index.
    pub node: usize,
    /// Every node's class capacities in bytes, fastest class first.
    pub capacities: Vec<Vec<u64>>,
    /// How to reach the other nodes (None: peers are never asked).
    pub peers: Option<PeersDesc>,
    /// Seconds a peer may wait for a fill in progress (None: [`DEFAULT_PEER_WAIT`]).
    pub peer_wait: Option<f64>,
}

/// How to reach the other nodes' peer servers.
#[derive(Clone, Default)]
pub struct PeersDesc {
    /// One `host:port` per node (this node's own may be anything).
    pub addresses: Vec<String>,
    /// The job secret (at least 16 bytes).
    pub secret: Vec<u8>,
    /// The job id bound into the handshake.
    pub job: u64,
    /// Connections per peer (None: [`DEFAULT_PEER_CONNECTIONS`]).
    pub connections: Option<usize>,
}

impl std::fmt::Debug for PeersDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeersDesc")
            .field("addresses", &self.addresses)
            .field("secret", &"<hidden>")
            .field("job", &self.job)
            .field("connections", &self.connections)
            .finish()
    }
}

/// A node agent's job (the `agent` dict): owners by hashing each file's path relative to
/// `hashed`, or one pair of (counts, first need) arrays per node, or both (the files no node's
/// counts read are placed by hashed owners and filled when first read).
#[derive(Clone, Debug, Default)]
pub struct AgentDesc {
    /// Fill the placed samples ahead of use.
    pub prefill: bool,
    /// The dataset root paths are hashed relative to.
    pub hashed: Option<PathBuf>,
    /// Every node's access counts and first needs, one value per sample.
    pub counts: Option<Vec<(Vec<u32>, Vec<u64>)>>,
}

impl ClusterDesc {
    /// Checks what the engine's own checks do not: the peer wait and the peers' addresses.
    pub fn validate(&self) -> Result<()> {
        if let Some(w) = self.peer_wait {
            if !(w.is_finite() && w >= 0.0) {
                return Err(Error::config(
                    "cluster.peer_wait",
                    format!("must be a finite number of seconds >= 0, got {w}"),
                ));
            }
        }
        if let Some(p) = &self.peers {
            if p.addresses.len() != self.nodes.len() {
                return Err(Error::config(
                    "cluster.peers",
                    format!("{} peer addresses for {} nodes", p.addresses.len(), self.nodes.len()),
                ));
            }
            if p.connections == Some(0) {
                return Err(Error::config("cluster.connections", "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The engine's view, reaching the other nodes through `peers`.
    fn into_spec(self, peers: Option<Arc<dyn PeerFetch>>) -> ClusterSpec {
        ClusterSpec {
            nodes: self.nodes,
            node: self.node,
            capacities: self.capacities,
            peers,
            peer_wait: self.peer_wait.map_or(DEFAULT_PEER_WAIT, Duration::from_secs_f64),
        }
    }
}

impl AgentDesc {
    /// The agent's placement inputs over `source` for node `node` of `nodes`.
    pub fn resolve(self, source: &dyn Source, nodes: usize, node: usize) -> Result<AgentSpec> {
        let keys = self.hashed.as_deref().map(|root| hashed_keys(source, root));
        let mut fill_on_read = Vec::new();
        let counts = match (self.counts, keys) {
            (Some(pairs), keys) => {
                let all = counts_per_node(pairs, source.len(), nodes)?;
                let (all, cluster) = match keys {
                    Some(keys) => {
                        let p = order_with_hashed_rest(all, &keys)?;
                        fill_on_read = p.outside;
                        (p.nodes, p.cluster)
                    }
                    None if nodes > 1 => {
                        let c = ClusterAccess::from_nodes(&all)?;
                        (all, Some(c))
                    }
                    None => (all, None),
                };
                Some(AgentCounts {
                    own: all
                        .into_iter()
                        .nth(node)
                        .ok_or_else(|| bad_counts(nodes, source.len()))?,
                    cluster: cluster.map(Arc::new),
                })
            }
            (None, Some(keys)) => {
                let owners = hashed_owners(&keys, nodes);
                Some(AgentCounts {
                    own: hashed_counts(&keys, &owners, node),
                    cluster: (nodes > 1).then(|| Arc::new(hashed_access(&keys, &owners, nodes))),
                })
            }
            (None, None) => None,
        };
        Ok(AgentSpec {
            counts,
            prefill: self.prefill,
            fill_on_read,
        })
    }
}

/// Each sample's key for hashed ownership: the checksum of its path relative to `root`.
fn hashed_keys(source: &dyn Source, root: &std::path::Path) -> Vec<u64> {
    (0..source.len() as u32)
        .map(|k| {
            let p = source.path(k);
            let rel = p.strip_prefix(root).unwrap_or(&p);
            crate::tier::checksum(rel.as_os_str().as_encoded_bytes())
        })
        .collect()
}

fn bad_counts(nodes: usize, samples: usize) -> Error {
    Error::config(
        "agent.counts",
        format!("expected {nodes} pair(s) of {samples} counts and first needs"),
    )
}

/// One node's counts per pair, each checked to hold one value per sample.
fn counts_per_node(pairs: Vec<(Vec<u32>, Vec<u64>)>, samples: usize, nodes: usize) -> Result<Vec<AccessCounts>> {
    if pairs.len() != nodes || pairs.iter().any(|(c, f)| c.len() != samples || f.len() != samples) {
        return Err(bad_counts(nodes, samples));
    }
    Ok(pairs
        .into_iter()
        .map(|(counts, first_need)| AccessCounts { counts, first_need })
        .collect())
}

impl EngineSpec {
    /// The peers to connect before [`EngineSpec::into_job`], checked (None: none to reach).
    pub fn peers(&self) -> Result<Option<&PeersDesc>> {
        match &self.cluster {
            Some(c) => {
                c.validate()?;
                Ok(c.peers.as_ref())
            }
            None => Ok(None),
        }
    }

    /// The job over `source`: its schedule, cluster part (reaching the other nodes through
    /// `peers`, connected from [`EngineSpec::peers`]) and agent part, each checked. The engine
    /// checks the ranks against the schedule when it starts.
    pub fn into_job(self, source: &dyn Source, peers: Option<Arc<dyn PeerFetch>>) -> Result<JobSpec> {
        if let Some(c) = &self.cluster {
            c.validate()?;
        }
        let n = source.len() as u64;
        let schedule = match self.orders {
            Some(o) => Schedule::explicit(n, o, self.world_size, self.batch_size, self.drop_last),
            None => Schedule::shuffle(
                n,
                self.world_size,
                self.batch_size,
                self.epochs,
                self.seed,
                self.drop_last,
            ),
        }?;
        let cluster = self.cluster.map(|c| c.into_spec(peers));
        let (nodes, node) = cluster.as_ref().map_or((1, 0), |c| (c.nodes.len(), c.node));
        let agent = match self.agent {
            Some(a) => Some(a.resolve(source, nodes, node)?),
            None => None,
        };
        Ok(JobSpec {
            schedule,
            rank: self.rank,
            local_ranks: self.local_ranks,
            run_id: self.run_id,
            first_epoch: self.start_epoch,
            cluster,
            agent,
        })
    }
}

/// Where each batch of a pass over `samples` samples ends (see [`super::Engine::append_epoch`]),
/// from the batches' sizes: every batch holds at least one sample and the sizes add up to the
/// samples (errors name `batch_sizes`).
pub fn batch_ends(samples: usize, batch_sizes: &[u64]) -> Result<Vec<u32>> {
    let mut ends = Vec::with_capacity(batch_sizes.len());
    let mut end = 0u64;
    for (i, &b) in batch_sizes.iter().enumerate() {
        if b == 0 {
            return Err(Error::config(
                "batch_sizes",
                format!("batch {i} has size 0; every batch holds at least one sample"),
            ));
        }
        end = end.saturating_add(b);
        if end > samples as u64 {
            return Err(Error::config(
                "batch_sizes",
                format!("the sizes add up to more than the {samples} samples"),
            ));
        }
        ends.push(end as u32);
    }
    if end != samples as u64 {
        return Err(Error::config(
            "batch_sizes",
            format!("the sizes add up to {end} but there are {samples} samples"),
        ));
    }
    Ok(ends)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::synthetic::Synthetic;

    fn two_nodes() -> ClusterDesc {
        ClusterDesc {
            nodes: vec![vec![0], vec![1]],
            node: 0,
            capacities: vec![vec![1 << 20]; 2],
            peers: Some(PeersDesc {
                addresses: vec!["127.0.0.1:1".into(), "127.0.0.1:2".into()],
                secret: vec![7; 32],
                job: 1,
                connections: None,
            }),
            peer_wait: None,
        }
    }

    fn spec(cluster: Option<ClusterDesc>, agent: Option<AgentDesc>) -> EngineSpec {
        EngineSpec {
            batch_size: 2,
            epochs: 1,
            world_size: 2,
            local_ranks: vec![0],
            cluster,
            agent,
            ..EngineSpec::default()
        }
    }

    fn key_of(e: Error) -> String {
        match e {
            Error::Config { key, .. } => key,
            other => panic!("not a configuration error: {other}"),
        }
    }

    #[test]
    fn a_valid_spec_becomes_the_job_with_defaults_filled_in() {
        let src = Synthetic::new(vec![10; 8], vec![]);
        let job = spec(Some(two_nodes()), None).into_job(&src, None).unwrap();
        let c = job.cluster.unwrap();
        assert_eq!(c.peer_wait, DEFAULT_PEER_WAIT);
        assert_eq!((c.node, c.nodes.len()), (0, 2));
        assert_eq!(job.schedule.world_size, 2);
    }

    #[test]
    fn bad_cluster_values_name_their_field() {
        let mut c = two_nodes();
        c.peer_wait = Some(f64::INFINITY);
        assert_eq!(key_of(spec(Some(c), None).peers().unwrap_err()), "cluster.peer_wait");
        let mut c = two_nodes();
        c.peer_wait = Some(-1.0);
        assert_eq!(key_of(spec(Some(c), None).peers().unwrap_err()), "cluster.peer_wait");
        let mut c = two_nodes();
        c.peers.as_mut().unwrap().addresses.pop();
        let err = spec(Some(c), None).peers().unwrap_err();
        assert!(err.to_string().contains("1 peer addresses for 2 nodes"), "{err}");
        assert_eq!(key_of(err), "cluster.peers");
        let mut c = two_nodes();
        c.peers.as_mut().unwrap().connections = Some(0);
        assert_eq!(key_of(spec(Some(c), None).peers().unwrap_err()), "cluster.connections");
    }

    #[test]
    fn agent_counts_of_the_wrong_shape_name_the_field() {
        let src = Synthetic::new(vec![10; 8], vec![]);
        let agent = AgentDesc {
            counts: Some(vec![(vec![1; 8], vec![0; 7])]),
            ..AgentDesc::default()
        };
        let err = spec(None, Some(agent)).into_job(&src, None).unwrap_err();
        assert!(err.to_string().contains("1 pair(s) of 8 counts"), "{err}");
        assert_eq!(key_of(err), "agent.counts");
    }

    #[test]
    fn batch_ends_add_up_the_sizes_and_name_the_field_when_they_do_not() {
        assert_eq!(batch_ends(5, &[2, 2, 1]).unwrap(), vec![2, 4, 5]);
        assert_eq!(batch_ends(0, &[]).unwrap(), Vec::<u32>::new());
        for (sizes, says) in [
            (&[2, 0, 3][..], "batch 1 has size 0"),
            (&[4, 4][..], "more than the 5 samples"),
            (&[2, 2][..], "add up to 4 but there are 5"),
            (&[u64::MAX, u64::MAX][..], "more than the 5 samples"),
        ] {
            let e = batch_ends(5, sizes).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
            assert_eq!(key_of(e), "batch_sizes");
        }
    }

    #[test]
    fn hashed_agents_split_the_files_between_nodes() {
        let src = Synthetic::new(vec![10; 64], vec![]);
        let agent = AgentDesc {
            hashed: Some(PathBuf::from("/")),
            ..AgentDesc::default()
        };
        let mut c = two_nodes();
        c.peers = None;
        let job = spec(Some(c), Some(agent)).into_job(&src, None).unwrap();
        let counts = job.agent.unwrap().counts.unwrap();
        let own = counts.own.counts.iter().filter(|&&c| c == 2).count();
        assert!(0 < own && own < 64, "node 0 owns part of the files: {own}");
        assert!(counts.cluster.is_some());
    }
}
