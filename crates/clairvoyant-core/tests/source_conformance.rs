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

// -- Container sources (LMDB, tar shards, HDF5 byte ranges) --------------------------------------

use clairvoyant_core::source::hdf5::contiguous_rows;
use clairvoyant_core::source::{hdf5, lmdb, tar_shards, ContainerSource, Hdf5Layout, LmdbRecords};

/// Sets the mtimes of `path` (and everything below it) a minute back, so an index built now is
/// not racy.
fn backdate_all(path: &Path) {
    let t = SystemTime::now() - Duration::from_secs(60);
    if path.is_dir() {
        for e in fs::read_dir(path).unwrap() {
            backdate_all(&e.unwrap().path());
        }
    }
    File::open(path).unwrap().set_modified(t).unwrap();
}

/// A container format as the suite sees it: how to make one, what it holds, how to open it.
trait ContainerCase: Sync {
    /// Writes the container below `dir`; returns the path to open.
    fn make(&self, dir: &Path) -> PathBuf;
    /// (bytes, label) of every sample, in order.
    fn expected(&self) -> Vec<(Vec<u8>, i64)>;
    fn open(&self, path: &Path, index_dir: Option<&Path>, index_path: Option<&Path>) -> Result<ContainerSource, Error>;
    /// The file holding sample `k`.
    fn file_of(&self, path: &Path, k: usize) -> PathBuf;
}

fn container_conformance(c: &dyn ContainerCase) {
    let tmp = tempfile::tempdir().unwrap();
    let path = c.make(&tmp.path().join("data"));
    backdate_all(&tmp.path().join("data"));
    let ix = tmp.path().join("ix");
    let expected = c.expected();

    // Exact bytes, sizes, labels; paths name the container file and the record.
    let first = c.open(&path, Some(&ix), None).unwrap();
    assert!(!first.index_was_reused());
    assert_eq!(first.len(), expected.len());
    for (k, (bytes, label)) in expected.iter().enumerate() {
        let k32 = k as u32;
        assert_eq!(first.size(k32), bytes.len() as u64, "sample {k}");
        assert_eq!(first.label(k32), *label, "sample {k}");
        assert_eq!(&read(&first, k32).unwrap(), bytes, "sample {k}");
        let p = first.path(k32).display().to_string();
        let file = fs::canonicalize(c.file_of(&path, k)).unwrap();
        assert!(p.starts_with(&format!("{}#", file.display())), "{p}");
    }
    // Any order, from several threads at once.
    std::thread::scope(|s| {
        for t in 0..4u32 {
            let (first, expected) = (&first, &expected);
            s.spawn(move || {
                for k in (0..expected.len() as u32).rev().filter(|k| k % 4 == t) {
                    assert_eq!(read(first, k).unwrap(), expected[k as usize].0);
                }
            });
        }
    });
    let fp = first.fingerprint();

    // Unchanged: reused. Ranks opening at once: exactly one indexes.
    assert!(c.open(&path, Some(&ix), None).unwrap().index_was_reused());
    let ix2 = tmp.path().join("ix2");
    let barrier = Barrier::new(4);
    let results: Vec<(u64, bool)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let o = c.open(&path, Some(&ix2), None).unwrap();
                    (o.fingerprint(), o.index_was_reused())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|&(f, _)| f == fp), "{results:?}");
    assert_eq!(results.iter().filter(|r| !r.1).count(), 1, "{results:?}");

    // A damaged index is rebuilt.
    let ip = first.index_path().unwrap().to_path_buf();
    let mut bytes = fs::read(&ip).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    fs::write(&ip, &bytes).unwrap();
    let o = c.open(&path, Some(&ix), None).unwrap();
    assert!(!o.index_was_reused() && o.fingerprint() == fp);
    let bytes = fs::read(&ip).unwrap();
    fs::write(&ip, &bytes[..bytes.len() - 3]).unwrap();
    assert!(!c.open(&path, Some(&ix), None).unwrap().index_was_reused());

    // An explicitly named index of another container is refused; its own explicit path works.
    let other = c.make(&tmp.path().join("other"));
    let foreign = c.open(&other, Some(&tmp.path().join("ix-other")), None).unwrap();
    let foreign = foreign.index_path().unwrap().to_path_buf();
    match c.open(&path, None, Some(&foreign)) {
        Err(Error::BadIndex { index, .. }) => assert_eq!(index, foreign),
        other => panic!("expected BadIndex, got {:?}", other.map(|s| s.len())),
    }
    let own = tmp.path().join("own.cvidx");
    assert!(!c.open(&path, None, Some(&own)).unwrap().index_was_reused());
    assert!(c.open(&path, None, Some(&own)).unwrap().index_was_reused());

    // A container changed after indexing: Changed, naming the file and the record; a new open
    // re-indexes.
    let f0 = fs::canonicalize(c.file_of(&path, 0)).unwrap();
    let orig = fs::read(&f0).unwrap();
    let mut grown = orig.clone();
    grown.extend_from_slice(&[0u8; 4096]);
    fs::write(&f0, &grown).unwrap();
    match read(&first, 0) {
        Err(Error::Changed { path, index, reason }) => {
            assert_eq!(path, f0);
            assert_eq!(index, ip);
            assert!(reason.contains("sample 0"), "{reason}");
        }
        other => panic!("expected Changed, got {other:?}"),
    }
    assert!(!c.open(&path, Some(&ix), None).unwrap().index_was_reused());

    // Truncated: indexing it again is Corrupt naming the container file and a record (or page).
    fs::write(&f0, &orig[..orig.len() * 2 / 3]).unwrap();
    match c.open(&path, Some(&tmp.path().join("ix3")), None) {
        Err(Error::Corrupt { path, record, reason }) => {
            assert_eq!(path, f0, "{record}: {reason}");
            assert!(!record.is_empty());
            let msg = Error::Corrupt { path, record, reason }.to_string();
            assert!(msg.contains(&f0.display().to_string()), "{msg}");
        }
        other => panic!("expected Corrupt, got {:?}", other.map(|s| s.len())),
    }
}

