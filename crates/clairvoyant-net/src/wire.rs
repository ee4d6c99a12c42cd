//! Blocking I/O helpers shared by server and client: whole-frame reads with timeouts, and a
//! vectored write of header + payload (one `writev`, no copy of the payload).

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A byte stream whose read timeout can be changed (a socket; an in-memory stream in fuzzing).
pub(crate) trait Wire: Read + Write {
    fn set_read_limit(&mut self, d: Duration) -> io::Result<()>;
}

impl Wire for TcpStream {
    fn set_read_limit(&mut self, d: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(d.max(Duration::from_millis(1))))
    }
}

/// Read exactly `buf.len()` bytes; on failure also say how many arrived (0 tells a peer that
/// closed an idle connection from one that broke mid-reply).
pub(crate) fn read_full<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> Result<(), (io::Error, usize)> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err((io::Error::from(io::ErrorKind::UnexpectedEof), got)),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((e, got)),
        }
    }
    Ok(())
}

/// Write `head` then `body` with as few `writev` calls as the socket allows.
pub(crate) fn write_two<W: Write + ?Sized>(w: &mut W, head: &[u8], body: &[u8]) -> io::Result<()> {
    let mut bufs = [IoSlice::new(head), IoSlice::new(body)];
    let mut slices: &mut [IoSlice<'_>] = &mut bufs;
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match w.write_vectored(slices) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Did the operation time out (a stalled peer) rather than fail?
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// CPU time used by the calling thread so far, in nanoseconds (Linux `RUSAGE_THREAD`; 0 elsewhere).
pub(crate) fn thread_cpu_nanos() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage writes a full `rusage` into the pointer we pass; RUSAGE_THREAD only
        // reads the calling thread's counters.
        let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, ru.as_mut_ptr()) };
        if rc != 0 {
            return 0;
        }
        // SAFETY: getrusage returned 0, so the struct is initialised.
        let ru = unsafe { ru.assume_init() };
        let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }
    #[cfg(not(target_os = "linux"))]
    {
        0
    }
}
