"""The ``clairvoyant`` command: plan, probe, config, simulate."""

from __future__ import annotations

import argparse
import json
import sys

from . import _native
from ._units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _plan(args) -> int:
    ranks = list(range(args.rank - args.rank % args.local_ranks, args.rank - args.rank % args.local_ranks + args.local_ranks))
    ranks = [r for r in ranks if r < args.world_size]
    classes = [("memory", args.memory), ("ssd", args.ssd)]
    report = json.loads(
        _native.plan_report(args.samples, args.world_size, args.epochs, args.batch_size, args.seed, ranks, [args.sample_bytes], classes, args.drop_last)
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
    text = _native.probe(args.path, args.output, args.ssd_dir, args.max_files, args.budget)
    if args.output is None:
        print(text)
    else:
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _config(args) -> int:
    from . import config

    path, text = config.resolve(args.config)
    print(f"# resolved from {path or 'machine defaults'}")
    print(text or "")
    return 0


def _simulate(args) -> int:
    from . import simulator

    sets = []
    for key, value in (("workers", args.workers), ("epochs", args.epochs), ("seed", args.seed)):
        if value is not None:
            sets.append((key, str(value)))
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"clairvoyant simulate: --set {item!r}: expected KEY=VALUE, e.g. system.compute_mbps=320")
        sets.append((key.strip(), value.strip()))
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
    show = sys.stderr.isatty() if args.progress is None else args.progress
    data = json.loads(simulator._wait(sim, show))
    result = simulator.SweepResult(data) if axes else simulator.SimulationResult(data)
    if args.json:
        print(result.to_json())
    else:
        print(result.table())
    if args.plot:
        path = result.plot(args.plot)
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clairvoyant", description="Clairvoyant prefetching and caching for ML training I/O.")
    sub = p.add_subparsers(dest="cmd", required=True)

    pl = sub.add_parser("plan", help="access-frequency histogram and cache placement for one rank")
    pl.add_argument("--samples", type=int, required=True, help="number of samples F")
    pl.add_argument("--world-size", type=int, required=True, help="number of ranks N")
    pl.add_argument("--epochs", type=int, required=True, help="epochs E")
    pl.add_argument("--batch-size", type=int, required=True, help="per-rank batch size")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--rank", type=int, default=0)
    pl.add_argument("--local-ranks", type=int, default=1, help="ranks per node sharing the cache (default 1)")
    pl.add_argument("--drop-last", action="store_true")
    pl.add_argument("--sample-bytes", type=_size, default=110_000, help="size of every sample (default 110kB)")
    pl.add_argument("--memory", type=_size, default=0, help="memory class capacity (e.g. 64GiB)")
    pl.add_argument("--ssd", type=_size, default=0, help="ssd class capacity")
    pl.add_argument("--json", action="store_true", help="print JSON")
    pl.set_defaults(fn=_plan)

    pr = sub.add_parser("probe", help="measure the dataset's storage and local tiers; write a config")
    pr.add_argument("path", help="dataset directory")
    pr.add_argument("-o", "--output", help="config file to write (default: print)")
    pr.add_argument("--ssd-dir", help="node-local directory to use as the ssd class")
    pr.add_argument("--max-files", type=int, default=256)
    pr.add_argument("--budget", type=float, default=10.0, help="seconds to spend measuring")
    pr.set_defaults(fn=_probe)

    co = sub.add_parser("config", help="print the resolved system description")
    co.add_argument("--config", help="TOML file")
    co.set_defaults(fn=_config)

    si = sub.add_parser(
        "simulate",
        help="predict a whole run's time under each I/O policy (or a what-if sweep)",
        description="Simulate a training run under data-loading policies on a described cluster. "
        "Scenarios: " + ", ".join(_native.sim_presets()) + ", or a TOML file. "
        "Policies: " + ", ".join(_native.sim_policies()) + ".",
    )
    si.add_argument("--scenario", default="imagenet-1k", help="preset name or TOML file (default imagenet-1k)")
    si.add_argument("--policy", action="append", default=[], help="policy to simulate (repeat or comma-separate; default all)")
    si.add_argument("--workers", type=int, help="override the number of workers N")
    si.add_argument("--epochs", type=int, help="override the number of epochs E")
    si.add_argument("--seed", type=int, help="override the shuffle seed")
    si.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any scenario key, e.g. system.compute_mbps=320")
    si.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2", help="what-if: a class name or 'staging' (capacity in GB) or a dotted key, with values; one or two")
    si.add_argument("--sizes-from", metavar="DIR", help="take sample sizes from a real dataset (ImageFolder layout)")
    si.add_argument("--json", action="store_true", help="print the result as JSON")
    si.add_argument("--plot", metavar="FILE", help="write a stacked-bar chart (or, with --sweep, a heatmap): .png, .svg or .pdf")
    si.add_argument("--show", action="store_true", help="print the resolved scenario as TOML and exit")
    si.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)")
    si.set_defaults(fn=_simulate)

    args = p.parse_args(argv)
    if getattr(args, "world_size", 1) < 1 or getattr(args, "rank", 0) < 0:
        p.error("world size must be >= 1 and rank >= 0")
    try:
        return args.fn(args)
    except (_native.ClairvoyantError, ValueError, OSError) as e:
        print(f"clairvoyant: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
