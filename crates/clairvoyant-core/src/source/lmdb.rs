//! LMDB databases (Caffe's `Datum` records or raw values), read the LMDBIO way: one indexing pass
//! per node walks the B+tree with positioned reads of its pages (LMDB's documented on-disk
//! layout, `mdb.c`) and records where each value lies in `data.mdb`; samples are then read with
//! one `pread` each, in access order, never by page-faulting through a shared memory map.
//!
//! Values the walk cannot turn into byte ranges (the duplicates of a key in a DUPSORT database,
//! kept in sub-pages or sub-databases, LEAF2 pages among them) are read through the LMDB library
//! (`heed`, read-only environment, one read transaction per read) and counted
//! ([`ContainerSource::fallback_reads`]).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use heed::types::Bytes;
use heed::{CommitOrAbort, Database, Env, EnvFlags, EnvOpenOptions, WithoutTls};
use prost::Message;

use super::container::{
    canonical, display_name, ContainerFile, ContainerIndex, ContainerSource, FallbackReader, Record, FALLBACK_FILE,
};
use crate::error::{Error, Result};

const PAGEHDRSZ: u64 = 16;
const NODESIZE: u64 = 8;
const MDB_MAGIC: u32 = 0xBEEF_C0DE;
const MDB_DATA_VERSION: u32 = 1;
const P_BRANCH: u16 = 0x01;
const P_LEAF: u16 = 0x02;
const P_LEAF2: u16 = 0x20;
const F_BIGDATA: u16 = 0x01;
const F_SUBDATA: u16 = 0x02;
const F_DUPDATA: u16 = 0x04;
const P_INVALID: u64 = u64::MAX;

/// What a sample is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LmdbRecords {
    /// Each value is a Caffe `Datum`: the sample is its `data` bytes (raw pixels, or the encoded
    /// image when `encoded` is set), the label its `label`, the shape (channels, height, width).
    CaffeDatum,
    /// Each value is the sample, label 0.
    Raw,
}

/// Caffe's `Datum` message (caffe.proto), for decoding a whole value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Datum {
    /// Number of channels of the image.
    #[prost(int32, optional, tag = "1")]
    pub channels: Option<i32>,
    /// Image height in pixels.
    #[prost(int32, optional, tag = "2")]
    pub height: Option<i32>,
    /// Image width in pixels.
    #[prost(int32, optional, tag = "3")]
    pub width: Option<i32>,
    /// The sample's bytes: raw pixels, or an encoded image when `encoded` is set.
    #[prost(bytes = "vec", optional, tag = "4")]
    pub data: Option<Vec<u8>>,
    /// The sample's class label.
    #[prost(int32, optional, tag = "5")]
    pub label: Option<i32>,
    /// Pixel values as floats, for datums stored that way instead of `data`.
    #[prost(float, repeated, packed = "false", tag = "6")]
    pub float_data: Vec<f32>,
    /// Whether `data` is an encoded image (JPEG, PNG) rather than raw pixels.
    #[prost(bool, optional, tag = "7")]
    pub encoded: Option<bool>,
}

/// Opens the LMDB environment at `path` (a directory holding `data.mdb`, or the data file
/// itself), reusing its index in `index_dir` (or at `index_path`) while the file is unchanged.
pub fn lmdb(
    path: &Path,
    records: LmdbRecords,
    index_dir: Option<&Path>,
    index_path: Option<&Path>,
) -> Result<ContainerSource> {
    let data = data_file(path)?;
    let canon = canonical(&data)?;
    let kind = match records {
        LmdbRecords::CaffeDatum => "datum",
        LmdbRecords::Raw => "raw",
    };
    let identity = format!("lmdb-{kind}:{}", canon.display());
    let src = ContainerSource::open(&identity, index_dir, index_path, || {
        scan(&canon, identity.clone(), records)
    })?;
    Ok(src.with_fallback(Box::new(LibraryReader { data: canon, records })))
}

/// What the walk found for one key: its value's byte range, or values only the library can read.
enum Found {
    Range(Vec<u8>, u64, u64),
    Library(Vec<u8>),
}

/// Reads values through the LMDB library: the environment opened read-only (no lock file, so a
/// read-only directory works) once per process, one read transaction per read.
#[derive(Debug)]
struct LibraryReader {
    data: PathBuf,
    records: LmdbRecords,
}

