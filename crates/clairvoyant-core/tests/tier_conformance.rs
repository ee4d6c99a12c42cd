//! The conformance suite every node-cache tier runs (the memory arena, the directory class, and
//! wrappers around them): claim, fill, publish and read through the node cache's records;
//! checksum mismatches and short reads are caught; a dead claimant is taken over; a full tier
//! leaves the sample uncached; concurrent claims give one filler. A new tier (peers, say) adds
//! one line per case below.

use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clairvoyant_core::tier::{
    checksum, Acquire, DirectoryTier, Fault, Faulty, Filled, MemoryTier, NodeCache, Tier, Verified, FILLING, NOSPACE,
    READY,
};

const SAMPLES: usize = 64;
const SIZE: usize = 1000;

fn key(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "conf-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn bytes(k: u32) -> Vec<u8> {
    (0..SIZE).map(|i| (k as usize * 13 + i) as u8).collect()
}

/// Where sample k lives in a statically laid out tier.
fn place(k: u32) -> u64 {
    k as u64 * SIZE as u64
}

/// A node cache over one tier made by `make` (given a private scratch directory).
fn cache_with(dir: &Path, tag: &str, tier: Box<dyn Tier>) -> NodeCache {
    let mut c = NodeCache::attach_in(dir, &key(tag), SAMPLES, 0, 1).unwrap();
    c.push_tier(tier);
    c
}

type Make = fn(&Path) -> Box<dyn Tier>;

fn memory(dir: &Path) -> Box<dyn Tier> {
    Box::new(MemoryTier::create_and_open("ram", &dir.join("arena.mem"), (SAMPLES * SIZE) as u64).unwrap())
}

fn directory(dir: &Path) -> Box<dyn Tier> {
    Box::new(DirectoryTier::open("ssd", &dir.join("ssd"), u64::MAX).unwrap())
}

fn faulty_memory(dir: &Path) -> Box<dyn Tier> {
    Box::new(Faulty::new(
        MemoryTier::create_and_open("ram", &dir.join("arena.mem"), (SAMPLES * SIZE) as u64).unwrap(),
    ))
}

fn faulty_directory(dir: &Path) -> Box<dyn Tier> {
    Box::new(Faulty::new(
        DirectoryTier::open("ssd", &dir.join("ssd"), u64::MAX).unwrap(),
    ))
}

/// Fill sample k through the protocol: claim, write, publish.
fn fill(c: &NodeCache, k: u32) -> Filled {
    assert_eq!(c.state().acquire(k, Duration::from_millis(10)), Acquire::Claimed);
    c.fill(0, k, place(k), &bytes(k), 0, false)
}

fn claim_fill_publish_read(make: Make) {
    let t = tempfile::tempdir().unwrap();
    let c = cache_with(t.path(), "cfpr", make(t.path()));
    for k in 0..SAMPLES as u32 {
        assert!(matches!(fill(&c, k), Filled::Ready));
        assert_eq!(c.state().state(k), READY);
        assert_eq!(c.state().record(k).0, checksum(&bytes(k)));
    }
    for k in 0..SAMPLES as u32 {
        assert_eq!(c.state().acquire(k, Duration::ZERO), Acquire::Ready);
        let mut buf = vec![0u8; SIZE];
        assert_eq!(c.read_verified(0, k, place(k), &mut buf), Verified::Good);
        assert_eq!(buf, bytes(k));
    }
}

fn mismatch_is_detected(make: Make) {
    let t = tempfile::tempdir().unwrap();
    let c = cache_with(t.path(), "mismatch", make(t.path()));
    assert!(matches!(fill(&c, 5), Filled::Ready));
    // The tier's bytes change behind the record's back.
    c.tier(0).write(5, place(5), &bytes(6)).unwrap();
    let mut buf = vec![0u8; SIZE];
    assert_eq!(c.read_verified(0, 5, place(5), &mut buf), Verified::Corrupt);
    if let Ok(Some(_)) = c.tier(0).mapped(place(5), SIZE as u64) {
        assert!(matches!(
            c.view_verified(0, 5, place(5), SIZE as u64),
            Err(Fault::Mismatch)
        ));
    }
}

fn short_read_is_detected(make: Make, shorten: fn(&Path, u32)) {
    let t = tempfile::tempdir().unwrap();
    let c = cache_with(t.path(), "short", make(t.path()));
    assert!(matches!(fill(&c, 9), Filled::Ready));
    shorten(t.path(), 9);
    let mut buf = vec![0u8; SIZE];
    assert_eq!(c.read_verified(0, 9, place(9), &mut buf), Verified::Corrupt);
}

fn truncate_arena(dir: &Path, k: u32) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("arena.mem"))
        .unwrap();
    f.set_len(place(k) + 10).unwrap();
}

fn truncate_file(dir: &Path, k: u32) {
    let d = std::fs::read_dir(dir.join("ssd")).unwrap().next().is_some();
    assert!(d);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("ssd").join(k.to_string()))
        .unwrap();
    f.set_len(10).unwrap();
}

fn dead_claimant_is_taken_over(make: Make) {
    let t = tempfile::tempdir().unwrap();
    let c = cache_with(t.path(), "dead", make(t.path()));
    // Process slot 50 never registered: its claim is a dead process's.
    c.state().word(3).store(FILLING | (51 << 8), Ordering::Release);
    let t0 = std::time::Instant::now();
    assert_eq!(c.state().acquire(3, Duration::from_secs(30)), Acquire::Claimed);
    assert!(t0.elapsed() < Duration::from_millis(500));
    assert!(matches!(c.fill(0, 3, place(3), &bytes(3), 0, false), Filled::Ready));
    let mut buf = vec![0u8; SIZE];
    assert_eq!(c.read_verified(0, 3, place(3), &mut buf), Verified::Good);
}

