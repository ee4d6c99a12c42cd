//! Node-shared tiers: one cache per machine, mapped by every local rank. A state segment holds a
//! record per sample (state word naming its claimant, checksum, dataset-file stamp); the tiers
//! hold the bytes: the memory class (a shared arena laid out statically by the placement) and
//! directory classes (one file per sample), all behind the [`Tier`] trait. Local ranks claim,
//! fill and read samples through the records, so a sample is cached once per node, read from
//! the dataset's storage once, and checked before its cached bytes are used.
//!
//! Everything lives in a private per-user directory (see [`secure`]); caches whose processes
//! all died are removed by the next attach ([`NodeCache::attach`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::model::ClassKind;

pub mod directory;
pub mod faulty;
pub mod memory;
pub mod salvage;
pub mod secure;
pub mod state;

pub use directory::DirectoryTier;
pub use faulty::Faulty;
pub use memory::MemoryTier;
pub use state::{Acquire, ArenaAt, StateSegment, EMPTY, FILLING, NOSPACE, READY};

/// Why a tier could not store or hand out a sample's bytes.
#[derive(Debug)]
pub enum Fault {
    /// The tier's storage is full: the sample stays uncached in this tier.
    NoSpace,
    /// Fewer bytes than the sample has (a truncated file or segment).
    Short {
        /// Bytes the sample has.
        expected: u64,
        /// Bytes the tier could hand out.
        got: u64,
    },
    /// The bytes do not match the checksum recorded when the sample was filled.
    Mismatch,
    /// Any other failure of the tier's storage (the error names the file).
    Io(Error),
}

/// One storage class of the node cache. `place` is where the placement put the sample (its
/// byte offset in a memory arena; unused by a directory). Claims and checksums are not the
/// tier's business: [`NodeCache`] keeps them in the state segment, so every tier (and wrapper)
/// gets the same protocol.
pub trait Tier: Send + Sync {
    /// The class's name, as in the system model.
    fn name(&self) -> &str;
    /// Bytes the tier may hold.
    fn capacity(&self) -> u64;
    /// Store `bytes` as `sample`.
    fn write(&self, sample: u32, place: u64, bytes: &[u8]) -> Result<(), Fault>;
    /// Read `sample` into `buf` (exactly its length).
    fn read(&self, sample: u32, place: u64, buf: &mut [u8]) -> Result<(), Fault>;
    /// The bytes in place, for tiers that are a shared mapping (zero-copy reads and in-place
    /// fills); `Ok(None)` for tiers that are not. Checks the backing file still holds them.
    fn mapped(&self, _place: u64, _len: u64) -> Result<Option<*mut u8>, Fault> {
        Ok(None)
    }
    /// [`Tier::mapped`] for a fill that writes the bytes in place: the range's storage is
    /// reserved first ([`Fault::NoSpace`] when it cannot be).
    fn writable(&self, place: u64, len: u64) -> Result<Option<*mut u8>, Fault> {
        self.mapped(place, len)
    }
    /// [`Tier::mapped`] for one access of a group made together (the samples of one hand-out
    /// call): the backing file's size is read by the group's first access (`size` is None) and
    /// kept in `size` for the rest, so a group costs one system call; a truncation that happened
    /// before the group began is always seen.
    fn mapped_in_group(&self, place: u64, len: u64, _size: &mut Option<u64>) -> Result<Option<*mut u8>, Fault> {
        self.mapped(place, len)
    }
    /// The shared file other processes map to read [`Tier::mapped`] bytes.
    fn shared_path(&self) -> Option<&Path> {
        None
    }
    /// Hint that `place..place+len` is about to be read (mapped tiers); never faults.
    fn prefetch(&self, _place: u64, _len: u64) {}
    /// Remove the tier's files (the last local rank leaves).
    fn remove(&self) {}
}

/// Ask the CPU to bring the cache lines of `ptr..ptr+len` in; a hint that never faults.
#[inline]
pub(crate) fn prefetch_lines(ptr: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut i = 0;
        while i < len {
            // SAFETY: prefetch is a hint; it does not access memory architecturally and never
            // faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch(ptr.wrapping_add(i) as *const i8, std::arch::x86_64::_MM_HINT_T0)
            };
            i += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (ptr, len);
}

