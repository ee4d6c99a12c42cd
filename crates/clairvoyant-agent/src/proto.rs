//! Frames on the agent's Unix stream socket.
//!
//! Every message is one frame, little-endian: `u32 len` (the number of bytes that follow), `u8
//! kind`, then `len - 1` bytes of payload. A frame is at most [`MAX_FRAME`] bytes after the length
//! field. The only bytes on the stream outside a frame are the `size` raw bytes that follow a
//! [`Reply::Inline`] or a [`Request::Fill`].
//!
//! | kind | message | payload |
//! |------|---------|---------|
//! | 0x01 | `Request::Hello` | `u32 version, u32 pid` |
//! | 0x02 | `Request::Lookup` | the relative path's bytes, any but NUL, not necessarily UTF-8 (1..=[`MAX_REL`], see [`is_normalized_rel`]) |
//! | 0x03 | `Request::Attach` | `u32 pid` |
//! | 0x04 | `Request::Stats` | empty |
//! | 0x05 | `Request::Plan` | the order files' path pattern (1..=[`MAX_REL`] bytes, no NUL) |
//! | 0x06 | `Request::Fill` | `u64 size, u64 change_ns`, the relative path's bytes (as for `Lookup`); then `size` raw bytes after the frame; no reply |
//! | 0x81 | `Reply::Hello` | `u32 version, bytes root, bytes dir_path, u8 has_arena, [bytes arena_path], u64 arena_len` |
//! | 0x82 | `Reply::Cached` | `u32 file, u64 size, u64 offset, u64 checksum` |
//! | 0x83 | `Reply::Inline` | `u32 file, u64 size, u64 checksum`, then `size` raw bytes after the frame |
//! | 0x84 | `Reply::Direct` | empty |
//! | 0x85 | `Reply::Unknown` | empty |
//! | 0x86 | `Reply::Error` | UTF-8 message |
//! | 0x87 | `Reply::Json` | UTF-8 JSON text |
//! | 0x88 | `Reply::Ok` | empty |
//!
//! `bytes` is a `u32` length followed by that many bytes. Decoding never panics: a malformed,
//! oversized or truncated frame is an `io::ErrorKind::InvalidData` (or `UnexpectedEof`) error.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The protocol version both sides send in `Hello`.
pub const VERSION: u32 = 1;
/// The largest frame after its length field (kind byte + payload).
pub const MAX_FRAME: usize = 64 * 1024;
/// The longest relative path a `Lookup` may carry.
pub const MAX_REL: usize = 4096;
/// The largest file a program hands to the agent with `Fill` (bigger ones are filled by the
/// agent on `Lookup`).
pub const MAX_FILL: u64 = 64 << 20;

const REQ_HELLO: u8 = 0x01;
const REQ_LOOKUP: u8 = 0x02;
const REQ_ATTACH: u8 = 0x03;
const REQ_STATS: u8 = 0x04;
const REQ_PLAN: u8 = 0x05;
const REQ_FILL: u8 = 0x06;
const REP_HELLO: u8 = 0x81;
const REP_CACHED: u8 = 0x82;
const REP_INLINE: u8 = 0x83;
const REP_DIRECT: u8 = 0x84;
const REP_UNKNOWN: u8 = 0x85;
const REP_ERROR: u8 = 0x86;
const REP_JSON: u8 = 0x87;
const REP_OK: u8 = 0x88;

/// A message from a client (an interposed process or a launcher) to the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message of every connection.
    Hello {
        /// [`VERSION`] of the client's protocol.
        version: u32,
        /// The client's process id.
        pid: u32,
    },
    /// Where are the bytes of this file? `rel` is relative to the dataset root, normalized
    /// ([`is_normalized_rel`]), no leading '/', at most [`MAX_REL`] bytes.
    Lookup {
        /// The file's path relative to the dataset root.
        rel: Vec<u8>,
    },
    /// A launcher (`clairvoyant run`) registers; the agent lives while any attached connection
    /// is open.
    Attach {
        /// The launcher's process id.
        pid: u32,
    },
    /// Ask for the agent's counters as JSON (answered by `Reply::Json`).
    Stats,
    /// The program's read order is known: per-node order files (`{node}` in `path` stands for
    /// each node's index; format as for `clairvoyant run --order-file`). Answered by `Ok` when
    /// the agent will place by it, `Error` when it has placed already.
    Plan {
        /// The order files' path, with `{node}` for the node's index.
        path: Vec<u8>,
    },
    /// A program read this file from the file system on a miss (it held the file's claim in the
    /// shared directory): its `size` bytes follow the frame, for the node cache. One way: the
    /// agent does not answer; it settles the claim in the shared directory instead.
    Fill {
        /// The file's path relative to the dataset root (normalized, as for `Lookup`).
        rel: Vec<u8>,
        /// The number of bytes that follow (at most [`MAX_FILL`]).
        size: u64,
        /// The file's last change as the program saw it before and after its read (ns, the later
        /// of mtime and ctime).
        change_ns: u64,
    },
}

