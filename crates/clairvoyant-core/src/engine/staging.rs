//! The staging ring: byte slots allocated in access order, filled by the staging prefetcher,
//! handed to the consumer as leases and freed in order when released.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use super::prefetch::Fetched;
use super::stats::Served;
use super::{ClassStore, Inner, Lease, Region, Src};
use crate::error::{Error, Result};

pub(super) enum Slot {
    Empty,
    Ring {
        start: u64,
        len: u64,
    },
    /// In the node's mapped memory class (checked when handed to the consumer).
    Arena {
        offset: u64,
        len: u64,
    },
    Heap(Box<[u8]>),
}

impl Slot {
    /// The slot's kind as the fetch takes it: empty 0, ring 1, arena 2, heap 3.
    fn kind(&self) -> u8 {
        match self {
            Slot::Empty => 0,
            Slot::Ring { .. } => 1,
            Slot::Arena { .. } => 2,
            Slot::Heap(_) => 3,
        }
    }
}

/// A position allocated under the staging lock that the producer fetches outside it.
struct Claim {
    pos: u64,
    sample: u32,
    kind: u8,
    /// The position's epoch plus one (the round its cached copy is checked in).
    round: u32,
}

/// How one hold of the staging lock by a producer ended.
enum Alloc {
    /// The engine is shutting down.
    Shutdown,
    /// A run of ready memory-class samples was allocated; let the consumer have the lock.
    RunDone,
    /// A position that needs a fetch.
    Fetch(Claim),
}

/// A sample the consumer took out of the staging state, on its way to becoming a lease.
struct Taken {
    pos: u64,
    sample: u32,
    label: i64,
    /// Staged in the ring before its file was truncated.
    lost: bool,
    status: Status,
    ptr: *const u8,
    len: usize,
    region: Region,
    offset: u64,
    /// Staged outside the ring.
    overflow: bool,
    corrupt: bool,
    epoch: u32,
    /// The sample closes its epoch.
    closes: bool,
    /// The ring's loss count when the entry was taken.
    losses: u64,
}

pub(super) enum Status {
    Pending,
    Ready(Src),
    Failed(Error),
    Taken,
}

pub(super) struct Entry {
    pub(super) sample: u32,
    /// Looked up by the producer, off the consumer's path.
    pub(super) label: i64,
    pub(super) slot: Slot,
    pub(super) status: Status,
    pub(super) released: bool,
    /// The cached copy was wrong and the sample was read again from the dataset.
    pub(super) corrupt: bool,
    /// Staged in the ring before its file was truncated: the bytes are gone.
    pub(super) lost: bool,
}

/// What one hand-out call (one sample, or a batch) has checked so far: a truncation that
/// happened before the call began is always seen; the segments' sizes are read once per call,
/// not once per sample (every sample's checksum is still checked).
#[derive(Default)]
pub(super) struct Group {
    /// The memory arena file's size (there is at most one memory class).
    pub(super) arena_size: Option<u64>,
    /// Whether the staging ring's file had its size.
    pub(super) ring_intact: Option<bool>,
}

pub(super) struct StagingState {
    /// Entries of the positions `base()..next_alloc`.
    pub(super) entries: VecDeque<Entry>,
    pub(super) next_alloc: u64,
    pub(super) next_consume: u64,
    pub(super) ring_head: u64,
    /// The end of the newest ring slot the consumer took (or skipped): the ring's bytes staged
    /// ahead of the consumer are those from there to `ring_head`, less the skipped ends of the
    /// ring in between ([`StagingState::ring_ahead`]).
    pub(super) ring_taken: u64,
    /// Ring bytes skipped at the ring's end (start, length) that the consumer has not passed.
    pub(super) ring_gaps: VecDeque<(u64, u64)>,
    /// A producer waits for the consumer to take ring bytes (the lead is full, see
    /// [`Inner::slot_for`]).
    pub(super) lead_full: bool,
    /// Where the ring's live bytes begin as far as `entries` go (see [`StagingState::tail`]).
    pub(super) ring_tail: u64,
    /// The access stream from position `stream_base` on: the passes not yet consumed. Passes
    /// are appended at its end and dropped from its front once consumed or skipped.
    pub(super) stream: VecDeque<u32>,
    pub(super) stream_base: u64,
    /// Start position of each epoch, then the stream's end.
    pub(super) epoch_starts: Vec<u64>,
    /// Entries taken out of `entries` by a skip that still hold their space, in position order:
    /// samples the consumer still holds, and skipped samples whose fetch was in flight (their
    /// producer frees them when it is done).
    pub(super) detached: Vec<(u64, Entry)>,
    /// Ring start of the oldest detached entry in the ring.
    pub(super) detached_tail: Option<u64>,
}

