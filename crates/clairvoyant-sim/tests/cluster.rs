//! CPU contention and the emulated cluster: properties that fail when the model is wrong.

use std::path::Path;

use clairvoyant_sim::{scenario, simulate, Policy, PolicyResult, Progress, Scenario};

/// `nodes` nodes x 2 ranks on one machine sharing a 12 MB/s file system, 2,000 samples of
/// 20 kB (40 MB), each node a memory class of `per_node` bytes, peers at 125 MB/s and 0.5 ms.
fn cluster(nodes: u32, per_node: u64, epochs: u32) -> String {
    format!(
        r#"
workers = {workers}
workers_per_node = 2
epochs = {epochs}
batch_size = 16
[dataset]
samples = 2000
mean = "20kB"
std = "5kB"
[network]
latency_ms = 0.5
[system]
compute_mbps = 4
preprocess_mbps = 200
interconnect_mbps = 125
[system.staging]
capacity = "8MB"
threads = 4
write_mbps = 100000
[system.pfs]
read_mbps = 12
open_latency_ms = 2
[[system.class]]
name = "ram"
kind = "memory"
capacity = {per_node}
threads = 2
read_mbps = 4000
write_mbps = 4000
"#,
        workers = nodes * 2
    )
}

fn resolve(text: &str, extra: &[(&str, &str)]) -> Scenario {
    let mut doc = scenario::from_toml_str(text, Path::new("cluster.toml")).unwrap();
    for (k, v) in extra {
        scenario::set(&mut doc, k, v).unwrap();
    }
    Scenario::from_doc(&doc).unwrap()
}

fn run(sc: &Scenario, p: Policy) -> (PolicyResult, u64) {
    let report = simulate(sc, &[p], &Progress::default()).unwrap();
    let r = report.policies.into_iter().find(|r| r.policy == p).unwrap();
    assert!(r.error.is_none(), "{:?}", r.error);
    (r, report.dataset_bytes)
}

#[test]
fn file_system_bytes_reach_the_minimum_when_the_cache_is_smaller_than_the_dataset() {
    // Aggregate cache C = 4 x 12.5 % = 50 % of S: the minimum is S + (E-1)(S-C).
    let epochs = 4;
    let probe = resolve(&cluster(4, 1, epochs), &[]);
    let s: u64 = probe.sample_sizes().iter().sum();
    let per_node = s / 8;
    let (r, dataset) = run(&resolve(&cluster(4, per_node, epochs), &[]), Policy::Clairvoyant);
    assert_eq!(dataset, s);
    let c = 4 * per_node;
    let min = s + (epochs as u64 - 1) * (s - c);
    let ratio = r.pfs_bytes as f64 / min as f64;
    assert!(
        (ratio - 1.0).abs() <= 0.05,
        "file system bytes {} against minimum {min} ({ratio:.3})",
        r.pfs_bytes
    );
    // Without peers each node caches the same most-used samples: far more file system reads.
    let (alone, _) = run(
        &resolve(
            &cluster(4, per_node, epochs).replace("interconnect_mbps = 125\n", ""),
            &[],
        ),
        Policy::Clairvoyant,
    );
    assert!(
        alone.pfs_bytes as f64 > 1.2 * r.pfs_bytes as f64,
        "{} vs {}",
        alone.pfs_bytes,
        r.pfs_bytes
    );
}

#[test]
fn the_file_system_is_read_once_when_the_aggregate_cache_holds_the_dataset() {
    let probe = resolve(&cluster(4, 1, 3), &[]);
    let s: u64 = probe.sample_sizes().iter().sum();
    let (r, _) = run(&resolve(&cluster(4, s * 3 / 10, 3), &[]), Policy::Clairvoyant);
    assert!(
        r.pfs_bytes as f64 <= 1.01 * s as f64,
        "{} bytes read for a dataset of {s}",
        r.pfs_bytes
    );
    assert!(
        r.pfs_bytes >= s,
        "every sample is read from the file system at least once"
    );
}

#[test]
fn more_nodes_with_the_same_aggregate_cache_read_the_file_system_no_more() {
    let probe = resolve(&cluster(2, 1, 3), &[]);
    let s: u64 = probe.sample_sizes().iter().sum();
    for aggregate in [s / 2, s * 6 / 5] {
        let mut last = None;
        for nodes in [1u32, 2, 4] {
            let (r, _) = run(
                &resolve(&cluster(nodes, aggregate / nodes as u64, 3), &[]),
                Policy::Clairvoyant,
            );
            if let Some((prev_nodes, prev)) = last {
                assert!(
                    r.pfs_bytes as f64 <= prev as f64 * 1.005,
                    "aggregate {aggregate}: {nodes} nodes read {} bytes, {prev_nodes} nodes {prev}",
                    r.pfs_bytes
                );
            }
            last = Some((nodes, r.pfs_bytes));
        }
    }
}

