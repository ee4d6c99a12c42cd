//! `image_folder`: a directory of class subdirectories with torchvision `ImageFolder` semantics
//! (same classes, labels and sample order), backed by a reusable on-disk index.

use std::cmp::Ordering;
use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::index::{dir_mtime_ns, index_path_in, load_or_build, now_ns, DirStamp, FileSource, Index, IndexEntry};
use crate::error::{Error, Result};

/// torchvision's `IMG_EXTENSIONS`, matched case-insensitively against the end of the file name.
pub const IMG_EXTENSIONS: [&str; 9] = [
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp",
];

/// Opens the dataset at `root`, reusing its index in `index_dir` (default: see
/// [`default_index_dir`](super::index::default_index_dir)) while the dataset is unchanged.
pub fn image_folder(root: &Path, index_dir: Option<&Path>) -> Result<FileSource> {
    let canon = canonical_root(root)?;
    let identity = identity(&canon)?;
    let index_path = index_path_in(index_dir, &identity)?;
    open(root, &canon, &identity, index_path, false)
}

/// Like [`image_folder`] with the index file named explicitly; an index of another dataset there
/// is `Error::BadIndex` rather than being overwritten.
pub fn image_folder_with_index(root: &Path, index_path: &Path) -> Result<FileSource> {
    let canon = canonical_root(root)?;
    let identity = identity(&canon)?;
    open(root, &canon, &identity, index_path.to_path_buf(), true)
}

/// Scans `root` into an index without reading or writing any index file.
pub fn scan_image_folder(root: &Path) -> Result<Index> {
    let canon = canonical_root(root)?;
    let identity = identity(&canon)?;
    scan(&canon, identity)
}

fn open(root: &Path, canon: &Path, identity: &OsStr, index_path: PathBuf, explicit: bool) -> Result<FileSource> {
    let (index, reused) = load_or_build(&index_path, identity, explicit, || scan(canon, identity.to_owned()))?;
    let base = std::path::absolute(root).map_err(|e| Error::io(root, e))?;
    Ok(FileSource::new(index, base, Some(index_path), reused))
}

fn canonical_root(root: &Path) -> Result<PathBuf> {
    let canon = fs::canonicalize(root).map_err(|e| Error::io(root, e))?;
    if !canon.is_dir() {
        return Err(Error::config("root", format!("{} is not a directory", root.display())));
    }
    Ok(canon)
}

fn identity(canon: &Path) -> Result<OsString> {
    let mut id = OsString::from("dir:");
    id.push(canon.as_os_str());
    Ok(id)
}

fn has_image_extension(name: &OsStr) -> bool {
    // The extensions are ASCII, so undecodable bytes elsewhere in the name do not matter.
    let lower = name.to_string_lossy().to_lowercase();
    IMG_EXTENSIONS.iter().any(|ext| lower.ends_with(ext))
}

/// The order of Python's `sorted()` on names as `os.scandir` gives them (str, with each byte
/// that is not UTF-8 decoded to the lone surrogate U+DC80..U+DCFF by surrogateescape), which is
/// torchvision's order. For UTF-8 names that is byte order.
pub(crate) fn python_str_order(a: &OsStr, b: &OsStr) -> Ordering {
    match (a.to_str(), b.to_str()) {
        (Some(x), Some(y)) => x.cmp(y),
        _ => code_points(a).cmp(code_points(b)),
    }
}

fn code_points(s: &OsStr) -> impl Iterator<Item = u32> + '_ {
    s.as_bytes().utf8_chunks().flat_map(|c| {
        c.valid()
            .chars()
            .map(|ch| ch as u32)
            .chain(c.invalid().iter().map(|&b| 0xDC00 + b as u32))
    })
}

/// One directory found by the walk: its path relative to the root and its image files, each
/// with its size.
struct WalkedDir {
    rel: OsString,
    files: Vec<(OsString, u64)>,
}

