"""Reporting shared by the benchmarks and the simulator's experiments: text tables, conditions, JSON, PNG bar plots.

Nothing here knows what is measured: callers pass rows of already-computed values. Missing values are ``None``
and print as ``-`` (a system that did not run, a ratio without a denominator); they are left out of plots.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

Cell = str | int | float | None


def p99(xs: Sequence[float]) -> float:
    """Nearest-rank 99th percentile (the maximum below 100 samples); ValueError for no samples. Integer rank
    arithmetic (ceil(0.99 n) exactly), so every benchmark and simulator table ranks the same sample."""
    if not xs:
        raise ValueError("p99 of no samples")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, -(-99 * len(s) // 100) - 1))]


def fmt_num(x: Cell, digits: int = 3) -> str:
    """Numbers with ``digits`` significant digits (thousands separators above 1000); None -> '-'."""
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], *, title: str | None = None) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned; numbers via :func:`fmt_num`."""
    text_rows = [[c if isinstance(c, str) else fmt_num(c) for c in row] for row in rows]
    for row in text_rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {len(headers)}")
    widths = [max([len(h)] + [len(r[i]) for r in text_rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    parts = [title] if title else []
    parts += [line(headers), "  ".join("-" * w for w in widths)]
    parts += [line(r) for r in text_rows]
    return "\n".join(parts)


def format_conditions(conditions: Mapping[str, Any]) -> str:
    """``key: value`` lines, keys aligned."""
    if not conditions:
        return ""
    w = max(len(k) for k in conditions)
    return "\n".join(f"{k.ljust(w)} : {v}" for k, v in conditions.items())


def save_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON (creating parent dirs); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    return path


def save_bar_panels(
    path: str,
    panels: Mapping[str, Mapping[str, float | None]],
    *,
    title: str = "",
    ylabel: str = "",
    annotate: bool = True,
) -> str:
    """One bar chart per panel (``panel title -> {bar label -> value}``) side by side, saved as PNG.

    Panels keep their own y scale (e.g. prefill and decode throughput differ by 10x). Bars with a None value
    are drawn as absent with an 'n/a' label so every panel lists the same systems. Returns the path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("save_bar_panels needs at least one panel")
    labels: list[str] = []
    for bars in panels.values():
        for k in bars:
            if k not in labels:
                labels.append(k)
    colors = plt.get_cmap("tab10")
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(max(4.0, 3.2 * n), 4.2), squeeze=False)
    for ax, (ptitle, bars) in zip(axes[0], panels.items()):
        vals = [bars.get(k) for k in labels]
        xs = list(range(len(labels)))
        heights = [v if v is not None else 0.0 for v in vals]
        rects = ax.bar(xs, heights, color=[colors(i % 10) for i in xs])
        ax.set_title(ptitle, fontsize=10)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=9)
        if annotate:
            for r, v in zip(rects, vals):
                ax.annotate("n/a" if v is None else fmt_num(v), (r.get_x() + r.get_width() / 2, r.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.margins(y=0.12)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