/// A message from the agent to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Answer to `Request::Hello`: the dataset root the agent serves, the shared directory of
    /// cached files ([`crate::dir`]) and the arena file that holds cached bytes, if any.
    Hello {
        /// [`VERSION`] of the agent's protocol.
        version: u32,
        /// The dataset root the agent serves.
        root: Vec<u8>,
        /// The shared directory of cached files.
        dir_path: PathBuf,
        /// The arena file that holds cached bytes; `None` when there is none.
        arena_path: Option<PathBuf>,
        /// The arena's length in bytes.
        arena_len: u64,
    },
    /// The file's bytes are in the arena at `offset`.
    Cached {
        /// The file's index in the agent's dataset.
        file: u32,
        /// The file's size in bytes.
        size: u64,
        /// Where the file's bytes start in the arena.
        offset: u64,
        /// [`crate::checksum`] of the file's bytes.
        checksum: u64,
    },
    /// Followed on the stream by exactly `size` raw bytes of the file.
    Inline {
        /// The file's index in the agent's dataset.
        file: u32,
        /// The file's size in bytes: the number of raw bytes that follow.
        size: u64,
        /// [`crate::checksum`] of those bytes.
        checksum: u64,
    },
    /// Not cached anywhere reachable: read the file system.
    Direct,
    /// Not a file of the dataset.
    Unknown,
    /// The agent failed to answer; the client reads the file system.
    Error {
        /// Why the agent could not answer.
        message: String,
    },
    /// Answer to `Request::Stats`.
    Json {
        /// The counters as a JSON document.
        text: String,
    },
    /// Answer to `Request::Attach`.
    Ok,
}

/// True when `rel` is a normalized relative path: 1..=[`MAX_REL`] bytes, components separated
/// by single '/', none empty, "." or "..", no leading or trailing '/', no NUL byte.
pub fn is_normalized_rel(rel: &[u8]) -> bool {
    !rel.is_empty()
        && rel.len() <= MAX_REL
        && !rel.contains(&0)
        && rel
            .split(|&b| b == b'/')
            .all(|c| !c.is_empty() && c != b"." && c != b"..")
}

/// Normalize a path relative to the dataset root lexically: drop empty and "." components,
/// resolve ".." against the preceding component. `None` when the result is empty, climbs above
/// the root, is longer than [`MAX_REL`] or contains a NUL byte.
pub fn normalize_rel(path: &[u8]) -> Option<Vec<u8>> {
    if path.contains(&0) {
        return None;
    }
    let mut parts: Vec<&[u8]> = Vec::new();
    for c in path.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop()?;
            }
            c => parts.push(c),
        }
    }
    let out = parts.join(&b'/');
    (!out.is_empty() && out.len() <= MAX_REL).then_some(out)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    if payload.len() + 1 > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "frame of kind {kind:#04x} has {} payload bytes, more than {}",
                payload.len(),
                MAX_FRAME - 1
            ),
        ));
    }
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.extend_from_slice(&((payload.len() + 1) as u32).to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(payload);
    // One write per frame: a frame never interleaves with another writer's on a shared socket
    // as long as writers hold their own lock, and it costs one system call.
    w.write_all(&buf)
}

fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len == 0 || len > MAX_FRAME {
        return Err(invalid(format!("frame length {len} is outside 1..={MAX_FRAME}")));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    let kind = buf[0];
    buf.remove(0);
    Ok((kind, buf))
}

