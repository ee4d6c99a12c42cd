//! One server per node. One poller thread multiplexes every connection (`mio`: epoll on Linux,
//! kqueue elsewhere): it accepts, runs the handshake, reads requests and finishes replies that
//! did not fit the socket buffer, all without blocking. A complete `Get` goes to a small fixed
//! pool of worker threads that asks the node's [`Provider`] and writes the reply (non-blocking;
//! what is left goes back to the poller). A provider answer that may wait for an imminent fill
//! is asked on a second pool (`waiters` threads), so waits never delay answers that are ready.
//! That pool also reads from the dataset the samples this node is first to hold for the asking
//! node: I/O-bound, so it has more threads than the first.
//!
//! Threads: 1 + `workers` + `waiters`, whatever the number of connections. An idle or slow connection
//! holds no thread, only its socket and a few hundred bytes of state: silent or trickling
//! connections (a slowloris) cannot starve the others, and time out on the poller's clock.
//!
//! `mio` rather than hand-written epoll: it is the readiness layer under tokio (widely used and
//! maintained), small (no runtime, no async), portable, and keeps `unsafe` out of this crate.

use crate::error::NetError;
use crate::frame::{self, Header, Kind, HEADER_LEN, MAC_LEN, MAX_DATA, MAX_MESSAGE, MAX_WAIT_MICROS, NONCE_LEN};
use crate::secret::{nonce, Secret};
use crate::wire::thread_cpu_nanos;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a node's provider answers for one sample.
pub enum Served {
    /// The bytes and the checksum recorded when they were read from the dataset (xxh3-64, the
    /// client checks it). `bytes` stays valid while the value lives (e.g. holds an Arc).
    Ready {
        /// The sample's bytes.
        bytes: Box<dyn AsRef<[u8]> + Send>,
        /// Their xxh3-64.
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
    /// May block up to `wait` (an imminent fill). Called from the server's waiting threads.
    fn serve(&self, sample: u32, wait: Duration) -> Served;

    /// The answer when it is known without waiting, else `None` (then [`Provider::serve`] is
    /// called with the request's wait, on a waiting thread). Must not block. The default always
    /// defers to `serve`.
    fn serve_now(&self, sample: u32) -> Option<Served> {
        let _ = sample;
        None
    }

    /// [`Provider::serve`] for a request received `queued` ago (it waited that long for a
    /// waiting thread): what the server calls. The default takes `queued` off the wait; a
    /// provider with waits of its own (e.g. for being set up) takes it off those too, so a
    /// queue of requests drains instead of each waiting in full.
    fn serve_queued(&self, sample: u32, wait: Duration, queued: Duration) -> Served {
        self.serve(sample, wait.saturating_sub(queued))
    }
}

/// Where and how a [`Server`] listens.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks an ephemeral port (see [`Server::local_addr`]).
    pub bind: SocketAddr,
    /// The job's shared secret (the handshake proves both sides hold it).
    pub secret: Secret,
    /// Job id bound into the handshake: a client of another job is refused.
    pub job: u64,
    /// Connections served at once; more are accepted and closed at once (counted).
    pub max_connections: usize,
    /// Longest time a handshake step or a request frame may take once begun, and longest
    /// silence while a reply drains.
    pub io_timeout: Duration,
    /// Threads answering requests that need no wait (at least 1).
    pub workers: usize,
    /// Threads answering requests that may wait for an imminent fill or read the sample from
    /// the dataset (at least 1).
    pub waiters: usize,
}

/// Counters since start. `cpu_seconds` is the CPU time of the server's threads (Linux).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ServerStats {
    /// Samples sent.
    pub served: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Answers "held but not filled yet".
    pub not_yet: u64,
    /// Answers "not cached here".
    pub not_held: u64,
    /// Samples the provider failed to read.
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
    /// CPU time of the server's threads, in seconds.
    pub cpu_seconds: f64,
}

