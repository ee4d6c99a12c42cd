"""Pictures of simulator results.

:func:`plot_policies` draws a policy comparison as stacked bars, one per policy, split by where
the time went (like Figure 8 of the NoPFS paper); :func:`plot_sweep` draws a what-if grid as a
heatmap (like its Figure 9). Both take the JSON documents of ``clairvoyant simulate --json``
as dicts and write PNG, SVG or PDF, chosen by the file's suffix.

matplotlib is an optional dependency (``pip install 'clairvoyant[plots]'``). The figures are
drawn with matplotlib's object API on the Agg canvas, so a backend chosen through pyplot is
left alone.
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from .errors import ConfigError

__all__ = ["plot_policies", "plot_sweep"]

PathLike = Union[str, os.PathLike]

# Fixed colours for the usual fetch locations: cool for node-local storage, warm for the
# shared file system. Other location names get colours from _OTHER_COLOURMAP.
_LOCATION_COLOURS = {
    "staging": "#9ecae1",
    "ram": "#3182bd",
    "memory": "#3182bd",
    "ssd": "#31a354",
    "remote": "#756bb1",
    "pfs": "#e6550d",
}
# Stacking order, bottom up: node-local tiers, then other names, then remote nodes and the PFS.
_LOCATION_ORDER = {"staging": 0, "ram": 1, "memory": 1, "ssd": 2, "remote": 4, "pfs": 5}
_OTHER_RANK = 3
_OTHER_COLOURMAP = "tab20b"
# tab20b indices, mid shades of its five hues first, so the first few extra locations differ most.
_OTHER_SHADES = (5, 9, 17, 13, 1, 7, 11, 19, 15, 3, 4, 8, 16, 12, 0, 6, 10, 18, 14, 2)

_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_PNG_DPI = 150
_NOT_RUN = "0.6"  # grey for a policy or a cell without a result


def plot_policies(result: Mapping[str, Any], path: PathLike) -> Path:
    """Draw a policy comparison as stacked bars and write it to ``path``.

    One bar per policy in the document's order; its height is the total time, its segments the
    time per fetch location and the label above it the time relative to Perfect. A policy that
    cannot run the scenario is drawn as a hatched "n/a" stub; a policy that does not read the
    full dataset every epoch gets a '*' after its name and a footnote.

    Returns the path written. Raises ValueError naming the field when ``result`` lacks
    something the chart needs, and ImportError when matplotlib is not installed.
    """
    mpl = _matplotlib()
    out, fmt = _output(path)
    policies = _field(result, "policies", "result")
    if not isinstance(policies, Mapping) or not policies:
        raise ConfigError("result['policies'] must be a non-empty mapping of policy name to result")
    bars = [_policy_bar(name, p) for name, p in policies.items()]
    unit, scale = _time_unit(b["total"] for b in bars)
    seen = dict.fromkeys(loc for b in bars for loc in b["segments"])
    locations = sorted(seen, key=lambda loc: _LOCATION_ORDER.get(loc.lower(), _OTHER_RANK))
    colours = _location_colours(locations, mpl.colormaps[_OTHER_COLOURMAP])

    fig = _figure(mpl, max(6.0, 0.75 * len(bars) + 3.5), 5.0)
    ax = fig.add_subplot()
    top = max((b["total"] for b in bars if b["total"] is not None), default=0.0) / scale or 1.0
    stub = 0.04 * top
    for x, bar in enumerate(bars):
        if bar["total"] is None:
            ax.bar(x, stub, width=0.7, color="none", edgecolor=_NOT_RUN, hatch="///", linewidth=0.8)
            ax.text(x, stub + 0.01 * top, "n/a", ha="center", va="bottom", fontsize=8, color="0.3")
            continue
        bottom = 0.0
        for loc in (loc for loc in locations if loc in bar["segments"]):
            height = bar["segments"][loc] / scale
            ax.bar(x, height, bottom=bottom, width=0.7, color=colours[loc], edgecolor="white", linewidth=0.5)
            bottom += height
        if bar["relative"] is not None:
            ax.text(x, bottom + 0.01 * top, f"{bar['relative']:.2f}×", ha="center", va="bottom", fontsize=8)

    labels = [b["name"] if b["full_randomization"] else b["name"] + "*" for b in bars]
    ax.set_xticks(range(len(bars)), labels, rotation=35, ha="right", rotation_mode="anchor")
    ax.set_xlim(-0.6, len(bars) - 0.4)
    ax.set_ylim(0, top * 1.1)
    ax.set_ylabel(f"total time ({unit})")
    ax.grid(axis="y", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if locations:
        handles = [mpl.patches.Patch(facecolor=colours[loc], label=loc) for loc in reversed(locations)]
        ax.legend(handles=handles, title="fetched from", fontsize=8, title_fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(_policies_title(result, fig.get_figwidth()), fontsize=10)
    notes = []
    if not all(b["full_randomization"] for b in bars):
        notes.append("* does not read the full dataset every epoch")
    if any(b["total"] is None for b in bars):
        notes.append("n/a: cannot run this scenario")
    if notes:
        fig.supxlabel("    ".join(notes), x=0.01, ha="left", fontsize=8, color="0.3")
    return _save(fig, out, fmt)


def plot_sweep(result: Mapping[str, Any], path: PathLike) -> Path:
    """Draw a what-if sweep as a heatmap of total time and write it to ``path``.

    Rows follow ``sweep[0]``'s values and columns ``sweep[1]``'s; a single swept key gives one
    row with its values across. Every cell is annotated with its time; cells without a result
    (null) are grey and read "n/a". The title names the policy, the scenario and, when present,
    the lower bound ``perfect_seconds``.

    Returns the path written. Raises ValueError naming the field when ``result`` lacks
    something the heatmap needs, and ImportError when matplotlib is not installed.
    """
    mpl = _matplotlib()
    out, fmt = _output(path)
    axes = _field(result, "sweep", "result")
    if not isinstance(axes, Sequence) or isinstance(axes, str) or not axes:
        raise ConfigError("result['sweep'] must be a non-empty list of swept keys")
    if len(axes) > 2:
        raise ConfigError(f"sweep has {len(axes)} keys; at most 2 can be drawn")
    for i, axis in enumerate(axes):
        _field(axis, "key", f"result['sweep'][{i}]")
        values = _field(axis, "values", f"result['sweep'][{i}]")
        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise ConfigError(f"result['sweep'][{i}]['values'] must be a non-empty list")
    grid = _sweep_grid(_field(result, "total_seconds", "result"), [len(a["values"]) for a in axes])
    unit, scale = _time_unit(v for row in grid for v in row)
    grid = [[None if v is None else v / scale for v in row] for row in grid]
    rows, cols = len(grid), len(grid[0])
    row_axis, col_axis = (axes[0], axes[1]) if len(axes) == 2 else (None, axes[0])

    fig = _figure(mpl, max(5.0, 0.9 * cols + 3.0), max(2.6, 0.55 * rows + 2.0))
    ax = fig.add_subplot()
    finite = [v for row in grid for v in row if v is not None]
    norm = mpl.colors.Normalize(min(finite, default=0.0), max(finite, default=1.0))
    cmap = mpl.colormaps["viridis"].with_extremes(bad=_NOT_RUN)
    masked = [[math.nan if v is None else v for v in row] for row in grid]
    image = ax.imshow(masked, cmap=cmap, norm=norm, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v is None:
                ax.text(j, i, "n/a", ha="center", va="center", fontsize=8, color="0.15")
            else:
                ax.text(j, i, _format_time(v), ha="center", va="center", fontsize=8, color=_text_colour(cmap(norm(v))))

    ax.set_xticks(range(cols), _tick_labels(col_axis))
    ax.set_xlabel(_axis_label(col_axis))
    if row_axis is None:
        ax.set_yticks([])
    else:
        ax.set_yticks(range(rows), _tick_labels(row_axis))
        ax.set_ylabel(_axis_label(row_axis))
    ax.tick_params(length=0)
    fig.colorbar(image, ax=ax, label=f"total time ({unit})")
    ax.set_title(_sweep_title(result, unit, scale), fontsize=10)
    return _save(fig, out, fmt)


def _matplotlib() -> Any:
    """The matplotlib package with the submodules used here imported."""
    try:
        import matplotlib.backends.backend_agg
        import matplotlib.colors
        import matplotlib.figure
        import matplotlib.patches
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'clairvoyant[plots]'") from e
    return matplotlib


def _figure(mpl: Any, width: float, height: float) -> Any:
    """A Figure on the Agg canvas, laid out so that labels, legend and colorbar fit."""
    fig = mpl.figure.Figure(figsize=(width, height), layout="constrained")
    mpl.backends.backend_agg.FigureCanvasAgg(fig)
    return fig


def _output(path: PathLike) -> tuple:
    """The output path and matplotlib's format name for its suffix."""
    out = Path(path)
    fmt = _FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ConfigError(f"cannot write {out.name!r}: the file name must end in .png, .svg or .pdf")
    return out, fmt


