//! The node agent's server over a real engine: lookups answered from the node cache and
//! recorded in the shared directory, unknown files, a lazy agent started by an order, launchers
//! attaching and leaving, many connections served at once, and files programs read themselves
//! and hand over (`Fill`).
#![cfg(feature = "server")]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clairvoyant_agent::client::Client;
use clairvoyant_agent::dir::{path_key, DirReader};
use clairvoyant_agent::proto::Reply;
use clairvoyant_agent::server::{Event, Server};
use clairvoyant_core::engine::{AgentCounts, AgentSpec, Engine, JobSpec};
use clairvoyant_core::model::StagingSpec;
use clairvoyant_core::plan::{hashed_counts, hashed_owners};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::list::file_list;
use clairvoyant_core::test_support::{memory_model, pfs};

const WAIT: Duration = Duration::from_secs(10);

fn content(i: usize) -> Vec<u8> {
    (0..1000 + 37 * i).map(|j| (i * 7 + j * 13) as u8).collect()
}

/// `n` files under `dir/data` ("c<i % 3>/f<i>.bin"), their relative paths.
fn dataset(dir: &Path, n: usize) -> (PathBuf, Vec<String>) {
    let root = dir.join("data");
    let rels: Vec<String> = (0..n).map(|i| format!("c{}/f{i}.bin", i % 3)).collect();
    for (i, r) in rels.iter().enumerate() {
        let p = root.join(r);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content(i)).unwrap();
    }
    (root, rels)
}

fn engine(dir: &Path, root: &Path, rels: &[impl AsRef<[u8]>], memory: u64) -> Arc<Engine> {
    engine_with(dir, root, rels, memory, false)
}

/// `prefill`: the order is known, the agent fills the node cache ahead of the programs.
fn engine_with(dir: &Path, root: &Path, rels: &[impl AsRef<[u8]>], memory: u64, prefill: bool) -> Arc<Engine> {
    use std::os::unix::ffi::OsStrExt;
    let paths: Vec<PathBuf> = rels
        .iter()
        .map(|r| root.join(std::ffi::OsStr::from_bytes(r.as_ref())))
        .collect();
    let idx = dir.join("index");
    std::fs::create_dir_all(&idx).unwrap();
    let source = Arc::new(file_list(&paths, &vec![0; paths.len()], Some(&idx)).unwrap());
    let keys: Vec<u64> = rels.iter().map(|r| clairvoyant_agent::checksum(r.as_ref())).collect();
    let owners = hashed_owners(&keys, 1);
    let model = memory_model(memory, StagingSpec::new(32 << 10, 2), pfs(100.0, 0.001));
    let spec = JobSpec {
        schedule: Schedule::shuffle(rels.len() as u64, 1, 1, 1, 0, true).unwrap(),
        rank: 0,
        local_ranks: vec![0],
        run_id: format!("agent-server-test-{}", std::process::id()),
        first_epoch: 0,
        cluster: None,
        agent: Some(AgentSpec {
            counts: Some(AgentCounts {
                own: hashed_counts(&keys, &owners, 0),
                cluster: None,
            }),
            prefill,
            fill_on_read: Vec::new(),
        }),
    };
    Arc::new(Engine::start(source, &model, spec).unwrap())
}

/// Every file looked up once: the bytes the agent points at (or sends) are the file's.
/// Returns (cached, inline, direct).
fn read_all(client: &mut Client, engine: &Engine, rels: &[String]) -> (usize, usize, usize) {
    let arena = engine.segments().1.map(|p| std::fs::File::open(p).unwrap());
    let mut seen = (0, 0, 0);
    for (i, r) in rels.iter().enumerate() {
        match client.lookup(r.as_bytes()).unwrap() {
            (
                Reply::Cached {
                    file,
                    size,
                    offset,
                    checksum,
                },
                _,
            ) => {
                assert_eq!(file as usize, i);
                let mut got = vec![0u8; size as usize];
                arena.as_ref().unwrap().read_exact_at(&mut got, offset).unwrap();
                assert_eq!(got, content(i), "{r} in the arena");
                assert_eq!(clairvoyant_agent::checksum(&got), checksum);
                seen.0 += 1;
            }
            (Reply::Inline { checksum, .. }, data) => {
                assert_eq!(data, content(i), "{r} inline");
                assert_eq!(clairvoyant_agent::checksum(&data), checksum);
                seen.1 += 1;
            }
            (Reply::Direct, _) => seen.2 += 1,
            (other, _) => panic!("{r}: {other:?}"),
        }
    }
    seen
}