/// A connection idle between requests longer than this is closed (a client that vanished
/// without a FIN must not hold a slot for ever); clients reopen transparently.
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// The whole handshake (Hello to Ready) must finish within this (or `io_timeout` if shorter),
/// timed from accept: a peer of the job finishes it in a round trip or two, so connections that
/// say nothing or trickle bytes ("slowloris") give their slot back quickly.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `shutdown` waits for the worker threads (one stuck in the provider is left).
const JOIN_TIMEOUT: Duration = Duration::from_secs(5);
/// After accept fails (out of descriptors), wait this long before accepting again.
const ACCEPT_PAUSE: Duration = Duration::from_millis(20);

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX);

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

// -- the protocol of one connection, without I/O (the poller and fuzzing drive it) ------------

#[derive(Clone, Copy)]
enum Phase {
    Hello,
    /// Challenge sent: (server nonce, client nonce).
    Auth([u8; NONCE_LEN], [u8; NONCE_LEN]),
    Ready,
}

/// What the bytes received so far call for.
#[derive(Debug)]
pub(crate) enum Step {
    /// The frame is not complete yet.
    More,
    /// A handshake reply was queued in the output.
    Reply,
    /// A complete request: answer it (and queue the reply with [`answer`]).
    Get { sample: u32, wait: Duration },
    /// Close the connection.
    Close(End),
}

/// Why a connection ended (only used to decide what to count).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum End {
    Frame,
    Auth,
}

enum Body {
    Empty,
    Provided(Box<dyn AsRef<[u8]> + Send>),
    Message(Vec<u8>),
}

impl Body {
    fn bytes(&self) -> &[u8] {
        match self {
            Body::Empty => &[],
            Body::Provided(b) => (**b).as_ref(),
            Body::Message(m) => m,
        }
    }
}

/// A reply being written: header (plus a handshake payload), then the body, from `pos` on.
pub(crate) struct Out {
    head: [u8; HEADER_LEN + NONCE_LEN + MAC_LEN],
    head_len: usize,
    body: Body,
    pos: usize,
}

impl Out {
    fn new() -> Out {
        Out {
            head: [0; HEADER_LEN + NONCE_LEN + MAC_LEN],
            head_len: 0,
            body: Body::Empty,
            pos: 0,
        }
    }

    fn set(&mut self, h: Header, extra: &[u8], body: Body) {
        self.head[..HEADER_LEN].copy_from_slice(&h.encode());
        self.head[HEADER_LEN..HEADER_LEN + extra.len()].copy_from_slice(extra);
        self.head_len = HEADER_LEN + extra.len();
        self.body = body;
        self.pos = 0;
    }

    pub(crate) fn pending(&self) -> bool {
        self.pos < self.head_len + self.body.bytes().len()
    }

    /// Write what is left with as few `writev` calls as the socket takes: `Ok(true)` when all
    /// is written, `Ok(false)` when the socket is full (non-blocking), `Err` when it broke.
    pub(crate) fn flush<W: Write>(&mut self, w: &mut W) -> io::Result<bool> {
        while self.pending() {
            let head = &self.head[self.pos.min(self.head_len)..self.head_len];
            let body = &self.body.bytes()[self.pos.saturating_sub(self.head_len)..];
            match w.write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                Ok(n) => self.pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        // Written: let go of the provider's bytes now.
        self.body = Body::Empty;
        Ok(true)
    }
}

/// One connection's protocol state: the frame being received and the reply being sent.
pub(crate) struct Proto {
    phase: Phase,
    inbuf: [u8; HEADER_LEN + NONCE_LEN],
    inlen: usize,
    /// Bytes of the current frame: `HEADER_LEN` until its header is decoded.
    need: usize,
    head: Option<Header>,
    pub(crate) out: Out,
}

impl Proto {
    pub(crate) fn new() -> Proto {
        Proto {
            phase: Phase::Hello,
            inbuf: [0; HEADER_LEN + NONCE_LEN],
            inlen: 0,
            need: HEADER_LEN,
            head: None,
            out: Out::new(),
        }
    }

