//! Setting a policy up: what it caches where (single copies, per-node placement, LBANN's data
//! store, parallel staging's shards), the rates it charges, and its fill threads.

use super::*;

/// A set-up step's outcome: `Ok(Err(reason))` when the policy cannot run the scenario (a result
/// of its own, not an error), `Err` for a failure.
pub(super) type Setup<T> = Result<std::result::Result<T, String>>;

/// What a policy caches, where its workers' samples come from first and in which order.
pub(super) struct CacheSetup {
    pub(super) cache: Cache,
    pub(super) order: Order,
    pub(super) fills: Vec<FillList>,
    pub(super) full_randomization: bool,
}

/// Seconds per byte of each transfer the simulation charges.
pub(super) struct Rates {
    /// Writing a sample into staging (or preprocessing it, whichever is slower).
    pub(super) write_spb: f64,
    pub(super) class_read_spb: Vec<f64>,
    pub(super) class_write_spb: Vec<f64>,
    /// Fetching from another node's class j; None where the class cannot be served remotely.
    pub(super) remote_spb: Vec<Option<f64>>,
}

impl Rates {
    pub(super) fn of(sc: &Scenario) -> Rates {
        let m = &sc.system;
        let per_thread = |curve: &clairvoyant_core::model::Curve, p: u32| {
            let p = p.max(1) as f64;
            curve.at(p) / p * 1e6
        };
        // Preprocessing is CPU work: with more busy processes than cores it slows down.
        let contention = sc.cpu.map_or(1.0, |c| c.slowdown(sc.workers_per_node));
        let beta = m.preprocess_mbps.map_or(0.0, |b| contention / (b * 1e6));
        Rates {
            write_spb: beta.max(1.0 / per_thread(&m.staging.write_mbps, m.staging.threads)),
            class_read_spb: m
                .classes
                .iter()
                .map(|c| 1.0 / per_thread(&c.read_mbps, c.threads))
                .collect(),
            class_write_spb: m
                .classes
                .iter()
                .map(|c| 1.0 / per_thread(&c.write_mbps, c.threads))
                .collect(),
            remote_spb: (0..m.classes.len())
                .map(|j| m.remote_fetch_seconds(j, 1_000_000).map(|s| s / 1e6))
                .collect(),
        }
    }
}

/// A cache of one copy per sample, nothing held yet: admitted to `admit_to` (fastest first) by
/// `admit`; `remote`: other nodes' copies are fetched.
fn single_cache(run: &Run, admit_to: Vec<usize>, admit: Admit, remote: bool) -> Cache {
    let nodes = run.scenario.nodes() as usize;
    Cache::Single {
        held: huge_vec(run.sizes.len(), Held::new(f64::INFINITY, NONE, UNCACHED)),
        cached: vec![Vec::new(); nodes],
        used: vec![vec![0; run.scenario.system.classes.len()]; nodes],
        admit_to,
        admit,
        remote,
    }
}

/// What `policy` caches and in which order its workers read.
pub(super) fn cache_setup(run: &Run, policy: Policy, threads: usize) -> Setup<CacheSetup> {
    let m = &run.scenario.system;
    let memory = m.memory_class().filter(|&j| m.classes[j].enabled());
    let enabled: Vec<usize> = (0..m.classes.len()).filter(|&j| m.classes[j].enabled()).collect();
    let mut setup = CacheSetup {
        cache: Cache::None,
        order: Order::Global,
        fills: Vec::new(),
        full_randomization: true,
    };
    match policy {
        Policy::Perfect | Policy::Naive => {}
        Policy::StagingBuffer => match staging_buffer_cache(run) {
            Ok(cache) => setup.cache = cache,
            Err(reason) => return Ok(Err(reason)),
        },
        Policy::DeepIoOrdered | Policy::DeepIoOpportunistic => {
            let Some(mem) = memory else {
                return Ok(Err("DeepIO caches in memory; the system has no memory class".into()));
            };
            if policy == Policy::DeepIoOpportunistic {
                setup.order = Order::Opportunistic;
            }
            setup.cache = single_cache(run, vec![mem], Admit::Always, true);
        }
        Policy::LbannDynamic | Policy::LbannPreloading => {
            let Some(mem) = memory else {
                return Ok(Err(
                    "the LBANN data store caches in memory; the system has no memory class".into(),
                ));
            };
            match lbann_cache(run, policy, mem, &mut setup.fills) {
                Ok(cache) => setup.cache = cache,
                Err(reason) => return Ok(Err(reason)),
            }
        }
        Policy::LocalityAware => {
            setup.order = Order::Locality;
            setup.cache = single_cache(run, enabled, Admit::Always, false);
        }
        Policy::ParallelStaging => return Ok(parallel_staging_setup(run, enabled)),
        Policy::Clairvoyant => setup.cache = clairvoyant_cache(run, threads, &mut setup.fills)?,
    }
    Ok(Ok(setup))
}