impl StagingState {
    /// Nothing allocated yet over `stream`, whose epochs start at `epoch_starts`.
    pub(super) fn new(stream: VecDeque<u32>, epoch_starts: Vec<u64>) -> StagingState {
        StagingState {
            entries: VecDeque::new(),
            next_alloc: 0,
            next_consume: 0,
            ring_head: 0,
            ring_taken: 0,
            ring_gaps: VecDeque::new(),
            lead_full: false,
            ring_tail: 0,
            stream,
            stream_base: 0,
            epoch_starts,
            detached: Vec::new(),
            detached_tail: None,
        }
    }

    /// Position of `entries[0]`.
    pub(super) fn base(&self) -> u64 {
        self.next_alloc - self.entries.len() as u64
    }

    /// End of the stream (appending a pass moves it).
    pub(super) fn total(&self) -> u64 {
        self.stream_base + self.stream.len() as u64
    }

    /// The epoch holding `pos` (the last epoch for the stream's end).
    pub(super) fn epoch_of(&self, pos: u64) -> u32 {
        (self.epoch_starts.partition_point(|&s| s <= pos).max(1) - 1) as u32
    }

    /// Ring bytes staged ahead of the consumer (the skipped ends of the ring not counted).
    pub(super) fn ring_ahead(&self) -> u64 {
        let skipped: u64 = self.ring_gaps.iter().map(|g| g.1).sum();
        self.ring_head.saturating_sub(self.ring_taken).saturating_sub(skipped)
    }

    /// The consumer took (or skipped) the ring's bytes up to `end`.
    pub(super) fn ring_took(&mut self, end: u64) {
        self.ring_taken = self.ring_taken.max(end);
        while self.ring_gaps.front().is_some_and(|g| g.0 < self.ring_taken) {
            self.ring_gaps.pop_front();
        }
    }

    /// Where the ring's live bytes begin.
    pub(super) fn tail(&self) -> u64 {
        self.detached_tail.unwrap_or(self.ring_tail)
    }

    pub(super) fn entry(&self, pos: u64) -> Option<&Entry> {
        match pos.checked_sub(self.base()) {
            Some(i) => self.entries.get(i as usize),
            None => self.detached.iter().find(|(p, _)| *p == pos).map(|(_, e)| e),
        }
    }

    pub(super) fn entry_mut(&mut self, pos: u64) -> Option<&mut Entry> {
        match pos.checked_sub(self.base()) {
            Some(i) => self.entries.get_mut(i as usize),
            None => self.detached.iter_mut().find(|(p, _)| *p == pos).map(|(_, e)| e),
        }
    }

    /// Free the detached entries that are released and no longer being fetched; whether any
    /// space was freed.
    fn free_detached(&mut self) -> bool {
        let before = self.detached.len();
        self.detached
            .retain(|(_, e)| !e.released || matches!(e.status, Status::Pending));
        self.detached_tail = self.detached.iter().find_map(|(_, e)| match e.slot {
            Slot::Ring { start, .. } => Some(start),
            _ => None,
        });
        self.detached.len() != before
    }

    /// Forget the stream before `pos` (the start of a pass no producer is behind). The memory
    /// goes back once most of what is held was dropped.
    pub(super) fn drop_stream_before(&mut self, pos: u64) {
        let n = (pos.saturating_sub(self.stream_base) as usize).min(self.stream.len());
        if n == 0 {
            return;
        }
        self.stream.drain(..n);
        self.stream_base += n as u64;
        if self.stream.capacity() > 2 * self.stream.len() + 4096 {
            self.stream.shrink_to_fit();
        }
    }
}

