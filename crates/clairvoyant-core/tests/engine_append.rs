//! A growing access stream: passes appended after start, skipped unread, dropped once consumed.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clairvoyant_core::engine::{Engine, JobSpec, Lease};
use clairvoyant_core::model::{Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;
use clairvoyant_core::{Error, Result};

/// Deterministic bytes for sample k; counts reads per sample. Reads of `blocked` wait until the
/// gate opens.
struct CountingSource {
    sizes: Vec<u64>,
    reads: Vec<AtomicU64>,
    blocked: u32,
    gate: Mutex<bool>,
    /// Notified when the gate opens and when `started` or `finished` is set (under `gate`).
    opened: Condvar,
    started: AtomicBool,
    finished: AtomicBool,
    fingerprint: u64,
}

impl CountingSource {
    fn new(n: usize, blocked: Option<u32>) -> Arc<CountingSource> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Arc::new(CountingSource {
            sizes: (0..n as u64).map(|k| 100 + (k * 37) % 900).collect(),
            reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            blocked: blocked.unwrap_or(u32::MAX),
            gate: Mutex::new(false),
            opened: Condvar::new(),
            started: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            fingerprint: std::process::id() as u64 ^ (NEXT.fetch_add(1, Ordering::Relaxed) << 40) ^ 0x5eed_0000,
        })
    }
    fn byte(k: u32, i: usize) -> u8 {
        (k as usize * 31 + i) as u8
    }
    fn reads_of(&self, ks: impl IntoIterator<Item = u32>) -> u64 {
        ks.into_iter()
            .map(|k| self.reads[k as usize].load(Ordering::Relaxed))
            .sum()
    }
    fn open_gate(&self) {
        *self.gate.lock().unwrap() = true;
        self.opened.notify_all();
    }
    fn signal(&self, flag: &AtomicBool) {
        let _g = self.gate.lock().unwrap();
        flag.store(true, Ordering::SeqCst);
        self.opened.notify_all();
    }
    /// Wait until `flag` is set (a minute at most: `what` did not happen).
    fn await_flag(&self, flag: &AtomicBool, what: &str) {
        let g = self.gate.lock().unwrap();
        let (_g, _) = self
            .opened
            .wait_timeout_while(g, Duration::from_secs(60), |_| !flag.load(Ordering::SeqCst))
            .unwrap();
        assert!(flag.load(Ordering::SeqCst), "{what}");
    }
}

