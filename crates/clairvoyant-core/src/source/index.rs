//! The on-disk index of a file-backed dataset (sample paths, sizes, labels) and `FileSource`, the
//! `Source` both `image_folder` and `file_list` return. Indexes are reused while the directory
//! mtimes recorded at scan time are unchanged; one process scans while the others wait on a lock.

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{ErrorKind, IoSliceMut, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Source;
use crate::error::{Error, Result};
use crate::tier::secure;

/// Overrides the directory where indexes are kept (the registry's
/// [`crate::sysinfo::env::CACHE_DIR`]).
pub const CACHE_DIR_ENV: &str = crate::sysinfo::env::CACHE_DIR.name;

const MAGIC: &[u8; 8] = b"CVINDEX\0";
/// Bumped on any change of the layout below; other versions are treated as damaged and rebuilt.
pub const FORMAT_VERSION: u32 = 1;
const FILE_PREFIX: &str = "index-";
const FILE_SUFFIX: &str = ".cvidx";

/// A directory modified this close to (or after) the start of a scan may have changed within the
/// same timestamp tick as the scan read it, so its unchanged mtime proves nothing ("racy git").
/// 2 s covers the coarsest common granularity (FAT; some NFS servers store whole seconds).
pub(crate) const RACY_WINDOW_NS: i64 = 2_000_000_000;

/// 64-bit FNV-1a (<http://www.isthe.com/chongo/tech/comp/fnv/>): tiny, stable across platforms and
/// releases, good enough to tell datasets apart and to detect damage (not an adversary).
#[derive(Clone, Copy, Debug)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    /// Mixes `bytes` into the hash.
    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Length-prefixed, so that ("ab", "c") and ("a", "bc") hash differently.
    pub fn write_str(&mut self, s: &str) {
        self.write_os(OsStr::new(s));
    }

    /// Like [`write_str`](Self::write_str) for a name as the OS gives it (any bytes); equal to
    /// it for UTF-8 names.
    pub fn write_os(&mut self, s: &OsStr) {
        self.write(&(s.len() as u64).to_le_bytes());
        self.write(s.as_bytes());
    }

    /// The hash of everything written so far.
    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// One sample of an index. Paths and names are kept as the OS gives them (bytes, not
/// necessarily UTF-8), as torchvision keeps them through `os.scandir`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    /// Relative to the dataset root for directory datasets; absolute for file lists.
    pub path: PathBuf,
    /// Size of the file in bytes at the scan.
    pub size: u64,
    /// The sample's label: its class index for directory datasets, as listed for file lists.
    pub label: i64,
}

/// A directory seen during the scan, with its mtime then: adding, removing or renaming an entry
/// changes a directory's mtime, so checking these detects such changes without a stat per file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirStamp {
    /// Absolute path.
    pub path: PathBuf,
    /// The directory's modification time at the scan, in ns since the Unix epoch.
    pub mtime_ns: i64,
}

/// Whether an index still describes its dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freshness {
    /// Every recorded directory is unchanged and was last modified well before the scan.
    Fresh,
    /// Unchanged, but some directory was modified within `RACY_WINDOW_NS` of the scan.
    Racy,
    /// A directory changed or vanished.
    Stale,
}

/// A dataset's samples, as scanned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index {
    /// Canonical dataset root for directory datasets; empty for file lists (entries are absolute).
    pub root: PathBuf,
    /// `dir:<canonical root>` or `list:<16 hex of the list hash>`; names the index file.
    pub identity: OsString,
    /// Class names, in label order (empty for file lists).
    pub classes: Vec<OsString>,
    /// One entry per sample, in sample order.
    pub entries: Vec<IndexEntry>,
    /// Every directory the scan read, to detect added, removed or renamed entries.
    pub dirs: Vec<DirStamp>,
    /// Wall clock (ns since the Unix epoch) when the scan began.
    pub scan_start_ns: i64,
    /// Wall clock (ns since the Unix epoch) when the scan ended.
    pub built_ns: i64,
}

