//! A local process stopped (SIGSTOP) while it holds fill claims in the node cache: the rank that
//! needs those samples waits about one deadline from the model (2 s for small samples), not the
//! 30 s fill time-out per claim, reads them from the dataset itself with the right bytes, and
//! leaves the claims to their holder. Once that process is killed (SIGKILL) its claims are taken
//! over and filled as before.
//!
//! The claimant is this test binary run again as a child process (`claimant_process`): it
//! attaches to the engine's node cache, claims samples and is stopped by the test.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use clairvoyant_core::engine::{Engine, JobSpec};
use clairvoyant_core::model::{ClassKind, StagingSpec, SystemModel};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;
use clairvoyant_core::test_support::{fast_class, one_class_model, pfs};
use clairvoyant_core::tier::{StateSegment, FILLING, READY};
use clairvoyant_core::Result;

/// Set for the child: `<state dir>\t<stem>\t<samples>\t<sample,sample,...>`.
const CLAIMANT: &str = "CV_TEST_CLAIMANT";
const N: usize = 240;

/// Deterministic bytes per sample; reads wait while the gate is closed; reads are counted.
struct GatedSource {
    reads: Vec<AtomicU64>,
    open: Mutex<bool>,
    opened: Condvar,
    fingerprint: u64,
}

impl GatedSource {
    fn new() -> Arc<GatedSource> {
        Arc::new(GatedSource {
            reads: (0..N).map(|_| AtomicU64::new(0)).collect(),
            open: Mutex::new(false),
            opened: Condvar::new(),
            fingerprint: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                ^ std::process::id() as u64,
        })
    }
    fn byte(k: u32, i: usize) -> u8 {
        (k as usize * 13 + i * 7) as u8
    }
    fn open_gate(&self) {
        *self.open.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.opened.notify_all();
    }
}

/// Opens the gate when dropped: a failing test does not leave the engine's threads blocked.
struct OpenOnDrop(Arc<GatedSource>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open_gate();
    }
}

impl Source for GatedSource {
    fn len(&self) -> usize {
        N
    }
    fn size(&self, k: u32) -> u64 {
        200 + (k as u64 * 53) % 700
    }
    fn label(&self, k: u32) -> i64 {
        k as i64
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("mem/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
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

/// A memory class, or (with `ssd`) a directory class only: the two ways a staged sample is
/// fetched from the node cache (in place, or copied).
fn model(ssd: Option<&Path>) -> SystemModel {
    let (name, kind) = match ssd {
        None => ("memory", ClassKind::Memory),
        Some(p) => ("ssd", ClassKind::Directory { path: p.to_path_buf() }),
    };
    one_class_model(
        fast_class(name, kind, 1 << 20),
        // A small staging ring (about 20 samples): epoch 1 is not staged far ahead of the
        // consumer while epoch 0 is consumed.
        StagingSpec::new(12 << 10, 3),
        // 1 ms to open, 100 MB/s: under 1 ms per sample, so the deadline is its 2 s floor.
        pfs(100.0, 0.001),
    )
}

/// The child process: claims the samples named in `CV_TEST_CLAIMANT`, says so, and holds them
/// until it is killed. Without that variable (an ordinary test run) it does nothing.
#[test]
fn claimant_process() {
    let Ok(arg) = std::env::var(CLAIMANT) else {
        return;
    };
    let f: Vec<&str> = arg.split('\t').collect();
    let state = StateSegment::open(Path::new(f[0]), f[1], f[2].parse().unwrap()).unwrap();
    for k in f[3].split(',') {
        assert!(state.claim(k.parse().unwrap()), "sample {k} was claimed already");
    }
    // On its own line: the test harness may have begun one ("test claimant_process ... ").
    println!("\nclaimed");
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// The node cache's state segment (directory, stem) of `engine`, from the name its staging ring
/// was created with (`<stem>.r<rank>.j<n>.p<pid>.ring` in the cache's directory; the ring is
/// unlinked and reached through this process's descriptor).
fn state_of(engine: &Engine) -> (PathBuf, String) {
    let ring = std::fs::read_link(engine.segments().0).unwrap();
    let ring = ring.to_str().unwrap().trim_end_matches(" (deleted)");
    let (dir, name) = ring.rsplit_once('/').unwrap();
    let stem = name.rsplitn(5, '.').nth(4).unwrap();
    (PathBuf::from(dir), stem.to_string())
}

/// Run this binary's `claimant_process` claiming `samples` of the node cache at (dir, stem);
/// returns once they are claimed.
fn spawn_claimant(dir: &Path, stem: &str, samples: &[u32]) -> Child {
    let list: Vec<String> = samples.iter().map(|k| k.to_string()).collect();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "claimant_process", "--nocapture", "--test-threads=1"])
        .env(CLAIMANT, format!("{}\t{stem}\t{N}\t{}", dir.display(), list.join(",")))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l == "claimed" => break,
            Some(Ok(_)) => {}
            _ => {
                let _ = child.kill();
                panic!("the claimant process ended before claiming: {:?}", child.wait());
            }
        }
    }
    child
}