type MainDb = Database<'static, Bytes, Bytes>;
/// The library's environments opened in this process, by data file.
type Envs = Mutex<HashMap<PathBuf, (Env<WithoutTls>, MainDb)>>;

/// heed refuses to open one environment twice in a process: every source of it shares this one,
/// with its main database.
fn library_env(data: &Path) -> Result<(Env<WithoutTls>, MainDb)> {
    static ENVS: OnceLock<Envs> = OnceLock::new();
    let mut envs = ENVS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some((env, db)) = envs.get(data) {
        return Ok((env.clone(), *db));
    }
    let mut opts = EnvOpenOptions::new().read_txn_without_tls();
    // SAFETY: read-only and without the lock file: nothing writes through this mapping, and a
    // container changed after indexing is refused (its size and mtime are checked per read)
    // before the library touches it.
    let env = unsafe {
        opts.flags(EnvFlags::READ_ONLY | EnvFlags::NO_SUB_DIR | EnvFlags::NO_LOCK);
        opts.open(data)
    }
    .map_err(|e| lib_err(data, "environment", e))?;
    let txn = env.read_txn().map_err(|e| lib_err(data, "read transaction", e))?;
    let db = env
        .open_databases_and_commit(txn, |opener, txn| -> heed::Result<_> {
            let db = opener.open_database::<Bytes, Bytes>(txn, None)?;
            Ok(CommitOrAbort::<_, ()>::Commit(db))
        })
        .map_err(|e| lib_err(data, "main database", e))?
        .unwrap_commit()
        .ok_or_else(|| lib_err(data, "main database", heed::Error::Mdb(heed::MdbError::NotFound)))?;
    envs.insert(data.to_path_buf(), (env.clone(), db));
    Ok((env, db))
}

fn lib_err(data: &Path, record: &str, e: heed::Error) -> Error {
    Error::Corrupt {
        path: data.to_path_buf(),
        record: record.to_string(),
        reason: format!("the LMDB library: {e}"),
    }
}

/// The bytes of a key from its record name ([`display_name`] in reverse).
fn key_of(name: &str) -> Vec<u8> {
    if let Some(hex) = name.strip_prefix("0x") {
        if hex.len() % 2 == 0 && hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digits"))
                .collect();
            // display_name writes hex only for keys that are not plain text.
            if display_name(&bytes) == name {
                return bytes;
            }
        }
    }
    name.as_bytes().to_vec()
}

/// All values of `keys` (each key's duplicates in cursor order), through the library.
fn library_values(data: &Path, keys: &[Vec<u8>], mut each: impl FnMut(usize, &[u8]) -> Result<()>) -> Result<()> {
    let (env, db) = library_env(data)?;
    let txn = env.read_txn().map_err(|e| lib_err(data, "read transaction", e))?;
    for (k, key) in keys.iter().enumerate() {
        let name = display_name(key);
        let iter = db
            .get_duplicates(&txn, key)
            .map_err(|e| lib_err(data, &name, e))?
            .ok_or_else(|| lib_err(data, &name, heed::Error::Mdb(heed::MdbError::NotFound)))?;
        for kv in iter {
            let (_, v) = kv.map_err(|e| lib_err(data, &name, e))?;
            each(k, v)?;
        }
    }
    Ok(())
}

/// The sample of a Datum value held in memory: its data bytes, label and shape.
fn datum_sample(data: &Path, name: &str, value: &[u8]) -> Result<(Vec<u8>, i64, Vec<u64>)> {
    let bad = |why: String| Error::Corrupt {
        path: data.to_path_buf(),
        record: name.to_string(),
        reason: format!("not a Caffe Datum: {why}"),
    };
    let d = Datum::decode(value).map_err(|e| bad(e.to_string()))?;
    let shape = vec![
        d.channels.unwrap_or(0) as u64,
        d.height.unwrap_or(0) as u64,
        d.width.unwrap_or(0) as u64,
        d.encoded.unwrap_or(false) as u64,
    ];
    let bytes = d.data.ok_or_else(|| bad("no data field".into()))?;
    Ok((bytes, d.label.unwrap_or(0) as i64, shape))
}

