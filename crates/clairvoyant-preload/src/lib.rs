//! `libclairvoyant_preload.so`: loaded with `LD_PRELOAD` into unmodified programs, it serves
//! reads of files under the dataset root (`CLAIRVOYANT_ROOT`) from the node agent's cache
//! (`CLAIRVOYANT_AGENT`) and passes every other call straight to libc.
//!
//! Design (see docs/transparent.md): a dataset open is a real open (so errno, permissions,
//! fstat, lseek, dup and fork are the kernel's); the library then remembers, per fd, where the
//! file's bytes are cached, and serves `read`-family calls and read-only `mmap` from there,
//! keeping the real file offset in step with `lseek`. Before serving it checks that the fd
//! still names the same file and that the file has not changed, and verifies the cached bytes'
//! checksum once per open. Any doubt or failure: the call goes to the real file.
//!
//! Stand-in opens (the `standin` section below): a read-only open of a file whose cached copy
//! is current is not an open of the file at all; the fd is an open of the arena file, recorded
//! as a stand-in, and every call that would otherwise reveal the arena is answered for the
//! dataset file, or first turns the stand-in into a real open of the file (`make_real`).

// Every public item of this crate is documented, and stays so.
#![warn(missing_docs)]

mod client;
mod fill;
mod paths;
mod real;
mod table;

use clairvoyant_agent::dir::{counter, path_key, Entry};
use client::{count, Found, Session};
use libc::{c_char, c_int, c_ulong, c_void, iovec, mode_t, off_t, size_t, ssize_t, FILE};
use paths::{Config, Place};
use real::{errno, set_errno};
use std::cell::Cell;
use std::ffi::CStr;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use table::Table;

// ---------------------------------------------------------------------------------------------
// Process state

static CONFIG: OnceLock<Option<Config>> = OnceLock::new();

fn config() -> Option<&'static Config> {
    CONFIG.get_or_init(Config::from_env).as_ref()
}

thread_local! {
    /// Set while this thread runs the library's own code: every interposed call it makes
    /// (std's file I/O, the socket) goes straight to libc.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

struct Guard;

impl Guard {
    fn enter() -> Option<Guard> {
        BUSY.try_with(|b| if b.replace(true) { None } else { Some(Guard) })
            .ok()
            .flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = BUSY.try_with(|b| b.set(false));
    }
}

/// Run `body` inside the guard, catching panics; when the guard is already held (our own I/O)
/// or the body panics, run `pass` (the real call) instead.
macro_rules! guarded {
    ($pass:expr, $body:expr) => {{
        match $crate::Guard::enter() {
            None => $pass,
            Some(_g) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| $body)) {
                Ok(v) => v,
                Err(_) => $pass,
            },
        }
    }};
}

mod standin;

/// Print `msg` on stderr once per process per `key`.
pub(crate) fn notice_once(key: &str, msg: &str) {
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.iter().any(|k| k == key) {
        seen.push(key.to_string());
        eprintln!("{msg}");
    }
}

extern "C" fn fork_child() {
    // SAFETY: getpid has no preconditions.
    table::OWNER_PID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    TABLE.after_fork();
    standin::REAL_LOCK.store(false, Ordering::Relaxed);
    standin::pool_after_fork();
    client::fork_child();
}