/// The checked-in LMDB of Caffe Datums written by tests/data/make_fixtures.py.
struct LmdbCase;
impl ContainerCase for LmdbCase {
    fn make(&self, dir: &Path) -> PathBuf {
        let p = dir.join("caffe.lmdb");
        fs::create_dir_all(&p).unwrap();
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/caffe.lmdb/data.mdb");
        fs::copy(src, p.join("data.mdb")).unwrap();
        p
    }
    fn expected(&self) -> Vec<(Vec<u8>, i64)> {
        (0..305usize)
            .map(|k| {
                let n = if k < 300 { 16 } else { 3 * 40 * 40 };
                let data = (0..n).map(|i| ((7 * k + i) % 256) as u8).collect();
                (data, if k == 5 { -1 } else { (k % 3) as i64 })
            })
            .collect()
    }
    fn open(&self, path: &Path, ix: Option<&Path>, ip: Option<&Path>) -> Result<ContainerSource, Error> {
        lmdb(path, LmdbRecords::CaffeDatum, ix, ip)
    }
    fn file_of(&self, path: &Path, _k: usize) -> PathBuf {
        path.join("data.mdb")
    }
}

/// Three tar shards of `.bin` samples with `.cls` labels (one `.json`), plus a directory entry.
struct TarCase;
impl TarCase {
    const PER_SHARD: usize = 7;
    fn sample(k: usize) -> (Vec<u8>, i64) {
        (vec![(k * 13 % 256) as u8; 100 + 37 * k], (k % 4) as i64)
    }
}
impl ContainerCase for TarCase {
    fn make(&self, dir: &Path) -> PathBuf {
        fs::create_dir_all(dir).unwrap();
        for s in 0..3 {
            let f = File::create(dir.join(format!("shard-{s:03}.tar"))).unwrap();
            let mut b = tar::Builder::new(f);
            let mut add = |name: &str, body: &[u8]| {
                let mut h = tar::Header::new_ustar();
                h.set_size(body.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, name, body).unwrap();
            };
            for k in s * Self::PER_SHARD..(s + 1) * Self::PER_SHARD {
                let (data, label) = Self::sample(k);
                add(&format!("sub/s{k:04}.bin"), &data);
                if k == 3 {
                    add(
                        &format!("sub/s{k:04}.json"),
                        format!("{{\"label\": {label}}}").as_bytes(),
                    );
                } else {
                    add(&format!("sub/s{k:04}.cls"), label.to_string().as_bytes());
                }
            }
            b.finish().unwrap();
        }
        dir.to_path_buf()
    }
    fn expected(&self) -> Vec<(Vec<u8>, i64)> {
        (0..3 * Self::PER_SHARD).map(Self::sample).collect()
    }
    fn open(&self, path: &Path, ix: Option<&Path>, ip: Option<&Path>) -> Result<ContainerSource, Error> {
        tar_shards(&[path.to_path_buf()], None, ix, ip)
    }
    fn file_of(&self, path: &Path, k: usize) -> PathBuf {
        path.join(format!("shard-{:03}.tar", k / Self::PER_SHARD))
    }
}

