//! Node-shared tiers: one cache per machine, mapped by every local rank. A state word per sample
//! lives in a shared-memory segment; the memory class is a second segment laid out statically by
//! the placement (a sample's offset is known before it is fetched); a directory class keeps one
//! file per sample. Local ranks claim, fill and read samples through these words, so a sample is
//! cached once per node and read from the dataset's storage once.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use memmap2::MmapRaw;

use crate::error::{Error, Result};

pub mod futex;

/// State of a sample in its class.
pub const EMPTY: u32 = 0;
pub const FILLING: u32 = 1;
pub const READY: u32 = 2;
pub const FAILED: u32 = 3;

const MAGIC: u32 = 0x4356_0002; // "CV", layout version 2
/// Header words: magic, attached now, detached so far, capacity agreement state, number of
/// agreed capacities, 3 reserved, one slot per process id, then the agreed capacities (u64 as
/// two words each).
const PID_SLOTS: usize = 64;
const FIRST_PID_SLOT: usize = 8;
const MAX_CLASSES: usize = 8;
const FIRST_CAPACITY: usize = FIRST_PID_SLOT + PID_SLOTS;
const HEADER_WORDS: usize = FIRST_CAPACITY + 2 * MAX_CLASSES;

/// Outcome of [`NodeCache::acquire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    Ready,
    Claimed,
    Unavailable,
}

/// The node cache: shared state words, the memory arena and directory classes.
pub struct NodeCache {
    state_path: PathBuf,
    state: MmapRaw,
    samples: usize,
    arena_path: Option<PathBuf>,
    arena: Option<MmapRaw>,
    arena_len: u64,
    dirs: Vec<PathBuf>,
    users: u32,
    detached: std::sync::atomic::AtomicBool,
}

// SAFETY: the mappings are only accessed through atomics (state words) or at disjoint, claimed
// byte ranges of the arena (a range is written only by the claimant of its sample and read only
// after the READY state is published with Release ordering).
unsafe impl Send for NodeCache {}
unsafe impl Sync for NodeCache {}

fn shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn open_shared(path: &Path, len: u64) -> Result<(File, MmapRaw)> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    // Every local rank asks for the same length; set_len on an already-sized file is a no-op and
    // new pages read as zero (= EMPTY).
    let cur = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if cur < len {
        file.set_len(len).map_err(|e| Error::io(path, e))?;
    }
    let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(path, e))?;
    Ok((file, map))
}