fn stat(client: &mut Client, key: &str) -> u64 {
    let text = client.stats().unwrap();
    let at = text
        .find(&format!("\"{key}\": "))
        .unwrap_or_else(|| panic!("{key} in {text}"))
        + key.len()
        + 4;
    text[at..].split([',', '}']).next().unwrap().trim().parse().unwrap()
}

fn start(engine: Option<Arc<Engine>>, dir: &Path, root: &Path, rels: &[String]) -> (Server, PathBuf) {
    let sock = dir.join("agent.sock");
    let rels = rels.iter().map(|r| r.as_bytes().to_vec()).collect();
    let server = Server::start(engine, &sock, root.to_str().unwrap(), rels, &dir.join("dir")).unwrap();
    (server, sock)
}

#[test]
fn lookups_are_served_from_the_node_cache_and_recorded_in_the_directory() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 30);
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let (server, sock) = start(Some(e.clone()), t.path(), &root, &rels);
    let mut c = Client::connect(&sock, WAIT).unwrap();
    // Memory for all of it: every file is cached on its first lookup, and found again.
    assert_eq!(read_all(&mut c, &e, &rels), (rels.len(), 0, 0));
    assert_eq!(read_all(&mut c, &e, &rels), (rels.len(), 0, 0));
    let dir = DirReader::open(server.dir_path()).unwrap();
    assert_eq!(dir.root_key(), path_key(root.to_str().unwrap().as_bytes()));
    for (i, r) in rels.iter().enumerate() {
        let entry = dir
            .lookup(path_key(r.as_bytes()))
            .unwrap_or_else(|| panic!("{r} in the directory"));
        assert_eq!((entry.file as usize, entry.size), (i, content(i).len() as u64));
    }
    assert!(matches!(c.lookup(b"c0/not-there.bin").unwrap().0, Reply::Unknown));
    assert_eq!(stat(&mut c, "lookups"), 2 * rels.len() as u64 + 1);
    assert_eq!(stat(&mut c, "cached"), 2 * rels.len() as u64);
    assert_eq!(stat(&mut c, "unknown"), 1);
    // Each file was read from the dataset once.
    assert_eq!(stat(&mut c, "pfs_files"), rels.len() as u64);
    drop(c);
    let dir_path = server.dir_path().to_path_buf();
    server.close();
    assert!(!sock.exists(), "the socket is removed on close");
    assert!(!dir_path.exists(), "the directory file is removed on close");
}

#[test]
fn a_name_that_is_not_utf8_is_cached_under_its_bytes() {
    use std::os::unix::ffi::OsStrExt;
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("data");
    let rels: Vec<Vec<u8>> = vec![
        b"c0/caf\xe9.bin".to_vec(),
        b"c\xff/x.bin".to_vec(),
        b"c0/plain.bin".to_vec(),
    ];
    let paths: Vec<PathBuf> = rels.iter().map(|r| root.join(std::ffi::OsStr::from_bytes(r))).collect();
    for (i, p) in paths.iter().enumerate() {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content(i)).unwrap();
    }
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let sock = t.path().join("agent.sock");
    let server = Server::start(
        Some(e.clone()),
        &sock,
        root.to_str().unwrap(),
        rels.clone(),
        &t.path().join("dir"),
    )
    .unwrap();
    let mut c = Client::connect(&sock, WAIT).unwrap();
    let arena = std::fs::File::open(e.segments().1.unwrap()).unwrap();
    for _ in 0..2 {
        for (i, r) in rels.iter().enumerate() {
            match c.lookup(r).unwrap().0 {
                Reply::Cached { file, size, offset, .. } => {
                    assert_eq!(file as usize, i);
                    let mut got = vec![0u8; size as usize];
                    arena.read_exact_at(&mut got, offset).unwrap();
                    assert_eq!(got, content(i));
                }
                other => panic!("{:?}: {other:?}", String::from_utf8_lossy(r)),
            }
        }
    }
    let dir = DirReader::open(server.dir_path()).unwrap();
    for (i, r) in rels.iter().enumerate() {
        assert_eq!(dir.lookup(path_key(r)).map(|e| e.file as usize), Some(i));
    }
    // Read from the dataset once each; a name differing only in its encoding is not the file.
    assert_eq!(stat(&mut c, "pfs_files"), 3);
    assert!(matches!(c.lookup("c0/café.bin".as_bytes()).unwrap().0, Reply::Unknown));
}

