//! A fault-injecting wrapper tier for tests: flips a byte in every n-th read, truncates reads,
//! or fails writes as a full disk would. It composes around any tier.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::{Fault, Tier};

/// A tier that forwards to `inner` and injects the faults its public switches turn on.
pub struct Faulty<T: Tier> {
    inner: T,
    /// Flip one byte of every n-th read (0: never).
    pub flip_every: AtomicU64,
    /// Report reads as short.
    pub short_reads: AtomicBool,
    /// Fail writes with [`Fault::NoSpace`].
    pub full: AtomicBool,
    reads: AtomicU64,
}

impl<T: Tier> Faulty<T> {
    /// Wraps `inner` with every fault off.
    pub fn new(inner: T) -> Self {
        Faulty {
            inner,
            flip_every: AtomicU64::new(0),
            short_reads: AtomicBool::new(false),
            full: AtomicBool::new(false),
            reads: AtomicU64::new(0),
        }
    }
}

impl<T: Tier> Tier for Faulty<T> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn capacity(&self) -> u64 {
        self.inner.capacity()
    }

    fn write(&self, sample: u32, place: u64, bytes: &[u8]) -> Result<(), Fault> {
        if self.full.load(Ordering::Relaxed) {
            return Err(Fault::NoSpace);
        }
        self.inner.write(sample, place, bytes)
    }

    fn read(&self, sample: u32, place: u64, buf: &mut [u8]) -> Result<(), Fault> {
        if self.short_reads.load(Ordering::Relaxed) {
            return Err(Fault::Short {
                expected: buf.len() as u64,
                got: buf.len() as u64 / 2,
            });
        }
        self.inner.read(sample, place, buf)?;
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        let every = self.flip_every.load(Ordering::Relaxed);
        if every > 0 && n.is_multiple_of(every) && !buf.is_empty() {
            let i = (n as usize * 7919) % buf.len();
            buf[i] ^= 0x5a;
        }
        Ok(())
    }

    // No `mapped`: reads always go through `read`, where the faults are injected.

    fn remove(&self) {
        self.inner.remove()
    }
}
