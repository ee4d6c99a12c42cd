//! One rank's start-up in a large cluster, over a synthetic dataset (no files) with peers never
//! contacted: `startup_scale SAMPLES NODES RANKS_PER_NODE EPOCHS LOCAL_INDEX RUN_ID SSD_DIR`.
//! The rank is local rank LOCAL_INDEX of node 0. It starts its engine (the node's plan: computed
//! by the node's first rank, read by the others), takes its first sample, prints one JSON line
//! (`seconds` to that point, peak resident bytes, where the plan came from), then holds its
//! engine until its standard input closes, so that the node's other ranks can attach meanwhile.

use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clairvoyant_core::engine::{ClusterSpec, Engine, JobSpec};
use clairvoyant_core::model::{ClassKind, ClassSpec, Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;

/// Samples of 110 kB whose bytes are computed, not read.
struct Synthetic(usize);

impl Source for Synthetic {
    fn len(&self) -> usize {
        self.0
    }
    fn size(&self, _: u32) -> u64 {
        110_000
    }
    fn label(&self, k: u32) -> i64 {
        k as i64 % 1000
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("synthetic/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> clairvoyant_core::error::Result<()> {
        buf.fill(k as u8);
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        0x5ca1e ^ self.0 as u64
    }
    fn total_bytes(&self) -> u64 {
        110_000 * self.0 as u64
    }
    fn largest(&self) -> Option<(u32, u64)> {
        (self.0 > 0).then_some((0, 110_000))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: startup_scale SAMPLES NODES RANKS_PER_NODE EPOCHS LOCAL_INDEX RUN_ID SSD_DIR";
    assert!(args.len() == 7, "{usage}");
    let n = |i: usize| -> u64 { args[i].parse().expect(usage) };
    let (samples, nodes, per_node, epochs, local) = (n(0), n(1) as u32, n(2) as u32, n(3) as u32, n(4) as u32);
    let t0 = Instant::now();
    let world = nodes * per_node;
    let model = SystemModel {
        staging: StagingSpec::new(4 << 20, 2),
        pfs: PfsSpec {
            read_mbps: Curve::constant(200.0),
            open_latency_s: 0.002,
        },
        classes: vec![ClassSpec {
            name: "ssd".into(),
            kind: ClassKind::Directory {
                path: PathBuf::from(&args[6]),
            },
            capacity: 64 << 30,
            threads: 1,
            read_mbps: Curve::constant(2000.0),
            write_mbps: Curve::constant(1000.0),
        }],
        interconnect_mbps: Some(10_000.0),
        compute_mbps: None,
        preprocess_mbps: None,
    };
    let groups: Vec<Vec<u32>> = (0..nodes)
        .map(|i| (i * per_node..(i + 1) * per_node).collect())
        .collect();
    let spec = JobSpec {
        schedule: Schedule::shuffle(samples, world, 32, epochs, 0, false).expect("schedule"),
        rank: local,
        local_ranks: groups[0].clone(),
        run_id: args[5].clone(),
        first_epoch: 0,
        cluster: (nodes > 1).then(|| ClusterSpec {
            nodes: groups.clone(),
            node: 0,
            capacities: vec![vec![64 << 30]; nodes as usize],
            peers: None,
            peer_wait: Duration::from_secs(1),
        }),
        agent: None,
    };
    let engine = Engine::start(Arc::new(Synthetic(samples as usize)), &model, spec).expect("engine start");
    engine.begin_epoch(0).expect("epoch 0");
    let lease = engine
        .next(Duration::from_secs(600))
        .expect("first sample")
        .expect("a sample");
    let seconds = t0.elapsed().as_secs_f64();
    engine.release(lease.pos);
    let peak = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024;
    println!(
        "{{\"seconds\": {seconds:.3}, \"peak_bytes\": {peak}, \"origin\": \"{}\"}}",
        engine.plan_origin().name()
    );
    let _ = std::io::stdin().read(&mut [0u8; 1]);
    engine.shutdown();
}
