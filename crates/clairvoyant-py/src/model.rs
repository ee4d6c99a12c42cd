//! Bindings of `clairvoyant_core::model` and `probe`: system descriptions travel as TOML text.

use std::path::{Path, PathBuf};

use clairvoyant_core::model::SystemModel;
use clairvoyant_core::probe::ProbeOptions;
use pyo3::prelude::*;

use crate::errors::IntoPy;

/// The model from resolved TOML text (as `resolve_config` returns it), or resolved afresh.
pub fn model_from(toml_text: Option<String>) -> PyResult<SystemModel> {
    match toml_text {
        Some(t) => SystemModel::from_toml_str(&t, Path::new("<resolved config>")).py_err(),
        None => Ok(SystemModel::resolve(None).py_err()?.0),
    }
}

/// (path used or None for machine defaults, the model as TOML text): an explicit file, else
/// $CLAIRVOYANT_CONFIG, else `<cache dir>/system.toml`, else detected; environment overrides
/// applied; validated.
/// The configuration registry (`clairvoyant_core::sysinfo::env::ALL`): one
/// (name, kind, choices, default, doc, set by "user" or "clairvoyant") per variable.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn settings() -> Vec<(
    &'static str,
    &'static str,
    Vec<&'static str>,
    &'static str,
    &'static str,
    &'static str,
)> {
    use clairvoyant_core::sysinfo::env::{SetBy, ALL};
    ALL.iter()
        .map(|v| {
            let by = match v.set_by {
                SetBy::User => "user",
                SetBy::Clairvoyant => "clairvoyant",
            };
            (v.name, v.kind.name(), v.kind.choices().to_vec(), v.default, v.doc, by)
        })
        .collect()
}

/// Bytes in a size written as people write it ("512MiB", "8 GiB", "1.5GB", "1048576"); a
/// `ConfigError` naming `what` otherwise. The one parser of sizes (`model::parse_bytes`).
#[pyfunction]
#[pyo3(signature = (text, what="size"))]
pub fn parse_bytes(text: &str, what: &str) -> PyResult<u64> {
    clairvoyant_core::model::parse_bytes(text)
        .map_err(|reason| crate::errors::config(format!("invalid value for {what}: {text:?} is not a size ({reason})")))
}

#[pyfunction]
#[pyo3(signature = (path=None))]
pub fn resolve_config(path: Option<PathBuf>) -> PyResult<(Option<String>, String)> {
    let (model, used) = SystemModel::resolve(path.as_deref()).py_err()?;
    Ok((used.map(|p| p.display().to_string()), model.to_toml_string()))
}

/// Measure the dataset's storage and the local tiers; returns the model as TOML text and writes
/// it to `output` when given. Progress goes to stderr.
#[pyfunction]
#[pyo3(signature = (dataset, output=None, ssd_dir=None, max_files=256, budget_s=10.0))]
pub fn probe(
    py: Python<'_>,
    dataset: PathBuf,
    output: Option<PathBuf>,
    ssd_dir: Option<PathBuf>,
    max_files: usize,
    budget_s: f64,
) -> PyResult<String> {
    let model = py
        .detach(|| {
            let progress = |msg: &str| eprintln!("{msg}");
            let opts = ProbeOptions {
                ssd_dir,
                max_files,
                budget_s,
                progress: Some(&progress),
                ..ProbeOptions::default()
            };
            let model = clairvoyant_core::probe::probe(&dataset, &opts)?;
            if let Some(out) = &output {
                model.save(out)?;
            }
            Ok::<_, clairvoyant_core::Error>(model)
        })
        .py_err()?;
    Ok(model.to_toml_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(resolve_config, m)?)?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    Ok(())
}
