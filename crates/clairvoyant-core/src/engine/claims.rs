//! Waiting for another local process's fill of a sample. A sibling rank stopped (SIGSTOP) or
//! stuck while it holds fill claims must not stall this one for the fill time-out per claim: the
//! wait is bounded by the deadline of a peer fetch (twice the model's file-system time for the
//! sample, 2-5 s), after which the sample is read from its origin into private memory, leaving
//! the claim to its holder (which may resume and publish it). A claimant that outlasted a deadline
//! is read around at once until that claim moves on (published, abandoned, taken over).
//! The deadlines are measured by the engine's [`Clock`] (real time but in tests, which advance
//! a [`ManualClock`](crate::clock::ManualClock) instead of waiting in real time).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::peer::storage_deadline;
use super::Inner;
use crate::clock::Clock;
use crate::tier::state::{MAX_PROCESSES, WAIT_SLICE};
use crate::tier::{Acquire, StateSegment};

/// How long a wait for a claimant already known to be slow lasts: one futex slice, so that a
/// claimant that died meanwhile is still noticed (and its claim taken over) as before.
pub const SLOW_CLAIMANT_WAIT: Duration = WAIT_SLICE;

/// Per process slot of the node cache, the claim of that process that outlasted a deadline, as
/// (sample << 32 | state word); 0: none. Kept per engine, in this process only: each waiting
/// process pays at most one deadline per stall of a claimant.
pub(super) struct SlowClaimants {
    held: Vec<AtomicU64>,
}

