//! The performance model (NoPFS Sec. 4): storage classes with capacities, prefetch threads and
//! read/write throughput as a function of threads, the shared file system's aggregate throughput
//! t(γ) as a function of concurrent readers, b_c, c and β. The engine uses it to choose sources
//! and placement; the simulator uses it to predict whole runs.
//!
//! # Notation (paper symbol → field or method)
//!
//! | paper        | meaning                                               | here                                              |
//! |--------------|-------------------------------------------------------|---------------------------------------------------|
//! | c            | compute throughput of training, MB/s                  | [`SystemModel::compute_mbps`]                     |
//! | β            | preprocessing rate, MB/s                              | [`SystemModel::preprocess_mbps`]                  |
//! | b_c          | inter-worker network bandwidth, MB/s                  | [`SystemModel::interconnect_mbps`]                |
//! | t(γ)         | aggregate random-read throughput of the PFS, γ readers| [`PfsSpec::read_mbps`] (`x` = γ)                  |
//! | t(γ)/γ       | per-reader PFS throughput                             | [`SystemModel::pfs_per_reader_mbps`]              |
//! | class 0      | the staging buffer                                    | [`SystemModel::staging`] ([`StagingSpec`])        |
//! | d_0, p_0     | staging capacity and prefetch threads                 | [`StagingSpec::capacity`], [`StagingSpec::threads`]|
//! | w_0(p)       | staging write throughput with p threads               | [`StagingSpec::write_mbps`]                       |
//! | class j ≥ 1  | a storage class (RAM, SSD, ...)                       | [`SystemModel::classes`]`[j - 1]` ([`ClassSpec`]) |
//! | d_j          | capacity of class j (bytes here, MB in the paper)     | [`ClassSpec::capacity`]                           |
//! | p_j          | prefetch threads of class j                           | [`ClassSpec::threads`]                            |
//! | r_j(p), w_j(p)| aggregate read/write throughput of class j, p threads| [`ClassSpec::read_mbps`], [`ClassSpec::write_mbps`]|
//! | r_j(p_j)/p_j | per-thread read throughput of class j                 | [`SystemModel::class_read_per_thread_mbps`]       |
//! | D = Σ d_j    | total local storage of a worker                       | [`SystemModel::local_capacity`]                   |
//! | s_k          | size of sample k                                      | the `bytes` argument                              |
//! | fetch_{i,0,0}(k) = s_k/(t(γ)/γ)        | fetch from the PFS          | [`SystemModel::fetch_seconds`]`(Location::Pfs, ..)` (+ open latency) |
//! | fetch_{i,1,j}(k) = s_k/min(b_c, r_j(p_j)/p_j) | fetch from a peer's class j | [`SystemModel::remote_fetch_seconds`]      |
//! | fetch_{i,2,j}(k) = s_k/(r_j(p_j)/p_j)  | fetch from the local class j | [`SystemModel::fetch_seconds`]`(Location::Class(j), ..)` |
//! | write_i(k) = max(s_k/β, s_k/(w_0(p_0)/p_0)) | preprocess + store in staging | [`SystemModel::write_seconds`]       |
//! | read_i(k) = fetch_i(k) + write_i(k)     | time to bring k into staging | [`SystemModel::read_seconds`]               |
//!
//! Throughput is in MB/s with MB = 10^6 bytes; capacities are bytes. Class indices used by
//! [`Location::Class`] index [`SystemModel::classes`] (0-based; the paper's class 0, the staging
//! buffer, is kept apart in [`SystemModel::staging`]).
//!
//! # Configuration file
//!
//! A TOML file (see [`SystemModel::from_toml_str`]) with human-friendly values:
//!
//! ```toml
//! interconnect_mbps = 10000.0      # optional: b_c
//! compute_mbps = 800.0             # optional: c
//! preprocess_mbps = 1500.0         # optional: β
//!
//! [staging]
//! capacity = "256 MiB"             # integer bytes or "512MiB", "8 GiB", "1.5GB"
//! threads = 4
//! write_mbps = [[1, 4000.0], [4, 16000.0]]   # optional
//!
//! [pfs]
//! read_mbps = [[1, 200.0], [10, 2000.0]]     # [[readers, MB/s], ...] or one number
//! open_latency_ms = 1.0
//!
//! [[class]]
//! name = "memory"
//! kind = "memory"
//! capacity = "8 GiB"
//! threads = 2
//! read_mbps = [[1, 5000.0], [4, 20000.0]]    # [[threads, MB/s], ...] or one number
//! write_mbps = 4000.0
//!
//! [[class]]
//! name = "ssd"
//! kind = "directory"
//! path = "/local/scratch/clairvoyant"        # relative paths are relative to the file
//! capacity = "200GB"                         # "0" or 0 disables the class
//! ```
//!
//! Missing sections and fields take the values [`SystemModel::detect`] finds on this machine; a
//! file without any `[[class]]` keeps the detected classes, `class = []` means no storage classes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sysinfo::defaults;

/// Most prefetch threads a class or the staging buffer may have.
pub const MAX_THREADS: u32 = 1024;

/// Throughput (MB/s, 10^6 bytes) measured at a few thread or reader counts; piecewise-linear
/// between points, flat beyond the ends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Curve(pub Vec<(f64, f64)>);

impl Curve {
    pub fn constant(mbps: f64) -> Self {
        Curve(vec![(1.0, mbps)])
    }

    /// `per_unit` MB/s per thread up to `max_x` threads, flat after: `[(1, per_unit), (max_x, max_x * per_unit)]`.
    pub fn linear_up_to(per_unit: f64, max_x: u32) -> Self {
        if max_x <= 1 {
            return Curve::constant(per_unit);
        }
        Curve(vec![(1.0, per_unit), (max_x as f64, per_unit * max_x as f64)])
    }

    /// Throughput at `x` threads/readers.
    pub fn at(&self, x: f64) -> f64 {
        let pts = &self.0;
        if pts.is_empty() {
            return 0.0;
        }
        if x <= pts[0].0 {
            return pts[0].1;
        }
        for w in pts.windows(2) {
            let ((x0, y0), (x1, y1)) = (w[0], w[1]);
            if x <= x1 {
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
            }
        }
        pts[pts.len() - 1].1
    }

