//! Python's handle on the node agent's server and client (`clairvoyant_agent::server`,
//! `clairvoyant_agent::client`): the agent process builds the engine and starts the server
//! through these; the serving itself is in the agent crate.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use clairvoyant_agent::client::Client;
use clairvoyant_agent::dir::counter;
use clairvoyant_agent::proto::Reply;
use clairvoyant_agent::server::{Event, Server};
use pyo3::prelude::*;

use crate::convert::json_to_python;
use crate::engine::PyEngine;
use crate::errors;

/// How long one wait lasts before Ctrl-C is looked at.
const STEP: Duration = Duration::from_millis(200);

#[pyclass(name = "AgentServer", frozen, module = "clairvoyant._native")]
pub struct PyAgentServer {
    server: Server,
}

#[pymethods]
impl PyAgentServer {
    /// Serve `engine`'s node cache for the files `rel_paths` (sample i is `root/rel_paths[i]`;
    /// str, a name that is not UTF-8 in Python's surrogate escapes, or bytes) on the Unix socket
    /// `socket`; cached files are recorded in a new shared directory file `dir`.
    #[new]
    #[pyo3(signature = (engine, socket, root, rel_paths, dir))]
    fn new(
        engine: Option<&PyEngine>,
        socket: PathBuf,
        root: String,
        rel_paths: Vec<Bound<'_, PyAny>>,
        dir: PathBuf,
    ) -> PyResult<Self> {
        let rel_paths = rel_paths
            .iter()
            .enumerate()
            .map(|(i, r)| name_bytes(r).map_err(|e| errors::ArgumentTypeError::new_err(format!("rel_paths[{i}]: {e}"))))
            .collect::<PyResult<Vec<Vec<u8>>>>()?;
        let server = Server::start(engine.map(|e| e.engine.clone()), &socket, &root, rel_paths, &dir)
            .map_err(|e| errors::io(&e, format!("cannot start the node agent on {}: {e}", socket.display())))?;
        Ok(PyAgentServer { server })
    }

    /// Let programs fill their misses themselves (order unknown, one node): the first opener of
    /// a file claims it in the shared directory, reads it and hands the bytes over.
    fn let_programs_fill(&self) {
        self.server.let_programs_fill();
    }

    /// Block until no launcher is attached any more (after one was), or none attached within
    /// `idle_wait` seconds of the start; wakes for Ctrl-C.
    fn wait_idle(&self, py: Python<'_>, idle_wait: f64) -> PyResult<()> {
        let start = Instant::now();
        let idle_wait = Duration::from_secs_f64(idle_wait.max(0.0));
        while !py.detach(|| self.server.idle(STEP, start, idle_wait)) {
            py.check_signals()?;
        }
        Ok(())
    }

    /// For a lazy agent (started without an engine): wait up to `timeout` seconds for what
    /// should start the engine: ("read", None) for a program's first read, ("plan", pattern)
    /// for an order; None on time-out. Wakes for Ctrl-C.
    fn wait_event(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<(String, Option<String>)>> {
        let deadline = Instant::now() + Duration::from_secs_f64(timeout.max(0.0));
        loop {
            match py.detach(|| self.server.wait_event(STEP)) {
                Some(Event::Read) => return Ok(Some(("read".into(), None))),
                Some(Event::Plan(p)) => {
                    return Ok(Some(("plan".into(), Some(String::from_utf8_lossy(&p).into_owned()))))
                }
                None if Instant::now() >= deadline => return Ok(None),
                None => py.check_signals()?,
            }
        }
    }

    /// Hand a lazy agent its engine: requests waiting for it go on.
    fn set_engine(&self, engine: &PyEngine) {
        self.server.set_engine(engine.engine.clone());
    }

    /// Whether every launcher that attached has gone (and one had).
    fn finished(&self) -> bool {
        self.server.finished()
    }

    /// Launchers attached now.
    #[getter]
    fn attached(&self) -> usize {
        self.server.attached()
    }

    /// The agent's figures as a dict (see `Server::stats_json`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let doc = serde_json::from_str(&self.server.stats_json())
            .map_err(|e| errors::ClairvoyantError::new_err(format!("node agent statistics: {e}")))?;
        json_to_python(py, &doc)
    }

    /// Stop accepting and remove the socket and the directory file (mappings stay valid for
    /// processes that have them).
    fn close(&self) {
        self.server.close();
    }
}

/// A client of an agent, for launchers and tests: `attach` keeps this connection registered
/// until `close`; `stats` and `lookup` ask on it.
#[pyclass(name = "AgentClient", module = "clairvoyant._native")]
pub struct PyAgentClient {
    conn: Option<Client>,
}

