//! HDF5 datasets, read without the HDF5 library's global lock: where a dataset is contiguous, or
//! chunked without filters, each sample (one slab along the leading axis, or one dataset of a
//! per-sample file as in CosmoFlow) is a byte range of the file, read with `pread` by any number
//! of threads and processes at once. The ranges are computed at indexing time by the caller (the
//! Python package uses h5py, whose wheels carry libhdf5, so no system HDF5 is needed); this
//! module keeps them in a container index like the other container sources.

use std::path::{Path, PathBuf};

use super::container::{canonical, ContainerFile, ContainerIndex, ContainerSource, Record};
use crate::error::Result;

/// Where the samples of an HDF5 dataset lie: the files, the directories whose listing defines
/// them (CosmoFlow), and one record per sample (`file` indexes `files`).
#[derive(Clone, Debug, Default)]
pub struct Hdf5Layout {
    pub files: Vec<PathBuf>,
    pub dirs: Vec<PathBuf>,
    pub records: Vec<Record>,
}

/// Opens the HDF5 dataset at `path` (a file, or a directory of per-sample files); `options`
/// (dataset names, label dataset) are part of its identity. `layout` runs only when the index
/// must be (re)built: once per node, under the index lock.
pub fn hdf5(
    path: &Path,
    options: &str,
    index_dir: Option<&Path>,
    index_path: Option<&Path>,
    layout: impl FnOnce() -> Result<Hdf5Layout>,
) -> Result<ContainerSource> {
    let identity = format!("hdf5:{}:{options}", canonical(path)?.display());
    ContainerSource::open(&identity, index_dir, index_path, || {
        let mut ix = ContainerIndex::new(identity.clone());
        let l = layout()?;
        for d in &l.dirs {
            ix.dirs.push(ContainerFile::stat(&canonical(d)?)?);
        }
        for f in &l.files {
            ix.files.push(ContainerFile::stat(&canonical(f)?)?);
        }
        ix.records = l.records;
        Ok(ix)
    })
}

/// Records of `rows` samples of `row_bytes` each, stored contiguously from `offset` of file
/// `file`, named `<dataset>[<row>]`.
pub fn contiguous_rows(
    file: u32,
    dataset: &str,
    offset: u64,
    rows: u64,
    row_bytes: u64,
    labels: &[i64],
) -> Vec<Record> {
    (0..rows)
        .map(|k| Record {
            file,
            offset: offset + k * row_bytes,
            len: row_bytes,
            label: labels.get(k as usize).copied().unwrap_or(0),
            name: format!("{dataset}[{k}]"),
            shape: vec![],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::Source;

    #[test]
    fn contiguous_rows_are_byte_ranges() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.h5");
        std::fs::write(&p, b"....aabbcc").unwrap();
        let src = hdf5(&p, "x", Some(&d.path().join("ix")), None, || {
            Ok(Hdf5Layout {
                files: vec![p.clone()],
                dirs: vec![],
                records: contiguous_rows(0, "x", 4, 3, 2, &[1, 2, 3]),
            })
        })
        .unwrap();
        let mut b = [0u8; 2];
        src.read_into(2, &mut b).unwrap();
        assert_eq!((&b, src.label(2)), (b"cc", 3));
        assert!(src.path(1).to_str().unwrap().ends_with("f.h5#x[1]"));
    }
}
