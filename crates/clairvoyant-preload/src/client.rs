//! The process's link to the agent: one Unix socket connection per process (re-made after
//! fork) for its `Hello`, the shared directory and the arena mapped from the agent's `Hello`,
//! and the lookups. Lookups run each on a connection of its own from a small pool, never under
//! a process-wide lock, so the threads of one process have as many lookups in flight as they
//! have opens (a miss costs one read at the program's own concurrency).

use crate::paths::{retry_after, Config, PROBE_TIMEOUT, RETRY_FIRST};
use crate::real;
use clairvoyant_agent::dir::{counter, path_key, DirReader, Entry};
use clairvoyant_agent::proto::{self, Reply, Request};
use std::cell::UnsafeCell;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The largest file accepted inline on the socket (a bigger one is read directly).
pub const MAX_INLINE: u64 = 256 << 20;

/// Counters of this process alone (the shared ones are in the directory).
pub static LOCAL: [AtomicU64; 32] = [const { AtomicU64::new(0) }; 32];

/// The arena file mapped read-only.
pub struct Arena {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a read-only shared mapping, unmapped only on drop.
unsafe impl Send for Arena {}
// SAFETY: the mapping is read-only and unmapped only on drop, so shared references only read immutable bytes.
unsafe impl Sync for Arena {}

impl Arena {
    fn map(path: &std::path::Path, len: u64) -> io::Result<Arena> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        let meta = f.metadata()?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("arena is owned by uid {}, not by this user (uid {me})", meta.uid()),
            ));
        }
        let flen = meta.len();
        if flen < len {
            return Err(io::Error::other(format!(
                "arena is {flen} bytes, the agent announced {len}"
            )));
        }
        if len == 0 {
            return Ok(Arena {
                ptr: std::ptr::null(),
                len: 0,
            });
        }
        // SAFETY: a fresh read-only shared mapping of an open file; the file can be closed after.
        let p = unsafe {
            real::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Arena {
            ptr: p as *const u8,
            len: len as usize,
        })
    }

    /// The bytes at [offset, offset + size), if inside the mapping.
    pub fn slice(&self, offset: u64, size: u64) -> Option<&[u8]> {
        let end = offset.checked_add(size)?;
        if end > self.len as u64 {
            return None;
        }
        if size == 0 {
            return Some(&[]);
        }
        // SAFETY: in bounds of a live read-only mapping. The agent never rewrites placed
        // bytes; if it did, the checksum verified before serving catches it.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(offset as usize), size as usize) })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: exactly the mapping made in `map`.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}

/// What one `Hello` gave: the directory and the arena (either may be missing).
pub struct Session {
    pub dir: Option<DirReader>,
    pub arena: Option<Arena>,
}

impl Session {
    pub fn count(&self, i: usize, v: u64) {
        if let Some(d) = &self.dir {
            d.counters()[i].fetch_add(v, Ordering::Relaxed);
        }
    }
}

/// Add to this process's counter and, when a session is known, to the shared one.
pub fn count(s: Option<&Session>, i: usize, v: u64) {
    LOCAL[i].fetch_add(v, Ordering::Relaxed);
    if let Some(s) = s {
        s.count(i, v);
    }
}

/// Where a dataset file's bytes come from, as decided at open.
pub enum Found {
    /// In the arena of `session`.
    Arena {
        session: Arc<Session>,
        entry: Entry,
        change_known: bool,
    },
    /// Sent on the socket, checksum already verified.
    Inline { bytes: Box<[u8]> },
    /// Read from the file by this process on a miss it claimed (and handed to the agent).
    Own { bytes: Box<[u8]> },
    /// This process holds the file's claim: the real open reads it ([`crate::fill::read`]).
    Claimed(crate::fill::Claim),
    /// Read the file system.
    Direct,
    /// The agent says this is not a dataset file: do not track it.
    Unknown,
}

struct Conn {
    pid: u32,
    stream: Option<UnixStream>,
    sock_ino: u64,
    down_until: Option<Instant>,
    /// Failed round trips or probes in a row (0: the agent answers).
    failures: u32,
    session: Option<Arc<Session>>,
    /// Lookup connections not in use now.
    idle: Vec<Pooled>,
}

/// The most lookup connections of one process; more concurrent lookups share the main one.
pub const POOL: usize = 32;

/// The fds of this process's lookup connections (-1: free slot), so `close` can notice a
/// program closing one behind our back and a forked child can close its copies.
pub static POOL_FDS: [AtomicI32; POOL] = [const { AtomicI32::new(-1) }; POOL];

/// One lookup connection, in slot `slot` of [`POOL_FDS`].
struct Pooled {
    stream: UnixStream,
    slot: usize,
    ino: u64,
}

impl Pooled {
    /// Still ours: the program neither closed nor replaced its fd.
    fn valid(&self) -> bool {
        let fd = self.stream.as_raw_fd();
        POOL_FDS[self.slot].load(Ordering::Relaxed) == fd && fd_ino(fd) == Some(self.ino)
    }

    /// Let go of it, closing the fd only when it is still ours.
    fn release(self) {
        let ours = self.valid();
        let fd = self.stream.as_raw_fd();
        let _ = POOL_FDS[self.slot].compare_exchange(fd, -1, Ordering::Relaxed, Ordering::Relaxed);
        if ours {
            drop(self.stream);
        } else {
            std::mem::forget(self.stream);
        }
    }
}

/// The program closes `fd` itself: if it is one of the agent connections, let go of it.
pub fn closed_by_program(fd: i32) {
    if fd < 0 {
        return;
    }
    let _ = SOCK_FD.compare_exchange(fd, -1, Ordering::Relaxed, Ordering::Relaxed);
    for slot in &POOL_FDS {
        let _ = slot.compare_exchange(fd, -1, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// A mutex that a fork handler can take and release explicitly (pthread), so a child never
/// inherits it locked by a thread that does not exist there.
struct ForkMutex {
    m: UnsafeCell<libc::pthread_mutex_t>,
    v: UnsafeCell<Conn>,
}

// SAFETY: `v` is only reached through `lock`, which holds `m`.
unsafe impl Sync for ForkMutex {}

static CONN: ForkMutex = ForkMutex {
    m: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
    v: UnsafeCell::new(Conn {
        pid: 0,
        stream: None,
        sock_ino: 0,
        down_until: None,
        failures: 0,
        session: None,
        idle: Vec::new(),
    }),
};

/// The fd of the agent socket, so `close` can notice a program closing it behind our back.
pub static SOCK_FD: AtomicI32 = AtomicI32::new(-1);

struct Locked;

impl Locked {
    fn new() -> Locked {
        // SAFETY: a statically initialised pthread mutex.
        unsafe { libc::pthread_mutex_lock(CONN.m.get()) };
        Locked
    }
    #[allow(clippy::mut_from_ref)]
    fn conn(&self) -> &mut Conn {
        // SAFETY: the mutex is held for the life of `self`, and `self` is not shared.
        unsafe { &mut *CONN.v.get() }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: locked in `new` by this thread.
        unsafe { libc::pthread_mutex_unlock(CONN.m.get()) };
    }
}

pub extern "C" fn fork_prepare() {
    // SAFETY: released in fork_parent / fork_child.
    unsafe { libc::pthread_mutex_lock(CONN.m.get()) };
}

pub extern "C" fn fork_parent() {
    // SAFETY: locked in fork_prepare by this thread.
    unsafe { libc::pthread_mutex_unlock(CONN.m.get()) };
}

pub extern "C" fn fork_child() {
    // SAFETY: the forking thread (this one, in the child) locked it in fork_prepare; nobody
    // else exists in the child yet.
    let c = unsafe { &mut *CONN.v.get() };
    // The parent's connection is not ours: close our copy of the descriptor; keep the
    // mappings (inherited, still valid).
    if let Some(s) = c.stream.take() {
        // SAFETY: our inherited copy of the socket fd.
        unsafe { real::close(s.as_raw_fd()) };
        std::mem::forget(s);
    }
    SOCK_FD.store(-1, Ordering::Relaxed);
    // The lookup connections too, idle or in use by threads that do not exist here.
    for slot in &POOL_FDS {
        let fd = slot.swap(-1, Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: our inherited copy of a lookup connection's fd.
            unsafe { real::close(fd) };
        }
    }
    for p in c.idle.drain(..) {
        std::mem::forget(p.stream);
    }
    c.pid = 0;
    c.down_until = None;
    c.failures = 0;
    // SAFETY: the forking thread (this one, in the child) locked this mutex in fork_prepare; unlocking
    // releases that lock once.
    unsafe { libc::pthread_mutex_unlock(CONN.m.get()) };
}

fn peer_uid(fd: i32) -> io::Result<u32> {
    // SAFETY: getsockopt into a zeroed ucred of the right length.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are live locals; `len` holds the size of `cred`, so the kernel writes within
    // it.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut libc::ucred as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Wait while a launcher holds the lock of the agent's folder (`agent.lock` beside the socket):
/// `clairvoyant run` starts the program while it starts the node agent (or while another
/// launcher does), and holds that lock until the agent serves. True when it waited for a lock
/// that was held (the caller connects again); false when there is no lock of this user's to
/// wait for, or it was free.
fn wait_for_start(cfg: &Config) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Some(dir) = cfg.agent.parent() else { return false };
    let Ok(path) = std::ffi::CString::new(dir.join("agent.lock").as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path; flags are constants.
    let fd = unsafe { real::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0) };
    if fd < 0 {
        return false;
    }
    // Only a lock file of this user's (in the launcher's private folder) may hold us up.
    // SAFETY: geteuid has no preconditions.
    let ours = crate::real_fstat(fd)
        .is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG && st.st_uid == unsafe { libc::geteuid() });
    // SAFETY: flock on our own fd: a non-blocking try first (free: nobody is starting the agent).
    let held = ours && unsafe { real::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } != 0;
    if held {
        // SAFETY: as above; blocks until the launcher lets go (it does once the agent serves, or
        // has failed; its exit lets go too).
        while unsafe { real::flock(fd, libc::LOCK_SH) } != 0 && crate::real::errno() == libc::EINTR {}
    }
    // SAFETY: our own fd (closing it drops our shared lock).
    unsafe { real::close(fd) };
    held
}

fn fd_ino(fd: i32) -> Option<u64> {
    crate::real_fstat(fd).map(|st| st.st_ino)
}

/// Reads from the socket within a deadline for the whole round trip.
struct Deadline<'a> {
    s: &'a UnixStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "agent round trip timed out"));
        }
        self.s.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        let mut s: &UnixStream = self.s;
        match s.read(buf) {
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "agent round trip timed out"))
            }
            r => r,
        }
    }
}

