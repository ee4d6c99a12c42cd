//! What the container sources (LMDB, HDF5, tar shards) share: an index of records, each a byte
//! range of one of a few large files, built once per node under a file lock and written
//! atomically; and `ContainerSource`, which reads a record with one positioned read (`pread`) of
//! its range, never through a memory map, so that many readers cost no page-fault storms.

use std::ffi::OsStr;
use std::fs::{self, File};
use std::io::ErrorKind;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::index::{
    begin_file, index_file_in, now_ns, open_file, put_bytes, seal_file, Fnv1a, Freshness, IndexFile, Reader,
    RACY_WINDOW_NS,
};
use super::Source;
use crate::error::{Error, Result};

/// Bumped on any change of the stored layout; other versions are rebuilt.
const CONTAINER_INDEX_VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"CVCONTNR";

/// One file of a container, with its size and mtime when indexed (checked at open and per read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerFile {
    /// Absolute path of the file (or directory).
    pub path: PathBuf,
    /// Size in bytes when indexed (not checked for directories).
    pub size: u64,
    /// Modification time when indexed, in ns since the Unix epoch.
    pub mtime_ns: i64,
}

impl ContainerFile {
    /// Stamps the file at `path` as it is now.
    pub fn stat(path: &Path) -> Result<ContainerFile> {
        let m = fs::metadata(path).map_err(|e| Error::io(path, e))?;
        Ok(ContainerFile {
            path: path.to_path_buf(),
            size: m.len(),
            mtime_ns: mtime_ns(&m),
        })
    }
}

/// The `file` of a record that is not a byte range: the container's own library reads it (see
/// [`FallbackReader`]); its `offset` is then the format's locator (for LMDB the value's ordinal
/// among the key's duplicates).
pub const FALLBACK_FILE: u32 = u32::MAX;

/// Reads the records marked [`FALLBACK_FILE`] through the container's own library, for layouts
/// the index pass could not turn into byte ranges.
pub trait FallbackReader: Send + Sync + std::fmt::Debug {
    /// Fills `buf` (exactly the record's `len`) with the record named `name` at `locator`.
    fn read(&self, name: &str, locator: u64, buf: &mut [u8]) -> Result<()>;
}

/// Flag on a record's `file` (below [`FALLBACK_FILE`]): the record's bytes are decoded from
/// stored pieces of `files[file & !DECODED]` by the source's [`RecordDecoder`] (HDF5 filtered or
/// split chunks); `offset` is then the decoder's locator and `len` the decoded length.
pub const DECODED: u32 = 1 << 31;

/// Reads the records flagged [`DECODED`]: their bytes are not one range of the file but are
/// decoded (decompressed, reassembled) from pieces the decoder knows from the index's `aux`.
pub trait RecordDecoder: Send + Sync + std::fmt::Debug {
    /// Fills `buf` (exactly the record's `len`) with the record named `name` (sample `sample`) at
    /// `locator` of `file`, whose open handle (stamp already checked) is `f`.
    fn read(&self, file: &ContainerFile, f: &File, sample: u32, name: &str, locator: u64, buf: &mut [u8])
        -> Result<()>;
}

/// One sample: `len` bytes at `offset` of `files[file]`, with its label and its name in the
/// container (LMDB key, HDF5 dataset and row, tar member); `file` is [`FALLBACK_FILE`] for a
/// record read through the container's library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Index into the container's `files`, or [`FALLBACK_FILE`], or flagged [`DECODED`].
    pub file: u32,
    /// Byte offset of the sample in its file (a locator for fallback and decoded records).
    pub offset: u64,
    /// Length of the sample in bytes.
    pub len: u64,
    /// The sample's integer label.
    pub label: i64,
    /// The sample's name in the container (LMDB key, HDF5 dataset and row, tar member).
    pub name: String,
    /// The sample's shape where the format records one (Caffe Datum c,h,w,encoded).
    pub shape: Vec<u64>,
}

