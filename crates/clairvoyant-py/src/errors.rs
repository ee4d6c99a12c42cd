//! Every core error variant mapped to a Python exception, built-ins where they fit.

use clairvoyant_core::Error;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    _native,
    ClairvoyantError,
    PyRuntimeError,
    "Base class of clairvoyant's own errors."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    PyValueError,
    "An invalid configuration value or argument; the message names the field."
);
pyo3::create_exception!(
    _native,
    DatasetChangedError,
    ClairvoyantError,
    "The dataset changed after it was indexed."
);
pyo3::create_exception!(
    _native,
    IndexMismatchError,
    ClairvoyantError,
    "An index file belongs to another dataset or is damaged."
);
pyo3::create_exception!(
    _native,
    CapacityError,
    PyValueError,
    "A sample is larger than a buffer or storage class."
);
pyo3::create_exception!(
    _native,
    ExhaustedError,
    ClairvoyantError,
    "Consumption went past the end of the schedule or an epoch."
);
pyo3::create_exception!(
    _native,
    CancelledError,
    ClairvoyantError,
    "The job was closed while waiting."
);

pub fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Config { .. } => ConfigError::new_err(msg),
        Error::NotFound { .. } => PyFileNotFoundError::new_err(msg),
        Error::Io { .. } => PyOSError::new_err(msg),
        Error::Changed { .. } => DatasetChangedError::new_err(msg),
        Error::BadIndex { .. } => IndexMismatchError::new_err(msg),
        Error::TooLarge { .. } => CapacityError::new_err(msg),
        Error::Exhausted(_) => ExhaustedError::new_err(msg),
        Error::Cancelled => CancelledError::new_err(msg),
        _ => ClairvoyantError::new_err(msg),
    }
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
    let py = m.py();
    m.add("ClairvoyantError", py.get_type::<ClairvoyantError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("DatasetChangedError", py.get_type::<DatasetChangedError>())?;
    m.add("IndexMismatchError", py.get_type::<IndexMismatchError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    m.add("ExhaustedError", py.get_type::<ExhaustedError>())?;
    m.add("CancelledError", py.get_type::<CancelledError>())?;
    Ok(())
}
