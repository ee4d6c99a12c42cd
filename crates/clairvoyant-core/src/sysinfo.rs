//! Machine detection and the defaults of the performance model: what a [`SystemModel`] looks
//! like with no configuration at all, the environment variables that change it, and where a
//! configuration file is looked for ([`SystemModel::resolve`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::model::{parse_bytes, ClassKind, PfsSpec, StagingSpec, SystemModel};

/// The configuration registry: every `CLAIRVOYANT_*` environment variable any part of
/// clairvoyant reads (this crate, the interposed library, the Python package), with its type,
/// default and meaning. Nothing reads a variable that is not declared here; the Python package
/// reads them through this list (`clairvoyant._settings`), and `docs/configuration.md`'s table is
/// generated from it (a test checks both).
pub mod env {
    use std::path::PathBuf;

    /// What a variable's value is.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        /// A file or directory path.
        Path,
        /// A byte size: "512MiB", "8 GiB", "1.5GB" or a plain number of bytes.
        Bytes,
        /// A whole number.
        Integer,
        /// A number of seconds (fractions allowed).
        Seconds,
        /// A number of milliseconds.
        Milliseconds,
        /// On or off: 1/true/yes/on or 0/false/no/off.
        Flag,
        /// One of the listed words.
        Choice(&'static [&'static str]),
        /// Free text.
        Text,
    }

    impl Kind {
        /// The kind's name as the registry's readers spell it ("choice" for a [`Kind::Choice`]).
        pub fn name(&self) -> &'static str {
            match self {
                Kind::Path => "path",
                Kind::Bytes => "bytes",
                Kind::Integer => "integer",
                Kind::Seconds => "seconds",
                Kind::Milliseconds => "milliseconds",
                Kind::Flag => "flag",
                Kind::Choice(_) => "choice",
                Kind::Text => "text",
            }
        }

        /// The words a [`Kind::Choice`] accepts; empty for the others.
        pub fn choices(&self) -> &'static [&'static str] {
            match self {
                Kind::Choice(c) => c,
                _ => &[],
            }
        }
    }

    /// Who sets a variable.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum SetBy {
        /// The user (or the launch script).
        User,
        /// clairvoyant itself, for the processes it starts (`clairvoyant run`, node emulation);
        /// documented because a user may see it in a program's environment.
        Clairvoyant,
    }

    /// An environment variable: name, type, what happens when it is unset, what it does and
    /// who sets it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Var {
        /// The variable's name (`CLAIRVOYANT_...`).
        pub name: &'static str,
        /// What its value is.
        pub kind: Kind,
        /// What happens when it is unset (its default, in words).
        pub default: &'static str,
        /// What it does, for the settings reference.
        pub doc: &'static str,
        /// Who sets it: the user, or clairvoyant for the processes it starts.
        pub set_by: SetBy,
    }

    const fn user(name: &'static str, kind: Kind, default: &'static str, doc: &'static str) -> Var {
        Var {
            name,
            kind,
            default,
            doc,
            set_by: SetBy::User,
        }
    }

    const fn internal(name: &'static str, kind: Kind, default: &'static str, doc: &'static str) -> Var {
        Var {
            name,
            kind,
            default,
            doc,
            set_by: SetBy::Clairvoyant,
        }
    }

    /// Path of the system model TOML file.
    pub const CONFIG: Var = user(
        "CLAIRVOYANT_CONFIG",
        Kind::Path,
        "<CLAIRVOYANT_CACHE_DIR>/system.toml when that file exists, else detected from the machine",
        "Path of the system model (TOML) to use when none is passed explicitly.",
    );

    /// Directory for clairvoyant's own files (dataset indices, `system.toml`).
    pub const CACHE_DIR: Var = user(
        "CLAIRVOYANT_CACHE_DIR",
        Kind::Path,
        "$XDG_CACHE_HOME/clairvoyant, else $HOME/.cache/clairvoyant, else <temp dir>/clairvoyant",
        "Directory for clairvoyant's own small files: dataset indices and system.toml. An index no job \
         used for 30 days is removed when a scan writes another. Created 0700; \
         it must be yours and writable by nobody else (in a world-writable sticky folder such as /tmp, \
         its private subfolder clairvoyant-<uid> is used).",
    );

    /// Directory of the node-local SSD class.
    pub const SSD_DIR: Var = user(
        "CLAIRVOYANT_SSD_DIR",
        Kind::Path,
        "unset: the detected \"ssd\" class is disabled (capacity 0)",
        "Directory on a node-local disk for the \"ssd\" storage class; the detected class then gets \
         50% of that file system's free space. Unset, nothing is written to local disks.",
    );

    /// Capacity override of the memory class.
    pub const MEMORY: Var = user(
        "CLAIRVOYANT_MEMORY",
        Kind::Bytes,
        "unset: 40% of MemAvailable (detected) or the configured value",
        "Capacity of the memory storage class, e.g. \"4GiB\"; \"0\" disables it. Overrides the file.",
    );

    /// Capacity override of the staging buffer.
    pub const STAGING: Var = user(
        "CLAIRVOYANT_STAGING",
        Kind::Bytes,
        "unset: 256 MiB (less on small machines) or the configured value",
        "Capacity of the staging buffer, e.g. \"512MiB\". Overrides the file.",
    );

    /// Directory for node-shared memory (the node cache's state, memory class, staging rings).
    pub const SHM_DIR: Var = user(
        "CLAIRVOYANT_SHM_DIR",
        Kind::Path,
        "/dev/shm, else the temp dir",
        "Directory (normally a tmpfs) holding the per-user directory of node-shared segments.",
    );

    /// The run shared by the local ranks of one job.
    pub const RUN_ID: Var = user(
        "CLAIRVOYANT_RUN_ID",
        Kind::Text,
        "the launcher's run id (TORCHELASTIC_RUN_ID, ...), else the parent process",
        "Names the run the local ranks of one job share (their node cache and rendezvous).",
    );

    /// Number of epochs the drop-in plans for.
    pub const EPOCHS: Var = user(
        "CLAIRVOYANT_EPOCHS",
        Kind::Integer,
        "3 for the predicted sampler order of `clairvoyant run --sampler-order`; the drop-in plans \
         as far as its sampler can be predicted",
        "Epochs of the run, so the cache is planned over the whole run (as Job(epochs=...)).",
    );

    /// Silences notices.
    pub const QUIET: Var = user(
        "CLAIRVOYANT_QUIET",
        Kind::Flag,
        "unset: notices are printed",
        "Set to silence clairvoyant's notices and statistics lines (errors are still raised).",
    );

    /// How cached copies are verified.
    pub const VERIFY: Var = user(
        "CLAIRVOYANT_VERIFY",
        Kind::Choice(&["open", "process"]),
        "open: a cached copy's checksum is verified at every open",
        "Transparent mode: \"process\" verifies each cached copy once per process (faster; later \
         damage of the copy is not detected, see docs/transparent.md).",
    );

    /// Whether the drop-in decodes natively.
    pub const NATIVE_DECODE: Var = user(
        "CLAIRVOYANT_NATIVE_DECODE",
        Kind::Flag,
        "on where the dataset and transforms allow it",
        "\"0\" makes the drop-in run torch's own decode and transforms (torch's exact batches).",
    );

    /// Whether the drop-in's persistent workers decode the next epoch's first batches ahead.
    pub const DECODE_AHEAD: Var = user(
        "CLAIRVOYANT_DECODE_AHEAD",
        Kind::Flag,
        "on with persistent workers, when the next epoch is predicted",
        "\"0\": the drop-in's idle persistent workers do not decode the next epoch's first batches \
         before it begins (see docs/architecture.md, \"Decode ahead\").",
    );

    /// Stand-in opens of transparent mode.
    pub const STANDIN: Var = user(
        "CLAIRVOYANT_STANDIN",
        Kind::Choice(&["auto", "1", "0"]),
        "auto: when the dataset root is not on a local file system",
        "Transparent mode's stand-in opens: 1 always, 0 never, auto (see docs/transparent.md).",
    );

    /// Rendezvous backend.
    pub const RENDEZVOUS: Var = user(
        "CLAIRVOYANT_RENDEZVOUS",
        Kind::Choice(&["store", "mpi", "file"]),
        "the first backend that applies (torch store, MPI, shared directory)",
        "The backend the nodes meet through (docs/cluster.md).",
    );

    /// How long nodes wait for each other.
    pub const RENDEZVOUS_TIMEOUT: Var = user(
        "CLAIRVOYANT_RENDEZVOUS_TIMEOUT",
        Kind::Seconds,
        "120",
        "Seconds the nodes (and the local ranks of a node) wait for each other at start.",
    );

    /// A directory every node sees.
    pub const SHARED_DIR: Var = user(
        "CLAIRVOYANT_SHARED_DIR",
        Kind::Path,
        "~/.cache/clairvoyant/rendezvous under Slurm, else none",
        "A directory every node sees, for the file rendezvous and the job secret; it must be yours \
         with mode 0700 (created so if missing).",
    );

    /// The job secret.
    pub const SECRET: Var = user(
        "CLAIRVOYANT_SECRET",
        Kind::Text,
        "derived at rendezvous (a shared directory or the launcher's store)",
        "The job secret, the same on every rank: any string of 16 characters or more.",
    );

    /// Rank 0 hosts a torch store.
    pub const STORE_MASTER: Var = user(
        "CLAIRVOYANT_STORE_MASTER",
        Kind::Flag,
        "off",
        "With MASTER_ADDR/MASTER_PORT and no store there yet, rank 0 hosts a torch TCPStore there.",
    );

    /// The peer server's address.
    pub const LISTEN: Var = user(
        "CLAIRVOYANT_LISTEN",
        Kind::Text,
        "the local address the kernel uses to reach MASTER_ADDR, else 127.0.0.1",
        "The address (or interface name, e.g. ib0) this node's peer server listens on.",
    );

    /// The peer server's port.
    pub const PORT: Var = user(
        "CLAIRVOYANT_PORT",
        Kind::Integer,
        "0: a port the system picks, announced at rendezvous",
        "The port of this node's peer server.",
    );

    /// Cooperation between nodes.
    pub const PEERS: Var = user(
        "CLAIRVOYANT_PEERS",
        Kind::Text,
        "on when there are several nodes",
        "off keeps every node on its own; on asks for cooperation; a comma-separated host:port list \
         names every node's server explicitly (docs/cluster.md).",
    );

    /// This process's node.
    pub const NODE_ID: Var = user(
        "CLAIRVOYANT_NODE_ID",
        Kind::Text,
        "host name, boot id and the device of /dev/shm",
        "Which node this process is on (processes with the same id share a node cache).",
    );

    /// Number of nodes of a transparent-mode run.
    pub const NODES: Var = user(
        "CLAIRVOYANT_NODES",
        Kind::Integer,
        "Slurm's node count, else 1",
        "Nodes of a `clairvoyant run` job (as --nodes).",
    );

    /// This node's index.
    pub const NODE_RANK: Var = user(
        "CLAIRVOYANT_NODE_RANK",
        Kind::Integer,
        "Slurm's SLURM_NODEID or torchrun's GROUP_RANK, else 0",
        "This node's index among the nodes (as --node-rank).",
    );

    /// How long a node agent waits for the other nodes' agents after its programs end.
    pub const AGENT_LINGER: Var = user(
        "CLAIRVOYANT_AGENT_LINGER",
        Kind::Seconds,
        "300",
        "`clairvoyant run`, several nodes: the longest an agent whose launchers are done keeps \
         serving agents of other nodes that are still running; an agent that is gone is not waited \
         for (docs/transparent.md, \"Life cycle\").",
    );

    /// Where node agents' logs are kept.
    pub const AGENT_LOG: Var = user(
        "CLAIRVOYANT_AGENT_LOG",
        Kind::Path,
        "unset: each agent's log is in its own folder, which goes when the agent exits normally",
        "`clairvoyant run`: a folder (created 0700) where each agent's log is written and kept, as \
         <agent folder>.<launcher pid>.log.",
    );

    /// Limit of one round trip to the node agent.
    pub const AGENT_TIMEOUT_MS: Var = user(
        "CLAIRVOYANT_AGENT_TIMEOUT_MS",
        Kind::Milliseconds,
        "10000",
        "Transparent mode: limit of one round trip to the node agent; past it the file is read directly \
         and the agent is asked again after 1 s, then ever more seldom (up to 30 s), first with a \
         short probe.",
    );

    /// The dataset root of transparent mode.
    pub const ROOT: Var = internal(
        "CLAIRVOYANT_ROOT",
        Kind::Path,
        "set by clairvoyant run",
        "Transparent mode: the dataset root whose files the interposed library serves.",
    );

    /// The node agent's socket.
    pub const AGENT: Var = internal(
        "CLAIRVOYANT_AGENT",
        Kind::Path,
        "set by clairvoyant run",
        "Transparent mode: the node agent's Unix socket.",
    );

    /// The program's sampler order is sent to the agent.
    pub const SAMPLER_ORDER: Var = internal(
        "CLAIRVOYANT_SAMPLER_ORDER",
        Kind::Flag,
        "set by clairvoyant run --sampler-order",
        "Transparent mode: the program's DataLoader sends its predicted order to the node agent.",
    );

    /// The FUSE emulation binary of the benchmarks.
    pub const FSEMU: Var = internal(
        "CLAIRVOYANT_FSEMU",
        Kind::Path,
        "target/release/clairvoyant-fsemu of the checkout",
        "The benchmarks' emulated shared file system (clairvoyant-fsemu) to mount.",
    );

    /// Every variable, in the order the documentation lists them.
    pub const ALL: [Var; 31] = [
        CONFIG,
        CACHE_DIR,
        SSD_DIR,
        MEMORY,
        STAGING,
        SHM_DIR,
        RUN_ID,
        EPOCHS,
        QUIET,
        VERIFY,
        NATIVE_DECODE,
        DECODE_AHEAD,
        STANDIN,
        RENDEZVOUS,
        RENDEZVOUS_TIMEOUT,
        SHARED_DIR,
        SECRET,
        STORE_MASTER,
        LISTEN,
        PORT,
        PEERS,
        NODE_ID,
        NODES,
        NODE_RANK,
        AGENT_LINGER,
        AGENT_LOG,
        AGENT_TIMEOUT_MS,
        ROOT,
        AGENT,
        SAMPLER_ORDER,
        FSEMU,
    ];

    /// Whether the flag `var` is on: set to anything but "", 0, false, no or off.
    pub fn flag(var: Var) -> bool {
        get(var).is_some_and(|v| !matches!(v.trim().to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off"))
    }

    /// The value of `var`; None when unset or empty.
    pub fn get(var: Var) -> Option<String> {
        std::env::var(var.name).ok().filter(|s| !s.trim().is_empty())
    }

    /// The cache directory (see [`CACHE_DIR`]); not created.
    pub fn cache_dir() -> PathBuf {
        user_cache_dir().unwrap_or_else(|| std::env::temp_dir().join("clairvoyant"))
    }

    /// `$CLAIRVOYANT_CACHE_DIR`, else `$XDG_CACHE_HOME/clairvoyant`, else
    /// `$HOME/.cache/clairvoyant`; None when none of them is set. The one derivation of the
    /// cache directory (indexes use it too).
    pub fn user_cache_dir() -> Option<PathBuf> {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        var(CACHE_DIR.name)
            .or_else(|| var("XDG_CACHE_HOME").map(|x| x.join("clairvoyant")))
            .or_else(|| var("HOME").map(|h| h.join(".cache").join("clairvoyant")))
    }
}

/// Typical numbers used when nothing is measured or configured.
pub mod defaults {
    use std::path::PathBuf;

    use crate::model::{ClassKind, ClassSpec, Curve};

    /// One mebibyte, in bytes.
    pub const MIB: u64 = 1 << 20;
    /// Staging buffer capacity on machines with enough memory.
    pub const STAGING_CAPACITY: u64 = 256 * MIB;
    /// Smallest detected staging buffer.
    pub const STAGING_MIN: u64 = 16 * MIB;
    /// Share of MemAvailable given to the memory class.
    pub const MEMORY_SHARE: f64 = 0.40;
    /// Memory class plus staging buffer stay below this share of MemAvailable.
    pub const MEMORY_TOTAL_SHARE: f64 = 0.50;
    /// Share of a file system's free space given to a directory class.
    pub const DISK_SHARE: f64 = 0.50;
    /// Prefetch threads of the memory class.
    pub const MEMORY_THREADS: u32 = 2;
    /// Prefetch threads of a directory class.
    pub const DISK_THREADS: u32 = 4;
    /// Conservative shared file system: 200 MB/s per reader, 2,000 MB/s aggregate, 1 ms per open.
    pub const PFS_PER_READER_MBPS: f64 = 200.0;
    /// Concurrent readers at which the conservative shared file system reaches its aggregate.
    pub const PFS_MAX_READERS: u32 = 10;
    /// Seconds per file open on the conservative shared file system.
    pub const PFS_OPEN_LATENCY_S: f64 = 1e-3;

    /// DRAM reads (memory copies): 5,000 MB/s per thread up to 4 threads.
    pub fn dram_read() -> Curve {
        Curve::linear_up_to(5000.0, 4)
    }

    /// DRAM writes: 4,000 MB/s per thread up to 4 threads.
    pub fn dram_write() -> Curve {
        Curve::linear_up_to(4000.0, 4)
    }

    /// A SATA/NVMe-class SSD, random reads: 400 MB/s per thread, 2,400 MB/s at 8 threads.
    pub fn ssd_read() -> Curve {
        Curve(vec![(1.0, 400.0), (4.0, 1500.0), (8.0, 2400.0)])
    }

    /// SSD writes (with fsync): 250 MB/s per thread, 1,200 MB/s at 8 threads.
    pub fn ssd_write() -> Curve {
        Curve(vec![(1.0, 250.0), (4.0, 900.0), (8.0, 1200.0)])
    }

    /// t(γ) of a conservative network file system.
    pub fn pfs_read() -> Curve {
        Curve::linear_up_to(PFS_PER_READER_MBPS, PFS_MAX_READERS)
    }

    /// A memory class named "memory" of `capacity` bytes with DRAM curves.
    pub fn memory_class(capacity: u64) -> ClassSpec {
        ClassSpec {
            name: "memory".into(),
            kind: ClassKind::Memory,
            capacity,
            threads: MEMORY_THREADS,
            read_mbps: dram_read(),
            write_mbps: dram_write(),
        }
    }

    /// A directory class with SSD curves; `capacity` None means [`DISK_SHARE`] of the free space
    /// of the file system holding `path` (0 when that cannot be found out).
    pub fn directory_class(name: &str, path: PathBuf, capacity: Option<u64>) -> ClassSpec {
        let capacity = capacity.unwrap_or_else(|| {
            super::free_space(&path)
                .map(|f| (f as f64 * DISK_SHARE) as u64)
                .unwrap_or(0)
        });
        ClassSpec {
            name: name.into(),
            kind: ClassKind::Directory { path },
            capacity: round_mib(capacity),
            threads: DISK_THREADS,
            read_mbps: ssd_read(),
            write_mbps: ssd_write(),
        }
    }

    /// Round down to whole MiB (keeps saved files readable); below 1 MiB unchanged.
    pub fn round_mib(bytes: u64) -> u64 {
        if bytes >= MIB {
            bytes / MIB * MIB
        } else {
            bytes
        }
    }
}

/// What [`SystemModel::detect`] looks at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    /// MemTotal of /proc/meminfo, bytes.
    pub mem_total: Option<u64>,
    /// MemAvailable of /proc/meminfo, bytes.
    pub mem_available: Option<u64>,
    /// `std::thread::available_parallelism` (1 when unknown).
    pub cpus: usize,
}

