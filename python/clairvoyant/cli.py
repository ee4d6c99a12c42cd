"""The ``clairvoyant`` command: plan, probe, config, simulate."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from . import _native
from ._report import Progress
from ._units import parse_size
from .errors import ClairvoyantError

# Names of settings as the library spells them, and the flag each comes from on the command line:
# messages from the library name the setting, the command line user knows the flag.
FLAGS = {
    "plan": {
        "samples": "--samples",
        "num_samples": "--samples",
        "world_size": "--world-size",
        "epochs": "--epochs",
        "batch_size": "--batch-size",
        "seed": "--seed",
        "rank": "--rank",
        "drop_last": "--drop-last",
        "sample_bytes": "--sample-bytes",
        "nodes": "--nodes",
    },
    "probe": {
        "budget_s": "--budget",
        "max_files": "--max-files",
        "ssd_dir": "--ssd-dir",
        "output": "--output",
        "dataset": "PATH",
    },
    "config": {"config": "--config"},
    "simulate": {
        "workers": "--workers",
        "epochs": "--epochs",
        "seed": "--seed",
        "scenario": "--scenario",
        "policy": "--policy",
        "policies": "--policy",
        "sizes": "--sizes-from",
    },
}

# A sample this small is read in about the time its open takes: the throughput measured says
# little about reading real samples.
TINY_FILE_BYTES = 32 * 1024
# Opens this fast come from the page cache, not from a device or a network file system.
CACHED_OPEN_MS = 0.02
# Faster than any one node's storage device or network link reads.
CACHED_READ_MBPS = 8000.0


def cli_message(message: str, cmd: str, args=None) -> str:
    """``message`` with the library's setting names replaced by the command's flags:
    ``invalid value for 'drop_last': ...; set drop_last=True`` -> ``invalid value for
    --drop-last: ...; set --drop-last``. For simulate, only settings given as flags (the others
    come from the scenario, which the message names)."""
    for key, flag in FLAGS.get(cmd, {}).items():
        if cmd == "simulate" and getattr(args, key, None) is None:
            continue
        message = re.sub(rf"\b{key}=True\b", flag, message)
        message = re.sub(rf"\b{key}=", f"{flag} ", message) if flag.startswith("--") else message
        message = message.replace(f"'{key}'", flag)
    return message


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count(low: int):
    """An argparse type: an integer of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _cluster_plan(args) -> int:
    per_node = args.world_size // args.nodes
    nodes = [list(range(i * per_node, (i + 1) * per_node)) for i in range(args.nodes)]
    classes = [("memory", args.memory), ("ssd", args.ssd)]
    node = min(args.rank // max(per_node, 1), args.nodes - 1)
    report = _native.cluster_plan_report(
        args.samples, args.world_size, args.epochs, args.batch_size, args.seed, nodes, [args.sample_bytes], classes, args.drop_last, node
    )
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    gb = 1e9
    total = report["dataset_bytes"]
    room = sum(n["replica_room_bytes"] for n in report["per_node"])
    print(
        f"plan for {args.nodes} nodes x {per_node} ranks: {args.samples:,} samples ({total / gb:.2f} GB), {args.epochs} epochs, "
        f"batch {args.batch_size}, seed {args.seed}; computed in {report['seconds']:.2f} s"
    )
    print(
        f"aggregate capacity {report['aggregate_capacity'] / gb:.2f} GB: coverage {report['coverage']:.1%} of the dataset, "
        f"{room / gb:.2f} GB left on the nodes for replicas of their own most used samples"
    )
    print(
        f"expected file-system reads over the run: {report['expected_fs_bytes'] / gb:.2f} GB "
        f"({report['expected_fs_bytes'] / max(total, 1):.2f}x the dataset; minimum {report['minimum_fs_bytes'] / gb:.2f} GB)"
    )
    mine = report["node"]
    print(
        f"node {mine['node']} (ranks {mine['ranks'][0]}-{mine['ranks'][-1]}) holds {mine['samples']:,} samples, {mine['bytes'] / gb:.2f} GB: "
        f"{mine['primary_bytes'] / gb:.2f} GB it serves, {mine['replica_bytes'] / gb:.2f} GB replicas; "
        f"caching alone it would read {mine['expected_fs_bytes_alone'] / gb:.2f} GB from the file system"
    )
    shown = report["per_node"] if len(report["per_node"]) <= 16 else report["per_node"][:8] + report["per_node"][-4:]
    for n in shown:
        print(
            f"node {n['node']:<4} ranks {n['ranks'][0]}-{n['ranks'][-1]}: primary for {n['primary_samples']:>10,} samples "
            f"{n['primary_bytes'] / gb:>8.2f} GB, {n['replica_room_bytes'] / gb:.2f} GB left for replicas"
        )
    if len(shown) < len(report["per_node"]):
        print(f"... {len(report['per_node']) - len(shown)} more nodes in --json")
    return 0


def _plan(args) -> int:
    if args.nodes is not None:
        return _cluster_plan(args)
    ranks = list(range(args.rank - args.rank % args.local_ranks, args.rank - args.rank % args.local_ranks + args.local_ranks))
    ranks = [r for r in ranks if r < args.world_size]
    classes = [("memory", args.memory), ("ssd", args.ssd)]
    report = _native.plan_report(
        args.samples, args.world_size, args.epochs, args.batch_size, args.seed, ranks, [args.sample_bytes], classes, args.drop_last
    )
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"plan for ranks {report['ranks']} of {args.world_size}: {args.samples:,} samples, {args.epochs} epochs, batch {args.batch_size}, seed {args.seed}")
    print(f"computed in {report['seconds']:.2f} s; mean accesses per sample {report['mean_accesses_per_sample']:.2f}")
    print(f"{'accesses':>9} {'measured':>12} {'expected':>12}")
    exp = report["expected_histogram"]
    keys = sorted({int(k) for k in report["frequency_histogram"]} | {int(k) for k in exp})
    for k in keys:
        print(f"{k:>9} {report['frequency_histogram'].get(str(k), 0):>12,} {exp.get(str(k), 0.0):>12,.1f}")
    for p in report["placement"]:
        print(f"class {p['class']:<8} {p['samples']:>10,} samples {p['bytes'] / 1e9:>10.2f} GB of {p['capacity'] / 1e9:.2f} GB")
    u = report["uncached"]
    print(f"uncached       {u['samples']:>10,} samples {u['bytes'] / 1e9:>10.2f} GB")
    return 0


