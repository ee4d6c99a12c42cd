//! The cargo-fuzz bodies (`fuzz/`) over generated and mutated inputs, so `cargo test` runs them.

use clairvoyant_net::frame::{Header, Kind, MAX_DATA};
use clairvoyant_net::fuzzing;
use proptest::prelude::*;

/// Valid frames of every kind, concatenated: the seeds that mutations start from.
fn valid_stream(specs: &[(u8, u32, u32, u64)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(k, sample, len, arg) in specs {
        let kind = match k % 9 {
            0 => Kind::Hello,
            1 => Kind::Challenge,
            2 => Kind::Auth,
            3 => Kind::AuthOk,
            4 => Kind::Get,
            5 => Kind::Data,
            6 => Kind::NotYet,
            7 => Kind::NotHeld,
            _ => Kind::Failed,
        };
        let (min, max) = kind.payload_range();
        let len = min + len % (max.min(2048) - min + 1);
        out.extend_from_slice(&Header::new(kind, sample, len, arg).encode());
        out.extend(std::iter::repeat_n(0x5A, len as usize));
    }
    out
}

fn run_all(data: &[u8]) {
    fuzzing::frame(data);
    fuzzing::server_session(data);
    fuzzing::client_handshake(data);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        run_all(&data);
    }

    #[test]
    fn mutated_valid_frames(
        specs in proptest::collection::vec((any::<u8>(), any::<u32>(), any::<u32>(), any::<u64>()), 1..6),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        cut in any::<usize>(),
        mode in any::<u8>(),
    ) {
        let mut data = vec![mode];
        data.extend(valid_stream(&specs));
        for (at, x) in flips {
            let n = data.len();
            data[at % n] ^= x;
        }
        data.truncate(1 + cut % data.len());
        run_all(&data);
        run_all(&data[1..]);
    }
}

#[test]
fn authenticated_requests_get_exactly_one_reply_each() {
    // Mode byte 1: the session starts after authentication; 3 Gets -> 3 replies, then EOF.
    let mut data = vec![1u8];
    for s in [0u32, 1, 2, 3] {
        data.extend_from_slice(&Header::new(Kind::Get, s, 0, 0).encode());
    }
    fuzzing::server_session(&data);
    let mut huge = Header::new(Kind::Data, 0, 0, 0).encode();
    huge[12..16].copy_from_slice(&(MAX_DATA + 1).to_le_bytes());
    fuzzing::frame(&huge);
}
