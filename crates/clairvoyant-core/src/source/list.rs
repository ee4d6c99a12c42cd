//! `file_list`: an explicit list of files with labels. Sizes come from one stat per file and are
//! cached in an index keyed by a hash of the list, validated by the mtimes of the parent dirs.

use std::collections::BTreeSet;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::index::{
    dir_mtime_ns, index_path_in, load_or_build, now_ns, DirStamp, FileSource, Fnv1a, Index, IndexEntry,
};
use crate::error::{Error, Result};

/// Opens the files `paths` (made absolute against the current directory) with `labels`, reusing
/// the index in `index_dir` (default: see [`default_index_dir`](super::index::default_index_dir)).
pub fn file_list(paths: &[PathBuf], labels: &[i64], index_dir: Option<&Path>) -> Result<FileSource> {
    let (abs, identity) = prepare(paths, labels)?;
    let index_path = index_path_in(index_dir, &identity)?;
    open(abs, labels, &identity, index_path, false)
}

/// Like [`file_list`] with the index file named explicitly; an index of another dataset there is
/// `Error::BadIndex`.
pub fn file_list_with_index(paths: &[PathBuf], labels: &[i64], index_path: &Path) -> Result<FileSource> {
    let (abs, identity) = prepare(paths, labels)?;
    open(abs, labels, &identity, index_path.to_path_buf(), true)
}

/// Parses a list file of `<path> <label>` lines. Paths are relative to the list file's directory
/// (absolute ones are kept) and may contain spaces: the label is the last field. Blank lines and
/// lines starting with `#` are skipped.
pub fn parse_list_file(path: &Path) -> Result<(Vec<PathBuf>, Vec<i64>)> {
    // Bytes, not text: a listed file name need not be UTF-8.
    let text = fs::read(path).map_err(|e| Error::io(path, e))?;
    let base = path.parent().unwrap_or(Path::new(""));
    let mut paths = Vec::new();
    let mut labels = Vec::new();
    for (k, line) in text.split(|&b| b == b'\n').enumerate() {
        let line = line.trim_ascii();
        if line.is_empty() || line.starts_with(b"#") {
            continue;
        }
        let bad = |why: &str| {
            Error::config(
                "list_file",
                format!(
                    "{}:{}: {why}, expected '<path> <label>': {:?}",
                    path.display(),
                    k + 1,
                    String::from_utf8_lossy(line)
                ),
            )
        };
        let cut = line
            .iter()
            .rposition(u8::is_ascii_whitespace)
            .ok_or_else(|| bad("missing label"))?;
        let (file, label) = (&line[..cut], &line[cut + 1..]);
        let label: i64 = std::str::from_utf8(label)
            .ok()
            .and_then(|l| l.parse().ok())
            .ok_or_else(|| bad("label is not an integer"))?;
        paths.push(base.join(OsStr::from_bytes(file.trim_ascii_end())));
        labels.push(label);
    }
    Ok((paths, labels))
}

/// Validates the arguments and returns the absolute paths and the list's identity.
fn prepare(paths: &[PathBuf], labels: &[i64]) -> Result<(Vec<PathBuf>, OsString)> {
    if paths.len() != labels.len() {
        return Err(Error::config(
            "labels",
            format!("{} labels for {} paths", labels.len(), paths.len()),
        ));
    }
    if paths.is_empty() {
        return Err(Error::config("paths", "the file list is empty"));
    }
    let mut h = Fnv1a::default();
    let mut abs = Vec::with_capacity(paths.len());
    for (p, &label) in paths.iter().zip(labels) {
        let a = std::path::absolute(p).map_err(|e| Error::io(p, e))?;
        // Labels are part of the identity: the same files with other labels are another dataset.
        h.write_os(a.as_os_str());
        h.write(&label.to_le_bytes());
        abs.push(a);
    }
    Ok((abs, format!("list:{:016x}", h.finish()).into()))
}

fn open(
    abs: Vec<PathBuf>,
    labels: &[i64],
    identity: &OsStr,
    index_path: PathBuf,
    explicit: bool,
) -> Result<FileSource> {
    let (index, reused) = load_or_build(&index_path, identity, explicit, || scan(abs, labels, identity))?;
    Ok(FileSource::new(index, PathBuf::new(), Some(index_path), reused))
}

