//! Conversions at the Python boundary that several bindings share: result documents become
//! Python dicts and lists (never JSON text), and integer arguments (numpy arrays read in place,
//! or sequences of ints) become checked Rust vectors whose errors name the argument.

use numpy::{Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyList, PyString};

use crate::errors::{ArgumentTypeError, ConfigError};

/// A result document as Python dicts, lists and numbers, keys in the document's order:
/// exactly what `json.loads` of its JSON text gives.
pub(crate) fn json_to_python<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            // serde_json holds only finite floats (non-finite ones are null).
            (None, None) => PyFloat::new(py, n.as_f64().unwrap_or(f64::NAN)).into_any(),
        },
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(a) => {
            let items = a.iter().map(|x| json_to_python(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, json_to_python(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// Unsigned integer types an argument can be checked into.
pub(crate) trait UInt: TryFrom<i128> + Copy {
    const MAX: u64;
}
impl UInt for u32 {
    const MAX: u64 = u32::MAX as u64;
}
impl UInt for u64 {
    const MAX: u64 = u64::MAX;
}

/// `ConfigError` for the value `got` of `name` outside `T`'s range.
fn out_of_range<T: UInt>(name: &str, got: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(format!(
        "invalid value for '{name}': must be in 0..={}, got {got}",
        T::MAX
    ))
}

/// The name of `obj`'s type, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_default()
}

/// The integer argument `name` in `T`'s range: ArgumentTypeError (a TypeError) naming it for a
/// non-integer (bool included), ConfigError naming it for a value out of range (instead of a
/// bare OverflowError).
pub(crate) fn int_arg<T: UInt>(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<T> {
    let py = obj.py();
    let shown = || obj.str().map(|s| s.to_string()).unwrap_or_default();
    if obj.is_instance_of::<PyBool>() {
        return Err(ArgumentTypeError::new_err(format!(
            "'{name}' must be an integer, not bool"
        )));
    }
    match obj.extract::<i128>() {
        Ok(v) => T::try_from(v).map_err(|_| out_of_range::<T>(name, v)),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(out_of_range::<T>(name, shown())),
        Err(_) => Err(ArgumentTypeError::new_err(format!(
            "'{name}' must be an integer, not {}",
            type_name(obj)
        ))),
    }
}

/// A sequence of unsigned integers: a 1-D numpy integer array (read in place, see
/// [`uint_array`]) or any sequence of ints; an element out of range or of the wrong type is named
/// by its position (`name[i]`).
pub(crate) fn uint_list<T>(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Vec<T>>
where
    T: UInt + for<'a, 'py> FromPyObject<'a, 'py>,
{
    if let Some(v) = uint_array::<T>(name, obj)? {
        return Ok(v);
    }
    if let Ok(v) = obj.extract::<Vec<T>>() {
        return Ok(v);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(ArgumentTypeError::new_err(format!(
            "'{name}' must be a sequence of integers, not str"
        )));
    }
    let items = obj.try_iter().map_err(|_| {
        ArgumentTypeError::new_err(format!(
            "'{name}' must be a sequence of integers, not {}",
            type_name(obj)
        ))
    })?;
    let mut out = Vec::new();
    for (i, item) in items.enumerate() {
        out.push(int_arg::<T>(&format!("{name}[{i}]"), &item?)?);
    }
    Ok(out)
}

/// The values of a 1-D numpy array of integers as `T`, read from the array's memory without
/// converting each element to a Python object; None when `obj` is not a numpy array (or is one
/// of Python objects, which the caller reads as a sequence). Errors name `name`: ConfigError
/// for another shape or an element out of `T`'s range (`name[i]`, negative ones included),
/// ArgumentTypeError for a dtype that is not an integer one (bool, float, ...).
pub(crate) fn uint_array<T: UInt>(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<T>>> {
    let Ok(arr) = obj.cast::<PyUntypedArray>() else {
        return Ok(None);
    };
    let dtype = arr.dtype();
    if dtype.kind() == b'O' && arr.ndim() == 1 {
        return Ok(None);
    }
    if arr.ndim() != 1 {
        return Err(ConfigError::new_err(format!(
            "invalid value for '{name}': must be a 1-D array of integers, got a {}-D array",
            arr.ndim()
        )));
    }
    if !matches!(dtype.kind(), b'i' | b'u') {
        let shown = dtype.str().map(|s| s.to_string()).unwrap_or_default();
        return Err(ArgumentTypeError::new_err(format!(
            "'{name}' must be an array of integers, not of dtype {shown}"
        )));
    }
    if let Some(v) = typed_array::<T>(name, obj)? {
        return Ok(Some(v));
    }
    // An integer dtype numpy does not hand over as one of the types above (another byte order):
    // one conversion of the whole array to the native 64-bit type of its sign.
    let native = if dtype.kind() == b'u' { "=u8" } else { "=i8" };
    let converted = obj.call_method1("astype", (native,))?;
    typed_array::<T>(name, &converted)?
        .map(Some)
        .ok_or_else(|| ArgumentTypeError::new_err(format!("'{name}': unsupported integer dtype {dtype}")))
}

/// The array `obj` as `T` when its dtype is one of the native integer types; None otherwise.
fn typed_array<T: UInt>(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<T>>> {
    macro_rules! each {
        ($($s:ty),*) => {$(
            if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, $s>>() {
                return checked::<T, $s>(name, &a).map(Some);
            }
        )*};
    }
    each!(u32, i64, u64, i32, u16, i16, u8, i8);
    Ok(None)
}

/// Every element of `a` checked into `T`; the first one out of range is named by its position.
fn checked<T: UInt, S: Element + Copy + Into<i128> + std::fmt::Display>(
    name: &str,
    a: &PyReadonlyArray1<'_, S>,
) -> PyResult<Vec<T>> {
    a.as_array()
        .iter()
        .enumerate()
        .map(|(i, &v)| T::try_from(v.into()).map_err(|_| out_of_range::<T>(&format!("{name}[{i}]"), v)))
        .collect()
}

/// Per-epoch orders of sample ids: a sequence of epochs (or a 2-D array, one row per epoch),
/// each read like [`uint_list`] (numpy arrays in place); errors name `orders[e]` and
/// `orders[e][i]`.
pub(crate) fn orders_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<u32>>> {
    let expected = "'orders' must be a sequence of sequences of sample ids";
    if obj.is_instance_of::<PyString>() {
        return Err(ArgumentTypeError::new_err(format!("{expected}, not str")));
    }
    let epochs = obj
        .try_iter()
        .map_err(|_| ArgumentTypeError::new_err(format!("{expected}, not {}", type_name(obj))))?;
    let mut out = Vec::new();
    for (e, epoch) in epochs.enumerate() {
        out.push(uint_list::<u32>(&format!("orders[{e}]"), &epoch?)?);
    }
    Ok(out)
}