    /// Check the curve: at least one point, every x ≥ 1 and strictly increasing, every y > 0 and
    /// finite. Errors name `key`.
    pub fn check(&self, key: &str) -> Result<()> {
        if self.0.is_empty() {
            return Err(Error::config(
                key,
                "has no points; give one number (MB/s) or [[threads, MB/s], ...]",
            ));
        }
        let mut prev: Option<f64> = None;
        for (i, &(x, y)) in self.0.iter().enumerate() {
            if !x.is_finite() || x < 1.0 {
                return Err(Error::config(
                    key,
                    format!("point {i} has x = {x}; thread/reader counts must be finite and >= 1"),
                ));
            }
            if let Some(p) = prev {
                if x <= p {
                    return Err(Error::config(
                        key,
                        format!("point {i} has x = {x} after x = {p}; x must be strictly increasing"),
                    ));
                }
            }
            if !y.is_finite() || y <= 0.0 {
                return Err(Error::config(
                    key,
                    format!("point {i} (x = {x}) has {y} MB/s; throughput must be finite and > 0"),
                ));
            }
            prev = Some(x);
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum ClassKind {
    /// Node RAM, shared by the node's ranks through shared memory.
    Memory,
    /// A local directory (node-local SSD).
    Directory { path: PathBuf },
}

/// One storage class j: capacity d_j, prefetch threads p_j, r_j(p), w_j(p).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassSpec {
    pub name: String,
    #[serde(flatten)]
    pub kind: ClassKind,
    /// Bytes; 0 disables the class.
    pub capacity: u64,
    pub threads: u32,
    pub read_mbps: Curve,
    pub write_mbps: Curve,
}

impl ClassSpec {
    /// Enabled: capacity > 0.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }
}

fn default_staging_write() -> Curve {
    defaults::dram_write()
}

/// Class 0: the staging buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagingSpec {
    pub capacity: u64,
    pub threads: u32,
    /// w_0(p): write throughput into the staging buffer with p threads (a memory copy).
    #[serde(default = "default_staging_write")]
    pub write_mbps: Curve,
}

impl StagingSpec {
    /// A staging buffer with the default (DRAM) write curve.
    pub fn new(capacity: u64, threads: u32) -> Self {
        StagingSpec {
            capacity,
            threads,
            write_mbps: default_staging_write(),
        }
    }
}

/// The dataset's storage (the shared file system).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PfsSpec {
    /// t(γ): aggregate random-read throughput with γ concurrent readers.
    pub read_mbps: Curve,
    /// Fixed cost per file open, seconds.
    #[serde(default)]
    pub open_latency_s: f64,
}

/// The whole system description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SystemModel {
    pub staging: StagingSpec,
    pub pfs: PfsSpec,
    /// Fastest first.
    #[serde(default, rename = "class")]
    pub classes: Vec<ClassSpec>,
    /// b_c, MB/s.
    #[serde(default)]
    pub interconnect_mbps: Option<f64>,
    /// c, MB/s.
    #[serde(default)]
    pub compute_mbps: Option<f64>,
    /// β, MB/s.
    #[serde(default)]
    pub preprocess_mbps: Option<f64>,
}

/// Where a sample can be fetched from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Local storage class j (index into `SystemModel::classes`).
    Class(usize),
    /// The shared file system.
    Pfs,
}

// ---------------------------------------------------------------------------------------------
// Model functions
// ---------------------------------------------------------------------------------------------

impl SystemModel {
    /// Per-reader PFS throughput t(γ)/γ in MB/s.
    pub fn pfs_per_reader_mbps(&self, readers: u32) -> f64 {
        let g = readers.max(1) as f64;
        self.pfs.read_mbps.at(g) / g
    }

    /// Per-thread read throughput r_j(p_j)/p_j of class j in MB/s.
    pub fn class_read_per_thread_mbps(&self, class: usize) -> f64 {
        let c = &self.classes[class];
        let p = c.threads.max(1) as f64;
        c.read_mbps.at(p) / p
    }

    /// Per-thread staging write throughput w_0(p_0)/p_0 in MB/s.
    pub fn staging_write_per_thread_mbps(&self) -> f64 {
        let p = self.staging.threads.max(1) as f64;
        self.staging.write_mbps.at(p) / p
    }

    /// Estimated seconds to fetch `bytes` from `loc` with `readers` concurrent PFS readers:
    /// fetch_{i,2,j} = s/(r_j(p_j)/p_j) for a local class, fetch_{i,0,0} = s/(t(γ)/γ) plus the
    /// open latency for the PFS.
    pub fn fetch_seconds(&self, loc: Location, bytes: u64, readers: u32) -> f64 {
        let mb = bytes as f64 / 1e6;
        match loc {
            Location::Class(j) => mb / self.class_read_per_thread_mbps(j).max(1e-9),
            Location::Pfs => self.pfs.open_latency_s + mb / self.pfs_per_reader_mbps(readers).max(1e-9),
        }
    }

    /// fetch_{i,1,j} = s/min(b_c, r_j(p_j)/p_j): seconds to fetch `bytes` from class j of another
    /// worker. None without an interconnect (`interconnect_mbps` unset).
    pub fn remote_fetch_seconds(&self, class: usize, bytes: u64) -> Option<f64> {
        let bc = self.interconnect_mbps?;
        let rate = bc.min(self.class_read_per_thread_mbps(class));
        Some(bytes as f64 / 1e6 / rate.max(1e-9))
    }

    /// write_i(k) = max(s/β, s/(w_0(p_0)/p_0)): seconds to preprocess and store `bytes` in the
    /// staging buffer (both pipelined). Without β (`preprocess_mbps` unset) only the write counts.
    pub fn write_seconds(&self, bytes: u64) -> f64 {
        let mb = bytes as f64 / 1e6;
        let write = mb / self.staging_write_per_thread_mbps().max(1e-9);
        match self.preprocess_mbps {
            Some(beta) if beta > 0.0 => write.max(mb / beta),
            _ => write,
        }
    }

    /// read_i(k) = fetch_i(k) + write_i(k): seconds to bring `bytes` from `loc` into staging.
    pub fn read_seconds(&self, loc: Location, bytes: u64, readers: u32) -> f64 {
        self.fetch_seconds(loc, bytes, readers) + self.write_seconds(bytes)
    }

    /// The location with the smallest estimated fetch time for a sample of `bytes`: the PFS with
    /// `readers` concurrent readers, or one of the enabled classes in `local` (the classes that
    /// hold the sample). A class wins only when strictly faster than the PFS, so a class slower
    /// than the source is never read from; among equal classes the first listed wins.
    pub fn fastest_source(&self, bytes: u64, local: &[usize], readers: u32) -> Location {
        let mut best = Location::Pfs;
        let mut best_t = self.fetch_seconds(Location::Pfs, bytes, readers);
        for &j in local {
            let Some(c) = self.classes.get(j) else {
                debug_assert!(false, "class {j} out of range ({} classes)", self.classes.len());
                continue;
            };
            if !c.enabled() {
                continue;
            }
            let t = self.fetch_seconds(Location::Class(j), bytes, readers);
            if t < best_t {
                best = Location::Class(j);
                best_t = t;
            }
        }
        best
    }