impl Machine {
    /// Reads this machine's memory figures (/proc/meminfo) and CPU count; unknown figures are
    /// None.
    pub fn detect() -> Self {
        let (mem_total, mem_available) = std::fs::read_to_string("/proc/meminfo")
            .map(|t| parse_meminfo(&t))
            .unwrap_or((None, None));
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Machine {
            mem_total,
            mem_available,
            cpus,
        }
    }
}

/// (MemTotal, MemAvailable) in bytes from the text of /proc/meminfo.
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            let mut it = rest.split_whitespace();
            let n: u64 = it.next()?.parse().ok()?;
            let mult = match it.next() {
                Some("kB") | Some("KB") | Some("kb") => 1024,
                None => 1,
                _ => return None,
            };
            n.checked_mul(mult)
        })
    };
    (field("MemTotal"), field("MemAvailable"))
}

/// Free bytes for unprivileged users (statvfs f_bavail × f_frsize) on the file system holding
/// `path`, or its nearest existing ancestor when `path` does not exist yet.
pub fn free_space(path: &Path) -> Result<u64> {
    let mut p = path;
    while !p.exists() {
        match p.parent() {
            Some(q) if !q.as_os_str().is_empty() => p = q,
            _ => {
                p = Path::new(".");
                break;
            }
        }
    }
    statvfs_free(p)
}

