//! Bindings of `clairvoyant_core::model`: system descriptions as TOML text.

use clairvoyant_core::model::SystemModel;
use pyo3::prelude::*;

use crate::errors::ConfigError;

/// The model from TOML text, or the machine's defaults.
pub fn model_from(toml_text: Option<String>) -> PyResult<SystemModel> {
    match toml_text {
        Some(t) => toml::from_str(&t).map_err(|e| ConfigError::new_err(e.to_string())),
        None => Ok(fallback()),
    }
}

fn fallback() -> SystemModel {
    use clairvoyant_core::model::*;
    SystemModel {
        staging: StagingSpec {
            capacity: 256 << 20,
            threads: 4,
        },
        pfs: PfsSpec {
            read_mbps: Curve(vec![(1.0, 200.0), (8.0, 2000.0)]),
            open_latency_s: 0.001,
        },
        classes: vec![ClassSpec {
            name: "memory".into(),
            kind: ClassKind::Memory,
            capacity: 4 << 30,
            threads: 2,
            read_mbps: Curve(vec![(1.0, 5000.0), (4.0, 20000.0)]),
            write_mbps: Curve(vec![(1.0, 5000.0), (4.0, 20000.0)]),
        }],
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
