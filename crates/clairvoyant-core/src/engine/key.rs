//! The node cache's name.

use super::JobSpec;
use crate::model::ClassSpec;

/// A run id that tells runs apart. torchrun without `--standalone` sets
/// `TORCHELASTIC_RUN_ID=none` for every run: that says nothing.
pub(super) fn meaningful_run_id(id: &str) -> &str {
    match id.trim() {
        "none" | "None" | "NONE" => "",
        s => s,
    }
}

/// The node cache's name: a hash of the user, the dataset, the schedule, the local ranks, the
/// classes the job caches in (everything but their capacities, which may be detected from free
/// memory at the moment each rank starts and are agreed in the cache instead) and a meaningful
/// run id. Not the parent process: ranks started by per-rank wrapper scripts must find one
/// cache. Unrelated runs with equal keys are told apart by the cache's rank table (generations).
pub(super) fn node_key(spec: &JobSpec, fingerprint: u64, classes: &[&ClassSpec]) -> u64 {
    let sched = &spec.schedule;
    let mut h = fnv1a(meaningful_run_id(&spec.run_id).as_bytes(), 0xcbf2_9ce4_8422_2325);
    h = fnv1a(&crate::tier::secure::uid().to_le_bytes(), h);
    for c in classes {
        let mut c = (*c).clone();
        c.capacity = 0;
        h = fnv1a(serde_json::to_string(&c).unwrap_or_default().as_bytes(), h);
        h = fnv1a(&[0xff], h);
    }
    h = fnv1a(&fingerprint.to_le_bytes(), h);
    h = fnv1a(&spec.first_epoch.to_le_bytes(), h);
    for v in [
        sched.world_size as u64,
        sched.batch_size as u64,
        sched.epochs as u64,
        sched.drop_last as u64,
    ] {
        h = fnv1a(&v.to_le_bytes(), h);
    }
    match &sched.order {
        crate::schedule::Order::Shuffle { seed, .. } => h = fnv1a(&seed.to_le_bytes(), h),
        crate::schedule::Order::Explicit { epochs, .. } => {
            for order in epochs {
                h = fnv1a(&(order.len() as u64).to_le_bytes(), h);
                for k in order {
                    h = fnv1a(&k.to_le_bytes(), h);
                }
            }
        }
    }
    for r in &spec.local_ranks {
        h = fnv1a(&r.to_le_bytes(), h);
    }
    // A node of a multi-node job: its placement depends on every node's ranks and capacities.
    if let Some(c) = &spec.cluster {
        h = fnv1a(b"cluster", h);
        for (ranks, caps) in c.nodes.iter().zip(&c.capacities) {
            for v in ranks.iter().map(|&r| r as u64).chain(caps.iter().copied()) {
                h = fnv1a(&v.to_le_bytes(), h);
            }
            h = fnv1a(&[0xfe], h);
        }
    }
    h
}

fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_is_not_a_run_id() {
        assert_eq!(meaningful_run_id("none"), "");
        assert_eq!(meaningful_run_id(" "), "");
        assert_eq!(meaningful_run_id("job-7"), "job-7");
    }
}