/// The checksum of a sample's bytes (xxh3-64: ~55 GB/s with AVX2, no C dependency).
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}

/// Print `msg` on stderr once per `key` in this process.
pub fn warn_once(key: &str, msg: &str) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.get_or_insert_with(HashSet::new).insert(key.to_string()) {
        eprintln!("clairvoyant: warning: {msg}");
    }
}

/// A class the engine wants, in placement order (fastest first).
#[derive(Clone, Debug)]
pub struct ClassRequest {
    /// The class's name, as in the system model.
    pub name: String,
    /// What the class is backed by (shared memory or a directory).
    pub kind: ClassKind,
    /// Bytes proposed (already at most what the class could ever use).
    pub capacity: u64,
}

/// Result of reading a READY sample from a tier and checking it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verified {
    /// The bytes match the recorded checksum.
    Good,
    /// Wrong checksum or fewer bytes than the sample has.
    Corrupt,
}

/// Result of storing a claimed sample.
#[derive(Debug)]
pub enum Filled {
    /// Published READY.
    Ready,
    /// The tier is full: the sample is marked uncacheable (warned once per class).
    NoSpace,
    /// The claim was given back (the next accessor retries).
    Failed(Fault),
}

/// Free shared memory left for other users of the file system beyond what the cache takes.
const SHM_MARGIN: u64 = 8 << 20;

/// Bytes the memory class may take of `free` shared memory: the local ranks' staging rings
/// (`ring_reserve`), the state segment and a margin come first.
fn memory_room(free: u64, ring_reserve: u64, samples: usize) -> u64 {
    free.saturating_sub(ring_reserve + SHM_MARGIN + (samples as u64) * 16)
}

/// Where the memory class's arena goes: in shared memory, else on disk.
struct Arenas {
    shm: PathBuf,
    disk: PathBuf,
}

/// The node cache of one job on this machine, as attached by one local rank.
pub struct NodeCache {
    state: StateSegment,
    dir: PathBuf,
    stem: String,
    tiers: Vec<Box<dyn Tier>>,
    users: u32,
    rank_index: usize,
    nonce: u32,
    creator_pid: u32,
    detached: AtomicBool,
    full_warned: Vec<AtomicBool>,
    /// This attachment set the cache up (it decided the capacities in [`NodeCache::setup`]).
    set_up_here: bool,
}

impl NodeCache {
    /// Attach to (or create) the node cache named `key` in the shared-memory directory, as local
    /// rank number `rank_index`; see [`NodeCache::attach_in`].
    pub fn attach(key: &str, samples: usize, rank_index: usize, users: u32) -> Result<NodeCache> {
        Self::attach_in(&secure::shm_base(), key, samples, rank_index, users)
    }

    /// Attach under `<base>/clairvoyant-<uid>/`. Caches whose processes all died are removed
    /// first. If a live attachment of another run already holds this local rank in `key`, the
    /// next generation (`key.g1`, `key.g2`, ...) is used, so unrelated runs never share state.
    /// `users` is how many attachments the cache expects over its life: it is removed once that
    /// many have left and none is attached.
    pub fn attach_in(base: &Path, key: &str, samples: usize, rank_index: usize, users: u32) -> Result<NodeCache> {
        static NONCE: AtomicU32 = AtomicU32::new(1);
        let dir = secure::private_dir(base)?;
        remove_dead_caches(&dir);
        if let Ok(disk) = secure::private_dir(&secure::disk_base()) {
            if disk != dir {
                remove_dead_caches(&disk);
            }
        }
        let nonce = NONCE.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
        for g in 0..64 {
            let stem = if g == 0 {
                format!("clairvoyant-{key}")
            } else {
                format!("clairvoyant-{key}.g{g}")
            };
            let state = StateSegment::open(&dir, &stem, samples)?;
            if state.register_rank(rank_index, nonce)? {
                return Ok(NodeCache {
                    state,
                    dir,
                    stem,
                    tiers: Vec::new(),
                    users,
                    rank_index,
                    nonce,
                    creator_pid: std::process::id(),
                    detached: AtomicBool::new(false),
                    full_warned: Vec::new(),
                    set_up_here: false,
                });
            }
        }
        Err(Error::config(
            "local_ranks",
            format!("64 runs on this machine already hold local rank {rank_index} of node cache {key}"),
        ))
    }