/// The staging-buffer baseline: the whole dataset already in class `staging_buffer_source` on
/// every node.
fn staging_buffer_cache(run: &Run) -> std::result::Result<Cache, String> {
    let sc = run.scenario;
    let Some(j) = sc.staging_buffer_source else {
        return Ok(Cache::None);
    };
    let c = &sc.system.classes[j];
    let total_bytes: u64 = run.sizes.iter().sum();
    if total_bytes > c.capacity {
        return Err(format!(
            "the dataset ({}) does not fit class '{}' ({}) that staging_buffer_source names",
            format_bytes(total_bytes),
            c.name,
            format_bytes(c.capacity)
        ));
    }
    Ok(Cache::Everywhere(j))
}

/// LBANN's data store in memory class `mem`: filled in the first epoch (dynamic), or samples
/// dealt to nodes round robin and preloaded (`fills` gets one list per node).
fn lbann_cache(run: &Run, policy: Policy, mem: usize, fills: &mut Vec<FillList>) -> std::result::Result<Cache, String> {
    let m = &run.scenario.system;
    let nodes = run.scenario.nodes() as usize;
    let total_bytes: u64 = run.sizes.iter().sum();
    let aggregate = m.classes[mem].capacity.saturating_mul(nodes as u64);
    if total_bytes > aggregate {
        return Err(format!(
            "the dataset ({}) exceeds the aggregate memory of {nodes} node(s) ({})",
            format_bytes(total_bytes),
            format_bytes(aggregate)
        ));
    }
    if policy == Policy::LbannDynamic {
        return Ok(single_cache(run, vec![mem], Admit::FirstEpoch, true));
    }
    let mut cache = single_cache(run, vec![mem], Admit::Never, true);
    let Cache::Single { held, used, .. } = &mut cache else {
        unreachable!()
    };
    let mut lists: Vec<Vec<u32>> = vec![Vec::new(); nodes];
    for (k, (h, &size)) in held.iter_mut().zip(run.sizes).enumerate() {
        let n = k % nodes;
        h.set(n as u32, mem as u8);
        used[n][mem] += size;
        lists[n].push(k as u32);
    }
    if let Some(n) = (0..nodes).find(|&n| used[n][mem] > m.classes[mem].capacity) {
        return Err(format!(
            "node {n}'s share of the dataset ({}) exceeds its memory ({})",
            format_bytes(used[n][mem]),
            format_bytes(m.classes[mem].capacity)
        ));
    }
    for (n, list) in lists.into_iter().enumerate() {
        fills.push(FillList {
            node: n as u32,
            class: mem,
            order: list,
            need: Vec::new(),
            cursor: 0,
        });
    }
    Ok(cache)
}

/// Parallel staging: the first epoch's order cut into one contiguous shard per worker; each
/// worker keeps what fits in its share of its node's classes `enabled` and reads only that.
fn parallel_staging_setup(run: &Run, enabled: Vec<usize>) -> std::result::Result<CacheSetup, String> {
    let sc = run.scenario;
    let m = &sc.system;
    let (f, workers) = (run.sizes.len(), sc.workers as usize);
    if enabled.is_empty() {
        return Err("parallel staging copies shards to local storage; the system has no storage class".into());
    }
    let mut cache = single_cache(run, enabled.clone(), Admit::Never, false);
    let Cache::Single { held, used, .. } = &mut cache else {
        unreachable!()
    };
    let global = run.schedule.global_order(0);
    let mut stored: Vec<Vec<u32>> = vec![Vec::new(); workers];
    let mut lists: HashMap<(usize, usize), Vec<u32>> = HashMap::new();
    for (w, shard) in stored.iter_mut().enumerate() {
        let n = w / sc.workers_per_node as usize;
        let (lo, hi) = (w * f / workers, (w + 1) * f / workers);
        let mut mine = vec![0u64; m.classes.len()];
        for &k in &global[lo..hi] {
            let s = run.sizes[k as usize];
            let room = enabled
                .iter()
                .copied()
                .find(|&j| mine[j] + s <= m.classes[j].capacity / sc.workers_per_node as u64);
            if let Some(j) = room {
                mine[j] += s;
                used[n][j] += s;
                held[k as usize].set(n as u32, j as u8);
                shard.push(k);
                lists.entry((n, j)).or_default().push(k);
            }
        }
    }
    let len = stored.iter().map(|s| s.len()).min().unwrap_or(0);
    if len == 0 {
        return Err("no worker can store any sample of its shard".into());
    }
    let mut keys: Vec<(usize, usize)> = lists.keys().copied().collect();
    keys.sort_unstable();
    let fills = keys
        .into_iter()
        .map(|key| FillList {
            node: key.0 as u32,
            class: key.1,
            order: lists.remove(&key).unwrap_or_default(),
            need: Vec::new(),
            cursor: 0,
        })
        .collect();
    Ok(CacheSetup {
        cache,
        order: Order::Shards { stored, len },
        fills,
        full_randomization: workers == 1 && len == f,
    })
}

