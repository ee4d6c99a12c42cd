//! What the node agent and the processes it serves share: the frames on the agent's Unix socket
//! ([`proto`]) and the shared-memory directory of cached files ([`dir`]) that lets an interposed
//! process find a cached file without a round trip to the agent.
//!
//! [`launch`] is what a launcher asks of the system for the program it starts.
//!
//! The agent's server itself ([`server`], feature `server`, on by default) answers those
//! processes from the engine's node cache; [`client`] is a launcher's and a test's side of it.
//!
//! Without the `server` feature this crate is deliberately small (std, libc, twox-hash)
//! because it is linked into `libclairvoyant_preload.so`, which is loaded into every process of
//! a transparent-mode job; the preload library depends on it with default features off.

// Every public item of this crate is documented, and stays so.
#![warn(missing_docs)]

pub mod client;
pub mod dir;
pub mod launch;
pub mod proto;
#[cfg(feature = "server")]
pub mod server;

/// The checksum of a cached file's bytes: XXH3-64, the same function as the engine's
/// `tier::checksum`, so a value computed by the engine can be verified here.
pub fn checksum(bytes: &[u8]) -> u64 {
    twox_hash::XxHash3_64::oneshot(bytes)
}