    /// Whether this attachment set the cache up: the first local rank to arrive, whichever it
    /// is (a rank started late may find the others gone and set up a fresh cache alone).
    pub fn set_up_here(&self) -> bool {
        self.set_up_here
    }

    /// The cache's name (`clairvoyant-<key>[.g<n>]`).
    pub fn stem(&self) -> &str {
        &self.stem
    }

    /// The private directory holding the state, the arena and the staging rings.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The node cache's state segment (per-sample claims, checksums and stamps).
    pub fn state(&self) -> &StateSegment {
        &self.state
    }

    /// Agree with the other local ranks on class capacities and map the classes. The first
    /// rank decides: the memory class is limited to what the shared-memory file system can hold
    /// after `ring_reserve` bytes for the local ranks' staging rings (a warning names the field
    /// when it clamps), its arena is created with the space reserved up front, and if that
    /// fails it goes to a file on disk (or is dropped). Returns the agreed capacities, which
    /// every local rank must use for the placement.
    pub fn setup(&mut self, classes: &[ClassRequest], ring_reserve: u64) -> Result<Vec<u64>> {
        let memory = classes.iter().position(|c| c.kind == ClassKind::Memory);
        if classes.iter().filter(|c| c.kind == ClassKind::Memory).count() > 1 {
            return Err(Error::config("class", "at most one memory class is supported"));
        }
        let arenas = Arenas {
            shm: self.dir.join(format!("{}.mem", self.stem)),
            disk: secure::private_dir(&secure::disk_base())?.join(format!("{}.mem", self.stem)),
        };
        let mut set_up_here = false;
        let (caps, at) = self.state.agree(|| {
            set_up_here = true;
            // A fresh cache starts empty: files a crashed run of the same name left in a
            // directory class go before anyone can fill it.
            self.clear_directory_classes(classes);
            let mut caps: Vec<u64> = classes.iter().map(|c| c.capacity).collect();
            let mut at = ArenaAt::None;
            if let Some(j) = memory.filter(|&j| caps[j] > 0) {
                (caps[j], at) = self.create_arena(&classes[j], caps[j], ring_reserve, &arenas);
            }
            Ok((caps, at))
        })?;
        self.set_up_here = set_up_here;
        if caps.len() != classes.len() {
            return Err(Error::config(
                "class",
                format!(
                    "this rank caches in {} classes but the node cache {} was set up with {}",
                    classes.len(),
                    self.stem,
                    caps.len()
                ),
            ));
        }
        self.open_tiers(classes, &caps, at, &arenas)?;
        Ok(caps)
    }

    /// Remove what a crashed run of the same name left in the directory classes.
    fn clear_directory_classes(&self, classes: &[ClassRequest]) {
        for c in classes {
            if let ClassKind::Directory { path } = &c.kind {
                // A missing, read-only or refused class folder is dealt with when the class is
                // opened (created, dropped with a warning, or an error).
                if let Ok(base) = secure::private_dir(path) {
                    let _ = std::fs::remove_dir_all(base.join(&self.stem));
                }
            }
        }
    }

    /// Create the memory class's arena of at most `cap` bytes: in shared memory, clamped to
    /// what it holds after the staging rings, else on disk, else none. Its capacity and where
    /// it is.
    fn create_arena(&self, class: &ClassRequest, cap: u64, ring_reserve: u64, arenas: &Arenas) -> (u64, ArenaAt) {
        let asked = cap;
        let mut cap = cap;
        let field = format!("class.{}.capacity", class.name);
        let free = crate::sysinfo::free_space(&self.dir).unwrap_or(0);
        let avail = memory_room(free, ring_reserve, self.state.samples());
        if cap > avail {
            warn_once(
                &field,
                &format!(
                    "{field} asks for {} but {} has {} free, {} of it for the staging rings \
                     (staging.capacity); using {}",
                    crate::model::human_bytes(cap),
                    self.dir.display(),
                    crate::model::human_bytes(free),
                    crate::model::human_bytes(ring_reserve),
                    crate::model::human_bytes(avail)
                ),
            );
            cap = avail;
        }
        if cap > 0 && MemoryTier::create(&arenas.shm, cap).is_ok() {
            return (cap, ArenaAt::Shm);
        }
        // Shared memory with no room at all (a container's 64 MB /dev/shm): the class asks the
        // disk for its whole capacity, where the page cache keeps what it can in memory.
        if cap == 0 {
            cap = asked;
        }
        let disk_free = crate::sysinfo::free_space(&arenas.disk).unwrap_or(0);
        cap = cap.min(disk_free.saturating_sub(SHM_MARGIN));
        if cap > 0 && MemoryTier::create(&arenas.disk, cap).is_ok() {
            warn_once(
                &format!("{field}.disk"),
                &format!(
                    "shared memory is full: the memory class '{}' is a file on disk ({})",
                    class.name,
                    arenas.disk.display()
                ),
            );
            return (cap, ArenaAt::Disk);
        }
        (0, ArenaAt::None)
    }

