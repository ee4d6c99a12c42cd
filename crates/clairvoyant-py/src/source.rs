//! Bindings of `clairvoyant_core::source`: source objects that Python passes to a job.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clairvoyant_core::source::hdf5::{self as h5, LayoutColumns};
use clairvoyant_core::source::synthetic::Synthetic;
use clairvoyant_core::source::{
    self, ContainerSource, EmulatedFs, EmulatedSpec, FileSource, LmdbRecords, Source, Throttled,
};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{argument_type, sample_out_of_range, IntoPy};

/// Any dataset source; built by the constructors below.
#[pyclass(name = "Source", frozen, module = "clairvoyant._native")]
pub struct PySource {
    pub inner: Arc<dyn Source>,
    classes: Vec<OsString>,
    index_path: Option<PathBuf>,
    index_reused: bool,
    /// The container behind a container source (LMDB, HDF5, tar), for record shapes.
    container: Option<Arc<ContainerSource>>,
}

impl PySource {
    fn from_files(files: FileSource, emulated: Option<&PyEmulatedFs>) -> PySource {
        let classes = files.classes().to_vec();
        let index_path = files.index_path().map(Path::to_path_buf);
        let index_reused = files.index_was_reused();
        let files: Arc<dyn Source> = Arc::new(files);
        let inner: Arc<dyn Source> = match emulated {
            Some(fs) => Arc::new(Throttled::new(files, fs.inner.clone())),
            None => files,
        };
        PySource {
            inner,
            classes,
            index_path,
            index_reused,
            container: None,
        }
    }

    fn from_container(c: ContainerSource, emulated: Option<&PyEmulatedFs>) -> PySource {
        let index_path = c.index_path().map(Path::to_path_buf);
        let index_reused = c.index_was_reused();
        let c = Arc::new(c);
        let inner: Arc<dyn Source> = match emulated {
            Some(fs) => Arc::new(Throttled::new(c.clone(), fs.inner.clone())),
            None => c.clone(),
        };
        PySource {
            inner,
            classes: Vec::new(),
            index_path,
            index_reused,
            container: Some(c),
        }
    }
}

impl PySource {
    /// `sample` as an index into the source: `OutOfRangeError` for any integer outside it (even
    /// one too large for 64 bits), `ArgumentTypeError` for a non-integer; never a panic.
    fn check(&self, sample: &Bound<'_, PyAny>) -> PyResult<u32> {
        let len = self.inner.len();
        match sample.extract::<i64>() {
            Ok(k) if (0..len as i64).contains(&k) => Ok(k as u32),
            Ok(_) => Err(sample_out_of_range(sample, len)),
            Err(e) if e.is_instance_of::<PyOverflowError>(sample.py()) => Err(sample_out_of_range(sample, len)),
            Err(_) => Err(argument_type("sample", "an int", sample)),
        }
    }
}

#[pymethods]
impl PySource {
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    fn size(&self, sample: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.size(self.check(sample)?))
    }
    fn label(&self, sample: &Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.inner.label(self.check(sample)?))
    }
    /// The sample's path as `os.fsdecode` gives it (bytes that are not UTF-8 as surrogates).
    fn path(&self, sample: &Bound<'_, PyAny>) -> PyResult<OsString> {
        Ok(self.inner.path(self.check(sample)?).into_os_string())
    }
    fn total_bytes(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.inner.total_bytes())
    }
    fn labels(&self) -> Vec<i64> {
        (0..self.inner.len() as u32).map(|k| self.inner.label(k)).collect()
    }
    fn paths(&self) -> Vec<OsString> {
        (0..self.inner.len() as u32)
            .map(|k| self.inner.path(k).into_os_string())
            .collect()
    }
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }
    fn classes(&self) -> Vec<OsString> {
        self.classes.clone()
    }
    /// The index file backing this source (None for synthetic sources).
    #[getter]
    fn index_path(&self) -> Option<OsString> {
        self.index_path.clone().map(PathBuf::into_os_string)
    }
    /// Whether the cached index was reused rather than rebuilt.
    #[getter]
    fn index_reused(&self) -> bool {
        self.index_reused
    }
    /// The bytes of `sample`, read from the source (through its emulation, if any).
    fn read<'py>(&self, py: Python<'py>, sample: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        let k = self.check(sample)?;
        let mut buf = vec![0u8; self.inner.size(k) as usize];
        py.detach(|| self.inner.read_into(k, &mut buf)).py_err()?;
        Ok(PyBytes::new(py, &buf))
    }
    /// The record's shape where the container has one (Caffe Datum: channels, height, width,
    /// encoded), else an empty list.
    fn shape(&self, sample: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let k = self.check(sample)?;
        Ok(self.container.as_ref().map(|c| c.record(k).shape).unwrap_or_default())
    }

    /// Reads that went through the container's own library (LMDB values the index pass could
    /// not turn into byte ranges); 0 for other sources.
    #[getter]
    fn fallback_reads(&self) -> u64 {
        self.container.as_ref().map_or(0, |c| c.fallback_reads())
    }

    /// Records read through the container's own library rather than by byte range.
    #[getter]
    fn fallback_records(&self) -> usize {
        self.container.as_ref().map_or(0, |c| c.fallback_records())
    }
}

