//! A new node cache takes over what a dead run of the same dataset cached on this machine (see
//! [`crate::tier::salvage`]).

use crate::source::Source;
use crate::tier::salvage::{self, Salvage, NOT_HELD};
use crate::tier::{checksum, Filled, NodeCache};

/// Write this cache's layout (so a run after a crash can reuse it), then copy into memory class
/// `mem` every sample of a salvaged cache that this placement puts there and nobody has filled
/// yet: its bytes must match the checksum recorded when they were cached, and its dataset file
/// must not have changed since. Returns (samples, bytes) reused.
pub(super) fn record_and_reuse(
    cache: &NodeCache,
    source: &dyn Source,
    mem: usize,
    class_of: &[u8],
    offset: &[u64],
) -> (u64, u64) {
    let Some(arena) = cache.arena_path() else { return (0, 0) };
    let offsets: Vec<u64> = class_of
        .iter()
        .zip(offset)
        .map(|(&c, &o)| if c as usize == mem { o } else { NOT_HELD })
        .collect();
    if let Err(e) = salvage::write_layout(cache.dir(), cache.stem(), source.fingerprint(), arena, &offsets) {
        crate::tier::warn_once(
            "layout",
            &format!("this node cache cannot be reused after a crash: {e}"),
        );
    }
    let (mut samples, mut bytes) = (0u64, 0u64);
    let state = cache.state();
    for old in Salvage::take(cache.dir(), source.fingerprint(), class_of.len()) {
        for (k, &o) in offsets.iter().enumerate() {
            if o == NOT_HELD {
                continue;
            }
            let k = k as u32;
            let len = source.size(k);
            let Some((from, sum, filled_ns)) = old.sample(k, len) else {
                continue;
            };
            if !unchanged_since(source, k, filled_ns) || !state.claim(k) {
                continue;
            }
            let Some(dst) = cache.fill_slot(mem, o, len) else {
                state.abandon(k);
                continue;
            };
            // SAFETY: the claim gives this thread the sample's range of the arena until it
            // publishes; the tier checked the range.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst, len as usize) };
            dst.copy_from_slice(from);
            if checksum(dst) != sum {
                state.abandon(k);
                continue;
            }
            if let Filled::Ready = cache.fill(mem, k, o, dst, state.fill_stamp(), true) {
                samples += 1;
                bytes += len;
            }
        }
    }
    if samples > 0 && !crate::sysinfo::env::flag(crate::sysinfo::env::QUIET) {
        eprintln!(
            "clairvoyant: reused {samples} samples ({}) that an earlier run cached on this node",
            crate::model::format_bytes(bytes)
        );
    }
    (samples, bytes)
}

/// Whether `sample`'s dataset file was last modified (or replaced) before `since_ns`; true for
/// sources without files.
fn unchanged_since(source: &dyn Source, sample: u32, since_ns: u64) -> bool {
    let path = source.path(sample);
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => crate::source::last_change_ns(&m) < since_ns as i128,
        Ok(_) => false,
        Err(_) => !path.exists() && path.is_relative(),
    }
}