def _probe(args) -> int:
    mean = _mean_file_size(args.path)
    model = _native.probe(args.path, args.output, args.ssd_dir, args.max_files, args.budget)
    for warning in probe_warnings(model, mean):
        print(f"clairvoyant probe: warning: {warning}", file=sys.stderr)
    if args.output is None:
        print(model.to_toml())
        print("clairvoyant probe: to use this description, save it with -o FILE", file=sys.stderr)
    else:
        print(f"wrote {args.output}", file=sys.stderr)
        print(probe_usage(args.output), file=sys.stderr)
    return 0


def probe_usage(path) -> str:
    """How the file `probe -o` wrote is used (docs/configuration.md)."""
    from .config import default_path

    path = os.path.abspath(path)
    return (
        f"use it with clairvoyant.Job(..., config={path!r}) or CLAIRVOYANT_CONFIG={path} in the training job's\n"
        f"environment; `clairvoyant config --config {path}` shows what is in force. Copied to\n"
        f"{default_path()} it is used by every job of this user that names no other."
    )


def _mean_file_size(path, limit: int = 2000):
    """Mean size of up to `limit` files under `path` (None when there are none or on errors)."""
    if os.path.isfile(path):
        return os.path.getsize(path) or None
    sizes = []
    stack = [os.fspath(path)]
    while stack and len(sizes) < limit:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file():
                        sizes.append(e.stat().st_size)
                        if len(sizes) >= limit:
                            break
        except OSError:
            continue
    sizes = [s for s in sizes if s > 0]
    return sum(sizes) / len(sizes) if sizes else None


def _bytes(n: float) -> str:
    return f"{n:,.0f} bytes" if n < 1024 else f"{n / 1024:.1f} KiB"


def probe_warnings(model, mean_file_bytes) -> list:
    """Why the storage figures of a probe (a :class:`clairvoyant._native.SystemModel`) may not
    describe the storage: files read from the page cache (opens or reads far faster than a
    device), or files so small that each read measures an open."""
    out = []
    open_ms = model.pfs_open_latency_ms
    peak = max(mbps for _, mbps in model.pfs_read_mbps)
    if (open_ms is not None and open_ms < CACHED_OPEN_MS) or (peak is not None and peak > CACHED_READ_MBPS):
        what = []
        if open_ms is not None and open_ms < CACHED_OPEN_MS:
            what.append(f"opens took {open_ms * 1e3:.1f} us")
        if peak is not None and peak > CACHED_READ_MBPS:
            what.append(f"reads reached {peak:,.0f} MB/s")
        out.append(
            f"the dataset's files were most likely in the page cache ({', '.join(what)}; a disk or a network file "
            "system takes 0.1 ms or more per open), so the storage figures measure memory, not the storage. "
            "Probe files that were not read recently (or after `echo 1 > /proc/sys/vm/drop_caches` as root), "
            "or set [pfs] by hand."
        )
    if mean_file_bytes is not None and mean_file_bytes < TINY_FILE_BYTES:
        out.append(
            f"the files are tiny (mean {_bytes(mean_file_bytes)}), so each read mostly measures an open: "
            "the throughput figures understate what larger samples would get."
        )
    return out


