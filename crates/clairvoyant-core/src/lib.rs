//! clairvoyant core: access streams, placement, performance model, sources, node-shared tiers
//! and the prefetching engine. No Python here; bindings live in `clairvoyant-py`.

#![warn(missing_docs)]

pub mod clock;
pub mod engine;
pub mod error;
pub mod mem;
pub mod model;
pub mod plan;
pub mod probe;
pub mod readahead;
pub mod schedule;
pub mod source;
pub mod sysinfo;
#[cfg(feature = "test-support")]
pub mod test_support;
pub mod tier;

pub use error::{Error, Result};