extern "C" fn init() {
    // SAFETY: getpid has no preconditions.
    table::OWNER_PID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
    // SAFETY: registering fork handlers; they live as long as the process (never unloaded).
    unsafe { libc::pthread_atfork(Some(client::fork_prepare), Some(client::fork_parent), Some(fork_child)) };
    if let Some(_g) = Guard::enter() {
        let _ = catch_unwind(config);
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

// ---------------------------------------------------------------------------------------------
// The fd table

pub(crate) const UNVERIFIED: u8 = 0;
pub(crate) const VERIFIED: u8 = 1;
/// Read the real file from now on (stale or corrupt).
const DROPPED: u8 = 2;

enum Src {
    Arena(Entry),
    Inline(Box<[u8]>),
    /// The bytes this process read from the file at open (a miss it filled itself).
    Own(Box<[u8]>),
    Direct,
}

/// What a stand-in fd stands for.
struct StandIn {
    /// The dataset file's `stat` at open (what `fstat` of the fd answers).
    st: libc::stat,
    /// The path as opened, made absolute at open (the fallback opens it).
    path: std::ffi::CString,
    /// The open's flags without `O_CLOEXEC`.
    flags: c_int,
}

struct FdInfo {
    /// The device and inode the fd names: the dataset file's, or for a stand-in the arena's.
    dev: u64,
    ino: u64,
    size: u64,
    /// The file's last change the cached bytes belong to (ns).
    change_ns: u64,
    rel: Box<[u8]>,
    src: Src,
    session: Option<Arc<Session>>,
    state: AtomicU8,
    /// Set when the fd is an open of the arena standing in for the dataset file.
    standin: Option<StandIn>,
}

static TABLE: Table<FdInfo> = Table::new();

/// With `CLAIRVOYANT_VERIFY=process`: tags of cached copies this process has verified (a
/// direct-mapped set; a collision only costs a second verification).
static VERIFIED_COPIES: [AtomicU64; 4096] = [const { AtomicU64::new(0) }; 4096];

/// Names one cached copy in this process: where its bytes are mapped and what they must be.
fn verified_tag(bytes: &[u8], e: &Entry) -> u64 {
    let mut raw = [0u8; 40];
    for (i, v) in [bytes.as_ptr() as u64, e.offset, e.size, e.checksum, e.file as u64]
        .into_iter()
        .enumerate()
    {
        raw[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    clairvoyant_agent::checksum(&raw) | 1
}

/// Whether the cached copy `bytes` of the arena entry `e` holds what the dataset file held: its
/// checksum, computed now; with `CLAIRVOYANT_VERIFY=process`, a copy this process has verified
/// before is not hashed again (docs/transparent.md: that mode trusts a copy after its first
/// check).
pub(crate) fn copy_holds(bytes: &[u8], e: &Entry) -> bool {
    let per_process = config().is_some_and(|c| c.verify_per_process);
    if !per_process {
        return clairvoyant_agent::checksum(bytes) == e.checksum;
    }
    let tag = verified_tag(bytes, e);
    let slot = &VERIFIED_COPIES[tag as usize % VERIFIED_COPIES.len()];
    if slot.load(Ordering::Acquire) == tag {
        return true;
    }
    if clairvoyant_agent::checksum(bytes) != e.checksum {
        return false;
    }
    slot.store(tag, Ordering::Release);
    true
}

fn last_change_ns(st: &libc::stat) -> u64 {
    let ns = |s: i64, n: i64| (s as i128 * 1_000_000_000 + n as i128).max(0) as u64;
    ns(st.st_mtime, st.st_mtime_nsec).max(ns(st.st_ctime, st.st_ctime_nsec))
}

/// The real `fstat` of `fd` (never the stand-in answer).
pub(crate) fn real_fstat(fd: c_int) -> Option<libc::stat> {
    // SAFETY: plain fstat into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a live, writable `stat`; fstat writes at most one and reports a bad fd as EBADF.
    let mut r = unsafe { real::fstat(fd, &mut st) };
    if r != 0 && errno() == libc::ENOSYS {
        // glibc before 2.33 exports no `fstat` symbol, only `__fxstat`.
        const STAT_VER: c_int = if cfg!(target_arch = "x86_64") { 1 } else { 0 };
        // SAFETY: as above.
        r = unsafe { real::__fxstat(STAT_VER, fd, &mut st) };
    }
    (r == 0).then_some(st)
}

impl FdInfo {
    fn count(&self, i: usize, v: u64) {
        count(self.session.as_deref(), i, v);
    }

    fn is_cached(&self) -> bool {
        !matches!(self.src, Src::Direct)
    }

    /// The cached bytes of the whole file, if they may be served now; `None`: read the real
    /// file. `fd` is dropped from the table when it no longer names this file.
    fn bytes(self: &Arc<Self>, fd: c_int) -> Option<&[u8]> {
        if !self.is_cached() || self.state.load(Ordering::Relaxed) == DROPPED {
            return None;
        }
        let st = real_fstat(fd)?;
        if st.st_dev != self.dev || st.st_ino != self.ino {
            // The fd was closed behind our back and now names another file.
            TABLE.remove_if(fd, self);
            return None;
        }
        if let (Some(_), Src::Arena(e)) = (&self.standin, &self.src) {
            // A stand-in's copy holds the bytes of the open (sealed, or a pooled file no one refills
            // while it is held): it cannot change size.
            if st.st_size as u64 != e.size {
                self.state.store(DROPPED, Ordering::Relaxed);
                self.count(counter::CORRUPT, 1);
                return None;
            }
        } else if st.st_size as u64 != self.size || last_change_ns(&st) != self.change_ns {
            self.state.store(DROPPED, Ordering::Relaxed);
            self.count(counter::STALE, 1);
            return None;
        }
        let bytes = match &self.src {
            Src::Arena(e) => self.session.as_ref()?.arena.as_ref()?.slice(e.offset, e.size),
            Src::Inline(b) | Src::Own(b) => Some(&b[..]),
            Src::Direct => None,
        };
        let Some(bytes) = bytes else {
            self.state.store(DROPPED, Ordering::Relaxed);
            self.count(counter::CORRUPT, 1);
            return None;
        };
        if let Src::Arena(e) = &self.src {
            if self.state.load(Ordering::Acquire) == UNVERIFIED {
                if !copy_holds(bytes, e) {
                    self.state.store(DROPPED, Ordering::Relaxed);
                    self.count(counter::CORRUPT, 1);
                    notice_once(
                        "corrupt",
                        &format!(
                            "clairvoyant: cached bytes of {} fail their checksum; reading the file directly",
                            String::from_utf8_lossy(&self.rel)
                        ),
                    );
                    return None;
                }
                self.state.store(VERIFIED, Ordering::Release);
            }
        }
        Some(bytes)
    }

    fn count_served(&self, n: usize) {
        match self.src {
            Src::Inline(_) => {
                self.count(counter::INLINE_READS, 1);
                self.count(counter::INLINE_BYTES, n as u64);
            }
            // Bytes this process read from the file system itself.
            Src::Own(_) => self.count_direct(n as ssize_t),
            _ => {
                self.count(counter::CACHED_READS, 1);
                self.count(counter::CACHED_BYTES, n as u64);
            }
        }
    }

    fn count_direct(&self, r: ssize_t) {
        if r >= 0 {
            self.count(counter::DIRECT_READS, 1);
            self.count(counter::DIRECT_BYTES, r as u64);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Opens

fn is_write(flags: c_int) -> bool {
    flags & libc::O_ACCMODE != libc::O_RDONLY
        || flags & (libc::O_CREAT | libc::O_TRUNC) != 0
        || flags & libc::O_TMPFILE == libc::O_TMPFILE
}

/// The directory a relative path is resolved from: the cwd or `dirfd`'s path.
fn base_dir(dirfd: c_int, buf: &mut [u8; 4096]) -> Option<usize> {
    if dirfd == libc::AT_FDCWD {
        // SAFETY: buf is writable for its length.
        let p = unsafe { libc::getcwd(buf.as_mut_ptr() as *mut c_char, buf.len()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: getcwd wrote a NUL-terminated string into buf.
        return Some(
            unsafe { CStr::from_ptr(buf.as_ptr() as *const c_char) }
                .to_bytes()
                .len(),
        );
    }
    let link = format!("/proc/self/fd/{dirfd}\0");
    // SAFETY: link is NUL-terminated; buf is writable for its length.
    let n = unsafe {
        libc::readlink(
            link.as_ptr() as *const c_char,
            buf.as_mut_ptr() as *mut c_char,
            buf.len(),
        )
    };
    (n > 0 && (n as usize) < buf.len() && buf[0] == b'/').then_some(n as usize)
}

fn place_of(cfg: &Config, dirfd: c_int, path: &[u8]) -> Place {
    if path.first() == Some(&b'/') {
        return paths::classify_abs(&cfg.roots, path);
    }
    let mut buf = [0u8; 4096];
    match base_dir(dirfd, &mut buf) {
        Some(n) => paths::classify_from(&cfg.roots, &buf[..n], path),
        // Unknown base (no /proc, cwd removed): treat as outside; reads stay correct.
        None => Place::Outside,
    }
}

fn refuse_write(path: &[u8]) -> c_int {
    notice_once(
        "erofs",
        &format!(
            "clairvoyant: refusing to open {} for writing: the dataset root is read-only under clairvoyant",
            String::from_utf8_lossy(path)
        ),
    );
    set_errno(libc::EROFS);
    -1
}

/// After a successful real open of a dataset path: find where the file is cached and
/// remember it for `fd`. `known`: the agent's answer, when it was asked before the open.
fn track(cfg: &Config, fd: c_int, rel: Vec<u8>, flags: c_int, known: Option<Found>) {
    if fd < 0 || fd as usize >= table::MAX_FD || flags & (libc::O_PATH | libc::O_DIRECT) != 0 {
        return;
    }
    let Some(st) = real_fstat(fd) else { return };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return;
    }
    let size = st.st_size as u64;
    let change = last_change_ns(&st);
    let found = match known {
        // Asked before the open: the file may have changed since (the answer was for the size
        // and last change seen then).
        Some(Found::Arena {
            session,
            entry,
            change_known,
        }) => {
            if session.arena.is_some() && entry.size == size && (!change_known || entry.mtime_ns == change) {
                Found::Arena {
                    session,
                    entry,
                    change_known,
                }
            } else {
                count(Some(&session), counter::STALE, 1);
                Found::Direct
            }
        }
        Some(Found::Inline { bytes }) if bytes.len() as u64 != size => {
            count(client::current().as_deref(), counter::STALE, 1);
            Found::Direct
        }
        Some(Found::Claimed(claim)) => fill::read(cfg, claim, fd, &st, &rel),
        Some(found) => found,
        None => find(cfg, fd, &st, &rel),
    };
    let (src, session, change_ns) = match found {
        Found::Unknown | Found::Claimed(_) => return,
        Found::Own { bytes } => (Src::Own(bytes), client::current(), change),
        Found::Direct => (Src::Direct, client::current(), change),
        Found::Inline { bytes } => (Src::Inline(bytes), client::current(), change),
        Found::Arena {
            session,
            entry,
            change_known,
        } => (
            Src::Arena(entry),
            Some(session),
            if change_known { entry.mtime_ns } else { change },
        ),
    };
    count(session.as_deref(), counter::OPENS, 1);
    let info = FdInfo {
        dev: st.st_dev,
        ino: st.st_ino,
        size,
        change_ns,
        rel: rel.into_boxed_slice(),
        src,
        session,
        state: AtomicU8::new(UNVERIFIED),
        standin: None,
    };
    TABLE.set(fd, Some(Arc::new(info)));
}

/// Where the bytes of `rel`, open for real as `fd` (`st` its `fstat`), are: the shared directory
/// (no round trip), else a miss: read by this process when the agent lets programs fill (it
/// claims the file, or waits for the process that has), else asked of the agent.
fn find(cfg: &Config, fd: c_int, st: &libc::stat, rel: &[u8]) -> Found {
    let (size, change) = (st.st_size as u64, last_change_ns(st));
    let Some(session) = client::session(cfg) else {
        return client::lookup(cfg, rel, size);
    };
    let cached = |e: Entry| {
        if session.arena.is_none() {
            client::lookup(cfg, rel, size)
        } else if e.size == size && e.mtime_ns == change {
            Found::Arena {
                session: session.clone(),
                entry: e,
                change_known: true,
            }
        } else {
            count(Some(&session), counter::STALE, 1);
            Found::Direct
        }
    };
    if let Some(e) = session.dir.as_ref().and_then(|d| d.lookup(path_key(rel))) {
        return cached(e);
    }
    match fill::miss(cfg, &session, rel, size) {
        fill::Miss::Ask => client::lookup(cfg, rel, size),
        fill::Miss::Cached(e) => cached(e),
        fill::Miss::Direct => Found::Direct,
        fill::Miss::Read(claim) => fill::read(cfg, claim, fd, st, rel),
    }
}

/// Every open variant ends here with `call`, the exact real function.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
unsafe fn open_common(dirfd: c_int, path: *const c_char, flags: c_int, call: impl Fn() -> c_int) -> c_int {
    guarded!(call(), {
        let Some(cfg) = config() else { return call() };
        if path.is_null() {
            return call();
        }
        // SAFETY: per the caller, a NUL-terminated string.
        let p = unsafe { CStr::from_ptr(path) }.to_bytes();
        match place_of(cfg, dirfd, p) {
            Place::Outside => {
                let fd = call();
                // A slot left by an fd closed behind our back (close_range, a raw syscall).
                if TABLE.has(fd) {
                    TABLE.set(fd, None);
                }
                fd
            }
            Place::Root if !is_write(flags) => call(),
            Place::Root => refuse_write(p),
            Place::Under(_) if is_write(flags) => refuse_write(p),
            Place::Under(rel) => {
                let saved = errno();
                let known = match standin::open(cfg, dirfd, path, p, &rel, flags) {
                    standin::Tried::Fd(fd) => {
                        set_errno(saved);
                        return fd;
                    }
                    standin::Tried::Real(known) => known,
                };
                let fd = call();
                if fd >= 0 {
                    track(cfg, fd, rel, flags, known);
                    set_errno(saved);
                }
                fd
            }
        }
    })
}

/// # Safety
/// C's `open`.
#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_ulong) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::open(path, flags, mode)) }
}

/// # Safety
/// C's `open64`.
#[no_mangle]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: c_ulong) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::open64(path, flags, mode)) }
}

/// # Safety
/// C's `openat`.
#[no_mangle]
pub unsafe extern "C" fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: c_ulong) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(dirfd, path, flags, || real::openat(dirfd, path, flags, mode)) }
}

/// # Safety
/// C's `openat64`.
#[no_mangle]
pub unsafe extern "C" fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: c_ulong) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(dirfd, path, flags, || real::openat64(dirfd, path, flags, mode)) }
}

