"""System description: resolution, bad values naming their field, probe, launcher variables."""

import subprocess
import sys

import pytest

import clairvoyant
from clairvoyant import _env, config


def test_defaults_need_no_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CLAIRVOYANT_CONFIG", raising=False)
    model = config.resolve(None)
    assert model.path is None and model.staging_capacity > 0 and model.memory_class() is not None
    text = model.to_toml()
    assert "[staging]" in text and 'kind = "memory"' in text


def test_a_file_becomes_a_typed_model(tmp_path):
    cfg = tmp_path / "system.toml"
    cfg.write_text(
        'preprocess_mbps = 900\n[staging]\ncapacity = "64 MiB"\nthreads = 3\n'
        "[pfs]\nread_mbps = [[1, 200.0], [8, 1600.0]]\nopen_latency_ms = 2.5\n"
        '[[class]]\nname = "ram"\nkind = "memory"\ncapacity = "1 GiB"\nthreads = 2\nread_mbps = 5000\n'
        '[[class]]\nname = "ssd"\nkind = "directory"\npath = "scratch"\ncapacity = 0\n'
    )
    model = config.resolve(cfg)
    assert model.path == str(cfg)
    assert (model.staging_capacity, model.staging_threads) == (64 << 20, 3)
    assert model.pfs_read_mbps == [(1.0, 200.0), (8.0, 1600.0)] and model.pfs_open_latency_ms == 2.5
    assert (model.preprocess_mbps, model.compute_mbps, model.interconnect_mbps) == (900.0, None, None)
    ram, ssd = model.classes
    assert (ram.name, ram.kind, ram.path, ram.capacity, ram.threads) == ("ram", "memory", None, 1 << 30, 2)
    assert ram.read_mbps == [(1.0, 5000.0)] and model.memory_class().name == "ram"
    assert (ssd.kind, ssd.path, ssd.capacity) == ("directory", str(tmp_path / "scratch"), 0)
    # Written and read back: the same description.
    again = tmp_path / "again.toml"
    model.save(again)
    assert again.read_text() == model.to_toml()
    assert clairvoyant._native.SystemModel.load(again).to_toml() == model.to_toml()
    assert clairvoyant._native.SystemModel.detect().path is None


@pytest.mark.parametrize(
    "body,field",
    [
        ('[staging]\ncapacity = "lots"\n', "staging.capacity"),
        ("[staging]\nthreads = 0\n", "staging.threads"),
        ('[[class]]\nname = "ram"\nkind = "memory"\ncapacity = "1GiB"\nthreads = 2\nread_mbps = -5\nwrite_mbps = 100\n', "class.ram.read_mbps"),
        ("[pfs]\nbogus = 1\n", "pfs.bogus"),
    ],
)
def test_bad_config_value_names_the_field_and_file(tmp_path, body, field):
    cfg = tmp_path / "system.toml"
    cfg.write_text(body)
    with pytest.raises(clairvoyant.ConfigError) as e:
        clairvoyant.Job(clairvoyant.Synthetic([10] * 4), batch_size=1, epochs=1, config=cfg)
    assert field in str(e.value) and "system.toml" in str(e.value)


def test_missing_config_file_is_reported(tmp_path):
    with pytest.raises((FileNotFoundError, OSError, clairvoyant.ConfigError), match="nope.toml"):
        clairvoyant.Job(clairvoyant.Synthetic([10] * 4), batch_size=1, epochs=1, config=tmp_path / "nope.toml")


def test_env_override_applies(monkeypatch, tmp_path):
    monkeypatch.setenv("CLAIRVOYANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CLAIRVOYANT_MEMORY", "3MiB")
    model = config.resolve(None)
    assert model.memory_class().capacity == 3 << 20
    assert 'capacity = "3 MiB"' in model.to_toml()


def test_probe_writes_a_config_a_job_accepts(tmp_path):
    data = tmp_path / "data" / "cls"
    data.mkdir(parents=True)
    for i in range(20):
        (data / f"{i}.jpg").write_bytes(bytes([i]) * 4096)
    out = tmp_path / "probed.toml"
    r = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "probe", str(tmp_path / "data"), "-o", str(out), "--budget", "2", "--max-files", "20"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "[pfs]" in text and "read_mbps" in text
    with clairvoyant.Job(str(tmp_path / "data"), batch_size=2, epochs=1, config=out) as job:
        assert job.config_path == str(out)
        assert sum(1 for _ in job.epoch(0)) == 20


@pytest.mark.parametrize(
    "env,expect",
    [
        ({}, (0, 1, [0])),
        ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "r"}, (5, 8, [4, 5, 6, 7])),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "9"}, (3, 4, [2, 3])),
        # srun -N 2 -n 5 (no --ntasks-per-node): this node's count from the step's per-node counts.
        ({"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "3,2"}, (4, 5, [3, 4])),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2(x3)"}, (2, 6, [2, 3])),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, (2, 3, [2])),
    ],
)
def test_launcher_environment(env, expect):
    p = _env.detect(env=env)
    assert (p.rank, p.world_size, p.local_ranks) == expect
    if "TORCHELASTIC_RUN_ID" in env:
        assert p.run_id == "r"
    if "SLURM_JOB_ID" in env:
        assert p.run_id.startswith("slurm-9")


