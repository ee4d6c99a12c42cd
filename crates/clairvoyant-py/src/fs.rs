//! Private folders and files of this user, for the Python side of the cluster set-up (the
//! rendezvous directory, the job secret, the agents' folders): the core's `tier::secure` rules,
//! so both languages refuse and repair the same things.

use std::ffi::OsString;
use std::path::PathBuf;

use clairvoyant_core::tier::secure;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::IntoPy;

/// `path` as a private directory of this user (created 0700 with its parents when `create`);
/// a symlink, a file, or a folder of another user is refused (`AccessDeniedError` naming it),
/// and so is one of ours that others may enter unless `tighten` (then it is closed again).
#[pyfunction]
#[pyo3(signature = (path, create = true, tighten = false))]
pub fn private_dir(py: Python<'_>, path: PathBuf, create: bool, tighten: bool) -> PyResult<OsString> {
    py.detach(|| secure::private_dir_at(&path, create, tighten)).py_err()?;
    Ok(path.into_os_string())
}

/// This user's folder in shared memory (`clairvoyant-<uid>`, or the next free `.1`, `.2`, ...
/// name with a warning when another user took it), created 0700.
#[pyfunction]
pub fn user_runtime_dir(py: Python<'_>) -> PyResult<OsString> {
    Ok(py
        .detach(|| secure::private_dir(&secure::shm_base()))
        .py_err()?
        .into_os_string())
}

/// Remove this user's node-cache files that no live process uses (`tier::clean`), under the
/// node-shared memory folder (`CLAIRVOYANT_SHM_DIR`, else `/dev/shm`) and the disk fallback's,
/// and in the folders of the directory classes `classes`: (files, bytes) removed.
#[pyfunction]
#[pyo3(signature = (classes=Vec::new()))]
pub fn clean_node_caches(py: Python<'_>, classes: Vec<PathBuf>) -> (u64, u64) {
    let c = py.detach(|| clairvoyant_core::tier::clean(&secure::shm_base(), &classes));
    (c.files, c.bytes)
}

/// The bytes of a file only this user may read (regular, owned by this user, mode 0600, never
/// through a symlink); anything else is refused (`AccessDeniedError` naming it).
#[pyfunction]
pub fn read_private<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyBytes>> {
    let bytes = py.detach(|| secure::read_private(&path)).py_err()?;
    Ok(PyBytes::new(py, &bytes))
}

/// Add this module's functions to `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(clean_node_caches, m)?)?;
    m.add_function(wrap_pyfunction!(private_dir, m)?)?;
    m.add_function(wrap_pyfunction!(user_runtime_dir, m)?)?;
    m.add_function(wrap_pyfunction!(read_private, m)?)?;
    Ok(())
}
