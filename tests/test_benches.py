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
