//! Fuzz bodies shared by the cargo-fuzz targets (`fuzz/`) and by `tests/fuzz_inputs.rs`, so
//! `cargo test` runs the same checks over generated and mutated inputs. Not a stable API.

use crate::client::{handshake, parse_challenge, HandshakeError};
use crate::frame::{decode, decode_frame, HEADER_LEN};
use crate::secret::Secret;
use crate::server::{answer, counters, End, Proto, Provider, Served, Step};
use crate::wire::Wire;
use std::io::{self, Read, Write};
use std::time::Duration;

/// The frame decoder: never panics; what it accepts re-encodes to the same header bytes and
/// carries exactly `len` payload bytes.
pub fn frame(data: &[u8]) {
    let _ = decode(data);
    if let Ok((h, payload, used)) = decode_frame(data) {
        assert_eq!(payload.len(), h.len as usize);
        assert_eq!(used, HEADER_LEN + payload.len());
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
    }
    let _ = parse_challenge(data);
}

/// The server's protocol (handshake and requests, the code its poller runs) over arbitrary
/// client bytes, fed in pieces of every size the input picks (first byte: bit 0 starts before or
/// after authentication, the rest sizes the pieces): never panics, never authenticates a random
/// client, never writes more than one reply per request.
pub fn server_session(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let secret = Secret::from_bytes(b"fuzzing secret, fixed").unwrap();
    let c = counters();
    let authenticated = mode & 1 == 1;
    let piece = 1 + (mode >> 1) as usize;
    let mut p = if authenticated {
        Proto::authenticated()
    } else {
        Proto::new()
    };
    let mut input = rest;
    let mut out = Vec::new();
    let mut replies = 0;
    loop {
        let want = p.want();
        let n = want.len().min(input.len()).min(piece);
        if n == 0 {
            return;
        }
        want[..n].copy_from_slice(&input[..n]);
        input = &input[n..];
        match p.got(n, &secret, 1, &c) {
            Step::More => {}
            Step::Reply => {
                // A random client cannot know the MAC: no handshake completes.
                assert!(authenticated || !p.ready(), "a random client was authenticated");
                assert!(p.out.flush(&mut out).unwrap());
            }
            Step::Get { sample, wait } => {
                assert!(authenticated, "a request before authentication was answered");
                answer(&mut p.out, sample, FuzzProvider.serve(sample, wait), &c);
                assert!(p.out.flush(&mut out).unwrap());
                replies += 1;
                assert!(replies <= rest.len() / HEADER_LEN, "more replies than requests");
            }
            Step::Close(why) => {
                assert!(matches!(why, End::Frame | End::Auth));
                return;
            }
        }
    }
}

/// The client's handshake over arbitrary server bytes: never panics, never succeeds (the
/// server MAC cannot be forged).
pub fn client_handshake(data: &[u8]) {
    let secret = Secret::from_bytes(b"fuzzing secret, fixed").unwrap();
    let mut s = Mock {
        input: data,
        pos: 0,
        out: Vec::new(),
    };
    let r = handshake(&mut s, &secret, 1);
    assert!(matches!(
        r,
        Err(HandshakeError::Io | HandshakeError::Frame | HandshakeError::ServerAuth)
    ));
}

struct FuzzProvider;

impl Provider for FuzzProvider {
    fn serve(&self, sample: u32, _wait: Duration) -> Served {
        match sample % 4 {
            0 => Served::Ready {
                bytes: Box::new(vec![sample as u8; (sample % 512) as usize]),
                checksum: 1,
            },
            1 => Served::NotYet,
            2 => Served::NotHeld,
            _ => Served::Failed("é".repeat(sample as usize % 2000)),
        }
    }
}

struct Mock<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
}

impl Read for Mock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.input.len() - self.pos);
        buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Mock<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Wire for Mock<'_> {
    fn set_read_limit(&mut self, _d: Duration) -> io::Result<()> {
        Ok(())
    }
}

/// The client's handshake on a socket (tests use it to hold authenticated raw connections).
pub fn authenticate(s: &mut std::net::TcpStream, secret: &Secret, job: u64) -> bool {
    handshake(s, secret, job).is_ok()
}
