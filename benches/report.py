"""Reporting for the demo and the benchmarks: plain-text and markdown tables, JSON files and a
PNG chart of per-epoch times and accelerator utilization."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Sequence


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width table; numbers right-aligned, text left-aligned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x == 0:
            return "0"
        if abs(x) >= 100:
            return f"{x:,.0f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3f}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return str(x)


def mb(nbytes: float) -> float:
    """Bytes to MB (10^6 bytes)."""
    return nbytes / 1e6


def sources_text(by_source: dict) -> str:
    """``{"memory": 1000, "pfs": 0}`` -> ``"memory 1000"`` (zero counts left out)."""
    parts = [f"{k} {v}" for k, v in by_source.items() if v]
    return ", ".join(parts) if parts else "-"


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)
    return path


def machine() -> dict:
    """What the figures were measured on: uname, CPU count and memory."""
    info = {"uname": " ".join(platform.uname()), "cpus": os.cpu_count()}
    try:
        info["uname"] = subprocess.run(["uname", "-a"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                    break
    except OSError:
        pass
    return info


def plot_epochs(result: dict, path: str | os.PathLike, title: str = "") -> Path | None:
    """Per-epoch time bars for each loader and their accelerator utilization, as a PNG.

    ``result`` maps loader names to lists of per-epoch dicts with ``epoch_seconds``,
    ``compute_seconds`` and ``accelerator_utilization``. Returns None when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    loaders = [k for k in ("pytorch", "one-node", "clairvoyant") if k in result]
    colours = {"pytorch": "#d62728", "one-node": "#ff7f0e", "clairvoyant": "#1f77b4"}
    fig, (ax_t, ax_u) = plt.subplots(1, 2, figsize=(10, 4))
    n = max(len(result[k]) for k in loaders)
    width = 0.8 / max(1, len(loaders))
    for i, name in enumerate(loaders):
        epochs = result[name]
        xs = [e["epoch"] + (i - (len(loaders) - 1) / 2) * width for e in epochs]
        ax_t.bar(xs, [e["epoch_seconds"] for e in epochs], width, label=name, color=colours.get(name))
        ax_u.plot(
            [e["epoch"] for e in epochs],
            [e["accelerator_utilization"] for e in epochs],
            marker="o",
            label=name,
            color=colours.get(name),
        )
    compute = [e["compute_seconds"] for e in result[loaders[0]]]
    ax_t.plot(range(len(compute)), compute, "k_", markersize=30, mew=2, label="compute time")
    ax_t.set_xlabel("epoch")
    ax_t.set_ylabel("epoch time (s)")
    ax_t.set_xticks(range(n))
    ax_t.set_ylim(0, 1.3 * max(e["epoch_seconds"] for k in loaders for e in result[k]))
    ax_t.legend(loc="upper center", ncol=3, fontsize=8)
    ax_u.set_xlabel("epoch")
    ax_u.set_ylabel("accelerator utilization")
    ax_u.set_ylim(0, 1.05)
    ax_u.set_xticks(range(n))
    ax_u.axhline(1.0, color="grey", lw=0.5)
    ax_u.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
