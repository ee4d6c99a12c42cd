//! The node cache's state segment: a header (process table, rank table, agreed capacities) and
//! one 16-byte record per sample (state word naming the claimant, dataset-file stamp, xxh3-64
//! checksum of the sample's bytes). It is created under a temporary name, initialised and then
//! linked into place, so nobody attaches a half-initialised segment.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use clairvoyant_futex as futex;

use super::secure;
use crate::clock::{Clock, RealClock};
use crate::error::{Error, Result};

/// Sample states (low 8 bits of the state word; a FILLING word carries the claimant's process
/// slot + 1 in the bits above).
pub const EMPTY: u32 = 0;
/// A process holds the claim and is filling the sample.
pub const FILLING: u32 = 1;
/// Filled and published: the record's checksum and stamp are valid.
pub const READY: u32 = 2;
/// The sample does not fit its class (the disk filled up): it stays uncached, nobody retries.
pub const NOSPACE: u32 = 3;

const MAGIC: u32 = 0x4356_0003; // "CV", layout version 3
pub(crate) const HEADER_BYTES: usize = 4096;
const RECORD_BYTES: usize = 16;
/// Slots in the header's process table: processes attached to one node cache at a time.
pub const MAX_PROCESSES: usize = 64;
/// Slots in the header's rank table: local ranks sharing one node cache.
pub const MAX_LOCAL_RANKS: usize = 64;
/// Storage classes whose capacities the header can hold.
pub const MAX_CLASSES: usize = 8;

// Header byte offsets.
const H_MAGIC: usize = 0;
const H_SAMPLES: usize = 8;
const H_ATTACHED: usize = 16;
const H_DETACHED: usize = 20;
const H_AGREE: usize = 28;
const H_NCAP: usize = 32;
const H_ARENA_AT: usize = 36;
const H_CAPS: usize = 40; // MAX_CLASSES u64
const H_CREATED: usize = 104; // wall-clock ns when the segment was created
const H_PLAN: usize = 112; // the node plan's turn (see `plan_turn`)
const H_PROCS: usize = 128; // MAX_PROCESSES x (pid u32, status u32, start u64)
const H_RANKS: usize = H_PROCS + MAX_PROCESSES * 16; // MAX_LOCAL_RANKS x u64 holder token
const _: () = assert!(H_RANKS + MAX_LOCAL_RANKS * 8 <= HEADER_BYTES);

const SLOT_FREE: u32 = 0;
const SLOT_LIVE: u32 = 1;
const SLOT_DEAD: u32 = 2;
const SLOT_BUSY: u32 = 3;

/// A rank-table token whose attachment has detached.
const DONE: u64 = 1 << 31;

/// How long one futex wait lasts before the waiter checks whether the claimant still lives.
pub const WAIT_SLICE: Duration = Duration::from_millis(15);

/// Outcome of [`StateSegment::acquire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// Filled and published; its checksum and stamp are in the record.
    Ready,
    /// The caller holds the claim (possibly taken over from a dead claimant) and must
    /// [`StateSegment::publish`] or [`StateSegment::abandon`] it.
    Claimed,
    /// The sample does not fit its class; it stays uncached.
    NoSpace,
    /// Still being filled by a live process after the time-out.
    Busy,
}

/// Where the memory class's arena lives, as agreed by the local ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArenaAt {
    /// There is no arena: the memory class got no space.
    None = 0,
    /// A file in the shared-memory directory (tmpfs).
    Shm = 1,
    /// A file on disk, because shared memory was full.
    Disk = 2,
}

/// The shared state of one node cache.
pub struct StateSegment {
    path: PathBuf,
    file: File,
    map: MmapRaw,
    samples: usize,
    /// This process's slot in the process table.
    slot: u32,
}

// SAFETY: the mapping is only accessed through atomics.
unsafe impl Send for StateSegment {}
// SAFETY: shared references touch the mapping only through atomics.
unsafe impl Sync for StateSegment {}

fn seg_len(samples: usize) -> u64 {
    (HEADER_BYTES + samples * RECORD_BYTES) as u64
}

