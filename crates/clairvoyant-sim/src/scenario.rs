//! Scenarios: a cluster, a dataset and a training run, described in TOML (or a table of the same
//! shape handed over from Python). A document is merged with its `base` preset and overrides as
//! a table, then read into typed structs (`file`, serde) and validated once by
//! [`Scenario::from_doc`]; errors name the dotted key and the file.
//!
//! ```toml
//! name = "my-cluster"
//! base = "imagenet-1k"          # optional: start from a preset and override it; without a
//!                               # base, [system] starts from a 5 GB / 8-thread staging buffer,
//!                               # the paper's PFS curve and no classes (never this machine)
//! workers = 16                  # N; one worker per node unless workers_per_node says otherwise
//! workers_per_node = 1
//! epochs = 90
//! batch_size = 32               # per worker
//! seed = 0                      # the shuffle's seed
//! staging_buffer_source = "pfs" # where the staging-buffer policy reads from: "pfs" or a class name
//!
//! [dataset]
//! samples = 1281167
//! mean = "107.7kB"              # sample sizes ~ Normal(mean, std), see below
//! std = "100kB"
//! seed = 0                      # seed of the drawn sizes (not of the shuffle)
//! # path = "/data/imagenet/train"  # or: the sizes of a real dataset (ImageFolder layout)
//!
//! [system]                      # per node, in the format of the engine's configuration file
//! compute_mbps = 64             # c: training throughput of one worker
//! preprocess_mbps = 200         # β
//! interconnect_mbps = 24000     # b_c
//! staging = { capacity = "5GB", threads = 8 }
//! pfs = { read_mbps = [[1, 330], [2, 730], [4, 1540], [8, 2870]] }
//! [[system.class]]
//! name = "ram"
//! kind = "memory"
//! capacity = "120GB"
//! ```
//!
//! Drawn sizes: each sample's size is drawn from Normal(mean, std) with a Box-Muller transform
//! on the documented PCG generator (so the same scenario gives the same sizes on any machine and
//! version), rounded to whole bytes; a draw below one byte is drawn again (a normal distribution
//! truncated at zero). When `std` is large against `mean` this raises the mean; the report states
//! the dataset's actual size.

mod file;

use std::f64::consts::PI;
use std::path::{Path, PathBuf};

