//! End-to-end tests of the engine on an in-memory source: order, exactly-once, node sharing,
//! capacity bounds, errors at the right sample, no hangs.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clairvoyant_core::engine::{Engine, JobSpec, Src};
use clairvoyant_core::model::{ClassKind, ClassSpec, Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;
use clairvoyant_core::test_support::flip_byte;
use clairvoyant_core::{Error, Result};

/// Deterministic bytes for sample k, of varying sizes; counts reads per sample.
struct MemSource {
    sizes: Vec<u64>,
    reads: Vec<AtomicU64>,
    missing: Mutex<Vec<u32>>,
    delay: Duration,
    fingerprint: u64,
}

impl MemSource {
    fn new(n: usize, delay: Duration) -> Arc<MemSource> {
        Arc::new(MemSource {
            sizes: (0..n as u64).map(|k| 100 + (k * 37) % 900).collect(),
            reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            missing: Mutex::new(vec![]),
            delay,
            fingerprint: rand_fingerprint(),
        })
    }
    /// `n` samples of `size` bytes each.
    fn of_size(n: usize, size: u64) -> Arc<MemSource> {
        Arc::new(MemSource {
            sizes: vec![size; n],
            reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            missing: Mutex::new(vec![]),
            delay: Duration::ZERO,
            fingerprint: rand_fingerprint(),
        })
    }
    fn byte(k: u32, i: usize) -> u8 {
        (k as usize * 31 + i) as u8
    }
    fn total_reads(&self) -> u64 {
        self.reads.iter().map(|r| r.load(Ordering::Relaxed)).sum()
    }
}

fn rand_fingerprint() -> u64 {
    use std::time::SystemTime;
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        ^ std::process::id() as u64
}

impl Source for MemSource {
    fn len(&self) -> usize {
        self.sizes.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.sizes[k as usize]
    }
    fn label(&self, k: u32) -> i64 {
        (k % 7) as i64
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("mem/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        if self.missing.lock().unwrap().contains(&k) {
            return Err(Error::NotFound {
                sample: k as u64,
                path: self.path(k),
            });
        }
        self.reads[k as usize].fetch_add(1, Ordering::Relaxed);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Self::byte(k, i);
        }
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

fn model(staging: u64, memory: u64, ssd: Option<(PathBuf, u64)>) -> SystemModel {
    let mut classes = vec![ClassSpec {
        name: "memory".into(),
        kind: ClassKind::Memory,
        capacity: memory,
        threads: 2,
        read_mbps: Curve::constant(10_000.0),
        write_mbps: Curve::constant(10_000.0),
    }];
    if let Some((path, cap)) = ssd {
        classes.push(ClassSpec {
            name: "ssd".into(),
            kind: ClassKind::Directory { path },
            capacity: cap,
            threads: 1,
            read_mbps: Curve::constant(2_000.0),
            write_mbps: Curve::constant(1_000.0),
        });
    }
    SystemModel {
        staging: StagingSpec::new(staging, 3),
        pfs: PfsSpec {
            read_mbps: Curve::constant(100.0),
            open_latency_s: 0.001,
        },
        classes,
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

fn spec(n: u64, world: u32, rank: u32, local: Vec<u32>, epochs: u32, run: &str) -> JobSpec {
    JobSpec {
        schedule: Schedule::shuffle(n, world, 4, epochs, 11, false).unwrap(),
        rank,
        local_ranks: local,
        run_id: run.to_string(),
        first_epoch: 0,
        cluster: None,
        agent: None,
    }
}

/// Consume everything; check order and bytes; return the sources seen per epoch.
fn consume_all(engine: &Engine, sched: &Schedule, rank: u32, hold: bool) -> Vec<Vec<Src>> {
    let mut out = Vec::new();
    let mut held = Vec::new();
    for e in 0..engine.epochs() {
        engine.begin_epoch(e).unwrap();
        let expect = sched.rank_epoch(rank, e).unwrap().samples;
        let mut srcs = Vec::new();
        for &k in &expect {
            let l = engine.next(Duration::from_secs(20)).unwrap().expect("sample in time");
            assert_eq!(l.sample, k);
            assert_eq!(l.label, (k % 7) as i64);
            // SAFETY: the lease is valid until released.
            let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
            assert_eq!(bytes.len() as u64, 100 + (k as u64 * 37) % 900);
            assert!(
                bytes.iter().enumerate().all(|(i, &b)| b == MemSource::byte(k, i)),
                "bytes of sample {k}"
            );
            srcs.push(l.source);
            if hold {
                held.push(l.pos);
            } else {
                engine.release(l.pos);
            }
        }
        out.push(srcs);
    }
    assert!(matches!(
        engine.next(Duration::from_millis(10)),
        Err(Error::Exhausted { .. })
    ));
    engine.release_many(&held);
    out
}

#[test]
fn one_rank_in_order_and_cached_after_first_epoch() {
    let src = MemSource::new(300, Duration::ZERO);
    let m = model(4096, 1 << 20, None);
    let sp = spec(300, 1, 0, vec![0], 3, "t1");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &m, sp).unwrap();
    let srcs = consume_all(&engine, &sched, 0, false);
    assert_eq!(
        src.total_reads(),
        300,
        "the source is read once per sample over the run"
    );
    let later: Vec<(usize, Src)> = srcs[1..]
        .iter()
        .flatten()
        .copied()
        .enumerate()
        .filter(|&(_, s)| s != Src::Memory)
        .collect();
    assert!(
        later.is_empty(),
        "not from memory in epochs 1-2 (position, source): {later:?}"
    );
    let stats = engine.stats();
    assert_eq!(stats.iter().map(|s| s.samples).sum::<u64>(), 900);
    assert_eq!(stats.iter().map(|s| s.pfs_files_read).sum::<u64>(), 300);
    assert_eq!(stats[1].pfs_bytes_read, 0);
}

#[test]
fn local_ranks_share_one_node_cache() {
    let src = MemSource::new(500, Duration::from_micros(200));
    let m = model(8192, 1 << 20, None);
    let threads: Vec<_> = (0..2u32)
        .map(|r| {
            let (src, mut m) = (src.clone(), m.clone());
            // Detected capacities differ between ranks started a moment apart; they must still
            // agree on one placement.
            m.classes[0].capacity += r as u64 * 4096;
            std::thread::spawn(move || {
                let sp = spec(500, 2, r, vec![0, 1], 3, "shared-run");
                let sched = sp.schedule.clone();
                let engine = Engine::start(src, &m, sp).unwrap();
                consume_all(&engine, &sched, r, false);
                engine.stats()
            })
        })
        .collect();
    let stats: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    // Every sample read from the source exactly once across both ranks and three epochs.
    assert!(src.reads.iter().all(|r| r.load(Ordering::Relaxed) == 1));
    let consumed: u64 = stats.iter().flatten().map(|s| s.samples).sum();
    assert_eq!(consumed, 1500);
}

#[test]
fn capacity_bounds_and_ssd_class() {
    let dir = tempfile::tempdir().unwrap();
    let src = MemSource::new(400, Duration::ZERO);
    let total: u64 = (0..400u32).map(|k| src.size(k)).sum();
    let m = model(4096, total / 4, Some((dir.path().to_path_buf(), total / 4)));
    let sp = spec(400, 1, 0, vec![0], 3, "t3");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &m, sp).unwrap();
    let summary = engine.placement_summary().to_vec();
    assert!(summary[0].2 <= total / 4 && summary[1].2 <= total / 4);
    assert!(summary[0].2 > 0 && summary[1].2 > 0);
    let srcs = consume_all(&engine, &sched, 0, false);
    let later: Vec<Src> = srcs[2].clone();
    assert!(later.contains(&Src::Ssd) && later.contains(&Src::Memory) && later.contains(&Src::Pfs));
    // Files on the SSD class never exceed its capacity.
    let on_disk: u64 = walk_size(dir.path());
    assert!(on_disk <= total / 4, "{on_disk} > {}", total / 4);
}

fn walk_size(p: &std::path::Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            n += walk_size(&e.path());
        } else {
            n += e.metadata().unwrap().len();
        }
    }
    n
}

