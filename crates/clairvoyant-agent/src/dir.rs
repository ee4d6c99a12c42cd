//! The shared directory of cached files: one file in shared memory, made by the agent, that lets
//! an interposed process find a cached file without a round trip to the agent.
//!
//! Layout (little-endian, native alignment):
//!
//! ```text
//! offset 0    header, 64 bytes: magic b"CVDIR001", u32 version, u32 slots (a power of two),
//!             u64 root key, AtomicU32 flags (bit 0: [`FLAG_PROGRAMS_FILL`]), u32 agent pid,
//!             zero padding
//! offset 64   counters: 32 x AtomicU64 (see [`counter`]), added to by interposed processes
//! offset 320  `slots` entries of 48 bytes:
//!             +0 AtomicU64 key (0 = empty)   +8 u64 offset   +16 u64 size   +24 u64 checksum
//!             +32 u32 file   +36 AtomicU32 state (0 empty, 1 ready)   +40 u64 mtime_ns
//! then        `slots` claims of 16 bytes: +0 AtomicU64 key (0 = empty)  +8 AtomicU32 word
//!             (see [`claim`])  +12 zero
//! ```
//!
//! Open addressing with linear probing; entries are never deleted (the node cache's placement is
//! static). One writer (the agent) fills an entry's fields, then stores `state = 1` with Release;
//! readers load `state` with Acquire before reading the fields. All fields are accessed through
//! atomics, so a reader racing with the writer never reads torn values.
//!
//! Claims (when the agent sets [`FLAG_PROGRAMS_FILL`]): the first process to open a file that is
//! not in the directory claims it (compare-and-swap of its word from free to its pid, any
//! process may insert a claim's key), reads the file itself and hands the bytes to the agent,
//! which records the entry and then settles the claim ([`claim::DONE`], or
//! [`claim::NOT_CACHED`]), waking the processes that wait on the word (a futex on the shared
//! mapping). A claim whose process is gone may be taken over.
//!
//! When the order is known the agent fills files itself, ahead of the programs: it claims each
//! file for its own pid while it reads it and settles the claim once the entry is recorded, so
//! that a program opening the file meanwhile waits on the word instead of asking the agent.
//!
//! `mtime_ns` is the file's last change as the engine defines it
//! (`clairvoyant_core::source::last_change_ns`: the later of mtime and ctime, in ns since the
//! epoch) when the entry was filled; a reader compares it with `fstat` of its open file.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The magic at the start of every directory file.
pub const MAGIC: &[u8; 8] = b"CVDIR001";
/// The layout version stored after the magic.
pub const VERSION: u32 = 2;
/// Bytes of the header.
pub const HEADER_LEN: usize = 64;
/// Number of counters.
pub const COUNTERS: usize = 32;
/// Bytes of one entry.
pub const ENTRY_LEN: usize = 48;
/// Bytes of one claim.
pub const CLAIM_LEN: usize = 16;
/// Header flag: programs fill their misses themselves and claim files in the directory.
pub const FLAG_PROGRAMS_FILL: u32 = 1;
const FLAGS_OFF: usize = 24;
const AGENT_PID_OFF: usize = 28;

/// Values of a claim's word.
pub mod claim {
    /// Nobody reads the file now, and it is not cached: the next opener may claim it.
    pub const FREE: u32 = 0;
    /// The file is in the node cache: its entry is in the directory (else ask the agent).
    pub const DONE: u32 = u32::MAX;
    /// This node does not cache the file: read it directly, claim nothing.
    pub const NOT_CACHED: u32 = u32::MAX - 1;
    /// Any other value: the pid of the process reading the file now.
    pub fn is_pid(word: u32) -> bool {
        word != FREE && word < NOT_CACHED
    }
}

/// What a process found when it tried to claim a file ([`DirReader::claim`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// The caller holds the claim: it reads the file and hands it over, or releases the claim.
    Won,
    /// The process with this pid reads the file now.
    Held(u32),
    /// Settled [`claim::DONE`].
    Done,
    /// Settled [`claim::NOT_CACHED`].
    NotCached,
    /// No room for the claim (every slot taken): ask the agent.
    Full,
}
const COUNTERS_OFF: usize = HEADER_LEN;
const ENTRIES_OFF: usize = HEADER_LEN + COUNTERS * 8;
/// The most slots a directory may have (2^28 entries = 12 GiB of directory).
pub const MAX_SLOTS: u32 = 1 << 28;

