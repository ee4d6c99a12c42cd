//! Several nodes in one process, their peers reached through an in-process fake transport: the
//! cluster-wide placement reads each cached sample from the dataset once, a rank's samples come
//! from other nodes' caches, and a peer that is down or answers wrong bytes is read around.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use clairvoyant_core::engine::{ClusterSpec, Engine, JobSpec, PeerFetch, PeerReply, PeerService, Serve, Src};
use clairvoyant_core::model::{ClassKind, ClassSpec, Curve, PfsSpec, StagingSpec, SystemModel};
use clairvoyant_core::plan::{AccessCounts, ClusterPlacement};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;
use clairvoyant_core::tier::checksum;
use clairvoyant_core::Result;

/// Bytes derived from (sample, position); every read counted per sample.
struct Dataset {
    sizes: Vec<u64>,
    reads: Vec<AtomicU64>,
    fingerprint: u64,
}

impl Dataset {
    fn new(n: usize, salt: u64) -> Arc<Dataset> {
        Arc::new(Dataset {
            sizes: (0..n as u64).map(|k| 500 + (k * 53) % 1500).collect(),
            reads: (0..n).map(|_| AtomicU64::new(0)).collect(),
            fingerprint: 0xc1u64 << 56 ^ (std::process::id() as u64) << 16 ^ salt,
        })
    }
    fn byte(k: u32, i: usize) -> u8 {
        (k as usize * 131 + i * 7) as u8
    }
    fn bytes_read(&self) -> u64 {
        (0..self.sizes.len())
            .map(|k| self.reads[k].load(Ordering::Relaxed) * self.sizes[k])
            .sum()
    }
    fn total(&self) -> u64 {
        self.sizes.iter().sum()
    }
}

impl Source for Dataset {
    fn len(&self) -> usize {
        self.sizes.len()
    }
    fn size(&self, k: u32) -> u64 {
        self.sizes[k as usize]
    }
    fn label(&self, k: u32) -> i64 {
        k as i64 % 10
    }
    fn path(&self, k: u32) -> PathBuf {
        PathBuf::from(format!("cluster/{k}"))
    }
    fn read_into(&self, k: u32, buf: &mut [u8]) -> Result<()> {
        std::thread::sleep(Duration::from_micros(200));
        self.reads[k as usize].fetch_add(1, Ordering::Relaxed);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = Self::byte(k, i);
        }
        Ok(())
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// The nodes' services, reached by direct calls. A node can be marked down; replies from a node
/// can be damaged on the way.
#[derive(Default)]
struct InProcess {
    services: Mutex<Vec<Option<PeerService>>>,
    registered: Condvar,
    down: Mutex<Vec<usize>>,
    damage_from: Mutex<Option<usize>>,
    asked: AtomicU64,
}

impl InProcess {
    fn new(nodes: usize) -> Arc<InProcess> {
        let p = InProcess::default();
        *p.services.lock().unwrap() = vec![None; nodes];
        Arc::new(p)
    }
    fn register(&self, node: usize, s: PeerService) {
        self.services.lock().unwrap()[node] = Some(s);
        self.registered.notify_all();
    }
}

impl PeerFetch for InProcess {
    fn fetch(&self, node: usize, sample: u32, wait: Duration, dst: &mut [u8]) -> PeerReply {
        self.asked.fetch_add(1, Ordering::Relaxed);
        if self.is_down(node) {
            return PeerReply::Down;
        }
        // A node's server answers once its engine is attached (like the real one).
        let guard = self.services.lock().unwrap();
        let (guard, _) = self
            .registered
            .wait_timeout_while(guard, Duration::from_secs(10), |s| s[node].is_none())
            .unwrap();
        let Some(service) = guard[node].clone() else {
            return PeerReply::Down;
        };
        drop(guard);
        match service.serve(sample, wait) {
            Serve::Ready { bytes, checksum: sum } => {
                let b = bytes.as_ref().as_ref();
                if b.len() != dst.len() {
                    return PeerReply::Corrupt;
                }
                dst.copy_from_slice(b);
                if *self.damage_from.lock().unwrap() == Some(node) {
                    dst[0] ^= 0x40;
                }
                if checksum(dst) != sum {
                    return PeerReply::Corrupt;
                }
                PeerReply::Got
            }
            Serve::NotYet => PeerReply::NotYet,
            Serve::NotHeld => PeerReply::NotHeld,
            Serve::Failed(_) => PeerReply::Down,
        }
    }
    fn is_down(&self, node: usize) -> bool {
        self.down.lock().unwrap().contains(&node)
    }
}

fn model(memory: u64) -> SystemModel {
    SystemModel {
        staging: StagingSpec::new(32 << 10, 3),
        pfs: PfsSpec {
            read_mbps: Curve::constant(100.0),
            open_latency_s: 0.001,
        },
        classes: vec![ClassSpec {
            name: "memory".into(),
            kind: ClassKind::Memory,
            capacity: memory,
            threads: 2,
            read_mbps: Curve::constant(10_000.0),
            write_mbps: Curve::constant(10_000.0),
        }],
        interconnect_mbps: None,
        compute_mbps: None,
        preprocess_mbps: None,
    }
}

struct Run {
    data: Arc<Dataset>,
    peers: Arc<InProcess>,
    schedule: Schedule,
    nodes: Vec<Vec<u32>>,
    capacity: u64,
}

impl Run {
    fn new(n: usize, nodes: u32, per_node: u32, epochs: u32, fraction: f64, salt: u64) -> Run {
        let data = Dataset::new(n, salt);
        let capacity = (data.total() as f64 * fraction) as u64;
        Run {
            peers: InProcess::new(nodes as usize),
            schedule: Schedule::shuffle(n as u64, nodes * per_node, 8, epochs, 5 + salt, false).unwrap(),
            nodes: (0..nodes)
                .map(|i| (i * per_node..(i + 1) * per_node).collect())
                .collect(),
            capacity,
            data,
        }
    }

