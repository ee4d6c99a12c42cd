//! The changed-file check ahead of staging: one thread per engine stats the dataset files of
//! the epoch the consumer is in, in access order, as soon as the consumer enters it, so that
//! staging and the hand-out find each cached copy already checked and pay no `stat` of their own.
//! It stats each file by its name in an open handle of its directory, opened once per epoch.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::Inner;

/// Samples copied out of the staging state per hold of its lock.
const CHUNK: usize = 256;

/// How far past a position that the hand-out had to check itself (the checker was behind) the
/// checker goes on: they then stat different files rather than race for the same ones in step.
const LEAD: u64 = 64;

impl Inner {
    /// The checker thread's body: for each round (the consumer's epoch + 1), check the cached
    /// copies of that epoch's samples against their dataset files ([`Inner::current_in`]) from
    /// the consumer's position on, in access order, until the epoch ends, the consumer moves to
    /// another epoch, or the engine shuts down.
    ///
    /// A check counts only for the round the consumer was in when it began, so the checker never
    /// reads ahead into the next epoch: a file changed between two epochs is stat'ed after the
    /// consumer entered the later one. A copy whose file changed is left unchecked; staging (or
    /// the hand-out) then stats it itself and reads the file, as it does for every sample the
    /// checker has not reached yet.
    pub(super) fn check_ahead(&self) {
        let mut done = 0;
        let mut chunk = Vec::with_capacity(CHUNK);
        let mut dirs = Dirs::default();
        while let Some((round, mut pos)) = self.wait_for_round(done) {
            // Opened again in each round, after the consumer entered it (see `Dirs`).
            dirs.open.clear();
            while self.next_chunk(round, &mut pos, &mut chunk) {
                self.check_chunk(&chunk, round, &mut pos, &mut dirs);
            }
            done = round;
        }
    }

    /// Check `chunk` (the samples just before position `pos`) for round `round`. Stops early
    /// when the consumer moved to another round or the engine shuts down, and goes on from
    /// [`Inner::check_from`] when that is further on (`pos` then moves there).
    fn check_chunk(&self, chunk: &[u32], round: u32, pos: &mut u64, dirs: &mut Dirs) {
        let start = *pos - chunk.len() as u64;
        for (i, &sample) in chunk.iter().enumerate() {
            if self.shutdown.load(Ordering::Relaxed) || self.round.load(Ordering::Relaxed) != round {
                return;
            }
            let from = self.check_from.load(Ordering::Relaxed);
            if from > start + i as u64 {
                *pos = from;
                return;
            }
            self.current_by(sample, round, |path| dirs.last_change(path));
        }
    }

    /// [`Inner::current_in`] for the sample the consumer is handed at staging position `pos`:
    /// where it makes a `stat` in the consumer's round (the checker has not checked the sample
    /// yet), the checker is sent on `LEAD` positions past `pos`, so that it checks what comes
    /// next rather than what the consumer is checking. (Staging's own checks, rare once the
    /// checker runs, do not move it.)
    pub(super) fn current_at(&self, pos: u64, sample: u32, round: u32) -> bool {
        if !self.stamp_checked_in(sample, round) && round == self.round.load(Ordering::Relaxed) {
            self.check_from.fetch_max(pos + LEAD, Ordering::Relaxed);
        }
        self.current_in(sample, round)
    }