/// Indexes into the counters block.
pub mod counter {
    /// Opens of dataset files by interposed processes.
    pub const OPENS: usize = 0;
    /// Reads served from the arena.
    pub const CACHED_READS: usize = 1;
    /// Bytes served from the arena.
    pub const CACHED_BYTES: usize = 2;
    /// Reads served from bytes the agent sent inline.
    pub const INLINE_READS: usize = 3;
    /// Bytes served from bytes the agent sent inline.
    pub const INLINE_BYTES: usize = 4;
    /// Reads of tracked dataset files that went to the file itself.
    pub const DIRECT_READS: usize = 5;
    /// Bytes read from the file itself by those reads.
    pub const DIRECT_BYTES: usize = 6;
    /// The agent was unreachable or failed; the file was read directly.
    pub const FALLBACKS: usize = 7;
    /// The checksum of cached bytes did not match; the file was read directly.
    pub const CORRUPT: usize = 8;
    /// The file changed after it was cached; the file was read directly.
    pub const STALE: usize = 9;
    /// Mappings of dataset files served from the cache.
    pub const MMAPS: usize = 10;
    /// Round trips to the agent.
    pub const LOOKUPS: usize = 11;
    /// Opens served by a stand-in (the arena file) without opening the dataset file.
    pub const STANDINS: usize = 12;
    /// Files a program read itself on a miss (holding the claim) and handed to the agent.
    pub const FILLS: usize = 13;
    /// Bytes of those files.
    pub const FILL_BYTES: usize = 14;
    /// Opens that waited in the directory for the agent's own fill (known order) of the file,
    /// instead of asking the agent.
    pub const FILL_WAITS: usize = 15;
    /// Names of the counters above, in index order (for stats output).
    pub const NAMES: [&str; 16] = [
        "opens",
        "cached_reads",
        "cached_bytes",
        "inline_reads",
        "inline_bytes",
        "direct_reads",
        "direct_bytes",
        "fallbacks",
        "corrupt",
        "stale",
        "mmaps",
        "lookups",
        "standins",
        "fills",
        "fill_bytes",
        "fill_waits",
    ];
}

/// The directory key of a normalized relative path: XXH3-64 of its bytes, 0 remapped to 1
/// (0 marks an empty slot).
pub fn path_key(rel: &[u8]) -> u64 {
    match twox_hash::XxHash3_64::oneshot(rel) {
        0 => 1,
        k => k,
    }
}

/// Where a cached file's bytes are in the arena, and what they must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    /// The file's index in the agent's dataset.
    pub file: u32,
    /// Where the file's bytes start in the arena.
    pub offset: u64,
    /// The file's size in bytes.
    pub size: u64,
    /// [`crate::checksum`] of the file's bytes.
    pub checksum: u64,
    /// The file's last change when the entry was filled, in ns since the epoch (see the module
    /// documentation).
    pub mtime_ns: u64,
}

/// The number of slots for `files` files: the next power of two of twice as many (at least 8).
pub fn slots_for(files: usize) -> u32 {
    let want = files.saturating_mul(2).max(8);
    let slots = want.checked_next_power_of_two().unwrap_or(usize::MAX);
    slots.min(MAX_SLOTS as usize) as u32
}

/// Total bytes of a directory file with `slots` slots.
pub fn file_len(slots: u32) -> usize {
    ENTRIES_OFF + slots as usize * (ENTRY_LEN + CLAIM_LEN)
}

/// Whether the process `pid` exists and has not exited (another user's counts as existing; a
/// killed process its parent has not reaped yet, a zombie, does not).
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if r != 0 {
        return io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    }
    // `/proc/<pid>/stat`: "pid (comm) S ...", the state after the last ')'.
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let after = stat
                .iter()
                .rposition(|&b| b == b')')
                .map_or(&stat[..], |i| &stat[i + 1..]);
            !matches!(after.iter().find(|b| !b.is_ascii_whitespace()), Some(b'Z' | b'X'))
        }
        Err(_) => true,
    }
}

/// A shared mapping of a directory file.
struct Map {
    ptr: *mut u8,
    len: usize,
    slots: u32,
}

// SAFETY: the mapping is only accessed through atomics (entries, counters) or read-only header
// bytes written before the mapping is shared; the pointer stays valid until drop.
unsafe impl Send for Map {}
// SAFETY: shared references reach the mapping only through atomics and the read-only header, as for Send
// above.
unsafe impl Sync for Map {}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: path contains a NUL byte", path.display()),
        )
    })
}