impl StateSegment {
    /// Open `<dir>/<stem>.state`, creating it if it does not exist, and register this process.
    pub fn open(dir: &Path, stem: &str, samples: usize) -> Result<StateSegment> {
        let path = dir.join(format!("{stem}.state"));
        for _ in 0..16 {
            let file = match secure::open_existing(&path, true) {
                Ok(f) => f,
                Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    match Self::create(dir, &path, samples)? {
                        Some(f) => f,
                        None => continue,
                    }
                }
                Err(e) => return Err(e),
            };
            let md = file.metadata().map_err(|e| Error::io(&path, e))?;
            if md.len() < seg_len(samples) {
                return Err(Error::BadIndex {
                    index: path.clone(),
                    reason: format!(
                        "is {} bytes, not a node cache of {samples} samples ({} bytes); remove it",
                        md.len(),
                        seg_len(samples)
                    ),
                });
            }
            let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(&path, e))?;
            let mut seg = StateSegment {
                path: path.clone(),
                file,
                map,
                samples,
                slot: 0,
            };
            if seg.u32(H_MAGIC).load(Ordering::Acquire) != MAGIC
                || seg.u64(H_SAMPLES).load(Ordering::Acquire) != samples as u64
            {
                return Err(Error::NotNodeCache { path });
            }
            seg.slot = seg.register_process()?;
            // A janitor or the last detacher may have unlinked it while we opened it.
            if seg.file.metadata().map(|m| m.nlink()).unwrap_or(0) == 0 {
                continue;
            }
            return Ok(seg);
        }
        Err(Error::io(
            &path,
            std::io::Error::other("the node cache kept disappearing while attaching"),
        ))
    }

    /// Create, initialise and link the segment; None if another process linked one first.
    fn create(dir: &Path, path: &Path, samples: usize) -> Result<Option<File>> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let tmp = dir.join(format!(
            "{}.{}.{}.tmp",
            path.file_name().unwrap().to_string_lossy(),
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let file = secure::create_reserved(&tmp, seg_len(samples)).map_err(|e| Error::io(&tmp, e))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(&tmp, e)
        })?;
        let mut seg = StateSegment {
            path: tmp.clone(),
            file,
            map,
            samples,
            slot: 0,
        };
        seg.u64(H_SAMPLES).store(samples as u64, Ordering::Relaxed);
        seg.u64(H_CREATED).store(wall_ns(), Ordering::Relaxed);
        // The creator is in the process table before anyone can see the segment: a creator that
        // dies right after linking leaves a segment the janitor can tell is dead.
        seg.slot = seg.register_process()?;
        seg.u32(H_MAGIC).store(MAGIC, Ordering::Release);
        let linked = std::fs::hard_link(&tmp, path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(Some(seg.file)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(Error::io(path, e)),
        }
    }

    /// Path of the segment's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of per-sample records (the dataset's sample count).
    pub fn samples(&self) -> usize {
        self.samples
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        assert!(off + 4 <= seg_len(self.samples) as usize && off.is_multiple_of(4));
        // SAFETY: in bounds of the mapping (checked), 4-aligned (page-aligned base), lives as
        // long as self; AtomicU32 has the size and alignment of u32.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        assert!(off + 8 <= seg_len(self.samples) as usize && off.is_multiple_of(8));
        // SAFETY: as in `u32`, 8-aligned.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    /// The state word of `sample`.
    pub fn word(&self, sample: u32) -> &AtomicU32 {
        self.u32(HEADER_BYTES + sample as usize * RECORD_BYTES)
    }

    fn stamp_word(&self, sample: u32) -> &AtomicU32 {
        self.u32(HEADER_BYTES + sample as usize * RECORD_BYTES + 4)
    }

    fn checksum_word(&self, sample: u32) -> &AtomicU64 {
        self.u64(HEADER_BYTES + sample as usize * RECORD_BYTES + 8)
    }

    fn proc_pid(&self, slot: usize) -> &AtomicU32 {
        self.u32(H_PROCS + slot * 16)
    }
    fn proc_status(&self, slot: usize) -> &AtomicU32 {
        self.u32(H_PROCS + slot * 16 + 4)
    }
    fn proc_start(&self, slot: usize) -> &AtomicU64 {
        self.u64(H_PROCS + slot * 16 + 8)
    }
    fn rank_token(&self, index: usize) -> &AtomicU64 {
        self.u64(H_RANKS + index * 8)
    }

    /// This process's slot: the one already holding (pid, start time), else a free one, else
    /// one of a dead process.
    fn register_process(&self) -> Result<u32> {
        let pid = std::process::id();
        let start = secure::start_time(pid).unwrap_or(0);
        for s in 0..MAX_PROCESSES {
            if self.proc_status(s).load(Ordering::Acquire) == SLOT_LIVE
                && self.proc_pid(s).load(Ordering::Relaxed) == pid
                && self.proc_start(s).load(Ordering::Relaxed) == start
            {
                return Ok(s as u32);
            }
        }
        for wanted in [SLOT_FREE, SLOT_DEAD] {
            for s in 0..MAX_PROCESSES {
                let st = self.proc_status(s);
                if st
                    .compare_exchange(wanted, SLOT_BUSY, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    if wanted == SLOT_DEAD {
                        // A dead process's claims must not look like ours: hand them back.
                        self.release_claims_of(s as u32);
                    }
                    self.proc_pid(s).store(pid, Ordering::Relaxed);
                    self.proc_start(s).store(start, Ordering::Relaxed);
                    st.store(SLOT_LIVE, Ordering::Release);
                    return Ok(s as u32);
                }
            }
        }
        Err(Error::config(
            "local_ranks",
            format!(
                "more than {MAX_PROCESSES} processes attached to the node cache {}",
                self.path.display()
            ),
        ))
    }

    fn release_claims_of(&self, slot: u32) {
        let filling = FILLING | ((slot + 1) << 8);
        for k in 0..self.samples as u32 {
            let w = self.word(k);
            if w.compare_exchange(filling, EMPTY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                futex::wake_all(w);
            }
        }
    }

    /// Whether the process in `slot` is gone; marks it dead once so other waiters need no
    /// system call.
    pub fn slot_dead(&self, slot: u32) -> bool {
        let s = slot as usize;
        if s >= MAX_PROCESSES {
            return true;
        }
        match self.proc_status(s).load(Ordering::Acquire) {
            SLOT_DEAD | SLOT_FREE => true,
            SLOT_LIVE => {
                let pid = self.proc_pid(s).load(Ordering::Relaxed);
                let start = self.proc_start(s).load(Ordering::Relaxed);
                if secure::alive(pid, start) {
                    return false;
                }
                let _ = self
                    .proc_status(s)
                    .compare_exchange(SLOT_LIVE, SLOT_DEAD, Ordering::AcqRel, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }

    /// Processes recorded as live whose process still runs.
    pub fn live_processes(&self) -> usize {
        (0..MAX_PROCESSES as u32)
            .filter(|&s| self.proc_status(s as usize).load(Ordering::Acquire) == SLOT_LIVE && !self.slot_dead(s))
            .count()
    }

    /// Register this attachment as local rank number `index` (position in the local ranks).
    /// Returns false when a live attachment of another run already holds that rank: the caller
    /// then tries the next generation of the cache.
    pub fn register_rank(&self, index: usize, nonce: u32) -> Result<bool> {
        if index >= MAX_LOCAL_RANKS {
            return Err(Error::config(
                "local_ranks",
                format!("at most {MAX_LOCAL_RANKS} local ranks share one node cache"),
            ));
        }
        let mine = ((self.slot as u64 + 1) << 32) | (nonce as u64 & (DONE - 1));
        let tok = self.rank_token(index);
        loop {
            let cur = tok.load(Ordering::Acquire);
            let holder_gone = cur == 0 || (cur & DONE == 0 && self.slot_dead((cur >> 32) as u32 - 1));
            if !holder_gone {
                return Ok(false);
            }
            if tok
                .compare_exchange(cur, mine, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.u32(H_ATTACHED).fetch_add(1, Ordering::AcqRel);
                return Ok(true);
            }
        }
    }

    /// Leave: marks the rank done; returns true when this was the last of `users` attachments
    /// (the caller then removes the cache's files).
    /// `ranks` is how many local ranks this attachment served (jobs of several ranks in one
    /// process share one attachment).
    pub fn unregister_rank(&self, index: usize, nonce: u32, users: u32, ranks: u32) -> bool {
        let mine = ((self.slot as u64 + 1) << 32) | (nonce as u64 & (DONE - 1));
        let _ = self
            .rank_token(index)
            .compare_exchange(mine, mine | DONE, Ordering::AcqRel, Ordering::Relaxed);
        let done = self.u32(H_DETACHED).fetch_add(ranks.max(1), Ordering::AcqRel) + ranks.max(1);
        self.u32(H_ATTACHED).fetch_sub(1, Ordering::AcqRel) == 1 && done >= users
    }

    /// Agree on class capacities: the first caller runs `decide` (which may create the memory
    /// arena) and publishes what it returns; everyone gets the published values.
    pub fn agree(&self, decide: impl FnOnce() -> Result<(Vec<u64>, ArenaAt)>) -> Result<(Vec<u64>, ArenaAt)> {
        let mut failed = None;
        // Before any engine exists (its clock included): real time.
        let turn = self.turn(
            H_AGREE,
            Duration::from_secs(120),
            &RealClock,
            "another local rank to finish setting up this node cache",
            || {
                let (caps, at) = match decide() {
                    Ok(v) if v.0.len() <= MAX_CLASSES => v,
                    other => {
                        failed = Some(other.err().unwrap_or_else(|| {
                            Error::config("class", format!("at most {MAX_CLASSES} storage classes are supported"))
                        }));
                        return None;
                    }
                };
                self.u32(H_NCAP).store(caps.len() as u32, Ordering::Relaxed);
                self.u32(H_ARENA_AT).store(at as u32, Ordering::Relaxed);
                for (i, &c) in caps.iter().enumerate() {
                    self.u64(H_CAPS + 8 * i).store(c, Ordering::Relaxed);
                }
                Some(2)
            },
        )?;
        if turn.is_none() {
            return Err(failed
                .unwrap_or_else(|| Error::io(&self.path, std::io::Error::other("setting up the node cache twice"))));
        }
        let n = self.u32(H_NCAP).load(Ordering::Relaxed) as usize;
        let caps = (0..n.min(MAX_CLASSES))
            .map(|i| self.u64(H_CAPS + 8 * i).load(Ordering::Relaxed))
            .collect();
        let at = match self.u32(H_ARENA_AT).load(Ordering::Relaxed) {
            1 => ArenaAt::Shm,
            2 => ArenaAt::Disk,
            _ => ArenaAt::None,
        };
        Ok((caps, at))
    }

    /// The node plan's turn: the first local rank runs `decide` (computing the plan and writing
    /// it for the others) and publishes its outcome (a code from 2 to 255); the others wait for
    /// it, as long as the deciding process lives, up to `timeout`. Returns the outcome and
    /// whether this caller decided. A decider that dies hands the turn to the next rank.
    /// `timeout` is measured by `clock` (the engine's).
    pub fn plan_turn(&self, timeout: Duration, clock: &dyn Clock, decide: impl FnOnce() -> u8) -> Result<(u8, bool)> {
        let mut decided = false;
        let what = "another local rank to compute the node's plan";
        let code = self.turn(H_PLAN, timeout, clock, what, || {
            decided = true;
            Some(decide().max(2) as u32)
        })?;
        Ok((code.unwrap_or(2) as u8, decided))
    }

    /// One decision among the local ranks, in the header word at `off`: 0 (open), `1 | (slot +
    /// 1) << 8` (being decided by that process slot), or the published outcome (2..=255). The
    /// first caller runs `decide`: `Some(code)` publishes it, `None` gives the turn back (another
    /// rank may manage) and returns `Ok(None)`. The others wait for the outcome while the
    /// decider lives, up to `timeout` as `clock` measures it (in futex waits of at most one
    /// [`WAIT_SLICE`] of real time, each followed by a look at the clock).
    fn turn(
        &self,
        off: usize,
        timeout: Duration,
        clock: &dyn Clock,
        what: &str,
        decide: impl FnOnce() -> Option<u32>,
    ) -> Result<Option<u32>> {
        let flag = self.u32(off);
        let mine = 1 | ((self.slot + 1) << 8);
        let mut decide = Some(decide);
        let deadline = clock.now() + timeout;
        loop {
            let cur = flag.load(Ordering::Acquire);
            if cur & 0xff >= 2 {
                return Ok(Some(cur));
            }
            if cur == 0 {
                let Some(d) = decide.take() else {
                    return Ok(None);
                };
                if flag
                    .compare_exchange(0, mine, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    decide = Some(d);
                    continue;
                }
                let outcome = d();
                flag.store(outcome.map_or(0, |c| c.clamp(2, 255)), Ordering::Release);
                futex::wake_all(flag);
                return Ok(outcome.map(|c| c.clamp(2, 255)));
            }
            // Another rank is deciding; if it died doing so, take its turn.
            if self.slot_dead((cur >> 8).saturating_sub(1)) {
                let _ = flag.compare_exchange(cur, 0, Ordering::AcqRel, Ordering::Acquire);
                continue;
            }
            let now = clock.now();
            if now >= deadline {
                return Err(Error::TimedOut {
                    path: self.path.clone(),
                    what: what.into(),
                    seconds: timeout.as_secs(),
                });
            }
            futex::wait(flag, cur, (deadline - now).min(WAIT_SLICE));
        }
    }

    fn mine(&self) -> u32 {
        FILLING | ((self.slot + 1) << 8)
    }

    /// Try to claim `sample` for filling (EMPTY -> FILLING by this process).
    pub fn claim(&self, sample: u32) -> bool {
        self.word(sample)
            .compare_exchange(EMPTY, self.mine(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Claim a READY sample again to replace its bytes (a corrupt copy or a changed dataset
    /// file); false if someone else got there first.
    pub fn reclaim(&self, sample: u32) -> bool {
        self.word(sample)
            .compare_exchange(READY, self.mine(), Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Settle who provides `sample`: ready, claimed by the caller, uncacheable, or busy after
    /// `timeout`. A claimant that died is noticed within one [`WAIT_SLICE`] and its claim taken
    /// over.
    pub fn acquire(&self, sample: u32, timeout: Duration) -> Acquire {
        let w = self.word(sample);
        let deadline = Instant::now() + timeout;
        let mut waited = false;
        loop {
            let s = w.load(Ordering::Acquire);
            match s & 0xff {
                READY => return Acquire::Ready,
                NOSPACE => return Acquire::NoSpace,
                EMPTY => {
                    if self.claim(sample) {
                        return Acquire::Claimed;
                    }
                }
                _ => {
                    let owner = s >> 8;
                    // The claimant's status word is free to read; /proc only after a slice.
                    if (waited || owner == 0 || self.proc_status_is_dead(owner))
                        && (owner == 0 || self.slot_dead(owner - 1))
                    {
                        if w.compare_exchange(s, self.mine(), Ordering::AcqRel, Ordering::Acquire)
                            .is_ok()
                        {
                            return Acquire::Claimed;
                        }
                        continue;
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Acquire::Busy;
                    }
                    futex::wait(w, s, (deadline - now).min(WAIT_SLICE));
                    waited = true;
                }
            }
        }
    }

    /// The claimant of `sample` while it is FILLING: (its process slot, the state word naming
    /// it); None in any other state.
    pub fn claimant(&self, sample: u32) -> Option<(u32, u32)> {
        let s = self.word(sample).load(Ordering::Acquire);
        (s & 0xff == FILLING && s >> 8 != 0).then(|| ((s >> 8) - 1, s))
    }

    /// This process's slot in the process table (what [`StateSegment::claimant`] names for
    /// this process's own claims).
    pub fn own_slot(&self) -> u32 {
        self.slot
    }

    fn proc_status_is_dead(&self, owner: u32) -> bool {
        let s = (owner - 1) as usize;
        s >= MAX_PROCESSES || self.proc_status(s).load(Ordering::Acquire) != SLOT_LIVE
    }

    /// Publish a filled sample: its checksum and dataset stamp, then READY; wakes waiters.
    pub fn publish(&self, sample: u32, checksum: u64, stamp: u32) {
        self.checksum_word(sample).store(checksum, Ordering::Relaxed);
        self.stamp_word(sample).store(stamp, Ordering::Relaxed);
        let w = self.word(sample);
        w.store(READY, Ordering::Release);
        futex::wake_all(w);
    }

    /// Give a claim back after a failed fill: the next accessor retries.
    pub fn abandon(&self, sample: u32) {
        let w = self.word(sample);
        w.store(EMPTY, Ordering::Release);
        futex::wake_all(w);
    }

    /// The sample does not fit its class: it stays uncached.
    pub fn mark_no_space(&self, sample: u32) {
        let w = self.word(sample);
        w.store(NOSPACE, Ordering::Release);
        futex::wake_all(w);
    }

    /// A fill stamp for a fill starting now: milliseconds since the segment was created, + 1
    /// (0 means "no stamp").
    pub fn fill_stamp(&self) -> u32 {
        let created = self.u64(H_CREATED).load(Ordering::Relaxed);
        (wall_ns().saturating_sub(created) / 1_000_000).min(u32::MAX as u64 - 1) as u32 + 1
    }

    /// When a fill with `stamp` began, in wall-clock ns (rounded down to the millisecond).
    pub fn fill_started_ns(&self, stamp: u32) -> u64 {
        self.u64(H_CREATED).load(Ordering::Relaxed) + (stamp.saturating_sub(1) as u64) * 1_000_000
    }

    /// Hint that `sample`'s record is about to be read.
    pub fn prefetch_record(&self, sample: u32) {
        if (sample as usize) < self.samples {
            let off = HEADER_BYTES + sample as usize * RECORD_BYTES;
            super::prefetch_lines(self.map.as_mut_ptr().wrapping_add(off), RECORD_BYTES);
        }
    }

    /// (checksum, dataset stamp) recorded for a READY sample.
    pub fn record(&self, sample: u32) -> (u64, u32) {
        (
            self.checksum_word(sample).load(Ordering::Relaxed),
            self.stamp_word(sample).load(Ordering::Relaxed),
        )
    }

    /// The sample's state ([`EMPTY`], [`FILLING`], [`READY`] or [`NOSPACE`]), without the
    /// claimant bits.
    pub fn state(&self, sample: u32) -> u32 {
        self.word(sample).load(Ordering::Acquire) & 0xff
    }
}

/// Wall-clock time in ns since the Unix epoch (file times are wall-clock).
pub fn wall_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Read the process table of the segment at `path` (opened safely) and say whether every
/// recorded process is dead. Segments with no magic are left alone.
pub fn all_dead(path: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let Ok(f) = secure::open_existing(path, false) else {
        return false;
    };
    let mut head = vec![0u8; HEADER_BYTES];
    if f.read_exact_at(&mut head, 0).is_err() {
        return false;
    }
    let u32_at = |o: usize| u32::from_ne_bytes(head[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_ne_bytes(head[o..o + 8].try_into().unwrap());
    if u32_at(H_MAGIC) != MAGIC {
        return false;
    }
    let mut any = false;
    for s in 0..MAX_PROCESSES {
        let o = H_PROCS + s * 16;
        match u32_at(o + 4) {
            SLOT_LIVE | SLOT_BUSY => {
                any = true;
                if secure::alive(u32_at(o), u64_at(o + 8)) {
                    return false;
                }
            }
            SLOT_DEAD => any = true,
            _ => {}
        }
    }
    any
}
