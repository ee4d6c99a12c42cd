//! Reuse across runs: what a crashed or restarted run's node cache held is kept for the next run
//! over the same dataset on this machine, which copies the samples its own placement puts in
//! its memory class instead of reading them from the dataset again (a torchrun restart after a
//! node failure re-plans with the same or fewer ranks and finds the survivors' caches warm).
//!
//! Every node cache with a memory class writes a layout file next to its state segment: the
//! dataset's fingerprint and each sample's offset in the arena. When all processes of a cache
//! have died, the janitor (see [`super::NodeCache::attach_in`]) renames its state, arena and
//! layout to `salvage-<name>.*` instead of removing them; the local rank that sets up the next
//! job's node cache over a dataset with the same fingerprint claims them (an atomic rename),
//! copies what it can use, checking each sample's checksum and that its file has not changed
//! since it was cached, and removes them. Salvaged caches nobody claims go after an hour.

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use memmap2::Mmap;

use super::secure;
use super::state::{StateSegment, READY};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"CVLAYOU1";
/// How long a salvaged cache waits for a run to reuse it.
pub(super) const KEEP_FOR: Duration = Duration::from_secs(3600);
/// Offset of a sample outside the memory class.
pub const NOT_HELD: u64 = u64::MAX;

fn layout_path(dir: &Path, stem: &str) -> PathBuf {
    dir.join(format!("{stem}.layout"))
}

fn salvaged(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("salvage-{name}"))
}

/// Write `<dir>/<stem>.layout`: the dataset's `fingerprint`, the arena's path and every
/// sample's offset in it ([`NOT_HELD`] for samples outside the memory class). Atomic (written
/// to a temporary file, then renamed); an existing layout is replaced.
pub fn write_layout(dir: &Path, stem: &str, fingerprint: u64, arena: &Path, offsets: &[u64]) -> Result<()> {
    let path = layout_path(dir, stem);
    let tmp = dir.join(format!("{stem}.layout.{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut buf = Vec::with_capacity(32 + offsets.len() * 8);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&fingerprint.to_le_bytes());
    buf.extend_from_slice(&(offsets.len() as u64).to_le_bytes());
    let a = arena.as_os_str().as_encoded_bytes();
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    buf.extend_from_slice(a);
    for o in offsets {
        buf.extend_from_slice(&o.to_le_bytes());
    }
    let mut f = secure::create_new(&tmp).map_err(|e| Error::io(&tmp, e))?;
    f.write_all(&buf).map_err(|e| Error::io(&tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

struct Layout {
    fingerprint: u64,
    arena: PathBuf,
    offsets: Vec<u64>,
}

fn read_layout(path: &Path) -> Option<Layout> {
    let f = secure::open_existing(path, false).ok()?;
    let len = f.metadata().ok()?.len();
    if !(32..=(1 << 36)).contains(&len) {
        return None;
    }
    let mut buf = vec![0u8; len as usize];
    f.read_exact_at(&mut buf, 0).ok()?;
    if &buf[..8] != MAGIC {
        return None;
    }
    let u64_at = |o: usize| -> Option<u64> { Some(u64::from_le_bytes(buf.get(o..o + 8)?.try_into().ok()?)) };
    let fingerprint = u64_at(8)?;
    let samples = u64_at(16)? as usize;
    let alen = u64_at(24)? as usize;
    let arena_bytes = buf.get(32..32 + alen)?;
    let arena = PathBuf::from(std::ffi::OsStr::new(std::str::from_utf8(arena_bytes).ok()?));
    let start = 32 + alen;
    if buf.len() != start + samples * 8 {
        return None;
    }
    let offsets = buf[start..]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Some(Layout {
        fingerprint,
        arena,
        offsets,
    })
}

/// Keep the dead cache `stem` of `dir` for the next run, if it has a layout: its state, arena
/// and layout are renamed `salvage-*`. False when there is nothing to keep.
pub(super) fn keep(dir: &Path, stem: &str) -> bool {
    let layout = layout_path(dir, stem);
    let Some(l) = read_layout(&layout) else { return false };
    let state = dir.join(format!("{stem}.state"));
    if std::fs::rename(&l.arena, salvaged(&l.arena)).is_err() {
        return false;
    }
    let _ = std::fs::rename(&state, salvaged(&state));
    let _ = std::fs::rename(&layout, salvaged(&layout));
    true
}

/// Remove salvaged caches older than an hour (and claimed ones whose claimant died).
pub(super) fn expire(dir: &Path, keep_for: Duration) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("salvage-") {
            continue;
        }
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|d| d >= keep_for);
        if !old {
            continue;
        }
        if name.ends_with(".layout") {
            if let Some(l) = read_layout(&entry.path()) {
                let _ = std::fs::remove_file(salvaged(&l.arena));
            }
        }
        let _ = std::fs::remove_file(entry.path());
    }
}

/// A salvaged cache claimed by this process; its files are removed when dropped.
pub struct Salvage {
    offsets: Vec<u64>,
    state: StateSegment,
    arena: Mmap,
    files: Vec<PathBuf>,
}

impl Salvage {
    /// Claim every salvaged cache in `dir` of a dataset with `fingerprint` and `samples` samples.
    pub fn take(dir: &Path, fingerprint: u64, samples: usize) -> Vec<Salvage> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(stem) = name.strip_prefix("salvage-").and_then(|n| n.strip_suffix(".layout")) else {
                continue;
            };
            let path = entry.path();
            match read_layout(&path) {
                Some(l) if l.fingerprint == fingerprint && l.offsets.len() == samples => {}
                _ => continue,
            }
            // Claim it: one rename succeeds.
            let claimed = path.with_extension(format!("layout.{}.taken", std::process::id()));
            if std::fs::rename(&path, &claimed).is_err() {
                continue;
            }
            let Some(l) = read_layout(&claimed) else { continue };
            let arena_path = salvaged(&l.arena);
            let state_stem = format!("salvage-{stem}");
            let files = vec![
                claimed.clone(),
                arena_path.clone(),
                dir.join(format!("{state_stem}.state")),
            ];
            let opened = (|| -> Option<Salvage> {
                let f = secure::open_existing(&arena_path, false).ok()?;
                // SAFETY: a private file of a dead run that only this process now uses.
                let arena = unsafe { Mmap::map(&f) }.ok()?;
                let state = StateSegment::open(dir, &state_stem, samples).ok()?;
                Some(Salvage {
                    offsets: l.offsets,
                    state,
                    arena,
                    files: files.clone(),
                })
            })();
            match opened {
                Some(s) => out.push(s),
                None => {
                    for f in files {
                        let _ = std::fs::remove_file(f);
                    }
                }
            }
        }
        out
    }

    /// The bytes of `sample` (`len` long) if the salvaged cache held it filled, with the
    /// checksum recorded then and when its fill began (wall-clock ns).
    pub fn sample(&self, sample: u32, len: u64) -> Option<(&[u8], u64, u64)> {
        let off = *self.offsets.get(sample as usize)?;
        if off == NOT_HELD || self.state.state(sample) != READY {
            return None;
        }
        let end = off.checked_add(len)?;
        let bytes = self.arena.get(off as usize..end as usize)?;
        let (checksum, stamp) = self.state.record(sample);
        Some((bytes, checksum, self.state.fill_started_ns(stamp)))
    }
}

impl Drop for Salvage {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}
