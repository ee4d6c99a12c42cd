"""The I/O performance simulator: how long a whole training run takes under each data-loading
policy, and where the time goes.

    result = clairvoyant.simulate("imagenet-1k", workers=16)
    print(result.table())
    result.plot("policies.png")

    sweep = clairvoyant.simulate("imagenet-22k", sweep={"ram": [32, 64, 128], "ssd": [128, 256]})
    sweep.plot("what-if.png")

Scenarios are presets (:func:`presets`), TOML files (see docs/simulator.md) or dicts holding
what such a file holds; the simulation itself runs in the native core on all cores, and its
result comes back as dicts and lists.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from . import _native
from .errors import ConfigError

PathLike = Union[str, Path]
ScenarioLike = Union[str, Path, Mapping[str, Any]]


def presets() -> list:
    """Names of the preset scenarios (the NoPFS paper's Section 6.1, then the emulated cluster of the
    distributed benchmark)."""
    return list(_native.sim_presets())


def policies() -> list:
    """Names of the simulated policies, in report order."""
    return list(_native.sim_policies())


def scenario_toml(scenario: ScenarioLike = "imagenet-1k", set: Optional[Mapping[str, Any]] = None) -> str:
    """The scenario (a preset, a TOML file or a dict, with overrides) as TOML text."""
    return _native.sim_scenario_toml(_scenario(scenario), _sets(set))


@dataclass(frozen=True)
class PolicyResult:
    """How one policy did. Times in seconds; ``total_seconds`` is None when it cannot run."""

    name: str
    total_seconds: Optional[float]
    relative_to_perfect: Optional[float]
    seconds_by_location: dict
    full_randomization: bool
    error: Optional[str]
    stall_seconds: float = 0.0
    preload_seconds: float = 0.0
    epoch_seconds: list = field(default_factory=list)
    pfs_bytes: int = 0
    pfs_reads_vs_dataset: float = 0.0


@dataclass(frozen=True)
class SimulationResult:
    """A policy comparison on one scenario; ``data`` is the JSON document of
    ``clairvoyant simulate --json``."""

    data: dict

    @property
    def scenario(self) -> str:
        return self.data["scenario"]

    @property
    def policies(self) -> dict:
        """Policy name -> :class:`PolicyResult`, Perfect first."""
        out = {}
        for name, p in self.data["policies"].items():
            known = {k: p[k] for k in PolicyResult.__dataclass_fields__ if k in p}
            out[name] = PolicyResult(name=name, **known)
        return out

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.data, indent=indent)

    def table(self) -> str:
        """A text table: total time per policy, relative to Perfect, and the share of time per
        fetch location."""
        d = self.data
        unit, scale = _unit([p["total_seconds"] for p in d["policies"].values()])
        lines = [
            f"{d['scenario']}: {d.get('description') or ''}".rstrip(": "),
            f"{d['samples']:,} samples, {d['dataset_bytes'] / 1e9:,.1f} GB; {d['workers']} workers, "
            f"{d['epochs']} epochs, batch {d['batch_size']}, seed {d['seed']}",
            "",
            f"{'policy':<22} {'time (' + unit + ')':>12} {'vs perfect':>10}  {'full dataset':>12}  where the time goes",
        ]
        for name, p in d["policies"].items():
            if p["total_seconds"] is None:
                lines.append(f"{name:<22} {'-':>12} {'-':>10}  {'':>12}  cannot run: {p['error']}")
                continue
            total = p["total_seconds"]
            shares = ", ".join(f"{loc} {s / total:.0%}" for loc, s in p["seconds_by_location"].items() if total > 0)
            rand = "yes" if p["full_randomization"] else "no"
            lines.append(f"{name:<22} {total / scale:>12,.2f} {p['relative_to_perfect']:>9.2f}x  {rand:>12}  {shares}")
        return "\n".join(lines)

    def plot(self, path: PathLike) -> Path:
        """A stacked-bar chart (time per policy, split by fetch location)."""
        from .plots import plot_policies

        return plot_policies(self.data, path)


@dataclass(frozen=True)
class SweepResult:
    """A what-if grid for one policy; ``data`` is the JSON document of
    ``clairvoyant simulate --sweep ... --json``."""

    data: dict

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.data, indent=indent)

    def table(self) -> str:
        d = self.data
        axes = d["sweep"]
        totals = d["total_seconds"]
        unit, scale = _unit([v for row in totals for v in row])
        head = axes[0]

        def label(a, v):
            return f"{a['key']}={v:g}{a.get('unit') or ''}" if isinstance(v, (int, float)) else f"{a['key']}={v}"

        lines = [f"{d['policy']} on {d['scenario']}: total time ({unit})"]
        if d.get("perfect_seconds") is not None:
            lines[0] += f"; lower bound {d['perfect_seconds'] / scale:,.2f}"
        cols = axes[1]["values"] if len(axes) > 1 else [None]
        width = 14
        lines.append(" " * 16 + "".join(f"{(label(axes[1], c) if c is not None else ''):>{width}}" for c in cols))
        for v, row in zip(head["values"], totals):
            cells = "".join(f"{(f'{x / scale:,.2f}' if x is not None else 'n/a'):>{width}}" for x in row)
            lines.append(f"{label(head, v):<16}{cells}")
        return "\n".join(lines)

    def plot(self, path: PathLike) -> Path:
        """A heatmap of total time over the swept values."""
        from .plots import plot_sweep

        return plot_sweep(self.data, path)


def simulate(
    scenario: ScenarioLike = "imagenet-1k",
    policies: Optional[Iterable[str]] = None,
    *,
    workers: Optional[int] = None,
    epochs: Optional[int] = None,
    seed: Optional[int] = None,
    set: Optional[Mapping[str, Any]] = None,
    sizes: Optional[Sequence[int]] = None,
    sweep: Optional[Mapping[str, Sequence[Any]]] = None,
    progress: Optional[bool] = None,
) -> Union[SimulationResult, SweepResult]:
    """Simulate a training run.

    ``scenario``: a preset name (:func:`presets`), a TOML file, or a dict with what such a file
    holds (``{"base": "mnist", "workers": 2, "dataset": {...}}``). ``policies``: names (all when
    None). ``workers``/``epochs``/``seed`` override the scenario's; ``set`` overrides any dotted
    key (``{"system.compute_mbps": 320, "system.class.ram.capacity": "64GB"}``); ``sizes``
    replaces the dataset by these sample sizes (bytes), e.g. a real dataset's. ``sweep`` maps one
    or two keys (a class name or ``staging`` = its capacity in GB, or any dotted key) to values
    and returns a :class:`SweepResult` for one policy (clairvoyant unless one is named).
    ``progress``: show a progress bar (default: when stderr is a terminal). Ctrl-C stops it.
    """
    overrides = dict(set or {})
    for key, value in (("workers", workers), ("epochs", epochs), ("seed", seed)):
        if value is not None:
            overrides[key] = value
    axes = [(str(k), [str(v) for v in values]) for k, values in (sweep or {}).items()]
    sim = _native.Simulation(
        _scenario(scenario),
        list(policies or []),
        _sets(overrides),
        None if sizes is None else [int(s) for s in sizes],
        axes,
    )
    show = sys.stderr.isatty() if progress is None else progress
    data = _wait(sim, show)
    return SweepResult(data) if axes else SimulationResult(data)


def _wait(sim, show: bool) -> dict:
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=1, unit=" samples", unit_scale=True, desc="simulating", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    try:
        while True:
            data = sim.result(0.25)
            if bar is not None:
                done, total = sim.progress()
                if total and bar.total != total:
                    bar.total = total
                bar.n = done
                bar.refresh()
            if data is not None:
                return data
    finally:
        if bar is not None:
            bar.close()


def _sets(overrides: Optional[Mapping[str, Any]]) -> list:
    """(dotted key, value) pairs; the values go to the native core as they are (numbers,
    strings, bools, lists, dicts)."""
    return [(str(key), _plain(value)) for key, value in (overrides or {}).items()]


def _scenario(scenario: ScenarioLike):
    """A preset name or file path as a string; a mapping as a dict (nested mappings too)."""
    if isinstance(scenario, Mapping):
        return _plain(scenario)
    return str(scenario)


def _plain(value: Any) -> Any:
    """Mappings as dicts and tuples as lists, all the way down; other values as they are."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _unit(values: Iterable[Optional[float]]) -> tuple:
    """A readable unit for these seconds: (name, seconds per unit)."""
    finite = [v for v in values if v is not None]
    top = max(finite, default=0.0)
    if top >= 2 * 3600:
        return "h", 3600.0
    if top >= 2 * 60:
        return "min", 60.0
    return "s", 1.0


