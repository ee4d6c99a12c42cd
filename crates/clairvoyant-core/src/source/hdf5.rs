//! HDF5 datasets, read without the HDF5 library or its global lock.
//!
//! Where a dataset is contiguous, or chunked without filters with chunks spanning whole samples,
//! each sample (one slab along the leading axis, or one dataset of a per-sample file as in
//! CosmoFlow) is a byte range of the file, read with one `pread`. Where it is not (chunks filtered
//! with deflate, shuffle or fletcher32; chunks that split a sample), the index keeps the
//! dataset's chunk table ([`ChunkedDataset`]: each stored chunk's file offset, stored size,
//! filter mask and position) and [`ChunkDecoder`] reads a sample by `pread`ing the chunks it
//! overlaps, undoing their filters in Rust and copying the sample's part out of each. Any number
//! of threads and processes read at once. Both are found at indexing time by the caller (the
//! Python package uses h5py, whose wheels carry libhdf5, so no system HDF5 is needed).

use std::collections::VecDeque;
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::container::{canonical, ContainerFile, ContainerIndex, ContainerSource, Record, RecordDecoder, DECODED};
use super::index::Reader;
use crate::error::{Error, Result};

/// HDF5 filter ids (`H5Zpublic.h`) this reader undoes.
pub const FILTER_DEFLATE: u32 = 1;
/// HDF5 filter id of the byte shuffle (bytes of each element grouped by significance).
pub const FILTER_SHUFFLE: u32 = 2;
/// HDF5 filter id of the Fletcher-32 checksum appended to each chunk.
pub const FILTER_FLETCHER32: u32 = 3;

/// Where the samples of an HDF5 dataset lie: the files, the directories whose listing defines
/// them (CosmoFlow), one record per sample (`file` indexes `files`), and the chunk tables of the
/// datasets whose samples are decoded (records made by [`decoded_record`]).
#[derive(Clone, Debug, Default)]
pub struct Hdf5Layout {
    /// The HDF5 files holding the samples.
    pub files: Vec<PathBuf>,
    /// Directories whose listing defines the files (CosmoFlow); empty otherwise.
    pub dirs: Vec<PathBuf>,
    /// One record per sample, in sample order.
    pub records: Vec<Record>,
    /// The chunked datasets whose samples are decoded from their chunks.
    pub chunked: Vec<ChunkedDataset>,
}

/// One filter of a dataset's pipeline, in the order HDF5 applied it when writing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The HDF5 filter id (see [`FILTER_DEFLATE`] and the others).
    pub id: u32,
    /// The filter's client data (`cd_values`; shuffle: the element size).
    pub params: Vec<u32>,
}

/// One stored chunk: `size` bytes at `offset` of the file; bit `i` of `mask` set means filter
/// `i` of the pipeline was skipped for it; `coords` is its first element's position.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredChunk {
    /// Byte offset of the stored (filtered) chunk in the file.
    pub offset: u64,
    /// Stored size of the chunk in bytes, after its filters.
    pub size: u64,
    /// Filter mask: bit `i` set means filter `i` of the pipeline was skipped for this chunk.
    pub mask: u32,
    /// Position of the chunk's first element, one coordinate per dimension.
    pub coords: Vec<u64>,
}

/// A chunked dataset whose samples are decoded from its chunks (`file` indexes the layout's
/// files). Every chunk must be stored (no fill-value chunks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkedDataset {
    /// Index of the dataset's file in the layout's `files`.
    pub file: u32,
    /// The dataset's path inside its HDF5 file.
    pub name: String,
    /// The dataset's shape in elements (the leading axis indexes samples).
    pub shape: Vec<u64>,
    /// The chunk shape in elements, one entry per dimension.
    pub chunk: Vec<u64>,
    /// Bytes per element.
    pub itemsize: u32,
    /// The filter pipeline, in the order HDF5 applied it when writing.
    pub filters: Vec<Filter>,
    /// Every stored chunk of the dataset.
    pub chunks: Vec<StoredChunk>,
}

impl ChunkedDataset {
    /// Bytes of one row (one index along the leading axis).
    pub fn row_bytes(&self) -> u64 {
        self.itemsize as u64 * self.shape.iter().skip(1).product::<u64>()
    }

    /// Bytes of one decoded chunk (edge chunks are stored whole too).
    fn chunk_bytes(&self) -> u64 {
        self.itemsize as u64 * self.chunk.iter().product::<u64>()
    }

