"""The clairvoyant command line."""

import io
import json
import os
import subprocess
import sys
import time

import pytest

import clairvoyant
from clairvoyant import _report, cli


def run(*args):
    return subprocess.run([sys.executable, "-m", "clairvoyant", *args], capture_output=True, text=True, timeout=120)


def test_plan_json_histogram_and_placement():
    r = run("plan", "--samples", "10000", "--world-size", "4", "--epochs", "8", "--batch-size", "16", "--seed", "1",
            "--sample-bytes", "1000", "--memory", "2MB", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    hist = {int(k): v for k, v in rep["frequency_histogram"].items()}
    assert sum(hist.values()) == 10000
    assert sum(k * v for k, v in hist.items()) == 8 * 10000 // 4
    # The analytic Binomial(8, 1/4) expectation sits next to the measured one.
    assert abs(rep["expected_histogram"]["2"] - hist[2]) < 0.05 * 10000
    mem = rep["placement"][0]
    assert mem["class"] == "memory" and mem["samples"] == 2000 and mem["bytes"] == 2_000_000
    assert rep["uncached"]["samples"] == 8000


def test_plan_rank_and_text_output():
    r = run("plan", "--samples", "1000", "--world-size", "2", "--epochs", "3", "--batch-size", "10", "--rank", "1")
    assert r.returncode == 0, r.stderr
    assert "plan for ranks [1] of 2" in r.stdout


def test_plan_bad_value_is_a_clear_error():
    r = run("plan", "--samples", "3", "--world-size", "4", "--epochs", "1", "--batch-size", "8")
    assert r.returncode == 1
    # The command line's spelling of the setting, not the library's.
    assert "--drop-last" in r.stderr and "drop_last" not in r.stderr, r.stderr
    r = run("plan", "--samples", "10", "--world-size", "1", "--epochs", "1", "--batch-size", "1", "--memory", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"clairvoyant {clairvoyant.__version__}"


@pytest.mark.parametrize("rank", ["2", "7"])
def test_plan_rank_outside_the_world_size_is_an_error_naming_rank(rank):
    r = run("plan", "--samples", "100", "--world-size", "2", "--epochs", "1", "--batch-size", "10", "--rank", rank)
    assert r.returncode == 2 and "--rank" in r.stderr and "--world-size 2" in r.stderr, r.stderr
    assert "plan for ranks" not in r.stdout


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--samples", "0"], "--samples"),
        (["--epochs", "0"], "--epochs"),
        (["--local-ranks", "0"], "--local-ranks"),
        (["--seed", "-1"], "--seed"),
        (["--rank", "-1"], "--rank"),
    ],
)
def test_plan_argument_errors_name_the_flag(args, flag):
    base = {"--samples": "100", "--world-size": "2", "--epochs": "1", "--batch-size": "10"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    r = run("plan", *[x for kv in base.items() for x in kv])
    assert r.returncode == 2 and f"argument {flag}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_messages_from_the_library_use_flag_spelling():
    msg = "invalid value for 'drop_last': 3 samples ...; set drop_last=True"
    assert cli.cli_message(msg, "plan") == "invalid value for --drop-last: 3 samples ...; set --drop-last"
    assert cli.cli_message("invalid value for 'budget_s': is 0", "probe") == "invalid value for --budget: is 0"


def test_simulate_plot_without_matplotlib_says_so_before_simulating():
    # 90 epochs on 16 workers simulate for tens of seconds; the error must come first.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from clairvoyant.cli import main\n"
        "sys.exit(main(['simulate', '--epochs', '90', '--workers', '16', '--plot', 'out.png']))\n"
    )
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--plot needs matplotlib" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 15
    assert "simulating" not in r.stderr