impl Source for CountingSource {
    fn len(&self) -> usize {
        self.sizes.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.sizes[k as usize]
    }
    fn label(&self, k: u32) -> i64 {
        k as i64
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("counting/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        self.reads[k as usize].fetch_add(1, Ordering::Relaxed);
        if k == self.blocked {
            self.signal(&self.started);
            let mut open = self.gate.lock().unwrap();
            while !*open {
                open = self.opened.wait(open).unwrap();
            }
        }
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Self::byte(k, i);
        }
        if k == self.blocked {
            self.signal(&self.finished);
        }
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// No storage class: every sample is read by the staging prefetcher, so reads count fetches.
fn model(staging: u64) -> SystemModel {
    SystemModel {
        staging: StagingSpec::new(staging, 4),
        pfs: PfsSpec {
            read_mbps: Curve::constant(1000.0),
            open_latency_s: 0.0,
        },
        classes: vec![],
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

fn start(source: &Arc<CountingSource>, staging: u64, orders: Vec<Vec<u32>>) -> Engine {
    let n = source.len() as u64;
    let spec = JobSpec {
        schedule: Schedule::explicit(n, orders, 1, 4, false).unwrap(),
        rank: 0,
        local_ranks: vec![0],
        run_id: format!("append-{:x}", source.fingerprint),
        first_epoch: 0,
        cluster: None,
        agent: None,
    };
    Engine::start(source.clone(), &model(staging), spec).unwrap()
}

fn take(engine: &Engine) -> Lease {
    engine.next(Duration::from_secs(20)).unwrap().expect("sample in time")
}

/// The lease holds sample `k`'s bytes.
fn check(l: &Lease, k: u32) {
    assert_eq!(l.sample, k);
    // SAFETY: the lease is valid until released.
    let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
    assert_eq!(bytes.len() as u64, 100 + (k as u64 * 37) % 900);
    for (i, &b) in bytes.iter().enumerate() {
        assert_eq!(b, CountingSource::byte(k, i), "sample {k} byte {i}");
    }
}

fn consume(engine: &Engine, samples: &[u32]) {
    for &k in samples {
        let l = take(engine);
        check(&l, k);
        engine.release(l.pos);
    }
}

#[test]
fn an_appended_pass_is_served_with_its_batches() {
    let src = CountingSource::new(50, None);
    let engine = start(&src, 1 << 16, vec![(0..20).collect()]);
    assert_eq!(engine.epochs(), 1);
    let pass: Vec<u32> = vec![49, 3, 3, 17, 0, 42, 8];
    assert_eq!(engine.append_epoch(pass.clone(), vec![2, 3, 7]).unwrap(), 1);
    assert_eq!(engine.epochs(), 2);
    assert_eq!(&*engine.batch_ends(1), &[2, 3, 7]);
    assert_eq!(engine.epoch_samples(1).unwrap(), pass);
    assert_eq!(engine.epoch_start(1), 20);
    engine.begin_epoch(0).unwrap();
    consume(&engine, &(0..20).collect::<Vec<_>>());
    engine.begin_epoch(1).unwrap();
    consume(&engine, &pass);
    // The end of the stream: at once, no waiting for more.
    let t = Instant::now();
    assert!(matches!(
        engine.next(Duration::from_secs(10)),
        Err(Error::Exhausted { epochs: 2 })
    ));
    assert!(t.elapsed() < Duration::from_secs(1));
    let stats = engine.stats();
    assert_eq!(stats.len(), 2);
    assert_eq!((stats[0].samples, stats[1].samples), (20, 7));
    assert_eq!(stats[1].epoch, 1);
}

#[test]
fn appending_wakes_producers_idle_at_the_end() {
    let src = CountingSource::new(30, None);
    let engine = start(&src, 1 << 16, vec![(0..10).collect()]);
    consume(&engine, &(0..10).collect::<Vec<_>>());
    assert!(matches!(
        engine.next(Duration::from_secs(1)),
        Err(Error::Exhausted { .. })
    ));
    // The producers reached the end and wait there.
    std::thread::sleep(Duration::from_millis(100));
    let pass: Vec<u32> = (10..30).rev().collect();
    engine.append_epoch(pass.clone(), vec![20]).unwrap();
    let t = Instant::now();
    engine.begin_epoch(1).unwrap();
    consume(&engine, &pass);
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    // Producers waiting at the end also stop at shutdown.
    engine.shutdown();
}

#[test]
fn skipping_a_long_stretch_never_reads_it() {
    // A small ring: staging runs only a few samples ahead of the consumer.
    let src = CountingSource::new(2000, None);
    let engine = start(&src, 8 << 10, vec![(0..1000).collect()]);
    engine.append_epoch((1000..2000).collect(), vec![500, 1000]).unwrap();
    consume(&engine, &[0, 1, 2, 3, 4]);
    std::thread::sleep(Duration::from_millis(50));
    engine.begin_epoch(1).unwrap();
    consume(&engine, &(1000..2000).collect::<Vec<_>>());
    let early = src.reads_of(0..100);
    assert!((5..100).contains(&early), "{early} reads of the first 100");
    assert_eq!(src.reads_of(100..1000), 0, "the skipped stretch was read");
    assert_eq!(src.reads_of(1000..2000), 1000, "the next pass is read once");
    let stats = engine.stats();
    assert_eq!(stats[0].samples, 5, "skipped samples count as consumed");
    assert_eq!(stats[1].samples, 1000);
}

#[test]
fn skipping_into_an_epoch_staging_already_reached() {
    // Short epochs and a large ring: staging runs several epochs ahead.
    let src = CountingSource::new(40, None);
    let engine = start(&src, 1 << 20, vec![(0..10).collect(), (10..20).collect()]);
    engine.append_epoch((20..30).collect(), vec![4, 8, 10]).unwrap();
    engine.append_epoch((30..40).collect(), vec![10]).unwrap();
    let t = Instant::now();
    while src.reads_of(0..40) < 30 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    consume(&engine, &[0, 1, 2]);
    let held = take(&engine);
    engine.begin_epoch(2).unwrap();
    consume(&engine, &(20..30).collect::<Vec<_>>());
    check(&held, 3);
    engine.release(held.pos);
    assert!(matches!(
        engine.begin_epoch(1),
        Err(Error::EpochConsumed { epoch: 1, next: 3 })
    ));
    engine.begin_epoch(3).unwrap();
    consume(&engine, &(30..40).collect::<Vec<_>>());
    assert_eq!(src.reads_of(0..40), 40, "every sample fetched once");
    assert_eq!(
        engine.stats().iter().map(|s| s.samples).collect::<Vec<_>>(),
        [4, 0, 10, 10]
    );
}

#[test]
fn skipping_past_a_fetch_in_flight_keeps_its_space_until_it_ends() {
    // Sample 2's read blocks until the gate opens; the ring is a few samples long, so the next
    // pass wraps around it many times.
    let src = CountingSource::new(400, Some(2));
    let engine = start(&src, 4 << 10, vec![(0..20).collect()]);
    engine.append_epoch((20..400).collect(), vec![380]).unwrap();
    src.await_flag(&src.started, "sample 2 never fetched");
    // Samples 0 and 1 are held across the skip.
    let (a, b) = (take(&engine), take(&engine));
    let t = Instant::now();
    engine.begin_epoch(1).unwrap();
    assert!(t.elapsed() < Duration::from_secs(1), "the skip waited for the fetch");
    // Let staging fill what the ring allows for the next pass, then let the blocked read write.
    std::thread::sleep(Duration::from_millis(100));
    src.open_gate();
    src.await_flag(&src.finished, "the blocked read never finished");
    consume(&engine, &(20..400).collect::<Vec<_>>());
    check(&a, 0);
    check(&b, 1);
    engine.release_many(&[a.pos, b.pos]);
    assert!(
        (3..20).all(|k| src.reads_of([k]) <= 1),
        "a skipped sample was read twice"
    );
    assert!(matches!(
        engine.next(Duration::from_secs(1)),
        Err(Error::Exhausted { .. })
    ));
}

#[test]
fn consumed_passes_are_dropped() {
    let src = CountingSource::new(1000, None);
    let engine = start(&src, 1 << 16, vec![(0..1000).collect()]);
    let backwards: Vec<u32> = (0..1000).rev().collect();
    engine.append_epoch(backwards.clone(), vec![1000]).unwrap();
    engine.append_epoch((0..1000).collect(), vec![1000]).unwrap();
    engine.append_epoch((0..1000).collect(), vec![1000]).unwrap();
    assert_eq!(engine.held_samples(), 4000);
    consume(&engine, &(0..1000).collect::<Vec<_>>());
    assert_eq!(engine.held_samples(), 3000);
    // An epoch of the starting schedule is derived again; its batches stay.
    assert_eq!(engine.epoch_samples(0).unwrap(), (0..1000).collect::<Vec<_>>());
    assert_eq!(engine.batch_ends(0).last(), Some(&1000));
    assert_eq!(engine.epoch_samples(1).unwrap(), backwards);
    consume(&engine, &backwards);
    assert_eq!(engine.held_samples(), 2000);
    assert!(matches!(
        engine.epoch_samples(1),
        Err(Error::EpochDropped { epoch: 1, next: 2 })
    ));
    assert_eq!(engine.batch_ends(1).last(), Some(&1000));
    consume(&engine, &[0, 1]);
    engine.begin_epoch(3).unwrap();
    assert_eq!(engine.held_samples(), 1000);
    let err = engine.epoch_samples(2).unwrap_err();
    assert!(err.to_string().contains("epoch 2 were dropped"), "{err}");
    assert_eq!(engine.epoch_samples(3).unwrap(), (0..1000).collect::<Vec<_>>());
    consume(&engine, &(0..1000).collect::<Vec<_>>());
    assert_eq!(engine.held_samples(), 0);
}

#[test]
fn invalid_passes_are_refused_naming_the_position() {
    let src = CountingSource::new(10, None);
    let engine = start(&src, 1 << 16, vec![(0..10).collect()]);
    let reason = |r: Result<u32>| match r {
        Err(Error::Config { key, reason }) => format!("{key}: {reason}"),
        other => panic!("expected a config error, got {other:?}"),
    };
    let r = reason(engine.append_epoch(vec![1, 2, 3, 10, 4], vec![5]));
    assert!(r.starts_with("samples: position 3: sample 10"), "{r}");
    let r = reason(engine.append_epoch(vec![], vec![]));
    assert!(r.starts_with("samples: ") && r.contains("at least one"), "{r}");
    let r = reason(engine.append_epoch(vec![1, 2, 3], vec![2, 2, 3]));
    assert!(r.starts_with("batch_ends: batch 1 is empty"), "{r}");
    let r = reason(engine.append_epoch(vec![1, 2, 3], vec![0, 3]));
    assert!(r.starts_with("batch_ends: batch 0 is empty"), "{r}");
    let r = reason(engine.append_epoch(vec![1, 2, 3], vec![2]));
    assert!(r.starts_with("batch_ends: ") && r.contains("3 samples"), "{r}");
    assert_eq!(engine.epochs(), 1, "a refused pass is not appended");
    engine.shutdown();
    assert!(matches!(engine.append_epoch(vec![1], vec![1]), Err(Error::Cancelled)));
}