impl Index {
    /// Stable 64-bit FNV-1a hash of identity, classes and entries; equal fingerprints mean the
    /// same samples with the same sizes and labels.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv1a::default();
        h.write_os(&self.identity);
        h.write(&(self.classes.len() as u64).to_le_bytes());
        for c in &self.classes {
            h.write_os(c);
        }
        h.write(&(self.entries.len() as u64).to_le_bytes());
        for e in &self.entries {
            h.write_os(e.path.as_os_str());
            h.write(&e.size.to_le_bytes());
            h.write(&e.label.to_le_bytes());
        }
        h.finish()
    }

    /// File name of the index for `identity`: `index-<16 hex of FNV-1a(identity)>.cvidx`.
    pub fn file_name(identity: impl AsRef<OsStr>) -> String {
        let mut h = Fnv1a::default();
        h.write(identity.as_ref().as_bytes());
        format!("{FILE_PREFIX}{:016x}{FILE_SUFFIX}", h.finish())
    }

    /// Human-readable dataset this index belongs to (for errors).
    pub fn describe_identity(identity: &OsStr) -> String {
        let b = identity.as_bytes();
        match b.strip_prefix(b"dir:") {
            Some(root) => format!("root {}", Path::new(OsStr::from_bytes(root)).display()),
            None => format!(
                "file list {}",
                OsStr::from_bytes(b.strip_prefix(b"list:").unwrap_or(b)).to_string_lossy()
            ),
        }
    }

    /// Binary layout, all integers little-endian: magic, u32 version, identity, classes, dir
    /// stamps, entries, i64 scan start and end, then a u64 FNV-1a of everything before it.
    /// Strings are u32 length + their bytes as the OS gives them (file names need not be UTF-8);
    /// lists are u64 count + items.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = begin_file(MAGIC, FORMAT_VERSION, 64 + self.entries.len() * 48);
        put_str(&mut w, &self.identity);
        w.extend_from_slice(&(self.classes.len() as u64).to_le_bytes());
        for c in &self.classes {
            put_str(&mut w, c);
        }
        w.extend_from_slice(&(self.dirs.len() as u64).to_le_bytes());
        for d in &self.dirs {
            put_str(&mut w, d.path.as_os_str());
            w.extend_from_slice(&d.mtime_ns.to_le_bytes());
        }
        w.extend_from_slice(&(self.entries.len() as u64).to_le_bytes());
        for e in &self.entries {
            put_str(&mut w, e.path.as_os_str());
            w.extend_from_slice(&e.size.to_le_bytes());
            w.extend_from_slice(&e.label.to_le_bytes());
        }
        w.extend_from_slice(&self.scan_start_ns.to_le_bytes());
        w.extend_from_slice(&self.built_ns.to_le_bytes());
        seal_file(w)
    }

    /// Parses `bytes`; any damage (bad magic, version, checksum, truncation) is `BadIndex`
    /// naming `index`.
    pub fn from_bytes(bytes: &[u8], index: &Path) -> Result<Index> {
        let mut r = open_file(bytes, index, MAGIC, FORMAT_VERSION, "a clairvoyant index")?;
        let parse = |r: &mut Reader| -> Option<Index> {
            let identity = r.string()?;
            let classes = (0..r.count(1)?).map(|_| r.string()).collect::<Option<Vec<_>>>()?;
            let dirs = (0..r.count(1)?)
                .map(|_| {
                    Some(DirStamp {
                        path: r.string()?.into(),
                        mtime_ns: r.u64()? as i64,
                    })
                })
                .collect::<Option<Vec<_>>>()?;
            let entries = (0..r.count(1)?)
                .map(|_| {
                    Some(IndexEntry {
                        path: r.string()?.into(),
                        size: r.u64()?,
                        label: r.u64()? as i64,
                    })
                })
                .collect::<Option<Vec<_>>>()?;
            let scan_start_ns = r.u64()? as i64;
            let built_ns = r.u64()? as i64;
            let root = identity
                .as_bytes()
                .strip_prefix(b"dir:")
                .map(|r| PathBuf::from(OsStr::from_bytes(r)))
                .unwrap_or_default();
            // Entries of a directory dataset are relative paths below its root: an entry that
            // would lead elsewhere ("/etc/shadow", "../x") makes the index damaged, never read.
            let inside = |p: &Path| p.components().all(|c| matches!(c, std::path::Component::Normal(_)));
            if !root.as_os_str().is_empty() && !entries.iter().all(|e| inside(&e.path)) {
                return None;
            }
            (r.pos == r.buf.len()).then_some(Index {
                root,
                identity,
                classes,
                entries,
                dirs,
                scan_start_ns,
                built_ns,
            })
        };
        parse(&mut r).ok_or_else(|| Error::BadIndex {
            index: index.to_path_buf(),
            reason: "is malformed (lengths do not add up)".into(),
        })
    }

    /// Reads and parses an index file (a regular file of this user or root, never through a
    /// symlink: see [`read_trusted`](crate::tier::secure::read_trusted)).
    pub fn load(path: &Path) -> Result<Index> {
        let bytes =
            secure::read_trusted(path)?.ok_or_else(|| Error::io(path, std::io::Error::from(ErrorKind::NotFound)))?;
        Index::from_bytes(&bytes, path)
    }

    /// Writes atomically and privately: a temporary file with an unpredictable name (mode
    /// 0600, `O_EXCL`) in the same directory, synced, then renamed over `path`, so readers see
    /// the old index or the new one, never half of one.
    pub fn save(&self, path: &Path) -> Result<()> {
        secure::write_private(path, &self.to_bytes())
    }

    /// Compares the recorded directory mtimes with the file system (one stat per directory).
    pub fn freshness(&self) -> Freshness {
        let mut fresh = Freshness::Fresh;
        for d in &self.dirs {
            match dir_mtime_ns(&d.path) {
                Ok(m) if m == d.mtime_ns => {
                    if m > self.scan_start_ns.saturating_sub(RACY_WINDOW_NS) {
                        fresh = Freshness::Racy;
                    }
                }
                _ => return Freshness::Stale,
            }
        }
        fresh
    }
}