fn scan(abs: Vec<PathBuf>, labels: &[i64], identity: &OsStr) -> Result<Index> {
    let scan_start_ns = now_ns();
    // Parallel stats overlap per-file latency on network file systems.
    let sizes: Vec<u64> = abs
        .par_iter()
        .enumerate()
        .map(|(k, p)| match fs::metadata(p) {
            Ok(m) => Ok(m.len()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound {
                sample: k as u64,
                path: p.clone(),
            }),
            Err(e) => Err(Error::io(p, e)),
        })
        .collect::<Result<_>>()?;
    let parents: BTreeSet<&Path> = abs.iter().map(|p| p.parent().unwrap_or(Path::new("/"))).collect();
    let dirs = parents
        .into_iter()
        .map(|d| {
            Ok(DirStamp {
                path: d.to_path_buf(),
                mtime_ns: dir_mtime_ns(Path::new(d)).map_err(|e| Error::io(d, e))?,
            })
        })
        .collect::<Result<_>>()?;
    let entries = abs
        .into_iter()
        .zip(sizes)
        .zip(labels)
        .map(|((path, size), &label)| IndexEntry { path, size, label })
        .collect();
    Ok(Index {
        root: PathBuf::new(),
        identity: identity.to_owned(),
        classes: Vec::new(),
        entries,
        dirs,
        scan_start_ns,
        built_ns: now_ns(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Source;

    #[test]
    fn parses_list_files() {
        let d = tempfile::tempdir().unwrap();
        let lf = d.path().join("list.txt");
        fs::write(&lf, "# header\n\na/1.jpg 3\n  with space.png   -1 \n/abs/x.bin 0\n").unwrap();
        let (paths, labels) = parse_list_file(&lf).unwrap();
        assert_eq!(
            paths,
            [
                d.path().join("a/1.jpg"),
                d.path().join("with space.png"),
                PathBuf::from("/abs/x.bin")
            ]
        );
        assert_eq!(labels, [3, -1, 0]);
        fs::write(&lf, "ok.jpg 1\nbroken.jpg cat\n").unwrap();
        let err = parse_list_file(&lf).unwrap_err().to_string();
        assert!(err.contains("list.txt:2"), "{err}");
        fs::write(&lf, b"caf\xe9 b.jpg 2\r\n").unwrap();
        let (paths, labels) = parse_list_file(&lf).unwrap();
        assert_eq!(paths, [d.path().join(OsStr::from_bytes(b"caf\xe9 b.jpg"))]);
        assert_eq!(labels, [2]);
        fs::write(&lf, "nolabel\n").unwrap();
        assert!(parse_list_file(&lf).unwrap_err().to_string().contains(":1:"));
    }

    #[test]
    fn argument_errors_name_the_field() {
        let err = file_list(&[PathBuf::from("/x")], &[], None).unwrap_err();
        assert!(matches!(&err, Error::Config { key, .. } if key == "labels"), "{err}");
        let err = file_list(&[], &[], None).unwrap_err();
        assert!(matches!(&err, Error::Config { key, .. } if key == "paths"), "{err}");
    }

    #[test]
    fn missing_file_at_scan_is_not_found() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a"), b"12").unwrap();
        let paths = [d.path().join("a"), d.path().join("b")];
        match file_list(&paths, &[0, 1], Some(&d.path().join("ix"))) {
            Err(Error::NotFound { sample: 1, path }) => assert_eq!(path, paths[1]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn labels_are_part_of_the_identity() {
        let d = tempfile::tempdir().unwrap();
        fs::write(d.path().join("a"), b"12").unwrap();
        let ix = d.path().join("ix");
        let paths = [d.path().join("a")];
        let s0 = file_list(&paths, &[0], Some(&ix)).unwrap();
        let s1 = file_list(&paths, &[1], Some(&ix)).unwrap();
        assert_ne!(s0.fingerprint(), s1.fingerprint());
        assert_ne!(s0.index_path(), s1.index_path());
        assert_eq!(s1.label(0), 1);
    }
}