/// The index of one container dataset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerIndex {
    /// `<kind>:<canonical path>` plus the options that change the records; names the index file.
    pub identity: String,
    /// The container's files, stamped when indexed; records point into them by index.
    pub files: Vec<ContainerFile>,
    /// Directories whose entries define the container (tar shard or CosmoFlow directories), with
    /// their mtimes: a file added or removed there changes them.
    pub dirs: Vec<ContainerFile>,
    /// One record per sample, in sample order.
    pub records: Vec<Record>,
    /// Format-specific data the format's [`RecordDecoder`] needs (HDF5: the chunk tables of
    /// filtered or split datasets); empty for plain byte ranges.
    pub aux: Vec<u8>,
    /// Wall clock (ns since the Unix epoch) when the scan began: files modified within
    /// `RACY_WINDOW_NS` of it make the index only racily fresh.
    pub scan_start_ns: i64,
    /// Wall clock (ns since the Unix epoch) when the index was built (0: not yet).
    pub built_ns: i64,
}

impl ContainerIndex {
    /// An empty index for `identity`, its scan starting now.
    pub fn new(identity: String) -> ContainerIndex {
        ContainerIndex {
            identity,
            files: Vec::new(),
            dirs: Vec::new(),
            records: Vec::new(),
            aux: Vec::new(),
            scan_start_ns: now_ns(),
            built_ns: 0,
        }
    }

