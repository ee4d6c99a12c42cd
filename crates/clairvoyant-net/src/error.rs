//! Errors of the peer transport: `NetError` for callers, `FrameError` for the wire decoder.

use std::net::SocketAddr;

/// What went wrong locally (configuration, binding, a bad peer index). Trouble with a remote
/// peer is not an error: [`crate::Client::fetch`] answers it with [`crate::Fetch::PeerDown`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// A secret was too short or not valid hex.
    #[error("invalid secret: {reason}")]
    Secret {
        /// What is wrong with it.
        reason: String,
    },
    /// A peer index outside the client's peer list.
    #[error("no peer {peer}: the client knows {peers} peers")]
    BadPeer {
        /// The index asked for.
        peer: usize,
        /// Peers the client knows.
        peers: usize,
    },
    /// A configuration value that cannot work.
    #[error("invalid config {key}: {reason}")]
    Config {
        /// The setting.
        key: &'static str,
        /// Why its value cannot work.
        reason: String,
    },
    /// The server could not bind or start its accept thread.
    #[error("cannot serve on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
}

/// Why a byte string is not a valid frame (see `docs/architecture.md`, "Peer transport").
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Fewer bytes than the header (or header + payload) needs.
    #[error("truncated frame: {have} bytes, need {need}")]
    Truncated {
        /// Bytes present.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The first four bytes are not the protocol magic.
    #[error("bad magic {got:02x?}")]
    Magic {
        /// The bytes found.
        got: [u8; 4],
    },
    /// A protocol version this build does not speak.
    #[error("unsupported protocol version {got} (this build speaks {})", crate::frame::VERSION)]
    Version {
        /// The version found.
        got: u8,
    },
    /// An unknown frame kind.
    #[error("unknown frame kind {got}")]
    Kind {
        /// The kind byte found.
        got: u8,
    },
    /// Flag bits that version 1 does not define.
    #[error("unknown flags {got:#06x} on a {kind} frame")]
    Flags {
        /// The frame's kind.
        kind: &'static str,
        /// The flag bits found.
        got: u16,
    },
    /// A payload length outside what the kind allows (checked before anything is allocated).
    #[error("{kind} frame with a {len}-byte payload (allowed {min}..={max})")]
    Length {
        /// The frame's kind.
        kind: &'static str,
        /// The payload length found.
        len: u32,
        /// Smallest length allowed.
        min: u32,
        /// Largest length allowed.
        max: u32,
    },
}