use clairvoyant_core::model::{describe_toml, format_bytes, parse_bytes, Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::schedule::{epoch_rng, Layout};
use clairvoyant_core::source::Source;
use clairvoyant_core::{Error, Result};
use rand_core::Rng;

/// The preset scenarios: the NoPFS paper's Section 6.1 cluster and datasets.
pub const PRESETS: &[(&str, &str)] = &[
    ("mnist", MNIST),
    ("imagenet-1k", IMAGENET_1K),
    ("openimages", OPENIMAGES),
    ("imagenet-22k", IMAGENET_22K),
    ("cosmoflow", COSMOFLOW),
    ("cosmoflow-512", COSMOFLOW_512),
    ("emulated-cluster", EMULATED_CLUSTER),
];

/// The paper's small Lassen-like cluster (Sec. 6.1): c = 64 MB/s, β = 200 MB/s, b_c = 24 GB/s,
/// a 5 GB staging buffer with 8 threads (r_0(8) = 111 GB/s), 120 GB of RAM with 4 threads
/// (r_1(4) = 85 GB/s), a 900 GB SSD with 2 threads (r_2(2) = 4 GB/s) and t(1..8) =
/// 330, 730, 1540, 2870 MB/s. Write rates are not given in the paper: RAM writes as fast as it
/// reads, the SSD writes at half its read rate.
const LASSEN: &str = r#"
[system]
compute_mbps = 64
preprocess_mbps = 200
interconnect_mbps = 24000

[system.staging]
capacity = "5GB"
threads = 8
write_mbps = [[1, 13875], [8, 111000]]

[system.pfs]
read_mbps = [[1, 330], [2, 730], [4, 1540], [8, 2870]]
open_latency_ms = 0

[[system.class]]
name = "ram"
kind = "memory"
capacity = "120GB"
threads = 4
read_mbps = [[1, 21250], [4, 85000]]
write_mbps = [[1, 21250], [4, 85000]]

[[system.class]]
name = "ssd"
kind = "directory"
capacity = "900GB"
threads = 2
read_mbps = [[1, 2000], [2, 4000]]
write_mbps = [[1, 1000], [2, 2000]]
"#;

const MNIST: &str = r#"
description = "MNIST (S < d1): 50,000 samples of 0.76 kB, Lassen-like cluster"
workers = 4
epochs = 90
batch_size = 32
[dataset]
samples = 50000
mean = "760B"
std = 0
"#;

const IMAGENET_1K: &str = r#"
description = "ImageNet-1k (d1 < S < D): 1,281,167 samples ~ N(107.7 kB, 100 kB), Lassen-like cluster"
workers = 4
epochs = 90
batch_size = 32
[dataset]
samples = 1281167
mean = "107.7kB"
std = "100kB"
"#;

const OPENIMAGES: &str = r#"
description = "OpenImages (d1 < S < ND): 1,743,042 samples ~ N(293.7 kB, 200 kB), Lassen-like cluster"
workers = 4
epochs = 90
batch_size = 32
[dataset]
samples = 1743042
mean = "293.7kB"
std = "200kB"
"#;

const IMAGENET_22K: &str = r#"
description = "ImageNet-22k (D < S < ND): 14,197,122 samples ~ N(107.7 kB, 200 kB), Lassen-like cluster"
workers = 4
epochs = 10
batch_size = 32
[dataset]
samples = 14197122
mean = "107.7kB"
std = "200kB"
"#;

const COSMOFLOW: &str = r#"
description = "CosmoFlow (ND < S): 262,144 samples of 17 MB, batch 16, Lassen-like cluster"
workers = 4
epochs = 10
batch_size = 16
[dataset]
samples = 262144
mean = "17MB"
std = 0
"#;

const COSMOFLOW_512: &str = r#"
description = "CosmoFlow 512^3 (ND < S): 10,000 samples of 1 GB, batch 1, Lassen-like cluster"
workers = 8
epochs = 10
batch_size = 1
[dataset]
samples = 10000
mean = "1000MB"
std = 0
"#;

/// The distributed benchmark's emulated cluster: 4 nodes x 2 ranks on one 2-core machine,
/// sharing one emulated file system (12 MB/s for the whole machine, 2 ms per open), each node
/// a memory class of 30 % of the dataset (sum 120 %), peers at 1 Gbit/s (125 MB/s) and 0.5 ms,
/// the dataset of the training benchmark (8,000 JPEGs, about 186 MB), 4 epochs, accelerators
/// 1.8x the file system's bandwidth in all. Every value replaces the Lassen cluster's.
/// `clairvoyant.simulator.predict_cluster` builds the same scenario from a run's parameters.
const EMULATED_CLUSTER: &str = r#"
description = "Emulated cluster: 4 nodes x 2 ranks on one 2-core machine, shared 12 MB/s file system, 30 % of the dataset per node"
workers = 8
workers_per_node = 2
epochs = 4
batch_size = 32
pfs_sharing = "fifo"
[dataset]
samples = 8000
mean = "23.3kB"
std = "6kB"
[cpu]
cores = 2
nodes_per_machine = 4
processes_per_worker = 2
[network]
latency_ms = 0.5
[system]
compute_mbps = 2.7
preprocess_mbps = 27
interconnect_mbps = 125
[system.staging]
capacity = "32MiB"
threads = 8
write_mbps = [[1, 2000], [8, 16000]]
[system.pfs]
read_mbps = 12
open_latency_ms = 2
[[system.class]]
name = "ram"
kind = "memory"
capacity = "56MB"
threads = 2
read_mbps = [[1, 2000], [2, 4000]]
write_mbps = [[1, 2000], [2, 4000]]
"#;

/// Where sample sizes come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Sizes {
    /// Drawn from Normal(mean, std) bytes (see the module docs), with its own seed.
    Normal {
        /// Mean sample size in bytes.
        mean: f64,
        /// Standard deviation of the sample size in bytes.
        std: f64,
        /// Seed of the drawn sizes (not of the shuffle).
        seed: u64,
    },
    /// Given: one size per sample (a real dataset's index).
    Given(Vec<u64>),
}

/// A resolved, validated scenario.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The scenario's name, as reports show it.
    pub name: String,
    /// A free-text description of the cluster and dataset.
    pub description: String,
    /// Number of workers (N), over all nodes.
    pub workers: u32,
    /// Workers per node (divides `workers`).
    pub workers_per_node: u32,
    /// Epochs of the training run.
    pub epochs: u32,
    /// Samples per batch and worker.
    pub batch_size: u32,
    /// The shuffle's seed.
    pub seed: u64,
    /// Whether each epoch's remainder (less than a global batch) is left out.
    pub drop_last: bool,
    /// Samples in the dataset.
    pub samples: u64,
    /// Where the sample sizes come from.
    pub sizes: Sizes,
    /// Where the staging-buffer policy reads from: `None` = the PFS, else a class index.
    pub staging_buffer_source: Option<usize>,
    /// One node's system: compute and preprocessing rates, staging buffer, storage classes,
    /// the PFS and the interconnect.
    pub system: SystemModel,
    /// CPU contention: the cores the workers' processes share (`[cpu]`); None = not modelled.
    pub cpu: Option<Cpu>,
    /// Latency of one fetch from a peer, seconds (`[network] latency_ms`); 0 by default.
    pub peer_latency_s: f64,
    /// How concurrent readers share the file system (`pfs_sharing`).
    pub pfs_sharing: PfsSharing,
}