/// A cursor over a payload that fails (never panics) when the payload is short.
struct Cur<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(invalid(format!("{} payload is truncated", self.what)));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> io::Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn end(self) -> io::Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(invalid(format!(
                "{} payload has {} trailing bytes",
                self.what,
                self.b.len()
            )))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) -> io::Result<()> {
    let n =
        u32::try_from(b.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "field longer than 4 GiB"))?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(b);
    Ok(())
}

fn utf8(b: &[u8], what: &str) -> io::Result<String> {
    String::from_utf8(b.to_vec()).map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// Write one request frame. A `Lookup` whose path is not normalized ([`is_normalized_rel`]) is
/// refused with `InvalidInput`.
pub fn write_request(w: &mut impl Write, r: &Request) -> io::Result<()> {
    match r {
        Request::Hello { version, pid } => {
            let mut p = [0u8; 8];
            p[..4].copy_from_slice(&version.to_le_bytes());
            p[4..].copy_from_slice(&pid.to_le_bytes());
            write_frame(w, REQ_HELLO, &p)
        }
        Request::Lookup { rel } => {
            if !is_normalized_rel(rel) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "lookup path {:?} is not a normalized relative path",
                        String::from_utf8_lossy(rel)
                    ),
                ));
            }
            write_frame(w, REQ_LOOKUP, rel)
        }
        Request::Attach { pid } => write_frame(w, REQ_ATTACH, &pid.to_le_bytes()),
        Request::Stats => write_frame(w, REQ_STATS, &[]),
        Request::Plan { path } => {
            if path.is_empty() || path.len() > MAX_REL || path.contains(&0) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "plan path must be 1 to 4096 bytes without NUL",
                ));
            }
            write_frame(w, REQ_PLAN, path)
        }
        Request::Fill { rel, size, change_ns } => {
            if !is_normalized_rel(rel) || *size > MAX_FILL {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "fill of {:?} ({size} bytes): not a normalized relative path, or over {MAX_FILL} bytes",
                        String::from_utf8_lossy(rel)
                    ),
                ));
            }
            let mut p = Vec::with_capacity(16 + rel.len());
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&change_ns.to_le_bytes());
            p.extend_from_slice(rel);
            write_frame(w, REQ_FILL, &p)
        }
    }
}

/// Read one request frame. Malformed, oversized or unknown frames are `InvalidData`; a stream
/// that ends inside a frame is `UnexpectedEof`.
pub fn read_request(r: &mut impl Read) -> io::Result<Request> {
    let (kind, p) = read_frame(r)?;
    match kind {
        REQ_HELLO => {
            let mut c = Cur {
                b: &p,
                what: "hello request",
            };
            let req = Request::Hello {
                version: c.u32()?,
                pid: c.u32()?,
            };
            c.end()?;
            Ok(req)
        }
        REQ_LOOKUP => {
            if !is_normalized_rel(&p) {
                return Err(invalid(format!(
                    "lookup path {:?} is not a normalized relative path of at most {MAX_REL} bytes",
                    String::from_utf8_lossy(&p[..p.len().min(256)])
                )));
            }
            Ok(Request::Lookup { rel: p })
        }
        REQ_ATTACH => {
            let mut c = Cur {
                b: &p,
                what: "attach request",
            };
            let req = Request::Attach { pid: c.u32()? };
            c.end()?;
            Ok(req)
        }
        REQ_STATS => {
            Cur {
                b: &p,
                what: "stats request",
            }
            .end()?;
            Ok(Request::Stats)
        }
        REQ_PLAN => {
            if p.is_empty() || p.len() > MAX_REL || p.contains(&0) {
                return Err(invalid(format!(
                    "plan path of {} bytes (1 to {MAX_REL}, no NUL)",
                    p.len()
                )));
            }
            Ok(Request::Plan { path: p })
        }
        REQ_FILL => read_fill(&p),
        k => Err(invalid(format!("unknown request kind {k:#04x}"))),
    }
}

fn read_fill(p: &[u8]) -> io::Result<Request> {
    let mut c = Cur {
        b: p,
        what: "fill request",
    };
    let size = c.u64()?;
    let change_ns = c.u64()?;
    let rel = c.b.to_vec();
    if !is_normalized_rel(&rel) || size > MAX_FILL {
        return Err(invalid(format!(
            "fill of {:?} ({size} bytes): not a normalized relative path of at most {MAX_REL} bytes, or over {MAX_FILL} bytes",
            String::from_utf8_lossy(&rel[..rel.len().min(256)])
        )));
    }
    Ok(Request::Fill { rel, size, change_ns })
}

