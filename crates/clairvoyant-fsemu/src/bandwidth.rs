//! The shared file system's bandwidth: an aggregate throughput t(γ) that depends on the number γ
//! of transfers in progress, shared equally between them (processor sharing).
//!
//! Every transfer in progress receives t(γ)/γ bytes per second. All transfers are served at the
//! same rate, so one virtual clock `served` (bytes delivered to each transfer since the start)
//! describes them all: a transfer of `n` bytes that starts when `served = v` ends when
//! `served = v + n`. Between arrivals and departures `served` grows at t(γ)/γ. A waiting reader
//! sleeps until its predicted end; an arrival or departure changes the rate, so every waiter is
//! woken to predict again. This is exact processor sharing, not a time-slice approximation.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// t(γ): the model's throughput table (MB/s at γ concurrent transfers), the same type and
/// interpolation the engine and the simulator use.
pub use clairvoyant_core::model::Curve;

/// Bytes per second each of `n >= 1` concurrent transfers receives: t(n)/n.
fn per_transfer_bps(curve: &Curve, n: usize) -> f64 {
    let n = n.max(1) as f64;
    curve.at(n) * 1e6 / n
}

/// The processor-sharing state, in seconds since `origin` and bytes.
#[derive(Debug)]
pub struct Sharing {
    curve: Curve,
    /// Transfers in progress.
    active: usize,
    /// Bytes served to each transfer in progress since the start.
    served: f64,
    /// When `served` was last brought up to date, seconds since the origin.
    at: f64,
}

impl Sharing {
    /// An idle state (no transfer, nothing served) sharing the aggregate bandwidth `curve`.
    pub fn new(curve: Curve) -> Sharing {
        Sharing {
            curve,
            active: 0,
            served: 0.0,
            at: 0.0,
        }
    }

    /// Transfers in progress.
    pub fn active(&self) -> usize {
        self.active
    }

    /// Brings `served` up to time `now` (seconds since the origin; never goes back).
    pub fn advance(&mut self, now: f64) {
        if now > self.at {
            if self.active > 0 {
                self.served += (now - self.at) * per_transfer_bps(&self.curve, self.active);
            }
            self.at = now;
        }
    }

    /// A transfer of `bytes` starts at `now`; returns the value of `served` at which it ends.
    pub fn start(&mut self, now: f64, bytes: u64) -> f64 {
        self.advance(now);
        self.active += 1;
        self.served + bytes as f64
    }

    /// Seconds from `now` until a transfer ending at `end` completes if nothing else changes; 0
    /// when it is complete.
    pub fn remaining(&mut self, now: f64, end: f64) -> f64 {
        self.advance(now);
        let left = end - self.served;
        if left <= 0.0 || self.active == 0 {
            0.0
        } else {
            left / per_transfer_bps(&self.curve, self.active)
        }
    }

    /// A transfer leaves at `now`.
    pub fn finish(&mut self, now: f64) {
        self.advance(now);
        self.active = self.active.saturating_sub(1);
    }
}

/// The shared bandwidth of a running file system: readers call [`Bandwidth::transfer`], which
/// sleeps for the transfer's share of t(γ).
#[derive(Debug)]
pub struct Bandwidth {
    state: Mutex<Sharing>,
    changed: Condvar,
    origin: Instant,
}

/// Shortest wait worth sleeping for; finer waits only cost wake-ups.
const MIN_WAIT_S: f64 = 20e-6;

impl Bandwidth {
    /// The shared bandwidth t(γ) given by `curve` (MB/s by concurrent transfers), idle, its
    /// clock starting now.
    pub fn new(curve: Curve) -> Bandwidth {
        Bandwidth {
            state: Mutex::new(Sharing::new(curve)),
            changed: Condvar::new(),
            origin: Instant::now(),
        }
    }

    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    fn lock(&self) -> MutexGuard<'_, Sharing> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Transfers in progress now.
    pub fn active(&self) -> usize {
        self.lock().active()
    }

    /// Waits as long as transferring `bytes` takes with the other transfers in progress.
    pub fn transfer(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut st = self.lock();
        let end = st.start(self.now(), bytes);
        self.changed.notify_all();
        loop {
            let left = st.remaining(self.now(), end);
            if left <= MIN_WAIT_S {
                break;
            }
            st = self
                .changed
                .wait_timeout(st, Duration::from_secs_f64(left))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        st.finish(self.now());
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Curve {
        Curve::parse_pairs("1:60,2:100,4:160,8:200", "--bandwidth").unwrap()
    }

    #[test]
    fn curve_interpolates_and_is_flat_beyond_the_ends() {
        let c = table();
        assert_eq!(c.at(1.0), 60.0);
        assert_eq!(c.at(3.0), 130.0);
        assert_eq!(c.at(6.0), 180.0);
        assert_eq!(c.at(64.0), 200.0);
        assert_eq!(c.at(0.5), 60.0);
        assert_eq!(Curve::parse_pairs("250", "--bandwidth").unwrap().at(9.0), 250.0);
    }

    #[test]
    fn bad_curves_are_refused_with_the_reason() {
        let err = |text: &str| Curve::parse_pairs(text, "--bandwidth").unwrap_err().to_string();
        assert!(err("").contains("readers:MB/s"));
        assert!(err("1:60,1:70").contains("increasing"));
        assert!(err("0:60").contains(">= 1"));
        assert!(err("1:-5").contains("> 0"));
        assert!(err("1:x").contains("'x'"));
        assert!(err("1:x").contains("--bandwidth"));
    }

    #[test]
    fn one_transfer_gets_t1() {
        let mut s = Sharing::new(table());
        let end = s.start(0.0, 60_000_000);
        assert!((s.remaining(0.0, end) - 1.0).abs() < 1e-9);
        assert!((s.remaining(0.5, end) - 0.5).abs() < 1e-9);
        assert_eq!(s.remaining(1.0, end), 0.0);
        s.finish(1.0);
        assert_eq!(s.active(), 0);
    }

    #[test]
    fn concurrent_transfers_share_t_gamma() {
        // Four transfers of 40 MB at once: t(4) = 160 MB/s, 40 MB/s each, all end at 1 s.
        let mut s = Sharing::new(table());
        let ends: Vec<f64> = (0..4).map(|_| s.start(0.0, 40_000_000)).collect();
        for e in &ends {
            assert!((s.remaining(0.0, *e) - 1.0).abs() < 1e-9);
        }
        // A second pair of 50 MB transfers at 100 MB/s: the short one leaving speeds the other up.
        let mut s = Sharing::new(table());
        let short = s.start(0.0, 25_000_000);
        let long = s.start(0.0, 50_000_000);
        assert!((s.remaining(0.0, short) - 0.5).abs() < 1e-9);
        s.finish(0.5);
        // 25 MB left at t(1) = 60 MB/s.
        assert!((s.remaining(0.5, long) - 25.0 / 60.0).abs() < 1e-9);
    }

    #[test]
    fn real_transfers_follow_the_curve() {
        let bw = Bandwidth::new(Curve::parse_pairs("1:100,4:200", "--bandwidth").unwrap());
        let t = Instant::now();
        bw.transfer(10_000_000); // 0.1 s alone
        let one = t.elapsed().as_secs_f64();
        assert!((0.095..0.2).contains(&one), "{one}");
        let t = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| bw.transfer(10_000_000)); // 40 MB at 200 MB/s: 0.2 s
            }
        });
        let four = t.elapsed().as_secs_f64();
        assert!((0.19..0.35).contains(&four), "{four}");
        assert_eq!(bw.active(), 0);
    }
}