    /// Map every class with its agreed capacity; a directory class that cannot be written
    /// caches nothing (warned once).
    fn open_tiers(&mut self, classes: &[ClassRequest], caps: &[u64], at: ArenaAt, arenas: &Arenas) -> Result<()> {
        let mut unusable = Vec::new();
        for (j, c) in classes.iter().enumerate() {
            let tier: Box<dyn Tier> = match &c.kind {
                ClassKind::Memory => {
                    let path = match at {
                        ArenaAt::Disk => &arenas.disk,
                        _ => &arenas.shm,
                    };
                    if caps[j] == 0 || at == ArenaAt::None {
                        Box::new(NoTier(c.name.clone()))
                    } else {
                        Box::new(MemoryTier::open(&c.name, path, caps[j])?)
                    }
                }
                ClassKind::Directory { path } => match self.open_directory(c, path, caps[j])? {
                    Some(tier) => tier,
                    None => {
                        unusable.push(j);
                        Box::new(NoTier(c.name.clone()))
                    }
                },
            };
            self.tiers.push(tier);
        }
        self.full_warned = (0..self.tiers.len())
            .map(|j| AtomicBool::new(unusable.contains(&j)))
            .collect();
        Ok(())
    }

    /// Open directory class `c` at `path`; None: it cannot be written (warned once).
    fn open_directory(&self, c: &ClassRequest, path: &Path, cap: u64) -> Result<Option<Box<dyn Tier>>> {
        match open_directory_class(&c.name, path, &self.dir, &self.stem, cap) {
            Ok(tier) => {
                tier.mark_owner(self.state.path());
                Ok(Some(Box::new(tier)))
            }
            Err(Error::Io { path: at, source }) if unwritable(&source) => {
                // One way for every class fault (full, read-only, not ours to write): the class
                // caches nothing, its samples are read from their origin.
                warn_once(
                    &format!("{}:{}:full", self.stem, c.name),
                    &format!(
                        "storage class '{}' cannot be used ({}: {source}); its samples stay uncached \
                         (class.{}.path)",
                        c.name,
                        at.display(),
                        c.name
                    ),
                );
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Add a tier directly (tests and wrappers); class indices follow the order of addition.
    pub fn push_tier(&mut self, tier: Box<dyn Tier>) {
        self.tiers.push(tier);
        self.full_warned.push(AtomicBool::new(false));
    }

    /// The tier of class index `class` (placement order).
    pub fn tier(&self, class: usize) -> &dyn Tier {
        self.tiers[class].as_ref()
    }

    /// Path of the memory class's shared file, if there is one.
    pub fn arena_path(&self) -> Option<&Path> {
        self.tiers.iter().find_map(|t| t.shared_path())
    }

    /// A new staging ring of `len` bytes for `rank`: in the shared-memory directory when it has
    /// room for it now (its blocks are reserved as staging first writes them), else in a disk
    /// directory, reserved whole. Named with the process id so the janitor removes it if the
    /// process dies. Returns its path, the file and how many bytes from its start are reserved.
    pub fn create_ring(&self, rank: u32, len: u64) -> Result<(PathBuf, std::fs::File, u64)> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}.r{rank}.j{n}.p{}.ring", self.stem, std::process::id());
        let shm = self.dir.join(&name);
        let room = crate::sysinfo::free_space(&self.dir).is_ok_and(|free| free >= len.saturating_add(SHM_MARGIN));
        if room {
            match secure::create_sized(&shm, len) {
                Ok(f) => return Ok((shm, f, 0)),
                Err(e) if !secure::is_no_space(&e) => return Err(Error::io(&shm, e)),
                Err(_) => {}
            }
        }
        let disk = secure::private_dir(&secure::disk_base())?.join(&name);
        let f = secure::create_reserved(&disk, len).map_err(|e| {
            if !secure::is_no_space(&e) {
                return Error::io(&disk, e);
            }
            let free = |p: &Path| {
                crate::sysinfo::free_space(p)
                    .map(crate::model::human_bytes)
                    .unwrap_or_else(|_| "?".into())
            };
            Error::config(
                "staging.capacity",
                format!(
                    "a staging ring of {} fits neither in shared memory ({}, {} free) nor on disk ({}, {} free); \
                     lower staging.capacity (or CLAIRVOYANT_STAGING)",
                    crate::model::human_bytes(len),
                    self.dir.display(),
                    free(&self.dir),
                    secure::disk_base().display(),
                    free(&secure::disk_base())
                ),
            )
        })?;
        warn_once(
            "staging.capacity",
            &format!(
                "shared memory cannot hold the staging ring (staging.capacity); it is a file on disk ({})",
                disk.display()
            ),
        );
        Ok((disk, f, len))
    }

    /// Read READY `sample` of `class` into `buf` and check it against its recorded checksum.
    pub fn read_verified(&self, class: usize, sample: u32, place: u64, buf: &mut [u8]) -> Verified {
        match self.tiers[class].read(sample, place, buf) {
            Ok(()) if checksum(buf) == self.state.record(sample).0 => Verified::Good,
            _ => Verified::Corrupt,
        }
    }

    /// The mapped bytes of READY `sample`, checked against its recorded checksum; None when the
    /// tier is not mapped, Err when the bytes are wrong or the backing file is too short.
    pub fn view_verified(&self, class: usize, sample: u32, place: u64, len: u64) -> Result<Option<*const u8>, Fault> {
        self.view_verified_in_group(class, sample, place, len, &mut None)
    }

    /// [`NodeCache::view_verified`] for one sample of a group handed out together: the mapped
    /// file's size is read once per group (see [`Tier::mapped_in_group`]); every sample's
    /// checksum is still checked.
    pub fn view_verified_in_group(
        &self,
        class: usize,
        sample: u32,
        place: u64,
        len: u64,
        size: &mut Option<u64>,
    ) -> Result<Option<*const u8>, Fault> {
        match self.tiers[class].mapped_in_group(place, len, size) {
            Ok(Some(p)) => {
                // SAFETY: the tier checked the range against the file's current size.
                let bytes = unsafe { std::slice::from_raw_parts(p as *const u8, len as usize) };
                if checksum(bytes) == self.state.record(sample).0 {
                    Ok(Some(p as *const u8))
                } else {
                    Err(Fault::Mismatch)
                }
            }
            r => r.map(|p| p.map(|p| p as *const u8)),
        }
    }

    /// The mapped bytes of READY `sample` at `place`, not checked against its checksum (for a
    /// reader that checks them itself, as a peer receiving them does); None when the tier is not
    /// mapped, Err when the backing file is too short.
    pub fn view(&self, class: usize, place: u64, len: u64) -> Result<Option<*const u8>, Fault> {
        self.tiers[class]
            .mapped_in_group(place, len, &mut None)
            .map(|p| p.map(|p| p as *const u8))
    }

    /// Hint that READY `sample` of `class` at `place` is about to be checked.
    pub fn prefetch(&self, class: usize, sample: u32, place: u64, len: u64) {
        self.state.prefetch_record(sample);
        self.tiers[class].prefetch(place, len.min(4096));
    }

    /// The mapped bytes where a claimed `sample` is to be filled in place (mapped tiers only).
    pub fn fill_slot(&self, class: usize, place: u64, len: u64) -> Option<*mut u8> {
        self.tiers[class].writable(place, len).ok().flatten()
    }

    /// `sample` does not fit in `class` (full, or no longer writable): it stays uncached, and
    /// the class's one warning says why.
    fn class_unusable(&self, class: usize, sample: u32, message: impl FnOnce() -> String) -> Filled {
        self.state.mark_no_space(sample);
        if !self.full_warned[class].swap(true, Ordering::Relaxed) {
            warn_once(&format!("{}:{}:full", self.stem, self.tiers[class].name()), &message());
        }
        Filled::NoSpace
    }

    /// Store the claimed `sample`'s `bytes` (read from the dataset, with dataset `stamp`) in
    /// `class` and publish it, or give the claim back. `in_place`: the bytes were read straight
    /// into [`NodeCache::fill_slot`] and need no copy.
    pub fn fill(&self, class: usize, sample: u32, place: u64, bytes: &[u8], stamp: u32, in_place: bool) -> Filled {
        let r = if in_place {
            Ok(())
        } else {
            self.tiers[class].write(sample, place, bytes)
        };
        match r {
            Ok(()) => {
                self.state.publish(sample, checksum(bytes), stamp);
                Filled::Ready
            }
            Err(Fault::NoSpace) => self.class_unusable(class, sample, || {
                format!(
                    "storage class '{}' is full; samples that do not fit stay uncached",
                    self.tiers[class].name()
                )
            }),
            Err(Fault::Io(Error::Io { path, source })) if unwritable(&source) => {
                // Made read-only (or removed) during the run: handled as a full class.
                self.class_unusable(class, sample, || {
                    let name = self.tiers[class].name();
                    format!(
                        "storage class '{name}' cannot be written ({}: {source}); samples that are not \
                         cached there yet stay uncached (class.{name}.path)",
                        path.display(),
                    )
                })
            }
            Err(f) => {
                self.state.abandon(sample);
                Filled::Failed(f)
            }
        }
    }

    /// Leave the cache; the last of its expected users removes its files. Does nothing in a
    /// forked child (the cache belongs to the process that attached).
    pub fn detach(&self) {
        self.detach_ranks(1)
    }

    /// [`NodeCache::detach`] for an attachment that served `ranks` local ranks of this process.
    pub fn detach_ranks(&self, ranks: u32) {
        if std::process::id() != self.creator_pid || self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        if self
            .state
            .unregister_rank(self.rank_index, self.nonce, self.users, ranks)
        {
            let _ = std::fs::remove_file(self.state.path());
            let _ = std::fs::remove_file(self.dir.join(format!("{}.layout", self.stem)));
            let _ = std::fs::remove_file(self.dir.join(format!("{}.plan", self.stem)));
            for t in &self.tiers {
                t.remove();
            }
        }
    }
}

impl Drop for NodeCache {
    fn drop(&mut self) {
        self.detach();
    }
}

/// Whether a write error means the class cannot take files now: full, read-only, no permission,
/// or its folder gone. Such a class is handled one way: it caches nothing more, with a warning.
fn unwritable(e: &std::io::Error) -> bool {
    secure::is_no_space(e)
        || matches!(
            e.raw_os_error(),
            Some(libc::EROFS) | Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::ENOENT)
        )
}