    /// Past the handshake (fuzzing starts sessions here too).
    pub(crate) fn authenticated() -> Proto {
        Proto {
            phase: Phase::Ready,
            ..Proto::new()
        }
    }

    pub(crate) fn ready(&self) -> bool {
        matches!(self.phase, Phase::Ready)
    }

    /// Part of a frame has arrived.
    fn partial(&self) -> bool {
        self.inlen > 0
    }

    /// Where the next received bytes go: never past the current frame.
    pub(crate) fn want(&mut self) -> &mut [u8] {
        &mut self.inbuf[self.inlen..self.need]
    }

    /// `n` bytes were received into [`Proto::want`].
    pub(crate) fn got(&mut self, n: usize, secret: &Secret, job: u64, c: &Counters) -> Step {
        self.inlen += n;
        if self.inlen < self.need {
            return Step::More;
        }
        let h = match self.head {
            Some(h) => h,
            None => {
                let expected = match self.phase {
                    Phase::Hello => Kind::Hello,
                    Phase::Auth(..) => Kind::Auth,
                    Phase::Ready => Kind::Get,
                };
                // The kind's length limits are checked before any payload byte is read.
                let h = match frame::decode(&self.inbuf[..HEADER_LEN]) {
                    Ok(h) if h.kind == expected => h,
                    _ => {
                        c.rejected_frames.fetch_add(1, Relaxed);
                        return Step::Close(End::Frame);
                    }
                };
                if h.len > 0 {
                    self.head = Some(h);
                    self.need = HEADER_LEN + h.len as usize;
                    return Step::More;
                }
                h
            }
        };
        let mut payload = [0u8; NONCE_LEN];
        payload[..h.len as usize].copy_from_slice(&self.inbuf[HEADER_LEN..self.need]);
        self.inlen = 0;
        self.need = HEADER_LEN;
        self.head = None;
        match (self.phase, h.kind) {
            (Phase::Hello, Kind::Hello) => {
                if h.arg != job {
                    c.auth_failures.fetch_add(1, Relaxed);
                    return Step::Close(End::Auth);
                }
                let sn = nonce();
                let mut body = [0u8; NONCE_LEN + MAC_LEN];
                body[..NONCE_LEN].copy_from_slice(&sn);
                body[NONCE_LEN..].copy_from_slice(&secret.server_mac(job, &payload, &sn));
                self.out.set(
                    Header::new(Kind::Challenge, 0, body.len() as u32, 0),
                    &body,
                    Body::Empty,
                );
                self.phase = Phase::Auth(sn, payload);
                Step::Reply
            }
            (Phase::Auth(sn, cn), Kind::Auth) => {
                // Constant-time comparison (hmac's verify_slice).
                if !secret.verify_client(job, &sn, &cn, &payload) {
                    c.auth_failures.fetch_add(1, Relaxed);
                    return Step::Close(End::Auth);
                }
                self.out.set(Header::new(Kind::AuthOk, 0, 0, 0), &[], Body::Empty);
                self.phase = Phase::Ready;
                Step::Reply
            }
            (Phase::Ready, Kind::Get) => Step::Get {
                sample: h.sample,
                wait: Duration::from_micros(h.arg.min(MAX_WAIT_MICROS)),
            },
            // `decode` returned the expected kind above.
            _ => Step::Close(End::Frame),
        }
    }
}

/// Queue the reply to a `Get` for `sample` into `out`, counting it.
pub(crate) fn answer(out: &mut Out, sample: u32, served: Served, c: &Counters) {
    match served {
        Served::Ready { bytes, checksum } => {
            let len = (*bytes).as_ref().len();
            if len > MAX_DATA as usize {
                let msg = format!("sample {sample}: {len} bytes exceed the frame limit of {MAX_DATA}");
                return failed(out, sample, &msg, c);
            }
            c.served.fetch_add(1, Relaxed);
            c.bytes.fetch_add(len as u64, Relaxed);
            out.set(
                Header::new(Kind::Data, sample, len as u32, checksum),
                &[],
                Body::Provided(bytes),
            );
        }
        Served::NotYet => {
            c.not_yet.fetch_add(1, Relaxed);
            out.set(Header::new(Kind::NotYet, sample, 0, 0), &[], Body::Empty);
        }
        Served::NotHeld => {
            c.not_held.fetch_add(1, Relaxed);
            out.set(Header::new(Kind::NotHeld, sample, 0, 0), &[], Body::Empty);
        }
        Served::Failed(msg) => failed(out, sample, &msg, c),
    }
}

fn failed(out: &mut Out, sample: u32, msg: &str, c: &Counters) {
    c.failed.fetch_add(1, Relaxed);
    let mut end = msg.len().min(MAX_MESSAGE as usize);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    let m = msg.as_bytes()[..end].to_vec();
    out.set(
        Header::new(Kind::Failed, sample, m.len() as u32, 0),
        &[],
        Body::Message(m),
    );
}

/// A fresh set of counters (for fuzzing the protocol without a server).
pub(crate) fn counters() -> Counters {
    Counters::default()
}

// -- the server -------------------------------------------------------------------------------

struct Conn {
    stream: TcpStream,
    proto: Proto,
    /// Closed by the poller when this passes (handshake step, partial frame, reply, idleness).
    deadline: Instant,
}

struct Job {
    token: usize,
    conn: Box<Conn>,
    sample: u32,
    wait: Duration,
    /// When the request was complete: time queued counts against its wait.
    since: Instant,
}

#[derive(Default)]
struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
}

