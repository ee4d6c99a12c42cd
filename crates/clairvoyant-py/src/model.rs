//! Bindings of `clairvoyant_core::model` and `probe`: a system description crosses into Python
//! as a typed `SystemModel` object (read from a file, resolved, detected or probed) and goes
//! back to the engine as that object; TOML text is made only to write a file.

use std::path::PathBuf;

use clairvoyant_core::model::{ClassKind, ClassSpec, Curve, SystemModel};
use clairvoyant_core::probe::ProbeOptions;
use pyo3::prelude::*;

use crate::errors::IntoPy;

/// The model a `SystemModel` object holds, or resolved afresh (None).
pub fn model_from(model: Option<&PySystemModel>) -> PyResult<SystemModel> {
    match model {
        Some(m) => Ok(m.model.clone()),
        None => Ok(SystemModel::resolve(None).py_err()?.0),
    }
}

fn points(c: &Curve) -> Vec<(f64, f64)> {
    c.0.clone()
}

/// A system description: staging buffer, the dataset's storage, the storage classes and the
/// optional rates, as typed fields; `path` is the file it came from (None for machine defaults).
#[pyclass(name = "SystemModel", frozen, module = "clairvoyant._native")]
pub struct PySystemModel {
    model: SystemModel,
    path: Option<PathBuf>,
}

/// One storage class of a [`PySystemModel`].
#[pyclass(name = "ClassSpec", frozen, get_all, module = "clairvoyant._native")]
pub struct PyClassSpec {
    name: String,
    /// "memory" or "directory".
    kind: &'static str,
    /// The directory of a directory class.
    path: Option<String>,
    capacity: u64,
    threads: u32,
    read_mbps: Vec<(f64, f64)>,
    write_mbps: Vec<(f64, f64)>,
}

impl From<&ClassSpec> for PyClassSpec {
    fn from(c: &ClassSpec) -> Self {
        let (kind, path) = match &c.kind {
            ClassKind::Memory => ("memory", None),
            ClassKind::Directory { path } => ("directory", Some(path.display().to_string())),
        };
        PyClassSpec {
            name: c.name.clone(),
            kind,
            path,
            capacity: c.capacity,
            threads: c.threads,
            read_mbps: points(&c.read_mbps),
            write_mbps: points(&c.write_mbps),
        }
    }
}

#[pymethods]
impl PyClassSpec {
    fn __repr__(&self) -> String {
        format!(
            "ClassSpec(name={:?}, kind={:?}, capacity={}, threads={})",
            self.name, self.kind, self.capacity, self.threads
        )
    }
}

impl PySystemModel {
    /// The core model.
    pub fn model(&self) -> &SystemModel {
        &self.model
    }
}

#[pymethods]
impl PySystemModel {
    /// The description in force: the file `path`, else $CLAIRVOYANT_CONFIG, else
    /// `<cache dir>/system.toml`, else detected from the machine; environment overrides applied;
    /// validated.
    #[staticmethod]
    #[pyo3(signature = (path=None))]
    fn resolve(py: Python<'_>, path: Option<PathBuf>) -> PyResult<Self> {
        let (model, path) = py.detach(|| SystemModel::resolve(path.as_deref())).py_err()?;
        Ok(PySystemModel { model, path })
    }

    /// The description in the TOML file at `path` (what it leaves out detected), validated; no
    /// environment overrides.
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let model = py.detach(|| SystemModel::load(&path)).py_err()?;
        Ok(PySystemModel {
            model,
            path: Some(path),
        })
    }

    /// The defaults detected on this machine (no file, no environment overrides).
    #[staticmethod]
    fn detect(py: Python<'_>) -> Self {
        let model = py.detach(SystemModel::detect);
        PySystemModel { model, path: None }
    }

    /// The file the description came from; None for machine defaults.
    #[getter]
    fn path(&self) -> Option<String> {
        self.path.as_ref().map(|p| p.display().to_string())
    }

    /// Staging buffer capacity, bytes.
    #[getter]
    fn staging_capacity(&self) -> u64 {
        self.model.staging.capacity
    }

    /// Staging prefetch threads.
    #[getter]
    fn staging_threads(&self) -> u32 {
        self.model.staging.threads
    }

    /// w_0(p): [(threads, MB/s), ...].
    #[getter]
    fn staging_write_mbps(&self) -> Vec<(f64, f64)> {
        points(&self.model.staging.write_mbps)
    }

    /// t(γ): [(readers, MB/s), ...].
    #[getter]
    fn pfs_read_mbps(&self) -> Vec<(f64, f64)> {
        points(&self.model.pfs.read_mbps)
    }

    /// Cost of one open on the dataset's storage, milliseconds.
    #[getter]
    fn pfs_open_latency_ms(&self) -> f64 {
        self.model.pfs.open_latency_s * 1e3
    }

    /// The storage classes, fastest first.
    #[getter]
    fn classes(&self) -> Vec<PyClassSpec> {
        self.model.classes.iter().map(PyClassSpec::from).collect()
    }

    /// The memory class, if any.
    fn memory_class(&self) -> Option<PyClassSpec> {
        self.model
            .memory_class()
            .map(|j| PyClassSpec::from(&self.model.classes[j]))
    }

    /// b_c, MB/s (None: no interconnect).
    #[getter]
    fn interconnect_mbps(&self) -> Option<f64> {
        self.model.interconnect_mbps
    }

    /// c, MB/s.
    #[getter]
    fn compute_mbps(&self) -> Option<f64> {
        self.model.compute_mbps
    }

    /// β, MB/s.
    #[getter]
    fn preprocess_mbps(&self) -> Option<f64> {
        self.model.preprocess_mbps
    }

    /// The description as a TOML file's text (every field written out).
    fn to_toml(&self) -> String {
        self.model.to_toml_string()
    }

    /// Write the TOML file at `path` atomically and privately (mode 0600).
    fn save(&self, py: Python<'_>, path: PathBuf) -> PyResult<()> {
        py.detach(|| self.model.save(&path)).py_err()
    }

    fn __repr__(&self) -> String {
        let from = self.path().unwrap_or_else(|| "machine defaults".into());
        format!("SystemModel(from {from}, {} classes)", self.model.classes.len())
    }
}

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

/// Measure the dataset's storage and the local tiers; returns the model and writes it to
/// `output` when given. Progress goes to stderr.
#[pyfunction]
#[pyo3(signature = (dataset, output=None, ssd_dir=None, max_files=256, budget_s=10.0))]
pub fn probe(
    py: Python<'_>,
    dataset: PathBuf,
    output: Option<PathBuf>,
    ssd_dir: Option<PathBuf>,
    max_files: usize,
    budget_s: f64,
) -> PyResult<PySystemModel> {
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
    Ok(PySystemModel { model, path: output })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySystemModel>()?;
    m.add_class::<PyClassSpec>()?;
    m.add_function(wrap_pyfunction!(settings, m)?)?;
    m.add_function(wrap_pyfunction!(parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(probe, m)?)?;
    Ok(())
}
