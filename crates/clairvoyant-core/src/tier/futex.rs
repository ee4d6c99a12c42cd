//! Cross-process wait/wake on a shared 32-bit word (Linux futex, non-private so it works on
//! shared mappings). Elsewhere a short sleep stands in; callers always re-check the word.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps until `word` is woken, while it still holds `expected`, for at most `timeout`;
/// returns at once if it holds another value. Spurious returns happen: re-check the word.
#[cfg(target_os = "linux")]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call; FUTEX_WAIT only reads
    // it and returns on mismatch, wake, signal or timeout.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        );
    }
}

/// Wakes every process and thread waiting on `word`.
#[cfg(target_os = "linux")]
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: as above; FUTEX_WAKE does not access the memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(not(target_os = "linux"))]
pub fn wait(_word: &AtomicU32, _expected: u32, timeout: Duration) {
    std::thread::sleep(timeout.min(Duration::from_millis(1)));
}

#[cfg(not(target_os = "linux"))]
pub fn wake_all(_word: &AtomicU32) {}
