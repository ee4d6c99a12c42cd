//! The node cache's name.

use super::JobSpec;

/// The node cache's name: a hash of everything but capacities that decides the placement.
pub(super) fn node_key(spec: &JobSpec, fingerprint: u64) -> u64 {
    let sched = &spec.schedule;
    let mut h = fnv1a(spec.run_id.as_bytes(), 0xcbf2_9ce4_8422_2325);
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
    h
}

fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