#[test]
fn holding_every_sample_does_not_hang() {
    let src = MemSource::new(200, Duration::ZERO);
    // Staging fits only a few samples and nothing is cached in memory.
    let m = model(2048, 0, None);
    let sp = spec(200, 1, 0, vec![0], 2, "t4");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &m, sp).unwrap();
    consume_all(&engine, &sched, 0, true);
    assert!(engine.stats()[0].overflow_bytes > 0);
}

#[test]
fn missing_sample_fails_at_its_position_and_the_epoch_goes_on() {
    let src = MemSource::new(100, Duration::ZERO);
    let sp = spec(100, 1, 0, vec![0], 1, "t5");
    let order = sp.schedule.rank_epoch(0, 0).unwrap().samples;
    let bad = order[10];
    src.missing.lock().unwrap().push(bad);
    let engine = Engine::start(src.clone(), &model(4096, 1 << 20, None), sp).unwrap();
    for (i, &k) in order.iter().enumerate() {
        match engine.next(Duration::from_secs(10)) {
            Ok(Some(l)) => {
                assert_ne!(i, 10);
                assert_eq!(l.sample, k);
                engine.release(l.pos);
            }
            Err(Error::NotFound { sample, path }) => {
                assert_eq!(i, 10);
                assert_eq!(sample, bad as u64);
                assert!(path.to_string_lossy().contains(&bad.to_string()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn staging_or_class_too_small_names_the_sample() {
    let src = MemSource::new(50, Duration::ZERO);
    let largest = (0..50u32).max_by_key(|&k| src.size(k)).unwrap();
    let err = Engine::start(
        src.clone(),
        &model(500, 1 << 20, None),
        spec(50, 1, 0, vec![0], 1, "t6"),
    )
    .err()
    .unwrap();
    let msg = err.to_string();
    assert!(matches!(err, Error::TooLarge { .. }), "{msg}");
    assert!(
        msg.contains(&format!("mem/{largest}")) && msg.contains("staging"),
        "{msg}"
    );
}

#[test]
fn a_sample_larger_than_a_class_is_just_not_cached_there() {
    let src = MemSource::new(50, Duration::ZERO);
    // A 600-byte memory class: samples above 600 bytes cannot go there.
    let sp = spec(50, 1, 0, vec![0], 2, "t6b");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(1 << 20, 600, None), sp).unwrap();
    let srcs = consume_all(&engine, &sched, 0, false);
    let order = sched.rank_epoch(0, 1).unwrap().samples;
    for (&k, &s) in order.iter().zip(&srcs[1]) {
        if src.size(k) > 600 {
            assert_eq!(s, Src::Pfs, "sample {k} of {} bytes", src.size(k));
        }
    }
}

#[test]
fn epochs_in_order_and_shutdown_wakes_consumer() {
    let src = MemSource::new(64, Duration::from_millis(50));
    let engine = Arc::new(Engine::start(src, &model(4096, 0, None), spec(64, 1, 0, vec![0], 3, "t7")).unwrap());
    engine.begin_epoch(1).unwrap(); // skips epoch 0
    assert!(engine.begin_epoch(0).is_err());
    assert!(engine.begin_epoch(3).is_err());
    let e2 = engine.clone();
    let waiter = std::thread::spawn(move || loop {
        match e2.next(Duration::from_millis(100)) {
            Ok(Some(l)) => e2.release(l.pos),
            Ok(None) => {}
            Err(e) => return e,
        }
    });
    std::thread::sleep(Duration::from_millis(100));
    engine.shutdown();
    assert!(matches!(waiter.join().unwrap(), Error::Cancelled));
}

#[test]
fn a_tier_slower_than_the_source_is_not_used() {
    let src = MemSource::new(100, Duration::ZERO);
    let mut m = model(4096, 1 << 20, None);
    // The source reads at 50 GB/s per reader (a page-cached dataset); the memory class at 10 GB/s.
    m.pfs = PfsSpec {
        read_mbps: Curve::constant(50_000.0),
        open_latency_s: 0.0,
    };
    let sp = spec(100, 1, 0, vec![0], 2, "t8");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &m, sp).unwrap();
    assert!(engine.placement_summary().is_empty());
    let srcs = consume_all(&engine, &sched, 0, false);
    assert!(srcs.iter().flatten().all(|&s| s == Src::Pfs));
    assert_eq!(src.total_reads(), 200);
}

#[test]
fn resumed_job_serves_the_same_later_epochs() {
    let src = MemSource::new(120, Duration::ZERO);
    let m = model(4096, 1 << 20, None);
    let mut sp = spec(120, 2, 1, vec![1], 4, "t9");
    sp.first_epoch = 2;
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &m, sp).unwrap();
    assert!(engine.begin_epoch(1).is_err());
    for e in 2..4 {
        engine.begin_epoch(e).unwrap();
        for &k in &sched.rank_epoch(1, e).unwrap().samples {
            let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
            assert_eq!(l.sample, k);
            engine.release(l.pos);
        }
    }
    // Only the samples of the two remaining epochs were read.
    assert_eq!(
        src.reads.iter().filter(|r| r.load(Ordering::Relaxed) > 0).count() as u64,
        {
            let mut seen: Vec<u32> = (2..4).flat_map(|e| sched.rank_epoch(1, e).unwrap().samples).collect();
            seen.sort();
            seen.dedup();
            seen.len() as u64
        }
    );
}

/// Flip one byte in every file below `dir` (the SSD class) or in the file `path`.
fn files_below(p: &std::path::Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            files_below(&e.path(), out);
        } else {
            out.push(e.path());
        }
    }
}

#[test]
fn a_corrupted_memory_class_is_detected_and_refetched() {
    let src = MemSource::new(200, Duration::ZERO);
    let sp = spec(200, 1, 0, vec![0], 1, "");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(1 << 20, 1 << 20, None), sp).unwrap();
    // Fill the cache without consuming: every memory-class sample READY.
    let arena = engine.segments().1.expect("memory class");
    let order = sched.rank_epoch(0, 0).unwrap().samples;
    // Let the class prefetchers run ahead, then overwrite a span of the arena.
    std::thread::sleep(Duration::from_millis(200));
    for at in (0..20_000u64).step_by(97) {
        flip_byte(&arena, at);
    }
    let mut wrong = 0;
    for &k in &order {
        let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
        // SAFETY: valid until released.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
        if !bytes.iter().enumerate().all(|(i, &b)| b == MemSource::byte(k, i)) {
            wrong += 1;
        }
        engine.release(l.pos);
    }
    assert_eq!(wrong, 0, "no silently wrong sample");
    assert!(engine.stats()[0].corrupt > 0, "corruption counted");
}

