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
        assert [proc.stdout.readline().strip() for _ in range(2)] == ["done", "done"]
        sampler = CpuSampler([proc.pid], launchers=True)
        sampler.sample()
        kinds = sampler.samples[-1][1]
        assert sorted(sampler.kind.values()) == ["agent", "launcher", "program"]
        assert kinds["agent"] >= 0.2 and kinds["program"] >= 0.2, kinds
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