/// # Safety
/// C's `creat`.
#[no_mangle]
pub unsafe extern "C" fn creat(path: *const c_char, mode: mode_t) -> c_int {
    let flags = libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC;
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::creat(path, mode)) }
}

/// # Safety
/// C's `creat64`.
#[no_mangle]
pub unsafe extern "C" fn creat64(path: *const c_char, mode: mode_t) -> c_int {
    let flags = libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC;
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::creat64(path, mode)) }
}

/// # Safety
/// glibc's fortified `open`.
#[no_mangle]
pub unsafe extern "C" fn __open_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::__open_2(path, flags)) }
}

/// # Safety
/// glibc's fortified `open64`.
#[no_mangle]
pub unsafe extern "C" fn __open64_2(path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(libc::AT_FDCWD, path, flags, || real::__open64_2(path, flags)) }
}

/// # Safety
/// glibc's fortified `openat`.
#[no_mangle]
pub unsafe extern "C" fn __openat_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(dirfd, path, flags, || real::__openat_2(dirfd, path, flags)) }
}

/// # Safety
/// glibc's fortified `openat64`.
#[no_mangle]
pub unsafe extern "C" fn __openat64_2(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
    // SAFETY: the caller keeps C's contract for this call (`path` NUL-terminated and alive, or null, which
    // open_common checks); open_common only reads `path`, and the closure passes the same arguments to libc's
    // definition.
    unsafe { open_common(dirfd, path, flags, || real::__openat64_2(dirfd, path, flags)) }
}

