//! Two nodes emulated in one process: two real engines, each with its own node cache under a
//! test-private shared-memory folder, each with its own peer server, reaching each other through
//! the real transport on loopback. A sample cached by one node reaches the other with the
//! dataset's bytes; once a node's server is closed, the other reads around it from the dataset.
//!
//! One test in this file: the shared-memory folder is a process-wide setting, set once here
//! before any engine starts.

use std::sync::Arc;
use std::time::Duration;

use clairvoyant_core::engine::{ClusterDesc, Engine, EngineSpec, PeersDesc, Src};
use clairvoyant_core::model::{StagingSpec, SystemModel};
use clairvoyant_core::test_support::{memory_model, pfs, PatternSource};
use clairvoyant_net::engine::{job_spec, NodeServer, PeerClient, ServerSpec};

const SAMPLES: usize = 400;
const EPOCHS: u32 = 3;
const SECRET: [u8; 32] = [0x5a; 32];
const JOB: u64 = 0x7e57;

type Dataset = PatternSource;

/// One memory class per node; the file system slow enough that a peer is worth asking.
fn model(memory: u64) -> SystemModel {
    memory_model(memory, StagingSpec::new(32 << 10, 2), pfs(50.0, 0.002))
}

/// A node: its engine, its server and the client it fetches from the other node with.
struct Node {
    engine: Engine,
    server: NodeServer,
    client: Arc<PeerClient>,
}

fn start_servers() -> Vec<NodeServer> {
    (0..2)
        .map(|_| {
            NodeServer::start(&ServerSpec {
                bind: "127.0.0.1:0".into(),
                secret: SECRET.to_vec(),
                job: JOB,
                max_connections: 64,
                io_timeout: 5.0,
                workers: 2,
                waiters: 2,
            })
            .expect("a server on loopback")
        })
        .collect()
}

/// Node `node` of two (one rank each), every node caching `capacity` bytes.
fn start_node(data: &Arc<Dataset>, server: NodeServer, addresses: &[String], node: u32, capacity: u64) -> Node {
    let spec = EngineSpec {
        batch_size: 8,
        epochs: EPOCHS,
        seed: 11,
        rank: node,
        world_size: 2,
        local_ranks: vec![node],
        run_id: "net-engine-test".into(),
        cluster: Some(ClusterDesc {
            nodes: vec![vec![0], vec![1]],
            node: node as usize,
            capacities: vec![vec![capacity]; 2],
            peers: Some(PeersDesc {
                addresses: addresses.to_vec(),
                secret: SECRET.to_vec(),
                job: JOB,
                connections: None,
            }),
            peer_wait: None,
        }),
        ..EngineSpec::default()
    };
    let (job, client) = job_spec(spec, data.as_ref()).expect("a valid spec");
    let engine = Engine::start(data.clone(), &model(capacity), job).expect("the engine starts");
    server.attach(engine.peer_service());
    Node {
        engine,
        server,
        client: client.expect("a peer client"),
    }
}

/// Consume `epoch` on `node`'s rank, checking order and bytes; samples per source.
fn consume(node: &Node, rank: u32, epoch: u32) -> [u64; 5] {
    let e = &node.engine;
    e.begin_epoch(epoch).unwrap();
    let mut by = [0u64; 5];
    let want = e.epoch_samples(epoch).unwrap();
    for &k in &want {
        let l = e.next(Duration::from_secs(60)).unwrap().expect("a sample in time");
        assert_eq!(l.sample, k, "rank {rank} epoch {epoch}: the scheduled order");
        // SAFETY: the lease's bytes stay valid until it is released below.
        let b = unsafe { std::slice::from_raw_parts(l.ptr, l.len) };
        assert_eq!(b.len() as u64, node_size(k), "sample {k}");
        assert!(
            b.iter().enumerate().all(|(i, &x)| x == Dataset::byte(k, i)),
            "rank {rank} epoch {epoch}: the bytes of sample {k} (from {:?})",
            l.source
        );
        by[l.source as usize] += 1;
        e.release(l.pos);
    }
    by
}

fn node_size(k: u32) -> u64 {
    500 + (k as u64 * 53) % 1500
}

#[test]
fn two_engines_share_their_caches_over_loopback_and_read_around_a_closed_peer() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    // Set before any engine starts, and the only test of this process: nothing reads it at once.
    std::env::set_var(clairvoyant_core::sysinfo::env::SHM_DIR.name, &shm);

    let data = Arc::new(PatternSource::new(
        (0..SAMPLES as u32).map(node_size).collect(),
        "two-nodes",
        0x0e71_0000_0000 ^ std::process::id() as u64,
    ));
    let total = data.total();
    // Together the nodes hold the dataset; each holds little more than its half, so most
    // samples another node is the primary of are fetched from it, not kept here.
    let capacity = total * 55 / 100;
    let servers = start_servers();
    let addresses: Vec<String> = servers.iter().map(|s| s.address().to_string()).collect();
    let mut nodes = Vec::new();
    for (i, server) in servers.into_iter().enumerate() {
        nodes.push(start_node(&data, server, &addresses, i as u32, capacity));
    }

    // Epoch 0 on both nodes at once: each has samples the other is the primary of.
    let first: Vec<[u64; 5]> = std::thread::scope(|s| {
        let hs: Vec<_> = nodes
            .iter()
            .enumerate()
            .map(|(r, n)| s.spawn(move || consume(n, r as u32, 0)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (r, by) in first.iter().enumerate() {
        assert!(
            by[Src::Peer as usize] > 0,
            "rank {r} fetched from the other node: {by:?}"
        );
    }
    for (r, n) in nodes.iter().enumerate() {
        let (served, _) = n.engine.peer_service().served();
        let fetched = n.client.stats().fetched;
        assert!(
            served > 0 && fetched > 0,
            "node {r}: served {served}, fetched {fetched}"
        );
        assert!(n.server.stats().unwrap().served > 0, "node {r}'s server answered");
    }
    let read_before = data.files_read();
    assert!(
        read_before <= SAMPLES as u64 * 2,
        "{read_before} reads of {SAMPLES} samples"
    );

    // Node 0 closes its server: node 1 goes on, reading node 0's samples from the dataset.
    let node0 = nodes.remove(0);
    node0.server.close();
    node0.engine.shutdown();
    let node1 = &nodes[0];
    let mut after = [0u64; 5];
    for epoch in 1..EPOCHS {
        let by = consume(node1, 1, epoch);
        after.iter_mut().zip(by).for_each(|(a, b)| *a += b);
    }
    assert!(
        after[Src::Pfs as usize] > 0,
        "node 0's samples read from the dataset: {after:?}"
    );
    let stats = node1.engine.stats();
    let fallbacks: u64 = stats.iter().map(|s| s.peer_fallbacks).sum();
    assert!(fallbacks > 0, "fetches from the closed node fell back: {stats:?}");
    let c = node1.client.stats();
    assert!(c.peer_down > 0 && c.down_events[0] > 0, "node 0 taken for down: {c:?}");
    assert!(data.files_read() > read_before);
    node1.server.close();
    node1.engine.shutdown();
}