fn full_tier_leaves_the_sample_uncached(c: &NodeCache) {
    assert!(matches!(fill(c, 1), Filled::NoSpace));
    assert_eq!(c.state().state(1), NOSPACE);
    assert_eq!(c.state().acquire(1, Duration::ZERO), Acquire::NoSpace, "not retried");
}

fn concurrent_claims_give_one_filler(make: Make) {
    let t = tempfile::tempdir().unwrap();
    let c = Arc::new(cache_with(t.path(), "race", make(t.path())));
    let fills = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (c, fills) = (c.clone(), fills.clone());
            std::thread::spawn(move || {
                for k in 0..SAMPLES as u32 {
                    match c.state().acquire(k, Duration::from_secs(10)) {
                        Acquire::Claimed => {
                            fills.fetch_add(1, Ordering::Relaxed);
                            assert!(matches!(c.fill(0, k, place(k), &bytes(k), 0, false), Filled::Ready));
                        }
                        Acquire::Ready => {
                            let mut buf = vec![0u8; SIZE];
                            assert_eq!(c.read_verified(0, k, place(k), &mut buf), Verified::Good);
                        }
                        other => panic!("{other:?}"),
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        fills.load(Ordering::Relaxed),
        SAMPLES,
        "each sample filled exactly once"
    );
}

macro_rules! suite {
    ($name:ident, $make:expr, $shorten:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn claim_fill_publish_read() {
                super::claim_fill_publish_read($make)
            }
            #[test]
            fn mismatch_is_detected() {
                super::mismatch_is_detected($make)
            }
            #[test]
            fn short_read_is_detected() {
                super::short_read_is_detected($make, $shorten)
            }
            #[test]
            fn dead_claimant_is_taken_over() {
                super::dead_claimant_is_taken_over($make)
            }
            #[test]
            fn concurrent_claims_give_one_filler() {
                super::concurrent_claims_give_one_filler($make)
            }
        }
    };
}

suite!(memory_tier, memory, truncate_arena);
suite!(directory_tier, directory, truncate_file);
suite!(faulty_memory_tier, faulty_memory, truncate_arena);
suite!(faulty_directory_tier, faulty_directory, truncate_file);

#[test]
fn memory_tier_refuses_what_it_cannot_hold() {
    let t = tempfile::tempdir().unwrap();
    let c = cache_with(t.path(), "cap", memory(t.path()));
    assert!(matches!(c.state().acquire(0, Duration::ZERO), Acquire::Claimed));
    // Past the arena's end: refused, the claim handed back for a retry elsewhere.
    assert!(matches!(
        c.fill(0, 0, (SAMPLES * SIZE) as u64, &bytes(0), 0, false),
        Filled::Failed(Fault::Short { .. })
    ));
    assert_eq!(c.state().acquire(0, Duration::ZERO), Acquire::Claimed, "retried");
}

#[test]
fn a_full_wrapped_tier_leaves_samples_uncached() {
    let t = tempfile::tempdir().unwrap();
    let f = Faulty::new(DirectoryTier::open("ssd", &t.path().join("full"), u64::MAX).unwrap());
    f.full.store(true, Ordering::Relaxed);
    full_tier_leaves_the_sample_uncached(&cache_with(t.path(), "full", Box::new(f)));
    let f =
        Faulty::new(MemoryTier::create_and_open("ram", &t.path().join("full.mem"), (SAMPLES * SIZE) as u64).unwrap());
    f.full.store(true, Ordering::Relaxed);
    full_tier_leaves_the_sample_uncached(&cache_with(t.path(), "fullm", Box::new(f)));
}

#[test]
fn a_byte_flipping_wrapper_is_caught_every_time() {
    let t = tempfile::tempdir().unwrap();
    let f = Faulty::new(DirectoryTier::open("ssd", &t.path().join("flip"), u64::MAX).unwrap());
    f.flip_every.store(2, Ordering::Relaxed);
    let c = cache_with(t.path(), "flip", Box::new(f));
    for k in 0..10 {
        assert!(matches!(fill(&c, k), Filled::Ready));
    }
    let mut caught = 0;
    for k in 0..10 {
        let mut buf = vec![0u8; SIZE];
        match c.read_verified(0, k, place(k), &mut buf) {
            Verified::Good => assert_eq!(buf, bytes(k)),
            Verified::Corrupt => caught += 1,
        }
    }
    assert_eq!(caught, 5, "every other read was flipped, and every flip caught");
}

#[test]
fn a_short_reading_wrapper_is_caught() {
    let t = tempfile::tempdir().unwrap();
    let f = Faulty::new(DirectoryTier::open("ssd", &t.path().join("short"), u64::MAX).unwrap());
    f.short_reads.store(true, Ordering::Relaxed);
    let c = cache_with(t.path(), "shortw", Box::new(f));
    assert!(matches!(fill(&c, 2), Filled::Ready));
    let mut buf = vec![0u8; SIZE];
    assert_eq!(c.read_verified(0, 2, place(2), &mut buf), Verified::Corrupt);
}
