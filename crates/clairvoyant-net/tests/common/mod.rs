//! Test helpers: an in-memory provider and configs.
#![allow(dead_code)]

use clairvoyant_net::{ClientConfig, Provider, RealClock, Secret, Served, Server, ServerConfig};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// Deterministic bytes of sample `id` with `len` bytes.
pub fn sample_bytes(id: u32, len: usize) -> Vec<u8> {
    let mut x = (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn xxh(b: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(b)
}

struct Slice(Arc<Vec<u8>>);
impl AsRef<[u8]> for Slice {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// What the provider answers for a sample.
#[derive(Clone)]
pub enum Entry {
    Bytes(Arc<Vec<u8>>),
    BadChecksum(Arc<Vec<u8>>),
    NotYet,
    Failed(String),
}

#[derive(Default)]
pub struct MemProvider {
    pub entries: HashMap<u32, Entry>,
}

impl MemProvider {
    pub fn with_sizes(sizes: &[(u32, usize)]) -> MemProvider {
        let mut entries = HashMap::new();
        for &(id, len) in sizes {
            entries.insert(id, Entry::Bytes(Arc::new(sample_bytes(id, len))));
        }
        MemProvider { entries }
    }
}

impl Provider for MemProvider {
    fn serve(&self, sample: u32, wait: Duration) -> Served {
        match self.serve_now(sample) {
            Some(s) => s,
            None => {
                std::thread::sleep(wait);
                Served::NotYet
            }
        }
    }

    fn serve_now(&self, sample: u32) -> Option<Served> {
        Some(match self.entries.get(&sample) {
            None => Served::NotHeld,
            Some(Entry::Bytes(b)) => Served::Ready {
                checksum: xxh(b),
                bytes: Box::new(Slice(b.clone())),
            },
            Some(Entry::BadChecksum(b)) => Served::Ready {
                checksum: xxh(b) ^ 1,
                bytes: Box::new(Slice(b.clone())),
            },
            Some(Entry::NotYet) => return None,
            Some(Entry::Failed(m)) => Served::Failed(m.clone()),
        })
    }
}

pub fn secret() -> Secret {
    Secret::from_bytes(b"the job secret used in tests").unwrap()
}

pub fn server_cfg(job: u64) -> ServerConfig {
    ServerConfig {
        bind: "127.0.0.1:0".parse().unwrap(),
        secret: secret(),
        job,
        max_connections: 64,
        io_timeout: Duration::from_millis(500),
        workers: 4,
        waiters: 4,
    }
}

pub fn client_cfg(job: u64) -> ClientConfig {
    ClientConfig {
        secret: secret(),
        job,
        connections_per_peer: 2,
        // Generous: the happy-path tests must not see a loaded CI machine as a dead peer.
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(2),
        dead_for: Duration::from_secs(30),
        clock: Arc::new(RealClock),
    }
}

pub fn start(p: MemProvider) -> Server {
    Server::start(server_cfg(7), Arc::new(p)).unwrap()
}

/// A server in a child process (this test binary run again as the test `test`, with `env` set),
/// killed when dropped; its address from the "LISTENING <addr>" line it prints.
pub struct ChildServer {
    pub child: std::process::Child,
    pub addr: std::net::SocketAddr,
}

impl ChildServer {
    pub fn spawn(test: &str, env: &str) -> ChildServer {
        use std::io::{BufRead, BufReader};
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--ignored", "--nocapture", "--test-threads=1"])
            .env(env, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let addr = loop {
            let line = lines.next().expect("the child server printed its address").unwrap();
            // libtest may print "test NAME ... " before it on the same line.
            if let Some(at) = line.find("LISTENING ") {
                break line[at + 10..].trim().parse().unwrap();
            }
        };
        ChildServer { child, addr }
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
