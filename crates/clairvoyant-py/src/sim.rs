//! Bindings of `clairvoyant_sim`: a simulation runs on its own thread; Python polls its
//! progress (for a progress bar), can cancel it, and gets the result as Python dicts and lists.
//! A scenario comes as a preset name, a file path or a dict (the table a file would hold);
//! overrides come as typed values. Nothing crosses as TOML or JSON text.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clairvoyant_core::Error;
use clairvoyant_sim::{scenario, Axis, Progress, Request, ScenarioSource};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::sync::atomic::Ordering;

use crate::convert::json_to_python;
use crate::errors::{to_py, IntoPy};

type Outcome = Option<Result<serde_json::Value, Error>>;

/// A running simulation.
#[pyclass(module = "clairvoyant._native")]
pub struct Simulation {
    progress: Arc<Progress>,
    outcome: Arc<Mutex<Outcome>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A Python value of a scenario as a TOML value: bool, int, float, str, list or tuple, and
/// dict with string keys. `key` (dotted) names it in errors.
fn to_toml(v: &Bound<'_, PyAny>, key: &str) -> PyResult<toml::Value> {
    let config = |reason: String| to_py(Error::config(key, reason));
    if let Ok(b) = v.cast::<PyBool>() {
        return Ok(toml::Value::Boolean(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        return v
            .extract::<i64>()
            .map(toml::Value::Integer)
            .map_err(|_| config(format!("is {v}, beyond a 64-bit integer")));
    }
    if let Ok(x) = v.cast::<PyFloat>() {
        return Ok(toml::Value::Float(x.value()));
    }
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(toml::Value::String(s.to_str()?.to_owned()));
    }
    if let Ok(d) = v.cast::<PyDict>() {
        return to_table(d, key).map(toml::Value::Table);
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items = v
            .try_iter()?
            .enumerate()
            .map(|(i, x)| to_toml(&x?, &format!("{key}[{i}]")));
        return items.collect::<PyResult<Vec<_>>>().map(toml::Value::Array);
    }
    // Other numbers (numpy's, for one): integers by `__index__`, the rest by `__float__`.
    if let Ok(n) = v.extract::<i64>() {
        return Ok(toml::Value::Integer(n));
    }
    if let Ok(x) = v.extract::<f64>() {
        return Ok(toml::Value::Float(x));
    }
    let kind = v.get_type().name()?;
    Err(config(format!(
        "is a {kind}; expected a number, a string, a bool, a list or a dict"
    )))
}

/// A dict with string keys as a TOML table; `prefix` (dotted, may be empty) names its keys.
fn to_table(d: &Bound<'_, PyDict>, prefix: &str) -> PyResult<toml::Table> {
    let mut out = toml::Table::new();
    for (k, v) in d.iter() {
        let Ok(name) = k.extract::<String>() else {
            let at = if prefix.is_empty() { "scenario" } else { prefix };
            return Err(to_py(Error::config(at, format!("has the key {k}; keys are strings"))));
        };
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        out.insert(name, to_toml(&v, &key)?);
    }
    Ok(out)
}

/// A TOML value as a Python value (a datetime as its TOML text).
fn toml_to_python<'py>(py: Python<'py>, v: &toml::Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        toml::Value::String(s) => PyString::new(py, s).into_any(),
        toml::Value::Integer(n) => n.into_pyobject(py)?.into_any(),
        toml::Value::Float(x) => PyFloat::new(py, *x).into_any(),
        toml::Value::Boolean(b) => PyBool::new(py, *b).to_owned().into_any(),
        toml::Value::Datetime(d) => PyString::new(py, &d.to_string()).into_any(),
        toml::Value::Array(a) => {
            let items = a.iter().map(|x| toml_to_python(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        toml::Value::Table(t) => {
            let d = PyDict::new(py);
            for (k, x) in t {
                d.set_item(k, toml_to_python(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// A request from Python's arguments: `scenario` a preset name, a file path or a dict; `sets`
/// (dotted key, value) with typed values.
fn request(
    scenario: &Bound<'_, PyAny>,
    policies: Vec<String>,
    sets: Vec<(String, Bound<'_, PyAny>)>,
    sizes: Option<Vec<u64>>,
    sweep: Vec<(String, Vec<String>)>,
) -> PyResult<Request> {
    let scenario = match scenario.cast::<PyDict>() {
        Ok(d) => ScenarioSource::Table(to_table(d, "")?),
        Err(_) => ScenarioSource::Named(scenario.str()?.to_str()?.to_owned()),
    };
    let sets = sets
        .into_iter()
        .map(|(k, v)| to_toml(&v, &k).map(|v| (k, v)))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(Request {
        scenario,
        sets,
        policies,
        sizes,
        sweep: sweep.into_iter().map(|(key, values)| Axis { key, values }).collect(),
    })
}

/// Fail fast on a bad scenario, override or policy name.
fn check(req: &Request) -> Result<(), Error> {
    let doc = clairvoyant_sim::request_doc(req)?;
    clairvoyant_sim::Scenario::from_doc(&doc)?;
    for p in &req.policies {
        clairvoyant_sim::Policy::parse(p)?;
    }
    Ok(())
}

#[pymethods]
impl Simulation {
    /// Start simulating. `scenario`: a preset name, a TOML file or a dict; `sets`: (dotted key,
    /// value) overrides; `sizes`: sample sizes replacing the scenario's dataset; `sweep`: (key,
    /// values) axes. Bad arguments raise here, before the thread starts.
    #[new]
    #[pyo3(signature = (scenario, policies=Vec::new(), sets=Vec::new(), sizes=None, sweep=Vec::new()))]
    fn new(
        py: Python<'_>,
        scenario: &Bound<'_, PyAny>,
        policies: Vec<String>,
        sets: Vec<(String, Bound<'_, PyAny>)>,
        sizes: Option<Vec<u64>>,
        sweep: Vec<(String, Vec<String>)>,
    ) -> PyResult<Self> {
        let req = request(scenario, policies, sets, sizes, sweep)?;
        py.detach(|| check(&req)).py_err()?;
        let progress = Arc::new(Progress::default());
        let outcome: Arc<Mutex<Outcome>> = Arc::new(Mutex::new(None));
        let (p, o) = (progress.clone(), outcome.clone());
        let thread = std::thread::Builder::new()
            .name("clairvoyant-sim".into())
            .spawn(move || {
                let r = clairvoyant_sim::run_request(&req, &p);
                *o.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            })
            .map_err(|e| to_py(Error::io("simulation thread", e)))?;
        Ok(Simulation {
            progress,
            outcome,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// (samples simulated, samples in all); the total grows while policies are set up.
    fn progress(&self) -> (u64, u64) {
        (
            self.progress.done.load(Ordering::Relaxed),
            self.progress.total.load(Ordering::Relaxed),
        )
    }

    /// Whether the result (or error) is ready.
    fn finished(&self) -> bool {
        self.outcome.lock().map(|o| o.is_some()).unwrap_or(true)
    }

    /// Ask the simulation to stop; `result` then raises CancelledError.
    fn cancel(&self) {
        self.progress.cancel.store(true, Ordering::Relaxed);
    }

    /// Wait up to `timeout` seconds (None: until done) and return the result document (dicts
    /// and lists), or None on timeout. Raises the simulation's error. Ctrl-C cancels the
    /// simulation.
    #[pyo3(signature = (timeout=None))]
    fn result<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            if let Some(r) = self.outcome.lock().unwrap_or_else(|e| e.into_inner()).take() {
                if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    py.detach(|| t.join()).ok();
                }
                return json_to_python(py, &r.map_err(to_py)?).map(Some);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(20)));
            if let Err(e) = py.check_signals() {
                self.cancel();
                return Err(e);
            }
        }
    }
}

impl Drop for Simulation {
    fn drop(&mut self) {
        self.progress.cancel.store(true, Ordering::Relaxed);
    }
}

/// The names of the preset scenarios.
#[pyfunction]
pub fn sim_presets() -> Vec<&'static str> {
    scenario::preset_names()
}

/// The policy names, in the report's order.
#[pyfunction]
pub fn sim_policies() -> Vec<&'static str> {
    clairvoyant_sim::Policy::ALL.iter().map(|p| p.name()).collect()
}

/// The scenario (preset, file or dict, with overrides) as TOML text, checked.
#[pyfunction]
#[pyo3(signature = (scenario, sets=Vec::new()))]
pub fn sim_scenario_toml(
    py: Python<'_>,
    scenario: &Bound<'_, PyAny>,
    sets: Vec<(String, Bound<'_, PyAny>)>,
) -> PyResult<String> {
    let req = request(scenario, Vec::new(), sets, None, Vec::new())?;
    py.detach(|| {
        let doc = clairvoyant_sim::request_doc(&req)?;
        clairvoyant_sim::Scenario::from_doc(&doc)?;
        Ok(scenario::to_toml_string(&doc))
    })
    .py_err()
}

/// A value as a command line writes it (`--set KEY=VALUE`): a TOML value (`3`, `1.5`, `true`,
/// `"64GB"`, `[[1, 330]]`), else the text itself.
#[pyfunction]
pub fn sim_value<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    toml_to_python(py, &scenario::parse_value(text))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Simulation>()?;
    m.add_function(wrap_pyfunction!(sim_presets, m)?)?;
    m.add_function(wrap_pyfunction!(sim_policies, m)?)?;
    m.add_function(wrap_pyfunction!(sim_scenario_toml, m)?)?;
    m.add_function(wrap_pyfunction!(sim_value, m)?)?;
    Ok(())
}
