//! Private files for node-shared state. Everything lives in a per-user directory
//! (`<base>/clairvoyant-<uid>/`, mode 0700, owner checked with `lstat` on every use); files are
//! created with `O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600, and existing ones are opened with
//! `O_NOFOLLOW` and checked with `fstat` (a regular file of this user). A symlink or a file of
//! another user is never read, written or truncated.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Effective user id of this process.
pub fn uid() -> u32 {
    // SAFETY: geteuid cannot fail and has no side effects.
    unsafe { libc::geteuid() }
}

/// Where node-shared memory lives: `CLAIRVOYANT_SHM_DIR`, else `/dev/shm`, else the temp dir.
pub fn shm_base() -> PathBuf {
    if let Some(d) = crate::sysinfo::env::get(crate::sysinfo::env::SHM_DIR) {
        return PathBuf::from(d);
    }
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A disk directory for file-backed fallbacks when shared memory is too small.
pub fn disk_base() -> PathBuf {
    std::env::temp_dir()
}

/// `<base>/clairvoyant-<uid>`, created 0700 if missing, and checked: a real directory (not a
/// symlink) owned by this user; group/other bits on our own directory are removed. If another
/// user took that name (or planted a symlink there), the next of `clairvoyant-<uid>.1`, `.2`, ...
/// that is ours is used (every process of this user walks the same sequence, so they still meet)
/// and a warning names the refused path; after 8 refusals the error names the first.
pub fn private_dir(base: &Path) -> Result<PathBuf> {
    let mut first_refusal = None;
    for i in 0..8 {
        let dir = if i == 0 {
            base.join(format!("clairvoyant-{}", uid()))
        } else {
            base.join(format!("clairvoyant-{}.{i}", uid()))
        };
        match make_private_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e @ Error::Untrusted { .. }) => {
                super::warn_once(
                    &format!("untrusted:{}", dir.display()),
                    &format!("{e}; using another name"),
                );
                first_refusal.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(first_refusal.expect("refused"))
}

/// Create `dir` (mode 0700) unless it exists, then check it as [`check_private_dir`] does.
pub fn make_private_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(dir, e)),
    }
    check_private_dir(dir)
}

/// `dir` as a private directory of this user: created 0700 with any missing parents when
/// `create` (the parents get 0700 too), then checked as [`check_private_dir`] does, except that
/// a folder the user named (`tighten` false: the rendezvous directory, agent logs) that others
/// may enter is refused rather than closed: its mode is the user's choice, and others may
/// have read it already. The run's own folders are closed again (`tighten` true).
pub fn private_dir_at(dir: &Path, create: bool, tighten: bool) -> Result<()> {
    if create {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| Error::io(dir, e))?;
    }
    if !tighten {
        let md = std::fs::symlink_metadata(dir).map_err(|e| Error::io(dir, e))?;
        if md.is_dir() && md.uid() == uid() && md.mode() & 0o077 != 0 {
            return Err(Error::untrusted(
                dir,
                format!(
                    "has mode {:04o}, which lets other users in; it must be 0700 (chmod 700 {})",
                    md.mode() & 0o7777,
                    dir.display()
                ),
            ));
        }
    }
    check_private_dir(dir)
}

/// The bytes of a file only this user may read (a job secret, a rendezvous file written by
/// another rank of this user): opened with `O_NOFOLLOW`, and refused unless it is a regular
/// file owned by this user with mode 0600. Unlike [`open_existing`], a looser mode is refused,
/// not tightened: someone else may have read it already.
pub fn read_private(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                Error::untrusted(path, "is a symbolic link")
            } else {
                Error::io(path, e)
            }
        })?;
    let md = regular_file_of_ours(&f, path)?;
    if md.mode() & 0o7777 != 0o600 {
        return Err(Error::untrusted(
            path,
            format!(
                "has mode {:04o}; it must be 0600 (readable by this user only)",
                md.mode() & 0o7777
            ),
        ));
    }
    let mut bytes = Vec::with_capacity(md.len() as usize);
    f.read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    Ok(bytes)
}

