//! A dataset file changed between epochs is read again, never served stale from the node cache,
//! whether the checker (the thread that stats an epoch's files ahead of staging) is ahead of the
//! consumer or behind it; and where it is ahead, the hand-out stats nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, SystemTime};

use clairvoyant_core::engine::{Engine, JobSpec, Src};
use clairvoyant_core::model::{ClassKind, ClassSpec, Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::{file_list, FileSource, Source};
use clairvoyant_core::Result;

const SIZE: usize = 512;
const CHECKER: &str = "cv-checker";

/// What the test controls of the checker thread, through the source's `path`, which every stat
/// of a sample's file asks first.
#[derive(Default)]
struct Gate {
    /// The checker waits in `path` while set.
    hold: bool,
    /// The checker asked for this sample's path (armed by the test).
    watch: Option<u32>,
    seen: bool,
    /// Per sample, `path` calls by threads other than the checker.
    others: HashMap<u32, u32>,
    /// Per sample, `path` calls by the consumer (the test's thread: the hand-out).
    consumer: HashMap<u32, u32>,
}

/// A file list whose `path` lets the test hold the checker back, or learn how far it got.
struct Watched {
    files: FileSource,
    gate: Mutex<Gate>,
    moved: Condvar,
}

impl Watched {
    fn gate(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.gate.lock().unwrap()
    }

    fn set_hold(&self, hold: bool) {
        self.gate().hold = hold;
        self.moved.notify_all();
    }

    /// Wait (for the checker) until `done` holds of the gate.
    fn wait_until(&self, done: impl Fn(&Gate) -> bool) {
        let (g, timeout) = self
            .moved
            .wait_timeout_while(self.gate(), Duration::from_secs(60), |g| !done(g))
            .unwrap();
        assert!(!timeout.timed_out() || done(&g), "the checker never got there");
    }
}

impl Source for Watched {
    fn len(&self) -> usize {
        self.files.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.files.size(k)
    }
    fn label(&self, k: u32) -> i64 {
        self.files.label(k)
    }
    fn path(&self, k: u32) -> PathBuf {
        let mut g = self.gate();
        if std::thread::current().name() == Some(CHECKER) {
            if g.watch == Some(k) {
                g.seen = true;
                self.moved.notify_all();
            }
            while g.hold {
                g = self.moved.wait(g).unwrap();
            }
        } else {
            *g.others.entry(k).or_default() += 1;
            if !std::thread::current().name().is_some_and(|n| n.starts_with("cv-")) {
                *g.consumer.entry(k).or_default() += 1;
            }
        }
        self.files.path(k)
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        self.files.read_into(k, buf)
    }
    fn fingerprint(&self) -> u64 {
        self.files.fingerprint()
    }
}

fn byte(k: u32) -> u8 {
    (k % 199) as u8
}

/// `n` files of `SIZE` bytes, sample k all `byte(k)`.
fn dataset(dir: &Path, n: u32) -> Arc<Watched> {
    let paths: Vec<PathBuf> = (0..n)
        .map(|k| {
            let p = dir.join(format!("{k:03}.bin"));
            std::fs::write(&p, vec![byte(k); SIZE]).unwrap();
            p
        })
        .collect();
    // Fill stamps are whole milliseconds: the files' last change must be clearly before the
    // fills begin, or a fill is taken for older than its file (and the file read again).
    let newest = paths.iter().map(|p| last_change(p)).max().unwrap();
    while SystemTime::now() < newest + Duration::from_millis(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let labels = vec![0i64; n as usize];
    std::fs::create_dir(dir.join("index")).unwrap();
    let files = file_list(&paths, &labels, Some(&dir.join("index"))).unwrap();
    Arc::new(Watched {
        files,
        gate: Mutex::new(Gate::default()),
        moved: Condvar::new(),
    })
}

/// When the file at `p` last changed (its mtime or ctime).
fn last_change(p: &Path) -> SystemTime {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).unwrap();
    let ctime = SystemTime::UNIX_EPOCH + Duration::new(m.ctime() as u64, m.ctime_nsec() as u32);
    m.modified().unwrap().max(ctime)
}

/// Rewrite sample `k`'s file in place with other bytes of the same size, last changed after
/// any fill began, whatever the grain of the file system's clock.
fn rewrite(src: &Watched, k: u32) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().write(true).open(src.files.path(k)).unwrap();
    f.write_all(&[255u8; SIZE]).unwrap();
    f.set_modified(SystemTime::now() + Duration::from_secs(600)).unwrap();
}

