//! How many staging fetches run at once: enough reads in flight to keep the file system busy,
//! sized from the model and from what the reads achieve, not from the number of cores.
//!
//! From the model. A file system that delivers t(γ) MB/s to γ concurrent transfers, with a
//! fixed latency `L` per open, is saturated at γ*, the fewest readers that reach (nearly) its
//! highest throughput. Each read of a typical sample of `s` bytes then spends `L` opening and
//! `s / (t(γ*)/γ*)` transferring, so keeping γ* transfers going takes
//! `γ* · (L + s/(t(γ*)/γ*)) / (s/(t(γ*)/γ*))` reads in flight (Little's law), shared between the
//! ranks of the node.
//!
//! From observations. The model's figure is where the [`Controller`] starts. It then measures the
//! staging throughput over windows in which the fetchers were busy (windows where they waited
//! for the consumer say nothing about the file system and are dropped) and climbs: one step up
//! (half the current level), kept when the throughput grew by at least [`Config::gain`],
//! otherwise undone, then held for a few windows before probing again. When the model's figures
//! for the file system are only defaults (unknown), a failed probe up is followed by a probe
//! down, kept when the throughput holds, so a figure that was too high comes down as well.
//! Where ranks share the file system, no step below the level they all started at is tried:
//! on a saturated file system the node would lose nothing, but the rank's part of the reads
//! would shrink while the others keep theirs, and synchronous training then waits for it at
//! every step (the ranks cannot step down together; as with known figures, the model's level is
//! the floor).
//!
//! Ranks adapt independently. Where the file system is saturated, one rank that adds reads
//! takes a larger share from the others, which looks like a gain to that rank; the saturation
//! estimate weighs a probe by the rank's part of the file system's reads, which counts every
//! rank of the job (nodes share the file system; counting only the node's ranks overstated a
//! rank's part, and on 4 emulated nodes ranks climbed to 32 reads where 2-15 each did as well). With
//! thousands of ranks one rank's probe barely moves the fetch time and the estimate says
//! little; [`Config::max`] bounds the result.
//!
//! [`Controller`] is pure logic over times in seconds that the caller passes in, so tests drive
//! it with synthetic figures; [`Gate`] applies it to threads (a permit per fetch).

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use crate::model::{Curve, SystemModel};
use crate::sysinfo::defaults;

/// The file system's figures as the model states them.
#[derive(Clone, Debug, PartialEq)]
pub struct FsFigures {
    /// t(γ), MB/s.
    pub read_mbps: Curve,
    /// Latency of each open, seconds.
    pub open_latency_s: f64,
    /// Typical sample size, bytes.
    pub typical_bytes: u64,
    /// Ranks reading the file system at once: this node's, or every node's when a job spans
    /// nodes that share the file system.
    pub ranks: u32,
    /// Whether the figures describe this file system (a configuration or a probe gave them), or
    /// are defaults that may be far off.
    pub known: bool,
}

/// Most readers considered when looking for the saturation point γ*.
const MAX_READERS: u32 = 4096;

/// γ*: the fewest concurrent readers at which t(γ) reaches 95% of its highest value.
pub fn saturating_readers(curve: &Curve) -> u32 {
    let peak = curve.0.iter().map(|p| p.1).fold(0.0_f64, f64::max);
    (1..=MAX_READERS)
        .find(|&g| curve.at(g as f64) >= 0.95 * peak)
        .unwrap_or(MAX_READERS)
}

/// Reads in flight on the whole node that keep the file system saturated (see the module docs).
pub fn node_reads_in_flight(f: &FsFigures) -> f64 {
    let g = saturating_readers(&f.read_mbps) as f64;
    let per_reader = f.read_mbps.at(g) * 1e6 / g; // bytes/s
    let s = f.typical_bytes.max(1) as f64;
    let transfer = s / per_reader.max(1e-9);
    g * (f.open_latency_s.max(0.0) + transfer) / transfer
}

/// Concurrent fetches for one rank from the model, within `[cfg.min, cfg.max]`; with
/// [`Config::headroom`] when the figures are known (unknown ones are only where the search
/// starts).
pub fn from_model(f: &FsFigures, cfg: &Config) -> usize {
    let headroom = if f.known { cfg.headroom } else { 1.0 };
    let per_rank = (headroom * node_reads_in_flight(f) / f.ranks.max(1) as f64).ceil();
    (per_rank as usize).clamp(cfg.min, cfg.max)
}