    /// Classes worth caching in: enabled, and faster to read than fetching from the PFS
    /// for a sample of `typical_bytes` (a class slower than the source is never routed through).
    pub fn useful_classes(&self, typical_bytes: u64, readers: u32) -> Vec<usize> {
        let pfs = self.fetch_seconds(Location::Pfs, typical_bytes, readers);
        (0..self.classes.len())
            .filter(|&j| {
                self.classes[j].capacity > 0 && self.fetch_seconds(Location::Class(j), typical_bytes, readers) < pfs
            })
            .collect()
    }

    /// D = Σ_{j≥1} d_j: bytes of all enabled storage classes (the staging buffer excluded).
    pub fn local_capacity(&self) -> u64 {
        self.classes.iter().map(|c| c.capacity).fold(0u64, u64::saturating_add)
    }

    /// Index of the class called `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// Index of the memory class, if any.
    pub fn memory_class(&self) -> Option<usize> {
        self.classes.iter().position(|c| c.kind == ClassKind::Memory)
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// Dotted key prefix of class `i`: `class.<name>` when the name is usable, else `class[i]`.
fn class_key(c: &ClassSpec, i: usize) -> String {
    if valid_name(&c.name) {
        format!("class.{}", c.name)
    } else {
        format!("class[{i}]")
    }
}

fn check_threads(key: &str, threads: u32) -> Result<()> {
    if threads == 0 {
        return Err(Error::config(key, "is 0; at least 1 prefetch thread is needed"));
    }
    if threads > MAX_THREADS {
        return Err(Error::config(
            key,
            format!("is {threads}; at most {MAX_THREADS} threads are allowed"),
        ));
    }
    Ok(())
}

fn check_rate(key: &str, v: Option<f64>) -> Result<()> {
    match v {
        Some(x) if !x.is_finite() || x <= 0.0 => Err(Error::config(
            key,
            format!("is {x}; must be a finite throughput > 0 MB/s (or left out)"),
        )),
        _ => Ok(()),
    }
}

impl SystemModel {
    /// Check every field; errors name the field (`staging.threads`, `class.ssd.capacity`, ...).
    ///
    /// Rules: staging capacity > 0 and 1..=[`MAX_THREADS`] threads; every curve has points with
    /// x ≥ 1 strictly increasing and y > 0; the PFS open latency is finite and ≥ 0; class names
    /// are non-empty, made of `[A-Za-z0-9_-]` and unique; enabled classes have 1..=MAX_THREADS
    /// threads; directory classes have a path, and no two share one; at most one memory class
    /// (memory is shared through one segment); `interconnect_mbps`, `compute_mbps` and
    /// `preprocess_mbps`, when given, are > 0.
    pub fn validate(&self) -> Result<()> {
        if self.staging.capacity == 0 {
            return Err(Error::config(
                "staging.capacity",
                "is 0; the staging buffer needs a positive capacity, e.g. \"256 MiB\"",
            ));
        }
        check_threads("staging.threads", self.staging.threads)?;
        self.staging.write_mbps.check("staging.write_mbps")?;
        self.pfs.read_mbps.check("pfs.read_mbps")?;
        let lat = self.pfs.open_latency_s;
        if !lat.is_finite() || lat < 0.0 {
            return Err(Error::config(
                "pfs.open_latency_ms",
                format!("is {} ms; must be finite and >= 0", lat * 1e3),
            ));
        }
        let mut memory: Option<&str> = None;
        for (i, c) in self.classes.iter().enumerate() {
            let key = class_key(c, i);
            if !valid_name(&c.name) {
                return Err(Error::config(
                    format!("{key}.name"),
                    format!(
                        "is {:?}; a class name is non-empty and uses only letters, digits, '_' and '-'",
                        c.name
                    ),
                ));
            }
            if let Some(first) = self.classes[..i].iter().position(|o| o.name == c.name) {
                return Err(Error::config(
                    format!("{key}.name"),
                    format!("'{}' names classes {first} and {i}; class names must be unique", c.name),
                ));
            }
            match &c.kind {
                ClassKind::Memory => {
                    if let Some(other) = memory {
                        return Err(Error::config(
                            format!("{key}.kind"),
                            format!(
                                "is \"memory\" but class '{other}' is already the memory class; at most one memory \
                                 class is allowed (node memory is shared through one segment)"
                            ),
                        ));
                    }
                    memory = Some(&c.name);
                }
                ClassKind::Directory { path } => {
                    if path.as_os_str().is_empty() {
                        return Err(Error::config(
                            format!("{key}.path"),
                            "is empty; a directory class needs a path",
                        ));
                    }
                    let dup = self.classes[..i]
                        .iter()
                        .find(|o| matches!(&o.kind, ClassKind::Directory { path: p } if p == path));
                    if let Some(o) = dup {
                        return Err(Error::config(
                            format!("{key}.path"),
                            format!(
                                "{} is also the path of class '{}'; each directory class needs its own",
                                path.display(),
                                o.name
                            ),
                        ));
                    }
                }
            }
            if c.enabled() {
                check_threads(&format!("{key}.threads"), c.threads)?;
            }
            c.read_mbps.check(&format!("{key}.read_mbps"))?;
            c.write_mbps.check(&format!("{key}.write_mbps"))?;
        }
        check_rate("interconnect_mbps", self.interconnect_mbps)?;
        check_rate("compute_mbps", self.compute_mbps)?;
        check_rate("preprocess_mbps", self.preprocess_mbps)?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Byte sizes
// ---------------------------------------------------------------------------------------------

const UNITS: &[(&str, u64)] = &[
    ("b", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parse a byte size: `"0"`, `"4096"`, `"512MiB"`, `"8 GiB"`, `"1.5GB"` (units B, kB, MB, GB,
/// TB in powers of 1000 and KiB, MiB, GiB, TiB in powers of 1024, any case). The error says what
/// is allowed.
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    const HELP: &str = "expected a byte count such as 0, 1048576, \"512MiB\", \"8 GiB\" or \"1.5GB\" \
                        (units B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)";
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = (t[..split].replace('_', ""), t[split..].trim().to_ascii_lowercase());
    if num.is_empty() {
        return Err(format!("found {s:?}; {HELP}"));
    }
    let Some(&(_, mult)) =
        UNITS
            .iter()
            .find(|(u, _)| *u == unit)
            .or(if unit.is_empty() { Some(&UNITS[0]) } else { None })
    else {
        return Err(format!("found {s:?}: unknown unit {unit:?}; {HELP}"));
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| format!("found {s:?}: too large"));
    }
    let x: f64 = num.parse().map_err(|_| format!("found {s:?}; {HELP}"))?;
    let bytes = x * mult as f64;
    if mult == 1 && x.fract() != 0.0 {
        return Err(format!("found {s:?}: a fraction of a byte; {HELP}"));
    }
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("found {s:?}: too large"));
    }
    Ok(bytes.round() as u64)
}

/// A byte size for people: `"1.0 TiB"`, `"55.3 GiB"`, `"800 B"`.
pub fn human_bytes(n: u64) -> String {
    for (unit, mult) in [
        ("TiB", 1u64 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ] {
        if n >= mult {
            return format!("{:.1} {unit}", n as f64 / mult as f64);
        }
    }
    format!("{n} B")
}

/// Format a byte size for a config file: `"8 GiB"`, `"512 MiB"` when exact, else the integer.
/// [`parse_bytes`] reads it back exactly.
pub fn format_bytes(n: u64) -> String {
    for (unit, mult) in [("TiB", 1u64 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)] {
        if n > 0 && n.is_multiple_of(mult) {
            return format!("\"{} {unit}\"", n / mult);
        }
    }
    n.to_string()
}

// ---------------------------------------------------------------------------------------------
// TOML
// ---------------------------------------------------------------------------------------------

/// Reads TOML values into model fields; every error is `Error::Config` with the dotted key and the
/// file (origin) in the reason.
struct Reader<'a> {
    origin: &'a Path,
}

/// A TOML value for an error message: its type and (at most 60 characters of) its text.
pub fn describe_toml(v: &toml::Value) -> String {
    let mut s = v.to_string();
    if s.len() > 60 {
        s.truncate(57);
        s.push_str("...");
    }
    format!("{} {s}", v.type_str())
}

impl Reader<'_> {
    fn err(&self, key: impl Into<String>, reason: impl std::fmt::Display) -> Error {
        Error::config(key, format!("{reason} (in {})", self.origin.display()))
    }

    fn table<'t>(&self, v: &'t toml::Value, key: &str, allowed: &[&str]) -> Result<&'t toml::Table> {
        let t = v
            .as_table()
            .ok_or_else(|| self.err(key, format!("found {}; expected a table", describe_toml(v))))?;
        self.keys(t, key, allowed)?;
        Ok(t)
    }

