//! A client of the node agent for launchers and tests (the interposed library has its own,
//! fork-aware one): one connection, one request at a time.

use std::io::{self, BufReader, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::proto::{self, Reply, Request};

/// A connection to the node agent's socket.
pub struct Client {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Client {
    /// Connect to the agent at `socket`; every round trip may take at most `timeout`. Sends no
    /// `Hello`: that is the interposed library's (it starts a lazy agent's cache).
    pub fn connect(socket: &Path, timeout: Duration) -> io::Result<Client> {
        let conn = UnixStream::connect(socket)?;
        let t = Some(timeout.max(Duration::from_millis(1)));
        conn.set_read_timeout(t)?;
        conn.set_write_timeout(t)?;
        Ok(Client {
            r: BufReader::new(conn.try_clone()?),
            w: conn,
        })
    }

    /// One request and its reply, with the raw bytes that follow an `Inline` reply.
    pub fn call(&mut self, req: &Request) -> io::Result<(Reply, Vec<u8>)> {
        proto::write_request(&mut self.w, req)?;
        let reply = proto::read_reply(&mut self.r)?;
        let mut data = Vec::new();
        if let Reply::Inline { size, .. } = &reply {
            data.resize(*size as usize, 0);
            self.r.read_exact(&mut data)?;
        }
        Ok((reply, data))
    }

    /// Register as a launcher: the agent lives while this connection is open.
    pub fn attach(&mut self) -> io::Result<()> {
        self.expect_ok(&Request::Attach {
            pid: std::process::id(),
        })
    }

    /// The agent's figures as JSON text.
    pub fn stats(&mut self) -> io::Result<String> {
        match self.call(&Request::Stats)? {
            (Reply::Json { text }, _) => Ok(text),
            (other, _) => Err(unexpected(&other)),
        }
    }

    /// Where the agent says `rel`'s bytes are (the bytes too when it sends them inline).
    pub fn lookup(&mut self, rel: &[u8]) -> io::Result<(Reply, Vec<u8>)> {
        self.call(&Request::Lookup { rel: rel.to_vec() })
    }

    /// Tell the agent the program's order (per-node order files, `{node}` in `pattern`):
    /// `Ok(Err(reason))` when it places otherwise.
    pub fn plan(&mut self, pattern: &[u8]) -> io::Result<Result<(), String>> {
        match self.call(&Request::Plan { path: pattern.to_vec() })? {
            (Reply::Ok, _) => Ok(Ok(())),
            (Reply::Error { message }, _) => Ok(Err(message)),
            (other, _) => Err(unexpected(&other)),
        }
    }

    fn expect_ok(&mut self, req: &Request) -> io::Result<()> {
        match self.call(req)? {
            (Reply::Ok, _) => Ok(()),
            (other, _) => Err(unexpected(&other)),
        }
    }
}

fn unexpected(r: &Reply) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("unexpected reply {r:?}"))
}