impl FallbackReader for LibraryReader {
    fn read(&self, name: &str, ordinal: u64, buf: &mut [u8]) -> Result<()> {
        let key = key_of(name);
        let (env, db) = library_env(&self.data)?;
        let txn = env.read_txn().map_err(|e| lib_err(&self.data, name, e))?;
        let missing = || Error::Corrupt {
            path: self.data.clone(),
            record: format!("{name} (value {ordinal})"),
            reason: "the LMDB library does not find this value".into(),
        };
        let mut iter = db
            .get_duplicates(&txn, &key)
            .map_err(|e| lib_err(&self.data, name, e))?
            .ok_or_else(missing)?;
        let (_, value) = iter
            .nth(ordinal as usize)
            .ok_or_else(missing)?
            .map_err(|e| lib_err(&self.data, name, e))?;
        let sample = match self.records {
            LmdbRecords::Raw => value.to_vec(),
            LmdbRecords::CaffeDatum => datum_sample(&self.data, name, value)?.0,
        };
        if sample.len() != buf.len() {
            return Err(Error::Corrupt {
                path: self.data.clone(),
                record: format!("{name} (value {ordinal})"),
                reason: format!("the value holds {} bytes, the index says {}", sample.len(), buf.len()),
            });
        }
        buf.copy_from_slice(&sample);
        Ok(())
    }
}

fn data_file(path: &Path) -> Result<PathBuf> {
    if path.is_dir() {
        let p = path.join("data.mdb");
        if !p.is_file() {
            return Err(Error::config(
                "path",
                format!(
                    "{} is a directory without data.mdb: not an LMDB environment",
                    path.display()
                ),
            ));
        }
        Ok(p)
    } else {
        Ok(path.to_path_buf())
    }
}

/// Indexes `data` by walking the main database's B+tree in key order (cursor order).
pub fn scan(data: &Path, identity: String, records: LmdbRecords) -> Result<ContainerIndex> {
    let mut ix = ContainerIndex::new(identity);
    let stamp = ContainerFile::stat(data)?;
    let f = File::open(data).map_err(|e| Error::io(data, e))?;
    let db = Db {
        f: &f,
        path: data,
        size: stamp.size,
        psize: 0,
    };
    let (psize, root, entries) = db.meta()?;
    let db = Db { psize, ..db };
    ix.files.push(stamp);
    let mut found = Vec::with_capacity(entries.min(1 << 24) as usize);
    let mut subdbs = 0u64;
    if root != P_INVALID {
        db.walk(root, 0, &mut found, &mut subdbs)?;
    }
    let from_library = library_records(data, &found, records)?;
    let values = found.iter().filter(|f| matches!(f, Found::Range(..))).count() as u64
        + from_library.iter().map(|v| v.len() as u64).sum::<u64>();
    if values + subdbs != entries {
        return Err(db.corrupt(
            "meta",
            format!(
                "the tree holds {} values, the meta page says {entries}",
                values + subdbs
            ),
        ));
    }
    let mut ranges = db.range_records(&found, records)?;
    let mut library = from_library.into_iter();
    for r in ranges.iter_mut() {
        match r.take() {
            Some(r) => ix.records.push(r),
            None => ix.records.extend(library.next().expect("one list per library key")),
        }
    }
    Ok(ix)
}

/// The records of the values only the library can read, one list per such key in cursor order.
fn library_records(data: &Path, found: &[Found], records: LmdbRecords) -> Result<Vec<Vec<Record>>> {
    let library_keys: Vec<Vec<u8>> = found
        .iter()
        .filter_map(|f| match f {
            Found::Library(key) => Some(key.clone()),
            Found::Range(..) => None,
        })
        .collect();
    let mut from_library: Vec<Vec<Record>> = vec![Vec::new(); library_keys.len()];
    if library_keys.is_empty() {
        return Ok(from_library);
    }
    library_values(data, &library_keys, |k, value| {
        let name = display_name(&library_keys[k]);
        let ordinal = from_library[k].len() as u64;
        let (len, label, shape) = match records {
            LmdbRecords::Raw => (value.len() as u64, 0, vec![]),
            LmdbRecords::CaffeDatum => {
                let (bytes, label, shape) = datum_sample(data, &name, value)?;
                (bytes.len() as u64, label, shape)
            }
        };
        from_library[k].push(Record {
            file: FALLBACK_FILE,
            offset: ordinal,
            len,
            label,
            name,
            shape,
        });
        Ok(())
    })?;
    Ok(from_library)
}