/// Tuning of the [`Controller`].
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// Fewest concurrent fetches the controller chooses.
    pub min: usize,
    /// Most concurrent fetches the controller chooses.
    pub max: usize,
    /// Reads in flight beyond the model's figure: the figure is the least that saturates the file
    /// system in theory, while a request's own overheads (the gap between open and read, the
    /// consumer's pauses) leave readers idle part of the time; extra readers on a saturated file
    /// system cost little, missing ones cost bandwidth.
    pub headroom: f64,
    /// A window closes after this long and [`Config::window_reads`] completions (or after
    /// [`Config::window_max_s`] whatever the count).
    pub window_s: f64,
    /// Completed reads a window needs before it closes (once [`Config::window_s`] has passed).
    pub window_reads: u64,
    /// Seconds after which a window closes whatever its count of reads.
    pub window_max_s: f64,
    /// Relative throughput gain that makes a step up worth keeping.
    pub gain: f64,
    /// Windows to wait after an undone probe before probing again.
    pub hold_windows: u32,
    /// A window counts when the fetchers were busy at least this share of the target on average.
    pub busy_share: f64,
    /// Staging that is this many samples ahead of the consumer (at least `far_min`, else
    /// `far_per_fetch` per fetch of the starting level) is not urgent: it runs at most `relaxed`
    /// fetches, and fewer than the target the closer it is to that mark, leaving the file system
    /// to ranks that are behind (the slowest rank sets the pace of synchronous training, and
    /// reads for a later epoch must not slow the current one).
    pub far_min: u64,
    /// Samples ahead per fetch of the starting level that make staging not urgent.
    pub far_per_fetch: u64,
    /// Most concurrent fetches while staging is not urgent (at least 1).
    pub relaxed: usize,
}

/// Most concurrent staging fetches of one rank.
pub const MAX_FETCHES: usize = 32;

/// Probe times ranks are spread over (see [`Controller::sharing`]): ranks in the same slot
/// probe together, so the first probe of a rank waits at most `2 * (STAGGER_SLOTS - 1)` windows
/// however many ranks a job has.
pub const STAGGER_SLOTS: u32 = 8;

impl Default for Config {
    fn default() -> Self {
        Config {
            min: 1,
            max: MAX_FETCHES,
            headroom: 1.5,
            window_s: 0.15,
            window_reads: 24,
            window_max_s: 1.0,
            gain: 0.08,
            hold_windows: 8,
            busy_share: 0.75,
            far_min: 128,
            far_per_fetch: 16,
            relaxed: 1,
        }
    }
}

/// What one window measured.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Window {
    /// Bytes/s staged.
    throughput: f64,
    /// Mean seconds per fetch.
    fetch_s: f64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Measure the current level, then probe.
    Measure,
    /// Trying a level above `from`, measured at `base`.
    Up { from: usize, base: Window },
    /// Trying a level below `from`, measured at `base`.
    Down { from: usize, base: Window },
    /// Keep the level for `left` more windows.
    Hold { left: u32 },
}

/// Chooses the number of concurrent staging fetches (see the module docs).
#[derive(Debug)]
pub struct Controller {
    cfg: Config,
    target: usize,
    /// The level staging's distance from the consumer is measured against (the starting one,
    /// the same for every rank that reads the file system the same way; see [`Controller::far`]).
    far_basis: usize,
    /// The file system's figures are defaults: probe down too.
    explore_down: bool,
    /// This rank's part of the file system's reads (1 / the ranks that read it).
    share: f64,
    phase: Phase,
    /// Windows to hold after the next failed probe: doubles while probes from one level keep
    /// failing (up to 16x the configured figure), back to the configured figure when the level
    /// changes for good.
    hold: u32,
    /// The level from which a probe down already failed: not tried again from there.
    down_failed_at: Option<usize>,
    // The open window.
    start: f64,
    bytes: u64,
    reads: u64,
    /// ∫ fetches in progress dt over the window, and the count and time of the last change.
    busy_integral: f64,
    busy: usize,
    busy_at: f64,
    /// Levels tried, for diagnostics and tests: (time, target, throughput of the window that led
    /// to it in bytes/s).
    pub history: Vec<(f64, usize, f64)>,
}

impl Controller {
    /// Starts at `initial` (clamped to the configured range) at time `now`.
    pub fn new(cfg: Config, initial: usize, explore_down: bool, now: f64) -> Controller {
        let target = initial.clamp(cfg.min, cfg.max);
        let hold = cfg.hold_windows;
        Controller {
            cfg,
            target,
            far_basis: target,
            explore_down,
            share: 1.0,
            phase: Phase::Measure,
            hold,
            down_failed_at: None,
            start: now,
            bytes: 0,
            reads: 0,
            busy_integral: 0.0,
            busy: 0,
            busy_at: now,
            history: vec![(now, target, 0.0)],
        }
    }

    /// Starts from the model's figures, as rank number `index` of the node's `f.ranks`.
    pub fn from_figures(cfg: Config, f: &FsFigures, index: u32, now: f64) -> Controller {
        let initial = from_model(f, &cfg);
        Controller::new(cfg, initial, !f.known, now).sharing(f.ranks, index)
    }

