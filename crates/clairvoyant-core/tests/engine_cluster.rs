//! Several nodes in one process, their peers reached through an in-process fake transport: the
//! cluster-wide placement reads each cached sample from the dataset once, a rank's samples come
//! from other nodes' caches, and a peer that is down or answers wrong bytes is read around.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use clairvoyant_core::engine::{
    ClusterSpec, Engine, JobSpec, PeerFetch, PeerReply, PeerService, Serve, Src, PEER_NOT_YET_ASKS,
};
use clairvoyant_core::model::{StagingSpec, SystemModel};
use clairvoyant_core::plan::{node_access, ClusterAccess, ClusterPlacement};
use clairvoyant_core::schedule::Schedule;
use clairvoyant_core::source::Source;
use clairvoyant_core::test_support::{flip_byte, memory_model, pfs, PatternSource};
use clairvoyant_core::tier::checksum;

type Dataset = PatternSource;

/// `n` samples of 500 to 2000 bytes, each read taking 200 µs; `salt` keeps the node caches of
/// tests running at once apart.
fn dataset(n: usize, salt: u64) -> Arc<Dataset> {
    let sizes = (0..n as u64).map(|k| 500 + (k * 53) % 1500).collect();
    let fingerprint = 0xc1u64 << 56 ^ (std::process::id() as u64) << 16 ^ salt;
    Arc::new(PatternSource::new(sizes, "cluster", fingerprint).with_read_delay(Duration::from_micros(200)))
}

