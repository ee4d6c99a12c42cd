//! The `system.toml` file (layout in the module docs). Read with serde into sections whose
//! fields are all optional, laid over a base model (the detected one, or the simulator's
//! neutral one), then validated once; written with the `toml` crate's serializer. Every error
//! is `Error::Config` with the dotted key (`class.ssd.capacity`) and the file in the reason.

use std::fmt::Display;
use std::path::{Path, PathBuf};

use serde::de::Error as _;
use serde::{Deserialize, Serialize};

use super::bytes::{format_bytes, parse_bytes};
use super::validate::class_key;
use super::{ClassKind, ClassSpec, Curve, SystemModel};
use crate::error::{Error, Result};
use crate::sysinfo::defaults;

/// A TOML value for an error message: its type and (at most 60 characters of) its text.
pub fn describe_toml(v: &toml::Value) -> String {
    let mut s = v.to_string();
    if s.len() > 60 {
        s.truncate(57);
        s.push_str("...");
    }
    format!("{} {s}", v.type_str())
}

fn found(v: &toml::Value, want: impl Display) -> String {
    format!("found {}; expected {want}", describe_toml(v))
}

// ---------------------------------------------------------------------------------------------
// Field values: each takes any TOML value and says what it expected when it cannot use it.
// ---------------------------------------------------------------------------------------------

/// Implements `Deserialize` for a field type from a conversion of the TOML value it is given.
macro_rules! from_toml_value {
    ($t:ty, |$v:ident| $body:expr) => {
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                let $v = toml::Value::deserialize(d)?;
                let r: std::result::Result<$t, String> = $body;
                r.map_err(D::Error::custom)
            }
        }
    };
}

/// Bytes: an integer or a size such as "8 GiB".
struct Capacity(u64);
from_toml_value!(Capacity, |v| match &v {
    toml::Value::Integer(n) if *n >= 0 => Ok(Capacity(*n as u64)),
    toml::Value::String(s) => parse_bytes(s).map(Capacity),
    _ => Err(found(&v, "a byte count >= 0 such as 1048576, \"512MiB\" or \"8 GiB\"")),
});

struct Threads(u32);
from_toml_value!(Threads, |v| match &v {
    toml::Value::Integer(n) if (0..=u32::MAX as i64).contains(n) => Ok(Threads(*n as u32)),
    _ => Err(found(&v, "a thread count (integer >= 1)")),
});

fn number(v: &toml::Value, want: &str) -> std::result::Result<f64, String> {
    match v {
        toml::Value::Integer(n) => Ok(*n as f64),
        toml::Value::Float(x) => Ok(*x),
        _ => Err(found(v, want)),
    }
}

/// A throughput in MB/s.
struct Rate(f64);
from_toml_value!(Rate, |v| number(&v, "a throughput in MB/s").map(Rate));

struct Millis(f64);
from_toml_value!(Millis, |v| number(&v, "milliseconds (a number >= 0)").map(Millis));

/// One number (MB/s at any count) or `[[threads, MB/s], ...]`.
struct CurveValue(Curve);
from_toml_value!(CurveValue, |v| {
    const WANT: &str = "a throughput in MB/s or [[threads, MB/s], ...] such as [[1, 500.0], [4, 1800.0]]";
    match v.as_array() {
        None => number(&v, WANT).map(|y| CurveValue(Curve::constant(y))),
        Some(arr) => arr
            .iter()
            .enumerate()
            .map(|(i, p)| match p.as_array().map(Vec::as_slice) {
                Some([x, y]) => Ok((number(x, WANT)?, number(y, WANT)?)),
                _ => Err(format!(
                    "point {i}: found {}; expected a pair [threads, MB/s] ({WANT})",
                    describe_toml(p)
                )),
            })
            .collect::<std::result::Result<Vec<_>, String>>()
            .map(|pts| CurveValue(Curve(pts))),
    }
});

struct Text(String);
from_toml_value!(Text, |v| match v {
    toml::Value::String(s) => Ok(Text(s)),
    other => Err(found(&other, "a string")),
});

struct DirPath(String);
from_toml_value!(DirPath, |v| match v {
    toml::Value::String(s) => Ok(DirPath(s)),
    other => Err(found(&other, "a directory path")),
});