    /// This rank is number `index` of the `ranks` that read the same file system the same way
    /// (every rank of the job: nodes share it). Ranks then probe at different times (windows of
    /// different lengths, the first probe delayed by two windows per slot, in [`STAGGER_SLOTS`]
    /// slots by index): the saturation estimate of `Controller::node_gain` assumes that the
    /// other ranks held still.
    pub fn sharing(mut self, ranks: u32, index: u32) -> Controller {
        let ranks = ranks.max(1);
        self.share = 1.0 / ranks as f64;
        let slots = ranks.min(STAGGER_SLOTS);
        let slot = index % slots;
        self.cfg.window_s *= 1.0 + 0.3 * slot as f64 / slots as f64;
        if slot > 0 {
            self.phase = Phase::Hold { left: 2 * slot };
        }
        self
    }

    /// The number of concurrent fetches currently chosen.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Samples staging must be ahead of the consumer to be not urgent (see [`Config::far_min`]),
    /// per fetch of the starting level, not of the current one: ranks that share a file system
    /// start at the same level but climb apart, and a rank whose own climb moved its mark would
    /// read further ahead at full concurrency while the others wait for their next batches
    /// (synchronous training goes at the pace of the rank that is behind).
    pub fn far(&self) -> u64 {
        self.cfg.far_min.max(self.cfg.far_per_fetch * self.far_basis as u64)
    }

    /// Fetches allowed at once when staging is `ahead` samples ahead of the consumer: the
    /// target when nothing is staged, fewer the further ahead staging is, `relaxed` from
    /// [`Controller::far`] on. Where ranks share a saturated file system each one's part of it
    /// follows its fetches in flight; a rank further ahead than the others then gives way to
    /// them, so that their next batches are not read after its later ones.
    pub fn allowed(&self, ahead: u64) -> usize {
        let relaxed = self.cfg.relaxed.clamp(1, self.target.max(1));
        let far = self.far();
        if ahead >= far {
            return relaxed;
        }
        let left = (self.target as u64 * (far - ahead)).div_ceil(far) as usize;
        left.max(relaxed)
    }

    /// The tuning this controller runs with.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    fn account_busy(&mut self, now: f64) {
        if now > self.busy_at {
            self.busy_integral += self.busy as f64 * (now - self.busy_at);
            self.busy_at = now;
        }
    }

    /// A fetch started at `now`.
    pub fn fetch_started(&mut self, now: f64) {
        self.account_busy(now);
        self.busy += 1;
    }

    /// A fetch of `bytes` ended at `now`. Returns true when the target changed.
    pub fn fetch_ended(&mut self, now: f64, bytes: u64) -> bool {
        self.account_busy(now);
        self.busy = self.busy.saturating_sub(1);
        self.bytes += bytes;
        self.reads += 1;
        let length = now - self.start;
        let full = length >= self.cfg.window_s && self.reads >= self.cfg.window_reads;
        if !(full || length >= self.cfg.window_max_s) {
            return false;
        }
        let w = Window {
            throughput: self.bytes as f64 / length.max(1e-9),
            // Little's law: fetches in progress on average / completions per second.
            fetch_s: self.busy_integral / self.reads.max(1) as f64,
        };
        let busy = self.busy_integral / length.max(1e-9);
        self.start = now;
        self.bytes = 0;
        self.reads = 0;
        self.busy_integral = 0.0;
        if busy < self.cfg.busy_share * self.target as f64 {
            // The fetchers waited (for the consumer, for ring space): the window says nothing
            // about the file system.
            return false;
        }
        self.window(now, w)
    }

    /// The node's throughput after a move from `base` (at level `from`) to `now` (at the current
    /// level), relative to before, if every rank of the node made the same move.
    ///
    /// This rank's own throughput overstates a gain where the file system is saturated: its
    /// extra reads take bandwidth from the other ranks. The fetch time tells how saturated the
    /// file system is: there, a transfer's time grows with the reads in flight on the node, and
    /// this rank's move changed those by `(k - 1) * share` (k: the level's ratio, share: this
    /// rank's part of the file system's reads), so `(w - 1) / ((k - 1) * share)` (w: the fetch time's
    /// ratio) estimates the saturation σ in [0, 1]; all ranks moving by k then give the node
    /// `k / (1 + (k - 1) σ)`.
    fn node_gain(&self, from: usize, base: Window, now: Window) -> f64 {
        let k = self.target as f64 / from.max(1) as f64;
        if (k - 1.0).abs() < 1e-9 || base.fetch_s <= 0.0 {
            return 1.0;
        }
        let w = now.fetch_s / base.fetch_s;
        let sigma = ((w - 1.0) / ((k - 1.0) * self.share)).clamp(0.0, 1.0);
        k / (1.0 + (k - 1.0) * sigma)
    }

    fn set(&mut self, now: f64, target: usize, throughput: f64) -> bool {
        let target = target.clamp(self.cfg.min, self.cfg.max);
        let changed = target != self.target;
        self.target = target;
        if changed {
            self.history.push((now, target, throughput));
        }
        changed
    }

    fn step(&self) -> usize {
        (self.target / 2).max(1)
    }

    /// Hold the level after a failed probe, longer each time probes from it fail.
    fn hold_after_failure(&mut self) {
        self.phase = Phase::Hold { left: self.hold };
        self.hold = (self.hold * 2).min(self.cfg.hold_windows * 16);
    }

    /// One saturated window at the current target.
    fn window(&mut self, now: f64, cur: Window) -> bool {
        let gain = self.cfg.gain;
        let x = cur.throughput;
        match self.phase {
            Phase::Measure => self.probe_up(now, cur),
            Phase::Up { from, base } => {
                let down = from.saturating_sub((from / 3).max(1));
                if x >= base.throughput * (1.0 + gain) && self.node_gain(from, base, cur) >= 1.0 + gain {
                    // Worth it: keep, and try further up.
                    self.hold = self.cfg.hold_windows;
                    self.down_failed_at = None;
                    self.probe_up(now, cur)
                } else if self.explore_down
                    && from > self.cfg.min
                    && self.down_failed_at != Some(from)
                    && self.may_step_to(down)
                {
                    self.phase = Phase::Down { from, base };
                    self.set(now, down, x)
                } else {
                    self.hold_after_failure();
                    self.set(now, from, x)
                }
            }
            Phase::Down { from, base } => {
                if self.node_gain(from, base, cur) >= 1.0 - gain / 2.0 {
                    // As fast with fewer: keep the lower level.
                    self.hold = self.cfg.hold_windows;
                    self.phase = Phase::Hold { left: self.hold };
                    false
                } else {
                    self.down_failed_at = Some(from);
                    self.hold_after_failure();
                    self.set(now, from, x)
                }
            }
            Phase::Hold { left } => {
                self.phase = if left <= 1 {
                    Phase::Measure
                } else {
                    Phase::Hold { left: left - 1 }
                };
                false
            }
        }
    }

    /// Whether a step down to `level` may be tried. Not below the level every rank started at
    /// where ranks share the file system: a lower level keeps a saturated file system's
    /// throughput but hands part of this rank's reads to the others, which do not move with it,
    /// and synchronous training then waits for this rank at every step. Kept only if the rank's
    /// own throughput held, such a step was undone on a saturated file system, after a window
    /// at the lower share that let this rank fall behind.
    fn may_step_to(&self, level: usize) -> bool {
        self.share >= 1.0 || level >= self.far_basis
    }

    fn probe_up(&mut self, now: f64, cur: Window) -> bool {
        if self.target >= self.cfg.max {
            self.phase = Phase::Hold { left: self.hold };
            return false;
        }
        self.phase = Phase::Up {
            from: self.target,
            base: cur,
        };
        let up = self.target + self.step();
        self.set(now, up, cur.throughput)
    }
}