impl NodeCache {
    /// Attach to (or create) the state of the node cache named `key`; then [`NodeCache::agree`]
    /// on capacities and [`NodeCache::map_classes`].
    ///
    /// `users` is how many attachments (local ranks) the cache expects over its life: it is
    /// removed once that many have detached and none is attached, so a rank that finishes
    /// before another has started does not take the cache away from it.
    pub fn attach(key: &str, samples: usize, users: u32) -> Result<NodeCache> {
        let base = shm_dir();
        let state_path = base.join(format!("clairvoyant-{key}.state"));
        let state_len = ((HEADER_WORDS + samples) * 4) as u64;
        let (_f, state) = open_shared(&state_path, state_len)?;
        let (arena_path, arena, arena_len) = (None, None, 0);
        let class_dirs = Vec::new();
        let cache = NodeCache {
            state_path,
            state,
            samples,
            arena_path,
            arena,
            arena_len,
            dirs: class_dirs,
            users,
            detached: false.into(),
        };
        let magic = cache.header(0);
        let _ = magic.compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire);
        if magic.load(Ordering::Acquire) != MAGIC {
            return Err(Error::NotNodeCache {
                path: cache.state_path.clone(),
            });
        }
        cache.header(1).fetch_add(1, Ordering::AcqRel);
        let pid = std::process::id();
        let recorded = (FIRST_PID_SLOT..FIRST_CAPACITY).any(|i| cache.header(i).load(Ordering::Relaxed) == pid);
        if !recorded {
            let _ = (FIRST_PID_SLOT..FIRST_CAPACITY).find(|&i| {
                cache
                    .header(i)
                    .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            });
        }
        remove_stale_segments(&base, &cache.state_path);
        Ok(cache)
    }

    /// Agree with the other local ranks on the class capacities the placement uses: the first
    /// rank to get here publishes its `proposal`, everyone gets the published values. (Detected
    /// capacities depend on free memory and disk at the moment each rank starts, and the ranks
    /// must compute the very same placement, since it fixes every sample's offset.)
    pub fn agree(&self, proposal: &[u64]) -> Result<Vec<u64>> {
        if proposal.len() > MAX_CLASSES {
            return Err(Error::config(
                "class",
                format!("at most {MAX_CLASSES} storage classes are supported"),
            ));
        }
        let flag = self.header(3);
        if flag.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            self.header(4).store(proposal.len() as u32, Ordering::Relaxed);
            for (i, &c) in proposal.iter().enumerate() {
                self.header(FIRST_CAPACITY + 2 * i).store(c as u32, Ordering::Relaxed);
                self.header(FIRST_CAPACITY + 2 * i + 1)
                    .store((c >> 32) as u32, Ordering::Relaxed);
            }
            flag.store(2, Ordering::Release);
            futex::wake_all(flag);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while flag.load(Ordering::Acquire) != 2 {
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(Error::TimedOut {
                    path: self.state_path.clone(),
                    what:
                        "another local rank to finish initialising this node cache (remove the file if that rank died)"
                            .into(),
                    seconds: 30,
                });
            }
            futex::wait(flag, 1, deadline - now);
        }
        let n = self.header(4).load(Ordering::Relaxed) as usize;
        Ok((0..n)
            .map(|i| {
                let lo = self.header(FIRST_CAPACITY + 2 * i).load(Ordering::Relaxed) as u64;
                let hi = self.header(FIRST_CAPACITY + 2 * i + 1).load(Ordering::Relaxed) as u64;
                lo | (hi << 32)
            })
            .collect())
    }

    /// Map the memory class (`arena_len` used bytes; 0 for none) and create the directory
    /// classes (a `clairvoyant-<key>` subdirectory of each path).
    pub fn map_classes(&mut self, arena_len: u64, dirs: &[PathBuf]) -> Result<()> {
        let key = self
            .state_path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".state"))
            .expect("state file name")
            .to_string();
        if arena_len > 0 {
            let p = self.state_path.with_extension("mem");
            let (_f, m) = open_shared(&p, arena_len)?;
            self.arena_path = Some(p);
            self.arena = Some(m);
            self.arena_len = arena_len;
        }
        for d in dirs {
            let dir = d.join(&key);
            std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            self.dirs.push(dir);
        }
        Ok(())
    }

    /// Path of the memory class's shared file, if there is a memory class.
    pub fn arena_path(&self) -> Option<&Path> {
        self.arena_path.as_deref()
    }

    /// A new path for one of `rank`'s staging rings next to this node cache: unique per job
    /// (a process may run several jobs, or the same job again), named with the process id so the
    /// janitor can remove it if the process dies.
    pub fn ring_path(&self, rank: u32) -> PathBuf {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let stem = self
            .state_path
            .file_stem()
            .and_then(|n| n.to_str())
            .unwrap_or("clairvoyant");
        self.state_path
            .with_file_name(format!("{stem}.r{rank}.j{n}.p{}.ring", std::process::id()))
    }

    fn header(&self, i: usize) -> &AtomicU32 {
        self.word(i)
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        assert!(i < HEADER_WORDS + self.samples);
        // SAFETY: the mapping is at least (HEADER_WORDS + samples) * 4 bytes, page aligned, and
        // lives as long as self; AtomicU32 has the alignment and size of u32.
        unsafe { &*(self.state.as_mut_ptr().add(i * 4) as *const AtomicU32) }
    }

    /// The state word of `sample`.
    pub fn state(&self, sample: u32) -> &AtomicU32 {
        self.word(HEADER_WORDS + sample as usize)
    }

    /// Try to claim `sample` for filling (EMPTY -> FILLING).
    pub fn claim(&self, sample: u32) -> bool {
        self.state(sample)
            .compare_exchange(EMPTY, FILLING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Publish the outcome of a fill and wake waiters (in any local process).
    pub fn publish(&self, sample: u32, ok: bool) {
        let w = self.state(sample);
        w.store(if ok { READY } else { FAILED }, Ordering::Release);
        futex::wake_all(w);
    }

    /// Wait up to `timeout` while `sample` is being filled elsewhere; returns the state seen last.
    pub fn wait_filled(&self, sample: u32, timeout: Duration) -> u32 {
        let w = self.state(sample);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let s = w.load(Ordering::Acquire);
            if s != FILLING {
                return s;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return s;
            }
            futex::wait(w, FILLING, deadline - now);
        }
    }

    /// Settle who provides `sample`: it is ready, or this caller now holds the claim to fill it,
    /// or it is unavailable (failed, or still being filled elsewhere after `timeout`).
    pub fn acquire(&self, sample: u32, timeout: Duration) -> Acquire {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            match self.state(sample).load(Ordering::Acquire) {
                READY => return Acquire::Ready,
                EMPTY => {
                    if self.claim(sample) {
                        return Acquire::Claimed;
                    }
                }
                FILLING => {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() || self.wait_filled(sample, left) == FILLING {
                        return Acquire::Unavailable;
                    }
                }
                _ => return Acquire::Unavailable,
            }
        }
    }

    pub fn is_ready(&self, sample: u32) -> bool {
        self.state(sample).load(Ordering::Acquire) == READY
    }

    /// The arena bytes at `offset..offset+len` as a raw pointer (memory class).
    pub fn arena_ptr(&self, offset: u64, len: u64) -> *mut u8 {
        let arena = self.arena.as_ref().expect("memory class not configured");
        assert!(offset + len <= self.arena_len, "arena range out of bounds");
        // SAFETY: bounds checked above; the mapping lives as long as self.
        unsafe { arena.as_mut_ptr().add(offset as usize) }
    }

    /// Path of `sample`'s file in directory class `dir` (index among the directory classes).
    pub fn file_path(&self, dir: usize, sample: u32) -> PathBuf {
        self.dirs[dir].join(format!("{sample}"))
    }

    /// Write `bytes` as `sample`'s file in directory class `dir`, atomically (tmp + rename).
    pub fn write_file(&self, dir: usize, sample: u32, bytes: &[u8]) -> Result<()> {
        let path = self.file_path(dir, sample);
        let tmp = self.dirs[dir].join(format!(".{sample}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
    }

    /// Read `sample`'s file in directory class `dir` into `buf`.
    pub fn read_file(&self, dir: usize, sample: u32, buf: &mut [u8]) -> Result<()> {
        use std::io::Read;
        let path = self.file_path(dir, sample);
        let mut f = File::open(&path).map_err(|e| Error::io(&path, e))?;
        f.read_exact(buf).map_err(|e| Error::io(&path, e))
    }

    /// Detach; the last local process to detach removes the segments and directories.
    pub fn detach(&self) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        // The process's slot stays: another job of this process may still use the segment, and
        // the janitor only removes segments whose recorded processes are all gone.
        let done = self.header(2).fetch_add(1, Ordering::AcqRel) + 1;
        if self.header(1).fetch_sub(1, Ordering::AcqRel) == 1 && done >= self.users {
            let _ = std::fs::remove_file(&self.state_path);
            if let Some(p) = &self.arena_path {
                let _ = std::fs::remove_file(p);
            }
            for d in &self.dirs {
                let _ = std::fs::remove_dir_all(d);
            }
        }
    }
}