    /// Stable hash of identity, files and records: equal fingerprints mean equal samples.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv1a::default();
        h.write_str(&self.identity);
        for f in &self.files {
            h.write_os(f.path.as_os_str());
            h.write(&f.size.to_le_bytes());
            h.write(&f.mtime_ns.to_le_bytes());
        }
        h.write(&(self.records.len() as u64).to_le_bytes());
        for r in &self.records {
            h.write(&r.file.to_le_bytes());
            h.write(&r.offset.to_le_bytes());
            h.write(&r.len.to_le_bytes());
            h.write(&r.label.to_le_bytes());
            h.write_str(&r.name);
        }
        if !self.aux.is_empty() {
            h.write(&self.aux);
        }
        h.finish()
    }

    /// Checks that every record lies inside its file (a truncated container, or an index that
    /// does not belong to these files, is `Corrupt` naming the file and the record).
    pub fn validate(&self) -> Result<()> {
        for (k, r) in self.records.iter().enumerate() {
            if r.file == FALLBACK_FILE && !self.files.is_empty() {
                continue;
            }
            let decoded = r.file != FALLBACK_FILE && r.file & DECODED != 0;
            let Some(f) = self.files.get((r.file & !DECODED) as usize) else {
                return Err(Error::Corrupt {
                    path: PathBuf::from(&self.identity),
                    record: format!("{} (sample {k})", r.name),
                    reason: format!("refers to file {} of {}", r.file & !DECODED, self.files.len()),
                });
            };
            if decoded {
                // Its pieces are the decoder's to check (they lie in `aux`).
                continue;
            }
            if r.offset.checked_add(r.len).is_none_or(|end| end > f.size) {
                return Err(Error::Corrupt {
                    path: f.path.clone(),
                    record: format!("{} (sample {k})", r.name),
                    reason: format!(
                        "bytes {}..{} lie past the end of the file ({} bytes): truncated?",
                        r.offset,
                        r.offset.saturating_add(r.len),
                        f.size
                    ),
                });
            }
        }
        Ok(())
    }

    /// The file name of the index for `identity`.
    pub fn file_name(identity: &str) -> String {
        let mut h = Fnv1a::default();
        h.write(identity.as_bytes());
        format!("container-{:016x}.cvidx", h.finish())
    }

    /// Binary layout, integers little-endian: magic, u32 version, identity, files and dirs (u64
    /// count; path, u64 size, i64 mtime each), records (u64 count; u32 file, u64 offset, u64 len,
    /// i64 label, name, u8 shape rank and u64 dims each), aux (u64 length + bytes), i64 scan
    /// start and end, then a u64 FNV-1a of everything before it. Strings and paths are u32
    /// length + bytes as the OS gives them (a path need not be UTF-8).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut w = begin_file(MAGIC, CONTAINER_INDEX_VERSION, 128 + self.records.len() * 48);
        put_bytes(&mut w, self.identity.as_bytes());
        for list in [&self.files, &self.dirs] {
            w.extend_from_slice(&(list.len() as u64).to_le_bytes());
            for f in list {
                put_bytes(&mut w, f.path.as_os_str().as_bytes());
                w.extend_from_slice(&f.size.to_le_bytes());
                w.extend_from_slice(&f.mtime_ns.to_le_bytes());
            }
        }
        w.extend_from_slice(&(self.records.len() as u64).to_le_bytes());
        for r in &self.records {
            w.extend_from_slice(&r.file.to_le_bytes());
            w.extend_from_slice(&r.offset.to_le_bytes());
            w.extend_from_slice(&r.len.to_le_bytes());
            w.extend_from_slice(&r.label.to_le_bytes());
            put_bytes(&mut w, r.name.as_bytes());
            w.push(r.shape.len().min(255) as u8);
            for d in r.shape.iter().take(255) {
                w.extend_from_slice(&d.to_le_bytes());
            }
        }
        w.extend_from_slice(&(self.aux.len() as u64).to_le_bytes());
        w.extend_from_slice(&self.aux);
        w.extend_from_slice(&self.scan_start_ns.to_le_bytes());
        w.extend_from_slice(&self.built_ns.to_le_bytes());
        seal_file(w)
    }

    /// Parses what [`to_bytes`](Self::to_bytes) wrote; damage is `BadIndex` naming `index`.
    pub fn from_bytes(bytes: &[u8], index: &Path) -> Result<ContainerIndex> {
        let bad = |reason: &str| Error::BadIndex {
            index: index.to_path_buf(),
            reason: reason.to_string(),
        };
        let mut r = open_file(bytes, index, MAGIC, CONTAINER_INDEX_VERSION, "a container index")?;
        let parse = |r: &mut Reader| -> Option<ContainerIndex> {
            let identity = String::from_utf8(r.bytes()?.to_vec()).ok()?;
            let mut lists = [Vec::new(), Vec::new()];
            for list in &mut lists {
                for _ in 0..r.count(20)? {
                    list.push(ContainerFile {
                        path: PathBuf::from(OsStr::from_bytes(r.bytes()?)),
                        size: r.u64()?,
                        mtime_ns: r.u64()? as i64,
                    });
                }
            }
            let [files, dirs] = lists;
            let n = r.count(33)?;
            let mut records = Vec::with_capacity(n);
            for _ in 0..n {
                let file = r.u32()?;
                let offset = r.u64()?;
                let len = r.u64()?;
                let label = r.u64()? as i64;
                let name = String::from_utf8(r.bytes()?.to_vec()).ok()?;
                let rank = r.take(1)?[0] as usize;
                let shape = (0..rank).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
                records.push(Record {
                    file,
                    offset,
                    len,
                    label,
                    name,
                    shape,
                });
            }
            let aux_len = r.count(1)?;
            let aux = r.take(aux_len)?.to_vec();
            let scan_start_ns = r.u64()? as i64;
            let built_ns = r.u64()? as i64;
            (r.pos == r.buf.len()).then_some(ContainerIndex {
                identity,
                files,
                dirs,
                records,
                aux,
                scan_start_ns,
                built_ns,
            })
        };
        parse(&mut r).ok_or_else(|| bad("is malformed (lengths do not add up)"))
    }

    /// Whether every recorded file and directory is as it was when indexed.
    pub fn freshness(&self) -> Freshness {
        let mut fresh = Freshness::Fresh;
        for f in self.files.iter().chain(&self.dirs) {
            match fs::metadata(&f.path) {
                Ok(m) if (f.path.is_dir() || m.len() == f.size) && mtime_ns(&m) == f.mtime_ns => {
                    if f.mtime_ns > self.scan_start_ns.saturating_sub(RACY_WINDOW_NS) {
                        fresh = Freshness::Racy;
                    }
                }
                _ => return Freshness::Stale,
            }
        }
        fresh
    }
}