/// The file system's figures in `model`, for samples of `typical_bytes` read by `ranks` ranks of
/// this node. They count as known unless they are the detected defaults.
pub fn figures(model: &SystemModel, typical_bytes: u64, ranks: u32) -> FsFigures {
    let known = model.pfs.read_mbps != defaults::pfs_read() || model.pfs.open_latency_s != defaults::PFS_OPEN_LATENCY_S;
    FsFigures {
        read_mbps: model.pfs.read_mbps.clone(),
        open_latency_s: model.pfs.open_latency_s,
        typical_bytes,
        ranks,
        known,
    }
}

/// The gate of the staging fetches of rank number `index` of the `ranks` that read the file
/// system (the node's, or the job's when it spans nodes) under `model`:
/// up to [`MAX_FETCHES`] (or the configured `staging.threads` when more), starting from the
/// model's figure.
pub fn staging_gate(model: &SystemModel, typical_bytes: u64, ranks: u32, index: u32) -> Gate {
    let cfg = Config {
        max: MAX_FETCHES.max(model.staging.threads as usize),
        ..Config::default()
    };
    let f = figures(model, typical_bytes, ranks);
    Gate::new(move |now| Controller::from_figures(cfg, &f, index, now))
}

/// Applies a [`Controller`] to threads: at most `target` permits are out at once.
#[derive(Debug)]
pub struct Gate {
    state: Mutex<GateState>,
    freed: Condvar,
    origin: Instant,
}

#[derive(Debug)]
struct GateState {
    ctl: Controller,
    out: usize,
    closed: bool,
}

/// The right to run one fetch; returned to the gate on drop.
pub struct Permit<'a> {
    gate: &'a Gate,
    started: bool,
}

impl Gate {
    /// A gate whose controller `make` builds, given the gate's clock at start (0 s).
    pub fn new(make: impl FnOnce(f64) -> Controller) -> Gate {
        Gate {
            state: Mutex::new(GateState {
                ctl: make(0.0),
                out: 0,
                closed: false,
            }),
            freed: Condvar::new(),
            origin: Instant::now(),
        }
    }

