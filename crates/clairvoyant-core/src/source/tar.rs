//! WebDataset-style tar shards: members grouped into samples by their key (the member path up to
//! the first dot of its file name); a sample's bytes are its data member, its label comes from a
//! `.cls` (text integer) or `.json` (`label` or `cls` field) companion. Member offsets are
//! indexed once per node with the `tar` crate (headers only, data skipped by seeking); samples
//! are then read by byte range in any order, across all shards (a full random order, unlike
//! WebDataset's shard-then-buffer shuffle).

use std::fs::{self, File};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use super::container::{canonical, ContainerFile, ContainerIndex, ContainerSource, Record};
use crate::error::{Error, Result};

/// Member extensions that are labels or metadata, never a sample's data.
const COMPANIONS: [&str; 2] = ["cls", "json"];

/// Opens tar shards: `paths` are `.tar` files, or directories whose `*.tar` files (sorted by
/// name) are the shards. `data_ext` picks the data member of each sample (e.g. "jpg"); None takes
/// the first member that is not a `.cls`/`.json` companion.
pub fn tar_shards(
    paths: &[PathBuf],
    data_ext: Option<&str>,
    index_dir: Option<&Path>,
    index_path: Option<&Path>,
) -> Result<ContainerSource> {
    if paths.is_empty() {
        return Err(Error::config("paths", "no tar shards given"));
    }
    let mut shards = Vec::new();
    let mut dirs = Vec::new();
    for p in paths {
        let c = canonical(p)?;
        if c.is_dir() {
            let mut found: Vec<PathBuf> = fs::read_dir(&c)
                .map_err(|e| Error::io(&c, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "tar") && p.is_file())
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(Error::config("paths", format!("no .tar files in {}", c.display())));
            }
            shards.extend(found);
            dirs.push(c);
        } else {
            shards.push(c);
        }
    }
    let mut identity = format!("tar:{}:", data_ext.unwrap_or("*"));
    for p in paths {
        identity.push_str(&canonical(p)?.display().to_string());
        identity.push('|');
    }
    ContainerSource::open(&identity, index_dir, index_path, || {
        let mut ix = ContainerIndex::new(identity.clone());
        for d in &dirs {
            ix.dirs.push(ContainerFile::stat(d)?);
        }
        for (k, s) in shards.iter().enumerate() {
            ix.files.push(ContainerFile::stat(s)?);
            scan_shard(s, k as u32, data_ext, &mut ix.records)?;
        }
        Ok(ix)
    })
}

/// Splits a member path into (key, extension) as WebDataset does: the extension is everything
/// after the first dot of the file name.
fn split_key(name: &str) -> (&str, &str) {
    let base_start = name.rfind('/').map_or(0, |i| i + 1);
    match name[base_start..].find('.') {
        Some(d) => (&name[..base_start + d], &name[base_start + d + 1..]),
        None => (name, ""),
    }
}

#[derive(Default)]
struct Group {
    key: String,
    data: Option<(u64, u64, String)>,
    label: Option<i64>,
}

/// One shard's scan: the sample being grouped and where the archive has got to.
struct ShardScan<'a> {
    shard: &'a Path,
    file: u32,
    data_ext: Option<&'a str>,
    group: Group,
    /// The last member read (errors name it).
    last_member: String,
    /// End of the last member's data, rounded to the tar block.
    end: u64,
}

