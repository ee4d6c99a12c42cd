//! LMDB databases (Caffe's `Datum` records or raw values), read the LMDBIO way: one indexing pass
//! per node walks the B+tree with positioned reads of its pages (LMDB's documented on-disk
//! layout, `mdb.c`) and records where each value lies in `data.mdb`; samples are then read with
//! one `pread` each, in access order, never by page-faulting through a shared memory map.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::container::{canonical, display_name, ContainerFile, ContainerIndex, ContainerSource, Record};
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
const MDB_DUPSORT: u16 = 0x04;
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
    #[prost(int32, optional, tag = "1")]
    pub channels: Option<i32>,
    #[prost(int32, optional, tag = "2")]
    pub height: Option<i32>,
    #[prost(int32, optional, tag = "3")]
    pub width: Option<i32>,
    #[prost(bytes = "vec", optional, tag = "4")]
    pub data: Option<Vec<u8>>,
    #[prost(int32, optional, tag = "5")]
    pub label: Option<i32>,
    #[prost(float, repeated, packed = "false", tag = "6")]
    pub float_data: Vec<f32>,
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
    ContainerSource::open(&identity, index_dir, index_path, || {
        scan(&canon, identity.clone(), records)
    })
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
    let mut values = Vec::with_capacity(entries.min(1 << 24) as usize);
    if root != P_INVALID {
        db.walk(root, 0, &mut values)?;
    }
    if values.len() as u64 != entries {
        return Err(db.corrupt(
            "meta",
            format!("the tree holds {} values, the meta page says {entries}", values.len()),
        ));
    }
    ix.records = match records {
        LmdbRecords::Raw => values
            .into_iter()
            .map(|(key, offset, len)| Record {
                file: 0,
                offset,
                len,
                label: 0,
                name: display_name(&key),
                shape: vec![],
            })
            .collect(),
        LmdbRecords::CaffeDatum => {
            use rayon::prelude::*;
            // Two small reads per value (its head, and what follows `data`), overlapped: on a
            // shared file system each is a round trip.
            values
                .into_par_iter()
                .map(|(key, offset, len)| db.datum_record(&key, offset, len))
                .collect::<Result<_>>()?
        }
    };
    Ok(ix)
}

struct Db<'a> {
    f: &'a File,
    path: &'a Path,
    size: u64,
    psize: u64,
}

impl Db<'_> {
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
            let flags = u16_at(p, main + 4);
            if flags & MDB_DUPSORT != 0 {
                return Err(self.corrupt(which, "the main database is DUPSORT, which is not supported".into()));
            }
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
    fn walk(&self, pgno: u64, depth: u32, out: &mut Vec<(Vec<u8>, u64, u64)>) -> Result<()> {
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
            return Err(self.corrupt(&what, "LEAF2 (DUPFIXED) pages are not supported".into()));
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
                self.walk(child, depth + 1, out)?;
            } else if flags & P_LEAF != 0 {
                let name = display_name(&key);
                if nflags & (F_SUBDATA | F_DUPDATA) != 0 {
                    return Err(self.corrupt(
                        &name,
                        "named sub-databases and duplicate values are not supported".into(),
                    ));
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
                    out.push((key, at, dsize));
                } else {
                    if dstart + dsize > self.psize {
                        return Err(self.corrupt(&name, "value lies outside its page".into()));
                    }
                    out.push((key, base + dstart, dsize));
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
    use prost::Message;

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