    fn now(&self) -> f64 {
        self.origin.elapsed().as_secs_f64()
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Threads worth starting: the most permits the controller can give.
    pub fn max_threads(&self) -> usize {
        self.lock().ctl.config().max
    }

    /// Samples staging must be ahead of the consumer to be not urgent ([`Controller::far`]).
    pub fn far(&self) -> u64 {
        self.lock().ctl.far()
    }

    /// The current number of concurrent fetches allowed.
    pub fn target(&self) -> usize {
        self.lock().ctl.target()
    }

    /// Levels chosen so far: (seconds since start, fetches, throughput in bytes/s).
    pub fn history(&self) -> Vec<(f64, usize, f64)> {
        self.lock().ctl.history.clone()
    }

    /// Waits for a permit; None once the gate is closed. `ahead` tells how many samples staging
    /// is ahead of the consumer (see [`Controller::allowed`]); it is asked again on every wake-up.
    pub fn acquire(&self, ahead: impl Fn() -> u64) -> Option<Permit<'_>> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            if st.out < st.ctl.allowed(ahead()) {
                st.out += 1;
                return Some(Permit {
                    gate: self,
                    started: false,
                });
            }
            st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Wakes every waiter; later `acquire` calls return None.
    pub fn close(&self) {
        self.lock().closed = true;
        self.freed.notify_all();
    }
}