impl Queue {
    fn push(&self, job: Job) {
        lock(&self.jobs).push_back(job);
        self.cv.notify_one();
    }

    fn pop(&self, stop: &AtomicBool) -> Option<Job> {
        let mut q = lock(&self.jobs);
        loop {
            if stop.load(Relaxed) {
                return None;
            }
            if let Some(j) = q.pop_front() {
                return Some(j);
            }
            q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn wake_all(&self) {
        let _g = lock(&self.jobs);
        self.cv.notify_all();
    }
}

struct Shared {
    cfg: ServerConfig,
    provider: Arc<dyn Provider>,
    stop: AtomicBool,
    counters: Counters,
    /// Complete requests, answered by the worker threads.
    quick: Queue,
    /// Requests whose answer may need waiting, answered by the waiting threads.
    waiting: Queue,
    /// Connections handed back by the workers (None: closed), with the poller's waker.
    returns: Mutex<Vec<(usize, Option<Box<Conn>>)>>,
    waker: Waker,
    /// Worker threads still running, so shutdown can wait for them with a timeout.
    live: Mutex<usize>,
    live_cv: Condvar,
}

/// A running peer server: serves the provider's samples until dropped.
pub struct Server {
    shared: Arc<Shared>,
    addr: SocketAddr,
    poller: Option<JoinHandle<()>>,
    workers: Vec<JoinHandle<()>>,
}

impl Server {
    /// Listen on `cfg.bind` and serve `provider`'s samples to clients of the same job.
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
        for (key, n) in [("workers", cfg.workers), ("waiters", cfg.waiters)] {
            if n == 0 {
                return Err(NetError::Config {
                    key,
                    reason: "must be at least 1".into(),
                });
            }
        }
        let bind = cfg.bind;
        let bind_err = |source| NetError::Bind { addr: bind, source };
        let mut listener = TcpListener::bind(bind).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        let poll = Poll::new().map_err(bind_err)?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(bind_err)?;
        let waker = Waker::new(poll.registry(), WAKER).map_err(bind_err)?;
        let (workers, waiters) = (cfg.workers, cfg.waiters);
        let shared = Arc::new(Shared {
            cfg,
            provider,
            stop: AtomicBool::new(false),
            counters: Counters::default(),
            quick: Queue::default(),
            waiting: Queue::default(),
            returns: Mutex::new(Vec::new()),
            waker,
            live: Mutex::new(0),
            live_cv: Condvar::new(),
        });
        let mut server = Server {
            shared: shared.clone(),
            addr,
            poller: None,
            workers: Vec::new(),
        };
        for i in 0..workers + waiters {
            let sh = shared.clone();
            let waits = i >= workers;
            *lock(&shared.live) += 1;
            let spawned = std::thread::Builder::new()
                .name(if waits { "cv-net-wait" } else { "cv-net-work" }.into())
                .spawn(move || {
                    let _live = LiveGuard(&sh);
                    worker(&sh, waits);
                });
            match spawned {
                Ok(t) => server.workers.push(t),
                Err(source) => {
                    *lock(&shared.live) -= 1;
                    return Err(NetError::Bind { addr, source }); // `server` drops: stops the rest
                }
            }
        }
        let sh = shared.clone();
        let poller = std::thread::Builder::new()
            .name("cv-net-poll".into())
            .spawn(move || poller(poll, listener, &sh))
            .map_err(|source| NetError::Bind { addr, source })?;
        server.poller = Some(poller);
        Ok(server)
    }

    /// The address it listens on (the port picked when `bind` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The counters now.
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

    /// Stop accepting, close every connection and join all threads (bounded: a worker stuck in
    /// the provider past the join timeout is left detached, and closes its connection when it
    /// returns).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let sh = &self.shared;
        if sh.stop.swap(true, Relaxed) {
            return;
        }
        let _ = sh.waker.wake();
        sh.quick.wake_all();
        sh.waiting.wake_all();
        if let Some(p) = self.poller.take() {
            let _ = p.join();
        }
        // Queued requests: their connections close here.
        lock(&sh.quick.jobs).clear();
        lock(&sh.waiting.jobs).clear();
        let live = lock(&sh.live);
        let _ = sh.live_cv.wait_timeout_while(live, JOIN_TIMEOUT, |n| *n > 0);
        for t in std::mem::take(&mut self.workers) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
        lock(&sh.returns).clear();
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

/// Counts a worker thread as ended when dropped (also on a panic).
struct LiveGuard<'a>(&'a Shared);

impl Drop for LiveGuard<'_> {
    fn drop(&mut self) {
        *lock(&self.0.live) -= 1;
        self.0.live_cv.notify_all();
    }
}