    fn where_(&self, files: &[ContainerFile]) -> String {
        let f = files.get(self.file as usize).map(|f| f.path.display().to_string());
        format!("dataset '{}' of {}", self.name, f.unwrap_or_default())
    }

    /// Shapes agree, chunks lie inside the file, every filter is one this reader undoes.
    fn check(&self, files: &[ContainerFile]) -> Result<()> {
        let Some(f) = files.get(self.file as usize) else {
            return Err(Error::config(
                "layout",
                format!(
                    "dataset {:?} refers to file {} of {}",
                    self.name,
                    self.file,
                    files.len()
                ),
            ));
        };
        self.check_shape(files)?;
        self.check_filters(files)?;
        self.check_chunks(f, files)
    }

    /// Shape, chunk shape and item size fit together.
    fn check_shape(&self, files: &[ContainerFile]) -> Result<()> {
        let rank = self.shape.len();
        if rank == 0 || self.chunk.len() != rank || self.chunk.contains(&0) || self.itemsize == 0 {
            return Err(Error::config(
                "layout",
                format!(
                    "{}: shape {:?}, chunks {:?}, item size {} do not fit",
                    self.where_(files),
                    self.shape,
                    self.chunk,
                    self.itemsize
                ),
            ));
        }
        Ok(())
    }