def test_bad_launcher_value_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        _env.detect(env={"RANK": "0", "WORLD_SIZE": "many"})
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "3", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    with pytest.raises(ValueError, match="SLURM_NODEID='3'"):
        _env.detect(env=slurm)
    with pytest.raises(ValueError, match="task count list"):
        _env.detect(env=dict(slurm, SLURM_NODEID="0", SLURM_STEP_TASKS_PER_NODE="two"))


# ---- the registry of environment variables ----

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_the_configuration_doc_holds_the_registrys_table():
    from clairvoyant import _settings

    doc = REPO / "docs" / "configuration.md"
    if not doc.is_file():
        pytest.skip(f"{doc} is not here (an installed package without its sources)")
    assert _settings.check(str(doc)) is None, "regenerate it: clairvoyant config --write-table docs/configuration.md"
    # The command line checks it the same way, and says what to do when it is stale.
    stale = REPO / "out" / "stale-configuration.md"
    stale.parent.mkdir(exist_ok=True)
    stale.write_text(doc.read_text().replace("| `CLAIRVOYANT_CONFIG` | path |", "| `CLAIRVOYANT_CONFIG` | text |"))
    try:
        r = subprocess.run([sys.executable, "-m", "clairvoyant.cli", "config", "--check-table", str(stale)], capture_output=True, text=True)
    finally:
        stale.unlink()
    assert r.returncode == 1 and "--write-table" in r.stderr


def test_every_variable_the_code_reads_is_in_the_registry():
    import re

    from clairvoyant import _settings

    known = set(_settings.registry())
    sources = [*(REPO / "python" / "clairvoyant").rglob("*.py"), *(REPO / "crates").glob("*/src/**/*.rs")]
    if not (REPO / "crates").is_dir():
        pytest.skip("the Rust sources are not here (an installed package)")
    unknown = {
        f"{name} ({path.relative_to(REPO)})"
        for path in sources
        for name in re.findall(r"CLAIRVOYANT_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace"))
        if name not in known
    }
    assert not unknown, "declare these in clairvoyant_core::sysinfo::env:\n" + "\n".join(sorted(unknown))


def test_values_are_read_by_their_type_and_a_wrong_one_names_the_variable():
    from clairvoyant import _settings

    get = _settings.get
    assert get("CLAIRVOYANT_MEMORY", env={"CLAIRVOYANT_MEMORY": "1.5 GiB"}) == 3 << 29
    assert get("CLAIRVOYANT_QUIET", env={"CLAIRVOYANT_QUIET": "Off"}) is False
    assert get("CLAIRVOYANT_QUIET", env={"CLAIRVOYANT_QUIET": "1"}) is True
    assert get("CLAIRVOYANT_RENDEZVOUS", env={"CLAIRVOYANT_RENDEZVOUS": "FILE"}) == "file"
    assert get("CLAIRVOYANT_EPOCHS", env={"CLAIRVOYANT_EPOCHS": " 7 "}) == 7
    assert get("CLAIRVOYANT_EPOCHS", None, env={"CLAIRVOYANT_EPOCHS": "  "}) is None
    # Unset: the registry's own default where it is a value (one default for every reader).
    assert get("CLAIRVOYANT_RENDEZVOUS_TIMEOUT", env={}) == 120.0
    assert get("CLAIRVOYANT_AGENT_TIMEOUT_MS", env={}) == 10000.0
    for name, value, expected in [
        ("CLAIRVOYANT_MEMORY", "lots", "not a size"),
        ("CLAIRVOYANT_QUIET", "perhaps", "1/true/yes/on"),
        ("CLAIRVOYANT_RENDEZVOUS", "carrier-pigeon", "store, mpi, file"),
        ("CLAIRVOYANT_EPOCHS", "three", "a whole number"),
        ("CLAIRVOYANT_RENDEZVOUS_TIMEOUT", "-1", "seconds"),
        ("CLAIRVOYANT_RENDEZVOUS_TIMEOUT", "nan", "seconds"),
    ]:
        with pytest.raises(clairvoyant.ConfigError, match=name) as info:
            get(name, env={name: value})
        assert expected in str(info.value), (name, value, str(info.value))
    with pytest.raises(clairvoyant.ConfigError, match="CLAIRVOYANT_NO_SUCH_THING is not a clairvoyant setting"):
        get("CLAIRVOYANT_NO_SUCH_THING", env={})


def test_the_drop_in_reads_its_epochs_through_the_registry(monkeypatch):
    from clairvoyant.torch import _dropin

    monkeypatch.setenv("CLAIRVOYANT_EPOCHS", "many")
    with pytest.raises(clairvoyant.ConfigError, match="CLAIRVOYANT_EPOCHS='many'"):
        _dropin._epochs_arg(None)
    monkeypatch.setenv("CLAIRVOYANT_EPOCHS", "4")
    assert _dropin._epochs_arg(None) == 4


def test_the_package_reads_its_variables_only_through_the_registry():
    import re

    # Reads of os.environ / env mappings by name, not writes (a launcher sets them for its
    # children). The interpreter start-up hook stays on os.environ: it runs in every program
    # and must not load the native module to find out it has nothing to do.
    read = re.compile(r"""(?:environ|env)(?:\.get\(|\[)\s*["']CLAIRVOYANT_[A-Z0-9_]+["']\s*(?:\)|,|\](?!\s*=[^=]))""")
    root = REPO / "python" / "clairvoyant"
    allowed = {root / "_settings.py", root / "_hook" / "sitecustomize.py"}
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path not in allowed
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if read.search(line)
    ]
    assert not found, "read these through clairvoyant._settings.get:\n" + "\n".join(found)