impl Permit<'_> {
    /// The fetch begins (work was found for it).
    pub fn start(&mut self) {
        if !self.started {
            self.started = true;
            let now = self.gate.now();
            self.gate.lock().ctl.fetch_started(now);
        }
    }

    /// The fetch brought `bytes` into staging.
    pub fn finish(mut self, bytes: u64) {
        if self.started {
            self.started = false;
            let now = self.gate.now();
            let grew = self.gate.lock().ctl.fetch_ended(now, bytes);
            if grew {
                self.gate.freed.notify_all();
            }
        }
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        let mut st = self.gate.lock();
        if self.started {
            // Abandoned: no throughput to report, but the fetch is no longer in progress.
            let now = self.gate.now();
            st.ctl.account_busy(now);
            st.ctl.busy = st.ctl.busy.saturating_sub(1);
        }
        st.out -= 1;
        drop(st);
        self.gate.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Curve {
        Curve(vec![(1.0, 60.0), (2.0, 100.0), (4.0, 160.0), (8.0, 200.0)])
    }

    fn table_figures(ranks: u32, known: bool) -> FsFigures {
        FsFigures {
            read_mbps: table(),
            open_latency_s: 2e-3,
            typical_bytes: 100_000,
            ranks,
            known,
        }
    }

    #[test]
    fn saturation_point_of_the_table() {
        // 95% of 200 MB/s = 190: reached between 4 (160) and 8 (200) readers, at 7 (190).
        assert_eq!(saturating_readers(&table()), 7);
        assert_eq!(saturating_readers(&Curve::constant(500.0)), 1);
        assert_eq!(saturating_readers(&Curve::linear_up_to(200.0, 10)), 10);
    }

    #[test]
    fn model_sizes_reads_from_latency_and_bandwidth() {
        // γ* = 7 at 190 MB/s: 27.1 MB/s per reader, 100 KB in 3.68 ms, plus 2 ms to open:
        // 7 · 5.68 / 3.68 = 10.8 reads in flight on the node; with headroom 1.5, 5 per rank of 4.
        let f = table_figures(4, true);
        let n = node_reads_in_flight(&f);
        assert!((n - 10.8).abs() < 0.1, "{n}");
        let cfg = Config::default();
        assert_eq!(from_model(&f, &cfg), 5);
        assert_eq!(from_model(&table_figures(1, true), &cfg), 17);
        let exact = Config {
            headroom: 1.0,
            ..Config::default()
        };
        assert_eq!(from_model(&f, &exact), 3);
        assert_eq!(from_model(&table_figures(1, true), &exact), 11);
        // Unknown figures are a starting point: no headroom.
        assert_eq!(from_model(&table_figures(4, false), &cfg), 3);
        // Longer latency needs more in flight; tiny files are all latency.
        let slow = FsFigures {
            open_latency_s: 20e-3,
            ..table_figures(1, true)
        };
        assert!(from_model(&slow, &cfg) > 30);
        assert_eq!(from_model(&slow, &cfg), cfg.max);
        let local = FsFigures {
            read_mbps: Curve::constant(5000.0),
            open_latency_s: 0.0,
            ..table_figures(4, true)
        };
        assert_eq!(from_model(&local, &cfg), 1);
    }

    /// A synthetic file system: `in_flight` reads share `t(in_flight)` (with latency L per read
    /// of s bytes), so a rank with n fetches gets n·s / (L + s·n/t(n)) bytes/s.
    fn synthetic(n: usize, peak_readers: f64) -> f64 {
        let c = Curve(vec![(1.0, 60.0), (2.0, 100.0), (4.0, 160.0), (peak_readers, 200.0)]);
        let s = 100_000.0;
        let l = 2e-3;
        // Readers in transfer γ solve γ = n·(s/(t(γ)/γ)) / (L + s/(t(γ)/γ)); iterate.
        let mut g = n as f64;
        for _ in 0..100 {
            let per = c.at(g.max(1.0)) * 1e6 / g.max(1.0);
            let x = s / per;
            g = n as f64 * x / (l + x);
        }
        let per = c.at(g.max(1.0)) * 1e6 / g.max(1.0);
        n as f64 * s / (l + s / per)
    }

    /// Drives a controller against `fs(n) -> bytes/s` with fetchers always busy, for `seconds`.
    fn drive(ctl: &mut Controller, seconds: f64, fs: impl Fn(usize) -> f64) {
        let s = 100_000u64;
        let (mut now, mut busy) = (0.0, 0);
        while now < seconds {
            let n = ctl.target();
            while busy < n {
                ctl.fetch_started(now);
                busy += 1;
            }
            now += s as f64 / fs(busy);
            ctl.fetch_ended(now, s);
            busy -= 1;
        }
    }

    /// Seconds per read of 100 KB with `n` reads in flight on the node of the table's file
    /// system (2 ms per open, processor sharing of t(γ) between transfers).
    fn node_read_seconds(n: f64) -> f64 {
        let (s, l) = (100_000.0, 2e-3);
        let c = table();
        let mut g = n.max(1.0);
        for _ in 0..200 {
            let x = s / (c.at(g.max(1.0)) * 1e6 / g.max(1.0));
            g = 0.5 * g + 0.5 * (n * x / (l + x)).max(1e-9);
        }
        l + s / (c.at(g.max(1.0)) * 1e6 / g.max(1.0))
    }

    /// Ranks sharing one synthetic file system, in steps of 1 ms, for `seconds`; returns the
    /// node's throughput over the last second, bytes/s.
    fn drive_node(ctls: &mut [Controller], seconds: f64) -> f64 {
        let dt = 1e-3;
        let mut busy = vec![0usize; ctls.len()];
        let mut due = vec![0.0f64; ctls.len()];
        let (mut now, mut last_second) = (0.0, 0u64);
        while now < seconds {
            for (i, c) in ctls.iter_mut().enumerate() {
                while busy[i] < c.target() {
                    c.fetch_started(now);
                    busy[i] += 1;
                }
            }
            let n: usize = busy.iter().sum();
            let w = node_read_seconds(n as f64);
            now += dt;
            for (i, c) in ctls.iter_mut().enumerate() {
                due[i] += busy[i] as f64 * dt / w;
                while due[i] >= 1.0 && busy[i] > 0 {
                    due[i] -= 1.0;
                    busy[i] -= 1;
                    c.fetch_ended(now, 100_000);
                    if now > seconds - 1.0 {
                        last_second += 100_000;
                    }
                }
            }
        }
        last_second as f64
    }

    #[test]
    fn ranks_of_a_node_stop_where_the_node_saturates() {
        for start in [1, 8] {
            let mut ctls: Vec<Controller> = (0..4)
                .map(|i| Controller::new(Config::default(), start, true, 0.0).sharing(4, i))
                .collect();
            let rate = drive_node(&mut ctls, 30.0);
            let total: usize = ctls.iter().map(|c| c.target()).sum();
            let histories: Vec<_> = ctls.iter().map(|c| &c.history).collect();
            // The node saturates at about 11 reads in flight (see the model test); without the
            // saturation estimate the ranks would climb to 4 x 32.
            let most = 28.max(4 * start);
            assert!(
                (8..=most).contains(&total),
                "start {start}: {total} in flight, {histories:?}"
            );
            // None ends below the level all started at: there, each one's part of the saturated
            // file system would shrink, and the ranks that stayed would wait for it at every step.
            for c in &ctls {
                assert!(c.target() >= start, "start {start}: {histories:?}");
            }
            assert!(rate > 0.9 * 200e6, "start {start}: {rate}");
        }
    }

    /// The model detected on a 2-core machine with 8 GiB and no configuration.
    fn detected_model() -> SystemModel {
        let machine = crate::sysinfo::Machine {
            mem_total: Some(8 << 30),
            mem_available: Some(4 << 30),
            cpus: 2,
        };
        SystemModel::detect_on(&machine, None)
    }

    #[test]
    fn ranks_of_several_nodes_share_the_file_system_s_reads() {
        // 4 nodes x 2 ranks on one file system with the detected defaults, as the engine sets
        // them up: the model's reads in flight divided by the job's 8 ranks, each rank 1/8 of
        // the reads. Divided by the node's 2 ranks, the ranks started (and stayed) at 15 each,
        // 120 reads in flight where about 11 saturate; on 4 emulated nodes some climbed to 32.
        // Starting at 4 each, they now end at 9-13 (84 in all; 69 while a rank could also step
        // below the start, see `may_step_to`).
        let m = detected_model();
        let f = figures(&m, 100_000, 8);
        let mut ctls: Vec<Controller> = (0..8)
            .map(|i| Controller::from_figures(Config::default(), &f, i, 0.0))
            .collect();
        let rate = drive_node(&mut ctls, 30.0);
        let levels: Vec<usize> = ctls.iter().map(|c| c.target()).collect();
        assert!(
            levels.iter().sum::<usize>() <= 96,
            "levels {levels:?}, {:?}",
            ctls.iter().map(|c| &c.history).collect::<Vec<_>>()
        );
        assert!(rate > 0.9 * 200e6, "{rate}");
    }

    #[test]
    fn probes_are_spread_over_a_few_slots_whatever_the_ranks() {
        // Rank 8,191 of 8,192 probes within the first 2 * (STAGGER_SLOTS - 1) windows, not
        // after thousands.
        let ctl = Controller::new(Config::default(), 1, true, 0.0).sharing(8192, 8191);
        assert_eq!(
            ctl.phase,
            Phase::Hold {
                left: 2 * (STAGGER_SLOTS - 1)
            }
        );
        assert!(ctl.config().window_s < 1.3 * Config::default().window_s);
        let first = Controller::new(Config::default(), 1, true, 0.0).sharing(8192, 8192);
        assert_eq!(first.phase, Phase::Measure);
    }

    #[test]
    fn unknown_figures_climb_to_saturation_and_stop() {
        let mut ctl = Controller::new(Config::default(), 2, true, 0.0);
        drive(&mut ctl, 20.0, |n| synthetic(n, 8.0));
        let t = ctl.target();
        // Saturation of the synthetic file system for one rank: about 11 reads in flight.
        assert!((9..=24).contains(&t), "target {t}, history {:?}", ctl.history);
        assert!(synthetic(t, 8.0) > 0.9 * 200e6, "{}", synthetic(t, 8.0));
    }

    #[test]
    fn a_file_system_that_gets_slower_with_readers_is_backed_off() {
        // Throughput peaks at 6 readers and falls beyond (contention).
        let fs = |n: usize| {
            let n = n as f64;
            if n <= 6.0 {
                n * 30e6
            } else {
                180e6 * (1.0 - 0.05 * (n - 6.0))
            }
        };
        let mut ctl = Controller::new(Config::default(), 16, true, 0.0);
        drive(&mut ctl, 30.0, fs);
        let t = ctl.target();
        assert!((4..=9).contains(&t), "target {t}, history {:?}", ctl.history);
    }

    #[test]
    fn known_figures_start_at_the_model_and_do_not_go_below() {
        let cfg = Config::default();
        let mut ctl = Controller::from_figures(cfg, &table_figures(1, true), 0, 0.0);
        assert_eq!(ctl.target(), 17);
        // A flat file system: no step up pays, and known figures are not probed below.
        drive(&mut ctl, 20.0, |_| 200e6);
        assert_eq!(ctl.target(), 17, "{:?}", ctl.history);
    }

    #[test]
    fn a_rank_that_shares_the_file_system_does_not_step_below_the_start() {
        // A file system that gives this rank the same throughput at any level: saturated by
        // the others' reads. Alone, the rank comes down from 12; sharing it, it stays.
        let flat = |_: usize| 200e6;
        let mut alone = Controller::new(Config::default(), 12, true, 0.0);
        drive(&mut alone, 30.0, flat);
        assert!(alone.target() < 12, "{:?}", alone.history);
        let mut shared = Controller::new(Config::default(), 12, true, 0.0).sharing(4, 0);
        drive(&mut shared, 30.0, flat);
        assert!(shared.history.iter().all(|&(_, t, _)| t >= 12), "{:?}", shared.history);
    }

    #[test]
    fn idle_windows_change_nothing() {
        let mut ctl = Controller::new(Config::default(), 4, true, 0.0);
        // One fetch at a time while the target is 4: the consumer is the limit.
        let mut now = 0.0;
        for _ in 0..1000 {
            ctl.fetch_started(now);
            now += 0.01;
            ctl.fetch_ended(now, 100_000);
        }
        assert_eq!(ctl.target(), 4);
        assert_eq!(ctl.history.len(), 1);
    }

    #[test]
    fn staging_far_ahead_runs_few_fetches() {
        let ctl = Controller::new(Config::default(), 8, true, 0.0);
        assert_eq!(ctl.far(), 128);
        assert_eq!(ctl.allowed(0), 8);
        // Fewer the further ahead: half way, half the target.
        assert_eq!(ctl.allowed(64), 4);
        assert_eq!(ctl.allowed(127), 1);
        assert_eq!(ctl.allowed(128), 1);
        assert!(
            (0..200).all(|a| ctl.allowed(a + 1) <= ctl.allowed(a)),
            "never more fetches further ahead"
        );
        let wide = Config {
            max: 64,
            ..Config::default()
        };
        let ctl = Controller::new(wide, 64, true, 0.0);
        assert_eq!(ctl.far(), 1024);
        assert_eq!(ctl.allowed(0), 64);
        assert_eq!(ctl.allowed(768), 16);
        assert_eq!(ctl.allowed(1024), 1);
        let one = Controller::new(Config::default(), 1, true, 0.0);
        assert_eq!(one.allowed(10_000), 1);
        // Through the gate: with staging far ahead only `relaxed` permits go out.
        let gate = Gate::new(|now| Controller::new(Config::default(), 8, false, now));
        let held: Vec<_> = (0..1).map(|_| gate.acquire(|| 1000).unwrap()).collect();
        let far = std::sync::atomic::AtomicU64::new(1000);
        std::thread::scope(|s| {
            let h = s.spawn(|| gate.acquire(|| far.load(std::sync::atomic::Ordering::SeqCst)).is_some());
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(!h.is_finished(), "a second permit went out while far ahead");
            // The consumer caught up; a permit coming back wakes the waiter, which re-checks.
            far.store(0, std::sync::atomic::Ordering::SeqCst);
            drop(held);
            assert!(h.join().unwrap());
        });
    }

    #[test]
    fn a_rank_that_climbed_reads_no_further_ahead_than_the_others() {
        // Two ranks on one file system start at the same level; one climbs to 4x. Its mark of
        // "far ahead" stays the other's, and as far ahead it gets as few fetches.
        let cfg = Config {
            max: 128,
            ..Config::default()
        };
        let mut climbed = Controller::new(cfg.clone(), 32, true, 0.0).sharing(2, 0);
        let stayed = Controller::new(cfg, 32, true, 0.0).sharing(2, 1);
        assert!(climbed.set(1.0, 128, 1e8));
        assert_eq!(climbed.far(), stayed.far());
        assert_eq!(climbed.allowed(climbed.far()), 1);
        // Near the far mark the climbed rank gives way: fewer fetches than the other rank runs
        // with nothing staged.
        let near = climbed.far() * 7 / 8;
        assert!(
            climbed.allowed(near) < stayed.allowed(0),
            "{} >= {}",
            climbed.allowed(near),
            stayed.allowed(0)
        );
    }

    #[test]
    fn targets_stay_in_range() {
        let cfg = Config {
            min: 2,
            max: 6,
            ..Config::default()
        };
        let mut ctl = Controller::new(cfg.clone(), 100, true, 0.0);
        assert_eq!(ctl.target(), 6);
        drive(&mut ctl, 10.0, |n| n as f64 * 10e6);
        assert_eq!(ctl.target(), 6);
        let mut ctl = Controller::new(cfg, 0, true, 0.0);
        assert_eq!(ctl.target(), 2);
        drive(&mut ctl, 10.0, |_| 1e6);
        assert!(ctl.target() >= 2);
    }

    #[test]
    fn detected_defaults_are_unknown_figures() {
        let mut m = detected_model();
        assert!(!figures(&m, 100_000, 4).known);
        m.pfs.read_mbps = table();
        let f = figures(&m, 100_000, 4);
        assert!(f.known);
        assert_eq!(f.ranks, 4);
        m.staging.threads = 64;
        assert_eq!(staging_gate(&m, 100_000, 4, 0).max_threads(), 64);
        m.staging.threads = 2;
        let g = staging_gate(&m, 100_000, 1, 0);
        assert_eq!(g.max_threads(), MAX_FETCHES);
        assert_eq!(g.target(), from_model(&figures(&m, 100_000, 1), &Config::default()));
    }

    #[test]
    fn gate_limits_permits_and_close_wakes_waiters() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let gate = Gate::new(|now| Controller::new(Config::default(), 3, false, now));
        assert_eq!(gate.max_threads(), MAX_FETCHES);
        let peak = AtomicUsize::new(0);
        let now = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..20 {
                        let Some(mut p) = gate.acquire(|| 0) else { return };
                        p.start();
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        peak.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_micros(200));
                        now.fetch_sub(1, Ordering::SeqCst);
                        p.finish(1000);
                    }
                });
            }
        });
        assert!(peak.load(Ordering::SeqCst) <= gate.target().max(3));
        // All permits returned: close wakes a waiter and refuses new ones.
        let p: Vec<_> = (0..gate.target()).map(|_| gate.acquire(|| 0).unwrap()).collect();
        std::thread::scope(|s| {
            let h = s.spawn(|| gate.acquire(|| 0).is_none());
            std::thread::sleep(std::time::Duration::from_millis(20));
            gate.close();
            assert!(h.join().unwrap());
        });
        drop(p);
        assert!(gate.acquire(|| 0).is_none());
    }
}
