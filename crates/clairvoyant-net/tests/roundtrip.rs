//! Happy paths: many samples of many sizes, every reply kind, concurrency.
mod common;

use clairvoyant_net::{Client, Fetch};
use common::*;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn round_trip_sizes_and_reply_kinds() {
    let mut sizes: Vec<(u32, usize)> = (0..200u32).map(|i| (i, (i as usize * 7919) % 300_000)).collect();
    sizes.push((1000, 0));
    sizes.push((1001, 5 << 20));
    sizes.push((1002, 1));
    let mut p = MemProvider::with_sizes(&sizes);
    p.entries.insert(2000, Entry::NotYet);
    p.entries.insert(
        2001,
        Entry::Failed("sample 2001: /data/x.jpg: permission denied".into()),
    );
    let server = start(p);
    let client = Client::new(client_cfg(7), vec![server.local_addr()]);
    for &(id, len) in &sizes {
        let mut dst = vec![0xAAu8; len];
        assert_eq!(
            client.fetch(0, id, Duration::ZERO, &mut dst).unwrap(),
            Fetch::Got,
            "sample {id} ({len} bytes)"
        );
        assert!(dst == sample_bytes(id, len), "sample {id}: bytes differ");
    }
    let mut dst = vec![0u8; 10];
    assert_eq!(
        client.fetch(0, 2000, Duration::from_millis(5), &mut dst).unwrap(),
        Fetch::NotYet
    );
    assert_eq!(client.fetch(0, 2001, Duration::ZERO, &mut dst).unwrap(), Fetch::NotHeld);
    assert_eq!(client.fetch(0, 3000, Duration::ZERO, &mut dst).unwrap(), Fetch::NotHeld);
    assert!(
        client.fetch(1, 0, Duration::ZERO, &mut dst).is_err(),
        "peer 1 does not exist"
    );
    let total: u64 = sizes.iter().map(|s| s.1 as u64).sum();
    let cs = client.stats();
    assert_eq!(
        (cs.fetched, cs.bytes, cs.not_yet, cs.not_held, cs.failed),
        (sizes.len() as u64, total, 1, 2, 1)
    );
    assert_eq!(cs.down_events, vec![0]);
    let ss = server.stats();
    assert_eq!(
        (ss.served, ss.bytes, ss.not_yet, ss.not_held, ss.failed),
        (sizes.len() as u64, total, 1, 1, 1)
    );
    assert_eq!(
        (ss.rejected_connections, ss.rejected_frames, ss.auth_failures),
        (0, 0, 0)
    );
    assert!(
        ss.connections <= 2,
        "one thread reuses pooled connections: {}",
        ss.connections
    );
    server.shutdown();
}

#[test]
fn corrupt_checksum_and_wrong_length_are_corrupt_not_down() {
    let mut p = MemProvider::with_sizes(&[(1, 1000), (3, 500)]);
    p.entries.insert(2, Entry::BadChecksum(Arc::new(sample_bytes(2, 1000))));
    let server = start(p);
    let client = Client::new(client_cfg(7), vec![server.local_addr()]);
    let mut dst = vec![0u8; 1000];
    assert_eq!(client.fetch(0, 2, Duration::ZERO, &mut dst).unwrap(), Fetch::Corrupt);
    // Sample 3 is 500 bytes at the peer, the caller expects 1000.
    assert_eq!(client.fetch(0, 3, Duration::ZERO, &mut dst).unwrap(), Fetch::Corrupt);
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    assert_eq!(dst, sample_bytes(1, 1000));
    assert!(!client.is_down(0));
    assert_eq!(client.stats().corrupt, 2);
}

#[test]
fn concurrent_fetches_from_many_threads_and_peers() {
    let sizes: Vec<(u32, usize)> = (0..64u32).map(|i| (i, 1000 + i as usize * 1500)).collect();
    // Three "nodes" on three loopback addresses, as the multi-node tests lay them out.
    let servers: Vec<_> = (1..=3)
        .map(|i| {
            let mut cfg = server_cfg(7);
            cfg.bind = format!("127.0.0.{i}:0").parse().unwrap();
            clairvoyant_net::Server::start(cfg, Arc::new(MemProvider::with_sizes(&sizes))).unwrap()
        })
        .collect();
    let client = Arc::new(Client::new(
        client_cfg(7),
        servers.iter().map(|s| s.local_addr()).collect(),
    ));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let client = client.clone();
            let sizes = sizes.clone();
            std::thread::spawn(move || {
                for i in 0..300usize {
                    let (id, len) = sizes[(i * 7 + t) % sizes.len()];
                    let mut dst = vec![0u8; len];
                    assert_eq!(
                        client.fetch((i + t) % 3, id, Duration::ZERO, &mut dst).unwrap(),
                        Fetch::Got
                    );
                    assert!(dst == sample_bytes(id, len), "thread {t}: sample {id} differs");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(client.stats().fetched, 8 * 300);
    for s in &servers {
        // connections_per_peer = 2 bounds what each server sees from this client.
        assert!(s.stats().connections <= 2, "{:?}", s.stats());
    }
}

#[test]
fn server_and_client_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Client>();
    send_sync::<clairvoyant_net::Server>();
    fn send<T: Send>() {}
    send::<clairvoyant_net::Served>();
}

#[test]
fn shutdown_is_quick_with_idle_and_half_open_connections() {
    let server = start(MemProvider::with_sizes(&[(1, 10)]));
    let client = Client::new(client_cfg(7), vec![server.local_addr()]);
    let mut dst = vec![0u8; 10];
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    let _half_open = std::net::TcpStream::connect(server.local_addr()).unwrap();
    let t0 = std::time::Instant::now();
    server.shutdown();
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "shutdown took {:?}",
        t0.elapsed()
    );
    assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::PeerDown);
}

