//! LMDB values the page walk cannot place (the duplicates of a key in a DUPSORT main database:
//! sub-pages, sub-databases, DUPFIXED LEAF2 pages) come through the LMDB library, exactly, and
//! are counted. The databases are written here with the library (heed); py-lmdb cannot set flags
//! on the main database.

use std::path::Path;

use clairvoyant_core::source::{lmdb, Datum, LmdbRecords, Source};
use heed::types::Bytes;
use heed::{CommitOrAbort, DatabaseFlags, EnvOpenOptions};
use prost::Message;

/// Writes `items` into the main database of a new environment in `dir`, opened with `flags`.
fn write(dir: &Path, flags: DatabaseFlags, items: &[(Vec<u8>, Vec<u8>)]) {
    std::fs::create_dir_all(dir).unwrap();
    // SAFETY: LMDB needs an environment opened once per process and its files left alone while open: `dir` is
    // this test's own temporary directory, and the environment is closed (prepare_for_closing) before
    // anything else opens or touches it.
    let env = unsafe { EnvOpenOptions::new().map_size(1 << 26).open(dir).unwrap() };
    let wtxn = env.write_txn().unwrap();
    let db = env
        .create_databases_and_commit(wtxn, |wdo, wtxn| {
            wdo.database_options()
                .types::<Bytes, Bytes>()
                .flags(flags)
                .create(wtxn)
                .map(CommitOrAbort::<_, ()>::Commit)
        })
        .unwrap()
        .unwrap_commit();
    let mut wtxn = env.write_txn().unwrap();
    for (k, v) in items {
        db.put(&mut wtxn, k, v).unwrap();
    }
    wtxn.commit().unwrap();
    env.prepare_for_closing().wait();
    // Indexes of files modified within 2 s are rebuilt on the next open (racy); move the
    // modification time back so that a reopen may reuse the index.
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let f = std::fs::File::options().write(true).open(dir.join("data.mdb")).unwrap();
    f.set_modified(old).unwrap();
}

fn value(k: usize, d: usize, n: usize) -> Vec<u8> {
    // The first two bytes make duplicates distinct and sort them by `d`.
    let mut v = vec![(d >> 8) as u8, d as u8];
    v.extend((0..n).map(|i| ((k * 7 + d * 13 + i) % 251) as u8));
    v
}

#[test]
fn dupsort_values_come_through_the_library_exactly_and_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let mut items = Vec::new();
    let mut library = 0;
    for k in 0..40usize {
        // One value (a plain node), three (a sub-page) or 300 (a sub-database).
        let dups = if k == 17 {
            300
        } else if k % 3 == 0 {
            3
        } else {
            1
        };
        if dups > 1 {
            library += dups;
        }
        for d in 0..dups {
            items.push((format!("k{k:04}").into_bytes(), value(k, d, 60 + (k + d) % 50)));
        }
    }
    write(&dir, DatabaseFlags::DUP_SORT, &items);
    items.sort(); // cursor order: keys, then each key's duplicates in byte order
    let ix = tmp.path().join("ix");
    let src = lmdb(&dir, LmdbRecords::Raw, Some(&ix), None).unwrap();
    assert_eq!(src.len(), items.len());
    assert_eq!(src.fallback_records(), library);
    assert_eq!(src.fallback_reads(), 0);
    for (i, (key, v)) in items.iter().enumerate() {
        assert_eq!(src.size(i as u32), v.len() as u64, "sample {i}");
        let mut buf = vec![0u8; v.len()];
        src.read_into(i as u32, &mut buf).unwrap();
        assert_eq!(&buf, v, "sample {i}");
        let p = src.path(i as u32).to_string_lossy().into_owned();
        assert!(
            p.ends_with(&format!("data.mdb#{}", String::from_utf8_lossy(key))),
            "{p}"
        );
    }
    assert_eq!(src.fallback_reads(), library as u64);
    // Reopened: the index is reused and marks the same records.
    let again = lmdb(&dir, LmdbRecords::Raw, Some(&ix), None).unwrap();
    assert!(again.index_was_reused());
    assert_eq!(again.fallback_records(), library);
    let last = items.len() - 1;
    let mut buf = vec![0u8; items[last].1.len()];
    again.read_into(last as u32, &mut buf).unwrap();
    assert_eq!(buf, items[last].1);
    assert_eq!(again.fallback_reads(), 1);
}