#[test]
fn a_truncated_memory_class_does_not_crash() {
    let src = MemSource::new(200, Duration::ZERO);
    let sp = spec(200, 1, 0, vec![0], 2, "");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(1 << 20, 1 << 20, None), sp).unwrap();
    let arena = engine.segments().1.expect("memory class");
    engine.begin_epoch(0).unwrap();
    for _ in 0..sched.rank_epoch(0, 0).unwrap().samples.len() {
        let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
        engine.release(l.pos);
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&arena)
        .unwrap()
        .set_len(1000)
        .unwrap();
    engine.begin_epoch(1).unwrap();
    for &k in &sched.rank_epoch(0, 1).unwrap().samples {
        let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
        assert_eq!(l.sample, k);
        // SAFETY: valid until released.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == MemSource::byte(k, i)));
        engine.release(l.pos);
    }
    assert!(engine.stats()[1].corrupt > 0);
}

#[test]
fn ssd_bit_flips_are_detected_and_repaired() {
    let dir = tempfile::tempdir().unwrap();
    let src = MemSource::new(200, Duration::ZERO);
    let sp = spec(200, 1, 0, vec![0], 3, "");
    let sched = sp.schedule.clone();
    // A small ring: staging runs only a few samples ahead of the consumer.
    let engine = Engine::start(
        src.clone(),
        &model(4096, 0, Some((dir.path().to_path_buf(), 1 << 20))),
        sp,
    )
    .unwrap();
    engine.begin_epoch(0).unwrap();
    for _ in 0..sched.rank_epoch(0, 0).unwrap().samples.len() {
        let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
        engine.release(l.pos);
    }
    let mut files = Vec::new();
    files_below(dir.path(), &mut files);
    // One file per sample and the directory's owner file; no temporary file left.
    files.retain(|f| f.file_name().unwrap() != ".owner");
    assert_eq!(files.len(), 200, "every sample cached, no temporary file left");
    for f in &files {
        flip_byte(f, 3);
    }
    // consume_all checks every byte of epochs 1 and 2 (and 0 again through begin_epoch order).
    let mut corrupt = 0;
    for e in 1..3 {
        engine.begin_epoch(e).unwrap();
        for &k in &sched.rank_epoch(0, e).unwrap().samples {
            let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
            // SAFETY: valid until released.
            let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
            assert!(
                bytes.iter().enumerate().all(|(i, &b)| b == MemSource::byte(k, i)),
                "sample {k}"
            );
            engine.release(l.pos);
        }
        corrupt += engine.stats()[e as usize].corrupt;
    }
    // Samples staged before the flip were read intact; every later read of a flipped file is
    // caught, and a caught file is rewritten.
    assert!((150..=200).contains(&corrupt), "{corrupt}");
    assert!(engine.stats()[2].corrupt < engine.stats()[1].corrupt);
}

