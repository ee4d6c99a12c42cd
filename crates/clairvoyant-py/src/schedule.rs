//! Bindings of `clairvoyant_core::schedule` and `plan`.

use clairvoyant_core::plan;
use clairvoyant_core::schedule::Schedule;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::errors::IntoPy;

/// One int64 array per epoch: `rank`'s samples in access order.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (num_samples, world_size, rank, epochs, batch_size, seed, drop_last=false))]
pub fn access_stream<'py>(
    py: Python<'py>,
    num_samples: u64,
    world_size: u32,
    rank: u32,
    epochs: u32,
    batch_size: u32,
    seed: u64,
    drop_last: bool,
) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
    let s = Schedule::shuffle(num_samples, world_size, batch_size, epochs, seed, drop_last).py_err()?;
    streams(py, &s, rank)
}

/// Like `access_stream`, from explicit per-epoch global orders (any sampler, materialised).
#[pyfunction]
#[pyo3(signature = (num_samples, orders, world_size, rank, batch_size, drop_last=false))]
pub fn access_stream_from_order<'py>(
    py: Python<'py>,
    num_samples: u64,
    orders: Vec<Vec<u32>>,
    world_size: u32,
    rank: u32,
    batch_size: u32,
    drop_last: bool,
) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
    let s = Schedule::explicit(num_samples, orders, world_size, batch_size, drop_last).py_err()?;
    streams(py, &s, rank)
}

fn streams<'py>(py: Python<'py>, s: &Schedule, rank: u32) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
    let per_epoch = py.detach(|| s.streams(&[rank])).py_err()?;
    Ok(per_epoch
        .into_iter()
        .map(|mut e| {
            e.remove(0)
                .samples
                .into_iter()
                .map(i64::from)
                .collect::<Vec<_>>()
                .into_pyarray(py)
        })
        .collect())
}

/// The plan report as a JSON string (see `clairvoyant plan --json`).
#[pyfunction]
#[pyo3(signature = (num_samples, world_size, epochs, batch_size, seed, ranks, sample_bytes, classes, drop_last=false))]
#[allow(clippy::too_many_arguments)]
pub fn plan_report(
    py: Python<'_>,
    num_samples: u64,
    world_size: u32,
    epochs: u32,
    batch_size: u32,
    seed: u64,
    ranks: Vec<u32>,
    sample_bytes: Vec<u64>,
    classes: Vec<(String, u64)>,
    drop_last: bool,
) -> PyResult<String> {
    let s = Schedule::shuffle(num_samples, world_size, batch_size, epochs, seed, drop_last).py_err()?;
    let report = py
        .detach(|| {
            let size = |k: u32| {
                if sample_bytes.len() == 1 {
                    sample_bytes[0]
                } else {
                    sample_bytes[k as usize]
                }
            };
            plan::report(&s, &ranks, size, &classes)
        })
        .py_err()?;
    Ok(report.to_string())
}