/// Consume epoch `e` checking order and bytes; returns how long it took.
fn consume(engine: &Engine, sched: &Schedule, e: u32) -> Duration {
    let t = Instant::now();
    engine.begin_epoch(e).unwrap();
    for k in sched.rank_epoch(0, e).unwrap().samples {
        let l = engine.next(Duration::from_secs(120)).unwrap().expect("sample in time");
        assert_eq!(l.sample, k);
        // SAFETY: the lease is valid until released.
        let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
        assert_eq!(bytes.len() as u64, 200 + (k as u64 * 53) % 700);
        assert!(
            bytes.iter().enumerate().all(|(i, &b)| b == GatedSource::byte(k, i)),
            "bytes of sample {k} in epoch {e}"
        );
        engine.release(l.pos);
    }
    t.elapsed()
}

/// Epoch 0 with six samples claimed by a stopped process; then (`kill`) the process is killed
/// and epoch 1 takes its claims over. Memory-class samples take no staging ring space, so the
/// staging prefetcher runs into epoch 1 during epoch 0: that class runs epoch 0 only.
fn stopped_then_killed_claimant(ssd: Option<&Path>, run: &str, kill: bool) {
    let src = GatedSource::new();
    let sched = Schedule::shuffle(N as u64, 1, 4, if kill { 2 } else { 1 }, 5, false).unwrap();
    let spec = JobSpec {
        schedule: sched.clone(),
        rank: 0,
        local_ranks: vec![0],
        run_id: format!("{run}-{}", std::process::id()),
        first_epoch: 0,
        cluster: None,
        agent: None,
    };
    // The engine's threads block on their first reads: samples far down the order are unclaimed.
    let engine = Engine::start(src.clone(), &model(ssd), spec).unwrap();
    let _gate = OpenOnDrop(src.clone());
    // Claimed: samples late in epoch 0 and in epoch 1 (staged after the claimant is killed).
    let later = sched.rank_epoch(0, sched.epochs - 1).unwrap().samples;
    let held: Vec<u32> = sched.rank_epoch(0, 0).unwrap().samples[60..]
        .iter()
        .copied()
        .filter(|k| !kill || later.iter().position(|x| x == k).unwrap() >= 100)
        .take(6)
        .collect();
    assert_eq!(held.len(), 6);
    let (dir, stem) = state_of(&engine);
    let mut child = spawn_claimant(&dir, &stem, &held);
    // SAFETY: stops the child process this test started.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGSTOP) };
    src.open_gate();

    let took = consume(&engine, &sched, 0);
    let state = StateSegment::open(&dir, &stem, N).unwrap();
    for &k in &held {
        assert_eq!(state.state(k), FILLING, "the stopped process still holds sample {k}");
        assert_eq!(
            src.reads[k as usize].load(Ordering::Relaxed),
            1,
            "sample {k} read around once"
        );
    }
    println!("{run}: epoch 0 with 6 samples claimed by a stopped process took {took:?}");
    assert!(
        took < Duration::from_secs(20),
        "6 claims of a stopped process cost {took:?} (at most about one 2 s deadline expected)"
    );

    child.kill().unwrap();
    child.wait().unwrap();
    if !kill {
        return;
    }
    let took = consume(&engine, &sched, 1);
    for &k in &held {
        assert_eq!(
            state.state(k),
            READY,
            "the killed process's claim on {k} was taken over and filled"
        );
        assert_eq!(src.reads[k as usize].load(Ordering::Relaxed), 2, "sample {k}");
    }
    println!("{run}: epoch 1 after the claimant was killed took {took:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
}

#[test]
fn a_stopped_claimant_costs_one_deadline_in_the_memory_class() {
    stopped_then_killed_claimant(None, "stopped-mem", false);
}

#[test]
fn a_stopped_claimant_costs_one_deadline_then_a_killed_one_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    stopped_then_killed_claimant(Some(dir.path()), "stopped-ssd", true);
}
