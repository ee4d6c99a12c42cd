//! Configuration read once from the environment, and the one question asked of every open:
//! is this path under the dataset root, and if so, what is its normalized relative path?

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::Duration;

/// The dataset root (absolute path) whose files are served.
pub const ENV_ROOT: &str = "CLAIRVOYANT_ROOT";
/// The agent's Unix socket path.
pub const ENV_AGENT: &str = "CLAIRVOYANT_AGENT";
/// Round-trip timeout in milliseconds (default 10000); tests shorten it.
pub const ENV_TIMEOUT_MS: &str = "CLAIRVOYANT_AGENT_TIMEOUT_MS";
/// `open` (default): verify a cached file's checksum once per open; `process`: once per process
/// and cached copy, later opens of the same copy in the same process are *unchecked* (bytes
/// damaged in the arena after that first check are served as they are).
pub const ENV_VERIFY: &str = "CLAIRVOYANT_VERIFY";
/// Stand-in opens (docs/transparent.md, "Stand-in opens"): `1` always, `0` never, anything else
/// or unset (`auto`): unless the root is on a local file system, where a real open costs less
/// than the `stat` plus arena open of a stand-in.
pub const ENV_STANDIN: &str = "CLAIRVOYANT_STANDIN";

/// `statfs` magic numbers of local file systems (linux/magic.h): ext2/3/4, XFS, Btrfs, tmpfs,
/// ramfs, overlayfs, F2FS, ZFS, bcachefs, JFS, ReiserFS, squashfs.
const LOCAL_FS: [i64; 12] = [
    0xEF53,
    0x5846_5342,
    0x9123_683E,
    0x0102_1994,
    0x8584_58F6,
    0x794C_7630,
    0xF2F5_2010,
    0x2FC1_2FC1,
    0xCA45_1A4E,
    0x3153_464A,
    0x5265_4973,
    0x7371_7368,
];

/// Whether stand-in opens are used for `root` given the value of `CLAIRVOYANT_STANDIN`.
fn standin_for(root: &[u8], var: Option<&OsStr>) -> bool {
    match var.map(|v| v.as_bytes()) {
        Some(b"0") => false,
        Some(b"1") => true,
        _ => {
            let Ok(c) = std::ffi::CString::new(root) else {
                return false;
            };
            // SAFETY: statfs into a zeroed struct; c is a C string.
            let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
            // SAFETY: `c` is a NUL-terminated C string alive for the call; `fs` is a live, writable `statfs`.
            if unsafe { libc::statfs(c.as_ptr(), &mut fs) } != 0 {
                return false;
            }
            !LOCAL_FS.contains(&(fs.f_type as i64))
        }
    }
}
/// After a failed round trip, how long the agent is not asked again; doubled after each failed
/// probe (a stopped agent costs one time-out, then short probes ever more seldom).
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
/// The longest time between two probes of an agent that does not answer.
pub const RETRY_MAX: Duration = Duration::from_secs(30);
/// How long the greeting of a probe (the first connection after a failure) may take: an agent
/// that answers at all answers a greeting in microseconds.
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(200);

/// How long the agent is not asked after `failures` failures in a row (at least one).
pub fn retry_after(failures: u32) -> Duration {
    RETRY_FIRST
        .saturating_mul(1u32 << failures.saturating_sub(1).min(16))
        .min(RETRY_MAX)
}

pub struct Config {
    /// The root as given and its canonical form (when different), without trailing '/'
    /// ("/" itself becomes the empty string).
    pub roots: Vec<Vec<u8>>,
    pub agent: PathBuf,
    pub timeout: Duration,
    /// Verify each cached copy once per process instead of once per open.
    pub verify_per_process: bool,
    /// Serve read-only opens of cached files without opening the file itself (`ENV_STANDIN`).
    pub standin: bool,
}

impl Config {
    /// `None` (pure pass-through) when either variable is missing, or the root is not absolute
    /// or is "/" itself (every write on the machine would be refused).
    pub fn from_env() -> Option<Config> {
        let root = std::env::var_os(ENV_ROOT)?;
        let agent = std::env::var_os(ENV_AGENT)?;
        let root = root.as_bytes();
        if !root.starts_with(b"/") || agent.is_empty() {
            return None;
        }
        let timeout = std::env::var(ENV_TIMEOUT_MS)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .unwrap_or(Duration::from_secs(10));
        let mut roots = vec![normalize_abs(root)];
        if roots[0].is_empty() {
            return None;
        }
        if let Ok(c) = std::fs::canonicalize(OsStr::from_bytes(root)) {
            let c = normalize_abs(c.as_os_str().as_bytes());
            if !roots.contains(&c) {
                roots.push(c);
            }
        }
        let verify_per_process = std::env::var_os(ENV_VERIFY).is_some_and(|v| v == "process");
        let standin = standin_for(root, std::env::var_os(ENV_STANDIN).as_deref());
        Some(Config {
            roots,
            agent: PathBuf::from(agent),
            timeout,
            verify_per_process,
            standin,
        })
    }
}

/// True when `p` (absolute) has an empty, "." or ".." component or a trailing '/'.
fn needs_normalizing(p: &[u8]) -> bool {
    p.len() > 1 && (p.ends_with(b"/") || p.ends_with(b"/.") || p.ends_with(b"/..") || has_odd_component(p))
}

fn has_odd_component(p: &[u8]) -> bool {
    p.windows(2).any(|w| w == b"//") || p.windows(3).any(|w| w == b"/./") || p.windows(4).any(|w| w == b"/../")
}