#[test]
fn a_lazy_agent_starts_on_the_order_and_refuses_a_second_one() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 12);
    let (server, sock) = start(None, t.path(), &root, &rels);
    assert_eq!(server.wait_event(Duration::from_millis(10)), None);
    let mut c = Client::connect(&sock, WAIT).unwrap();
    c.plan(b"/orders/{node}.txt").unwrap().unwrap();
    // The same order again is fine; another is refused with the reason.
    c.plan(b"/orders/{node}.txt").unwrap().unwrap();
    let why = c.plan(b"/other/{node}.txt").unwrap().unwrap_err();
    assert!(why.contains("another order came first"), "{why}");
    assert_eq!(
        server.wait_event(WAIT),
        Some(Event::Plan(b"/orders/{node}.txt".to_vec()))
    );
    // A lookup waits for the engine, then is served.
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let waiting = {
        let (sock, rels, e) = (sock.clone(), rels.clone(), e.clone());
        std::thread::spawn(move || read_all(&mut Client::connect(&sock, WAIT).unwrap(), &e, &rels))
    };
    std::thread::sleep(Duration::from_millis(50));
    server.set_engine(e.clone());
    assert_eq!(waiting.join().unwrap(), (rels.len(), 0, 0));
    // Placed by it: the same order from a later rank is taken, another is refused.
    c.plan(b"/orders/{node}.txt").unwrap().unwrap();
    let why = c.plan(b"/other/{node}.txt").unwrap().unwrap_err();
    assert!(why.contains("placed the dataset already"), "{why}");
}

#[test]
fn an_order_after_the_first_read_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 6);
    let (server, sock) = start(None, t.path(), &root, &rels);
    let reader = {
        let sock = sock.clone();
        std::thread::spawn(move || Client::connect(&sock, WAIT).unwrap().lookup(b"c0/f0.bin").unwrap())
    };
    assert_eq!(server.wait_event(WAIT), Some(Event::Read));
    let mut c = Client::connect(&sock, WAIT).unwrap();
    let why = c.plan(b"/orders/{node}.txt").unwrap().unwrap_err();
    assert!(why.contains("placing the dataset already"), "{why}");
    server.set_engine(engine(t.path(), &root, &rels, 1 << 30));
    assert!(matches!(reader.join().unwrap().0, Reply::Cached { file: 0, .. }));
    let why = c.plan(b"/orders/{node}.txt").unwrap().unwrap_err();
    assert!(why.contains("placed the dataset already"), "{why}");
}

#[test]
fn a_lazy_agents_first_read_asks_for_the_engine() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 6);
    let (server, sock) = start(None, t.path(), &root, &rels);
    let reader = {
        let sock = sock.clone();
        std::thread::spawn(move || Client::connect(&sock, WAIT).unwrap().lookup(b"c1/f1.bin").unwrap())
    };
    assert_eq!(server.wait_event(WAIT), Some(Event::Read));
    server.set_engine(engine(t.path(), &root, &rels, 1 << 30));
    assert!(matches!(reader.join().unwrap().0, Reply::Cached { file: 1, .. }));
}