struct Panicky;
impl clairvoyant_net::Provider for Panicky {
    fn serve(&self, sample: u32, _wait: Duration) -> clairvoyant_net::Served {
        if sample == 13 {
            panic!("provider bug on sample 13");
        }
        clairvoyant_net::Served::NotHeld
    }
}

#[test]
fn a_panicking_provider_answers_failed_and_the_server_goes_on() {
    let server = clairvoyant_net::Server::start(server_cfg(7), Arc::new(Panicky)).unwrap();
    // The panic hook prints a backtrace (RUST_BACKTRACE=1), which can outlast a short timeout.
    let mut cfg = client_cfg(7);
    cfg.io_timeout = Duration::from_secs(20);
    let client = Client::new(cfg, vec![server.local_addr()]);
    let mut dst = vec![0u8; 10];
    assert_eq!(client.fetch(0, 13, Duration::ZERO, &mut dst).unwrap(), Fetch::NotHeld);
    assert_eq!(client.fetch(0, 14, Duration::ZERO, &mut dst).unwrap(), Fetch::NotHeld);
    assert_eq!((client.stats().failed, server.stats().failed), (1, 1));
    assert!(!client.is_down(0));
}

#[test]
fn requests_waiting_for_a_fill_do_not_delay_ready_ones() {
    let mut p = MemProvider::with_sizes(&[(1, 1000)]);
    p.entries.insert(2, Entry::NotYet);
    let mut cfg = server_cfg(7);
    (cfg.workers, cfg.waiters) = (2, 2);
    let server = clairvoyant_net::Server::start(cfg, Arc::new(p)).unwrap();
    let addr = server.local_addr();
    // More waiting requests than waiting threads, each granted 800 ms.
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                let client = Client::new(client_cfg(7), vec![addr]);
                let mut dst = vec![0u8; 10];
                let t0 = std::time::Instant::now();
                let f = client.fetch(0, 2, Duration::from_millis(800), &mut dst).unwrap();
                (f, t0.elapsed())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let client = Client::new(client_cfg(7), vec![addr]);
    let mut dst = vec![0u8; 1000];
    let t0 = std::time::Instant::now();
    for _ in 0..10 {
        assert_eq!(client.fetch(0, 1, Duration::ZERO, &mut dst).unwrap(), Fetch::Got);
    }
    let ready = t0.elapsed();
    assert!(ready < Duration::from_millis(600), "ready answers waited: {ready:?}");
    for t in waiting {
        let (f, took) = t.join().unwrap();
        assert_eq!(f, Fetch::NotYet);
        // Time queued behind other waits counts against the wait granted.
        assert!(took < Duration::from_millis(1500), "a waiting request took {took:?}");
    }
    eprintln!("10 ready fetches beside 4 waiting ones: {ready:?}");
}

/// A provider whose every answer is a slow read (as a dataset read for the asking node): each
/// `serve` holds its thread until `want` of them run at once (or 5 s pass), and notes the most
/// that ran at once.
struct SlowReads {
    want: usize,
    running: std::sync::Mutex<(usize, usize)>,
    moved: std::sync::Condvar,
}

impl clairvoyant_net::Provider for SlowReads {
    fn serve(&self, sample: u32, _wait: Duration) -> clairvoyant_net::Served {
        let mut g = self.running.lock().unwrap();
        g.0 += 1;
        g.1 = g.1.max(g.0);
        self.moved.notify_all();
        let (mut g, _) = self
            .moved
            .wait_timeout_while(g, Duration::from_secs(5), |g| g.1 < self.want)
            .unwrap();
        g.0 -= 1;
        clairvoyant_net::Served::Ready {
            bytes: Box::new(sample.to_le_bytes().to_vec()),
            checksum: twox_hash::XxHash3_64::oneshot(&sample.to_le_bytes()),
        }
    }
}

#[test]
fn requests_that_read_run_on_all_waiting_threads_not_on_the_answering_ones() {
    let provider = Arc::new(SlowReads {
        want: 6,
        running: std::sync::Mutex::new((0, 0)),
        moved: std::sync::Condvar::new(),
    });
    let mut cfg = server_cfg(7);
    (cfg.workers, cfg.waiters) = (1, 6);
    let server = clairvoyant_net::Server::start(cfg, provider.clone()).unwrap();
    let addr = server.local_addr();
    let readers: Vec<_> = (0..6u32)
        .map(|k| {
            std::thread::spawn(move || {
                let client = Client::new(client_cfg(7), vec![addr]);
                let mut dst = vec![0u8; 4];
                let f = client.fetch(0, k, Duration::from_secs(10), &mut dst).unwrap();
                (f, dst == k.to_le_bytes())
            })
        })
        .collect();
    for r in readers {
        assert_eq!(r.join().unwrap(), (Fetch::Got, true));
    }
    // All 6 reads ran at once: the waiting pool is sized by `waiters`, not by `workers` (1).
    assert_eq!(provider.running.lock().unwrap().1, 6);
}