fn put_str(w: &mut Vec<u8>, s: &OsStr) {
    put_bytes(w, s.as_bytes());
}

/// The start of an index file: its magic and format version.
pub(crate) fn begin_file(magic: &[u8], version: u32, capacity: usize) -> Vec<u8> {
    let mut w = Vec::with_capacity(capacity);
    w.extend_from_slice(magic);
    w.extend_from_slice(&version.to_le_bytes());
    w
}

/// The end of an index file: the FNV-1a of everything before it.
pub(crate) fn seal_file(mut w: Vec<u8>) -> Vec<u8> {
    let mut h = Fnv1a::default();
    h.write(&w);
    w.extend_from_slice(&h.finish().to_le_bytes());
    w
}

/// Check what [`begin_file`] and [`seal_file`] framed (magic, checksum, version) and return a
/// reader of the body after the version; damage is `BadIndex` naming `index` (`what`: "a
/// clairvoyant index", "a container index").
pub(crate) fn open_file<'a>(
    bytes: &'a [u8],
    index: &Path,
    magic: &[u8],
    version: u32,
    what: &str,
) -> Result<Reader<'a>> {
    let bad = |reason: String| Error::BadIndex {
        index: index.to_path_buf(),
        reason,
    };
    if bytes.len() < magic.len() + 4 + 8 || &bytes[..magic.len()] != magic {
        return Err(bad(format!("is not {what} (bad magic)")));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let mut h = Fnv1a::default();
    h.write(body);
    if h.finish().to_le_bytes() != sum {
        return Err(bad("is damaged (checksum mismatch)".into()));
    }
    let mut r = Reader {
        buf: body,
        pos: magic.len(),
    };
    let found = r.u32().ok_or_else(|| bad("is truncated".into()))?;
    if found != version {
        return Err(bad(format!("has format version {found}, expected {version}")));
    }
    Ok(r)
}

/// A length-prefixed (u32, little-endian) byte string, as [`Reader::bytes`] reads it back.
pub(crate) fn put_bytes(w: &mut Vec<u8>, b: &[u8]) {
    w.extend_from_slice(&(b.len() as u32).to_le_bytes());
    w.extend_from_slice(b);
}

/// Reads the little-endian binary layouts of the index files; every read is bounds-checked and
/// a damaged file gives None, never a panic or a huge allocation.
pub(crate) struct Reader<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl Reader<'_> {
    pub(crate) fn take(&mut self, n: usize) -> Option<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len())?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Some(s)
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
    /// A list length, bounded by the bytes left (each item takes at least `min_item` bytes), so
    /// a damaged count cannot trigger a huge allocation.
    pub(crate) fn count(&mut self, min_item: u64) -> Option<usize> {
        let n = self.u64()?;
        (n.checked_mul(min_item)? <= (self.buf.len() - self.pos) as u64).then_some(n as usize)
    }
    /// A byte string written by [`put_bytes`].
    pub(crate) fn bytes(&mut self) -> Option<&[u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Option<OsString> {
        Some(OsString::from_vec(self.bytes()?.to_vec()))
    }
}

/// Wall clock in ns since the Unix epoch (comparable with file mtimes).
pub(crate) fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// mtime in ns of the directory at `path`, following symlinks.
pub(crate) fn dir_mtime_ns(path: &Path) -> std::io::Result<i64> {
    let m = fs::metadata(path)?;
    Ok(m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec()))
}

/// `$CLAIRVOYANT_CACHE_DIR`, else `$XDG_CACHE_HOME/clairvoyant`, else `~/.cache/clairvoyant`
/// ([`crate::sysinfo::env::user_cache_dir`]).
pub fn default_index_dir() -> Result<PathBuf> {
    crate::sysinfo::env::user_cache_dir().ok_or_else(|| {
        Error::config(
            "index_dir",
            format!("none given and neither {CACHE_DIR_ENV}, XDG_CACHE_HOME nor HOME is set"),
        )
    })
}

