//! The scenario document's typed form: what a file (or a table handed over from Python) may
//! say, read with serde in one pass. Unknown and mistyped fields are refused with the dotted
//! key; ranges and cross-field rules are checked once, when the scenario is resolved.

use serde::de::{self, Deserializer, Unexpected, Visitor};
use serde::Deserialize;

use super::{parse_fractional_bytes, PfsSharing};

/// The keys of a scenario document, each optional (defaults are applied when it is resolved).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields, expecting = "a scenario table")]
pub(crate) struct ScenarioFile {
    pub name: Option<String>,
    pub description: Option<String>,
    pub workers: Option<u64>,
    pub workers_per_node: Option<u64>,
    pub epochs: Option<u64>,
    pub batch_size: Option<u64>,
    /// The shuffle's seed; a negative one is taken modulo 2^64, as it always was.
    pub seed: Option<i64>,
    pub drop_last: Option<bool>,
    pub staging_buffer_source: Option<String>,
    #[serde(default)]
    pub dataset: DatasetFile,
    /// Per node, in the engine's configuration format: read by the core's system model.
    pub system: Option<toml::Table>,
    pub cpu: Option<CpuFile>,
    #[serde(default)]
    pub network: NetworkFile,
    pub pfs_sharing: Option<PfsSharing>,
}

/// `[dataset]`: drawn sizes (`samples`, `mean`, `std`, `seed`) or a real dataset (`path`).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(crate) struct DatasetFile {
    pub samples: Option<u64>,
    pub mean: Option<ByteSize>,
    pub std: Option<ByteSize>,
    /// Seed of the drawn sizes; a negative one is taken modulo 2^64.
    pub seed: Option<i64>,
    pub path: Option<String>,
}

/// `[cpu]`: who shares which cores.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(crate) struct CpuFile {
    pub cores: Option<u64>,
    pub nodes_per_machine: Option<u64>,
    pub processes_per_worker: Option<u64>,
}

/// `[network]`: the peers' latency (their bandwidth is `system.interconnect_mbps`).
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields, expecting = "a table")]
pub(crate) struct NetworkFile {
    pub latency_ms: Option<f64>,
}

/// A byte size that keeps fractions: an integer, a float or a string with a unit ("107.7kB").
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ByteSize(pub f64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(ByteSizeVisitor)
    }
}

struct ByteSizeVisitor;

impl Visitor<'_> for ByteSizeVisitor {
    type Value = ByteSize;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a size such as 110000 or \"107.7kB\"")
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> std::result::Result<ByteSize, E> {
        if n < 0 {
            return Err(E::invalid_value(Unexpected::Signed(n), &self));
        }
        Ok(ByteSize(n as f64))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> std::result::Result<ByteSize, E> {
        Ok(ByteSize(n as f64))
    }

    fn visit_f64<E: de::Error>(self, x: f64) -> std::result::Result<ByteSize, E> {
        if x >= 0.0 && x.is_finite() {
            Ok(ByteSize(x))
        } else {
            Err(E::invalid_value(Unexpected::Float(x), &self))
        }
    }

    fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<ByteSize, E> {
        parse_fractional_bytes(s).map(ByteSize).map_err(E::custom)
    }
}

/// The typed form of a scenario document, or the first field that does not fit: (dotted key,
/// reason). The loader's `origin` key (where the document came from) is not a field.
pub(crate) fn parse(doc: &toml::Table) -> std::result::Result<ScenarioFile, (String, String)> {
    let mut doc = doc.clone();
    doc.remove("origin");
    clairvoyant_core::model::deserialize_toml(toml::Value::Table(doc)).map_err(|(key, message)| {
        let key = if key == "." { "scenario".to_string() } else { key };
        (key, plain(&message))
    })
}

/// serde's type names in words a scenario's author uses.
fn plain(message: &str) -> String {
    message
        .replace("expected u64", "expected an integer >= 0")
        .replace("expected i64", "expected an integer")
        .replace("expected f64", "expected a number")
        .replace("expected a map", "expected a table")
}
