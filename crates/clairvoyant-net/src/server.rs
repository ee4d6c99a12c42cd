//! One server per node: an accept thread and one thread per authenticated connection, each
//! answering one `Get` at a time from the node's [`Provider`]. Blocking sockets with timeouts;
//! nothing polls.

use crate::error::NetError;
use crate::frame::{self, Header, Kind, HEADER_LEN, MAC_LEN, MAX_DATA, MAX_MESSAGE, MAX_WAIT_MICROS, NONCE_LEN};
use crate::secret::{nonce, Secret};
use crate::wire::{read_full, thread_cpu_nanos, write_two, Wire};
use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a node's provider answers for one sample.
pub enum Served {
    /// The bytes and the checksum recorded when they were read from the dataset (xxh3-64, the
    /// client checks it). `bytes` stays valid while the value lives (e.g. holds an Arc).
    Ready {
        bytes: Box<dyn AsRef<[u8]> + Send>,
        checksum: u64,
    },
    /// Held here but not filled yet (after waiting at most the request's `wait`).
    NotYet,
    /// This node does not cache the sample.
    NotHeld,
    /// The node failed to read it (message names the sample/file).
    Failed(String),
}

/// The node's cache as the server sees it.
pub trait Provider: Send + Sync + 'static {
    /// May block up to `wait` (an imminent fill). Called from server threads.
    fn serve(&self, sample: u32, wait: Duration) -> Served;
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks an ephemeral port (see [`Server::local_addr`]).
    pub bind: SocketAddr,
    pub secret: Secret,
    /// Job id bound into the handshake: a client of another job is refused.
    pub job: u64,
    /// Connections served at once; more are accepted and closed at once (counted).
    pub max_connections: usize,
    /// Longest silence tolerated inside a handshake or a frame, and for a write to drain.
    pub io_timeout: Duration,
}

/// Counters since start. `cpu_seconds` is the CPU time of the connection threads (Linux).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerStats {
    pub served: u64,
    pub bytes: u64,
    pub not_yet: u64,
    pub not_held: u64,
    pub failed: u64,
    /// Connections accepted in total.
    pub connections: u64,
    /// Connections open now.
    pub open_connections: u64,
    /// Connections refused: over `max_connections`, failed or silent handshakes.
    pub rejected_connections: u64,
    /// Of those, handshakes whose MAC or job did not match.
    pub auth_failures: u64,
    /// Malformed or out-of-place frames (the connection is closed).
    pub rejected_frames: u64,
    pub cpu_seconds: f64,
}

/// A connection idle between requests longer than this is closed (a client that vanished
/// without a FIN must not hold a slot for ever); clients reopen transparently.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// How long `shutdown` waits for threads (each is woken by closing its socket).
const JOIN_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Default)]
pub(crate) struct Counters {
    served: AtomicU64,
    bytes: AtomicU64,
    not_yet: AtomicU64,
    not_held: AtomicU64,
    failed: AtomicU64,
    connections: AtomicU64,
    open: AtomicU64,
    rejected_connections: AtomicU64,
    auth_failures: AtomicU64,
    rejected_frames: AtomicU64,
    cpu_nanos: AtomicU64,
}

struct Shared {
    cfg: ServerConfig,
    provider: Arc<dyn Provider>,
    stop: AtomicBool,
    counters: Counters,
    /// Open connections by id, so shutdown can close them and wake their threads.
    conns: Mutex<HashMap<u64, TcpStream>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Connection threads still running, so shutdown can wait for them with a timeout.
    live: Mutex<usize>,
    live_cv: Condvar,
}

pub struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
    /// A duplicate of the listening socket, to wake the accept thread at shutdown.
    #[cfg_attr(not(target_os = "linux"), allow(dead_code))]
    listener: TcpListener,
}

