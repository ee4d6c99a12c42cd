//! Stand-in opens: a read-only open of a dataset file whose cached copy is current does not
//! open the file. The fd is a read-only open of an in-memory copy of the file (`memfd`, its own
//! open file description, the copy's checksum verified when made), recorded in the fd table as
//! a stand-in with the dataset file's `stat`. Its size, contents and offsets are the file's, so
//! what the library does not see (io_uring, raw system calls, `sendfile`, a mapping made by
//! another library) still reads the file's bytes, the kernel serves reads, offsets and mappings
//! of it, and dup and fork keep working unchanged. The in-memory files are reused once nothing
//! holds them any more ([`pooled_copy`]).
//!
//! Calls that would reveal the copy's own metadata are answered for the dataset file (`fstat`
//! family, `statx`/`fstatat` on the fd; `lseek` needs nothing: the copy's size is the file's).
//! Calls that act on the open file itself first turn the stand-in into a real open of the file
//! ([`make_real`]): a copy without close-on-exec, locks, ioctls, xattrs, file-system statistics.
//! Reads of any kind (`sendfile`, `splice`, `preadv2`) need nothing: the copy holds the bytes.
//! Stand-ins are close-on-exec only (opens with `O_CLOEXEC`, and copies made with it), so an
//! exec'd program never inherits one. Files over 64 MiB are opened for real (each open stand-in
//! holds a copy).

use crate::client::{self, count, Found, Session};
use crate::fill;
use crate::paths::Config;
use crate::real::{self, errno, set_errno};
use crate::{
    base_dir, last_change_ns, notice_once, real_fstat, FdInfo, Src, StandIn, DROPPED, TABLE, UNVERIFIED, VERIFIED,
};
use clairvoyant_agent::dir::{counter, path_key};
use libc::{c_char, c_int, c_uint, c_ulong, c_void, size_t, ssize_t};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

/// The open flags a stand-in accepts (besides `O_RDONLY`, which is 0); any other flag: a real open.
const FLAGS: c_int = libc::O_CLOEXEC | libc::O_LARGEFILE | libc::O_NOCTTY | libc::O_NONBLOCK | libc::O_NOATIME;

/// Whether this process may read a file of this `stat` by its mode bits. `false` is also the
/// inconclusive answer (too many groups): the caller then makes the real open, whose errno is
/// exact.
fn readable(st: &libc::stat, euid: libc::uid_t) -> bool {
    if euid == 0 {
        return true; // the groups are not needed: no system call for them
    }
    let mut groups = [0 as libc::gid_t; 256];
    // SAFETY: id getters have no preconditions; the buffer holds `groups.len()` entries.
    let (egid, n) = unsafe {
        (
            libc::getegid(),
            libc::getgroups(groups.len() as c_int, groups.as_mut_ptr()),
        )
    };
    if n < 0 {
        return euid == 0;
    }
    readable_by(st, euid, egid, &groups[..n as usize])
}

/// The kernel's read permission check by mode bits alone (no ACLs, no security modules).
fn readable_by(st: &libc::stat, euid: libc::uid_t, egid: libc::gid_t, groups: &[libc::gid_t]) -> bool {
    if euid == 0 {
        return true;
    }
    let bit = if st.st_uid == euid {
        libc::S_IRUSR
    } else if st.st_gid == egid || groups.contains(&st.st_gid) {
        libc::S_IRGRP
    } else {
        libc::S_IROTH
    };
    st.st_mode & bit != 0
}

/// The absolute form of the path an open was given (relative to the cwd or `dirfd`).
fn absolute(dirfd: c_int, p: &[u8]) -> Option<CString> {
    if p.first() == Some(&b'/') {
        return CString::new(p).ok();
    }
    let mut buf = [0u8; 4096];
    let n = base_dir(dirfd, &mut buf)?;
    let mut v = Vec::with_capacity(n + 1 + p.len());
    v.extend_from_slice(&buf[..n]);
    v.push(b'/');
    v.extend_from_slice(p);
    CString::new(v).ok()
}

/// What a stand-in open attempt ended in.
pub(crate) enum Tried {
    /// The stand-in fd.
    Fd(c_int),
    /// Make the real open (errno may have been changed; the caller restores it on success).
    /// `Some`: the agent was asked already (the file was not in the shared directory), and this
    /// is its answer for the real open's fd: asking again would cost a second round trip.
    Real(Option<Found>),
}

