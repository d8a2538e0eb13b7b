"""Reports of replays: a side-by-side table, the JSON and CSV files, and plots.

JSON (``saria replay --json``): ``{"trace": ..., "config": {...}, "results": [record, ...]}`` with
each record exactly the keys of :data:`saria.replay.metrics.RESULT_KEYS`; a metric with no
samples (no eligible request for CHAR, no reload for transfer times) is ``null``. Plots need
matplotlib (``pip install 'saria[plot]'``); without it :class:`PlotUnavailable` says so.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from saria.outputs import OutputError, atomic_output, check_output, write_output
from saria.replay.metrics import RESULT_KEYS

__all__ = ["PLOT_FORMATS", "PlotUnavailable", "check_plot_path", "format_table", "json_text", "plot_results",
           "plot_tradeoffs", "write_csv", "write_json"]

# What a plot path's suffix may name (matplotlib's Agg backend writes these; no suffix: PNG).
PLOT_FORMATS = ("png", "pdf", "svg", "eps", "ps", "jpg", "jpeg")

GiB = 1 << 30

def _ratio(v: float) -> str:
    """Three decimals, or three digits when that would be unreadably long (a budget of 1e-300 DWPD)."""
    return f"{v:.3f}" if abs(v) < 1e6 else f"{v:.3g}"


# (label, key, format) rows of the side-by-side table.
TABLE_ROWS = (
    ("SSD writes (GiB)", "ssd_write_bytes", lambda v: f"{v / GiB:,.1f}"),
    ("normalized writes (x SSD)", "normalized_writes", lambda v: _ratio(v)),
    ("write budget ratio", "write_budget_ratio", lambda v: _ratio(v)),
    ("useful write fraction", "useful_write_fraction", lambda v: f"{v:.2%}"),
    ("SSD reads (GiB)", "ssd_read_bytes", lambda v: f"{v / GiB:,.1f}"),
    ("CHAR", "char_mean", lambda v: f"{v:.2%}"),
    ("retention (vs FD, DRAM-only)", "retention", lambda v: f"{v:.3f}"),
    ("CHAR P25 bad", "char_p25_bad", lambda v: f"{v:.2%}"),
    ("hit ratio (chunks)", "hit_ratio", lambda v: f"{v:.2%}"),
    ("DRAM hit tokens", "dram_hit_tokens", lambda v: f"{v:,}"),
    ("SSD hit tokens", "ssd_hit_tokens", lambda v: f"{v:,}"),
    ("transfer mean (ms)", "transfer_ms_mean", lambda v: f"{v:,.1f}"),
    ("transfer P90 (ms)", "transfer_ms_p90", lambda v: f"{v:,.1f}"),
    ("transfer P25 bad (ms)", "transfer_ms_p25_bad", lambda v: f"{v:,.1f}"),
    ("TTFT mean (ms)", "ttft_ms_mean", lambda v: f"{v:,.1f}"),
    ("TTFT P90 (ms)", "ttft_ms_p90", lambda v: f"{v:,.1f}"),
    ("DRAM evictions", "dram_evictions", lambda v: f"{v:,}"),
    ("promotions (chunks)", "promotions", lambda v: f"{v:,}"),
    ("prewarm reads (GiB)", "prewarm_read_bytes", lambda v: f"{v / GiB:,.1f}"),
    ("prewarm hit tokens", "prewarm_hit_tokens", lambda v: f"{v:,}"),
    ("prewarm wasted tokens", "prewarm_wasted_tokens", lambda v: f"{v:,}"),
)


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _cell(fmt, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and abs(value) >= 1e15:  # a table cell, not a page of digits
        return f"{value:.3g}"
    return fmt(value)


def format_table(results: Sequence[dict]) -> str:
    """Policies side by side, one metric per row."""
    labels = [label for label, _, _ in TABLE_ROWS]
    columns = [[r["policy"]] + [_cell(fmt, r[key]) for _, key, fmt in TABLE_ROWS] for r in results]
    width0 = max(len(label) for label in labels)
    widths = [max(len(cell) for cell in column) for column in columns]
    lines = [" " * width0 + "".join(f"  {c[0]:>{w}}" for c, w in zip(columns, widths))]
    for i, label in enumerate(labels, 1):
        lines.append(f"{label:<{width0}}" + "".join(f"  {c[i]:>{w}}" for c, w in zip(columns, widths)))
    return "\n".join(lines)


def _clean(value):
    """NaN and infinities -> None (JSON has neither), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def json_text(document: dict) -> str:
    """``document`` as strict JSON (NaN and infinities -> null; other non-JSON values as their
    str), indented."""
    return json.dumps(_clean(document), indent=2, allow_nan=False, default=str) + "\n"