/// An LMDB environment (directory or data file); `caffe`: values are Caffe Datums.
#[pyfunction]
#[pyo3(signature = (path, caffe=true, index_dir=None, emulated=None, index_path=None))]
pub fn lmdb(
    py: Python<'_>,
    path: PathBuf,
    caffe: bool,
    index_dir: Option<PathBuf>,
    emulated: Option<PyRef<'_, PyEmulatedFs>>,
    index_path: Option<PathBuf>,
) -> PyResult<PySource> {
    let records = if caffe {
        LmdbRecords::CaffeDatum
    } else {
        LmdbRecords::Raw
    };
    let c = py
        .detach(|| source::lmdb(&path, records, index_dir.as_deref(), index_path.as_deref()))
        .py_err()?;
    Ok(PySource::from_container(c, emulated.as_deref()))
}

/// WebDataset-style tar shards (files or directories of `*.tar`).
#[pyfunction]
#[pyo3(signature = (paths, data_ext=None, index_dir=None, emulated=None, index_path=None))]
pub fn tar_shards(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    data_ext: Option<String>,
    index_dir: Option<PathBuf>,
    emulated: Option<PyRef<'_, PyEmulatedFs>>,
    index_path: Option<PathBuf>,
) -> PyResult<PySource> {
    let c = py
        .detach(|| source::tar_shards(&paths, data_ext.as_deref(), index_dir.as_deref(), index_path.as_deref()))
        .py_err()?;
    Ok(PySource::from_container(c, emulated.as_deref()))
}

/// What `hdf5`'s `layout` callable returns: files, directories, then per record its file index,
/// offset, length, label, name and `via`, then the chunked datasets (see [`LayoutColumns`]).
struct PyLayout(LayoutColumns);

/// A chunked dataset: file index, name, shape, chunk shape, item size, filters (id, params) in
/// pipeline order, stored chunks (file offset, stored size, filter mask, coordinates).
type ChunkedTuple = (
    u32,
    String,
    Vec<u64>,
    Vec<u64>,
    u32,
    Vec<(u32, Vec<u32>)>,
    Vec<(u64, u64, u32, Vec<u64>)>,
);

fn chunked_dataset((file, name, shape, chunk, itemsize, filters, chunks): ChunkedTuple) -> h5::ChunkedDataset {
    h5::ChunkedDataset {
        file,
        name,
        shape,
        chunk,
        itemsize,
        filters: filters
            .into_iter()
            .map(|(id, params)| h5::Filter { id, params })
            .collect(),
        chunks: chunks
            .into_iter()
            .map(|(offset, size, mask, coords)| h5::StoredChunk {
                offset,
                size,
                mask,
                coords,
            })
            .collect(),
    }
}

impl<'a, 'py> FromPyObject<'a, 'py> for PyLayout {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        #[allow(clippy::type_complexity)]
        let (files, dirs, file, offset, len, label, name, via, chunked): (
            Vec<PathBuf>,
            Vec<PathBuf>,
            Vec<u32>,
            Vec<u64>,
            Vec<u64>,
            Vec<i64>,
            Vec<String>,
            Vec<i64>,
            Vec<ChunkedTuple>,
        ) = obj.extract()?;
        Ok(PyLayout(LayoutColumns {
            files,
            dirs,
            file,
            offset,
            len,
            label,
            name,
            via,
            chunked: chunked.into_iter().map(chunked_dataset).collect(),
        }))
    }
}

/// HDF5 samples as byte ranges; `layout()` (Python, h5py) is called only when the index must be
/// built, once per node under the index lock.
#[pyfunction]
#[pyo3(signature = (path, options, layout, index_dir=None, emulated=None, index_path=None))]
pub fn hdf5(
    py: Python<'_>,
    path: PathBuf,
    options: String,
    layout: Py<PyAny>,
    index_dir: Option<PathBuf>,
    emulated: Option<PyRef<'_, PyEmulatedFs>>,
    index_path: Option<PathBuf>,
) -> PyResult<PySource> {
    let mut py_err: Option<PyErr> = None;
    let built = py.detach(|| {
        source::hdf5(&path, &options, index_dir.as_deref(), index_path.as_deref(), || {
            let t: PyLayout = Python::attach(|py| layout.call0(py).and_then(|v| v.extract(py))).map_err(|e| {
                let msg = e.to_string();
                py_err = Some(e);
                clairvoyant_core::Error::config("layout", msg)
            })?;
            t.0.into_layout()
        })
    });
    if let Some(e) = py_err {
        return Err(e);
    }
    Ok(PySource::from_container(built.py_err()?, emulated.as_deref()))
}