struct Db<'a> {
    f: &'a File,
    path: &'a Path,
    size: u64,
    psize: u64,
}

impl Db<'_> {
    /// The records of the values the walk found byte ranges for, in cursor order (None where a
    /// key's values only the library can read).
    fn range_records(&self, found: &[Found], records: LmdbRecords) -> Result<Vec<Option<Record>>> {
        let located = |key: &[u8], offset: u64, len: u64| -> Result<Record> {
            match records {
                LmdbRecords::Raw => Ok(Record {
                    file: 0,
                    offset,
                    len,
                    label: 0,
                    name: display_name(key),
                    shape: vec![],
                }),
                LmdbRecords::CaffeDatum => self.datum_record(key, offset, len),
            }
        };
        use rayon::prelude::*;
        // Two small reads per Datum (its head, and what follows `data`), overlapped: on a shared
        // file system each is a round trip.
        found
            .par_iter()
            .map(|f| match f {
                Found::Range(key, offset, len) => located(key, *offset, *len).map(Some),
                Found::Library(_) => Ok(None),
            })
            .collect::<Result<_>>()
    }

    fn corrupt(&self, record: &str, reason: String) -> Error {
        Error::Corrupt {
            path: self.path.to_path_buf(),
            record: record.to_string(),
            reason,
        }
    }

    fn read(&self, offset: u64, len: u64, what: &str) -> Result<Vec<u8>> {
        if offset.checked_add(len).is_none_or(|e| e > self.size) {
            return Err(self.corrupt(
                what,
                format!(
                    "bytes {offset}..{} lie past the end of the file ({} bytes): truncated?",
                    offset.saturating_add(len),
                    self.size
                ),
            ));
        }
        let mut buf = vec![0u8; len as usize];
        self.f
            .read_exact_at(&mut buf, offset)
            .map_err(|e| Error::io(self.path, e))?;
        Ok(buf)
    }

    /// Page size, main-database root and entry count, from the newer of the two meta pages.
    fn meta(&self) -> Result<(u64, u64, u64)> {
        let parse = |p: &[u8], which: &str| -> Result<(u64, u64, u64, u64)> {
            let magic = u32_at(p, 16);
            let version = u32_at(p, 20);
            if magic != MDB_MAGIC {
                return Err(self.corrupt(which, format!("bad magic {magic:#x}: not an LMDB data file")));
            }
            if version != MDB_DATA_VERSION {
                return Err(self.corrupt(
                    which,
                    format!("LMDB data version {version}, expected {MDB_DATA_VERSION}"),
                ));
            }
            // MDB_meta after the page header: magic, version, address, mapsize, dbs[FREE, MAIN]
            // (48 bytes each: pad (= page size for FREE), flags, depth, 3 page counts, entries,
            // root), last page, txnid.
            let psize = u32_at(p, 40) as u64;
            let main = 40 + 48;
            let entries = u64_at(p, main + 32);
            let root = u64_at(p, main + 40);
            let txnid = u64_at(p, 40 + 96 + 8);
            Ok((psize, root, entries, txnid))
        };
        let p0 = self.read(0, 160, "meta page 0")?;
        let m0 = parse(&p0, "meta page 0")?;
        if !(512..=65536).contains(&m0.0) || !m0.0.is_power_of_two() {
            return Err(self.corrupt("meta page 0", format!("page size {} is not plausible", m0.0)));
        }
        let best = match self
            .read(m0.0, 160, "meta page 1")
            .and_then(|p| parse(&p, "meta page 1"))
        {
            Ok(m1) if m1.3 > m0.3 => m1,
            _ => m0,
        };
        Ok((best.0, best.1, best.2))
    }

    /// In-order walk below `pgno`, appending (key, value offset, value length).
    /// Values only the library can read (duplicates) are `Found::Library`; the names of named
    /// sub-databases are no samples and are only counted in `subdbs`.
    fn walk(&self, pgno: u64, depth: u32, out: &mut Vec<Found>, subdbs: &mut u64) -> Result<()> {
        let what = format!("page {pgno}");
        if depth > 64 {
            return Err(self.corrupt(&what, "the tree is deeper than 64 levels (a cycle?)".into()));
        }
        let base = pgno
            .checked_mul(self.psize)
            .ok_or_else(|| self.corrupt(&what, "page number out of range".into()))?;
        let page = self.read(base, self.psize, &what)?;
        let flags = u16_at(&page, 10);
        let lower = u16_at(&page, 12) as u64;
        if lower < PAGEHDRSZ || lower > self.psize {
            return Err(self.corrupt(&what, format!("bad lower bound {lower}")));
        }
        let n = ((lower - PAGEHDRSZ) / 2) as usize;
        if flags & P_LEAF2 != 0 {
            // LEAF2 pages only hold the duplicates of a DUPFIXED sub-database, below a node
            // this walk hands to the library; in the main tree they mean damage.
            return Err(self.corrupt(&what, "a LEAF2 (DUPFIXED) page in the main tree".into()));
        }
        for i in 0..n {
            let off = u16_at(&page, PAGEHDRSZ as usize + 2 * i) as u64;
            if off + NODESIZE > self.psize {
                return Err(self.corrupt(&what, format!("node {i} at {off} lies outside the page")));
            }
            let o = off as usize;
            let lo = u16_at(&page, o) as u64;
            let hi = u16_at(&page, o + 2) as u64;
            let nflags = u16_at(&page, o + 4);
            let ksize = u16_at(&page, o + 6) as u64;
            let kstart = off + NODESIZE;
            if kstart + ksize > self.psize {
                return Err(self.corrupt(&what, format!("key of node {i} lies outside the page")));
            }
            let key = page[kstart as usize..(kstart + ksize) as usize].to_vec();
            if flags & P_BRANCH != 0 {
                // Branch nodes keep the child page number in lo, hi and flags (64-bit pgno_t).
                let child = lo | (hi << 16) | ((nflags as u64) << 32);
                self.walk(child, depth + 1, out, subdbs)?;
            } else if flags & P_LEAF != 0 {
                let name = display_name(&key);
                if nflags & F_DUPDATA != 0 {
                    // Several values under this key, in a sub-page or a sub-database (perhaps of
                    // LEAF2 pages): read through the library.
                    out.push(Found::Library(key));
                    continue;
                }
                if nflags & F_SUBDATA != 0 {
                    // The name of a named sub-database, not a value of the main database.
                    *subdbs += 1;
                    continue;
                }
                let dsize = lo | (hi << 16);
                let dstart = kstart + ksize;
                if nflags & F_BIGDATA != 0 {
                    if dstart + 8 > self.psize {
                        return Err(self.corrupt(&name, "overflow page number lies outside the page".into()));
                    }
                    let ov = u64_at(&page, dstart as usize);
                    let at = ov
                        .checked_mul(self.psize)
                        .and_then(|b| b.checked_add(PAGEHDRSZ))
                        .ok_or_else(|| self.corrupt(&name, "overflow page out of range".into()))?;
                    out.push(Found::Range(key, at, dsize));
                } else {
                    if dstart + dsize > self.psize {
                        return Err(self.corrupt(&name, "value lies outside its page".into()));
                    }
                    out.push(Found::Range(key, base + dstart, dsize));
                }
            } else {
                return Err(self.corrupt(&what, format!("unexpected page flags {flags:#x} in the tree")));
            }
        }
        Ok(())
    }

    /// The record of a Datum value: the range of its `data` field, its label and shape.
    fn datum_record(&self, key: &[u8], offset: u64, len: u64) -> Result<Record> {
        let name = display_name(key);
        let bad = |why: String| self.corrupt(&name, format!("not a Caffe Datum: {why}"));
        let head = self.read(offset, len.min(64), &name)?;
        let mut fields = DatumFields::default();
        let mut pos = 0u64;
        let mut buf = head;
        let mut buf_at = 0u64; // value offset of buf[0]
        while pos < len {
            // The next field's key and varint (at most 20 bytes) must be in buf.
            let need = (len - pos).min(20);
            if pos < buf_at || pos + need > buf_at + buf.len() as u64 {
                buf_at = pos;
                buf = self.read(offset + pos, (len - pos).min(64), &name)?;
            }
            let mut slice = &buf[(pos - buf_at) as usize..];
            let before = slice.len();
            let (tag, wire) = prost::encoding::decode_key(&mut slice).map_err(|e| bad(e.to_string()))?;
            match wire {
                prost::encoding::WireType::Varint => {
                    let v = prost::encoding::decode_varint(&mut slice).map_err(|e| bad(e.to_string()))?;
                    match tag {
                        1 => fields.channels = v as i32 as i64,
                        2 => fields.height = v as i32 as i64,
                        3 => fields.width = v as i32 as i64,
                        5 => fields.label = v as i32 as i64,
                        7 => fields.encoded = v != 0,
                        _ => {}
                    }
                    pos += (before - slice.len()) as u64;
                }
                prost::encoding::WireType::LengthDelimited => {
                    let l = prost::encoding::decode_varint(&mut slice).map_err(|e| bad(e.to_string()))?;
                    let value_at = pos + (before - slice.len()) as u64;
                    if value_at.checked_add(l).is_none_or(|e| e > len) {
                        return Err(bad(format!(
                            "field {tag} of {l} bytes runs past the value of {len} bytes"
                        )));
                    }
                    if tag == 4 {
                        fields.data = Some((value_at, l));
                    }
                    pos = value_at + l;
                }
                prost::encoding::WireType::ThirtyTwoBit => pos += (before - slice.len()) as u64 + 4,
                prost::encoding::WireType::SixtyFourBit => pos += (before - slice.len()) as u64 + 8,
                w => return Err(bad(format!("unexpected wire type {w:?}"))),
            }
        }
        let (at, l) = fields.data.ok_or_else(|| bad("no data field".into()))?;
        Ok(Record {
            file: 0,
            offset: offset + at,
            len: l,
            label: fields.label,
            name,
            shape: vec![
                fields.channels as u64,
                fields.height as u64,
                fields.width as u64,
                fields.encoded as u64,
            ],
        })
    }
}

