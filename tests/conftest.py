"""Test-session setup: nothing a test does may stay on the machine after the session.

- Shared memory and temporary files: before collection the session makes two folders of its
  own, ``/dev/shm/clairvoyant-tests-*`` (inside ``$CLAIRVOYANT_SHM_DIR`` when set, else in
  the temporary directory when there is no /dev/shm) and
  ``/tmp/clairvoyant-tests-*``, world-writable with the sticky bit like the real ones (tests
  run some processes as another user), and points ``CLAIRVOYANT_SHM_DIR`` and ``TMPDIR`` at
  them; every process a test starts inherits both. Both are removed when the session ends
  (kept, and named, when a test failed). pytest's own ``tmp_path`` folders stay in the real
  temporary directory, and only those of failed tests are kept (pyproject.toml).
- The cache folder: indexes and the system description default to ``$CLAIRVOYANT_CACHE_DIR``,
  else ``$XDG_CACHE_HOME/clairvoyant``, else ``~/.cache/clairvoyant``. The session points
  ``CLAIRVOYANT_CACHE_DIR`` at a temporary directory before any test runs and fails if by the
  end the user's cache directory holds an index of a dataset the session made.
- Leftovers: the session fails, naming them, when by its end ``/tmp`` or ``/dev/shm`` holds an
  entry of this project's (a name starting ``clairvoyant`` or ``cv-``; one level inside the
  user folders ``clairvoyant-<uid>``) that was not there when it began. Another test session of
  the project running at the same time (its ``clairvoyant-tests-<pid>-*`` folder seen, its
  process alive) may have made them: then they are only named.

Tests that mean a real ``/dev/shm`` or ``/tmp`` path still name it themselves.
"""

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

ENV = "CLAIRVOYANT_CACHE_DIR"
_SESSION_DIRS: dict = {}
# Where the product (and the tests) may leave things behind: the real temporary directory and
# shared-memory folder, whatever TMPDIR and CLAIRVOYANT_SHM_DIR say during the session.
LEFTOVER_PLACES = ("/tmp", "/dev/shm")
SESSION_PREFIX = "clairvoyant-tests-"


def project_entries(places) -> set:
    """This project's entries in `places`: names starting ``clairvoyant`` or ``cv-`` (not the
    test sessions' own folders), and what the per-user folders ``clairvoyant-<uid>[.n]`` hold."""
    out = set()
    for place in map(Path, places):
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for name in names:
            if not name.startswith(("clairvoyant", "cv-")) or name.startswith(SESSION_PREFIX):
                continue
            out.add(str(place / name))
            inside = place / name
            if re.fullmatch(r"clairvoyant-\d+(\.\d+)?", name) and inside.is_dir() and not inside.is_symlink():
                try:
                    out.update(str(inside / n) for n in os.listdir(inside))
                except OSError:
                    pass  # another user's folder
    return out


