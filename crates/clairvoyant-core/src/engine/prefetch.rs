//! Class prefetchers (each rank fills its share of every storage class in order of first
//! need) and the fetch of one staged sample from the fastest tier that has it.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::staging::Slot;
use super::{ClassStore, Inner, Src};
use crate::error::Result;
use crate::tier::Acquire;

impl Inner {
    pub(super) fn read_source(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        self.source.read_into(sample, buf)?;
        self.pfs_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.pfs_files.fetch_add(1, Ordering::Relaxed);
        Ok(())
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

    /// Fetch `sample` for staging position `pos`. Returns the source, and a heap buffer when
    /// the sample had to be staged outside its planned place.
    pub(super) fn fetch(&self, pos: u64, sample: u32, slot_kind: u8) -> Result<(Src, Option<Box<[u8]>>)> {
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
}
