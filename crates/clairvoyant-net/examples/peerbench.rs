//! Peer fetch throughput: N in-process servers on 127.0.0.1 serve 100 KB samples from memory to
//! client threads; the same bytes are then moved by a plain TCP copy (a sender thread writing,
//! a receiver reading into the same buffer size) in the same run, as the baseline.
//!
//! `target/release/examples/peerbench --json [--servers 4] [--ranks 4] [--threads-per-rank 2]
//!  [--size 102400] [--samples 20000] [--connections 2] [--rounds 3]`

use clairvoyant_net::{Client, ClientConfig, Fetch, Provider, Secret, Served, Server, ServerConfig};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

const DISTINCT: usize = 256;

struct Arena {
    bytes: Vec<u8>,
    size: usize,
    sums: Vec<u64>,
}

struct ArenaSlice {
    arena: Arc<Arena>,
    at: usize,
}

impl AsRef<[u8]> for ArenaSlice {
    fn as_ref(&self) -> &[u8] {
        &self.arena.bytes[self.at..self.at + self.arena.size]
    }
}

struct ArenaProvider(Arc<Arena>);

impl Provider for ArenaProvider {
    fn serve(&self, sample: u32, _wait: Duration) -> Served {
        let i = sample as usize % DISTINCT;
        Served::Ready {
            bytes: Box::new(ArenaSlice {
                arena: self.0.clone(),
                at: i * self.0.size,
            }),
            checksum: self.0.sums[i],
        }
    }

    fn serve_now(&self, sample: u32) -> Option<Served> {
        Some(self.serve(sample, Duration::ZERO))
    }
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map_or(default, |v| v.parse().expect(name))
}

fn process_cpu() -> f64 {
    cpu(libc::RUSAGE_SELF)
}