/// Where the index for `identity` lives in `index_dir` (or the default directory).
pub(crate) fn index_path_in(index_dir: Option<&Path>, identity: &OsStr) -> Result<PathBuf> {
    index_file_in(index_dir, Index::file_name(identity))
}

/// `file_name` in `index_dir`, else in [`default_index_dir`]; a folder another user could
/// write is replaced by the trusted one [`secure::trusted_dir`] names. Every kind of index file
/// is placed here.
pub(crate) fn index_file_in(index_dir: Option<&Path>, file_name: String) -> Result<PathBuf> {
    let dir = match index_dir {
        Some(d) => d.to_path_buf(),
        None => default_index_dir()?,
    };
    let dir = secure::trusted_dir(&dir, true)?.unwrap_or(dir);
    Ok(dir.join(file_name))
}

/// An exclusive `flock` on `<index>.lock`, released when dropped or when the process dies (the
/// kernel drops it with the descriptor), so a crashed scanner never blocks the others for good.
/// The holder removes the lock file when it is done, so none stays in the cache folder; a
/// process that waited meanwhile holds a lock on a file no longer at the path, sees so
/// (device and inode differ, or the path is gone) and locks the path anew.
pub(crate) struct IndexLock {
    _file: File,
    path: PathBuf,
}

impl IndexLock {
    fn path_of(index_path: &Path) -> PathBuf {
        let mut p = index_path.as_os_str().to_owned();
        p.push(".lock");
        PathBuf::from(p)
    }

    pub(crate) fn acquire(index_path: &Path) -> Result<IndexLock> {
        let path = Self::path_of(index_path);
        loop {
            let file = secure::open_lock(&path)?;
            if !flock(&file, libc::LOCK_EX).map_err(|e| Error::io(&path, e))? {
                continue;
            }
            if still_linked(&file, &path) {
                return Ok(IndexLock { _file: file, path });
            }
        }
    }

    /// Remove a lock file a holder left (killed between its scan and its removal), unless
    /// someone holds it now.
    pub(crate) fn reclaim(index_path: &Path) {
        let path = Self::path_of(index_path);
        if fs::symlink_metadata(&path).is_err() {
            return;
        }
        let Ok(file) = secure::open_lock(&path) else { return };
        if flock(&file, libc::LOCK_EX | libc::LOCK_NB).unwrap_or(false) && still_linked(&file, &path) {
            let _ = fs::remove_file(&path);
        }
    }
}

impl Drop for IndexLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a waiter then finds it gone and locks a fresh file.
        let _ = fs::remove_file(&self.path);
    }
}