impl SlowClaimants {
    pub(super) fn new() -> Self {
        SlowClaimants {
            held: (0..MAX_PROCESSES).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The process in `slot` held `sample` (state word `word`) past a deadline.
    pub(super) fn mark(&self, slot: u32, sample: u32, word: u32) {
        if let Some(h) = self.held.get(slot as usize) {
            h.store(((sample as u64) << 32) | word as u64, Ordering::Relaxed);
        }
    }

    /// Whether the process in `slot` still holds the claim that outlasted a deadline; forgets it
    /// once the claim moved on (the process resumed, or died and was taken over).
    pub(super) fn is_slow(&self, state: &StateSegment, slot: u32) -> bool {
        let Some(h) = self.held.get(slot as usize) else {
            return false;
        };
        let v = h.load(Ordering::Relaxed);
        if v == 0 {
            return false;
        }
        let (sample, word) = ((v >> 32) as u32, v as u32);
        if (sample as usize) < state.samples() && state.word(sample).load(Ordering::Acquire) == word {
            return true;
        }
        let _ = h.compare_exchange(v, 0, Ordering::Relaxed, Ordering::Relaxed);
        false
    }
}

impl Inner {
    /// How long to wait for the claim on `sample` (`bytes` long) held now: this process's own
    /// fills the fill time-out (a process that runs this is not stopped); another process's the
    /// deadline rule of a peer fetch ([`storage_deadline`]); a process known to be slow one
    /// [`SLOW_CLAIMANT_WAIT`].
    pub(super) fn claim_wait(&self, sample: u32, bytes: u64) -> Duration {
        let state = self.node.cache.state();
        match state.claimant(sample) {
            Some((slot, _)) if slot == state.own_slot() => self.fill_timeout,
            Some((slot, _)) if self.slow_claimants.is_slow(state, slot) => SLOW_CLAIMANT_WAIT,
            _ => storage_deadline(self.pfs_speed, bytes),
        }
    }

    /// Settle who provides `sample` ([`StateSegment::acquire`]) waiting at most
    /// [`Inner::claim_wait`] for another process's fill; `Busy` then means: read it into private
    /// memory, the claim is not ours. A claimant that outlasted the wait is marked slow.
    pub(super) fn acquire_claim(&self, sample: u32, bytes: u64) -> Acquire {
        let state = self.node.cache.state();
        let got = acquire_within(state, &*self.clock, sample, self.claim_wait(sample, bytes));
        if got == Acquire::Busy {
            if let Some((slot, word)) = state.claimant(sample) {
                if slot != state.own_slot() {
                    self.slow_claimants.mark(slot, sample, word);
                }
            }
        }
        got
    }
}

/// [`StateSegment::acquire`] waiting at most `wait` as `clock` measures it: in waits of at most
/// one [`WAIT_SLICE`] of real time (each ends with the check for a dead claimant, as in one long
/// wait), until the claim settles or the clock reaches the deadline.
fn acquire_within(state: &StateSegment, clock: &dyn Clock, sample: u32, wait: Duration) -> Acquire {
    let deadline = clock.now() + wait;
    loop {
        let left = deadline.saturating_duration_since(clock.now());
        let got = state.acquire(sample, left.min(WAIT_SLICE));
        if got != Acquire::Busy || left.is_zero() {
            return got;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use std::sync::Arc;
    use std::thread::JoinHandle;

    /// A wait long enough to hang the test if it were measured in real time.
    const HOUR: Duration = Duration::from_secs(3600);
    /// Long enough for a waiter to read the clock; reached only when it does not.
    const READ: Duration = Duration::from_secs(30);

    /// `acquire_within(sample, HOUR)` on a thread of its own (left behind if the test fails,
    /// rather than hanging it), once it took its deadline from the clock.
    fn waiter(state: &Arc<StateSegment>, clock: &Arc<ManualClock>, sample: u32) -> JoinHandle<Acquire> {
        let reads = clock.reads();
        let (st, c) = (state.clone(), clock.clone());
        let w = std::thread::spawn(move || acquire_within(&st, &*c, sample, HOUR));
        assert!(
            clock.await_reads(reads + 1, READ),
            "the wait takes its deadline from the clock"
        );
        w
    }

    fn segment(dir: &tempfile::TempDir) -> Arc<StateSegment> {
        Arc::new(StateSegment::open(dir.path(), "claims", 4).unwrap())
    }

    #[test]
    fn a_claim_wait_ends_when_the_clock_reaches_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let (state, clock) = (segment(&dir), Arc::new(ManualClock::new()));
        // A claim of a live process (this one) that is never published.
        assert!(state.claim(1));
        let w = waiter(&state, &clock, 1);
        clock.advance(HOUR - Duration::from_millis(1));
        // A read after the advance: the waiter saw 1 ms left and waits on.
        assert!(clock.await_reads(clock.reads() + 1, READ), "the wait reads the clock");
        assert!(!w.is_finished(), "gave up before the deadline");
        clock.advance(Duration::from_millis(1));
        assert_eq!(w.join().unwrap(), Acquire::Busy);
        assert!(state.claimant(1).is_some(), "the claim stays its holder's");
        assert_eq!(acquire_within(&state, &*clock, 1, Duration::ZERO), Acquire::Busy);
    }

    #[test]
    fn a_sample_nobody_fills_has_no_claimant() {
        let dir = tempfile::tempdir().unwrap();
        let state = segment(&dir);
        assert_eq!(state.claimant(0), None, "empty");
        assert!(state.claim(1));
        assert_eq!(state.claimant(1).map(|(slot, _)| slot), Some(state.own_slot()));
        state.publish(1, 7, 1);
        assert_eq!(state.claimant(1), None, "ready");
    }

    #[test]
    fn a_claim_wait_ends_when_the_claim_settles_whatever_the_clock() {
        let dir = tempfile::tempdir().unwrap();
        let (state, clock) = (segment(&dir), Arc::new(ManualClock::new()));
        assert!(state.claim(1));
        let w = waiter(&state, &clock, 1);
        state.publish(1, 7, 1);
        assert_eq!(w.join().unwrap(), Acquire::Ready);
        assert!(state.claim(2));
        let w = waiter(&state, &clock, 2);
        state.abandon(2);
        assert_eq!(
            w.join().unwrap(),
            Acquire::Claimed,
            "an abandoned claim goes to the waiter"
        );
        assert!(state.claim(3));
        let w = waiter(&state, &clock, 3);
        state.mark_no_space(3);
        assert_eq!(w.join().unwrap(), Acquire::NoSpace);
    }

    #[test]
    fn a_slow_mark_lasts_while_its_claim_is_held_and_goes_when_it_moves_on() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateSegment::open(dir.path(), "slow", 4).unwrap();
        let slow = SlowClaimants::new();
        assert!(state.claim(1));
        let (slot, word) = state.claimant(1).unwrap();
        assert_eq!(slot, state.own_slot());
        assert!(!slow.is_slow(&state, slot));
        slow.mark(slot, 1, word);
        assert!(slow.is_slow(&state, slot), "the claim is still held");
        assert!(!slow.is_slow(&state, slot + 1), "another process is not marked");
        state.publish(1, 0, 0);
        assert!(!slow.is_slow(&state, slot), "the claimant made progress");
        assert!(state.claim(2));
        assert!(
            !slow.is_slow(&state, slot),
            "the mark was dropped, not moved to a new claim"
        );
        slow.mark(MAX_PROCESSES as u32, 2, word);
        assert!(
            !slow.is_slow(&state, MAX_PROCESSES as u32),
            "a slot out of range is ignored"
        );
    }
}