#[derive(Default)]
struct DatumFields {
    channels: i64,
    height: i64,
    width: i64,
    label: i64,
    encoded: bool,
    data: Option<(u64, u64)>,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datum_round_trips_through_prost() {
        let d = Datum {
            channels: Some(3),
            height: Some(2),
            width: Some(2),
            data: Some(vec![7; 12]),
            label: Some(5),
            float_data: vec![],
            encoded: Some(false),
        };
        let bytes = d.encode_to_vec();
        assert_eq!(Datum::decode(bytes.as_slice()).unwrap(), d);
    }

    #[test]
    fn datum_record_finds_data_between_other_fields() {
        // Encoded image, float_data after the label, a negative label: the record is exactly
        // the data field's bytes, wherever the value sits in the file.
        let d = Datum {
            channels: Some(3),
            height: Some(300),
            width: Some(200),
            data: Some((0..500u32).map(|i| (i % 251) as u8).collect()),
            label: Some(-7),
            float_data: vec![1.5, 2.5, 3.5],
            encoded: Some(true),
        };
        let value = d.encode_to_vec();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let mut file = vec![0xEEu8; 1000];
        file.extend_from_slice(&value);
        std::fs::write(&p, &file).unwrap();
        let f = File::open(&p).unwrap();
        let db = Db {
            f: &f,
            path: &p,
            size: file.len() as u64,
            psize: 4096,
        };
        let r = db.datum_record(b"k", 1000, value.len() as u64).unwrap();
        assert_eq!(r.label, -7);
        assert_eq!(r.shape, [3, 300, 200, 1]);
        let start = r.offset as usize;
        assert_eq!(&file[start..start + r.len as usize], d.data.as_deref().unwrap());
        // A value that is not a Datum is Corrupt, naming the key.
        let err = db.datum_record(b"k", 0, 40).unwrap_err().to_string();
        assert!(err.contains("record k") && err.contains("not a Caffe Datum"), "{err}");
    }

    #[test]
    fn record_names_give_back_their_keys() {
        for key in [&b"00001234"[..], b"0x41", b"0xzz", b"", b"\xff\x00k", b"a\0b", b"0x"] {
            assert_eq!(key_of(&display_name(key)), key, "{key:?}");
        }
    }

    #[test]
    fn not_lmdb_is_corrupt_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("data.mdb");
        std::fs::write(&p, vec![1u8; 8192]).unwrap();
        let err = lmdb(d.path(), LmdbRecords::Raw, Some(&d.path().join("ix")), None).unwrap_err();
        assert!(matches!(err, Error::Corrupt { .. }), "{err}");
        assert!(
            err.to_string().contains("data.mdb") && err.to_string().contains("meta page 0"),
            "{err}"
        );
    }
}
