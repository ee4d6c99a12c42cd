//! The one error type of the core. Variants are named for what the caller can do about them;
//! context lives in fields so bindings can map each variant to a fitting exception.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value (or argument) is invalid; `key` names the field.
    #[error("invalid value for '{key}': {reason}")]
    Config { key: String, reason: String },

    /// A sample's file does not exist.
    #[error("sample {sample} ({path}) not found")]
    NotFound { sample: u64, path: PathBuf },

    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The dataset differs from its index (a file changed size, appeared or vanished).
    #[error("dataset changed after indexing: {path}: {reason}; delete the index ({index}) or let it rebuild")]
    Changed {
        path: PathBuf,
        index: PathBuf,
        reason: String,
    },

    /// A container (LMDB, HDF5, tar) or one of its records is damaged or truncated, or uses a
    /// layout this reader does not understand; `record` names the key, index or member.
    #[error("{path}: record {record}: {reason}")]
    Corrupt {
        path: PathBuf,
        record: String,
        reason: String,
    },

    /// An index file belongs to another dataset or is damaged.
    #[error("index {index} {reason}")]
    BadIndex { index: PathBuf, reason: String },

    /// A file at the name of a node cache's shared state is not one (remove it, or use another
    /// run id).
    #[error("{path} is not a clairvoyant node cache; remove it or choose another run id")]
    NotNodeCache { path: PathBuf },

    /// A sample does not fit a buffer or storage class.
    #[error("sample {sample} ({path}) is {size} bytes, larger than {what} ({capacity} bytes)")]
    TooLarge {
        sample: u64,
        path: String,
        size: u64,
        what: String,
        capacity: u64,
    },

    /// Every epoch of the job was consumed: there is no next sample.
    #[error("all {epochs} epochs of this job were consumed")]
    Exhausted { epochs: u32 },

    /// An epoch past the job's last one (pass more epochs to the job).
    #[error("epoch {epoch} is past the job's last epoch ({last})")]
    EpochPastEnd { epoch: u32, last: u32 },

    /// An epoch before the epoch the job was started (resumed) at.
    #[error("epoch {epoch} is before the job's start epoch {first}")]
    EpochBeforeStart { epoch: u32, first: u32 },

    /// An epoch that was already consumed (epochs are consumed in order).
    #[error("epoch {epoch} was already consumed (epochs are consumed in order; the next is {next})")]
    EpochConsumed { epoch: u32, next: u32 },

    /// The samples of a consumed (or skipped) epoch, which the engine no longer holds.
    #[error("the samples of epoch {epoch} were dropped once it was consumed or skipped (the current epoch is {next})")]
    EpochDropped { epoch: u32, next: u32 },

    /// Waiting for another process (a local rank initialising shared state) took too long.
    #[error("timed out after {seconds} s waiting for {what} ({path})")]
    TimedOut { path: PathBuf, what: String, seconds: u64 },

    /// A simulated run stopped before its last iteration: no simulated thread could progress.
    #[error("simulation of {policy} stopped at iteration {iteration} of {iterations}: no thread could make progress")]
    SimulationStalled {
        policy: String,
        iteration: u64,
        iterations: u64,
    },

    /// The job was shut down while waiting.
    #[error("the job was shut down")]
    Cancelled,

    /// A plan would need more memory than the machine has available: refused before allocating.
    #[error("the plan of {what} needs about {} of memory, but {} is available; {hint}", crate::model::format_bytes(*need), crate::model::format_bytes(*available))]
    PlanTooLarge {
        what: String,
        need: u64,
        available: u64,
        hint: String,
    },

    /// A node-shared file or directory is not private to this user (a symlink, a file of another
    /// user, group or world access): it is never read, written or truncated.
    #[error("refusing {path}: {reason}")]
    Untrusted { path: PathBuf, reason: String },
}

impl Error {
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            reason: reason.into(),
        }
    }

    pub fn untrusted(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Untrusted {
            path: path.into(),
            reason: reason.into(),
        }
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