impl IndexFile for ContainerIndex {
    type Identity = str;
    fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        ContainerIndex::from_bytes(bytes, path)
    }
    fn to_bytes(&self) -> Vec<u8> {
        ContainerIndex::to_bytes(self)
    }
    fn identity(&self) -> &str {
        &self.identity
    }
    fn describe(identity: &str) -> String {
        identity.to_string()
    }
    fn freshness(&self) -> Freshness {
        ContainerIndex::freshness(self)
    }
    fn built_ns(&self) -> i64 {
        self.built_ns
    }
    /// A container's scanner is format code: check that it built the index asked for and that
    /// every record lies within its file, then stamp the build time.
    fn seal(&mut self, identity: &str) -> Result<()> {
        if self.identity != identity {
            return Err(Error::config(
                "index",
                format!("built for {}, expected {identity}", self.identity),
            ));
        }
        self.validate()?;
        self.built_ns = now_ns();
        Ok(())
    }
}

pub(crate) fn mtime_ns(m: &fs::Metadata) -> i64 {
    m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec())
}

/// Where the index of a container lives: `index_path` if given, else in `index_dir` (default:
/// [`default_index_dir`](super::index::default_index_dir)).
pub fn container_index_path(identity: &str, index_dir: Option<&Path>, index_path: Option<&Path>) -> Result<PathBuf> {
    match index_path {
        Some(p) => Ok(p.to_path_buf()),
        None => index_file_in(index_dir, ContainerIndex::file_name(identity)),
    }
}

/// Loads the index at `path` for `identity` while it is fresh, else runs `build` under the lock,
/// validates and saves its result (the one path of every index file,
/// `index::load_or_build`). Returns the index and whether it was reused.
pub fn load_or_build_container(
    path: &Path,
    identity: &str,
    explicit: bool,
    build: impl FnOnce() -> Result<ContainerIndex>,
) -> Result<(ContainerIndex, bool)> {
    super::index::load_or_build(path, identity, explicit, build)
}

/// The records of a source, column-wise with names in one string: about 40 bytes plus the name
/// per record rather than three heap allocations (ImageNet's 1.28 M records in about 80 MB).
#[derive(Debug, Default)]
struct Table {
    file: Vec<u32>,
    offset: Vec<u64>,
    len: Vec<u64>,
    label: Vec<i64>,
    name_end: Vec<u64>,
    names: String,
    /// Per record the end of its dimensions in `dims` (empty when no record has a shape).
    dim_end: Vec<u32>,
    dims: Vec<u32>,
}

impl Table {
    fn from_records(records: Vec<Record>) -> Table {
        let n = records.len();
        let mut t = Table {
            file: Vec::with_capacity(n),
            offset: Vec::with_capacity(n),
            len: Vec::with_capacity(n),
            label: Vec::with_capacity(n),
            name_end: Vec::with_capacity(n),
            ..Table::default()
        };
        let shaped = records.iter().any(|r| !r.shape.is_empty());
        for r in records {
            t.file.push(r.file);
            t.offset.push(r.offset);
            t.len.push(r.len);
            t.label.push(r.label);
            t.names.push_str(&r.name);
            t.name_end.push(t.names.len() as u64);
            if shaped {
                t.dims.extend(r.shape.iter().map(|&d| d.min(u32::MAX as u64) as u32));
                t.dim_end.push(t.dims.len() as u32);
            }
        }
        t.names.shrink_to_fit();
        t
    }

    fn name(&self, k: usize) -> &str {
        let start = if k == 0 { 0 } else { self.name_end[k - 1] as usize };
        &self.names[start..self.name_end[k] as usize]
    }

    fn shape(&self, k: usize) -> Vec<u64> {
        if self.dim_end.is_empty() {
            return Vec::new();
        }
        let start = if k == 0 { 0 } else { self.dim_end[k - 1] as usize };
        self.dims[start..self.dim_end[k] as usize]
            .iter()
            .map(|&d| d as u64)
            .collect()
    }
}

/// A dataset whose samples are byte ranges of a few container files.
#[derive(Debug)]
pub struct ContainerSource {
    /// Files, directories and identity; its records live in `table`.
    index: ContainerIndex,
    table: Table,
    index_path: Option<PathBuf>,
    reused: bool,
    fingerprint: u64,
    handles: Vec<OnceLock<File>>,
    /// Reads the [`FALLBACK_FILE`] records, and how many reads went through it.
    fallback: Option<Box<dyn FallbackReader>>,
    fallback_reads: AtomicU64,
    /// Reads the [`DECODED`] records.
    decoder: Option<Box<dyn RecordDecoder>>,
}

