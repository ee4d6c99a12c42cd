//! Conformance suite every file-backed source runs (image_folder, file_list, Throttled), plus
//! timing and shared-counter checks of the emulated file system.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime};

use clairvoyant_core::source::{
    file_list, file_list_with_index, image_folder, image_folder_with_index, EmulatedFs, EmulatedSpec, FileSource,
    Source, Throttled,
};
use clairvoyant_core::Error;

/// The small tree and what torchvision's ImageFolder makes of it: classes sorted, directories in
/// sorted path order, file names sorted case-sensitively ("B" < "a"), extensions matched without
/// regard to case, other files and loose files at the root ignored.
const TREE: &[&str] = &[
    "cat/b.JPG",
    "cat/a.png",
    "cat/B.jpg",
    "cat/notes.txt",
    "cat/sub-x/d.Png",
    "cat/sub/c.jpeg",
    "dog/z.webp",
    "dog/deep/er/e.TIF",
    "dog/deep/readme",
    "loose.jpg",
];
const EXPECTED: &[(&str, i64)] = &[
    ("cat/B.jpg", 0),
    ("cat/a.png", 0),
    ("cat/b.JPG", 0),
    ("cat/sub/c.jpeg", 0),
    ("cat/sub-x/d.Png", 0),
    ("dog/z.webp", 1),
    ("dog/deep/er/e.TIF", 1),
];

fn contents(rel: &str) -> Vec<u8> {
    rel.repeat(3).into_bytes()
}

fn make_tree(root: &Path) {
    for rel in TREE {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, contents(rel)).unwrap();
    }
    backdate(root);
}

/// Sets directory mtimes a minute back, so that an index built now is not "racy" (a directory
/// modified within the timestamp granularity of the scan is rescanned on the next open).
fn backdate(dir: &Path) {
    File::open(dir)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(60))
        .unwrap();
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            backdate(&e.path());
        }
    }
}

struct Opened {
    src: Arc<dyn Source>,
    reused: bool,
    index_path: PathBuf,
}

impl Opened {
    fn from(fs: FileSource, wrap: &dyn Fn(Arc<dyn Source>) -> Arc<dyn Source>) -> Opened {
        let reused = fs.index_was_reused();
        let index_path = fs.index_path().unwrap().to_path_buf();
        Opened {
            src: wrap(Arc::new(fs)),
            reused,
            index_path,
        }
    }
}

/// How a backend opens the dataset at a root: with an index directory, or an explicit index file.
trait Backend: Sync {
    fn open(&self, root: &Path, index_dir: &Path) -> Result<Opened, Error>;
    fn open_explicit(&self, root: &Path, index_path: &Path) -> Result<Opened, Error>;
    /// Whether files added to the tree become samples (directory scan) or not (fixed list).
    fn discovers_files(&self) -> bool;
}

struct Folder;
impl Backend for Folder {
    fn open(&self, root: &Path, ix: &Path) -> Result<Opened, Error> {
        Ok(Opened::from(image_folder(root, Some(ix))?, &|s| s))
    }
    fn open_explicit(&self, root: &Path, ip: &Path) -> Result<Opened, Error> {
        Ok(Opened::from(image_folder_with_index(root, ip)?, &|s| s))
    }
    fn discovers_files(&self) -> bool {
        true
    }
}

struct List;
impl List {
    fn args(root: &Path) -> (Vec<PathBuf>, Vec<i64>) {
        EXPECTED.iter().map(|(p, l)| (root.join(p), *l)).unzip()
    }
}
impl Backend for List {
    fn open(&self, root: &Path, ix: &Path) -> Result<Opened, Error> {
        let (p, l) = List::args(root);
        Ok(Opened::from(file_list(&p, &l, Some(ix))?, &|s| s))
    }
    fn open_explicit(&self, root: &Path, ip: &Path) -> Result<Opened, Error> {
        let (p, l) = List::args(root);
        Ok(Opened::from(file_list_with_index(&p, &l, ip)?, &|s| s))
    }
    fn discovers_files(&self) -> bool {
        false
    }
}