/// Lexical normalization of an absolute path: no empty, "." or ".." components, no trailing
/// '/'; "/" becomes the empty string (so that `root + "/" + rel` is always the path).
pub fn normalize_abs(p: &[u8]) -> Vec<u8> {
    let mut parts: Vec<&[u8]> = Vec::new();
    for c in p.split(|&b| b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    let mut out = Vec::with_capacity(p.len());
    for c in parts {
        out.push(b'/');
        out.extend_from_slice(c);
    }
    out
}

/// Where an absolute path is with respect to the roots.
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    Outside,
    /// The root itself (a directory).
    Root,
    /// A normalized relative path under the root.
    Under(Vec<u8>),
}

fn under<'a>(root: &[u8], p: &'a [u8]) -> Option<&'a [u8]> {
    if p.len() > root.len() && p.starts_with(root) && p[root.len()] == b'/' {
        Some(&p[root.len() + 1..])
    } else {
        None
    }
}

/// Classify an absolute path. The common case (a clean path outside the root) costs one scan
/// for odd components and one prefix comparison per root, and allocates nothing.
pub fn classify_abs(roots: &[Vec<u8>], p: &[u8]) -> Place {
    if needs_normalizing(p) {
        return classify_clean(roots, &normalize_abs(p));
    }
    classify_clean(roots, p)
}

fn classify_clean(roots: &[Vec<u8>], p: &[u8]) -> Place {
    for r in roots {
        if p == &r[..] || (p.is_empty() && r.is_empty()) {
            return Place::Root;
        }
        if let Some(rel) = under(r, p) {
            if rel.is_empty() {
                return Place::Root;
            }
            return Place::Under(rel.to_vec());
        }
    }
    Place::Outside
}

/// Classify `rel_or_abs` as seen from the directory `base` (absolute).
pub fn classify_from(roots: &[Vec<u8>], base: &[u8], path: &[u8]) -> Place {
    if path.starts_with(b"/") {
        return classify_abs(roots, path);
    }
    let mut full = Vec::with_capacity(base.len() + 1 + path.len());
    full.extend_from_slice(base);
    full.push(b'/');
    full.extend_from_slice(path);
    classify_clean(roots, &normalize_abs(&full))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_that_keeps_failing_is_asked_ever_more_seldom() {
        let waits: Vec<u64> = (1..=8).map(|n| retry_after(n).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_after(u32::MAX), RETRY_MAX);
        assert!(PROBE_TIMEOUT < RETRY_FIRST);
    }

    #[test]
    fn standin_setting() {
        let on = Some(OsStr::new("1"));
        let off = Some(OsStr::new("0"));
        assert!(standin_for(b"/no/such/root", on) && !standin_for(b"/", off));
        assert!(!standin_for(b"/no/such/root", None), "statfs fails: real opens");
        // /proc is no local disk file system: auto uses stand-ins there.
        assert!(standin_for(b"/proc", None) && standin_for(b"/proc", Some(OsStr::new("auto"))));
    }

    fn roots() -> Vec<Vec<u8>> {
        vec![b"/pfs/data".to_vec(), b"/mnt/real/data".to_vec()]
    }

    fn under_(s: &str) -> Place {
        Place::Under(s.as_bytes().to_vec())
    }

    #[test]
    fn clean_paths() {
        let r = roots();
        assert_eq!(classify_abs(&r, b"/usr/lib/python3/os.py"), Place::Outside);
        assert_eq!(classify_abs(&r, b"/pfs/database/x"), Place::Outside);
        assert_eq!(classify_abs(&r, b"/pfs/data"), Place::Root);
        assert_eq!(classify_abs(&r, b"/pfs/data/"), Place::Root);
        assert_eq!(classify_abs(&r, b"/pfs/data/a/b.jpg"), under_("a/b.jpg"));
        assert_eq!(classify_abs(&r, b"/mnt/real/data/a"), under_("a"));
    }

    #[test]
    fn odd_components_are_resolved_lexically() {
        let r = roots();
        assert_eq!(classify_abs(&r, b"/pfs//data/./a//b.jpg"), under_("a/b.jpg"));
        assert_eq!(classify_abs(&r, b"/pfs/data/../data/a"), under_("a"));
        assert_eq!(classify_abs(&r, b"/pfs/data/../other/a"), Place::Outside);
        assert_eq!(classify_abs(&r, b"/pfs/x/../data/a/.."), Place::Root);
        assert_eq!(classify_abs(&r, b"/../../pfs/data/z"), under_("z"));
    }

    #[test]
    fn relative_paths_join_the_base() {
        let r = roots();
        assert_eq!(classify_from(&r, b"/pfs/data/train", b"x.jpg"), under_("train/x.jpg"));
        assert_eq!(classify_from(&r, b"/pfs", b"data/x.jpg"), under_("x.jpg"));
        assert_eq!(classify_from(&r, b"/pfs/data", b"../x"), Place::Outside);
        assert_eq!(classify_from(&r, b"/home/u", b"/pfs/data/q"), under_("q"));
        assert_eq!(classify_from(&r, b"/home/u", b"q"), Place::Outside);
    }

    #[test]
    fn slash_as_root_holds_everything() {
        let r = vec![normalize_abs(b"/")];
        assert_eq!(r[0], b"");
        assert_eq!(classify_abs(&r, b"/etc/passwd"), under_("etc/passwd"));
        assert_eq!(classify_abs(&r, b"/"), Place::Root);
    }

    #[test]
    fn relative_paths_are_normalized_for_the_protocol() {
        let r = roots();
        for p in [&b"/pfs/data/a//b/./c"[..], b"/pfs/data/a/b/c", b"/pfs/data/x/../a/b/c"] {
            match classify_abs(&r, p) {
                Place::Under(rel) => {
                    assert_eq!(rel, b"a/b/c");
                    assert!(clairvoyant_agent::proto::is_normalized_rel(&rel));
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