/// The engine's placement: per node from its ranks' access counts, or (several nodes with an
/// interconnect) one placement for the whole cluster; `fills` gets each node's fill lists.
fn clairvoyant_cache(run: &Run, threads: usize, fills: &mut Vec<FillList>) -> Result<Cache> {
    let sc = run.scenario;
    let m = &sc.system;
    let (f, nodes, workers) = (run.sizes.len(), sc.nodes() as usize, sc.workers as usize);
    let wpn = sc.workers_per_node as usize;
    let groups: Vec<Vec<u32>> = (0..nodes)
        .map(|n| ((n * wpn) as u32..((n + 1) * wpn) as u32).collect())
        .collect();
    let total_bytes: u64 = run.sizes.iter().sum();
    let mean = (total_bytes / f.max(1) as u64).max(1);
    let useful = m.useful_classes(mean, (workers * threads) as u32);
    let caps: Vec<u64> = (0..m.classes.len())
        .map(|j| if useful.contains(&j) { m.classes[j].capacity } else { 0 })
        .collect();
    let counts = AccessCounts::compute_groups(&run.schedule, &groups)?;
    let mut local = Vec::with_capacity(nodes);
    let mut first = huge_vec(
        f,
        Copy {
            avail: f64::INFINITY,
            node: NONE,
            class: UNCACHED,
        },
    );
    if nodes > 1 && m.interconnect_mbps.is_some() {
        // Peers: one placement for the whole cluster (coverage, then replicas).
        let plan =
            crate::cluster::cluster_placement(&run.schedule, &groups, &counts, |k| run.sizes[k as usize], &caps)?;
        check_cancel(run.progress)?;
        for (k, (c, &h)) in first.iter_mut().zip(&plan.home).enumerate() {
            if h != NONE {
                c.node = h;
                c.class = plan.class_of[h as usize][k];
            }
        }
        for (n, ((acc, lists), classes)) in counts.into_iter().zip(plan.fill_order).zip(plan.class_of).enumerate() {
            local.push(node_slots(n as u32, acc, lists, classes, f, fills));
        }
    } else {
        // Each node on its own: the engine's one-node placement.
        for (n, acc) in counts.into_iter().enumerate() {
            check_cancel(run.progress)?;
            let p = Placement::compute(&acc, |k| run.sizes[k as usize], &caps);
            local.push(node_slots(n as u32, acc, p.fill_order, p.class_of, f, fills));
        }
    }
    Ok(Cache::Placed { local, first })
}

/// The thread slots of each fill list, after the `first` slots of the staging threads; and the
/// number of slots in all.
pub(super) fn fill_slots(sc: &Scenario, fills: &[FillList], first: usize) -> (Vec<std::ops::Range<usize>>, usize) {
    let mut slots = Vec::with_capacity(fills.len());
    let mut next = first;
    for fl in fills {
        let p = sc.system.classes[fl.class].threads.max(1) as usize;
        slots.push(next..next + p);
        next += p;
    }
    (slots, next)
}

/// Iterations per epoch: a worker's batches, or (shards) its shard's.
pub(super) fn iters_per_epoch(run: &Run, order: &Order) -> usize {
    let sc = run.scenario;
    match order {
        Order::Shards { len, .. } => {
            let b = sc.batch_size as usize;
            if sc.drop_last && *len >= b {
                len / b
            } else {
                len.div_ceil(b)
            }
        }
        _ => run.layout().batches_per_rank() as usize,
    }
}

/// One node's placement in the simulation: its classes' fill lists (in first-need order, with
/// each sample's first need) appended to `fills`, and its `f` slots, each in its class.
fn node_slots(
    node: u32,
    acc: AccessCounts,
    fill_order: Vec<Vec<u32>>,
    class_of: Vec<u8>,
    f: usize,
    fills: &mut Vec<FillList>,
) -> Vec<Slot> {
    for (j, list) in fill_order.into_iter().enumerate() {
        if !list.is_empty() {
            fills.push(FillList {
                node,
                class: j,
                need: list.iter().map(|&k| acc.first_need[k as usize]).collect(),
                order: list,
                cursor: 0,
            });
        }
    }
    drop(acc);
    let mut slots = huge_vec(
        f,
        Slot {
            avail: f64::INFINITY,
            class: UNCACHED,
        },
    );
    for (slot, class) in slots.iter_mut().zip(class_of) {
        slot.class = class;
    }
    slots
}