fn process_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Remove node caches left behind by runs whose processes all died without detaching (a crash
/// would otherwise pin their shared memory until reboot). A segment is stale only when it
/// records at least one process and none of them is alive.
fn remove_stale_segments(dir: &Path, except: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("clairvoyant-") {
            continue;
        }
        if let Some(pid) = name
            .strip_suffix(".ring")
            .and_then(|n| n.rsplit(".p").next())
            .and_then(|p| p.parse().ok())
        {
            // A staging ring belongs to one process.
            if !process_alive(pid) {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        if path == except || !name.ends_with(".state") {
            continue;
        }
        let mut head = vec![0u8; HEADER_WORDS * 4];
        let Ok(mut file) = File::open(&path) else { continue };
        if std::io::Read::read_exact(&mut file, &mut head).is_err() {
            continue;
        }
        let word = |i: usize| u32::from_ne_bytes(head[i * 4..i * 4 + 4].try_into().unwrap());
        if word(0) != MAGIC {
            continue;
        }
        let pids: Vec<u32> = (FIRST_PID_SLOT..FIRST_CAPACITY).map(word).filter(|&p| p != 0).collect();
        if !pids.is_empty() && pids.iter().all(|&p| !process_alive(p)) {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(path.with_extension("mem"));
        }
    }
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        self.detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_fill_publish_shared_between_handles() {
        let key = format!("test-{}-{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], "");
        let dir = tempfile::tempdir().unwrap();
        let open = |key: &str, d: &Path| {
            let mut c = NodeCache::attach(key, 10, 2).unwrap();
            c.map_classes(100, &[d.to_path_buf()]).unwrap();
            c
        };
        let a = open(&key, dir.path());
        let b = open(&key, dir.path());
        assert!(a.claim(3));
        assert!(!b.claim(3));
        // SAFETY: 3..13 lies inside the 100-byte arena, claimed by `a`.
        unsafe { std::ptr::copy_nonoverlapping(b"helloworld".as_ptr(), a.arena_ptr(3, 10), 10) };
        let t = std::thread::spawn({
            let key = key.clone();
            let d = dir.path().to_path_buf();
            move || {
                let mut c = NodeCache::attach(&key, 10, 2).unwrap();
                c.map_classes(100, &[d]).unwrap();
                c.wait_filled(3, Duration::from_secs(5))
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        a.publish(3, true);
        assert_eq!(t.join().unwrap(), READY);
        // SAFETY: published READY above.
        let got = unsafe { std::slice::from_raw_parts(b.arena_ptr(3, 10), 10) };
        assert_eq!(got, b"helloworld");
        b.write_file(0, 7, b"xyz").unwrap();
        let mut buf = [0u8; 3];
        a.read_file(0, 7, &mut buf).unwrap();
        assert_eq!(&buf, b"xyz");
        let state = a.state_path.clone();
        drop(a);
        assert!(state.exists());
        drop(b);
        assert!(!state.exists(), "last detach removes the segment");
    }

    #[test]
    fn segments_of_dead_processes_are_removed() {
        let base = shm_dir();
        let stale = base.join(format!("clairvoyant-stale-test-{}.state", std::process::id()));
        let mem = stale.with_extension("mem");
        let mut header = vec![0u8; HEADER_WORDS * 4 + 16];
        header[0..4].copy_from_slice(&MAGIC.to_ne_bytes());
        // A pid far above pid_max is never alive.
        header[FIRST_PID_SLOT * 4..FIRST_PID_SLOT * 4 + 4].copy_from_slice(&0x7fff_fff0u32.to_ne_bytes());
        // Agreed capacities follow the pid slots; a capacity of 1 must not read as pid 1 (alive).
        header[FIRST_CAPACITY * 4..FIRST_CAPACITY * 4 + 4].copy_from_slice(&1u32.to_ne_bytes());
        std::fs::write(&stale, &header).unwrap();
        std::fs::write(&mem, b"data").unwrap();
        let live = base.join(format!("clairvoyant-live-test-{}.state", std::process::id()));
        header[FIRST_PID_SLOT * 4..FIRST_PID_SLOT * 4 + 4].copy_from_slice(&std::process::id().to_ne_bytes());
        std::fs::write(&live, &header).unwrap();
        let _c = NodeCache::attach(&format!("janitor-{}", std::process::id()), 1, 1).unwrap();
        assert!(!stale.exists() && !mem.exists(), "stale segment removed");
        assert!(live.exists(), "a live process's segment stays");
        std::fs::remove_file(live).unwrap();
    }

    #[test]
    fn cache_outlives_an_early_finisher_until_every_user_came() {
        let key = format!("test-users-{}", std::process::id());
        let a = NodeCache::attach(&key, 4, 2).unwrap();
        assert_eq!(a.agree(&[100, 7]).unwrap(), vec![100, 7]);
        assert!(a.claim(0));
        a.publish(0, true);
        let state = a.state_path.clone();
        drop(a);
        assert!(state.exists(), "the second rank has not attached yet");
        let b = NodeCache::attach(&key, 4, 2).unwrap();
        assert_eq!(b.agree(&[5 << 33, 1]).unwrap(), vec![100, 7], "the first proposal wins");
        assert!(b.is_ready(0), "the first rank's fill is still there");
        drop(b);
        assert!(!state.exists());
    }

    #[test]
    fn wait_times_out_instead_of_hanging() {
        let key = format!("test-timeout-{}", std::process::id());
        let a = NodeCache::attach(&key, 4, 1).unwrap();
        assert!(a.claim(1));
        let t0 = std::time::Instant::now();
        assert_eq!(a.wait_filled(1, Duration::from_millis(50)), FILLING);
        assert!(t0.elapsed() >= Duration::from_millis(45));
    }
}