#[pymethods]
impl PyAgentClient {
    #[new]
    #[pyo3(signature = (socket, timeout=10.0))]
    fn new(socket: PathBuf, timeout: f64) -> PyResult<Self> {
        let conn = Client::connect(&socket, Duration::from_secs_f64(timeout.max(0.001)))
            .map_err(|e| errors::connection(&e, format!("node agent at {}: {e}", socket.display())))?;
        Ok(PyAgentClient { conn: Some(conn) })
    }

    /// Register as a launcher: the agent lives while this connection is open.
    fn attach(&mut self) -> PyResult<()> {
        self.conn()?.attach().map_err(err)
    }

    /// The agent's figures as a dict.
    fn stats<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = self.conn()?.stats().map_err(err)?;
        let doc =
            serde_json::from_str(&text).map_err(|e| err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
        json_to_python(py, &doc)
    }

    /// Where the agent says `rel`'s bytes are (str or bytes): ("cached", offset, size,
    /// checksum), ("inline", bytes, checksum), ("direct",), ("unknown",) or ("error", message).
    fn lookup<'py>(&mut self, py: Python<'py>, rel: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let rel = name_bytes(&rel).map_err(|e| errors::ArgumentTypeError::new_err(format!("rel: {e}")))?;
        let (reply, data) = self.conn()?.lookup(&rel).map_err(err)?;
        let t = match reply {
            Reply::Cached {
                offset, size, checksum, ..
            } => ("cached", offset, size, checksum).into_pyobject(py)?.into_any(),
            Reply::Inline { checksum, .. } => ("inline", pyo3::types::PyBytes::new(py, &data), checksum)
                .into_pyobject(py)?
                .into_any(),
            Reply::Direct => ("direct",).into_pyobject(py)?.into_any(),
            Reply::Unknown => ("unknown",).into_pyobject(py)?.into_any(),
            Reply::Error { message } => ("error", message).into_pyobject(py)?.into_any(),
            other => {
                return Err(errors::connection(
                    &std::io::Error::from(std::io::ErrorKind::InvalidData),
                    format!("node agent: unexpected reply {other:?}"),
                ))
            }
        };
        Ok(t)
    }

    /// Tell the agent the program's order (per-node order files, `{node}` in `pattern`);
    /// raises with the agent's reason when it places otherwise.
    fn plan(&mut self, pattern: &str) -> PyResult<()> {
        self.conn()?
            .plan(pattern.as_bytes())
            .map_err(err)?
            .map_err(errors::ClairvoyantError::new_err)
    }

    fn close(&mut self) {
        self.conn = None;
    }
}

impl PyAgentClient {
    fn conn(&mut self) -> PyResult<&mut Client> {
        self.conn
            .as_mut()
            .ok_or_else(|| errors::config("the node agent client is closed"))
    }
}

/// A file name's bytes from bytes or str (a name that is not UTF-8 arrives in str as Python's
/// surrogate escapes, as `os.listdir` gives it).
fn name_bytes(name: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = name.cast::<pyo3::types::PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    let name: std::ffi::OsString = name.extract()?;
    Ok(std::os::unix::ffi::OsStringExt::into_vec(name))
}

fn err(e: std::io::Error) -> PyErr {
    errors::connection(&e, format!("node agent: {e}"))
}

/// The shared counters of an agent's directory file, by name (summed over every interposed
/// process).
#[pyfunction]
fn agent_dir_counters(path: PathBuf) -> PyResult<Vec<(&'static str, u64)>> {
    let d = clairvoyant_agent::dir::DirReader::open(&path)
        .map_err(|e| errors::io(&e, format!("node agent directory {}: {e}", path.display())))?;
    Ok(counter::NAMES
        .iter()
        .zip(d.counters().iter())
        .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
        .collect())
}

/// In the program `clairvoyant run` starts, between fork and exec: killed when the launcher
/// `parent` dies without stopping it (`clairvoyant_agent::launch::die_with_launcher`). No GIL
/// release: nothing else runs in a freshly forked child.
#[pyfunction]
pub fn die_with_launcher(parent: i32) -> bool {
    clairvoyant_agent::launch::die_with_launcher(parent)
}

/// Register the agent's classes and functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(die_with_launcher, m)?)?;
    m.add_function(wrap_pyfunction!(agent_dir_counters, m)?)?;
    m.add("AGENT_COUNTERS", counter::NAMES.to_vec())?;
    m.add_class::<PyAgentServer>()?;
    m.add_class::<PyAgentClient>()?;
    Ok(())
}
