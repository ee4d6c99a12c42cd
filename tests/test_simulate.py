"""The simulator from Python and from the command line: result shape, overrides, sweeps,
errors, plots."""

import json
import subprocess
import sys
import threading

import pytest

import clairvoyant
from clairvoyant import _native, cli
from clairvoyant.simulator import presets, scenario_toml

POLICIES = [
    "perfect",
    "naive",
    "staging-buffer",
    "deepio-ordered",
    "deepio-opportunistic",
    "parallel-staging",
    "lbann-dynamic",
    "lbann-preloading",
    "locality-aware",
    "clairvoyant",
]


def test_presets_and_policies_are_the_documented_names():
    assert presets() == ["mnist", "imagenet-1k", "openimages", "imagenet-22k", "cosmoflow", "cosmoflow-512", "emulated-cluster"]
    assert clairvoyant.simulator.policies() == POLICIES


def test_simulate_returns_every_policy_with_the_documented_shape():
    r = clairvoyant.simulate("mnist", epochs=2, progress=False)
    assert list(r.policies) == POLICIES
    assert r.data["scenario"] == "mnist" and r.data["epochs"] == 2
    for name, p in r.data["policies"].items():
        assert set(p) >= {"total_seconds", "relative_to_perfect", "seconds_by_location", "full_randomization", "error"}
        assert p["error"] is None
        assert abs(sum(p["seconds_by_location"].values()) - p["total_seconds"]) < 1e-6 * p["total_seconds"]
        assert p["relative_to_perfect"] >= 1.0 - 1e-9, name
    assert r.policies["perfect"].relative_to_perfect == 1.0
    assert r.policies["naive"].relative_to_perfect > 1.2  # no prefetching stalls
    assert not r.policies["parallel-staging"].full_randomization
    text = r.table()
    assert "naive" in text and "vs perfect" in text
    assert json.loads(r.to_json())["policies"].keys() == r.data["policies"].keys()


def test_same_seed_same_result_and_the_seed_matters():
    a = clairvoyant.simulate("mnist", ["clairvoyant", "locality-aware"], epochs=2, seed=3, progress=False)
    b = clairvoyant.simulate("mnist", ["clairvoyant", "locality-aware"], epochs=2, seed=3, progress=False)
    c = clairvoyant.simulate("mnist", ["clairvoyant", "locality-aware"], epochs=2, seed=4, progress=False)
    assert a.data == b.data
    assert a.data["policies"]["locality-aware"] != c.data["policies"]["locality-aware"]


def test_lbann_reports_an_error_instead_of_a_time_beyond_aggregate_memory():
    r = clairvoyant.simulate("cosmoflow", ["lbann-dynamic"], epochs=1, progress=False)
    p = r.data["policies"]["lbann-dynamic"]
    assert p["total_seconds"] is None and p["relative_to_perfect"] is None
    assert "exceeds the aggregate memory" in p["error"]


def test_overrides_and_real_sizes():
    r = clairvoyant.simulate("mnist", ["staging-buffer"], workers=2, epochs=1, set={"system.compute_mbps": 1.0}, progress=False)
    assert r.data["workers"] == 2
    # c = 1 MB/s: the run is compute bound, 50,000 x 760 B / (2 x 1 MB/s) = 19 s.
    assert abs(r.data["policies"]["perfect"]["total_seconds"] - 19.0) < 0.1
    r = clairvoyant.simulate("mnist", ["perfect"], epochs=1, sizes=[1000] * 640, progress=False)
    assert r.data["samples"] == 640 and r.data["dataset_bytes"] == 640_000


def test_sweep_grid():
    s = clairvoyant.simulate("mnist", epochs=1, sweep={"ram": [0.01, 1], "ssd": [0, 1, 2]}, progress=False)
    assert isinstance(s, clairvoyant.SweepResult)
    d = s.data
    assert d["policy"] == "clairvoyant"
    assert [a["key"] for a in d["sweep"]] == ["ram", "ssd"] and d["sweep"][0]["unit"] == "GB"
    assert len(d["total_seconds"]) == 2 and all(len(row) == 3 for row in d["total_seconds"])
    assert d["perfect_seconds"] > 0
    assert "ram=0.01GB" in s.table()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"scenario": "nope"}, "scenario"),
        ({"scenario": "mnist", "policies": ["fastest"]}, "policy"),
        ({"scenario": "mnist", "workers": 0}, "workers"),
        ({"scenario": "mnist", "set": {"system.class.nvme.capacity": "1GB"}}, "nvme"),
        ({"scenario": "mnist", "set": {"dataset.mean": "huge"}}, "dataset.mean"),
        ({"scenario": "mnist", "sweep": {"ram": [1], "ssd": [1], "staging": [1]}}, "sweep"),
    ],
)
def test_bad_requests_name_the_field(kwargs, field):
    with pytest.raises(clairvoyant.ConfigError, match=field.replace(".", r"\.")):
        clairvoyant.simulate(progress=False, **kwargs)


