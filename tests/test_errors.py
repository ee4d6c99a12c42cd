"""Exceptions: every one derives from ClairvoyantError and the matching built-in; I/O errors come
by kind with errno and filename; no argument reaches a panic."""

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clairvoyant
from clairvoyant import _native, errors

BUILTIN = {
    "ConfigError": ValueError,
    "CapacityError": ValueError,
    "ArgumentTypeError": TypeError,
    "OutOfRangeError": IndexError,
    "DatasetChangedError": RuntimeError,
    "IndexMismatchError": RuntimeError,
    "CorruptError": RuntimeError,
    "ExhaustedError": RuntimeError,
    "EpochOutOfRangeError": IndexError,
    "EpochConsumedError": RuntimeError,
    "CancelledError": RuntimeError,
    "SimulationStalledError": RuntimeError,
    "ClairvoyantOSError": OSError,
    "NotFoundError": FileNotFoundError,
    "AccessDeniedError": PermissionError,
    "IsDirectoryError": IsADirectoryError,
    "NotDirectoryError": NotADirectoryError,
    "AlreadyExistsError": FileExistsError,
    "TimedOutError": TimeoutError,
    "ConnectionFailedError": ConnectionError,
}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_class_derives_from_clairvoyant_error_and_its_builtin(name):
    cls = getattr(clairvoyant, name)
    assert issubclass(cls, clairvoyant.ClairvoyantError) and issubclass(cls, BUILTIN[name])
    assert issubclass(cls, Exception)
    # The native module raises these very classes, and code may raise them through it.
    assert getattr(_native, name) is cls


def test_every_public_exception_is_listed():
    public = {n for n in errors.__all__ if n.endswith("Error")} - {"ClairvoyantError"}
    assert public == set(BUILTIN)


@pytest.mark.parametrize(
    "code, cls",
    [
        (errno.ENOENT, clairvoyant.NotFoundError),
        (errno.EACCES, clairvoyant.AccessDeniedError),
        (errno.EPERM, clairvoyant.AccessDeniedError),
        (errno.EISDIR, clairvoyant.IsDirectoryError),
        (errno.ENOTDIR, clairvoyant.NotDirectoryError),
        (errno.EEXIST, clairvoyant.AlreadyExistsError),
        (errno.ETIMEDOUT, clairvoyant.TimedOutError),
        (errno.ENOSPC, clairvoyant.ClairvoyantOSError),
        (None, clairvoyant.ClairvoyantOSError),
    ],
)
def test_os_errors_by_errno(code, cls):
    e = errors.os_error(code, "reading /x failed", "/x")
    assert type(e) is cls and e.errno == code and e.filename == "/x"
    # The message names the file already; OSError's "[Errno n] ...: '/x'" is not added.
    assert str(e) == "reading /x failed"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path / "cache"))


def test_missing_dataset_is_not_found_with_errno_and_filename(tmp_path, cache_dir):
    missing = tmp_path / "missing"
    for make in (lambda: clairvoyant.ImageFolder(missing), lambda: clairvoyant.Job(str(missing), batch_size=1, epochs=1)):
        with pytest.raises(clairvoyant.NotFoundError) as info:
            make()
        assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, clairvoyant.ClairvoyantError)
        assert info.value.errno == errno.ENOENT and info.value.filename == str(missing)
        assert str(missing) in str(info.value)


def test_a_directory_listed_as_a_sample_is_a_directory_error(tmp_path, cache_dir):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"abc")
    src = clairvoyant.FileList([tmp_path / "f", tmp_path / "d"], [0, 1])
    with clairvoyant.Job(src, batch_size=1, epochs=1, order=[[0, 1]]) as job:
        it = job.epoch(0)
        assert bytes(next(it)[0]) == b"abc"
        with pytest.raises(clairvoyant.IsDirectoryError) as info:
            next(it)
    assert info.value.errno == errno.EISDIR and info.value.filename == str(tmp_path / "d")


def test_a_path_through_a_file_is_a_not_directory_error(tmp_path, cache_dir):
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(clairvoyant.NotDirectoryError) as info:
        clairvoyant.FileList([tmp_path / "f" / "x.jpg"], [0])
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(tmp_path / "f" / "x.jpg")