#[test]
fn local_ranks_outside_the_world_are_a_config_error() {
    let src = MemSource::new(20, Duration::ZERO);
    for local in [vec![0, 5], vec![0, 0, 1]] {
        let err = Engine::start(src.clone(), &model(1 << 20, 0, None), spec(20, 2, 0, local, 1, ""))
            .err()
            .expect("refused");
        assert!(
            matches!(&err, Error::Config { key, .. } if key == "local_ranks"),
            "{err}"
        );
    }
}

/// Take every sample of `epochs` in order, checking its bytes, and release it.
fn take_in_order(engine: &Engine, sched: &Schedule, epochs: std::ops::Range<u32>) {
    for e in epochs {
        engine.begin_epoch(e).unwrap();
        for &k in &sched.rank_epoch(0, e).unwrap().samples {
            let l = engine.next(Duration::from_secs(20)).unwrap().expect("sample in time");
            assert_eq!(l.sample, k);
            // SAFETY: the lease is valid until released.
            let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
            assert!(
                bytes.iter().enumerate().all(|(i, &b)| b == MemSource::byte(k, i)),
                "bytes of sample {k}"
            );
            engine.release(l.pos);
        }
    }
}

#[test]
fn staging_keeps_a_lead_ahead_of_a_consumer_that_waits_not_the_whole_ring() {
    // 4,000 samples of 1 KiB: the whole epoch would fit in the 64 MiB ring.
    let src = MemSource::of_size(4000, 1024);
    let sp = spec(4000, 1, 0, vec![0], 1, "");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(64 << 20, 0, None), sp).unwrap();
    engine.begin_epoch(0).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // The lead is the read-concurrency controller's far mark (128 samples here, at most 16 per
    // fetch of 32) in typical samples, plus the fetches in flight.
    let staged = src.total_reads();
    assert!((64..=16 * 32 + 32).contains(&staged), "{staged} samples staged ahead");
    // Staging follows the consumer to the end.
    take_in_order(&engine, &sched, 0..1);
    assert_eq!(src.total_reads(), 4000);
}