impl Conn {
    /// Drop the connection without closing an fd that may no longer be ours.
    fn forget_stream(&mut self, ours: bool) {
        if let Some(s) = self.stream.take() {
            if ours {
                drop(s);
            } else {
                std::mem::forget(s);
            }
        }
        SOCK_FD.store(-1, Ordering::Relaxed);
    }

    fn fail(&mut self, why: &str, cfg: &Config) {
        let ours = self
            .stream
            .as_ref()
            .is_some_and(|s| fd_ino(s.as_raw_fd()) == Some(self.sock_ino));
        self.forget_stream(ours);
        self.failures = self.failures.saturating_add(1);
        let wait = retry_after(self.failures);
        self.down_until = Some(Instant::now() + wait);
        crate::notice_once(
            "agent",
            &format!(
                "clairvoyant: agent at {} failed ({why}); reading files directly, asking again in {} s, then ever more seldom",
                cfg.agent.display(),
                wait.as_secs()
            ),
        );
    }

    /// Connected and greeted, or an error (the caller falls back).
    fn ensure(&mut self, cfg: &Config) -> Result<(), String> {
        let pid = std::process::id();
        if self.pid != pid {
            // A child that did not go through our fork handler (clone, vfork): the socket is the
            // parent's; leave its fd alone, and those of the lookup connections.
            self.forget_stream(false);
            for p in self.idle.drain(..) {
                let _ =
                    POOL_FDS[p.slot].compare_exchange(p.stream.as_raw_fd(), -1, Ordering::Relaxed, Ordering::Relaxed);
                std::mem::forget(p.stream);
            }
            self.pid = pid;
        }
        if self.down_until.is_some_and(|t| Instant::now() < t) {
            return Err("agent unavailable".into());
        }
        if let Some(s) = &self.stream {
            if fd_ino(s.as_raw_fd()) == Some(self.sock_ino) && SOCK_FD.load(Ordering::Relaxed) == s.as_raw_fd() {
                return Ok(());
            }
            // The program closed or replaced our socket fd.
            self.forget_stream(false);
        }
        let mut res = self.connect(cfg);
        if res.is_err() && self.failures == 0 && wait_for_start(cfg) {
            // The launcher was starting the agent (it started the program meanwhile): ask again.
            self.forget_stream(true);
            res = self.connect(cfg);
        }
        if let Err(e) = &res {
            self.fail(e, cfg);
        }
        res
    }

