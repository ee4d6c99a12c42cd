//! Bindings of `clairvoyant_core::engine`: samples reach Python as read-only numpy views of the
//! staging ring or of the node's shared memory, kept valid by a lease object that releases the
//! staging space when the last view of it is gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clairvoyant_core::engine::{AgentDesc, ClusterDesc, Engine, EngineSpec, Lease, PeersDesc, Region, SOURCE_NAMES};
use clairvoyant_net::engine::PeerClient;
use numpy::ndarray::ArrayView1;
use numpy::{IntoPyArray, PyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::convert::{orders_arg, uint_list};
use crate::errors::{to_py, IntoPy};
use crate::source::PySource;

/// A batch as handed to Python: views and labels.
type Batch<'py> = (Vec<Bound<'py, PyArray1<u8>>>, Bound<'py, PyArray1<i64>>);

/// A batch for a worker process: lease, descriptors, labels, bytes of samples in private memory.
type SharedBatch<'py> = (
    Bound<'py, PyAny>,
    Vec<(u8, u64, usize)>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyDict>,
);

/// Keeps staged samples alive; releases them when garbage collected.
#[pyclass(frozen, module = "clairvoyant._native")]
struct LeaseHolder {
    engine: Arc<Engine>,
    positions: Vec<u64>,
}

impl Drop for LeaseHolder {
    fn drop(&mut self) {
        self.engine.release_many(&self.positions);
    }
}

#[pyclass(name = "Engine", frozen, module = "clairvoyant._native")]
pub struct PyEngine {
    pub(crate) engine: Arc<Engine>,
    /// The client this engine fetches other nodes' samples with (multi-node jobs).
    peers: Option<Arc<PeerClient>>,
    /// Set by `interrupt`: the batch being taken on another thread gives up.
    interrupted: AtomicBool,
}

fn view<'py>(lease: &Lease, holder: &Bound<'py, PyAny>) -> Bound<'py, PyArray1<u8>> {
    // SAFETY: the lease's bytes stay valid and unchanged until `holder` (the array's base object)
    // is dropped, which releases them; the array is made read-only below.
    unsafe {
        let v = ArrayView1::from_shape_ptr(lease.len, lease.ptr);
        let arr = PyArray1::borrow_from_array(&v, holder.clone());
        (*arr.as_array_ptr()).flags &= !numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
        arr
    }
}

impl PyEngine {
    /// Take the next `n` samples. If one of them fails, the rest of the batch is still consumed
    /// (so batches stay aligned), every taken sample is released and the first error raised.
    fn take(&self, py: Python<'_>, n: usize) -> PyResult<Vec<Lease>> {
        let mut leases = Vec::with_capacity(n);
        let mut first_err = None;
        // Samples consumed so far, handed out or failed.
        let mut taken = 0;
        self.interrupted.store(false, Ordering::Relaxed);
        while taken < n {
            if self.interrupted.swap(false, Ordering::Relaxed) {
                first_err = Some(to_py(clairvoyant_core::Error::Cancelled));
                break;
            }
            // One call hands out as many as are ready (the GIL released once for them all),
            // waking every 20 ms for Ctrl-C and `interrupt`.
            let before = leases.len();
            let r = py.detach(|| self.engine.next_many(n - taken, Duration::from_millis(20), &mut leases));
            taken += leases.len() - before;
            match r {
                Ok(()) if taken < n => {
                    if let Err(e) = py.check_signals() {
                        if e.is_instance_of::<pyo3::exceptions::PyKeyboardInterrupt>(py) {
                            first_err = Some(e);
                        } else {
                            first_err.get_or_insert(e);
                        }
                        break;
                    }
                }
                Ok(()) => {}
                Err(e @ (clairvoyant_core::Error::Cancelled | clairvoyant_core::Error::Exhausted { .. })) => {
                    first_err = Some(to_py(e));
                    break;
                }
                Err(e) => {
                    taken += 1;
                    first_err.get_or_insert(to_py(e));
                }
            }
        }
        match first_err {
            Some(e) => {
                self.engine
                    .release_many(&leases.iter().map(|l| l.pos).collect::<Vec<_>>());
                Err(e)
            }
            None => Ok(leases),
        }
    }