    fn keys(&self, t: &toml::Table, prefix: &str, allowed: &[&str]) -> Result<()> {
        for k in t.keys() {
            if !allowed.contains(&k.as_str()) {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                return Err(self.err(key, format!("unknown key; allowed here: {}", allowed.join(", "))));
            }
        }
        Ok(())
    }

    fn capacity(&self, v: &toml::Value, key: &str) -> Result<u64> {
        match v {
            toml::Value::Integer(n) if *n >= 0 => Ok(*n as u64),
            toml::Value::String(s) => parse_bytes(s).map_err(|r| self.err(key, r)),
            _ => Err(self.err(
                key,
                format!(
                    "found {}; expected a byte count >= 0 such as 1048576, \"512MiB\" or \"8 GiB\"",
                    describe_toml(v)
                ),
            )),
        }
    }

    fn threads(&self, v: &toml::Value, key: &str) -> Result<u32> {
        match v {
            toml::Value::Integer(n) if (0..=u32::MAX as i64).contains(n) => Ok(*n as u32),
            _ => Err(self.err(
                key,
                format!("found {}; expected a thread count (integer >= 1)", describe_toml(v)),
            )),
        }
    }

    fn number(&self, v: &toml::Value, key: &str, what: &str) -> Result<f64> {
        match v {
            toml::Value::Integer(n) => Ok(*n as f64),
            toml::Value::Float(x) => Ok(*x),
            _ => Err(self.err(key, format!("found {}; expected {what}", describe_toml(v)))),
        }
    }

    fn curve(&self, v: &toml::Value, key: &str) -> Result<Curve> {
        const WANT: &str = "a throughput in MB/s or [[threads, MB/s], ...] such as [[1, 500.0], [4, 1800.0]]";
        if let Some(arr) = v.as_array() {
            let mut pts = Vec::with_capacity(arr.len());
            for (i, p) in arr.iter().enumerate() {
                let pair = p.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                    self.err(
                        key,
                        format!(
                            "point {i}: found {}; expected a pair [threads, MB/s] ({WANT})",
                            describe_toml(p)
                        ),
                    )
                })?;
                let x = self.number(&pair[0], key, WANT)?;
                let y = self.number(&pair[1], key, WANT)?;
                pts.push((x, y));
            }
            Ok(Curve(pts))
        } else {
            Ok(Curve::constant(self.number(v, key, WANT)?))
        }
    }

    fn rate(&self, v: &toml::Value, key: &str) -> Result<f64> {
        self.number(v, key, "a throughput in MB/s")
    }

    fn path(&self, v: &toml::Value, key: &str) -> Result<PathBuf> {
        let s = v
            .as_str()
            .ok_or_else(|| self.err(key, format!("found {}; expected a directory path", describe_toml(v))))?;
        let p = PathBuf::from(s);
        if p.is_relative() && !s.is_empty() {
            if let Some(dir) = self.origin.parent().filter(|d| !d.as_os_str().is_empty()) {
                return Ok(dir.join(p));
            }
        }
        Ok(p)
    }

    fn class(&self, v: &toml::Value, i: usize, base: &SystemModel) -> Result<ClassSpec> {
        const ALLOWED: &[&str] = &["name", "kind", "path", "capacity", "threads", "read_mbps", "write_mbps"];
        let t = v.as_table().ok_or_else(|| {
            self.err(
                format!("class[{i}]"),
                format!("found {}; expected a table", describe_toml(v)),
            )
        })?;
        let name = match t.get("name") {
            None => return Err(self.err(format!("class[{i}].name"), "missing; every [[class]] needs a name")),
            Some(n) => n
                .as_str()
                .ok_or_else(|| {
                    self.err(
                        format!("class[{i}].name"),
                        format!("found {}; expected a string", describe_toml(n)),
                    )
                })?
                .to_string(),
        };
        let prefix = if valid_name(&name) {
            format!("class.{name}")
        } else {
            format!("class[{i}]")
        };
        self.keys(t, &prefix, ALLOWED)?;
        let k = |f: &str| format!("{prefix}.{f}");
        let kind = match t.get("kind") {
            None => return Err(self.err(k("kind"), "missing; expected \"memory\" or \"directory\"")),
            Some(toml::Value::String(s)) if s == "memory" => {
                if t.contains_key("path") {
                    return Err(self.err(
                        k("path"),
                        "a memory class has no path; remove it or use kind = \"directory\"",
                    ));
                }
                ClassKind::Memory
            }
            Some(toml::Value::String(s)) if s == "directory" => match t.get("path") {
                Some(p) => ClassKind::Directory {
                    path: self.path(p, &k("path"))?,
                },
                None => return Err(self.err(k("path"), "missing; a directory class needs a path")),
            },
            Some(other) => {
                return Err(self.err(
                    k("kind"),
                    format!("found {}; expected \"memory\" or \"directory\"", describe_toml(other)),
                ))
            }
        };
        // Defaults: the detected class of the same kind, else the built-in typical numbers.
        let mut spec = match &kind {
            ClassKind::Memory => base
                .classes
                .iter()
                .find(|c| c.kind == ClassKind::Memory)
                .cloned()
                .unwrap_or_else(|| defaults::memory_class(0)),
            ClassKind::Directory { path } => defaults::directory_class(&name, path.clone(), None),
        };
        spec.name = name;
        spec.kind = kind;
        if let Some(v) = t.get("capacity") {
            spec.capacity = self.capacity(v, &k("capacity"))?;
        }
        if let Some(v) = t.get("threads") {
            spec.threads = self.threads(v, &k("threads"))?;
        }
        if let Some(v) = t.get("read_mbps") {
            spec.read_mbps = self.curve(v, &k("read_mbps"))?;
        }
        if let Some(v) = t.get("write_mbps") {
            spec.write_mbps = self.curve(v, &k("write_mbps"))?;
        }
        Ok(spec)
    }

    fn model(&self, doc: &toml::Table, base: SystemModel) -> Result<SystemModel> {
        const TOP: &[&str] = &[
            "staging",
            "pfs",
            "class",
            "interconnect_mbps",
            "compute_mbps",
            "preprocess_mbps",
        ];
        self.keys(doc, "", TOP)?;
        let mut m = base;
        if let Some(v) = doc.get("staging") {
            let t = self.table(v, "staging", &["capacity", "threads", "write_mbps"])?;
            if let Some(v) = t.get("capacity") {
                m.staging.capacity = self.capacity(v, "staging.capacity")?;
            }
            if let Some(v) = t.get("threads") {
                m.staging.threads = self.threads(v, "staging.threads")?;
            }
            if let Some(v) = t.get("write_mbps") {
                m.staging.write_mbps = self.curve(v, "staging.write_mbps")?;
            }
        }
        if let Some(v) = doc.get("pfs") {
            let t = self.table(v, "pfs", &["read_mbps", "open_latency_ms"])?;
            if let Some(v) = t.get("read_mbps") {
                m.pfs.read_mbps = self.curve(v, "pfs.read_mbps")?;
            }
            if let Some(v) = t.get("open_latency_ms") {
                m.pfs.open_latency_s = self.number(v, "pfs.open_latency_ms", "milliseconds (a number >= 0)")? / 1e3;
            }
        }
        if let Some(v) = doc.get("class") {
            let arr = v.as_array().ok_or_else(|| {
                self.err(
                    "class",
                    format!(
                        "found {}; expected [[class]] tables (or class = [] for none)",
                        describe_toml(v)
                    ),
                )
            })?;
            let base = m.clone();
            m.classes = arr
                .iter()
                .enumerate()
                .map(|(i, c)| self.class(c, i, &base))
                .collect::<Result<_>>()?;
        }
        for (key, slot) in [
            ("interconnect_mbps", &mut m.interconnect_mbps),
            ("compute_mbps", &mut m.compute_mbps),
            ("preprocess_mbps", &mut m.preprocess_mbps),
        ] {
            if let Some(v) = doc.get(key) {
                *slot = Some(self.rate(v, key)?);
            }
        }
        Ok(m)
    }
}

