"""The benchmark and demo harness (benches/): run from the checkout, outside the package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import clairvoyant

ROOT = Path(__file__).resolve().parent.parent


def _help(module: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_benchmarks_run_from_the_checkout():
    out = _help("benches")
    assert out.startswith("usage: python -m benches"), out
    for name in ("training", "overhead", "formats", "cluster", "decode", "transparent", "scale", "epoch0"):
        assert name in out, name


def test_the_package_runs_the_checkouts_benchmarks_from_anywhere(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "clairvoyant.bench", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m clairvoyant.bench"), proc.stdout
    assert "epoch0" in proc.stdout


def test_the_package_without_a_checkout_says_where_the_benchmarks_are(monkeypatch, capsys):
    import clairvoyant.bench

    monkeypatch.setattr(clairvoyant.bench, "checkout", lambda: None)
    assert clairvoyant.bench.main(["--only", "epoch0"]) == 2
    assert "./dev bench" in capsys.readouterr().err


def test_the_demo_runs_from_the_checkout():
    assert _help("benches.demo").startswith("usage: python -m benches.demo")


def test_the_package_holds_no_harness():
    package = Path(clairvoyant.__file__).parent
    names = {p.name for p in package.rglob("*.py")}
    harness = {"bench.py", "demo.py", "_emulation.py", "_validate.py"} | {n for n in names if n.startswith("_bench")}
    assert not names & harness, sorted(names & harness)


def test_epoch0_cpu_is_set_against_each_epoch():
    from benches.epoch0 import cpu_between, per_epoch_cpu, phases

    # cumulative CPU seconds by kind, sampled at t = 0, 1, 2, 3
    samples = [(float(t), {"agent": a, "program": p, "launcher": 0.0}) for t, a, p in ((0, 0, 0), (1, 1, 2), (2, 1, 4), (3, 3, 4))]
    assert cpu_between(samples, "agent", 0.5, 2.5) == 1.5  # 0.5 of the first second, none, 1.0 of the last
    assert cpu_between(samples, "program", -1.0, 9.0) == 4.0  # outside the samples: their ends
    ranks = [
        {"epoch_bounds": [[0.0, 1.0], [1.0, 3.0]], "samples": [10, 10], "started": -2.0},
        {"epoch_bounds": [[0.0, 0.5], [1.5, 2.0]], "samples": [10, 10], "started": -1.0},
    ]
    cpu = per_epoch_cpu(samples, ranks)
    # epoch 0: agent 1 s over 20 samples; epoch 1 runs from the first rank's start to the last end
    assert cpu["agent_us_per_sample"] == [50_000.0, 100_000.0]
    assert cpu["program_us_per_sample"] == [100_000.0, 100_000.0]
    assert phases(ranks, spawned=-3.0, ended=4.0) == {"start": 2.0, "setup": 1.0, "epochs": 3.0, "end": 1.0, "job": 7.0}


def test_epoch0_sampler_tells_the_agent_from_the_program():
    """A launcher-like root whose two children burn CPU: the one named like the node agent
    counts as the agent, the other as the program, the root as the launcher."""
    from benches.epoch0 import CpuSampler

    burn = (
        "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()"
    )
    root = (
        "import subprocess, sys\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {burn!r}, *a], stdin=subprocess.PIPE, stdout=sys.stdout) for a in (['clairvoyant._agent'], [])]\n"
        "sys.stdin.read()\n"
        "for k in kids: k.stdin.close(); k.wait()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", root], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # The two children share one pipe: their lines may arrive interleaved ("donedone").
        said = ""
        while said.count("done") < 2:
            line = proc.stdout.readline()
            if not line:
                break
            said += line
        assert said.replace("\n", "") == "donedone", said
        sampler = CpuSampler([proc.pid], launchers=True)
        sampler.sample()
        kinds = sampler.samples[-1][1]
        assert sorted(sampler.kind.values()) == ["agent", "launcher", "program"]
        assert kinds["agent"] >= 0.2 and kinds["program"] >= 0.2, kinds
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def _fuse_rank_figures(data: float, epochs: int = 3) -> dict:
    """What one rank of the cluster benchmark on FUSE reports, with made-up figures."""
    sources = {"staging": 0, "memory": 60, "ssd": 0, "pfs": 0, "peer": 40}
    return {
        "epoch_seconds": [4.5] + [2.2] * (epochs - 1),
        "compute_seconds": [2.0] * epochs,
        "data_seconds": [data] * epochs,
        "barrier_seconds": [0.1] * epochs,
        "cpu_seconds": [1.0] * epochs,
        "setup_seconds": 0.3,
        "fs_bytes": [1000] + [0] * (epochs - 1),
        "reads_in_flight": [30.0] + [0.0] * (epochs - 1),
        "stats": [
            {
                "sources": {k: {"samples": v, "bytes": v} for k, v in sources.items()},
                "stall_seconds": 0.5,
                "peer_misses": 0,
                "peer_fallbacks": 1,
            }
        ]
        * epochs,
        "peer_stats": None,
    }


def test_the_cluster_benchmark_on_fuse_sums_its_ranks_and_reports_only_parts_that_ran(monkeypatch):
    """The FUSE part of the cluster benchmark: per epoch the slowest rank's figures and the sum of
    the samples by source; targets and tables only for the parts that ran."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benches import bench, cluster

    per_rank = [_fuse_rank_figures(0.2), _fuse_rank_figures(0.7)]
    s = cluster._fuse_summary(per_rank, total=1000)
    assert s["epoch_seconds"] == [4.5, 2.2, 2.2]
    assert s["data_seconds"] == [0.7, 0.7, 0.7]
    assert s["floor_over_epoch"][1] == 2.0 / 2.2
    assert s["fs_vs_dataset"] == [1.0, 0.0, 0.0]
    assert s["samples_by_source"][1] == {"staging": 0, "memory": 120, "ssd": 0, "pfs": 0, "peer": 80}
    assert s["peer_misses"] == [2, 2, 2] and s["cpu_seconds"] == [2.0, 2.0, 2.0]
    fuse = {
        "nodes": 4,
        "ranks": 8,
        "files": 10,
        "dataset_bytes": 1000,
        "node_memory_fraction": 0.3,
        "compute_mbps_per_rank": 50.0,
        "bound_seconds": 4.0,
        "runs": {"clairvoyant": [s], "pool": [{"epoch_seconds": [4.3]}], "floor": [{"epoch_seconds": [2.1, 2.1, 2.1]}], "baseline": []},
        "epoch0_vs_bound": 4.5 / 4.0,
        "epoch0_vs_pool": 4.5 / 4.3,
        "floor_over_epoch_ge1_min": 2.0 / 2.2,
        "floor_over_epoch_ge1_mean": 2.0 / 2.2,
        "loop_over_epoch_ge1_min": 2.1 / 2.2,
        "loop_over_epoch_ge1_mean": 2.1 / 2.2,
        "fs_vs_dataset": 1.0,
    }
    only_fuse = {"training": None, "peer_transport": None, "kill": None, "setup": None, "fuse": fuse}
    targets = {t["name"]: t for t in bench.evaluate(None, None, cluster=only_fuse)}
    assert set(targets) == {
        "cluster_fuse_epoch0_vs_bound",
        "cluster_fuse_epoch0_vs_pool",
        "cluster_fuse_floor_epochs_ge1",
        "cluster_fuse_fs_vs_dataset",
    }
    assert not targets["cluster_fuse_epoch0_vs_bound"]["met"] and targets["cluster_fuse_fs_vs_dataset"]["met"]
    text = cluster.markdown(only_fuse)
    assert "| 1 | 4.50, 2.20, 2.20 | 0.909, 0.909 | 2.10, 2.10, 2.10 |" in text, text
    assert "Peer transport" not in text and "Set-up" not in text
    assert cluster.bench_cluster(ROOT / "out", print, parts=()) == {
        "training": None,
        "peer_transport": None,
        "kill": None,
        "setup": None,
        "fuse": None,
    }
