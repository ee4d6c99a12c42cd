//! Each policy's defining behaviour on tiny scenarios whose results can be checked by hand.

use std::path::Path;

use clairvoyant_sim::{scenario, simulate, Policy, PolicyResult, Progress, Report, Scenario};

/// 1 MB samples, c = 10 MB/s (0.1 s per sample of compute), β = 100 MB/s (0.01 s per sample),
/// a PFS of 50 MB/s flat with 2 ms per open (0.022 s per sample for one reader), no classes.
const BASE: &str = r#"
workers = 1
epochs = 2
batch_size = 2
[dataset]
samples = 4
mean = "1MB"
std = 0
[system]
compute_mbps = 10
preprocess_mbps = 100
class = []
[system.staging]
capacity = "100MB"
threads = 1
write_mbps = 1000000
[system.pfs]
read_mbps = 50
open_latency_ms = 2
"#;

fn scenario(extra: &[(&str, &str)]) -> Scenario {
    let mut doc = scenario::from_toml_str(BASE, Path::new("test.toml")).unwrap();
    for (k, v) in extra {
        scenario::set(&mut doc, k, v).unwrap();
    }
    Scenario::from_doc(&doc).unwrap()
}

fn with_classes(extra: &[(&str, &str)], classes: &str) -> Scenario {
    let text = format!("{BASE}\n{classes}").replace("class = []\n", "");
    let mut doc = scenario::from_toml_str(&text, Path::new("test.toml")).unwrap();
    for (k, v) in extra {
        scenario::set(&mut doc, k, v).unwrap();
    }
    Scenario::from_doc(&doc).unwrap()
}

fn run(sc: &Scenario, p: Policy) -> PolicyResult {
    let report: Report = simulate(sc, &[p], &Progress::default()).unwrap();
    report.policies.into_iter().find(|r| r.policy == p).unwrap()
}

fn total(r: &PolicyResult) -> f64 {
    r.total_seconds
        .unwrap_or_else(|| panic!("{} failed: {:?}", r.policy, r.error))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * b.abs().max(1.0)
}

const FETCH: f64 = 0.002 + 1.0 / 50.0; // one reader
const PREP: f64 = 0.01;
const COMPUTE: f64 = 0.1;

#[test]
fn perfect_is_compute_only() {
    let r = run(&scenario(&[]), Policy::Perfect);
    assert!(close(total(&r), 2.0 * 4.0 * COMPUTE), "{}", total(&r));
    assert_eq!(r.stall_seconds, 0.0);
}

#[test]
fn naive_equals_the_analytic_sum() {
    // No overlap: every batch is read (one sample after the other) and then computed.
    let r = run(&scenario(&[]), Policy::Naive);
    let expect = 2.0 * 4.0 * (FETCH + PREP + COMPUTE);
    assert!(close(total(&r), expect), "{} vs {expect}", total(&r));
    assert_eq!(r.pfs_bytes, 8_000_000);

    // Two workers read at the same time: t(2)/2 = 25 MB/s each; the slowest sets the pace.
    let r = run(&scenario(&[("workers", "2"), ("dataset.samples", "8")]), Policy::Naive);
    let expect = 2.0 * 2.0 * (2.0 * (0.002 + 1.0 / 25.0 + PREP) + 2.0 * COMPUTE);
    assert!(close(total(&r), expect), "{} vs {expect}", total(&r));
}

#[test]
fn staging_buffer_overlaps_reads_with_compute() {
    // Reads (0.032 s each) run ahead of compute: only the first batch is waited for.
    let r = run(&scenario(&[]), Policy::StagingBuffer);
    let expect = 2.0 * (FETCH + PREP) + 8.0 * COMPUTE;
    assert!(close(total(&r), expect), "{} vs {expect}", total(&r));
    assert_eq!(r.pfs_bytes, 8_000_000, "reads every epoch from the PFS");

    // A staging buffer of one batch cannot read ahead: no better than Naive.
    let one = run(
        &scenario(&[("system.staging.capacity", "\"2MB\"")]),
        Policy::StagingBuffer,
    );
    let naive = run(&scenario(&[]), Policy::Naive);
    assert!(
        close(total(&one), total(&naive)),
        "{} vs {}",
        total(&one),
        total(&naive)
    );
}

#[test]
fn staging_buffer_from_a_class_reads_no_pfs() {
    let sc = with_classes(
        &[("staging_buffer_source", "\"ram\"")],
        "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"1GB\"\nthreads = 1\nread_mbps = 1000\nwrite_mbps = 1000",
    );
    let r = run(&sc, Policy::StagingBuffer);
    assert_eq!(r.pfs_bytes, 0);
    let tiny = with_classes(
        &[("staging_buffer_source", "\"ram\"")],
        "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"1MB\"\nthreads = 1",
    );
    let r = run(&tiny, Policy::StagingBuffer);
    assert!(
        r.error.as_deref().unwrap().contains("does not fit class 'ram'"),
        "{:?}",
        r.error
    );
}

