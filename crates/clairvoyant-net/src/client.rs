//! The client a rank's staging and fill threads share: a bounded pool of authenticated
//! connections per peer, replies read straight into the caller's buffer, and per-peer failure
//! detection: a peer that failed once is taken off the data path (fetches answer `PeerDown` at
//! once) and probed off it, by a background connect and handshake, first after `dead_for`, then
//! after twice as long after each failed probe (at most [`MAX_BACKOFF_FACTOR`] times).
//! [`Client::fetch_within`] bounds a fetch's wait (for a connection, the handshake, the reply)
//! by a deadline the caller derives from its other source: a peer silent that long is taken for
//! stalled. A peer that answers other requests meanwhile is alive, only busy (for example
//! reading the sample from a loaded file system on the caller's behalf): the wait goes on, up to
//! the client's own time-outs, rather than reading the sample a second time elsewhere.
//! The down state and the back-off are decided by [`ClientConfig::clock`] (tests advance a
//! [`ManualClock`](crate::ManualClock)); I/O time-outs and fetch deadlines are real time.

use crate::clock::Clock;
use crate::error::NetError;
use crate::frame::{self, Header, Kind, HEADER_LEN, MAC_LEN, MAX_MESSAGE, MAX_WAIT_MICROS, NONCE_LEN};
use crate::secret::{nonce, Secret};
use crate::wire::{is_timeout, read_full, write_two, Wire};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a [`Client`] connects and when it gives up on a peer.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// The job's shared secret (the handshake proves both sides hold it).
    pub secret: Secret,
    /// Job id bound into the handshake: a server of another job is refused.
    pub job: u64,
    /// Connections kept per peer: how many fetches to one peer run at once.
    pub connections_per_peer: usize,
    /// Longest wait for a TCP connection and the handshake's first reply.
    pub connect_timeout: Duration,
    /// Longest silence tolerated inside a reply (on top of the request's `wait`).
    pub io_timeout: Duration,
    /// How long a failed peer is not asked before the first probe (doubling after each
    /// failed probe, up to [`MAX_BACKOFF_FACTOR`] times).
    pub dead_for: Duration,
    /// What `dead_for` and the back-off are measured by: [`RealClock`](crate::RealClock) but in
    /// tests, which advance a [`ManualClock`](crate::ManualClock) instead of waiting in real time.
    pub clock: Arc<dyn Clock>,
}

/// The longest wait between probes of a down peer, as a multiple of `dead_for`.
pub const MAX_BACKOFF_FACTOR: u32 = 16;

/// The outcome of one fetch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    /// `dst` holds the sample and its checksum was verified.
    Got,
    /// The peer holds the sample but has not filled it yet.
    NotYet,
    /// The peer does not cache the sample (or failed to read it: counted as `failed`).
    NotHeld,
    /// The peer is unreachable, stalled, broken or refused us: use another source.
    PeerDown,
    /// The bytes did not match their checksum or expected length: use another source.
    Corrupt,
}

/// Counters since the client was made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Samples received and verified.
    pub fetched: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Answers "held but not filled yet".
    pub not_yet: u64,
    /// Answers "not cached there".
    pub not_held: u64,
    /// Replies saying the peer failed to read the sample (answered as `NotHeld`).
    pub failed: u64,
    /// Fetches answered [`Fetch::PeerDown`].
    pub peer_down: u64,
    /// Replies whose bytes failed their checksum or length.
    pub corrupt: u64,
    /// Per peer: how many times it was marked down.
    pub down_events: Vec<u64>,
}

struct Conn {
    stream: TcpStream,
    read_limit: Duration,
}

impl Conn {
    fn limit(&mut self, d: Duration) -> io::Result<()> {
        if d != self.read_limit {
            self.stream.set_read_limit(d)?;
            self.read_limit = d;
        }
        Ok(())
    }
}

#[derive(Default)]
struct PeerInner {
    idle: Vec<Conn>,
    open: usize,
    down_until: Option<Instant>,
    probing: bool,
    /// Wait before the next probe (zero: `dead_for`); doubled by each failed probe.
    backoff: Duration,
}