fn scan(canon: &Path, identity: OsString) -> Result<Index> {
    let scan_start_ns = now_ns();
    let root_mtime = dir_mtime_ns(canon).map_err(|e| Error::io(canon, e))?;
    // find_classes: names of the root's entries that are directories (symlinks followed), sorted.
    let mut classes = Vec::new();
    for entry in fs::read_dir(canon).map_err(|e| Error::io(canon, e))? {
        let entry = entry.map_err(|e| Error::io(canon, e))?;
        let path = entry.path();
        if fs::metadata(&path).map(|m| m.is_dir()).unwrap_or(false) {
            classes.push(entry.file_name());
        }
    }
    classes.sort_by(|a, b| python_str_order(a, b));
    if classes.is_empty() {
        return Err(Error::config(
            "root",
            format!("no class folders found in {}", canon.display()),
        ));
    }
    // Classes are independent; walking them in parallel overlaps the stat latency of each file,
    // which dominates on network file systems.
    let walked: Vec<(Vec<WalkedDir>, Vec<DirStamp>)> = classes
        .par_iter()
        .map(|c| {
            let mut dirs = Vec::new();
            let mut stamps = Vec::new();
            let mut ancestors = HashSet::new();
            walk(canon, c.clone(), &mut ancestors, &mut dirs, &mut stamps)?;
            // sorted(os.walk(...)): directories in order of their path string.
            dirs.sort_by(|a, b| python_str_order(&a.rel, &b.rel));
            Ok((dirs, stamps))
        })
        .collect::<Result<_>>()?;
    let mut entries = Vec::new();
    let mut all_stamps = vec![DirStamp {
        path: canon.to_path_buf(),
        mtime_ns: root_mtime,
    }];
    let mut empty = Vec::new();
    for (label, (dirs, stamps)) in walked.into_iter().enumerate() {
        let before = entries.len();
        for d in dirs {
            for (name, size) in d.files {
                entries.push(IndexEntry {
                    path: Path::new(&d.rel).join(name),
                    size,
                    label: label as i64,
                });
            }
        }
        if entries.len() == before {
            empty.push(classes[label].to_string_lossy());
        }
        all_stamps.extend(stamps);
    }
    // As torchvision: a class without any image is an error, since its label could never occur.
    if !empty.is_empty() {
        return Err(Error::config(
            "root",
            format!(
                "found no image files ({}) for the classes {} in {}",
                IMG_EXTENSIONS.join(", "),
                empty.join(", "),
                canon.display()
            ),
        ));
    }
    Ok(Index {
        root: canon.to_path_buf(),
        identity,
        classes,
        entries,
        dirs: all_stamps,
        scan_start_ns,
        built_ns: now_ns(),
    })
}