/// Line and column (1-based) of byte `offset` in `s`.
fn line_col(s: &str, offset: usize) -> (usize, usize) {
    let before = &s[..offset.min(s.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(before.len(), |i| before.len() - i - 1) + 1;
    (line, col)
}

fn fmt_f64(x: f64) -> String {
    toml::Value::Float(x).to_string()
}

fn fmt_curve(c: &Curve) -> String {
    if let [(x, y)] = c.0.as_slice() {
        if *x == 1.0 {
            return fmt_f64(*y);
        }
    }
    let pts: Vec<String> =
        c.0.iter()
            .map(|&(x, y)| {
                let xs = if x.fract() == 0.0 && x.abs() < 1e15 {
                    format!("{}", x as i64)
                } else {
                    fmt_f64(x)
                };
                format!("[{xs}, {}]", fmt_f64(y))
            })
            .collect();
    format!("[{}]", pts.join(", "))
}

/// Milliseconds to write for `seconds` such that reading them back (ms / 1000) gives `seconds`
/// exactly, when such a neighbour of `seconds * 1000` exists.
fn ms_for(seconds: f64) -> f64 {
    let ms = seconds * 1e3;
    if !ms.is_finite() {
        return ms;
    }
    let mut cands = vec![ms];
    let (mut up, mut down) = (ms, ms);
    for _ in 0..4 {
        up = up.next_up();
        down = down.next_down();
        cands.push(up);
        cands.push(down);
    }
    cands.into_iter().find(|c| c / 1e3 == seconds).unwrap_or(ms)
}

fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_string()).to_string()
}

impl SystemModel {
    /// Parse a TOML system description (layout in the module docs). `origin` names where the text
    /// came from (the file): it is named in every error, and relative class paths are relative to
    /// its directory. Missing fields take the values of [`SystemModel::detect`]. The result is
    /// validated. Every error is `Error::Config { key, reason }` with the dotted key
    /// (`class.ssd.capacity`); a TOML syntax error has key `toml` and gives the line and column.
    pub fn from_toml_str(s: &str, origin: &Path) -> Result<SystemModel> {
        Self::from_toml_with_base(s, origin, SystemModel::detect())
    }

    /// Like [`SystemModel::from_toml_str`] with the defaults taken from `base` instead of the machine.
    pub fn from_toml_with_base(s: &str, origin: &Path, base: SystemModel) -> Result<SystemModel> {
        let doc: toml::Table = s.parse().map_err(|e: toml::de::Error| {
            let at = match e.span() {
                Some(sp) => {
                    let (l, c) = line_col(s, sp.start);
                    format!("{}:{l}:{c}", origin.display())
                }
                None => origin.display().to_string(),
            };
            Error::config("toml", format!("syntax error at {at}: {}", e.message().trim()))
        })?;
        Self::from_toml_table(&doc, origin, base)
    }

    /// Like [`SystemModel::from_toml_with_base`] for an already parsed table (a section of a
    /// larger document, such as a simulation scenario's `[system]`). Error keys are relative to
    /// the table.
    pub fn from_toml_table(doc: &toml::Table, origin: &Path, base: SystemModel) -> Result<SystemModel> {
        let r = Reader { origin };
        let m = r.model(doc, base)?;
        m.validate().map_err(|e| match e {
            Error::Config { key, reason } => r.err(key, reason),
            other => other,
        })?;
        Ok(m)
    }