def _save(fig: Any, out: Path, fmt: str) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, format=fmt, dpi=_PNG_DPI if fmt == "png" else "figure")
    finally:
        fig.clear()
    return out


def _field(container: Any, key: str, where: str) -> Any:
    """``container[key]``, or a ValueError naming the field when it is not there."""
    if not isinstance(container, Mapping):
        raise ConfigError(f"{where} must be a mapping, not {type(container).__name__}")
    if key not in container:
        raise ConfigError(f"{where}[{key!r}] is missing")
    return container[key]


def _number(value: Any, where: str) -> Optional[float]:
    """A non-negative number or None, or a ValueError naming the field."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where} must be a non-negative number or null, not {value!r}")
    return float(value)


def _policy_bar(name: str, policy: Any) -> dict:
    """One policy's bar: total and segment seconds, relative time, randomization."""
    where = f"result['policies'][{name!r}]"
    total = _number(_field(policy, "total_seconds", where), f"{where}['total_seconds']")
    segments = {}
    if total is not None:
        by_location = _field(policy, "seconds_by_location", where)
        if not isinstance(by_location, Mapping):
            raise ConfigError(f"{where}['seconds_by_location'] must be a mapping of location to seconds")
        for loc, seconds in by_location.items():
            seconds = _number(seconds, f"{where}['seconds_by_location'][{loc!r}]")
            if seconds:
                segments[str(loc)] = seconds
    relative = policy.get("relative_to_perfect")
    return {
        "name": str(name),
        "total": total,
        "segments": segments,
        "relative": None if total is None else _number(relative, f"{where}['relative_to_perfect']"),
        "full_randomization": bool(policy.get("full_randomization", True)),
    }


