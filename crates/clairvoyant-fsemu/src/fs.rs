//! The FUSE file system: a read-only view of a backing directory where every open costs a fixed
//! latency and every read shares the aggregate bandwidth t(γ), without page cache (each file is
//! opened with `FOPEN_DIRECT_IO`, so every read reaches this process). With
//! [`Spec::mmap_files`] files are opened without it (and without `FOPEN_KEEP_CACHE`), so that
//! the kernel can map them: each page fault of a mapping is then a read of this file system,
//! paying its bandwidth, as on a shared file system read through `mmap`.
//!
//! The root holds one extra, virtual file, [`STATS_NAME`]: reading it returns the counters as
//! JSON (a snapshot taken when it is opened). Opening it costs no latency and is not counted.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, OpenAccMode,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, Request,
};
use serde::Serialize;

use crate::bandwidth::{Bandwidth, Curve};

/// Name of the virtual statistics file in the root directory.
pub const STATS_NAME: &str = ".fsemu-stats";
const STATS_INO: u64 = 2;
const FIRST_INO: u64 = 3;
/// The data set does not change while mounted: let the kernel keep names and attributes.
const TTL: Duration = Duration::from_secs(3600);

/// Parameters of the emulated file system.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Latency of each open, overlapping between concurrent openers.
    pub open_latency: Duration,
    /// t(γ), shared by all readers.
    pub bandwidth: Curve,
    /// Open files through the page cache (no `FOPEN_DIRECT_IO`) so that they can be memory
    /// mapped; the cache is dropped at each open (no `FOPEN_KEEP_CACHE`). Off by default.
    pub mmap_files: bool,
}

impl Spec {
    /// How regular files are opened: direct I/O, unless they are to be mappable.
    fn file_open_flags(&self) -> FopenFlags {
        if self.mmap_files {
            FopenFlags::empty()
        } else {
            FopenFlags::FOPEN_DIRECT_IO
        }
    }
}

#[derive(Default)]
struct FileCounters {
    opens: AtomicU64,
    reads: AtomicU64,
    bytes: AtomicU64,
}

struct Node {
    path: PathBuf,
    counters: FileCounters,
}

#[derive(Default)]
struct Inodes {
    nodes: HashMap<u64, Arc<Node>>,
    by_path: HashMap<PathBuf, u64>,
    next: u64,
}

enum Handle {
    File { file: File, node: Arc<Node> },
    Stats(Vec<u8>),
}

/// Totals since mounting.
#[derive(Default)]
struct Totals {
    opens: AtomicU64,
    reads: AtomicU64,
    bytes: AtomicU64,
    /// Nanoseconds spent in open latency, summed over openers.
    open_ns: AtomicU64,
    /// Nanoseconds spent transferring, summed over readers.
    transfer_ns: AtomicU64,
    /// Opens and reads in progress, and the most seen at once.
    in_progress: AtomicUsize,
    max_in_progress: AtomicUsize,
}

/// The counters as written to the statistics file.
#[derive(Serialize)]
pub struct Stats {
    /// Seconds since the file system was created.
    pub uptime_s: f64,
    /// The emulated latency of each open, in milliseconds.
    pub open_latency_ms: f64,
    /// The bandwidth curve t(γ): (concurrent transfers, aggregate MB/s) points.
    pub bandwidth_mbps: Vec<(f64, f64)>,
    /// Files opened since mounting.
    pub opens: u64,
    /// Read requests served since mounting.
    pub reads: u64,
    /// Bytes served by reads since mounting.
    pub bytes: u64,
    /// Seconds spent in opens and transfers, summed over callers: divided by an interval's
    /// length, the mean number of file operations in progress.
    pub open_seconds: f64,
    /// Seconds spent transferring, summed over readers.
    pub transfer_seconds: f64,
    /// Opens and reads in progress now.
    pub in_progress: usize,
    /// The most opens and reads in progress at once since mounting.
    pub max_in_progress: usize,
    /// Transfers sharing the bandwidth now (γ).
    pub transfers: usize,
    /// Per file (path relative to the backing directory): opens, reads, bytes.
    pub files: std::collections::BTreeMap<String, FileStats>,
}

/// The counters of one file since mounting.
#[derive(Serialize)]
pub struct FileStats {
    /// Times the file was opened.
    pub opens: u64,
    /// Read requests served from the file.
    pub reads: u64,
    /// Bytes served from the file.
    pub bytes: u64,
}

/// The emulated file system over `root`.
pub struct EmuFs {
    root: PathBuf,
    spec: Spec,
    bandwidth: Bandwidth,
    inodes: RwLock<Inodes>,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    next_fh: AtomicU64,
    totals: Totals,
    started: Instant,
}

/// Counts one operation in progress while alive.
struct InProgress<'a>(&'a Totals);

