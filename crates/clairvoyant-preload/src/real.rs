//! The libc functions this library interposes, found once with `dlsym(RTLD_NEXT, ...)`.

use libc::{c_char, c_int, c_uint, c_ulong, c_void, iovec, mode_t, off_t, size_t, ssize_t, FILE};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The value a call returns when its libc function cannot be found (never in practice).
pub trait Fail {
    fn fail() -> Self;
}
impl Fail for c_int {
    fn fail() -> Self {
        -1
    }
}
impl Fail for ssize_t {
    fn fail() -> Self {
        -1
    }
}
impl Fail for i64 {
    fn fail() -> Self {
        -1
    }
}
impl Fail for *mut FILE {
    fn fail() -> Self {
        std::ptr::null_mut()
    }
}
impl Fail for *mut c_void {
    fn fail() -> Self {
        libc::MAP_FAILED
    }
}

pub fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

pub fn errno() -> c_int {
    // SAFETY: as above.
    unsafe { *libc::__errno_location() }
}

fn resolve(cache: &AtomicUsize, name: &[u8]) -> usize {
    let p = cache.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: name is NUL-terminated; RTLD_NEXT finds the definition after this library.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr() as *const c_char) } as usize;
    cache.store(p, Ordering::Release);
    p
}

macro_rules! reals {
    ($( $name:ident : fn($($a:ident : $t:ty),*) -> $r:ty ;)*) => {
        $(
            /// Call the next definition of this function (libc's).
            pub unsafe fn $name($($a: $t),*) -> $r {
                static P: AtomicUsize = AtomicUsize::new(0);
                let p = resolve(&P, concat!(stringify!($name), "\0").as_bytes());
                if p == 0 {
                    set_errno(libc::ENOSYS);
                    return <$r as Fail>::fail();
                }
                // SAFETY: p is libc's definition of this symbol, whose C prototype is this one.
                let f: unsafe extern "C" fn($($t),*) -> $r = unsafe { std::mem::transmute(p) };
                // SAFETY: each wrapper is an `unsafe fn` with its C function's contract, which the caller
                // keeps; the arguments pass unchanged.
                unsafe { f($($a),*) }
            }
        )*
    };
}

/// Functions whose C prototype ends in `...`: called as variadic with one more argument (the
/// mode of `open`, the argument of `fcntl`), which the callee reads only when it needs it.
macro_rules! reals_variadic {
    ($( $name:ident : fn($($a:ident : $t:ty),*; $v:ident) -> $r:ty ;)*) => {
        $(
            /// Call the next definition of this function (libc's).
            pub unsafe fn $name($($a: $t),*, $v: c_ulong) -> $r {
                static P: AtomicUsize = AtomicUsize::new(0);
                let p = resolve(&P, concat!(stringify!($name), "\0").as_bytes());
                if p == 0 {
                    set_errno(libc::ENOSYS);
                    return <$r as Fail>::fail();
                }
                // SAFETY: p is libc's definition of this variadic symbol.
                let f: unsafe extern "C" fn($($t),*, ...) -> $r = unsafe { std::mem::transmute(p) };
                // SAFETY: as in `reals!`; the extra argument is passed as one machine word, which the callee
                // reads only when `cmd`/`flags` call for it, as the caller's C call would.
                unsafe { f($($a),*, $v) }
            }
        )*
    };
}

reals_variadic! {
    open: fn(path: *const c_char, flags: c_int; mode) -> c_int;
    open64: fn(path: *const c_char, flags: c_int; mode) -> c_int;
    openat: fn(dirfd: c_int, path: *const c_char, flags: c_int; mode) -> c_int;
    openat64: fn(dirfd: c_int, path: *const c_char, flags: c_int; mode) -> c_int;
    fcntl: fn(fd: c_int, cmd: c_int; arg) -> c_int;
    fcntl64: fn(fd: c_int, cmd: c_int; arg) -> c_int;
    ioctl: fn(fd: c_int, req: c_ulong; arg) -> c_int;
}

