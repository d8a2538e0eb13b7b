#!/usr/bin/env python3
"""Admission policies against the offline ceiling: writes, retention and TTFT on every trace.

For every trace in ``../shared/traces/`` (Mooncake format) and two ``synth`` seeds, at the paper's
capacities (DRAM 1M / SSD 10M tokens) and at one tenth of them, replays (sessions re-windowed over
12 h, as the paper does) the references (DRAM-only, full duplicate), the paper's E2R8 and E3R8,
the offline oracle, and saria's policies, and prints one table:

* ``writes``: SSD GiB written, and the cut against full duplicate;
* ``CHAR``, ``retention``: ``(CHAR - CHAR_dram-only) / (CHAR_FD - CHAR_dram-only)``, ``-`` where
  full duplicate gains nothing (everything fits in DRAM);
* ``useful``: the share of written bytes later read from SSD;
* ``dTTFT``: mean TTFT against the paper's E2R8 in the replay's timing model;
* ``vs paper``: for each policy, whether it is at least as good as E2R8 on both axes (writes and
  retention), and how much of the gap to the oracle it closes on each axis.

    python bench/bench_policy.py                    # the table (a few minutes on 2 cores)
    python bench/bench_policy.py --plot-dir docs/policy   # and a writes-vs-CHAR plot per trace
    python bench/bench_policy.py --json out.json    # every record
    python bench/bench_policy.py --ssd-dtype fp8    # the SSD tier storing FP8 (same SSD bytes; see
                                                    # bench/bench_ssd_dtype.py for fp8 against bf16)

A missing trace folder leaves the two synth seeds, and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.replay.experiment import Experiment, Point, open_trace  # noqa: E402
from saria.replay.policies import BaseSettings, parse_policy  # noqa: E402
from saria.replay.replay import ReplaySettings  # noqa: E402
from saria.replay.traces import TraceError  # noqa: E402
from saria.ssd_dtype import SSD_DTYPES  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
GiB = 1 << 30

# (label, spec): the references first, the paper's thresholds, the ceiling, then saria's.
POLICIES = (
    ("DRAM-only", "dram-only"),
    ("FD", "full-duplicate"),
    ("E2R8 (paper)", "paper"),
    ("E3R8", "paper:theta_E=3"),
    ("oracle", "oracle"),
    ("saria", "saria"),
    ("saria+session", "saria:admission=eq1+deferred+session,session_p=0.4"),
)
SCALES = ((1.0, "paper capacities"), (0.1, "one tenth"))
MARKERS = ("o", "s", "D", "v", "*", "^", "P")  # one per policy, in POLICIES order


def traces(folder: Path) -> list[str]:
    specs = sorted(str(p) for p in folder.glob("*.jsonl")) if folder.is_dir() else []
    if not specs:
        print(f"note: no traces in {folder}; only the synthetic ones", file=sys.stderr)
    return specs + ["synth", "synth:seed=1"]


def replay_all(spec: str, scale: float, jobs: int | None, ssd_dtype: str = "auto") -> list[dict] | None:
    try:
        trace = open_trace(spec)
    except TraceError as exc:
        print(f"note: {spec}: {exc} (skipped)", file=sys.stderr)
        return None
    base = BaseSettings(dram_tokens=int(1_000_000 * scale), ssd_tokens=int(10_000_000 * scale), ssd_dtype=ssd_dtype)
    arrivals = "rewindow"
    try:
        exp = Experiment(trace, spec, base, ReplaySettings(), arrivals=arrivals, workers=jobs, progress=False)
    except (TraceError, ValueError) as exc:
        print(f"note: {spec}: {exc} (skipped)", file=sys.stderr)
        return None
    results, _ = exp.run([Point(label, parse_policy(policy)) for label, policy in POLICIES], desc=Path(spec).name)
    return results


def _closed(value: float, paper: float, oracle: float) -> float:
    """The share of the paper-to-oracle gap ``value`` closes (NaN without a gap)."""
    gap = oracle - paper
    return (value - paper) / gap if abs(gap) > 1e-12 else math.nan


def verdicts(results: dict[str, dict]) -> dict[str, dict]:
    """Per policy: dominates (>= paper on writes and retention), and the gap closed per axis."""
    paper, oracle = results["E2R8 (paper)"], results["oracle"]
    out = {}
    for label, r in results.items():
        writes_ok = r["ssd_write_bytes"] <= paper["ssd_write_bytes"] * (1 + 1e-9)
        char_ok = r["char_mean"] >= paper["char_mean"] - 1e-9
        out[label] = {"dominates": writes_ok and char_ok,
                      "writes_gap_closed": _closed(-r["ssd_write_bytes"], -paper["ssd_write_bytes"],
                                                   -oracle["ssd_write_bytes"]),
                      "char_gap_closed": _closed(r["char_mean"], paper["char_mean"], oracle["char_mean"]),
                      "ttft_change": r["ttft_ms_mean"] / paper["ttft_ms_mean"] - 1.0}
    return out


def _pct(v: float) -> str:
    return "-" if v != v else f"{v:+.0%}"


def table(rows: list[tuple[str, str, dict[str, dict]]]) -> str:
    head = (f"{'trace':<28} {'capacity':<16} {'policy':<14} {'writes GiB':>10} {'vs FD':>6} {'CHAR':>7} "
            f"{'retention':>9} {'useful':>7} {'dTTFT':>6}  vs paper (gap to oracle closed: writes, CHAR)")
    lines = [head, "-" * len(head)]
    for trace, scale, results in rows:
        verdict = verdicts(results)
        fd = results["FD"]["ssd_write_bytes"]
        for label, r in results.items():
            cut = 1.0 - r["ssd_write_bytes"] / fd if fd else math.nan
            ret = r["retention"]
            useful = r["useful_write_fraction"]
            v = verdict[label]
            said = ("" if label in ("DRAM-only", "FD", "E2R8 (paper)", "oracle") else
                    f"{'>=' if v['dominates'] else 'not >='} paper; {_pct(v['writes_gap_closed'])}, "
                    f"{_pct(v['char_gap_closed'])}")
            lines.append(f"{Path(trace).stem:<28} {scale:<16} {label:<14} {r['ssd_write_bytes'] / GiB:>10,.1f} "
                         f"{'-' if cut != cut else f'{-cut:+.0%}':>6} {r['char_mean']:>7.2%} "
                         f"{'-' if ret != ret else f'{ret:.3f}':>9} {'-' if useful != useful else f'{useful:.0%}':>7} "
                         f"{_pct(v['ttft_change']):>6}  {said}")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[tuple[str, str, dict[str, dict]]], folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    by_trace: dict[str, list] = {}
    for trace, scale, results in rows:
        by_trace.setdefault(trace, []).append((scale, results))
    for trace, panels in by_trace.items():
        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
        for ax, (scale, results) in zip(axes[0], panels):
            for (label, r), marker in zip(results.items(), MARKERS):
                # A marker per policy: those on one point (saria is E2R8 under pressure) stay told apart.
                ax.scatter(r["ssd_write_bytes"] / GiB, r["char_mean"] * 100, s=90 if marker == "*" else 45,
                           marker=marker, label=label, alpha=0.8)
            ax.legend(fontsize=7, loc="lower right")
            ax.set_xlabel("SSD writes (GiB)")
            ax.set_ylabel("CHAR (%)")
            ax.set_title(f"{Path(trace).stem}, {scale}", fontsize=10)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"policy_{Path(trace).stem.replace(':', '_').replace('=', '')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Admission policies against the offline oracle on every trace, at "
                                                 "the paper's capacities and one tenth of them.")
    parser.add_argument("--traces", type=Path, default=TRACES, help=f"the trace folder (default {TRACES})")
    parser.add_argument("--json", type=Path, help="write every record as JSON")
    parser.add_argument("--plot-dir", type=Path, help="write a writes-vs-CHAR plot per trace here (needs matplotlib)")
    parser.add_argument("--jobs", type=int, default=None, help="replays in parallel (default: the CPU count)")
    parser.add_argument("--quick", action="store_true", help="a small synth trace at one tenth capacity (a smoke run)")
    parser.add_argument("--ssd-dtype", choices=SSD_DTYPES, default="auto",
                        help="how the SSD tier stores kv objects: auto (bf16, default) or fp8 (0.516x the bytes; the "
                             "SSD capacity stays in bytes, so it holds ~1.94x the chunks)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    specs = ["synth:sessions=60"] if args.quick else traces(args.traces)
    scales = SCALES[1:] if args.quick else SCALES
    rows = []
    for spec in specs:
        for scale, name in scales:
            results = replay_all(spec, scale, args.jobs, args.ssd_dtype)
            if results is None:
                continue
            rows.append((spec, name, {label: r for (label, _), r in zip(POLICIES, results)}))
            print(f"  {Path(spec).name}, {name}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{"trace": t, "capacity": s, "results": r, "verdicts": verdicts(r)}
                                         for t, s, r in rows], indent=1, default=str))
    if args.plot_dir:
        for path in plot(rows, args.plot_dir):
            print(f"plot: {path}", file=sys.stderr)
    print(json.dumps({"traces": len(specs), "replays": len(rows) * len(POLICIES),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