/// The directory class `name` at `path`: the folder is created (0700, parents included) when
/// missing, then `<path>/clairvoyant-<uid>/<stem>` as a private directory.
fn open_directory_class(name: &str, path: &Path, shm_dir: &Path, stem: &str, capacity: u64) -> Result<DirectoryTier> {
    use std::os::unix::fs::DirBuilderExt;
    if !path.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| Error::io(path, e))?;
    }
    let base = secure::private_dir(path)?;
    remove_dead_class_dirs(&base, shm_dir, stem);
    DirectoryTier::open(name, &base.join(stem), capacity)
}

/// A class that could not be created (no space at all): holds nothing.
struct NoTier(String);

impl Tier for NoTier {
    fn name(&self) -> &str {
        &self.0
    }
    fn capacity(&self) -> u64 {
        0
    }
    fn write(&self, _: u32, _: u64, _: &[u8]) -> Result<(), Fault> {
        Err(Fault::NoSpace)
    }
    fn read(&self, _: u32, _: u64, buf: &mut [u8]) -> Result<(), Fault> {
        Err(Fault::Short {
            expected: buf.len() as u64,
            got: 0,
        })
    }
}

fn pid_alive(pid: u32) -> bool {
    secure::start_time(pid).is_some()
}

/// What [`clean`] removed: files, and the bytes they held (allocated blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Files removed.
    pub files: u64,
    /// Bytes those files held.
    pub bytes: u64,
}