impl Server {
    pub fn start(cfg: ServerConfig, provider: Arc<dyn Provider>) -> Result<Server, NetError> {
        if cfg.max_connections == 0 {
            return Err(NetError::Config {
                key: "max_connections",
                reason: "must be at least 1".into(),
            });
        }
        if cfg.io_timeout.is_zero() {
            return Err(NetError::Config {
                key: "io_timeout",
                reason: "must be above zero".into(),
            });
        }
        let bind = cfg.bind;
        let listener = TcpListener::bind(bind).map_err(|source| NetError::Bind { addr: bind, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| NetError::Bind { addr: bind, source })?;
        let shared = Arc::new(Shared {
            cfg,
            provider,
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            conns: Mutex::new(HashMap::new()),
            threads: Mutex::new(Vec::new()),
            live: Mutex::new(0),
            live_cv: Condvar::new(),
        });
        let dup = listener.try_clone().map_err(|source| NetError::Bind { addr, source })?;
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("cv-net-accept".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|source| NetError::Bind { addr, source })?;
        Ok(Server {
            shared,
            addr,
            accept: Some(accept),
            listener: dup,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> ServerStats {
        let c = &self.shared.counters;
        ServerStats {
            served: c.served.load(Relaxed),
            bytes: c.bytes.load(Relaxed),
            not_yet: c.not_yet.load(Relaxed),
            not_held: c.not_held.load(Relaxed),
            failed: c.failed.load(Relaxed),
            connections: c.connections.load(Relaxed),
            open_connections: c.open.load(Relaxed),
            rejected_connections: c.rejected_connections.load(Relaxed),
            auth_failures: c.auth_failures.load(Relaxed),
            rejected_frames: c.rejected_frames.load(Relaxed),
            cpu_seconds: c.cpu_nanos.load(Relaxed) as f64 * 1e-9,
        }
    }

    /// Stop accepting, close every connection and join all threads (bounded: a thread stuck in
    /// the provider past the join timeout is left detached).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(accept) = self.accept.take() else { return };
        self.shared.stop.store(true, Relaxed);
        // Wake the blocking accept: on Linux shutting the listening socket down makes accept
        // fail at once; elsewhere, connect to it.
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: `self.listener` is our own duplicate of the listening socket, open until
            // `self` drops, so the descriptor cannot have been closed or reused.
            unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        }
        #[cfg(not(target_os = "linux"))]
        {
            let mut wake = self.addr;
            if wake.ip().is_unspecified() {
                wake.set_ip(match wake {
                    SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                    SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
                });
            }
            let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        }
        let _ = accept.join();
        for s in lock(&self.shared.conns).values() {
            let _ = s.shutdown(Shutdown::Both);
        }
        let live = lock(&self.shared.live);
        let _ = self.shared.live_cv.wait_timeout_while(live, JOIN_TIMEOUT, |n| *n > 0);
        for t in std::mem::take(&mut *lock(&self.shared.threads)) {
            // A thread still stuck in the provider past the timeout is left detached.
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Unregisters a connection and counts its thread as ended when dropped (also on a panic).
struct LiveGuard<'a>(&'a Shared, u64);

impl Drop for LiveGuard<'_> {
    fn drop(&mut self) {
        lock(&self.0.conns).remove(&self.1);
        self.0.counters.open.fetch_sub(1, Relaxed);
        *lock(&self.0.live) -= 1;
        self.0.live_cv.notify_all();
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if sh.stop.load(Relaxed) {
            break;
        }
        let Ok(stream) = stream else {
            // Out of descriptors or memory: wait a little rather than spin on the error.
            std::thread::sleep(Duration::from_millis(20));
            continue;
        };
        let c = &sh.counters;
        c.connections.fetch_add(1, Relaxed);
        lock(&sh.threads).retain(|t| !t.is_finished());
        if c.open.load(Relaxed) as usize >= sh.cfg.max_connections {
            c.rejected_connections.fetch_add(1, Relaxed);
            continue; // dropped: closed
        }
        let Ok(registered) = stream.try_clone() else {
            c.rejected_connections.fetch_add(1, Relaxed);
            continue;
        };
        let id = next_id;
        next_id += 1;
        c.open.fetch_add(1, Relaxed);
        lock(&sh.conns).insert(id, registered);
        *lock(&sh.live) += 1;
        let sh2 = sh.clone();
        let spawned = std::thread::Builder::new().name("cv-net-conn".into()).spawn(move || {
            let _live = LiveGuard(&sh2, id);
            connection(stream, &sh2);
        });
        match spawned {
            Ok(t) => lock(&sh.threads).push(t),
            Err(_) => {
                *lock(&sh.live) -= 1;
                lock(&sh.conns).remove(&id);
                c.open.fetch_sub(1, Relaxed);
                c.rejected_connections.fetch_add(1, Relaxed);
            }
        }
    }
}

fn connection(mut stream: TcpStream, sh: &Shared) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(sh.cfg.io_timeout));
    let mut cpu = thread_cpu_nanos();
    let mut session = Session {
        secret: &sh.cfg.secret,
        job: sh.cfg.job,
        io_timeout: sh.cfg.io_timeout,
        idle: IDLE_TIMEOUT,
        counters: &sh.counters,
    };
    if session.handshake(&mut stream).is_err() {
        sh.counters.rejected_connections.fetch_add(1, Relaxed);
        return;
    }
    while !sh.stop.load(Relaxed) {
        let r = session.one_request(&mut stream, &*sh.provider);
        let now = thread_cpu_nanos();
        sh.counters.cpu_nanos.fetch_add(now.saturating_sub(cpu), Relaxed);
        cpu = now;
        if r.is_err() {
            break;
        }
    }
}

/// Why a connection ended (only used to decide what to count).
#[derive(Debug)]
pub(crate) enum End {
    Io,
    Frame,
    Auth,
}

/// The server side of one connection, generic over the byte stream so fuzzing can drive it.
pub(crate) struct Session<'a> {
    pub secret: &'a Secret,
    pub job: u64,
    pub io_timeout: Duration,
    pub idle: Duration,
    pub counters: &'a Counters,
}