#[cfg(unix)]
fn statvfs_free(p: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        Error::io(
            p,
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains NUL"),
        )
    })?;
    // SAFETY: `st` is plain old data written by statvfs; `c` is a valid NUL-terminated string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated C string alive for the call; `st` is a live, writable `statvfs`.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(Error::io(p, std::io::Error::last_os_error()));
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

#[cfg(not(unix))]
fn statvfs_free(p: &Path) -> Result<u64> {
    Err(Error::io(
        p,
        std::io::Error::new(std::io::ErrorKind::Unsupported, "free space unknown on this platform"),
    ))
}

impl SystemModel {
    /// Sane defaults from this machine, without any configuration file:
    ///
    /// - staging buffer: 256 MiB (1/16 of MemAvailable when that is less, at least 16 MiB), with
    ///   one prefetch thread per core, clamped to 2..=8;
    /// - a "memory" class with 40% of MemAvailable, capped so that it and the staging buffer stay
    ///   under 50% of MemAvailable; 2 threads; DRAM curves (5,000 MB/s per thread up to 4);
    ///   disabled when /proc/meminfo cannot be read;
    /// - a "ssd" directory class at `$CLAIRVOYANT_SSD_DIR` with 50% of that file system's free
    ///   space. Without the variable the class is disabled (capacity 0, path
    ///   `<cache dir>/ssd`): writing gigabytes to a user's disk unasked is not a sane default;
    /// - the PFS as a conservative network file system: 200 MB/s per reader up to 2,000 MB/s
    ///   aggregate, 1 ms per open (run [`crate::probe::probe`] to measure it);
    /// - no interconnect, compute or preprocessing rates.
    ///
    /// Capacity overrides (`CLAIRVOYANT_MEMORY`, `CLAIRVOYANT_STAGING`) are applied by
    /// [`SystemModel::resolve`], not here.
    pub fn detect() -> SystemModel {
        let ssd = env::get(env::SSD_DIR).map(PathBuf::from);
        Self::detect_on(&Machine::detect(), ssd)
    }