def _engine_system():
    """The engine's system description, as this machine's configuration gives it."""
    from . import config

    return config.resolve(None)


def size_value(n: int):
    """A capacity in bytes as the system file writes it: whole TiB, GiB or MiB as a size
    ('8 GiB'), else the integer."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n > 0 and n % mult == 0:
            return f"{n // mult} {unit}"
    return int(n)


def curve_value(points):
    """A throughput curve [(threads or readers, MB/s), ...] as the system file writes it: one
    number when constant, else [[x, MB/s], ...] with whole counts as integers."""
    if len(points) == 1 and points[0][0] == 1.0:
        return float(points[0][1])
    return [[int(x) if float(x).is_integer() and abs(x) < 1e15 else float(x), float(y)] for x, y in points]


def cluster_scenario(
    *,
    sizes: Sequence[int],
    nodes: int,
    ranks_per_node: int,
    memory_per_node: int,
    epochs: int,
    batch_size: int,
    seed: int,
    fs_bandwidth: float,
    fs_latency: float,
    compute_per_batch: float,
    network_mbps: float = 125.0,
    network_latency: float = 0.0005,
    cores: Optional[int] = None,
    preprocess_mbps: Optional[float] = None,
    processes_per_rank: int = 2,
) -> dict:
    """The scenario of an emulated cluster (see :func:`predict_cluster`) as a dict, as a scenario
    file would hold it; the sample sizes are not in it (pass them as ``sizes`` to
    :func:`simulate`)."""
    import os

    if fs_bandwidth < 1e5:
        raise ConfigError(f"fs_bandwidth is in bytes per second; got {fs_bandwidth!r} (did you mean {fs_bandwidth!r}e6?)")
    if not sizes:
        raise ConfigError("sizes is empty: give one size in bytes per sample")
    for name, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node), ("epochs", epochs), ("batch_size", batch_size)):
        if int(v) < 1:
            raise ConfigError(f"{name} must be at least 1, got {v!r}")
    if compute_per_batch <= 0:
        raise ConfigError(f"compute_per_batch must be > 0 seconds, got {compute_per_batch!r}")
    engine = _engine_system()
    memory = engine.memory_class()
    threads = engine.staging_threads
    mean = sum(sizes) / len(sizes)
    system: dict = {
        "compute_mbps": batch_size * mean / compute_per_batch / 1e6,
        "interconnect_mbps": float(network_mbps),
    }
    if preprocess_mbps:
        # Decode runs in the rank's decode processes beside the staging threads: spread over them.
        decoders = max(1, int(processes_per_rank) - 1)
        system["preprocess_mbps"] = preprocess_mbps * decoders / threads
    system["staging"] = {"capacity": size_value(engine.staging_capacity), "threads": threads, "write_mbps": curve_value(engine.staging_write_mbps)}
    system["pfs"] = {"read_mbps": fs_bandwidth / 1e6, "open_latency_ms": fs_latency * 1e3}
    system["class"] = [
        {
            "name": "memory",
            "kind": "memory",
            "capacity": int(memory_per_node),
            "threads": memory.threads if memory else 2,
            "read_mbps": curve_value(memory.read_mbps) if memory else 4000.0,
            "write_mbps": curve_value(memory.write_mbps) if memory else 4000.0,
        }
    ]
    return {
        "name": "emulated-cluster",
        "workers": nodes * ranks_per_node,
        "workers_per_node": ranks_per_node,
        "epochs": epochs,
        "batch_size": batch_size,
        "seed": seed,
        "pfs_sharing": "fifo",
        "dataset": {"samples": len(sizes), "mean": 1},
        "cpu": {"cores": int(cores or os.cpu_count() or 1), "nodes_per_machine": nodes, "processes_per_worker": int(processes_per_rank)},
        "network": {"latency_ms": network_latency * 1e3},
        "system": system,
    }


def cluster_scenario_toml(**kwargs) -> str:
    """:func:`cluster_scenario` (same arguments) as TOML text, to save as a scenario file."""
    return scenario_toml(cluster_scenario(**kwargs))


def predict_cluster(
    *,
    sizes: Sequence[int],
    nodes: int,
    ranks_per_node: int,
    memory_per_node: int,
    epochs: int,
    batch_size: int,
    seed: int,
    fs_bandwidth: float,
    fs_latency: float,
    compute_per_batch: float,
    network_mbps: float = 125.0,
    network_latency: float = 0.0005,
    cores: Optional[int] = None,
    preprocess_mbps: Optional[float] = None,
    processes_per_rank: int = 2,
) -> dict:
    """Predict an emulated cluster run of clairvoyant: ``nodes`` x ``ranks_per_node`` ranks on one
    machine of ``cores`` cores (default: this machine's), sharing one file system of
    ``fs_bandwidth`` bytes/s in all with ``fs_latency`` seconds per open, each node a memory class
    of ``memory_per_node`` bytes, peers at ``network_mbps`` MB/s (125 = 1 Gbit/s) and
    ``network_latency`` seconds. ``sizes``: the samples' sizes in bytes; ``compute_per_batch``:
    the accelerator's seconds per batch of ``batch_size`` mean-sized samples; ``seed``: the
    shuffle's. ``preprocess_mbps``: β of one decode process (MB/s, measured; None = not
    modelled), shared by the ``processes_per_rank`` processes of every rank on the cores.

    Returns ``{"epoch_seconds": [...], "fs_bytes": int, "fs_reads_vs_dataset": float,
    "samples_by_location": {...}, "scenario": TOML text}`` (the simulator's clairvoyant policy
    with cluster-wide placement; see docs/simulator.md)."""
    scenario = cluster_scenario(
        sizes=sizes,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        memory_per_node=memory_per_node,
        epochs=epochs,
        batch_size=batch_size,
        seed=seed,
        fs_bandwidth=fs_bandwidth,
        fs_latency=fs_latency,
        compute_per_batch=compute_per_batch,
        network_mbps=network_mbps,
        network_latency=network_latency,
        cores=cores,
        preprocess_mbps=preprocess_mbps,
        processes_per_rank=processes_per_rank,
    )
    r = simulate(scenario, ["clairvoyant"], sizes=[int(s) for s in sizes], progress=False)
    p = r.data["policies"]["clairvoyant"]
    if p["error"]:
        raise ConfigError(f"the simulator cannot run this cluster: {p['error']}")
    return {
        "epoch_seconds": list(p["epoch_seconds"]),
        "fs_bytes": int(p["pfs_bytes"]),
        "fs_reads_vs_dataset": p["pfs_reads_vs_dataset"],
        "samples_by_location": p["samples_by_location"],
        "scenario": scenario_toml(scenario),
    }
