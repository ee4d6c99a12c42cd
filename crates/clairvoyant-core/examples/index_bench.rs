//! Times indexing an ImageFolder tree of many small files: the first (scanning) open and later
//! opens that reuse the index. Usage: `index_bench [classes] [files_per_class] [file_bytes]`.

use std::fs::{self, File};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use clairvoyant_core::source::{image_folder, Source};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |k: usize, default: usize| std::env::args().nth(k).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (classes, per_class, bytes) = (arg(1, 1000), arg(2, 200), arg(3, 100));
    let tmp = tempfile::Builder::new().prefix("cv-index-bench-").tempdir_in("/tmp")?;
    let root = tmp.path().join("data");
    let ixdir = tmp.path().join("ix");

    let t = Instant::now();
    let payload = vec![7u8; bytes];
    for c in 0..classes {
        let d = root.join(format!("class{c:04}"));
        fs::create_dir_all(&d)?;
        for f in 0..per_class {
            fs::write(d.join(format!("img{f:05}.jpg")), &payload)?;
        }
    }
    // Back-date the directories: an index of directories modified within the last 2 s would be
    // rescanned on the next open (racy mtimes), which is not what the warm timing is about.
    let past = SystemTime::now() - Duration::from_secs(60);
    File::open(&root)?.set_modified(past)?;
    for e in fs::read_dir(&root)? {
        File::open(e?.path())?.set_modified(past)?;
    }
    println!(
        "created {} files in {:.2} s",
        classes * per_class,
        t.elapsed().as_secs_f64()
    );

    let t = Instant::now();
    let cold = image_folder(&root, Some(&ixdir))?;
    let cold_s = t.elapsed().as_secs_f64();
    assert!(!cold.index_was_reused());
    assert_eq!(cold.len(), classes * per_class);
    let index_bytes = fs::metadata(cold.index_path().unwrap())?.len();
    println!(
        "cold scan: {:.3} s for {} samples ({} classes, {threads} rayon threads); index {:.1} MB",
        cold_s,
        cold.len(),
        cold.classes().len(),
        index_bytes as f64 / 1e6,
        threads = rayon::current_num_threads()
    );

    let mut warm = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let w = image_folder(&root, Some(&ixdir))?;
        warm.push(t.elapsed().as_secs_f64());
        assert!(w.index_was_reused());
        assert_eq!(w.fingerprint(), cold.fingerprint());
    }
    warm.sort_by(f64::total_cmp);
    println!(
        "warm load (index reused): median {:.4} s, min {:.4} s over {} runs",
        warm[2],
        warm[0],
        warm.len()
    );
    drop(cold);
    remove(tmp.path())?;
    Ok(())
}

fn remove(p: &Path) -> std::io::Result<()> {
    let t = Instant::now();
    fs::remove_dir_all(p)?;
    println!("removed the generated files in {:.2} s", t.elapsed().as_secs_f64());
    Ok(())
}