reals! {
    creat: fn(path: *const c_char, mode: mode_t) -> c_int;
    creat64: fn(path: *const c_char, mode: mode_t) -> c_int;
    __open_2: fn(path: *const c_char, flags: c_int) -> c_int;
    __open64_2: fn(path: *const c_char, flags: c_int) -> c_int;
    __openat_2: fn(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int;
    __openat64_2: fn(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int;
    fopen: fn(path: *const c_char, mode: *const c_char) -> *mut FILE;
    fopen64: fn(path: *const c_char, mode: *const c_char) -> *mut FILE;
    fdopen: fn(fd: c_int, mode: *const c_char) -> *mut FILE;
    fileno: fn(f: *mut FILE) -> c_int;
    fileno_unlocked: fn(f: *mut FILE) -> c_int;
    read: fn(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t;
    __read_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, buflen: size_t) -> ssize_t;
    pread: fn(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t;
    pread64: fn(fd: c_int, buf: *mut c_void, n: size_t, off: off_t) -> ssize_t;
    __pread_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t;
    __pread64_chk: fn(fd: c_int, buf: *mut c_void, n: size_t, off: off_t, buflen: size_t) -> ssize_t;
    readv: fn(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t;
    preadv: fn(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t;
    preadv64: fn(fd: c_int, iov: *const iovec, cnt: c_int, off: off_t) -> ssize_t;
    close: fn(fd: c_int) -> c_int;
    dup: fn(fd: c_int) -> c_int;
    dup2: fn(fd: c_int, new: c_int) -> c_int;
    dup3: fn(fd: c_int, new: c_int, flags: c_int) -> c_int;
    mmap: fn(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void;
    mmap64: fn(addr: *mut c_void, len: size_t, prot: c_int, flags: c_int, fd: c_int, off: off_t) -> *mut c_void;
    fstat: fn(fd: c_int, buf: *mut libc::stat) -> c_int;
    fstat64: fn(fd: c_int, buf: *mut libc::stat64) -> c_int;
    __fxstat: fn(ver: c_int, fd: c_int, buf: *mut libc::stat) -> c_int;
    __fxstat64: fn(ver: c_int, fd: c_int, buf: *mut libc::stat64) -> c_int;
    fstatat: fn(dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int;
    fstatat64: fn(dirfd: c_int, path: *const c_char, buf: *mut libc::stat64, flags: c_int) -> c_int;
    __fxstatat: fn(ver: c_int, dirfd: c_int, path: *const c_char, buf: *mut libc::stat, flags: c_int) -> c_int;
    __fxstatat64: fn(ver: c_int, dirfd: c_int, path: *const c_char, buf: *mut libc::stat64, flags: c_int) -> c_int;
    statx: fn(dirfd: c_int, path: *const c_char, flags: c_int, mask: c_uint, buf: *mut libc::statx) -> c_int;
    lseek: fn(fd: c_int, off: off_t, whence: c_int) -> off_t;
    fchmod: fn(fd: c_int, mode: mode_t) -> c_int;
    fchown: fn(fd: c_int, uid: libc::uid_t, gid: libc::gid_t) -> c_int;
    futimens: fn(fd: c_int, times: *const libc::timespec) -> c_int;
    flock: fn(fd: c_int, op: c_int) -> c_int;
    fgetxattr: fn(fd: c_int, name: *const c_char, value: *mut c_void, size: size_t) -> ssize_t;
    fsetxattr: fn(fd: c_int, name: *const c_char, value: *const c_void, size: size_t, flags: c_int) -> c_int;
    flistxattr: fn(fd: c_int, list: *mut c_char, size: size_t) -> ssize_t;
    fremovexattr: fn(fd: c_int, name: *const c_char) -> c_int;
    fstatfs: fn(fd: c_int, buf: *mut c_void) -> c_int;
    fstatfs64: fn(fd: c_int, buf: *mut c_void) -> c_int;
    fstatvfs: fn(fd: c_int, buf: *mut c_void) -> c_int;
    fstatvfs64: fn(fd: c_int, buf: *mut c_void) -> c_int;
    fexecve: fn(fd: c_int, argv: *const *const c_char, envp: *const *const c_char) -> c_int;
    posix_spawn_file_actions_adddup2: fn(fa: *mut c_void, fd: c_int, newfd: c_int) -> c_int;
    sendmsg: fn(sock: c_int, msg: *const libc::msghdr, flags: c_int) -> ssize_t;
}