    /// `leases` for a worker process: (lease, [(region, offset, length)], int64 labels,
    /// {index: bytes} for samples in private memory).
    fn shared<'py>(&self, py: Python<'py>, leases: &[Lease]) -> PyResult<SharedBatch<'py>> {
        let private = PyDict::new(py);
        for (i, l) in leases.iter().enumerate() {
            if l.region == Region::Private {
                // SAFETY: valid until the lease is released, which happens after this copy.
                let bytes = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
                private.set_item(i, PyBytes::new(py, bytes))?;
            }
        }
        let descriptors = leases.iter().map(|l| (l.region as u8, l.offset, l.len)).collect();
        let labels = leases.iter().map(|l| l.label).collect::<Vec<_>>().into_pyarray(py);
        let holder = self.hold(py, leases)?;
        Ok((holder, descriptors, labels, private))
    }

    /// One object keeping `leases` alive; dropping it releases them.
    fn hold<'py>(&self, py: Python<'py>, leases: &[Lease]) -> PyResult<Bound<'py, PyAny>> {
        let holder = LeaseHolder {
            engine: self.engine.clone(),
            positions: leases.iter().map(|l| l.pos).collect(),
        };
        Ok(Bound::new(py, holder)?.into_any())
    }

    /// Wait for the next sample with the GIL released, waking every 100 ms for Ctrl-C.
    fn wait_next(&self, py: Python<'_>) -> PyResult<Lease> {
        loop {
            match py.detach(|| self.engine.next(Duration::from_millis(100))) {
                Ok(Some(l)) => return Ok(l),
                Ok(None) => py.check_signals()?,
                Err(e) => return Err(to_py(e)),
            }
        }
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (source, batch_size, epochs, seed, drop_last, rank, world_size, local_ranks, run_id, model=None, orders=None, start_epoch=0, cluster=None, agent=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        source: &PySource,
        batch_size: u32,
        epochs: u32,
        seed: u64,
        drop_last: bool,
        rank: u32,
        world_size: u32,
        local_ranks: Vec<u32>,
        run_id: String,
        model: Option<PyRef<'_, crate::model::PySystemModel>>,
        orders: Option<Bound<'_, PyAny>>,
        start_epoch: u32,
        cluster: Option<PyCluster>,
        agent: Option<PyAgent>,
    ) -> PyResult<Self> {
        let orders = orders.as_ref().map(orders_arg).transpose()?;
        let spec = EngineSpec {
            batch_size,
            epochs,
            seed,
            drop_last,
            rank,
            world_size,
            local_ranks,
            run_id,
            orders,
            start_epoch,
            cluster: cluster.map(|c| c.0),
            agent: agent.map(|a| a.0),
        };
        let model = crate::model::model_from(model.as_deref())?;
        let src = source.inner.clone();
        let (engine, peers) = py
            .detach(|| {
                let (job, peers) = clairvoyant_net::engine::job_spec(spec, src.as_ref())?;
                Engine::start(src, &model, job).map(|e| (e, peers))
            })
            .py_err()?;
        Ok(PyEngine {
            engine: Arc::new(engine),
            peers,
            interrupted: AtomicBool::new(false),
        })
    }

    /// Make a batch being taken on another thread (`next_batch_shared`, `next_batch`) give up
    /// within 20 ms with CancelledError, its samples released. A later call waits again.
    fn interrupt(&self) {
        self.interrupted.store(true, Ordering::Relaxed);
    }

    fn begin_epoch(&self, py: Python<'_>, epoch: u32) -> PyResult<()> {
        py.detach(|| self.engine.begin_epoch(epoch)).py_err()
    }

    /// The next sample as (read-only uint8 view, label).
    fn next_sample<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, PyArray1<u8>>, i64)> {
        let lease = self.wait_next(py)?;
        let holder = self.hold(py, std::slice::from_ref(&lease))?;
        Ok((view(&lease, &holder), lease.label))
    }

    /// The next `n` samples as (list of views, int64 labels). If one of them fails, the rest of
    /// the batch is still consumed (so batches stay aligned) and the first error is raised.
    fn next_batch<'py>(&self, py: Python<'py>, n: usize) -> PyResult<Batch<'py>> {
        let leases = self.take(py, n)?;
        let holder = self.hold(py, &leases)?;
        let views = leases.iter().map(|l| view(l, &holder)).collect();
        let labels = leases.iter().map(|l| l.label).collect::<Vec<_>>().into_pyarray(py);
        Ok((views, labels))
    }

    /// The next `n` samples for a worker process: (lease, [(region, offset, length)], int64
    /// labels, {index: bytes} for samples in private memory). Regions 0 and 1 are the staging ring
    /// and memory arena files of `segments`; the bytes stay valid while `lease` is alive.
    fn next_batch_shared<'py>(&self, py: Python<'py>, n: usize) -> PyResult<SharedBatch<'py>> {
        let leases = self.take(py, n)?;
        self.shared(py, &leases)
    }

    /// The first part of the next `n` samples for a worker process, as soon as `at_least` of
    /// them are ready: (lease, [(region, offset, length)], int64 labels, {index: bytes} for
    /// samples in private memory, failed). The part holds the samples ready by then (at least
    /// `at_least` or one, at most `n`). `failed`: one more sample, after those, was consumed but
    /// could not be read (the dataset reads it); the part ends there. A batch is taken by
    /// calling again for the samples left.
    #[pyo3(signature = (n, at_least=1))]
    #[allow(clippy::type_complexity)]
    fn next_part_shared<'py>(
        &self,
        py: Python<'py>,
        n: usize,
        at_least: usize,
    ) -> PyResult<(
        Bound<'py, PyAny>,
        Vec<(u8, u64, usize)>,
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyDict>,
        bool,
    )> {
        let mut leases = Vec::with_capacity(n);
        let mut failed = false;
        self.interrupted.store(false, Ordering::Relaxed);
        let at_least = at_least.clamp(1, n.max(1));
        while leases.len() < at_least.min(n) && !failed {
            let cancel = if self.interrupted.swap(false, Ordering::Relaxed) {
                Some(to_py(clairvoyant_core::Error::Cancelled))
            } else {
                let left = n - leases.len();
                match py.detach(|| self.engine.next_ready(left, Duration::from_millis(20), &mut leases)) {
                    Ok(()) if leases.len() < at_least => py.check_signals().err(),
                    Ok(()) => None,
                    Err(e @ (clairvoyant_core::Error::Cancelled | clairvoyant_core::Error::Exhausted { .. })) => {
                        Some(to_py(e))
                    }
                    Err(_) => {
                        // The sample is consumed; those before it are this part.
                        failed = true;
                        None
                    }
                }
            };
            if let Some(e) = cancel {
                self.engine
                    .release_many(&leases.iter().map(|l| l.pos).collect::<Vec<_>>());
                return Err(e);
            }
        }
        let (holder, descriptors, labels, private) = self.shared(py, &leases)?;
        Ok((holder, descriptors, labels, private, failed))
    }

    /// (staging ring file, memory arena file or None): what worker processes map.
    #[getter]
    fn segments(&self) -> (String, Option<String>) {
        let (ring, arena) = self.engine.segments();
        (ring.display().to_string(), arena.map(|p| p.display().to_string()))
    }

    fn epoch_samples<'py>(&self, py: Python<'py>, epoch: u32) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.check_epoch(epoch)?;
        Ok(int64_array(py, &self.engine.epoch_samples(epoch).py_err()?))
    }

    fn batch_ends<'py>(&self, py: Python<'py>, epoch: u32) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.check_epoch(epoch)?;
        Ok(int64_array(py, &self.engine.batch_ends(epoch)))
    }

    /// Append a pass over `samples` in batches of `batch_sizes` as the next epoch; its index.
    fn append_epoch(&self, py: Python<'_>, samples: &Bound<'_, PyAny>, batch_sizes: Vec<u64>) -> PyResult<u32> {
        let samples = sample_ids(samples)?;
        let ends = clairvoyant_core::engine::batch_ends(samples.len(), &batch_sizes).py_err()?;
        py.detach(|| self.engine.append_epoch(samples, ends)).py_err()
    }

    /// Samples of the stream the engine still holds (passes not yet consumed).
    #[getter]
    fn held_samples(&self) -> usize {
        self.engine.held_samples()
    }

    #[getter]
    fn epochs(&self) -> u32 {
        self.engine.epochs()
    }

    #[getter]
    fn position(&self) -> u64 {
        self.engine.position()
    }

    fn epoch_start(&self, epoch: u32) -> PyResult<u64> {
        self.check_epoch(epoch)?;
        Ok(self.engine.epoch_start(epoch))
    }

    /// (class name, samples, bytes) per storage class of this node's placement.
    /// Where this rank's node plan came from: "computed", "shared" (read from the node's first
    /// rank) or "process" (another job of this process).
    fn plan_origin(&self) -> &'static str {
        self.engine.plan_origin().name()
    }

    fn placement(&self) -> Vec<(String, u64, u64)> {
        self.engine.placement_summary().to_vec()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let mut out = Vec::new();
        for s in self.engine.stats() {
            let d = PyDict::new(py);
            d.set_item("epoch", s.epoch)?;
            d.set_item("samples", s.samples)?;
            d.set_item("bytes", s.bytes)?;
            d.set_item("stall_seconds", s.stall_seconds)?;
            let sources = PyDict::new(py);
            for (name, (n, b)) in SOURCE_NAMES.iter().zip(s.by_source) {
                let x = PyDict::new(py);
                x.set_item("samples", n)?;
                x.set_item("bytes", b)?;
                sources.set_item(name, x)?;
            }
            d.set_item("sources", sources)?;
            d.set_item("pfs_bytes_read", s.pfs_bytes_read)?;
            d.set_item("pfs_files_read", s.pfs_files_read)?;
            d.set_item("overflow_bytes", s.overflow_bytes)?;
            d.set_item("corrupt", s.corrupt)?;
            d.set_item("peer_misses", s.peer_misses)?;
            d.set_item("peer_fallbacks", s.peer_fallbacks)?;
            out.push(d);
        }
        Ok(out)
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| self.engine.shutdown());
    }

    /// The peer client's counters (None for a one-node job).
    fn peer_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = &self.peers else { return Ok(None) };
        let s = p.stats();
        let d = PyDict::new(py);
        d.set_item("fetched", s.fetched)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("not_yet", s.not_yet)?;
        d.set_item("not_held", s.not_held)?;
        d.set_item("failed", s.failed)?;
        d.set_item("peer_down", s.peer_down)?;
        d.set_item("corrupt", s.corrupt)?;
        d.set_item("down_events", s.down_events)?;
        Ok(Some(d))
    }

    /// Totals since start: dataset bytes and files read, bytes from peers, samples and bytes
    /// served to peers.
    fn io_totals(&self) -> [u64; 5] {
        self.engine.io_totals()
    }

    /// Samples and bytes this engine's node cache served to peers through this process.
    fn served(&self) -> (u64, u64) {
        self.engine.peer_service().served()
    }
}