#[test]
fn the_staging_ring_reuses_its_first_blocks_instead_of_touching_new_ones() {
    use std::os::unix::fs::MetadataExt;
    // 3 epochs of 600 samples of 64 KiB (112 MiB) staged through a 64 MiB ring.
    let src = MemSource::of_size(600, 64 << 10);
    let sp = spec(600, 1, 0, vec![0], 3, "");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(64 << 20, 0, None), sp).unwrap();
    let ring = engine.segments().0;
    take_in_order(&engine, &sched, 0..3);
    assert_eq!(src.total_reads(), 1800);
    // The lead is 128 samples (8 MiB): the ring starts again at its beginning once what is live
    // leaves room there for a lead, so it uses about twice the lead, not the whole ring.
    let used = std::fs::metadata(&ring).unwrap().blocks() * 512;
    assert!(used <= 32 << 20, "{} MiB of the ring's 64 were used", used >> 20);
    engine.shutdown();
}

#[test]
fn close_releases_the_ring_at_once() {
    let src = MemSource::new(50, Duration::ZERO);
    let engine = Engine::start(src, &model(1 << 16, 0, None), spec(50, 1, 0, vec![0], 1, "")).unwrap();
    use std::os::unix::fs::MetadataExt;
    let ring = engine.segments().0;
    let file = |p: &std::path::Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let before = file(&ring);
    assert!(before.is_some());
    let l = engine.next(Duration::from_secs(10)).unwrap().unwrap();
    engine.shutdown();
    // The ring is reached through this process's descriptor (/proc/<pid>/fd/<n>): closed at
    // close. A test running beside this one may get the same descriptor number for a file of
    // its own, so the path may exist again, but not as the ring.
    assert_ne!(file(&ring), before, "the ring's descriptor is closed at close");
    // The lease's bytes are still readable (mapping kept while a lease is alive).
    // SAFETY: not released yet.
    let b = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
    assert_eq!(b.len(), l.len);
    engine.release(l.pos);
}

