"""Pictures of simulator results: a stacked-bar chart of time per policy split by fetch location
(like the NoPFS paper's Figure 8) and a what-if heatmap (like its Figure 9).

Both take the JSON documents of ``clairvoyant simulate --json`` (as dicts) and write PNG, SVG
or PDF by the file's suffix. matplotlib is an optional dependency (``clairvoyant[plots]``);
the figures are drawn without pyplot, so a backend a user has chosen is left alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

PathLike = Union[str, Path]

# Fixed colours for the usual locations: cool for local storage, warm for the shared file system.
_COLOURS = {
    "staging": "#9ecae1",
    "ram": "#3182bd",
    "memory": "#3182bd",
    "ssd": "#31a354",
    "remote": "#9467bd",
    "pfs": "#e6550d",
}


def _figure(width: float, height: float):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'clairvoyant[plots]'") from e
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _unit(values) -> tuple:
    top = max((v for v in values if v is not None), default=0.0)
    if top >= 2 * 3600:
        return "hours", 3600.0
    if top >= 2 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def _save(fig, path: PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150 if path.suffix.lower() == ".png" else None)
    return path


def _need(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{where}[{key!r}] is missing")
    return d[key]


def plot_policies(result: dict, path: PathLike) -> Path:
    """Stacked bars: one per policy, height = total time, segments = time per fetch location.
    A policy that cannot run the scenario is marked n/a; one that does not visit the whole
    dataset every epoch gets a '*' after its name."""
    policies = _need(result, "policies", "result")
    if not policies:
        raise ValueError("result['policies'] is empty")
    names = list(policies)
    unit, scale = _unit(p.get("total_seconds") for p in policies.values())
    locations: list = []
    for p in policies.values():
        for loc in (p.get("seconds_by_location") or {}):
            if loc not in locations:
                locations.append(loc)
    from matplotlib import colormaps

    others = colormaps["tab10"]
    colour = {loc: _COLOURS.get(loc, others(i % 10)) for i, loc in enumerate(locations)}

    fig = _figure(max(6.0, 0.8 * len(names) + 2), 4.8)
    ax = fig.add_subplot()
    top = max((p["total_seconds"] or 0.0) / scale for p in policies.values()) or 1.0
    for i, name in enumerate(names):
        p = policies[name]
        if p.get("total_seconds") is None:
            ax.text(i, top * 0.02, "n/a", ha="center", va="bottom", fontsize=9, color="0.4")
            continue
        bottom = 0.0
        for loc in locations:
            v = (p.get("seconds_by_location") or {}).get(loc, 0.0) / scale
            if v > 0:
                ax.bar(i, v, bottom=bottom, color=colour[loc], width=0.7, edgecolor="white", linewidth=0.5)
                bottom += v
        rel = p.get("relative_to_perfect")
        if rel is not None:
            ax.text(i, bottom + top * 0.01, f"{rel:.2f}×", ha="center", va="bottom", fontsize=8)
    labels = [n + ("" if policies[n].get("full_randomization", True) else "*") for n in names]
    ax.set_xticks(range(len(names)), labels, rotation=35, ha="right")
    ax.set_ylabel(f"total time ({unit})")
    ax.set_ylim(0, top * 1.12)
    ax.set_xlim(-0.6, len(names) - 0.4)
    from matplotlib.patches import Patch

    handles = [Patch(color=colour[loc], label=loc) for loc in locations]
    if handles:
        ax.legend(handles=handles, title="fetched from", fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    title = result.get("scenario", "")
    if result.get("workers") is not None:
        title += f" — {result['workers']} workers, {result.get('epochs', '?')} epochs"
    ax.set_title(title, fontsize=10)
    notes = []
    if any(not policies[n].get("full_randomization", True) for n in names):
        notes.append("* does not read the full dataset every epoch")
    if any(policies[n].get("total_seconds") is None for n in names):
        notes.append("n/a: the policy cannot run this scenario")
    if notes:
        ax.set_xlabel("; ".join(notes), fontsize=7, color="0.3", loc="left")
    return _save(fig, path)


def plot_sweep(result: dict, path: PathLike) -> Path:
    """A heatmap of total time over one or two swept parameters; cells are annotated."""
    axes = _need(result, "sweep", "result")
    totals = _need(result, "total_seconds", "result")
    if not axes:
        raise ValueError("result['sweep'] is empty")
    if len(axes) > 2:
        raise ValueError(f"sweep has {len(axes)} keys; at most 2 can be drawn")
    unit, scale = _unit(v for row in totals for v in row)
    rows, cols = len(totals), max((len(r) for r in totals), default=0)
    import numpy as np

    grid = np.full((rows, cols), np.nan)
    for i, row in enumerate(totals):
        for j, v in enumerate(row):
            if v is not None:
                grid[i, j] = v / scale
    fig = _figure(max(4.5, 1.1 * cols + 2.5), max(2.5, 0.6 * rows + 1.8))
    ax = fig.add_subplot()
    from matplotlib import colormaps

    cmap = colormaps["viridis_r"].with_extremes(bad="0.85")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto")
    finite = grid[np.isfinite(grid)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0
    for i in range(rows):
        for j in range(cols):
            v = grid[i, j]
            text, colour = ("n/a", "0.3") if np.isnan(v) else (f"{v:,.2f}", "white" if v > mid else "black")
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color=colour)

    def label(a: dict) -> str:
        return f"{a['key']} ({a['unit']})" if a.get("unit") else str(a["key"])

    def ticks(a: dict) -> list:
        return [f"{v:g}" if isinstance(v, (int, float)) else str(v) for v in a["values"]]

    ax.set_yticks(range(rows), ticks(axes[0]))
    ax.set_ylabel(label(axes[0]))
    if len(axes) == 2:
        ax.set_xticks(range(cols), ticks(axes[1]))
        ax.set_xlabel(label(axes[1]))
    else:
        ax.set_xticks([])
    fig.colorbar(im, ax=ax, label=f"total time ({unit})")
    title = f"{result.get('policy', '')} on {result.get('scenario', '')}"
    if result.get("perfect_seconds") is not None:
        title += f"; lower bound {result['perfect_seconds'] / scale:,.2f} {unit}"
    ax.set_title(title, fontsize=10)
    return _save(fig, path)
