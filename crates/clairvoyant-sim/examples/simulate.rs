//! Time a scenario: `cargo run --release -p clairvoyant-sim --example simulate -- imagenet-1k 16 90`.
use std::time::Instant;

use clairvoyant_sim::{scenario, simulate, Policy, Progress, Scenario};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut doc = scenario::load(args.first().map_or("imagenet-1k", |s| s.as_str())).unwrap();
    if let Some(w) = args.get(1) {
        scenario::set(&mut doc, "workers", w).unwrap();
    }
    if let Some(e) = args.get(2) {
        scenario::set(&mut doc, "epochs", e).unwrap();
    }
    let policies: Vec<Policy> = args.iter().skip(3).map(|p| Policy::parse(p).unwrap()).collect();
    let sc = Scenario::from_doc(&doc).unwrap();
    let t = Instant::now();
    let report = simulate(&sc, &policies, &Progress::default()).unwrap();
    println!("{}", serde_json::to_string_pretty(&report.to_json()).unwrap());
    eprintln!("simulated in {:.1} s", t.elapsed().as_secs_f64());
}
