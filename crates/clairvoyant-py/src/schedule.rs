//! Bindings of `clairvoyant_core::schedule` and `plan`.

use clairvoyant_core::plan::ReportSpec;
use clairvoyant_core::schedule::Schedule;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;

use crate::convert::{int_arg, json_to_python, orders_arg, uint_list};
use crate::errors::IntoPy;

/// One int64 array per epoch: `rank`'s samples in access order.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (num_samples, world_size, rank, epochs, batch_size, seed, drop_last=false))]
pub fn access_stream<'py>(
    py: Python<'py>,
    num_samples: &Bound<'py, PyAny>,
    world_size: &Bound<'py, PyAny>,
    rank: &Bound<'py, PyAny>,
    epochs: &Bound<'py, PyAny>,
    batch_size: &Bound<'py, PyAny>,
    seed: &Bound<'py, PyAny>,
    drop_last: bool,
) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
    let num_samples = int_arg::<u64>("num_samples", num_samples)?;
    let world_size = int_arg::<u32>("world_size", world_size)?;
    let rank = int_arg::<u32>("rank", rank)?;
    let epochs = int_arg::<u32>("epochs", epochs)?;
    let batch_size = int_arg::<u32>("batch_size", batch_size)?;
    let seed = int_arg::<u64>("seed", seed)?;
    let s = Schedule::shuffle(num_samples, world_size, batch_size, epochs, seed, drop_last).py_err()?;
    streams(py, &s, rank)
}

/// Like `access_stream`, from explicit per-epoch global orders (any sampler, materialised).
#[pyfunction]
#[pyo3(signature = (num_samples, orders, world_size, rank, batch_size, drop_last=false))]
pub fn access_stream_from_order<'py>(
    py: Python<'py>,
    num_samples: &Bound<'py, PyAny>,
    orders: &Bound<'py, PyAny>,
    world_size: &Bound<'py, PyAny>,
    rank: &Bound<'py, PyAny>,
    batch_size: &Bound<'py, PyAny>,
    drop_last: bool,
) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
    let num_samples = int_arg::<u64>("num_samples", num_samples)?;
    let orders = orders_arg(orders)?;
    let world_size = int_arg::<u32>("world_size", world_size)?;
    let rank = int_arg::<u32>("rank", rank)?;
    let batch_size = int_arg::<u32>("batch_size", batch_size)?;
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

/// The arguments both plan reports share, each checked into its type by name (the values
/// themselves are checked by `ReportSpec`).
#[allow(clippy::too_many_arguments)]
fn report_spec(
    num_samples: &Bound<'_, PyAny>,
    world_size: &Bound<'_, PyAny>,
    epochs: &Bound<'_, PyAny>,
    batch_size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
    sample_bytes: &Bound<'_, PyAny>,
    classes: Vec<(String, Bound<'_, PyAny>)>,
    drop_last: bool,
) -> PyResult<ReportSpec> {
    Ok(ReportSpec {
        num_samples: int_arg::<u64>("num_samples", num_samples)?,
        world_size: int_arg::<u32>("world_size", world_size)?,
        epochs: int_arg::<u32>("epochs", epochs)?,
        batch_size: int_arg::<u32>("batch_size", batch_size)?,
        seed: int_arg::<u64>("seed", seed)?,
        drop_last,
        sample_bytes: uint_list::<u64>("sample_bytes", sample_bytes)?,
        classes: classes
            .iter()
            .enumerate()
            .map(|(j, (name, cap))| Ok((name.clone(), int_arg::<u64>(&format!("classes[{j}] capacity"), cap)?)))
            .collect::<PyResult<Vec<_>>>()?,
    })
}

/// The plan report as dicts and lists (what `clairvoyant plan --json` prints).
#[pyfunction]
#[pyo3(signature = (num_samples, world_size, epochs, batch_size, seed, ranks, sample_bytes, classes, drop_last=false))]
#[allow(clippy::too_many_arguments)]
pub fn plan_report<'py>(
    py: Python<'py>,
    num_samples: &Bound<'_, PyAny>,
    world_size: &Bound<'_, PyAny>,
    epochs: &Bound<'_, PyAny>,
    batch_size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
    ranks: &Bound<'_, PyAny>,
    sample_bytes: &Bound<'_, PyAny>,
    classes: Vec<(String, Bound<'_, PyAny>)>,
    drop_last: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let ranks = uint_list::<u32>("ranks", ranks)?;
    let spec = report_spec(
        num_samples,
        world_size,
        epochs,
        batch_size,
        seed,
        sample_bytes,
        classes,
        drop_last,
    )?;
    let report = py.detach(|| spec.report(&ranks)).py_err()?;
    json_to_python(py, &report)
}

/// The report (dicts and lists) of the cluster-wide placement for `nodes` (each node's ranks), every node with
/// the capacities `classes`: coverage, expected file-system reads, every node's primary share and
/// node `node`'s full placement.
#[pyfunction]
#[pyo3(signature = (num_samples, world_size, epochs, batch_size, seed, nodes, sample_bytes, classes, drop_last=false, node=0))]
#[allow(clippy::too_many_arguments)]
pub fn cluster_plan_report<'py>(
    py: Python<'py>,
    num_samples: &Bound<'_, PyAny>,
    world_size: &Bound<'_, PyAny>,
    epochs: &Bound<'_, PyAny>,
    batch_size: &Bound<'_, PyAny>,
    seed: &Bound<'_, PyAny>,
    nodes: Vec<Vec<u32>>,
    sample_bytes: &Bound<'_, PyAny>,
    classes: Vec<(String, Bound<'_, PyAny>)>,
    drop_last: bool,
    node: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let spec = report_spec(
        num_samples,
        world_size,
        epochs,
        batch_size,
        seed,
        sample_bytes,
        classes,
        drop_last,
    )?;
    let v = py.detach(|| spec.cluster_report(&nodes, node)).py_err()?;
    json_to_python(py, &v)
}