def test_unreadable_sample_is_a_permission_error():
    if os.geteuid() != 0:
        pytest.skip("needs root to run the reader as another user (setpriv --reuid=nobody)")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is not installed")
    # pytest's tmp_path lies below a 0700 directory of root; user nobody needs a way in.
    base = Path(tempfile.mkdtemp(prefix="cv-perm-"))
    try:
        base.chmod(0o755)
        secret = base / "secret.bin"
        secret.write_bytes(b"x" * 10)
        secret.chmod(0o600)
        (base / "ix").mkdir()
        # nobody's own index folder: a folder others may write would be refused.
        import pwd

        nobody = pwd.getpwnam("nobody")
        os.chown(base / "ix", nobody.pw_uid, nobody.pw_gid)
        script = (
            "import clairvoyant\n"
            f"src = clairvoyant.FileList([{str(secret)!r}], [0], index_dir={str(base / 'ix')!r})\n"
            "job = clairvoyant.Job(src, batch_size=1, epochs=1)\n"
            "try:\n"
            "    next(job.epoch(0))\n"
            "except clairvoyant.AccessDeniedError as e:\n"
            "    assert isinstance(e, PermissionError) and e.filename.endswith('secret.bin'), e\n"
            "    print('denied', e.errno)\n"
        )
        r = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c", script],
            capture_output=True, text=True, timeout=60, cwd=base,
            env={**os.environ, "HOME": str(base), "CLAIRVOYANT_CACHE_DIR": str(base / "ix")},
        )
        if "ModuleNotFoundError" in r.stderr or "ImportError" in r.stderr:
            pytest.skip(f"user nobody cannot import this checkout: {r.stderr.strip().splitlines()[-1]}")
        assert r.returncode == 0 and f"denied {errno.EACCES}" in r.stdout, r.stdout + r.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_epoch_errors_are_typed(tmp_path):
    src = clairvoyant.Synthetic([10] * 8)
    with clairvoyant.Job(src, batch_size=2, epochs=2) as job:
        with pytest.raises(clairvoyant.EpochOutOfRangeError, match="past the job's last epoch"):
            next(job.epoch(5))
        list(job.epoch(0))
        with pytest.raises(clairvoyant.EpochConsumedError, match="already consumed"):
            next(job.epoch(0))
    with clairvoyant.Job(src, batch_size=2, epochs=3, start_epoch=1) as job:
        with pytest.raises(clairvoyant.EpochOutOfRangeError, match="start epoch") as info:
            next(job.epoch(0))
        assert isinstance(info.value, IndexError) and isinstance(info.value, clairvoyant.ExhaustedError)


def test_index_of_another_dataset_is_an_index_mismatch(tmp_path, cache_dir):
    for name in ("a", "b"):
        (tmp_path / name / "cls").mkdir(parents=True)
        (tmp_path / name / "cls" / "1.jpg").write_bytes(b"1")
    ix = tmp_path / "one.cvidx"
    clairvoyant.ImageFolder(tmp_path / "a", index_path=ix)
    with pytest.raises(clairvoyant.IndexMismatchError, match="another dataset"):
        clairvoyant.ImageFolder(tmp_path / "b", index_path=ix)


def test_wrong_source_type_and_missing_labels(tmp_path):
    with pytest.raises(clairvoyant.ArgumentTypeError, match="'source'"):
        clairvoyant.Job(42, batch_size=1, epochs=1)
    with pytest.raises(clairvoyant.ConfigError, match="'labels'"):
        clairvoyant.FileList([tmp_path / "x"])
    with pytest.raises(clairvoyant.NotFoundError):
        clairvoyant.Job(str(tmp_path / "nothing-here"), batch_size=1, epochs=1)


@settings(max_examples=200, deadline=None)
@given(sample=st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=3), st.none()))
def test_source_accessors_raise_only_clairvoyant_errors(sample):
    src = clairvoyant.Synthetic([3, 4, 5])
    for method in (src._native.size, src._native.label, src._native.path):
        try:
            method(sample)
        except clairvoyant.ClairvoyantError as e:
            assert isinstance(e, (IndexError, TypeError)), e
            assert "'sample'" in str(e)
        else:
            assert isinstance(sample, int) and 0 <= sample < 3


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(), st.text(max_size=2)), max_size=4),
    labels=st.one_of(st.none(), st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=4)),
)
def test_synthetic_arguments_raise_only_clairvoyant_errors(sizes, labels):
    try:
        src = clairvoyant.Synthetic(sizes, labels)
    except clairvoyant.ClairvoyantError as e:
        assert "'sizes'" in str(e) or "'labels'" in str(e), e
    else:
        assert len(src) == len(sizes) and all(isinstance(s, int) and 0 <= s < 2**64 for s in sizes)