impl ShardScan<'_> {
    /// A corrupt-shard error at `record`.
    fn corrupt(&self, record: &str, reason: String) -> Error {
        Error::Corrupt {
            path: self.shard.to_path_buf(),
            record: record.to_string(),
            reason,
        }
    }

    /// Close the sample being grouped: its record, or an error if it has no data member.
    fn flush(&mut self, out: &mut Vec<Record>) -> Result<()> {
        if self.group.key.is_empty() {
            return Ok(());
        }
        let g = std::mem::take(&mut self.group);
        match g.data {
            Some((offset, len, member)) => out.push(Record {
                file: self.file,
                offset,
                len,
                label: g.label.unwrap_or(0),
                name: member,
                shape: vec![],
            }),
            None => {
                return Err(self.corrupt(
                    &g.key,
                    format!(
                        "sample has no data member ({})",
                        self.data_ext
                            .map_or("only .cls/.json companions".into(), |e| format!("no .{e}"))
                    ),
                ))
            }
        }
        Ok(())
    }

    /// Add one archive member to its sample (a new key closes the previous sample).
    fn member<R: Read>(&mut self, entry: &mut tar::Entry<R>, out: &mut Vec<Record>) -> Result<()> {
        let kind = entry.header().entry_type();
        if !(kind.is_file() || kind == tar::EntryType::Continuous) {
            return Ok(());
        }
        let name = entry
            .path()
            .map_err(|e| self.corrupt(&format!("after {}", self.last_member), format!("bad member name: {e}")))?
            .to_string_lossy()
            .into_owned();
        self.last_member = name.clone();
        let (key, ext) = split_key(&name);
        if key != self.group.key {
            self.flush(out)?;
            self.group.key = key.to_string();
        }
        let offset = entry.raw_file_position();
        let size = entry.size();
        self.end = offset + size.div_ceil(512) * 512;
        if ext == "cls" || (ext == "json" && self.group.label.is_none()) {
            return self.label(entry, &name, ext);
        }
        let wanted = match self.data_ext {
            Some(want) => ext == want,
            None => !COMPANIONS.contains(&ext),
        };
        if wanted && self.group.data.is_none() {
            self.group.data = Some((offset, size, name));
        }
        Ok(())
    }

    /// Read a `.cls` or `.json` companion's label into the sample being grouped.
    fn label<R: Read>(&mut self, entry: &mut tar::Entry<R>, name: &str, ext: &str) -> Result<()> {
        let mut text = String::new();
        entry
            .by_ref()
            .take(1 << 20)
            .read_to_string(&mut text)
            .map_err(|e| self.corrupt(name, format!("unreadable label: {e}")))?;
        let label = if ext == "cls" {
            text.trim().parse::<i64>().ok()
        } else {
            serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("label").or_else(|| v.get("cls")).and_then(|l| l.as_i64()))
        };
        match (ext, label) {
            ("cls", None) => Err(self.corrupt(name, format!("label {:?} is not an integer", text.trim()))),
            (_, Some(l)) => {
                self.group.label = Some(l);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Index one shard's samples into `out` (headers only; data is skipped by seeking).
fn scan_shard(shard: &Path, file: u32, data_ext: Option<&str>, out: &mut Vec<Record>) -> Result<()> {
    let f = File::open(shard).map_err(|e| Error::io(shard, e))?;
    let file_size = f.metadata().map_err(|e| Error::io(shard, e))?.len();
    let mut scan = ShardScan {
        shard,
        file,
        data_ext,
        group: Group::default(),
        last_member: String::from("(start of archive)"),
        end: 0,
    };
    let mut ar = tar::Archive::new(BufReader::with_capacity(8192, f));
    let entries = ar
        .entries_with_seek()
        .map_err(|e| scan.corrupt(&scan.last_member, format!("unreadable tar: {e}")))?;
    for entry in entries {
        let mut entry =
            entry.map_err(|e| scan.corrupt(&format!("after {}", scan.last_member), format!("bad tar header: {e}")))?;
        scan.member(&mut entry, out)?;
    }
    // A shard cut at a header boundary reads as a shorter archive: only its missing
    // end-of-archive blocks (two zero blocks of 512 bytes) tell.
    if scan.end + 1024 > file_size {
        return Err(scan.corrupt(
            &scan.last_member,
            format!("the archive ends ({file_size} bytes) without its end-of-archive blocks: truncated?"),
        ));
    }
    scan.flush(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_split_at_the_first_dot_of_the_file_name() {
        assert_eq!(split_key("a/b.c/0001.seg.png"), ("a/b.c/0001", "seg.png"));
        assert_eq!(split_key("0001.cls"), ("0001", "cls"));
        assert_eq!(split_key("noext"), ("noext", ""));
    }
}