struct Peer {
    addr: SocketAddr,
    inner: Mutex<PeerInner>,
    cv: Condvar,
    down_events: AtomicU64,
    /// Replies received from this peer on any connection: the evidence that it is alive.
    answered: AtomicU64,
}

/// A fetch's deadline: `by`, moved to `window` from now each time the peer is found to have
/// answered another request since this fetch last looked (it is alive and busy, not stalled).
struct Deadline {
    by: Instant,
    window: Duration,
    heard: u64,
}

impl Deadline {
    fn new(p: &Peer, window: Duration) -> Deadline {
        Deadline {
            by: Instant::now() + window,
            window,
            heard: p.answered.load(Relaxed),
        }
    }

    /// At `by`: whether the wait may go on (the peer answered meanwhile); `by` moves if so.
    fn extend(&mut self, p: &Peer) -> bool {
        let answered = p.answered.load(Relaxed);
        if answered == self.heard {
            return false;
        }
        self.heard = answered;
        self.by = Instant::now() + self.window;
        true
    }
}

#[derive(Default)]
struct Counters {
    fetched: AtomicU64,
    bytes: AtomicU64,
    not_yet: AtomicU64,
    not_held: AtomicU64,
    failed: AtomicU64,
    peer_down: AtomicU64,
    corrupt: AtomicU64,
}

/// Shared by all of a rank's threads (`Send + Sync`); connects lazily.
pub struct Client {
    cfg: ClientConfig,
    peers: Vec<Arc<Peer>>,
    counters: Counters,
}

/// Remote trouble: the peer is marked down.
#[derive(Debug)]
enum Fault {
    /// The connection broke before any byte of the reply: perhaps only this pooled connection
    /// was stale (closed by the server while idle), so one retry on a fresh one is allowed.
    Stale,
    Broken,
}