@pytest.mark.parametrize(
    "latency, bandwidth, name",
    [(-1, 100, "open_latency_ms"), (float("nan"), 100, "open_latency_ms"), (1, 0, "bandwidth_mbps"),
     ("x", 100, "open_latency_ms"), (1, 10**400, "bandwidth_mbps")],
)
def test_emulated_fs_arguments_name_the_argument(tmp_path, latency, bandwidth, name):
    with pytest.raises(clairvoyant.ClairvoyantError, match=f"'{name}'"):
        clairvoyant.EmulatedFs(tmp_path / "state", latency, bandwidth)


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda d: clairvoyant.ImageFolder(3.5), "root"),
        (lambda d: clairvoyant.ImageFolder(d, index_dir=object()), "index_dir"),
        (lambda d: clairvoyant.FileList([d / "a", 7], [0, 1]), "paths"),
        (lambda d: clairvoyant.FileList(5, [0]), "paths"),
        (lambda d: clairvoyant.FileList([d / "a"], 3), "labels"),
        (lambda d: clairvoyant.FileList([d / "a"], ["x"]), "labels"),
        (lambda d: clairvoyant.FileList(d / "list.txt", [0]), "labels"),
        (lambda d: clairvoyant.EmulatedFs(None), "state_path"),
    ],
)
def test_source_arguments_of_the_wrong_kind_name_the_argument(tmp_path, make, name):
    (tmp_path / "a").write_bytes(b"x")
    (tmp_path / "list.txt").write_text("a 0\n")
    with pytest.raises(clairvoyant.ClairvoyantError, match=f"'{name}'") as info:
        make(tmp_path)
    assert isinstance(info.value, (TypeError, ValueError))


# Exceptions of Python's own protocols, raised as the protocol demands: iteration's end, a missing
# attribute, an optional dependency not installed, a command line's exit.
PROTOCOL = {"StopIteration", "AttributeError", "ImportError", "SystemExit"}


def _builtin_raises(path: Path):
    import ast
    import builtins

    src = path.read_text()
    lines = src.splitlines()
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if not isinstance(target, ast.Name) or target.id in PROTOCOL:
            continue
        found = getattr(builtins, target.id, None)
        if isinstance(found, type) and issubclass(found, BaseException):
            line = lines[node.lineno - 1]
            # The drop-in raises what torch's DataLoader raises, where a program catches that.
            if "# as torch's DataLoader" not in line:
                yield f"{path}:{node.lineno}: {line.strip()}"


def test_the_package_raises_only_its_own_exceptions():
    root = Path(clairvoyant.__file__).parent
    found = [hit for f in sorted(root.rglob("*.py")) for hit in _builtin_raises(f)]
    assert not found, "raise a ClairvoyantError subclass (clairvoyant.errors) instead of a built-in:\n" + "\n".join(found)


def test_the_bindings_raise_only_the_packages_exceptions():
    # pyo3's built-in exception classes only in errors.rs, which maps every error to
    # clairvoyant.errors; elsewhere they may be matched, never raised.
    src = Path(__file__).resolve().parents[1] / "crates" / "clairvoyant-py" / "src"
    if not src.is_dir():
        pytest.skip(f"{src} is not here (an installed package without its sources)")
    found = [
        f"{f.name}:{n}: {line.strip()}"
        for f in sorted(src.glob("*.rs"))
        if f.name != "errors.rs"
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if "exceptions::Py" in line and "new_err" in line
    ]
    assert not found, "raise through crate::errors instead:\n" + "\n".join(found)