#[test]
fn two_jobs_of_one_process_over_one_dataset_cache_it_once() {
    // Train and validation over the same dataset, different schedules, at the same time.
    let src = MemSource::new(100, Duration::ZERO);
    let m = model(1 << 20, 1 << 20, None);
    let a = Engine::start(src.clone(), &m, spec(100, 1, 0, vec![0], 2, "none")).unwrap();
    let mut sp = spec(100, 1, 0, vec![0], 2, "");
    sp.schedule = Schedule::shuffle(100, 1, 5, 2, 99, false).unwrap();
    let sched_b = sp.schedule.clone();
    let b = Engine::start(src.clone(), &m, sp).unwrap();
    assert_eq!(a.segments().1, b.segments().1, "one memory class");
    consume_all(&a, &spec(100, 1, 0, vec![0], 2, "").schedule, 0, false);
    consume_all(&b, &sched_b, 0, false);
    assert_eq!(src.total_reads(), 100, "every sample read once for both jobs");
    let arena = a.segments().1.unwrap();
    a.shutdown();
    assert!(arena.exists(), "still used by the other job");
    b.shutdown();
    assert!(!arena.exists());
}

#[test]
fn ranks_without_a_run_id_share_one_cache() {
    let src = MemSource::new(300, Duration::from_micros(100));
    let m = model(8192, 1 << 20, None);
    let threads: Vec<_> = (0..2u32)
        .map(|r| {
            let (src, m) = (src.clone(), m.clone());
            std::thread::spawn(move || {
                let sp = spec(300, 2, r, vec![0, 1], 2, "");
                let sched = sp.schedule.clone();
                let engine = Engine::start(src, &m, sp).unwrap();
                let arena = engine.segments().1;
                consume_all(&engine, &sched, r, false);
                arena
            })
        })
        .collect();
    let arenas: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(arenas[0], arenas[1]);
    assert!(src.reads.iter().all(|r| r.load(Ordering::Relaxed) == 1));
    let arena = arenas[0].clone().unwrap();
    assert!(!arena.exists(), "both ranks left: the cache is removed");
}

#[test]
fn a_truncated_staging_ring_does_not_crash() {
    let src = MemSource::new(300, Duration::ZERO);
    let sp = spec(300, 1, 0, vec![0], 2, "");
    let sched = sp.schedule.clone();
    let engine = Engine::start(src.clone(), &model(1 << 20, 0, None), sp).unwrap();
    let ring = engine.segments().0;
    engine.begin_epoch(0).unwrap();
    // Let staging fill the ring, then cut it.
    std::thread::sleep(Duration::from_millis(100));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ring)
        .unwrap()
        .set_len(0)
        .unwrap();
    take_in_order(&engine, &sched, 0..2);
    assert!(engine.stats()[0].corrupt > 0, "lost samples refetched and counted");
}

/// A source whose read of one sample waits until the test lets it through.
struct Gated {
    inner: Arc<MemSource>,
    held: Mutex<Option<u32>>,
    open: std::sync::Condvar,
}