/// `os.walk(followlinks=True)` below `root/rel`: records the directory, its image files (names
/// sorted) and recurses into subdirectories, including symlinked ones. A directory that is its own
/// ancestor (a symlink loop) is skipped, where os.walk would recurse until the path is too long.
fn walk(
    root: &Path,
    rel: OsString,
    ancestors: &mut HashSet<(u64, u64)>,
    out: &mut Vec<WalkedDir>,
    stamps: &mut Vec<DirStamp>,
) -> Result<()> {
    let dir = root.join(&rel);
    let meta = fs::metadata(&dir).map_err(|e| Error::io(&dir, e))?;
    let key = (meta.dev(), meta.ino());
    if !ancestors.insert(key) {
        return Ok(());
    }
    stamps.push(DirStamp {
        path: dir.clone(),
        mtime_ns: meta
            .mtime()
            .saturating_mul(1_000_000_000)
            .saturating_add(meta.mtime_nsec()),
    });
    let mut files = Vec::new();
    let mut subdirs = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
        let entry = entry.map_err(|e| Error::io(&dir, e))?;
        let path = entry.path();
        let ft = entry.file_type().map_err(|e| Error::io(&path, e))?;
        // Like os.walk, symlinks count as what they point to; a broken one is a "file".
        let target = if ft.is_symlink() {
            fs::metadata(&path).ok()
        } else {
            None
        };
        let is_dir = if ft.is_symlink() {
            target.as_ref().is_some_and(|m| m.is_dir())
        } else {
            ft.is_dir()
        };
        // Names are kept as bytes: one that is not UTF-8 is as usable as any other.
        let name = entry.file_name();
        if is_dir {
            subdirs.push(name);
        } else if has_image_extension(&name) {
            let size = match target {
                Some(m) => m.len(),
                None => entry.metadata().map_err(|e| Error::io(&path, e))?.len(),
            };
            files.push((name, size));
        }
    }
    files.sort_by(|a, b| python_str_order(&a.0, &b.0));
    out.push(WalkedDir {
        rel: rel.clone(),
        files,
    });
    for s in subdirs {
        let mut sub = rel.clone();
        sub.push("/");
        sub.push(s);
        walk(root, sub, ancestors, out, stamps)?;
    }
    ancestors.remove(&key);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Source;

    #[test]
    fn extensions_match_case_insensitively() {
        assert!(has_image_extension(OsStr::new("a.JPG")));
        assert!(has_image_extension(OsStr::new("b.Tiff")));
        assert!(has_image_extension(OsStr::new("c.webp")));
        assert!(!has_image_extension(OsStr::new("d.txt")));
        assert!(!has_image_extension(OsStr::new("jpg")));
    }

    #[test]
    fn order_is_sorted_walk_order_not_depth_first() {
        // sorted(os.walk()) puts "c/b c" and "c/b-x" between "c/b" and "c/b/x" because ' ' and
        // '-' sort before '/'; a depth-first walk would list "c/b/x" right after "c/b".
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        for sub in ["c/b", "c/b/x", "c/b c", "c/b-x"] {
            fs::create_dir_all(r.join(sub)).unwrap();
        }
        for f in ["c/b/1.png", "c/b/x/2.png", "c/b c/3.png", "c/b-x/4.png", "c/0.png"] {
            fs::write(r.join(f), b"x").unwrap();
        }
        let ix = scan_image_folder(r).unwrap();
        let paths: Vec<_> = ix.entries.iter().map(|e| e.path.to_str().unwrap()).collect();
        assert_eq!(
            paths,
            ["c/0.png", "c/b/1.png", "c/b c/3.png", "c/b-x/4.png", "c/b/x/2.png"]
        );
    }

    #[test]
    fn empty_root_and_empty_class_are_errors() {
        let d = tempfile::tempdir().unwrap();
        let ix = tempfile::tempdir().unwrap();
        let err = image_folder(d.path(), Some(ix.path())).unwrap_err();
        assert!(
            matches!(err, Error::Config { .. }) && err.to_string().contains("no class folders"),
            "{err}"
        );
        fs::create_dir(d.path().join("cat")).unwrap();
        fs::write(d.path().join("cat/readme.txt"), b"x").unwrap();
        let err = scan_image_folder(d.path()).unwrap_err();
        assert!(err.to_string().contains("cat"), "{err}");
        let err = image_folder(&d.path().join("missing"), None).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
    }

    #[test]
    fn symlinked_dirs_are_followed_and_loops_cut() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path().join("root");
        fs::create_dir_all(r.join("a")).unwrap();
        fs::create_dir_all(d.path().join("outside")).unwrap();
        fs::write(d.path().join("outside/o.jpg"), b"xy").unwrap();
        std::os::unix::fs::symlink(d.path().join("outside"), r.join("a/link")).unwrap();
        std::os::unix::fs::symlink(&r, r.join("a/loop")).unwrap();
        fs::write(r.join("a/1.jpg"), b"abc").unwrap();
        let src = image_folder(&r, Some(&d.path().join("ix"))).unwrap();
        let paths: Vec<_> = src.index().entries.iter().map(|e| (e.path.clone(), e.size)).collect();
        // "a/loop" leads back to the root, whose "a" is an ancestor: the walk enters the root
        // once more (finds no images there) but does not loop.
        assert_eq!(paths, [("a/1.jpg".into(), 3), ("a/link/o.jpg".into(), 2)]);
        assert_eq!(src.path(1), std::path::absolute(&r).unwrap().join("a/link/o.jpg"));
    }

    #[test]
    fn names_that_are_not_utf8_are_indexed_and_read() {
        use std::os::unix::ffi::OsStringExt;
        let d = tempfile::tempdir().unwrap();
        let r = d.path().join("root");
        let bad_class = OsString::from_vec(b"cl\xe4ss".to_vec());
        let bad_file = OsString::from_vec(b"caf\xe9.jpg".to_vec());
        fs::create_dir_all(r.join(&bad_class)).unwrap();
        fs::create_dir_all(r.join("b")).unwrap();
        fs::write(r.join(&bad_class).join(&bad_file), b"abc").unwrap();
        fs::write(r.join("b").join(&bad_file), b"de").unwrap();
        fs::write(r.join("b/z.jpg"), b"f").unwrap();
        let ix = d.path().join("ix");
        let src = image_folder(&r, Some(&ix)).unwrap();
        // Python sorts "b" < "cl\udce4ss" and "caf\udce9.jpg" < "z.jpg".
        assert_eq!(src.classes(), [OsString::from("b"), bad_class.clone()]);
        assert_eq!(src.path(0), std::path::absolute(&r).unwrap().join("b").join(&bad_file));
        assert_eq!(src.label(2), 1);
        let mut buf = vec![0u8; src.size(2) as usize];
        src.read_into(2, &mut buf).unwrap();
        assert_eq!(buf, b"abc");
        // The stored index keeps the bytes: a second open reuses it and sees the same names.
        let again = image_folder(&r, Some(&ix)).unwrap();
        assert_eq!(again.index().entries, src.index().entries);
        assert_eq!(again.fingerprint(), src.fingerprint());
    }

    #[test]
    fn order_matches_python_str_order_for_undecodable_bytes() {
        use std::os::unix::ffi::OsStringExt;
        // b"\xf5" decodes to U+DCF5, which sorts before U+10000 (bytes f0 90 80 80) although
        // its byte is larger; "\u00e9" (c3 a9) sorts before U+DCE9.
        let raw = |b: &[u8]| OsString::from_vec(b.to_vec());
        let mut names = vec![
            raw(b"\xf0\x90\x80\x80"),
            raw(b"\xf5"),
            raw(b"\xe9"),
            raw("\u{e9}".as_bytes()),
            raw(b"a"),
        ];
        names.sort_by(|a, b| python_str_order(a, b));
        assert_eq!(
            names,
            [
                raw(b"a"),
                raw("\u{e9}".as_bytes()),
                raw(b"\xe9"),
                raw(b"\xf5"),
                raw(b"\xf0\x90\x80\x80")
            ]
        );
    }
}