/// Try a stand-in open of the dataset file `rel` opened as `path` (`p`, relative to `dirfd`)
/// with `flags`. A file the shared directory does not hold yet is asked of the agent before
/// any open of the file: the agent's fill is this open's only read of the file system (one
/// open, one read), and its answer (cached, or bytes from a peer) becomes the stand-in.
pub(crate) fn open(cfg: &Config, dirfd: c_int, path: *const c_char, p: &[u8], rel: &[u8], flags: c_int) -> Tried {
    if !cfg.standin
        || !crate::table::owner()
        || flags & libc::O_CLOEXEC == 0
        || flags & !FLAGS != 0
        || flags & libc::O_ACCMODE != libc::O_RDONLY
    {
        return Tried::Real(None);
    }
    let Some(session) = client::session(cfg) else {
        return Tried::Real(None);
    };
    let Some(st) = stat_for_standin(dirfd, path, flags) else {
        return Tried::Real(None);
    };
    let found = match find(cfg, session, rel, st.st_size as u64) {
        Ok(found) => found,
        Err(tried) => return tried,
    };
    standin_of(found, dirfd, p, rel, flags, st)
}

/// The metadata of the file `path` (relative to `dirfd`) resolved as the open would (symlinks
/// followed), when a stand-in may replace the open: a regular file this process may read, and
/// `O_NOATIME` only where the real open would allow it (else the real open answers).
fn stat_for_standin(dirfd: c_int, path: *const c_char, flags: c_int) -> Option<libc::stat> {
    // SAFETY: a plain stat into a zeroed struct; path is the caller's C string.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is the caller's NUL-terminated C string (null-checked by the open wrappers); `st` is a
    // live, writable `stat`.
    if unsafe { real::fstatat(dirfd, path, &mut st, 0) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return None;
    }
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if !readable(&st, euid) {
        return None;
    }
    // O_NOATIME: EPERM unless the owner (or privileged): let the real open answer.
    if flags & libc::O_NOATIME != 0 && euid != 0 && euid != st.st_uid {
        return None;
    }
    Some(st)
}

/// Where the bytes of `rel` (`size` bytes) are: in the shared directory, or, on a miss, read by
/// this process itself (the real open does) when the agent lets programs fill, or waited for
/// from the process that does; else the agent fills it now (or waits for the fill in progress)
/// and says where its bytes are. `Err`: the real open, with what is known for its fd.
fn find(cfg: &Config, session: Arc<Session>, rel: &[u8], size: u64) -> Result<Found, Tried> {
    if let Some(entry) = session.dir.as_ref().and_then(|d| d.lookup(path_key(rel))) {
        return Ok(Found::Arena {
            session,
            entry,
            change_known: true,
        });
    }
    match fill::miss(cfg, &session, rel, size) {
        fill::Miss::Cached(entry) => Ok(Found::Arena {
            session,
            entry,
            change_known: true,
        }),
        fill::Miss::Ask => Ok(client::lookup(cfg, rel, size)),
        fill::Miss::Direct => Err(Tried::Real(Some(Found::Direct))),
        fill::Miss::Read(claim) => Err(Tried::Real(Some(Found::Claimed(claim)))),
    }
}

/// A stand-in fd holding the arena copy `found` names, when it is still the file `st` describes
/// and its checksum holds; else the real open, with `found` for its fd (bytes from a peer or a
/// directory class go there, as before).
fn standin_of(found: Found, dirfd: c_int, p: &[u8], rel: &[u8], flags: c_int, st: libc::stat) -> Tried {
    let Found::Arena {
        session,
        entry: e,
        change_known,
    } = &found
    else {
        return Tried::Real(Some(found));
    };
    let (session, e) = (session.clone(), *e);
    let Some(abs) = absolute(dirfd, p) else {
        return Tried::Real(Some(found));
    };
    if !change_known || e.size != st.st_size as u64 || e.mtime_ns != last_change_ns(&st) {
        return Tried::Real(Some(found));
    }
    let Some(bytes) = session.arena.as_ref().and_then(|a| a.slice(e.offset, e.size)) else {
        return Tried::Real(Some(found));
    };
    if !crate::copy_holds(bytes, &e) {
        count(Some(&session), counter::CORRUPT, 1);
        return Tried::Real(None); // the real open; its reads go to the file system
    }
    let Some(fd) = copy_fd(&abs, bytes) else {
        return Tried::Real(Some(found));
    };
    let Some(ast) = real_fstat(fd).filter(|_| (fd as usize) < crate::table::MAX_FD) else {
        // SAFETY: our own fd, not yet handed out.
        unsafe { real::close(fd) };
        return Tried::Real(Some(found));
    };
    count(Some(&session), counter::OPENS, 1);
    count(Some(&session), counter::STANDINS, 1);
    let info = FdInfo {
        dev: ast.st_dev,
        ino: ast.st_ino,
        size: e.size,
        change_ns: e.mtime_ns,
        rel: rel.into(),
        src: Src::Arena(e),
        session: Some(session.clone()),
        state: AtomicU8::new(VERIFIED),
        standin: Some(StandIn {
            st,
            path: abs,
            flags: flags & !libc::O_CLOEXEC,
        }),
    };
    TABLE.set(fd, Some(Arc::new(info)));
    Tried::Fd(fd)
}

