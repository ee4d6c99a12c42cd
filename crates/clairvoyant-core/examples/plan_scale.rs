//! The cluster-wide plan at a given scale, for measuring its time and memory:
//! `plan_scale SAMPLES NODES RANKS_PER_NODE EPOCHS [MEMORY_BYTES_PER_NODE]` prints the report's
//! headline figures and the process's peak resident memory.

use clairvoyant_core::plan::cluster_report;
use clairvoyant_core::schedule::Schedule;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("an integer"))
        .collect();
    let [samples, nodes, per_node, epochs] = args[..4] else {
        panic!("usage: plan_scale SAMPLES NODES RANKS_PER_NODE EPOCHS [MEMORY_BYTES_PER_NODE]")
    };
    let memory = args.get(4).copied().unwrap_or(64 << 30);
    let world = (nodes * per_node) as u32;
    let schedule = Schedule::shuffle(samples, world, 32, epochs as u32, 0, false).unwrap();
    let groups: Vec<Vec<u32>> = (0..nodes as u32)
        .map(|i| (i * per_node as u32..(i + 1) * per_node as u32).collect())
        .collect();
    let t0 = std::time::Instant::now();
    let r = cluster_report(&schedule, &groups, 0, |_| 110_000, &[("memory".into(), memory)]).unwrap();
    let peak = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0) * 1024)
        .unwrap_or(0);
    println!(
        "{{\"samples\": {samples}, \"nodes\": {nodes}, \"ranks_per_node\": {per_node}, \"epochs\": {epochs}, \"seconds\": {:.2}, \"peak_bytes\": {peak}, \"coverage\": {}, \"expected_fs_bytes\": {}, \"minimum_fs_bytes\": {}}}",
        t0.elapsed().as_secs_f64(),
        r["coverage"],
        r["expected_fs_bytes"],
        r["minimum_fs_bytes"]
    );
}