def write_json(path: str | Path, trace: str, config: dict, results: Sequence[dict], flag: str | None = None) -> None:
    """``{"trace", "config", "results"}``; every record has exactly :data:`RESULT_KEYS`. Written
    whole or not at all; ``flag`` names the option in errors."""
    for record in results:
        if tuple(record) != RESULT_KEYS:
            raise ValueError(f"result record keys {tuple(record)} are not {RESULT_KEYS}")
    write_output(path, json_text({"trace": trace, "config": config, "results": [dict(r) for r in results]}), flag)


def write_csv(path: str | Path, rows: Iterable[dict], flag: str | None = None) -> None:
    """One row per record; columns are the first record's keys (empty cells for NaN). Written
    whole or not at all; ``flag`` names the option in errors."""
    rows = list(rows)
    if not rows:
        raise ValueError("nothing to write")
    with atomic_output(path, flag, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
                             for k, v in row.items()})


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("matplotlib is not installed, so no plot was drawn: "
                              "pip install 'saria[plot]' (or matplotlib) to draw plots") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_path(path: str | Path) -> Path:
    """``--plot PATH`` checked before any work: writable, and a format the plots can be drawn in."""
    path = check_output(path, "--plot")
    suffix = path.suffix[1:].lower()
    if suffix and suffix not in PLOT_FORMATS:
        raise OutputError(f"--plot {path}: cannot draw a .{suffix} file; name a {', '.join(PLOT_FORMATS)} file")
    return path


def _save(plt, fig, path: str | Path) -> None:
    """Save ``fig`` whole or not at all, in the format its suffix names (PNG without one)."""
    try:
        with atomic_output(path, "--plot", mode="wb") as f:
            fig.savefig(f, dpi=120, format=Path(path).suffix[1:].lower() or "png")
    finally:
        plt.close(fig)


def _num(value) -> float:
    return math.nan if value is None else float(value)


def plot_results(path: str | Path, results: Sequence[dict], title: str) -> None:
    """Bars per policy: SSD writes, CHAR (mean and P25 bad), transfer and TTFT (mean and P90)."""
    plt = _pyplot()
    names = [r["policy"] for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    x = range(len(names))
    axes[0].bar(x, [r["ssd_write_bytes"] / GiB for r in results], color="tab:red")
    axes[0].set_ylabel("SSD writes (GiB)")
    for ax, keys, ylabel in ((axes[1], ("char_mean", "char_p25_bad"), "CHAR"),
                             (axes[2], ("transfer_ms_mean", "transfer_ms_p90"), "transfer (ms)"),
                             (axes[3], ("ttft_ms_mean", "ttft_ms_p90"), "TTFT (ms)")):
        for offset, key in ((-0.2, keys[0]), (0.2, keys[1])):
            ax.bar([i + offset for i in x], [_num(r[key]) for r in results], width=0.4,
                   label=key.replace("_ms", "").replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(plt, fig, path)


def plot_tradeoffs(path: str | Path, rows: Sequence[dict], title: str, series_key: str = "series",
                   label_key: str = "point") -> None:
    """Paper Figures 10/11/13: normalized SSD writes (x) against CHAR P25 bad, mean TTFT and P90
    TTFT (y), one line per series (e.g. the theta_E sweep, the theta_R sweep), points labelled."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series: dict[str, list[dict]] = {}
    for row in rows:
        series.setdefault(str(row[series_key]), []).append(row)
    for name, points in series.items():
        points = sorted(points, key=lambda r: _num(r["normalized_writes"]))
        xs = [_num(r["normalized_writes"]) for r in points]
        for ax, key in zip(axes, ("char_p25_bad", "ttft_ms_mean", "ttft_ms_p90")):
            ax.plot(xs, [_num(r[key]) for r in points], marker="o", label=name)
            for r, x in zip(points, xs):
                ax.annotate(str(r[label_key]), (x, _num(r[key])), fontsize=7, textcoords="offset points",
                            xytext=(3, 3))
    for ax, ylabel in zip(axes, ("CHAR P25 bad", "mean TTFT (ms)", "P90 TTFT (ms)")):
        ax.set_xlabel("normalized SSD writes (x SSD capacity)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(plt, fig, path)
