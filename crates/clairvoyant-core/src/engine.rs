//! The engine of one job on one rank: it computes the rank's access stream and the node's
//! placement, attaches to the node cache, runs the class prefetchers and the staging
//! prefetcher, and hands samples to the consumer strictly in access order as zero-copy leases.
//!
//! Staging is a byte ring filled in access order by `p_0` threads. Samples placed in the node's
//! memory class take no ring space: the consumer reads them in place in shared memory. Every
//! queue is bounded, every wait is on a condition variable or futex (no polling), and an error
//! while fetching a sample is raised when the consumer reaches that sample.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::model::{ClassKind, SystemModel};
use crate::plan::{AccessCounts, Placement, UNCACHED};
use crate::readahead::Gate;
use crate::schedule::Schedule;
use crate::source::Source;
use crate::tier::{Acquire, NodeCache};

/// Where the consumer's copy of a sample came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Src {
    /// Already present in this rank's staging buffer.
    Staging = 0,
    /// The node's memory class (read in place, zero-copy).
    Memory = 1,
    /// A node-local directory class.
    Ssd = 2,
    /// The dataset's storage (the shared file system).
    Pfs = 3,
}

pub const SOURCE_NAMES: [&str; 4] = ["staging", "memory", "ssd", "pfs"];

/// The memory region a lease's bytes live in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Region {
    Ring = 0,
    Arena = 1,
    /// Private memory of this process (zero-length samples, overflow).
    Private = 2,
}

/// Per-epoch figures of one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpochStats {
    pub epoch: u32,
    pub samples: u64,
    pub bytes: u64,
    pub stall_seconds: f64,
    pub by_source: [(u64, u64); 4],
    /// Bytes this rank read from the dataset's storage while the epoch was consumed
    /// (staging and class prefetchers together).
    pub pfs_bytes_read: u64,
    pub pfs_files_read: u64,
    /// Bytes staged outside the ring because the consumer still held every staged sample.
    pub overflow_bytes: u64,
}

/// Identity of a job on a node: everything that decides its placement.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub schedule: Schedule,
    pub rank: u32,
    /// The ranks sharing this node's cache (including `rank`).
    pub local_ranks: Vec<u32>,
    /// Same string on every local rank of one run, different between concurrent runs.
    pub run_id: String,
    /// First epoch to serve (a resumed run); earlier epochs are neither fetched nor cached for.
    pub first_epoch: u32,
}

/// A consumed sample: valid until released.
#[derive(Debug)]
pub struct Lease {
    pub pos: u64,
    pub sample: u32,
    pub label: i64,
    /// Where the bytes are: the staging ring or the node's memory arena (both shared files that
    /// other processes can map, see [`Engine::segments`]) or private memory, at `offset`.
    pub region: Region,
    pub offset: u64,
    pub ptr: *const u8,
    pub len: usize,
    pub source: Src,
}

// SAFETY: a lease points into memory kept alive by the engine's shared state until released.
unsafe impl Send for Lease {}

enum Slot {
    Empty,
    Ring { start: u64, len: u64 },
    Arena { offset: u64, len: u64 },
    Heap(Box<[u8]>),
}

enum Status {
    Pending,
    Ready(Src),
    Failed(Error),
    Taken,
}

struct Entry {
    sample: u32,
    slot: Slot,
    status: Status,
    released: bool,
}

struct StagingState {
    entries: VecDeque<Entry>,
    next_alloc: u64,
    next_consume: u64,
    ring_head: u64,
    ring_tail: u64,
}

impl StagingState {
    /// Position of `entries[0]`.
    fn base(&self) -> u64 {
        self.next_alloc - self.entries.len() as u64
    }
}

#[derive(Clone, Copy)]
enum ClassStore {
    Memory,
    Directory(usize),
}

struct Inner {
    source: Arc<dyn Source>,
    stream: Vec<u32>,
    epoch_starts: Vec<u64>,
    batch_ends: Vec<Vec<u32>>,
    class_of: Vec<u8>,
    offset: Vec<u64>,
    stores: Vec<ClassStore>,
    cache: NodeCache,
    ring: RingBuf,
    ring_cap: u64,
    max_entries: usize,
    st: Mutex<StagingState>,
    produced: Condvar,
    freed: Condvar,
    shutdown: AtomicBool,
    fill_timeout: Duration,
    stats: Mutex<Vec<EpochStats>>,
    pfs_bytes: AtomicU64,
    pfs_files: AtomicU64,
    pfs_at_epoch_start: Mutex<(u64, u64)>,
    owner_pid: u32,
    /// How many staging fetches run at once.
    readahead: Gate,
}

