//! A directory class (node-local SSD): one file per sample under a private directory. Files are
//! written under an exclusive temporary name and renamed; free space is checked before writing
//! and a full disk leaves no temporary file behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{secure, Fault, Tier};
use crate::error::{Error, Result};

/// The file in a directory class's per-cache directory naming its state segment.
const OWNER: &str = ".owner";

/// The state segment that owns the per-cache directory `dir`, if it says.
pub(super) fn owner_of(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    let f = secure::open_existing(&dir.join(OWNER), false).ok()?;
    let mut bytes = Vec::new();
    (&f).read_to_end(&mut bytes).ok()?;
    Some(PathBuf::from(std::ffi::OsString::from_vec(bytes)))
}

/// Free space a directory class leaves on its file system.
const RESERVE: u64 = 16 << 20;

/// A directory class: one file per sample, named by its index, under a private directory.
pub struct DirectoryTier {
    name: String,
    dir: PathBuf,
    capacity: u64,
}

impl DirectoryTier {
    /// Use `dir` (created 0700 if missing, checked as private) for class `name`.
    pub fn open(name: &str, dir: &Path, capacity: u64) -> Result<DirectoryTier> {
        secure::make_private_dir(dir)?;
        Ok(DirectoryTier {
            name: name.into(),
            dir: dir.to_path_buf(),
            capacity,
        })
    }

    /// The private directory holding the class's sample files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Record which state segment owns this directory, so that a janitor working from another
    /// shared-memory directory does not mistake it for a dead cache's.
    pub fn mark_owner(&self, state: &Path) {
        let tmp = self.dir.join(format!(".{OWNER}.{}.tmp", std::process::id()));
        let written = secure::create_new(&tmp)
            .and_then(|mut f| f.write_all(state.as_os_str().as_encoded_bytes()))
            .and_then(|_| std::fs::rename(&tmp, self.dir.join(OWNER)));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }

    fn file(&self, sample: u32) -> PathBuf {
        self.dir.join(sample.to_string())
    }
}

impl Tier for DirectoryTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn write(&self, sample: u32, _place: u64, bytes: &[u8]) -> Result<(), Fault> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let free = crate::sysinfo::free_space(&self.dir).unwrap_or(u64::MAX);
        if free < bytes.len() as u64 + RESERVE {
            return Err(Fault::NoSpace);
        }
        let path = self.file(sample);
        let tmp = self.dir.join(format!(
            ".{sample}.{}.{}.tmp",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let written = secure::create_new(&tmp).and_then(|mut f| f.write_all(bytes));
        if let Err(e) = written.and_then(|_| std::fs::rename(&tmp, &path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(if secure::is_no_space(&e) {
                Fault::NoSpace
            } else {
                Fault::Io(Error::io(&path, e))
            });
        }
        Ok(())
    }

    fn read(&self, sample: u32, _place: u64, buf: &mut [u8]) -> Result<(), Fault> {
        let path = self.file(sample);
        let mut f = secure::open_existing(&path, false).map_err(Fault::Io)?;
        let have = f.metadata().map_err(|e| Fault::Io(Error::io(&path, e)))?.len();
        if have != buf.len() as u64 {
            return Err(Fault::Short {
                expected: buf.len() as u64,
                got: have,
            });
        }
        f.read_exact(buf).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                Fault::Short {
                    expected: buf.len() as u64,
                    got: 0,
                }
            } else {
                Fault::Io(Error::io(&path, e))
            }
        })
    }

    fn remove(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
