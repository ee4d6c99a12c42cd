//! Peers that die or stall: detected once per peer, then answered `PeerDown` at once.
mod common;

use clairvoyant_net::{Client, Fetch, ManualClock, Server};
use common::*;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "CLAIRVOYANT_NET_CHILD_SERVER";

/// Not a test of its own: run by the tests below in a child process (this same test binary)
/// to get a server that can be killed with SIGKILL or stopped with SIGSTOP.
#[test]
#[ignore = "a child process of the tests below, started by them with --ignored"]
fn child_server() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "child_server runs only as the child process of the tests below"
    );
    let server = start(MemProvider::with_sizes(
        &(0..100u32).map(|i| (i, 100_000)).collect::<Vec<_>>(),
    ));
    println!("LISTENING {}", server.local_addr());
    // Killed by the parent; never outlives it by more than this.
    std::thread::sleep(Duration::from_secs(60));
}

impl ChildServer {
    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} failed");
    }
}

impl ChildServer {
    /// SIGSTOP takes effect asynchronously: wait (bounded) until every thread is stopped.
    fn wait_stopped(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let dir = format!("/proc/{}/task", self.child.id());
        loop {
            let all = std::fs::read_dir(&dir).unwrap().all(|t| {
                let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap_or_default();
                // The state follows the parenthesised command name.
                stat.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('T'))
            });
            if all {
                return;
            }
            assert!(Instant::now() < deadline, "the child server did not stop");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

fn fast_client(addrs: Vec<SocketAddr>) -> Client {
    let mut cfg = client_cfg(7);
    cfg.io_timeout = Duration::from_millis(300);
    cfg.dead_for = Duration::from_secs(30);
    Client::new(cfg, addrs)
}

#[test]
fn sigkill_is_detected_at_the_first_failing_request() {
    let child = ChildServer::spawn("child_server", CHILD_ENV);
    // A long io_timeout: detection must come from the closed sockets, not from a timeout.
    let client = Client::new(client_cfg(7), vec![child.addr]);
    let mut dst = vec![0u8; 100_000];
    for i in 0..20 {
        assert_eq!(client.fetch(0, i, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    }
    child.signal("-KILL");
    let mut child = child;
    let _ = child.child.wait();
    let t0 = Instant::now();
    assert_eq!(client.fetch(0, 21, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    let first = t0.elapsed();
    assert!(
        first < Duration::from_millis(250),
        "detected by RST/EOF, not a timeout: {first:?}"
    );
    let t1 = Instant::now();
    for i in 0..1000 {
        assert_eq!(client.fetch(0, i, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    }
    let rest = t1.elapsed();
    assert!(
        rest < Duration::from_millis(50),
        "later fetches do not touch the network: 1000 took {rest:?}"
    );
    assert!(client.is_down(0));
    assert_eq!(client.stats().down_events, vec![1]);
    eprintln!("sigkill: first failing fetch {first:?}, then 1000 fetches in {rest:?}");
}

#[test]
fn sigstop_is_detected_within_io_timeout() {
    let child = ChildServer::spawn("child_server", CHILD_ENV);
    let client = Arc::new(fast_client(vec![child.addr]));
    let mut dst = vec![0u8; 100_000];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    child.signal("-STOP");
    child.wait_stopped();
    // Several threads at once: one detects it, the others stop asking.
    let t0 = Instant::now();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || {
                let mut dst = vec![0u8; 100_000];
                let t0 = Instant::now();
                let f = client.fetch(0, t, Duration::from_millis(50), &mut dst).unwrap();
                (f, t0.elapsed())
            })
        })
        .collect();
    for t in threads {
        let (f, took) = t.join().unwrap();
        assert_eq!(f, Fetch::PeerDown);
        // io_timeout 300 ms + wait 50 ms, plus a connect+handshake for threads beyond the pool.
        assert!(took < Duration::from_millis(1500), "stalled peer detected in {took:?}");
    }
    eprintln!("sigstop: all 4 fetches answered PeerDown after {:?}", t0.elapsed());
    assert_eq!(client.stats().down_events, vec![1]);
    child.signal("-CONT");
}

/// A client whose down state is measured by `clock` (advanced by the test, never slept for).
fn manual_client(addrs: Vec<SocketAddr>, dead_for: Duration, clock: &Arc<ManualClock>) -> Client {
    let mut cfg = client_cfg(7);
    cfg.dead_for = dead_for;
    cfg.clock = clock.clone();
    Client::new(cfg, addrs)
}

/// Long enough for a probe of a local server, or of one that closes the connection, to end;
/// reached only when a probe hangs.
const PROBE_END: Duration = Duration::from_secs(30);

#[test]
fn shutdown_mid_stream_then_probe_after_dead_for() {
    let sizes: Vec<(u32, usize)> = (0..50u32).map(|i| (i, 50_000)).collect();
    let server = start(MemProvider::with_sizes(&sizes));
    let addr = server.local_addr();
    let clock = Arc::new(ManualClock::new());
    let dead_for = Duration::from_millis(300);
    let client = Arc::new(manual_client(vec![addr], dead_for, &clock));
    let stop = Arc::new(AtomicBool::new(false));
    // Each thread says once when it got 50 samples, and once when it was answered PeerDown.
    let (tx, rx) = std::sync::mpsc::channel::<Fetch>();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (client, stop, tx) = (client.clone(), stop.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut dst = vec![0u8; 50_000];
                let (mut i, mut got, mut down) = (t, 0, false);
                while !stop.load(Ordering::Relaxed) {
                    match client.fetch(0, i % 50, Duration::ZERO, &mut dst).unwrap() {
                        Fetch::Got => {
                            assert_eq!(dst, sample_bytes(i % 50, 50_000));
                            got += 1;
                            if got == 50 {
                                tx.send(Fetch::Got).unwrap();
                            }
                        }
                        Fetch::PeerDown if !down => {
                            down = true;
                            tx.send(Fetch::PeerDown).unwrap();
                        }
                        Fetch::PeerDown => {}
                        other => panic!("unexpected {other:?}"),
                    }
                    i += 1;
                }
            })
        })
        .collect();
    drop(tx);
    for _ in 0..4 {
        assert_eq!(
            rx.recv().unwrap(),
            Fetch::Got,
            "every thread is served before the shutdown"
        );
    }
    let t0 = Instant::now();
    server.shutdown();
    let shut = t0.elapsed();
    assert!(
        shut < Duration::from_secs(2),
        "shutdown joins its threads quickly: {shut:?}"
    );
    assert_eq!(rx.recv().unwrap(), Fetch::PeerDown, "a thread noticed the shutdown");
    assert!(client.is_down(0), "the clock stands still: down until it is advanced");
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client.stats().down_events, vec![1]);
    // A new server on the same address: after dead_for, one probe finds it and the peer is up.
    let mut scfg = server_cfg(7);
    scfg.bind = addr;
    let server = Server::start(scfg, Arc::new(MemProvider::with_sizes(&sizes))).unwrap();
    let mut dst = vec![0u8; 50_000];
    clock.advance(dead_for - Duration::from_millis(1));
    assert_eq!(
        client.fetch(0, 3, Duration::ZERO, &mut dst).unwrap(),
        Fetch::PeerDown,
        "still within dead_for"
    );
    assert!(client.await_probe(0, PROBE_END));
    assert!(client.is_down(0), "no probe within dead_for");
    clock.advance(Duration::from_millis(1));
    // The probe runs off the data path: the fetch that starts it is answered at once, and the
    // peer is back once the probe's handshake succeeded.
    assert_eq!(
        client.fetch(0, 3, Duration::ZERO, &mut dst).unwrap(),
        Fetch::PeerDown,
        "the first fetch after dead_for is not the probe"
    );
    assert!(client.await_probe(0, PROBE_END), "the probe ended");
    assert!(!client.is_down(0), "the probe found the new server");
    assert_eq!(client.fetch(0, 3, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    assert_eq!(dst, sample_bytes(3, 50_000));
    assert_eq!(client.stats().down_events, vec![1]);
    drop(server);
}

/// Fetch from a down peer after `clock` was advanced by `wait` less 1 ms: no probe starts (a
/// probe would hang in its handshake: the listener never accepts it); then by the last 1 ms:
/// the fetch starts a probe, which the listener accepts and fails by closing the connection.
fn expect_probe_after(client: &Client, clock: &ManualClock, listener: &std::net::TcpListener, wait: Duration) {
    let mut dst = vec![0u8; 1000];
    clock.advance(wait - Duration::from_millis(1));
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert!(client.await_probe(0, Duration::from_secs(5)), "probed before {wait:?}");
    assert!(client.is_down(0));
    clock.advance(Duration::from_millis(1));
    assert!(!client.is_down(0), "the wait of {wait:?} is over");
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    drop(listener.accept().expect("the probe connects"));
    assert!(client.await_probe(0, PROBE_END), "the probe ended");
    assert!(client.is_down(0), "a failed probe keeps the peer down");
}

/// Failed probes double the wait before the next one, up to MAX_BACKOFF_FACTOR × dead_for; a
/// peer that answers a probe is up, and its next failure waits dead_for again.
#[test]
fn failed_probes_back_off_up_to_the_cap_and_recovery_resets_it() {
    use clairvoyant_net::MAX_BACKOFF_FACTOR;
    // A peer that accepts connections and closes them: every handshake with it fails.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let clock = Arc::new(ManualClock::new());
    let dead_for = Duration::from_secs(1);
    // Patient: a probe the listener does not accept hangs in its handshake (and is seen to).
    let mut cfg = client_cfg(7);
    (cfg.dead_for, cfg.clock) = (dead_for, clock.clone());
    (cfg.connect_timeout, cfg.io_timeout) = (Duration::from_secs(120), Duration::from_secs(120));
    let client = Client::new(cfg, vec![addr]);
    let mut dst = vec![0u8; 1000];
    let fetcher = std::thread::scope(|s| {
        let f = s.spawn(|| client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap());
        drop(listener.accept().unwrap());
        f.join().unwrap()
    });
    assert_eq!(fetcher, Fetch::PeerDown);
    assert_eq!(client.stats().down_events, vec![1]);
    let mut wait = dead_for;
    for _ in 0..7 {
        expect_probe_after(&client, &clock, &listener, wait);
        wait = (wait * 2).min(dead_for * MAX_BACKOFF_FACTOR);
    }
    assert_eq!(wait, dead_for * MAX_BACKOFF_FACTOR, "the cap was reached");
    assert_eq!(client.stats().down_events, vec![1], "marked down once");
    // The peer comes back: the next probe, after the capped wait, finds it.
    drop(listener);
    let sizes = [(1u32, 1000usize)];
    let mut scfg = server_cfg(7);
    scfg.bind = addr;
    let server = Server::start(scfg.clone(), Arc::new(MemProvider::with_sizes(&sizes))).unwrap();
    clock.advance(wait);
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert!(client.await_probe(0, PROBE_END));
    assert!(!client.is_down(0), "the peer answered the probe");
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    // It fails again: the wait before its probe is dead_for again, not the capped one.
    server.shutdown();
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert_eq!(client.stats().down_events, vec![2]);
    let server = Server::start(scfg, Arc::new(MemProvider::with_sizes(&sizes))).unwrap();
    clock.advance(dead_for - Duration::from_millis(1));
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert!(client.await_probe(0, PROBE_END));
    assert!(client.is_down(0), "not probed within dead_for");
    clock.advance(Duration::from_millis(1));
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    assert!(client.await_probe(0, PROBE_END));
    assert!(!client.is_down(0), "probed after dead_for");
    drop(server);
}

/// A peer stopped with SIGSTOP costs one time-out: later fetches are answered `PeerDown` at
/// once while probes with growing waits run off the data path, and it is back after SIGCONT.
#[test]
fn a_stopped_peer_costs_one_time_out() {
    let child = ChildServer::spawn("child_server", CHILD_ENV);
    let mut cfg = client_cfg(7);
    cfg.io_timeout = Duration::from_millis(300);
    cfg.connect_timeout = Duration::from_millis(300);
    cfg.dead_for = Duration::from_millis(100);
    let client = Client::new(cfg, vec![child.addr]);
    let mut dst = vec![0u8; 100_000];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    child.signal("-STOP");
    child.wait_stopped();
    let t0 = Instant::now();
    assert_eq!(client.fetch(0, 2, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
    let first = t0.elapsed();
    // Stopped for 2 s, about 20 dead_for periods: the data path never waits on the peer again.
    let (mut slowest, mut fetches) = (Duration::ZERO, 0);
    while t0.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        assert_eq!(client.fetch(0, 3, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
        slowest = slowest.max(t.elapsed());
        fetches += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    eprintln!("sigstop: first fetch {first:?}, then {fetches} fetches, the slowest {slowest:?}");
    assert!(
        slowest * 3 < Duration::from_millis(300),
        "a fetch waited on the stopped peer ({slowest:?}; io_timeout 300 ms)"
    );
    assert_eq!(client.stats().down_events, vec![1], "marked down once");
    child.signal("-CONT");
    let t1 = Instant::now();
    let mut back = false;
    while t1.elapsed() < Duration::from_secs(10) {
        if client.fetch(0, 4, Duration::ZERO, &mut dst).unwrap() == Fetch::Got {
            back = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(back, "the peer is probed again and back after SIGCONT");
}

/// 300 connections that never say a word (and are reopened when closed) against a server of
/// 256 slots with the production 10 s I/O time-out: peers of the job are still served.
#[test]
fn silent_connections_do_not_lock_out_peers() {
    use std::io::Read;
    use std::net::TcpStream;
    let sizes: Vec<(u32, usize)> = (0..20u32).map(|i| (i, 10_000)).collect();
    let mut cfg = server_cfg(7);
    cfg.max_connections = 256;
    cfg.io_timeout = Duration::from_secs(10);
    let server = Server::start(cfg, Arc::new(MemProvider::with_sizes(&sizes))).unwrap();
    let addr = server.local_addr();
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let (full_tx, full) = std::sync::mpsc::channel();
    let attacker = {
        let (stop, opened) = (stop.clone(), opened.clone());
        std::thread::spawn(move || {
            let mut conns: Vec<TcpStream> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                // Drop the ones the server closed, then top up to 300.
                conns.retain_mut(|c| {
                    let mut b = [0u8; 1];
                    matches!(c.read(&mut b), Err(ref e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
                while conns.len() < 300 {
                    let Ok(c) = TcpStream::connect(addr) else { break };
                    c.set_nonblocking(true).unwrap();
                    conns.push(c);
                    opened.fetch_add(1, Ordering::Relaxed);
                }
                if opened.load(Ordering::Relaxed) >= 300 {
                    let _ = full_tx.send(());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    full.recv().expect("the attacker opened its 300 connections");
    let mut served = 0;
    for i in 0..20u32 {
        let client = Client::new(client_cfg(7), vec![addr]);
        let mut dst = vec![0u8; 10_000];
        if client.fetch(0, i, Duration::ZERO, &mut dst).unwrap() == Fetch::Got {
            assert_eq!(dst, sample_bytes(i, 10_000));
            served += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    attacker.join().unwrap();
    let st = server.stats();
    eprintln!(
        "slowloris: {served} of 20 peers served; {} silent connections opened, {} refused or closed",
        opened.load(Ordering::Relaxed),
        st.rejected_connections
    );
    assert_eq!(served, 20, "peers locked out by silent connections");
    assert!(st.open_connections <= 256 + 1);
}

/// A client whose own time-outs are far longer than any test: only a fetch's deadline can end a
/// wait on a silent peer. Its down state is measured by `clock`.
fn patient_client(addrs: Vec<SocketAddr>, dead_for: Duration, clock: &Arc<ManualClock>) -> Client {
    let mut cfg = client_cfg(7);
    cfg.io_timeout = Duration::from_secs(120);
    cfg.connect_timeout = Duration::from_secs(120);
    cfg.dead_for = dead_for;
    cfg.clock = clock.clone();
    Client::new(cfg, addrs)
}

/// A peer that accepts connections but never says a word (a stopped process's kernel still
/// completes the TCP handshake): a fetch with a deadline gives up at the deadline, not at the
/// client's I/O time-out, and the peer is then skipped without another connection.
#[test]
fn a_silent_peer_costs_one_deadline_then_is_skipped() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let (accepted, held) = (accepted.clone(), held.clone());
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                accepted.fetch_add(1, Ordering::SeqCst);
                held.lock().unwrap().push(s); // kept open, never answered
            }
        });
    }
    let client = patient_client(vec![addr], Duration::from_secs(120), &Arc::new(ManualClock::new()));
    let mut dst = vec![7u8; 1000];
    let t0 = Instant::now();
    let f = client
        .fetch_within(0, 1, Duration::from_secs(5), Duration::from_millis(200), &mut dst)
        .unwrap();
    let took = t0.elapsed();
    eprintln!("silent peer: fetch answered {f:?} after {took:?} (deadline 200 ms, I/O time-out 120 s)");
    assert_eq!(f, Fetch::PeerDown);
    // Generous: only the deadline can end the wait before the 120 s time-outs.
    assert!(
        took < Duration::from_secs(60),
        "the fetch waited for the I/O time-out ({took:?})"
    );
    assert_eq!(client.stats().down_events, vec![1]);
    assert!(client.is_down(0), "taken off the data path");
    let before = accepted.load(Ordering::SeqCst);
    for s in 0..100 {
        assert_eq!(
            client
                .fetch_within(0, s, Duration::from_secs(5), Duration::from_millis(200), &mut dst)
                .unwrap(),
            Fetch::PeerDown
        );
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        before,
        "a down peer is not contacted on the data path"
    );
    assert_eq!(client.stats().down_events, vec![1], "marked down once");
}

/// Answers sample 1 at once; sample 2 only when the test lets it (an authenticated peer that
/// goes silent mid-request, as a stopped process does).
struct Gate {
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
    inner: MemProvider,
}

impl clairvoyant_net::Provider for Gate {
    fn serve(&self, sample: u32, _wait: Duration) -> clairvoyant_net::Served {
        let g = self.open.lock().unwrap();
        drop(self.opened.wait_while(g, |open| !*open).unwrap());
        self.inner.serve(sample, Duration::ZERO)
    }
    fn serve_now(&self, sample: u32) -> Option<clairvoyant_net::Served> {
        if sample == 2 && !*self.open.lock().unwrap() {
            return None;
        }
        self.inner.serve_now(sample)
    }
}

/// A peer silent after the handshake: the fetch falls back at its deadline, the peer is marked
/// down once, and the reply that comes later is never read: once the peer answers a probe
/// again, every fetch gets its own sample's bytes.
#[test]
fn a_reply_after_the_deadline_is_discarded() {
    let gate = Arc::new(Gate {
        open: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        inner: MemProvider::with_sizes(&[(1, 50_000), (2, 50_000), (3, 50_000)]),
    });
    let server = Server::start(server_cfg(7), gate.clone()).unwrap();
    let clock = Arc::new(ManualClock::new());
    let dead_for = Duration::from_millis(50);
    let client = patient_client(vec![server.local_addr()], dead_for, &clock);
    let mut dst = vec![0u8; 50_000];
    let within = Duration::from_millis(300);
    assert_eq!(
        client.fetch_within(0, 1, Duration::ZERO, within, &mut dst).unwrap(),
        Fetch::Got
    );
    let t0 = Instant::now();
    let f = client.fetch_within(0, 2, Duration::ZERO, within, &mut dst).unwrap();
    let took = t0.elapsed();
    eprintln!("silent after the handshake: {f:?} after {took:?} (deadline 300 ms)");
    assert_eq!(f, Fetch::PeerDown);
    assert!(
        took < Duration::from_secs(60),
        "the fetch waited for the I/O time-out ({took:?})"
    );
    assert_eq!(client.stats().down_events, vec![1]);
    // The peer answers again (its late reply to sample 2 goes to a closed connection).
    *gate.open.lock().unwrap() = true;
    gate.opened.notify_all();
    // After dead_for, the next fetch starts a probe off the data path, which finds it up.
    clock.advance(dead_for);
    let within = Duration::from_secs(30);
    assert_eq!(
        client.fetch_within(0, 3, Duration::ZERO, within, &mut dst).unwrap(),
        Fetch::PeerDown
    );
    assert!(client.await_probe(0, PROBE_END), "the probe ended");
    assert!(!client.is_down(0), "the peer answered the probe");
    for _ in 0..17 {
        for s in [3u32, 1, 2] {
            dst.fill(0);
            let f = client.fetch_within(0, s, Duration::ZERO, within, &mut dst).unwrap();
            assert_eq!(f, Fetch::Got, "sample {s}");
            assert_eq!(dst, sample_bytes(s, 50_000), "sample {s}: its own bytes");
        }
    }
    drop(server);
}

/// A peer that keeps answering other requests while one reply takes many deadlines (it reads
/// that sample from a loaded file system on the caller's behalf) is busy, not stalled: the
/// fetch waits for the reply rather than reading the sample a second time elsewhere, and the
/// peer stays on the data path.
#[test]
fn a_busy_peer_that_answers_others_is_waited_for() {
    let gate = Arc::new(Gate {
        open: std::sync::Mutex::new(false),
        opened: std::sync::Condvar::new(),
        inner: MemProvider::with_sizes(&[(1, 50_000), (2, 50_000)]),
    });
    let server = Server::start(server_cfg(7), gate.clone()).unwrap();
    let client = Arc::new(patient_client(
        vec![server.local_addr()],
        Duration::from_secs(120),
        &Arc::new(ManualClock::new()),
    ));
    let within = Duration::from_secs(1);
    let slow = {
        let client = client.clone();
        std::thread::spawn(move || {
            let mut dst = vec![0u8; 50_000];
            let f = client.fetch_within(0, 2, Duration::ZERO, within, &mut dst).unwrap();
            (f, dst)
        })
    };
    // Sample 2's reply is held for three deadlines while sample 1 is answered throughout.
    let t0 = Instant::now();
    let mut dst = vec![0u8; 50_000];
    let mut answered = 0;
    while t0.elapsed() < within * 3 {
        assert_eq!(
            client.fetch_within(0, 1, Duration::ZERO, within, &mut dst).unwrap(),
            Fetch::Got
        );
        answered += 1;
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!slow.is_finished(), "sample 2 was answered before the gate opened");
    *gate.open.lock().unwrap() = true;
    gate.opened.notify_all();
    let (f, dst) = slow.join().unwrap();
    eprintln!(
        "busy peer: {f:?} after {:?}; {answered} other replies meanwhile",
        t0.elapsed()
    );
    assert_eq!(f, Fetch::Got, "the busy peer was given up");
    assert_eq!(dst, sample_bytes(2, 50_000));
    assert_eq!(client.stats().down_events, vec![0], "the busy peer was marked down");
}
