//! `image_folder`: a directory of class subdirectories with torchvision `ImageFolder` semantics
//! (same classes, labels and sample order), backed by a reusable on-disk index.

use std::collections::HashSet;
use std::fs;
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

fn open(root: &Path, canon: &Path, identity: &str, index_path: PathBuf, explicit: bool) -> Result<FileSource> {
    let (index, reused) = load_or_build(&index_path, identity, explicit, || scan(canon, identity.to_string()))?;
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

fn identity(canon: &Path) -> Result<String> {
    Ok(format!("dir:{}", utf8(canon)?))
}

fn utf8(p: &Path) -> Result<&str> {
    p.to_str()
        .ok_or_else(|| Error::config("root", format!("{} is not valid UTF-8", p.display())))
}

fn has_image_extension(name: &str) -> bool {
    let lower = name.to_lowercase();
    IMG_EXTENSIONS.iter().any(|ext| lower.ends_with(ext))
}

/// One directory found by the walk: its path relative to the root and its image files, each
/// with its size.
struct WalkedDir {
    rel: String,
    files: Vec<(String, u64)>,
}

fn scan(canon: &Path, identity: String) -> Result<Index> {
    let scan_start_ns = now_ns();
    let root_mtime = dir_mtime_ns(canon).map_err(|e| Error::io(canon, e))?;
    // find_classes: names of the root's entries that are directories (symlinks followed), sorted.
    let mut classes = Vec::new();
    for entry in fs::read_dir(canon).map_err(|e| Error::io(canon, e))? {
        let entry = entry.map_err(|e| Error::io(canon, e))?;
        let path = entry.path();
        if fs::metadata(&path).map(|m| m.is_dir()).unwrap_or(false) {
            classes.push(utf8(&path)?.rsplit('/').next().unwrap_or_default().to_string());
        }
    }
    classes.sort();
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
            dirs.sort_by(|a, b| a.rel.cmp(&b.rel));
            Ok((dirs, stamps))
        })
        .collect::<Result<_>>()?;
    let mut entries = Vec::new();
    let mut all_stamps = vec![DirStamp {
        path: utf8(canon)?.to_string(),
        mtime_ns: root_mtime,
    }];
    let mut empty = Vec::new();
    for (label, (dirs, stamps)) in walked.into_iter().enumerate() {
        let before = entries.len();
        for d in dirs {
            for (name, size) in d.files {
                entries.push(IndexEntry {
                    path: format!("{}/{}", d.rel, name),
                    size,
                    label: label as i64,
                });
            }
        }
        if entries.len() == before {
            empty.push(classes[label].as_str());
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
    rel: String,
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
        path: utf8(&dir)?.to_string(),
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
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            // Index paths are UTF-8; a name that is not can only be skipped if it would not be used.
            if is_dir || has_image_extension(&name.to_string_lossy()) {
                return Err(Error::config("root", format!("{} is not valid UTF-8", path.display())));
            }
            continue;
        };
        if is_dir {
            subdirs.push(name.to_string());
        } else if has_image_extension(name) {
            let size = match target {
                Some(m) => m.len(),
                None => entry.metadata().map_err(|e| Error::io(&path, e))?.len(),
            };
            files.push((name.to_string(), size));
        }
    }
    files.sort();
    out.push(WalkedDir {
        rel: rel.clone(),
        files,
    });
    for s in subdirs {
        walk(root, format!("{rel}/{s}"), ancestors, out, stamps)?;
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
        assert!(has_image_extension("a.JPG"));
        assert!(has_image_extension("b.Tiff"));
        assert!(has_image_extension("c.webp"));
        assert!(!has_image_extension("d.txt"));
        assert!(!has_image_extension("jpg"));
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
        let paths: Vec<_> = ix.entries.iter().map(|e| e.path.as_str()).collect();
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
        assert_eq!(paths, [("a/1.jpg".to_string(), 3), ("a/link/o.jpg".to_string(), 2)]);
        assert_eq!(src.path(1), std::path::absolute(&r).unwrap().join("a/link/o.jpg"));
    }
}