/// The largest file served by a stand-in (each open stand-in holds a copy of its file).
const MAX_COPY: usize = 64 << 20;

/// The in-memory file a stand-in reads: a reused one from this process's pool when one is free
/// (see [`pooled_copy`]), else a new sealed one.
fn copy_fd(path: &CString, bytes: &[u8]) -> Option<c_int> {
    if bytes.len() > MAX_COPY {
        return None;
    }
    let saved = errno();
    let fd = pooled_copy(bytes).or_else(|| sealed_copy(path, bytes));
    set_errno(saved);
    fd
}

/// A new sealed in-memory file (`memfd`, close-on-exec) holding exactly `bytes`, offset 0:
/// whatever reaches it unseen (io_uring, raw system calls, `sendfile`, a mapping) reads the
/// dataset file's bytes.
fn sealed_copy(path: &CString, bytes: &[u8]) -> Option<c_int> {
    let base = path.as_bytes().rsplit(|&b| b == b'/').next().unwrap_or(b"");
    let mut name = b"clairvoyant:".to_vec();
    name.extend_from_slice(&base[..base.len().min(200)]);
    let name = CString::new(name).ok()?;
    // SAFETY: a valid C string; flags are constants.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return None;
    }
    if !fill(fd, bytes) {
        // SAFETY: our own fd.
        unsafe { real::close(fd) };
        return None;
    }
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on our own fd.
    unsafe { real::fcntl(fd, libc::F_ADD_SEALS, seals as c_ulong) };
    Some(fd)
}

/// Make the in-memory file `fd` hold exactly `bytes`.
fn fill(fd: c_int, bytes: &[u8]) -> bool {
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::FileExt;
    // SAFETY: `fd` is our own open file; ManuallyDrop leaves it open (the caller owns it).
    let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    file.set_len(bytes.len() as u64).is_ok() && file.write_all_at(bytes, 0).is_ok()
}

// ---------------------------------------------------------------------------------------------
// Reused copies

/// In-memory files kept for reuse per process.
const POOL_FILES: usize = 8;
/// The largest copy made in a reused file (larger ones would hold their memory between opens).
const POOL_MAX_BYTES: usize = 4 << 20;

/// One reusable in-memory file: this process's read-write open of it, and its identity (the fd
/// number may have been closed by the program and reused for something else).
#[derive(Clone, Copy)]
struct Pooled {
    fd: c_int,
    dev: u64,
    ino: u64,
}

static POOL: std::sync::Mutex<Vec<Pooled>> = std::sync::Mutex::new(Vec::new());
/// No reuse in this process: leases are unavailable, `/proc` is not mounted, or the pool was
/// held by another thread when the process forked.
static POOL_OFF: AtomicBool = AtomicBool::new(false);

/// A stand-in's copy made in a reused in-memory file, when one is free: a new file per open
/// costs fresh pages (allocated, zeroed, freed at close) for every file read, several times the
/// copy itself. The stand-in fd is a read-only open of the file of its own (through
/// `/proc/self/fd`), and the pool keeps the read-write one. A file is filled again only when
/// nothing else holds it: a write lease is granted only when no other open of the file exists,
/// so a stand-in still open, a copy of its fd (here or in a child), a mapping of it, or an fd in
/// flight to another process keeps its bytes as they were. None: fall back to a new sealed copy.
fn pooled_copy(bytes: &[u8]) -> Option<c_int> {
    if bytes.len() > POOL_MAX_BYTES || POOL_OFF.load(Ordering::Relaxed) {
        return None;
    }
    let p = take_unheld()?;
    if !fill(p.fd, bytes) {
        // SAFETY: the pool's own fd, taken out of it above.
        unsafe { real::close(p.fd) };
        return None;
    }
    let fd = reopen(p.fd, libc::O_RDONLY | libc::O_CLOEXEC);
    match POOL.try_lock() {
        Ok(mut pool) if pool.len() < POOL_FILES => pool.push(p),
        // SAFETY: the pool's own fd, not in it any more (the stand-in holds the file).
        _ => unsafe {
            real::close(p.fd);
        },
    }
    (fd >= 0).then_some(fd)
}