fn cpu(who: libc::c_int) -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct we pass.
    unsafe { libc::getrusage(who, ru.as_mut_ptr()) };
    // SAFETY: initialised above (zeroed, then filled).
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Fetch `samples` in total through the peer transport; returns (seconds, process CPU seconds).
fn peer_round(
    servers: &[Server],
    ranks: usize,
    threads: usize,
    conns: usize,
    size: usize,
    samples: usize,
) -> (f64, f64) {
    let addrs: Vec<_> = servers.iter().map(|s| s.local_addr()).collect();
    let cfg = ClientConfig {
        secret: Secret::from_bytes(b"peerbench secret, 16+ bytes").unwrap(),
        job: 1,
        connections_per_peer: conns,
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(5),
        dead_for: Duration::from_secs(5),
        clock: Arc::new(clairvoyant_net::RealClock),
    };
    let clients: Vec<Arc<Client>> = (0..ranks)
        .map(|_| Arc::new(Client::new(cfg.clone(), addrs.clone())))
        .collect();
    let per = samples / (ranks * threads);
    let cpu0 = process_cpu();
    let t0 = Instant::now();
    let hs: Vec<_> = (0..ranks * threads)
        .map(|t| {
            let client = clients[t / threads].clone();
            let n = addrs.len();
            std::thread::spawn(move || {
                let mut dst = vec![0u8; size];
                for i in 0..per {
                    let f = client
                        .fetch((i + t) % n, (i * 31 + t) as u32, Duration::ZERO, &mut dst)
                        .unwrap();
                    assert_eq!(f, Fetch::Got);
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    (t0.elapsed().as_secs_f64(), process_cpu() - cpu0)
}

/// The same bytes through plain sockets: one sender thread per receiver thread, no framing.
/// Returns (seconds, process CPU seconds, sender threads' CPU seconds).
fn plain_round(arena: &Arc<Arena>, streams: usize, size: usize, samples: usize) -> (f64, f64, f64) {
    let per = samples / streams;
    let mut pairs = Vec::new();
    for _ in 0..streams {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let rx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (tx, _) = l.accept().unwrap();
        pairs.push((tx, rx));
    }
    let cpu0 = process_cpu();
    let t0 = Instant::now();
    let mut hs = Vec::new();
    for (t, (mut tx, mut rx)) in pairs.into_iter().enumerate() {
        let arena = arena.clone();
        hs.push(std::thread::spawn(move || {
            let c0 = cpu(libc::RUSAGE_THREAD);
            for i in 0..per {
                let at = ((i * 31 + t) % DISTINCT) * size;
                tx.write_all(&arena.bytes[at..at + size]).unwrap();
            }
            cpu(libc::RUSAGE_THREAD) - c0
        }));
        hs.push(std::thread::spawn(move || {
            let mut dst = vec![0u8; size];
            for _ in 0..per {
                rx.read_exact(&mut dst).unwrap();
            }
            0.0
        }));
    }
    let sender_cpu: f64 = hs.into_iter().map(|h| h.join().unwrap()).sum();
    (t0.elapsed().as_secs_f64(), process_cpu() - cpu0, sender_cpu)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nservers = arg(&args, "--servers", 4);
    let ranks = arg(&args, "--ranks", 4);
    let threads = arg(&args, "--threads-per-rank", 2);
    let size = arg(&args, "--size", 100 * 1024);
    let samples = arg(&args, "--samples", 20_000);
    let conns = arg(&args, "--connections", 2);
    let rounds = arg(&args, "--rounds", 3);
    let json = args.iter().any(|a| a == "--json");

    let mut bytes = vec![0u8; DISTINCT * size];
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for b in bytes.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let sums = (0..DISTINCT)
        .map(|i| twox_hash::XxHash3_64::oneshot(&bytes[i * size..(i + 1) * size]))
        .collect();
    let arena = Arc::new(Arena { bytes, size, sums });
    let servers: Vec<Server> = (0..nservers)
        .map(|_| {
            let cfg = ServerConfig {
                bind: "127.0.0.1:0".parse().unwrap(),
                secret: Secret::from_bytes(b"peerbench secret, 16+ bytes").unwrap(),
                job: 1,
                max_connections: 256,
                io_timeout: Duration::from_secs(5),
                workers: 4,
                waiters: 4,
            };
            Server::start(cfg, Arc::new(ArenaProvider(arena.clone()))).unwrap()
        })
        .collect();
    let streams = ranks * threads;
    let moved = (samples / streams * streams * size) as f64;
    let (mut peer, mut plain, mut peer_cpu, mut plain_cpu, mut sender_cpu) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..rounds {
        let (s, c, sc) = plain_round(&arena, streams, size, samples);
        plain.push(moved / s / 1e9);
        plain_cpu.push(c);
        sender_cpu.push(sc);
        let (s, c) = peer_round(&servers, ranks, threads, conns, size, samples);
        peer.push(moved / s / 1e9);
        peer_cpu.push(c);
    }
    let served: u64 = servers.iter().map(|s| s.stats().served).sum();
    let server_cpu: f64 = servers.iter().map(|s| s.stats().cpu_seconds).sum();
    let (gbps, plain_gbps) = (median(peer.clone()), median(plain.clone()));
    let n = (samples / streams * streams) as f64;
    let out = serde_json::json!({
        "servers": nservers, "ranks": ranks, "threads_per_rank": threads, "connections_per_peer": conns,
        "sample_bytes": size, "samples_per_round": samples / streams * streams, "rounds": rounds,
        "peer_gbps": gbps, "plain_socket_gbps": plain_gbps, "peer_over_plain": gbps / plain_gbps,
        "peer_gbps_rounds": peer, "plain_socket_gbps_rounds": plain,
        "server_cpu_us_per_sample": server_cpu / served as f64 * 1e6,
        "process_cpu_us_per_sample_peer": median(peer_cpu) / n * 1e6,
        "process_cpu_us_per_sample_plain": median(plain_cpu) / n * 1e6,
        "plain_sender_cpu_us_per_sample": median(sender_cpu) / n * 1e6,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
    });
    if json {
        println!("{out}");
    } else {
        println!("{}", serde_json::to_string_pretty(&out).unwrap());
    }
}
