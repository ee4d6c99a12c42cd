//! The node agent's server (transparent mode): answers interposed processes on a Unix socket
//! from the engine's node cache, and records every cached file it hands out in the shared
//! directory so later opens (any process of the job on this node) find it without asking.
//! One thread per connection, bounded; only processes of this user may connect.
//!
//! The agent process (`python -m clairvoyant._agent`) builds the engine and starts a [`Server`];
//! the Python bindings only wrap it.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::dir::{claim, counter, path_key, DirWriter, Entry};
use crate::proto::{self, Reply, Request};
use clairvoyant_core::engine::{Adopted, Engine, Local, Prefill};

/// Connections served at once; more wait in the listen queue.
const MAX_CONNECTIONS: usize = 4096;
/// How long a lookup may wait for a fill another thread has in progress.
const FILL_WAIT: Duration = Duration::from_secs(30);
/// How long a request may wait for a lazily started engine (the program's first read or its
/// order started it; with several nodes the nodes meet first).
const ENGINE_WAIT: Duration = Duration::from_secs(120);

#[derive(Default)]
struct Counts {
    lookups: AtomicU64,
    cached: AtomicU64,
    inline: AtomicU64,
    inline_bytes: AtomicU64,
    direct: AtomicU64,
    unknown: AtomicU64,
    failed: AtomicU64,
    /// Files programs read themselves and handed over (`Fill`), and those kept in the cache
    /// (files, bytes).
    fills: AtomicU64,
    fills_kept: AtomicU64,
    fill_bytes_kept: AtomicU64,
}

struct Shared {
    /// The engine; None until a lazy agent's first read or order.
    engine: Mutex<Option<Arc<Engine>>>,
    engine_set: Condvar,
    want: Mutex<Option<Event>>,
    wanted: Condvar,
    root: Vec<u8>,
    files: HashMap<Vec<u8>, u32>,
    paths: Vec<PathBuf>,
    /// The shared directory's key of each file (`path_key` of its relative path).
    keys: Vec<u64>,
    dir: DirWriter,
    counts: Counts,
    /// (attached launchers, connections, whether any launcher ever attached).
    live: Mutex<(usize, usize, bool)>,
    changed: Condvar,
    closing: AtomicBool,
    uid: u32,
}

/// The node agent's server: a listening socket, its accept thread and the connections it
/// serves. Closed (socket and directory file removed) by [`Server::close`] or on drop.
pub struct Server {
    shared: Arc<Shared>,
    socket: PathBuf,
    /// The listening socket, shut down by [`Server::close`] to end the accepting thread's wait.
    listener: UnixListener,
    accept: Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// What should start a lazy agent's engine (see [`Server::wait_event`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A program's first read came before any order: place by hashed owners.
    Read,
    /// A program said its order: the per-node order files' path pattern.
    Plan(Vec<u8>),
}