def test_simulate_plot_with_an_unknown_extension_fails_before_simulating(tmp_path):
    pytest.importorskip("matplotlib")
    r = run("simulate", "--epochs", "90", "--workers", "16", "--plot", str(tmp_path / "chart.txt"))
    assert r.returncode == 2 and ".png, .svg or .pdf" in r.stderr, r.stderr


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_without_tqdm_prints_lines_every_2_s_or_10_percent(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    out = io.StringIO()
    p = _report.Progress("simulating", "samples", stream=out, bar=True)
    clock = FakeClock()
    p._clock, p.start, p._last_t = clock, 0.0, 0.0
    for done in range(0, 1001, 10):  # 1% every 0.1 s: a line each 2 s (20%) or 10%
        clock.t = done / 100
        p.update(done, 1000)
    p.close()
    lines = out.getvalue().splitlines()
    assert 10 <= len(lines) <= 12, lines
    assert lines[0].startswith("simulating: 100 of 1,000 samples (10%)")
    assert lines[-2].startswith("simulating: 1,000 of 1,000 samples (100%)")
    assert lines[-1] == "simulating: done in 10.0 s"


def test_progress_is_shown_when_output_is_piped():
    r = run("simulate", "--epochs", "2", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "simulating: done in" in r.stderr, r.stderr
    r = run("simulate", "--epochs", "2", "--workers", "2", "--no-progress")
    assert r.returncode == 0 and "simulating" not in r.stderr


def test_probe_warns_about_page_cached_and_tiny_files_and_says_how_to_use_the_file(tmp_path):
    data = tmp_path / "data" / "c"
    data.mkdir(parents=True)
    for i in range(20):
        (data / f"{i}.jpg").write_bytes(os.urandom(2000))  # just written: in the page cache
    out = tmp_path / "system.toml"
    r = run("probe", str(tmp_path / "data"), "--budget", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "tiny" in r.stderr, r.stderr
    # Whether the timed opens look page-cached depends on the machine's load at that moment: the
    # command must print exactly the warnings its own figures call for.
    from clairvoyant._native import SystemModel

    cached = any("page cache" in w for w in cli.probe_warnings(SystemModel.load(str(out)), 2000))
    assert ("page cache" in r.stderr) == cached, r.stderr
    assert f"CLAIRVOYANT_CONFIG={out}" in r.stderr and f"config={str(out)!r}" in r.stderr
    assert "system.toml" in r.stderr and out.exists()
    assert "probe: probe:" not in r.stderr


def test_probe_warnings_only_when_the_figures_are_suspect(tmp_path):
    from clairvoyant._native import SystemModel

    def model(text):
        path = tmp_path / "system.toml"
        path.write_text(text)
        return SystemModel.load(path)

    slow = model("[pfs]\nread_mbps = [[1, 180.0], [8, 900.0]]\nopen_latency_ms = 0.8\n")
    assert cli.probe_warnings(slow, 110_000) == []
    cached = model("[pfs]\nread_mbps = [[1, 9000.0], [8, 30000.0]]\nopen_latency_ms = 0.8\n")
    assert any("page cache" in w for w in cli.probe_warnings(cached, 110_000))
    fast_open = model("[pfs]\nread_mbps = 180.0\nopen_latency_ms = 0.001\n")
    assert any("opens took 1.0 us" in w for w in cli.probe_warnings(fast_open, 110_000))
    assert any("page cache" in w for w in cli.probe_warnings(cached, 110_000))
    assert any("tiny" in w for w in cli.probe_warnings(slow, 4000))


def test_plan_across_nodes_reports_coverage_and_file_system_reads():
    # 4 nodes at 30 % of the dataset each (120 % in all): covered once, the rest replicated.
    r = run("plan", "--samples", "20000", "--world-size", "8", "--epochs", "4", "--batch-size", "16",
            "--nodes", "4", "--memory", "660000000", "--sample-bytes", "110000", "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["nodes"] == 4 and rep["coverage"] == 1.0
    assert rep["expected_fs_bytes"] == rep["dataset_bytes"] == 20000 * 110000
    # Node 0 fills the room left after coverage with replicas of its own most used samples.
    mine = rep["node"]
    assert mine["bytes"] == 660000000 and mine["replica_bytes"] == 660000000 - mine["primary_bytes"] > 0
    assert mine["replica_bytes"] == rep["per_node"][0]["replica_room_bytes"]
    # Caching alone, node 0 would read more than its share of the dataset from the file system.
    assert mine["expected_fs_bytes_alone"] > rep["dataset_bytes"] / 2
    assert sum(n["primary_samples"] for n in rep["per_node"]) == 20000
    # 12.5 % each: half the dataset cached; reads reach the minimum S + (E-1)(S-C).
    r = run("plan", "--samples", "20000", "--world-size", "8", "--epochs", "4", "--batch-size", "16",
            "--nodes", "4", "--memory", "275000000", "--sample-bytes", "110000", "--json")
    rep = json.loads(r.stdout)
    assert rep["coverage"] == 0.5
    assert rep["expected_fs_bytes"] == rep["minimum_fs_bytes"]
    text = run("plan", "--samples", "2000", "--world-size", "4", "--epochs", "2", "--batch-size", "8", "--nodes", "2", "--memory", "1MB")
    assert "coverage" in text.stdout and "node 1" in text.stdout


def test_plan_nodes_must_divide_the_world_size():
    r = run("plan", "--samples", "100", "--world-size", "6", "--epochs", "1", "--batch-size", "4", "--nodes", "4")
    assert r.returncode == 2 and "--nodes 4" in r.stderr


def test_a_plan_larger_than_the_machine_is_refused_before_it_starts():
    # 4 billion samples would need hundreds of GB (the counts alone 48 GB): refused with the
    # sizes, for one node and across nodes, instead of being killed for memory.
    for extra in ([], ["--nodes", "4"]):
        r = run("plan", "--samples", "4000000000", "--world-size", "8", "--epochs", "2", "--batch-size", "32", *extra)
        assert r.returncode != 0
        assert "the plan of 4000000000 samples" in r.stderr and "needs about" in r.stderr and "is available" in r.stderr, r.stderr


def _probe(code: str):
    """What ``code``, run in a fresh interpreter, prints as JSON."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_package_imports_its_heavy_parts_at_first_use():
    """`import clairvoyant` (what the launcher, the agent and the sampler hook pay) leaves the job,
    the sources and numpy unimported; their names and the submodules resolve at first use, and an
    unknown name is an AttributeError that names it."""
    probe = (
        "import sys, json, clairvoyant\n"
        "before = [m for m in ('numpy', 'clairvoyant.job', 'clairvoyant.sources') if m in sys.modules]\n"
        "job = clairvoyant.Job.__module__\n"
        "src = clairvoyant.sources.as_source.__module__\n"
        "try:\n"
        "    clairvoyant.no_such_name\n"
        "    missing = None\n"
        "except AttributeError as e:\n"
        "    missing = str(e)\n"
        "print(json.dumps([before, job, src, missing, 'Job' in dir(clairvoyant)]))\n"
    )
    before, job, src, missing, listed = _probe(probe)
    assert before == [], f"imported with the package: {before}"
    assert (job, src, listed) == ("clairvoyant.job", "clairvoyant.sources", True)
    assert missing is not None and "no_such_name" in missing


def test_the_launcher_starts_a_program_without_the_clusters_modules():
    """What `clairvoyant run` imports before it starts the program (the CLI, the launcher, the
    interposed library's module) leaves out typing, dataclasses (and inspect), pathlib, hashlib
    (OpenSSL), tempfile and the cluster's modules: 4 launchers starting at once on 2 cores paid
    them in every rank's start."""
    probe = (
        "import sys, json\n"
        "import clairvoyant.cli, clairvoyant._run, clairvoyant._preload\n"
        "heavy = ('typing', 'dataclasses', 'inspect', 'pathlib', 'hashlib', 'tempfile', 'clairvoyant._cluster', 'datetime', 'socket')\n"
        "print(json.dumps([m for m in heavy if m in sys.modules]))\n"
    )
    imported = _probe(probe)
    assert imported == [], f"imported before the program starts: {imported}"


def test_the_launchers_temporary_folder_is_tempfiles(tmp_path, monkeypatch):
    """The launcher names the temporary folder without importing tempfile: the same folder as
    tempfile.gettempdir() for a usable TMPDIR, a missing one, and none."""
    import tempfile

    from clairvoyant import _dirs

    for tmpdir in (str(tmp_path), str(tmp_path / "missing"), None):
        if tmpdir is None:
            monkeypatch.delenv("TMPDIR", raising=False)
        else:
            monkeypatch.setenv("TMPDIR", tmpdir)
        for k in ("TEMP", "TMP"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads the environment again
        assert _dirs.temp_dir() == tempfile.gettempdir(), tmpdir


def test_the_launchers_temporary_folder_in_a_removed_working_folder(tmp_path, monkeypatch):
    """A launcher started in a folder that was removed still finds the temporary folder (the
    current folder is only the last candidate, and is not resolved before it is needed)."""
    from clairvoyant import _dirs

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert _dirs.temp_dir() == str(tmp_path)