    /// Read and parse the TOML file at `path` (see [`SystemModel::from_toml_str`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_toml_str(&text, path)
    }

    /// The model as TOML, every field written out; [`SystemModel::from_toml_str`] reads it back equal.
    pub fn to_toml_string(&self) -> String {
        let mut o = String::new();
        o.push_str(
            "# clairvoyant system model (NoPFS performance model).\n\
             # Capacities: bytes or \"512 MiB\", \"8 GiB\", \"1.5GB\"; 0 disables a class.\n\
             # Throughput: MB/s (10^6 bytes/s), one number or [[threads or readers, MB/s], ...].\n",
        );
        for (k, v) in [
            ("interconnect_mbps", self.interconnect_mbps),
            ("compute_mbps", self.compute_mbps),
            ("preprocess_mbps", self.preprocess_mbps),
        ] {
            if let Some(x) = v {
                let _ = writeln!(o, "{k} = {}", fmt_f64(x));
            }
        }
        if self.classes.is_empty() {
            o.push_str("class = []\n");
        }
        let s = &self.staging;
        let _ = write!(
            o,
            "\n[staging]\ncapacity = {}\nthreads = {}\nwrite_mbps = {}\n",
            format_bytes(s.capacity),
            s.threads,
            fmt_curve(&s.write_mbps)
        );
        let _ = write!(
            o,
            "\n[pfs]\nread_mbps = {}\nopen_latency_ms = {}\n",
            fmt_curve(&self.pfs.read_mbps),
            fmt_f64(ms_for(self.pfs.open_latency_s))
        );
        for c in &self.classes {
            let _ = write!(o, "\n[[class]]\nname = {}\n", toml_str(&c.name));
            match &c.kind {
                ClassKind::Memory => o.push_str("kind = \"memory\"\n"),
                ClassKind::Directory { path } => {
                    let _ = write!(
                        o,
                        "kind = \"directory\"\npath = {}\n",
                        toml_str(&path.to_string_lossy())
                    );
                }
            }
            let _ = write!(
                o,
                "capacity = {}\nthreads = {}\nread_mbps = {}\nwrite_mbps = {}\n",
                format_bytes(c.capacity),
                c.threads,
                fmt_curve(&c.read_mbps),
                fmt_curve(&c.write_mbps)
            );
        }
        o
    }

    /// Write [`SystemModel::to_toml_string`] to `path` (creating its directory, mode 0700),
    /// atomically and privately (mode 0600, see [`write_private`](crate::tier::secure::write_private)).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        crate::source::index::make_parent(path)?;
        crate::tier::secure::write_private(path, self.to_toml_string().as_bytes())
    }
}