/// How concurrent PFS readers share t(γ) (`pfs_sharing = "share"` or `"fifo"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PfsSharing {
    /// NoPFS's model (default): each of γ concurrent transfers runs at t(γ)/γ, fixed when it
    /// starts; the aggregate is also capped at t(γ).
    #[default]
    Share,
    /// One timeline: each transfer runs at t(1) (a reader alone) and queues behind the bytes
    /// already admitted at the aggregate rate; open latencies overlap other transfers. This is
    /// how the emulated file system (`clairvoyant-core` `EmulatedFs`) works.
    Fifo,
}

/// The `[cpu]` table: who shares which cores. Preprocessing (s/β) is CPU work; when more
/// processes compete for a machine's cores than it has, each runs at cores/processes of its
/// speed (β is measured in one process with a core to itself).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cpu {
    /// Cores of one machine.
    pub cores: u32,
    /// Nodes of the scenario running on one machine (several when nodes are emulated on one
    /// machine, as the distributed benchmark does); their processes share its cores.
    pub nodes_per_machine: u32,
    /// Processes per worker that compete for cores: its training process plus its decode
    /// processes (PyTorch's DataLoader: 1 + num_workers; clairvoyant: 1 + decode workers).
    pub processes_per_worker: u32,
}

impl Cpu {
    /// The factor by which contention slows preprocessing: busy processes per machine / cores,
    /// at least 1 (every process counted as busy: a bound, not a fit).
    pub fn slowdown(&self, workers_per_node: u32) -> f64 {
        let busy = self.nodes_per_machine as f64 * workers_per_node as f64 * self.processes_per_worker as f64;
        (busy / self.cores.max(1) as f64).max(1.0)
    }
}

fn err(origin: &str, key: &str, reason: impl std::fmt::Display) -> Error {
    Error::config(key, format!("{reason} (in {origin})"))
}

/// The names of the preset scenarios.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// A preset's document (the shared cluster merged with the dataset), with `name` set.
pub fn preset(name: &str) -> Result<toml::Table> {
    let Some((_, text)) = PRESETS.iter().find(|(n, _)| *n == name) else {
        return Err(Error::config(
            "scenario",
            format!("unknown scenario '{name}'; presets: {}", preset_names().join(", ")),
        ));
    };
    let mut doc: toml::Table = LASSEN.parse().expect("preset cluster parses");
    let own: toml::Table = text.parse().expect("preset parses");
    merge(&mut doc, own);
    doc.insert("name".into(), toml::Value::String(name.into()));
    Ok(doc)
}

