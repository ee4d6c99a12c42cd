//! Class prefetchers (each rank fills its share of every storage class in order of first
//! need) and the fetch of one staged sample from the fastest tier that has it. Every cached copy
//! is checked against the checksum recorded when it was read from the dataset, and once per
//! epoch against the dataset file's modification times; a wrong copy is read again from the
//! dataset and counted as corrupt, a stale one is read again from the dataset.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::staging::Slot;
use super::{ClassStore, Inner, Prefill, Src};
use crate::error::Result;
use crate::tier::{Acquire, Filled, Verified};

/// What [`Inner::fetch`] produced for one staged sample.
pub(super) struct Fetched {
    pub(super) src: Src,
    /// The bytes had to be staged outside their planned place.
    pub(super) heap: Option<Box<[u8]>>,
    /// A cached copy was wrong (and was replaced by the dataset's bytes).
    pub(super) corrupt: bool,
}

impl Fetched {
    fn from(src: Src) -> Self {
        Fetched {
            src,
            heap: None,
            corrupt: false,
        }
    }
}

impl Inner {
    pub(super) fn read_source(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        self.source.read_into(sample, buf)?;
        self.pfs_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.pfs_files.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The stamp recorded with a fill that starts now: when it started (see
    /// [`crate::tier::StateSegment::fill_stamp`]); 0 when the source has no files to check.
    pub(super) fn stamp(&self) -> u32 {
        if self.stamps {
            self.node.cache.state().fill_stamp()
        } else {
            0
        }
    }

    /// Whether this job checked the cached copy of `sample` against the dataset file in round
    /// `round` (the epoch of the staging position + 1) or later, or there is no file to check,
    /// without a system call: a memory copy staged in place needs no fetch then. The checker
    /// (`checker.rs`) makes these checks ahead of staging; where it is behind, a staging thread
    /// checks the sample itself (`fetch`), off the consumer's path.
    pub(super) fn stamp_checked_in(&self, sample: u32, round: u32) -> bool {
        !self.stamps || self.checked[sample as usize].load(Ordering::Relaxed) >= round
    }

    /// The copy of `sample` was just filled from, or checked against, the dataset file.
    pub(super) fn mark_checked(&self, sample: u32) {
        self.checked[sample as usize].fetch_max(self.round.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Whether the cached copy of `sample` is of the dataset file as it is now: the file was
    /// last modified, replaced or renamed (mtime, ctime) before the fill began. Checked with a
    /// stat once per sample per epoch the consumer is in (copies filled in that epoch need none),
    /// normally by the checker, ahead of staging.
    pub(super) fn current(&self, sample: u32) -> bool {
        self.current_in(sample, self.round.load(Ordering::Relaxed))
    }

    /// [`Inner::current`] for round `round` (the epoch + 1 of the position it is staged for): a
    /// check made in an earlier round is made again, so a file changed between epochs is read
    /// again (or reported as changed, as for a sample that is not cached), never served stale.
    /// A check counts for the round the consumer is in when it is made: a position staged ahead
    /// of an epoch boundary is checked once more when it is handed out (`staging::next`), so a
    /// change made between the epochs is still seen; one staged in its own epoch is not. The
    /// consumer's round is read before the stat: a check counts for the round it began in.
    pub(super) fn current_in(&self, sample: u32, round: u32) -> bool {
        self.current_by(sample, round, |path| {
            std::fs::metadata(path).ok().map(|m| crate::source::last_change_ns(&m))
        })
    }

    /// [`Inner::current_in`] with the file's last change (mtime or ctime, ns) read by
    /// `last_change` (None: it cannot be read, so the copy is not taken as current).
    pub(super) fn current_by(
        &self,
        sample: u32,
        round: u32,
        last_change: impl FnOnce(&std::path::Path) -> Option<i128>,
    ) -> bool {
        if !self.stamps || self.checked[sample as usize].load(Ordering::Relaxed) >= round {
            return true;
        }
        let (_, recorded) = self.node.cache.state().record(sample);
        if recorded == 0 {
            return true;
        }
        let now = self.round.load(Ordering::Relaxed);
        let started = self.node.cache.state().fill_started_ns(recorded) as i128;
        let ok = last_change(&self.source.path(sample)).is_some_and(|t| t < started);
        if ok {
            self.checked[sample as usize].fetch_max(round.min(now), Ordering::Relaxed);
        }
        ok
    }

    /// Read claimed `sample` from where it originates (the dataset, or the node that serves it)
    /// into class `class` and publish it (or give the claim back). `buf` is scratch space for
    /// classes that are not mapped.
    pub(super) fn fill_claimed(&self, class: usize, sample: u32, buf: &mut Vec<u8>) -> Result<Src> {
        let len = self.source.size(sample);
        let place = self.node.offset[sample as usize];
        let stamp = self.stamp();
        let in_place = self.node.cache.fill_slot(class, place, len);
        let bytes: &mut [u8] = match in_place {
            // SAFETY: the claim gives this thread exclusive write access to the sample's range of
            // the mapped class until it publishes; the tier checked the range.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p, len as usize) },
            None => {
                buf.resize(len as usize, 0);
                &mut buf[..]
            }
        };
        let src = match self.read_origin(sample, bytes) {
            Ok(src) => src,
            Err(e) => {
                self.node.cache.state().abandon(sample);
                return Err(e);
            }
        };
        if let Filled::Ready = self
            .node
            .cache
            .fill(class, sample, place, bytes, stamp, in_place.is_some())
        {
            self.mark_checked(sample);
        }
        Ok(src)
    }

    /// Fill this rank's share of class `class`, in order of first need.
    pub(super) fn class_prefetch(&self, class: usize, share: &[u32], next: &AtomicUsize) {
        let mut buf = Vec::new();
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&k) = share.get(i) else { return };
            if !self.node.cache.state().claim(k) {
                continue;
            }
            // A failed read gives the claim back: the staging prefetcher retries it and reports
            // the error at the sample it belongs to.
            let _ = self.fill_claimed(class, k, &mut buf);
        }
    }

    /// A node agent's prefill when the order is known: the samples of `share` in order of first
    /// need, as many reads at once as the read-concurrency controller allows (an agent stages
    /// nothing, so its gate is this prefill's), so the node cache fills ahead of the programs'
    /// opens at the file system's concurrency. A program's open of a sample being filled waits
    /// for that fill ([`Engine::local`](super::Engine::local)), never reads it a second time.
    pub(super) fn agent_prefill(&self, class: usize, share: &[u32], next: &AtomicUsize) {
        let mut buf = Vec::new();
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return;
            }
            let Some(mut permit) = self.readahead.acquire(|| 0) else {
                return;
            };
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(&k) = share.get(i) else { return };
            // Filled already (a program asked first) or being filled: the permit goes back unused.
            if !self.node.cache.state().claim(k) {
                continue;
            }
            permit.start();
            if let Some(f) = self.prefilled.get() {
                f(k, Prefill::Started);
            }
            // A failed read gives the claim back: the program's own open reads it then.
            let filled = self.fill_claimed(class, k, &mut buf).is_ok();
            if filled {
                permit.finish(self.source.size(k));
            }
            // Published now (the agent's shared directory), so that programs find it without
            // asking; those waiting for it there are woken. (Looked up again: a hook set during
            // the read is told of its end, not of its start.)
            if let Some(f) = self.prefilled.get() {
                f(k, if filled { Prefill::Filled } else { Prefill::Failed });
            }
        }
    }