/// HDF5 as the core sees it: a file and the byte ranges of its rows (the Python package finds
/// them with h5py; its tests run real HDF5 files).
struct Hdf5Case;
impl ContainerCase for Hdf5Case {
    fn make(&self, dir: &Path) -> PathBuf {
        fs::create_dir_all(dir).unwrap();
        let p = dir.join("rows.h5");
        let mut bytes = vec![0xAAu8; 512];
        for (data, _) in self.expected() {
            bytes.extend_from_slice(&data);
        }
        fs::write(&p, bytes).unwrap();
        p
    }
    fn expected(&self) -> Vec<(Vec<u8>, i64)> {
        (0..40).map(|k| (vec![k as u8; 48], (k % 5) as i64)).collect()
    }
    fn open(&self, path: &Path, ix: Option<&Path>, ip: Option<&Path>) -> Result<ContainerSource, Error> {
        let labels: Vec<i64> = self.expected().iter().map(|e| e.1).collect();
        let file = path.to_path_buf();
        // As h5py would report a truncated file: the rows still claim their ranges.
        hdf5(path, "data|labels", ix, ip, || {
            Ok(Hdf5Layout {
                files: vec![file.clone()],
                dirs: vec![],
                records: contiguous_rows(0, "data", 512, 40, 48, &labels),
                ..Hdf5Layout::default()
            })
        })
    }
    fn file_of(&self, path: &Path, _k: usize) -> PathBuf {
        path.to_path_buf()
    }
}

/// HDF5 rows decoded from chunks: 40 rows of 6x4 u16 in chunks of 3x4x3 (rows split across
/// chunks, edge chunks stored whole), shuffled then deflated, one chunk stored raw (its filter
/// mask set), as h5py's `get_chunk_info` would describe them.
struct Hdf5ChunkedCase;
impl Hdf5ChunkedCase {
    const SHAPE: [u64; 3] = [40, 6, 4];
    const CHUNK: [u64; 3] = [3, 4, 3];
    fn value(x: &[u64]) -> u16 {
        (x[0] * 97 + x[1] * 13 + x[2] * 5) as u16
    }
    fn dataset(&self) -> (Vec<u8>, hdf5::ChunkedDataset) {
        use std::io::Write;
        let [s0, s1, s2] = Self::SHAPE;
        let [c0, c1, c2] = Self::CHUNK;
        let mut file = vec![0x55u8; 300];
        let mut chunks = vec![];
        for a in (0..s0).step_by(c0 as usize) {
            for b in (0..s1).step_by(c1 as usize) {
                for c in (0..s2).step_by(c2 as usize) {
                    let mut raw = vec![];
                    for x in a..a + c0 {
                        for y in b..b + c1 {
                            for z in c..c + c2 {
                                raw.extend_from_slice(&Self::value(&[x, y, z]).to_le_bytes());
                            }
                        }
                    }
                    let plain = chunks.len() == 5;
                    let stored = if plain {
                        raw
                    } else {
                        let n = raw.len() / 2;
                        let mut sh = vec![0u8; raw.len()];
                        for i in 0..n {
                            sh[i] = raw[2 * i];
                            sh[n + i] = raw[2 * i + 1];
                        }
                        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                        z.write_all(&sh).unwrap();
                        z.finish().unwrap()
                    };
                    chunks.push(hdf5::StoredChunk {
                        offset: file.len() as u64,
                        size: stored.len() as u64,
                        mask: if plain { 0b11 } else { 0 },
                        coords: vec![a, b, c],
                    });
                    file.extend_from_slice(&stored);
                }
            }
        }
        let ds = hdf5::ChunkedDataset {
            file: 0,
            name: "/data".into(),
            shape: Self::SHAPE.to_vec(),
            chunk: Self::CHUNK.to_vec(),
            itemsize: 2,
            filters: vec![
                hdf5::Filter {
                    id: hdf5::FILTER_SHUFFLE,
                    params: vec![2],
                },
                hdf5::Filter {
                    id: hdf5::FILTER_DEFLATE,
                    params: vec![1],
                },
            ],
            chunks,
        };
        (file, ds)
    }
}
impl ContainerCase for Hdf5ChunkedCase {
    fn make(&self, dir: &Path) -> PathBuf {
        fs::create_dir_all(dir).unwrap();
        let p = dir.join("gzip.h5");
        fs::write(&p, self.dataset().0).unwrap();
        p
    }
    fn expected(&self) -> Vec<(Vec<u8>, i64)> {
        let [s0, s1, s2] = Self::SHAPE;
        (0..s0)
            .map(|x| {
                let mut row = vec![];
                for y in 0..s1 {
                    for z in 0..s2 {
                        row.extend_from_slice(&Self::value(&[x, y, z]).to_le_bytes());
                    }
                }
                (row, (x % 7) as i64)
            })
            .collect()
    }
    fn open(&self, path: &Path, ix: Option<&Path>, ip: Option<&Path>) -> Result<ContainerSource, Error> {
        let file = path.to_path_buf();
        let (_, ds) = self.dataset();
        let row = Self::SHAPE[1] * Self::SHAPE[2] * 2;
        hdf5(path, "data|", ix, ip, || {
            Ok(Hdf5Layout {
                files: vec![file.clone()],
                records: (0..Self::SHAPE[0])
                    .map(|r| hdf5::decoded_record(0, 0, r, row, (r % 7) as i64, format!("/data[{r}]")))
                    .collect(),
                chunked: vec![ds],
                ..Hdf5Layout::default()
            })
        })
    }
    fn file_of(&self, path: &Path, _k: usize) -> PathBuf {
        path.to_path_buf()
    }
}

