"""Plots of simulator results from hand-written result documents."""

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib")

from clairvoyant.plots import plot_policies, plot_sweep  # noqa: E402

RESULT = {
    "scenario": "test",
    "workers": 4,
    "epochs": 3,
    "policies": {
        "perfect": {"total_seconds": 100.0, "relative_to_perfect": 1.0, "seconds_by_location": {"staging": 100.0}, "full_randomization": True, "error": None},
        "naive": {"total_seconds": 170.0, "relative_to_perfect": 1.7, "seconds_by_location": {"pfs": 170.0}, "full_randomization": True, "error": None},
        "sharded": {"total_seconds": 110.0, "relative_to_perfect": 1.1, "seconds_by_location": {"nvme-0": 60.0, "ram": 50.0}, "full_randomization": False, "error": None},
        "lbann-preloading": {"total_seconds": None, "relative_to_perfect": None, "seconds_by_location": {}, "full_randomization": True, "error": "too big"},
    },
}

SWEEP = {
    "scenario": "test",
    "policy": "clairvoyant",
    "sweep": [{"key": "ram", "values": [32, 64], "unit": "GB"}, {"key": "ssd", "values": [128, 256, 512], "unit": "GB"}],
    "total_seconds": [[9000.0, 8000.0, None], [7000.0, 6500.0, 6400.0]],
    "errors": [[None, None, "x"], [None, None, None]],
    "perfect_seconds": 3800.0,
}


def test_policies_png_and_svg(tmp_path):
    png = plot_policies(RESULT, tmp_path / "sub" / "bars.png")
    data = png.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 10_000
    svg = plot_policies(RESULT, tmp_path / "bars.svg")
    text = svg.read_text()
    assert "<svg" in text


def test_sweep_two_keys_one_key_and_missing_cells(tmp_path):
    assert plot_sweep(SWEEP, tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    one = dict(SWEEP, sweep=SWEEP["sweep"][:1], total_seconds=[[9000.0], [None]])
    assert plot_sweep(one, tmp_path / "one.png").stat().st_size > 5_000


def test_bad_documents_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="policies"):
        plot_policies({"scenario": "x"}, tmp_path / "a.png")
    with pytest.raises(ValueError, match="sweep"):
        plot_sweep({"total_seconds": []}, tmp_path / "b.png")
    with pytest.raises(ValueError, match="at most 2"):
        plot_sweep(dict(SWEEP, sweep=SWEEP["sweep"] * 2), tmp_path / "c.png")