impl ContainerSource {
    /// Wraps a (validated) index; `index_path` is where it is stored.
    pub fn new(mut index: ContainerIndex, index_path: Option<PathBuf>, reused: bool) -> ContainerSource {
        let fingerprint = index.fingerprint();
        let handles = (0..index.files.len()).map(|_| OnceLock::new()).collect();
        let table = Table::from_records(std::mem::take(&mut index.records));
        ContainerSource {
            index,
            table,
            index_path,
            reused,
            fingerprint,
            handles,
            fallback: None,
            fallback_reads: AtomicU64::new(0),
            decoder: None,
        }
    }

    /// Sets the reader of the records marked [`FALLBACK_FILE`].
    pub fn with_fallback(mut self, reader: Box<dyn FallbackReader>) -> ContainerSource {
        self.fallback = Some(reader);
        self
    }

    /// Sets the reader of the records flagged [`DECODED`].
    pub fn with_decoder(mut self, decoder: Box<dyn RecordDecoder>) -> ContainerSource {
        self.decoder = Some(decoder);
        self
    }

    /// How many records are read through the container's library rather than by byte range.
    pub fn fallback_records(&self) -> usize {
        self.table.file.iter().filter(|&&f| f == FALLBACK_FILE).count()
    }

    /// How many reads of this source went through the container's library so far.
    pub fn fallback_reads(&self) -> u64 {
        self.fallback_reads.load(Ordering::Relaxed)
    }

    /// Opens (or builds) the index of `identity` at `index_path` and wraps it.
    pub fn open(
        identity: &str,
        index_dir: Option<&Path>,
        index_path: Option<&Path>,
        build: impl FnOnce() -> Result<ContainerIndex>,
    ) -> Result<ContainerSource> {
        let path = container_index_path(identity, index_dir, index_path)?;
        let (ix, reused) = load_or_build_container(&path, identity, index_path.is_some(), build)?;
        Ok(ContainerSource::new(ix, Some(path), reused))
    }

    /// The container's identity, files and directories (its records are not kept here: see
    /// [`record`](Self::record)).
    pub fn index(&self) -> &ContainerIndex {
        &self.index
    }

    /// Where the index is stored (None: kept in memory only).
    pub fn index_path(&self) -> Option<&Path> {
        self.index_path.as_deref()
    }

    /// True when the index was loaded from disk rather than built by this open.
    pub fn index_was_reused(&self) -> bool {
        self.reused
    }

    /// The record behind `sample`.
    pub fn record(&self, sample: u32) -> Record {
        let k = sample as usize;
        Record {
            file: self.table.file[k],
            offset: self.table.offset[k],
            len: self.table.len[k],
            label: self.table.label[k],
            name: self.table.name(k).to_string(),
            shape: self.table.shape(k),
        }
    }

    fn index_name(&self) -> PathBuf {
        self.index_path.clone().unwrap_or_else(|| PathBuf::from("(in memory)"))
    }

    fn changed(&self, f: &ContainerFile, sample: u32, reason: String) -> Error {
        Error::Changed {
            path: f.path.clone(),
            index: self.index_name(),
            reason: format!(
                "record {} (sample {sample}): {reason}",
                self.table.name(sample as usize)
            ),
        }
    }

    /// A read through the container's library: the first file's stamp is checked, as for byte
    /// ranges, then the reader fills `buf`.
    fn read_fallback(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        let k = sample as usize;
        let cf = &self.index.files[0];
        let Some(reader) = &self.fallback else {
            return Err(Error::Corrupt {
                path: cf.path.clone(),
                record: format!("{} (sample {sample})", self.table.name(k)),
                reason: "the index marks this record for the library fallback, which this source does not have".into(),
            });
        };
        let m = fs::metadata(&cf.path).map_err(|e| Error::io(&cf.path, e))?;
        if m.len() != cf.size || mtime_ns(&m) != cf.mtime_ns {
            return Err(self.changed(
                cf,
                sample,
                format!(
                    "the container changed after indexing (indexed {} bytes, now {})",
                    cf.size,
                    m.len()
                ),
            ));
        }
        self.fallback_reads.fetch_add(1, Ordering::Relaxed);
        reader.read(self.table.name(k), self.table.offset[k], buf)
    }

