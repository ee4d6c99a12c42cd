//! The engine and the transport joined (feature `engine`): a node's [`NodeServer`] answers
//! peers from the attached engine's cache ([`clairvoyant_core::engine::PeerService`]), and a
//! rank's [`PeerClient`] is the engine's [`PeerFetch`]. The transport modules know nothing of
//! the core; this one translates between them, so the real engine plus transport is tested in
//! Rust (`tests/engine.rs`) and the bindings only wrap it.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use clairvoyant_core::engine::{EngineSpec, JobSpec, PeerFetch, PeerReply, PeerService, PeersDesc, Serve};
use clairvoyant_core::source::Source;

use crate::ServerStats;
use crate::{
    Client, ClientConfig, ClientStats, Fetch, NetError, Provider, RealClock, Secret, Served, Server, ServerConfig,
};

/// How long a request may wait for the node's engine to be attached to its server (the nodes
/// start at different speeds).
pub const ATTACH_WAIT: Duration = Duration::from_secs(30);

/// How long a client's connect to a peer may take.
pub const CLIENT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Background probes of a down peer are bounded by this (a fetch on the data path is bounded by
/// the engine's deadline, after which it reads the file system instead).
pub const CLIENT_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A peer found down is taken off the data path and probed in the background after this long
/// (then after twice as long after each failed probe).
pub const CLIENT_DEAD_FOR: Duration = Duration::from_secs(5);

impl From<Serve> for Served {
    fn from(s: Serve) -> Served {
        match s {
            Serve::Ready { bytes, checksum } => Served::Ready { bytes, checksum },
            Serve::NotYet => Served::NotYet,
            Serve::NotHeld => Served::NotHeld,
            Serve::Failed(m) => Served::Failed(m),
        }
    }
}

impl From<Fetch> for PeerReply {
    fn from(f: Fetch) -> PeerReply {
        match f {
            Fetch::Got => PeerReply::Got,
            Fetch::NotYet => PeerReply::NotYet,
            Fetch::NotHeld => PeerReply::NotHeld,
            Fetch::Corrupt => PeerReply::Corrupt,
            Fetch::PeerDown => PeerReply::Down,
        }
    }
}

/// A node server's provider: the attached engine's service, or a short wait for one.
#[derive(Default)]
pub struct NodeProvider {
    service: Mutex<Option<PeerService>>,
    attached: Condvar,
}

impl NodeProvider {
    /// Serve from `service` from now on; requests waiting for an engine go on.
    pub fn attach(&self, service: PeerService) {
        *self.service.lock().unwrap_or_else(|p| p.into_inner()) = Some(service);
        self.attached.notify_all();
    }

    /// Serve nothing any more (requests answer "not yet" after their wait).
    pub fn detach(&self) {
        *self.service.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn current(&self) -> Option<PeerService> {
        self.service.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Provider for NodeProvider {
    fn serve(&self, sample: u32, wait: Duration) -> Served {
        self.serve_queued(sample, wait, Duration::ZERO)
    }

    /// A request waits for the engine at most its own wait (up to [`ATTACH_WAIT`]) from when it
    /// was received, then answers "not yet": the asking node reads the file system instead of
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
        service.serve(sample, wait).into()
    }

    /// Without waiting: a sample already filled, not held, or failed; `None` (ask `serve` on a
    /// waiting thread) before the engine is attached or while the sample is not filled yet.
    fn serve_now(&self, sample: u32) -> Option<Served> {
        match self.current()?.serve(sample, Duration::ZERO) {
            Serve::NotYet => None,
            other => Some(other.into()),
        }
    }
}

/// What starting a node's peer server takes (the arguments of `clairvoyant._native.PeerServer`).
#[derive(Clone)]
pub struct ServerSpec {
    /// `host:port` with an IP address to listen on (port 0: any free port).
    pub bind: String,
    /// The job secret (at least 16 bytes).
    pub secret: Vec<u8>,
    /// The job id bound into the handshake.
    pub job: u64,
    /// Connections served at once.
    pub max_connections: usize,
    /// Seconds a handshake step or request frame may take once begun (at least 0.01).
    pub io_timeout: f64,
    /// Threads answering requests that need no wait (at least 1).
    pub workers: usize,
    /// Threads answering requests that may wait or read from the dataset (at least 1).
    pub waiters: usize,
}

impl ServerSpec {
    /// The server's configuration, checked: errors name the field.
    pub fn config(&self) -> Result<ServerConfig, NetError> {
        if !self.io_timeout.is_finite() {
            return Err(NetError::Config {
                key: "io_timeout",
                reason: format!("must be a finite number of seconds, got {}", self.io_timeout),
            });
        }
        Ok(ServerConfig {
            bind: parse_addr(&self.bind).map_err(|reason| NetError::Config { key: "bind", reason })?,
            secret: Secret::from_bytes(&self.secret)?,
            job: self.job,
            max_connections: self.max_connections,
            io_timeout: Duration::from_secs_f64(self.io_timeout.max(0.01)),
            workers: self.workers.max(1),
            waiters: self.waiters.max(1),
        })
    }
}

/// `s` as a socket address, or why not.
fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|e| format!("{s:?}: {e} (expected host:port with an IP)"))
}

/// One node's peer server: started before the nodes meet (its address is announced), answering
/// from the node's cache once an engine is attached.
pub struct NodeServer {
    server: Mutex<Option<Server>>,
    provider: Arc<NodeProvider>,
    address: SocketAddr,
}

impl NodeServer {
    /// Listen as `spec` says; nothing is served until [`NodeServer::attach`].
    pub fn start(spec: &ServerSpec) -> Result<NodeServer, NetError> {
        let provider = Arc::new(NodeProvider::default());
        let server = Server::start(spec.config()?, provider.clone())?;
        let address = server.local_addr();
        Ok(NodeServer {
            server: Mutex::new(Some(server)),
            provider,
            address,
        })
    }

    /// The address it listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Serve from `service`'s node cache from now on.
    pub fn attach(&self, service: PeerService) {
        self.provider.attach(service);
    }

    /// The server's counters (None once closed).
    pub fn stats(&self) -> Option<ServerStats> {
        self.server
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(Server::stats)
    }

    /// Stop serving (bounded time) and let go of the engine; idempotent.
    pub fn close(&self) {
        let server = self.server.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.provider.detach();
        if let Some(s) = server {
            s.shutdown();
        }
    }
}

impl Drop for NodeServer {
    fn drop(&mut self) {
        self.close();
    }
}

/// A rank's client of the other nodes' servers, as the engine fetches through it.
pub struct PeerClient {
    client: Client,
}

impl PeerClient {
    /// A client for `desc`'s nodes (one address per node; this node's own may be anything).
    /// Nothing connects until a fetch needs it. Errors name the field of the `cluster` part.
    pub fn connect(desc: &PeersDesc) -> clairvoyant_core::Result<PeerClient> {
        let addrs = desc
            .addresses
            .iter()
            .enumerate()
            .map(|(i, a)| parse_addr(a).map_err(|r| clairvoyant_core::Error::config(format!("cluster.peers[{i}]"), r)))
            .collect::<clairvoyant_core::Result<Vec<_>>>()?;
        let secret = Secret::from_bytes(&desc.secret)
            .map_err(|e| clairvoyant_core::Error::config("cluster.secret", e.to_string()))?;
        let cfg = ClientConfig {
            secret,
            job: desc.job,
            connections_per_peer: desc
                .connections
                .unwrap_or(clairvoyant_core::engine::DEFAULT_PEER_CONNECTIONS)
                .max(1),
            connect_timeout: CLIENT_CONNECT_TIMEOUT,
            io_timeout: CLIENT_IO_TIMEOUT,
            dead_for: CLIENT_DEAD_FOR,
            clock: Arc::new(RealClock),
        };
        Ok(PeerClient {
            client: Client::new(cfg, addrs),
        })
    }

    /// The client's counters.
    pub fn stats(&self) -> ClientStats {
        self.client.stats()
    }
}

impl PeerFetch for PeerClient {
    fn fetch(&self, node: usize, sample: u32, wait: Duration, within: Duration, dst: &mut [u8]) -> PeerReply {
        match self.client.fetch_within(node, sample, wait, within, dst) {
            Ok(f) => f.into(),
            Err(_) => PeerReply::Down,
        }
    }

    fn is_down(&self, node: usize) -> bool {
        self.client.is_down(node)
    }
}

/// The engine's job from `spec` over `source`, with the client its peers are reached through
/// (None for a job on one node, or one whose peers are never asked).
pub fn job_spec(spec: EngineSpec, source: &dyn Source) -> clairvoyant_core::Result<(JobSpec, Option<Arc<PeerClient>>)> {
    let client = match spec.peers()? {
        Some(p) => Some(Arc::new(PeerClient::connect(p)?)),
        None => None,
    };
    let fetch = client.clone().map(|c| c as Arc<dyn PeerFetch>);
    Ok((spec.into_job(source, fetch)?, client))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_enum_pairs_translate_one_to_one() {
        let pairs = [
            (Fetch::Got, PeerReply::Got),
            (Fetch::NotYet, PeerReply::NotYet),
            (Fetch::NotHeld, PeerReply::NotHeld),
            (Fetch::Corrupt, PeerReply::Corrupt),
            (Fetch::PeerDown, PeerReply::Down),
        ];
        for (f, r) in pairs {
            assert_eq!(PeerReply::from(f), r);
        }
        assert!(matches!(Served::from(Serve::NotYet), Served::NotYet));
        assert!(matches!(Served::from(Serve::NotHeld), Served::NotHeld));
        assert!(matches!(Served::from(Serve::Failed("x".into())), Served::Failed(m) if m == "x"));
        let ready = Served::from(Serve::Ready {
            bytes: Box::new(vec![1u8, 2, 3]),
            checksum: 9,
        });
        assert!(matches!(ready, Served::Ready { ref bytes, checksum: 9 } if (**bytes).as_ref() == [1, 2, 3]));
    }

    #[test]
    fn a_provider_without_an_engine_answers_not_yet_after_the_request_wait() {
        let p = NodeProvider::default();
        assert!(p.serve_now(3).is_none(), "deferred to a waiting thread");
        // Queued longer than its wait: answered at once, not after ATTACH_WAIT.
        let r = p.serve_queued(3, Duration::from_millis(5), Duration::from_secs(1));
        assert!(matches!(r, Served::NotYet));
    }

    fn server_spec(bind: &str) -> ServerSpec {
        ServerSpec {
            bind: bind.into(),
            secret: vec![1; 32],
            job: 7,
            max_connections: 16,
            io_timeout: 1.0,
            workers: 1,
            waiters: 1,
        }
    }

    #[test]
    fn bad_server_values_name_their_field() {
        let e = server_spec("localhost:80").config().unwrap_err();
        assert!(matches!(e, NetError::Config { key: "bind", .. }), "{e}");
        let mut s = server_spec("127.0.0.1:0");
        s.io_timeout = f64::NAN;
        assert!(matches!(
            s.config().unwrap_err(),
            NetError::Config { key: "io_timeout", .. }
        ));
        s = server_spec("127.0.0.1:0");
        s.secret = vec![1; 3];
        assert!(matches!(s.config().unwrap_err(), NetError::Secret { .. }));
    }

    #[test]
    fn bad_peer_values_name_their_field() {
        let mut d = PeersDesc {
            addresses: vec!["127.0.0.1:1".into(), "nowhere".into()],
            secret: vec![1; 32],
            job: 1,
            connections: None,
        };
        let e = PeerClient::connect(&d).err().expect("a bad address");
        assert!(e.to_string().contains("'cluster.peers[1]'"), "{e}");
        d.addresses[1] = "127.0.0.1:2".into();
        d.secret = vec![0; 4];
        let e = PeerClient::connect(&d).err().expect("a short secret");
        assert!(e.to_string().contains("'cluster.secret'"), "{e}");
    }
}