fn model() -> SystemModel {
    SystemModel {
        staging: StagingSpec::new(1 << 16, 2),
        pfs: PfsSpec {
            read_mbps: Curve::constant(100.0),
            open_latency_s: 0.001,
        },
        classes: vec![ClassSpec {
            name: "memory".into(),
            kind: ClassKind::Memory,
            capacity: 1 << 20,
            threads: 2,
            read_mbps: Curve::constant(10_000.0),
            write_mbps: Curve::constant(10_000.0),
        }],
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

fn start(src: &Arc<Watched>, run: &str) -> (Engine, Schedule) {
    let schedule = Schedule::shuffle(src.len() as u64, 1, 4, 2, 5, false).unwrap();
    let spec = JobSpec {
        schedule: schedule.clone(),
        rank: 0,
        local_ranks: vec![0],
        run_id: run.to_string(),
        first_epoch: 0,
        cluster: None,
        agent: None,
    };
    (Engine::start(src.clone(), &model(), spec).unwrap(), schedule)
}

/// Take `samples` (the next ones of the current epoch) and check each one's bytes: `changed`'s
/// are the rewritten ones. Returns where each came from.
fn take(engine: &Engine, samples: &[u32], changed: u32) -> Vec<Src> {
    samples
        .iter()
        .map(|&k| {
            let l = engine.next(Duration::from_secs(60)).unwrap().expect("sample in time");
            assert_eq!(l.sample, k);
            // SAFETY: the lease is valid until released.
            let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
            let want = if k == changed { 255 } else { byte(k) };
            assert!(
                bytes.len() == SIZE && bytes.iter().all(|&b| b == want),
                "bytes of sample {k}"
            );
            let src = l.source;
            engine.release(l.pos);
            src
        })
        .collect()
}

#[test]
fn checker_ahead_leaves_the_hand_out_no_stat_and_a_changed_file_is_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let src = dataset(dir.path(), 200);
    let (engine, schedule) = start(&src, "checker-ahead");
    let order = |e| schedule.rank_epoch(0, e).unwrap().samples;
    take(&engine, &order(0), u32::MAX);
    // The last sample of epoch 1 changes between the epochs; the checker reports when it asks
    // for that file, after it checked every sample before it (those it was sent past, see below,
    // excepted).
    let e1 = order(1);
    let changed = *e1.last().unwrap();
    rewrite(&src, changed);
    {
        let mut g = src.gate();
        (g.watch, g.seen) = (Some(changed), false);
        g.others.clear();
        g.consumer.clear();
    }
    engine.begin_epoch(1).unwrap();
    take(&engine, &e1[..1], changed);
    src.wait_until(|g| g.seen);
    let srcs = take(&engine, &e1[1..], changed);
    assert!(srcs.contains(&Src::Memory), "epoch 1 was served from the node cache");
    // The hand-out checked the epoch's first sample itself (the checker had not started) and so
    // sent the checker on 64 positions; from there on the checker was ahead of the hand-out
    // (staging may have checked samples itself where it was ahead of the checker).
    let (others, consumer) = {
        let g = src.gate();
        (g.others.clone(), g.consumer.clone())
    };
    let stated: Vec<u32> = e1[64..e1.len() - 1]
        .iter()
        .copied()
        .filter(|k| consumer.contains_key(k))
        .collect();
    assert_eq!(
        stated,
        Vec::<u32>::new(),
        "samples the checker had checked were stat'ed again"
    );
    assert!(
        others.get(&changed).is_some_and(|&n| n > 0),
        "the changed file was looked at"
    );
    engine.shutdown();
}

#[test]
fn checker_behind_staging_checks_itself_and_a_changed_file_is_read_again() {
    let dir = tempfile::tempdir().unwrap();
    let src = dataset(dir.path(), 64);
    let (engine, schedule) = start(&src, "checker-behind");
    let order = |e| schedule.rank_epoch(0, e).unwrap().samples;
    take(&engine, &order(0), u32::MAX);
    // The checker checks nothing from here on (every check of a file asks for its path first).
    src.set_hold(true);
    let e1 = order(1);
    let changed = e1[e1.len() / 2];
    rewrite(&src, changed);
    src.gate().others.clear();
    engine.begin_epoch(1).unwrap();
    // Every sample's bytes are checked as it is taken: the changed file's are the new ones.
    let srcs = take(&engine, &e1, changed);
    assert!(srcs.contains(&Src::Memory), "epoch 1 was served from the node cache");
    // Staging and the hand-out stat'ed the files themselves.
    assert!(!src.gate().others.is_empty());
    src.set_hold(false);
    engine.shutdown();
}