enum Admit {
    Normal,
    Probe,
    Down,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Client {
    /// `peers[i]` is node `i`'s server. Nothing connects until the first fetch.
    pub fn new(cfg: ClientConfig, peers: Vec<SocketAddr>) -> Client {
        let peers = peers
            .into_iter()
            .map(|addr| {
                Arc::new(Peer {
                    addr,
                    inner: Mutex::new(PeerInner::default()),
                    cv: Condvar::new(),
                    down_events: AtomicU64::new(0),
                    answered: AtomicU64::new(0),
                })
            })
            .collect();
        Client {
            cfg,
            peers,
            counters: Counters::default(),
        }
    }

    /// Fetch `sample` of expected length `dst.len()` from node `peer`, waiting at most `wait` at the server.
    pub fn fetch(&self, peer: usize, sample: u32, wait: Duration, dst: &mut [u8]) -> Result<Fetch, NetError> {
        self.fetch_by(peer, sample, wait, None, dst)
    }

    /// [`Client::fetch`] bounded by `within` of silence (waiting for a pooled connection,
    /// connecting and the handshake, the reply): a peer that has answered nothing, to this fetch
    /// or any other, for `within` is taken for stalled, marked down (its other fetches answer
    /// `PeerDown` at once; it is probed off the data path) and the connection is closed, so a
    /// late reply is never read. While the peer answers other requests the wait goes on, up to
    /// the client's time-outs (`connect_timeout` and `io_timeout`, as for [`Client::fetch`]).
    /// The server is granted at most a quarter of `within` to wait for a fill in progress, so a
    /// live peer answers in time even when it is slow to be scheduled.
    pub fn fetch_within(
        &self,
        peer: usize,
        sample: u32,
        wait: Duration,
        within: Duration,
        dst: &mut [u8],
    ) -> Result<Fetch, NetError> {
        let within = within.max(Duration::from_millis(1));
        self.fetch_by(peer, sample, wait.min(within / 4), Some(within), dst)
    }

    fn fetch_by(
        &self,
        peer: usize,
        sample: u32,
        wait: Duration,
        within: Option<Duration>,
        dst: &mut [u8],
    ) -> Result<Fetch, NetError> {
        let p = self.peers.get(peer).ok_or(NetError::BadPeer {
            peer,
            peers: self.peers.len(),
        })?;
        let probe = match self.admit(p) {
            Admit::Down => return Ok(self.count(Fetch::PeerDown, 0)),
            Admit::Normal => false,
            Admit::Probe => true,
        };
        let wait = wait.min(Duration::from_micros(MAX_WAIT_MICROS));
        let mut deadline = within.map(|w| Deadline::new(p, w));
        let mut outcome = self.attempt(p, sample, wait, &mut deadline, dst);
        if let Err(Fault::Stale) = outcome {
            // The other pooled connections are likely as stale (the server closed idle ones or
            // restarted): drop them and retry once on a fresh connection.
            self.drop_idle(p);
            outcome = self.attempt(p, sample, wait, &mut deadline, dst);
        }
        let f = match outcome {
            Ok(Some(f)) => {
                if probe {
                    self.mark_up(p);
                }
                f
            }
            // No connection came free in time while others held them: they will judge the peer.
            Ok(None) => {
                if probe {
                    self.mark_down(p);
                }
                Fetch::PeerDown
            }
            Err(_) => {
                self.mark_down(p);
                Fetch::PeerDown
            }
        };
        Ok(self.count(f, dst.len()))
    }

    /// Is `peer` currently marked down (out of range counts as down)?
    pub fn is_down(&self, peer: usize) -> bool {
        let Some(p) = self.peers.get(peer) else { return true };
        let g = lock(&p.inner);
        g.down_until.is_some_and(|t| self.cfg.clock.now() < t)
    }

    /// Wait until no probe of `peer` runs (at most `within`); whether none does. A fetch that
    /// finds a down peer's `dead_for` over starts a probe in the background and answers
    /// `PeerDown` at once; this is how a caller learns the probe's outcome ([`Client::is_down`]).
    pub fn await_probe(&self, peer: usize, within: Duration) -> bool {
        let Some(p) = self.peers.get(peer) else { return true };
        let g = lock(&p.inner);
        let (g, _) =
            p.cv.wait_timeout_while(g, within, |g| g.probing)
                .unwrap_or_else(|e| e.into_inner());
        !g.probing
    }

    /// The counters now.
    pub fn stats(&self) -> ClientStats {
        let c = &self.counters;
        ClientStats {
            fetched: c.fetched.load(Relaxed),
            bytes: c.bytes.load(Relaxed),
            not_yet: c.not_yet.load(Relaxed),
            not_held: c.not_held.load(Relaxed),
            failed: c.failed.load(Relaxed),
            peer_down: c.peer_down.load(Relaxed),
            corrupt: c.corrupt.load(Relaxed),
            down_events: self.peers.iter().map(|p| p.down_events.load(Relaxed)).collect(),
        }
    }

    fn count(&self, f: Fetch, len: usize) -> Fetch {
        let c = &self.counters;
        match f {
            Fetch::Got => {
                c.fetched.fetch_add(1, Relaxed);
                c.bytes.fetch_add(len as u64, Relaxed);
            }
            Fetch::NotYet => {
                c.not_yet.fetch_add(1, Relaxed);
            }
            Fetch::NotHeld => {
                c.not_held.fetch_add(1, Relaxed);
            }
            Fetch::PeerDown => {
                c.peer_down.fetch_add(1, Relaxed);
            }
            Fetch::Corrupt => {
                c.corrupt.fetch_add(1, Relaxed);
            }
        }
        f
    }

    fn admit(&self, p: &Arc<Peer>) -> Admit {
        let mut g = lock(&p.inner);
        match g.down_until {
            None => Admit::Normal,
            Some(t) if self.cfg.clock.now() < t || g.probing => Admit::Down,
            Some(_) => {
                g.probing = true;
                drop(g);
                // Probe off the data path: this fetch goes elsewhere at once.
                let (peer, cfg) = (p.clone(), self.cfg.clone());
                let spawned = std::thread::Builder::new()
                    .name("cv-net-probe".into())
                    .spawn(move || probe(&peer, &cfg));
                match spawned {
                    Ok(_) => Admit::Down,
                    // No thread to spare: this fetch is the probe, as a last resort.
                    Err(_) => Admit::Probe,
                }
            }
        }
    }

    fn mark_down(&self, p: &Peer) {
        let mut g = lock(&p.inner);
        if g.down_until.is_none() {
            p.down_events.fetch_add(1, Relaxed);
        }
        let backoff = if g.backoff.is_zero() {
            self.cfg.dead_for
        } else {
            g.backoff
        };
        g.down_until = Some(self.cfg.clock.now() + backoff);
        g.probing = false;
        // Pooled connections to a failed peer are not trusted again.
        let n = g.idle.len();
        g.idle.clear();
        g.open -= n;
        drop(g);
        p.cv.notify_all();
    }

    fn drop_idle(&self, p: &Peer) {
        let mut g = lock(&p.inner);
        let n = g.idle.len();
        g.idle.clear();
        g.open -= n;
        drop(g);
        p.cv.notify_all();
    }

    fn mark_up(&self, p: &Peer) {
        mark_up(p);
    }

    /// Take a pooled connection, open one, or wait for one. `Ok(None)`: none came free in time
    /// or the peer was marked down meanwhile.
    fn acquire(&self, p: &Peer, wait: Duration, dl: &mut Option<Deadline>) -> Result<Option<(Conn, bool)>, Fault> {
        let limit = Instant::now() + self.cfg.connect_timeout + self.cfg.io_timeout * 2 + wait;
        let mut g = lock(&p.inner);
        loop {
            let down_now = g.down_until.is_some_and(|t| self.cfg.clock.now() < t) && !g.probing;
            if down_now {
                return Ok(None);
            }
            if let Some(c) = g.idle.pop() {
                return Ok(Some((c, true)));
            }
            if g.open < self.cfg.connections_per_peer.max(1) {
                g.open += 1;
                drop(g);
                return match connect(&self.cfg, p.addr, dl.as_ref().map(|d| d.by)) {
                    Ok(c) => Ok(Some((c, false))),
                    Err(f) => {
                        lock(&p.inner).open -= 1;
                        p.cv.notify_one();
                        Err(f)
                    }
                };
            }
            let now = Instant::now();
            let deadline = dl.as_ref().map_or(limit, |d| d.by.min(limit));
            if now >= deadline {
                // The pool's connections are busy: wait on while their replies come.
                if now < limit && dl.as_mut().is_some_and(|d| d.extend(p)) {
                    continue;
                }
                return Ok(None);
            }
            g =
                p.cv.wait_timeout(g, deadline - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
        }
    }

    fn release(&self, p: &Peer, c: Option<Conn>) {
        let mut g = lock(&p.inner);
        match c {
            Some(c) if g.down_until.is_none() || g.probing => g.idle.push(c),
            _ => g.open -= 1,
        }
        drop(g);
        p.cv.notify_one();
    }

    fn attempt(
        &self,
        p: &Peer,
        sample: u32,
        wait: Duration,
        dl: &mut Option<Deadline>,
        dst: &mut [u8],
    ) -> Result<Option<Fetch>, Fault> {
        let Some((mut c, reused)) = self.acquire(p, wait, dl)? else {
            return Ok(None);
        };
        match self.request(p, &mut c, sample, wait, dl, dst) {
            Ok((f, keep)) => {
                self.release(p, keep.then_some(c));
                Ok(Some(f))
            }
            Err(f) => {
                self.release(p, None);
                Err(if reused { f } else { Fault::Broken })
            }
        }
    }

    /// One request on one connection. `Ok((outcome, keep))`: `keep` is false when the
    /// connection is out of step (a reply of the wrong length) and must be closed.
    /// A time-out (the deadline passed with the peer silent, or `io_timeout` of silence on
    /// this connection) is `Fault::Broken`: the connection is closed, so a reply that comes
    /// later is never read.
    fn request(
        &self,
        p: &Peer,
        c: &mut Conn,
        sample: u32,
        wait: Duration,
        dl: &mut Option<Deadline>,
        dst: &mut [u8],
    ) -> Result<(Fetch, bool), Fault> {
        let get = Header::new(Kind::Get, sample, 0, wait.as_micros() as u64);
        write_two(&mut c.stream, &get.encode(), &[]).map_err(|_| Fault::Stale)?;
        let hb = self.reply_header(p, c, wait, dl)?;
        p.answered.fetch_add(1, Relaxed);
        // The peer has answered: the rest of the reply gets a deadline of its own.
        let by = dl.as_mut().map(|d| {
            d.extend(p);
            d.by
        });
        let h = frame::decode(&hb).map_err(|_| Fault::Broken)?;
        if h.sample != sample {
            return Err(Fault::Broken);
        }
        c.limit(bounded(self.cfg.io_timeout, by)?).map_err(|_| Fault::Broken)?;
        match h.kind {
            Kind::Data => {
                if h.len as usize != dst.len() {
                    // Another length than the dataset's: wrong bytes; the stream is out of step.
                    return Ok((Fetch::Corrupt, false));
                }
                read_full(&mut c.stream, dst).map_err(|_| Fault::Broken)?;
                let ok = twox_hash::XxHash3_64::oneshot(dst) == h.arg;
                Ok((if ok { Fetch::Got } else { Fetch::Corrupt }, true))
            }
            Kind::NotYet => Ok((Fetch::NotYet, true)),
            Kind::NotHeld => Ok((Fetch::NotHeld, true)),
            Kind::Failed => {
                let mut msg = [0u8; MAX_MESSAGE as usize];
                read_full(&mut c.stream, &mut msg[..h.len as usize]).map_err(|_| Fault::Broken)?;
                self.counters.failed.fetch_add(1, Relaxed);
                Ok((Fetch::NotHeld, true))
            }
            _ => Err(Fault::Broken),
        }
    }

    /// Read a reply's header: within `io_timeout + wait` of silence on this connection, and by
    /// the deadline unless the peer answered other requests meanwhile.
    fn reply_header(
        &self,
        p: &Peer,
        c: &mut Conn,
        wait: Duration,
        dl: &mut Option<Deadline>,
    ) -> Result<[u8; HEADER_LEN], Fault> {
        let limit = Instant::now() + self.cfg.io_timeout + wait;
        let mut hb = [0u8; HEADER_LEN];
        let mut got = 0;
        loop {
            let now = Instant::now();
            let by = dl.as_ref().map_or(limit, |d| d.by.min(limit));
            if now >= by {
                if now < limit && dl.as_mut().is_some_and(|d| d.extend(p)) {
                    continue;
                }
                return Err(Fault::Broken);
            }
            c.limit(by - now).map_err(|_| Fault::Broken)?;
            match read_full(&mut c.stream, &mut hb[got..]) {
                Ok(()) => return Ok(hb),
                Err((e, n)) if is_timeout(&e) => got += n,
                Err((_, n)) => return Err(if got + n == 0 { Fault::Stale } else { Fault::Broken }),
            }
        }
    }
}

/// Why a handshake failed (tests and fuzzing look at it; the client maps all to `PeerDown`).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum HandshakeError {
    Io,
    Frame,
    /// The server's MAC did not verify: wrong secret or job.
    ServerAuth,
}

/// `limit`, or less where `by` comes sooner; `by` passed already is a time-out.
fn bounded(limit: Duration, by: Option<Instant>) -> Result<Duration, Fault> {
    match by {
        None => Ok(limit),
        Some(by) => {
            let left = by.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Fault::Broken);
            }
            Ok(limit.min(left))
        }
    }
}