impl<'a> InProgress<'a> {
    fn new(t: &'a Totals) -> Self {
        let now = t.in_progress.fetch_add(1, Ordering::Relaxed) + 1;
        t.max_in_progress.fetch_max(now, Ordering::Relaxed);
        InProgress(t)
    }
}

impl Drop for InProgress<'_> {
    fn drop(&mut self) {
        self.0.in_progress.fetch_sub(1, Ordering::Relaxed);
    }
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn attr_of(ino: u64, m: &std::fs::Metadata) -> FileAttr {
    let t = |s: i64, ns: i64| {
        if s >= 0 {
            UNIX_EPOCH + Duration::new(s as u64, ns as u32)
        } else {
            UNIX_EPOCH
        }
    };
    let kind = if m.is_dir() {
        FileType::Directory
    } else if m.file_type().is_symlink() {
        FileType::Symlink
    } else {
        FileType::RegularFile
    };
    FileAttr {
        ino: INodeNo(ino),
        size: m.size(),
        blocks: m.blocks(),
        atime: t(m.atime(), m.atime_nsec()),
        mtime: t(m.mtime(), m.mtime_nsec()),
        ctime: t(m.ctime(), m.ctime_nsec()),
        crtime: t(m.mtime(), m.mtime_nsec()),
        kind,
        // Read-only view: no write bits.
        perm: (m.mode() & 0o555) as u16,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

impl EmuFs {
    /// The emulated file system over the directory `root` (canonicalised; an error if it is
    /// not a directory), with counters at zero.
    pub fn new(root: &Path, spec: Spec) -> std::io::Result<EmuFs> {
        let root = root.canonicalize()?;
        if !root.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("{} is not a directory", root.display()),
            ));
        }
        let mut inodes = Inodes {
            next: FIRST_INO,
            ..Default::default()
        };
        inodes.nodes.insert(
            INodeNo::ROOT.0,
            Arc::new(Node {
                path: PathBuf::new(),
                counters: FileCounters::default(),
            }),
        );
        inodes.by_path.insert(PathBuf::new(), INodeNo::ROOT.0);
        Ok(EmuFs {
            root,
            bandwidth: Bandwidth::new(spec.bandwidth.clone()),
            spec,
            inodes: RwLock::new(inodes),
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            totals: Totals::default(),
            started: Instant::now(),
        })
    }

    fn node(&self, ino: u64) -> Option<Arc<Node>> {
        self.inodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .nodes
            .get(&ino)
            .cloned()
    }

    /// The inode of `rel` (relative to the root), allocated on first sight.
    fn ino_of(&self, rel: PathBuf) -> u64 {
        if let Some(&i) = self.inodes.read().unwrap_or_else(|p| p.into_inner()).by_path.get(&rel) {
            return i;
        }
        let mut w = self.inodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&i) = w.by_path.get(&rel) {
            return i;
        }
        let i = w.next;
        w.next += 1;
        w.by_path.insert(rel.clone(), i);
        w.nodes.insert(
            i,
            Arc::new(Node {
                path: rel,
                counters: FileCounters::default(),
            }),
        );
        i
    }

    fn stats_attr(&self) -> FileAttr {
        let now = SystemTime::now();
        FileAttr {
            ino: INodeNo(STATS_INO),
            size: self.stats_json().len() as u64,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            crtime: now,
            kind: FileType::RegularFile,
            perm: 0o444,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let t = &self.totals;
        let mut files = std::collections::BTreeMap::new();
        for node in self.inodes.read().unwrap_or_else(|p| p.into_inner()).nodes.values() {
            let c = &node.counters;
            let opens = c.opens.load(Ordering::Relaxed);
            if opens > 0 {
                files.insert(
                    node.path.to_string_lossy().into_owned(),
                    FileStats {
                        opens,
                        reads: c.reads.load(Ordering::Relaxed),
                        bytes: c.bytes.load(Ordering::Relaxed),
                    },
                );
            }
        }
        Stats {
            uptime_s: self.started.elapsed().as_secs_f64(),
            open_latency_ms: self.spec.open_latency.as_secs_f64() * 1e3,
            bandwidth_mbps: self.spec.bandwidth.0.clone(),
            opens: t.opens.load(Ordering::Relaxed),
            reads: t.reads.load(Ordering::Relaxed),
            bytes: t.bytes.load(Ordering::Relaxed),
            open_seconds: t.open_ns.load(Ordering::Relaxed) as f64 / 1e9,
            transfer_seconds: t.transfer_ns.load(Ordering::Relaxed) as f64 / 1e9,
            in_progress: t.in_progress.load(Ordering::Relaxed),
            max_in_progress: t.max_in_progress.load(Ordering::Relaxed),
            transfers: self.bandwidth.active(),
            files,
        }
    }

    /// [`EmuFs::stats`] as pretty-printed JSON with a final newline (the statistics file's
    /// contents).
    pub fn stats_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(&self.stats()).unwrap_or_default();
        v.push(b'\n');
        v
    }

    fn handle(&self, fh: u64) -> Option<Arc<Handle>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner()).get(&fh).cloned()
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(fh, Arc::new(h));
        fh
    }
}

