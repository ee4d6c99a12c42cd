//! Timing loops for the interposed library (`python -m benches.preload` runs them).
//!
//! `preloadbench open|read PATH N [BLOCK]`: N cycles of `open(PATH)` + `close` (`open`) or of
//! `open` + `read` to the end in 1 MiB calls + `close` (`read`), in blocks of BLOCK cycles
//! (default 500) that alternate between the symbols the program links to (interposed when
//! `LD_PRELOAD` holds the library) and libc's own definitions (found with `dlopen("libc.so.6")`),
//! so both run under the same load. Prints JSON: ns per cycle of each, as the best block and the
//! median block, and the bytes of one cycle.

use std::ffi::{c_char, c_int, c_void, CString};
use std::time::Instant;

type OpenFn = unsafe extern "C" fn(*const c_char, c_int, ...) -> c_int;
type ReadFn = unsafe extern "C" fn(c_int, *mut c_void, usize) -> isize;
type CloseFn = unsafe extern "C" fn(c_int) -> c_int;

struct Calls {
    open: OpenFn,
    read: ReadFn,
    close: CloseFn,
}

fn libc_own() -> Calls {
    // SAFETY: dlopen/dlsym of libc's exported functions with their C prototypes.
    unsafe {
        let h = libc::dlopen(c"libc.so.6".as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "dlopen libc.so.6 failed");
        let sym = |n: &std::ffi::CStr| {
            let p = libc::dlsym(h, n.as_ptr());
            assert!(!p.is_null(), "{n:?} not found in libc");
            p
        };
        Calls {
            open: std::mem::transmute::<*mut c_void, OpenFn>(sym(c"open")),
            read: std::mem::transmute::<*mut c_void, ReadFn>(sym(c"read")),
            close: std::mem::transmute::<*mut c_void, CloseFn>(sym(c"close")),
        }
    }
}

fn linked() -> Calls {
    Calls {
        open: libc::open,
        read: libc::read,
        close: libc::close,
    }
}

/// One block of `n` cycles; returns (ns per cycle, bytes of the last cycle).
fn block(c: &Calls, path: &CString, read: bool, n: usize, buf: &mut [u8]) -> (f64, u64) {
    let mut bytes = 0u64;
    let t = Instant::now();
    for _ in 0..n {
        // SAFETY: plain libc calls on a valid C string and an owned buffer.
        unsafe {
            let fd = (c.open)(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                eprintln!("{}: {}", path.to_string_lossy(), std::io::Error::last_os_error());
                std::process::exit(1);
            }
            if read {
                bytes = 0;
                loop {
                    let r = (c.read)(fd, buf.as_mut_ptr() as *mut c_void, buf.len());
                    if r <= 0 {
                        break;
                    }
                    bytes += r as u64;
                }
            }
            (c.close)(fd);
        }
    }
    (t.elapsed().as_nanos() as f64 / n as f64, bytes)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if !(4..=5).contains(&args.len()) || !matches!(args[1].as_str(), "open" | "read") {
        eprintln!("usage: preloadbench open|read PATH N [BLOCK]");
        std::process::exit(2);
    }
    let read = args[1] == "read";
    let path = CString::new(args[2].as_str()).expect("path without NUL");
    let n: usize = args[3].parse().expect("N is a number");
    let bs: usize = args
        .get(4)
        .map_or(500, |b| b.parse().expect("BLOCK is a number"))
        .max(1);
    let (lk, own) = (linked(), libc_own());
    let mut buf = vec![0u8; 1 << 20];
    let (mut a, mut b, mut bytes) = (Vec::new(), Vec::new(), 0);
    // Warm-up: page cache, the agent connection, lazy symbol resolution.
    block(&lk, &path, read, bs.min(50), &mut buf);
    block(&own, &path, read, bs.min(50), &mut buf);
    for _ in 0..n.div_ceil(bs) {
        let (t, by) = block(&lk, &path, read, bs, &mut buf);
        a.push(t);
        bytes = by;
        b.push(block(&own, &path, read, bs, &mut buf).0);
    }
    let stats = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        (v[0], v[v.len() / 2])
    };
    let ((ab, am), (bb, bm)) = (stats(&mut a), stats(&mut b));
    println!(
        "{{\"linked_best_ns\": {ab:.1}, \"linked_median_ns\": {am:.1}, \"libc_best_ns\": {bb:.1}, \"libc_median_ns\": {bm:.1}, \"bytes\": {bytes}, \"blocks\": {}}}",
        a.len()
    );
}