def other_sessions(places, own) -> set:
    """The folders in `places` of test sessions other than this one (`own`) that still run:
    a session's folder names its pid (``clairvoyant-tests-<pid>-*``); the folders a failed
    session keeps stay behind after it."""
    found = set()
    for place in places:
        try:
            names = os.listdir(place)
        except OSError:
            continue
        for n in names:
            m = re.match(re.escape(SESSION_PREFIX) + r"(\d+)-", n)
            if m and _alive(int(m.group(1))):
                found.add(str(Path(place) / n))
    return found - set(own)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _session_dir(parent: str) -> str:
    d = tempfile.mkdtemp(prefix=f"{SESSION_PREFIX}{os.getpid()}-", dir=parent)
    os.chmod(d, 0o1777)
    return d


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a worker of a distributed run: its controller set them
        return
    # Inside the folder already given (a session started by a test: the outer one removes it).
    shm_parent = os.environ.get("CLAIRVOYANT_SHM_DIR")
    if not shm_parent and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm_parent = "/dev/shm"
    _SESSION_DIRS["saved"] = {k: os.environ.get(k) for k in ("CLAIRVOYANT_SHM_DIR", "TMPDIR")}
    _SESSION_DIRS["before"] = project_entries(LEFTOVER_PLACES)
    _SESSION_DIRS["others"] = other_sessions(LEFTOVER_PLACES, ())
    _SESSION_DIRS["shm"] = _session_dir(shm_parent or tempfile.gettempdir())
    # pytest's own tmp_path folders stay where they were (their paths hold sockets, which allow
    # 107 bytes); the `tmp_path_retention_policy` in pyproject.toml removes those of passed tests.
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _SESSION_DIRS["tmp"] = _session_dir(tempfile.gettempdir())
    os.environ["CLAIRVOYANT_SHM_DIR"] = _SESSION_DIRS["shm"]
    os.environ["TMPDIR"] = _SESSION_DIRS["tmp"]
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_sessionfinish(session, exitstatus):
    if "tmp" not in _SESSION_DIRS:
        return
    for k, v in _SESSION_DIRS.pop("saved").items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    tempfile.tempdir = None
    dirs = [_SESSION_DIRS.pop("shm"), _SESSION_DIRS.pop("tmp")]
    if session.testsfailed:
        print(f"\nnote: kept the session's folders for a look at the failures: {' '.join(dirs)}")
        return
    for d in dirs:
        _remove_after_multiprocessing(d)
    left = sorted(project_entries(LEFTOVER_PLACES) - _SESSION_DIRS.pop("before"))
    if not left:
        return
    others = _SESSION_DIRS.pop("others") | other_sessions(LEFTOVER_PLACES, dirs)
    if others:
        print(f"\nnote: new in /tmp or /dev/shm, maybe from the test session running beside this one ({sorted(others)[0]}): {left}")
        return
    print(f"\nerror: the test session left these behind in /tmp or /dev/shm: {left}")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _remove_after_multiprocessing(d: str) -> None:
    """Remove ``d`` now, or, when this process's multiprocessing keeps its own temporary folder
    in it, right after multiprocessing removes that folder at exit (its finalizers run by falling
    priority; the folder's is -100), so neither trips over the other."""
    import multiprocessing.process
    import multiprocessing.util

    mine = multiprocessing.process.current_process()._config.get("tempdir")
    if mine and os.path.realpath(mine).startswith(os.path.realpath(d) + os.sep):
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(d,), kwargs={"ignore_errors": True}, exitpriority=-200)
    else:
        shutil.rmtree(d, ignore_errors=True)


def user_cache_dirs():
    dirs = [Path.home() / ".cache" / "clairvoyant"]
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(Path(os.environ["XDG_CACHE_HOME"]) / "clairvoyant")
    return dirs


def snapshot(dirs):
    """Every path below `dirs` with its mtime and size (absent directories: None)."""
    out = {}
    for d in dirs:
        if not d.exists():
            out[str(d)] = None
            continue
        out[str(d)] = d.stat().st_mtime_ns
        for p in sorted(d.rglob("*")):
            st = p.lstat()
            out[str(p)] = (st.st_mtime_ns, st.st_size)
    return out


def written_by(path: Path, marks) -> bool:
    """Whether `path` (an index names its dataset, which lies in this session's temporary
    directory) or, for a lock, the index beside it mentions one of `marks`."""
    if path.suffix == ".lock":
        path = path.with_suffix("")
    try:
        data = path.read_bytes()
    except OSError:
        return False
    return any(m in data for m in marks)


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    dirs = user_cache_dirs()
    before = snapshot(dirs)
    saved = os.environ.get(ENV)
    cache = tmp_path_factory.mktemp("clairvoyant-cache")
    os.environ[ENV] = str(cache)
    yield cache
    if saved is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = saved
    after = snapshot(dirs)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    # Other test runs of the same user (another checkout) may write there at the same time: a
    # change fails this session when it names this session's temporary directory.
    base = tmp_path_factory.getbasetemp()
    marks = {os.fsencode(str(base)), os.fsencode(os.path.realpath(base))}
    ours = [k for k in changed if written_by(Path(k), marks)]
    assert not ours, f"the test session wrote to the user's cache directory: {ours[:10]}"
    if changed:
        print(f"\nnote: {len(changed)} entries of {[str(d) for d in dirs]} changed during the session, none naming it")