/// An ImageFolder directory (torchvision layout and order), indexed once and cached.
#[pyfunction]
#[pyo3(signature = (root, index_dir=None, emulated=None, index_path=None))]
pub fn image_folder(
    py: Python<'_>,
    root: PathBuf,
    index_dir: Option<PathBuf>,
    emulated: Option<PyRef<'_, PyEmulatedFs>>,
    index_path: Option<PathBuf>,
) -> PyResult<PySource> {
    let files = py
        .detach(|| match &index_path {
            Some(p) => source::image_folder_with_index(&root, p),
            None => source::image_folder(&root, index_dir.as_deref()),
        })
        .py_err()?;
    Ok(PySource::from_files(files, emulated.as_deref()))
}

/// A list of files with labels, indexed once and cached.
#[pyfunction]
#[pyo3(signature = (paths, labels, index_dir=None, emulated=None))]
pub fn file_list(
    py: Python<'_>,
    paths: Vec<PathBuf>,
    labels: Vec<i64>,
    index_dir: Option<PathBuf>,
    emulated: Option<PyRef<'_, PyEmulatedFs>>,
) -> PyResult<PySource> {
    let files = py
        .detach(|| source::file_list(&paths, &labels, index_dir.as_deref()))
        .py_err()?;
    Ok(PySource::from_files(files, emulated.as_deref()))
}

/// Parse a text file of `<path> <label>` lines.
#[pyfunction]
pub fn parse_list_file(path: PathBuf) -> PyResult<(Vec<OsString>, Vec<i64>)> {
    let (paths, labels) = source::parse_list_file(&path).py_err()?;
    Ok((paths.into_iter().map(PathBuf::into_os_string).collect(), labels))
}

/// An emulated shared file system: per-open latency and an aggregate bandwidth shared by every
/// process that opens the same state file.
#[pyclass(name = "EmulatedFs", frozen, module = "clairvoyant._native")]
pub struct PyEmulatedFs {
    inner: Arc<EmulatedFs>,
}

#[pymethods]
impl PyEmulatedFs {
    #[new]
    fn new(state_path: PathBuf, open_latency_ms: f64, bandwidth_mbps: f64) -> PyResult<Self> {
        if !(open_latency_ms.is_finite() && open_latency_ms >= 0.0) {
            return Err(crate::errors::ConfigError::new_err(format!(
                "invalid value for 'open_latency_ms': must be a finite number >= 0, got {open_latency_ms}"
            )));
        }
        let spec = EmulatedSpec {
            open_latency_s: open_latency_ms / 1e3,
            bandwidth_mbps,
        };
        Ok(PyEmulatedFs {
            inner: EmulatedFs::open(spec, &state_path).py_err()?,
        })
    }

    /// Read a whole file through the emulation (the GIL is released while waiting).
    fn read<'py>(&self, py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = py.detach(|| self.inner.read_file(&path)).py_err()?;
        Ok(PyBytes::new(py, &bytes))
    }

    #[getter]
    fn bytes_read(&self) -> u64 {
        self.inner.bytes_read()
    }

    #[getter]
    fn files_read(&self) -> u64 {
        self.inner.files_read()
    }

    #[getter]
    fn open_latency_ms(&self) -> f64 {
        self.inner.spec().open_latency_s * 1e3
    }

    #[getter]
    fn bandwidth_mbps(&self) -> f64 {
        self.inner.spec().bandwidth_mbps
    }

    #[getter]
    fn state_path(&self) -> OsString {
        self.inner.state_path().as_os_str().to_owned()
    }

    fn reset(&self) {
        self.inner.reset_counters();
    }
}

/// Deterministic in-memory bytes of the given sizes (tests, overhead measurements).
#[pyfunction]
#[pyo3(signature = (sizes, labels=None))]
pub fn synthetic_source(sizes: Vec<u64>, labels: Option<Vec<i64>>) -> PySource {
    PySource {
        inner: Arc::new(Synthetic::new(sizes, labels.unwrap_or_default())),
        classes: Vec::new(),
        index_path: None,
        index_reused: false,
        container: None,
    }
}

/// Where indexes (and `system.toml`) live by default: `$CLAIRVOYANT_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/clairvoyant`, else `~/.cache/clairvoyant`.
#[pyfunction]
pub fn default_index_dir() -> PyResult<OsString> {
    Ok(source::default_index_dir().py_err()?.into_os_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySource>()?;
    m.add_class::<PyEmulatedFs>()?;
    m.add_function(wrap_pyfunction!(synthetic_source, m)?)?;
    m.add_function(wrap_pyfunction!(image_folder, m)?)?;
    m.add_function(wrap_pyfunction!(file_list, m)?)?;
    m.add_function(wrap_pyfunction!(lmdb, m)?)?;
    m.add_function(wrap_pyfunction!(tar_shards, m)?)?;
    m.add_function(wrap_pyfunction!(hdf5, m)?)?;
    m.add_function(wrap_pyfunction!(parse_list_file, m)?)?;
    m.add_function(wrap_pyfunction!(default_index_dir, m)?)?;
    Ok(())
}
