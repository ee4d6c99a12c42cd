//! Every core error variant mapped to a Python exception. The classes live in
//! `clairvoyant/errors.py`, where each derives from `ClairvoyantError` and the matching built-in
//! (PyO3's `create_exception!` takes one base); they are imported once and re-exported here so
//! `clairvoyant._native.ConfigError` is `clairvoyant.ConfigError`.

use std::io::ErrorKind;
use std::path::Path;

use clairvoyant_core::Error;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

pyo3::import_exception!(clairvoyant.errors, ClairvoyantError);
pyo3::import_exception!(clairvoyant.errors, ConfigError);
pyo3::import_exception!(clairvoyant.errors, CapacityError);
pyo3::import_exception!(clairvoyant.errors, OutOfRangeError);
pyo3::import_exception!(clairvoyant.errors, ArgumentTypeError);
pyo3::import_exception!(clairvoyant.errors, DatasetChangedError);
pyo3::import_exception!(clairvoyant.errors, IndexMismatchError);
pyo3::import_exception!(clairvoyant.errors, CorruptError);
pyo3::import_exception!(clairvoyant.errors, ExhaustedError);
pyo3::import_exception!(clairvoyant.errors, EpochOutOfRangeError);
pyo3::import_exception!(clairvoyant.errors, EpochConsumedError);
pyo3::import_exception!(clairvoyant.errors, CancelledError);
pyo3::import_exception!(clairvoyant.errors, SimulationStalledError);
pyo3::import_exception!(clairvoyant.errors, ConnectionFailedError);

/// The `OSError` subclass for an error number, with `errno`, `filename` and the message set
/// (`clairvoyant.errors.os_error`, which picks the class as `OSError(errno, ...)` does).
fn os_error(code: Option<i32>, msg: String, path: Option<&Path>) -> PyErr {
    static FACTORY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    Python::attach(|py| {
        let made = FACTORY
            .import(py, "clairvoyant.errors", "os_error")
            .and_then(|f| f.call1((code, msg.clone(), path.map(Path::as_os_str))));
        match made {
            Ok(exc) => PyErr::from_value(exc),
            Err(e) => e,
        }
    })
}

/// errno of an I/O error: the OS's own, else the one its kind stands for.
fn errno_of(e: &std::io::Error) -> Option<i32> {
    e.raw_os_error().or(match e.kind() {
        ErrorKind::NotFound => Some(libc::ENOENT),
        ErrorKind::PermissionDenied => Some(libc::EACCES),
        ErrorKind::AlreadyExists => Some(libc::EEXIST),
        ErrorKind::TimedOut => Some(libc::ETIMEDOUT),
        ErrorKind::IsADirectory => Some(libc::EISDIR),
        ErrorKind::NotADirectory => Some(libc::ENOTDIR),
        ErrorKind::StorageFull => Some(libc::ENOSPC),
        _ => None,
    })
}

pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Config { .. } => ConfigError::new_err(msg),
        Error::NotFound { path, .. } => os_error(Some(libc::ENOENT), msg, Some(&path)),
        Error::Io { path, source } => os_error(errno_of(&source), msg, Some(&path)),
        Error::Changed { .. } => DatasetChangedError::new_err(msg),
        Error::BadIndex { .. } => IndexMismatchError::new_err(msg),
        Error::Corrupt { .. } => CorruptError::new_err(msg),
        Error::NotNodeCache { path } => os_error(Some(libc::EEXIST), msg, Some(&path)),
        Error::TooLarge { .. } | Error::PlanTooLarge { .. } => CapacityError::new_err(msg),
        Error::Exhausted { .. } => ExhaustedError::new_err(msg),
        Error::EpochPastEnd { .. } | Error::EpochBeforeStart { .. } => EpochOutOfRangeError::new_err(msg),
        Error::EpochConsumed { .. } | Error::EpochDropped { .. } => EpochConsumedError::new_err(msg),
        Error::TimedOut { path, .. } => os_error(Some(libc::ETIMEDOUT), msg, Some(&path)),
        Error::SimulationStalled { .. } => SimulationStalledError::new_err(msg),
        Error::Cancelled => CancelledError::new_err(msg),
        Error::Untrusted { path, .. } => os_error(Some(libc::EACCES), msg, Some(&path)),
        // The core's enum is non_exhaustive; a variant added there without a line here still
        // reaches Python as a ClairvoyantError.
        _ => ClairvoyantError::new_err(msg),
    }
}

/// `ConfigError` with `msg`: an invalid argument or setting, which `msg` names.
pub fn config(msg: impl Into<String>) -> PyErr {
    ConfigError::new_err(msg.into())
}

/// `ConnectionFailedError` (a `ConnectionError`) for a node agent or peer that could not be
/// reached or whose connection broke with `e`; `errno` is `e`'s.
pub fn connection(e: &std::io::Error, msg: String) -> PyErr {
    ConnectionFailedError::new_err((errno_of(e), msg))
}

/// The `ClairvoyantOSError` subclass `e`'s errno picks, with `msg` and no file name.
pub fn io(e: &std::io::Error, msg: String) -> PyErr {
    os_error(errno_of(e), msg, None)
}

/// `OutOfRangeError` for a sample number outside a dataset of `len` samples.
pub fn sample_out_of_range(sample: &Bound<'_, PyAny>, len: usize) -> PyErr {
    OutOfRangeError::new_err(format!(
        "invalid value for 'sample': {sample} is outside the dataset (0..{len})"
    ))
}

/// `ArgumentTypeError` for an argument `name` that is not `expected`.
pub fn argument_type(name: &str, expected: &str, got: &Bound<'_, PyAny>) -> PyErr {
    let type_name = got
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    ArgumentTypeError::new_err(format!(
        "invalid value for '{name}': expected {expected}, not {type_name}"
    ))
}

pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Every name of `clairvoyant.errors.__all__` is re-exported on `_native` (code raises
    // `_native.ConfigError(...)`): one list of the classes, kept in errors.py.
    let errors = m.py().import("clairvoyant.errors")?;
    for name in errors.getattr("__all__")?.try_iter()? {
        let name: String = name?.extract()?;
        m.add(name.as_str(), errors.getattr(name.as_str())?)?;
    }
    Ok(())
}