/// The staging ring's bytes: a shared file mapping, so that worker processes (decoding for
/// this rank) can read staged samples in place. Its blocks are reserved a step at a time just
/// before staging first writes them ([`RingBuf::reserve`]), so a ring costs nothing at the
/// job's start and no memory it never uses; a tmpfs that is full then shows up as a sample
/// staged in process memory, not as SIGBUS on first write.
/// The file is created in the node cache's private directory and unlinked as soon as it is
/// mapped: workers open it through this process's descriptor (`/proc/<pid>/fd/<fd>`), so the
/// memory goes with this process however it ends (closed, killed, `os._exit`), with nothing
/// left in the directory. The descriptor is closed when the job closes; the mapping is dropped
/// once no lease is alive.
pub(super) struct RingBuf {
    pub(super) ptr: *mut u8,
    file: std::sync::Mutex<Option<std::fs::File>>,
    len: u64,
    /// Where other processes open the ring: this process's descriptor of it.
    pub(super) path: std::path::PathBuf,
    map: std::sync::Mutex<Option<memmap2::MmapRaw>>,
    owner_pid: u32,
    /// Bytes from the ring's start whose blocks are reserved.
    reserved: std::sync::atomic::AtomicU64,
}

/// How much of the ring [`RingBuf::reserve`] reserves at a time.
const RING_RESERVE_STEP: u64 = 4 << 20;

