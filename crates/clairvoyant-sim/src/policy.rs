//! The data-loading policies the simulator compares (NoPFS paper, Sec. 6).

use clairvoyant_core::{Error, Result};

/// A data-loading policy the simulator can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// No stalls at all: the lower bound.
    Perfect,
    /// Every sample read from the PFS when it is needed; no prefetching, no caching.
    Naive,
    /// Double buffering: staging threads prefetch the access stream into a bounded staging
    /// buffer from one location (the PFS by default) and drop each sample once used.
    StagingBuffer,
    /// DeepIO, ordered mode: the first epoch fills the workers' memory with what they read;
    /// later reads come from any worker's memory (over the interconnect) or, when not cached, the PFS.
    DeepIoOrdered,
    /// DeepIO, opportunistic mode: as ordered, but after the first epoch a sample not cached
    /// anywhere is replaced by a cached one, so the PFS is not read again (the order changes).
    DeepIoOpportunistic,
    /// Data sharding: before training each worker copies its shard of the dataset to its local
    /// storage, then trains on that shard only.
    ParallelStaging,
    /// LBANN data store, dynamic: the first epoch reads from the PFS and keeps each sample in
    /// its reader's memory; later epochs fetch from memory. Fails beyond aggregate memory.
    LbannDynamic,
    /// LBANN data store, preloading: the dataset is partitioned into the workers' memory before
    /// training. Fails beyond aggregate memory.
    LbannPreloading,
    /// Yang and Cong: workers cache what they read; within every global batch, samples are
    /// reassigned to the worker that caches them where possible; the rest come from the PFS.
    LocalityAware,
    /// This project: access-frequency placement over all storage classes, class prefetchers
    /// filling in first-need order, staging from the fastest location (local, a peer, the PFS).
    Clairvoyant,
}

impl Policy {
    /// Every policy, in the order reports list them.
    pub const ALL: [Policy; 10] = [
        Policy::Perfect,
        Policy::Naive,
        Policy::StagingBuffer,
        Policy::DeepIoOrdered,
        Policy::DeepIoOpportunistic,
        Policy::ParallelStaging,
        Policy::LbannDynamic,
        Policy::LbannPreloading,
        Policy::LocalityAware,
        Policy::Clairvoyant,
    ];

    /// The policy's name as scenarios, the command line and reports spell it.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Perfect => "perfect",
            Policy::Naive => "naive",
            Policy::StagingBuffer => "staging-buffer",
            Policy::DeepIoOrdered => "deepio-ordered",
            Policy::DeepIoOpportunistic => "deepio-opportunistic",
            Policy::ParallelStaging => "parallel-staging",
            Policy::LbannDynamic => "lbann-dynamic",
            Policy::LbannPreloading => "lbann-preloading",
            Policy::LocalityAware => "locality-aware",
            Policy::Clairvoyant => "clairvoyant",
        }
    }

    /// The policy named `name` (see [`Policy::name`]); an unknown name is a configuration error
    /// listing the known ones.
    pub fn parse(name: &str) -> Result<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<&str> = Policy::ALL.iter().map(|p| p.name()).collect();
            Error::config(
                "policy",
                format!("unknown policy '{name}'; policies: {}", names.join(", ")),
            )
        })
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