impl PyEngine {
    pub(crate) fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
}

/// The fields of a dict argument (`cluster`, `agent`), each read once: a missing required key is
/// a `ConfigError` naming it, a value of the wrong type an `ArgumentTypeError` naming it.
struct Fields<'py> {
    dict: Bound<'py, PyDict>,
    name: &'static str,
}

impl<'py> Fields<'py> {
    fn of(obj: Borrowed<'_, 'py, PyAny>, name: &'static str) -> PyResult<Self> {
        match obj.cast::<PyDict>() {
            Ok(d) => Ok(Fields {
                dict: d.to_owned(),
                name,
            }),
            Err(_) => Err(crate::errors::argument_type(name, "a dict", &obj.to_owned())),
        }
    }

    /// The value at `key`, None when absent or None.
    fn get<T: for<'a> FromPyObject<'a, 'py>>(&self, key: &str) -> PyResult<Option<T>> {
        match self.dict.get_item(key)?.filter(|v| !v.is_none()) {
            Some(v) => v.extract::<T>().map(Some).map_err(|e| {
                let e: PyErr = e.into();
                crate::errors::ArgumentTypeError::new_err(format!("{}['{key}']: {e}", self.name))
            }),
            None => Ok(None),
        }
    }

    fn need<T: for<'a> FromPyObject<'a, 'py>>(&self, key: &str) -> PyResult<T> {
        self.get(key)?
            .ok_or_else(|| crate::errors::config(format!("{}['{key}'] is required", self.name)))
    }
}

