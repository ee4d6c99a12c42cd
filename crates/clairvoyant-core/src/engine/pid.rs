//! This process's id without a system call per use: read once, and forgotten in the child of a
//! `fork` (a `pthread_atfork` handler), so a forked process never takes its parent's id for its
//! own. Processes made by `clone` without the C library's `fork` (which run no atfork handlers)
//! are not covered; Python's `os.fork` and `multiprocessing` go through `fork`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Once;

static PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget() {
    PID.store(0, Ordering::Relaxed);
}

/// The id of the calling process.
pub(super) fn current() -> u32 {
    let p = PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers a handler that only stores to an atomic (async-signal-safe), run in
        // the child after fork.
        unsafe { libc::pthread_atfork(None, None, Some(forget)) };
    });
    // Registered before the id is cached: a fork from here on clears it.
    let p = std::process::id();
    PID.store(p, Ordering::Relaxed);
    p
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_forked_child_sees_its_own_id() {
        let parent = super::current();
        assert_eq!(parent, std::process::id());
        // SAFETY: the child only calls async-signal-safe functions (getpid, _exit) besides an
        // atomic load.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            let ok = super::current() == std::process::id() && super::current() != parent;
            // SAFETY: _exit is async-signal-safe and ends the forked child without running the parent's
            // atexit handlers or unwinding.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked.
        unsafe { libc::waitpid(child, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status}"
        );
        assert_eq!(super::current(), parent);
    }
}