#[derive(PartialEq)]
enum Kind {
    Memory,
    Directory,
}
from_toml_value!(Kind, |v| match v.as_str() {
    Some("memory") => Ok(Kind::Memory),
    Some("directory") => Ok(Kind::Directory),
    _ => Err(found(&v, "\"memory\" or \"directory\"")),
});

/// `[[class]]` tables, each read on its own (its errors name the class).
struct ClassList(Vec<toml::Value>);
from_toml_value!(ClassList, |v| match v {
    toml::Value::Array(a) => Ok(ClassList(a)),
    other => Err(found(&other, "[[class]] tables (or class = [] for none)")),
});

// ---------------------------------------------------------------------------------------------
// Sections: what a file may say; what it leaves out keeps the base model's value.
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct FileModel {
    staging: Option<FileStaging>,
    pfs: Option<FilePfs>,
    class: Option<ClassList>,
    interconnect_mbps: Option<Rate>,
    compute_mbps: Option<Rate>,
    preprocess_mbps: Option<Rate>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct FileStaging {
    capacity: Option<Capacity>,
    threads: Option<Threads>,
    write_mbps: Option<CurveValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct FilePfs {
    read_mbps: Option<CurveValue>,
    open_latency_ms: Option<Millis>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a table")]
struct FileClass {
    name: Option<Text>,
    kind: Option<Kind>,
    path: Option<DirPath>,
    capacity: Option<Capacity>,
    threads: Option<Threads>,
    read_mbps: Option<CurveValue>,
    write_mbps: Option<CurveValue>,
}

/// `value` as `T`, or the first field that does not fit: its dotted key (`a.b`, `a[0].b`; an
/// unknown key is the last part; `.` for the value as a whole) and serde's message. The system
/// description and the simulator's scenarios name the keys of their errors this way.
pub fn deserialize_toml<T: serde::de::DeserializeOwned>(
    value: toml::Value,
) -> std::result::Result<T, (String, String)> {
    serde_path_to_error::deserialize(value)
        .map_err(|e| (e.path().to_string(), e.into_inner().message().trim().to_string()))
}

/// The dotted key (under `prefix`) and the reason of an error [`deserialize_toml`] gave for a
/// table; an unknown key's reason lists the keys allowed there (serde names them in its message:
/// ``unknown field `x`, expected one of `a`, `b` ``).
fn key_and_reason((path, message): (String, String), prefix: &str) -> (String, String) {
    let path = if path == "." { "" } else { path.as_str() };
    let key = [prefix, path]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(".");
    let Some(rest) = message.strip_prefix("unknown field `") else {
        return (key, message);
    };
    let allowed: Vec<&str> = rest.split('`').skip(2).step_by(2).filter(|n| !n.is_empty()).collect();
    (key, format!("unknown key; allowed here: {}", allowed.join(", ")))
}

/// Lays a file's sections over a base model; errors name `origin`.
struct Reader<'a> {
    origin: &'a Path,
}

impl Reader<'_> {
    fn err(&self, key: impl Into<String>, reason: impl Display) -> Error {
        Error::config(key, format!("{reason} (in {})", self.origin.display()))
    }

    fn serde_err(&self, e: (String, String), prefix: &str) -> Error {
        let (key, reason) = key_and_reason(e, prefix);
        self.err(key, reason)
    }

    /// A class's directory: relative paths are relative to the file's folder.
    fn path(&self, s: String) -> PathBuf {
        let p = PathBuf::from(&s);
        if p.is_relative() && !s.is_empty() {
            if let Some(dir) = self.origin.parent().filter(|d| !d.as_os_str().is_empty()) {
                return dir.join(p);
            }
        }
        p
    }

    fn model(&self, doc: &toml::Table, base: SystemModel) -> Result<SystemModel> {
        let file: FileModel = deserialize_toml(toml::Value::Table(doc.clone())).map_err(|e| self.serde_err(e, ""))?;
        let mut m = base;
        if let Some(s) = file.staging {
            set(&mut m.staging.capacity, s.capacity.map(|c| c.0));
            set(&mut m.staging.threads, s.threads.map(|t| t.0));
            set(&mut m.staging.write_mbps, s.write_mbps.map(|c| c.0));
        }
        if let Some(p) = file.pfs {
            set(&mut m.pfs.read_mbps, p.read_mbps.map(|c| c.0));
            set(&mut m.pfs.open_latency_s, p.open_latency_ms.map(|ms| ms.0 / 1e3));
        }
        if let Some(list) = file.class {
            let base = m.clone();
            m.classes = list
                .0
                .iter()
                .enumerate()
                .map(|(i, c)| self.class(c, i, &base))
                .collect::<Result<_>>()?;
        }
        for (slot, v) in [
            (&mut m.interconnect_mbps, file.interconnect_mbps),
            (&mut m.compute_mbps, file.compute_mbps),
            (&mut m.preprocess_mbps, file.preprocess_mbps),
        ] {
            if let Some(r) = v {
                *slot = Some(r.0);
            }
        }
        Ok(m)
    }

    /// `[[class]]` number `i`; what it leaves out comes from the base's class of the same kind
    /// (memory), else from the built-in typical numbers.
    fn class(&self, v: &toml::Value, i: usize, base: &SystemModel) -> Result<ClassSpec> {
        if !v.is_table() {
            return Err(self.err(format!("class[{i}]"), found(v, "a table")));
        }
        let named = v.get("name").and_then(toml::Value::as_str).unwrap_or("");
        let prefix = class_key(named, i);
        let c: FileClass = deserialize_toml(v.clone()).map_err(|e| self.serde_err(e, &prefix))?;
        let Some(Text(name)) = c.name else {
            return Err(self.err(format!("class[{i}].name"), "missing; every [[class]] needs a name"));
        };
        let k = |f: &str| format!("{prefix}.{f}");
        let kind = match (c.kind, c.path) {
            (None, _) => return Err(self.err(k("kind"), "missing; expected \"memory\" or \"directory\"")),
            (Some(Kind::Memory), Some(_)) => {
                return Err(self.err(
                    k("path"),
                    "a memory class has no path; remove it or use kind = \"directory\"",
                ))
            }
            (Some(Kind::Memory), None) => ClassKind::Memory,
            (Some(Kind::Directory), Some(DirPath(p))) => ClassKind::Directory { path: self.path(p) },
            (Some(Kind::Directory), None) => return Err(self.err(k("path"), "missing; a directory class needs a path")),
        };
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
        set(&mut spec.capacity, c.capacity.map(|c| c.0));
        set(&mut spec.threads, c.threads.map(|t| t.0));
        set(&mut spec.read_mbps, c.read_mbps.map(|c| c.0));
        set(&mut spec.write_mbps, c.write_mbps.map(|c| c.0));
        Ok(spec)
    }
}

fn set<T>(slot: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *slot = v;
    }
}

