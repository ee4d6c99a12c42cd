//! clairvoyant-sim: a discrete-event simulator of training I/O. It predicts how long a whole
//! training run takes under each data-loading policy of the NoPFS paper's Section 6 (and this
//! project's own), on the same performance model and placement code the engine uses, and
//! where the time goes.
//!
//! [`simulate`] compares policies on one scenario; [`sweep`] varies one or two system
//! parameters for one policy (a what-if heatmap).

#![warn(missing_docs)]

pub mod cluster;
pub mod policy;
pub mod scenario;
pub mod sim;

use std::sync::atomic::Ordering;

use clairvoyant_core::{Error, Result};
use serde_json::{json, Map, Value};

pub use policy::Policy;
pub use scenario::Scenario;
pub use sim::{PolicyResult, Progress, Run};

/// The result of comparing policies on one scenario.
#[derive(Clone, Debug)]
pub struct Report {
    /// The scenario the policies ran on.
    pub scenario: Scenario,
    /// Total bytes of the scenario's dataset (the drawn or given sample sizes summed).
    pub dataset_bytes: u64,
    /// Perfect first, then the requested policies in the order given.
    pub policies: Vec<PolicyResult>,
}

impl Report {
    /// Total seconds of the perfect (stall-free) run, if it is among the results.
    pub fn perfect_seconds(&self) -> Option<f64> {
        self.policies
            .iter()
            .find(|p| p.policy == Policy::Perfect)?
            .total_seconds
    }

    /// The JSON document `clairvoyant simulate --json` prints.
    pub fn to_json(&self) -> Value {
        let sc = &self.scenario;
        let perfect = self.perfect_seconds();
        let mut policies = Map::new();
        for p in &self.policies {
            let by_loc: Map<String, Value> = p
                .seconds_by_location()
                .into_iter()
                .map(|(n, s)| (n, json!(s)))
                .collect();
            let samples: Map<String, Value> = p
                .samples_by_location
                .iter()
                .map(|(n, c)| (n.clone(), json!(c)))
                .collect();
            policies.insert(
                p.policy.name().to_string(),
                json!({
                    "total_seconds": p.total_seconds,
                    "relative_to_perfect": match (p.total_seconds, perfect) {
                        (Some(t), Some(b)) if b > 0.0 => Some(t / b),
                        _ => None,
                    },
                    "seconds_by_location": by_loc,
                    "full_randomization": p.full_randomization,
                    "error": p.error,
                    "preload_seconds": p.preload_seconds,
                    "compute_seconds": p.compute_seconds,
                    "stall_seconds": p.stall_seconds,
                    "epoch_seconds": p.epoch_seconds,
                    "samples_by_location": samples,
                    "pfs_bytes": p.pfs_bytes,
                    "pfs_reads_vs_dataset": p.pfs_bytes as f64 / self.dataset_bytes.max(1) as f64,
                }),
            );
        }
        json!({
            "scenario": sc.name,
            "description": sc.description,
            "workers": sc.workers,
            "workers_per_node": sc.workers_per_node,
            "epochs": sc.epochs,
            "batch_size": sc.batch_size,
            "seed": sc.seed,
            "samples": sc.samples,
            "dataset_bytes": self.dataset_bytes,
            "policies": policies,
        })
    }
}

/// Perfect, then `policies` without repeats (Perfect is always simulated: it is the reference).
fn with_perfect(policies: &[Policy]) -> Vec<Policy> {
    let mut out = vec![Policy::Perfect];
    for &p in policies {
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Simulate `policies` (all when empty) on `scenario`, in parallel. `progress.total` is set
/// to the number of samples to simulate and `done` advances as they are.
pub fn simulate(scenario: &Scenario, policies: &[Policy], progress: &Progress) -> Result<Report> {
    let policies = with_perfect(if policies.is_empty() { &Policy::ALL } else { policies });
    let sizes = scenario.sample_sizes();
    let run = Run::new(scenario, &sizes, progress)?;
    progress
        .total
        .fetch_add(run.samples_per_run() * policies.len() as u64, Ordering::Relaxed);
    let results = run.simulate_all(&policies)?;
    Ok(Report {
        scenario: scenario.clone(),
        dataset_bytes: sizes.iter().sum(),
        policies: results,
    })
}

/// Relative cost of simulating a policy, for scheduling the longest first.
pub(crate) fn cost(p: Policy) -> u32 {
    match p {
        Policy::Clairvoyant => 4,
        Policy::LocalityAware | Policy::DeepIoOpportunistic | Policy::DeepIoOrdered | Policy::LbannDynamic => 2,
        Policy::Perfect => 0,
        _ => 1,
    }
}

/// `f` on every item on the machine's cores, the most expensive items first (so that no long
/// item starts last, alone); results in the items' order.
pub(crate) fn run_all<T: Sync, R: Send>(
    items: &[T],
    cost: impl Fn(&T) -> u32,
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(cost(&items[i])));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let slots: Vec<std::sync::Mutex<Option<Result<R>>>> = items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let threads = rayon::current_num_threads().clamp(1, items.len().max(1));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(n) else { break };
                let r = f(&items[i]);
                let failed = r.is_err();
                *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                if failed {
                    next.store(order.len(), Ordering::Relaxed);
                }
            });
        }
    });
    let results: Vec<Option<Result<R>>> = slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect();
    // An item's error wins over items skipped because of it.
    if let Some(pos) = results.iter().position(|r| matches!(r, Some(Err(_)))) {
        let Some(Some(Err(e))) = results.into_iter().nth(pos) else {
            unreachable!()
        };
        return Err(e);
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("every item ran").expect("no error"))
        .collect())
}

