//! A miss read by the program itself (when the agent lets programs fill: order unknown, one
//! node). The first process to open a file the shared directory does not hold claims it there
//! (no round trip), opens and reads it in its own thread as it would directly, serves its reads
//! from those bytes, and hands them to the agent (`Fill`, one way: it waits for no answer). Any
//! other open of the file while it is read waits on the claim (a futex in the shared mapping)
//! until the agent has recorded the copy, so the file system is read once per file. A claim
//! whose process is gone is taken over; while the agent is gone, or after the round-trip
//! time-out, a waiter reads the file directly.
//!
//! When the order is known programs do not fill: the agent fills ahead of them and holds a
//! file's claim while it reads it, so an open of that file waits on the claim the same way and
//! then finds the entry, without a round trip to the agent.

use crate::client::{self, count, Found, Session};
use crate::paths::Config;
use crate::{last_change_ns, real, real_fstat};
use clairvoyant_agent::dir::{alive, counter, path_key, Claimed, DirReader, Entry};
use clairvoyant_agent::proto::MAX_FILL;
use libc::{c_int, c_void, off_t};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one wait on a claim lasts before the holder's and the agent's lives are checked.
const WAIT_STEP: Duration = Duration::from_millis(50);

/// This process holds the claim on a file: it reads the file and hands it over, or the claim is
/// given back when this is dropped (a failed open, a changed file).
pub(crate) struct Claim {
    session: Arc<Session>,
    key: u64,
    pid: u32,
    handed_over: bool,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.handed_over {
            if let Some(d) = &self.session.dir {
                // Dropped after a failed open too: its errno is the program's.
                let saved = real::errno();
                d.release(self.key, self.pid);
                real::set_errno(saved);
            }
        }
    }
}

/// What a miss (the shared directory has no entry for the file) comes to.
pub(crate) enum Miss {
    /// Programs do not fill (or the file is too big, or no claim fits): ask the agent.
    Ask,
    /// Recorded meanwhile: serve this entry.
    Cached(Entry),
    /// Read the file directly (not cached on this node, or waiting did not end).
    Direct,
    /// This process holds the claim: open the file and [`read`] it.
    Read(Claim),
}

/// Decide a miss of `rel` (`size` bytes by `stat`): claim it, or wait for the process that has.
pub(crate) fn miss(cfg: &Config, session: &Arc<Session>, rel: &[u8], size: u64) -> Miss {
    let Some(dir) = session.dir.as_ref() else {
        return Miss::Ask;
    };
    let key = path_key(rel);
    let until = Instant::now() + cfg.timeout;
    if !dir.programs_fill() {
        return agent_fill(session, dir, key, until);
    }
    if size > MAX_FILL || session.arena.is_none() || client::agent_down() {
        // (An agent that failed is not asked: the lookup reads the file directly at once.)
        return Miss::Ask;
    }
    let pid = std::process::id();
    loop {
        if let Some(e) = dir.lookup(key) {
            return Miss::Cached(e);
        }
        let holder = match dir.claim(key, pid) {
            Claimed::Won => return Miss::Read(claim(session, key, pid)),
            Claimed::Done => return dir.lookup(key).map_or(Miss::Ask, Miss::Cached),
            Claimed::NotCached => return Miss::Direct,
            Claimed::Full => return Miss::Ask,
            Claimed::Held(holder) => holder,
        };
        if !alive(holder) {
            if dir.take_over(key, holder, pid) {
                return Miss::Read(claim(session, key, pid));
            }
            continue;
        }
        if !alive(dir.agent_pid()) || client::agent_down() || Instant::now() >= until {
            count(Some(session), counter::FALLBACKS, 1);
            return Miss::Direct;
        }
        dir.wait_claim(key, holder, WAIT_STEP);
    }
}

/// Programs do not fill (the order is known): when the agent is reading the file now (it
/// holds its claim), wait for that fill in the directory rather than ask the agent, which
/// would wait for it too; else ask.
fn agent_fill(session: &Session, dir: &DirReader, key: u64, until: Instant) -> Miss {
    let agent = dir.agent_pid();
    let mut waited = false;
    loop {
        let word = dir.claim_state(key);
        if word != agent || !clairvoyant_agent::dir::claim::is_pid(word) {
            break;
        }
        if client::agent_down() || !alive(agent) || Instant::now() >= until {
            return Miss::Ask;
        }
        dir.wait_claim(key, word, WAIT_STEP);
        waited = true;
    }
    match dir.lookup(key) {
        Some(e) => {
            if waited {
                count(Some(session), counter::FILL_WAITS, 1);
            }
            Miss::Cached(e)
        }
        None => Miss::Ask,
    }
}

fn claim(session: &Arc<Session>, key: u64, pid: u32) -> Claim {
    Claim {
        session: session.clone(),
        key,
        pid,
        handed_over: false,
    }
}

/// The claimed file is open as `fd` (`st` its `fstat`): read it whole, as a direct read would,
/// hand the bytes to the agent, and serve this open from them. A file that changes while it is
/// read, or a short read, gives the claim back and reads the file directly.
pub(crate) fn read(cfg: &Config, mut claim: Claim, fd: c_int, st: &libc::stat, rel: &[u8]) -> Found {
    let size = st.st_size as u64;
    let change = last_change_ns(st);
    let Some(bytes) = read_whole(fd, size) else {
        return Found::Direct;
    };
    let same = real_fstat(fd).is_some_and(|now| now.st_size as u64 == size && last_change_ns(&now) == change);
    if !same {
        return Found::Direct;
    }
    let session = Some(&*claim.session);
    count(session, counter::FILLS, 1);
    count(session, counter::FILL_BYTES, size);
    claim.handed_over = client::hand_over(cfg, rel, change, &bytes);
    Found::Own { bytes }
}

/// `size` bytes of `fd` from offset 0 (its offset untouched), or None when it has fewer.
fn read_whole(fd: c_int, size: u64) -> Option<Box<[u8]>> {
    let mut buf = vec![0u8; size as usize];
    let mut at = 0usize;
    while at < buf.len() {
        // SAFETY: reading into the in-bounds tail of our own buffer.
        let n = unsafe { real::pread(fd, buf[at..].as_mut_ptr() as *mut c_void, buf.len() - at, at as off_t) };
        if n < 0 && real::errno() == libc::EINTR {
            continue;
        }
        if n <= 0 {
            return None;
        }
        at += n as usize;
    }
    Some(buf.into_boxed_slice())
}