#[test]
fn the_agent_lives_while_a_launcher_is_attached() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 3);
    let (server, sock) = start(None, t.path(), &root, &rels);
    let since = Instant::now();
    // Nobody attached yet: idle only after the wait for a first launcher.
    assert!(!server.idle(Duration::from_millis(5), since, WAIT));
    assert!(server.idle(Duration::from_millis(5), since, Duration::ZERO));
    let mut launcher = Client::connect(&sock, WAIT).unwrap();
    launcher.attach().unwrap();
    assert_eq!(server.attached(), 1);
    assert!(!server.finished());
    assert!(!server.idle(Duration::from_millis(5), since, Duration::ZERO));
    drop(launcher);
    let deadline = Instant::now() + WAIT;
    while !server.idle(Duration::from_millis(20), since, Duration::ZERO) {
        assert!(Instant::now() < deadline, "the launcher's leaving was not seen");
    }
    assert!(server.finished());
    assert_eq!(server.attached(), 0);
}

#[test]
fn many_connections_are_served_at_once_and_never_wrongly() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 64);
    // Memory for about half: the rest is answered Direct.
    let half: u64 = (0..32).map(|i| content(i).len() as u64).sum();
    let e = engine(t.path(), &root, &rels, half);
    let (_server, sock) = start(Some(e.clone()), t.path(), &root, &rels);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (sock, e, rels) = (sock.clone(), e.clone(), rels.clone());
            std::thread::spawn(move || read_all(&mut Client::connect(&sock, WAIT).unwrap(), &e, &rels))
        })
        .collect();
    for t in threads {
        let s = t.join().unwrap();
        assert_eq!(s.0 + s.1 + s.2, rels.len());
        assert!(s.0 > 0 && s.2 > 0, "{s:?}: some cached, some not");
    }
}

/// The files of `rels` the directory holds, each checked against the arena and the file.
fn published(dir: &DirReader, engine: &Engine, rels: &[String]) -> usize {
    let arena = std::fs::File::open(engine.segments().1.unwrap()).unwrap();
    let mut n = 0;
    for (i, r) in rels.iter().enumerate() {
        if let Some(e) = dir.lookup(path_key(r.as_bytes())) {
            assert_eq!((e.file as usize, e.size), (i, content(i).len() as u64), "{r}");
            let mut got = vec![0u8; e.size as usize];
            arena.read_exact_at(&mut got, e.offset).unwrap();
            assert_eq!(got, content(i), "{r} in the arena");
            assert_eq!(clairvoyant_agent::checksum(&got), e.checksum, "{r}");
            n += 1;
        }
    }
    n
}