/// Line and column (1-based) of byte `offset` in `s`.
fn line_col(s: &str, offset: usize) -> (usize, usize) {
    let before = &s[..offset.min(s.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(before.len(), |i| before.len() - i - 1) + 1;
    (line, col)
}

// ---------------------------------------------------------------------------------------------
// Writing: every field, in the shapes a person writes (sizes in MiB/GiB/TiB when exact, one
// number for a constant curve).
// ---------------------------------------------------------------------------------------------

const HEADER: &str = "# clairvoyant system model (NoPFS performance model).\n\
                      # Capacities: bytes or \"512 MiB\", \"8 GiB\", \"1.5GB\"; 0 disables a class.\n\
                      # Throughput: MB/s (10^6 bytes/s), one number or [[threads or readers, MB/s], ...].\n";

#[derive(Serialize)]
#[serde(untagged)]
enum SizeOut {
    Bytes(u64),
    Text(String),
}

impl SizeOut {
    fn of(n: u64) -> SizeOut {
        let f = format_bytes(n);
        match f.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
            Some(t) => SizeOut::Text(t.to_string()),
            None => SizeOut::Bytes(n),
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum NumOut {
    Int(i64),
    Float(f64),
}

#[derive(Serialize)]
#[serde(untagged)]
enum CurveOut {
    One(f64),
    Points(Vec<(NumOut, f64)>),
}

impl CurveOut {
    fn of(c: &Curve) -> CurveOut {
        if let [(x, y)] = c.0.as_slice() {
            if *x == 1.0 {
                return CurveOut::One(*y);
            }
        }
        let x_out = |x: f64| {
            if x.fract() == 0.0 && x.abs() < 1e15 {
                NumOut::Int(x as i64)
            } else {
                NumOut::Float(x)
            }
        };
        CurveOut::Points(c.0.iter().map(|&(x, y)| (x_out(x), y)).collect())
    }
}

#[derive(Serialize)]
struct StagingOut {
    capacity: SizeOut,
    threads: u32,
    write_mbps: CurveOut,
}

#[derive(Serialize)]
struct PfsOut {
    read_mbps: CurveOut,
    open_latency_ms: f64,
}

#[derive(Serialize)]
struct ClassOut<'a> {
    name: &'a str,
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<String>,
    capacity: SizeOut,
    threads: u32,
    read_mbps: CurveOut,
    write_mbps: CurveOut,
}

#[derive(Serialize)]
struct FileOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    interconnect_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    compute_mbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    preprocess_mbps: Option<f64>,
    staging: StagingOut,
    pfs: PfsOut,
    class: Vec<ClassOut<'a>>,
}

impl<'a> FileOut<'a> {
    fn of(m: &'a SystemModel) -> FileOut<'a> {
        let class = m.classes.iter().map(|c| {
            let (kind, path) = match &c.kind {
                ClassKind::Memory => ("memory", None),
                ClassKind::Directory { path } => ("directory", Some(path.to_string_lossy().into_owned())),
            };
            ClassOut {
                name: &c.name,
                kind,
                path,
                capacity: SizeOut::of(c.capacity),
                threads: c.threads,
                read_mbps: CurveOut::of(&c.read_mbps),
                write_mbps: CurveOut::of(&c.write_mbps),
            }
        });
        FileOut {
            interconnect_mbps: m.interconnect_mbps,
            compute_mbps: m.compute_mbps,
            preprocess_mbps: m.preprocess_mbps,
            staging: StagingOut {
                capacity: SizeOut::of(m.staging.capacity),
                threads: m.staging.threads,
                write_mbps: CurveOut::of(&m.staging.write_mbps),
            },
            pfs: PfsOut {
                read_mbps: CurveOut::of(&m.pfs.read_mbps),
                open_latency_ms: ms_for(m.pfs.open_latency_s),
            },
            class: class.collect(),
        }
    }
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
        let body = toml::to_string(&FileOut::of(self)).expect("a system model is always valid TOML");
        let gap = if body.starts_with('[') { "\n" } else { "" };
        format!("{HEADER}{gap}{body}")
    }

    /// Write [`SystemModel::to_toml_string`] to `path` (creating its directory, mode 0700),
    /// atomically and privately (mode 0600, see [`write_private`](crate::tier::secure::write_private)).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        crate::source::index::make_parent(path)?;
        crate::tier::secure::write_private(path, self.to_toml_string().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{base, key_of, parse, sample};
    use super::*;
    use crate::sysinfo::ENV_LOCK;

    /// The reason of a config error, panicking on anything else.
    fn reason_of(r: Result<SystemModel>) -> String {
        match r {
            Err(Error::Config { reason, .. }) => reason,
            other => panic!("expected a config error, got {other:?}"),
        }
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
    fn a_value_that_does_not_fit_is_named_by_its_dotted_key() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Doc {
            #[allow(dead_code)]
            list: Vec<Inner>,
        }
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Inner {
            #[allow(dead_code)]
            n: u32,
        }
        let of = |s: &str| deserialize_toml::<Doc>(toml::Value::Table(s.parse().unwrap())).unwrap_err();
        let (key, message) = of("[[list]]\nn = 1\n[[list]]\nn = \"x\"\n");
        assert_eq!(key, "list[1].n");
        assert!(message.contains("invalid type"), "{message}");
        let (key, message) = of("[[list]]\nn = 1\nm = 2\n");
        assert_eq!(key, "list[0].m");
        assert!(message.starts_with("unknown field `m`"), "{message}");
        assert_eq!(of("").0, ".", "a missing field is the document's");
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

    #[test]
    fn serde_json_still_works() {
        let m = sample();
        let j = serde_json::to_string(&m).unwrap();
        let back: SystemModel = serde_json::from_str(&j).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn the_file_is_written_as_people_write_it() {
        let expected = r#"# clairvoyant system model (NoPFS performance model).
# Capacities: bytes or "512 MiB", "8 GiB", "1.5GB"; 0 disables a class.
# Throughput: MB/s (10^6 bytes/s), one number or [[threads or readers, MB/s], ...].
interconnect_mbps = 10000.0
compute_mbps = 800.0
preprocess_mbps = 1500.5

[staging]
capacity = "512 MiB"
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
write_mbps = 4000.0

[[class]]
name = "ssd"
kind = "directory"
path = "/local/scratch/cv"
capacity = 1500000000
threads = 4
read_mbps = [[1, 500.0], [4, 1800.0]]
write_mbps = [[1, 300.0], [4, 900.0]]
"#;
        assert_eq!(sample().to_toml_string(), expected);
        let mut m = sample();
        m.classes.clear();
        (m.interconnect_mbps, m.compute_mbps, m.preprocess_mbps) = (None, None, None);
        m.pfs.read_mbps = Curve(vec![(2.5, 100.0)]);
        let text = m.to_toml_string();
        let body = text.split_once("...].\n").unwrap().1;
        assert!(
            body.starts_with("class = []\n\n[staging]\ncapacity = \"512 MiB\"\n"),
            "{text}"
        );
        assert!(body.contains("\n[pfs]\nread_mbps = [[2.5, 100.0]]\n"), "{text}");
        let mut m = sample();
        m.classes.truncate(1);
        (m.interconnect_mbps, m.compute_mbps, m.preprocess_mbps) = (None, None, None);
        let text = m.to_toml_string();
        assert!(text.contains("...].\n\n[staging]\n"), "{text}");
    }

    #[test]
    fn bad_fields_are_named_with_what_was_expected() {
        for (text, key, says) in [
            ("staging = 3\n", "staging", "a table"),
            (
                "[staging]\ncapacity = true\n",
                "staging.capacity",
                "found boolean true; expected a byte count",
            ),
            (
                "[staging]\ncapacity = \"12 parsecs\"\n",
                "staging.capacity",
                "unknown unit",
            ),
            (
                "[staging]\nthreads = 2.5\n",
                "staging.threads",
                "expected a thread count",
            ),
            (
                "[pfs]\nopen_latency_ms = \"soon\"\n",
                "pfs.open_latency_ms",
                "expected milliseconds",
            ),
            (
                "[pfs]\nread_mbps = [[1, \"x\"]]\n",
                "pfs.read_mbps",
                "found string \"x\"",
            ),
            ("[pfs]\nread_mbps = [5]\n", "pfs.read_mbps", "point 0: found integer 5"),
            ("class = 3\n", "class", "expected [[class]] tables"),
            ("class = [3]\n", "class[0]", "found integer 3; expected a table"),
            ("[[class]]\nname = 7\n", "class[0].name", "expected a string"),
            (
                "[[class]]\nname = \"ssd\"\nkind = \"directory\"\npath = 1\n",
                "class.ssd.path",
                "a directory path",
            ),
            (
                "[[class]]\nname = \"m\"\nkind = \"memory\"\nthreads = -1\n",
                "class.m.threads",
                "thread count",
            ),
            (
                "[[class]]\nname = \"m\"\nkind = \"memory\"\nread_mbps = []\n",
                "class.m.read_mbps",
                "has no points",
            ),
            (
                "[[class]]\nname = \"my ssd\"\nkind = \"memory\"\nspeed = 1\n",
                "class[0].speed",
                "allowed here: name, kind, path",
            ),
            (
                "preprocess_mbps = 0\n",
                "preprocess_mbps",
                "must be a finite throughput > 0",
            ),
        ] {
            let r = parse(text);
            let reason = reason_of(parse(text));
            assert_eq!(key_of(r), key, "{text}: {reason}");
            assert!(reason.contains(says), "{text}: {reason}");
            assert!(reason.ends_with("(in /etc/test/system.toml)"), "{text}: {reason}");
        }
    }

    #[test]
    fn a_table_section_keeps_relative_keys() {
        let doc: toml::Table = "[staging]\nthreads = 0\n".parse().unwrap();
        let e = SystemModel::from_toml_table(&doc, Path::new("scenario.toml"), base()).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, reason } if key == "staging.threads" && reason.contains("scenario.toml")),
            "{e}"
        );
    }
}