/// A scenario document from a preset name or a TOML file path. A file's `base = "<preset>"`
/// starts from that preset and overrides it (classes are merged by name).
pub fn load(name_or_path: &str) -> Result<toml::Table> {
    if PRESETS.iter().any(|(n, _)| *n == name_or_path) {
        return preset(name_or_path);
    }
    let path = Path::new(name_or_path);
    if !path.exists() {
        return Err(Error::config(
            "scenario",
            format!(
                "'{name_or_path}' is neither a preset ({}) nor an existing file",
                preset_names().join(", ")
            ),
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    from_toml_str(&text, path)
}

/// Parse a scenario document (see [`load`]); `origin` is named in errors.
pub fn from_toml_str(text: &str, origin: &Path) -> Result<toml::Table> {
    let o = origin.display().to_string();
    let own: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| err(&o, "toml", format!("syntax error: {}", e.message().trim())))?;
    let stem = origin
        .file_stem()
        .map_or("scenario".into(), |s| s.to_string_lossy().into_owned());
    // Relative dataset paths are relative to the file.
    let dir = origin.parent().filter(|d| !d.as_os_str().is_empty());
    from_table(own, &o, dir, &stem)
}

/// A scenario document from a table already in hand (a parsed file, or a mapping given from
/// Python): its `base` preset is resolved and overridden, a relative `dataset.path` is taken
/// relative to `dir` (when given), and it is named `default_name` unless it names itself.
/// `origin` is named in errors.
pub fn from_table(mut own: toml::Table, origin: &str, dir: Option<&Path>, default_name: &str) -> Result<toml::Table> {
    if let (Some(toml::Value::Table(d)), Some(dir)) = (own.get_mut("dataset"), dir) {
        if let Some(toml::Value::String(p)) = d.get_mut("path") {
            let pb = PathBuf::from(&*p);
            if pb.is_relative() {
                *p = dir.join(pb).display().to_string();
            }
        }
    }
    let mut doc = match own.remove("base") {
        None => toml::Table::new(),
        Some(toml::Value::String(b)) => preset(&b).map_err(|e| err(origin, "base", e))?,
        Some(v) => {
            return Err(err(
                origin,
                "base",
                format!("found {}; expected a preset name", describe_toml(&v)),
            ))
        }
    };
    // The scenario is named by the file (or its own `name`), not by the preset it starts from.
    doc.remove("name");
    merge(&mut doc, own);
    if !doc.contains_key("name") {
        doc.insert("name".into(), toml::Value::String(default_name.into()));
    }
    doc.insert("origin".into(), toml::Value::String(origin.into()));
    Ok(doc)
}

/// Deep-merge `over` into `base`: tables merge, arrays of named tables merge by `name`, any
/// other value replaces.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (Some(toml::Value::Array(b)), toml::Value::Array(o))
                if !o.is_empty() && o.iter().all(|x| x.get("name").is_some()) =>
            {
                let mut out = Vec::with_capacity(o.len());
                for item in o {
                    let name = item.get("name").cloned();
                    match (b.iter().position(|x| x.get("name") == name.as_ref()), item) {
                        (Some(i), toml::Value::Table(t)) => {
                            let mut merged = b[i].as_table().cloned().unwrap_or_default();
                            merge(&mut merged, t);
                            out.push(toml::Value::Table(merged));
                        }
                        (_, item) => out.push(item),
                    }
                }
                *b = out;
            }
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Set the dotted `key` of a scenario document to `value` (parsed as a TOML value, else taken
/// as a string, as a command line writes it): `epochs=3`, `system.compute_mbps=320`,
/// `system.class.ram.capacity=64GB`, `system.pfs.read_mbps=[[1,330],[8,2870]]`. A class is
/// addressed by its name.
pub fn set(doc: &mut toml::Table, key: &str, value: &str) -> Result<()> {
    set_value(doc, key, parse_value(value))
}

/// A value as a command line writes it: a TOML value (`3`, `1.5`, `true`, `"64GB"`,
/// `[[1, 330]]`), else the text itself as a string (`64GB`).
pub fn parse_value(text: &str) -> toml::Value {
    format!("v = {text}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(text.to_string()))
}

/// Set the dotted `key` of a scenario document to a typed `value` (see [`set`]).
pub fn set_value(doc: &mut toml::Table, key: &str, parsed: toml::Value) -> Result<()> {
    let parts: Vec<&str> = key.split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(Error::config(key, "is not a dotted key such as system.compute_mbps"));
    }
    let mut table = doc;
    let mut i = 0;
    while i + 1 < parts.len() {
        let p = parts[i];
        let entry = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        match entry {
            toml::Value::Table(t) => {
                table = t;
                i += 1;
            }
            toml::Value::Array(arr) => {
                let name = parts[i + 1];
                let found = arr
                    .iter_mut()
                    .find(|x| x.get("name").and_then(|n| n.as_str()) == Some(name))
                    .and_then(|x| x.as_table_mut());
                let Some(t) = found else {
                    return Err(Error::config(key, format!("there is no '{p}' named '{name}'")));
                };
                table = t;
                i += 2;
            }
            other => {
                return Err(Error::config(
                    key,
                    format!("'{p}' is {}, not a table", describe_toml(other)),
                ))
            }
        }
    }
    if i >= parts.len() {
        return Err(Error::config(key, "names a table, not a value"));
    }
    table.insert(parts[i].to_string(), parsed);
    Ok(())
}

/// The dotted key and unit a sweep's short key stands for: a class name or `staging` is that
/// capacity in GB; anything else is a dotted key taken as is (no unit).
pub fn sweep_key(doc: &toml::Table, short: &str) -> (String, Option<&'static str>) {
    if short == "staging" {
        return ("system.staging.capacity".into(), Some("GB"));
    }
    let is_class = doc
        .get("system")
        .and_then(|s| s.get("class"))
        .and_then(|c| c.as_array())
        .is_some_and(|a| a.iter().any(|x| x.get("name").and_then(|n| n.as_str()) == Some(short)));
    if is_class {
        return (format!("system.class.{short}.capacity"), Some("GB"));
    }
    (short.to_string(), None)
}

/// The TOML text of a scenario document (what `clairvoyant simulate --show` prints).
pub fn to_toml_string(doc: &toml::Table) -> String {
    let mut d = doc.clone();
    d.remove("origin");
    toml::to_string_pretty(&d).unwrap_or_default()
}

/// Names the origin in every error of one resolution.
struct Reader<'a> {
    origin: &'a str,
}

impl Reader<'_> {
    fn err(&self, key: &str, reason: impl std::fmt::Display) -> Error {
        err(self.origin, key, reason)
    }

    /// `v` (default `default`) when it lies in `min..=max`.
    fn range(&self, key: &str, v: Option<u64>, default: u64, min: u64, max: u64) -> Result<u64> {
        match v {
            None => Ok(default),
            Some(n) if (min..=max).contains(&n) => Ok(n),
            Some(n) => Err(self.err(key, format!("is {n}; expected an integer from {min} to {max}"))),
        }
    }

    /// A required `v` in `min..=max`; `missing` says what to give.
    fn required(&self, key: &str, v: Option<u64>, min: u64, max: u64, missing: &str) -> Result<u64> {
        match v {
            None => Err(self.err(key, format!("missing; {missing}"))),
            Some(n) => self.range(key, Some(n), n, min, max),
        }
    }
}

/// The run's shape: who trains how long on what batches.
struct Shape {
    workers: u32,
    workers_per_node: u32,
    epochs: u32,
    batch_size: u32,
    seed: u64,
    drop_last: bool,
}

/// Like [`parse_bytes`] but keeps fractions of a byte (a mean may be 107.7 kB = 107,700 bytes;
/// "0.5B" is 0.5).
fn parse_fractional_bytes(s: &str) -> std::result::Result<f64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '-' || c == '+'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if let (Ok(x), Ok(scale)) = (num.trim().parse::<f64>(), parse_bytes(&format!("1{}", unit.trim()))) {
        if x.is_finite() && x >= 0.0 {
            return Ok(x * scale as f64);
        }
    }
    parse_bytes(t).map(|b| b as f64)
}