#[test]
fn prefilled_files_are_published_in_the_directory_without_a_lookup() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 40);
    for lazy in [false, true] {
        let sub = t.path().join(if lazy { "lazy" } else { "eager" });
        std::fs::create_dir_all(&sub).unwrap();
        let e = engine_with(&sub, &root, &rels, 1 << 30, true);
        // Eager: the server starts on a running engine. Lazy: it is handed the engine later
        // (some files are filled before, the rest after).
        let (server, sock) = if lazy {
            let (server, sock) = start(None, &sub, &root, &rels);
            server.set_engine(e.clone());
            (server, sock)
        } else {
            start(Some(e.clone()), &sub, &root, &rels)
        };
        let dir = DirReader::open(server.dir_path()).unwrap();
        // The prefill has no event to wait for from outside: poll the directory.
        let deadline = Instant::now() + Duration::from_secs(60);
        while published(&dir, &e, &rels) < rels.len() {
            assert!(
                Instant::now() < deadline,
                "prefilled files not published in the directory"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut c = Client::connect(&sock, WAIT).unwrap();
        assert_eq!(stat(&mut c, "lookups"), 0, "nobody asked");
        assert_eq!(stat(&mut c, "pfs_files"), rels.len() as u64, "each file read once");
        drop(c);
        server.close();
    }
}

#[test]
fn concurrent_lookups_of_the_same_files_read_each_file_once() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 60);
    // Order unknown (fills on lookups only), then known (lookups race the prefill).
    for prefill in [false, true] {
        let sub = t.path().join(format!("prefill-{prefill}"));
        std::fs::create_dir_all(&sub).unwrap();
        let e = engine_with(&sub, &root, &rels, 1 << 30, prefill);
        let (server, sock) = start(Some(e.clone()), &sub, &root, &rels);
        let threads: Vec<_> = (0..8usize)
            .map(|k| {
                let (sock, e) = (sock.clone(), e.clone());
                // Pairs of threads share an order: the same file asked at the same time, and
                // distinct files at once.
                let mut order: Vec<usize> = (0..rels.len()).collect();
                order.rotate_left((k / 2) * rels.len() / 4);
                if k % 4 >= 2 {
                    order.reverse();
                }
                let mine: Vec<String> = order.iter().map(|&i| rels[i].clone()).collect();
                let want: Vec<Vec<u8>> = order.iter().map(|&i| content(i)).collect();
                std::thread::spawn(move || {
                    let mut c = Client::connect(&sock, WAIT).unwrap();
                    let arena = std::fs::File::open(e.segments().1.unwrap()).unwrap();
                    for (r, want) in mine.iter().zip(want) {
                        match c.lookup(r.as_bytes()).unwrap() {
                            (Reply::Cached { size, offset, .. }, _) => {
                                let mut got = vec![0u8; size as usize];
                                arena.read_exact_at(&mut got, offset).unwrap();
                                assert_eq!(got, want, "{r}");
                            }
                            (other, _) => panic!("{r}: {other:?}"),
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut c = Client::connect(&sock, WAIT).unwrap();
        assert_eq!(
            stat(&mut c, "pfs_files"),
            rels.len() as u64,
            "each file read from the dataset exactly once (prefill {prefill})"
        );
        drop(c);
        server.close();
    }
}

/// Hand `rel` (sample `i`) to the agent as a program that read it would: a `Fill` and the bytes.
fn send_fill(sock: &Path, rel: &str, bytes: &[u8], change_ns: u64) {
    use std::io::Write;
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    let req = clairvoyant_agent::proto::Request::Fill {
        rel: rel.as_bytes().to_vec(),
        size: bytes.len() as u64,
        change_ns,
    };
    clairvoyant_agent::proto::write_request(&mut s, &req).unwrap();
    s.write_all(bytes).unwrap();
}

fn change_ns(p: &Path) -> u64 {
    clairvoyant_core::source::last_change_ns(&std::fs::metadata(p).unwrap()) as u64
}

/// Wait (on the claim's futex) until `rel`'s claim is settled, and return its word.
fn settled(dir: &DirReader, rel: &str, holder: u32) -> u32 {
    use clairvoyant_agent::dir::{claim, Claimed};
    let key = path_key(rel.as_bytes());
    let until = Instant::now() + WAIT;
    loop {
        // A probe with pid 1 never wins a held claim; it reports the word.
        let word = match dir.claim(key, 1) {
            Claimed::Held(p) if p == holder => None,
            Claimed::Held(p) => Some(p),
            Claimed::Done => Some(claim::DONE),
            Claimed::NotCached => Some(claim::NOT_CACHED),
            Claimed::Won => {
                dir.release(key, 1);
                Some(claim::FREE)
            }
            Claimed::Full => panic!("no room for a claim"),
        };
        if let Some(w) = word {
            return w;
        }
        assert!(Instant::now() < until, "{rel}: the agent never settled the claim");
        dir.wait_claim(key, holder, Duration::from_millis(200));
    }
}

#[test]
fn bytes_a_program_read_are_kept_without_reading_the_file_again() {
    use clairvoyant_agent::dir::{claim, Claimed};
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 12);
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let (server, sock) = start(Some(e.clone()), t.path(), &root, &rels);
    server.let_programs_fill();
    let dir = DirReader::open(server.dir_path()).unwrap();
    assert!(dir.programs_fill());
    let me = std::process::id();
    // A lookup of a file a live program has claimed waits for its fill, and never reads it.
    let key0 = path_key(rels[0].as_bytes());
    assert_eq!(dir.claim(key0, me), Claimed::Won);
    let waiter = {
        let (sock, rel) = (sock.clone(), rels[0].clone());
        std::thread::spawn(move || Client::connect(&sock, WAIT).unwrap().lookup(rel.as_bytes()).unwrap().0)
    };
    for (i, r) in rels.iter().enumerate() {
        let key = path_key(r.as_bytes());
        if i > 0 {
            assert_eq!(dir.claim(key, me), Claimed::Won);
        }
        send_fill(&sock, r, &content(i), change_ns(&root.join(r)));
        assert_eq!(settled(&dir, r, me), claim::DONE, "{r}");
        let entry = dir
            .lookup(key)
            .unwrap_or_else(|| panic!("{r} recorded before the claim is settled"));
        let arena = std::fs::File::open(e.segments().1.unwrap()).unwrap();
        let mut got = vec![0u8; entry.size as usize];
        arena.read_exact_at(&mut got, entry.offset).unwrap();
        assert_eq!(got, content(i), "{r} in the arena");
        assert_eq!(clairvoyant_agent::checksum(&got), entry.checksum);
    }
    assert!(matches!(waiter.join().unwrap(), Reply::Cached { file: 0, .. }));
    let mut c = Client::connect(&sock, WAIT).unwrap();
    assert_eq!(read_all(&mut c, &e, &rels), (rels.len(), 0, 0));
    assert_eq!(stat(&mut c, "pfs_files"), 0, "the agent read nothing itself");
    assert_eq!(stat(&mut c, "program_fills_kept"), rels.len() as u64);
    server.close();
}

#[test]
fn a_fill_of_a_changed_or_unknown_file_is_not_kept() {
    use clairvoyant_agent::dir::{claim, Claimed};
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 4);
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let (server, sock) = start(Some(e.clone()), t.path(), &root, &rels);
    server.let_programs_fill();
    let dir = DirReader::open(server.dir_path()).unwrap();
    let me = std::process::id();
    // The file's last change is not the one the program read: the claim is free again.
    assert_eq!(dir.claim(path_key(rels[1].as_bytes()), me), Claimed::Won);
    send_fill(&sock, &rels[1], &content(1), change_ns(&root.join(&rels[1])) + 1);
    assert_eq!(settled(&dir, &rels[1], me), claim::FREE);
    assert!(dir.lookup(path_key(rels[1].as_bytes())).is_none());
    // Not a dataset file: nobody claims it again.
    assert_eq!(dir.claim(path_key(b"c0/new.bin"), me), Claimed::Won);
    send_fill(&sock, "c0/new.bin", b"abc", 1);
    assert_eq!(settled(&dir, "c0/new.bin", me), claim::NOT_CACHED);
    let mut c = Client::connect(&sock, WAIT).unwrap();
    assert_eq!(stat(&mut c, "program_fills"), 2);
    assert_eq!(stat(&mut c, "program_fills_kept"), 0);
    server.close();
}

#[test]
fn a_claim_whose_program_is_gone_does_not_hold_up_a_lookup() {
    use clairvoyant_agent::dir::Claimed;
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 3);
    let e = engine(t.path(), &root, &rels, 1 << 30);
    let (server, sock) = start(Some(e.clone()), t.path(), &root, &rels);
    server.let_programs_fill();
    let dir = DirReader::open(server.dir_path()).unwrap();
    // A program that claimed the file and was killed before it handed it over.
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let key = path_key(rels[2].as_bytes());
    assert_eq!(dir.claim(key, pid), Claimed::Won);
    assert!(!clairvoyant_agent::dir::alive(pid));
    let mut c = Client::connect(&sock, WAIT).unwrap();
    assert!(matches!(
        c.lookup(rels[2].as_bytes()).unwrap().0,
        Reply::Cached { file: 2, .. }
    ));
    // A program may take the claim over, too.
    assert!(dir.take_over(key, pid, std::process::id()));
    server.close();
}

/// An agent whose folder was removed under it (a cleaner of /tmp or /dev/shm, a user's `rm -r`)
/// still closes: nothing can connect to its socket's path any more, so closing must not rely on
/// a connection to wake the thread that accepts them.
#[test]
fn an_agent_whose_socket_path_is_gone_still_closes() {
    let t = tempfile::tempdir().unwrap();
    let (root, rels) = dataset(t.path(), 4);
    let folder = t.path().join("agent");
    std::fs::create_dir(&folder).unwrap();
    let (server, _sock) = start(None, &folder, &root, &rels);
    std::fs::remove_dir_all(&folder).unwrap();
    let (done, closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        server.close();
        let _ = done.send(());
    });
    assert!(
        closed.recv_timeout(Duration::from_secs(10)).is_ok(),
        "close() still waits for its accepting thread 10 s after its folder was removed"
    );
}