impl Session<'_> {
    fn read_frame_header<W: Wire>(&self, s: &mut W) -> Result<Header, End> {
        let mut hb = [0u8; HEADER_LEN];
        read_full(s, &mut hb).map_err(|_| End::Io)?;
        frame::decode(&hb).map_err(|_| {
            self.counters.rejected_frames.fetch_add(1, Relaxed);
            End::Frame
        })
    }

    fn expect<W: Wire>(&self, s: &mut W, kind: Kind) -> Result<Header, End> {
        let h = self.read_frame_header(s)?;
        if h.kind != kind {
            self.counters.rejected_frames.fetch_add(1, Relaxed);
            return Err(End::Frame);
        }
        Ok(h)
    }

    /// Hello -> Challenge -> Auth -> AuthOk, every read limited by `io_timeout`; afterwards
    /// reads wait up to `idle` (a pooled connection may be quiet between requests; one
    /// timeout for a whole request keeps the per-request path at one read and one writev).
    pub(crate) fn handshake<W: Wire>(&mut self, s: &mut W) -> Result<(), End> {
        s.set_read_limit(self.io_timeout).map_err(|_| End::Io)?;
        let hello = self.expect(s, Kind::Hello)?;
        let mut cn = [0u8; NONCE_LEN];
        read_full(s, &mut cn).map_err(|_| End::Io)?;
        if hello.arg != self.job {
            self.counters.auth_failures.fetch_add(1, Relaxed);
            return Err(End::Auth);
        }
        let sn = nonce();
        let mut body = [0u8; NONCE_LEN + MAC_LEN];
        body[..NONCE_LEN].copy_from_slice(&sn);
        body[NONCE_LEN..].copy_from_slice(&self.secret.server_mac(self.job, &cn, &sn));
        let h = Header::new(Kind::Challenge, 0, body.len() as u32, 0);
        write_two(s, &h.encode(), &body).map_err(|_| End::Io)?;
        self.expect(s, Kind::Auth)?;
        let mut mac = [0u8; MAC_LEN];
        read_full(s, &mut mac).map_err(|_| End::Io)?;
        if !self.secret.verify_client(self.job, &sn, &cn, &mac) {
            self.counters.auth_failures.fetch_add(1, Relaxed);
            return Err(End::Auth);
        }
        write_two(s, &Header::new(Kind::AuthOk, 0, 0, 0).encode(), &[]).map_err(|_| End::Io)?;
        s.set_read_limit(self.idle).map_err(|_| End::Io)
    }

    /// Read one `Get` and write its reply: header and payload in one `writev`, the payload
    /// straight from the provider's bytes.
    pub(crate) fn one_request<W: Wire>(&mut self, s: &mut W, provider: &dyn Provider) -> Result<(), End> {
        let get = self.expect(s, Kind::Get)?;
        let wait = Duration::from_micros(get.arg.min(MAX_WAIT_MICROS));
        let sample = get.sample;
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| provider.serve(sample, wait)))
            .unwrap_or_else(|_| Served::Failed(format!("sample {sample}: the node's provider panicked")));
        let c = self.counters;
        match served {
            Served::Ready { bytes, checksum } => {
                let b = (*bytes).as_ref();
                if b.len() > MAX_DATA as usize {
                    let msg = format!(
                        "sample {sample}: {} bytes exceed the frame limit of {MAX_DATA}",
                        b.len()
                    );
                    return self.failed(s, sample, &msg);
                }
                let h = Header::new(Kind::Data, sample, b.len() as u32, checksum);
                write_two(s, &h.encode(), b).map_err(|_| End::Io)?;
                c.served.fetch_add(1, Relaxed);
                c.bytes.fetch_add(b.len() as u64, Relaxed);
                Ok(())
            }
            Served::NotYet => {
                c.not_yet.fetch_add(1, Relaxed);
                write_two(s, &Header::new(Kind::NotYet, sample, 0, 0).encode(), &[]).map_err(|_| End::Io)
            }
            Served::NotHeld => {
                c.not_held.fetch_add(1, Relaxed);
                write_two(s, &Header::new(Kind::NotHeld, sample, 0, 0).encode(), &[]).map_err(|_| End::Io)
            }
            Served::Failed(msg) => self.failed(s, sample, &msg),
        }
    }

    fn failed<W: Wire>(&self, s: &mut W, sample: u32, msg: &str) -> Result<(), End> {
        self.counters.failed.fetch_add(1, Relaxed);
        let mut end = msg.len().min(MAX_MESSAGE as usize);
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        let m = &msg.as_bytes()[..end];
        write_two(s, &Header::new(Kind::Failed, sample, m.len() as u32, 0).encode(), m).map_err(|_| End::Io)
    }
}

/// A fresh set of counters (for fuzzing the session without a server).
pub(crate) fn counters() -> Counters {
    Counters::default()
}