    /// Fetch `sample` for staging position `pos`, of round `round` (its epoch + 1: a cached copy
    /// is checked against its dataset file once per round).
    pub(super) fn fetch(&self, pos: u64, sample: u32, slot_kind: u8, round: u32) -> Result<Fetched> {
        let len = self.source.size(sample);
        let dst: &mut [u8] = match slot_kind {
            0 => return Ok(Fetched::from(Src::Staging)),
            2 => return self.fetch_mapped(sample, len, round),
            _ => {
                // A truncated ring file would fault on write: give it its size back (what was
                // staged before is marked lost).
                self.ring_intact(pos);
                let st = self.lock();
                let e = st.entry(pos).expect("a pending entry is kept until fetched");
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
        let mut corrupt = false;
        if let Some((class, ClassStore::Copy)) = self.store_of(sample) {
            let state = self.node.cache.state();
            let place = self.node.offset[sample as usize];
            match self.acquire_claim(sample, len) {
                Acquire::Ready => {
                    let good = self.node.cache.read_verified(class, sample, place, dst) == Verified::Good;
                    if good && self.current_in(sample, round) {
                        return Ok(Fetched::from(Src::Ssd));
                    }
                    corrupt = !good;
                    // Replace the copy with the dataset's bytes, unless someone else already is.
                    let stamp = self.stamp();
                    let src = self.read_origin(sample, dst)?;
                    if state.reclaim(sample) {
                        if let Filled::Ready = self.node.cache.fill(class, sample, place, dst, stamp, false) {
                            self.mark_checked(sample);
                        }
                    }
                    return Ok(Fetched {
                        corrupt,
                        ..Fetched::from(src)
                    });
                }
                Acquire::Claimed => {
                    let stamp = self.stamp();
                    let src = match self.read_origin(sample, dst) {
                        Ok(src) => src,
                        Err(e) => {
                            state.abandon(sample);
                            return Err(e);
                        }
                    };
                    if let Filled::Ready = self.node.cache.fill(class, sample, place, dst, stamp, false) {
                        self.mark_checked(sample);
                    }
                    return Ok(Fetched::from(src));
                }
                Acquire::NoSpace | Acquire::Busy => {}
            }
        }
        let src = self.read_origin(sample, dst)?;
        Ok(Fetched {
            corrupt,
            ..Fetched::from(src)
        })
    }

    /// A sample of the mapped memory class: served in place (checked by the consumer, see
    /// [`Inner::check_mapped`]); filled in place when this rank claims it; read into a private
    /// buffer when the dataset file changed, the class has no room for it, or another process's
    /// fill of it outlasted its deadline ([`Inner::acquire_claim`]).
    fn fetch_mapped(&self, sample: u32, len: u64, round: u32) -> Result<Fetched> {
        let (class, _) = self.store_of(sample).expect("mapped class");
        // Staged in place, it is checked for its own round when handed out: a position of an
        // epoch the consumer has not entered yet needs no check now (one would not count).
        let later = round > self.round.load(Ordering::Relaxed);
        match self.acquire_claim(sample, len) {
            Acquire::Ready if later || self.current_in(sample, round) => return Ok(Fetched::from(Src::Memory)),
            Acquire::Claimed => {
                let mut scratch = Vec::new();
                let src = self.fill_claimed(class, sample, &mut scratch)?;
                if self.node.cache.state().state(sample) == crate::tier::READY {
                    return Ok(Fetched::from(src));
                }
            }
            _ => {}
        }
        // Other processes may hold views of the shared copy: read into private memory.
        let mut heap = vec![0u8; len as usize].into_boxed_slice();
        let src = self.read_origin(sample, &mut heap)?;
        Ok(Fetched {
            heap: Some(heap),
            ..Fetched::from(src)
        })
    }

    /// Replace the damaged copy of `sample` in a mapped class (the memory arena) with `bytes`,
    /// just read from the dataset with fill stamp `stamp`, unless another process is at it.
    pub(super) fn repair_mapped(&self, sample: u32, bytes: &[u8], stamp: u32) {
        let Some((class, ClassStore::Mapped)) = self.store_of(sample) else {
            return;
        };
        if self.node.cache.state().reclaim(sample) {
            let place = self.node.offset[sample as usize];
            if let Filled::Ready = self.node.cache.fill(class, sample, place, bytes, stamp, false) {
                self.mark_checked(sample);
            }
        }
    }

    /// Check a memory-class sample just before it is handed to the consumer (as late as
    /// possible, so a copy damaged or truncated after staging is still caught): the arena file
    /// still holds it and its checksum matches. None: read it from the dataset instead.
    /// `arena_size`: the arena file's size as read earlier in the same hand-out call, if it was.
    pub(super) fn check_mapped(
        &self,
        sample: u32,
        offset: u64,
        len: u64,
        arena_size: &mut Option<u64>,
    ) -> Option<*const u8> {
        let (class, _) = self.store_of(sample)?;
        self.node
            .cache
            .view_verified_in_group(class, sample, offset, len, arena_size)
            .ok()
            .flatten()
    }
}