// ---------------------------------------------------------------------------------------------
// Reads

/// Copy `bytes[pos..]` into the buffers; returns the count.
fn copy_out(bytes: &[u8], pos: u64, bufs: &[(*mut u8, usize)]) -> usize {
    let mut at = pos.min(bytes.len() as u64) as usize;
    let mut got = 0;
    for &(p, n) in bufs {
        let k = n.min(bytes.len() - at);
        if k == 0 {
            break;
        }
        // SAFETY: the caller's buffer p is writable for n >= k bytes; the source is in bounds.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().add(at), p, k) };
        at += k;
        got += k;
    }
    got
}

/// Serve a read of `fd` at `pos` (None: the file offset, advanced after) from the cache, or
/// return `None` to make the caller do the real call (counting it as a direct read).
fn serve(fd: c_int, bufs: &[(*mut u8, usize)], pos: Option<off_t>) -> Option<(ssize_t, Arc<FdInfo>)> {
    let info = TABLE.get(fd)?;
    if info.standin.is_some() {
        // The stand-in is the file's verified copy: the kernel reads it, no arena involved.
        return Some((STANDIN_READ, info));
    }
    let Some(bytes) = info.bytes(fd) else {
        return Some((-2, info));
    };
    let saved = errno();
    let at = match pos {
        Some(p) if p < 0 => return Some((-2, info)),
        Some(p) => p,
        // SAFETY: lseek is not interposed; fd is open.
        None => unsafe { real::lseek(fd, 0, libc::SEEK_CUR) },
    };
    if at < 0 {
        return Some((-2, info));
    }
    let got = copy_out(bytes, at as u64, bufs);
    if pos.is_none() {
        // SAFETY: as above.
        if unsafe { real::lseek(fd, at + got as off_t, libc::SEEK_SET) } < 0 {
            return Some((-2, info));
        }
    }
    info.count_served(got);
    set_errno(saved);
    Some((got as ssize_t, info))
}

/// What `serve` answers for a stand-in: make the real call, on the copy.
const STANDIN_READ: ssize_t = -3;

/// The read-family template: serve from the cache, or make the real call.
fn read_common(fd: c_int, bufs: &[(*mut u8, usize)], pos: Option<off_t>, call: impl Fn() -> ssize_t) -> ssize_t {
    if !TABLE.has(fd) {
        return call();
    }
    guarded!(call(), {
        match serve(fd, bufs, pos) {
            Some((r, _)) if r >= 0 => r,
            Some((STANDIN_READ, info)) => {
                let r = call();
                if r >= 0 {
                    info.count_served(r as usize);
                }
                r
            }
            Some((_, info)) => {
                let r = call();
                info.count_direct(r);
                r
            }
            None => call(),
        }
    })
}

/// # Safety
/// C's `read`.
#[no_mangle]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    // SAFETY: the caller's arguments go unchanged to libc's `read`; `buf` writable for `n` bytes is the
    // caller's contract, which read_common relies on too.
    read_common(fd, &[(buf as *mut u8, n)], None, || unsafe { real::read(fd, buf, n) })
}