impl RingBuf {
    /// Map the ring created at `path` (`reserved` bytes from its start reserved) and unlink it
    /// there (see [`RingBuf`]).
    pub(super) fn new(file: std::fs::File, path: std::path::PathBuf, reserved: u64) -> Result<RingBuf> {
        use std::os::fd::AsRawFd;
        let map = match memmap2::MmapRaw::map_raw(&file) {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(Error::io(&path, e));
            }
        };
        let _ = std::fs::remove_file(&path);
        let owner_pid = super::pid::current();
        let len = map.len() as u64;
        Ok(RingBuf {
            ptr: map.as_mut_ptr(),
            path: std::path::PathBuf::from(format!("/proc/{owner_pid}/fd/{}", file.as_raw_fd())),
            file: std::sync::Mutex::new(Some(file)),
            len,
            map: std::sync::Mutex::new(Some(map)),
            owner_pid,
            reserved: std::sync::atomic::AtomicU64::new(reserved.min(len)),
        })
    }

    /// Reserve the ring's blocks up to byte `end` before staging writes there: a step at a time
    /// in the first lap, nothing after. False when they cannot be (the file system is full, or
    /// the ring is closed): the sample is staged elsewhere.
    pub(super) fn reserve(&self, end: u64) -> bool {
        if end <= self.reserved.load(Ordering::Acquire) {
            return true;
        }
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let have = self.reserved.load(Ordering::Acquire);
        if end <= have {
            return true;
        }
        let Some(f) = file.as_ref() else { return false };
        let to = end.max(have + RING_RESERVE_STEP).min(self.len);
        if crate::tier::secure::reserve_range(f, have, to - have).is_err() {
            return false;
        }
        self.reserved.store(to, Ordering::Release);
        true
    }

    /// Bytes from the ring's start whose blocks are reserved (and were written, or are about to
    /// be).
    pub(super) fn reserved(&self) -> u64 {
        self.reserved.load(Ordering::Acquire)
    }

    /// Whether the ring's file still has its size. If someone truncated it, its size is given
    /// back (so that touching its pages does not fault) and false returned: what was staged in
    /// it is lost.
    pub(super) fn intact(&self) -> bool {
        use std::os::fd::AsRawFd;
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let Some(file) = file.as_ref() else {
            return true; // closed: nothing can truncate it any more
        };
        // SAFETY: lseek on a valid descriptor only moves its offset, which nothing else uses
        // (the ring is accessed through its mapping).
        let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
        if end < 0 || end as u64 >= self.len {
            return true;
        }
        // The blocks past the cut are gone: reserved again when staging gets there.
        self.reserved.fetch_min(end as u64, Ordering::AcqRel);
        let _ = file.set_len(self.len);
        false
    }

    /// Close the descriptor other processes open the ring through (mappings stay valid).
    pub(super) fn unlink(&self) {
        if super::pid::current() == self.owner_pid {
            self.file.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
    }

    /// Drop the mapping: nothing may read or write the ring afterwards.
    pub(super) fn unmap(&self) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    pub(super) fn is_mapped(&self) -> bool {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
}

impl Drop for RingBuf {
    fn drop(&mut self) {
        self.unlink();
    }
}

impl Inner {
    /// Fill the staging ring strictly in access order. Memory-class samples already filled need
    /// no fetch (they are checked when handed out): they are marked ready while the lock
    /// is held, a run of them at a time, so serving them costs the producer no extra lock
    /// round trip per sample.
    pub(super) fn staging_prefetch(&self) {
        loop {
            // How many fetch at once is the read-concurrency controller's call (readahead.rs).
            let ahead = || {
                let st = self.lock();
                st.next_alloc.saturating_sub(st.next_consume)
            };
            let Some(mut permit) = self.readahead.acquire(ahead) else {
                return;
            };
            let claim = match self.allocate_run() {
                Alloc::Shutdown => return,
                Alloc::RunDone => continue,
                Alloc::Fetch(c) => c,
            };
            permit.start();
            let outcome = self.fetch(claim.pos, claim.sample, claim.kind, claim.round);
            permit.finish(self.source.size(claim.sample));
            self.finish_fetch(claim.pos, outcome);
        }
    }

    /// Allocate positions under the staging lock: a run of ready memory-class samples, ended
    /// by the first position that needs a fetch (or by the run's length, or shutdown).
    fn allocate_run(&self) -> Alloc {
        // Ready memory-class samples allocated per lock hold, before the consumer gets a turn.
        const RUN: usize = 256;
        let mut st = self.lock();
        let mut run = 0;
        // A sample made ready at the consumer's position: wake it before letting go.
        let mut wake = false;
        let next = loop {
            if self.shutdown.load(Ordering::Relaxed) {
                break Alloc::Shutdown;
            }
            if st.next_alloc >= st.total() {
                // The end of the stream so far: wait for a pass to be appended.
                st = self.wait_on(&self.grown, st, &mut wake);
                continue;
            }
            // The consumer waiting for the very next sample while it still holds every
            // staged one must not wait for space it will never give back.
            let consumer_starved = st.next_consume == st.next_alloc;
            if st.entries.len() >= self.max_entries && !consumer_starved {
                st = self.wait_on(&self.freed, st, &mut wake);
                continue;
            }
            if run >= RUN {
                break Alloc::RunDone;
            }
            let sample = st.stream[(st.next_alloc - st.stream_base) as usize];
            // The round (epoch + 1) of the position, for its fetch.
            let round = st.epoch_of(st.next_alloc) + 1;
            let Some((slot, status)) = self.slot_for(&mut st, sample, consumer_starved) else {
                st = self.wait_on(&self.freed, st, &mut wake);
                continue;
            };
            let (pos, kind, ready) = (st.next_alloc, slot.kind(), matches!(status, Status::Ready(_)));
            st.next_alloc += 1;
            st.entries.push_back(Entry {
                sample,
                label: self.source.label(sample),
                slot,
                status,
                released: false,
                corrupt: false,
                lost: false,
            });
            if !ready {
                break Alloc::Fetch(Claim {
                    pos,
                    sample,
                    kind,
                    round,
                });
            }
            run += 1;
            wake |= pos == st.next_consume;
        };
        if wake {
            self.produced.notify_all();
        }
        next
    }

    /// Wait on `cv`, first waking the consumer if a sample was made ready at its position.
    fn wait_on<'a>(
        &self,
        cv: &std::sync::Condvar,
        st: MutexGuard<'a, StagingState>,
        wake: &mut bool,
    ) -> MutexGuard<'a, StagingState> {
        if std::mem::take(wake) {
            self.produced.notify_all();
        }
        cv.wait(st).unwrap_or_else(|p| p.into_inner())
    }

    /// Where the next position's bytes go, and whether it is ready already (a filled
    /// memory-class sample); None: no ring space yet, wait for some.
    fn slot_for(&self, st: &mut StagingState, sample: u32, starved: bool) -> Option<(Slot, Status)> {
        let len = self.source.size(sample);
        let mut status = Status::Pending;
        let slot = match self.store_of(sample) {
            _ if len == 0 => Slot::Empty,
            Some((_, ClassStore::Mapped)) => {
                // A filled copy needs no fetch: it is checked against its dataset file (in the
                // consumer's epoch, normally by the checker ahead of the consumer) and its
                // checksum when handed out. A staging thread's own stat would only repeat
                // the checker's work, one sample and one wake-up at a time.
                if self.node.cache.state().state(sample) == crate::tier::READY {
                    status = Status::Ready(Src::Memory);
                }
                Slot::Arena {
                    offset: self.node.offset[sample as usize],
                    len,
                }
            }
            _ => {
                // Contiguous ring space; skip the ring's tail end if it is too short. Past the
                // reserved blocks, start again at the ring's beginning when what is live leaves
                // room there for a whole lead as well: blocks written before cost no page
                // faults, and the ring uses only as much memory as the consumer holds and staging
                // keeps ahead of it.
                let phys = st.ring_head % self.ring_cap;
                let wrapped = st.ring_head + (self.ring_cap - phys);
                let start = if phys + len > self.ring_cap
                    || (phys > 0
                        && phys + len > self.ring.reserved()
                        && wrapped + len + self.ring_lead - st.tail() <= self.ring_cap)
                {
                    wrapped
                } else {
                    st.ring_head
                };
                let fits = start + len - st.tail() <= self.ring_cap;
                // Staging ahead of the consumer holds at most the lead's bytes: from memory or
                // another node a sample comes in far less time than the lead takes to consume,
                // and filling the whole ring at once (as soon as the first epoch's file-system
                // reads end) would only take the cores from the training steps in a burst.
                if !starved && st.ring_ahead() + len > self.ring_lead.max(len) {
                    st.lead_full = true;
                    return None;
                }
                if fits && self.ring.reserve(start % self.ring_cap + len) {
                    if start > st.ring_head {
                        st.ring_gaps.push_back((st.ring_head, start - st.ring_head));
                    }
                    st.ring_head = start + len;
                    Slot::Ring { start, len }
                } else if fits || starved {
                    if fits {
                        crate::tier::warn_once(
                            "staging.ring.reserve",
                            "shared memory is full: samples that find no reserved room in the staging ring are staged in process memory",
                        );
                    }
                    // Stage it outside the ring rather than hang.
                    Slot::Heap(vec![0u8; len as usize].into_boxed_slice())
                } else {
                    return None;
                }
            }
        };
        Some((slot, status))
    }

    /// Record a fetch's outcome in its entry and wake whoever waits for it.
    fn finish_fetch(&self, pos: u64, outcome: Result<Fetched>) {
        let mut st = self.lock();
        let detached = pos < st.base();
        let entry = st.entry_mut(pos).expect("a pending entry is kept until fetched");
        match outcome {
            Ok(f) => {
                if let Some(h) = f.heap {
                    entry.slot = Slot::Heap(h);
                }
                entry.corrupt = f.corrupt;
                entry.status = Status::Ready(f.src);
            }
            Err(e) => entry.status = Status::Failed(e),
        }
        if detached {
            // Skipped while it was fetched: its space can go now.
            if st.free_detached() {
                self.freed.notify_all();
            }
        } else if pos == st.next_consume {
            self.produced.notify_all();
        }
    }

    /// The next sample, waiting up to `timeout` for it. `group` carries what the hand-out call
    /// this sample belongs to already checked (the segments' sizes, read once per call).
    pub(super) fn next(&self, timeout: Duration, group: &mut Group) -> Result<Option<Lease>> {
        let Some((st, pos, stalled)) = self.wait_ready(timeout)? else {
            return Ok(None);
        };
        let mut t = self.take(st, pos);
        let ready = matches!(t.status, Status::Ready(_));
        // A memory copy staged in place (possibly before the epoch began) whose dataset file
        // changed since it was filled: read the file as for a sample that is not cached.
        let stale = ready && t.region == Region::Arena && !self.current_at(t.pos, t.sample, t.epoch + 1);
        if ready {
            match self.check_taken(&t, stale, group) {
                Some(p) => t.ptr = p,
                None => self.read_again(&mut t, stale, stalled)?,
            }
        }
        self.hand_out(t, stalled)
    }

    /// Wait up to `timeout` for the consumer's position to be ready: the lock, the position
    /// and how long it waited; None: the timeout passed first.
    #[allow(clippy::type_complexity)]
    fn wait_ready(&self, timeout: Duration) -> Result<Option<(MutexGuard<'_, StagingState>, u64, Duration)>> {
        let mut t0: Option<Instant> = None;
        let mut st = self.lock();
        loop {
            // Re-read each time: another thread may have skipped ahead meanwhile.
            let pos = st.next_consume;
            if pos >= st.total() {
                return Err(Error::Exhausted {
                    epochs: st.epoch_starts.len() as u32 - 1,
                });
            }
            if self.shutdown.load(Ordering::Relaxed) {
                return Err(Error::Cancelled);
            }
            let ready =
                st.next_alloc > pos && !matches!(st.entries[(pos - st.base()) as usize].status, Status::Pending);
            if ready {
                return Ok(Some((st, pos, t0.map_or(Duration::ZERO, |t| t.elapsed()))));
            }
            if st.next_alloc <= pos {
                // Producers may be waiting for space that only this wait can unlock.
                self.freed.notify_all();
            }
            // The clock is read only when the sample is not ready at once.
            let start = *t0.get_or_insert_with(Instant::now);
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                self.add_stall(st.epoch_of(pos), start.elapsed());
                return Ok(None);
            }
            st = self
                .produced
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Take the ready entry at `pos` (the consumer's) out of the staging state: move the
    /// consumer on, close the pass if it ends there, and start reading the next sample's bytes.
    fn take(&self, mut st: MutexGuard<'_, StagingState>, pos: u64) -> Taken {
        let idx = (pos - st.base()) as usize;
        st.next_consume += 1;
        if let Slot::Ring { start, len } = st.entries[idx].slot {
            st.ring_took(start + len);
            if std::mem::take(&mut st.lead_full) {
                self.freed.notify_one();
            }
        }
        let epoch = st.epoch_of(pos);
        if self.round.load(Ordering::Relaxed) <= epoch {
            self.round.fetch_max(epoch + 1, Ordering::Relaxed);
            // The checker starts on the epoch now.
            self.round_moved.notify_all();
        }
        let closes = pos + 1 == st.epoch_starts[epoch as usize + 1];
        if closes {
            // The pass is consumed: no producer needs its samples any more.
            st.drop_stream_before(pos + 1);
        }
        let losses = self.ring_losses.load(Ordering::Relaxed);
        let entry = &mut st.entries[idx];
        let status = std::mem::replace(&mut entry.status, Status::Taken);
        let (ptr, len, region, offset) = self.slot_bytes(&entry.slot);
        let taken = Taken {
            pos,
            sample: entry.sample,
            label: entry.label,
            lost: entry.lost,
            status,
            ptr,
            len,
            region,
            offset,
            overflow: matches!(entry.slot, Slot::Heap(_)),
            corrupt: entry.corrupt,
            epoch,
            closes,
            losses,
        };
        // The next sample will be checked in a moment: have its bytes and record on the way.
        if let Some(Entry {
            sample: k,
            slot: Slot::Arena { offset, len },
            ..
        }) = st.entries.get(idx + 1)
        {
            if let Some((class, _)) = self.store_of(*k) {
                self.node.cache.prefetch(class, *k, *offset, *len);
            }
        }
        taken
    }

    /// Where a slot's bytes are: pointer (null for the arena, mapped by the caller), length,
    /// region and offset in it.
    fn slot_bytes(&self, slot: &Slot) -> (*const u8, usize, Region, u64) {
        match slot {
            Slot::Empty => (
                std::ptr::NonNull::<u8>::dangling().as_ptr() as *const u8,
                0,
                Region::Private,
                0,
            ),
            Slot::Ring { start, len } => (
                self.ring_ptr(*start) as *const u8,
                *len as usize,
                Region::Ring,
                start % self.ring_cap,
            ),
            Slot::Arena { offset, len } => (std::ptr::null(), *len as usize, Region::Arena, *offset),
            Slot::Heap(h) => (h.as_ptr(), h.len(), Region::Private, 0),
        }
    }

    /// The checked bytes of a ready sample; None: damaged after it was staged, lost, or stale.
    fn check_taken(&self, t: &Taken, stale: bool, group: &mut Group) -> Option<*const u8> {
        match t.region {
            _ if stale => None,
            Region::Arena => self.check_mapped(t.sample, t.offset, t.len as u64, &mut group.arena_size),
            Region::Ring if t.lost || !self.ring_intact_in_group(group) => None,
            // Lost to a truncation another thread saw after the entry was read above.
            Region::Ring if self.ring_losses.load(Ordering::Relaxed) != t.losses => None,
            _ => Some(t.ptr),
        }
    }

    /// Replace a damaged (or stale) sample's bytes with the dataset's, in private memory, and
    /// repair a memory-class copy; a read error is recorded and returned.
    fn read_again(&self, t: &mut Taken, stale: bool, stalled: Duration) -> Result<()> {
        t.corrupt |= !stale;
        let was_arena = t.region == Region::Arena;
        let stamp = self.stamp();
        let mut heap = vec![0u8; t.len].into_boxed_slice();
        let read = self.read_source(t.sample, &mut heap);
        if was_arena && read.is_ok() {
            // ... and back in the node cache, so later reads find it there again.
            self.repair_mapped(t.sample, &heap, stamp);
        }
        let mut st = self.lock();
        t.ptr = heap.as_ptr();
        (t.region, t.offset) = (Region::Private, 0);
        // Handed out and not yet released, so still held (in place or detached).
        if let Some(e) = st.entry_mut(t.pos) {
            e.slot = Slot::Heap(heap);
        }
        drop(st);
        if let Err(e) = read {
            t.corrupt = true; // counted so whatever made it be read again
            self.fail(t, stalled);
            return Err(e);
        }
        Ok(())
    }

    /// Give back a taken sample that cannot be handed out and count it as consumed (nothing
    /// delivered, read from the dataset, corrupt when its copy was).
    fn fail(&self, t: &Taken, stalled: Duration) {
        self.release(&[t.pos]);
        let served = Served {
            bytes: 0,
            src: Src::Pfs,
            overflow: false,
            corrupt: t.corrupt,
        };
        self.record(t.epoch, t.closes, stalled, served);
    }

    /// Record the taken sample in the statistics and hand it out as a lease (or its error).
    fn hand_out(&self, mut t: Taken, stalled: Duration) -> Result<Option<Lease>> {
        match std::mem::replace(&mut t.status, Status::Taken) {
            Status::Ready(source) => {
                self.record(
                    t.epoch,
                    t.closes,
                    stalled,
                    Served {
                        bytes: t.len as u64,
                        src: source,
                        overflow: t.overflow,
                        corrupt: t.corrupt,
                    },
                );
                Ok(Some(Lease {
                    pos: t.pos,
                    sample: t.sample,
                    label: t.label,
                    region: t.region,
                    offset: t.offset,
                    ptr: t.ptr,
                    len: t.len,
                    source,
                }))
            }
            Status::Failed(e) => {
                self.fail(&t, stalled);
                Err(e)
            }
            _ => unreachable!("entry consumed twice"),
        }
    }

    pub(super) fn release(&self, positions: &[u64]) {
        // A forked child may drop leases it inherited; the engine (and its lock, possibly held
        // by a thread that does not exist in the child) belongs to the parent.
        if super::pid::current() != self.owner_pid {
            return;
        }
        let mut st = self.lock();
        let mut freed = false;
        for &pos in positions {
            // Only what was handed out comes back.
            if pos >= st.next_consume {
                continue;
            }
            if pos < st.base() {
                if let Some(e) = st.entry_mut(pos) {
                    e.released = true;
                    freed = true;
                }
                continue;
            }
            let idx = (pos - st.base()) as usize;
            if let Some(e) = st.entries.get_mut(idx) {
                e.released = true;
            }
        }
        if freed {
            st.free_detached();
        }
        while st.entries.front().is_some_and(|e| e.released) {
            let e = st.entries.pop_front().unwrap();
            if let Slot::Ring { start, len } = e.slot {
                st.ring_tail = start + len;
            }
            freed = true;
        }
        if freed {
            self.freed.notify_all();
        }
        self.unmap_if_idle(&st);
    }

    /// Move the consumer to `target` (an epoch's start, ahead of it) without fetching what lies
    /// between: positions not allocated yet are never fetched, staged ones are freed unseen, and
    /// one whose fetch is in flight is freed by its producer when the fetch ends. Samples the
    /// consumer still holds stay valid until released.
    pub(super) fn skip_to(&self, st: &mut StagingState, target: u64) {
        let from = st.next_consume;
        debug_assert!(from < target && target <= st.total());
        // The epoch being left closes its PFS figures here (its last sample is never recorded).
        {
            let e = st.epoch_of(from) as usize;
            // Lock order as in `record`: stats, then the epoch's PFS base.
            let mut stats = self.stats.lock().unwrap_or_else(|p| p.into_inner());
            let mut base = self.pfs_at_epoch_start.lock().unwrap_or_else(|p| p.into_inner());
            let (b, f) = (
                self.pfs_bytes.load(Ordering::Relaxed),
                self.pfs_files.load(Ordering::Relaxed),
            );
            if let Some(s) = stats.get_mut(e) {
                s.pfs_bytes_read = b - base.0;
                s.pfs_files_read = f - base.1;
            }
            *base = (b, f);
        }
        let base = st.base();
        let n = target.min(st.next_alloc).saturating_sub(base) as usize;
        for i in 0..n {
            let pos = base + i as u64;
            let mut e = st.entries.pop_front().expect("entry of an allocated position");
            if let Slot::Ring { start, len } = e.slot {
                st.ring_tail = start + len;
                st.ring_took(start + len);
            }
            let keep = if pos < from {
                // Handed out: the consumer may still read it.
                !e.released
            } else {
                e.released = true;
                matches!(e.status, Status::Pending)
            };
            if keep {
                st.detached.push((pos, e));
            }
        }
        st.next_alloc = st.next_alloc.max(target);
        st.next_consume = target;
        st.free_detached();
        st.drop_stream_before(target);
        self.freed.notify_all();
    }

    /// Whether the ring still holds what was staged at `pos`: if the ring's file was truncated,
    /// every sample staged in it is marked lost (and refetched when the consumer gets to it).
    pub(super) fn ring_intact(&self, pos: u64) -> bool {
        if !self.ring.intact() {
            self.mark_ring_lost();
        }
        let st = self.lock();
        st.entry(pos).is_none_or(|e| !e.lost)
    }

    /// Whether the ring's file still has its size, read once per hand-out call (`group`); if it
    /// was truncated, every sample staged in it is marked lost.
    fn ring_intact_in_group(&self, group: &mut Group) -> bool {
        if group.ring_intact != Some(true) {
            let intact = self.ring.intact();
            if !intact {
                self.mark_ring_lost();
            }
            group.ring_intact = Some(intact);
        }
        group.ring_intact == Some(true)
    }

    fn mark_ring_lost(&self) {
        let mut st = self.lock();
        let StagingState { entries, detached, .. } = &mut *st;
        for e in entries.iter_mut().chain(detached.iter_mut().map(|(_, e)| e)) {
            if matches!(e.slot, Slot::Ring { .. }) {
                e.lost = true;
            }
        }
        self.ring_losses.fetch_add(1, Ordering::Relaxed);
    }

    /// After shutdown, once the prefetch threads have exited, drop the ring's mapping once
    /// every handed-out sample is released (samples never handed out are not coming back for).
    pub(super) fn unmap_if_idle(&self, st: &StagingState) {
        if !self.producers_gone.load(Ordering::Acquire) || !self.ring.is_mapped() {
            return;
        }
        let base = st.base();
        let outstanding = st
            .entries
            .iter()
            .enumerate()
            .any(|(i, e)| base + (i as u64) < st.next_consume && !e.released)
            || st.detached.iter().any(|(_, e)| !e.released);
        if !outstanding {
            self.ring.unmap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_kinds_are_the_codes_the_fetch_takes() {
        let kinds = [
            Slot::Empty,
            Slot::Ring { start: 0, len: 1 },
            Slot::Arena { offset: 0, len: 1 },
            Slot::Heap(vec![0u8; 1].into_boxed_slice()),
        ]
        .map(|s| s.kind());
        assert_eq!(kinds, [0, 1, 2, 3]);
    }
}