    /// Every filter is one this reader undoes.
    fn check_filters(&self, files: &[ContainerFile]) -> Result<()> {
        for flt in &self.filters {
            if ![FILTER_DEFLATE, FILTER_SHUFFLE, FILTER_FLETCHER32].contains(&flt.id) {
                return Err(Error::config(
                    "dataset",
                    format!(
                        "{} uses HDF5 filter {} ({}), which clairvoyant does not decode (it reads deflate/gzip, \
                         shuffle and fletcher32); rewrite it, e.g. `h5repack -f NONE in.h5 out.h5` or \
                         `h5repack -f GZIP=4 in.h5 out.h5`",
                        self.where_(files),
                        flt.id,
                        filter_name(flt.id)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Every chunk is stored, on the chunk grid, and inside file `f`.
    fn check_chunks(&self, f: &ContainerFile, files: &[ContainerFile]) -> Result<()> {
        let expected: u64 = self
            .shape
            .iter()
            .zip(&self.chunk)
            .map(|(s, c)| s.div_ceil(*c))
            .product();
        if self.chunks.len() as u64 != expected {
            return Err(Error::config(
                "dataset",
                format!(
                    "{} has {} of its {expected} chunks stored (the others were never written)",
                    self.where_(files),
                    self.chunks.len()
                ),
            ));
        }
        for c in &self.chunks {
            let inside = c.coords.len() == self.shape.len()
                && c.coords.iter().zip(&self.chunk).all(|(x, n)| x.is_multiple_of(*n))
                && c.coords.iter().zip(&self.shape).all(|(x, s)| x < s);
            if !inside {
                return Err(Error::config(
                    "layout",
                    format!(
                        "{}: a chunk at {:?} is not on the chunk grid",
                        self.where_(files),
                        c.coords
                    ),
                ));
            }
            if c.offset.checked_add(c.size).is_none_or(|end| end > f.size) {
                return Err(Error::Corrupt {
                    path: f.path.clone(),
                    record: format!("{} chunk {:?}", self.name, c.coords),
                    reason: format!(
                        "bytes {}..{} lie past the end of the file ({} bytes): truncated?",
                        c.offset,
                        c.offset.saturating_add(c.size),
                        f.size
                    ),
                });
            }
        }
        Ok(())
    }
}

fn filter_name(id: u32) -> &'static str {
    match id {
        4 => "szip",
        5 => "nbit",
        6 => "scaleoffset",
        32000 => "lzf",
        32001 => "blosc",
        32004 => "lz4",
        32008 => "bitshuffle",
        32015 => "zstd",
        _ => "unknown",
    }
}

/// Bits of a decoded record's locator that hold the first row; the rest is the dataset's index.
const ROW_BITS: u32 = 40;

/// The record of `len` bytes starting at row `first_row` of `chunked[dataset]` (in file `file`):
/// read by decoding chunks, not as a byte range.
pub fn decoded_record(file: u32, dataset: u32, first_row: u64, len: u64, label: i64, name: String) -> Record {
    Record {
        file: file | DECODED,
        offset: ((dataset as u64) << ROW_BITS) | first_row,
        len,
        label,
        name,
        shape: vec![],
    }
}

/// A layout as a caller that walks the file gathers it (the Python package, with h5py): the
/// files and directories, then one column per record field: its file index, offset, length,
/// label, name and `via` (negative: the record is a byte range; else it is `len` bytes from row
/// `offset` of `chunked[via]`), then the chunked datasets.
#[derive(Clone, Debug, Default)]
pub struct LayoutColumns {
    /// The HDF5 files.
    pub files: Vec<PathBuf>,
    /// The directories whose listing defines the files (CosmoFlow).
    pub dirs: Vec<PathBuf>,
    /// Per record: the index of its file in `files`.
    pub file: Vec<u32>,
    /// Per record: its byte offset in the file, or its first row in `chunked[via]`.
    pub offset: Vec<u64>,
    /// Per record: its length in bytes.
    pub len: Vec<u64>,
    /// Per record: its label.
    pub label: Vec<i64>,
    /// Per record: its name.
    pub name: Vec<String>,
    /// Per record: negative for a byte range, else the chunked dataset it is decoded from.
    pub via: Vec<i64>,
    /// The chunked datasets records are decoded from.
    pub chunked: Vec<ChunkedDataset>,
}

impl LayoutColumns {
    /// The layout, one record per row; every column must have one entry per record (errors name
    /// `layout` and the column).
    pub fn into_layout(self) -> Result<Hdf5Layout> {
        let n = self.file.len();
        let lengths = [
            ("offset", self.offset.len()),
            ("len", self.len.len()),
            ("label", self.label.len()),
            ("name", self.name.len()),
            ("via", self.via.len()),
        ];
        if let Some((column, m)) = lengths.iter().find(|(_, m)| *m != n) {
            return Err(Error::config(
                "layout",
                format!("record columns differ in length: {m} {column} values for {n} records"),
            ));
        }
        let records = (0..n)
            .map(|k| {
                let (file, offset, len, label) = (self.file[k], self.offset[k], self.len[k], self.label[k]);
                let name = self.name[k].clone();
                match u32::try_from(self.via[k]) {
                    Ok(d) => decoded_record(file, d, offset, len, label, name),
                    Err(_) => Record {
                        file,
                        offset,
                        len,
                        label,
                        name,
                        shape: vec![],
                    },
                }
            })
            .collect();
        Ok(Hdf5Layout {
            files: self.files,
            dirs: self.dirs,
            records,
            chunked: self.chunked,
        })
    }
}

/// Opens the HDF5 dataset at `path` (a file, or a directory of per-sample files); `options`
/// (dataset names, label dataset) are part of its identity. `layout` runs only when the index
/// must be (re)built: once per node, under the index lock.
pub fn hdf5(
    path: &Path,
    options: &str,
    index_dir: Option<&Path>,
    index_path: Option<&Path>,
    layout: impl FnOnce() -> Result<Hdf5Layout>,
) -> Result<ContainerSource> {
    let identity = format!("hdf5:{}:{options}", canonical(path)?.display());
    let src = ContainerSource::open(&identity, index_dir, index_path, || {
        let mut ix = ContainerIndex::new(identity.clone());
        let l = layout()?;
        for d in &l.dirs {
            ix.dirs.push(ContainerFile::stat(&canonical(d)?)?);
        }
        for f in &l.files {
            ix.files.push(ContainerFile::stat(&canonical(f)?)?);
        }
        for d in &l.chunked {
            d.check(&ix.files)?;
        }
        for (k, r) in l.records.iter().enumerate() {
            if r.file & DECODED == 0 {
                continue;
            }
            let fits = l.chunked.get((r.offset >> ROW_BITS) as usize).is_some_and(|d| {
                let (row, rb) = (r.offset & ((1 << ROW_BITS) - 1), d.row_bytes());
                d.file == r.file & !DECODED && rb > 0 && r.len.is_multiple_of(rb) && row + r.len / rb <= d.shape[0]
            });
            if !fits {
                return Err(Error::config(
                    "layout",
                    format!(
                        "record {} (sample {k}) does not fit the chunked dataset it refers to",
                        r.name
                    ),
                ));
            }
        }
        if !l.chunked.is_empty() {
            ix.aux = encode_chunked(&l.chunked);
        }
        ix.records = l.records;
        Ok(ix)
    })?;
    if src.index().aux.is_empty() {
        return Ok(src);
    }
    let at = src.index_path().map(Path::to_path_buf).unwrap_or_default();
    let datasets = decode_chunked(&src.index().aux).ok_or_else(|| Error::BadIndex {
        index: at,
        reason: "holds a chunk table this version cannot read".into(),
    })?;
    for d in &datasets {
        d.check(&src.index().files)?;
    }
    let decoder = ChunkDecoder::new(datasets);
    Ok(src.with_decoder(Box::new(decoder)))
}

/// Records of `rows` samples of `row_bytes` each, stored contiguously from `offset` of file
/// `file`, named `<dataset>[<row>]`.
pub fn contiguous_rows(
    file: u32,
    dataset: &str,
    offset: u64,
    rows: u64,
    row_bytes: u64,
    labels: &[i64],
) -> Vec<Record> {
    (0..rows)
        .map(|k| Record {
            file,
            offset: offset + k * row_bytes,
            len: row_bytes,
            label: labels.get(k as usize).copied().unwrap_or(0),
            name: format!("{dataset}[{k}]"),
            shape: vec![],
        })
        .collect()
}

const AUX_MAGIC: &[u8; 4] = b"H5CK";

/// The chunk tables as the index's `aux`: magic, u64 count; per dataset u32 file, name, u8 rank,
/// shape and chunk (u64 each), u32 item size, u8 filter count (u32 id, u8 count, u32 params),
/// u64 chunk count (u64 offset, u64 size, u32 mask, u64 coords each). Little-endian.
fn encode_chunked(ds: &[ChunkedDataset]) -> Vec<u8> {
    let mut w = AUX_MAGIC.to_vec();
    let u32_ = |w: &mut Vec<u8>, v: u32| w.extend_from_slice(&v.to_le_bytes());
    let u64_ = |w: &mut Vec<u8>, v: u64| w.extend_from_slice(&v.to_le_bytes());
    u64_(&mut w, ds.len() as u64);
    for d in ds {
        u32_(&mut w, d.file);
        super::index::put_bytes(&mut w, d.name.as_bytes());
        w.push(d.shape.len() as u8);
        for &v in d.shape.iter().chain(&d.chunk) {
            u64_(&mut w, v);
        }
        u32_(&mut w, d.itemsize);
        w.push(d.filters.len() as u8);
        for f in &d.filters {
            u32_(&mut w, f.id);
            w.push(f.params.len() as u8);
            for &p in &f.params {
                u32_(&mut w, p);
            }
        }
        u64_(&mut w, d.chunks.len() as u64);
        for c in &d.chunks {
            u64_(&mut w, c.offset);
            u64_(&mut w, c.size);
            u32_(&mut w, c.mask);
            for &x in &c.coords {
                u64_(&mut w, x);
            }
        }
    }
    w
}

fn decode_chunked(aux: &[u8]) -> Option<Vec<ChunkedDataset>> {
    if aux.get(..4)? != AUX_MAGIC {
        return None;
    }
    let mut r = Reader { buf: aux, pos: 4 };
    let n = r.count(16)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let file = r.u32()?;
        let name = String::from_utf8(r.bytes()?.to_vec()).ok()?;
        let rank = r.take(1)?[0] as usize;
        let shape = (0..rank).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
        let chunk = (0..rank).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
        let itemsize = r.u32()?;
        let nf = r.take(1)?[0] as usize;
        let mut filters = Vec::with_capacity(nf);
        for _ in 0..nf {
            let id = r.u32()?;
            let np = r.take(1)?[0] as usize;
            let params = (0..np).map(|_| r.u32()).collect::<Option<Vec<_>>>()?;
            filters.push(Filter { id, params });
        }
        let nc = r.count(20 + 8 * rank as u64)?;
        let mut chunks = Vec::with_capacity(nc);
        for _ in 0..nc {
            let offset = r.u64()?;
            let size = r.u64()?;
            let mask = r.u32()?;
            let coords = (0..rank).map(|_| r.u64()).collect::<Option<Vec<_>>>()?;
            chunks.push(StoredChunk {
                offset,
                size,
                mask,
                coords,
            });
        }
        out.push(ChunkedDataset {
            file,
            name,
            shape,
            chunk,
            itemsize,
            filters,
            chunks,
        });
    }
    (r.pos == aux.len()).then_some(out)
}

/// Decoded chunks kept per process: at most this many, and at most [`CACHE_BYTES`] in all. Only
/// chunks that hold parts of several samples are kept (a chunk read for one sample only is not
/// read again in that epoch).
const CACHE_CHUNKS: usize = 16;
const CACHE_BYTES: u64 = 64 << 20;

/// A decoded chunk, keyed by (dataset, chunk).
type CachedChunk = ((u32, usize), Arc<Vec<u8>>);

/// Reads the decoded records of an HDF5 source: `pread`s each chunk a sample overlaps, undoes
/// its filters (last applied first), copies the sample's part. Chunks holding several samples
/// go through a small LRU cache of decoded chunks.
#[derive(Debug)]
pub struct ChunkDecoder {
    datasets: Vec<ChunkedDataset>,
    cache: Mutex<VecDeque<CachedChunk>>,
}

impl ChunkDecoder {
    /// A decoder for the records of `datasets` (their chunk tables are sorted by position).
    pub fn new(mut datasets: Vec<ChunkedDataset>) -> ChunkDecoder {
        for d in &mut datasets {
            d.chunks.sort_by(|a, b| a.coords.cmp(&b.coords));
        }
        ChunkDecoder {
            datasets,
            cache: Mutex::new(VecDeque::new()),
        }
    }

    fn cached(&self, key: (u32, usize)) -> Option<Arc<Vec<u8>>> {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let at = c.iter().position(|e| e.0 == key)?;
        let e = c.remove(at)?;
        let v = e.1.clone();
        c.push_front(e);
        Some(v)
    }

    fn keep(&self, key: (u32, usize), v: Arc<Vec<u8>>) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if c.iter().any(|e| e.0 == key) {
            return;
        }
        c.push_front((key, v));
        while c.len() > CACHE_CHUNKS || c.iter().map(|e| e.1.len() as u64).sum::<u64>() > CACHE_BYTES {
            c.pop_back();
        }
    }
}

impl RecordDecoder for ChunkDecoder {
    fn read(
        &self,
        file: &ContainerFile,
        f: &File,
        sample: u32,
        name: &str,
        locator: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        let corrupt = |reason: String| Error::Corrupt {
            path: file.path.clone(),
            record: format!("{name} (sample {sample})"),
            reason,
        };
        let di = (locator >> ROW_BITS) as u32;
        let row0 = locator & ((1 << ROW_BITS) - 1);
        let Some(d) = self.datasets.get(di as usize) else {
            return Err(corrupt(format!(
                "refers to chunked dataset {di} of {}",
                self.datasets.len()
            )));
        };
        let rb = d.row_bytes();
        let rows = buf.len() as u64 / rb.max(1);
        if rows * rb != buf.len() as u64 || row0 + rows > d.shape[0] {
            return Err(corrupt(format!(
                "{} bytes from row {row0} do not fit {:?}",
                buf.len(),
                d.shape
            )));
        }
        // The sample is rows [row0, row0 + rows) of the whole extent of the other dimensions.
        let mut lo = vec![0u64; d.shape.len()];
        lo[0] = row0;
        let mut hi = d.shape.clone();
        hi[0] = row0 + rows;
        let c0 = d.chunk[0];
        let first = d.chunks.partition_point(|c| c.coords[0] + c0 <= row0);
        let last = d.chunks.partition_point(|c| c.coords[0] < row0 + rows);
        let mut copied = 0u64;
        for ci in first..last {
            let c = &d.chunks[ci];
            let key = (di, ci);
            let data = match self.cached(key) {
                Some(v) => v,
                None => {
                    let v = Arc::new(decode_chunk(d, c, f).map_err(|reason| {
                        corrupt(format!(
                            "chunk {:?} of {:?} ({} bytes at offset {}): {reason}",
                            c.coords, d.name, c.size, c.offset
                        ))
                    })?);
                    // Worth keeping only if it holds rows of other samples too.
                    if c.coords[0] < row0 || (c.coords[0] + c0).min(d.shape[0]) > row0 + rows {
                        self.keep(key, v.clone());
                    }
                    v
                }
            };
            copied += copy_slab(d, &c.coords, &data, &lo, &hi, buf);
        }
        if copied != buf.len() as u64 {
            return Err(corrupt(format!(
                "the chunk table covers {copied} of its {} bytes",
                buf.len()
            )));
        }
        Ok(())
    }
}

/// Reads chunk `c` of `d` and undoes its filters: the decoded chunk, `chunk_bytes` long.
fn decode_chunk(d: &ChunkedDataset, c: &StoredChunk, f: &File) -> std::result::Result<Vec<u8>, String> {
    let mut data = vec![0u8; c.size as usize];
    let mut filled = 0usize;
    while filled < data.len() {
        match f.read_at(&mut data[filled..], c.offset + filled as u64) {
            Ok(0) => return Err(format!("the file ends {filled} bytes into the chunk")),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("read failed: {e}")),
        }
    }
    let want = d.chunk_bytes() as usize;
    for (i, flt) in d.filters.iter().enumerate().rev() {
        if i < 32 && c.mask & (1 << i) != 0 {
            continue;
        }
        data = match flt.id {
            FILTER_DEFLATE => {
                let mut out = Vec::with_capacity(want + 4);
                flate2::read::ZlibDecoder::new(&data[..])
                    .read_to_end(&mut out)
                    .map_err(|e| format!("the deflate stream is damaged or truncated ({e})"))?;
                out
            }
            FILTER_SHUFFLE => {
                let es = flt.params.first().copied().unwrap_or(d.itemsize).max(1) as usize;
                unshuffle(&data, es)
            }
            FILTER_FLETCHER32 => {
                if data.len() < 4 {
                    return Err("too short for its fletcher32 checksum".into());
                }
                let (body, sum) = data.split_at(data.len() - 4);
                let stored = u32::from_le_bytes(sum.try_into().expect("4 bytes"));
                let computed = fletcher32(body);
                // HDF5 also accepts the byte-swapped sum (files from 1.6.x on little-endian).
                if stored != computed && stored != swapped_fletcher(computed) {
                    return Err(format!(
                        "fletcher32 checksum mismatch (stored {stored:#010x}, computed {computed:#010x})"
                    ));
                }
                data.truncate(data.len() - 4);
                data
            }
            other => return Err(format!("filter {other} is not decoded")),
        };
    }
    if data.len() != want {
        return Err(format!("decodes to {} bytes, not the chunk's {want}", data.len()));
    }
    Ok(data)
}

/// Undoes HDF5's byte shuffle: byte `b` of element `i` was stored at `b * n + i`; bytes past the
/// last whole element are stored as they were.
fn unshuffle(data: &[u8], es: usize) -> Vec<u8> {
    let n = data.len() / es;
    if es == 1 || n <= 1 {
        return data.to_vec();
    }
    let mut out = vec![0u8; data.len()];
    for b in 0..es {
        let plane = &data[b * n..(b + 1) * n];
        for (i, &v) in plane.iter().enumerate() {
            out[i * es + b] = v;
        }
    }
    out[n * es..].copy_from_slice(&data[n * es..]);
    out
}

/// HDF5's Fletcher-32 (`H5_checksum_fletcher32`): 16-bit big-endian words, an odd last byte
/// as the high byte of a word.
pub fn fletcher32(data: &[u8]) -> u32 {
    let (mut s1, mut s2) = (0u32, 0u32);
    for block in data.chunks(720) {
        let mut words = block.chunks_exact(2);
        for w in &mut words {
            s1 += ((w[0] as u32) << 8) | w[1] as u32;
            s2 += s1;
        }
        if let [b] = words.remainder() {
            s1 += (*b as u32) << 8;
            s2 += s1;
        }
        s1 = (s1 & 0xffff) + (s1 >> 16);
        s2 = (s2 & 0xffff) + (s2 >> 16);
    }
    s1 = (s1 & 0xffff) + (s1 >> 16);
    s2 = (s2 & 0xffff) + (s2 >> 16);
    (s2 << 16) | s1
}

fn swapped_fletcher(v: u32) -> u32 {
    let b = v.to_le_bytes();
    u32::from_le_bytes([b[1], b[0], b[3], b[2]])
}

/// Copies the part of the decoded chunk at `coords` that lies in the box `lo..hi` of `d` into
/// `out` (that box, C order); returns the bytes copied.
fn copy_slab(d: &ChunkedDataset, coords: &[u64], chunk: &[u8], lo: &[u64], hi: &[u64], out: &mut [u8]) -> u64 {
    let rank = d.shape.len();
    let es = d.itemsize as u64;
    let mut a = vec![0u64; rank];
    let mut b = vec![0u64; rank];
    for j in 0..rank {
        a[j] = coords[j].max(lo[j]);
        b[j] = (coords[j] + d.chunk[j]).min(hi[j]);
        if a[j] >= b[j] {
            return 0;
        }
    }
    // Element strides of the chunk and of the output box.
    let mut cs = vec![1u64; rank];
    let mut os = vec![1u64; rank];
    for j in (0..rank - 1).rev() {
        cs[j] = cs[j + 1] * d.chunk[j + 1];
        os[j] = os[j + 1] * (hi[j + 1] - lo[j + 1]);
    }
    let run = ((b[rank - 1] - a[rank - 1]) * es) as usize;
    let mut x = a.clone();
    let mut copied = 0u64;
    loop {
        let (mut ci, mut oi) = (0u64, 0u64);
        for j in 0..rank {
            ci += (x[j] - coords[j]) * cs[j];
            oi += (x[j] - lo[j]) * os[j];
        }
        let (ci, oi) = ((ci * es) as usize, (oi * es) as usize);
        out[oi..oi + run].copy_from_slice(&chunk[ci..ci + run]);
        copied += run as u64;
        // Next run: odometer over all dimensions but the last.
        let mut j = rank - 1;
        loop {
            if j == 0 {
                return copied;
            }
            j -= 1;
            x[j] += 1;
            if x[j] < b[j] {
                break;
            }
            x[j] = a[j];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Source;
    use std::io::Write;

    #[test]
    fn layout_columns_of_unequal_length_name_the_column() {
        let cols = LayoutColumns {
            file: vec![0, 0],
            offset: vec![0, 8],
            len: vec![8, 8],
            label: vec![1],
            name: vec!["a".into(), "b".into()],
            via: vec![-1, 0],
            ..LayoutColumns::default()
        };
        let e = cols.clone().into_layout().unwrap_err();
        assert!(e.to_string().contains("1 label values for 2 records"), "{e}");
        let ok = LayoutColumns {
            label: vec![1, 2],
            ..cols
        }
        .into_layout()
        .unwrap();
        assert_eq!((ok.records[0].file, ok.records[0].offset), (0, 0), "a byte range");
        assert_ne!(ok.records[1].file, 0, "a decoded record");
    }

    #[test]
    fn contiguous_rows_are_byte_ranges() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.h5");
        std::fs::write(&p, b"....aabbcc").unwrap();
        let src = hdf5(&p, "x", Some(&d.path().join("ix")), None, || {
            Ok(Hdf5Layout {
                files: vec![p.clone()],
                records: contiguous_rows(0, "x", 4, 3, 2, &[1, 2, 3]),
                ..Hdf5Layout::default()
            })
        })
        .unwrap();
        let mut b = [0u8; 2];
        src.read_into(2, &mut b).unwrap();
        assert_eq!((&b, src.label(2)), (b"cc", 3));
        assert!(src.path(1).to_str().unwrap().ends_with("f.h5#x[1]"));
    }

    fn shuffle(data: &[u8], es: usize) -> Vec<u8> {
        let n = data.len() / es;
        let mut out = data.to_vec();
        for i in 0..n {
            for b in 0..es {
                out[b * n + i] = data[i * es + b];
            }
        }
        out
    }

    #[test]
    fn shuffle_round_trips_with_a_tail() {
        let data: Vec<u8> = (0..27u8).collect();
        assert_eq!(unshuffle(&shuffle(&data, 4), 4), data);
    }

    const ROWS: u64 = 7;
    const COLS: u64 = 5;

    fn value(r: u64, c: u64) -> u16 {
        (r * 100 + c) as u16
    }

    /// A 2-D dataset (7 rows of 5 u16) in chunks of 3x2 (rows split across chunks, edge chunks
    /// stored whole), shuffled and deflated, with some chunks stored raw (mask bits set).
    fn fixture(p: &Path) -> ChunkedDataset {
        let (rows, cols, cr, cc) = (ROWS, COLS, 3u64, 2u64);
        let mut file = vec![0u8; 64];
        let mut chunks = vec![];
        for r0 in (0..rows).step_by(cr as usize) {
            for c0 in (0..cols).step_by(cc as usize) {
                let mut raw = vec![];
                for r in r0..r0 + cr {
                    for c in c0..c0 + cc {
                        raw.extend_from_slice(&value(r, c).to_le_bytes());
                    }
                }
                let skip = (r0 + c0) % 3 == 0;
                let stored = if skip {
                    raw
                } else {
                    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                    z.write_all(&shuffle(&raw, 2)).unwrap();
                    z.finish().unwrap()
                };
                chunks.push(StoredChunk {
                    offset: file.len() as u64,
                    size: stored.len() as u64,
                    mask: if skip { 0b11 } else { 0 },
                    coords: vec![r0, c0],
                });
                file.extend_from_slice(&stored);
            }
        }
        std::fs::write(p, &file).unwrap();
        ChunkedDataset {
            file: 0,
            name: "/m".into(),
            shape: vec![rows, cols],
            chunk: vec![cr, cc],
            itemsize: 2,
            filters: vec![
                Filter {
                    id: FILTER_SHUFFLE,
                    params: vec![2],
                },
                Filter {
                    id: FILTER_DEFLATE,
                    params: vec![4],
                },
            ],
            chunks,
        }
    }

    #[test]
    fn split_filtered_rows_decode() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.h5");
        let ds = fixture(&p);
        let (rows, cols) = (ROWS, COLS);
        let records = (0..rows)
            .map(|r| decoded_record(0, 0, r, cols * 2, r as i64, format!("/m[{r}]")))
            .collect();
        let open = |ix: &str| {
            let (p, ds) = (p.clone(), ds.clone());
            hdf5(&p.clone(), "m", Some(&d.path().join(ix)), None, move || {
                Ok(Hdf5Layout {
                    files: vec![p],
                    records,
                    chunked: vec![ds],
                    ..Hdf5Layout::default()
                })
            })
        };
        let src = open("ix").unwrap();
        for r in (0..rows as u32).rev() {
            let mut b = vec![0u8; 10];
            src.read_into(r, &mut b).unwrap();
            let want: Vec<u8> = (0..cols).flat_map(|c| value(r as u64, c).to_le_bytes()).collect();
            assert_eq!(b, want, "row {r}");
        }
        assert!(src.path(3).to_str().unwrap().ends_with("c.h5#/m[3]"));
        // An unknown filter is a ConfigError naming the file, the dataset and the filter.
        let mut lzf = ds.clone();
        lzf.filters[1].id = 32000;
        let err = hdf5(&p, "m2", Some(&d.path().join("ix2")), None, || {
            Ok(Hdf5Layout {
                files: vec![p.clone()],
                chunked: vec![lzf],
                ..Hdf5Layout::default()
            })
        })
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("c.h5") && err.contains("/m") && err.contains("32000 (lzf)") && err.contains("h5repack"),
            "{err}"
        );
    }

    /// Chunks shared by several samples are kept (bounded); a chunk of one sample is not.
    #[test]
    fn only_shared_chunks_are_cached() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.h5");
        let ds = fixture(&p);
        let cf = ContainerFile::stat(&p).unwrap();
        let f = File::open(&p).unwrap();
        let dec = ChunkDecoder::new(vec![ds]);
        let cached = || dec.cache.lock().unwrap().len();
        let mut row = vec![0u8; (COLS * 2) as usize];
        dec.read(&cf, &f, 0, "/m[0]", 0, &mut row).unwrap();
        assert_eq!(cached(), 3); // the three chunks across row 0 also hold rows 1 and 2
        dec.read(&cf, &f, 1, "/m[1]", 1, &mut row).unwrap();
        assert_eq!(cached(), 3);
        // The whole dataset as one sample (CosmoFlow): its chunks hold nothing else.
        let whole = ChunkDecoder::new(dec.datasets.clone());
        let mut all = vec![0u8; (ROWS * COLS * 2) as usize];
        whole.read(&cf, &f, 0, "/m", 0, &mut all).unwrap();
        assert_eq!(whole.cache.lock().unwrap().len(), 0);
        let want: Vec<u8> = (0..ROWS)
            .flat_map(|r| (0..COLS).flat_map(move |c| value(r, c).to_le_bytes()))
            .collect();
        assert_eq!(all, want);
        // Past the row count: Corrupt naming the record.
        let err = dec.read(&cf, &f, 9, "/m[6]", 6, &mut all).unwrap_err().to_string();
        assert!(err.contains("c.h5") && err.contains("/m[6] (sample 9)"), "{err}");
    }
}