/// One swept parameter: the short key (a class name, `staging`, or a dotted scenario key) and
/// its values as written (a bare number for a capacity means GB).
#[derive(Clone, Debug)]
pub struct Axis {
    /// The swept parameter's short key (a class name, `staging`, or a dotted scenario key).
    pub key: String,
    /// The values to try, as written.
    pub values: Vec<String>,
}

/// A what-if grid: `cells[i][j]` for `axes[0].values[i]` and `axes[1].values[j]`.
#[derive(Clone, Debug)]
pub struct SweepReport {
    /// Name of the swept scenario.
    pub scenario: String,
    /// The policy simulated in every cell.
    pub policy: Policy,
    /// One or two axes, each with the unit a bare number is taken in (`GB` for capacities).
    pub axes: Vec<(Axis, Option<&'static str>)>,
    /// The policy's result per cell: `cells[i][j]` for the i-th value of the first axis and the
    /// j-th of the second.
    pub cells: Vec<Vec<PolicyResult>>,
    /// Total seconds of the perfect run on the unswept scenario, for reference.
    pub perfect_seconds: Option<f64>,
}

impl SweepReport {
    /// The sweep as a JSON document: the axes with their values and units, and per cell the
    /// policy's total seconds and error.
    pub fn to_json(&self) -> Value {
        let sweep: Vec<Value> = self
            .axes
            .iter()
            .map(|(a, unit)| {
                let values: Vec<Value> = a
                    .values
                    .iter()
                    .map(|v| v.parse::<f64>().map_or_else(|_| json!(v), |x| json!(x)))
                    .collect();
                json!({"key": a.key, "values": values, "unit": unit})
            })
            .collect();
        let totals: Vec<Vec<Option<f64>>> = self
            .cells
            .iter()
            .map(|row| row.iter().map(|c| c.total_seconds).collect())
            .collect();
        let errors: Vec<Vec<Option<String>>> = self
            .cells
            .iter()
            .map(|row| row.iter().map(|c| c.error.clone()).collect())
            .collect();
        json!({
            "scenario": self.scenario,
            "policy": self.policy.name(),
            "sweep": sweep,
            "total_seconds": totals,
            "errors": errors,
            "perfect_seconds": self.perfect_seconds,
        })
    }
}

/// Simulate `policy` on every combination of one or two axes applied to the scenario document
/// `doc` (see [`scenario::set`]); cells run in parallel.
pub fn sweep(doc: &toml::Table, axes: &[Axis], policy: Policy, progress: &Progress) -> Result<SweepReport> {
    sweep_with(doc, axes, policy, None, progress)
}

/// [`sweep`] with the sample sizes given instead of the scenario's.
fn sweep_with(
    doc: &toml::Table,
    axes: &[Axis],
    policy: Policy,
    sizes: Option<&[u64]>,
    progress: &Progress,
) -> Result<SweepReport> {
    if axes.is_empty() || axes.len() > 2 {
        return Err(Error::config(
            "sweep",
            format!("{} swept parameters given; sweep one or two", axes.len()),
        ));
    }
    let resolved: Vec<(Axis, String, Option<&'static str>)> = axes
        .iter()
        .map(|a| {
            let (key, unit) = scenario::sweep_key(doc, &a.key);
            (a.clone(), key, unit)
        })
        .collect();
    for (a, _, _) in &resolved {
        if a.values.is_empty() {
            return Err(Error::config(format!("sweep.{}", a.key), "has no values"));
        }
    }
    let rows = resolved[0].0.values.len();
    let cols = resolved.get(1).map_or(1, |r| r.0.values.len());
    let mut docs = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        for j in 0..cols {
            let mut d = doc.clone();
            for (axis, (a, key, unit)) in resolved.iter().enumerate() {
                let v = &a.values[if axis == 0 { i } else { j }];
                let value = match unit {
                    Some(u) if v.parse::<f64>().is_ok() => format!("\"{v}{u}\""),
                    _ => v.clone(),
                };
                scenario::set(&mut d, key, &value)
                    .map_err(|e| Error::config(format!("sweep.{}", a.key), e.to_string()))?;
            }
            docs.push(Scenario::from_doc(&d)?);
        }
    }
    let mut base = Scenario::from_doc(doc)?;
    let sizes = match sizes {
        Some(v) => {
            base.samples = v.len() as u64;
            base.sizes = scenario::Sizes::Given(v.to_vec());
            for sc in &mut docs {
                sc.samples = base.samples;
                sc.sizes = base.sizes.clone();
            }
            base.sample_sizes()
        }
        None => base.sample_sizes(),
    };
    let per_run = Run::new(&base, &sizes, progress)?.samples_per_run();
    progress
        .total
        .fetch_add(per_run * (docs.len() as u64 + 1), Ordering::Relaxed);
    let perfect = Run::new(&base, &sizes, progress)?
        .simulate(Policy::Perfect)?
        .total_seconds;
    let results = run_all(&docs, |_| 0, |sc| Run::new(sc, &sizes, progress)?.simulate(policy))?;
    let mut it = results.into_iter();
    let cells = (0..rows).map(|_| it.by_ref().take(cols).collect()).collect();
    Ok(SweepReport {
        scenario: base.name.clone(),
        policy,
        axes: resolved.into_iter().map(|(a, _, u)| (a, u)).collect(),
        cells,
        perfect_seconds: perfect,
    })
}

/// Where a request's scenario comes from.
#[derive(Clone, Debug)]
pub enum ScenarioSource {
    /// A preset name or a scenario TOML file.
    Named(String),
    /// A scenario table as a file would hold it (`base`, `[dataset]`, `[system]`, ...), given
    /// from Python; a relative `dataset.path` is relative to the working directory.
    Table(toml::Table),
}

impl Default for ScenarioSource {
    fn default() -> Self {
        ScenarioSource::Named("imagenet-1k".into())
    }
}

/// A whole simulation request, as the CLI and Python take it.
#[derive(Clone, Debug, Default)]
pub struct Request {
    /// A preset, a scenario file or a scenario table.
    pub scenario: ScenarioSource,
    /// Dotted-key overrides applied in order (`workers` = 16, `system.compute_mbps` = 320).
    pub sets: Vec<(String, toml::Value)>,
    /// Policy names; empty = all.
    pub policies: Vec<String>,
    /// Sample sizes that replace the scenario's dataset (a real dataset's sizes).
    pub sizes: Option<Vec<u64>>,
    /// One or two swept parameters (then exactly one policy, clairvoyant by default).
    pub sweep: Vec<Axis>,
}

/// The scenario document a request describes (preset, file or table, with its overrides).
pub fn request_doc(req: &Request) -> Result<toml::Table> {
    let mut doc = match &req.scenario {
        ScenarioSource::Named(name) => scenario::load(name)?,
        ScenarioSource::Table(table) => {
            // Errors name the scenario by its own name, as there is no file to name.
            let origin = match table.get("name").and_then(|n| n.as_str()) {
                Some(name) => format!("scenario '{name}'"),
                None => "the scenario table".to_string(),
            };
            scenario::from_table(table.clone(), &origin, None, "scenario")?
        }
    };
    for (k, v) in &req.sets {
        scenario::set_value(&mut doc, k, v.clone())?;
    }
    Ok(doc)
}

/// Run a request: a policy comparison, or a sweep when axes are given. Returns the JSON
/// document (`Report::to_json` or `SweepReport::to_json`).
pub fn run_request(req: &Request, progress: &Progress) -> Result<Value> {
    let doc = request_doc(req)?;
    let policies = req
        .policies
        .iter()
        .map(|p| Policy::parse(p))
        .collect::<Result<Vec<_>>>()?;
    let given = |mut sc: Scenario| {
        if let Some(sizes) = &req.sizes {
            sc.samples = sizes.len() as u64;
            sc.sizes = scenario::Sizes::Given(sizes.clone());
        }
        sc
    };
    if req.sweep.is_empty() {
        let sc = given(Scenario::from_doc(&doc)?);
        return Ok(simulate(&sc, &policies, progress)?.to_json());
    }
    let policy = match policies.as_slice() {
        [] => Policy::Clairvoyant,
        [p] => *p,
        _ => {
            return Err(Error::config(
                "policy",
                format!("a sweep simulates one policy; {} were given", policies.len()),
            ))
        }
    };
    Ok(sweep_with(&doc, &req.sweep, policy, req.sizes.as_deref(), progress)?.to_json())
}