/// Remove this user's node-cache files that no live process uses, in
/// `<shm>/clairvoyant-<uid>` and the disk fallback's `<tmp>/clairvoyant-<uid>`: caches whose
/// processes all died (state, arena, layout, plan), staging rings of dead processes, stale
/// temporary files, and the copies kept for the next job's reuse after a crash (`salvage-*`).
/// Then, in each directory class's folder of `classes` (the paths a configuration names), the
/// per-cache folders whose cache is gone. What a live process uses is kept. The next job's start
/// removes the same files (keeping the salvaged copies for an hour, and each directory class it
/// uses); this is for a node where none follows (a job's epilog).
pub fn clean(shm: &Path, classes: &[PathBuf]) -> Cleaned {
    let mine = format!("clairvoyant-{}", secure::uid());
    let private = |base: &Path| {
        let dir = base.join(&mine);
        (dir.is_dir() && secure::check_private_dir(&dir).is_ok()).then_some(dir)
    };
    let mut dirs: Vec<PathBuf> = Vec::new();
    for base in [shm.to_path_buf(), secure::disk_base()] {
        if let Some(dir) = private(&base).filter(|d| !dirs.contains(d)) {
            dirs.push(dir);
        }
    }
    let class_dirs: Vec<PathBuf> = classes.iter().filter_map(|c| private(c)).collect();
    let files = || {
        let mut found = std::collections::HashMap::new();
        for d in &dirs {
            sizes(d, 0, &mut found);
        }
        for d in &class_dirs {
            sizes(d, 1, &mut found); // a folder per cache
        }
        found
    };
    let before = files();
    for d in &dirs {
        remove_dead_caches(d);
        salvage::expire(d, std::time::Duration::ZERO);
    }
    let states = shm.join(&mine);
    for d in &class_dirs {
        remove_dead_class_dirs(d, &states, "");
    }
    let after = files();
    let mut out = Cleaned::default();
    for (path, bytes) in &before {
        if !after.contains_key(path) {
            out.files += 1;
            out.bytes += bytes;
        }
    }
    out
}