#[test]
fn contention_slows_preprocessing_only_beyond_the_cores() {
    // A CPU-bound run: β = 2 MB/s per process against a fast file system and accelerator.
    let text = cluster(2, 1, 1)
        .replace("preprocess_mbps = 200", "preprocess_mbps = 2")
        .replace("read_mbps = 12", "read_mbps = 10000")
        .replace("open_latency_ms = 2", "open_latency_ms = 0")
        .replace("compute_mbps = 4", "compute_mbps = 1000");
    let time = |cpu: &str| {
        let sc = resolve(&format!("{text}\n{cpu}"), &[]);
        let (r, _) = run(&sc, Policy::StagingBuffer);
        r.total_seconds.unwrap()
    };
    let free = time("");
    // 2 nodes x 2 workers x 2 processes = 8 on 8 cores: no contention.
    let enough = time("[cpu]\ncores = 8\nnodes_per_machine = 2\nprocesses_per_worker = 2");
    assert!((enough / free - 1.0).abs() < 1e-9, "{enough} vs {free}");
    // The same 8 processes on 2 cores: each at a quarter of its speed.
    let two = time("[cpu]\ncores = 2\nnodes_per_machine = 2\nprocesses_per_worker = 2");
    assert!(two > 3.5 * free, "2 cores: {two} s, no contention: {free} s");
    // More processes per worker: slower still.
    let three = time("[cpu]\ncores = 2\nnodes_per_machine = 2\nprocesses_per_worker = 3");
    assert!(three > two * 1.3, "{three} vs {two}");
}

#[test]
fn cpu_and_network_keys_are_checked() {
    let bad = |extra: &str, key: &str| {
        let text = format!("{}\n{extra}", cluster(2, 1_000_000, 1)).replace("[network]\nlatency_ms = 0.5\n", "");
        let e = scenario::from_toml_str(&text, Path::new("bad.toml"))
            .and_then(|d| Scenario::from_doc(&d))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key) && e.contains("bad.toml"), "{e}");
    };
    bad("[cpu]\ncores = 0", "cpu.cores");
    bad("[cpu]\nnodes_per_machine = 1", "cpu.cores");
    bad("[cpu]\ncores = 2\nnodes_per_machine = 3", "cpu.nodes_per_machine");
    bad("[cpu]\ncores = 2\nthreads = 3", "cpu.threads");
    bad("[network]\nlatency_ms = -1", "network.latency_ms");
}

#[test]
fn the_emulated_cluster_preset_reads_the_dataset_about_once() {
    let sc = Scenario::preset("emulated-cluster").unwrap();
    let (r, s) = run(&sc, Policy::Clairvoyant);
    assert_eq!(r.epoch_seconds.len(), 4);
    assert!(r.pfs_bytes as f64 <= 1.05 * s as f64, "{} vs {s}", r.pfs_bytes);
    let (p, _) = run(&sc, Policy::StagingBuffer);
    assert_eq!(p.pfs_bytes, 4 * s, "PyTorch's DataLoader reads the dataset every epoch");
}

#[test]
fn fifo_sharing_is_the_share_model_for_one_reader_and_faster_with_many() {
    // No classes, the PFS only: staging-buffer policy, 1 or 8 readers.
    let text = cluster(2, 1, 1)
        .replace("interconnect_mbps = 125\n", "")
        .replace("compute_mbps = 4", "compute_mbps = 1000");
    let time = |threads: &str, sharing: &str| {
        let sc = resolve(
            &format!("pfs_sharing = \"{sharing}\"\n{text}"),
            &[
                ("system.staging.threads", threads),
                ("workers", "1"),
                ("workers_per_node", "1"),
            ],
        );
        let (r, _) = run(&sc, Policy::StagingBuffer);
        r.total_seconds.unwrap()
    };
    let (share1, fifo1) = (time("1", "share"), time("1", "fifo"));
    assert!((fifo1 / share1 - 1.0).abs() < 1e-9, "one reader: {fifo1} vs {share1}");
    let (share8, fifo8) = (time("8", "share"), time("8", "fifo"));
    assert!(fifo8 < share8, "8 readers: fifo {fifo8} vs share {share8}");
    // FIFO still cannot beat the aggregate bandwidth: 2,000 x 20 kB at 12 MB/s.
    let probe = resolve(&text, &[]);
    let bytes: u64 = probe.sample_sizes().iter().sum();
    assert!(fifo8 >= bytes as f64 / 12e6, "{fifo8} s for {bytes} bytes at 12 MB/s");
    let e = scenario::from_toml_str(&format!("pfs_sharing = \"lifo\"\n{text}"), Path::new("bad.toml"))
        .and_then(|d| Scenario::from_doc(&d))
        .unwrap_err()
        .to_string();
    assert!(e.contains("pfs_sharing") && e.contains("bad.toml"), "{e}");
}
