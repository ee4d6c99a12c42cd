//! The per-process table of open dataset files, indexed by fd.
//!
//! Each slot is one word: a pointer from `Arc::into_raw` (or 0), whose low bit is a lock held
//! only for the instant of cloning or replacing the pointer (never across I/O). Because every
//! operation under the lock is a single word store, a child created by `fork` while some other
//! thread held a slot's lock can clear all lock bits ([`Table::after_fork`]) and find every
//! pointer intact.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

/// The pid of the process the table describes (set at load and in a forked child; 0: unknown).
pub static OWNER_PID: AtomicI32 = AtomicI32::new(0);

/// False in a child that shares the parent's memory without having gone through the fork
/// handlers (`vfork`, `clone(CLONE_VM)`): its fds are its own but the table is the parent's, so
/// it must not change the table (and must not make stand-ins, which only the table marks).
pub fn owner() -> bool {
    let p = OWNER_PID.load(Ordering::Relaxed);
    // SAFETY: getpid has no preconditions.
    p == 0 || p == unsafe { libc::getpid() }
}

/// fds at or above this pass through untracked.
pub const MAX_FD: usize = 65536;

pub struct Table<T> {
    slots: [AtomicUsize; MAX_FD],
    _t: std::marker::PhantomData<T>,
}

// SAFETY: slots hold `Arc<T>` pointers, shared across threads only as `Arc<T>` clones.
unsafe impl<T: Send + Sync> Sync for Table<T> {}

impl<T> Table<T> {
    /// An empty table (const: a static table lives in .bss and needs no initialisation).
    pub const fn new() -> Self {
        Table {
            slots: [const { AtomicUsize::new(0) }; MAX_FD],
            _t: std::marker::PhantomData,
        }
    }

    fn slot(&self, fd: i32) -> Option<&AtomicUsize> {
        usize::try_from(fd).ok().and_then(|i| self.slots.get(i))
    }

    fn lock(s: &AtomicUsize) -> usize {
        loop {
            let v = s.load(Ordering::Relaxed);
            if v & 1 == 0
                && s.compare_exchange_weak(v, v | 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return v;
            }
            // Held for one pointer copy by another thread: yield rather than burn the core.
            std::thread::yield_now();
        }
    }

    /// True when `fd` may be tracked (cheap: one load).
    pub fn has(&self, fd: i32) -> bool {
        self.slot(fd).is_some_and(|s| s.load(Ordering::Relaxed) != 0)
    }

    pub fn get(&self, fd: i32) -> Option<Arc<T>> {
        let s = self.slot(fd)?;
        if s.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let v = Self::lock(s);
        let out = if v == 0 {
            None
        } else {
            // SAFETY: v came from Arc::into_raw and the slot owns one count, which cannot be
            // released while we hold the lock; we add one for the returned Arc.
            unsafe {
                Arc::increment_strong_count(v as *const T);
                Some(Arc::from_raw(v as *const T))
            }
        };
        s.store(v, Ordering::Release);
        out
    }

    /// Put `v` in the slot (None clears it); returns the previous value.
    pub fn set(&self, fd: i32, v: Option<Arc<T>>) -> Option<Arc<T>> {
        let s = self.slot(fd)?;
        if v.is_none() && s.load(Ordering::Relaxed) == 0 {
            return None;
        }
        if !owner() {
            return None;
        }
        let new = v.map_or(0, |a| Arc::into_raw(a) as usize);
        let old = Self::lock(s);
        s.store(new, Ordering::Release);
        // SAFETY: old came from Arc::into_raw; the slot's count is ours now.
        (old != 0).then(|| unsafe { Arc::from_raw(old as *const T) })
    }

    /// Clear `fd` only if it still holds `expect`.
    pub fn remove_if(&self, fd: i32, expect: &Arc<T>) {
        let Some(s) = self.slot(fd) else { return };
        if !owner() {
            return;
        }
        let old = Self::lock(s);
        if old == Arc::as_ptr(expect) as usize {
            s.store(0, Ordering::Release);
            // SAFETY: as in `set`.
            drop(unsafe { Arc::from_raw(old as *const T) });
        } else {
            s.store(old, Ordering::Release);
        }
    }

    /// In a child after fork: release the locks of threads that do not exist here.
    pub fn after_fork(&self) {
        for s in self.slots.iter() {
            s.fetch_and(!1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_replace_remove() {
        let t: Box<Table<u32>> = Box::new(Table::new());
        assert!(t.get(3).is_none());
        assert!(t.set(3, Some(Arc::new(7))).is_none());
        assert_eq!(*t.get(3).unwrap(), 7);
        let a = t.get(3).unwrap();
        assert_eq!(Arc::strong_count(&a), 2);
        assert_eq!(*t.set(3, Some(Arc::new(8))).unwrap(), 7);
        t.remove_if(3, &a);
        assert_eq!(*t.get(3).unwrap(), 8, "a different value is not removed");
        let b = t.get(3).unwrap();
        t.remove_if(3, &b);
        assert!(t.get(3).is_none());
        assert_eq!(Arc::strong_count(&b), 1);
        assert!(t.set(-1, Some(Arc::new(1))).is_none() && t.get(-1).is_none());
        assert!(t.set(MAX_FD as i32, Some(Arc::new(1))).is_none() && t.get(MAX_FD as i32).is_none());
    }

    #[test]
    fn threads_hammering_one_slot_keep_counts_right() {
        let t: Arc<Table<u64>> = Arc::new(Table::new());
        let keep = Arc::new(5u64);
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let (t, keep) = (t.clone(), keep.clone());
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if i % 2 == 0 {
                            t.set(9, Some(keep.clone()));
                        } else if let Some(v) = t.get(9) {
                            assert_eq!(*v, 5);
                        }
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        t.set(9, None);
        assert_eq!(Arc::strong_count(&keep), 1);
    }
}