/// A configured capacity limited to what the file system holding `path` has free; a warning
/// naming `field` says so when it clamps.
pub fn clamp_to_free(field: &str, capacity: u64, path: &std::path::Path) -> u64 {
    let Ok(free) = crate::sysinfo::free_space(path) else {
        return capacity;
    };
    if capacity <= free {
        return capacity;
    }
    crate::tier::warn_once(
        field,
        &format!(
            "{field} is {} but {} has {} free; using {}",
            format_bytes(capacity),
            path.display(),
            format_bytes(free),
            format_bytes(free)
        ),
    );
    free
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sysinfo::{Machine, ENV_LOCK};

    fn base() -> SystemModel {
        let m = Machine {
            mem_total: Some(16 << 30),
            mem_available: Some(8 << 30),
            cpus: 4,
        };
        SystemModel::detect_on(&m, Some(PathBuf::from("/nonexistent/clairvoyant-ssd")))
    }

    fn parse(s: &str) -> Result<SystemModel> {
        SystemModel::from_toml_with_base(s, Path::new("/etc/test/system.toml"), base())
    }

    /// The key of a config error, panicking on anything else.
    fn key_of(r: Result<SystemModel>) -> String {
        match r {
            Err(Error::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    fn invalid_key(f: impl FnOnce(&mut SystemModel)) -> String {
        let mut m = sample();
        f(&mut m);
        match m.validate() {
            Err(Error::Config { key, .. }) => key,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    const FULL: &str = r#"
interconnect_mbps = 10000.0
compute_mbps = 800
preprocess_mbps = 1500.5

[staging]
capacity = "512MiB"
threads = 4
write_mbps = [[1, 4000.0], [4, 16000.0]]

[pfs]
read_mbps = [[1, 250.0], [4, 900.0], [16, 2500.0]]
open_latency_ms = 2.5

[[class]]
name = "memory"
kind = "memory"
capacity = "8 GiB"
threads = 2
read_mbps = [[1, 5000.0], [4, 20000.0]]
write_mbps = 4000

[[class]]
name = "ssd"
kind = "directory"
path = "/local/scratch/cv"
capacity = "1.5GB"
threads = 4
read_mbps = [[1, 500.0], [4, 1800.0]]
write_mbps = [[1, 300.0], [4, 900.0]]
"#;

    fn sample() -> SystemModel {
        parse(FULL).unwrap()
    }

    #[test]
    fn full_file_parses() {
        let m = sample();
        assert_eq!(m.staging.capacity, 512 << 20);
        assert_eq!(m.staging.threads, 4);
        assert_eq!(m.pfs.open_latency_s, 2.5e-3);
        assert_eq!(m.pfs.read_mbps.0.len(), 3);
        assert_eq!(m.classes.len(), 2);
        assert_eq!(m.classes[0].capacity, 8 << 30);
        assert_eq!(m.classes[0].write_mbps, Curve::constant(4000.0));
        assert_eq!(m.classes[1].capacity, 1_500_000_000);
        assert_eq!(
            m.classes[1].kind,
            ClassKind::Directory {
                path: "/local/scratch/cv".into()
            }
        );
        assert_eq!(m.interconnect_mbps, Some(10000.0));
        assert_eq!(m.compute_mbps, Some(800.0));
        assert_eq!(m.preprocess_mbps, Some(1500.5));
    }

    #[test]
    fn toml_round_trip() {
        let m = sample();
        let text = m.to_toml_string();
        let back = parse(&text).unwrap();
        assert_eq!(back, m, "{text}");
        // Awkward values survive too.
        let mut m2 = m.clone();
        m2.pfs.open_latency_s = 0.000_123_456_789;
        m2.staging.capacity = 123_456_789;
        m2.classes[1].read_mbps = Curve(vec![(1.0, 0.1 + 0.2), (2.5, 1e-3), (3.0, 1e12)]);
        m2.interconnect_mbps = None;
        let back = parse(&m2.to_toml_string()).unwrap();
        assert_eq!(back, m2);
        // No classes at all.
        let mut m3 = m.clone();
        m3.classes.clear();
        assert_eq!(parse(&m3.to_toml_string()).unwrap(), m3);
    }

    #[test]
    fn missing_fields_take_defaults() {
        let m = parse("[pfs]\nread_mbps = 800\n").unwrap();
        let b = base();
        assert_eq!(m.pfs.read_mbps, Curve::constant(800.0));
        assert_eq!(m.staging, b.staging);
        assert_eq!(m.classes, b.classes);
        let m = parse("class = []\n").unwrap();
        assert!(m.classes.is_empty());
        let m = parse("[[class]]\nname = \"ram\"\nkind = \"memory\"\ncapacity = 0\n").unwrap();
        assert_eq!(m.classes.len(), 1);
        assert_eq!(m.classes[0].capacity, 0);
        assert_eq!(m.classes[0].threads, crate::sysinfo::defaults::MEMORY_THREADS);
    }

    #[test]
    fn relative_directory_path_is_relative_to_the_file() {
        let m = parse("[[class]]\nname = \"ssd\"\nkind = \"directory\"\npath = \"scratch\"\ncapacity = 0\n").unwrap();
        assert_eq!(
            m.classes[0].kind,
            ClassKind::Directory {
                path: "/etc/test/scratch".into()
            }
        );
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_bytes("0"), Ok(0));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("8 GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("2kb"), Ok(2000));
        assert_eq!(parse_bytes(" 1_000 B "), Ok(1000));
        for bad in ["", "GiB", "-1", "1.5", "12 parsecs", "1e3", "99999999999 TiB"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} accepted");
        }
        for n in [0, 1, 1 << 20, 3 << 30, 5 << 40, 123_456_789, u64::MAX] {
            let f = format_bytes(n);
            assert_eq!(parse_bytes(f.trim_matches('"')), Ok(n), "{f}");
        }
    }

    #[test]
    fn curve_interpolation() {
        let c = Curve(vec![(1.0, 100.0), (4.0, 400.0), (8.0, 600.0)]);
        assert_eq!(c.at(0.0), 100.0); // before the first point: flat
        assert_eq!(c.at(1.0), 100.0);
        assert_eq!(c.at(2.0), 200.0);
        assert_eq!(c.at(4.0), 400.0);
        assert_eq!(c.at(6.0), 500.0);
        assert_eq!(c.at(8.0), 600.0);
        assert_eq!(c.at(100.0), 600.0); // after the last point: flat
        assert_eq!(Curve::constant(7.0).at(32.0), 7.0);
        assert_eq!(Curve(vec![]).at(1.0), 0.0);
        assert_eq!(Curve::linear_up_to(200.0, 10).at(5.0), 1000.0);
    }

    #[test]
    fn unknown_keys_are_rejected() {
        assert_eq!(key_of(parse("turbo = true\n")), "turbo");
        assert_eq!(key_of(parse("[staging]\ncapacity = 1\nthread = 2\n")), "staging.thread");
        assert_eq!(key_of(parse("[pfs]\nopen_latency = 1\n")), "pfs.open_latency");
        let e = parse("[[class]]\nname = \"ssd\"\nkind = \"directory\"\npath = \"/x\"\nsize = 3\n").unwrap_err();
        let Error::Config { key, reason } = e else { panic!() };
        assert_eq!(key, "class.ssd.size");
        assert!(reason.contains("capacity"), "{reason}");
    }

    #[test]
    fn errors_name_the_file() {
        let e = parse("[staging]\nthreads = 0\n").unwrap_err();
        assert!(e.to_string().contains("/etc/test/system.toml"), "{e}");
        assert!(e.to_string().contains("staging.threads"), "{e}");
        let e = parse("[staging]\ncapacity = \"lots\"\n").unwrap_err();
        assert!(
            e.to_string().contains("/etc/test/system.toml") && e.to_string().contains("\"lots\""),
            "{e}"
        );

        let _g = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, "[staging]\ncapacity = \"1 GiB\"\nthreads = -3\n").unwrap();
        let e = SystemModel::load(&path).unwrap_err();
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        assert!(
            matches!(&e, Error::Config { key, .. } if key == "staging.threads"),
            "{e}"
        );
    }

    #[test]
    fn syntax_errors_give_file_and_line() {
        let e = parse("[staging]\ncapacity = 1\nthreads = = 2\n").unwrap_err();
        let Error::Config { key, reason } = e else { panic!() };
        assert_eq!(key, "toml");
        assert!(reason.contains("/etc/test/system.toml:3:"), "{reason}");
    }

    #[test]
    fn parse_type_errors_name_the_field() {
        assert_eq!(key_of(parse("[staging]\ncapacity = -5\n")), "staging.capacity");
        assert_eq!(key_of(parse("[staging]\nthreads = \"four\"\n")), "staging.threads");
        assert_eq!(key_of(parse("[pfs]\nread_mbps = \"fast\"\n")), "pfs.read_mbps");
        assert_eq!(key_of(parse("[pfs]\nread_mbps = [[1, 2, 3]]\n")), "pfs.read_mbps");
        assert_eq!(key_of(parse("[[class]]\nkind = \"memory\"\n")), "class[0].name");
        assert_eq!(key_of(parse("[[class]]\nname = \"x\"\n")), "class.x.kind");
        assert_eq!(
            key_of(parse("[[class]]\nname = \"x\"\nkind = \"tape\"\n")),
            "class.x.kind"
        );
        assert_eq!(
            key_of(parse("[[class]]\nname = \"x\"\nkind = \"directory\"\n")),
            "class.x.path"
        );
        assert_eq!(
            key_of(parse("[[class]]\nname = \"x\"\nkind = \"memory\"\npath = \"/a\"\n")),
            "class.x.path"
        );
        assert_eq!(
            key_of(parse("[[class]]\nname = \"m\"\nkind = \"memory\"\ncapacity = 1.5\n")),
            "class.m.capacity"
        );
        assert_eq!(key_of(parse("compute_mbps = \"quick\"\n")), "compute_mbps");
    }

    // One test per validation rule; each asserts the key.

    #[test]
    fn rule_staging_capacity_positive() {
        assert_eq!(invalid_key(|m| m.staging.capacity = 0), "staging.capacity");
        assert_eq!(key_of(parse("[staging]\ncapacity = \"0\"\n")), "staging.capacity");
    }

    #[test]
    fn rule_staging_threads() {
        assert_eq!(invalid_key(|m| m.staging.threads = 0), "staging.threads");
        assert_eq!(invalid_key(|m| m.staging.threads = MAX_THREADS + 1), "staging.threads");
    }

    #[test]
    fn rule_class_threads_when_enabled() {
        assert_eq!(invalid_key(|m| m.classes[1].threads = 0), "class.ssd.threads");
        let mut m = sample();
        m.classes[1].threads = 0;
        m.classes[1].capacity = 0; // disabled: threads do not matter
        m.validate().unwrap();
    }

    #[test]
    fn rule_curve_x_at_least_one() {
        assert_eq!(
            invalid_key(|m| m.pfs.read_mbps = Curve(vec![(0.0, 10.0), (2.0, 20.0)])),
            "pfs.read_mbps"
        );
    }

    #[test]
    fn rule_curve_x_increasing() {
        assert_eq!(
            invalid_key(|m| m.classes[0].read_mbps = Curve(vec![(1.0, 10.0), (4.0, 20.0), (4.0, 30.0)])),
            "class.memory.read_mbps"
        );
        assert_eq!(
            invalid_key(|m| m.classes[1].write_mbps = Curve(vec![(2.0, 10.0), (1.0, 20.0)])),
            "class.ssd.write_mbps"
        );
    }

    #[test]
    fn rule_curve_y_positive() {
        assert_eq!(
            invalid_key(|m| m.staging.write_mbps = Curve(vec![(1.0, 0.0)])),
            "staging.write_mbps"
        );
        assert_eq!(
            invalid_key(|m| m.pfs.read_mbps = Curve(vec![(1.0, f64::NAN)])),
            "pfs.read_mbps"
        );
        assert_eq!(
            key_of(parse("[pfs]\nread_mbps = [[1, 100.0], [2, -1.0]]\n")),
            "pfs.read_mbps"
        );
    }

    #[test]
    fn rule_curve_not_empty() {
        assert_eq!(key_of(parse("[pfs]\nread_mbps = []\n")), "pfs.read_mbps");
    }

    #[test]
    fn rule_open_latency() {
        assert_eq!(invalid_key(|m| m.pfs.open_latency_s = -1.0), "pfs.open_latency_ms");
    }

    #[test]
    fn rule_unique_class_names() {
        assert_eq!(
            invalid_key(|m| m.classes[1].name = "memory".into()),
            "class.memory.name"
        );
    }

    #[test]
    fn rule_class_name_format() {
        assert_eq!(invalid_key(|m| m.classes[1].name = String::new()), "class[1].name");
        assert_eq!(invalid_key(|m| m.classes[1].name = "my ssd".into()), "class[1].name");
    }

    #[test]
    fn rule_directory_needs_path() {
        assert_eq!(
            invalid_key(|m| m.classes[1].kind = ClassKind::Directory { path: PathBuf::new() }),
            "class.ssd.path"
        );
    }

    #[test]
    fn rule_directory_paths_distinct() {
        let key = invalid_key(|m| {
            let mut c = m.classes[1].clone();
            c.name = "ssd2".into();
            m.classes.push(c);
        });
        assert_eq!(key, "class.ssd2.path");
    }

    #[test]
    fn rule_one_memory_class() {
        let key = invalid_key(|m| {
            let mut c = m.classes[0].clone();
            c.name = "ram2".into();
            m.classes.push(c);
        });
        assert_eq!(key, "class.ram2.kind");
    }

    #[test]
    fn rule_optional_rates_positive() {
        assert_eq!(invalid_key(|m| m.interconnect_mbps = Some(0.0)), "interconnect_mbps");
        assert_eq!(invalid_key(|m| m.compute_mbps = Some(-1.0)), "compute_mbps");
        assert_eq!(
            invalid_key(|m| m.preprocess_mbps = Some(f64::INFINITY)),
            "preprocess_mbps"
        );
    }

    fn two_tier(pfs_mbps: f64, class_mbps: f64) -> SystemModel {
        SystemModel {
            staging: StagingSpec::new(64 << 20, 2),
            pfs: PfsSpec {
                read_mbps: Curve::constant(pfs_mbps),
                open_latency_s: 0.0,
            },
            classes: vec![ClassSpec {
                name: "ssd".into(),
                kind: ClassKind::Directory { path: "/x".into() },
                capacity: 1 << 30,
                threads: 1,
                read_mbps: Curve::constant(class_mbps),
                write_mbps: Curve::constant(class_mbps),
            }],
            interconnect_mbps: None,
            compute_mbps: None,
            preprocess_mbps: None,
        }
    }

    #[test]
    fn fastest_source_picks_class_only_when_faster() {
        // Class faster than the PFS: the class, if it holds the sample.
        let m = two_tier(100.0, 1000.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Class(0));
        assert_eq!(m.fastest_source(1 << 20, &[], 1), Location::Pfs);
        // Source faster than the class: the PFS even when the class holds it.
        let m = two_tier(2000.0, 500.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Equal: the PFS (a class must be strictly faster).
        let m = two_tier(500.0, 500.0);
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Many readers share t(γ): the class wins again.
        let mut m = two_tier(2000.0, 500.0);
        m.pfs.read_mbps = Curve::linear_up_to(2000.0, 1);
        assert_eq!(m.fastest_source(1 << 20, &[0], 8), Location::Class(0));
        // A disabled class is never picked.
        let mut m = two_tier(100.0, 1000.0);
        m.classes[0].capacity = 0;
        assert_eq!(m.fastest_source(1 << 20, &[0], 1), Location::Pfs);
        // Open latency counts: tiny samples from a high-latency PFS come from the class.
        let mut m = two_tier(2000.0, 1000.0);
        m.pfs.open_latency_s = 0.01;
        assert_eq!(m.fastest_source(1000, &[0], 1), Location::Class(0));
    }

    #[test]
    fn fastest_source_prefers_the_faster_class() {
        let mut m = two_tier(100.0, 1000.0);
        let mut mem = m.classes[0].clone();
        mem.name = "memory".into();
        mem.kind = ClassKind::Memory;
        mem.read_mbps = Curve::constant(10_000.0);
        m.classes.insert(0, mem);
        assert_eq!(m.fastest_source(1 << 20, &[1, 0], 1), Location::Class(0));
        assert_eq!(m.fastest_source(1 << 20, &[1], 1), Location::Class(1));
    }

    #[test]
    fn write_and_read_seconds() {
        let mut m = two_tier(100.0, 1000.0);
        m.staging.threads = 2;
        m.staging.write_mbps = Curve::linear_up_to(1000.0, 4); // w_0(2)/2 = 1000 MB/s
        assert!((m.write_seconds(10_000_000) - 0.01).abs() < 1e-12);
        m.preprocess_mbps = Some(100.0); // β slower than the copy: it dominates
        assert!((m.write_seconds(10_000_000) - 0.1).abs() < 1e-12);
        m.preprocess_mbps = Some(1e6);
        assert!((m.write_seconds(10_000_000) - 0.01).abs() < 1e-12);
        let r = m.read_seconds(Location::Pfs, 10_000_000, 1);
        assert!((r - (0.1 + 0.01)).abs() < 1e-12);
        assert_eq!(m.remote_fetch_seconds(0, 1_000_000), None);
        m.interconnect_mbps = Some(100.0);
        assert!((m.remote_fetch_seconds(0, 1_000_000).unwrap() - 0.01).abs() < 1e-12);
    }

    #[test]
    fn serde_json_still_works() {
        let m = sample();
        let j = serde_json::to_string(&m).unwrap();
        let back: SystemModel = serde_json::from_str(&j).unwrap();
        assert_eq!(back, m);
    }
}
