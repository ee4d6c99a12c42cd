//! The per-job secret and the handshake MACs (HMAC-SHA256, compared in constant time).

use crate::error::NetError;
use crate::frame::{MAC_LEN, NONCE_LEN, VERSION};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// A 32-byte job secret. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret([u8; 32]);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Any byte string of at least 16 bytes, hashed (SHA-256) to the 32-byte key.
    pub fn from_bytes(b: &[u8]) -> Result<Secret, NetError> {
        if b.len() < 16 {
            return Err(NetError::Secret {
                reason: format!("{} bytes; at least 16 are needed", b.len()),
            });
        }
        Ok(Secret(Sha256::digest(b).into()))
    }

    /// The inverse of [`Secret::to_hex`]: exactly 64 hex digits, taken as the key itself.
    pub fn from_hex(s: &str) -> Result<Secret, NetError> {
        let s = s.trim();
        if s.len() != 64 {
            return Err(NetError::Secret {
                reason: format!("{} hex digits; exactly 64 are needed", s.len()),
            });
        }
        let mut k = [0u8; 32];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            let hi = hex_val(pair[0]);
            let lo = hex_val(pair[1]);
            match (hi, lo) {
                (Some(h), Some(l)) => k[i] = (h << 4) | l,
                _ => {
                    return Err(NetError::Secret {
                        reason: format!("not a hex digit at position {}", 2 * i),
                    })
                }
            }
        }
        Ok(Secret(k))
    }

    /// 32 bytes from the operating system's random source.
    pub fn random() -> Secret {
        let mut k = [0u8; 32];
        getrandom::fill(&mut k).expect("the operating system's random source failed");
        Secret(k)
    }

    /// The secret as 64 lower-case hex digits (to hand to the other ranks).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, label: &[u8], job: u64, first: &[u8; NONCE_LEN], second: &[u8; NONCE_LEN]) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(&[VERSION]);
        m.update(&job.to_le_bytes());
        m.update(first);
        m.update(second);
        m
    }

    /// The server's proof: MAC over (version, job, client nonce, server nonce).
    pub(crate) fn server_mac(&self, job: u64, cn: &[u8; NONCE_LEN], sn: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
        self.mac(SERVER_LABEL, job, cn, sn).finalize().into_bytes().into()
    }

    /// The client's proof: MAC over (version, job, server nonce, client nonce), another label,
    /// so neither side's answer can be reflected back as the other's.
    pub(crate) fn client_mac(&self, job: u64, sn: &[u8; NONCE_LEN], cn: &[u8; NONCE_LEN]) -> [u8; MAC_LEN] {
        self.mac(CLIENT_LABEL, job, sn, cn).finalize().into_bytes().into()
    }

    pub(crate) fn verify_server(&self, job: u64, cn: &[u8; NONCE_LEN], sn: &[u8; NONCE_LEN], mac: &[u8]) -> bool {
        self.mac(SERVER_LABEL, job, cn, sn).verify_slice(mac).is_ok()
    }

    pub(crate) fn verify_client(&self, job: u64, sn: &[u8; NONCE_LEN], cn: &[u8; NONCE_LEN], mac: &[u8]) -> bool {
        self.mac(CLIENT_LABEL, job, sn, cn).verify_slice(mac).is_ok()
    }
}

const SERVER_LABEL: &[u8] = b"clairvoyant-net server";
const CLIENT_LABEL: &[u8] = b"clairvoyant-net client";

pub(crate) fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).expect("the operating system's random source failed");
    n
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_rejects() {
        let s = Secret::random();
        assert_eq!(Secret::from_hex(&s.to_hex()).unwrap(), s);
        assert!(Secret::from_hex("abc").is_err());
        assert!(Secret::from_hex(&"g".repeat(64)).is_err());
        assert!(Secret::from_bytes(b"short").is_err());
        assert_eq!(
            Secret::from_bytes(b"0123456789abcdef").unwrap(),
            Secret::from_bytes(b"0123456789abcdef").unwrap()
        );
        assert_eq!(format!("{s:?}"), "Secret(..)");
    }

    #[test]
    fn macs_bind_job_and_role() {
        let s = Secret::random();
        let (cn, sn) = (nonce(), nonce());
        let m = s.server_mac(7, &cn, &sn);
        assert!(s.verify_server(7, &cn, &sn, &m));
        assert!(!s.verify_server(8, &cn, &sn, &m));
        assert!(!s.verify_client(7, &cn, &sn, &m));
        assert!(!Secret::random().verify_server(7, &cn, &sn, &m));
        assert!(!s.verify_server(7, &cn, &sn, &m[..31]));
    }
}
