//! The memory class: one shared file (normally on tmpfs) mapped by every local rank, laid out
//! statically by the placement (a sample's place is its byte offset). The file is created at its
//! full size without blocks; each sample's range is reserved (`fallocate`) just before it is
//! written, so that creating the class costs no time at the job's start, and a file system that
//! fills up meanwhile leaves the sample uncached (the class is full) instead of raising SIGBUS
//! when the page is touched. Its size is checked (`lseek`) before bytes are handed out, so a
//! truncated file is reported as a short read instead of a SIGBUS.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::MmapRaw;

use super::{secure, Fault, Tier};
use crate::error::{Error, Result};

/// The memory class: one shared, mapped file (the arena) holding each placed sample at its
/// byte offset.
pub struct MemoryTier {
    name: String,
    path: PathBuf,
    file: File,
    map: MmapRaw,
    len: u64,
}

// SAFETY: the mapping is written only in byte ranges claimed through the state segment and read
// after the claim is published (release/acquire on the state word).
unsafe impl Send for MemoryTier {}
// SAFETY: shared references write only ranges claimed through the state segment and read only published ones,
// as for Send above.
unsafe impl Sync for MemoryTier {}

impl MemoryTier {
    /// Create the arena at `path`, `len` bytes long (its blocks are reserved as samples are
    /// written): exclusively, under a temporary name, then linked into place (a stale file of
    /// ours left by a dead run is replaced).
    pub fn create(path: &Path, len: u64) -> std::io::Result<()> {
        let tmp = path.with_extension(format!("mem.{}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        let _f = secure::create_sized(&tmp, len)?;
        let r = match std::fs::hard_link(&tmp, path) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                // In our private directory only we can have put it there: a dead run's arena.
                std::fs::remove_file(path).and_then(|_| std::fs::hard_link(&tmp, path))
            }
            r => r,
        };
        let _ = std::fs::remove_file(&tmp);
        r
    }

    /// Map an existing arena of at least `len` bytes.
    pub fn open(name: &str, path: &Path, len: u64) -> Result<MemoryTier> {
        let file = secure::open_existing(path, true)?;
        let have = file.metadata().map_err(|e| Error::io(path, e))?.len();
        if have < len {
            return Err(Error::BadIndex {
                index: path.to_path_buf(),
                reason: format!("holds {have} bytes, the memory class needs {len}; remove it"),
            });
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| Error::io(path, e))?;
        Ok(MemoryTier {
            name: name.into(),
            path: path.to_path_buf(),
            file,
            map,
            len,
        })
    }

    /// Create and map a private arena (tests, wrappers): `path` must not exist.
    pub fn create_and_open(name: &str, path: &Path, len: u64) -> Result<MemoryTier> {
        Self::create(path, len).map_err(|e| Error::io(path, e))?;
        Self::open(name, path, len)
    }

    fn check(&self, place: u64, len: u64) -> Result<(), Fault> {
        self.check_in_group(place, len, &mut None)
    }

    /// Check the range `place..place + len` and reserve its blocks for a write.
    fn reserve(&self, place: u64, len: u64) -> Result<(), Fault> {
        self.check(place, len)?;
        secure::reserve_range(&self.file, place, len).map_err(|e| {
            if secure::is_no_space(&e) {
                Fault::NoSpace
            } else {
                Fault::Io(Error::io(&self.path, e))
            }
        })
    }

    /// [`MemoryTier::check`] with the file's size read only when `size` does not hold it yet
    /// (see [`Tier::mapped_in_group`]).
    fn check_in_group(&self, place: u64, len: u64, size: &mut Option<u64>) -> Result<(), Fault> {
        if place.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Fault::Short {
                expected: len,
                got: self.len.saturating_sub(place),
            });
        }
        // Somebody may have truncated the file: touching a page past its end would be SIGBUS. The
        // size is read on every access, or once per group of accesses made together (a
        // truncation right before a read or a group must be seen).
        let now = match *size {
            Some(n) => n,
            None => {
                let n = file_len(&self.file).map_err(|e| Fault::Io(Error::io(&self.path, e)))?;
                *size = Some(n);
                n
            }
        };
        if place + len > now {
            // Give the file its size back (it is ours): other processes' views of the lost
            // pages then read zeros, which their checksums catch, instead of faulting.
            let _ = self.file.set_len(self.len);
            *size = None;
            return Err(Fault::Short {
                expected: len,
                got: now.saturating_sub(place),
            });
        }
        Ok(())
    }
}

impl Tier for MemoryTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn capacity(&self) -> u64 {
        self.len
    }

    fn write(&self, _sample: u32, place: u64, bytes: &[u8]) -> Result<(), Fault> {
        self.reserve(place, bytes.len() as u64)?;
        // SAFETY: in bounds (checked); the caller holds the sample's claim, so nobody else
        // writes or reads this range until it publishes.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.map.as_mut_ptr().add(place as usize), bytes.len())
        };
        Ok(())
    }

    fn read(&self, _sample: u32, place: u64, buf: &mut [u8]) -> Result<(), Fault> {
        let p = self.mapped(place, buf.len() as u64)?.expect("mapped");
        // SAFETY: checked range of a live mapping.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }

    fn mapped(&self, place: u64, len: u64) -> Result<Option<*mut u8>, Fault> {
        self.check(place, len)?;
        // SAFETY: in bounds (checked above).
        Ok(Some(unsafe { self.map.as_mut_ptr().add(place as usize) }))
    }

    fn writable(&self, place: u64, len: u64) -> Result<Option<*mut u8>, Fault> {
        self.reserve(place, len)?;
        // SAFETY: in bounds (checked above).
        Ok(Some(unsafe { self.map.as_mut_ptr().add(place as usize) }))
    }

    fn mapped_in_group(&self, place: u64, len: u64, size: &mut Option<u64>) -> Result<Option<*mut u8>, Fault> {
        self.check_in_group(place, len, size)?;
        // SAFETY: in bounds (checked above).
        Ok(Some(unsafe { self.map.as_mut_ptr().add(place as usize) }))
    }

    fn prefetch(&self, place: u64, len: u64) {
        if place < self.len {
            super::prefetch_lines(
                self.map.as_mut_ptr().wrapping_add(place as usize),
                len.min(self.len - place) as usize,
            );
        }
    }

    fn shared_path(&self) -> Option<&Path> {
        Some(&self.path)
    }

    fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The current size of `f`: `lseek(SEEK_END)`, the cheapest system call that reads it (the
/// descriptor's offset is not used otherwise: the arena is only accessed through the mapping).
fn file_len(f: &File) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on a valid descriptor only moves its offset.
    let end = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(end as u64)
}