#[test]
fn dupfixed_leaf2_pages_of_caffe_datums() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let mut items = Vec::new();
    for k in 0..5usize {
        // 200 duplicates: a sub-database of LEAF2 pages; 2: a LEAF2 sub-page.
        for d in 0..(if k == 2 { 200 } else { 2 }) {
            let datum = Datum {
                channels: Some(1),
                height: Some(5),
                width: Some(8),
                data: Some(value(k, d, 38)),
                label: Some((1000 + k * 300 + d) as i32), // two-byte varints: equal lengths
                float_data: vec![],
                encoded: Some(false),
            };
            items.push((format!("d{k:02}").into_bytes(), datum.encode_to_vec()));
        }
    }
    assert!(items.iter().all(|(_, v)| v.len() == items[0].1.len()));
    write(&dir, DatabaseFlags::DUP_SORT | DatabaseFlags::DUP_FIXED, &items);
    items.sort();
    let src = lmdb(&dir, LmdbRecords::CaffeDatum, Some(&tmp.path().join("ix")), None).unwrap();
    assert_eq!(src.len(), 208);
    assert_eq!(src.fallback_records(), 208);
    for (i, (_, v)) in items.iter().enumerate() {
        let d = Datum::decode(v.as_slice()).unwrap();
        let data = d.data.unwrap();
        let mut buf = vec![0u8; src.size(i as u32) as usize];
        src.read_into(i as u32, &mut buf).unwrap();
        assert_eq!(buf, data, "sample {i}");
        assert_eq!(src.label(i as u32), d.label.unwrap() as i64, "sample {i}");
        assert_eq!(src.record(i as u32).shape, [1, 5, 8, 0], "sample {i}");
    }
    assert_eq!(src.fallback_reads(), 208);
}

#[test]
fn a_changed_database_is_refused_before_the_library_reads_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("db");
    let items: Vec<_> = (0..3).map(|d| (b"key".to_vec(), value(0, d, 20))).collect();
    write(&dir, DatabaseFlags::DUP_SORT, &items);
    let src = lmdb(&dir, LmdbRecords::Raw, Some(&tmp.path().join("ix")), None).unwrap();
    assert_eq!(src.fallback_records(), 3);
    let f = std::fs::File::options().write(true).open(dir.join("data.mdb")).unwrap();
    f.set_modified(std::time::SystemTime::now()).unwrap();
    let mut buf = vec![0u8; src.size(1) as usize];
    let err = src.read_into(1, &mut buf).unwrap_err().to_string();
    assert!(err.contains("data.mdb") && err.contains("record key"), "{err}");
    assert_eq!(src.fallback_reads(), 0);
}

/// The DUPSORT items of the checked-in fixture `tests/data/dupsort.lmdb`, which the Python tests
/// read against py-lmdb (a second build of the LMDB library): 12 keys, key 5 with 100
/// duplicates (a sub-database), every third key with 3 (a sub-page), the others with one.
fn fixture_items() -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut items = Vec::new();
    for k in 0..12usize {
        let dups = if k == 5 {
            100
        } else if k % 3 == 0 {
            3
        } else {
            1
        };
        for d in 0..dups {
            items.push((format!("key{k:02}").into_bytes(), value(k, d, 40 + (k + d) % 30)));
        }
    }
    items
}

#[test]
fn dupsort_fixture_is_current() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dupsort.lmdb");
    if std::env::var_os("CLAIRVOYANT_WRITE_FIXTURES").is_some() {
        let _ = std::fs::remove_dir_all(&fixture);
        write(&fixture, DatabaseFlags::DUP_SORT, &fixture_items());
        std::fs::remove_file(fixture.join("lock.mdb")).unwrap();
        println!("wrote {}", fixture.display());
    }
    let tmp = tempfile::tempdir().unwrap();
    let src = lmdb(&fixture, LmdbRecords::Raw, Some(&tmp.path().join("ix")), None).unwrap();
    let mut items = fixture_items();
    items.sort();
    assert_eq!(src.len(), items.len());
    assert_eq!(src.fallback_records(), 100 + 4 * 3);
    for (i, (_, v)) in items.iter().enumerate() {
        let mut buf = vec![0u8; v.len()];
        src.read_into(i as u32, &mut buf).unwrap();
        assert_eq!(&buf, v, "sample {i}");
    }
}