    /// Wait for the consumer to be in a round after `done`: that round and the position the
    /// check starts from (the consumer's); None at shutdown.
    fn wait_for_round(&self, done: u32) -> Option<(u32, u64)> {
        let mut st = self.lock();
        loop {
            if self.shutdown.load(Ordering::Relaxed) {
                return None;
            }
            let round = self.round.load(Ordering::Relaxed);
            if round > done {
                return Some((round, st.next_consume));
            }
            st = self.round_moved.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Copy into `chunk` the next samples of round `round`'s epoch from position `pos` on (never
    /// one the consumer already has), and move `pos` past them; false when the epoch is done,
    /// the consumer is in another round or the engine shuts down.
    fn next_chunk(&self, round: u32, pos: &mut u64, chunk: &mut Vec<u32>) -> bool {
        chunk.clear();
        let st = self.lock();
        if self.shutdown.load(Ordering::Relaxed) || self.round.load(Ordering::Relaxed) != round {
            return false;
        }
        let Some(&end) = st.epoch_starts.get(round as usize) else {
            return false;
        };
        let from = (*pos).max(st.next_consume).max(st.stream_base);
        let to = end.min(st.total()).min(from + CHUNK as u64);
        if from >= to {
            return false;
        }
        let at = (from - st.stream_base) as usize;
        chunk.extend(st.stream.range(at..at + (to - from) as usize));
        *pos = to;
        true
    }
}

/// Directories opened most: more are not kept open (their files are stat'ed by full path).
const MAX_DIRS: usize = 256;

/// The checker's open handles of the dataset's directories, so that a file's `stat` resolves
/// only its name, not its whole path again. They are opened anew in each round, after the
/// consumer entered it: a directory replaced or renamed before then is resolved afresh, as a
/// `stat` of the whole path would; one replaced during the round is a change after the check,
/// as for a file.
#[derive(Default)]
struct Dirs {
    /// None: it could not be opened (its files are stat'ed by full path).
    open: HashMap<PathBuf, Option<OwnedFd>>,
}

impl Dirs {
    /// The last change (mtime or ctime, ns) of the file at `path`; None when it cannot be read.
    fn last_change(&mut self, path: &Path) -> Option<i128> {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return full_path_change(path);
        };
        if !self.open.contains_key(dir) && self.open.len() >= MAX_DIRS {
            return full_path_change(path);
        }
        let fd = self.open.entry(dir.to_path_buf()).or_insert_with(|| open_dir(dir));
        let (Some(fd), Ok(name)) = (fd.as_ref(), CString::new(name.as_bytes())) else {
            return full_path_change(path);
        };
        // SAFETY: an all-zero `stat` is a valid value of this plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open directory handle, `name` a NUL-terminated string and `st` a
        // writable `stat` that outlive the call.
        if unsafe { libc::fstatat(fd.as_raw_fd(), name.as_ptr(), &mut st, 0) } != 0 {
            return None;
        }
        let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
        Some(ns(st.st_mtime, st.st_mtime_nsec).max(ns(st.st_ctime, st.st_ctime_nsec)))
    }
}

fn full_path_change(path: &Path) -> Option<i128> {
    std::fs::metadata(path).ok().map(|m| crate::source::last_change_ns(&m))
}

/// A handle of the directory `dir` for `fstatat` (`O_PATH`: it reads nothing).
fn open_dir(dir: &Path) -> Option<OwnedFd> {
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is NUL-terminated and outlives the call.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    // SAFETY: a descriptor `open` just returned is owned by nothing else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    fn write(path: &Path, future_s: u64) {
        std::fs::write(path, b"x").unwrap();
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() + Duration::from_secs(future_s))
            .unwrap();
    }

    #[test]
    fn a_directory_replaced_between_rounds_is_resolved_again() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        let file = dir.join("a.bin");
        write(&file, 0);
        let mut dirs = Dirs::default();
        let before = dirs.last_change(&file).unwrap();
        assert_eq!(Some(before), full_path_change(&file));
        // The directory is replaced by another holding a newer file of the same name.
        std::fs::rename(&dir, tmp.path().join("old")).unwrap();
        std::fs::create_dir(&dir).unwrap();
        write(&file, 600);
        // Within the round the handle still names the directory opened in it...
        assert_eq!(dirs.last_change(&file), Some(before));
        // ... and the next round opens the path again and sees the new file.
        dirs.open.clear();
        let after = dirs.last_change(&file).unwrap();
        assert!(after > before);
        assert_eq!(Some(after), full_path_change(&file));
        assert_eq!(dirs.last_change(&dir.join("missing.bin")), None);
    }
}
