//! Peer transport for clairvoyant: each node runs one [`Server`] that serves its cached samples
//! by sample id to authenticated members of the same job, and each rank shares one [`Client`]
//! that fetches from other nodes into its own buffers. No Python. The transport knows nothing
//! of the core; the `engine` feature (on by default) adds [`engine`], which joins the two.
//!
//! Wire format, handshake and fault handling: `docs/architecture.md`, "Peer transport".
#![warn(missing_docs)]

mod client;
mod clock;
#[cfg(feature = "engine")]
pub mod engine;
mod error;
pub mod frame;
mod secret;
mod server;
mod wire;

#[doc(hidden)]
pub mod fuzzing;

pub use client::{parse_challenge, Client, ClientConfig, ClientStats, Fetch, MAX_BACKOFF_FACTOR};
pub use clock::{Clock, ManualClock, RealClock};
pub use error::{FrameError, NetError};
pub use frame::{decode, decode_frame, Header, Kind};
pub use secret::Secret;
pub use server::{Provider, Served, Server, ServerConfig, ServerStats};