/// Write one reply frame. For `Inline`, the caller writes the `size` bytes right after.
/// A reply that does not fit in a frame (a very long `Json` or `Error`) is `InvalidInput`.
pub fn write_reply(w: &mut impl Write, r: &Reply) -> io::Result<()> {
    let mut p = Vec::new();
    let kind = match r {
        Reply::Hello {
            version,
            root,
            dir_path,
            arena_path,
            arena_len,
        } => {
            p.extend_from_slice(&version.to_le_bytes());
            put_bytes(&mut p, root)?;
            put_bytes(&mut p, dir_path.as_os_str().as_bytes())?;
            match arena_path {
                Some(a) => {
                    p.push(1);
                    put_bytes(&mut p, a.as_os_str().as_bytes())?;
                }
                None => p.push(0),
            }
            p.extend_from_slice(&arena_len.to_le_bytes());
            REP_HELLO
        }
        Reply::Cached {
            file,
            size,
            offset,
            checksum,
        } => {
            p.extend_from_slice(&file.to_le_bytes());
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&checksum.to_le_bytes());
            REP_CACHED
        }
        Reply::Inline { file, size, checksum } => {
            p.extend_from_slice(&file.to_le_bytes());
            p.extend_from_slice(&size.to_le_bytes());
            p.extend_from_slice(&checksum.to_le_bytes());
            REP_INLINE
        }
        Reply::Direct => REP_DIRECT,
        Reply::Unknown => REP_UNKNOWN,
        Reply::Error { message } => {
            p.extend_from_slice(message.as_bytes());
            REP_ERROR
        }
        Reply::Json { text } => {
            p.extend_from_slice(text.as_bytes());
            REP_JSON
        }
        Reply::Ok => REP_OK,
    };
    write_frame(w, kind, &p)
}

fn path(b: &[u8]) -> PathBuf {
    Path::new(OsStr::from_bytes(b)).to_path_buf()
}

