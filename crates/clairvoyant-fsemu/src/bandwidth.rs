//! The shared file system's bandwidth: an aggregate throughput t(γ) that depends on the number γ
//! of transfers in progress, shared equally between them (processor sharing).
//!
//! Every transfer in progress receives t(γ)/γ bytes per second. All transfers are served at the
//! same rate, so one virtual clock `served` (bytes delivered to each transfer since the start)
//! describes them all: a transfer of `n` bytes that starts when `served = v` ends when
//! `served = v + n`. Between arrivals and departures `served` grows at t(γ)/γ. A transfer leaves
//! at the moment `served` reaches its end, whenever its reader's thread wakes to see it: a
//! reader woken late (a busy machine) delays its own read, never the others' share. A waiting
//! reader sleeps until its end as the transfers in progress decide it (they leave at known
//! ends); one that starts later slows it, so a reader may wake early and sleep again, never
//! late. This is exact processor sharing, not a time-slice approximation.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Mutex, MutexGuard};
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
    /// The ends (values of `served`, as the bits of a non-negative f64, which order as the
    /// values do) of the transfers in progress, the soonest first.
    ends: BinaryHeap<Reverse<u64>>,
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
            ends: BinaryHeap::new(),
            served: 0.0,
            at: 0.0,
        }
    }

    /// Transfers in progress.
    pub fn active(&self) -> usize {
        self.ends.len()
    }

    /// Brings `served` up to time `now` (seconds since the origin; never goes back). Transfers
    /// whose end `served` reaches on the way leave at that moment, and the rest share t(γ) of
    /// the fewer from then on.
    pub fn advance(&mut self, now: f64) {
        while now > self.at {
            let Some(&Reverse(bits)) = self.ends.peek() else {
                self.at = now;
                return;
            };
            let next = f64::from_bits(bits);
            let rate = per_transfer_bps(&self.curve, self.ends.len());
            let reached = self.at + (next - self.served).max(0.0) / rate;
            if reached > now {
                self.served += (now - self.at) * rate;
                self.at = now;
                return;
            }
            self.served = self.served.max(next);
            self.at = reached;
            self.ends.pop();
        }
    }

    /// A transfer of `bytes` starts at `now`; returns the value of `served` at which it ends.
    pub fn start(&mut self, now: f64, bytes: u64) -> f64 {
        self.advance(now);
        let end = self.served + bytes as f64;
        self.ends.push(Reverse(end.to_bits()));
        end
    }

    /// Seconds from `now` until a transfer ending at `end` completes if no other transfer starts
    /// (those in progress leave on the way, each at its own end, and the rest speed up); 0 when
    /// it is complete. A start only pushes ends later, so a reader that sleeps this long never
    /// wakes after its end, and none needs waking when another leaves.
    pub fn remaining(&mut self, now: f64, end: f64) -> f64 {
        self.advance(now);
        if end <= self.served || self.ends.is_empty() {
            return 0.0;
        }
        let mut ends: Vec<f64> = self.ends.iter().map(|r| f64::from_bits(r.0)).collect();
        ends.sort_by(f64::total_cmp);
        let (mut served, mut left, mut seconds) = (self.served, ends.len(), 0.0);
        for e in ends {
            let rate = per_transfer_bps(&self.curve, left);
            if e >= end {
                return seconds + (end - served) / rate;
            }
            seconds += (e - served).max(0.0) / rate;
            served = served.max(e);
            left -= 1;
        }
        seconds + (end - served).max(0.0) / per_transfer_bps(&self.curve, 1)
    }
}

/// The shared bandwidth of a running file system: readers call [`Bandwidth::transfer`], which
/// sleeps for the transfer's share of t(γ).
#[derive(Debug)]
pub struct Bandwidth {
    state: Mutex<Sharing>,
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
        let end = self.lock().start(self.now(), bytes);
        loop {
            let left = self.lock().remaining(self.now(), end);
            if left <= MIN_WAIT_S {
                break;
            }
            std::thread::sleep(Duration::from_secs_f64(left));
        }
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
        // 25 MB left at t(1) = 60 MB/s.
        assert!((s.remaining(0.5, long) - 25.0 / 60.0).abs() < 1e-9);
    }

    #[test]
    fn a_transfer_leaves_when_its_bytes_are_served_not_when_its_reader_wakes() {
        // 25 and 50 MB at once, 50 MB/s each: the short one ends at 0.5 s. Its reader wakes
        // late, at 0.75 s: the long one was served alone from 0.5 s at t(1) = 60 MB/s.
        let mut s = Sharing::new(table());
        let short = s.start(0.0, 25_000_000);
        let long = s.start(0.0, 50_000_000);
        assert!((s.remaining(0.75, long) - (25.0 - 0.25 * 60.0) / 60.0).abs() < 1e-9);
        assert_eq!(s.active(), 1);
        assert_eq!(s.remaining(0.75, short), 0.0);
        // A transfer starting later shares with the long one only: both at t(2)/2 = 50 MB/s.
        let late = s.start(0.75, 5_000_000);
        assert!((s.remaining(0.75, late) - 0.1).abs() < 1e-9);
        assert!((s.remaining(0.85, long) - (10.0 - 5.0) / 60.0).abs() < 1e-9);
        assert_eq!(s.active(), 1);
        // Several leave between two looks: each at its own end.
        let mut s = Sharing::new(table());
        let ends: Vec<f64> = [10_000_000, 20_000_000, 40_000_000]
            .iter()
            .map(|&b| s.start(0.0, b))
            .collect();
        // t(3) = 130: 43.3 MB/s each until 10 MB (0.2308 s); t(2)/2 = 50 until 20 MB (+0.2 s);
        // then 60 MB/s alone for the last 20 MB (+0.3333 s).
        let all = 10.0 / (130.0 / 3.0) + 0.2 + 20.0 / 60.0;
        // Known from the start: the others leave on the way at their ends.
        assert!((s.remaining(0.0, ends[2]) - all).abs() < 1e-9);
        assert!((s.remaining(0.0, ends[0]) - 10.0 / (130.0 / 3.0)).abs() < 1e-9);
        assert!((s.remaining(0.5, ends[2]) - (all - 0.5)).abs() < 1e-9);
        assert_eq!(s.active(), 1);
        assert_eq!(s.remaining(all, ends[2]), 0.0);
        assert_eq!(s.active(), 0);
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
