"""The I/O performance simulator: how long a whole training run takes under each data-loading
policy, and where the time goes.

    result = clairvoyant.simulate("imagenet-1k", workers=16)
    print(result.table())
    result.plot("policies.png")

    sweep = clairvoyant.simulate("imagenet-22k", sweep={"ram": [32, 64, 128], "ssd": [128, 256]})
    sweep.plot("what-if.png")

Scenarios are presets (:func:`presets`) or TOML files (see docs/simulator.md); the simulation
itself runs in the native core on all cores.
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


def presets() -> list:
    """Names of the preset scenarios (the NoPFS paper's Section 6.1, then the emulated cluster of the
    distributed benchmark)."""
    return list(_native.sim_presets())


def policies() -> list:
    """Names of the simulated policies, in report order."""
    return list(_native.sim_policies())


def scenario_toml(scenario: PathLike = "imagenet-1k", set: Optional[Mapping[str, Any]] = None) -> str:
    """The scenario (a preset or a TOML file, with overrides) as TOML text."""
    return _native.sim_scenario_toml(str(scenario), _sets(set))


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
    scenario: PathLike = "imagenet-1k",
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

    ``scenario``: a preset name (:func:`presets`) or a TOML file. ``policies``: names (all when
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
        str(scenario),
        list(policies or []),
        _sets(overrides),
        None if sizes is None else [int(s) for s in sizes],
        axes,
    )
    show = sys.stderr.isatty() if progress is None else progress
    text = _wait(sim, show)
    data = json.loads(text)
    return SweepResult(data) if axes else SimulationResult(data)


def _wait(sim, show: bool) -> str:
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(total=1, unit=" samples", unit_scale=True, desc="simulating", file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    try:
        while True:
            text = sim.result(0.25)
            if bar is not None:
                done, total = sim.progress()
                if total and bar.total != total:
                    bar.total = total
                bar.n = done
                bar.refresh()
            if text is not None:
                return text
    finally:
        if bar is not None:
            bar.close()


def _sets(overrides: Optional[Mapping[str, Any]]) -> list:
    out = []
    for key, value in (overrides or {}).items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            text = json.dumps(value)  # a TOML basic string
        else:
            text = json.dumps(value)  # lists (curves) are valid TOML arrays
        out.append((str(key), text))
    return out


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


def toml_size(n: int) -> str:
    """A capacity in bytes as a TOML value, as the system file writes it: whole TiB, GiB or MiB
    as a size ('8 GiB'), else the integer."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n > 0 and n % mult == 0:
            return repr(f"{n // mult} {unit}")
    return str(n)


def toml_curve(points) -> str:
    """A throughput curve [(threads or readers, MB/s), ...] as a TOML value, as the system file
    writes it: one number when constant, else [[x, MB/s], ...] with whole counts as integers."""
    if len(points) == 1 and points[0][0] == 1.0:
        return repr(float(points[0][1]))
    return repr([[int(x) if float(x).is_integer() and abs(x) < 1e15 else float(x), float(y)] for x, y in points])


def cluster_scenario_toml(
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
) -> str:
    """The scenario of an emulated cluster (see :func:`predict_cluster`) as TOML text; the sample
    sizes are not in it (pass them as ``sizes`` to :func:`simulate`)."""
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
    compute_mbps = batch_size * mean / compute_per_batch / 1e6
    cores = int(cores or os.cpu_count() or 1)
    lines = [
        'name = "emulated-cluster"',
        f"workers = {nodes * ranks_per_node}",
        f"workers_per_node = {ranks_per_node}",
        f"epochs = {epochs}",
        f"batch_size = {batch_size}",
        f"seed = {seed}",
        'pfs_sharing = "fifo"',
        "[dataset]",
        f"samples = {len(sizes)}",
        "mean = 1",
        "[cpu]",
        f"cores = {cores}",
        f"nodes_per_machine = {nodes}",
        f"processes_per_worker = {int(processes_per_rank)}",
        "[network]",
        f"latency_ms = {network_latency * 1e3!r}",
        "[system]",
        f"compute_mbps = {compute_mbps!r}",
        f"interconnect_mbps = {float(network_mbps)!r}",
    ]
    if preprocess_mbps:
        # Decode runs in the rank's decode processes beside the staging threads: spread over them.
        decoders = max(1, int(processes_per_rank) - 1)
        lines.append(f"preprocess_mbps = {preprocess_mbps * decoders / threads!r}")
    lines += [
        "[system.staging]",
        f"capacity = {toml_size(engine.staging_capacity)}",
        f"threads = {threads}",
        f"write_mbps = {toml_curve(engine.staging_write_mbps)}",
        "[system.pfs]",
        f"read_mbps = {fs_bandwidth / 1e6!r}",
        f"open_latency_ms = {fs_latency * 1e3!r}",
        "[[system.class]]",
        'name = "memory"',
        'kind = "memory"',
        f"capacity = {int(memory_per_node)}",
        f"threads = {memory.threads if memory else 2}",
        f"read_mbps = {toml_curve(memory.read_mbps) if memory else '4000.0'}",
        f"write_mbps = {toml_curve(memory.write_mbps) if memory else '4000.0'}",
    ]
    return "\n".join(lines) + "\n"


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
    import os
    import tempfile

    text = cluster_scenario_toml(
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
    fd, path = tempfile.mkstemp(prefix="clairvoyant-cluster-", suffix=".toml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        r = simulate(path, ["clairvoyant"], sizes=[int(s) for s in sizes], progress=False)
    finally:
        os.unlink(path)
    p = r.data["policies"]["clairvoyant"]
    if p["error"]:
        raise ConfigError(f"the simulator cannot run this cluster: {p['error']}")
    return {
        "epoch_seconds": list(p["epoch_seconds"]),
        "fs_bytes": int(p["pfs_bytes"]),
        "fs_reads_vs_dataset": p["pfs_reads_vs_dataset"],
        "samples_by_location": p["samples_by_location"],
        "scenario": text,
    }
