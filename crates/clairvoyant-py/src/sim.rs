//! Bindings of `clairvoyant_sim`: a simulation runs on its own thread; Python polls its
//! progress (for a progress bar), can cancel it, and gets the result as JSON text.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clairvoyant_core::Error;
use clairvoyant_sim::{scenario, Axis, Progress, Request};
use pyo3::prelude::*;
use std::sync::atomic::Ordering;

use crate::errors::{to_py, IntoPy};

type Outcome = Option<Result<String, Error>>;

/// A running simulation.
#[pyclass(module = "clairvoyant._native")]
pub struct Simulation {
    progress: Arc<Progress>,
    outcome: Arc<Mutex<Outcome>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn request(
    scenario: String,
    policies: Vec<String>,
    sets: Vec<(String, String)>,
    sizes: Option<Vec<u64>>,
    sweep: Vec<(String, Vec<String>)>,
) -> Request {
    Request {
        scenario,
        sets,
        policies,
        sizes,
        sweep: sweep.into_iter().map(|(key, values)| Axis { key, values }).collect(),
    }
}

#[pymethods]
impl Simulation {
    /// Start simulating. `scenario`: a preset name or a TOML file; `sets`: (dotted key, value)
    /// overrides; `sizes`: sample sizes replacing the scenario's dataset; `sweep`: (key,
    /// values) axes. Bad arguments raise here, before the thread starts.
    #[new]
    #[pyo3(signature = (scenario, policies=Vec::new(), sets=Vec::new(), sizes=None, sweep=Vec::new()))]
    fn new(
        scenario: String,
        policies: Vec<String>,
        sets: Vec<(String, String)>,
        sizes: Option<Vec<u64>>,
        sweep: Vec<(String, Vec<String>)>,
    ) -> PyResult<Self> {
        let req = request(scenario, policies, sets, sizes, sweep);
        // Fail fast on a bad scenario, override or policy name.
        let doc = clairvoyant_sim::request_doc(&req).py_err()?;
        clairvoyant_sim::Scenario::from_doc(&doc).py_err()?;
        for p in &req.policies {
            clairvoyant_sim::Policy::parse(p).py_err()?;
        }
        let progress = Arc::new(Progress::default());
        let outcome: Arc<Mutex<Outcome>> = Arc::new(Mutex::new(None));
        let (p, o) = (progress.clone(), outcome.clone());
        let thread = std::thread::Builder::new()
            .name("clairvoyant-sim".into())
            .spawn(move || {
                let r = clairvoyant_sim::run_request(&req, &p).map(|v| v.to_string());
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

    /// Wait up to `timeout` seconds (None: until done) and return the result as JSON text, or
    /// None on timeout. Raises the simulation's error. Ctrl-C cancels the simulation.
    #[pyo3(signature = (timeout=None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<String>> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            if let Some(r) = self.outcome.lock().unwrap_or_else(|e| e.into_inner()).take() {
                if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    py.detach(|| t.join()).ok();
                }
                return r.map(Some).map_err(to_py);
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

/// The scenario (preset or file, with overrides) as TOML text.
#[pyfunction]
#[pyo3(signature = (scenario, sets=Vec::new()))]
pub fn sim_scenario_toml(scenario: String, sets: Vec<(String, String)>) -> PyResult<String> {
    let req = request(scenario, Vec::new(), sets, None, Vec::new());
    let doc = clairvoyant_sim::request_doc(&req).py_err()?;
    clairvoyant_sim::Scenario::from_doc(&doc).py_err()?;
    Ok(scenario::to_toml_string(&doc))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Simulation>()?;
    m.add_function(wrap_pyfunction!(sim_presets, m)?)?;
    m.add_function(wrap_pyfunction!(sim_policies, m)?)?;
    m.add_function(wrap_pyfunction!(sim_scenario_toml, m)?)?;
    Ok(())
}