#[test]
fn hdf5_chunks_conform() {
    container_conformance(&Hdf5ChunkedCase);
}

/// A damaged compressed chunk (same size and mtime, so no change is seen) is Corrupt naming the
/// file and the record.
#[test]
fn hdf5_damaged_chunk_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let p = Hdf5ChunkedCase.make(tmp.path());
    backdate_all(&p);
    let src = Hdf5ChunkedCase.open(&p, Some(&tmp.path().join("ix")), None).unwrap();
    let (_, ds) = Hdf5ChunkedCase.dataset();
    let c = &ds.chunks[9]; // rows 6..9
    let mtime = fs::metadata(&p).unwrap().modified().unwrap();
    let mut bytes = fs::read(&p).unwrap();
    let mid = (c.offset + c.size / 2) as usize;
    for b in &mut bytes[mid..(c.offset + c.size) as usize] {
        *b = 0;
    }
    fs::write(&p, &bytes).unwrap();
    File::options()
        .write(true)
        .open(&p)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    match read(&src, 7) {
        Err(Error::Corrupt { path, record, reason }) => {
            assert_eq!(path, fs::canonicalize(&p).unwrap());
            assert!(record.contains("/data[7] (sample 7)"), "{record}");
            assert!(reason.contains("chunk"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // Rows in undamaged chunks still read.
    assert_eq!(read(&src, 0).unwrap(), Hdf5ChunkedCase.expected()[0].0);
}

#[test]
fn lmdb_conforms() {
    container_conformance(&LmdbCase);
}

#[test]
fn tar_shards_conform() {
    container_conformance(&TarCase);
}

#[test]
fn hdf5_ranges_conform() {
    container_conformance(&Hdf5Case);
}

#[test]
fn lmdb_raw_values_and_bad_datums() {
    let tmp = tempfile::tempdir().unwrap();
    let path = LmdbCase.make(tmp.path());
    let raw = lmdb(&path, LmdbRecords::Raw, Some(&tmp.path().join("ix")), None).unwrap();
    assert_eq!(raw.len(), 305);
    // A raw value is the whole Datum: its data bytes are inside it.
    let v = read(&raw, 301).unwrap();
    let data = &LmdbCase.expected()[301].0;
    assert!(v.windows(data.len()).any(|w| w == data.as_slice()));
    assert_eq!(raw.path(7).file_name().unwrap().to_str().unwrap(), "data.mdb#00000007");
}

#[test]
fn tar_member_without_data_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("one.tar");
    let mut b = tar::Builder::new(File::create(&p).unwrap());
    let mut h = tar::Header::new_ustar();
    h.set_size(1);
    h.set_cksum();
    b.append_data(&mut h, "lonely.cls", &b"1"[..]).unwrap();
    b.finish().unwrap();
    drop(b);
    match tar_shards(std::slice::from_ref(&p), None, Some(&tmp.path().join("ix")), None) {
        Err(Error::Corrupt { path, record, .. }) => {
            assert_eq!(path, fs::canonicalize(&p).unwrap());
            assert_eq!(record, "lonely");
        }
        other => panic!("expected Corrupt, got {:?}", other.map(|s| s.len())),
    }
}
