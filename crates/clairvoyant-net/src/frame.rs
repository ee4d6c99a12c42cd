//! The wire format: a fixed 24-byte little-endian header, then `len` payload bytes.
//!
//! `decode` is pure, never panics and rejects a frame whose length is outside what its kind
//! allows before any buffer is sized from it, so an untrusted length never drives an allocation.

use crate::error::FrameError;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"CVPN";
/// Protocol version; bound into the handshake MACs as well.
pub const VERSION: u8 = 1;
/// Bytes in a header.
pub const HEADER_LEN: usize = 24;
/// Handshake nonces and MACs (HMAC-SHA256) are 32 bytes.
pub const NONCE_LEN: usize = 32;
/// Bytes of a handshake MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Largest sample a `Data` frame may carry (1 GiB).
pub const MAX_DATA: u32 = 1 << 30;
/// Largest `Failed` message in bytes; longer messages are cut.
pub const MAX_MESSAGE: u32 = 1024;
/// Longest wait a `Get` may ask the server for; larger values are clamped.
pub const MAX_WAIT_MICROS: u64 = 60_000_000;

/// Frame kinds. The handshake is Hello -> Challenge -> Auth -> AuthOk, then Get -> one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// client -> server: payload = client nonce; arg = job id.
    Hello = 1,
    /// server -> client: payload = server nonce ++ server MAC.
    Challenge = 2,
    /// client -> server: payload = client MAC.
    Auth = 3,
    /// server -> client: empty; the connection may now carry requests.
    AuthOk = 4,
    /// client -> server: empty; `sample`, arg = how long the server may wait, in microseconds.
    Get = 5,
    /// server -> client: payload = the sample's bytes; arg = their xxh3-64.
    Data = 6,
    /// server -> client: held here but not filled yet.
    NotYet = 7,
    /// server -> client: this node does not cache the sample.
    NotHeld = 8,
    /// server -> client: payload = UTF-8 message (the node failed to read the sample).
    Failed = 9,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Challenge,
            3 => Kind::Auth,
            4 => Kind::AuthOk,
            5 => Kind::Get,
            6 => Kind::Data,
            7 => Kind::NotYet,
            8 => Kind::NotHeld,
            9 => Kind::Failed,
            _ => return None,
        })
    }

    /// The kind's name, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Hello => "Hello",
            Kind::Challenge => "Challenge",
            Kind::Auth => "Auth",
            Kind::AuthOk => "AuthOk",
            Kind::Get => "Get",
            Kind::Data => "Data",
            Kind::NotYet => "NotYet",
            Kind::NotHeld => "NotHeld",
            Kind::Failed => "Failed",
        }
    }

    /// Allowed payload lengths for this kind.
    pub fn payload_range(self) -> (u32, u32) {
        match self {
            Kind::Hello => (NONCE_LEN as u32, NONCE_LEN as u32),
            Kind::Challenge => ((NONCE_LEN + MAC_LEN) as u32, (NONCE_LEN + MAC_LEN) as u32),
            Kind::Auth => (MAC_LEN as u32, MAC_LEN as u32),
            Kind::AuthOk | Kind::Get | Kind::NotYet | Kind::NotHeld => (0, 0),
            Kind::Data => (0, MAX_DATA),
            Kind::Failed => (0, MAX_MESSAGE),
        }
    }
}

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// What the frame is.
    pub kind: Kind,
    /// The sample it concerns (0 where none).
    pub sample: u32,
    /// Payload bytes that follow the header.
    pub len: u32,
    /// Kind-specific: job id (Hello), wait in µs (Get), xxh3-64 checksum (Data), else 0.
    pub arg: u64,
}

impl Header {
    /// A header with these fields.
    pub fn new(kind: Kind, sample: u32, len: u32, arg: u64) -> Header {
        Header { kind, sample, len, arg }
    }

    /// The header's wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        // b[6..8]: flags, zero in version 1.
        b[8..12].copy_from_slice(&self.sample.to_le_bytes());
        b[12..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.arg.to_le_bytes());
        b
    }
}

