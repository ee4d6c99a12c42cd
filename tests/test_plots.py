"""Plots of simulator results, drawn from hand-written result documents."""

import copy
import sys

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install 'clairvoyant[plots]')")

from clairvoyant.plots import plot_policies, plot_sweep  # noqa: E402

POLICIES = {
    "scenario": "imagenet-1k",
    "description": "ImageNet-1k, 4 workers on a Lassen-like cluster",
    "workers": 4,
    "epochs": 90,
    "policies": {
        "perfect": {"total_seconds": 10000.0, "relative_to_perfect": 1.0, "seconds_by_location": {"staging": 10000.0}, "full_randomization": True, "error": None},
        "naive": {"total_seconds": 17000.0, "relative_to_perfect": 1.7, "seconds_by_location": {"pfs": 17000.0}, "full_randomization": True, "error": None},
        "parallel-staging": {"total_seconds": 11000.0, "relative_to_perfect": 1.1, "seconds_by_location": {"nvme-burst-buffer": 6000.0, "ram": 5000.0}, "full_randomization": False, "error": None},
        "lbann-preloading": {"total_seconds": None, "relative_to_perfect": None, "seconds_by_location": {}, "full_randomization": True, "error": "dataset (1.5 TB) exceeds aggregate memory (480 GB)"},
        "clairvoyant": {"total_seconds": 10500.0, "relative_to_perfect": 1.05, "seconds_by_location": {"ram": 6000.0, "ssd": 3000.0, "pfs": 1000.0, "remote": 500.0}, "full_randomization": True, "error": None},
    },
}

SWEEP = {
    "scenario": "imagenet-22k",
    "policy": "clairvoyant",
    "sweep": [{"key": "ram", "values": [32, 64, 128], "unit": "GB"}, {"key": "ssd", "values": [128, 256, 512, 1024], "unit": "GB"}],
    "total_seconds": [[9000.0, 8000.0, 7000.0, None], [7000.0, 6500.0, 6400.0, 6000.0], [5000.0, 4800.0, 4500.0, 4000.0]],
    "errors": [[None, None, None, "ssd cannot hold the staging buffer"], [None] * 4, [None] * 4],
    "perfect_seconds": 3800.0,
}

SINGLE = {
    "scenario": "mnist",
    "policy": "clairvoyant",
    "sweep": [{"key": "ram", "values": [0.01, 1], "unit": "GB"}],
    "total_seconds": [[0.23, 0.148]],
    "errors": [[None, None]],
    "perfect_seconds": 0.148,
}


def assert_png(path, min_bytes=10_000):
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG"
    assert len(data) > min_bytes


def test_policies_png_in_a_new_directory(tmp_path):
    out = plot_policies(POLICIES, tmp_path / "figures" / "policies.png")
    assert out == tmp_path / "figures" / "policies.png"
    assert_png(out)


def test_policies_svg(tmp_path):
    text = plot_policies(POLICIES, str(tmp_path / "policies.svg")).read_text()
    assert text.lstrip().startswith(("<?xml", "<svg")) and "</svg>" in text


def test_policies_ten_bars_and_short_times(tmp_path):
    result = copy.deepcopy(POLICIES)
    for i in range(6):
        result["policies"][f"extra-policy-{i}"] = {"total_seconds": 50.0 + i, "relative_to_perfect": 1.0, "seconds_by_location": {f"class-{i}": 50.0 + i}, "full_randomization": True, "error": None}
    for p in result["policies"].values():
        if p["total_seconds"] is not None:
            p["seconds_by_location"] = {k: v / 200 for k, v in p["seconds_by_location"].items()}
            p["total_seconds"] /= 200
    assert_png(plot_policies(result, tmp_path / "ten.png"))


def test_policies_pdf(tmp_path):
    assert plot_policies(POLICIES, tmp_path / "policies.PDF").read_bytes()[:5] == b"%PDF-"


def test_sweep_png_with_a_missing_cell(tmp_path):
    assert_png(plot_sweep(SWEEP, tmp_path / "out" / "sweep.png"))


def test_sweep_svg(tmp_path):
    assert "</svg>" in plot_sweep(SWEEP, tmp_path / "sweep.svg").read_text()


def test_single_key_sweep(tmp_path):
    assert_png(plot_sweep(SINGLE, tmp_path / "row.png"), min_bytes=5_000)


def test_single_key_sweep_given_as_a_column(tmp_path):
    column = dict(SINGLE, total_seconds=[[0.23], [None]])
    assert_png(plot_sweep(column, tmp_path / "column.png"), min_bytes=5_000)


def test_sweep_without_any_result(tmp_path):
    empty = dict(SINGLE, total_seconds=[[None, None]], perfect_seconds=None)
    assert_png(plot_sweep(empty, tmp_path / "empty.png"), min_bytes=5_000)


@pytest.mark.parametrize(
    "result, message",
    [
        ({"scenario": "x"}, r"result\['policies'\] is missing"),
        ({"policies": {}}, r"result\['policies'\] must be a non-empty"),
        ({"policies": {"naive": {"seconds_by_location": {}}}}, r"result\['policies'\]\['naive'\]\['total_seconds'\] is missing"),
        ({"policies": {"naive": {"total_seconds": 5.0}}}, r"\['naive'\]\['seconds_by_location'\] is missing"),
        ({"policies": {"naive": {"total_seconds": "fast", "seconds_by_location": {}}}}, r"\['naive'\]\['total_seconds'\] must be a non-negative number"),
        ([], r"result must be a mapping"),
    ],
)
def test_policies_name_the_bad_field(tmp_path, result, message):
    with pytest.raises(ValueError, match=message):
        plot_policies(result, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sweep": None}, r"result\['sweep'\] must be a non-empty list"),
        ({"sweep": SWEEP["sweep"] + [{"key": "workers", "values": [4, 8]}]}, r"sweep has 3 keys; at most 2 can be drawn"),
        ({"sweep": [{"values": [1, 2]}]}, r"result\['sweep'\]\[0\]\['key'\] is missing"),
        ({"sweep": [SWEEP["sweep"][0], {"key": "ssd", "values": []}]}, r"result\['sweep'\]\[1\]\['values'\] must be a non-empty list"),
        ({"total_seconds": [[1.0, 2.0, 3.0, 4.0]]}, r"result\['total_seconds'\] should be 3 x 4"),
        ({"total_seconds": [[1.0, 2.0, 3.0, -4.0]] * 3}, r"result\['total_seconds'\]\[0\]\[3\] must be a non-negative number"),
    ],
)
def test_sweep_names_the_bad_field(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        plot_sweep(dict(SWEEP, **change), tmp_path / "bad.png")


def test_sweep_without_totals(tmp_path):
    result = {k: v for k, v in SWEEP.items() if k != "total_seconds"}
    with pytest.raises(ValueError, match=r"result\['total_seconds'\] is missing"):
        plot_sweep(result, tmp_path / "bad.png")


def test_unsupported_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.png, \.svg or \.pdf"):
        plot_policies(POLICIES, tmp_path / "policies.jpg")


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"plots need matplotlib: pip install 'clairvoyant\[plots\]'"):
        plot_sweep(SWEEP, tmp_path / "sweep.png")