/// Read one reply frame (for `Inline`, the caller then reads exactly `size` bytes). Malformed,
/// oversized or unknown frames are `InvalidData`; a stream that ends inside a frame is
/// `UnexpectedEof`.
pub fn read_reply(r: &mut impl Read) -> io::Result<Reply> {
    let (kind, p) = read_frame(r)?;
    let empty = |what: &'static str| Cur { b: &p, what }.end();
    let rep = match kind {
        REP_HELLO => {
            let mut c = Cur {
                b: &p,
                what: "hello reply",
            };
            let version = c.u32()?;
            let root = c.bytes()?.to_vec();
            let dir_path = path(c.bytes()?);
            let arena_path = match c.u8()? {
                0 => None,
                1 => Some(path(c.bytes()?)),
                v => return Err(invalid(format!("hello reply: arena flag {v} is neither 0 nor 1"))),
            };
            let arena_len = c.u64()?;
            c.end()?;
            Reply::Hello {
                version,
                root,
                dir_path,
                arena_path,
                arena_len,
            }
        }
        REP_CACHED => {
            let mut c = Cur {
                b: &p,
                what: "cached reply",
            };
            let rep = Reply::Cached {
                file: c.u32()?,
                size: c.u64()?,
                offset: c.u64()?,
                checksum: c.u64()?,
            };
            c.end()?;
            rep
        }
        REP_INLINE => {
            let mut c = Cur {
                b: &p,
                what: "inline reply",
            };
            let rep = Reply::Inline {
                file: c.u32()?,
                size: c.u64()?,
                checksum: c.u64()?,
            };
            c.end()?;
            rep
        }
        REP_DIRECT => {
            empty("direct reply")?;
            Reply::Direct
        }
        REP_UNKNOWN => {
            empty("unknown reply")?;
            Reply::Unknown
        }
        REP_ERROR => Reply::Error {
            message: utf8(&p, "error reply")?,
        },
        REP_JSON => Reply::Json {
            text: utf8(&p, "json reply")?,
        },
        REP_OK => {
            empty("ok reply")?;
            Reply::Ok
        }
        k => return Err(invalid(format!("unknown reply kind {k:#04x}"))),
    };
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello {
                version: VERSION,
                pid: 4242,
            },
            Request::Lookup {
                rel: b"train/n01440764/img_0001.JPEG".to_vec(),
            },
            Request::Lookup {
                rel: vec![b'a'; MAX_REL],
            },
            Request::Attach { pid: u32::MAX },
            Request::Stats,
            Request::Plan {
                path: b"/dev/shm/clairvoyant-0/agent-1/order-{node}.txt".to_vec(),
            },
            Request::Fill {
                rel: b"train/n01440764/img_0002.JPEG".to_vec(),
                size: MAX_FILL,
                change_ns: u64::MAX,
            },
        ]
    }

    fn all_replies() -> Vec<Reply> {
        vec![
            Reply::Hello {
                version: VERSION,
                root: b"/pfs/imagenet".to_vec(),
                dir_path: "/dev/shm/cv-1/dir".into(),
                arena_path: Some("/dev/shm/cv-1/arena".into()),
                arena_len: 1 << 40,
            },
            Reply::Hello {
                version: 7,
                root: vec![0xff, 0],
                dir_path: "".into(),
                arena_path: None,
                arena_len: 0,
            },
            Reply::Cached {
                file: 3,
                size: 110_000,
                offset: 4096,
                checksum: u64::MAX,
            },
            Reply::Inline {
                file: 9,
                size: 5,
                checksum: 1,
            },
            Reply::Direct,
            Reply::Unknown,
            Reply::Error {
                message: "peer 10.0.0.2:7000 unreachable".into(),
            },
            Reply::Json {
                text: "{\"hits\": 3}".into(),
            },
            Reply::Ok,
        ]
    }

    #[test]
    fn requests_round_trip_on_one_stream() {
        let mut buf = Vec::new();
        for r in all_requests() {
            write_request(&mut buf, &r).unwrap();
        }
        let mut rd = &buf[..];
        for r in all_requests() {
            assert_eq!(read_request(&mut rd).unwrap(), r);
        }
        assert!(rd.is_empty());
        assert_eq!(read_request(&mut rd).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn replies_round_trip_with_inline_bytes_after_the_frame() {
        let mut buf = Vec::new();
        for r in all_replies() {
            write_reply(&mut buf, &r).unwrap();
            if let Reply::Inline { size, .. } = r {
                buf.extend(std::iter::repeat_n(7u8, size as usize));
            }
        }
        let mut rd = &buf[..];
        for r in all_replies() {
            let got = read_reply(&mut rd).unwrap();
            assert_eq!(got, r);
            if let Reply::Inline { size, .. } = got {
                let mut data = vec![0u8; size as usize];
                rd.read_exact(&mut data).unwrap();
                assert_eq!(data, vec![7u8; size as usize]);
            }
        }
        assert!(rd.is_empty());
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let mut frames = Vec::new();
        for r in all_requests() {
            let mut b = Vec::new();
            write_request(&mut b, &r).unwrap();
            frames.push((b, true));
        }
        for r in all_replies() {
            let mut b = Vec::new();
            write_reply(&mut b, &r).unwrap();
            frames.push((b, false));
        }
        for (f, is_req) in frames {
            for cut in 0..f.len() {
                let mut rd = &f[..cut];
                let err = if is_req {
                    read_request(&mut rd).unwrap_err()
                } else {
                    read_reply(&mut rd).unwrap_err()
                };
                assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut} of {f:?}");
            }
        }
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let mut b = ((payload.len() + 1) as u32).to_le_bytes().to_vec();
        b.push(kind);
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn malformed_frames_are_invalid_data() {
        let bad_requests: Vec<Vec<u8>> = vec![
            0u32.to_le_bytes().to_vec(),                   // zero length
            (MAX_FRAME as u32 + 1).to_le_bytes().to_vec(), // oversized: refused before allocating
            u32::MAX.to_le_bytes().to_vec(),
            frame(0x7f, &[]),                         // unknown kind
            frame(REQ_HELLO, &[1, 0, 0, 0]),          // short
            frame(REQ_HELLO, &[0; 9]),                // trailing byte
            frame(REQ_ATTACH, &[0; 3]),               // short
            frame(REQ_STATS, &[1]),                   // trailing byte
            frame(REQ_LOOKUP, b""),                   // empty path
            frame(REQ_LOOKUP, b"/etc/passwd"),        // absolute
            frame(REQ_LOOKUP, b"a/../../etc/passwd"), // climbs out
            frame(REQ_LOOKUP, b"a//b"),
            frame(REQ_LOOKUP, b"a/./b"),
            frame(REQ_LOOKUP, b"a/b/"),
            frame(REQ_LOOKUP, b"a\0b"),
            frame(REQ_LOOKUP, &vec![b'a'; MAX_REL + 1]), // too long
            frame(REQ_FILL, &[0; 15]),                   // short
            frame(REQ_FILL, &[0; 16]),                   // no path
            frame(REQ_FILL, &[&[0xff; 8][..], &[0; 8], b"a"].concat()), // over MAX_FILL
        ];
        for b in bad_requests {
            let err = read_request(&mut &b[..]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{b:?}: {err}");
        }
        let bad_replies: Vec<Vec<u8>> = vec![
            frame(0x01, &[]),
            frame(REP_CACHED, &[0; 27]),
            frame(REP_CACHED, &[0; 29]),
            frame(REP_INLINE, &[0; 19]),
            frame(REP_DIRECT, &[0]),
            frame(REP_OK, &[0]),
            frame(REP_ERROR, &[0xff, 0xfe]),
            frame(REP_JSON, &[0xc3]),
            // hello: root length points past the end
            frame(REP_HELLO, &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]),
            // hello: arena flag 2
            frame(
                REP_HELLO,
                &[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
        ];
        for b in bad_replies {
            let err = read_reply(&mut &b[..]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{b:?}: {err}");
        }
    }

    #[test]
    fn writers_refuse_what_readers_would_refuse() {
        let mut sink = Vec::new();
        for rel in [&b""[..], b"/abs", b"a/../b", b"a//b", &vec![b'x'; MAX_REL + 1]] {
            let err = write_request(&mut sink, &Request::Lookup { rel: rel.to_vec() }).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        let err = write_reply(
            &mut sink,
            &Reply::Json {
                text: "x".repeat(MAX_FRAME),
            },
        )
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(sink.is_empty(), "nothing is written for a refused frame");
    }

    #[test]
    fn random_bytes_never_panic() {
        // A small deterministic generator (xorshift) is enough to shake the decoders.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 40) as usize;
            let mut b = Vec::with_capacity(len + 5);
            b.extend_from_slice(&(len as u32 + 1).to_le_bytes());
            b.push((x >> 8) as u8 | if x & 1 == 0 { 0x80 } else { 0 });
            for i in 0..len {
                b.push((x >> (i % 56)) as u8);
            }
            let _ = read_request(&mut &b[..]);
            let _ = read_reply(&mut &b[..]);
        }
    }

    #[test]
    fn names_that_are_not_utf8_travel_as_bytes() {
        let names: [&[u8]; 4] = [b"caf\xe9.bin", b"dir-\xfe/x\xff.bin", b"\x80", b"a/\xc3(/b"];
        for name in names {
            assert!(is_normalized_rel(name));
            assert_eq!(normalize_rel(name).unwrap(), name);
            let mut buf = Vec::new();
            write_request(&mut buf, &Request::Lookup { rel: name.to_vec() }).unwrap();
            assert_eq!(&buf[5..], name, "the name's bytes are the payload, unchanged");
            assert_eq!(
                read_request(&mut &buf[..]).unwrap(),
                Request::Lookup { rel: name.to_vec() }
            );
        }
        let plan = Request::Plan {
            path: b"/run/\xe9/order-{node}.txt".to_vec(),
        };
        let mut buf = Vec::new();
        write_request(&mut buf, &plan).unwrap();
        assert_eq!(read_request(&mut &buf[..]).unwrap(), plan);
    }

    /// A valid frame with one byte changed: decoding fails or succeeds, never panics; when the
    /// length field is intact the stream stays in step (the next frame reads whole).
    #[test]
    fn damaged_frames_never_panic_and_keep_the_stream_in_step() {
        let mut frames = Vec::new();
        for r in all_requests() {
            let mut b = Vec::new();
            write_request(&mut b, &r).unwrap();
            frames.push((b, true));
        }
        for r in all_replies() {
            let mut b = Vec::new();
            write_reply(&mut b, &r).unwrap();
            if let Reply::Inline { size, .. } = r {
                b.extend(std::iter::repeat_n(7u8, size as usize));
            }
            frames.push((b, false));
        }
        let mut next_req = Vec::new();
        write_request(&mut next_req, &Request::Stats).unwrap();
        let mut next_rep = Vec::new();
        write_reply(&mut next_rep, &Reply::Ok).unwrap();
        for (f, is_req) in frames {
            // Past the frame itself (the raw bytes after an Inline reply are the caller's).
            let frame_len = 4 + u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize;
            for at in 0..frame_len.min(f.len()).min(300) {
                for mask in [0x01u8, 0x80, 0xff, 0x5a] {
                    let mut d = f[..frame_len].to_vec();
                    d[at] ^= mask;
                    d.extend_from_slice(if is_req { &next_req } else { &next_rep });
                    let mut rd = &d[..];
                    if is_req {
                        let _ = read_request(&mut rd);
                    } else {
                        let _ = read_reply(&mut rd);
                    }
                    if at >= 4 {
                        if is_req {
                            assert_eq!(read_request(&mut rd).unwrap(), Request::Stats, "byte {at} of {f:?}");
                        } else {
                            assert_eq!(read_reply(&mut rd).unwrap(), Reply::Ok, "byte {at} of {f:?}");
                        }
                        assert!(rd.is_empty());
                    }
                }
            }
        }
    }

    fn rel_strategy() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        proptest::collection::vec(proptest::collection::vec(1u8..=255, 1..12), 1..6).prop_map(|parts| {
            parts
                .into_iter()
                .map(|p| {
                    let p: Vec<u8> = p.into_iter().map(|b| if b == b'/' { b'_' } else { b }).collect();
                    if p == b"." || p == b".." {
                        b"x".to_vec()
                    } else {
                        p
                    }
                })
                .collect::<Vec<_>>()
                .join(&b'/')
        })
    }

    proptest::proptest! {
        #[test]
        fn any_valid_message_round_trips(
            rel in rel_strategy(),
            a in proptest::num::u32::ANY,
            b in proptest::num::u64::ANY,
            c in proptest::num::u64::ANY,
            text in ".{0,200}",
            root in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        ) {
            let reqs = [
                Request::Hello { version: a, pid: a ^ 1 },
                Request::Lookup { rel: rel.clone() },
                Request::Attach { pid: a },
                Request::Stats,
                Request::Plan { path: rel.clone() },
                Request::Fill { rel: rel.clone(), size: b % (MAX_FILL + 1), change_ns: c },
            ];
            let reps = [
                Reply::Hello { version: a, root: root.clone(), dir_path: PathBuf::from(OsStr::from_bytes(&rel)), arena_path: (b % 2 == 0).then(|| PathBuf::from(text.clone())), arena_len: c },
                Reply::Cached { file: a, size: b, offset: c, checksum: b ^ c },
                Reply::Inline { file: a, size: 0, checksum: c },
                Reply::Error { message: text.clone() },
                Reply::Json { text: text.clone() },
            ];
            for r in &reqs {
                let mut buf = Vec::new();
                write_request(&mut buf, r).unwrap();
                proptest::prop_assert_eq!(&read_request(&mut &buf[..]).unwrap(), r);
            }
            for r in &reps {
                let mut buf = Vec::new();
                write_reply(&mut buf, r).unwrap();
                proptest::prop_assert_eq!(&read_reply(&mut &buf[..]).unwrap(), r);
            }
        }

        #[test]
        fn arbitrary_frames_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = read_request(&mut &bytes[..]);
            let _ = read_reply(&mut &bytes[..]);
        }
    }

    #[test]
    fn normalize_rel_is_lexical_and_refuses_escapes() {
        assert_eq!(normalize_rel(b"a/./b//c/").unwrap(), b"a/b/c");
        assert_eq!(normalize_rel(b"a/x/../b").unwrap(), b"a/b");
        assert_eq!(normalize_rel(b"../a"), None);
        assert_eq!(normalize_rel(b"a/.."), None);
        assert_eq!(normalize_rel(b"."), None);
        assert_eq!(normalize_rel(b"a\0"), None);
        for p in [&b"a/./b//c/"[..], b"x/y/../z", b"q"] {
            assert!(is_normalized_rel(&normalize_rel(p).unwrap()));
        }
    }
}
