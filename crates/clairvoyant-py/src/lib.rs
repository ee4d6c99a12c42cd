//! Thin PyO3 bindings: the private module `clairvoyant._native`. Each file mirrors a core module;
//! bodies extract arguments, call the core with the GIL released and convert results.

// Every public item of this crate is documented, and stays so.
#![warn(missing_docs)]

use pyo3::prelude::*;

mod agent;
mod convert;
mod decode;
mod engine;
mod errors;
mod fs;
mod model;
mod peer;
mod schedule;
mod sim;
mod source;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(schedule::access_stream, m)?)?;
    m.add_function(wrap_pyfunction!(schedule::access_stream_from_order, m)?)?;
    m.add_function(wrap_pyfunction!(schedule::plan_report, m)?)?;
    m.add_function(wrap_pyfunction!(schedule::cluster_plan_report, m)?)?;
    source::register(m)?;
    model::register(m)?;
    engine::register(m)?;
    peer::register(m)?;
    sim::register(m)?;
    decode::register(m)?;
    agent::register(m)?;
    fs::register(m)?;
    Ok(())
}
