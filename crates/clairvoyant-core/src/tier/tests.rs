use std::time::Duration;

use super::*;
use crate::clock::{ManualClock, RealClock};

fn key(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "unit-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

#[test]
fn claim_fill_publish_shared_between_handles() {
    let base = tempfile::tempdir().unwrap();
    let k = key("share");
    let a = NodeCache::attach_in(base.path(), &k, 10, 0, 2).unwrap();
    let b = NodeCache::attach_in(base.path(), &k, 10, 1, 2).unwrap();
    assert_eq!(a.stem(), b.stem(), "two local ranks of one run share one cache");
    assert!(a.state().claim(3));
    assert!(!b.state().claim(3));
    let t = std::thread::spawn({
        let (base, k) = (base.path().to_path_buf(), k.clone());
        move || {
            let c = NodeCache::attach_in(&base, &k, 10, 0, 2).unwrap();
            // Rank 0 is held by `a` (alive): another run, another generation.
            let other = c.stem().to_string();
            drop(c);
            other
        }
    });
    let other = t.join().unwrap();
    assert_ne!(other, a.stem());
    assert!(other.ends_with(".g1"), "{other}");
    a.state().publish(3, checksum(b"x"), 7);
    assert_eq!(b.state().acquire(3, Duration::from_millis(10)), Acquire::Ready);
    assert_eq!(b.state().record(3), (checksum(b"x"), 7));
    let path = a.state().path().to_path_buf();
    drop(a);
    assert!(path.exists());
    drop(b);
    assert!(!path.exists(), "the last user removes the cache");
}

#[test]
fn files_are_private() {
    use std::os::unix::fs::MetadataExt;
    let base = tempfile::tempdir().unwrap();
    let mut c = NodeCache::attach_in(base.path(), &key("mode"), 4, 0, 1).unwrap();
    c.setup(
        &[ClassRequest {
            name: "ram".into(),
            kind: ClassKind::Memory,
            capacity: 4096,
        }],
        0,
    )
    .unwrap();
    let dir = c.dir().to_path_buf();
    assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
    for e in std::fs::read_dir(&dir).unwrap() {
        let m = e.unwrap().metadata().unwrap();
        assert_eq!(m.mode() & 0o077, 0, "nothing readable by others");
    }
    assert!(c.arena_path().is_some());
}

#[test]
fn a_planted_symlink_is_refused_and_its_target_untouched() {
    let base = tempfile::tempdir().unwrap();
    let k = key("link");
    let dir = secure::private_dir(base.path()).unwrap();
    let _ = &dir;
    let victim = base.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, dir.join(format!("clairvoyant-{k}.state"))).unwrap();
    let e = NodeCache::attach_in(base.path(), &k, 4, 0, 1).err().expect("refused");
    assert!(matches!(e, Error::Untrusted { .. }), "{e}");
    assert!(e.to_string().contains(&k), "names the path: {e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

#[test]
fn a_dead_claimant_is_taken_over_within_a_slice() {
    let base = tempfile::tempdir().unwrap();
    let k = key("dead");
    let c = NodeCache::attach_in(base.path(), &k, 4, 0, 1).unwrap();
    // A claim by process slot 40, which never registered: a dead process.
    c.state().word(2).store(FILLING | (41 << 8), Ordering::Release);
    let t0 = std::time::Instant::now();
    assert_eq!(c.state().acquire(2, Duration::from_secs(30)), Acquire::Claimed);
    assert!(t0.elapsed() < Duration::from_millis(500), "{:?}", t0.elapsed());
    // A failed fill is retried, not failed for good.
    c.state().abandon(2);
    assert_eq!(c.state().acquire(2, Duration::from_millis(1)), Acquire::Claimed);
}

#[test]
fn a_live_claimant_is_waited_for_then_busy() {
    let base = tempfile::tempdir().unwrap();
    let c = NodeCache::attach_in(base.path(), &key("busy"), 4, 0, 1).unwrap();
    assert!(c.state().claim(1));
    let t0 = std::time::Instant::now();
    assert_eq!(c.state().acquire(1, Duration::from_millis(60)), Acquire::Busy);
    assert!(t0.elapsed() >= Duration::from_millis(55));
}

#[test]
fn caches_of_dead_processes_are_removed_whatever_their_key() {
    let base = tempfile::tempdir().unwrap();
    let k = key("stale");
    let c = NodeCache::attach_in(base.path(), &k, 4, 0, 1).unwrap();
    let path = c.state().path().to_path_buf();
    // Make the only recorded process look dead: a pid that never exists.
    std::mem::forget(c);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&0x7fff_fff0u32.to_ne_bytes(), 128).unwrap();
    }
    let ring = path.with_file_name(format!("clairvoyant-{k}.r0.j0.p{}.ring", 0x7fff_fff0u32));
    std::fs::write(&ring, b"").unwrap();
    let _other = NodeCache::attach_in(base.path(), &key("next"), 4, 0, 1).unwrap();
    assert!(!path.exists(), "dead cache removed by another run");
    assert!(!ring.exists(), "dead ring removed");
}

