//! Cross-process wait/wake on a shared 32-bit word (Linux futex, not `FUTEX_PRIVATE`, so that it
//! works across processes mapping the same file). Elsewhere a short sleep stands in for the wait;
//! callers always look at the word again after a wait returns.
//!
//! Its own crate because both the engine's node cache (`clairvoyant-core`) and the agent's
//! shared directory (`clairvoyant-agent`, which interposed processes load without the core)
//! wait on such words: one copy of the `unsafe` calls, std + libc only.
#![warn(missing_docs)]

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps until `word` is woken, while it still holds `expected`, for at most `timeout`;
/// returns at once if it holds another value. Spurious returns happen: look at the word again.
#[cfg(target_os = "linux")]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 for the duration of the call (a shared mapping or
    // this process's memory); FUTEX_WAIT only reads it and the timespec, and returns on
    // mismatch, wake, signal or timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Wakes every process and thread waiting on `word`.
#[cfg(target_os = "linux")]
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: as in `wait`; FUTEX_WAKE does not access the memory.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Sleeps briefly (at most 1 ms) in place of a futex wait.
#[cfg(not(target_os = "linux"))]
pub fn wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_millis(1)));
}

/// Nothing to wake where waits are sleeps.
#[cfg(not(target_os = "linux"))]
pub fn wake_all(_word: &AtomicU32) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    #[test]
    fn a_wait_on_a_word_that_changed_returns_at_once() {
        let w = AtomicU32::new(1);
        // An hour: the test hangs if the wait does not see the mismatch.
        wait(&w, 0, Duration::from_secs(3600));
    }

    #[test]
    fn a_wake_ends_a_wait() {
        let w = Arc::new(AtomicU32::new(0));
        let waiter = {
            let w = w.clone();
            std::thread::spawn(move || {
                while w.load(Ordering::Acquire) == 0 {
                    wait(&w, 0, Duration::from_secs(3600));
                }
            })
        };
        w.store(1, Ordering::Release);
        wake_all(&w);
        waiter.join().unwrap();
    }
}