/// Shared so that the signal handler can write the statistics while the session runs.
pub struct Shared(pub Arc<EmuFs>);

impl Filesystem for Shared {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let fs = &self.0;
        if parent == INodeNo::ROOT && name == STATS_NAME {
            reply.entry(&Duration::ZERO, &fs.stats_attr(), Generation(0));
            return;
        }
        let Some(dir) = fs.node(parent.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let rel = dir.path.join(name);
        match std::fs::symlink_metadata(fs.root.join(&rel)) {
            Ok(m) => {
                let ino = fs.ino_of(rel);
                reply.entry(&TTL, &attr_of(ino, &m), Generation(0));
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let fs = &self.0;
        if ino.0 == STATS_INO {
            reply.attr(&Duration::ZERO, &fs.stats_attr());
            return;
        }
        let Some(node) = fs.node(ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        match std::fs::symlink_metadata(fs.root.join(&node.path)) {
            Ok(m) => reply.attr(&TTL, &attr_of(ino.0, &m)),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let fs = &self.0;
        let Some(node) = fs.node(ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        match std::fs::read_link(fs.root.join(&node.path)) {
            Ok(t) => reply.data(t.as_os_str().as_bytes()),
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let fs = &self.0;
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            reply.error(Errno::EROFS);
            return;
        }
        if ino.0 == STATS_INO {
            let fh = fs.add_handle(Handle::Stats(fs.stats_json()));
            reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
            return;
        }
        let Some(node) = fs.node(ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        {
            let _busy = InProgress::new(&fs.totals);
            let t = Instant::now();
            std::thread::sleep(fs.spec.open_latency);
            fs.totals
                .open_ns
                .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        match File::open(fs.root.join(&node.path)) {
            Ok(file) => {
                fs.totals.opens.fetch_add(1, Ordering::Relaxed);
                node.counters.opens.fetch_add(1, Ordering::Relaxed);
                let fh = fs.add_handle(Handle::File { file, node });
                reply.opened(FileHandle(fh), fs.spec.file_open_flags());
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let fs = &self.0;
        let Some(h) = fs.handle(fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        match &*h {
            Handle::Stats(bytes) => {
                let start = (offset as usize).min(bytes.len());
                let end = (start + size as usize).min(bytes.len());
                reply.data(&bytes[start..end]);
            }
            Handle::File { file, node } => {
                let mut buf = vec![0u8; size as usize];
                let mut got = 0;
                while got < buf.len() {
                    match file.read_at(&mut buf[got..], offset + got as u64) {
                        Ok(0) => break,
                        Ok(n) => got += n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            reply.error(errno(&e));
                            return;
                        }
                    }
                }
                {
                    let _busy = InProgress::new(&fs.totals);
                    let t = Instant::now();
                    fs.bandwidth.transfer(got as u64);
                    fs.totals
                        .transfer_ns
                        .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                fs.totals.reads.fetch_add(1, Ordering::Relaxed);
                fs.totals.bytes.fetch_add(got as u64, Ordering::Relaxed);
                node.counters.reads.fetch_add(1, Ordering::Relaxed);
                node.counters.bytes.fetch_add(got as u64, Ordering::Relaxed);
                reply.data(&buf[..got]);
            }
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.0.handles.lock().unwrap_or_else(|p| p.into_inner()).remove(&fh.0);
        reply.ok();
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let fs = &self.0;
        let Some(dir) = fs.node(ino.0) else {
            reply.error(Errno::ENOENT);
            return;
        };
        let rd = match std::fs::read_dir(fs.root.join(&dir.path)) {
            Ok(rd) => rd,
            Err(e) => {
                reply.error(errno(&e));
                return;
            }
        };
        let mut entries: Vec<(u64, FileType, std::ffi::OsString)> = vec![
            (ino.0, FileType::Directory, ".".into()),
            (ino.0, FileType::Directory, "..".into()),
        ];
        if ino == INodeNo::ROOT {
            entries.push((STATS_INO, FileType::RegularFile, STATS_NAME.into()));
        }
        let mut names: Vec<(std::ffi::OsString, FileType)> = rd
            .filter_map(|e| e.ok())
            .map(|e| {
                let kind = match e.file_type() {
                    Ok(t) if t.is_dir() => FileType::Directory,
                    Ok(t) if t.is_symlink() => FileType::Symlink,
                    _ => FileType::RegularFile,
                };
                (e.file_name(), kind)
            })
            .collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, kind) in names {
            let i = fs.ino_of(dir.path.join(&name));
            entries.push((i, kind, name));
        }
        for (i, (e_ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(e_ino), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok();
    }
}