/// Decode a header from the first `HEADER_LEN` bytes of `buf`, checking magic, version, kind,
/// flags and the payload length against the kind's limits.
pub fn decode(buf: &[u8]) -> Result<Header, FrameError> {
    let Some(b) = buf.get(..HEADER_LEN) else {
        return Err(FrameError::Truncated {
            have: buf.len(),
            need: HEADER_LEN,
        });
    };
    let magic = [b[0], b[1], b[2], b[3]];
    if magic != MAGIC {
        return Err(FrameError::Magic { got: magic });
    }
    if b[4] != VERSION {
        return Err(FrameError::Version { got: b[4] });
    }
    let kind = Kind::from_u8(b[5]).ok_or(FrameError::Kind { got: b[5] })?;
    let flags = u16::from_le_bytes([b[6], b[7]]);
    if flags != 0 {
        return Err(FrameError::Flags {
            kind: kind.name(),
            got: flags,
        });
    }
    let sample = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    let len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[16..24]);
    let arg = u64::from_le_bytes(a);
    let (min, max) = kind.payload_range();
    if len < min || len > max {
        return Err(FrameError::Length {
            kind: kind.name(),
            len,
            min,
            max,
        });
    }
    Ok(Header { kind, sample, len, arg })
}

/// Decode one whole frame from the front of `buf`: its header, its payload (borrowed) and the
/// number of bytes it used.
pub fn decode_frame(buf: &[u8]) -> Result<(Header, &[u8], usize), FrameError> {
    let h = decode(buf)?;
    let end = HEADER_LEN + h.len as usize;
    let payload = buf.get(HEADER_LEN..end).ok_or(FrameError::Truncated {
        have: buf.len(),
        need: end,
    })?;
    Ok((h, payload, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_every_kind() {
        for k in 1..=9u8 {
            let kind = Kind::from_u8(k).unwrap();
            let (min, _) = kind.payload_range();
            let h = Header::new(kind, 7, min, 0xdead_beef);
            assert_eq!(decode(&h.encode()).unwrap(), h);
        }
    }

    #[test]
    fn rejects_oversized_and_bad_fields() {
        let mut b = Header::new(Kind::Data, 1, 0, 0).encode();
        b[12..16].copy_from_slice(&(MAX_DATA + 1).to_le_bytes());
        assert!(matches!(decode(&b), Err(FrameError::Length { .. })));
        let mut b = Header::new(Kind::Get, 1, 0, 0).encode();
        b[12] = 1;
        assert!(matches!(decode(&b), Err(FrameError::Length { kind: "Get", .. })));
        let mut b = Header::new(Kind::Get, 1, 0, 0).encode();
        b[4] = 2;
        assert_eq!(decode(&b), Err(FrameError::Version { got: 2 }));
        b[4] = VERSION;
        b[5] = 0;
        assert_eq!(decode(&b), Err(FrameError::Kind { got: 0 }));
        b[5] = Kind::Get as u8;
        b[6] = 1;
        assert!(matches!(decode(&b), Err(FrameError::Flags { .. })));
        assert!(matches!(decode(&b[..10]), Err(FrameError::Truncated { have: 10, .. })));
        let mut b = Header::new(Kind::Get, 1, 0, 0).encode();
        b[0] = b'X';
        assert!(matches!(decode(&b), Err(FrameError::Magic { .. })));
    }

    #[test]
    fn decode_frame_needs_the_whole_payload() {
        let mut buf = Header::new(Kind::Failed, 3, 5, 0).encode().to_vec();
        buf.extend_from_slice(b"oops");
        assert!(matches!(
            decode_frame(&buf),
            Err(FrameError::Truncated { need: 29, .. })
        ));
        buf.push(b'!');
        let (h, p, used) = decode_frame(&buf).unwrap();
        assert_eq!((h.kind, p, used), (Kind::Failed, &b"oops!"[..], 29));
    }
}