impl Scenario {
    /// Resolve and validate a scenario document. Errors name the dotted key and the origin.
    pub fn from_doc(doc: &toml::Table) -> Result<Scenario> {
        let origin = doc
            .get("origin")
            .and_then(|v| v.as_str())
            .unwrap_or("the scenario")
            .to_string();
        let r = Reader { origin: &origin };
        let f = file::parse(doc).map_err(|(key, reason)| r.err(&key, reason))?;
        let shape = Scenario::shape(&r, &f)?;
        let (samples, sizes) = Scenario::dataset(&r, &f.dataset)?;
        let system = Scenario::system(&r, f.system.clone().unwrap_or_default())?;
        let staging_buffer_source = Scenario::staging_source(&r, &system, f.staging_buffer_source.as_deref())?;
        let cpu = f
            .cpu
            .as_ref()
            .map(|c| Scenario::cpu(&r, c, shape.workers / shape.workers_per_node))
            .transpose()?;
        let peer_latency_s = match f.network.latency_ms {
            None => 0.0,
            Some(x) if x >= 0.0 && x.is_finite() => x / 1e3,
            Some(x) => return Err(r.err("network.latency_ms", format!("is {x}; expected milliseconds >= 0"))),
        };
        Layout::new(samples, shape.workers, shape.batch_size, shape.drop_last).map_err(|e| match e {
            Error::Config { reason, .. } => r.err("batch_size", reason),
            other => other,
        })?;
        Ok(Scenario {
            name: f.name.unwrap_or_else(|| "scenario".into()),
            description: f.description.unwrap_or_default(),
            workers: shape.workers,
            workers_per_node: shape.workers_per_node,
            epochs: shape.epochs,
            batch_size: shape.batch_size,
            seed: shape.seed,
            drop_last: shape.drop_last,
            samples,
            sizes,
            staging_buffer_source,
            system,
            cpu,
            peer_latency_s,
            pfs_sharing: f.pfs_sharing.unwrap_or_default(),
        })
    }

    /// The top-level numbers, in range, with their defaults.
    fn shape(r: &Reader, f: &file::ScenarioFile) -> Result<Shape> {
        let workers = r.range("workers", f.workers, 1, 1, 1 << 20)? as u32;
        let workers_per_node = r.range("workers_per_node", f.workers_per_node, 1, 1, 1 << 16)? as u32;
        if !workers.is_multiple_of(workers_per_node) {
            return Err(r.err(
                "workers_per_node",
                format!("is {workers_per_node}, which does not divide workers = {workers}"),
            ));
        }
        Ok(Shape {
            workers,
            workers_per_node,
            epochs: r.range("epochs", f.epochs, 1, 1, 1 << 20)? as u32,
            batch_size: r.range("batch_size", f.batch_size, 32, 1, 1 << 24)? as u32,
            seed: f.seed.unwrap_or(0) as u64,
            drop_last: f.drop_last.unwrap_or(false),
        })
    }

    /// `[dataset]`: the number of samples and where their sizes come from.
    fn dataset(r: &Reader, d: &file::DatasetFile) -> Result<(u64, Sizes)> {
        if let Some(path) = &d.path {
            let given = [
                ("samples", d.samples.is_some()),
                ("mean", d.mean.is_some()),
                ("std", d.std.is_some()),
            ];
            if let Some((k, _)) = given.iter().find(|(_, present)| *present) {
                return Err(r.err(
                    &format!("dataset.{k}"),
                    "cannot be combined with dataset.path (the sizes come from the dataset)",
                ));
            }
            let src = clairvoyant_core::source::dir::image_folder(Path::new(path), None)?;
            let sizes: Vec<u64> = (0..src.len() as u32).map(|k| src.size(k)).collect();
            return Ok((sizes.len() as u64, Sizes::Given(sizes)));
        }
        let samples = r.required(
            "dataset.samples",
            d.samples,
            1,
            u32::MAX as u64,
            "give the number of samples or dataset.path",
        )?;
        let mean = d
            .mean
            .ok_or_else(|| r.err("dataset.mean", "missing; give the mean sample size, e.g. \"110kB\""))?
            .0;
        if mean < 1.0 {
            return Err(r.err("dataset.mean", format!("is {mean} bytes; must be at least 1 byte")));
        }
        let std = d.std.map_or(0.0, |s| s.0);
        let seed = d.seed.unwrap_or(0) as u64;
        Ok((samples, Sizes::Normal { mean, std, seed }))
    }