    /// The open handle of file `k`, opened on first use and checked against its stamp.
    fn handle(&self, k: usize, sample: u32) -> Result<&File> {
        if let Some(f) = self.handles[k].get() {
            return Ok(f);
        }
        let cf = &self.index.files[k];
        let f = File::open(&cf.path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => Error::NotFound {
                sample: sample as u64,
                path: cf.path.clone(),
            },
            _ => Error::io(&cf.path, e),
        })?;
        let _ = self.handles[k].set(f);
        Ok(self.handles[k].get().expect("just set"))
    }
}

impl Source for ContainerSource {
    fn len(&self) -> usize {
        self.table.len.len()
    }

    fn size(&self, sample: u32) -> u64 {
        self.table.len[sample as usize]
    }

    fn label(&self, sample: u32) -> i64 {
        self.table.label[sample as usize]
    }

    /// `<container file>#<record name>`.
    fn path(&self, sample: u32) -> PathBuf {
        let k = sample as usize;
        let file = match self.table.file[k] {
            FALLBACK_FILE => 0,
            f => (f & !DECODED) as usize,
        };
        let mut p = self.index.files[file].path.as_os_str().to_owned();
        p.push("#");
        p.push(self.table.name(k));
        PathBuf::from(p)
    }

    fn read_into(&self, sample: u32, buf: &mut [u8]) -> Result<()> {
        let k = sample as usize;
        if self.table.file[k] == FALLBACK_FILE {
            return self.read_fallback(sample, buf);
        }
        let decoded = self.table.file[k] & DECODED != 0;
        let file = (self.table.file[k] & !DECODED) as usize;
        let (offset, len) = (self.table.offset[k], self.table.len[k]);
        let cf = &self.index.files[file];
        let f = self.handle(file, sample)?;
        // One fstat per read: a container rewritten in place (size or mtime) is never read as if
        // it were the indexed one.
        let m = f.metadata().map_err(|e| Error::io(&cf.path, e))?;
        if m.len() != cf.size || mtime_ns(&m) != cf.mtime_ns {
            return Err(self.changed(
                cf,
                sample,
                format!(
                    "the container changed after indexing (indexed {} bytes, now {})",
                    cf.size,
                    m.len()
                ),
            ));
        }
        if decoded {
            let Some(decoder) = &self.decoder else {
                return Err(Error::Corrupt {
                    path: cf.path.clone(),
                    record: format!("{} (sample {sample})", self.table.name(k)),
                    reason: "the index marks this record as decoded from stored pieces, which this source cannot do"
                        .into(),
                });
            };
            return decoder.read(cf, f, sample, self.table.name(k), offset, buf);
        }
        let mut filled = 0usize;
        while filled < buf.len() {
            match f.read_at(&mut buf[filled..], offset + filled as u64) {
                Ok(0) => {
                    return Err(Error::Corrupt {
                        path: cf.path.clone(),
                        record: format!("{} (sample {sample})", self.table.name(k)),
                        reason: format!(
                            "the file ends {filled} bytes into the record of {len} bytes at offset {offset}"
                        ),
                    })
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&cf.path, e)),
            }
        }
        Ok(())
    }

    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// A name as text: UTF-8 as is, anything else as `0x` and hex digits (LMDB keys are bytes).
pub fn display_name(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if !s.contains('\0') => s.to_string(),
        _ => {
            let mut s = String::from("0x");
            for b in bytes {
                s.push_str(&format!("{b:02x}"));
            }
            s
        }
    }
}