fn with_path(path: &Path, what: &str, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display()))
}

impl Map {
    fn new(fd: libc::c_int, len: usize, path: &Path) -> io::Result<Map> {
        // SAFETY: a fresh shared mapping of an open fd; the kernel validates the arguments.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(with_path(
                path,
                "mmap of the cache directory",
                io::Error::last_os_error(),
            ));
        }
        Ok(Map {
            ptr: ptr as *mut u8,
            len,
            slots: 0,
        })
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: off is 8-aligned and in bounds (callers compute it from the validated slot
        // count); mmap memory is page-aligned; AtomicU64 has the layout of u64.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: as for u64_at, with 4-byte alignment.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    fn counters(&self) -> &[AtomicU64; COUNTERS] {
        // SAFETY: the counters block is 32 aligned u64s at offset 64, inside the mapping.
        unsafe { &*(self.ptr.add(COUNTERS_OFF) as *const [AtomicU64; COUNTERS]) }
    }

    fn header(&self) -> &[u8] {
        // SAFETY: the mapping is at least HEADER_LEN bytes (checked by both constructors).
        unsafe { std::slice::from_raw_parts(self.ptr, HEADER_LEN) }
    }

    fn slot(&self, i: u32) -> usize {
        ENTRIES_OFF + i as usize * ENTRY_LEN
    }

    /// The word of `key`'s claim; with `insert`, a claim slot is made for it when there is none.
    fn claim_word(&self, key: u64, insert: bool) -> Option<&AtomicU32> {
        if key == 0 {
            return None;
        }
        let base = ENTRIES_OFF + self.slots as usize * ENTRY_LEN;
        let mask = self.slots - 1;
        let mut i = (key as u32) & mask;
        for _ in 0..self.slots {
            let s = base + i as usize * CLAIM_LEN;
            let k = self.u64_at(s);
            let mut cur = k.load(Ordering::Acquire);
            if cur == 0 && insert {
                cur = match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => key,
                    Err(now) => now,
                };
            }
            if cur == key {
                return Some(self.u32_at(s + 8));
            }
            if cur == 0 {
                return None;
            }
            i = (i + 1) & mask;
        }
        None
    }

    fn flags(&self) -> &AtomicU32 {
        self.u32_at(FLAGS_OFF)
    }

    /// The word of `key`'s claim ([`claim::FREE`] when there is none), without making one.
    fn claim_state(&self, key: u64) -> u32 {
        self.claim_word(key, false)
            .map_or(claim::FREE, |w| w.load(Ordering::Acquire))
    }

    /// Move `key`'s claim word from `from` to `to` in one compare-and-swap (making the word when
    /// `create`); the word when it was `from`. Wakes nobody.
    fn swap_claim(&self, key: u64, from: u32, to: u32, create: bool) -> Option<&AtomicU32> {
        self.claim_word(key, create).filter(|w| {
            w.compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    /// Settle `pid`'s claim on `key` to `word` and wake the waiters (nothing when `pid` does not
    /// hold it).
    fn settle_held(&self, key: u64, pid: u32, word: u32) {
        if let Some(w) = self.swap_claim(key, pid, word, false) {
            clairvoyant_futex::wake_all(w);
        }
    }

    fn lookup(&self, key: u64) -> Option<Entry> {
        if key == 0 {
            return None;
        }
        let mask = self.slots - 1;
        let mut i = (key as u32) & mask;
        for _ in 0..self.slots {
            let s = self.slot(i);
            let k = self.u64_at(s).load(Ordering::Acquire);
            if k == 0 {
                return None;
            }
            if k == key {
                if self.u32_at(s + 36).load(Ordering::Acquire) != 1 {
                    return None;
                }
                return Some(Entry {
                    offset: self.u64_at(s + 8).load(Ordering::Relaxed),
                    size: self.u64_at(s + 16).load(Ordering::Relaxed),
                    checksum: self.u64_at(s + 24).load(Ordering::Relaxed),
                    file: self.u32_at(s + 32).load(Ordering::Relaxed),
                    mtime_ns: self.u64_at(s + 40).load(Ordering::Relaxed),
                });
            }
            i = (i + 1) & mask;
        }
        None
    }
}

/// The agent's side: creates the directory file and fills it. One writer per directory.
pub struct DirWriter {
    map: Map,
    path: PathBuf,
    used: AtomicU32,
    lock: std::sync::Mutex<()>,
}

impl DirWriter {
    /// Create the directory file at `path` (mode 0600, `O_EXCL | O_NOFOLLOW`: an existing file or
    /// a symlink there is refused) with [`slots_for`]`(slots_for_files)` slots and root key 0.
    pub fn create(path: &Path, slots_for_files: usize) -> io::Result<DirWriter> {
        Self::create_with_root(path, slots_for_files, 0)
    }

    /// As [`DirWriter::create`], recording `root_key` in the header so readers can check they
    /// serve the same root. By convention it is `path_key` of the root's bytes exactly as the
    /// agent sends them in `Reply::Hello { root, .. }` (the interposed library accepts 0 or that).
    pub fn create_with_root(path: &Path, slots_for_files: usize, root_key: u64) -> io::Result<DirWriter> {
        let c = cpath(path)?;
        let slots = slots_for(slots_for_files);
        let len = file_len(slots);
        // SAFETY: c is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o600 as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(with_path(
                path,
                "create the cache directory",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd is ours; closed on every path below.
        let res = (|| {
            // SAFETY: `fd` is the file just created, open until the close below; ftruncate takes only
            // numbers.
            if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
                return Err(with_path(path, "size the cache directory", io::Error::last_os_error()));
            }
            Map::new(fd, len, path)
        })();
        // SAFETY: `fd` is ours, opened above; the mapping made from it (if any) stays valid after the close.
        unsafe { libc::close(fd) };
        let mut map = res?;
        map.slots = slots;
        // SAFETY: the mapping is fresh (zero-filled by ftruncate) and not yet visible to readers
        // that validate the magic, which is written last.
        unsafe {
            let h = std::slice::from_raw_parts_mut(map.ptr, HEADER_LEN);
            h[8..12].copy_from_slice(&VERSION.to_le_bytes());
            h[12..16].copy_from_slice(&slots.to_le_bytes());
            h[16..24].copy_from_slice(&root_key.to_le_bytes());
            h[AGENT_PID_OFF..AGENT_PID_OFF + 4].copy_from_slice(&std::process::id().to_le_bytes());
            std::sync::atomic::fence(Ordering::Release);
            h[..8].copy_from_slice(MAGIC);
        }
        Ok(DirWriter {
            map,
            path: path.to_path_buf(),
            used: AtomicU32::new(0),
            lock: std::sync::Mutex::new(()),
        })
    }

    /// Record `e` under `key`. False when the directory is full (every slot is used), when `key` is 0 or when `key` is already
    /// present (entries are never changed once readers may see them).
    pub fn insert(&self, key: u64, e: &Entry) -> bool {
        if key == 0 {
            return false;
        }
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let m = &self.map;
        if self.used.load(Ordering::Relaxed) >= m.slots {
            return false;
        }
        let mask = m.slots - 1;
        let mut i = (key as u32) & mask;
        for _ in 0..m.slots {
            let s = m.slot(i);
            let k = m.u64_at(s).load(Ordering::Relaxed);
            if k == key {
                return false;
            }
            if k == 0 {
                m.u64_at(s + 8).store(e.offset, Ordering::Relaxed);
                m.u64_at(s + 16).store(e.size, Ordering::Relaxed);
                m.u64_at(s + 24).store(e.checksum, Ordering::Relaxed);
                m.u32_at(s + 32).store(e.file, Ordering::Relaxed);
                m.u64_at(s + 40).store(e.mtime_ns, Ordering::Relaxed);
                m.u64_at(s).store(key, Ordering::Release);
                m.u32_at(s + 36).store(1, Ordering::Release);
                self.used.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            i = (i + 1) & mask;
        }
        false
    }

    /// The entry under `key`, as a reader would see it.
    pub fn lookup(&self, key: u64) -> Option<Entry> {
        self.map.lookup(key)
    }

    /// Let programs fill their misses themselves (claims in this directory, [`Request::Fill`]
    /// to the agent), from now on.
    ///
    /// [`Request::Fill`]: crate::proto::Request::Fill
    pub fn set_programs_fill(&self) {
        self.map.flags().fetch_or(FLAG_PROGRAMS_FILL, Ordering::Release);
    }

    /// Settle `key`'s claim (made if there is none) to `word` ([`claim::DONE`],
    /// [`claim::NOT_CACHED`] or [`claim::FREE`]) and wake the processes waiting on it. Record the
    /// entry first: a waiter looks it up once woken.
    pub fn settle(&self, key: u64, word: u32) {
        if let Some(w) = self.map.claim_word(key, true) {
            w.store(word, Ordering::Release);
            clairvoyant_futex::wake_all(w);
        }
    }

    /// The word of `key`'s claim ([`claim::FREE`] when there is none).
    pub fn claim_state(&self, key: u64) -> u32 {
        self.map.claim_state(key)
    }

    /// Claim `key` for process `pid` (the agent, filling the file itself) when nobody holds it
    /// and it is not settled; true when `pid` holds it now. Programs that find the claim wait
    /// for [`DirWriter::settle_held`] instead of asking the agent.
    pub fn claim(&self, key: u64, pid: u32) -> bool {
        self.map.swap_claim(key, claim::FREE, pid, true).is_some()
    }

    /// Settle the claim on `key` that `pid` (the agent's prefill) holds to `word`: [`claim::DONE`]
    /// once the entry is recorded, [`claim::FREE`] when the file was not filled; wake the
    /// waiters. Nothing when `pid` does not hold it.
    pub fn settle_held(&self, key: u64, pid: u32, word: u32) {
        self.map.settle_held(key, pid, word)
    }

    /// Wait at most `timeout` for `key`'s claim to change from `seen`.
    pub fn wait_claim(&self, key: u64, seen: u32, timeout: std::time::Duration) {
        if let Some(w) = self.map.claim_word(key, false) {
            clairvoyant_futex::wait(w, seen, timeout);
        }
    }

    /// The counters block (interposed processes add to it).
    pub fn counters(&self) -> &[AtomicU64; 32] {
        self.map.counters()
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.map.slots
    }

    /// Number of entries inserted.
    pub fn len(&self) -> usize {
        self.used.load(Ordering::Relaxed) as usize
    }

    /// True when nothing was inserted.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The directory file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// An interposed process's side: maps an existing directory file and looks entries up.
pub struct DirReader {
    map: Map,
    root_key: u64,
}

impl DirReader {
    /// Map the directory file at `path`. Refused, with the path and the reason: a symlink, a
    /// file owned by another user, a bad magic or version, a slot count that is not a power of
    /// two, or a size that does not match the slot count.
    pub fn open(path: &Path) -> io::Result<DirReader> {
        let c = cpath(path)?;
        // SAFETY: c is a valid NUL-terminated path.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(with_path(path, "open the cache directory", io::Error::last_os_error()));
        }
        let res = Self::from_fd(fd, path);
        // SAFETY: fd is ours; the mapping (if any) outlives it.
        unsafe { libc::close(fd) };
        res
    }

    fn from_fd(fd: libc::c_int, path: &Path) -> io::Result<DirReader> {
        let bad = |why: String| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not a cache directory: {why}", path.display()),
            )
        };
        // SAFETY: st is plain data filled by the kernel.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a live, writable `stat`; a bad fd is reported as EBADF.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(with_path(
                path,
                "fstat of the cache directory",
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        if st.st_uid != euid {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{}: cache directory is owned by uid {}, not by this user (uid {euid})",
                    path.display(),
                    st.st_uid
                ),
            ));
        }
        let size = st.st_size as u64;
        if size < ENTRIES_OFF as u64 {
            return Err(bad(format!(
                "{size} bytes, shorter than the {ENTRIES_OFF}-byte header and counters"
            )));
        }
        let mut map = Map::new(fd, ENTRIES_OFF, path)?;
        let h = map.header();
        if &h[..8] != MAGIC {
            return Err(bad(format!(
                "magic {:?}, expected {:?}",
                String::from_utf8_lossy(&h[..8]),
                "CVDIR001"
            )));
        }
        let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if version != VERSION {
            return Err(bad(format!(
                "layout version {version}, this library reads version {VERSION}"
            )));
        }
        let slots = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        if slots == 0 || !slots.is_power_of_two() || slots > MAX_SLOTS {
            return Err(bad(format!(
                "slot count {slots} is not a power of two in 1..={MAX_SLOTS}"
            )));
        }
        let mut rk = [0u8; 8];
        rk.copy_from_slice(&h[16..24]);
        let root_key = u64::from_le_bytes(rk);
        let want = file_len(slots) as u64;
        if size != want {
            return Err(bad(format!("{size} bytes, expected {want} for {slots} slots")));
        }
        drop(map);
        map = Map::new(fd, want as usize, path)?;
        map.slots = slots;
        Ok(DirReader { map, root_key })
    }

    /// The entry recorded under `key`, if it is ready.
    pub fn lookup(&self, key: u64) -> Option<Entry> {
        self.map.lookup(key)
    }

    /// Whether the agent lets programs fill their misses ([`FLAG_PROGRAMS_FILL`]).
    pub fn programs_fill(&self) -> bool {
        self.map.flags().load(Ordering::Acquire) & FLAG_PROGRAMS_FILL != 0
    }

    /// The agent's process id, as it recorded it.
    pub fn agent_pid(&self) -> u32 {
        self.map.u32_at(AGENT_PID_OFF).load(Ordering::Relaxed)
    }

    /// The word of `key`'s claim ([`claim::FREE`] when there is none), without making one.
    pub fn claim_state(&self, key: u64) -> u32 {
        self.map.claim_state(key)
    }

    /// Claim `key` for process `pid` (see the module documentation).
    pub fn claim(&self, key: u64, pid: u32) -> Claimed {
        let Some(w) = self.map.claim_word(key, true) else {
            return Claimed::Full;
        };
        loop {
            match w.load(Ordering::Acquire) {
                claim::FREE => {
                    if w.compare_exchange(claim::FREE, pid, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        return Claimed::Won;
                    }
                }
                claim::DONE => return Claimed::Done,
                claim::NOT_CACHED => return Claimed::NotCached,
                other => return Claimed::Held(other),
            }
        }
    }

    /// Take over `key`'s claim from `from` (a process that is gone); true when `pid` holds it now.
    pub fn take_over(&self, key: u64, from: u32, pid: u32) -> bool {
        self.map.swap_claim(key, from, pid, false).is_some()
    }

    /// Give back `pid`'s claim on `key` (the file was not handed over) and wake the waiters.
    pub fn release(&self, key: u64, pid: u32) {
        self.map.settle_held(key, pid, claim::FREE)
    }

    /// Wait at most `timeout` for `key`'s claim to change from `seen`.
    pub fn wait_claim(&self, key: u64, seen: u32, timeout: std::time::Duration) {
        if let Some(w) = self.map.claim_word(key, false) {
            clairvoyant_futex::wait(w, seen, timeout);
        }
    }

    /// The counters block shared with the agent and the other interposed processes.
    pub fn counters(&self) -> &[AtomicU64; 32] {
        self.map.counters()
    }

    /// The root key recorded by the agent (0 when none).
    pub fn root_key(&self) -> u64 {
        self.root_key
    }

    /// Number of slots.
    pub fn slots(&self) -> u32 {
        self.map.slots
    }
}

