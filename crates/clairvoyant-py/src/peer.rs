//! Bindings of the peer transport: a node's server (started before the nodes meet, so its
//! address can be announced; it answers from the node's cache once a job's engine is attached)
//! and the client an engine fetches other nodes' samples with.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use clairvoyant_core::engine::{PeerFetch, PeerReply, PeerService, Serve};
use clairvoyant_net::{Client, ClientConfig, Fetch, NetError, Provider, Secret, Served, Server, ServerConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::PyEngine;
use crate::errors;

/// How long a request may wait for the node's engine to be attached to its server (the nodes
/// start at different speeds).
const ATTACH_WAIT: Duration = Duration::from_secs(30);

/// The server's provider: the attached engine's service, or a short wait for one.
#[derive(Default)]
struct Late {
    service: Mutex<Option<PeerService>>,
    attached: Condvar,
}

impl Provider for Late {
    fn serve(&self, sample: u32, wait: Duration) -> Served {
        self.serve_queued(sample, wait, Duration::ZERO)
    }

    /// A request waits for the engine at most its own wait (up to 30 s) from when it was
    /// received, then answers "not yet": the asking node reads the file system instead of
    /// taking this node for stalled (its fetch is bounded by a deadline of four times the wait).
    /// Time spent queued for a waiting thread counts, so requests that arrive before the engine
    /// is attached drain in about that time whatever their number.
    fn serve_queued(&self, sample: u32, wait: Duration, queued: Duration) -> Served {
        let attach_wait = ATTACH_WAIT.min(wait).saturating_sub(queued);
        let wait = wait.saturating_sub(queued);
        let guard = self.service.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .attached
            .wait_timeout_while(guard, attach_wait, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        let Some(service) = guard.clone() else {
            return Served::NotYet;
        };
        drop(guard);
        match service.serve(sample, wait) {
            Serve::Ready { bytes, checksum } => Served::Ready { bytes, checksum },
            Serve::NotYet => Served::NotYet,
            Serve::NotHeld => Served::NotHeld,
            Serve::Failed(m) => Served::Failed(m),
        }
    }

    /// Without waiting: a sample already filled, not held, or failed; `None` (ask `serve` on a
    /// waiting thread) before the engine is attached or while the sample is not filled yet.
    fn serve_now(&self, sample: u32) -> Option<Served> {
        let service = self.service.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
        match service.serve(sample, Duration::ZERO) {
            Serve::Ready { bytes, checksum } => Some(Served::Ready { bytes, checksum }),
            Serve::NotYet => None,
            Serve::NotHeld => Some(Served::NotHeld),
            Serve::Failed(m) => Some(Served::Failed(m)),
        }
    }
}

pub(crate) fn secret(bytes: &[u8]) -> PyResult<Secret> {
    Secret::from_bytes(bytes).map_err(|e| errors::config(format!("invalid job secret: {e}")))
}

fn addr(s: &str, what: &str) -> PyResult<SocketAddr> {
    s.parse().map_err(|e| {
        errors::config(format!(
            "invalid {what} address {s:?}: {e} (expected host:port with an IP)"
        ))
    })
}

/// One node's peer server.
#[pyclass(name = "PeerServer", frozen, module = "clairvoyant._native")]
pub struct PyPeerServer {
    server: Mutex<Option<Server>>,
    late: Arc<Late>,
    address: String,
}

#[pymethods]
impl PyPeerServer {
    #[new]
    /// Connections cost no thread (`workers` threads answer all of them, as many again wait
    /// for imminent fills), so the cap allows every rank of a 256-node job a few connections.
    #[pyo3(signature = (bind, secret, job, max_connections=8192, io_timeout=5.0, workers=4))]
    fn new(
        bind: &str,
        secret: &[u8],
        job: u64,
        max_connections: usize,
        io_timeout: f64,
        workers: usize,
    ) -> PyResult<Self> {
        let cfg = ServerConfig {
            bind: addr(bind, "listen")?,
            secret: self::secret(secret)?,
            job,
            max_connections,
            io_timeout: Duration::from_secs_f64(io_timeout.max(0.01)),
            workers: workers.max(1),
        };
        let late = Arc::new(Late::default());
        let server = Server::start(cfg, late.clone()).map_err(|e| match &e {
            NetError::Bind { source, .. } => errors::io(source, format!("cannot start the peer server on {bind}: {e}")),
            _ => errors::config(format!("cannot start the peer server on {bind}: {e}")),
        })?;
        let address = server.local_addr().to_string();
        Ok(PyPeerServer {
            server: Mutex::new(Some(server)),
            late,
            address,
        })
    }

    /// host:port the server listens on.
    #[getter]
    fn address(&self) -> String {
        self.address.clone()
    }

    /// Serve from `engine`'s node cache from now on.
    fn attach(&self, engine: &PyEngine) {
        *self.late.service.lock().unwrap_or_else(|p| p.into_inner()) = Some(engine.engine().peer_service());
        self.late.attached.notify_all();
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(s) = self.server.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let s = s.stats();
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
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        *self.late.service.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if let Some(s) = server {
            py.detach(|| s.shutdown());
        }
    }
}

/// The engine's view of the client.
pub(crate) struct Peers {
    client: Client,
}

impl PeerFetch for Peers {
    fn fetch(&self, node: usize, sample: u32, wait: Duration, within: Duration, dst: &mut [u8]) -> PeerReply {
        match self.client.fetch_within(node, sample, wait, within, dst) {
            Ok(Fetch::Got) => PeerReply::Got,
            Ok(Fetch::NotYet) => PeerReply::NotYet,
            Ok(Fetch::NotHeld) => PeerReply::NotHeld,
            Ok(Fetch::Corrupt) => PeerReply::Corrupt,
            Ok(Fetch::PeerDown) | Err(_) => PeerReply::Down,
        }
    }
    fn is_down(&self, node: usize) -> bool {
        self.client.is_down(node)
    }
}

impl Peers {
    pub(crate) fn stats(&self) -> clairvoyant_net::ClientStats {
        self.client.stats()
    }
}

/// A client for `peers` (one address per node; this node's own may be anything).
pub(crate) fn client(peers: &[String], secret: &[u8], job: u64, connections: usize) -> PyResult<Arc<Peers>> {
    let addrs = peers
        .iter()
        .map(|p| addr(p, "peer"))
        .collect::<PyResult<Vec<SocketAddr>>>()?;
    let cfg = ClientConfig {
        secret: self::secret(secret)?,
        job,
        connections_per_peer: connections.max(1),
        connect_timeout: Duration::from_secs(3),
        // Background probes only: a fetch is bounded by the engine's deadline (the time the
        // file system would take for the sample, within 1-5 s), after which it reads the file
        // system instead.
        io_timeout: Duration::from_secs(10),
        // A peer found down is taken off the data path and probed in the background after this
        // long (then after twice as long after each failed probe).
        dead_for: Duration::from_secs(5),
    };
    Ok(Arc::new(Peers {
        client: Client::new(cfg, addrs),
    }))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPeerServer>()?;
    Ok(())
}