// SAFETY: the ring is written only in byte ranges allocated to one producer under the staging
// lock and read by the consumer only after the entry is marked ready under the same lock.
unsafe impl Sync for Inner {}
unsafe impl Send for Inner {}

/// One job on one rank.
pub struct Engine {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    placement_summary: Vec<(String, u64, u64)>,
    first_epoch: u32,
}

/// The staging ring's bytes: a shared file mapping in `/dev/shm`, so that worker processes
/// (decoding for this rank) can read staged samples in place. Pages are allocated on first
/// write, so untouched capacity costs no resident memory. The file is removed on drop (and by
/// the node janitor if the process dies).
struct RingBuf {
    ptr: *mut u8,
    path: std::path::PathBuf,
    _map: memmap2::MmapRaw,
}

impl RingBuf {
    fn new(len: u64, path: std::path::PathBuf) -> Result<RingBuf> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        file.set_len(len.max(1)).map_err(|e| Error::io(&path, e))?;
        let map = memmap2::MmapRaw::map_raw(&file).map_err(|e| Error::io(&path, e))?;
        Ok(RingBuf {
            ptr: map.as_mut_ptr(),
            path,
            _map: map,
        })
    }
}

impl Drop for RingBuf {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The node cache's name: a hash of everything but capacities that decides the placement.
fn node_key(spec: &JobSpec, fingerprint: u64) -> u64 {
    let sched = &spec.schedule;
    let mut h = fnv1a(spec.run_id.as_bytes(), 0xcbf2_9ce4_8422_2325);
    h = fnv1a(&fingerprint.to_le_bytes(), h);
    h = fnv1a(&spec.first_epoch.to_le_bytes(), h);
    for v in [
        sched.world_size as u64,
        sched.batch_size as u64,
        sched.epochs as u64,
        sched.drop_last as u64,
    ] {
        h = fnv1a(&v.to_le_bytes(), h);
    }
    match &sched.order {
        crate::schedule::Order::Shuffle { seed, .. } => h = fnv1a(&seed.to_le_bytes(), h),
        crate::schedule::Order::Explicit { epochs, .. } => {
            for order in epochs {
                h = fnv1a(&(order.len() as u64).to_le_bytes(), h);
                for k in order {
                    h = fnv1a(&k.to_le_bytes(), h);
                }
            }
        }
    }
    for r in &spec.local_ranks {
        h = fnv1a(&r.to_le_bytes(), h);
    }
    h
}

fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Engine {
    pub fn start(source: Arc<dyn Source>, model: &SystemModel, spec: JobSpec) -> Result<Engine> {
        model.validate()?;
        let sched = &spec.schedule;
        if source.len() as u64 != sched.num_samples() as u64 {
            return Err(Error::config(
                "num_samples",
                format!(
                    "the schedule has {} samples but the source has {}",
                    sched.num_samples(),
                    source.len()
                ),
            ));
        }
        if !spec.local_ranks.contains(&spec.rank) {
            return Err(Error::config(
                "local_ranks",
                format!("must include this rank {}", spec.rank),
            ));
        }
        let (largest, largest_size) = source.largest().unwrap_or((0, 0));
        if largest_size > model.staging.capacity {
            return Err(Error::TooLarge {
                sample: largest as u64,
                path: source.path(largest).display().to_string(),
                size: largest_size,
                what: "the staging buffer (staging.capacity)".into(),
                capacity: model.staging.capacity,
            });
        }
        for c in &model.classes {
            if c.capacity > 0 && c.capacity < largest_size {
                return Err(Error::TooLarge {
                    sample: largest as u64,
                    path: source.path(largest).display().to_string(),
                    size: largest_size,
                    what: format!("storage class '{}' (class.{}.capacity)", c.name, c.name),
                    capacity: c.capacity,
                });
            }
        }

        // This rank's stream over the whole run.
        if spec.first_epoch >= sched.epochs {
            return Err(Error::config(
                "start_epoch",
                format!("{} is not below the job's {} epochs", spec.first_epoch, sched.epochs),
            ));
        }
        let streams = sched.streams_from(&[spec.rank], spec.first_epoch)?;
        let mut stream = Vec::new();
        let mut epoch_starts = vec![0u64; spec.first_epoch as usize + 1];
        let mut batch_ends = vec![Vec::new(); spec.first_epoch as usize];
        for epoch in streams {
            let e = epoch.into_iter().next().expect("one rank");
            stream.extend_from_slice(&e.samples);
            epoch_starts.push(stream.len() as u64);
            batch_ends.push(e.batch_ends);
        }

        // The node cache: every local rank derives the same key, agrees on the capacities the
        // first rank proposed, and so computes the very same placement.
        let f = source.len();
        let mut cache = NodeCache::attach(
            &format!("{:016x}", node_key(&spec, source.fingerprint())),
            f,
            spec.local_ranks.len() as u32,
        )?;
        let typical = if f == 0 { 0 } else { source.total_bytes() / f as u64 };
        let useful = model.useful_classes(typical.max(1), spec.local_ranks.len() as u32);
        let proposal: Vec<u64> = useful.iter().map(|&j| model.classes[j].capacity).collect();
        let capacities = cache.agree(&proposal)?;
        if capacities.len() != proposal.len() {
            return Err(Error::config(
                "class",
                format!(
                    "this rank would cache in {} classes but another local rank chose {}: give every local rank the same configuration",
                    proposal.len(),
                    capacities.len()
                ),
            ));
        }
        let access = AccessCounts::compute_from(sched, &spec.local_ranks, spec.first_epoch)?;
        let placement = Placement::compute(&access, |k| source.size(k), &capacities);

        let mut stores = Vec::new();
        let mut dirs = Vec::new();
        let mut arena_len = 0;
        let mut placement_summary = Vec::new();
        for (i, &j) in useful.iter().enumerate() {
            let class = &model.classes[j];
            placement_summary.push((class.name.clone(), placement.samples[i], placement.used[i]));
            match &class.kind {
                ClassKind::Memory => {
                    if arena_len > 0 {
                        return Err(Error::config("class", "at most one memory class is supported"));
                    }
                    arena_len = placement.used[i];
                    stores.push(ClassStore::Memory);
                }
                ClassKind::Directory { path } => {
                    stores.push(ClassStore::Directory(dirs.len()));
                    dirs.push(path.clone());
                }
            }
        }
        cache.map_classes(arena_len, &dirs)?;

        let ring_cap = model.staging.capacity;
        let ring = RingBuf::new(ring_cap, cache.ring_path(spec.rank))?;
        // Entries bound the look-ahead in samples (bytes are bounded by the ring). Samples served
        // from the memory class take no ring space, so this must cover every batch a consumer
        // keeps in flight (e.g. decode workers x prefetch depth x batch size) or the staging
        // prefetcher stalls behind them; an entry costs ~48 bytes.
        let max_entries = 1 << 16;
        let epochs = sched.epochs as usize;
        let inner = Arc::new(Inner {
            source,
            stream,
            epoch_starts,
            batch_ends,
            class_of: placement.class_of,
            offset: placement.offset,
            stores,
            cache,
            ring,
            ring_cap,
            max_entries,
            st: Mutex::new(StagingState {
                entries: VecDeque::new(),
                next_alloc: 0,
                next_consume: 0,
                ring_head: 0,
                ring_tail: 0,
            }),
            produced: Condvar::new(),
            freed: Condvar::new(),
            shutdown: AtomicBool::new(false),
            fill_timeout: Duration::from_secs(30),
            stats: Mutex::new(
                (0..epochs)
                    .map(|e| EpochStats {
                        epoch: e as u32,
                        ..Default::default()
                    })
                    .collect(),
            ),
            pfs_bytes: AtomicU64::new(0),
            pfs_files: AtomicU64::new(0),
            pfs_at_epoch_start: Mutex::new((0, 0)),
            owner_pid: std::process::id(),
            readahead: crate::readahead::staging_gate(
                model,
                typical,
                spec.local_ranks.len() as u32,
                spec.local_ranks.iter().position(|&r| r == spec.rank).unwrap_or(0) as u32,
            ),
        });

        let mut threads = Vec::new();
        let local_index = spec.local_ranks.iter().position(|&r| r == spec.rank).unwrap();
        let local_count = spec.local_ranks.len();
        for (i, &j) in useful.iter().enumerate() {
            let share: Arc<Vec<u32>> = Arc::new(
                placement.fill_order[i]
                    .iter()
                    .enumerate()
                    .filter(|(n, _)| n % local_count == local_index)
                    .map(|(_, &k)| k)
                    .collect(),
            );
            let next = Arc::new(AtomicUsize::new(0));
            for t in 0..model.classes[j].threads.max(1) {
                let (inner, share, next) = (inner.clone(), share.clone(), next.clone());
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("cv-class{i}-{t}"))
                        .spawn(move || inner.class_prefetch(i, &share, &next))
                        .expect("spawn class prefetcher"),
                );
            }
        }
        for t in 0..inner.readahead.max_threads() {
            let inner = inner.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("cv-staging-{t}"))
                    .spawn(move || inner.staging_prefetch())
                    .expect("spawn staging prefetcher"),
            );
        }
        Ok(Engine {
            inner,
            threads: Mutex::new(threads),
            placement_summary,
            first_epoch: spec.first_epoch,
        })
    }

    /// Samples of `epoch` for this rank, in order.
    pub fn epoch_samples(&self, epoch: u32) -> &[u32] {
        let (a, b) = (
            self.inner.epoch_starts[epoch as usize],
            self.inner.epoch_starts[epoch as usize + 1],
        );
        &self.inner.stream[a as usize..b as usize]
    }

    pub fn epochs(&self) -> u32 {
        self.inner.batch_ends.len() as u32
    }

    /// End position (within the epoch) of each batch of `epoch`.
    pub fn batch_ends(&self, epoch: u32) -> &[u32] {
        &self.inner.batch_ends[epoch as usize]
    }

    /// The shared files holding staged samples: (staging ring, memory arena if any). A worker
    /// process maps them read-only to read a lease's bytes at its [`Lease::offset`].
    pub fn segments(&self) -> (std::path::PathBuf, Option<std::path::PathBuf>) {
        (
            self.inner.ring.path.clone(),
            self.inner.cache.arena_path().map(|p| p.to_path_buf()),
        )
    }

    /// (class name, samples, bytes) placed per class on this node.
    pub fn placement_summary(&self) -> &[(String, u64, u64)] {
        &self.placement_summary
    }

    /// Position (in the whole run) of the next sample to consume.
    pub fn position(&self) -> u64 {
        self.inner.lock().next_consume
    }

    /// Start position of `epoch` in the whole run.
    pub fn epoch_start(&self, epoch: u32) -> u64 {
        self.inner.epoch_starts[epoch as usize]
    }

    /// Make `epoch` the current one: it must not be behind the consumer; the rest of an
    /// unfinished earlier epoch is skipped (its samples released unseen).
    pub fn begin_epoch(&self, epoch: u32) -> Result<()> {
        self.inner.check_pid()?;
        let epochs = self.epochs();
        if epoch >= epochs {
            return Err(Error::Exhausted(format!(
                "epoch {epoch} is past the job's last epoch ({})",
                epochs.saturating_sub(1)
            )));
        }
        if epoch < self.first_epoch {
            return Err(Error::Exhausted(format!(
                "epoch {epoch} is before the job's start epoch {}",
                self.first_epoch
            )));
        }
        let start = self.inner.epoch_starts[epoch as usize];
        let pos = self.position();
        if pos > start {
            let cur = self.inner.epoch_of(pos);
            return Err(Error::Exhausted(format!(
                "epoch {epoch} was already consumed (epochs are consumed in order; the next is {})",
                if self.inner.epoch_starts[cur as usize] == pos {
                    cur
                } else {
                    cur + 1
                }
            )));
        }
        while self.position() < start {
            match self.next(Duration::from_secs(1)) {
                Ok(Some(l)) => self.release(l.pos),
                Ok(None) => {}
                Err(e @ (Error::Cancelled | Error::Exhausted(_))) => return Err(e),
                // A sample that cannot be read is skipped along with the rest.
                Err(_) => {}
            }
        }
        Ok(())
    }

    /// The next sample in access order, waiting up to `timeout` for it (None on time-out, so a
    /// caller can check for interrupts and call again). Errors from fetching this sample are
    /// returned here; the consumer then moves on to the following sample.
    pub fn next(&self, timeout: Duration) -> Result<Option<Lease>> {
        self.inner.check_pid()?;
        self.inner.next(timeout)
    }

    /// Give a consumed sample's staging space back.
    pub fn release(&self, pos: u64) {
        self.inner.release(&[pos]);
    }

    pub fn release_many(&self, pos: &[u64]) {
        self.inner.release(pos);
    }

    pub fn label(&self, sample: u32) -> i64 {
        self.inner.source.label(sample)
    }

    pub fn stats(&self) -> Vec<EpochStats> {
        let mut s = self.inner.stats.lock().unwrap().clone();
        // The current epoch's PFS figures so far.
        let pos = self.position();
        if pos < *self.inner.epoch_starts.last().unwrap() {
            let e = self.inner.epoch_of(pos) as usize;
            let base = *self.inner.pfs_at_epoch_start.lock().unwrap();
            s[e].pfs_bytes_read = self.inner.pfs_bytes.load(Ordering::Relaxed) - base.0;
            s[e].pfs_files_read = self.inner.pfs_files.load(Ordering::Relaxed) - base.1;
        } else if let Some(last) = s.last_mut() {
            // Reads that ended after the last epoch closed (a class prefetcher filling samples
            // for another local rank) belong to the last epoch.
            let base = *self.inner.pfs_at_epoch_start.lock().unwrap();
            last.pfs_bytes_read += self.inner.pfs_bytes.load(Ordering::Relaxed) - base.0;
            last.pfs_files_read += self.inner.pfs_files.load(Ordering::Relaxed) - base.1;
        }
        s
    }

    /// Stop all threads; waiting consumers get `Error::Cancelled`. Idempotent.
    pub fn shutdown(&self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.readahead.close();
        {
            let _g = self.inner.lock();
            self.inner.produced.notify_all();
            self.inner.freed.notify_all();
        }
        let threads: Vec<_> = self.threads.lock().unwrap().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
        // Leave the node cache now rather than when the last lease is garbage collected, so a
        // job started next attaches to a fresh cache; mappings stay valid for live leases.
        self.inner.cache.detach();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, StagingState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_pid(&self) -> Result<()> {
        let me = std::process::id();
        if me != self.owner_pid {
            return Err(Error::config(
                "job",
                format!(
                    "created in process {} and used in forked process {me}; create the job in the process that uses it",
                    self.owner_pid
                ),
            ));
        }
        Ok(())
    }

    fn epoch_of(&self, pos: u64) -> u32 {
        (self.epoch_starts.partition_point(|&s| s <= pos) - 1) as u32
    }

    fn total(&self) -> u64 {
        self.stream.len() as u64
    }

    fn ring_ptr(&self, start: u64) -> *mut u8 {
        // SAFETY: the offset is reduced modulo the ring's length.
        unsafe { self.ring.ptr.add((start % self.ring_cap) as usize) }
    }

    fn store_of(&self, sample: u32) -> Option<(usize, ClassStore)> {
        let c = self.class_of[sample as usize];
        (c != UNCACHED).then(|| (c as usize, self.stores[c as usize]))
    }

    fn read_source(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        self.source.read_into(sample, buf)?;
        self.pfs_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.pfs_files.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Fill this rank's share of class `class`, in order of first need.
    fn class_prefetch(&self, class: usize, share: &[u32], next: &AtomicUsize) {
        let mut buf = Vec::new();
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&k) = share.get(i) else { return };
            if !self.cache.claim(k) {
                continue;
            }
            let len = self.source.size(k);
            let ok = match self.stores[class] {
                ClassStore::Memory => {
                    // SAFETY: the claim gives this thread exclusive write access to the
                    // sample's static arena range until it publishes.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(self.cache.arena_ptr(self.offset[k as usize], len), len as usize)
                    };
                    self.read_source(k, dst).is_ok()
                }
                ClassStore::Directory(d) => {
                    buf.resize(len as usize, 0);
                    self.read_source(k, &mut buf).is_ok() && self.cache.write_file(d, k, &buf).is_ok()
                }
            };
            // A failed fill is published as FAILED: readers then go to the source themselves
            // and report the error at the sample it belongs to.
            self.cache.publish(k, ok);
        }
    }

    /// Fill the staging ring strictly in access order.
    fn staging_prefetch(&self) {
        loop {
            let ahead = || {
                let st = self.lock();
                st.next_alloc.saturating_sub(st.next_consume)
            };
            let Some(mut permit) = self.readahead.acquire(ahead) else {
                return;
            };
            let (pos, sample, slot_kind) = {
                let mut st = self.lock();
                loop {
                    if self.shutdown.load(Ordering::Relaxed) || st.next_alloc >= self.total() {
                        return;
                    }
                    // The consumer waiting for the very next sample while it still holds every
                    // staged one must not wait for space it will never give back.
                    let consumer_starved = st.next_consume == st.next_alloc;
                    if st.entries.len() >= self.max_entries && !consumer_starved {
                        st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
                        continue;
                    }
                    let sample = self.stream[st.next_alloc as usize];
                    let len = self.source.size(sample);
                    let slot = match self.store_of(sample) {
                        _ if len == 0 => Slot::Empty,
                        Some((_, ClassStore::Memory)) => Slot::Arena {
                            offset: self.offset[sample as usize],
                            len,
                        },
                        _ => {
                            // Contiguous ring space; skip the ring's tail end if it is too short.
                            let phys = st.ring_head % self.ring_cap;
                            let start = if phys + len > self.ring_cap {
                                st.ring_head + (self.ring_cap - phys)
                            } else {
                                st.ring_head
                            };
                            if start + len - st.ring_tail <= self.ring_cap {
                                st.ring_head = start + len;
                                Slot::Ring { start, len }
                            } else if consumer_starved {
                                // Stage it outside the ring rather than hang.
                                Slot::Heap(vec![0u8; len as usize].into_boxed_slice())
                            } else {
                                st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
                                continue;
                            }
                        }
                    };
                    let pos = st.next_alloc;
                    st.next_alloc += 1;
                    let kind = match &slot {
                        Slot::Empty => 0,
                        Slot::Ring { .. } => 1,
                        Slot::Arena { .. } => 2,
                        Slot::Heap(_) => 3,
                    };
                    st.entries.push_back(Entry {
                        sample,
                        slot,
                        status: Status::Pending,
                        released: false,
                    });
                    break (pos, sample, kind);
                }
            };
            permit.start();
            let outcome = self.fetch(pos, sample, slot_kind);
            permit.finish(self.source.size(sample));
            let mut st = self.lock();
            let idx = (pos - st.base()) as usize;
            let entry = &mut st.entries[idx];
            match outcome {
                Ok((src, heap)) => {
                    if let Some(h) = heap {
                        entry.slot = Slot::Heap(h);
                    }
                    entry.status = Status::Ready(src);
                }
                Err(e) => entry.status = Status::Failed(e),
            }
            if pos == st.next_consume {
                self.produced.notify_all();
            }
        }
    }

    /// Fetch `sample` for staging position `pos`. Returns the source, and a heap buffer when
    /// the sample had to be staged outside its planned place.
    fn fetch(&self, pos: u64, sample: u32, slot_kind: u8) -> Result<(Src, Option<Box<[u8]>>)> {
        let len = self.source.size(sample);
        let dst: &mut [u8] = match slot_kind {
            0 => return Ok((Src::Staging, None)),
            2 => {
                let off = self.offset[sample as usize];
                match self.cache.acquire(sample, self.fill_timeout) {
                    Acquire::Ready => return Ok((Src::Memory, None)),
                    Acquire::Claimed => {
                        // SAFETY: claimed; exclusive until published.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(self.cache.arena_ptr(off, len), len as usize) };
                        let r = self.read_source(sample, dst);
                        self.cache.publish(sample, r.is_ok());
                        r?;
                        return Ok((Src::Pfs, None));
                    }
                    Acquire::Unavailable => {
                        // Failed or stuck elsewhere: read it ourselves into a private buffer.
                        let mut heap = vec![0u8; len as usize].into_boxed_slice();
                        self.read_source(sample, &mut heap)?;
                        return Ok((Src::Pfs, Some(heap)));
                    }
                }
            }
            _ => {
                let st = self.lock();
                let e = &st.entries[(pos - st.base()) as usize];
                let ptr = match &e.slot {
                    Slot::Ring { start, .. } => self.ring_ptr(*start),
                    Slot::Heap(h) => h.as_ptr() as *mut u8,
                    _ => unreachable!("slot kind mismatch"),
                };
                drop(st);
                // SAFETY: this producer alone owns the allocated range until it marks the entry
                // ready; ring ranges never wrap, heap buffers are not moved while pending.
                unsafe { std::slice::from_raw_parts_mut(ptr, len as usize) }
            }
        };
        if let Some((_, ClassStore::Directory(d))) = self.store_of(sample) {
            match self.cache.acquire(sample, self.fill_timeout) {
                Acquire::Ready if self.cache.read_file(d, sample, dst).is_ok() => return Ok((Src::Ssd, None)),
                Acquire::Claimed => {
                    let r = self.read_source(sample, dst);
                    let ok = r.is_ok() && self.cache.write_file(d, sample, dst).is_ok();
                    self.cache.publish(sample, ok);
                    r?;
                    return Ok((Src::Pfs, None));
                }
                _ => {}
            }
        }
        self.read_source(sample, dst)?;
        Ok((Src::Pfs, None))
    }

    fn next(&self, timeout: Duration) -> Result<Option<Lease>> {
        let t0 = Instant::now();
        let mut st = self.lock();
        let pos = st.next_consume;
        if pos >= self.total() {
            return Err(Error::Exhausted(format!(
                "all {} epochs of this job were consumed",
                self.batch_ends.len()
            )));
        }
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return Err(Error::Cancelled);
            }
            let ready =
                st.next_alloc > pos && !matches!(st.entries[(pos - st.base()) as usize].status, Status::Pending);
            if ready {
                break;
            }
            if st.next_alloc <= pos {
                // Producers may be waiting for space that only this wait can unlock.
                self.freed.notify_all();
            }
            let left = timeout.saturating_sub(t0.elapsed());
            if left.is_zero() {
                self.add_stall(pos, t0.elapsed());
                return Ok(None);
            }
            st = self
                .produced
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let stalled = t0.elapsed();
        let idx = (pos - st.base()) as usize;
        st.next_consume += 1;
        let entry = &mut st.entries[idx];
        let sample = entry.sample;
        let status = std::mem::replace(&mut entry.status, Status::Taken);
        let (ptr, len, region, offset) = match &entry.slot {
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
            Slot::Arena { offset, len } => (
                self.cache.arena_ptr(*offset, *len) as *const u8,
                *len as usize,
                Region::Arena,
                *offset,
            ),
            Slot::Heap(h) => (h.as_ptr(), h.len(), Region::Private, 0),
        };
        let overflow = matches!(entry.slot, Slot::Heap(_));
        drop(st);
        let epoch = self.epoch_of(pos);
        match status {
            Status::Ready(source) => {
                self.record(epoch, pos, stalled, len as u64, source, overflow);
                Ok(Some(Lease {
                    pos,
                    sample,
                    label: self.source.label(sample),
                    region,
                    offset,
                    ptr,
                    len,
                    source,
                }))
            }
            Status::Failed(e) => {
                self.release(&[pos]);
                self.record(epoch, pos, stalled, 0, Src::Pfs, false);
                Err(e)
            }
            _ => unreachable!("entry consumed twice"),
        }
    }

    fn add_stall(&self, pos: u64, d: Duration) {
        let e = self.epoch_of(pos) as usize;
        self.stats.lock().unwrap()[e].stall_seconds += d.as_secs_f64();
    }

    fn record(&self, epoch: u32, pos: u64, stalled: Duration, bytes: u64, src: Src, overflow: bool) {
        let mut stats = self.stats.lock().unwrap();
        let s = &mut stats[epoch as usize];
        s.stall_seconds += stalled.as_secs_f64();
        s.samples += 1;
        s.bytes += bytes;
        s.by_source[src as usize].0 += 1;
        s.by_source[src as usize].1 += bytes;
        if overflow {
            s.overflow_bytes += bytes;
        }
        let end = self.epoch_starts[epoch as usize + 1];
        if pos + 1 == end {
            // Close the epoch's PFS figures.
            let mut base = self.pfs_at_epoch_start.lock().unwrap();
            let (b, f) = (
                self.pfs_bytes.load(Ordering::Relaxed),
                self.pfs_files.load(Ordering::Relaxed),
            );
            s.pfs_bytes_read = b - base.0;
            s.pfs_files_read = f - base.1;
            *base = (b, f);
        }
    }

    fn release(&self, positions: &[u64]) {
        // A forked child may drop leases it inherited; the engine (and its lock, possibly held
        // by a thread that does not exist in the child) belongs to the parent.
        if std::process::id() != self.owner_pid {
            return;
        }
        let mut st = self.lock();
        for &pos in positions {
            if pos < st.base() {
                continue;
            }
            let idx = (pos - st.base()) as usize;
            if let Some(e) = st.entries.get_mut(idx) {
                e.released = true;
            }
        }
        let mut freed = false;
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
    }
}
