//! The node's plan, computed once per node and read by its other local ranks: the placement of
//! the node's classes, the cluster's primary table (multi-node jobs) and every local rank's
//! access stream. The first local rank writes it into the node cache's private directory; the
//! others map it read-only, check its checksum and take their copy, instead of shuffling every
//! epoch and placing again, so a rank's start-up does not grow with the number of local ranks.
//!
//! Layout (little-endian): magic `CVPLAN\0\x01`; samples u64, classes u32, ranks u32, epochs
//! u32, has-primary u32; class per sample (u8); offset per sample (u64); primary per sample
//! (u16, if present); per class: bytes used, samples, fill-order length (u64 each) and the fill
//! order (u32); per rank and epoch: sample count (u64), samples (u32), batch count (u64), batch
//! ends (u32); then the XXH3-64 of everything before it.

use std::io::Write;
use std::path::Path;

use super::Placement;
use crate::error::{Error, Result};
use crate::schedule::RankEpoch;
use crate::tier::secure;

const MAGIC: &[u8; 8] = b"CVPLAN\0\x01";

/// One node's plan as its local ranks share it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodePlan {
    /// Where each sample is cached on this node.
    pub placement: Placement,
    /// Per sample, the node that serves it (multi-node jobs).
    pub primary: Option<Vec<u16>>,
    /// `streams[i][e]`: local rank i's stream in the job's epoch `first_epoch + e`.
    pub streams: Vec<Vec<RankEpoch>>,
}

/// Bytes the written plan takes.
pub fn plan_file_bytes(plan: &NodePlan) -> u64 {
    let f = plan.placement.class_of.len() as u64;
    let fill: u64 = plan.placement.fill_order.iter().map(|v| 24 + 4 * v.len() as u64).sum();
    let streams: u64 = plan
        .streams
        .iter()
        .flatten()
        .map(|s| 16 + 4 * (s.samples.len() + s.batch_ends.len()) as u64)
        .sum();
    32 + f * (9 + if plan.primary.is_some() { 2 } else { 0 }) + fill + streams + 8
}

/// A writer that hashes what it writes.
struct Hashed<W: Write> {
    out: W,
    hash: twox_hash::XxHash3_64,
}

impl<W: Write> Hashed<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        std::hash::Hasher::write(&mut self.hash, bytes);
        self.out.write_all(bytes)
    }

    fn u64s(&mut self, values: impl Iterator<Item = u64>) -> std::io::Result<()> {
        let mut buf = Vec::with_capacity(1 << 16);
        for v in values {
            buf.extend_from_slice(&v.to_le_bytes());
            if buf.len() >= 1 << 16 {
                self.put(&buf)?;
                buf.clear();
            }
        }
        self.put(&buf)
    }

    fn u32s(&mut self, values: &[u32]) -> std::io::Result<()> {
        for chunk in values.chunks(1 << 14) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.put(&bytes)?;
        }
        Ok(())
    }
}

impl NodePlan {
    /// Write the plan to `path` (a new private file; anything at the name is replaced).
    pub fn write(&self, path: &Path) -> Result<()> {
        let _ = std::fs::remove_file(path);
        let file = secure::create_new(path).map_err(|e| Error::io(path, e))?;
        let mut w = Hashed {
            out: std::io::BufWriter::with_capacity(1 << 20, file),
            hash: twox_hash::XxHash3_64::with_seed(0),
        };
        let p = &self.placement;
        let epochs = self.streams.first().map_or(0, |s| s.len());
        let written = (|| -> std::io::Result<()> {
            w.put(MAGIC)?;
            w.put(&(p.class_of.len() as u64).to_le_bytes())?;
            for v in [
                p.used.len() as u32,
                self.streams.len() as u32,
                epochs as u32,
                self.primary.is_some() as u32,
            ] {
                w.put(&v.to_le_bytes())?;
            }
            w.put(&p.class_of)?;
            w.u64s(p.offset.iter().copied())?;
            if let Some(primary) = &self.primary {
                for chunk in primary.chunks(1 << 15) {
                    let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                    w.put(&bytes)?;
                }
            }
            for j in 0..p.used.len() {
                w.u64s([p.used[j], p.samples[j], p.fill_order[j].len() as u64].into_iter())?;
                w.u32s(&p.fill_order[j])?;
            }
            for rank in &self.streams {
                for e in rank {
                    w.u64s(std::iter::once(e.samples.len() as u64))?;
                    w.u32s(&e.samples)?;
                    w.u64s(std::iter::once(e.batch_ends.len() as u64))?;
                    w.u32s(&e.batch_ends)?;
                }
            }
            let sum = std::hash::Hasher::finish(&w.hash);
            w.out.write_all(&sum.to_le_bytes())?;
            w.out.flush()
        })();
        if let Err(e) = written {
            let _ = std::fs::remove_file(path);
            return Err(Error::io(path, e));
        }
        Ok(())
    }

