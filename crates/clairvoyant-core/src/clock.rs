//! The monotonic clock the engine's waits for other local processes' claims are decided by:
//! the real one in production, a [`ManualClock`] that tests advance explicitly (so a test of
//! "after the deadline" advances time instead of waiting in real time).

use std::fmt::Debug;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A source of monotonic time.
pub trait Clock: Send + Sync + Debug {
    /// The time now; never goes backwards.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock ([`Instant::now`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct RealClock;

impl Clock for RealClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that stands still until [`ManualClock::advance`] moves it (for tests); it counts
/// how often it was read, so a test can await a reader ([`ManualClock::await_reads`]).
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    /// (time since `start`, reads so far)
    state: Mutex<(Duration, u64)>,
    read: Condvar,
}

impl ManualClock {
    /// A clock standing at the real time of its creation.
    pub fn new() -> ManualClock {
        ManualClock {
            start: Instant::now(),
            state: Mutex::new((Duration::ZERO, 0)),
            read: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (Duration, u64)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Move the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.lock().0 += by;
    }

    /// How many times [`Clock::now`] was called.
    pub fn reads(&self) -> u64 {
        self.lock().1
    }

    /// Wait (at most `within` of real time) until [`Clock::now`] was called at least `n` times
    /// in all; whether it was.
    pub fn await_reads(&self, n: u64, within: Duration) -> bool {
        let g = self.lock();
        let (g, _) = self
            .read
            .wait_timeout_while(g, within, |s| s.1 < n)
            .unwrap_or_else(|p| p.into_inner());
        g.1 >= n
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        let mut g = self.lock();
        g.1 += 1;
        let now = self.start + g.0;
        drop(g);
        self.read.notify_all();
        now
    }
}