/// The client side of the handshake: Hello -> Challenge (verify the server) -> Auth -> AuthOk,
/// all done by `by` where given (a fetch's deadline; a probe has none).
fn connect(cfg: &ClientConfig, addr: SocketAddr, by: Option<Instant>) -> Result<Conn, Fault> {
    let stream = TcpStream::connect_timeout(&addr, bounded(cfg.connect_timeout, by)?).map_err(|_| Fault::Broken)?;
    let _ = stream.set_nodelay(true);
    stream
        .set_write_timeout(Some(bounded(cfg.io_timeout, by)?.max(Duration::from_millis(1))))
        .map_err(|_| Fault::Broken)?;
    let mut c = Conn {
        stream,
        read_limit: Duration::ZERO,
    };
    c.limit(bounded(cfg.io_timeout, by)?).map_err(|_| Fault::Broken)?;
    handshake(&mut c.stream, &cfg.secret, cfg.job).map_err(|_| Fault::Broken)?;
    Ok(c)
}

fn mark_up(p: &Peer) {
    let mut g = lock(&p.inner);
    g.down_until = None;
    g.probing = false;
    g.backoff = Duration::ZERO;
    drop(g);
    p.cv.notify_all();
}

/// A background probe of a down peer: a connect and handshake (a stopped or overloaded peer
/// fails it within `connect_timeout + io_timeout`). Up: the connection joins the pool and the
/// peer is back on the data path. Still down: the next probe waits twice as long.
fn probe(p: &Peer, cfg: &ClientConfig) {
    match connect(cfg, p.addr, None) {
        Ok(c) => {
            let mut g = lock(&p.inner);
            if g.open < cfg.connections_per_peer.max(1) {
                g.open += 1;
                g.idle.push(c);
            }
            drop(g);
            mark_up(p);
        }
        Err(_) => {
            let mut g = lock(&p.inner);
            let base = cfg.dead_for.max(Duration::from_millis(1));
            let last = if g.backoff.is_zero() { base } else { g.backoff };
            g.backoff = (last * 2).min(base * MAX_BACKOFF_FACTOR);
            g.down_until = Some(cfg.clock.now() + g.backoff);
            g.probing = false;
            drop(g);
            p.cv.notify_all();
        }
    }
}