    /// Read the plan at `path` (a private file of this user), checking its checksum and that it
    /// is a plan of `samples` samples for `ranks` local ranks.
    pub fn read(path: &Path, samples: usize, ranks: usize) -> Result<NodePlan> {
        let file = secure::open_existing(path, false)?;
        // SAFETY: a private file of this user that its writer finished before publishing it; it
        // is only read here, and checked against its checksum before use.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let bad = |reason: String| Error::Corrupt {
            path: path.to_path_buf(),
            record: "node plan".into(),
            reason,
        };
        if map.len() < 40 || &map[..8] != MAGIC {
            return Err(bad("not a node plan of this version".into()));
        }
        let (body, trailer) = map.split_at(map.len() - 8);
        if twox_hash::XxHash3_64::oneshot(body) != u64::from_le_bytes(trailer.try_into().expect("8 bytes")) {
            return Err(bad("checksum mismatch".into()));
        }
        let mut r = Reader { at: 8, body };
        let f = r.u64()? as usize;
        let classes = r.u32()? as usize;
        let nranks = r.u32()? as usize;
        let epochs = r.u32()? as usize;
        let has_primary = r.u32()? != 0;
        if f != samples || nranks != ranks {
            return Err(bad(format!(
                "a plan of {f} samples for {nranks} local ranks, not {samples} for {ranks}"
            )));
        }
        let class_of = r.take(f)?.to_vec();
        let offset = r
            .take(f * 8)?
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8")))
            .collect();
        let primary = if has_primary {
            Some(
                r.take(f * 2)?
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            )
        } else {
            None
        };
        let (mut used, mut count, mut fill_order) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..classes {
            used.push(r.u64()?);
            count.push(r.u64()?);
            let n = r.u64()? as usize;
            fill_order.push(r.u32s(n)?);
        }
        let mut streams = Vec::with_capacity(nranks);
        for _ in 0..nranks {
            let mut rank = Vec::with_capacity(epochs);
            for _ in 0..epochs {
                let n = r.u64()? as usize;
                let samples = r.u32s(n)?;
                let b = r.u64()? as usize;
                let batch_ends = r.u32s(b)?;
                rank.push(RankEpoch { samples, batch_ends });
            }
            streams.push(rank);
        }
        if r.at != body.len() {
            return Err(bad(format!("{} bytes past its end", body.len() - r.at)));
        }
        Ok(NodePlan {
            placement: Placement {
                class_of,
                offset,
                used,
                samples: count,
                fill_order,
            },
            primary,
            streams,
        })
    }
}

struct Reader<'a> {
    at: usize,
    body: &'a [u8],
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.body.len())
            .ok_or_else(|| Error::Corrupt {
                path: Default::default(),
                record: "node plan".into(),
                reason: format!("truncated at byte {}", self.at),
            })?;
        let out = &self.body[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u32s(&mut self, n: usize) -> Result<Vec<u32>> {
        Ok(self
            .take(n.saturating_mul(4))?
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{AccessCounts, UNCACHED};
    use crate::schedule::Schedule;

    fn plan() -> NodePlan {
        let s = Schedule::shuffle(500, 4, 8, 3, 1, false).unwrap();
        let access = AccessCounts::compute(&s, &[0, 1]).unwrap();
        let placement = Placement::compute(&access, |k| 10 + k as u64 % 7, &[1000, 2000]);
        let streams = s.streams(&[0, 1]).unwrap();
        let streams = (0..2).map(|i| streams.iter().map(|e| e[i].clone()).collect()).collect();
        NodePlan {
            placement,
            primary: Some((0..500).map(|k| (k % 3) as u16).collect()),
            streams,
        }
    }

    #[test]
    fn round_trip_and_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.plan");
        let p = plan();
        p.write(&path).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), plan_file_bytes(&p));
        assert_eq!(NodePlan::read(&path, 500, 2).unwrap(), p);
        assert!(p.placement.class_of.iter().any(|&c| c != UNCACHED));
        // Another job's plan is refused by size.
        assert!(NodePlan::read(&path, 501, 2)
            .unwrap_err()
            .to_string()
            .contains("500 samples"));
        // A flipped byte fails the checksum.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 1;
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        assert!(NodePlan::read(&path, 500, 2)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        // Truncated.
        std::fs::write(&path, &bytes[..50]).unwrap();
        assert!(NodePlan::read(&path, 500, 2).is_err());
    }

    #[test]
    fn a_symlink_is_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.plan");
        plan().write(&real).unwrap();
        let link = dir.path().join("link.plan");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(NodePlan::read(&link, 500, 2)
            .unwrap_err()
            .to_string()
            .contains("symbolic link"));
    }
}