struct ThrottledFolder(Arc<EmulatedFs>);
impl Backend for ThrottledFolder {
    fn open(&self, root: &Path, ix: &Path) -> Result<Opened, Error> {
        Ok(Opened::from(image_folder(root, Some(ix))?, &|s| {
            Arc::new(Throttled::new(s, self.0.clone()))
        }))
    }
    fn open_explicit(&self, root: &Path, ip: &Path) -> Result<Opened, Error> {
        Ok(Opened::from(image_folder_with_index(root, ip)?, &|s| {
            Arc::new(Throttled::new(s, self.0.clone()))
        }))
    }
    fn discovers_files(&self) -> bool {
        true
    }
}

fn read(src: &dyn Source, k: u32) -> Result<Vec<u8>, Error> {
    let mut buf = vec![0u8; src.size(k) as usize];
    src.read_into(k, &mut buf).map(|_| buf)
}

fn conformance(b: &dyn Backend) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    let ixdir = tmp.path().join("ix");
    make_tree(&root);
    let abs_root = std::path::absolute(&root).unwrap();

    // Contents, order, labels and paths.
    let first = b.open(&root, &ixdir).unwrap();
    assert!(!first.reused, "a new index is built by scanning");
    assert!(first.index_path.starts_with(&ixdir) && first.index_path.exists());
    let src = &first.src;
    assert_eq!(src.len(), EXPECTED.len());
    for (k, (rel, label)) in EXPECTED.iter().enumerate() {
        let k = k as u32;
        assert_eq!(src.path(k), abs_root.join(rel));
        assert_eq!(src.label(k), *label, "{rel}");
        assert_eq!(src.size(k), contents(rel).len() as u64);
        assert_eq!(read(src.as_ref(), k).unwrap(), contents(rel), "{rel}");
    }
    let total: u64 = EXPECTED.iter().map(|(r, _)| contents(r).len() as u64).sum();
    assert_eq!(src.total_bytes(), total);
    let fp = src.fingerprint();

    // Unchanged dataset: the index is loaded, not rescanned.
    let again = b.open(&root, &ixdir).unwrap();
    assert!(again.reused, "an unchanged dataset reuses its index");
    assert_eq!(again.src.fingerprint(), fp);

    // Ranks opening at once: all succeed, exactly one scans, all agree.
    let ixdir2 = tmp.path().join("ix2");
    let barrier = Barrier::new(4);
    let results: Vec<(u64, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let o = b.open(&root, &ixdir2).unwrap();
                    (o.src.fingerprint(), o.reused)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|&(f, _)| f == fp), "{results:?}");
    assert_eq!(results.iter().filter(|&&(_, reused)| !reused).count(), 1, "{results:?}");

    // A damaged index is rebuilt: flipped byte, then truncation.
    let mut bytes = fs::read(&first.index_path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    fs::write(&first.index_path, &bytes).unwrap();
    let o = b.open(&root, &ixdir).unwrap();
    assert!(!o.reused && o.src.fingerprint() == fp);
    let bytes = fs::read(&first.index_path).unwrap();
    fs::write(&first.index_path, &bytes[..bytes.len() - 3]).unwrap();
    let o = b.open(&root, &ixdir).unwrap();
    assert!(!o.reused && o.src.fingerprint() == fp);
    assert!(b.open(&root, &ixdir).unwrap().reused);

    // An explicitly named index of another dataset is refused, naming the index and both datasets.
    let other = tmp.path().join("other");
    make_tree(&other);
    fs::write(other.join("cat/extra.png"), b"x").unwrap();
    backdate(&other);
    let foreign = b.open(&other, &tmp.path().join("ix-other")).unwrap().index_path;
    match b.open_explicit(&root, &foreign) {
        Err(Error::BadIndex { index, reason }) => {
            assert_eq!(index, foreign);
            if b.discovers_files() {
                let canon = |p: &Path| fs::canonicalize(p).unwrap().display().to_string();
                assert!(
                    reason.contains(&canon(&root)) && reason.contains(&canon(&other)),
                    "{reason}"
                );
            }
        }
        Err(e) => panic!("expected BadIndex, got {e}"),
        Ok(_) => panic!("expected BadIndex, got a source"),
    }
    // ... while an explicit path of its own (even new) works.
    let own = tmp.path().join("own.cvidx");
    assert!(!b.open_explicit(&root, &own).unwrap().reused);
    assert!(b.open_explicit(&root, &own).unwrap().reused);

    // A file whose size changed after indexing: Changed, naming the file.
    let (rel0, _) = EXPECTED[0];
    let p0 = root.join(rel0);
    for altered in [b"longer than before, much longer".to_vec(), b"short".to_vec()] {
        fs::write(&p0, &altered).unwrap();
        match read(src.as_ref(), 0) {
            Err(Error::Changed { path, index, .. }) => {
                assert_eq!(path, abs_root.join(rel0));
                assert_eq!(index, first.index_path);
            }
            other => panic!("expected Changed, got {other:?}"),
        }
    }
    fs::write(&p0, contents(rel0)).unwrap();
    assert_eq!(read(src.as_ref(), 0).unwrap(), contents(rel0));

    // A vanished file: NotFound naming sample and path.
    let (rel3, _) = EXPECTED[3];
    let p3 = root.join(rel3);
    fs::rename(&p3, tmp.path().join("aside")).unwrap();
    match read(src.as_ref(), 3) {
        Err(Error::NotFound { sample, path }) => {
            assert_eq!(sample, 3);
            assert_eq!(path, abs_root.join(rel3));
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    fs::rename(tmp.path().join("aside"), &p3).unwrap();
    assert!(
        !b.open(&root, &ixdir).unwrap().reused,
        "removing and restoring a file changes its directory"
    );
    backdate(&root);
    assert!(
        !b.open(&root, &ixdir).unwrap().reused,
        "a back-dated mtime differs from the recorded one"
    );
    assert!(b.open(&root, &ixdir).unwrap().reused);

    // A new file next to listed ones: rescanned; a directory scan picks it up at its sorted place.
    fs::write(root.join("dog/new.bmp"), b"new!").unwrap();
    let grown = b.open(&root, &ixdir).unwrap();
    assert!(!grown.reused, "adding a file triggers a rescan");
    if b.discovers_files() {
        assert_eq!(grown.src.len(), EXPECTED.len() + 1);
        assert_eq!(grown.src.path(5), abs_root.join("dog/new.bmp"));
        assert_eq!(grown.src.label(5), 1);
        assert_ne!(grown.src.fingerprint(), fp);
    } else {
        assert_eq!(grown.src.len(), EXPECTED.len());
        assert_eq!(grown.src.fingerprint(), fp);
    }
}

#[test]
fn image_folder_conforms() {
    conformance(&Folder);
}

#[test]
fn file_list_conforms() {
    conformance(&List);
}

#[test]
fn throttled_image_folder_conforms_and_counts() {
    let st = tempfile::tempdir().unwrap();
    let spec = EmulatedSpec {
        open_latency_s: 0.0,
        bandwidth_mbps: 1000.0,
    };
    let fs = EmulatedFs::open(spec, &st.path().join("state")).unwrap();
    conformance(&ThrottledFolder(fs.clone()));
    // Only successful reads count: the full pass plus the re-read after restoring the file; the
    // Changed and NotFound reads do not.
    assert_eq!(fs.files_read(), EXPECTED.len() as u64 + 1);
}

fn one_mb_files(dir: &Path) -> Vec<PathBuf> {
    (0..4)
        .map(|k| {
            let p = dir.join(format!("f{k}"));
            fs::write(&p, vec![k as u8; 1_000_000]).unwrap();
            p
        })
        .collect()
}

#[test]
fn emulated_bandwidth_caps_one_and_many_readers() {
    let d = tempfile::tempdir().unwrap();
    let files = one_mb_files(d.path());
    let spec = EmulatedSpec {
        open_latency_s: 0.0,
        bandwidth_mbps: 10.0,
    };
    let fs = EmulatedFs::open(spec, &d.path().join("state")).unwrap();

    let t = Instant::now();
    for (k, p) in files.iter().enumerate() {
        assert_eq!(fs.read_file(p).unwrap(), vec![k as u8; 1_000_000]);
    }
    let serial = t.elapsed().as_secs_f64();

    let t = Instant::now();
    std::thread::scope(|s| {
        for p in &files {
            let fs = &fs;
            s.spawn(move || {
                let mut buf = vec![0u8; 1_000_000];
                fs.read_into(0, p, &mut buf).unwrap();
            });
        }
    });
    let parallel = t.elapsed().as_secs_f64();
    // 4 MB at 10 MB/s: 0.4 s however many readers share the bandwidth.
    for el in [serial, parallel] {
        assert!(el >= 0.39, "4 MB at 10 MB/s took {el:.3} s");
        assert!(el < 2.0, "4 MB at 10 MB/s took {el:.3} s");
    }
    assert_eq!(fs.files_read(), 8);
    assert_eq!(fs.bytes_read(), 8_000_000);
}

#[test]
fn emulated_handles_on_one_state_file_share_counters_and_bandwidth() {
    let d = tempfile::tempdir().unwrap();
    let files = one_mb_files(d.path());
    let spec = EmulatedSpec {
        open_latency_s: 0.0,
        bandwidth_mbps: 10.0,
    };
    let state = d.path().join("state");
    let a = EmulatedFs::open(spec, &state).unwrap();
    let b = EmulatedFs::open(spec, &state).unwrap();
    let t = Instant::now();
    std::thread::scope(|s| {
        for (k, p) in files.iter().enumerate() {
            let h = if k % 2 == 0 { a.clone() } else { b.clone() };
            s.spawn(move || h.read_file(p).unwrap());
        }
    });
    let el = t.elapsed().as_secs_f64();
    assert!(
        el >= 0.39,
        "two handles must share one 10 MB/s budget; 4 MB took {el:.3} s"
    );
    assert!(el < 2.0, "{el}");
    assert_eq!((a.files_read(), b.files_read()), (4, 4));
    assert_eq!((a.bytes_read(), b.bytes_read()), (4_000_000, 4_000_000));
    a.reset_counters();
    assert_eq!((b.files_read(), b.bytes_read()), (0, 0));
}

/// Set in child processes of `processes_opening_at_once_scan_once`: "<root>|<index dir>".
const CHILD_ENV: &str = "CLAIRVOYANT_TEST_CHILD_OPEN";

#[test]
fn processes_opening_at_once_scan_once() {
    if let Ok(arg) = std::env::var(CHILD_ENV) {
        let (root, ix) = arg.split_once('|').unwrap();
        let s = image_folder(Path::new(root), Some(Path::new(ix))).unwrap();
        println!("CHILD {:016x} {}", s.fingerprint(), s.index_was_reused());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("data");
    make_tree(&root);
    let ix = tmp.path().join("ix");
    let children: Vec<_> = (0..4)
        .map(|_| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "processes_opening_at_once_scan_once",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, format!("{}|{}", root.display(), ix.display()))
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut seen = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let line = text
            .lines()
            .find_map(|l| l.split_once("CHILD ").map(|(_, r)| r))
            .unwrap_or_else(|| panic!("no child result in {text:?}"))
            .to_string();
        seen.push(line);
    }
    let fp = format!("{:016x}", image_folder(&root, Some(&ix)).unwrap().fingerprint());
    assert!(seen.iter().all(|l| l.starts_with(&fp)), "{seen:?}");
    assert_eq!(
        seen.iter().filter(|l| l.ends_with("false")).count(),
        1,
        "exactly one process scans: {seen:?}"
    );
}