/// A multi-node job's part from its Python description: `nodes` (every node's ranks), `node`
/// (this one's index), `capacities` (every node's class capacities), and, to reach the other
/// nodes, `peers` (one host:port per node), `secret` (bytes), `job` (id bound into the
/// handshake), optional `connections` per peer and `peer_wait` seconds.
struct PyCluster(ClusterDesc);

impl<'a, 'py> FromPyObject<'a, 'py> for PyCluster {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let f = Fields::of(obj, "cluster")?;
        let nodes = f.need("nodes")?;
        let node = f.need("node")?;
        let capacities = f.need("capacities")?;
        let peer_wait = f.get("peer_wait")?;
        let peers = match f.get::<Vec<String>>("peers")? {
            Some(addresses) => Some(PeersDesc {
                addresses,
                secret: f.need("secret")?,
                job: f.need("job")?,
                connections: f.get("connections")?,
            }),
            None => None,
        };
        Ok(PyCluster(ClusterDesc {
            nodes,
            node,
            capacities,
            peers,
            peer_wait,
        }))
    }
}

/// A node agent's job from Python: `{"prefill": bool, "hashed": root}` (owners by hashing each
/// file's path relative to `root`) or `{"prefill": bool, "counts": [(counts, first_need), ...]}`
/// (one pair per node: uint32 counts and uint64 first needs, numpy arrays or sequences of ints),
/// or both (see [`AgentDesc`]).
struct PyAgent(AgentDesc);