#[test]
fn early_finisher_keeps_the_cache_for_the_late_rank() {
    let base = tempfile::tempdir().unwrap();
    let k = key("late");
    let a = NodeCache::attach_in(base.path(), &k, 4, 0, 2).unwrap();
    assert!(a.state().claim(0));
    a.state().publish(0, 1, 0);
    let path = a.state().path().to_path_buf();
    drop(a);
    assert!(path.exists());
    let b = NodeCache::attach_in(base.path(), &k, 4, 1, 2).unwrap();
    assert_eq!(b.state().state(0), READY);
    drop(b);
    assert!(!path.exists());
}

#[test]
fn a_forked_child_does_not_detach() {
    let base = tempfile::tempdir().unwrap();
    let c = NodeCache::attach_in(base.path(), &key("fork"), 4, 0, 1).unwrap();
    let path = c.state().path().to_path_buf();
    // SAFETY: the child only drops the cache (no allocation-heavy work) and exits at once.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        c.detach();
        // SAFETY: leave the child without running the parent's destructors.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(path.exists(), "the child left the parent's cache alone");
    drop(c);
    assert!(!path.exists());
}

#[test]
fn memory_class_leaves_room_for_the_rings() {
    assert_eq!(memory_room(1 << 30, 0, 0), (1 << 30) - SHM_MARGIN);
    assert_eq!(
        memory_room(1 << 30, 256 << 20, 1000),
        (1 << 30) - (256 << 20) - SHM_MARGIN - 16_000
    );
    assert_eq!(memory_room(64 << 20, 512 << 20, 0), 0, "rings first");
}

#[test]
fn a_rank_that_died_while_setting_up_is_replaced() {
    let base = tempfile::tempdir().unwrap();
    let c = NodeCache::attach_in(base.path(), &key("agree"), 4, 0, 1).unwrap();
    // Process slot 30 (never registered: dead) began deciding the capacities.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(c.state().path()).unwrap();
        f.write_all_at(&(1u32 | (31 << 8)).to_ne_bytes(), 28).unwrap();
    }
    let t0 = std::time::Instant::now();
    let (caps, at) = c.state().agree(|| Ok((vec![7, 9], ArenaAt::None))).unwrap();
    assert_eq!(caps, vec![7, 9]);
    assert_eq!(at, ArenaAt::None);
    assert!(t0.elapsed() < Duration::from_secs(1));
}

#[test]
fn class_directories_of_dead_caches_go_and_live_ones_stay() {
    let shm = tempfile::tempdir().unwrap();
    let other_shm = tempfile::tempdir().unwrap();
    let ssd = tempfile::tempdir().unwrap();
    let class = |c: &mut NodeCache| {
        c.setup(
            &[ClassRequest {
                name: "ssd".into(),
                kind: ClassKind::Directory {
                    path: ssd.path().to_path_buf(),
                },
                capacity: 1 << 20,
            }],
            0,
        )
        .unwrap();
    };
    // A live cache whose state is in another shared-memory directory.
    let mut live = NodeCache::attach_in(other_shm.path(), &key("live"), 4, 0, 1).unwrap();
    class(&mut live);
    let base = secure::private_dir(ssd.path()).unwrap();
    let live_dir = base.join(live.stem());
    // A dead cache's directory: its owner file names a state that is gone.
    let dead_dir = base.join("clairvoyant-dead");
    std::fs::create_dir(&dead_dir).unwrap();
    std::fs::write(
        dead_dir.join(".owner"),
        shm.path().join("gone.state").as_os_str().as_encoded_bytes(),
    )
    .unwrap();
    std::fs::write(dead_dir.join("3"), b"old").unwrap();
    let mut c = NodeCache::attach_in(shm.path(), &key("janitor"), 4, 0, 1).unwrap();
    class(&mut c);
    assert!(!dead_dir.exists(), "a dead cache's files are removed");
    assert!(live_dir.exists(), "a live cache of another shm directory is kept");
}