/// # Safety
/// glibc's fortified `read`.
#[no_mangle]
pub unsafe extern "C" fn __read_chk(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        // SAFETY: n > buflen: the caller's arguments go unchanged to glibc's `__read_chk`, which detects the
        // overflow and aborts (__chk_fail) before writing anything.
        return unsafe { real::__read_chk(fd, buf, n, buflen) };
    }
    // SAFETY: n <= buflen here, so `buf` is writable for `n` bytes, the contract of `read`.
    unsafe { read(fd, buf, n) }
}

/// # Safety
/// C's `pread`.
#[no_mangle]
pub unsafe extern "C" fn pread(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    // SAFETY: the caller's arguments go unchanged to libc's `pread`; `buf` writable for `n` bytes is the
    // caller's contract, which read_common relies on too.
    read_common(fd, &[(buf as *mut u8, n)], Some(off), || unsafe {
        real::pread(fd, buf, n, off)
    })
}

/// # Safety
/// C's `pread64`.
#[no_mangle]
pub unsafe extern "C" fn pread64(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t {
    // SAFETY: the caller's arguments go unchanged to libc's `pread64`; `buf` writable for `n` bytes is the
    // caller's contract, which read_common relies on too.
    read_common(fd, &[(buf as *mut u8, n)], Some(off), || unsafe {
        real::pread64(fd, buf, n, off)
    })
}

/// # Safety
/// glibc's fortified `pread`.
#[no_mangle]
pub unsafe extern "C" fn __pread_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        // SAFETY: n > buflen: the caller's arguments go unchanged to glibc's `__pread_chk`, which detects the
        // overflow and aborts (__chk_fail) before writing anything.
        return unsafe { real::__pread_chk(fd, buf, n, off, buflen) };
    }
    // SAFETY: n <= buflen here, so `buf` is writable for `n` bytes, the contract of `pread`.
    unsafe { pread(fd, buf, n, off) }
}

/// # Safety
/// glibc's fortified `pread64`.
#[no_mangle]
pub unsafe extern "C" fn __pread64_chk(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t {
    if n > buflen {
        // SAFETY: n > buflen: the caller's arguments go unchanged to glibc's `__pread64_chk`, which detects the
        // overflow and aborts (__chk_fail) before writing anything.
        return unsafe { real::__pread64_chk(fd, buf, n, off, buflen) };
    }
    // SAFETY: n <= buflen here, so `buf` is writable for `n` bytes, the contract of `pread64`.
    unsafe { pread64(fd, buf, n, off) }
}

/// The caller's iovecs as (pointer, length) pairs; `None` for an invalid count (the real call
/// reports it).
unsafe fn iovs(iov: *const iovec, cnt: c_int) -> Option<Vec<(*mut u8, usize)>> {
    if iov.is_null() || !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return None;
    }
    // SAFETY: the caller passes cnt valid iovecs.
    let v = unsafe { std::slice::from_raw_parts(iov, cnt as usize) };
    let total = v.iter().try_fold(0usize, |a, i| a.checked_add(i.iov_len))?;
    (total <= isize::MAX as usize).then(|| v.iter().map(|i| (i.iov_base as *mut u8, i.iov_len)).collect())
}

/// The vectored reads: served like `read`/`pread` into the caller's buffers.
///
/// # Safety
/// `iov` holds `cnt` iovecs (the caller's contract with libc).
unsafe fn vectored(
    fd: c_int,
    iov: *const iovec,
    cnt: c_int,
    pos: Option<off_t>,
    call: impl Fn() -> ssize_t,
) -> ssize_t {
    if !TABLE.has(fd) {
        return call();
    }
    // SAFETY: our own contract: `iov` holds `cnt` valid iovecs, as the caller promised libc.
    match unsafe { iovs(iov, cnt) } {
        Some(b) => read_common(fd, &b, pos, call),
        None => call(),
    }
}

/// # Safety
/// C's `readv`.
#[no_mangle]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    // SAFETY: the closure passes the caller's arguments unchanged to libc's `readv`; `vectored` relies on the
    // caller's contract that `iov` holds `cnt` valid iovecs (it checks null and the count range).
    let call = || unsafe { real::readv(fd, iov, cnt) };
    // SAFETY: `iov` holds `cnt` iovecs (the caller's readv contract), as `vectored` requires.
    unsafe { vectored(fd, iov, cnt, None, call) }
}

/// # Safety
/// C's `preadv`.
#[no_mangle]
pub unsafe extern "C" fn preadv(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    // SAFETY: the closure passes the caller's arguments unchanged to libc's `preadv`; `vectored` relies on
    // the caller's contract that `iov` holds `cnt` valid iovecs (it checks null and the count range).
    let call = || unsafe { real::preadv(fd, iov, cnt, off) };
    // SAFETY: `iov` holds `cnt` iovecs (the caller's preadv contract), as `vectored` requires.
    unsafe { vectored(fd, iov, cnt, Some(off), call) }
}

/// # Safety
/// C's `preadv64`.
#[no_mangle]
pub unsafe extern "C" fn preadv64(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t {
    // SAFETY: the closure passes the caller's arguments unchanged to libc's `preadv64`; `vectored` relies on
    // the caller's contract that `iov` holds `cnt` valid iovecs (it checks null and the count range).
    let call = || unsafe { real::preadv64(fd, iov, cnt, off) };
    // SAFETY: `iov` holds `cnt` iovecs (the caller's preadv64 contract), as `vectored` requires.
    unsafe { vectored(fd, iov, cnt, Some(off), call) }
}

// ---------------------------------------------------------------------------------------------
// fd bookkeeping

/// # Safety
/// C's `close`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if BUSY.try_with(|b| !b.get()).unwrap_or(false) {
        // The program closes an agent connection (e.g. closing every fd): let go of it.
        client::closed_by_program(fd);
    }
    if TABLE.has(fd) {
        TABLE.set(fd, None);
    }
    // SAFETY: close takes only the fd number; our table slot for it is cleared above, so nothing of ours
    // refers to the fd afterwards.
    unsafe { real::close(fd) }
}