pub(crate) fn handshake<W: Wire>(s: &mut W, secret: &Secret, job: u64) -> Result<(), HandshakeError> {
    let cn = nonce();
    write_two(s, &Header::new(Kind::Hello, 0, NONCE_LEN as u32, job).encode(), &cn).map_err(|_| HandshakeError::Io)?;
    let mut hb = [0u8; HEADER_LEN];
    read_full(s, &mut hb).map_err(|_| HandshakeError::Io)?;
    let h = frame::decode(&hb).map_err(|_| HandshakeError::Frame)?;
    if h.kind != Kind::Challenge {
        return Err(HandshakeError::Frame);
    }
    let mut body = [0u8; NONCE_LEN + MAC_LEN];
    read_full(s, &mut body).map_err(|_| HandshakeError::Io)?;
    let (sn, mac) = parse_challenge(&body).ok_or(HandshakeError::Frame)?;
    if !secret.verify_server(job, &cn, &sn, mac) {
        return Err(HandshakeError::ServerAuth);
    }
    let my = secret.client_mac(job, &sn, &cn);
    write_two(s, &Header::new(Kind::Auth, 0, MAC_LEN as u32, 0).encode(), &my).map_err(|_| HandshakeError::Io)?;
    read_full(s, &mut hb).map_err(|_| HandshakeError::Io)?;
    match frame::decode(&hb) {
        Ok(h) if h.kind == Kind::AuthOk => Ok(()),
        _ => Err(HandshakeError::Frame),
    }
}

/// Split a Challenge payload into the server nonce and MAC.
pub fn parse_challenge(body: &[u8]) -> Option<([u8; NONCE_LEN], &[u8])> {
    if body.len() != NONCE_LEN + MAC_LEN {
        return None;
    }
    let mut sn = [0u8; NONCE_LEN];
    sn.copy_from_slice(&body[..NONCE_LEN]);
    Some((sn, &body[NONCE_LEN..]))
}