    fn connect(&mut self, cfg: &Config) -> Result<(), String> {
        let s = connect_checked(cfg)?;
        self.sock_ino = fd_ino(s.as_raw_fd()).unwrap_or(0);
        SOCK_FD.store(s.as_raw_fd(), Ordering::Relaxed);
        self.stream = Some(s);
        // After a failure this is a probe: an agent that answers at all greets at once, so a
        // stopped one costs the program a short wait, not another full time-out.
        let within = if self.failures > 0 {
            cfg.timeout.min(PROBE_TIMEOUT)
        } else {
            cfg.timeout
        };
        let s = self.stream.as_ref().ok_or("not connected")?;
        let reply = round_trip_within(
            s,
            &Request::Hello {
                version: proto::VERSION,
                pid: self.pid,
            },
            within,
        )?;
        let Reply::Hello {
            version,
            root,
            dir_path,
            arena_path,
            arena_len,
        } = reply
        else {
            return Err(format!("unexpected answer to hello: {reply:?}"));
        };
        if version != proto::VERSION {
            return Err(format!(
                "agent speaks protocol version {version}, this library {}",
                proto::VERSION
            ));
        }
        let root_n = crate::paths::normalize_abs(&root);
        if !cfg.roots.contains(&root_n) {
            return Err(format!(
                "agent serves the dataset root {:?}, this process was given {:?}",
                String::from_utf8_lossy(&root),
                String::from_utf8_lossy(&cfg.roots[0])
            ));
        }
        if self.session.is_none() {
            let dir = match DirReader::open(&dir_path) {
                Ok(d) if d.root_key() == 0 || d.root_key() == path_key(&root) => Some(d),
                Ok(_) => {
                    crate::notice_once(
                        "dir",
                        &format!(
                            "clairvoyant: {} belongs to another dataset root; not used",
                            dir_path.display()
                        ),
                    );
                    None
                }
                Err(e) => {
                    crate::notice_once("dir", &format!("clairvoyant: {e}; every open asks the agent"));
                    None
                }
            };
            let arena = match arena_path {
                Some(p) => match Arena::map(&p, arena_len) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        crate::notice_once(
                            "arena",
                            &format!("clairvoyant: {}: {e}; cached files are read directly", p.display()),
                        );
                        None
                    }
                },
                None => None,
            };
            self.session = Some(Arc::new(Session { dir, arena }));
        }
        Ok(())
    }
}

