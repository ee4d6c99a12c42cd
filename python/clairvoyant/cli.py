"""The ``clairvoyant`` command: plan, probe, config."""

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