    /// [`SystemModel::detect`] for a given machine and SSD directory.
    pub fn detect_on(m: &Machine, ssd_dir: Option<PathBuf>) -> SystemModel {
        use defaults::*;
        let staging_cap = match m.mem_available {
            Some(avail) => round_mib((avail / 16).clamp(STAGING_MIN, STAGING_CAPACITY)),
            None => STAGING_CAPACITY,
        };
        let threads = m.cpus.clamp(2, 8) as u32;
        let memory_cap = match m.mem_available {
            Some(avail) => {
                let share = (avail as f64 * MEMORY_SHARE) as u64;
                let cap = ((avail as f64 * MEMORY_TOTAL_SHARE) as u64).saturating_sub(staging_cap);
                round_mib(share.min(cap))
            }
            None => 0,
        };
        let ssd = match ssd_dir {
            Some(dir) => directory_class("ssd", dir, None),
            None => directory_class("ssd", env::cache_dir().join("ssd"), Some(0)),
        };
        SystemModel {
            staging: StagingSpec {
                capacity: staging_cap,
                threads,
                write_mbps: dram_write(),
            },
            pfs: PfsSpec {
                read_mbps: pfs_read(),
                open_latency_s: PFS_OPEN_LATENCY_S,
            },
            classes: vec![memory_class(memory_cap), ssd],
            interconnect_mbps: None,
            compute_mbps: None,
            preprocess_mbps: None,
        }
    }