/// A new connection to the agent, from a process of this user only.
fn connect_checked(cfg: &Config) -> Result<UnixStream, String> {
    let s = UnixStream::connect(&cfg.agent).map_err(|e| format!("connect: {e}"))?;
    // Only an agent of this user may serve this process: another local user could have
    // put a socket at a predictable path.
    let peer = peer_uid(s.as_raw_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if peer != me {
        return Err(format!(
            "the process behind the socket runs as uid {peer}, not as this user (uid {me})"
        ));
    }
    s.set_write_timeout(Some(cfg.timeout)).map_err(|e| e.to_string())?;
    Ok(s)
}

/// A new lookup connection in a free slot; None when every slot is taken or it cannot connect
/// (the lookup then goes on the main connection).
fn connect_pooled(cfg: &Config) -> Option<Pooled> {
    let stream = connect_checked(cfg).ok()?;
    let fd = stream.as_raw_fd();
    let ino = fd_ino(fd)?;
    let slot = POOL_FDS
        .iter()
        .position(|s| s.compare_exchange(-1, fd, Ordering::Relaxed, Ordering::Relaxed).is_ok())?;
    Some(Pooled { stream, slot, ino })
}

fn round_trip(s: &UnixStream, req: &Request, cfg: &Config) -> Result<Reply, String> {
    round_trip_within(s, req, cfg.timeout)
}

fn round_trip_within(s: &UnixStream, req: &Request, within: Duration) -> Result<Reply, String> {
    let mut w = s;
    proto::write_request(&mut w, req).map_err(|e| format!("send: {e}"))?;
    let mut rd = Deadline {
        s,
        until: Instant::now() + within,
    };
    proto::read_reply(&mut rd).map_err(|e| format!("receive: {e}"))
}

fn inline_bytes(s: &UnixStream, size: u64, cfg: &Config) -> Result<Box<[u8]>, String> {
    if size > MAX_INLINE {
        return Err(format!("inline reply of {size} bytes exceeds {MAX_INLINE}"));
    }
    let mut buf = vec![0u8; size as usize];
    let mut rd = Deadline {
        s,
        until: Instant::now() + cfg.timeout,
    };
    rd.read_exact(&mut buf)
        .map_err(|e| format!("receive inline bytes: {e}"))?;
    Ok(buf.into_boxed_slice())
}

/// A lookup's answer: the reply, and the bytes that follow an `Inline` one.
type Answer = (Reply, Option<Box<[u8]>>);

/// A lookup's round trip.
fn exchange(s: &UnixStream, rel: &[u8], cfg: &Config) -> Result<Answer, String> {
    let reply = round_trip(s, &Request::Lookup { rel: rel.to_vec() }, cfg)?;
    let bytes = match &reply {
        Reply::Inline { size, .. } => Some(inline_bytes(s, *size, cfg)?),
        _ => None,
    };
    Ok((reply, bytes))
}

/// The session of this process, connecting first if there is none and the agent may be asked.
pub fn session(cfg: &Config) -> Option<Arc<Session>> {
    let l = Locked::new();
    let c = l.conn();
    if c.session.is_none() {
        let _ = c.ensure(cfg);
    }
    c.session.clone()
}

/// Run `f` on a connection of the calling thread's own: an idle one of the process's pool, or a
/// new one; when every slot is taken, the main connection under its mutex. The caller has made
/// sure the agent may be asked (`Conn::ensure`). No lock is held while `f` runs on a pooled one.
fn on_connection<T>(cfg: &Config, f: impl Fn(&UnixStream) -> Result<T, String>) -> Result<T, String> {
    let pooled = {
        let l = Locked::new();
        let c = l.conn();
        let mut pooled = None;
        while let Some(p) = c.idle.pop() {
            if p.valid() {
                pooled = Some(p);
                break;
            }
            p.release();
        }
        pooled
    };
    match pooled.or_else(|| connect_pooled(cfg)) {
        Some(p) => {
            let res = f(&p.stream);
            let l = Locked::new();
            let c = l.conn();
            if res.is_ok() {
                // Answered: the agent is back (a greeting alone does not say so).
                c.failures = 0;
            }
            if res.is_ok() && c.pid == std::process::id() {
                c.idle.push(p);
            } else {
                p.release();
            }
            res
        }
        None => {
            // Every slot in use: share the main connection.
            let l = Locked::new();
            let c = l.conn();
            let res = match c.ensure(cfg) {
                Ok(()) => match c.stream.as_ref() {
                    Some(s) => f(s),
                    None => Err("not connected".into()),
                },
                Err(e) => Err(e),
            };
            if res.is_ok() {
                c.failures = 0;
            }
            res
        }
    }
}

/// Send all of `bytes` on `s` (`MSG_NOSIGNAL`: an agent gone is an error, not a `SIGPIPE`).
fn send_all(s: &UnixStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: sending from a live slice on our own socket.
        let n = unsafe {
            libc::send(
                s.as_raw_fd(),
                bytes.as_ptr() as *const libc::c_void,
                bytes.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        bytes = &bytes[n as usize..];
    }
    Ok(())
}

/// Hand `bytes`, the whole of `rel` as of its last change `change_ns`, read by this process on a
/// miss it claimed, to the agent: one `Fill` frame and the bytes, no answer awaited (the agent
/// settles the claim). False when they could not be sent.
pub fn hand_over(cfg: &Config, rel: &[u8], change_ns: u64, bytes: &[u8]) -> bool {
    {
        let l = Locked::new();
        if l.conn().ensure(cfg).is_err() {
            return false;
        }
    }
    let mut frame = Vec::with_capacity(32 + rel.len());
    let req = Request::Fill {
        rel: rel.to_vec(),
        size: bytes.len() as u64,
        change_ns,
    };
    if proto::write_request(&mut frame, &req).is_err() {
        return false;
    }
    let sent = on_connection(cfg, |s| {
        send_all(s, &frame)
            .and_then(|_| send_all(s, bytes))
            .map_err(|e| format!("send a fill: {e}"))
    });
    match sent {
        Ok(()) => true,
        Err(e) => {
            Locked::new().conn().fail(&e, cfg);
            false
        }
    }
}

/// Ask the agent where `rel` is. Any failure counts FALLBACKS and answers `Direct`.
pub fn lookup(cfg: &Config, rel: &[u8], size: u64) -> Found {
    let session = {
        let l = Locked::new();
        let c = l.conn();
        if c.ensure(cfg).is_err() {
            count(c.session.as_deref(), counter::FALLBACKS, 1);
            return Found::Direct;
        }
        c.session.clone()
    };
    count(session.as_deref(), counter::LOOKUPS, 1);
    // The round trip (a fill of the file, perhaps) holds no lock: other threads look up at the
    // same time on connections of their own.
    let answer = on_connection(cfg, |s| exchange(s, rel, cfg));
    let (reply, inline) = match answer {
        Ok(a) => a,
        Err(e) => {
            let l = Locked::new();
            l.conn().fail(&e, cfg);
            count(session.as_deref(), counter::FALLBACKS, 1);
            return Found::Direct;
        }
    };
    answer_to_found(cfg, session, rel, size, reply, inline)
}

/// What a lookup's answer means for the open of `rel` (`size` bytes at open).
fn answer_to_found(
    cfg: &Config,
    session: Option<Arc<Session>>,
    rel: &[u8],
    size: u64,
    reply: Reply,
    inline: Option<Box<[u8]>>,
) -> Found {
    match reply {
        Reply::Cached {
            file,
            size: sz,
            offset,
            checksum,
        } => cached_found(
            session,
            rel,
            size,
            Entry {
                file,
                offset,
                size: sz,
                checksum,
                mtime_ns: 0,
            },
        ),
        Reply::Inline { size: sz, checksum, .. } => inline_found(session.as_deref(), rel, size, sz, checksum, inline),
        Reply::Direct => Found::Direct,
        Reply::Unknown => Found::Unknown,
        Reply::Error { message } => {
            // The connection is fine; the agent could not answer this one.
            Locked::new().conn().down_until = Some(Instant::now() + RETRY_FIRST);
            crate::notice_once(
                "agent-error",
                &format!(
                    "clairvoyant: agent error for {}: {message}; reading directly",
                    String::from_utf8_lossy(rel)
                ),
            );
            count(session.as_deref(), counter::FALLBACKS, 1);
            Found::Direct
        }
        other => {
            let l = Locked::new();
            l.conn().fail(&format!("unexpected answer to a lookup: {other:?}"), cfg);
            count(session.as_deref(), counter::FALLBACKS, 1);
            Found::Direct
        }
    }
}

/// The open of `rel` (`size` bytes at open) answered "cached at `e`" (its change time not yet
/// known): the arena copy, with the change time when the shared directory records the same copy.
fn cached_found(session: Option<Arc<Session>>, rel: &[u8], size: u64, mut e: Entry) -> Found {
    let Some(session) = session.filter(|s| s.arena.is_some()) else {
        return Found::Direct;
    };
    // The directory may know the file's last change (when the agent placed it there).
    let from_dir = session.dir.as_ref().and_then(|d| d.lookup(path_key(rel)));
    let change_known = match from_dir {
        Some(d) if d.offset == e.offset && d.size == e.size && d.checksum == e.checksum => {
            e.mtime_ns = d.mtime_ns;
            true
        }
        _ => false,
    };
    if e.size != size {
        count(Some(&session), counter::STALE, 1);
        return Found::Direct;
    }
    Found::Arena {
        entry: e,
        session,
        change_known,
    }
}

/// The open of `rel` (`size` bytes at open) answered with the bytes themselves (`sz` bytes,
/// `checksum`): used when they are whole and intact, else the file is read directly.
fn inline_found(
    session: Option<&Session>,
    rel: &[u8],
    size: u64,
    sz: u64,
    checksum: u64,
    inline: Option<Box<[u8]>>,
) -> Found {
    let bytes = inline.unwrap_or_default();
    if sz != size {
        count(session, counter::STALE, 1);
        return Found::Direct;
    }
    if clairvoyant_agent::checksum(&bytes) != checksum {
        count(session, counter::CORRUPT, 1);
        crate::notice_once(
            "corrupt",
            &format!(
                "clairvoyant: {}: bytes from the agent fail their checksum; reading the file directly",
                String::from_utf8_lossy(rel)
            ),
        );
        return Found::Direct;
    }
    Found::Inline { bytes }
}

/// Whether the agent is in back-off after a failure (it is not asked now).
pub fn agent_down() -> bool {
    let l = Locked::new();
    l.conn().down_until.is_some_and(|t| Instant::now() < t)
}

/// The current session without connecting.
pub fn current() -> Option<Arc<Session>> {
    let l = Locked::new();
    l.conn().session.clone()
}
