//! What the model's tests share: a base model of a known machine and a full file read over it.

use std::path::{Path, PathBuf};

use super::SystemModel;
use crate::error::{Error, Result};
use crate::sysinfo::Machine;

/// The model detected on a 16 GiB, 4-CPU machine without an SSD directory.
pub(super) fn base() -> SystemModel {
    let m = Machine {
        mem_total: Some(16 << 30),
        mem_available: Some(8 << 30),
        cpus: 4,
    };
    SystemModel::detect_on(&m, Some(PathBuf::from("/nonexistent/clairvoyant-ssd")))
}

/// `s` read as `/etc/test/system.toml` over [`base`].
pub(super) fn parse(s: &str) -> Result<SystemModel> {
    SystemModel::from_toml_with_base(s, Path::new("/etc/test/system.toml"), base())
}

/// The key of a config error, panicking on anything else.
pub(super) fn key_of(r: Result<SystemModel>) -> String {
    match r {
        Err(Error::Config { key, .. }) => key,
        other => panic!("expected a config error, got {other:?}"),
    }
}

pub(super) const FULL: &str = r#"
interconnect_mbps = 10000.0
compute_mbps = 800
preprocess_mbps = 1500.5

[staging]
capacity = "512MiB"
threads = 4
write_mbps = [[1, 4000.0], [4, 16000.0]]

[pfs]
read_mbps = [[1, 250.0], [4, 900.0], [16, 2500.0]]
open_latency_ms = 2.5

[[class]]
name = "memory"
kind = "memory"
capacity = "8 GiB"
threads = 2
read_mbps = [[1, 5000.0], [4, 20000.0]]
write_mbps = 4000

[[class]]
name = "ssd"
kind = "directory"
path = "/local/scratch/cv"
capacity = "1.5GB"
threads = 4
read_mbps = [[1, 500.0], [4, 1800.0]]
write_mbps = [[1, 300.0], [4, 900.0]]
"#;

/// [`FULL`], parsed.
pub(super) fn sample() -> SystemModel {
    parse(FULL).unwrap()
}