impl Server {
    /// Serve `engine`'s node cache (None: a lazy agent, handed its engine later by
    /// [`Server::set_engine`]) for the files `rel_paths` (sample i is `root/rel_paths[i]`; names
    /// are bytes, any but NUL) on the Unix socket `socket`; cached files are recorded in a new
    /// shared directory file `dir`.
    pub fn start(
        engine: Option<Arc<Engine>>,
        socket: &Path,
        root: &str,
        rel_paths: Vec<Vec<u8>>,
        dir: &Path,
    ) -> io::Result<Server> {
        let dir_writer = DirWriter::create_with_root(dir, rel_paths.len(), path_key(root.as_bytes()))?;
        if let Ok(m) = std::fs::symlink_metadata(socket) {
            if m.file_type().is_socket() {
                // A dead agent's socket: whoever started this one holds the start lock.
                let _ = std::fs::remove_file(socket);
            }
        }
        let listener = UnixListener::bind(socket)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {}: {e}", socket.display())))?;
        let root_path = PathBuf::from(root);
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            engine_set: Condvar::new(),
            want: Mutex::new(None),
            wanted: Condvar::new(),
            paths: rel_paths
                .iter()
                .map(|r| root_path.join(std::ffi::OsStr::from_bytes(r)))
                .collect(),
            keys: rel_paths.iter().map(|r| path_key(r)).collect(),
            files: rel_paths.into_iter().enumerate().map(|(i, r)| (r, i as u32)).collect(),
            root: root.as_bytes().to_vec(),
            dir: dir_writer,
            counts: Counts::default(),
            live: Mutex::new((0, 0, false)),
            changed: Condvar::new(),
            closing: AtomicBool::new(false),
            // SAFETY: getuid cannot fail.
            uid: unsafe { libc::getuid() },
        });
        if let Some(engine) = shared.engine_now() {
            publish_prefilled(&shared, &engine);
        }
        let s = shared.clone();
        let accepting = listener.try_clone()?;
        let accept = std::thread::Builder::new()
            .name("cv-agent-accept".into())
            .spawn(move || accept_loop(s, accepting))?;
        Ok(Server {
            shared,
            socket: socket.to_path_buf(),
            listener,
            accept: Mutex::new(Some(accept)),
        })
    }

    /// Wait at most `step` for a launcher to attach or leave; true once no launcher is
    /// attached any more (after one was), or none attached within `idle_wait` of `since`.
    pub fn idle(&self, step: Duration, since: Instant, idle_wait: Duration) -> bool {
        let live = self.shared.live.lock().unwrap_or_else(|p| p.into_inner());
        let (live, _) = self
            .shared
            .changed
            .wait_timeout(live, step)
            .unwrap_or_else(|p| p.into_inner());
        let (attached, _, ever) = *live;
        if ever {
            attached == 0
        } else {
            since.elapsed() > idle_wait
        }
    }

    /// For a lazy agent: wait at most `step` for what should start its engine.
    pub fn wait_event(&self, step: Duration) -> Option<Event> {
        let want = self.shared.want.lock().unwrap_or_else(|p| p.into_inner());
        let (want, _) = self
            .shared
            .wanted
            .wait_timeout_while(want, step, |w| w.is_none())
            .unwrap_or_else(|p| p.into_inner());
        want.clone()
    }

    /// Hand a lazy agent its engine: requests waiting for it go on.
    pub fn set_engine(&self, engine: Arc<Engine>) {
        publish_prefilled(&self.shared, &engine);
        *self.shared.engine.lock().unwrap_or_else(|p| p.into_inner()) = Some(engine);
        self.shared.engine_set.notify_all();
    }

    /// Let programs fill their misses themselves (order unknown, one node): the first opener
    /// of a file claims it in the shared directory, reads it as it would directly and hands the
    /// bytes over (`Fill`) without waiting; the agent keeps them and settles the claim.
    pub fn let_programs_fill(&self) {
        self.shared.dir.set_programs_fill();
    }

    /// Whether every launcher that attached has gone (and one had).
    pub fn finished(&self) -> bool {
        let live = self.shared.live.lock().unwrap_or_else(|p| p.into_inner());
        live.2 && live.0 == 0
    }

    /// Launchers attached now.
    pub fn attached(&self) -> usize {
        self.shared.live.lock().unwrap_or_else(|p| p.into_inner()).0
    }

    /// The agent's figures as JSON: what it answered, what the programs counted in the shared
    /// directory (`reads`), the engine's reads from the dataset and peers, and the agent's CPU.
    pub fn stats_json(&self) -> String {
        stats_json(&self.shared)
    }

    /// The shared directory file.
    pub fn dir_path(&self) -> &Path {
        self.shared.dir.path()
    }

    /// Stop accepting and remove the socket and the directory file (mappings stay valid for
    /// processes that have them).
    pub fn close(&self) {
        if self.shared.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the accept loop: shutting the listening socket down ends its wait in accept()
        // (which then fails at once), also when the socket's path is gone and no connection
        // can reach it.
        // SAFETY: the descriptor is the listener's, open while `self` lives.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.accept.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(self.shared.dir.path());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.close();
    }
}

