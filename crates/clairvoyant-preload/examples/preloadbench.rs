//! Timing loops for the interposed library, run with and without `LD_PRELOAD` by
//! `python -m clairvoyant._bench_preload` (the loops call libc directly, so the only Python-free
//! cost measured is the library's).
//!
//! `preloadbench open PATH N`: N x (open(PATH, O_RDONLY) + close), prints ns per open+close.
//! `preloadbench read PATH N`: N x (open + read to end in 1 MiB calls + close), prints ns per
//! cycle and the bytes of one cycle.

use std::ffi::CString;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: preloadbench open|read PATH N");
        std::process::exit(2);
    }
    let path = CString::new(args[2].as_str()).expect("path without NUL");
    let n: u64 = args[3].parse().expect("N is a number");
    let mut buf = vec![0u8; 1 << 20];
    let mut bytes = 0u64;
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: plain libc calls on a valid C string and an owned buffer.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                eprintln!("{}: {}", args[2], std::io::Error::last_os_error());
                std::process::exit(1);
            }
            if args[1] == "read" {
                bytes = 0;
                loop {
                    let r = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
                    if r <= 0 {
                        break;
                    }
                    bytes += r as u64;
                }
            }
            libc::close(fd);
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("{{\"ns_per_op\": {ns:.1}, \"bytes\": {bytes}, \"n\": {n}}}");
}