    /// Apply `CLAIRVOYANT_MEMORY` and `CLAIRVOYANT_STAGING` (see [`env`](mod@env)).
    pub fn apply_env_overrides(&mut self) -> Result<()> {
        self.apply_overrides(env::get(env::MEMORY).as_deref(), env::get(env::STAGING).as_deref())
    }

    /// Apply capacity overrides given as strings ("4GiB"); errors are keyed by the variable name.
    /// A memory override on a model without a memory class adds one with default curves.
    pub fn apply_overrides(&mut self, memory: Option<&str>, staging: Option<&str>) -> Result<()> {
        if let Some(s) = staging {
            self.staging.capacity = parse_bytes(s).map_err(|r| Error::config(env::STAGING.name, r))?;
        }
        if let Some(s) = memory {
            let cap = parse_bytes(s).map_err(|r| Error::config(env::MEMORY.name, r))?;
            match self.classes.iter_mut().find(|c| c.kind == ClassKind::Memory) {
                Some(c) => c.capacity = cap,
                None if cap > 0 => self.classes.insert(0, defaults::memory_class(cap)),
                None => {}
            }
        }
        Ok(())
    }

    /// The system model to use and the file it came from: `explicit`, else `$CLAIRVOYANT_CONFIG`,
    /// else `<cache dir>/system.toml` when present, else [`SystemModel::detect`] (path None).
    /// Environment overrides are applied, then the result is validated.
    pub fn resolve(explicit: Option<&Path>) -> Result<(SystemModel, Option<PathBuf>)> {
        let (mut m, path) = if let Some(p) = explicit {
            (SystemModel::load(p)?, Some(p.to_path_buf()))
        } else if let Some(p) = env::get(env::CONFIG) {
            let p = PathBuf::from(p);
            let m = SystemModel::load(&p).map_err(|e| match e {
                Error::Io { path, source } => Error::config(
                    env::CONFIG.name,
                    format!("cannot read {}: {source} (set by the environment)", path.display()),
                ),
                other => other,
            })?;
            (m, Some(p))
        } else {
            // Only from a folder and a file no other user can write (see `trusted_dir`).
            let dir = env::cache_dir();
            let dir = crate::tier::secure::trusted_dir(&dir, false)?;
            let p = dir.map(|d| d.join("system.toml"));
            match p
                .as_deref()
                .map(crate::tier::secure::read_trusted)
                .transpose()?
                .flatten()
            {
                Some(bytes) => {
                    let p = p.expect("read from a path");
                    let text = String::from_utf8(bytes)
                        .map_err(|_| Error::config("system.toml", format!("{} is not UTF-8 text", p.display())))?;
                    (SystemModel::from_toml_str(&text, &p)?, Some(p))
                }
                None => (SystemModel::detect(), None),
            }
        };
        m.apply_env_overrides()?;
        m.validate()?;
        Ok((m, path))
    }
}

