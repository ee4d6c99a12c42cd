//! The changed-file check ahead of staging: one thread per engine stats the dataset files of
//! the epoch the consumer is in, in access order, as soon as the consumer enters it, so that
//! staging and the hand-out find each cached copy already checked and pay no `stat` of their own.

use std::sync::atomic::Ordering;

use super::Inner;

/// Samples copied out of the staging state per hold of its lock.
const CHUNK: usize = 256;

/// How far past a position that staging or the hand-out had to check itself (the checker was
/// behind) the checker goes on: they then stat different files rather than race for the same
/// ones in step.
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
        while let Some((round, mut pos)) = self.wait_for_round(done) {
            while self.next_chunk(round, &mut pos, &mut chunk) {
                self.check_chunk(&chunk, round, &mut pos);
            }
            done = round;
        }
    }

    /// Check `chunk` (the samples just before position `pos`) for round `round`. Stops early
    /// when the consumer moved to another round or the engine shuts down, and goes on from
    /// [`Inner::check_from`] when that is further on (`pos` then moves there).
    fn check_chunk(&self, chunk: &[u32], round: u32, pos: &mut u64) {
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
            self.current_in(sample, round);
        }
    }

    /// [`Inner::current_in`] for the sample at staging position `pos`: where it makes a `stat`
    /// in the consumer's round (the checker has not checked the sample yet), the checker is sent
    /// on `LEAD` positions past `pos`, so that it checks what comes next rather than what is
    /// being checked here.
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