/// Canonical absolute path of a container, as it goes into identities.
pub(crate) fn canonical(path: &Path) -> Result<PathBuf> {
    fs::canonicalize(path).map_err(|e| match e.kind() {
        ErrorKind::NotFound => Error::NotFound {
            sample: 0,
            path: path.to_path_buf(),
        },
        _ => Error::io(path, e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dir: &Path) -> ContainerIndex {
        let p = dir.join("blob");
        fs::write(&p, b"hello world").unwrap();
        let mut ix = ContainerIndex::new(format!("test:{}", p.display()));
        ix.files.push(ContainerFile::stat(&p).unwrap());
        for (k, (o, l)) in [(0u64, 5u64), (6, 5)].into_iter().enumerate() {
            ix.records.push(Record {
                file: 0,
                offset: o,
                len: l,
                label: k as i64,
                name: format!("r{k}"),
                shape: vec![],
            });
        }
        ix
    }

    #[test]
    fn round_trip_and_every_damage_detected() {
        use std::os::unix::ffi::OsStringExt;
        let d = tempfile::tempdir().unwrap();
        let mut ix = sample(d.path());
        // Paths need not be UTF-8; shapes round-trip.
        ix.dirs.push(ContainerFile {
            path: PathBuf::from(std::ffi::OsString::from_vec(b"/caf\xe9".to_vec())),
            size: 0,
            mtime_ns: -3,
        });
        ix.records[0].shape = vec![3, 256, 256, 0];
        ix.aux = b"chunk table".to_vec();
        let b = ix.to_bytes();
        assert_eq!(ContainerIndex::from_bytes(&b, Path::new("x")).unwrap(), ix);
        for n in 0..b.len() {
            assert!(
                ContainerIndex::from_bytes(&b[..n], Path::new("x")).is_err(),
                "truncated to {n}"
            );
        }
        for i in 0..b.len() {
            let mut flipped = b.clone();
            flipped[i] ^= 0x10;
            assert!(
                matches!(
                    ContainerIndex::from_bytes(&flipped, Path::new("x")),
                    Err(Error::BadIndex { .. })
                ),
                "flip at {i}"
            );
        }
    }

    #[test]
    fn reads_ranges_and_detects_truncation() {
        let d = tempfile::tempdir().unwrap();
        let ix = sample(d.path());
        ix.validate().unwrap();
        let src = ContainerSource::new(ix.clone(), None, false);
        let mut buf = [0u8; 5];
        src.read_into(1, &mut buf).unwrap();
        assert_eq!(&buf, b"world");
        assert!(src.path(1).to_str().unwrap().ends_with("blob#r1"));
        let mut bad = ix;
        bad.records[1].len = 50;
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("blob") && err.contains("r1"), "{err}");
    }

    /// A container index goes through the one load-or-build path of every index file: built
    /// once, reused while fresh, sealed (identity, record ranges, build time) before it is saved,
    /// and an explicitly named index of another dataset is refused.
    #[test]
    fn load_or_build_reuses_checks_and_refuses_foreign_indexes() {
        let d = tempfile::tempdir().unwrap();
        let id = sample(d.path()).identity;
        let path = container_index_path(&id, Some(&d.path().join("ix")), None).unwrap();
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            ContainerIndex::file_name(&id)
        );
        // The blob was just written: its mtime is racy, so wait for the index to be fresh by
        // building with a scan start well after it.
        let build = || {
            let mut ix = sample(d.path());
            ix.scan_start_ns = now_ns() + 3 * RACY_WINDOW_NS;
            Ok(ix)
        };
        let (a, reused) = load_or_build_container(&path, &id, false, build).unwrap();
        assert!(!reused && a.built_ns > 0);
        let (b, reused) = load_or_build_container(&path, &id, false, || panic!("must not rebuild")).unwrap();
        assert!(reused);
        assert_eq!(a, b);
        let e = load_or_build_container(&path, "test:/elsewhere", true, build).unwrap_err();
        assert!(
            matches!(&e, Error::BadIndex { reason, .. } if reason.contains("another dataset")),
            "{e}"
        );
        // Not explicit: an index of another dataset at the path is rebuilt; what the build gives
        // is checked before it is saved.
        let e = load_or_build_container(&path, "test:/elsewhere", false, build).unwrap_err();
        assert!(matches!(&e, Error::Config { key, .. } if key == "index"), "{e}");
        let bad = || {
            let mut ix = sample(d.path());
            ix.records[1].len = 50;
            Ok(ix)
        };
        let other = d.path().join("ix").join("other");
        assert!(load_or_build_container(&other, &id, false, bad).is_err());
        assert!(!other.exists(), "an index that fails its checks is not saved");
    }
}