fn worker(sh: &Shared, waits: bool) {
    let queue = if waits { &sh.waiting } else { &sh.quick };
    while let Some(mut job) = queue.pop(&sh.stop) {
        let cpu = thread_cpu_nanos();
        let sample = job.sample;
        let provider = &*sh.provider;
        let served = if waits {
            let queued = job.since.elapsed();
            Some(guarded(sample, || provider.serve_queued(sample, job.wait, queued)))
        } else {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| provider.serve_now(sample))) {
                Ok(s) => s,
                Err(_) => Some(panicked(sample)),
            }
        };
        let Some(served) = served else {
            sh.waiting.push(job);
            sh.counters
                .cpu_nanos
                .fetch_add(thread_cpu_nanos().saturating_sub(cpu), Relaxed);
            continue;
        };
        answer(&mut job.conn.proto.out, sample, served, &sh.counters);
        // Non-blocking: what the socket does not take now, the poller finishes.
        let keep = job.conn.proto.out.flush(&mut job.conn.stream).is_ok() && !sh.stop.load(Relaxed);
        lock(&sh.returns).push((job.token, keep.then_some(job.conn)));
        let _ = sh.waker.wake();
        sh.counters
            .cpu_nanos
            .fetch_add(thread_cpu_nanos().saturating_sub(cpu), Relaxed);
    }
}

fn guarded(sample: u32, f: impl FnOnce() -> Served) -> Served {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| panicked(sample))
}