#[cfg(test)]
mod tests {
    /// The programs' checksum is the engine's (xxh3-64, seed 0): golden values.
    #[test]
    fn checksum_is_xxh3_64_golden() {
        let pattern = |n: usize| (0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>();
        assert_eq!(crate::checksum(b""), 0x2d06800538d394c2);
        assert_eq!(crate::checksum(&pattern(110_000)), 0xcd837f5c597dd0b3);
    }

    use super::*;
    use std::sync::Arc;

    fn entry(i: u64) -> Entry {
        Entry {
            file: i as u32,
            offset: i * 4096,
            size: i * 3 + 1,
            checksum: i ^ 0xdead_beef,
            mtime_ns: i * 1_000_000_007,
        }
    }

    #[test]
    fn path_key_is_xxh3_with_zero_remapped() {
        assert_eq!(path_key(b"a/b.jpg"), twox_hash::XxHash3_64::oneshot(b"a/b.jpg"));
        assert_ne!(path_key(b""), 0);
    }

    #[test]
    fn insert_then_lookup_from_writer_and_reader() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        let w = DirWriter::create_with_root(&p, 100, 77).unwrap();
        assert_eq!(w.slots(), 256);
        let meta = std::fs::metadata(&p).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len() as usize, file_len(256));
        for i in 0..100u64 {
            assert!(w.insert(path_key(format!("f/{i}").as_bytes()), &entry(i)));
        }
        assert!(
            !w.insert(path_key(b"f/3"), &entry(999)),
            "an existing key is not replaced"
        );
        let r = DirReader::open(&p).unwrap();
        assert_eq!(r.root_key(), 77);
        for i in 0..100u64 {
            assert_eq!(r.lookup(path_key(format!("f/{i}").as_bytes())), Some(entry(i)));
            assert_eq!(w.lookup(path_key(format!("f/{i}").as_bytes())), Some(entry(i)));
        }
        assert_eq!(r.lookup(path_key(b"f/100")), None);
        assert_eq!(r.lookup(0), None);
        r.counters()[counter::OPENS].fetch_add(5, Ordering::Relaxed);
        assert_eq!(
            w.counters()[counter::OPENS].load(Ordering::Relaxed),
            5,
            "counters are shared"
        );
    }

    #[test]
    fn create_refuses_an_existing_file_and_a_symlink() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        std::fs::write(&p, b"x").unwrap();
        assert_eq!(
            DirWriter::create(&p, 1).err().unwrap().kind(),
            io::ErrorKind::AlreadyExists
        );
        let l = d.path().join("link");
        std::os::unix::fs::symlink(d.path().join("elsewhere"), &l).unwrap();
        assert!(DirWriter::create(&l, 1).is_err());
        assert!(!d.path().join("elsewhere").exists());
    }

    #[test]
    fn full_directory_refuses_inserts() {
        let d = tempfile::tempdir().unwrap();
        let w = DirWriter::create(&d.path().join("dir"), 1).unwrap();
        assert_eq!(w.slots(), 8);
        let mut ok = 0;
        for i in 0..20u64 {
            if w.insert(path_key(&i.to_le_bytes()), &entry(i)) {
                ok += 1;
            }
        }
        assert_eq!(ok, 8);
        assert_eq!(w.len(), 8);
        for i in 0..20u64 {
            let got = w.lookup(path_key(&i.to_le_bytes()));
            assert_eq!(got.is_some(), i < 8, "key {i}");
        }
        assert!(!w.insert(0, &entry(1)));
    }

    #[test]
    fn concurrent_readers_see_complete_entries_or_none() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        let w = Arc::new(DirWriter::create(&p, 5000).unwrap());
        let n = 5000u64;
        let readers: Vec<_> = (0..3)
            .map(|t| {
                let p = p.clone();
                std::thread::spawn(move || {
                    let r = DirReader::open(&p).unwrap();
                    let mut seen = 0u64;
                    for round in 0..50 {
                        for i in (t..n).step_by(7) {
                            if let Some(e) = r.lookup(path_key(&i.to_le_bytes())) {
                                assert_eq!(e, entry(i), "round {round}");
                                seen += 1;
                            }
                        }
                    }
                    seen
                })
            })
            .collect();
        for i in 0..n {
            assert!(w.insert(path_key(&i.to_le_bytes()), &entry(i)));
        }
        for h in readers {
            h.join().unwrap();
        }
        let r = DirReader::open(&p).unwrap();
        for i in 0..n {
            assert_eq!(r.lookup(path_key(&i.to_le_bytes())), Some(entry(i)));
        }
    }

    #[test]
    fn one_claim_per_file_across_processes_settled_by_the_agent() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        let w = DirWriter::create(&p, 10).unwrap();
        let a = DirReader::open(&p).unwrap();
        let b = DirReader::open(&p).unwrap();
        assert_eq!(a.agent_pid(), std::process::id());
        assert!(!a.programs_fill());
        w.set_programs_fill();
        assert!(a.programs_fill() && b.programs_fill());
        let k = path_key(b"c/x.bin");
        assert_eq!(a.claim(k, 100), Claimed::Won);
        assert_eq!(b.claim(k, 200), Claimed::Held(100), "one reader per file");
        assert_eq!(w.claim_state(k), 100);
        assert!(!b.take_over(k, 99, 200), "only from the holder seen");
        b.release(k, 200); // not the holder: no effect
        assert_eq!(b.claim(k, 200), Claimed::Held(100));
        a.release(k, 100);
        assert_eq!(b.claim(k, 200), Claimed::Won, "a released claim is free");
        assert!(a.take_over(k, 200, 300));
        assert_eq!(b.claim(k, 200), Claimed::Held(300));
        w.settle(k, claim::DONE);
        assert_eq!(a.claim(k, 400), Claimed::Done);
        let k2 = path_key(b"c/y.bin");
        w.settle(k2, claim::NOT_CACHED);
        assert_eq!(b.claim(k2, 5), Claimed::NotCached);
        assert_eq!(w.claim_state(path_key(b"never")), claim::FREE);
        assert!(claim::is_pid(5) && !claim::is_pid(claim::DONE) && !claim::is_pid(claim::FREE));
    }

    #[test]
    fn the_agent_claims_what_it_fills_and_readers_wait_for_the_settle() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        let w = Arc::new(DirWriter::create(&p, 10).unwrap());
        let r = DirReader::open(&p).unwrap();
        let agent = std::process::id();
        let k = path_key(b"c/z.bin");
        assert_eq!(r.claim_state(k), claim::FREE, "no claim made by looking");
        assert!(w.claim(k, agent));
        assert!(!w.claim(k, agent), "held already");
        assert_eq!(r.claim_state(k), agent);
        w.settle_held(k, agent + 1, claim::FREE); // not the holder: no effect
        assert_eq!(r.claim_state(k), agent);
        w.settle_held(k, agent, claim::FREE);
        assert_eq!(r.claim_state(k), claim::FREE, "a failed fill gives the claim back");
        assert!(w.claim(k, agent));
        let settler = {
            let w = w.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                w.insert(
                    k,
                    &Entry {
                        file: 3,
                        offset: 0,
                        size: 1,
                        checksum: 0,
                        mtime_ns: 0,
                    },
                );
                w.settle(k, claim::DONE);
            })
        };
        let t = std::time::Instant::now();
        while r.claim_state(k) == agent {
            r.wait_claim(k, agent, std::time::Duration::from_secs(5));
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "woken by the settle");
        assert_eq!(r.lookup(k).map(|e| e.file), Some(3), "the entry is there once settled");
        settler.join().unwrap();
        let k2 = path_key(b"c/done.bin");
        w.settle(k2, claim::DONE);
        assert!(!w.claim(k2, agent), "a settled file is not claimed again");
    }

    #[test]
    fn claims_race_to_exactly_one_winner_and_waiters_wake_on_settle() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        let w = Arc::new(DirWriter::create(&p, 64).unwrap());
        let keys: Vec<u64> = (0..64u64).map(|i| path_key(&i.to_le_bytes())).collect();
        let racers: Vec<_> = (1..=6u32)
            .map(|pid| {
                let (p, keys, w) = (p.clone(), keys.clone(), w.clone());
                std::thread::spawn(move || {
                    let r = DirReader::open(&p).unwrap();
                    let mut won = 0;
                    for &k in &keys {
                        match r.claim(k, pid) {
                            Claimed::Won => {
                                won += 1;
                                w.settle(k, claim::DONE);
                            }
                            Claimed::Held(other) => {
                                // Woken by the settle (or the holder's release): never left waiting.
                                while claim::is_pid(w.claim_state(k)) {
                                    r.wait_claim(k, other, std::time::Duration::from_secs(5));
                                }
                            }
                            Claimed::Done => {}
                            other => panic!("{other:?}"),
                        }
                        assert_eq!(w.claim_state(k), claim::DONE);
                    }
                    won
                })
            })
            .collect();
        let total: usize = racers.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, keys.len(), "every file claimed exactly once");
    }

    #[test]
    fn a_process_that_exited_is_not_alive_even_before_it_is_reaped() {
        assert!(alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Exited but not reaped: a zombie until `wait` (waitid with WNOWAIT leaves it so).
        // SAFETY: siginfo_t is plain data; all zeros is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waiting for our own child into a zeroed siginfo; WNOWAIT keeps it unreaped.
        let r = unsafe { libc::waitid(libc::P_PID, pid, &mut info, libc::WEXITED | libc::WNOWAIT) };
        assert_eq!(r, 0);
        assert!(!alive(pid), "a zombie is not alive");
        child.wait().unwrap();
        assert!(!alive(pid));
    }

    #[test]
    fn reader_validates_the_header() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dir");
        drop(DirWriter::create(&p, 10).unwrap());
        let good = std::fs::read(&p).unwrap();
        let check = |bytes: &[u8], needle: &str| {
            let q = d.path().join("bad");
            let _ = std::fs::remove_file(&q);
            std::fs::write(&q, bytes).unwrap();
            let err = DirReader::open(&q).err().expect("refused");
            let msg = err.to_string();
            assert!(msg.contains(needle) && msg.contains("bad"), "{msg}");
        };
        let mut b = good.clone();
        b[0] = b'X';
        check(&b, "magic");
        let mut b = good.clone();
        b[8] = 9;
        check(&b, "version 9");
        let mut b = good.clone();
        b[12] = 3;
        check(&b, "power of two");
        check(&good[..good.len() - 48], "expected");
        check(&good[..100], "shorter");
        let mut b = good.clone();
        b.extend_from_slice(&[0; 48]);
        check(&b, "expected");
        assert!(DirReader::open(&d.path().join("missing"))
            .err()
            .unwrap()
            .to_string()
            .contains("missing"));
        DirReader::open(&p).unwrap();
    }
}
