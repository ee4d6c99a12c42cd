//! Bindings of `clairvoyant_core::source`: source objects that Python passes to a job.

use std::sync::Arc;

use clairvoyant_core::source::synthetic::Synthetic;
use clairvoyant_core::source::Source;
use pyo3::prelude::*;

/// Any dataset source; built by the constructors below.
#[pyclass(name = "Source", frozen, module = "clairvoyant._native")]
pub struct PySource {
    pub inner: Arc<dyn Source>,
}

#[pymethods]
impl PySource {
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    fn size(&self, sample: u32) -> u64 {
        self.inner.size(sample)
    }
    fn label(&self, sample: u32) -> i64 {
        self.inner.label(sample)
    }
    fn path(&self, sample: u32) -> String {
        self.inner.path(sample).display().to_string()
    }
    fn total_bytes(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.inner.total_bytes())
    }
    fn labels(&self) -> Vec<i64> {
        (0..self.inner.len() as u32).map(|k| self.inner.label(k)).collect()
    }
    fn paths(&self) -> Vec<String> {
        (0..self.inner.len() as u32)
            .map(|k| self.inner.path(k).display().to_string())
            .collect()
    }
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
}

/// Deterministic in-memory bytes of the given sizes (tests, overhead measurements).
#[pyfunction]
#[pyo3(signature = (sizes, labels=None))]
pub fn synthetic_source(sizes: Vec<u64>, labels: Option<Vec<i64>>) -> PySource {
    PySource {
        inner: Arc::new(Synthetic::new(sizes, labels.unwrap_or_default())),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySource>()?;
    m.add_function(wrap_pyfunction!(synthetic_source, m)?)?;
    Ok(())
}