/// The regular files in `dir` and, `depth` levels down, in its folders (never through a
/// symlink), with the bytes each holds (allocated blocks), added to `found`.
fn sizes(dir: &Path, depth: u32, found: &mut std::collections::HashMap<PathBuf, u64>) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue }; // of the entry itself: a symlink is no folder
        if m.is_file() {
            found.insert(e.path(), m.blocks() * 512);
        } else if m.is_dir() && depth > 0 {
            sizes(&e.path(), depth - 1, found);
        }
    }
}

/// Remove, in a private directory, the caches whose recorded processes all died (state, arena
/// next to it and in the disk directory), staging rings of dead processes and temporary files
/// older than a minute.
fn remove_dead_caches(dir: &Path) {
    salvage::expire(dir, salvage::KEEP_FOR);
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let disk = secure::private_dir(&secure::disk_base()).ok();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if !name.starts_with("clairvoyant-") {
            continue;
        }
        if let Some(stem) = name.strip_suffix(".state") {
            if state::all_dead(&path) {
                // The node's plan is of no use to another run.
                let _ = std::fs::remove_file(dir.join(format!("{stem}.plan")));
                // Kept for the next run over the same dataset when it has a layout.
                if salvage::keep(dir, stem) {
                    continue;
                }
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(dir.join(format!("{stem}.layout")));
                let _ = std::fs::remove_file(dir.join(format!("{stem}.mem")));
                if let Some(d) = &disk {
                    let _ = std::fs::remove_file(d.join(format!("{stem}.mem")));
                }
            }
        } else if let Some(pid) = name
            .strip_suffix(".ring")
            .and_then(|n| n.rsplit(".p").next())
            .and_then(|p| p.parse().ok())
        {
            if !pid_alive(pid) {
                let _ = std::fs::remove_file(&path);
            }
        } else if name.ends_with(".tmp") {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|d| d.as_secs() > 60);
            if old {
                let _ = std::fs::remove_file(&path);
            }
        }
    }
}

/// Remove a directory class's per-cache directories whose cache no longer exists: the state
/// segment named in the directory's owner file (or, without one, the one of the same name in
/// `state_dir`) is gone.
fn remove_dead_class_dirs(base: &Path, state_dir: &Path, except: &str) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == except || !name.starts_with("clairvoyant-") || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let state = directory::owner_of(&entry.path()).unwrap_or_else(|| state_dir.join(format!("{name}.state")));
        if !state.exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests;
