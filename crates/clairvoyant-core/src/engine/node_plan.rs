//! One plan per node: the first local rank to get the turn computes the node's plan (placement,
//! the cluster's primary table, and the local ranks' streams when they are small enough to
//! share) and writes it into the node cache ([`crate::plan::NodePlan`]); the other local ranks
//! wait for it and read it, checking its checksum. A rank that finds no usable plan (the first
//! could not write it, it is damaged) computes its own, with a warning: the result is the same,
//! only slower.

use std::sync::Arc;
use std::time::Duration;

use super::{AgentCounts, JobSpec};
use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::plan::{AccessCounts, ClusterPlacement, NodePlan, Placement};
use crate::schedule::RankEpoch;
use crate::source::Source;
use crate::tier::NodeCache;

/// Local ranks' streams are put into the shared plan up to this many bytes in all; above it
/// (few ranks over a large dataset: the streams are large and cheap to shuffle again) each rank
/// shuffles its own.
const SHARED_STREAMS_BYTES: u64 = 256 << 20;

/// How long local ranks wait for the first to publish the node's plan while it lives.
const PLAN_WAIT: Duration = Duration::from_secs(1800);

/// Where a rank's plan came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanOrigin {
    /// Computed by this rank (the node's first, or alone).
    Computed,
    /// Read from the plan the node's first rank shared.
    Shared,
    /// Taken from another job of this process over the same node cache.
    Process,
}

impl PlanOrigin {
    /// The origin's lower-case name, as reported in statistics.
    pub fn name(self) -> &'static str {
        match self {
            PlanOrigin::Computed => "computed",
            PlanOrigin::Shared => "shared",
            PlanOrigin::Process => "process",
        }
    }
}

/// The node's plan for this rank, this rank's stream when the plan carried it, and where the
/// plan came from.
pub(super) fn shared_plan(
    cache: &NodeCache,
    source: &Arc<dyn Source>,
    spec: &JobSpec,
    capacities: &[u64],
    clock: &dyn Clock,
) -> Result<(NodePlan, Option<Vec<RankEpoch>>, PlanOrigin)> {
    let local = spec.local_ranks.len();
    let rank_index = spec
        .local_ranks
        .iter()
        .position(|&r| r == spec.rank)
        .expect("validated");
    let sched = &spec.schedule;
    let epochs_left = sched.epochs.saturating_sub(spec.first_epoch) as u64;
    let stream_bytes = (0..sched.epochs)
        .map(|e| sched.layout(e).map_or(0, |l| l.epoch_len))
        .sum::<u64>()
        .saturating_mul(4 * local as u64)
        / sched.world_size.max(1) as u64;
    let share_streams = local > 1 && spec.agent.is_none() && epochs_left > 0 && stream_bytes <= SHARED_STREAMS_BYTES;
    if local == 1 {
        let mut plan = compute_plan(source, spec, capacities, false)?;
        let mine = plan.streams.pop();
        return Ok((plan, mine, PlanOrigin::Computed));
    }
    let path = cache.dir().join(format!("{}.plan", cache.stem()));
    let mut computed: Option<Result<NodePlan>> = None;
    let mut own_stream = None;
    let (code, _) = cache.state().plan_turn(PLAN_WAIT, clock, || {
        let mut plan = compute_plan(source, spec, capacities, share_streams);
        if let (Ok(p), false) = (&mut plan, share_streams) {
            // Only the streams of every local rank are shared; this one's own stays here.
            own_stream = p.streams.pop();
        }
        let code = match &plan {
            Ok(p) => match p.write(&path) {
                Ok(()) => 2,
                Err(e) => {
                    crate::tier::warn_once(
                        "node-plan-write",
                        &format!("the node's plan could not be shared ({e}); the other local ranks compute it themselves"),
                    );
                    3
                }
            },
            Err(_) => 3,
        };
        computed = Some(plan);
        code
    })?;
    let (mut plan, origin) = match computed {
        Some(plan) => (plan?, PlanOrigin::Computed),
        None if code == 2 => match NodePlan::read(&path, source.len(), if share_streams { local } else { 0 }) {
            Ok(plan) => (plan, PlanOrigin::Shared),
            Err(e) => {
                crate::tier::warn_once(
                    "node-plan-read",
                    &format!("the node's plan is unusable ({e}); this rank computes it itself"),
                );
                (compute_plan(source, spec, capacities, false)?, PlanOrigin::Computed)
            }
        },
        None => (compute_plan(source, spec, capacities, false)?, PlanOrigin::Computed),
    };
    let mine = if plan.streams.len() == local {
        Some(std::mem::take(&mut plan.streams[rank_index]))
    } else {
        own_stream.or_else(|| plan.streams.pop())
    };
    plan.streams.clear();
    Ok((plan, mine, origin))
}

/// Compute the node's plan. `all_streams`: keep every local rank's stream (to share them), else
/// only this rank's when it comes for free (`streams` is then empty or this rank's alone).
fn compute_plan(source: &Arc<dyn Source>, spec: &JobSpec, capacities: &[u64], all_streams: bool) -> Result<NodePlan> {
    let sched = &spec.schedule;
    let f = source.len();
    let first = spec.first_epoch;
    let size = |k: u32| source.size(k);
    let given = spec.agent.as_ref().and_then(|a| a.counts.as_ref());
    let keep: Vec<u32> = if all_streams {
        spec.local_ranks.clone()
    } else if spec.agent.is_none() {
        vec![spec.rank]
    } else {
        Vec::new()
    };
    // Streams per epoch (as computed) into streams per rank.
    let by_rank = |epochs: Vec<Vec<RankEpoch>>| -> Vec<Vec<RankEpoch>> {
        let mut out: Vec<Vec<RankEpoch>> = (0..keep.len()).map(|_| Vec::with_capacity(epochs.len())).collect();
        for e in epochs {
            for (i, s) in e.into_iter().enumerate() {
                out[i].push(s);
            }
        }
        out
    };
    match &spec.cluster {
        None => {
            let (access, streams) = match given {
                Some(a) => (a.own.clone(), Vec::new()),
                None if all_streams => {
                    let epochs = sched.streams_from(&keep, first)?;
                    (AccessCounts::from_streams(f, first, &epochs), by_rank(epochs))
                }
                None => {
                    crate::plan::check_plan_memory(f as u64, false, &format!("{f} samples"))?;
                    (AccessCounts::compute_from(sched, &spec.local_ranks, first)?, Vec::new())
                }
            };
            Ok(NodePlan {
                placement: Placement::compute(&access, size, capacities),
                primary: None,
                streams,
            })
        }
        Some(c) => {
            let computed;
            let (access, own, streams) = match given {
                Some(AgentCounts {
                    own,
                    cluster: Some(cluster),
                }) if cluster.samples.len() == f => (&**cluster, own, Vec::new()),
                Some(_) => {
                    return Err(Error::config(
                        "agent.counts",
                        format!("the cluster's summaries for {f} samples are missing or of another size"),
                    ))
                }
                None => {
                    crate::plan::check_plan_memory(f as u64, true, &format!("{f} samples on {} nodes", c.nodes.len()))?;
                    let (access, own, epochs) = crate::plan::node_access(sched, &c.nodes, c.node, first, &keep)?;
                    computed = (access, own);
                    (&computed.0, &computed.1, by_rank(epochs))
                }
            };
            let mut all = ClusterPlacement::compute(access, size, &c.capacities, &[(c.node, own)]);
            Ok(NodePlan {
                placement: all.nodes.swap_remove(0),
                primary: Some(all.primary),
                streams,
            })
        }
    }
}
