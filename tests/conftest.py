"""Test-session setup: nothing a test does may land in the user's cache directory.

Indexes and the system description default to ``$CLAIRVOYANT_CACHE_DIR``, else
``$XDG_CACHE_HOME/clairvoyant``, else ``~/.cache/clairvoyant``. The session points
``CLAIRVOYANT_CACHE_DIR`` at a temporary directory before any test runs (subprocesses inherit
it) and fails if by the end the user's cache directory holds an index of a dataset the session
made.
"""

import os
from pathlib import Path

import pytest

ENV = "CLAIRVOYANT_CACHE_DIR"


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