fn panicked(sample: u32) -> Served {
    Served::Failed(format!("sample {sample}: the node's provider panicked"))
}

enum Slot {
    Free,
    Here(Box<Conn>),
    /// With a worker.
    Busy,
}

struct Poller<'a> {
    sh: &'a Shared,
    registry: &'a mio::Registry,
    slots: Vec<Slot>,
    free: Vec<usize>,
}

impl Poller<'_> {
    fn close(&mut self, i: usize, handshaking: bool) {
        self.slots[i] = Slot::Free;
        self.free.push(i);
        self.sh.counters.open.fetch_sub(1, Relaxed);
        if handshaking {
            self.sh.counters.rejected_connections.fetch_add(1, Relaxed);
        }
    }

    /// Accept until none is pending; `false` when accept failed (out of descriptors).
    fn accept(&mut self, listener: &TcpListener) -> bool {
        let c = &self.sh.counters;
        loop {
            let mut stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            };
            c.connections.fetch_add(1, Relaxed);
            if c.open.load(Relaxed) as usize >= self.sh.cfg.max_connections {
                // Full: the connection that has been handshaking longest gives its slot to the
                // new one (a peer of the job authenticates in a round trip, so it is never the
                // oldest for long); with none handshaking, the new one is refused.
                match self.oldest_handshaking() {
                    Some(old) => self.close(old, true),
                    None => {
                        c.rejected_connections.fetch_add(1, Relaxed);
                        continue; // dropped: closed
                    }
                }
            }
            let i = self.free.pop().unwrap_or_else(|| {
                self.slots.push(Slot::Free);
                self.slots.len() - 1
            });
            let _ = stream.set_nodelay(true);
            let interest = Interest::READABLE | Interest::WRITABLE;
            if self.registry.register(&mut stream, Token(i), interest).is_err() {
                self.free.push(i);
                c.rejected_connections.fetch_add(1, Relaxed);
                continue;
            }
            c.open.fetch_add(1, Relaxed);
            self.slots[i] = Slot::Here(Box::new(Conn {
                stream,
                proto: Proto::new(),
                deadline: Instant::now() + self.sh.cfg.io_timeout.min(HANDSHAKE_TIMEOUT),
            }));
            // The Hello may be there already.
            self.drive(i);
        }
    }

    /// The connection still handshaking whose deadline comes first (accepted earliest).
    fn oldest_handshaking(&self) -> Option<usize> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Here(c) if !c.proto.ready() => Some((c.deadline, i)),
                _ => None,
            })
            .min()
            .map(|(_, i)| i)
    }

    /// Make all the progress connection `i` allows without blocking: finish its reply, read
    /// and act on what arrived, until the socket has nothing more or a request goes to a worker.
    fn drive(&mut self, i: usize) {
        let Slot::Here(conn) = &mut self.slots[i] else { return };
        let (io_timeout, sh) = (self.sh.cfg.io_timeout, self.sh);
        loop {
            if conn.proto.out.pending() {
                match conn.proto.out.flush(&mut conn.stream) {
                    // While handshaking, the deadline set at accept stands.
                    Ok(true) if conn.proto.ready() => conn.deadline = Instant::now() + IDLE_TIMEOUT,
                    Ok(true) => {}
                    Ok(false) => {
                        if conn.proto.ready() {
                            conn.deadline = Instant::now() + io_timeout;
                        }
                        return;
                    }
                    Err(_) => {
                        let handshaking = !conn.proto.ready();
                        return self.close(i, handshaking);
                    }
                }
            }
            let began = conn.proto.partial();
            let n = match conn.stream.read(conn.proto.want()) {
                Ok(0) => {
                    let handshaking = !conn.proto.ready();
                    return self.close(i, handshaking);
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    let handshaking = !conn.proto.ready();
                    return self.close(i, handshaking);
                }
            };
            let handshaking = !conn.proto.ready();
            match conn.proto.got(n, &sh.cfg.secret, sh.cfg.job, &sh.counters) {
                Step::More => {
                    // A request frame, once begun, must complete within io_timeout (trickled
                    // bytes do not extend it); the handshake within its deadline from accept.
                    if !began && !handshaking {
                        conn.deadline = Instant::now() + io_timeout;
                    }
                }
                Step::Reply if handshaking => {}
                Step::Reply => conn.deadline = Instant::now() + io_timeout,
                Step::Get { sample, wait } => {
                    let Slot::Here(conn) = std::mem::replace(&mut self.slots[i], Slot::Busy) else {
                        unreachable!("slot {i} holds the connection being driven")
                    };
                    sh.quick.push(Job {
                        token: i,
                        conn,
                        sample,
                        wait,
                        since: Instant::now(),
                    });
                    return;
                }
                Step::Close(_) => return self.close(i, handshaking),
            }
        }
    }

    /// Close connections whose deadline passed.
    fn sweep(&mut self, now: Instant) {
        for i in 0..self.slots.len() {
            if let Slot::Here(c) = &self.slots[i] {
                if c.deadline <= now {
                    let handshaking = !c.proto.ready();
                    self.close(i, handshaking);
                }
            }
        }
    }
}

