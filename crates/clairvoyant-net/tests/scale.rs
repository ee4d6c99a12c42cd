//! Scale: one server with 255 peers connected at once keeps its threads and memory bounded, and
//! a client opens a connection to a peer only when it first fetches from it.
mod common;

use clairvoyant_net::{Client, Fetch, Server, ServerConfig};
use common::*;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "CLAIRVOYANT_NET_SCALE_SERVER";
const PEERS: usize = 255;
const SAMPLES: u32 = 256;
const SAMPLE_LEN: usize = 64 << 10;

/// Not a test of its own: the server of `many_peers_bounded_threads_and_memory`, run in a child
/// process (this same test binary) so that its threads and memory can be counted alone.
#[test]
#[ignore = "a child process of the tests below, started by them with --ignored"]
fn child_scale_server() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "child_scale_server runs only as the child process of the tests below"
    );
    let sizes: Vec<(u32, usize)> = (0..SAMPLES).map(|i| (i, SAMPLE_LEN)).collect();
    let mut cfg = server_cfg(7);
    cfg.max_connections = 1024;
    cfg.io_timeout = Duration::from_secs(10);
    let server = Server::start(cfg, Arc::new(MemProvider::with_sizes(&sizes))).unwrap();
    println!("LISTENING {}", server.local_addr());
    // Killed by the parent; never outlives it by more than this.
    std::thread::sleep(Duration::from_secs(120));
}

impl ChildServer {
    /// (threads, resident KiB) of the child process.
    fn usage(&self) -> (usize, u64) {
        let pid = self.child.id();
        let threads = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let rss = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        (threads, rss)
    }
}

/// The server's threads: what a process with one server and nothing else runs at most.
const THREAD_BOUND: usize = 16;
/// Growth of the server's resident memory with 255 connections open and served.
const RSS_GROWTH_BOUND_KIB: u64 = 32 << 10;

#[test]
fn many_peers_bounded_threads_and_memory() {
    let server = ChildServer::spawn("child_scale_server", CHILD_ENV);
    std::thread::sleep(Duration::from_millis(200));
    let (threads0, rss0) = server.usage();
    // 255 peers, each its own client with one connection, all connected at the same time.
    let start = Arc::new(Barrier::new(PEERS + 1));
    let connected = Arc::new(Barrier::new(PEERS + 1));
    let measured = Arc::new(Barrier::new(PEERS + 1));
    let t0 = Instant::now();
    let peers: Vec<_> = (0..PEERS)
        .map(|p| {
            let (start, connected, measured) = (start.clone(), connected.clone(), measured.clone());
            let addr = server.addr;
            std::thread::spawn(move || {
                let mut cfg = client_cfg(7);
                cfg.connections_per_peer = 1;
                cfg.io_timeout = Duration::from_secs(20);
                cfg.connect_timeout = Duration::from_secs(20);
                let client = Client::new(cfg, vec![addr]);
                let mut dst = vec![0u8; SAMPLE_LEN];
                let mut got = 0;
                start.wait();
                let first = p as u32 % SAMPLES;
                if client.fetch(0, first, Duration::ZERO, &mut dst).unwrap() == Fetch::Got
                    && dst == sample_bytes(first, SAMPLE_LEN)
                {
                    got += 1;
                }
                connected.wait();
                measured.wait();
                for i in 1..8u32 {
                    let s = (p as u32 * 8 + i) % SAMPLES;
                    if client.fetch(0, s, Duration::ZERO, &mut dst).unwrap() == Fetch::Got
                        && dst == sample_bytes(s, SAMPLE_LEN)
                    {
                        got += 1;
                    }
                }
                (got, client.stats().down_events[0])
            })
        })
        .collect();
    start.wait();
    connected.wait();
    // Every peer has fetched once and holds its connection open (idle, pooled).
    let (threads1, rss1) = server.usage();
    measured.wait();
    let mut served = 0;
    for t in peers {
        let (got, down) = t.join().unwrap();
        assert_eq!(down, 0, "no peer was refused or timed out");
        served += got;
    }
    let took = t0.elapsed();
    let (threads2, rss2) = server.usage();
    eprintln!(
        "{PEERS} peers connected: server threads {threads0} idle, {threads1} with all connected, \
         {threads2} after; resident {rss0} KiB idle, {rss1} KiB connected, {rss2} KiB after; \
         {served} fetches of {SAMPLE_LEN} B in {took:?}"
    );
    assert_eq!(served, PEERS * 8, "every peer got every sample it asked for");
    assert!(
        threads1 <= THREAD_BOUND && threads2 <= THREAD_BOUND,
        "server threads with {PEERS} peers: {threads1} connected, {threads2} after (bound {THREAD_BOUND})"
    );
    let growth = rss1.max(rss2).saturating_sub(rss0);
    assert!(
        growth <= RSS_GROWTH_BOUND_KIB,
        "server resident memory grew by {growth} KiB with {PEERS} peers (bound {RSS_GROWTH_BOUND_KIB} KiB)"
    );
}

#[test]
fn connections_open_only_to_peers_fetched_from() {
    const N: usize = 6;
    let servers: Vec<Server> = (0..N)
        .map(|_| {
            let cfg = ServerConfig {
                max_connections: 8,
                ..server_cfg(7)
            };
            Server::start(cfg, Arc::new(MemProvider::with_sizes(&[(1, 1000), (2, 1000)]))).unwrap()
        })
        .collect();
    let client = Client::new(client_cfg(7), servers.iter().map(|s| s.local_addr()).collect());
    std::thread::sleep(Duration::from_millis(100));
    let accepted = |servers: &[Server]| servers.iter().map(|s| s.stats().connections).collect::<Vec<_>>();
    assert_eq!(accepted(&servers), vec![0; N], "no connection before the first fetch");
    let mut dst = vec![0u8; 1000];
    assert_eq!(client.fetch(3, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    assert_eq!(client.fetch(3, 2, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    let mut want = vec![0; N];
    want[3] = 1;
    assert_eq!(
        accepted(&servers),
        want,
        "exactly one connection, to the peer fetched from"
    );
    let open = servers.iter().map(|s| s.stats().open_connections).collect::<Vec<_>>();
    assert_eq!(open, want, "and it stays open (pooled)");
    assert_eq!(client.fetch(5, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    want[5] = 1;
    assert_eq!(accepted(&servers), want);
}