const RAM: &str =
    "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"1GB\"\nthreads = 1\nread_mbps = 1000\nwrite_mbps = 1000";

#[test]
fn clairvoyant_reads_each_sample_once_and_beats_staging() {
    let sc = with_classes(&[("epochs", "5")], RAM);
    let c = run(&sc, Policy::Clairvoyant);
    assert_eq!(c.pfs_bytes, 4_000_000, "the node reads each sample once");
    let s = run(&sc, Policy::StagingBuffer);
    assert_eq!(s.pfs_bytes, 20_000_000);
    assert!(total(&c) <= total(&s));
    assert!(c.full_randomization);
    // No class: the PFS every epoch, like the staging buffer.
    let none = run(&scenario(&[("epochs", "5")]), Policy::Clairvoyant);
    assert_eq!(none.pfs_bytes, 20_000_000);
}

#[test]
fn clairvoyant_fetches_from_peers() {
    // Two nodes that each cache the whole dataset: with an interconnect, a node copies from
    // its peer what the peer already read, so the PFS is read less than once per node.
    let extra = [("workers", "2"), ("dataset.samples", "64"), ("epochs", "4")];
    let alone = run(&with_classes(&extra, RAM), Policy::Clairvoyant);
    assert!(alone.pfs_bytes > 64_000_000, "samples both nodes need are read by both");
    let mut linked = extra.to_vec();
    linked.push(("system.interconnect_mbps", "10000"));
    let peers = run(&with_classes(&linked, RAM), Policy::Clairvoyant);
    assert!(
        peers.pfs_bytes < alone.pfs_bytes,
        "{} vs {}",
        peers.pfs_bytes,
        alone.pfs_bytes
    );
    assert!(
        peers.pfs_bytes >= 64_000_000,
        "every sample is read from the PFS at least once"
    );
}

#[test]
fn lbann_refuses_datasets_beyond_aggregate_memory() {
    let small = "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"3MB\"\nthreads = 1";
    for p in [Policy::LbannDynamic, Policy::LbannPreloading] {
        let r = run(&with_classes(&[], small), p);
        assert!(r.total_seconds.is_none());
        assert!(
            r.error.as_deref().unwrap().contains("exceeds the aggregate memory"),
            "{:?}",
            r.error
        );
        let ok = run(&with_classes(&[], RAM), p);
        assert!(ok.error.is_none() && ok.pfs_bytes == 4_000_000, "{p}: {:?}", ok);
    }
    // Preloading: the whole dataset before training, then memory only.
    let r = run(&with_classes(&[("epochs", "3")], RAM), Policy::LbannPreloading);
    assert!(r.preload_seconds > 0.0);
    assert!(r.samples_by_location.iter().all(|(n, _)| n != "pfs"));
}

#[test]
fn parallel_staging_never_reads_the_pfs_after_staging() {
    let sc = with_classes(&[("workers", "2"), ("dataset.samples", "16"), ("epochs", "3")], RAM);
    let r = run(&sc, Policy::ParallelStaging);
    assert!(r.preload_seconds > 0.0);
    assert_eq!(r.pfs_bytes, 16_000_000, "each shard copied once");
    assert!(
        r.samples_by_location.iter().all(|(n, _)| n != "pfs"),
        "{:?}",
        r.samples_by_location
    );
    assert!(!r.full_randomization, "workers see only their shard");
    // Storage for half a shard: the rest of the dataset is never trained on.
    let half = "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"4MB\"\nthreads = 1";
    let r = run(
        &with_classes(&[("workers", "2"), ("dataset.samples", "16")], half),
        Policy::ParallelStaging,
    );
    assert_eq!(r.pfs_bytes, 8_000_000);
    let fetched: u64 = r.samples_by_location.iter().map(|x| x.1).sum();
    assert_eq!(fetched, 2 * 2 * 4, "2 epochs x 2 workers x 4 stored samples");
}

#[test]
fn deepio_modes() {
    // Memory for half the dataset.
    let half = "[[system.class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = \"8MB\"\nthreads = 1\nread_mbps = 1000";
    for link in ["0", "10000"] {
        let mut extra = vec![("workers", "2"), ("dataset.samples", "32"), ("epochs", "4")];
        if link != "0" {
            extra.push(("system.interconnect_mbps", link));
        }
        let sc = with_classes(&extra, half);
        let ordered = run(&sc, Policy::DeepIoOrdered);
        let opportunistic = run(&sc, Policy::DeepIoOpportunistic);
        assert!(ordered.full_randomization);
        assert!(
            ordered.pfs_bytes > 32_000_000,
            "ordered mode reads uncached samples from the PFS"
        );
        assert!(
            !opportunistic.full_randomization,
            "cached samples replace uncached ones"
        );
        assert_eq!(
            opportunistic.pfs_bytes, 32_000_000,
            "only the first epoch reads the PFS"
        );
    }
    // With room for everything the two modes agree.
    let sc = with_classes(&[("workers", "2"), ("dataset.samples", "32"), ("epochs", "4")], RAM);
    let a = run(&sc, Policy::DeepIoOrdered);
    let b = run(&sc, Policy::DeepIoOpportunistic);
    assert!(b.full_randomization && close(total(&a), total(&b)));
}

