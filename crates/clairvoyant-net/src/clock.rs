//! The monotonic clock the peer client's down state and back-off are decided by: the real one
//! in production, a [`ManualClock`] that tests advance explicitly (so a test of "after
//! `dead_for`" advances time instead of waiting in real time). Socket time-outs and fetch
//! deadlines stay in real time, as the kernel measures them.

use std::fmt::Debug;
use std::sync::Mutex;
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

/// A clock that stands still until [`ManualClock::advance`] moves it (for tests).
#[derive(Debug)]
pub struct ManualClock {
    start: Instant,
    elapsed: Mutex<Duration>,
}

impl ManualClock {
    /// A clock standing at the real time of its creation.
    pub fn new() -> ManualClock {
        ManualClock {
            start: Instant::now(),
            elapsed: Mutex::new(Duration::ZERO),
        }
    }

    /// Move the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.elapsed.lock().unwrap_or_else(|p| p.into_inner()) += by;
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.start + *self.elapsed.lock().unwrap_or_else(|p| p.into_inner())
    }
}