#[cfg(test)]
pub(crate) static ENV_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Curve;

    /// Sets environment variables for the life of the guard (restoring them after), holding the
    /// lock that serialises every test touching the environment.
    struct EnvGuard {
        saved: Vec<(&'static str, Option<std::ffi::OsString>)>,
        _lock: std::sync::MutexGuard<'static, ()>,
    }

    impl EnvGuard {
        fn set(vars: &[(&'static str, Option<&str>)]) -> Self {
            let lock = ENV_LOCK.lock().unwrap_or_else(|p| p.into_inner());
            let mut saved = Vec::new();
            for &(k, v) in vars {
                saved.push((k, std::env::var_os(k)));
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
            EnvGuard { saved, _lock: lock }
        }
    }

    impl Drop for EnvGuard {
        fn drop(&mut self) {
            for (k, v) in self.saved.drain(..).rev() {
                match v {
                    Some(v) => std::env::set_var(k, v),
                    None => std::env::remove_var(k),
                }
            }
        }
    }

    fn all_unset<'a>(extra: &[(&'static str, Option<&'a str>)]) -> Vec<(&'static str, Option<&'a str>)> {
        let mut v: Vec<_> = env::ALL.iter().map(|var| (var.name, None)).collect();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn env_vars_are_declared_once() {
        let names: Vec<_> = env::ALL.iter().map(|v| v.name).collect();
        for n in &names {
            assert_eq!(names.iter().filter(|&x| x == n).count(), 1, "{n}");
            assert!(n.starts_with("CLAIRVOYANT_"), "{n}");
        }
        assert!(env::ALL.iter().all(|v| !v.doc.is_empty() && !v.default.is_empty()));
        assert!(env::ALL
            .iter()
            .all(|v| matches!(v.kind, env::Kind::Choice(c) if !c.is_empty()) || v.kind.choices().is_empty()));
    }

    #[test]
    fn a_flag_is_off_only_when_unset_or_said_so() {
        for (value, on) in [
            (None, false),
            (Some(""), false),
            (Some("0"), false),
            (Some("off"), false),
            (Some("No"), false),
            (Some("1"), true),
            (Some("yes"), true),
        ] {
            let _g = EnvGuard::set(&[("CLAIRVOYANT_QUIET", value)]);
            assert_eq!(env::flag(env::QUIET), on, "{value:?}");
        }
    }

    #[test]
    fn meminfo() {
        let t = "MemTotal:       16318412 kB\nMemFree:  1000 kB\nMemAvailable:   8000000 kB\n";
        assert_eq!(parse_meminfo(t), (Some(16318412 * 1024), Some(8000000 * 1024)));
        assert_eq!(parse_meminfo("garbage"), (None, None));
    }

    #[test]
    fn detect_validates() {
        let _g = EnvGuard::set(&all_unset(&[]));
        let m = SystemModel::detect();
        m.validate().unwrap();
        assert!(m.staging.capacity > 0 && m.staging.threads >= 2 && m.staging.threads <= 8);
        let ssd = &m.classes[m.class_index("ssd").unwrap()];
        assert_eq!(ssd.capacity, 0, "no SSD class without CLAIRVOYANT_SSD_DIR");
        // The detected model round-trips through TOML.
        let back = SystemModel::from_toml_str(&m.to_toml_string(), Path::new("detected.toml")).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn detect_on_small_and_unknown_machines() {
        for (avail, cpus) in [
            (Some(64u64 << 20), 1),
            (Some(512 << 20), 2),
            (Some(256 << 30), 128),
            (None, 4),
        ] {
            let m = SystemModel::detect_on(
                &Machine {
                    mem_total: avail,
                    mem_available: avail,
                    cpus,
                },
                None,
            );
            m.validate().unwrap();
            assert!((2..=8).contains(&m.staging.threads));
            if let Some(a) = avail {
                let mem = m.classes[m.memory_class().unwrap()].capacity;
                assert!(mem + m.staging.capacity <= a / 2 + defaults::STAGING_MIN, "{a} {mem}");
                assert!(mem as f64 <= a as f64 * defaults::MEMORY_SHARE);
            }
        }
        let m = SystemModel::detect_on(
            &Machine {
                mem_total: None,
                mem_available: Some(64 << 30),
                cpus: 8,
            },
            None,
        );
        assert_eq!(m.staging.capacity, defaults::STAGING_CAPACITY);
        assert_eq!(
            m.classes[0].capacity,
            ((64u64 << 30) as f64 * 0.4) as u64 / defaults::MIB * defaults::MIB
        );
    }

    #[test]
    fn ssd_dir_enables_the_ssd_class() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap().to_string();
        let _g = EnvGuard::set(&all_unset(&[("CLAIRVOYANT_SSD_DIR", Some(&d))]));
        let m = SystemModel::detect();
        let ssd = &m.classes[m.class_index("ssd").unwrap()];
        assert_eq!(
            ssd.kind,
            ClassKind::Directory {
                path: dir.path().to_path_buf()
            }
        );
        let free = free_space(dir.path()).unwrap();
        assert!(ssd.capacity > 0 || free < 2 * defaults::MIB);
        assert!(ssd.capacity <= free / 2 + 1);
    }

    #[test]
    fn env_overrides_are_applied() {
        let _g = EnvGuard::set(&all_unset(&[
            ("CLAIRVOYANT_CACHE_DIR", Some("/nonexistent/clairvoyant-cache")),
            ("CLAIRVOYANT_MEMORY", Some("3GiB")),
            ("CLAIRVOYANT_STAGING", Some("64 MiB")),
        ]));
        let (m, path) = SystemModel::resolve(None).unwrap();
        assert_eq!(path, None);
        assert_eq!(m.staging.capacity, 64 << 20);
        assert_eq!(m.classes[m.memory_class().unwrap()].capacity, 3 << 30);
    }

    #[test]
    fn bad_env_override_names_the_variable() {
        let _g = EnvGuard::set(&all_unset(&[
            ("CLAIRVOYANT_CACHE_DIR", Some("/nonexistent/clairvoyant-cache")),
            ("CLAIRVOYANT_STAGING", Some("lots")),
        ]));
        let e = SystemModel::resolve(None).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, .. } if key == "CLAIRVOYANT_STAGING"),
            "{e}"
        );
        drop(_g);
        let _g = EnvGuard::set(&all_unset(&[
            ("CLAIRVOYANT_CACHE_DIR", Some("/nonexistent/clairvoyant-cache")),
            ("CLAIRVOYANT_STAGING", Some("0")),
        ]));
        let e = SystemModel::resolve(None).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, .. } if key == "staging.capacity"),
            "{e}"
        );
    }

    #[test]
    fn resolve_order() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let cache_s = cache.to_str().unwrap().to_string();
        let mut cached = SystemModel::detect_on(
            &Machine {
                mem_total: None,
                mem_available: Some(8 << 30),
                cpus: 4,
            },
            None,
        );
        cached.pfs.read_mbps = Curve::constant(111.0);
        cached.save(cache.join("system.toml")).unwrap();
        let mut other = cached.clone();
        other.pfs.read_mbps = Curve::constant(222.0);
        let other_path = dir.path().join("other.toml");
        other.save(&other_path).unwrap();
        let explicit = dir.path().join("explicit.toml");
        let mut ex = cached.clone();
        ex.pfs.read_mbps = Curve::constant(333.0);
        ex.save(&explicit).unwrap();

        // The cache dir file.
        let g = EnvGuard::set(&all_unset(&[("CLAIRVOYANT_CACHE_DIR", Some(&cache_s))]));
        let (m, p) = SystemModel::resolve(None).unwrap();
        assert_eq!((m.pfs.read_mbps.at(1.0), p), (111.0, Some(cache.join("system.toml"))));
        drop(g);
        // CLAIRVOYANT_CONFIG wins over the cache dir, and the memory override applies on top.
        let g = EnvGuard::set(&all_unset(&[
            ("CLAIRVOYANT_CACHE_DIR", Some(&cache_s)),
            ("CLAIRVOYANT_CONFIG", Some(other_path.to_str().unwrap())),
            ("CLAIRVOYANT_MEMORY", Some("0")),
        ]));
        let (m, p) = SystemModel::resolve(None).unwrap();
        assert_eq!((m.pfs.read_mbps.at(1.0), p), (222.0, Some(other_path.clone())));
        assert_eq!(m.classes[m.memory_class().unwrap()].capacity, 0);
        // An explicit path wins over both.
        let (m, p) = SystemModel::resolve(Some(&explicit)).unwrap();
        assert_eq!((m.pfs.read_mbps.at(1.0), p), (333.0, Some(explicit.clone())));
        drop(g);
        // A missing CLAIRVOYANT_CONFIG file is named with the variable.
        let _g = EnvGuard::set(&all_unset(&[("CLAIRVOYANT_CONFIG", Some("/nonexistent/x.toml"))]));
        let e = SystemModel::resolve(None).unwrap_err();
        assert!(
            matches!(&e, Error::Config { key, reason } if key == "CLAIRVOYANT_CONFIG" && reason.contains("/nonexistent/x.toml")),
            "{e}"
        );
    }

    #[test]
    fn free_space_of_missing_path_uses_ancestor() {
        let dir = tempfile::tempdir().unwrap();
        let a = free_space(dir.path()).unwrap();
        let b = free_space(&dir.path().join("not/yet/there")).unwrap();
        // Same file system; free space may move a little between the calls.
        assert!(a.abs_diff(b) < (256 << 20), "{a} {b}");
    }
}