/// `dir` must be a directory (not a symlink) owned by this user; its mode is reduced to 0700.
pub fn check_private_dir(dir: &Path) -> Result<()> {
    let md = std::fs::symlink_metadata(dir).map_err(|e| Error::io(dir, e))?;
    if md.file_type().is_symlink() {
        return Err(Error::untrusted(
            dir,
            "is a symbolic link, not a directory of this user",
        ));
    }
    if !md.is_dir() {
        return Err(Error::untrusted(dir, "is not a directory"));
    }
    if md.uid() != uid() {
        return Err(Error::untrusted(
            dir,
            format!(
                "is owned by uid {}, not by this user (uid {}); another user created it",
                md.uid(),
                uid()
            ),
        ));
    }
    if md.mode() & 0o077 != 0 {
        // Our own directory, opened up by someone with our rights: close it again. (In a sticky
        // directory such as /dev/shm nobody else can replace it between the check and here.)
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| Error::io(dir, e))?;
    }
    Ok(())
}

/// Create `path` exclusively (never an existing file, never through a symlink), mode 0600.
pub fn create_new(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Open an existing file of ours: no symlink, a regular file owned by this user (checked with
/// `fstat` on the opened descriptor); group/other bits are removed.
pub fn open_existing(path: &Path, write: bool) -> Result<File> {
    let mut options = OpenOptions::new();
    options
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    open_checked(&options, path)
}

/// Open `path` with `options` (which hold `O_NOFOLLOW`: a symlink is refused as untrusted) and
/// check it is a regular file of this user.
fn open_checked(options: &OpenOptions, path: &Path) -> Result<File> {
    let f = options.open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            Error::untrusted(path, "is a symbolic link")
        } else {
            Error::io(path, e)
        }
    })?;
    check_file(&f, path)?;
    Ok(f)
}

/// The metadata of `f` (opened from `path`) when it is a regular file owned by this user.
fn regular_file_of_ours(f: &File, path: &Path) -> Result<std::fs::Metadata> {
    let md = f.metadata().map_err(|e| Error::io(path, e))?;
    if !md.is_file() {
        return Err(Error::untrusted(path, "is not a regular file"));
    }
    if md.uid() != uid() {
        return Err(Error::untrusted(
            path,
            format!("is owned by uid {}, not by this user (uid {})", md.uid(), uid()),
        ));
    }
    Ok(md)
}

/// `f` (opened from `path`) must be a regular file owned by this user.
pub fn check_file(f: &File, path: &Path) -> Result<()> {
    let md = regular_file_of_ours(f, path)?;
    if md.mode() & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// A folder for files kept between runs (indexes, `system.toml`): `dir` itself when it is a
/// directory owned by this user or root and writable by nobody else, else, in a world-writable
/// sticky folder such as /tmp, the private subfolder `clairvoyant-<uid>` ([`private_dir`]).
/// Anything else (owned by another user, or writable by others without the sticky bit, or a
/// symlink another user made) is refused as ssh refuses a loose `~/.ssh`: another user could
/// plant files there. Missing folders are created 0700 when `create`, else `Ok(None)`.
pub fn trusted_dir(dir: &Path, create: bool) -> Result<Option<PathBuf>> {
    let lmd = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !create => return Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| Error::io(dir, e))?;
            std::fs::symlink_metadata(dir).map_err(|e| Error::io(dir, e))?
        }
        Err(e) => return Err(Error::io(dir, e)),
    };
    let trusted = |owner: u32| owner == uid() || owner == 0;
    if lmd.file_type().is_symlink() && !trusted(lmd.uid()) {
        return Err(Error::untrusted(
            dir,
            format!(
                "is a symbolic link made by uid {}, not by this user (uid {})",
                lmd.uid(),
                uid()
            ),
        ));
    }
    let md = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
    if !md.is_dir() {
        return Err(Error::untrusted(dir, "is not a directory"));
    }
    if !trusted(md.uid()) {
        return Err(Error::untrusted(
            dir,
            format!(
                "is owned by uid {}, not by this user (uid {}) or root; another user could plant \
                 files there (use a folder of your own, e.g. set CLAIRVOYANT_CACHE_DIR)",
                md.uid(),
                uid()
            ),
        ));
    }
    if md.mode() & 0o022 == 0 {
        return Ok(Some(dir.to_path_buf()));
    }
    if md.mode() & 0o1000 != 0 {
        return private_dir(dir).map(Some);
    }
    Err(Error::untrusted(
        dir,
        format!(
            "is writable by other users (mode {:o}) and not sticky; another user could plant files \
             there (chmod go-w it, or set CLAIRVOYANT_CACHE_DIR to a folder only you can write)",
            md.mode() & 0o7777
        ),
    ))
}

