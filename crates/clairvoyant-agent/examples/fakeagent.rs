//! A stand-in agent for the interposed library's tests: it snapshots every regular file under
//! `--root` into an arena file, records them in a shared directory and answers the socket
//! protocol. It is not the product agent (no engine, no tiers, no peers).
//!
//! `target/release/examples/fakeagent --root DIR --socket PATH --state DIR
//!  [--mode dir|lookup|inline|direct|hang|gather:N]`
//!
//! Modes: `dir` puts every file in the shared directory (no round trip needed); `lookup` leaves
//! the directory empty and answers `Cached`; `inline` answers `Inline` with the snapshot's bytes;
//! `direct` answers `Direct`; `hang` never answers a lookup (to test the client's timeout);
//! `gather:N` answers as `lookup` does, but holds each lookup until N are in flight at once (at
//! most 5 s) and writes the most it saw in flight to `STATE/max_in_flight`.
//! A file that changed since the snapshot (size or last change) is answered `Direct`.
//! Writes `STATE/manifest.tsv` (relative path, arena offset, size per line), prints `ready` on
//! stdout once it accepts connections, and exits when stdin closes.

use clairvoyant_agent::dir::{path_key, DirWriter, Entry};
use clairvoyant_agent::proto::{read_request, write_reply, Reply, Request, VERSION};
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Dir,
    Lookup,
    Inline,
    Direct,
    Hang,
    Gather(usize),
}

/// Lookups in flight now and the most seen at once (mode `gather`).
#[derive(Default)]
struct InFlight {
    now: std::sync::Mutex<(usize, usize)>,
    changed: std::sync::Condvar,
}

struct Agent {
    root: Vec<u8>,
    mode: Mode,
    files: HashMap<Vec<u8>, (Entry, PathBuf)>,
    dir: DirWriter,
    dir_path: PathBuf,
    arena_path: PathBuf,
    arena_len: u64,
    in_flight: InFlight,
    state: PathBuf,
}

fn last_change_ns(m: &std::fs::Metadata) -> u64 {
    let ns = |s: i64, n: i64| (s as i128 * 1_000_000_000 + n as i128).max(0) as u64;
    ns(m.mtime(), m.mtime_nsec()).max(ns(m.ctime(), m.ctime_nsec()))
}

fn walk(root: &Path, at: &Path, out: &mut Vec<(Vec<u8>, PathBuf)>) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(at)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let t = e.file_type()?;
        if t.is_dir() {
            walk(root, &e.path(), out)?;
        } else if t.is_file() {
            let rel = e.path().strip_prefix(root).unwrap().as_os_str().as_bytes().to_vec();
            out.push((rel, e.path()));
        }
    }
    Ok(())
}

fn build(root: &Path, state: &Path, mode: Mode) -> std::io::Result<Agent> {
    let mut list = Vec::new();
    walk(root, root, &mut list)?;
    let arena_path = state.join("arena");
    let dir_path = state.join("dir");
    let mut arena = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&arena_path)?;
    let root_bytes = root.as_os_str().as_bytes().to_vec();
    let dir = DirWriter::create_with_root(&dir_path, list.len(), path_key(&root_bytes))?;
    let mut files = HashMap::new();
    let mut offset = 0u64;
    for (i, (rel, path)) in list.into_iter().enumerate() {
        let meta = std::fs::metadata(&path)?;
        let bytes = std::fs::read(&path)?;
        let e = Entry {
            file: i as u32,
            offset,
            size: bytes.len() as u64,
            checksum: clairvoyant_agent::checksum(&bytes),
            mtime_ns: last_change_ns(&meta),
        };
        arena.write_all(&bytes)?;
        let pad = (4096 - bytes.len() % 4096) % 4096;
        arena.write_all(&vec![0u8; pad])?;
        offset += (bytes.len() + pad) as u64;
        if mode == Mode::Dir && !dir.insert(path_key(&rel), &e) {
            return Err(std::io::Error::other(format!("{}: directory full", path.display())));
        }
        files.insert(rel, (e, path));
    }
    arena.sync_all()?;
    let mut manifest: Vec<_> = files
        .iter()
        .map(|(rel, (e, _))| (e.offset, rel.clone(), e.size))
        .collect();
    manifest.sort();
    let text: String = manifest
        .into_iter()
        .map(|(offset, rel, size)| format!("{}\t{offset}\t{size}\n", String::from_utf8_lossy(&rel)))
        .collect();
    std::fs::write(state.join("manifest.tsv"), text)?;
    Ok(Agent {
        root: root_bytes,
        mode,
        files,
        dir,
        dir_path,
        arena_path,
        arena_len: offset,
        in_flight: InFlight::default(),
        state: state.to_path_buf(),
    })
}