def _location_colours(locations: list, colormap: Any) -> dict:
    colours = {}
    others = 0
    for loc in locations:
        fixed = _LOCATION_COLOURS.get(loc.lower())
        if fixed is None:
            fixed = colormap(_OTHER_SHADES[others % len(_OTHER_SHADES)])
            others += 1
        colours[loc] = fixed
    return colours


def _time_unit(seconds: Any) -> tuple:
    """("seconds" | "minutes" | "hours", divisor) so that the largest value reads well."""
    top = max((s for s in seconds if s is not None), default=0.0)
    if top >= 2 * 3600:
        return "hours", 3600.0
    if top >= 2 * 60:
        return "minutes", 60.0
    return "seconds", 1.0


def _format_time(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 1:
        return f"{value:.2f}"
    return f"{value:#.3g}"


def _policies_title(result: Mapping[str, Any], width_inches: float) -> str:
    title = str(result.get("scenario") or "policy comparison")
    run = ""
    if result.get("workers") is not None:
        run = f"{result['workers']} workers" + (f", {result['epochs']} epochs" if result.get("epochs") is not None else "")
    subtitle = "; ".join(str(x) for x in (result.get("description"), run) if x)
    if subtitle:
        title += "\n" + textwrap.fill(str(subtitle), width=max(40, int(width_inches * 10)))
    return title


def _sweep_grid(totals: Any, lengths: list) -> list:
    """``total_seconds`` as rows x columns, checked against the swept values. A single key's
    values run across one row; a single column of the same length is accepted too."""
    if not isinstance(totals, Sequence) or not all(isinstance(r, Sequence) and not isinstance(r, str) for r in totals):
        raise ConfigError("result['total_seconds'] must be a list of rows")
    grid = [[_number(v, f"result['total_seconds'][{i}][{j}]") for j, v in enumerate(r)] for i, r in enumerate(totals)]
    if len(lengths) == 1 and len(grid) == lengths[0] and all(len(r) == 1 for r in grid):
        grid = [[r[0] for r in grid]]
    shape = (1, lengths[0]) if len(lengths) == 1 else tuple(lengths)
    if len(grid) != shape[0] or any(len(r) != shape[1] for r in grid):
        found = f"{len(grid)} rows of lengths {sorted({len(r) for r in grid})}"
        raise ConfigError(f"result['total_seconds'] should be {shape[0]} x {shape[1]} to match result['sweep'], found {found}")
    return grid


def _axis_label(axis: Mapping[str, Any]) -> str:
    return f"{axis['key']} ({axis['unit']})" if axis.get("unit") else str(axis["key"])


def _tick_labels(axis: Mapping[str, Any]) -> list:
    return [f"{v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v) for v in axis["values"]]


def _text_colour(rgba: tuple) -> str:
    """Black on light cells, white on dark ones."""
    r, g, b = rgba[:3]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _sweep_title(result: Mapping[str, Any], unit: str, scale: float) -> str:
    title = f"{result.get('policy') or 'policy'} on {result.get('scenario') or 'scenario'}: total time ({unit})"
    perfect = _number(result.get("perfect_seconds"), "result['perfect_seconds']")
    if perfect is not None:
        title += f"\nlower bound (perfect): {_format_time(perfect / scale)} {unit}"
    return title