/// The bytes of a file kept between runs, or None when it does not exist. Opened with
/// `O_NOFOLLOW`; a file that is not a regular file owned by this user or root, or that others
/// can write, is refused ([`Error::Untrusted`]): its content is never used.
pub fn read_trusted(path: &Path) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    let mut f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(Error::untrusted(path, "is a symbolic link")),
        Err(e) => return Err(Error::io(path, e)),
    };
    let md = f.metadata().map_err(|e| Error::io(path, e))?;
    if !md.is_file() {
        return Err(Error::untrusted(path, "is not a regular file"));
    }
    if md.uid() != uid() && md.uid() != 0 {
        return Err(Error::untrusted(
            path,
            format!("is owned by uid {}, not by this user (uid {}) or root", md.uid(), uid()),
        ));
    }
    if md.mode() & 0o022 != 0 {
        return Err(Error::untrusted(
            path,
            format!("is writable by other users (mode {:o})", md.mode() & 0o7777),
        ));
    }
    let mut bytes = Vec::with_capacity(md.len() as usize);
    f.read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    Ok(Some(bytes))
}

/// Replace `path` atomically with `bytes`: a temporary file with an unpredictable name
/// (`tempfile`, `O_EXCL`, mode 0600) in the same folder, synced, then renamed over `path`
/// (a rename replaces a symlink there, it never writes through it). Nothing is left on failure.
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d,
        None => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| Error::io(dir, e))?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().sync_all())
        .map_err(|e| Error::io(tmp.path(), e))?;
    tmp.persist(path).map_err(|e| Error::io(path, e.error))?;
    Ok(())
}

/// Open (creating, mode 0600) a lock file: never through a symlink (`O_NOFOLLOW`), and only a
/// regular file of this user.
pub fn open_lock(path: &Path) -> Result<File> {
    let mut options = OpenOptions::new();
    options
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK);
    open_checked(&options, path)
}

/// Reserve `len` bytes of `f` now, so that a full file system shows up here and not later as
/// SIGBUS or EFAULT when a mapped page is first touched.
pub fn reserve(f: &File, len: u64) -> std::io::Result<()> {
    reserve_range(f, 0, len)
}

/// [`reserve`] the `len` bytes of `f` from `offset` (blocks already there cost nothing; the
/// file grows if the range ends past its end).
pub fn reserve_range(f: &File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a valid descriptor; posix_fallocate returns an error number, never touches memory.
        let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), offset as libc::off_t, len as libc::off_t) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = f.as_raw_fd();
        let end = offset + len;
        if f.metadata()?.len() < end {
            f.set_len(end)?;
        }
        Ok(())
    }
}

/// Create `path` exclusively, `len` bytes long with no blocks reserved (they are taken as the
/// file is written: see [`reserve_range`]); on failure nothing is left behind.
pub fn create_sized(path: &Path, len: u64) -> std::io::Result<File> {
    let f = create_new(path)?;
    if let Err(e) = f.set_len(len) {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(f)
}

/// Create `path` exclusively with `len` bytes reserved; on failure nothing is left behind.
pub fn create_reserved(path: &Path, len: u64) -> std::io::Result<File> {
    let f = create_new(path)?;
    if let Err(e) = reserve(&f, len).and_then(|_| f.set_len(len)) {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(f)
}

/// Whether `e` means the file system is full (or the user's quota is).
pub fn is_no_space(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG)
    )
}