/// A pooled file that nothing else holds, taken out of the pool, or a new one while the pool
/// has room; None when every pooled file is held (or the pool is busy or off).
fn take_unheld() -> Option<Pooled> {
    let mut pool = POOL.try_lock().ok()?;
    let mut i = 0;
    while i < pool.len() {
        let p = pool[i];
        if !real_fstat(p.fd).is_some_and(|st| st.st_dev == p.dev && st.st_ino == p.ino) {
            // The program closed the fd (its number may name another file now): forget it.
            pool.swap_remove(i);
            continue;
        }
        match unheld(p.fd) {
            Some(true) => return Some(pool.swap_remove(i)),
            Some(false) => i += 1,
            None => {
                POOL_OFF.store(true, Ordering::Relaxed);
                return None;
            }
        }
    }
    if pool.len() >= POOL_FILES {
        return None;
    }
    drop(pool);
    new_pooled()
}

/// Whether no open of the file `fd` is open but `fd`'s own: a write lease is granted only then
/// (and given back at once). None: leases cannot be taken here.
fn unheld(fd: c_int) -> Option<bool> {
    // SAFETY: fcntl on the pool's own fd.
    if unsafe { real::fcntl(fd, libc::F_SETLEASE, libc::F_WRLCK as c_ulong) } == 0 {
        // SAFETY: as above.
        unsafe { real::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK as c_ulong) };
        return Some(true);
    }
    match errno() {
        libc::EAGAIN | libc::EBUSY => Some(false),
        _ => None,
    }
}

