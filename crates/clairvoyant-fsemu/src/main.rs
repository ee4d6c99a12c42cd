//! `clairvoyant-fsemu BACKING MOUNTPOINT`: mounts BACKING read-only at MOUNTPOINT as an emulated
//! shared file system (per-open latency, aggregate bandwidth t(γ) shared by concurrent readers,
//! direct I/O so that nothing is served from the page cache, per-file read counters).
//!
//! Prints `mounted MOUNTPOINT` once the file system answers. SIGTERM or SIGINT unmounts and exits
//! 0; SIGUSR1 writes the counters to `--stats-out` (also written at exit). The counters can be
//! read at any time as JSON from `MOUNTPOINT/.fsemu-stats`.
//!
//! As root the kernel is asked to mount directly; other users need `fusermount3` (package
//! `fuse3`) and `user_allow_other` in /etc/fuse.conf for other users to read the mount.

#![warn(missing_docs)]

mod bandwidth;
mod fs;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};

use bandwidth::Curve;
use fs::{EmuFs, Shared, Spec};

/// An emulated shared file system mounted through FUSE, for benchmarks and tests.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Directory whose contents are exposed (read-only).
    backing: PathBuf,
    /// Empty directory to mount on.
    mountpoint: PathBuf,
    /// Latency of each file open, milliseconds; concurrent opens overlap.
    #[arg(long, default_value_t = 2.0)]
    open_latency_ms: f64,
    /// Aggregate bandwidth t(γ) as readers:MB/s pairs (interpolated, flat beyond the ends), or
    /// one number for a constant bandwidth.
    #[arg(long, default_value = "1:60,2:100,4:160,8:200")]
    bandwidth: String,
    /// Threads serving requests: the most opens and reads that can be in progress at once.
    #[arg(long, default_value_t = 256)]
    threads: usize,
    /// Open files through the page cache instead of with direct I/O, so that readers can
    /// memory-map them (each page fault is then a read here, paying the emulated bandwidth).
    /// The cache is dropped at each open; drop it between runs (`echo 3 >
    /// /proc/sys/vm/drop_caches`) for cold reads.
    #[arg(long)]
    mmap_files: bool,
    /// Where SIGUSR1 and exit write the counters (JSON).
    #[arg(long)]
    stats_out: Option<PathBuf>,
}

fn write_stats(fs: &EmuFs, path: &Path) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, fs.stats_json()).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

/// CPU time of this process so far, in clock ticks (Linux; None elsewhere).
fn cpu_ticks() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// Waits until this process runs at least `n` threads and has finished setting them up (its CPU
/// time stops growing), at most `limit`: requests that arrive while serving threads are still
/// being created would see a slower file system than the one configured.
fn wait_until_serving(n: usize, limit: Duration) {
    let t = std::time::Instant::now();
    let mut last = None;
    let mut quiet = 0;
    while t.elapsed() < limit {
        let running = std::fs::read_dir("/proc/self/task")
            .map(|d| d.count())
            .unwrap_or(usize::MAX);
        let ticks = cpu_ticks();
        if running >= n {
            if ticks.is_none() || ticks == last {
                quiet += 1;
                if quiet >= 3 {
                    return;
                }
            } else {
                quiet = 0;
            }
        }
        last = ticks;
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if !(args.open_latency_ms.is_finite() && args.open_latency_ms >= 0.0) {
        bail!("--open-latency-ms must be a number >= 0, got {}", args.open_latency_ms);
    }
    if args.threads == 0 {
        bail!("--threads must be at least 1");
    }
    let curve = Curve::parse_pairs(&args.bandwidth, "--bandwidth")?;
    let spec = Spec {
        open_latency: Duration::from_secs_f64(args.open_latency_ms / 1e3),
        bandwidth: curve,
        mmap_files: args.mmap_files,
    };
    let emu = Arc::new(
        EmuFs::new(&args.backing, spec).with_context(|| format!("backing directory {}", args.backing.display()))?,
    );
    if !args.mountpoint.is_dir() {
        bail!("mount point {} is not a directory", args.mountpoint.display());
    }

    // Register the signals before mounting, so that none is lost between the two.
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGUSR1]).context("installing signal handlers")?;
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::RO,
        fuser::MountOption::FSName("clairvoyant-fsemu".into()),
        fuser::MountOption::Subtype("clairvoyant-fsemu".into()),
        fuser::MountOption::DefaultPermissions,
    ];
    // Every local user (ranks may run as another user) may read.
    config.acl = fuser::SessionACL::All;
    config.n_threads = Some(args.threads);
    config.clone_fd = true;
    let session = fuser::spawn_mount(Shared(emu.clone()), &args.mountpoint, &config).with_context(|| {
        format!(
            "mounting {} (needs /dev/fuse, and root or fusermount3 from the fuse3 package)",
            args.mountpoint.display()
        )
    })?;
    wait_until_serving(args.threads + 1, Duration::from_secs(5));
    println!("mounted {}", args.mountpoint.display());
    std::io::stdout().flush().ok();

    for sig in signals.forever() {
        match sig {
            SIGUSR1 => {
                if let Some(p) = &args.stats_out {
                    if let Err(e) = write_stats(&emu, p) {
                        eprintln!("clairvoyant-fsemu: {e:#}");
                    }
                }
            }
            _ => break,
        }
    }
    session
        .umount_and_join()
        .with_context(|| format!("unmounting {}", args.mountpoint.display()))?;
    if let Some(p) = &args.stats_out {
        write_stats(&emu, p)?;
    }
    println!("unmounted {}", args.mountpoint.display());
    Ok(())
}