fn copy_slot(old: c_int, new: c_int) {
    if new >= 0 && new != old && (TABLE.has(old) || TABLE.has(new)) {
        TABLE.set(new, TABLE.get(old));
    }
}

/// Before a call that would give the fd's open file description to an exec'd program (a copy
/// without `O_CLOEXEC`) or act on it as a file: a stand-in `fd` becomes a real open of the
/// dataset file. False (errno `EIO`) when that fails; the call must then not be made.
fn real_before(fd: c_int) -> bool {
    if !TABLE.has(fd) {
        return true;
    }
    guarded!(true, {
        match TABLE.get(fd) {
            Some(info) if info.standin.is_some() => {
                let ok = standin::make_real(fd, &info);
                if !ok {
                    set_errno(libc::EIO);
                }
                ok
            }
            _ => true,
        }
    })
}

/// # Safety
/// C's `dup`.
#[no_mangle]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    // The copy has no O_CLOEXEC: stand-ins stay close-on-exec, so the source becomes real and
    // the copy shares its offset as the kernel's dup does.
    if !real_before(fd) {
        return -1;
    }
    // SAFETY: dup takes only fd numbers (no memory); an invalid fd is the kernel's EBADF.
    let r = unsafe { real::dup(fd) };
    copy_slot(fd, r);
    r
}

/// # Safety
/// C's `dup2`.
#[no_mangle]
pub unsafe extern "C" fn dup2(fd: c_int, new: c_int) -> c_int {
    if fd != new && !real_before(fd) {
        return -1;
    }
    // SAFETY: dup2 takes only fd numbers (no memory); an invalid fd is the kernel's EBADF.
    let r = unsafe { real::dup2(fd, new) };
    copy_slot(fd, r);
    r
}

/// # Safety
/// C's `dup3`.
#[no_mangle]
pub unsafe extern "C" fn dup3(fd: c_int, new: c_int, flags: c_int) -> c_int {
    if fd != new && flags & libc::O_CLOEXEC == 0 && !real_before(fd) {
        return -1;
    }
    // SAFETY: dup3 takes only fd numbers (no memory); an invalid fd is the kernel's EBADF.
    let r = unsafe { real::dup3(fd, new, flags) };
    copy_slot(fd, r);
    r
}

/// Whether `fcntl(fd, cmd, arg)` on a stand-in needs the real file first: everything except
/// reading the flags, making a close-on-exec copy and setting close-on-exec.
fn fcntl_needs_real(cmd: c_int, arg: c_ulong) -> bool {
    match cmd {
        libc::F_GETFD | libc::F_GETFL | libc::F_DUPFD_CLOEXEC => false,
        libc::F_SETFD => arg as c_int & libc::FD_CLOEXEC == 0,
        _ => true,
    }
}

/// # Safety
/// C's `fcntl` (the third argument is passed on as it came).
#[no_mangle]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    if fcntl_needs_real(cmd, arg) && !real_before(fd) {
        return -1;
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `fcntl`, which reads `arg` only as `cmd`
    // requires (the caller's contract for that command).
    let r = unsafe { real::fcntl(fd, cmd, arg) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        copy_slot(fd, r);
    }
    r
}

/// # Safety
/// glibc's `fcntl64`.
#[no_mangle]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: c_ulong) -> c_int {
    if fcntl_needs_real(cmd, arg) && !real_before(fd) {
        return -1;
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `fcntl64`, which reads `arg` only as `cmd`
    // requires (the caller's contract for that command).
    let r = unsafe { real::fcntl64(fd, cmd, arg) };
    if cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC {
        copy_slot(fd, r);
    }
    r
}

// ---------------------------------------------------------------------------------------------
// mmap