fn poller(mut poll: Poll, listener: TcpListener, sh: &Shared) {
    let registry = poll.registry().try_clone().expect("cloning the poll registry");
    let mut p = Poller {
        sh,
        registry: &registry,
        slots: Vec::new(),
        free: Vec::new(),
    };
    let mut events = Events::with_capacity(256);
    // Deadlines are checked this often (a timeout closes at most one tick late).
    let tick = (sh.cfg.io_timeout / 4).clamp(Duration::from_millis(5), Duration::from_millis(250));
    let mut next_sweep = Instant::now() + tick;
    let mut accept_paused: Option<Instant> = None;
    let mut cpu = thread_cpu_nanos();
    while !sh.stop.load(Relaxed) {
        let now = Instant::now();
        let until = accept_paused.map_or(next_sweep, |t| t.min(next_sweep));
        if let Err(e) = poll.poll(&mut events, Some(until.saturating_duration_since(now))) {
            if e.kind() != io::ErrorKind::Interrupted {
                // The poll itself failed: nothing can be served; stop rather than spin.
                break;
            }
        }
        if sh.stop.load(Relaxed) {
            break;
        }
        for ev in events.iter() {
            match ev.token() {
                LISTENER => {
                    if accept_paused.is_none() && !p.accept(&listener) {
                        accept_paused = Some(Instant::now() + ACCEPT_PAUSE);
                    }
                }
                WAKER => {}
                Token(i) => p.drive(i),
            }
        }
        let returned = std::mem::take(&mut *lock(&sh.returns));
        for (i, conn) in returned {
            match conn {
                Some(mut conn) => {
                    conn.deadline = Instant::now()
                        + if conn.proto.out.pending() {
                            sh.cfg.io_timeout
                        } else {
                            IDLE_TIMEOUT
                        };
                    p.slots[i] = Slot::Here(conn);
                    // The next request may have arrived while the worker had it.
                    p.drive(i);
                }
                None => p.close(i, false),
            }
        }
        let now = Instant::now();
        if accept_paused.is_some_and(|t| now >= t) {
            // Edge-triggered: connections that waited while paused raise no new event.
            accept_paused = if p.accept(&listener) {
                None
            } else {
                Some(now + ACCEPT_PAUSE)
            };
        }
        if now >= next_sweep {
            p.sweep(now);
            next_sweep = now + tick;
        }
        let t = thread_cpu_nanos();
        sh.counters.cpu_nanos.fetch_add(t.saturating_sub(cpu), Relaxed);
        cpu = t;
    }
    // Every connection here closes as `p` drops; those with workers close when they return.
    let open = p.slots.iter().filter(|s| matches!(s, Slot::Here(_))).count();
    sh.counters.open.fetch_sub(open as u64, Relaxed);
}