impl Gated {
    fn let_through(&self) {
        *self.held.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.open.notify_all();
    }
}

/// Lets a [`Gated`] source's held read through when dropped: declared after the engine, it
/// runs first when a test fails, so the engine's shutdown does not wait for ever on the read.
struct OpenAtEnd(Arc<Gated>);

impl Drop for OpenAtEnd {
    fn drop(&mut self) {
        self.0.let_through();
    }
}

impl Source for Gated {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.inner.size(k)
    }
    fn label(&self, k: u32) -> i64 {
        self.inner.label(k)
    }
    fn path(&self, k: u32) -> PathBuf {
        self.inner.path(k)
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        let mut held = self.held.lock().unwrap();
        while *held == Some(k) {
            held = self.open.wait(held).unwrap();
        }
        drop(held);
        self.inner.read_into(k, buf)
    }
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
}

#[test]
fn a_part_of_a_batch_is_handed_out_while_its_later_samples_are_still_read() {
    let sp = spec(64, 1, 0, vec![0], 1, "");
    let order = sp.schedule.rank_epoch(0, 0).unwrap().samples;
    let src = Arc::new(Gated {
        inner: MemSource::new(64, Duration::ZERO),
        held: Mutex::new(Some(order[3])),
        open: std::sync::Condvar::new(),
    });
    let engine = Engine::start(src.clone(), &model(1 << 20, 0, None), sp).unwrap();
    let _open = OpenAtEnd(src.clone());
    engine.begin_epoch(0).unwrap();
    let mut out = Vec::new();
    let t0 = std::time::Instant::now();
    // The samples before the held one come without waiting for it: in one call, or in a few
    // where a loaded machine has not staged them all when the first call returns.
    while out.len() < 3 {
        engine
            .next_ready(8 - out.len(), Duration::from_secs(10), &mut out)
            .unwrap();
    }
    assert_eq!(
        out.iter().map(|l| l.sample).collect::<Vec<_>>(),
        order[..3],
        "the samples before the one being read"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "waited for the held sample: {:?}",
        t0.elapsed()
    );
    // Only the first sample of a call is waited for: none is ready, so nothing comes.
    let mut none = Vec::new();
    engine.next_ready(5, Duration::from_millis(30), &mut none).unwrap();
    assert!(none.is_empty());
    src.let_through();
    engine.next_ready(5, Duration::from_secs(10), &mut out).unwrap();
    assert_eq!(out[3].sample, order[3]);
    while out.len() < 8 {
        engine
            .next_ready(8 - out.len(), Duration::from_secs(10), &mut out)
            .unwrap();
    }
    assert_eq!(out.iter().map(|l| l.sample).collect::<Vec<_>>(), order[..8]);
    for l in &out {
        // SAFETY: a lease's bytes stay valid until it is released, below.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
        assert!(bytes
            .iter()
            .enumerate()
            .all(|(i, &b)| b == MemSource::byte(l.sample, i)));
        engine.release(l.pos);
    }
}

#[test]
fn a_part_ends_at_a_sample_that_cannot_be_read_which_is_consumed() {
    let src = MemSource::new(64, Duration::ZERO);
    let sp = spec(64, 1, 0, vec![0], 1, "");
    let order = sp.schedule.rank_epoch(0, 0).unwrap().samples;
    src.missing.lock().unwrap().push(order[2]);
    let engine = Engine::start(src.clone(), &model(1 << 20, 0, None), sp).unwrap();
    engine.begin_epoch(0).unwrap();
    let mut out = Vec::new();
    let err = loop {
        if let Err(e) = engine.next_ready(4 - out.len(), Duration::from_secs(10), &mut out) {
            break e;
        }
    };
    assert!(
        matches!(err, Error::NotFound { sample, .. } if sample == order[2] as u64),
        "{err:?}"
    );
    assert_eq!(out.iter().map(|l| l.sample).collect::<Vec<_>>(), order[..2]);
    engine.next_ready(1, Duration::from_secs(10), &mut out).unwrap();
    assert_eq!(out[2].sample, order[3], "the missing sample was consumed");
    for l in &out {
        engine.release(l.pos);
    }
}