def test_a_rank_outside_the_world_is_a_config_error(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    with pytest.raises(clairvoyant.ConfigError, match="rank"):
        clairvoyant.Job(str(tmp_path), 1, epochs=1, rank=5, world_size=2)


def _engine(cluster=None, agent=None):
    src = _native.synthetic_source([10] * 8)
    return _native.Engine(src, 2, 1, 0, False, 0, 2, [0], "dict-args", None, None, 0, cluster, agent)


TWO_NODES = {"nodes": [[0], [1]], "node": 0, "capacities": [[1 << 20], [1 << 20]]}


@pytest.mark.parametrize(
    "cluster, agent, cls, match",
    [
        ({"node": 0, "capacities": [[1], [1]]}, None, clairvoyant.ConfigError, r"cluster\['nodes'\] is required"),
        ({**TWO_NODES, "node": "zero"}, None, clairvoyant.ArgumentTypeError, r"cluster\['node'\]"),
        ([1, 2], None, clairvoyant.ArgumentTypeError, r"'cluster': expected a dict, not list"),
        ({**TWO_NODES, "peer_wait": float("inf")}, None, clairvoyant.ConfigError, r"'cluster.peer_wait'"),
        (
            {**TWO_NODES, "peers": ["127.0.0.1:1"], "secret": b"s" * 32, "job": 1},
            None,
            clairvoyant.ConfigError,
            r"'cluster.peers': 1 peer addresses for 2 nodes",
        ),
        ({**TWO_NODES, "peers": ["127.0.0.1:1"] * 2, "job": 1}, None, clairvoyant.ConfigError, r"cluster\['secret'\] is required"),
        (
            {**TWO_NODES, "peers": ["127.0.0.1:1", "host"], "secret": b"s" * 32, "job": 1},
            None,
            clairvoyant.ConfigError,
            r"'cluster.peers\[1\]'",
        ),
        ({**TWO_NODES, "peers": ["127.0.0.1:1"] * 2, "secret": b"s", "job": 1}, None, clairvoyant.ConfigError, r"'cluster.secret'"),
        (None, {"counts": [([1] * 8, [0] * 7)]}, clairvoyant.ConfigError, r"'agent.counts': expected 1 pair\(s\) of 8"),
        (None, {"prefill": "yes"}, clairvoyant.ArgumentTypeError, r"agent\['prefill'\]"),
        (None, "hashed", clairvoyant.ArgumentTypeError, r"'agent': expected a dict, not str"),
    ],
)
def test_engine_dict_arguments_name_the_bad_field(cluster, agent, cls, match):
    with pytest.raises(cls, match=match):
        _engine(cluster, agent)


def test_peer_server_arguments_name_the_bad_field():
    with pytest.raises(clairvoyant.ConfigError, match="bind"):
        _native.PeerServer("localhost:0", b"s" * 32, 1)
    with pytest.raises(clairvoyant.ConfigError, match="io_timeout"):
        _native.PeerServer("127.0.0.1:0", b"s" * 32, 1, io_timeout=float("nan"))
    with pytest.raises(clairvoyant.ConfigError, match="at least 16"):
        _native.PeerServer("127.0.0.1:0", b"s", 1)


def test_an_unreachable_agent_is_a_connection_error_of_ours(tmp_path):
    missing = tmp_path / "agent.sock"
    with pytest.raises(clairvoyant.ConnectionFailedError) as info:
        _native.AgentClient(str(missing), timeout=0.5)
    assert isinstance(info.value, ConnectionError)
    assert info.value.errno == errno.ENOENT
    assert str(missing) in str(info.value)


def test_a_size_that_is_not_one_names_itself():
    from clairvoyant._units import parse_size

    with pytest.raises(clairvoyant.ConfigError, match='"12 parsecs" is not a size'):
        parse_size("12 parsecs")


def test_the_native_stubs_name_everything_the_module_exports():
    import re

    stub = (Path(_native.__file__).parent / "_native.pyi").read_text()
    missing = [n for n in dir(_native) if not n.startswith("_") and not re.search(rf"^(def|class) {n}\b|^{n}: |\b{n} as {n}\b", stub, re.M)]
    assert not missing, f"add these to clairvoyant/_native.pyi: {missing}"


def test_the_simulator_stubs_take_the_native_parameters():
    import ast
    import inspect

    stub = ast.parse((Path(_native.__file__).parent / "_native.pyi").read_text())
    defs = {n.name: n for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}

    def params(fn: ast.FunctionDef) -> list:
        return [a.arg for a in fn.args.args if a.arg != "self"]

    for name in ("sim_presets", "sim_policies", "sim_scenario_toml", "sim_value"):
        assert params(defs[name]) == list(inspect.signature(getattr(_native, name)).parameters), name
    methods = {n.name: n for n in defs["Simulation"].body if isinstance(n, ast.FunctionDef)}
    assert params(methods["__init__"]) == list(inspect.signature(_native.Simulation).parameters)
    for name in ("progress", "finished", "cancel", "result"):
        native = [p for p in inspect.signature(getattr(_native.Simulation, name)).parameters if p != "self"]
        assert params(methods[name]) == native, name