impl Shared {
    /// The engine, once there is one: a lazy agent's first read asks for it and waits.
    fn engine_for_read(&self) -> Option<Arc<Engine>> {
        let guard = self.engine.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = guard.as_ref() {
            return Some(e.clone());
        }
        {
            let mut want = self.want.lock().unwrap_or_else(|p| p.into_inner());
            if want.is_none() {
                *want = Some(Event::Read);
                self.wanted.notify_all();
            }
        }
        let (guard, _) = self
            .engine_set
            .wait_timeout_while(guard, ENGINE_WAIT, |e| e.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.clone()
    }

    fn engine_now(&self) -> Option<Arc<Engine>> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// A program says its order: place by it, unless placed (or about to be) otherwise. The
    /// same order again (every rank of the node sends it) is taken, before or after placing.
    fn plan(&self, path: Vec<u8>) -> Reply {
        // Not held together with `want`: `engine_for_read` takes `engine`, then `want`.
        let placed = self.engine_now().is_some();
        let mut want = self.want.lock().unwrap_or_else(|p| p.into_inner());
        match &*want {
            Some(Event::Plan(p)) if *p == path => Reply::Ok,
            _ if placed => Reply::Error {
                message: "the agent has placed the dataset already (a program read it before the order came)".into(),
            },
            None => {
                *want = Some(Event::Plan(path));
                self.wanted.notify_all();
                Reply::Ok
            }
            Some(_) => Reply::Error {
                message: "the agent is placing the dataset already (a program read it before the order came, or another order came first)".into(),
            },
        }
    }
}

fn accept_loop(shared: Arc<Shared>, listener: UnixListener) {
    for conn in listener.incoming() {
        if shared.closing.load(Ordering::Acquire) {
            return;
        }
        let Ok(conn) = conn else { continue };
        if peer_uid(&conn) != Some(shared.uid) {
            continue;
        }
        {
            let mut live = shared.live.lock().unwrap_or_else(|p| p.into_inner());
            if live.1 >= MAX_CONNECTIONS {
                continue;
            }
            live.1 += 1;
        }
        let s = shared.clone();
        let spawned = std::thread::Builder::new().name("cv-agent-conn".into()).spawn(move || {
            let attached = serve(&s, conn);
            let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
            live.1 -= 1;
            if attached {
                live.0 -= 1;
            }
            s.changed.notify_all();
        });
        if spawned.is_err() {
            shared.live.lock().unwrap_or_else(|p| p.into_inner()).1 -= 1;
        }
    }
}

fn peer_uid(conn: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

/// Serve one connection until it closes; whether it was a launcher's (attached).
fn serve(s: &Shared, conn: UnixStream) -> bool {
    let Ok(read_half) = conn.try_clone() else { return false };
    let mut r = BufReader::new(read_half);
    let mut w = BufWriter::new(conn);
    let mut attached = false;
    loop {
        let req = match proto::read_request(&mut r) {
            Ok(req) => req,
            Err(_) => return attached,
        };
        let ok = match req {
            Request::Hello { .. } => match s.engine_for_read() {
                Some(engine) => {
                    let arena = engine.segments().1;
                    let arena_len = arena
                        .as_ref()
                        .and_then(|p| std::fs::metadata(p).ok())
                        .map_or(0, |m| m.len());
                    proto::write_reply(
                        &mut w,
                        &Reply::Hello {
                            version: proto::VERSION,
                            root: s.root.clone(),
                            dir_path: s.dir.path().to_path_buf(),
                            arena_path: arena,
                            arena_len,
                        },
                    )
                }
                None => proto::write_reply(
                    &mut w,
                    &Reply::Error {
                        message: "the node agent has not started its cache yet".into(),
                    },
                ),
            },
            Request::Plan { path } => proto::write_reply(&mut w, &s.plan(path)),
            Request::Attach { .. } => {
                if !attached {
                    attached = true;
                    let mut live = s.live.lock().unwrap_or_else(|p| p.into_inner());
                    live.0 += 1;
                    live.2 = true;
                    s.changed.notify_all();
                }
                proto::write_reply(&mut w, &Reply::Ok)
            }
            Request::Stats => proto::write_reply(&mut w, &Reply::Json { text: stats_json(s) }),
            Request::Lookup { rel } => lookup(s, &rel, &mut w),
            Request::Fill { rel, size, change_ns } => {
                // One way: the bytes follow the frame, nothing is answered.
                let mut bytes = vec![0u8; size as usize];
                if r.read_exact(&mut bytes).is_err() {
                    return attached;
                }
                fill(s, &rel, change_ns, &bytes);
                Ok(())
            }
        };
        if ok.and_then(|_| w.flush()).is_err() {
            return attached;
        }
    }
}

/// Record the files `engine`'s prefill (known order) fills in the shared directory as they are
/// filled, and those it has filled already, so that programs' opens find them without a round
/// trip.
fn publish_prefilled(shared: &Arc<Shared>, engine: &Arc<Engine>) {
    let weak = Arc::downgrade(shared);
    let weak_engine = Arc::downgrade(engine);
    // The engine holds the hook: weak references, so that neither keeps the other alive.
    let pid = std::process::id();
    let hooked = engine.on_prefilled(Box::new(move |file, event| {
        let (Some(s), Some(e)) = (weak.upgrade(), weak_engine.upgrade()) else {
            return;
        };
        let key = s.keys[file as usize];
        match event {
            // Programs that open the file meanwhile wait for it in the directory.
            Prefill::Started => {
                s.dir.claim(key, pid);
            }
            Prefill::Filled if publish(&s, &e, file) => s.dir.settle_held(key, pid, claim::DONE),
            Prefill::Filled | Prefill::Failed => s.dir.settle_held(key, pid, claim::FREE),
        }
    }));
    if hooked {
        for file in 0..shared.paths.len() as u32 {
            if engine.filled(file) {
                publish(shared, engine, file);
            }
        }
    }
}

/// Record filled `file` in the shared directory (it is not filled here if it is not); whether
/// its entry is there now.
fn publish(s: &Shared, engine: &Engine, file: u32) -> bool {
    if !engine.filled(file) {
        return false;
    }
    match engine.local(file, Duration::ZERO) {
        Local::Mapped { offset, len, checksum } => record(s, file, offset, len, checksum),
        _ => false,
    }
}

/// Record `file`'s cached copy in the shared directory; false when the file's last change cannot
/// be read (then nobody should use the copy without asking).
fn record(s: &Shared, file: u32, offset: u64, len: u64, checksum: u64) -> bool {
    // The file's last change now: the engine has checked the copy is of the file as it is
    // (`Engine::local`), and a reader compares it with its own fstat.
    match std::fs::metadata(&s.paths[file as usize]) {
        Ok(m) => {
            let e = Entry {
                file,
                offset,
                size: len,
                checksum,
                mtime_ns: clairvoyant_core::source::last_change_ns(&m).max(0) as u64,
            };
            s.dir.insert(s.keys[file as usize], &e);
            true
        }
        Err(_) => false,
    }
}

/// A program read `rel` itself on a miss (it holds the file's claim) and handed over `bytes`,
/// which were the file's with last change `change_ns`: keep them in the node cache, record the
/// file in the shared directory, then settle the claim (waking the programs waiting on it).
fn fill(s: &Shared, rel: &[u8], change_ns: u64, bytes: &[u8]) {
    s.counts.fills.fetch_add(1, Ordering::Relaxed);
    let key = path_key(rel);
    let (Some(&file), Some(engine)) = (s.files.get(rel), s.engine_now()) else {
        // Not a dataset file (or no cache yet): nobody claims it again; it is read directly.
        s.dir.settle(key, claim::NOT_CACHED);
        return;
    };
    let path = &s.paths[file as usize];
    let unchanged = || {
        std::fs::metadata(path).is_ok_and(|m| {
            m.len() == bytes.len() as u64 && clairvoyant_core::source::last_change_ns(&m).max(0) as u64 == change_ns
        })
    };
    let word = match engine.adopt(file, bytes, unchanged) {
        Adopted::Mapped { offset, len, checksum } => {
            let e = Entry {
                file,
                offset,
                size: len,
                checksum,
                mtime_ns: change_ns,
            };
            s.dir.insert(key, &e);
            claim::DONE
        }
        // Kept in a directory class: a lookup hands it out.
        Adopted::Stored => claim::DONE,
        Adopted::NotCached => claim::NOT_CACHED,
        Adopted::Refused => claim::FREE,
    };
    if word == claim::DONE {
        s.counts.fills_kept.fetch_add(1, Ordering::Relaxed);
        s.counts
            .fill_bytes_kept
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
    }
    s.dir.settle(key, word);
}

/// A program's claim on `key` in progress: wait for its fill (at most [`FILL_WAIT`], less when
/// its process is gone) rather than read the file a second time.
fn wait_for_program_fill(s: &Shared, key: u64) {
    let until = Instant::now() + FILL_WAIT;
    loop {
        let word = s.dir.claim_state(key);
        if !claim::is_pid(word) || !crate::dir::alive(word) || Instant::now() >= until {
            return;
        }
        s.dir.wait_claim(key, word, Duration::from_millis(100));
    }
}

fn lookup(s: &Shared, rel: &[u8], w: &mut impl Write) -> std::io::Result<()> {
    s.counts.lookups.fetch_add(1, Ordering::Relaxed);
    let Some(&file) = s.files.get(rel) else {
        s.counts.unknown.fetch_add(1, Ordering::Relaxed);
        return proto::write_reply(w, &Reply::Unknown);
    };
    let Some(engine) = s.engine_for_read() else {
        s.counts.failed.fetch_add(1, Ordering::Relaxed);
        return proto::write_reply(
            w,
            &Reply::Error {
                message: "the node agent has not started its cache yet".into(),
            },
        );
    };
    wait_for_program_fill(s, s.keys[file as usize]);
    match engine.local(file, FILL_WAIT) {
        Local::Mapped { offset, len, checksum } => {
            if record(s, file, offset, len, checksum) {
                s.counts.cached.fetch_add(1, Ordering::Relaxed);
                proto::write_reply(
                    w,
                    &Reply::Cached {
                        file,
                        size: len,
                        offset,
                        checksum,
                    },
                )
            } else {
                s.counts.direct.fetch_add(1, Ordering::Relaxed);
                proto::write_reply(w, &Reply::Direct)
            }
        }
        Local::Bytes { bytes, checksum, .. } => {
            s.counts.inline.fetch_add(1, Ordering::Relaxed);
            s.counts.inline_bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            proto::write_reply(
                w,
                &Reply::Inline {
                    file,
                    size: bytes.len() as u64,
                    checksum,
                },
            )?;
            w.write_all(&bytes)
        }
        Local::Direct => {
            s.counts.direct.fetch_add(1, Ordering::Relaxed);
            proto::write_reply(w, &Reply::Direct)
        }
        Local::Failed(message) => {
            s.counts.failed.fetch_add(1, Ordering::Relaxed);
            proto::write_reply(w, &Reply::Error { message })
        }
    }
}

/// The agent's figures as JSON: what it answered, what the programs counted in the shared
/// directory (`reads`), the engine's reads from the dataset and peers, and the agent's CPU time.
fn stats_json(s: &Shared) -> String {
    let c = &s.counts;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let counters = s.dir.counters();
    let reads: Vec<String> = counter::NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| format!("\"{}\": {}", n, counters[i].load(Ordering::Relaxed)))
        .collect();
    let engine = s.engine_now();
    let [pfs_bytes, pfs_files, peer_bytes, served_samples, served_bytes] =
        engine.as_ref().map_or([0; 5], |e| e.io_totals());
    let attached = s.live.lock().unwrap_or_else(|p| p.into_inner()).0;
    let (placed_files, placed_bytes) = engine.as_ref().map_or((0, 0), |e| {
        e.placement_summary()
            .iter()
            .fold((0, 0), |(f, b), (_, files, bytes)| (f + files, b + bytes))
    });
    format!(
        concat!(
            "{{\"files\": {}, \"attached\": {}, \"lookups\": {}, \"cached\": {}, \"inline\": {}, \"inline_bytes\": {}, ",
            "\"direct\": {}, \"unknown\": {}, \"failed\": {}, \"program_fills\": {}, \"program_fills_kept\": {}, ",
            "\"program_fill_bytes_kept\": {}, ",
            "\"cached_files\": {}, \"reads\": {{{}}}, ",
            "\"pfs_bytes\": {}, \"pfs_files\": {}, \"peer_bytes\": {}, \"served_samples\": {}, ",
            "\"served_bytes\": {}, \"agent_cpu_s\": {:.3}, \"placed_files\": {}, \"placed_bytes\": {}}}"
        ),
        s.paths.len(),
        attached,
        load(&c.lookups),
        load(&c.cached),
        load(&c.inline),
        load(&c.inline_bytes),
        load(&c.direct),
        load(&c.unknown),
        load(&c.failed),
        load(&c.fills),
        load(&c.fills_kept),
        load(&c.fill_bytes_kept),
        s.dir.len(),
        reads.join(", "),
        pfs_bytes,
        pfs_files,
        peer_bytes,
        served_samples,
        served_bytes,
        cpu_seconds(),
        placed_files,
        placed_bytes,
    )
}

fn cpu_seconds() -> f64 {
    // SAFETY: ru is valid for writes.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0.0;
    }
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}