/// `flock(op)` on `file`, retried on EINTR: Ok(false) when `LOCK_NB` finds it held.
fn flock(file: &File, op: libc::c_int) -> std::io::Result<bool> {
    loop {
        // SAFETY: flock on a descriptor we own and keep open for the duration of the call.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            ErrorKind::Interrupted => continue,
            ErrorKind::WouldBlock => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Whether `path` still names the file open as `file`.
fn still_linked(file: &File, path: &Path) -> bool {
    match (file.metadata(), fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// What the one load-or-build path needs of a kind of index file (a file index, a container
/// index): its bytes (header, version and checksum checked by [`open_file`]), the dataset it
/// describes, whether that dataset is unchanged, and what to check before it is saved.
pub(crate) trait IndexFile: Sized {
    /// The dataset identity (`OsStr` for file indexes, `str` for containers).
    type Identity: ?Sized + PartialEq;
    /// Decodes and checks a stored index; damage is an error.
    fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self>;
    /// The stored form.
    fn to_bytes(&self) -> Vec<u8>;
    /// The dataset this index belongs to.
    fn identity(&self) -> &Self::Identity;
    /// `identity` for an error message.
    fn describe(identity: &Self::Identity) -> String;
    /// Whether the dataset is as it was when indexed.
    fn freshness(&self) -> Freshness;
    /// Wall clock (ns since the Unix epoch) when the index was built.
    fn built_ns(&self) -> i64;
    /// Checks a freshly built index for `identity` before it is saved (and stamps it).
    fn seal(&mut self, _identity: &Self::Identity) -> Result<()> {
        Ok(())
    }
}

impl IndexFile for Index {
    type Identity = OsStr;
    fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        Index::from_bytes(bytes, path)
    }
    fn to_bytes(&self) -> Vec<u8> {
        Index::to_bytes(self)
    }
    fn identity(&self) -> &OsStr {
        &self.identity
    }
    fn describe(identity: &OsStr) -> String {
        Index::describe_identity(identity)
    }
    fn freshness(&self) -> Freshness {
        Index::freshness(self)
    }
    fn built_ns(&self) -> i64 {
        self.built_ns
    }
}

/// Reads the index at `path` if it belongs to `identity`. Missing or damaged: None (rebuild). Of
/// another dataset: `BadIndex` when the caller named the file explicitly, else None. Only a file
/// of this user that no other can write is read (see [`secure::read_trusted`]).
fn try_load<I: IndexFile>(path: &Path, identity: &I::Identity, explicit: bool) -> Result<Option<I>> {
    let Some(bytes) = secure::read_trusted(path)? else {
        return Ok(None);
    };
    let Ok(index) = I::from_bytes(&bytes, path) else {
        return Ok(None);
    };
    if index.identity() != identity {
        if explicit {
            return Err(Error::BadIndex {
                index: path.to_path_buf(),
                reason: format!(
                    "belongs to another dataset ({}), not to {}",
                    I::describe(index.identity()),
                    I::describe(identity)
                ),
            });
        }
        return Ok(None);
    }
    Ok(Some(index))
}

/// Creates the folder of an index file (mode 0700) if missing.
pub(crate) fn make_parent(path: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

/// Loads the index at `path` for `identity` if still fresh, else builds it with `build` under the
/// lock, seals ([`IndexFile::seal`]) and saves the result atomically and privately. Returns the
/// index and whether it was reused (no scan here). Every kind of index file goes through here.
pub(crate) fn load_or_build<I: IndexFile>(
    path: &Path,
    identity: &I::Identity,
    explicit: bool,
    build: impl FnOnce() -> Result<I>,
) -> Result<(I, bool)> {
    let call_start = now_ns();
    // Fast path without the lock: writes are atomic renames, so what we read is whole.
    if let Some(ix) = try_load::<I>(path, identity, explicit)? {
        if ix.freshness() == Freshness::Fresh {
            IndexLock::reclaim(path);
            mark_used(path);
            return Ok((ix, true));
        }
    }
    make_parent(path)?;
    let _lock = IndexLock::acquire(path)?;
    // Another process may have scanned while we waited. A racy index built after this call began
    // is as fresh as a scan we would start now, so take it rather than scanning once per rank.
    if let Some(ix) = try_load::<I>(path, identity, explicit)? {
        match ix.freshness() {
            Freshness::Fresh => {
                mark_used(path);
                return Ok((ix, true));
            }
            Freshness::Racy if ix.built_ns() >= call_start => return Ok((ix, true)),
            _ => {}
        }
    }
    let mut ix = build()?;
    ix.seal(identity)?;
    secure::write_private(path, &ix.to_bytes())?;
    if !explicit {
        prune_unused(path);
    }
    Ok((ix, false))
}

/// Index files in a cache folder that no job used for this long are removed when another is
/// written beside them: datasets come and go, and the folder would otherwise keep every index
/// it ever held.
pub(crate) const UNUSED_FOR: Duration = Duration::from_secs(30 * 24 * 3600);
/// A reused index's modification time is moved to now when it is older than this: the time
/// [`prune_unused`] goes by, at most one write a day per index.
const MARK_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The age of `m`'s modification time (zero if in the future or unknown).
fn age(m: &fs::Metadata) -> Duration {
    m.modified()
        .ok()
        .and_then(|t| t.elapsed().ok())
        .unwrap_or(Duration::ZERO)
}

/// Note that the index at `path` was used: its modification time becomes now, if older than
/// [`MARK_AFTER`]. Failing (a read-only folder, an index of another user's) changes nothing.
fn mark_used(path: &Path) {
    let Ok(m) = fs::symlink_metadata(path) else { return };
    if age(&m) <= MARK_AFTER {
        return;
    }
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a NUL-terminated path; null times mean now; the call follows no symbolic link.
    unsafe {
        libc::utimensat(libc::AT_FDCWD, c.as_ptr(), std::ptr::null(), libc::AT_SYMLINK_NOFOLLOW);
    }
}

/// Whether `name` is one of the index files this crate writes (`index-` or `container-`, 16
/// hex digits, `.cvidx`).
fn is_index_file_name(name: &OsStr) -> bool {
    let Some(name) = name.to_str() else { return false };
    let Some(stem) = name.strip_suffix(FILE_SUFFIX) else {
        return false;
    };
    let hex = stem.strip_prefix("index-").or_else(|| stem.strip_prefix("container-"));
    hex.is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Remove the index files beside `written` (this user's regular files, by their names) that
/// were not used for [`UNUSED_FOR`]. Runs after a scan wrote `written`, so once per new or
/// changed dataset; whatever cannot be removed stays.
fn prune_unused(written: &Path) {
    let Some(dir) = written.parent() else { return };
    let Ok(entries) = fs::read_dir(dir) else { return };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let p = e.path();
        if p == written || !is_index_file_name(&e.file_name()) {
            continue;
        }
        let Ok(m) = fs::symlink_metadata(&p) else { continue };
        if m.file_type().is_file() && m.uid() == me && age(&m) > UNUSED_FOR {
            let _ = fs::remove_file(&p);
        }
    }
}

/// A dataset of plain files described by an [`Index`]: one file per sample, read whole.
#[derive(Debug)]
pub struct FileSource {
    index: Index,
    /// Prefix joined with entry paths: the absolute root as the caller named it (symlinks kept),
    /// or empty for file lists whose entries are absolute.
    base: PathBuf,
    index_path: Option<PathBuf>,
    reused: bool,
    fingerprint: u64,
}

impl FileSource {
    /// Wraps an index; `index_path` is where it is stored (None for an in-memory index).
    pub fn new(index: Index, base: PathBuf, index_path: Option<PathBuf>, reused: bool) -> FileSource {
        let fingerprint = index.fingerprint();
        FileSource {
            index,
            base,
            index_path,
            reused,
            fingerprint,
        }
    }

    /// The index file backing this source, if any.
    pub fn index_path(&self) -> Option<&Path> {
        self.index_path.as_deref()
    }

    /// Class names in label order (empty for file lists).
    pub fn classes(&self) -> &[OsString] {
        &self.index.classes
    }

    /// True when the index was loaded from disk without scanning the dataset in this call.
    pub fn index_was_reused(&self) -> bool {
        self.reused
    }

    /// The dataset's index: root, classes and one entry per sample.
    pub fn index(&self) -> &Index {
        &self.index
    }
}

impl Source for FileSource {
    fn len(&self) -> usize {
        self.index.entries.len()
    }

    fn size(&self, sample: u32) -> u64 {
        self.index.entries[sample as usize].size
    }

    fn label(&self, sample: u32) -> i64 {
        self.index.entries[sample as usize].label
    }

    fn path(&self, sample: u32) -> PathBuf {
        self.base.join(&self.index.entries[sample as usize].path)
    }

    fn read_into(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        let index = self.index_path.clone().unwrap_or_else(|| PathBuf::from("(in memory)"));
        read_exact_file(sample as u64, &self.path(sample), buf, &index)
    }

    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// Reads the file at `path`, which must be exactly `buf.len()` bytes long. A missing file is
/// `NotFound`; a shorter or longer one is `Changed`.
///
/// Each read asks for one byte past the indexed size (a vectored read into `buf` and a byte
/// beside it), so a longer file shows in the same call. A read of a regular file that returns
/// less than it asked for has reached the file's end, so the read that fills `buf` short by that
/// one byte ends it: no second read confirms the end. Where every read is a request to a server
/// (a FUSE file system opened for direct I/O, as object-store mounts are), that is one request
/// a file fewer.
pub(crate) fn read_exact_file(sample: u64, path: &Path, buf: &mut [u8], index: &Path) -> Result<()> {
    let mut f = File::open(path).map_err(|e| match e.kind() {
        ErrorKind::NotFound => Error::NotFound {
            sample,
            path: path.to_path_buf(),
        },
        _ => Error::io(path, e),
    })?;
    let want = buf.len();
    let changed = |f: &File, reason: &str| {
        let now = f
            .metadata()
            .map(|m| format!(", now {} bytes", m.len()))
            .unwrap_or_default();
        Error::Changed {
            path: path.to_path_buf(),
            index: index.to_path_buf(),
            reason: format!("{reason} (indexed {want} bytes{now})"),
        }
    };
    let mut filled = 0;
    let mut extra = [0u8; 1];
    loop {
        let asked = want - filled + 1;
        let got = match f.read_vectored(&mut [IoSliceMut::new(&mut buf[filled..]), IoSliceMut::new(&mut extra)]) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io(path, e)),
        };
        if got == asked {
            return Err(changed(&f, "file is longer than indexed"));
        }
        if got == 0 {
            return if filled == want {
                Ok(())
            } else {
                Err(changed(&f, "file is shorter than indexed"))
            };
        }
        filled += got;
        if filled == want {
            return Ok(()); // a short read: the file's end
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_index(root: &Path) -> Index {
        Index {
            root: root.to_path_buf(),
            identity: format!("dir:{}", root.display()).into(),
            classes: vec!["a".into(), "b".into()],
            entries: vec![
                IndexEntry {
                    path: "a/1.jpg".into(),
                    size: 3,
                    label: 0,
                },
                IndexEntry {
                    path: "b/x/2.png".into(),
                    size: 0,
                    label: 1,
                },
            ],
            dirs: vec![DirStamp {
                path: root.to_path_buf(),
                mtime_ns: 5,
            }],
            scan_start_ns: 10,
            built_ns: 11,
        }
    }

    #[test]
    fn fnv1a_known_vectors() {
        // Published test vectors of 64-bit FNV-1a.
        let h = |s: &[u8]| {
            let mut f = Fnv1a::default();
            f.write(s);
            f.finish()
        };
        assert_eq!(h(b""), 0xcbf29ce484222325);
        assert_eq!(h(b"a"), 0xaf63dc4c8601ec8c);
        assert_eq!(h(b"foobar"), 0x85944171f73967e8);
    }

    #[test]
    fn round_trip_and_stable_fingerprint() {
        let ix = sample_index(Path::new("/data/set"));
        let back = Index::from_bytes(&ix.to_bytes(), Path::new("x")).unwrap();
        assert_eq!(back, ix);
        assert_eq!(back.fingerprint(), ix.fingerprint());
        let mut other = ix.clone();
        other.entries[0].size = 4;
        assert_ne!(other.fingerprint(), ix.fingerprint());
        assert_eq!(
            Index::file_name("dir:/data/set").len(),
            "index-".len() + 16 + ".cvidx".len()
        );
    }

    #[test]
    fn every_truncation_and_bit_flip_is_detected() {
        let bytes = sample_index(Path::new("/r")).to_bytes();
        for n in 0..bytes.len() {
            assert!(
                Index::from_bytes(&bytes[..n], Path::new("x")).is_err(),
                "truncated to {n}"
            );
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(Index::from_bytes(&b, Path::new("x")), Err(Error::BadIndex { .. })),
                "flip at {i}"
            );
        }
    }

    #[test]
    fn read_exact_file_reports_size_changes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        fs::write(&p, b"hello").unwrap();
        let mut buf = [0u8; 5];
        read_exact_file(0, &p, &mut buf, Path::new("ix")).unwrap();
        assert_eq!(&buf, b"hello");
        let mut short = [0u8; 4];
        assert!(matches!(
            read_exact_file(0, &p, &mut short, Path::new("ix")),
            Err(Error::Changed { .. })
        ));
        let mut long = [0u8; 6];
        assert!(matches!(
            read_exact_file(0, &p, &mut long, Path::new("ix")),
            Err(Error::Changed { .. })
        ));
        let missing = d.path().join("nope");
        match read_exact_file(7, &missing, &mut buf, Path::new("ix")) {
            Err(Error::NotFound { sample: 7, path }) => assert_eq!(path, missing),
            other => panic!("{other:?}"),
        }
    }

    /// A file is read with one read where it can be: the read that comes back short of the byte
    /// past the indexed size ends it. A FIFO whose writer stays open stands for a server that
    /// answers each read once: a second read would wait for the writer.
    #[test]
    fn read_exact_file_ends_at_a_short_read_without_a_second() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("fifo");
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let writer = {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut f = fs::OpenOptions::new().write(true).open(&p).unwrap();
                std::io::Write::write_all(&mut f, b"hello").unwrap();
                let _ = wait.recv_timeout(Duration::from_secs(10)); // holds the FIFO open
            })
        };
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 5];
                let r = read_exact_file(0, &p, &mut buf, Path::new("ix")).map(|_| buf);
                let _ = tx.send(r);
            });
        }
        let got = rx.recv_timeout(Duration::from_secs(5));
        done.send(()).unwrap();
        writer.join().unwrap();
        assert_eq!(&got.expect("a second read waited for the end").unwrap(), b"hello");
    }

    /// A dataset folder `data` in `parent`, back-dated so that a first scan of it is not racy.
    fn scanned_dir(parent: &Path) -> PathBuf {
        let data = parent.join("data");
        fs::create_dir(&data).unwrap();
        File::open(&data)
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(60))
            .unwrap();
        data
    }

    /// What a scan of `data` made now would record.
    fn scan_of(data: &Path) -> Result<Index> {
        let mut ix = sample_index(data);
        ix.dirs = vec![DirStamp {
            path: data.to_path_buf(),
            mtime_ns: dir_mtime_ns(data).unwrap(),
        }];
        ix.scan_start_ns = now_ns();
        ix.built_ns = now_ns();
        Ok(ix)
    }

    #[test]
    fn load_or_build_scans_once_then_reuses() {
        let d = tempfile::tempdir().unwrap();
        let data = scanned_dir(d.path());
        let build = || scan_of(&data);
        let ip = d.path().join("ix").join(Index::file_name("id"));
        let id = OsString::from(format!("dir:{}", data.display()));
        let (a, reused) = load_or_build(&ip, id.as_os_str(), false, build).unwrap();
        assert!(!reused);
        let (b, reused) = load_or_build(&ip, id.as_os_str(), false, || panic!("must not rescan")).unwrap();
        assert!(reused);
        assert_eq!(a, b);
        fs::write(data.join("new"), b"").unwrap();
        let (_, reused) = load_or_build(&ip, id.as_os_str(), false, build).unwrap();
        assert!(!reused, "a changed directory is rescanned");
        let err = load_or_build(&ip, OsStr::new("dir:/elsewhere"), true, build).unwrap_err();
        assert!(matches!(err, Error::BadIndex { .. }), "{err}");
    }

    /// Index files no job used for 30 days go when a scan writes another beside them; an old
    /// index that is reused is marked used and stays; other files and recent indexes stay.
    #[test]
    fn unused_index_files_are_removed_when_another_is_written() {
        let d = tempfile::tempdir().unwrap();
        let data = scanned_dir(d.path());
        let build = || scan_of(&data);
        let dir = d.path().join("cache");
        let id = OsString::from(format!("dir:{}", data.display()));
        let used = dir.join(Index::file_name("used"));
        load_or_build(&used, id.as_os_str(), false, build).unwrap();
        let stale = dir.join(Index::file_name("gone"));
        let stale_container = dir.join("container-0123456789abcdef.cvidx");
        let recent = dir.join(Index::file_name("recent"));
        let other = dir.join("notes-0123456789abcdef.cvidx");
        for p in [&stale, &stale_container, &recent, &other] {
            fs::write(p, b"x").unwrap();
        }
        let long_ago = SystemTime::now() - UNUSED_FOR - Duration::from_secs(3600);
        for p in [&stale, &stale_container, &other, &used] {
            File::options()
                .write(true)
                .open(p)
                .unwrap()
                .set_modified(long_ago)
                .unwrap();
        }
        let (_, reused) = load_or_build::<Index>(&used, id.as_os_str(), false, || panic!("must not rescan")).unwrap();
        assert!(reused);
        // A scan writes a new index beside them.
        let new = dir.join(Index::file_name("new"));
        let (_, reused) = load_or_build(&new, id.as_os_str(), false, build).unwrap();
        assert!(!reused);
        assert!(!stale.exists() && !stale_container.exists());
        for kept in [&used, &recent, &other, &new] {
            assert!(kept.exists(), "{}", kept.display());
        }
    }

    /// The lock file lives only while a scan holds it; one a killed scanner left is removed by
    /// the next load, and one held now is kept.
    #[test]
    fn index_lock_files_do_not_stay() {
        let d = tempfile::tempdir().unwrap();
        let ip = d.path().join("x.idx");
        let lock = d.path().join("x.idx.lock");
        let held = IndexLock::acquire(&ip).unwrap();
        assert!(lock.exists());
        IndexLock::reclaim(&ip);
        assert!(lock.exists(), "a held lock is kept");
        drop(held);
        assert!(!lock.exists());
        // Left by a killed holder (a file nobody holds): reclaimed.
        secure::open_lock(&lock).unwrap();
        IndexLock::reclaim(&ip);
        assert!(!lock.exists());
    }

    /// Holders removing the file as they go never let two threads in at once.
    #[test]
    fn index_lock_excludes_while_its_file_comes_and_goes() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let d = tempfile::tempdir().unwrap();
        let ip = Arc::new(d.path().join("x.idx"));
        let inside = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (ip, inside) = (ip.clone(), inside.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _l = IndexLock::acquire(&ip).unwrap();
                        assert_eq!(inside.fetch_add(1, Ordering::SeqCst), 0, "two holders at once");
                        std::thread::yield_now();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(!d.path().join("x.idx.lock").exists());
    }

    #[test]
    fn entries_outside_the_root_make_an_index_damaged() {
        for bad in ["../secret", "/etc/shadow", "a/../../b", "./x"] {
            let ix = Index {
                root: PathBuf::from("/data"),
                identity: OsString::from("dir:/data"),
                classes: vec![OsString::from("a")],
                entries: vec![IndexEntry {
                    path: PathBuf::from(bad),
                    size: 1,
                    label: 0,
                }],
                dirs: Vec::new(),
                scan_start_ns: 0,
                built_ns: 0,
            };
            let e = Index::from_bytes(&ix.to_bytes(), Path::new("i")).unwrap_err();
            assert!(matches!(e, Error::BadIndex { .. }), "{bad}: {e}");
        }
    }
}