/// The nodes' services, reached by direct calls. A node can be marked down; replies from a node
/// can be damaged on the way.
#[derive(Default)]
struct InProcess {
    services: Mutex<Vec<Option<PeerService>>>,
    registered: Condvar,
    down: Mutex<Vec<usize>>,
    damage_from: Mutex<Option<usize>>,
    /// Each node's memory arena file, once its engine is registered.
    arenas: Mutex<Vec<Option<PathBuf>>>,
    /// Replies whose bytes failed their checksum at the asker.
    corrupt: AtomicU64,
    asked: AtomicU64,
    /// Every sample's first this many asks are answered "not yet" (a fill in progress there).
    not_yet_first: u32,
    not_yet_asked: Mutex<std::collections::HashMap<u32, u32>>,
    /// Fetches whose wait at the peer was not shorter than the asker's deadline: a peer still
    /// filling the sample would answer "not yet" only when the asker had given up on it.
    late_answers: AtomicU64,
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
    fn fetch(&self, node: usize, sample: u32, wait: Duration, within: Duration, dst: &mut [u8]) -> PeerReply {
        self.asked.fetch_add(1, Ordering::Relaxed);
        if wait >= within {
            self.late_answers.fetch_add(1, Ordering::Relaxed);
        }
        if self.is_down(node) {
            return PeerReply::Down;
        }
        if self.not_yet_first > 0 {
            let mut asked = self.not_yet_asked.lock().unwrap();
            let n = asked.entry(sample).or_default();
            *n += 1;
            if *n <= self.not_yet_first {
                return PeerReply::NotYet;
            }
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
                    self.corrupt.fetch_add(1, Ordering::Relaxed);
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
    memory_model(memory, StagingSpec::new(32 << 10, 3), pfs(100.0, 0.001))
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
        let data = dataset(n, salt);
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
                    run_id: format!("cluster-test-{}", self.data.fingerprint()),
                    first_epoch: 0,
                    cluster: Some(ClusterSpec {
                        nodes: self.nodes.clone(),
                        node: i,
                        capacities: vec![vec![self.capacity]; self.nodes.len()],
                        peers: Some(self.peers.clone()),
                        peer_wait: Duration::from_secs(5),
                    }),
                    agent: None,
                };
                let e = Engine::start(self.data.clone(), &m, spec).unwrap();
                if r == ranks[0] {
                    self.peers.register(i, e.peer_service());
                    let mut arenas = self.peers.arenas.lock().unwrap();
                    arenas.resize(self.nodes.len(), None);
                    arenas[i] = e.segments().1;
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

    fn placement(&self) -> (ClusterAccess, ClusterPlacement) {
        let (access, _, _) = node_access(&self.schedule, &self.nodes, 0, 0, &[]).unwrap();
        let caps = vec![vec![self.capacity]; self.nodes.len()];
        let p = ClusterPlacement::compute(&access, |k| self.data.size(k), &caps, &[]);
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
        (0..run.data.len() as u32).filter(|&k| run.data.reads(k) > 1).count()
    );
    let peer: u64 = by.iter().map(|b| b[Src::Peer as usize]).sum();
    let all: u64 = by.iter().flatten().sum();
    assert!(
        peer > all / 3,
        "most samples of a rank live on other nodes: {peer} of {all}"
    );
}

/// A peer that answers "not yet" (its fill of the sample is still reading it) is asked again,
/// not read around: the dataset is still read once.
#[test]
fn a_peer_still_filling_is_asked_again_not_read_around() {
    let mut run = Run::new(600, 3, 2, 2, 0.4, 5);
    let mut peers = InProcess::default();
    *peers.services.lock().unwrap() = vec![None; 3];
    peers.not_yet_first = PEER_NOT_YET_ASKS - 1;
    run.peers = Arc::new(peers);
    let by = run.run(|_, _| {});
    assert_eq!(run.data.bytes_read(), run.data.total(), "a sample read twice");
    let peer: u64 = by.iter().map(|b| b[Src::Peer as usize]).sum();
    assert!(peer > 0, "no sample came from a peer");
}

/// A peer waits for a sample it is still filling for less than the asker waits for its answer:
/// it says "not yet" in time to be asked again, and is not taken for down meanwhile.
#[test]
fn a_peer_answers_before_the_askers_deadline() {
    let run = Run::new(600, 3, 2, 2, 0.4, 6);
    run.run(|_, _| {});
    assert!(run.peers.asked.load(Ordering::Relaxed) > 0, "no peer was asked");
    assert_eq!(
        run.peers.late_answers.load(Ordering::Relaxed),
        0,
        "a peer's wait outlasted the asker's deadline"
    );
}

#[test]
fn aggregate_memory_below_the_dataset_reads_the_minimum() {
    let run = Run::new(1200, 4, 2, 4, 0.125, 2);
    run.run(|_, _| {});
    let (access, p) = run.placement();
    let expected = access.expected_storage_bytes(&p.primary, |k| run.data.size(k));
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

/// A node serves its memory copies without checking them (the asker checks every reply): bytes
/// damaged in its arena reach no rank, they are read again elsewhere. The damage is done while
/// every rank waits (a rank reading a view it was handed could see bytes change under it, as
/// with any shared copy). Node 0's own ranks repair the copies they are handed, so whether node
/// 1 asks for one still damaged depends on the threads' pace: a run where it never did is tried
/// again (each run checks every byte).
#[test]
fn bytes_damaged_in_a_peers_arena_reach_no_rank() {
    let mut refused = 0;
    for salt in 6..11 {
        let run = Run::new(600, 2, 2, 3, 0.6, salt);
        let all = std::sync::Barrier::new(run.nodes.iter().map(Vec::len).sum());
        run.run(|epoch, peers| {
            if epoch == 1 {
                if all.wait().is_leader() {
                    let arena = peers.arenas.lock().unwrap()[0].clone().expect("node 0's arena");
                    let len = std::fs::metadata(&arena).unwrap().len();
                    for at in (0..len).step_by(61) {
                        flip_byte(&arena, at);
                    }
                }
                all.wait();
            }
        });
        refused = run.peers.corrupt.load(Ordering::Relaxed);
        if refused > 0 {
            break;
        }
    }
    assert!(
        refused > 0,
        "in 5 runs no damaged reply was sent: the test did not reach the asker's check"
    );
}

/// Node agents (transparent mode): one engine per node, no consumer of its own, serving random
/// reads through `Engine::local`; placement by hashed owners (no known order).
fn start_agents(data: &Arc<Dataset>, peers: &Arc<InProcess>, nodes: usize, capacity: u64, run: &str) -> Vec<Engine> {
    start_agents_with(data, peers, nodes, capacity, run, false)
}

fn start_agents_with(
    data: &Arc<Dataset>,
    peers: &Arc<InProcess>,
    nodes: usize,
    capacity: u64,
    run: &str,
    prefill: bool,
) -> Vec<Engine> {
    use clairvoyant_core::engine::{AgentCounts, AgentSpec};
    use clairvoyant_core::plan::{hashed_access, hashed_counts, hashed_owners};
    let keys: Vec<u64> = (0..data.len() as u32)
        .map(|k| checksum(data.path(k).to_string_lossy().as_bytes()))
        .collect();
    let owners = hashed_owners(&keys, nodes);
    let access = Arc::new(hashed_access(&keys, &owners, nodes));
    let groups: Vec<Vec<u32>> = (0..nodes as u32).map(|i| vec![i]).collect();
    (0..nodes)
        .map(|i| {
            let spec = JobSpec {
                schedule: Schedule::shuffle(data.len() as u64, nodes as u32, 1, 1, 3, false).unwrap(),
                rank: i as u32,
                local_ranks: vec![i as u32],
                run_id: format!("{run}-{}", data.fingerprint()),
                first_epoch: 0,
                cluster: (nodes > 1).then(|| ClusterSpec {
                    nodes: groups.clone(),
                    node: i,
                    capacities: vec![vec![capacity]; nodes],
                    peers: Some(peers.clone() as Arc<dyn PeerFetch>),
                    peer_wait: Duration::from_secs(5),
                }),
                agent: Some(AgentSpec {
                    counts: Some(AgentCounts {
                        own: hashed_counts(&keys, &owners, i),
                        cluster: (nodes > 1).then(|| access.clone()),
                    }),
                    prefill,
                    fill_on_read: Vec::new(),
                }),
            };
            let e = Engine::start(data.clone(), &model(capacity), spec).unwrap();
            peers.register(i, e.peer_service());
            e
        })
        .collect()
}

/// Wait until `done(agent)`, looking again after each sample the agent's prefill fills (its
/// [`Engine::on_prefilled`] event); fails when no fill comes for 30 s while it is not done.
fn await_prefill(agent: &Engine, done: impl Fn(&Engine) -> bool) {
    let (filled, fills) = std::sync::mpsc::channel();
    let hooked = agent.on_prefilled(Box::new(move |_, event| {
        if event != clairvoyant_core::engine::Prefill::Started {
            let _ = filled.send(());
        }
    }));
    assert!(hooked, "the prefill event was taken already");
    while !done(agent) {
        fills
            .recv_timeout(Duration::from_secs(30))
            .expect("the prefill did not finish");
    }
}

/// Read every sample through node `agent` as a program would; returns (mapped, bytes, direct).
fn read_all_local(data: &Dataset, agent: &Engine) -> (u64, u64, u64) {
    use clairvoyant_core::engine::Local;
    use std::os::unix::fs::FileExt;
    let arena = agent.segments().1.map(|p| std::fs::File::open(p).unwrap());
    let mut seen = (0, 0, 0);
    for k in 0..data.len() as u32 {
        let want = data.bytes(k);
        match agent.local(k, Duration::from_secs(5)) {
            Local::Mapped {
                offset,
                len,
                checksum: sum,
            } => {
                let mut got = vec![0u8; len as usize];
                arena.as_ref().unwrap().read_exact_at(&mut got, offset).unwrap();
                assert_eq!(got, want, "sample {k} in the arena");
                assert_eq!(checksum(&got), sum);
                seen.0 += 1;
            }
            Local::Bytes {
                bytes, checksum: sum, ..
            } => {
                assert_eq!(bytes, want, "sample {k} fetched");
                assert_eq!(checksum(&bytes), sum);
                seen.1 += 1;
            }
            Local::Direct => seen.2 += 1,
            Local::Failed(m) => panic!("sample {k}: {m}"),
        }
    }
    seen
}

#[test]
fn an_agent_keeps_a_fixed_subset_and_fills_it_on_first_read() {
    let data = dataset(300, 41);
    let peers = InProcess::new(1);
    let agents = start_agents(&data, &peers, 1, data.total() / 2, "agent-one");
    let first = read_all_local(&data, &agents[0]);
    let after_first = data.bytes_read();
    let second = read_all_local(&data, &agents[0]);
    // The same samples are cached both times; the second pass reads nothing from the dataset.
    assert_eq!(first, second);
    assert_eq!(data.bytes_read(), after_first);
    assert_eq!(first.1, 0);
    let cached_fraction = first.0 as f64 / 300.0;
    assert!((0.4..0.6).contains(&cached_fraction), "{first:?}");
    // Nothing was read ahead: only the samples asked for, once each.
    assert_eq!(agents[0].io_totals()[0], after_first);
}

#[test]
fn an_agent_that_knows_the_order_fills_ahead_and_programs_never_read_twice() {
    let data = dataset(300, 43);
    let peers = InProcess::new(1);
    let agents = start_agents_with(&data, &peers, 1, data.total(), "agent-prefill", true);
    // Programs open files while the prefill runs: each sample is read from the dataset once,
    // by whichever came first, the other waiting for that read.
    let seen = read_all_local(&data, &agents[0]);
    assert_eq!(seen, (300, 0, 0));
    await_prefill(&agents[0], |a| a.io_totals()[1] >= 300);
    for k in 0..300 {
        assert_eq!(data.reads(k), 1, "sample {k}");
    }
    assert_eq!(read_all_local(&data, &agents[0]), (300, 0, 0));
    assert_eq!(data.bytes_read(), data.total());
}

#[test]
fn an_agent_that_knows_the_order_fills_before_the_programs_ask() {
    let data = dataset(200, 44);
    let peers = InProcess::new(1);
    let agents = start_agents_with(&data, &peers, 1, data.total(), "agent-prefill-ahead", true);
    // No program has asked anything: the whole placement is filled all the same.
    await_prefill(&agents[0], |a| a.io_totals()[1] >= 200);
    assert_eq!(data.bytes_read(), data.total());
    assert_eq!(read_all_local(&data, &agents[0]), (200, 0, 0));
    assert_eq!(data.bytes_read(), data.total(), "nothing read again once filled");
}

#[test]
fn an_agent_fills_ahead_only_what_the_order_reads_and_the_rest_on_first_read() {
    use clairvoyant_core::engine::{AgentCounts, AgentSpec};
    use clairvoyant_core::plan::{order_with_hashed_rest, AccessCounts};
    let data = dataset(300, 45);
    // The order reads samples 0..150 (a train/ folder) twice; 150..300 (val/) are outside it.
    let mut order = AccessCounts::empty(300);
    let ordered: Vec<u32> = (0..150).rev().collect();
    order.add_stream(0, &ordered);
    order.add_stream(1, &ordered);
    let keys: Vec<u64> = (0..300u32)
        .map(|k| checksum(data.path(k).to_string_lossy().as_bytes()))
        .collect();
    let p = order_with_hashed_rest(vec![order], &keys).unwrap();
    let spec = JobSpec {
        schedule: Schedule::shuffle(300, 1, 1, 1, 3, false).unwrap(),
        rank: 0,
        local_ranks: vec![0],
        run_id: "agent-partial-order".into(),
        first_epoch: 0,
        cluster: None,
        agent: Some(AgentSpec {
            counts: Some(AgentCounts {
                own: p.nodes.into_iter().next().unwrap(),
                cluster: None,
            }),
            prefill: true,
            fill_on_read: p.outside,
        }),
    };
    let agent = Engine::start(data.clone(), &model(data.total()), spec).unwrap();
    await_prefill(&agent, |a| a.io_totals()[1] >= 150);
    assert!((0..150).all(|k| data.reads(k) == 1));
    assert!(
        (150..300).all(|k| data.reads(k) == 0),
        "a sample outside the order was read ahead"
    );
    // Every sample is cached all the same: the rest when first read, then never read again.
    assert_eq!(read_all_local(&data, &agent), (300, 0, 0));
    assert_eq!(read_all_local(&data, &agent), (300, 0, 0));
    assert!((0..300).all(|k| data.reads(k) == 1));
}

#[test]
fn agents_of_two_nodes_read_the_dataset_once_between_them() {
    let data = dataset(300, 42);
    let peers = InProcess::new(2);
    let agents = start_agents(&data, &peers, 2, data.total() * 6 / 10, "agent-two");
    for _ in 0..2 {
        for a in &agents {
            let (mapped, bytes, direct) = read_all_local(&data, a);
            assert_eq!(direct, 0);
            assert!(mapped > 100 && bytes > 0, "{mapped} {bytes}");
        }
    }
    // Every sample was read from the dataset exactly once across the nodes.
    for k in 0..300 {
        assert_eq!(data.reads(k), 1, "sample {k}");
    }
    // Owners are split between the nodes.
    let owned: Vec<u64> = agents.iter().map(|a| a.placement_summary()[0].1).collect();
    assert!(owned.iter().all(|&o| o > 100), "{owned:?}");
}