    /// `[system]`, read by the core's system model on the neutral base; c is required.
    fn system(r: &Reader, mut system_doc: toml::Table) -> Result<SystemModel> {
        // A simulated directory class needs no real path.
        if let Some(toml::Value::Array(classes)) = system_doc.get_mut("class") {
            for c in classes.iter_mut().filter_map(|c| c.as_table_mut()) {
                if c.get("kind").and_then(|k| k.as_str()) == Some("directory") && !c.contains_key("path") {
                    let name = c.get("name").and_then(|n| n.as_str()).unwrap_or("class").to_string();
                    c.insert("path".into(), toml::Value::String(format!("/simulated/{name}")));
                }
            }
        }
        let system =
            SystemModel::from_toml_table(&system_doc, Path::new(r.origin), neutral_system()).map_err(|e| match e {
                Error::Config { key, reason } => Error::config(format!("system.{key}"), reason),
                other => other,
            })?;
        if system.compute_mbps.is_none() {
            return Err(r.err(
                "system.compute_mbps",
                "missing; the simulator needs the training throughput c of a worker (MB/s)",
            ));
        }
        Ok(system)
    }

    /// `staging_buffer_source`: `None` for the PFS, else the index of a class of `system`.
    fn staging_source(r: &Reader, system: &SystemModel, name: Option<&str>) -> Result<Option<usize>> {
        match name {
            None | Some("pfs") => Ok(None),
            Some(s) => system.class_index(s).map(Some).ok_or_else(|| {
                let names: Vec<&str> = system.classes.iter().map(|c| c.name.as_str()).collect();
                r.err(
                    "staging_buffer_source",
                    format!("is '{s}'; expected \"pfs\" or a class name ({})", names.join(", ")),
                )
            }),
        }
    }

    /// `[cpu]` for a scenario of `nodes` nodes.
    fn cpu(r: &Reader, c: &file::CpuFile, nodes: u32) -> Result<Cpu> {
        let cores = r.required("cpu.cores", c.cores, 1, 1 << 20, "give the cores of one machine")?;
        let per_machine = r.range("cpu.nodes_per_machine", c.nodes_per_machine, 1, 1, 1 << 20)?;
        if per_machine > nodes as u64 {
            return Err(r.err(
                "cpu.nodes_per_machine",
                format!("is {per_machine}, more than the scenario's {nodes} node(s)"),
            ));
        }
        let procs = r.range("cpu.processes_per_worker", c.processes_per_worker, 2, 1, 1 << 16)?;
        Ok(Cpu {
            cores: cores as u32,
            nodes_per_machine: per_machine as u32,
            processes_per_worker: procs as u32,
        })
    }

    /// A preset, resolved.
    pub fn preset(name: &str) -> Result<Scenario> {
        Scenario::from_doc(&preset(name)?)
    }

    /// Number of nodes (`workers / workers_per_node`).
    pub fn nodes(&self) -> u32 {
        self.workers / self.workers_per_node
    }

    /// c in bytes per second.
    pub fn compute_bps(&self) -> f64 {
        self.system.compute_mbps.unwrap_or(1.0) * 1e6
    }

    /// Every sample's size in bytes.
    pub fn sample_sizes(&self) -> Vec<u64> {
        let drawn;
        let sizes = match &self.sizes {
            Sizes::Given(v) => v,
            Sizes::Normal { mean, std, seed } => {
                drawn = draw_sizes(self.samples, *mean, *std, *seed);
                &drawn
            }
        };
        // Looked up by random sample number all through a simulation: on huge pages.
        let mut out = clairvoyant_core::mem::huge_vec(sizes.len(), 0u64);
        out.copy_from_slice(sizes);
        out
    }

    /// A short human description of the dataset.
    pub fn dataset_summary(&self, sizes: &[u64]) -> String {
        let total: u64 = sizes.iter().sum();
        format!(
            "{} samples, {} (mean {})",
            self.samples,
            format_bytes(total),
            format_bytes((total as f64 / sizes.len().max(1) as f64).round() as u64)
        )
    }
}