/// A private or read-only mapping of a cached dataset file: an anonymous mapping filled from
/// the cache. `None`: make the real call.
fn map_cached(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> Option<*mut c_void> {
    let info = TABLE.get(fd)?;
    if info.standin.is_some() {
        return None; // the copy itself is mapped (`standin::map_real`)
    }
    let shared = matches!(flags & 0x03, libc::MAP_SHARED | libc::MAP_SHARED_VALIDATE);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as off_t;
    if (shared && prot & libc::PROT_WRITE != 0) || len == 0 || off < 0 || off % page != 0 {
        return None;
    }
    let bytes = info.bytes(fd)?;
    let keep =
        libc::MAP_FIXED | libc::MAP_FIXED_NOREPLACE | libc::MAP_NORESERVE | libc::MAP_POPULATE | libc::MAP_LOCKED;
    let aflags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | (flags & keep);
    let saved = errno();
    // SAFETY: a fresh anonymous mapping where the caller asked for one.
    let p = unsafe { real::mmap(addr, len, libc::PROT_READ | libc::PROT_WRITE, aflags, -1, 0) };
    if p == libc::MAP_FAILED {
        set_errno(saved);
        return None;
    }
    let got = copy_out(bytes, off as u64, &[(p as *mut u8, len)]);
    // SAFETY: p..p+len is the mapping just made.
    if prot != libc::PROT_READ | libc::PROT_WRITE && unsafe { libc::mprotect(p, len, prot) } != 0 {
        // SAFETY: p..p+len is the anonymous mapping made above, not yet handed to anyone.
        unsafe { libc::munmap(p, len) };
        set_errno(saved);
        return None;
    }
    info.count(counter::MMAPS, 1);
    info.count_served(got);
    set_errno(saved);
    Some(p)
}

/// `mmap` and `mmap64`: a private or read-only mapping of a cached file is filled from the
/// cache; a stand-in's copy is mapped itself; anything else is the real call.
fn map_common(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
    call: impl Fn() -> *mut c_void,
) -> *mut c_void {
    if fd < 0 || !TABLE.has(fd) {
        return call();
    }
    guarded!(
        call(),
        map_cached(addr, len, prot, flags, fd, off).unwrap_or_else(|| standin::map_real(fd, prot, flags, &call))
    )
}

/// # Safety
/// C's `mmap`.
#[no_mangle]
pub unsafe extern "C" fn mmap(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: the caller's arguments pass unchanged to libc's `mmap`; `map_common` never dereferences `addr`,
    // and a MAP_FIXED over live memory is the caller's own request.
    map_common(addr, len, prot, flags, fd, off, || unsafe {
        real::mmap(addr, len, prot, flags, fd, off)
    })
}

/// # Safety
/// C's `mmap64`.
#[no_mangle]
pub unsafe extern "C" fn mmap64(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    // SAFETY: the caller's arguments pass unchanged to libc's `mmap64`; `map_common` never dereferences
    // `addr`, and a MAP_FIXED over live memory is the caller's own request.
    map_common(addr, len, prot, flags, fd, off, || unsafe {
        real::mmap64(addr, len, prot, flags, fd, off)
    })
}

// ---------------------------------------------------------------------------------------------
// stdio: streams over dataset files are cookie streams whose reads go through `read` above

#[repr(C)]
struct CookieIo {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    fn fopencookie(cookie: *mut c_void, mode: *const c_char, funcs: CookieIo) -> *mut FILE;
}

struct Cookie {
    fd: c_int,
    slot: usize,
}

/// Cookie streams and their fds, so `fileno` answers for them.
const STREAMS: usize = 1024;
static STREAM_FILE: [AtomicUsize; STREAMS] = [const { AtomicUsize::new(0) }; STREAMS];
static STREAM_FD: [AtomicI32; STREAMS] = [const { AtomicI32::new(-1) }; STREAMS];
static STREAM_COUNT: AtomicUsize = AtomicUsize::new(0);

unsafe extern "C" fn ck_read(c: *mut c_void, buf: *mut c_char, n: size_t) -> ssize_t {
    // SAFETY: c is the Cookie made in `cookie_stream`, alive until ck_close.
    let fd = unsafe { (*(c as *const Cookie)).fd };
    // SAFETY: stdio hands its own buffer, writable for `n` bytes (fopencookie's read contract).
    unsafe { read(fd, buf as *mut c_void, n) }
}

unsafe extern "C" fn ck_seek(c: *mut c_void, pos: *mut i64, whence: c_int) -> c_int {
    // SAFETY: as in ck_read; pos is stdio's in/out offset.
    let fd = unsafe { (*(c as *const Cookie)).fd };
    // SEEK_END of a stand-in is the dataset file's end too: the copy has the file's size.
    // SAFETY: lseek takes only numbers; `*pos` reads stdio's valid in/out offset (fopencookie's seek
    // contract).
    let r = unsafe { real::lseek(fd, *pos, whence) };
    if r < 0 {
        return -1;
    }
    // SAFETY: `pos` is stdio's writable offset (fopencookie's seek contract).
    unsafe { *pos = r };
    0
}

unsafe extern "C" fn ck_close(c: *mut c_void) -> c_int {
    // SAFETY: stdio calls close once; the Box is ours from here.
    let c = unsafe { Box::from_raw(c as *mut Cookie) };
    if c.slot < STREAMS {
        STREAM_FD[c.slot].store(-1, Ordering::Relaxed);
        STREAM_FILE[c.slot].store(0, Ordering::Release);
        STREAM_COUNT.fetch_sub(1, Ordering::Relaxed);
    }
    // SAFETY: the stream owns `c.fd` (fopen's or fdopen's fd, given to the stream) and stdio closes it once,
    // here.
    unsafe { close(c.fd) }
}

/// A stdio stream reading the tracked `fd`, or NULL (the caller then uses the real fdopen).
fn cookie_stream(fd: c_int, mode: *const c_char) -> *mut FILE {
    let c = Box::into_raw(Box::new(Cookie { fd, slot: usize::MAX }));
    let funcs = CookieIo {
        read: Some(ck_read),
        write: None,
        seek: Some(ck_seek),
        close: Some(ck_close),
    };
    // SAFETY: c lives until ck_close; mode is the caller's mode string.
    let f = unsafe { fopencookie(c as *mut c_void, mode, funcs) };
    if f.is_null() {
        // SAFETY: not handed to stdio.
        drop(unsafe { Box::from_raw(c) });
        return f;
    }
    for i in 0..STREAMS {
        if STREAM_FILE[i]
            .compare_exchange(0, f as usize, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            STREAM_FD[i].store(fd, Ordering::Release);
            STREAM_COUNT.fetch_add(1, Ordering::Relaxed);
            // SAFETY: c is alive (the stream is open) and only stdio's thread touches it now.
            unsafe { (*c).slot = i };
            break;
        }
    }
    f
}

fn mode_writes(mode: &[u8]) -> bool {
    mode.iter().any(|b| matches!(b, b'w' | b'a' | b'+'))
}

unsafe fn fopen_common(path: *const c_char, mode: *const c_char, call: impl Fn() -> *mut FILE) -> *mut FILE {
    guarded!(call(), {
        let Some(cfg) = config() else { return call() };
        if path.is_null() || mode.is_null() {
            return call();
        }
        // SAFETY: C strings from the caller.
        let (p, m) = unsafe { (CStr::from_ptr(path).to_bytes(), CStr::from_ptr(mode).to_bytes()) };
        match place_of(cfg, libc::AT_FDCWD, p) {
            Place::Outside => call(),
            Place::Root if !mode_writes(m) => call(),
            Place::Root | Place::Under(_) if mode_writes(m) => {
                refuse_write(p);
                std::ptr::null_mut()
            }
            Place::Root => call(),
            Place::Under(rel) => {
                let flags = libc::O_RDONLY | if m.contains(&b'e') { libc::O_CLOEXEC } else { 0 };
                let saved = errno();
                let fd = match standin::open(cfg, libc::AT_FDCWD, path, p, &rel, flags) {
                    standin::Tried::Fd(fd) => fd,
                    standin::Tried::Real(known) => {
                        // SAFETY: path is the caller's C string.
                        let fd = unsafe { real::open(path, flags, 0) };
                        if fd < 0 {
                            return std::ptr::null_mut();
                        }
                        track(cfg, fd, rel, flags, known);
                        fd
                    }
                };
                let f = if TABLE.has(fd) {
                    cookie_stream(fd, mode)
                } else {
                    std::ptr::null_mut()
                };
                let f = if f.is_null() {
                    // SAFETY: `fd` is the open fd made above; `mode` is the caller's NUL-terminated mode
                    // string (checked non-null above).
                    unsafe { real::fdopen(fd, mode) }
                } else {
                    f
                };
                if f.is_null() {
                    let e = errno();
                    TABLE.set(fd, None);
                    // SAFETY: `fd` was opened above by this call and no stream took it, so closing it undoes
                    // our own open.
                    unsafe { real::close(fd) };
                    set_errno(e);
                } else {
                    set_errno(saved);
                }
                f
            }
        }
    })
}

/// # Safety
/// C's `fopen`.
#[no_mangle]
pub unsafe extern "C" fn fopen(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: `path` and `mode` are the caller's NUL-terminated C strings (fopen_common returns the real call
    // for null ones) and pass unchanged to libc's `fopen`.
    unsafe { fopen_common(path, mode, || real::fopen(path, mode)) }
}

/// # Safety
/// C's `fopen64`.
#[no_mangle]
pub unsafe extern "C" fn fopen64(path: *const c_char, mode: *const c_char) -> *mut FILE {
    // SAFETY: `path` and `mode` are the caller's NUL-terminated C strings (fopen_common returns the real call
    // for null ones) and pass unchanged to libc's `fopen64`.
    unsafe { fopen_common(path, mode, || real::fopen64(path, mode)) }
}

/// # Safety
/// C's `fdopen`.
#[no_mangle]
pub unsafe extern "C" fn fdopen(fd: c_int, mode: *const c_char) -> *mut FILE {
    // SAFETY: the caller's fd and NUL-terminated mode string pass unchanged to libc's `fdopen`.
    let call = || unsafe { real::fdopen(fd, mode) };
    if !TABLE.has(fd) || mode.is_null() {
        return call();
    }
    guarded!(call(), {
        // SAFETY: the caller's mode string.
        let m = unsafe { CStr::from_ptr(mode) }.to_bytes();
        // fdopen of an fd opened read-only for writing fails with EINVAL in the real call.
        if mode_writes(m) || fcntl_getfl(fd) & libc::O_ACCMODE != libc::O_RDONLY {
            return call();
        }
        let saved = errno();
        let f = cookie_stream(fd, mode);
        if f.is_null() {
            call()
        } else {
            set_errno(saved);
            f
        }
    })
}

fn fcntl_getfl(fd: c_int) -> c_int {
    // SAFETY: F_GETFL takes no argument.
    unsafe { real::fcntl(fd, libc::F_GETFL, 0) }
}

fn stream_fd(f: *mut FILE) -> Option<c_int> {
    if STREAM_COUNT.load(Ordering::Relaxed) == 0 || f.is_null() {
        return None;
    }
    (0..STREAMS)
        .find(|&i| STREAM_FILE[i].load(Ordering::Acquire) == f as usize)
        .map(|i| STREAM_FD[i].load(Ordering::Acquire))
}

/// # Safety
/// C's `fileno`.
#[no_mangle]
pub unsafe extern "C" fn fileno(f: *mut FILE) -> c_int {
    match stream_fd(f) {
        Some(fd) if fd >= 0 => fd,
        // SAFETY: `f` is not one of our cookie streams: the caller's FILE (or null) passes unchanged to
        // libc's `fileno`.
        _ => unsafe { real::fileno(f) },
    }
}

/// # Safety
/// C's `fileno_unlocked`.
#[no_mangle]
pub unsafe extern "C" fn fileno_unlocked(f: *mut FILE) -> c_int {
    match stream_fd(f) {
        Some(fd) if fd >= 0 => fd,
        // SAFETY: `f` is not one of our cookie streams: the caller's FILE (or null) passes unchanged to
        // libc's `fileno_unlocked`.
        _ => unsafe { real::fileno_unlocked(f) },
    }
}

// ---------------------------------------------------------------------------------------------
// Introspection for tests and tools

/// This process's value of counter `i` (see `clairvoyant_agent::dir::counter`), or 0.
#[no_mangle]
pub extern "C" fn clairvoyant_preload_counter(i: c_int) -> u64 {
    usize::try_from(i)
        .ok()
        .and_then(|i| client::LOCAL.get(i))
        .map_or(0, |c| c.load(Ordering::Relaxed))
}

/// 1 when this process serves a dataset root (both variables set), else 0.
#[no_mangle]
pub extern "C" fn clairvoyant_preload_active() -> c_int {
    guarded!(0, config().is_some() as c_int)
}