/// Start time of process `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`);
/// None when the process does not exist or has exited (a zombie not yet reaped by its parent
/// holds no claim). Together with the pid it names a process even after its pid is reused.
pub fn start_time(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses: fields 3.. follow the last ')'.
    let mut fields = s[s.rfind(')')? + 1..].split_whitespace();
    if matches!(fields.next()?, "Z" | "X" | "x") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// Whether the process (pid, start time) still runs.
pub fn alive(pid: u32, start: u64) -> bool {
    if Path::new("/proc/self/stat").exists() {
        return start_time(pid) == Some(start);
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_dir_is_0700_and_refuses_symlinks_and_files() {
        let t = tempfile::tempdir().unwrap();
        let d = private_dir(t.path()).unwrap();
        let md = std::fs::symlink_metadata(&d).unwrap();
        assert_eq!(md.mode() & 0o777, 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(t.path()).unwrap();
        assert_eq!(
            std::fs::symlink_metadata(&d).unwrap().mode() & 0o777,
            0o700,
            "mode repaired"
        );

        let other = tempfile::tempdir().unwrap();
        let link = other.path().join(format!("clairvoyant-{}", uid()));
        std::os::unix::fs::symlink(t.path(), &link).unwrap();
        let e = check_private_dir(&link).unwrap_err();
        assert!(matches!(e, Error::Untrusted { .. }), "{e}");
        assert!(e.to_string().contains(&link.display().to_string()), "{e}");
        let d2 = private_dir(other.path()).unwrap();
        assert_eq!(
            d2,
            other.path().join(format!("clairvoyant-{}.1", uid())),
            "the next name"
        );
        assert!(
            std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(),
            "left alone"
        );

        let third = tempfile::tempdir().unwrap();
        for i in 0..8 {
            let name = if i == 0 {
                format!("clairvoyant-{}", uid())
            } else {
                format!("clairvoyant-{}.{i}", uid())
            };
            std::fs::write(third.path().join(name), b"x").unwrap();
        }
        assert!(matches!(private_dir(third.path()), Err(Error::Untrusted { .. })));
    }

    #[test]
    fn files_are_created_exclusively_0600_and_symlinks_refused() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("a");
        let f = create_new(&p).unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600);
        assert!(create_new(&p).is_err(), "never opens an existing file");
        let target = t.path().join("victim");
        std::fs::write(&target, b"keep").unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(create_new(&link).is_err());
        let e = open_existing(&link, true).unwrap_err();
        assert!(matches!(e, Error::Untrusted { .. }), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        let f = open_existing(&p, false).unwrap();
        assert_eq!(f.metadata().unwrap().mode() & 0o777, 0o600, "mode repaired");
        assert!(open_existing(t.path(), false).is_err(), "a directory is not a segment");
    }

    #[test]
    fn private_dir_at_creates_parents_and_read_private_refuses_loose_files() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        private_dir_at(&d, true, false).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        assert!(matches!(
            private_dir_at(&t.path().join("missing"), false, false),
            Err(Error::Io { .. })
        ));
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = private_dir_at(&d, false, false).unwrap_err();
        assert!(e.to_string().contains("has mode 0755"), "{e}");
        private_dir_at(&d, false, true).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700, "closed again");
        let f = d.join("secret");
        std::fs::write(&f, b"s3cret").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_private(&f).unwrap(), b"s3cret");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = read_private(&f).unwrap_err();
        assert!(e.to_string().contains("has mode 0640"), "{e}");
        assert_eq!(std::fs::metadata(&f).unwrap().mode() & 0o777, 0o640, "never tightened");
        let link = d.join("link");
        std::os::unix::fs::symlink(&f, &link).unwrap();
        let e = read_private(&link).unwrap_err();
        assert!(
            matches!(e, Error::Untrusted { .. }) && e.to_string().contains("symbolic link"),
            "{e}"
        );
        assert!(
            matches!(read_private(&d), Err(Error::Untrusted { .. })),
            "a directory is refused"
        );
    }

    #[test]
    fn start_time_names_this_process() {
        let me = std::process::id();
        let st = start_time(me).unwrap();
        assert!(alive(me, st));
        assert!(!alive(me, st + 1), "another start time is another process");
        assert!(!alive(0x7fff_fff0, st));
    }

    #[test]
    fn an_unreaped_child_is_dead() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert_eq!(start_time(pid), None, "exited, not yet reaped");
        child.wait().unwrap();
    }

    fn chown(p: &Path, uid: u32) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        assert_eq!(
            // SAFETY: a valid NUL-terminated path; lchown does not follow a symlink there.
            unsafe { libc::lchown(c.as_ptr(), uid, uid) },
            0,
            "lchown {}",
            p.display()
        );
    }

    #[test]
    fn cache_folders_of_others_or_writable_by_others_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let fresh = t.path().join("a/b/cache");
        assert_eq!(
            trusted_dir(&fresh, false).unwrap(),
            None,
            "not created when asked not to"
        );
        assert_eq!(trusted_dir(&fresh, true).unwrap(), Some(fresh.clone()));
        for d in [t.path().join("a"), t.path().join("a/b"), fresh.clone()] {
            assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700, "{}", d.display());
        }
        let open = t.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = trusted_dir(&open, true).unwrap_err();
        assert!(
            matches!(e, Error::Untrusted { .. }) && e.to_string().contains("writable by other users"),
            "{e}"
        );
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let sub = trusted_dir(&open, true).unwrap().unwrap();
        assert_eq!(
            sub,
            open.join(format!("clairvoyant-{}", uid())),
            "a private subfolder of a sticky one"
        );
        assert_eq!(std::fs::metadata(&sub).unwrap().mode() & 0o777, 0o700);
        if uid() != 0 {
            eprintln!("skipping the parts with folders of another user: needs root (lchown)");
            return;
        }
        let theirs = t.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        chown(&theirs, 65534);
        let e = trusted_dir(&theirs, true).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        chown(&link, 65534);
        let e = trusted_dir(&link, true).unwrap_err();
        assert!(e.to_string().contains("symbolic link made by uid 65534"), "{e}");
    }

    #[test]
    fn files_kept_between_runs_are_private_and_never_followed() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, b"secret").unwrap();
        let p = t.path().join("index");
        std::os::unix::fs::symlink(&victim, &p).unwrap();
        let e = read_trusted(&p).unwrap_err();
        assert!(matches!(e, Error::Untrusted { .. }), "{e}");
        write_private(&p, b"new").unwrap();
        assert_eq!(
            std::fs::read(&victim).unwrap(),
            b"secret",
            "written through the symlink"
        );
        let md = std::fs::symlink_metadata(&p).unwrap();
        assert!(md.is_file() && md.mode() & 0o777 == 0o600, "{:o}", md.mode());
        assert_eq!(read_trusted(&p).unwrap().unwrap(), b"new");
        assert_eq!(read_trusted(&t.path().join("missing")).unwrap(), None);
        let names: Vec<_> = std::fs::read_dir(t.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporary file left: {names:?}");

        let lock = t.path().join("x.lock");
        let target = t.path().join("created-through-link");
        std::os::unix::fs::symlink(&target, &lock).unwrap();
        assert!(matches!(open_lock(&lock), Err(Error::Untrusted { .. })));
        assert!(!target.exists(), "a file was created through a planted symlink");
        let lock2 = t.path().join("y.lock");
        assert_eq!(open_lock(&lock2).unwrap().metadata().unwrap().mode() & 0o777, 0o600);

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(read_trusted(&p)
            .unwrap_err()
            .to_string()
            .contains("writable by other users"));
        if uid() != 0 {
            eprintln!("skipping the parts with files of another user: needs root (lchown)");
            return;
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        chown(&p, 65534);
        assert!(read_trusted(&p).unwrap_err().to_string().contains("owned by uid 65534"));
        chown(&lock2, 65534);
        assert!(matches!(open_lock(&lock2), Err(Error::Untrusted { .. })));
    }
}