fn serve(agent: &Agent, stream: UnixStream) -> std::io::Result<()> {
    let mut rd = BufReader::new(stream.try_clone()?);
    let mut wr = BufWriter::new(stream);
    let mut arena: Option<std::fs::File> = None;
    loop {
        let req = match read_request(&mut rd) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        match req {
            Request::Hello { .. } => write_reply(
                &mut wr,
                &Reply::Hello {
                    version: VERSION,
                    root: agent.root.clone(),
                    dir_path: agent.dir_path.clone(),
                    arena_path: Some(agent.arena_path.clone()),
                    arena_len: agent.arena_len,
                },
            )?,
            Request::Attach { .. } => write_reply(&mut wr, &Reply::Ok)?,
            Request::Fill { size, .. } => {
                // Never asked for (this agent does not let programs fill): skip the bytes.
                std::io::copy(&mut (&mut rd).take(size), &mut std::io::sink())?;
            }
            Request::Plan { .. } => write_reply(
                &mut wr,
                &Reply::Error {
                    message: "this stand-in agent does not place".into(),
                },
            )?,
            Request::Stats => write_reply(
                &mut wr,
                &Reply::Json {
                    text: stats_json(agent),
                },
            )?,
            Request::Lookup { rel } => {
                if agent.mode == Mode::Hang {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                }
                if let Mode::Gather(n) = agent.mode {
                    gather(agent, n);
                }
                answer_lookup(agent, &rel, &mut arena, &mut wr)?;
            }
        }
        wr.flush()?;
    }
}

/// The shared directory's counters as a JSON object.
fn stats_json(agent: &Agent) -> String {
    let c = agent.dir.counters();
    let fields: Vec<String> = clairvoyant_agent::dir::counter::NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| format!("\"{n}\": {}", c[i].load(Ordering::Relaxed)))
        .collect();
    format!("{{{}}}", fields.join(", "))
}

/// Answer a lookup of `rel` as the mode says (a changed or unknown file: `Direct`/`Unknown`).
fn answer_lookup(
    agent: &Agent,
    rel: &[u8],
    arena: &mut Option<std::fs::File>,
    wr: &mut BufWriter<UnixStream>,
) -> std::io::Result<()> {
    let Some((e, path)) = agent.files.get(rel) else {
        return write_reply(wr, &Reply::Unknown);
    };
    let fresh = std::fs::metadata(path)
        .map(|m| m.len() == e.size && last_change_ns(&m) == e.mtime_ns)
        .unwrap_or(false);
    match agent.mode {
        _ if !fresh => write_reply(wr, &Reply::Direct),
        Mode::Dir | Mode::Lookup | Mode::Gather(_) => write_reply(
            wr,
            &Reply::Cached {
                file: e.file,
                size: e.size,
                offset: e.offset,
                checksum: e.checksum,
            },
        ),
        Mode::Inline => {
            let f = match arena {
                Some(f) => f,
                None => arena.insert(std::fs::File::open(&agent.arena_path)?),
            };
            let mut bytes = vec![0u8; e.size as usize];
            std::os::unix::fs::FileExt::read_exact_at(f, &mut bytes, e.offset)?;
            write_reply(
                wr,
                &Reply::Inline {
                    file: e.file,
                    size: e.size,
                    checksum: e.checksum,
                },
            )?;
            wr.write_all(&bytes)
        }
        Mode::Direct | Mode::Hang => write_reply(wr, &Reply::Direct),
    }
}

/// Hold this lookup until `n` are in flight at once (or 5 s passed); record the most seen.
fn gather(agent: &Agent, n: usize) {
    let f = &agent.in_flight;
    let mut g = f.now.lock().unwrap();
    g.0 += 1;
    if g.0 > g.1 {
        g.1 = g.0;
        std::fs::write(agent.state.join("max_in_flight"), g.1.to_string()).unwrap();
    }
    f.changed.notify_all();
    let (mut g, _) = f
        .changed
        .wait_timeout_while(g, std::time::Duration::from_secs(5), |g| g.1 < n)
        .unwrap();
    g.0 -= 1;
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut root, mut socket, mut state, mut mode) = (None, None, None, Mode::Dir);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--root" => root = Some(PathBuf::from(val())),
            "--socket" => socket = Some(PathBuf::from(val())),
            "--state" => state = Some(PathBuf::from(val())),
            "--mode" => {
                mode = match val().as_str() {
                    "dir" => Mode::Dir,
                    "lookup" => Mode::Lookup,
                    "inline" => Mode::Inline,
                    "direct" => Mode::Direct,
                    "hang" => Mode::Hang,
                    m => match m.strip_prefix("gather:").and_then(|n| n.parse().ok()) {
                        Some(n) => Mode::Gather(n),
                        None => panic!("unknown mode {m}"),
                    },
                }
            }
            _ => panic!("unknown argument {a}"),
        }
    }
    let (root, socket, state) = (
        root.expect("--root"),
        socket.expect("--socket"),
        state.expect("--state"),
    );
    let agent = Arc::new(build(&root, &state, mode).unwrap_or_else(|e| panic!("{}: {e}", root.display())));
    let listener = UnixListener::bind(&socket).unwrap_or_else(|e| panic!("{}: {e}", socket.display()));
    println!("ready");
    std::io::stdout().flush().unwrap();
    std::thread::spawn(|| {
        let mut sink = [0u8; 64];
        while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    let live = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if live.load(Ordering::Relaxed) >= 256 {
            continue; // dropped: the client falls back to direct reads
        }
        live.fetch_add(1, Ordering::Relaxed);
        let (agent, live) = (agent.clone(), live.clone());
        std::thread::spawn(move || {
            if let Err(e) = serve(&agent, stream) {
                eprintln!("fakeagent: connection ended: {e}");
            }
            live.fetch_sub(1, Ordering::Relaxed);
        });
    }
}