def _config(args) -> int:
    from . import _settings, config

    if args.variables:
        sys.stdout.write(_settings.markdown())
        return 0
    if args.write_table:
        _settings.write(args.write_table)
        return 0
    if args.check_table:
        problem = _settings.check(args.check_table)
        if problem:
            print(f"clairvoyant config: {problem}", file=sys.stderr)
            return 1
        return 0

    model = config.resolve(args.config)
    print(f"# resolved from {model.path or 'machine defaults'}")
    print(model.to_toml())
    return 0


def _simulate(args) -> int:
    from . import simulator

    sets = []
    for key, value in (("workers", args.workers), ("epochs", args.epochs), ("seed", args.seed)):
        if value is not None:
            sets.append((key, value))
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"clairvoyant simulate: --set {item!r}: expected KEY=VALUE, e.g. system.compute_mbps=320")
        # As written on a command line: a TOML value (3, 1.5, "64GB", [[1, 330]]), else the text.
        sets.append((key.strip(), _native.sim_value(value.strip())))
    if args.show:
        print(_native.sim_scenario_toml(args.scenario, sets), end="")
        return 0
    axes = []
    for item in args.sweep:
        key, eq, values = item.partition("=")
        vals = [v.strip() for v in values.split(",") if v.strip()]
        if not eq or not key or not vals:
            raise SystemExit(f"clairvoyant simulate: --sweep {item!r}: expected KEY=V1,V2,..., e.g. ram=32,64,128")
        axes.append((key.strip(), vals))
    policies = [p.strip() for item in args.policy for p in item.split(",") if p.strip()]
    sizes = None
    if args.sizes_from:
        from .sources import ImageFolder

        src = ImageFolder(args.sizes_from)
        sizes = [src.size(k) for k in range(len(src))]
    sim = _native.Simulation(args.scenario, policies, sets, sizes, axes)
    data = _wait(sim, args.progress is not False)
    result = simulator.SweepResult(data) if axes else simulator.SimulationResult(data)
    if args.json:
        print(result.to_json())
    else:
        print(result.table())
    if args.plot:
        path = result.plot(args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _wait(sim, show: bool) -> dict:
    """The simulation's result document, with progress on stderr while it runs."""
    progress = Progress("simulating", "samples") if show else None
    try:
        while True:
            data = sim.result(0.25)
            if progress is not None:
                progress.update(*sim.progress())
            if data is not None:
                return data
    finally:
        if progress is not None:
            progress.close()


def _check_plot(path: str) -> str | None:
    """Why `--plot path` cannot be written (checked before a long simulation), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, which is not installed: pip install matplotlib (or clairvoyant[plots])"
    if os.path.splitext(path)[1].lower() not in (".png", ".svg", ".pdf"):
        return f"--plot {path}: the file name must end in .png, .svg or .pdf"
    return None


def _run(args) -> int:
    from . import _run as run

    return run.main(args)


def _plan_parser(sub) -> argparse.ArgumentParser:
    """``clairvoyant plan``."""
    pl = sub.add_parser("plan", help="access-frequency histogram and cache placement for one rank")
    pl.add_argument("--samples", type=_count(1), required=True, help="number of samples F")
    pl.add_argument("--world-size", type=_count(1), required=True, help="number of ranks N")
    pl.add_argument("--epochs", type=_count(1), required=True, help="epochs E")
    pl.add_argument("--batch-size", type=_count(1), required=True, help="per-rank batch size")
    pl.add_argument("--seed", type=_count(0), default=0)
    pl.add_argument("--rank", type=_count(0), default=0, help="rank to plan for, 0..world size - 1 (default 0); with --nodes, its node's placement is shown")
    pl.add_argument("--local-ranks", type=_count(1), default=1, help="ranks per node sharing the cache (default 1)")
    pl.add_argument(
        "--nodes", type=_count(1), default=None, help="plan across this many nodes (world size split evenly; capacities per node)"
    )
    pl.add_argument("--drop-last", action="store_true")
    pl.add_argument("--sample-bytes", type=_size, default=110_000, help="size of every sample (default 110kB)")
    pl.add_argument("--memory", type=_size, default=0, help="memory class capacity (e.g. 64GiB)")
    pl.add_argument("--ssd", type=_size, default=0, help="ssd class capacity")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(fn=_plan)
    return pl


def _probe_parser(sub) -> argparse.ArgumentParser:
    """``clairvoyant probe``."""
    pr = sub.add_parser("probe", help="measure the dataset's storage and local tiers; write a config")
    pr.add_argument("path", help="dataset directory")
    pr.add_argument("-o", "--output", help="config file to write (default: print)")
    pr.add_argument("--ssd-dir", help="node-local directory to use as the ssd class")
    pr.add_argument("--max-files", type=_count(1), default=256, help="most dataset files to read (default 256)")
    pr.add_argument("--budget", type=_seconds, default=10.0, help="seconds to spend measuring (default 10)")
    pr.set_defaults(fn=_probe)
    return pr


def _config_parser(sub) -> argparse.ArgumentParser:
    """``clairvoyant config``."""
    co = sub.add_parser("config", help="print the resolved system description")
    co.add_argument("--config", help="TOML file")
    table = co.add_mutually_exclusive_group()
    table.add_argument("--variables", action="store_true", help="print the table of every CLAIRVOYANT_* environment variable")
    table.add_argument("--write-table", metavar="FILE", help="replace FILE's table of environment variables with the current one")
    table.add_argument("--check-table", metavar="FILE", help="fail when FILE's table of environment variables is out of date")
    co.set_defaults(fn=_config)
    return co


def _simulate_parser(sub) -> argparse.ArgumentParser:
    """``clairvoyant simulate``."""
    si = sub.add_parser(
        "simulate",
        help="predict a whole run's time under each I/O policy (or a what-if sweep)",
        description="Simulate a training run under data-loading policies on a described cluster. "
        "Scenarios: " + ", ".join(_native.sim_presets()) + ", or a TOML file. "
        "Policies: " + ", ".join(_native.sim_policies()) + ".",
    )
    si.add_argument("--scenario", default="imagenet-1k", help="preset name or TOML file (default imagenet-1k)")
    si.add_argument("--policy", action="append", default=[], help="policy to simulate (repeat or comma-separate; default all)")
    si.add_argument("--workers", type=_count(1), help="override the number of workers N")
    si.add_argument("--epochs", type=_count(1), help="override the number of epochs E")
    si.add_argument("--seed", type=_count(0), help="override the shuffle seed")
    si.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any scenario key, e.g. system.compute_mbps=320")
    si.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help="what-if: a class name or 'staging' (capacity in GB) or a dotted key, with values; one or two")
    si.add_argument("--sizes-from", metavar="DIR", help="take sample sizes from a real dataset (ImageFolder layout)")
    si.add_argument("--json", action="store_true", help="print the result as JSON")
    si.add_argument("--plot", metavar="FILE", help="write a stacked-bar chart (or, with --sweep, a heatmap): .png, .svg or .pdf")
    si.add_argument("--show", action="store_true", help="print the resolved scenario as TOML and exit")
    si.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr: a bar on a terminal, else a line every 2 s or 10%% (default: on)",
    )
    si.set_defaults(fn=_simulate)
    return si


def _run_parser(sub) -> argparse.ArgumentParser:
    """``clairvoyant run``."""
    ru = sub.add_parser(
        "run",
        help="run an unmodified program with its dataset reads served from the node's cache",
        description="Run COMMAND with its reads of files under --dataset served from this node's cache and other "
        "nodes' caches (transparent mode; see docs/transparent.md). Example: "
        "clairvoyant run --dataset /pfs/imagenet -- python train.py",
    )
    ru.add_argument("--dataset", required=True, help="the dataset's root directory")
    ru.add_argument("--order-file", help="per-epoch read orders (one path per line, epochs separated by blank lines); {node} is replaced by the node's index")
    ru.add_argument(
        "--sampler-order",
        action="store_true",
        help="Python programs: hand the DataLoader's DistributedSampler order to the node agent at the first iter() (CLAIRVOYANT_EPOCHS epochs, default 3)",
    )
    ru.add_argument("--stats", action="store_true", help="print reads by source every --stats-interval seconds and in total")
    ru.add_argument("--stats-interval", type=_seconds, default=10.0, help="seconds between --stats lines (default 10)")
    ru.add_argument("--stats-json", metavar="FILE", help="write the node agent's figures at the end as JSON")
    ru.add_argument("--nodes", type=_count(1), default=None, help="nodes of the job (default: from the launcher, else 1)")
    ru.add_argument("--node-rank", type=_count(0), default=None, help="this node's index (default: from the launcher)")
    ru.add_argument("--config", help="system description TOML (default: as for every job)")
    ru.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    ru.set_defaults(fn=_run)
    return ru


def _clean(args) -> int:
    from . import _native
    from ._run import reclaim_agent_dirs
    from .config import resolve
    from .errors import ClairvoyantError

    try:
        model = resolve(args.config)
    except ClairvoyantError as e:
        if args.config is not None:
            raise
        # The node's memory is still cleaned; only the directory classes are not known.
        print(f"clairvoyant clean: warning: directory classes not cleaned: {e}", file=sys.stderr)
        model = None
    classes = [c.path for c in model.classes if c.kind == "directory"] if model is not None else []
    files, nbytes = _native.clean_node_caches(classes)
    agents = reclaim_agent_dirs()
    if files or agents:
        what = f"{files} file(s), {nbytes / 1e6:.1f} MB" + (f", and {agents} agent folder(s)" if agents else "")
        print(f"clairvoyant clean: removed {what}, of jobs whose processes are gone")
    else:
        print("clairvoyant clean: nothing to remove (caches of running jobs are kept)")
    return 0


def _clean_parser(sub) -> None:
    cl = sub.add_parser(
        "clean",
        help="remove this user's node-cache files of jobs whose processes are gone (for a job's epilog)",
        description="Remove this user's node-cache files that no running process uses: caches of jobs that were killed, "
        "their staging rings, the copies kept for reuse after a crash, the folders of node agents that are gone, and "
        "the killed jobs' folders in the directory classes of the system description (--config, else the one every "
        "job uses). The next job on the node does the same when it starts (keeping the copies for reuse for an hour); "
        "run this where no job follows, in a Slurm epilog for instance. Caches of running jobs are kept.",
    )
    cl.add_argument(
        "--config",
        metavar="TOML",
        help="the system description whose directory classes to clean (default: $CLAIRVOYANT_CONFIG, else <cache dir>/system.toml)",
    )
    cl.set_defaults(fn=_clean)


def _check(p: argparse.ArgumentParser, pl: argparse.ArgumentParser, si: argparse.ArgumentParser, args) -> None:
    """What argparse cannot check alone; exits with a usage error naming the argument."""
    if args.cmd == "plan" and args.nodes is not None and args.world_size % args.nodes:
        p.error(f"--world-size {args.world_size} is not a multiple of --nodes {args.nodes}")
    if args.cmd == "plan" and args.rank >= args.world_size:
        pl.error(f"argument --rank: {args.rank} is outside the world size (--world-size {args.world_size}: ranks 0 to {args.world_size - 1})")
    if args.cmd == "simulate" and args.plot and not args.show:
        problem = _check_plot(args.plot)
        if problem is not None:
            si.error(problem)


def _dispatch(args) -> int:
    """Run the subcommand; an error of the command is one line on stderr and exit status 1."""
    try:
        return args.fn(args)
    except BrokenPipeError:
        # Output piped into `head` or a pager that quit: not an error of this command.
        sys.stdout = open(os.devnull, "w")  # the interpreter flushes stdout at exit
        return 0
    except (ClairvoyantError, ValueError, OSError) as e:
        print(f"clairvoyant {args.cmd}: error: {cli_message(str(e), args.cmd, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"clairvoyant {args.cmd}: interrupted", file=sys.stderr)
        return 130


class _Version(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked for (the
    lookup reads every installed distribution's metadata: 20 ms before each `clairvoyant run`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from . import __version__

        print(f"clairvoyant {__version__}")
        parser.exit()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clairvoyant", description="Clairvoyant prefetching and caching for ML training I/O.")
    p.add_argument("--version", action=_Version, nargs=0, help="show the version and exit")
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = _plan_parser(sub)
    _probe_parser(sub)
    _config_parser(sub)
    si = _simulate_parser(sub)
    _run_parser(sub)
    _clean_parser(sub)
    args = p.parse_args(argv)
    _check(p, pl, si, args)
    return _dispatch(args)


if __name__ == "__main__":
    sys.exit(main())
