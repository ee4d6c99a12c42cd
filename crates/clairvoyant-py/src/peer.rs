//! Bindings of the peer transport (`clairvoyant_net::engine`): a node's server (started before
//! the nodes meet, so its address can be announced; it answers from the node's cache once a
//! job's engine is attached). The client an engine fetches with is made with the engine.

use clairvoyant_net::engine::{NodeServer, ServerSpec};
use clairvoyant_net::NetError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::PyEngine;
use crate::errors;

/// One node's peer server.
#[pyclass(name = "PeerServer", frozen, module = "clairvoyant._native")]
pub struct PyPeerServer {
    server: NodeServer,
}

#[pymethods]
impl PyPeerServer {
    #[new]
    /// Connections cost no thread (`workers` threads answer all of them; `waiters` threads
    /// answer those that wait for an imminent fill or read the sample from the dataset), so the
    /// cap allows every rank of a 256-node job a few connections. The waiters are I/O-bound: a
    /// dataset read that spends 0.14 s queued in a busy shared file system lets 4 threads answer
    /// 28 such requests a second, 16 threads 114.
    #[pyo3(signature = (bind, secret, job, max_connections=8192, io_timeout=5.0, workers=4, waiters=16))]
    fn new(
        bind: String,
        secret: Vec<u8>,
        job: u64,
        max_connections: usize,
        io_timeout: f64,
        workers: usize,
        waiters: usize,
    ) -> PyResult<Self> {
        let spec = ServerSpec {
            bind,
            secret,
            job,
            max_connections,
            io_timeout,
            workers,
            waiters,
        };
        let server = NodeServer::start(&spec).map_err(|e| {
            let msg = format!("cannot start the peer server on {}: {e}", spec.bind);
            match &e {
                NetError::Bind { source, .. } => errors::io(source, msg),
                _ => errors::config(msg),
            }
        })?;
        Ok(PyPeerServer { server })
    }

    /// host:port the server listens on.
    #[getter]
    fn address(&self) -> String {
        self.server.address().to_string()
    }

    /// Serve from `engine`'s node cache from now on.
    fn attach(&self, engine: &PyEngine) {
        self.server.attach(engine.engine().peer_service());
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(s) = self.server.stats() {
            d.set_item("served", s.served)?;
            d.set_item("bytes", s.bytes)?;
            d.set_item("not_yet", s.not_yet)?;
            d.set_item("not_held", s.not_held)?;
            d.set_item("failed", s.failed)?;
            d.set_item("connections", s.connections)?;
            d.set_item("rejected_connections", s.rejected_connections)?;
            d.set_item("rejected_frames", s.rejected_frames)?;
            d.set_item("cpu_seconds", s.cpu_seconds)?;
        }
        Ok(d)
    }

    /// Stop serving (bounded time); idempotent.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.server.close());
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPeerServer>()?;
    Ok(())
}