#[test]
fn locality_aware_reads_less_pfs_and_keeps_randomization() {
    let sc = with_classes(&[("workers", "4"), ("dataset.samples", "256"), ("epochs", "4")], RAM);
    let l = run(&sc, Policy::LocalityAware);
    let s = run(&sc, Policy::StagingBuffer);
    assert!(l.full_randomization);
    assert!(l.pfs_bytes < s.pfs_bytes / 2, "{} vs {}", l.pfs_bytes, s.pfs_bytes);
    assert!(l.pfs_bytes >= 256_000_000, "the first epoch reads everything");
}

#[test]
fn results_are_deterministic_and_seconds_add_up() {
    let sc = with_classes(&[("workers", "2"), ("dataset.samples", "64"), ("epochs", "3")], RAM);
    let a = simulate(&sc, &[], &Progress::default()).unwrap();
    let b = simulate(&sc, &[], &Progress::default()).unwrap();
    assert_eq!(a.policies, b.policies);
    for p in &a.policies {
        let t = total(p);
        let by: f64 = p.seconds_by_location().iter().map(|x| x.1).sum();
        assert!(close(by, t), "{}: {by} vs {t}", p.policy);
        let epochs: f64 = p.epoch_seconds.iter().sum();
        assert!(close(epochs, t), "{}: epochs {epochs} vs {t}", p.policy);
        assert!(t >= total(&a.policies[0]) - 1e-9, "{} beats perfect", p.policy);
    }
    let json = a.to_json();
    assert_eq!(json["policies"]["perfect"]["relative_to_perfect"], 1.0);
    assert!(json["policies"]["naive"]["error"].is_null());
}

#[test]
fn cancel_stops_a_run() {
    let sc = Scenario::preset("imagenet-1k").unwrap();
    let progress = Progress::default();
    progress.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
    let err = simulate(&sc, &[Policy::StagingBuffer], &progress).unwrap_err();
    assert!(matches!(err, clairvoyant_core::Error::Cancelled), "{err}");
}

#[test]
fn policies_run_together_give_what_each_gives_alone() {
    // Policies side by side run at different epochs at once (a long set-up does not hold the
    // others back); each result is still the one it gives alone.
    let sc = with_classes(&[("workers", "4"), ("dataset.samples", "3000"), ("epochs", "4")], RAM);
    let all = simulate(&sc, &[], &Progress::default()).unwrap();
    assert!(all.policies.len() > 5);
    for p in &all.policies {
        let alone = simulate(&sc, &[p.policy], &Progress::default()).unwrap();
        let mine = alone.policies.iter().find(|r| r.policy == p.policy).unwrap();
        assert_eq!(mine, p, "{}", p.policy);
    }
}

#[test]
fn cancel_during_a_run_stops_it() {
    let sc = with_classes(
        &[("workers", "4"), ("dataset.samples", "100000"), ("epochs", "40")],
        RAM,
    );
    let progress = Progress::default();
    let (err, done) = std::thread::scope(|s| {
        s.spawn(|| {
            while progress.done.load(std::sync::atomic::Ordering::Relaxed) == 0 {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            progress.cancel.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let err = simulate(&sc, &[], &progress).unwrap_err();
        (err, progress.done.load(std::sync::atomic::Ordering::Relaxed))
    });
    assert!(matches!(err, clairvoyant_core::Error::Cancelled), "{err}");
    let total = progress.total.load(std::sync::atomic::Ordering::Relaxed);
    assert!(done < total / 2, "stopped at {done} of {total} samples");
}

#[test]
fn policies_that_need_storage_say_what_is_missing() {
    // No classes at all.
    let sc = scenario(&[]);
    for (p, what) in [
        (Policy::DeepIoOrdered, "no memory class"),
        (Policy::LbannDynamic, "no memory class"),
        (Policy::ParallelStaging, "no storage class"),
    ] {
        let r = run(&sc, p);
        assert!(r.total_seconds.is_none());
        assert!(r.error.as_deref().unwrap_or("").contains(what), "{p}: {:?}", r.error);
    }
}

#[test]
fn workers_per_node_must_divide_workers() {
    let mut doc = scenario::from_toml_str(BASE, Path::new("nodes.toml")).unwrap();
    scenario::set(&mut doc, "workers", "3").unwrap();
    scenario::set(&mut doc, "workers_per_node", "2").unwrap();
    let e = Scenario::from_doc(&doc).unwrap_err().to_string();
    assert!(e.contains("workers_per_node") && e.contains("nodes.toml"), "{e}");
}