impl<'a, 'py> FromPyObject<'a, 'py> for PyAgent {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let f = Fields::of(obj, "agent")?;
        Ok(PyAgent(AgentDesc {
            prefill: f.get("prefill")?.unwrap_or(false),
            hashed: f.get("hashed")?,
            counts: agent_counts(&f)?,
        }))
    }
}

/// `agent['counts']`: every node's (counts, first needs) pair, arrays read in place; errors name
/// `agent.counts[n].counts` or `agent.counts[n].first_need` (and the position in it).
#[allow(clippy::type_complexity)]
fn agent_counts(f: &Fields<'_>) -> PyResult<Option<Vec<(Vec<u32>, Vec<u64>)>>> {
    let Some(pairs) = f.dict.get_item("counts")?.filter(|v| !v.is_none()) else {
        return Ok(None);
    };
    let expected = "a sequence of (counts, first_need) pairs";
    let items = pairs
        .try_iter()
        .map_err(|_| crate::errors::argument_type("agent.counts", expected, &pairs))?;
    let mut out = Vec::new();
    for (n, pair) in items.enumerate() {
        let pair = pair?;
        let halves = match pair.try_iter() {
            Ok(it) => it.collect::<PyResult<Vec<_>>>()?,
            Err(_) => Vec::new(),
        };
        let [counts, first] = halves.as_slice() else {
            let at = format!("agent.counts[{n}]");
            return Err(crate::errors::argument_type(&at, "a (counts, first_need) pair", &pair));
        };
        out.push((
            uint_list::<u32>(&format!("agent.counts[{n}].counts"), counts)?,
            uint_list::<u64>(&format!("agent.counts[{n}].first_need"), first)?,
        ));
    }
    Ok(Some(out))
}

/// The capacities this node would cache `source` in for `local_ranks` ranks: [(class, bytes)],
/// fastest first (announced to the other nodes of a multi-node job).
#[pyfunction]
#[pyo3(signature = (source, local_ranks, model=None))]
pub fn node_capacities(
    source: &PySource,
    local_ranks: u32,
    model: Option<PyRef<'_, crate::model::PySystemModel>>,
) -> PyResult<Vec<(String, u64)>> {
    let model = crate::model::model_from(model.as_deref())?;
    Ok(clairvoyant_core::engine::node_capacities(
        source.inner.as_ref(),
        &model,
        local_ranks,
    ))
}

impl PyEngine {
    fn check_epoch(&self, epoch: u32) -> PyResult<()> {
        if epoch >= self.engine.epochs() {
            return Err(to_py(clairvoyant_core::Error::EpochPastEnd {
                epoch,
                last: self.engine.epochs().saturating_sub(1),
            }));
        }
        Ok(())
    }
}

/// Sample ids from a numpy integer array (fast path) or any sequence of ints.
fn sample_ids(samples: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let bad = |i: usize, k: i128| {
        to_py(clairvoyant_core::Error::config(
            "samples",
            format!("position {i}: sample {k} is not a valid sample id"),
        ))
    };
    if let Ok(a) = samples.extract::<numpy::PyReadonlyArray1<'_, i64>>() {
        return a
            .as_array()
            .iter()
            .enumerate()
            .map(|(i, &k)| u32::try_from(k).map_err(|_| bad(i, k as i128)))
            .collect();
    }
    if let Ok(a) = samples.extract::<numpy::PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().to_vec());
    }
    let ids: Vec<i64> = samples.extract()?;
    ids.iter()
        .enumerate()
        .map(|(i, &k)| u32::try_from(k).map_err(|_| bad(i, k as i128)))
        .collect()
}

fn int64_array<'py>(py: Python<'py>, values: &[u32]) -> Bound<'py, PyArray1<i64>> {
    values.iter().map(|&k| k as i64).collect::<Vec<_>>().into_pyarray(py)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<LeaseHolder>()?;
    m.add_function(wrap_pyfunction!(node_capacities, m)?)?;
    Ok(())
}