#[test]
fn the_node_plan_turn_passes_on_from_a_dead_rank_and_is_taken_once() {
    let base = tempfile::tempdir().unwrap();
    let name = key("plan");
    let c = NodeCache::attach_in(base.path(), &name, 4, 0, 2).unwrap();
    // Process slot 30 (never registered: dead) began computing the node's plan.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(c.state().path()).unwrap();
        f.write_all_at(&(1u32 | (31 << 8)).to_ne_bytes(), 112).unwrap();
    }
    let (code, decided) = c.state().plan_turn(Duration::from_secs(5), &RealClock, || 3).unwrap();
    assert_eq!((code, decided), (3, true), "the turn came to this rank");
    // A second local rank gets the published outcome without deciding.
    let d = NodeCache::attach_in(base.path(), &name, 4, 1, 2).unwrap();
    let (code, decided) = d
        .state()
        .plan_turn(Duration::from_secs(5), &RealClock, || panic!("decided twice"))
        .unwrap();
    assert_eq!((code, decided), (3, false));
}

#[test]
fn the_wait_for_a_living_rank_computing_the_plan_ends_when_the_clock_reaches_its_deadline() {
    /// A wait long enough to hang the test if it were measured in real time.
    const HOUR: Duration = Duration::from_secs(3600);
    /// Long enough for the waiter to read the clock; reached only when it does not.
    const READ: Duration = Duration::from_secs(30);
    let base = tempfile::tempdir().unwrap();
    let name = key("plan-clock");
    let c = NodeCache::attach_in(base.path(), &name, 4, 0, 2).unwrap();
    let d = NodeCache::attach_in(base.path(), &name, 4, 1, 2).unwrap();
    let clock = ManualClock::new();
    let (inside, entered) = std::sync::mpsc::channel();
    let (finish, finished) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        // The first rank decides until told to finish; this process lives, so it is waited for.
        let first = s.spawn(move || {
            c.state()
                .plan_turn(HOUR, &RealClock, || {
                    inside.send(()).unwrap();
                    let _ = finished.recv();
                    2
                })
                .unwrap()
        });
        entered.recv().unwrap();
        let clock = &clock;
        let second = s.spawn(move || d.state().plan_turn(HOUR, clock, || 9));
        assert!(clock.await_reads(1, READ), "the wait takes its deadline from the clock");
        clock.advance(HOUR - Duration::from_millis(1));
        // A read after the advance: the waiter saw 1 ms left and waits on.
        assert!(clock.await_reads(clock.reads() + 1, READ), "the wait reads the clock");
        assert!(!second.is_finished(), "gave up before the deadline");
        clock.advance(Duration::from_millis(1));
        let err = second.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::TimedOut { .. }), "{err:?}");
        finish.send(()).unwrap();
        assert_eq!(first.join().unwrap(), (2, true));
    });
}

#[test]
fn a_living_rank_computing_the_plan_is_waited_for() {
    let base = tempfile::tempdir().unwrap();
    let name = key("plan-wait");
    let c = NodeCache::attach_in(base.path(), &name, 4, 0, 2).unwrap();
    let d = NodeCache::attach_in(base.path(), &name, 4, 1, 2).unwrap();
    let (inside, entered) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let first = s.spawn(move || {
            c.state()
                .plan_turn(Duration::from_secs(30), &RealClock, || {
                    inside.send(()).unwrap();
                    std::thread::sleep(Duration::from_millis(300));
                    2
                })
                .unwrap()
        });
        entered.recv().unwrap();
        let (code, decided) = d.state().plan_turn(Duration::from_secs(30), &RealClock, || 9).unwrap();
        assert_eq!(first.join().unwrap(), (2, true));
        assert_eq!((code, decided), (2, false), "the second waited for the first's outcome");
    });
}

/// Checksums recorded in node caches on disk stay valid across versions: xxh3-64 with seed 0,
/// whatever implementation computes it (the same values as the reference implementation's).
#[test]
fn checksum_is_xxh3_64_golden() {
    let pattern = |n: usize| (0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>();
    assert_eq!(checksum(b""), 0x2d06800538d394c2);
    assert_eq!(checksum(&pattern(3)), 0xa9088dda485b481c);
    assert_eq!(checksum(&pattern(1024)), 0x9b81661c641c72b1);
    assert_eq!(checksum(&pattern(110_000)), 0xcd837f5c597dd0b3);
}