def test_scenario_file_with_base(tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text('base = "mnist"\nworkers = 2\nepochs = 1\n[[system.class]]\nname = "ram"\ncapacity = "1GB"\n')
    r = clairvoyant.simulate(f, ["clairvoyant"], progress=False)
    assert r.data["scenario"] == "cluster" and r.data["workers"] == 2
    text = scenario_toml(f)
    assert 'name = "ram"' in text and "ssd" not in text
    f.write_text("workers = 2\n[dataset]\nsamples = 10\nmean = 5\n")
    with pytest.raises(clairvoyant.ConfigError, match=r"system\.compute_mbps.*cluster\.toml"):
        clairvoyant.simulate(f, progress=False)


def test_a_scenario_dict_is_the_scenario_file_it_would_be(tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text(
        'base = "mnist"\nname = "cluster"\nworkers = 2\nepochs = 1\n[dataset]\nsamples = 640\nmean = "1kB"\n[[system.class]]\nname = "ram"\ncapacity = "1MB"\n'
    )
    d = {
        "base": "mnist",
        "name": "cluster",
        "workers": 2,
        "epochs": 1,
        "dataset": {"samples": 640, "mean": "1kB"},
        "system": {"class": [{"name": "ram", "capacity": "1MB"}]},
    }
    from_file = clairvoyant.simulate(f, ["clairvoyant"], progress=False)
    from_dict = clairvoyant.simulate(d, ["clairvoyant"], progress=False)
    assert from_dict.data == from_file.data and from_dict.to_json() == from_file.to_json()
    assert scenario_toml(d) == scenario_toml(f)
    # Overrides are typed values: a string stays a string.
    with pytest.raises(clairvoyant.ConfigError, match=r"'epochs'.*string"):
        clairvoyant.simulate(d, set={"epochs": "3"}, progress=False)


@pytest.mark.parametrize(
    "scenario, field",
    [
        ({"base": "mnist", "workerz": 2}, "'workerz'.*unknown field"),
        ({"base": "mnist", "dataset": {"samples": "many"}}, "'dataset.samples'.*string"),
        ({"base": "mnist", "dataset": {"mean": None}}, "'dataset.mean'.*NoneType"),
        ({"base": "mnist", "system": {"pfs": {"read_mbps": [[1, object()]]}}}, r"'system.pfs.read_mbps\[0\]\[1\]'.*object"),
        ({"base": "mnist", "name": "mine", "epochs": 2**70}, "'epochs'.*64-bit.*"),
        ({"base": "mnist", "name": "mine", "epochs": 0}, r"'epochs'.*\(in scenario 'mine'\)"),
    ],
)
def test_a_bad_scenario_dict_names_the_field(scenario, field):
    with pytest.raises(clairvoyant.ConfigError, match=field):
        clairvoyant.simulate(scenario, progress=False)


def test_command_line_values_are_typed_as_toml_writes_them():
    assert _native.sim_value("3") == 3 and _native.sim_value("1.5") == 1.5 and _native.sim_value("true") is True
    assert _native.sim_value('"64GB"') == "64GB" and _native.sim_value("64GB") == "64GB"
    assert _native.sim_value("[[1, 330], [8, 2870.5]]") == [[1, 330], [8, 2870.5]]


def test_cancel_raises_cancelled():
    sim = _native.Simulation("imagenet-1k", ["staging-buffer"], [("workers", 16)], None, [])
    threading.Timer(0.3, sim.cancel).start()
    with pytest.raises(clairvoyant.CancelledError):
        sim.result()


def test_progress_reaches_the_total():
    sim = _native.Simulation("mnist", ["naive"], [("epochs", 2)], None, [])
    assert isinstance(sim.result(), dict)
    done, total = sim.progress()
    assert total > 0 and done == total


def test_cli_json_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "policies.png"
    rc = cli.main(["simulate", "--scenario", "mnist", "--epochs", "1", "--policy", "naive,clairvoyant", "--json", "--plot", str(png)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["policies"]) == ["perfect", "naive", "clairvoyant"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    heat = tmp_path / "sweep.svg"
    rc = cli.main(["simulate", "--scenario", "mnist", "--epochs", "1", "--sweep", "ram=0.01,1", "--plot", str(heat)])
    assert rc == 0
    assert "<svg" in heat.read_text()
    assert "ram=1GB" in capsys.readouterr().out


def test_cli_errors_and_show(capsys):
    assert cli.main(["simulate", "--scenario", "mnist", "--set", "epochs=x"]) == 1
    assert "epochs" in capsys.readouterr().err
    assert cli.main(["simulate", "--scenario", "mnist", "--show", "--set", "workers=8"]) == 0
    out = capsys.readouterr().out
    assert "workers = 8" in out and "[dataset]" in out


def test_command_line_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "clairvoyant", "simulate", "--scenario", "mnist", "--epochs", "1", "--policy", "naive"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "naive" in out.stdout


def _cluster_sizes(n=2000, seed=0):
    import random

    rng = random.Random(seed)
    return [max(1, int(rng.gauss(20_000, 5_000))) for _ in range(n)]


def _predict(sizes, nodes, per_node, **kw):
    from clairvoyant.simulator import predict_cluster

    args = dict(
        sizes=sizes,
        nodes=nodes,
        ranks_per_node=2,
        memory_per_node=per_node,
        epochs=4,
        batch_size=16,
        seed=0,
        fs_bandwidth=12e6,
        fs_latency=0.002,
        compute_per_batch=0.05,
        cores=2,
    )
    args.update(kw)
    return predict_cluster(**args)


def test_predict_cluster_reads_the_minimum_from_the_file_system():
    sizes = _cluster_sizes()
    s = sum(sizes)
    # 4 nodes x 30 %: the aggregate holds the dataset, the file system is read about once.
    r = _predict(sizes, 4, int(0.3 * s))
    assert len(r["epoch_seconds"]) == 4 and all(t > 0 for t in r["epoch_seconds"])
    assert s <= r["fs_bytes"] <= 1.05 * s, (r["fs_bytes"], s)
    # 4 nodes x 12.5 %: within 5 % of S + (E-1)(S-C).
    per = int(0.125 * s)
    r = _predict(sizes, 4, per)
    minimum = s + 3 * (s - 4 * per)
    assert abs(r["fs_bytes"] / minimum - 1) <= 0.05, (r["fs_bytes"], minimum)
    assert "nodes_per_machine = 4" in r["scenario"]


def test_predict_cluster_more_nodes_same_aggregate_read_no_more():
    sizes = _cluster_sizes()
    s = sum(sizes)
    two = _predict(sizes, 2, s // 4)["fs_bytes"]
    four = _predict(sizes, 4, s // 8)["fs_bytes"]
    assert four <= two * 1.005, (four, two)


def test_predict_cluster_contention_and_errors():
    sizes = _cluster_sizes(800)
    s = sum(sizes)
    fast = _predict(sizes, 2, s, preprocess_mbps=5.0, cores=64, compute_per_batch=0.001)
    slow = _predict(sizes, 2, s, preprocess_mbps=5.0, cores=1, compute_per_batch=0.001)
    assert sum(slow["epoch_seconds"]) > 1.5 * sum(fast["epoch_seconds"]), (slow["epoch_seconds"], fast["epoch_seconds"])
    with pytest.raises(ValueError, match="bytes per second"):
        _predict(sizes, 2, s, fs_bandwidth=12.0)
    with pytest.raises(ValueError, match="nodes"):
        _predict(sizes, 0, s)


def test_the_training_benchmark_validation_scenario_resolves():
    from benches import validate as _validate

    cfg = {
        "ranks": 2,
        "epochs": 3,
        "batch_size": 16,
        "seed": 5,
        "num_workers_per_rank": 2,
        "compute_bytes_per_second_per_rank": 3.3e6,
        "bandwidth_mbps": 12,
    }
    system = {"class": [], "staging": {"capacity": 100_000, "threads": 2, "write_mbps": 100000.0}}
    scenario = _validate._scenario("bench-pytorch", cfg, [1000] * 64, 27.5, system, 1, 2.0)
    text = scenario_toml(scenario)
    assert 'name = "bench-pytorch"' in text and "nodes_per_machine = 2" in text and "open_latency_ms = 2.0" in text
    r = clairvoyant.simulate(scenario, ["staging-buffer"], sizes=[1000] * 64, progress=False)
    assert len(r.policies["staging-buffer"].epoch_seconds) == 3


def test_numpy_numbers_are_values_too():
    np = pytest.importorskip("numpy")
    plain = clairvoyant.simulate("mnist", ["staging-buffer"], epochs=1, set={"workers": 2, "system.compute_mbps": 1.5}, progress=False)
    numpy = clairvoyant.simulate(
        "mnist", ["staging-buffer"], epochs=1, set={"workers": np.int64(2), "system.compute_mbps": np.float32(1.5)}, progress=False
    )
    assert numpy.data == plain.data