    /// Start every rank, consume every epoch on every rank at once (checking order and bytes),
    /// and return each rank's samples per source over the run.
    fn run(&self, during: impl Fn(u32, &InProcess) + Sync) -> Vec<[u64; 5]> {
        let m = model(self.capacity);
        let mut engines = Vec::new();
        for (i, ranks) in self.nodes.iter().enumerate() {
            for &r in ranks {
                let spec = JobSpec {
                    schedule: self.schedule.clone(),
                    rank: r,
                    local_ranks: ranks.clone(),
                    run_id: format!("cluster-test-{}", self.data.fingerprint),
                    first_epoch: 0,
                    cluster: Some(ClusterSpec {
                        nodes: self.nodes.clone(),
                        node: i,
                        capacities: vec![vec![self.capacity]; self.nodes.len()],
                        peers: Some(self.peers.clone()),
                        peer_wait: Duration::from_secs(5),
                    }),
                };
                let e = Engine::start(self.data.clone(), &m, spec).unwrap();
                if r == ranks[0] {
                    self.peers.register(i, e.peer_service());
                }
                engines.push((r, e));
            }
        }
        let stop = AtomicBool::new(false);
        let out = std::thread::scope(|s| {
            let handles: Vec<_> = engines
                .iter()
                .map(|(r, e)| {
                    let (sched, during, stop) = (&self.schedule, &during, &stop);
                    let peers = &self.peers;
                    s.spawn(move || {
                        let mut by = [0u64; 5];
                        for epoch in 0..sched.epochs {
                            e.begin_epoch(epoch).unwrap();
                            for (i, &k) in sched.rank_epoch(*r, epoch).unwrap().samples.iter().enumerate() {
                                if i == 20 {
                                    during(epoch, peers);
                                }
                                let l = e.next(Duration::from_secs(30)).unwrap().expect("a sample in time");
                                assert_eq!(l.sample, k, "rank {r} epoch {epoch}");
                                // SAFETY: valid until released.
                                let b = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
                                assert!(
                                    b.iter().enumerate().all(|(i, &x)| x == Dataset::byte(k, i)),
                                    "bytes of sample {k} (from {:?})",
                                    l.source
                                );
                                by[l.source as usize] += 1;
                                e.release(l.pos);
                            }
                        }
                        let _ = stop.load(Ordering::Relaxed);
                        by
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        });
        stop.store(true, Ordering::Relaxed);
        for (_, e) in &engines {
            e.shutdown();
        }
        out
    }

    fn placement(&self) -> (Vec<AccessCounts>, ClusterPlacement) {
        let access = AccessCounts::compute_groups(&self.schedule, &self.nodes).unwrap();
        let caps = vec![vec![self.capacity]; self.nodes.len()];
        let p = ClusterPlacement::compute(&access, |k| self.data.size(k), &caps);
        (access, p)
    }
}

#[test]
fn aggregate_memory_above_the_dataset_reads_it_once() {
    let run = Run::new(1200, 4, 2, 4, 0.30, 1);
    let by = run.run(|_, _| {});
    assert_eq!(
        run.data.bytes_read(),
        run.data.total(),
        "each sample read from the dataset once over the run ({} samples read more than once)",
        run.data.reads.iter().filter(|r| r.load(Ordering::Relaxed) > 1).count()
    );
    let peer: u64 = by.iter().map(|b| b[Src::Peer as usize]).sum();
    let all: u64 = by.iter().flatten().sum();
    assert!(
        peer > all / 3,
        "most samples of a rank live on other nodes: {peer} of {all}"
    );
}

#[test]
fn aggregate_memory_below_the_dataset_reads_the_minimum() {
    let run = Run::new(1200, 4, 2, 4, 0.125, 2);
    run.run(|_, _| {});
    let (access, p) = run.placement();
    let expected = p.expected_storage_bytes(&access, |k| run.data.size(k));
    let (s, c) = (run.data.total(), p.covered_bytes(|k| run.data.size(k)));
    assert_eq!(expected, s + 3 * (s - c), "the placement reaches S + (E-1)(S-C)");
    assert_eq!(run.data.bytes_read(), expected, "the dataset read exactly as planned");
}

#[test]
fn a_peer_that_goes_down_is_read_around() {
    let run = Run::new(800, 3, 2, 3, 0.4, 3);
    run.run(|epoch, peers| {
        if epoch == 1 {
            let mut d = peers.down.lock().unwrap();
            if !d.contains(&1) {
                d.push(1);
            }
        }
    });
    // Every sample arrived with its bytes (checked in `run`); the samples node 1 served are read
    // from the dataset again by the others.
    assert!(run.data.bytes_read() > run.data.total());
}

#[test]
fn damaged_peer_replies_are_read_from_the_dataset() {
    let run = Run::new(600, 2, 2, 2, 0.6, 4);
    *run.peers.damage_from.lock().unwrap() = Some(0);
    let by = run.run(|_, _| {});
    // Node 1's ranks never take node 0's damaged bytes.
    let from_peers: u64 = by[2..].iter().map(|b| b[Src::Peer as usize]).sum();
    assert_eq!(from_peers, 0);
    assert!(run.peers.asked.load(Ordering::Relaxed) > 0);
}
