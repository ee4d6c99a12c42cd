"""The clairvoyant command line."""

import json
import subprocess
import sys


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
    assert "drop_last" in r.stderr
    r = run("plan", "--samples", "10", "--world-size", "1", "--epochs", "1", "--batch-size", "1", "--memory", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