/// A new in-memory file for the pool. The pool keeps an open of it made through `/proc`, not
/// `memfd_create`'s own: only an open made that way counts as a writer in the lease's check.
fn new_pooled() -> Option<Pooled> {
    // SAFETY: a constant C string and flags.
    let m = unsafe { libc::memfd_create(c"clairvoyant:copy".as_ptr(), libc::MFD_CLOEXEC) };
    if m < 0 {
        return None;
    }
    let fd = reopen(m, libc::O_RDWR | libc::O_CLOEXEC);
    // SAFETY: our own fd, replaced by `fd`.
    unsafe { real::close(m) };
    if fd < 0 {
        POOL_OFF.store(true, Ordering::Relaxed);
        return None;
    }
    let st = real_fstat(fd)?;
    Some(Pooled {
        fd,
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// A new open (its own open file description) of what `fd` names, through `/proc/self/fd`.
fn reopen(fd: c_int, flags: c_int) -> c_int {
    let Ok(path) = CString::new(format!("/proc/self/fd/{fd}")) else {
        return -1;
    };
    // SAFETY: a NUL-terminated path; no mode needed without O_CREAT.
    unsafe { real::open(path.as_ptr(), flags, 0) }
}

/// In a forked child: the pool's fds are the parent's open file descriptions, which the parent
/// fills again; the child closes its copies and starts an empty pool (or none, if another thread
/// held the pool when the process forked).
pub(crate) fn pool_after_fork() {
    match POOL.try_lock() {
        Ok(mut pool) => {
            for p in pool.drain(..) {
                // SAFETY: the child's copy of a pool fd.
                unsafe { real::close(p.fd) };
            }
        }
        Err(_) => POOL_OFF.store(true, Ordering::Relaxed),
    }
}

/// Held while a stand-in becomes real (released in a forked child).
pub(crate) static REAL_LOCK: AtomicBool = AtomicBool::new(false);

struct RealLock;

impl RealLock {
    fn take() -> RealLock {
        while REAL_LOCK
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            // Held for one open + dup3 by another thread.
            std::thread::yield_now();
        }
        RealLock
    }
}

impl Drop for RealLock {
    fn drop(&mut self) {
        REAL_LOCK.store(false, Ordering::Release);
    }
}

/// Whether `fd` still is the stand-in `info` (not closed behind our back, not made real).
fn still_standin(fd: c_int, info: &FdInfo) -> bool {
    info.standin.is_some() && real_fstat(fd).is_some_and(|st| st.st_dev == info.dev && st.st_ino == info.ino)
}

/// Turn the stand-in `fd` into a real open of the dataset file: open the file, `dup3` it onto
/// `fd` (keeping its close-on-exec state), set its offset to the stand-in's position, close the
/// temporary fd, and replace the table entry by a direct one (still served from the cache unless
/// the cached copy was dropped). True when `fd` no longer is a stand-in; false when the file
/// cannot be opened (errno untouched; the caller reports `EIO`).
pub(crate) fn make_real(fd: c_int, info: &Arc<FdInfo>) -> bool {
    let Some(si) = &info.standin else { return true };
    let _l = RealLock::take();
    if !still_standin(fd, info) {
        return true; // another thread made it real, or the fd names something else now
    }
    let saved = errno();
    let fail = |why: String| {
        notice_once(
            "standin-real",
            &format!(
                "clairvoyant: cannot open {} to replace its cached stand-in ({why}); the read fails with EIO",
                si.path.to_string_lossy()
            ),
        );
        set_errno(saved);
        false
    };
    // SAFETY: fcntl/lseek on an open fd.
    let fdflags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
    // SAFETY: lseek takes only numbers; `fd` is the open stand-in fd being made real.
    let pos = unsafe { real::lseek(fd, 0, libc::SEEK_CUR) };
    if fdflags < 0 || pos < 0 {
        return fail(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: the recorded absolute path; read-only flags of the original open.
    let tmp = unsafe { real::open(si.path.as_ptr(), si.flags | libc::O_CLOEXEC, 0) };
    if tmp < 0 {
        return fail(std::io::Error::last_os_error().to_string());
    }
    let Some(st) = real_fstat(tmp) else {
        // SAFETY: our temporary fd.
        unsafe { real::close(tmp) };
        return fail("fstat failed".into());
    };
    let cloexec = if fdflags & libc::FD_CLOEXEC != 0 {
        libc::O_CLOEXEC
    } else {
        0
    };
    // SAFETY: both fds are open; fd's old description (the copy) is closed by dup3.
    if unsafe { real::dup3(tmp, fd, cloexec) } < 0 {
        let e = std::io::Error::last_os_error().to_string();
        // SAFETY: `tmp` is the fd opened above, ours alone; closing it on this failure path leaks nothing and
        // touches no caller fd.
        unsafe { real::close(tmp) };
        return fail(e);
    }
    // SAFETY: fd is now the real file.
    unsafe {
        real::lseek(fd, pos, libc::SEEK_SET);
        real::close(tmp);
    }
    let dropped = info.state.load(Ordering::Relaxed) == DROPPED;
    let src = match &info.src {
        Src::Arena(e) if !dropped => Src::Arena(*e),
        _ => Src::Direct,
    };
    let state = if dropped {
        UNVERIFIED
    } else {
        info.state.load(Ordering::Acquire)
    };
    let real_info = FdInfo {
        dev: st.st_dev,
        ino: st.st_ino,
        size: info.size,
        change_ns: info.change_ns,
        rel: info.rel.clone(),
        src,
        session: info.session.clone(),
        state: AtomicU8::new(state),
        standin: None,
    };
    TABLE.set(fd, Some(Arc::new(real_info)));
    set_errno(saved);
    true
}

/// A mapping the cache does not serve: a stand-in's copy is mapped itself, except a writable
/// shared mapping (the read-only or sealed copy refuses it with another errno than the file
/// would): the
/// stand-in becomes real first.
pub(crate) fn map_real(fd: c_int, prot: c_int, flags: c_int, call: &dyn Fn() -> *mut c_void) -> *mut c_void {
    let shared = matches!(flags & 0x03, libc::MAP_SHARED | libc::MAP_SHARED_VALIDATE);
    match TABLE.get(fd) {
        Some(info) if info.standin.is_some() && shared && prot & libc::PROT_WRITE != 0 && !make_real(fd, &info) => {
            set_errno(libc::EIO);
            libc::MAP_FAILED
        }
        Some(info) if info.standin.is_some() => {
            let p = call();
            if p != libc::MAP_FAILED {
                info.count(counter::MMAPS, 1);
            }
            p
        }
        _ => call(),
    }
}

// ---------------------------------------------------------------------------------------------
// What reveals the copy: stat of the fd

/// The dataset file's `stat` when `fd` is a stand-in.
fn stat_of(fd: c_int) -> Option<libc::stat> {
    if !TABLE.has(fd) {
        return None;
    }
    let info = TABLE.get(fd)?;
    let si = info.standin.as_ref()?;
    still_standin(fd, &info).then_some(si.st)
}

/// Run `body` with the stand-in `stat` of `fd` inside the guard, or return `None`.
fn with_stat<R>(fd: c_int, body: impl FnOnce(&libc::stat) -> R) -> Option<R> {
    if !TABLE.has(fd) {
        return None;
    }
    guarded!(None, stat_of(fd).map(|st| body(&st)))
}

const _: () = assert!(std::mem::size_of::<libc::stat>() == std::mem::size_of::<libc::stat64>());

/// # Safety
/// `buf` points to a writable `struct stat` (or `stat64`: the same layout here).
unsafe fn put_stat(st: &libc::stat, buf: *mut c_void) -> c_int {
    // SAFETY: per the caller.
    unsafe { std::ptr::write_unaligned(buf as *mut libc::stat, *st) };
    0
}

fn empty_path(path: *const c_char, flags: c_int) -> bool {
    // SAFETY: a non-NULL C string from the caller.
    flags & libc::AT_EMPTY_PATH != 0 && !path.is_null() && unsafe { *path } == 0
}

/// # Safety
/// C's `fstat`.
#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, buf: *mut libc::stat) -> c_int {
    // SAFETY: `buf` is the caller's writable `struct stat` (C's contract for this call); put_stat writes
    // exactly one. Otherwise the arguments pass unchanged to libc's `fstat`.
    with_stat(fd, |st| unsafe { put_stat(st, buf as *mut c_void) }).unwrap_or_else(|| unsafe { real::fstat(fd, buf) })
}

/// # Safety
/// C's `fstat64`.
#[no_mangle]
pub unsafe extern "C" fn fstat64(fd: c_int, buf: *mut libc::stat64) -> c_int {
    // SAFETY: `buf` is the caller's writable `struct stat64` (C's contract for this call); put_stat writes
    // exactly one. Otherwise the arguments pass unchanged to libc's `fstat64`.
    with_stat(fd, |st| unsafe { put_stat(st, buf as *mut c_void) }).unwrap_or_else(|| unsafe { real::fstat64(fd, buf) })
}

/// # Safety
/// glibc's old `fstat` entry point.
#[no_mangle]
pub unsafe extern "C" fn __fxstat(ver: c_int, fd: c_int, buf: *mut libc::stat) -> c_int {
    // SAFETY: `buf` is the caller's writable `struct stat` (C's contract for this call); put_stat writes
    // exactly one.
    with_stat(fd, |st| unsafe { put_stat(st, buf as *mut c_void) })
        // SAFETY: the caller's arguments pass unchanged to glibc's `__fxstat`.
        .unwrap_or_else(|| unsafe { real::__fxstat(ver, fd, buf) })
}

/// # Safety
/// glibc's old `fstat64` entry point.
#[no_mangle]
pub unsafe extern "C" fn __fxstat64(ver: c_int, fd: c_int, buf: *mut libc::stat64) -> c_int {
    // SAFETY: `buf` is the caller's writable `struct stat64` (C's contract for this call); put_stat writes
    // exactly one.
    with_stat(fd, |st| unsafe { put_stat(st, buf as *mut c_void) })
        // SAFETY: the caller's arguments pass unchanged to glibc's `__fxstat64`.
        .unwrap_or_else(|| unsafe { real::__fxstat64(ver, fd, buf) })
}

/// # Safety
/// C's `fstatat`.
#[no_mangle]
pub unsafe extern "C" fn fstatat(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int {
    if empty_path(path, flags) {
        // SAFETY: `buf` is the caller's writable `struct stat` (C's contract for this call); put_stat writes
        // exactly one.
        if let Some(r) = with_stat(dirfd, |st| unsafe { put_stat(st, buf as *mut c_void) }) {
            return r;
        }
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `fstatat`.
    unsafe { real::fstatat(dirfd, path, buf, flags) }
}

/// # Safety
/// C's `fstatat64`.
#[no_mangle]
pub unsafe extern "C" fn fstatat64(dirfd: c_int, path: *const c_char, buf: *mut libc::stat64, flags: c_int) -> c_int {
    if empty_path(path, flags) {
        // SAFETY: `buf` is the caller's writable `struct stat64` (C's contract for this call); put_stat
        // writes exactly one.
        if let Some(r) = with_stat(dirfd, |st| unsafe { put_stat(st, buf as *mut c_void) }) {
            return r;
        }
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `fstatat64`.
    unsafe { real::fstatat64(dirfd, path, buf, flags) }
}

/// # Safety
/// glibc's old `fstatat` entry point.
#[no_mangle]
pub unsafe extern "C" fn __fxstatat(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat,
    flags: c_int,
) -> c_int {
    if empty_path(path, flags) {
        // SAFETY: `buf` is the caller's writable `struct stat` (C's contract for this call); put_stat writes
        // exactly one.
        if let Some(r) = with_stat(dirfd, |st| unsafe { put_stat(st, buf as *mut c_void) }) {
            return r;
        }
    }
    // SAFETY: the caller's arguments pass unchanged to glibc's `__fxstatat`.
    unsafe { real::__fxstatat(ver, dirfd, path, buf, flags) }
}

/// # Safety
/// glibc's old `fstatat64` entry point.
#[no_mangle]
pub unsafe extern "C" fn __fxstatat64(
    ver: c_int,
    dirfd: c_int,
    path: *const c_char,
    buf: *mut libc::stat64,
    flags: c_int,
) -> c_int {
    if empty_path(path, flags) {
        // SAFETY: `buf` is the caller's writable `struct stat64` (C's contract for this call); put_stat
        // writes exactly one.
        if let Some(r) = with_stat(dirfd, |st| unsafe { put_stat(st, buf as *mut c_void) }) {
            return r;
        }
    }
    // SAFETY: the caller's arguments pass unchanged to glibc's `__fxstatat64`.
    unsafe { real::__fxstatat64(ver, dirfd, path, buf, flags) }
}

/// The `statx` answer built from a `stat`: the basic fields (`stx_mask` says which).
fn statx_of(st: &libc::stat) -> libc::statx {
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    let ts = |s: i64, ns: i64| {
        // SAFETY: as above.
        let mut t: libc::statx_timestamp = unsafe { std::mem::zeroed() };
        t.tv_sec = s;
        t.tv_nsec = ns as u32;
        t
    };
    x.stx_mask = libc::STATX_BASIC_STATS;
    x.stx_blksize = st.st_blksize as u32;
    x.stx_nlink = st.st_nlink as u32;
    x.stx_uid = st.st_uid;
    x.stx_gid = st.st_gid;
    x.stx_mode = st.st_mode as u16;
    x.stx_ino = st.st_ino;
    x.stx_size = st.st_size as u64;
    x.stx_blocks = st.st_blocks as u64;
    x.stx_atime = ts(st.st_atime, st.st_atime_nsec);
    x.stx_mtime = ts(st.st_mtime, st.st_mtime_nsec);
    x.stx_ctime = ts(st.st_ctime, st.st_ctime_nsec);
    x.stx_rdev_major = libc::major(st.st_rdev);
    x.stx_rdev_minor = libc::minor(st.st_rdev);
    x.stx_dev_major = libc::major(st.st_dev);
    x.stx_dev_minor = libc::minor(st.st_dev);
    x
}

/// # Safety
/// C's `statx`.
#[no_mangle]
pub unsafe extern "C" fn statx(
    dirfd: c_int,
    path: *const c_char,
    flags: c_int,
    mask: c_uint,
    buf: *mut libc::statx,
) -> c_int {
    if empty_path(path, flags) && !buf.is_null() {
        // SAFETY: the caller's writable statx.
        if let Some(r) = with_stat(dirfd, |st| unsafe {
            std::ptr::write_unaligned(buf, statx_of(st));
            0
        }) {
            return r;
        }
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `statx`.
    unsafe { real::statx(dirfd, path, flags, mask, buf) }
}

// ---------------------------------------------------------------------------------------------
// Calls that act on the open file itself: a stand-in becomes real first

/// Make `fd` real when it is a stand-in; false (errno `EIO`) when that failed.
fn ready(fd: c_int) -> bool {
    crate::real_before(fd)
}

macro_rules! real_first {
    ($( $name:ident ( $($a:ident : $t:ty),* ) -> $r:ty [$fd:ident] ; )*) => {
        $(
            /// # Safety
            /// The C function of this name; a stand-in fd becomes a real open first.
            #[no_mangle]
            pub unsafe extern "C" fn $name($($a: $t),*) -> $r {
                if !ready($fd) {
                    return <$r as real::Fail>::fail();
                }
                // SAFETY: the caller's arguments pass unchanged to libc's `$name` (same C prototype); `ready`
                // only turns a stand-in fd into a real open, touching no caller memory.
                unsafe { real::$name($($a),*) }
            }
        )*
    };
}

real_first! {
    fchmod(fd: c_int, mode: libc::mode_t) -> c_int [fd];
    fchown(fd: c_int, uid: libc::uid_t, gid: libc::gid_t) -> c_int [fd];
    futimens(fd: c_int, times: *const libc::timespec) -> c_int [fd];
    flock(fd: c_int, op: c_int) -> c_int [fd];
    fgetxattr(fd: c_int, name: *const c_char, value: *mut c_void, size: size_t) -> ssize_t [fd];
    fsetxattr(fd: c_int, name: *const c_char, value: *const c_void, size: size_t, flags: c_int) -> c_int [fd];
    flistxattr(fd: c_int, list: *mut c_char, size: size_t) -> ssize_t [fd];
    fremovexattr(fd: c_int, name: *const c_char) -> c_int [fd];
    fstatfs(fd: c_int, buf: *mut c_void) -> c_int [fd];
    fstatfs64(fd: c_int, buf: *mut c_void) -> c_int [fd];
    fstatvfs(fd: c_int, buf: *mut c_void) -> c_int [fd];
    fstatvfs64(fd: c_int, buf: *mut c_void) -> c_int [fd];
    fexecve(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int [fd];
}

/// # Safety
/// C's `ioctl` (the third argument is passed on as it came). `FIOCLEX` keeps a stand-in; any
/// other request makes it real first.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: c_ulong) -> c_int {
    if req != libc::FIOCLEX && !ready(fd) {
        return -1;
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `ioctl` (same C prototype); `ready` only turns
    // a stand-in fd into a real open, touching no caller memory.
    unsafe { real::ioctl(fd, req, arg) }
}

/// # Safety
/// C's `sendmsg`: fds passed to another process (`SCM_RIGHTS`) are never stand-ins; each one
/// becomes real first.
#[no_mangle]
pub unsafe extern "C" fn sendmsg(sock: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t {
    // SAFETY: the caller's msghdr and its control buffer, walked with the libc CMSG macros.
    unsafe {
        if !msg.is_null() && !(*msg).msg_control.is_null() {
            let mut c = libc::CMSG_FIRSTHDR(msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c) as *const c_int;
                    let n = ((*c).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize) / 4;
                    for i in 0..n {
                        if !ready(std::ptr::read_unaligned(data.add(i))) {
                            return -1;
                        }
                    }
                }
                c = libc::CMSG_NXTHDR(msg, c);
            }
        }
        real::sendmsg(sock, msg, flags)
    }
}

/// # Safety
/// C's `posix_spawn_file_actions_adddup2`: the spawned program gets `fd` without close-on-exec,
/// so a stand-in becomes real first.
#[no_mangle]
pub unsafe extern "C" fn posix_spawn_file_actions_adddup2(fa: *mut c_void, fd: c_int, newfd: c_int) -> c_int {
    if !ready(fd) {
        return libc::EIO;
    }
    // SAFETY: the caller's arguments pass unchanged to libc's `posix_spawn_file_actions_adddup2` (same C
    // prototype); `ready` only turns a stand-in fd into a real open, touching no caller memory.
    unsafe { real::posix_spawn_file_actions_adddup2(fa, fd, newfd) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statx_carries_the_stat_fields() {
        // SAFETY: zeroed plain data.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_size = 110_000;
        st.st_mode = libc::S_IFREG | 0o640;
        st.st_ino = 77;
        st.st_dev = libc::makedev(8, 3);
        st.st_mtime = 1_700_000_000;
        st.st_mtime_nsec = 123;
        let x = statx_of(&st);
        assert_eq!(
            (x.stx_size, x.stx_ino, x.stx_mode as u32),
            (110_000, 77, libc::S_IFREG | 0o640)
        );
        assert_eq!((x.stx_dev_major, x.stx_dev_minor), (8, 3));
        assert_eq!((x.stx_mtime.tv_sec, x.stx_mtime.tv_nsec), (1_700_000_000, 123));
        assert_eq!(x.stx_mask, libc::STATX_BASIC_STATS);
    }

    #[test]
    fn read_permission_by_mode_bits() {
        // SAFETY: zeroed plain data.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_uid = 1000;
        st.st_gid = 100;
        st.st_mode = libc::S_IFREG | 0o044; // group and others, not the owner
        assert!(
            !readable_by(&st, 1000, 100, &[]),
            "the owner class decides for the owner"
        );
        assert!(readable_by(&st, 1001, 100, &[]), "group by egid");
        assert!(readable_by(&st, 1001, 5, &[7, 100]), "group by a supplementary group");
        assert!(readable_by(&st, 1001, 5, &[]), "others");
        st.st_mode = libc::S_IFREG | 0o600;
        assert!(readable_by(&st, 1000, 5, &[]));
        assert!(!readable_by(&st, 1001, 100, &[100]));
        assert!(!readable_by(&st, 1001, 5, &[]));
        st.st_mode = libc::S_IFREG;
        assert!(readable_by(&st, 0, 0, &[]), "root reads any regular file");
    }

    #[test]
    fn empty_path_needs_the_flag() {
        let e = c"";
        assert!(empty_path(e.as_ptr(), libc::AT_EMPTY_PATH));
        assert!(!empty_path(e.as_ptr(), 0));
        assert!(!empty_path(c"x".as_ptr(), libc::AT_EMPTY_PATH));
        assert!(!empty_path(std::ptr::null(), libc::AT_EMPTY_PATH));
    }
}
