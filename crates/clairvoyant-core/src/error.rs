//! The one error type of the core. Variants are named for what the caller can do about them;
//! context lives in fields so bindings can map each variant to a fitting exception.

use std::path::PathBuf;

/// A result whose error is the core's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the core, with the context a caller needs to act on it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration value (or argument) is invalid; `key` names the field.
    #[error("invalid value for '{key}': {reason}")]
    Config {
        /// The field, argument or setting that is invalid.
        key: String,
        /// Why the value is refused (and what would be accepted).
        reason: String,
    },

    /// A sample's file does not exist.
    #[error("sample {sample} ({path}) not found")]
    NotFound {
        /// Index of the sample in the dataset.
        sample: u64,
        /// The file that does not exist.
        path: PathBuf,
    },

    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file or directory the operation was on.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The dataset differs from its index (a file changed size, appeared or vanished).
    #[error("dataset changed after indexing: {path}: {reason}; delete the index ({index}) or let it rebuild")]
    Changed {
        /// The dataset file or directory that changed.
        path: PathBuf,
        /// The index file that no longer describes the dataset.
        index: PathBuf,
        /// What changed (size, appeared, vanished).
        reason: String,
    },

    /// A container (LMDB, HDF5, tar) or one of its records is damaged or truncated, or uses a
    /// layout this reader does not understand; `record` names the key, index or member.
    #[error("{path}: record {record}: {reason}")]
    Corrupt {
        /// The container file.
        path: PathBuf,
        /// The record's key, index or member name.
        record: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An index file belongs to another dataset or is damaged.
    #[error("index {index} {reason}")]
    BadIndex {
        /// The index file.
        index: PathBuf,
        /// What is wrong with it (another dataset's, damaged, another version).
        reason: String,
    },

    /// A file at the name of a node cache's shared state is not one (remove it, or use another
    /// run id).
    #[error("{path} is not a clairvoyant node cache; remove it or choose another run id")]
    NotNodeCache {
        /// The file found where the node cache's state segment belongs.
        path: PathBuf,
    },

    /// A sample does not fit a buffer or storage class.
    #[error("sample {sample} ({path}) is {size} bytes, larger than {what} ({capacity} bytes)")]
    TooLarge {
        /// Index of the sample in the dataset.
        sample: u64,
        /// The sample's file (or name in its container).
        path: String,
        /// The sample's size in bytes.
        size: u64,
        /// The buffer or class it does not fit (e.g. the staging ring).
        what: String,
        /// Capacity of that buffer or class in bytes.
        capacity: u64,
    },

    /// Every epoch of the job was consumed: there is no next sample.
    #[error("all {epochs} epochs of this job were consumed")]
    Exhausted {
        /// Number of epochs the job had.
        epochs: u32,
    },

    /// An epoch past the job's last one (pass more epochs to the job).
    #[error("epoch {epoch} is past the job's last epoch ({last})")]
    EpochPastEnd {
        /// The epoch asked for.
        epoch: u32,
        /// The job's last epoch.
        last: u32,
    },

    /// An epoch before the epoch the job was started (resumed) at.
    #[error("epoch {epoch} is before the job's start epoch {first}")]
    EpochBeforeStart {
        /// The epoch asked for.
        epoch: u32,
        /// The epoch the job started (resumed) at.
        first: u32,
    },

    /// An epoch that was already consumed (epochs are consumed in order).
    #[error("epoch {epoch} was already consumed (epochs are consumed in order; the next is {next})")]
    EpochConsumed {
        /// The epoch asked for.
        epoch: u32,
        /// The next epoch still to be consumed.
        next: u32,
    },

    /// The samples of a consumed (or skipped) epoch, which the engine no longer holds.
    #[error("the samples of epoch {epoch} were dropped once it was consumed or skipped (the current epoch is {next})")]
    EpochDropped {
        /// The epoch asked for.
        epoch: u32,
        /// The current epoch.
        next: u32,
    },

    /// Waiting for another process (a local rank initialising shared state) took too long.
    #[error("timed out after {seconds} s waiting for {what} ({path})")]
    TimedOut {
        /// The shared file that was being waited on.
        path: PathBuf,
        /// What was awaited, in words.
        what: String,
        /// How long the wait lasted, in seconds.
        seconds: u64,
    },

    /// A simulated run stopped before its last iteration: no simulated thread could progress.
    #[error("simulation of {policy} stopped at iteration {iteration} of {iterations}: no thread could make progress")]
    SimulationStalled {
        /// Name of the simulated policy.
        policy: String,
        /// The iteration the simulation stopped at.
        iteration: u64,
        /// Iterations the run should have had.
        iterations: u64,
    },

    /// The job was shut down while waiting.
    #[error("the job was shut down")]
    Cancelled,

    /// A plan would need more memory than the machine has available: refused before allocating.
    #[error("the plan of {what} needs about {} of memory, but {} is available; {hint}", crate::model::format_bytes(*need), crate::model::format_bytes(*available))]
    PlanTooLarge {
        /// What the plan is for, in words.
        what: String,
        /// Estimated bytes of memory the plan needs.
        need: u64,
        /// Bytes of memory available on the machine.
        available: u64,
        /// What to change to make it fit.
        hint: String,
    },

    /// A node-shared file or directory is not private to this user (a symlink, a file of another
    /// user, group or world access): it is never read, written or truncated.
    #[error("refusing {path}: {reason}")]
    Untrusted {
        /// The refused file or directory.
        path: PathBuf,
        /// Why it is not trusted (symlink, owner, mode).
        reason: String,
    },
}

impl Error {
    /// An [`Error::Config`] for field `key`.
    pub fn config(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Config {
            key: key.into(),
            reason: reason.into(),
        }
    }

    /// An [`Error::Untrusted`] for `path`.
    pub fn untrusted(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Untrusted {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// An [`Error::Io`] on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