/// What a scenario without `base` starts from (never this machine's values): the paper's
/// 5 GB staging buffer with 8 threads and its PFS curve; no storage classes, no interconnect;
/// c and β must be given.
fn neutral_system() -> SystemModel {
    SystemModel {
        staging: StagingSpec::new(5_000_000_000, 8),
        pfs: PfsSpec {
            read_mbps: Curve(vec![(1.0, 330.0), (2.0, 730.0), (4.0, 1540.0), (8.0, 2870.0)]),
            open_latency_s: 0.0,
        },
        classes: Vec::new(),
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

/// `n` sizes from Normal(mean, std) (bytes), redrawing draws below one byte; Box-Muller on the
/// documented generator, so the sizes are the same everywhere.
pub fn draw_sizes(n: u64, mean: f64, std: f64, seed: u64) -> Vec<u64> {
    if std <= 0.0 {
        return vec![mean.round().max(1.0) as u64; n as usize];
    }
    let mut rng = epoch_rng(seed, u64::MAX);
    let unit = |rng: &mut rand_pcg::Lcg128Xsl64| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let mut out = Vec::with_capacity(n as usize);
    while (out.len() as u64) < n {
        let (u1, u2) = (unit(&mut rng), unit(&mut rng));
        let r = (-2.0 * u1.ln()).sqrt();
        for z in [r * (2.0 * PI * u2).cos(), r * (2.0 * PI * u2).sin()] {
            let x = (mean + std * z).round();
            if x >= 1.0 && (out.len() as u64) < n {
                out.push(x as u64);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_resolve() {
        for name in preset_names().into_iter().filter(|&n| n != "emulated-cluster") {
            let s = Scenario::preset(name).unwrap();
            assert_eq!(s.name, name);
            assert_eq!(s.system.classes.len(), 2);
            assert_eq!(s.system.compute_mbps, Some(64.0));
        }
        assert_eq!(Scenario::preset("cosmoflow-512").unwrap().workers, 8);
        let c = Scenario::preset("emulated-cluster").unwrap();
        assert_eq!((c.nodes(), c.workers_per_node, c.system.classes.len()), (4, 2, 1));
        assert_eq!(c.cpu.unwrap().slowdown(c.workers_per_node), 8.0);
        assert_eq!(c.peer_latency_s, 0.0005);
    }

    #[test]
    fn drawn_sizes_are_golden_and_positive() {
        // Pinned: changing these changes every simulated dataset.
        let v = draw_sizes(5, 107_700.0, 100_000.0, 0);
        assert_eq!(v, GOLDEN_SIZES);
        let many = draw_sizes(200_000, 107_700.0, 200_000.0, 3);
        assert!(many.iter().all(|&s| s >= 1));
        // Truncation at zero raises the mean of N(107.7k, 200k) to about 205 kB.
        let mean = many.iter().sum::<u64>() as f64 / many.len() as f64;
        assert!((mean - 205_000.0).abs() < 5_000.0, "mean {mean}");
        assert_eq!(draw_sizes(3, 760.0, 0.0, 9), vec![760, 760, 760]);
    }

    const GOLDEN_SIZES: [u64; 5] = [101_640, 153_222, 31_603, 193_276, 219_395];

    #[test]
    fn files_override_presets_and_errors_name_fields() {
        let doc = from_toml_str(
            "base = \"imagenet-1k\"\nworkers = 16\n[[system.class]]\nname = \"ram\"\ncapacity = \"64GB\"\n",
            Path::new("my.toml"),
        )
        .unwrap();
        let s = Scenario::from_doc(&doc).unwrap();
        assert_eq!((s.workers, s.samples, s.name.as_str()), (16, 1_281_167, "my"));
        assert_eq!(s.system.classes.len(), 1, "a given class list replaces the preset's");
        assert_eq!(s.system.classes[0].capacity, 64_000_000_000);
        assert_eq!(s.system.classes[0].threads, 4, "merged by name");

        let bad = |text: &str, key: &str| {
            let text = format!("base = \"mnist\"\n{text}");
            let e = from_toml_str(&text, Path::new("bad.toml"))
                .and_then(|d| Scenario::from_doc(&d))
                .unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(key) && msg.contains("bad.toml"), "{msg}");
        };
        bad("workers = 0\n[dataset]\nsamples = 10\nmean = 5", "workers");
        bad("[dataset]\nsamples = 10\nmean = \"x\"", "dataset.mean");
        bad("[dataset]\nsamples = 10\nmean = 5\nbogus = 1", "dataset.bogus");
        bad(
            "[dataset]\nsamples = 10\nmean = 5\n[system]\ncompute_mbps = -1",
            "system.compute_mbps",
        );
        bad(
            "[dataset]\nsamples = 10\nmean = 5\n[system.staging]\nthreads = 0",
            "system.staging.threads",
        );
        bad(
            "staging_buffer_source = \"nvme\"\n[dataset]\nsamples = 10\nmean = 5",
            "staging_buffer_source",
        );
        bad(
            "workers = 8\nbatch_size = 4\n[dataset]\nsamples = 3\nmean = 5",
            "batch_size",
        );
        let e = from_toml_str("base = \"nope\"", Path::new("bad.toml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("base") && e.contains("bad.toml"), "{e}");
        let e = from_toml_str("[dataset]\nsamples = 10\nmean = 5", Path::new("bare.toml"))
            .and_then(|d| Scenario::from_doc(&d))
            .unwrap_err()
            .to_string();
        assert!(e.contains("system.compute_mbps") && e.contains("bare.toml"), "{e}");
        let e = from_toml_str(
            "[dataset]\nsamples = 10\n[system]\ncompute_mbps = 1",
            Path::new("bare.toml"),
        )
        .and_then(|d| Scenario::from_doc(&d))
        .unwrap_err()
        .to_string();
        assert!(e.contains("dataset.mean"), "{e}");
    }

    #[test]
    fn unknown_and_mistyped_fields_are_named_with_the_file() {
        let msg = |text: &str| {
            from_toml_str(&format!("base = \"mnist\"\n{text}"), Path::new("typed.toml"))
                .and_then(|d| Scenario::from_doc(&d))
                .unwrap_err()
                .to_string()
        };
        let cases = [
            ("workerz = 4", "'workerz'", "unknown field `workerz`"),
            ("[network]\nlatency = 1", "'network.latency'", "unknown field `latency`"),
            (
                "workers = \"four\"",
                "'workers'",
                "invalid type: string \"four\", expected an integer >= 0",
            ),
            ("epochs = 1.5", "'epochs'", "invalid type: floating point `1.5`"),
            ("seed = true", "'seed'", "expected an integer"),
            ("drop_last = 1", "'drop_last'", "expected a boolean"),
            ("dataset = 3", "'dataset'", "expected a table"),
            (
                "[dataset]\nstd = true",
                "'dataset.std'",
                "expected a size such as 110000",
            ),
            (
                "[dataset]\nmean = -5",
                "'dataset.mean'",
                "expected a size such as 110000",
            ),
            (
                "[network]\nlatency_ms = \"fast\"",
                "'network.latency_ms'",
                "expected a number",
            ),
            ("pfs_sharing = \"lifo\"", "'pfs_sharing'", "expected `share` or `fifo`"),
            ("system = [1]", "'system'", "expected a table"),
        ];
        for (text, key, reason) in cases {
            let m = msg(text);
            assert!(
                m.contains(key) && m.contains(reason) && m.contains("typed.toml"),
                "{text}: {m}"
            );
        }
    }

    #[test]
    fn a_table_in_hand_is_a_scenario_like_a_file() {
        let file = from_toml_str(
            "base = \"mnist\"\nworkers = 2\n[dataset]\nmean = \"1kB\"\n",
            Path::new("from-file.toml"),
        )
        .unwrap();
        let mut own = toml::Table::new();
        own.insert("base".into(), "mnist".into());
        own.insert("workers".into(), 2.into());
        let mut dataset = toml::Table::new();
        dataset.insert("mean".into(), "1kB".into());
        own.insert("dataset".into(), dataset.into());
        let table = from_table(own, "scenario given in code", None, "from-file").unwrap();
        let (a, b) = (Scenario::from_doc(&file).unwrap(), Scenario::from_doc(&table).unwrap());
        assert_eq!(
            (a.name.as_str(), a.workers, &a.sizes),
            (b.name.as_str(), b.workers, &b.sizes)
        );
        assert_eq!(a.system, b.system);
        // Typed overrides; errors name the origin given.
        let mut doc = table.clone();
        set_value(&mut doc, "epochs", toml::Value::String("3".into())).unwrap();
        let e = Scenario::from_doc(&doc).unwrap_err().to_string();
        assert!(e.contains("'epochs'") && e.contains("scenario given in code"), "{e}");
        assert_eq!(parse_value("3"), toml::Value::Integer(3));
        assert_eq!(parse_value("64GB"), toml::Value::String("64GB".into()));
    }

    #[test]
    fn set_and_sweep_keys() {
        let mut doc = preset("imagenet-22k").unwrap();
        set(&mut doc, "epochs", "3").unwrap();
        set(&mut doc, "system.compute_mbps", "320").unwrap();
        let (k, unit) = sweep_key(&doc, "ram");
        assert_eq!((k.as_str(), unit), ("system.class.ram.capacity", Some("GB")));
        set(&mut doc, &k, "\"32GB\"").unwrap();
        set(&mut doc, "system.pfs.read_mbps", "[[1, 100], [4, 300]]").unwrap();
        let s = Scenario::from_doc(&doc).unwrap();
        assert_eq!(s.epochs, 3);
        assert_eq!(s.system.compute_mbps, Some(320.0));
        assert_eq!(s.system.classes[0].capacity, 32_000_000_000);
        assert_eq!(s.system.pfs.read_mbps.at(4.0), 300.0);
        assert!(set(&mut doc, "system.class.nvme.capacity", "1").is_err());
        assert!(set(&mut doc, "epochs.x", "1").is_err());
        assert_eq!(sweep_key(&doc, "staging").0, "system.staging.capacity");
        // A round trip through the printed TOML gives the same scenario.
        let text = to_toml_string(&doc);
        let again = Scenario::from_doc(&from_toml_str(&text, Path::new("x.toml")).unwrap()).unwrap();
        assert_eq!(again.system, s.system);
        assert_eq!(again.epochs, 3);
    }

    #[test]
    fn fractional_sizes() {
        assert_eq!(parse_fractional_bytes("107.7kB").unwrap(), 107_700.0);
        assert_eq!(parse_fractional_bytes("0.76 kB").unwrap(), 760.0);
        assert_eq!(parse_fractional_bytes("17MB").unwrap(), 17e6);
        assert_eq!(parse_fractional_bytes("1GiB").unwrap(), (1u64 << 30) as f64);
        assert!(parse_fractional_bytes("12 parsecs").is_err());
    }
}
