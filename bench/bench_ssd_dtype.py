#!/usr/bin/env python3
"""FP8 kv objects on the SSD tier against bf16 (``ssd_dtype`` fp8 vs auto) on every trace.

For every trace in ``../shared/traces/`` (each format ``saria replay`` reads), at the paper's
capacities (DRAM 1M / SSD 10M tokens), one tenth and one hundredth of them (where the small agent
traces first press on SSD), replays the ``saria`` policy with
``ssd_dtype=auto`` and with ``ssd_dtype=fp8`` at the same SSD capacity in bytes (so fp8 holds
~1.94x the kv objects), sessions re-windowed over 12 h as ``bench_policy.py`` does, each with the
DRAM-only and full-duplicate references of its own format for retention. One markdown row per
(trace, capacity):

* ``SSD chunks``: kv objects the SSD holds (capacity / a kv object's SSD bytes);
* ``writes``, ``reads``: SSD GiB written and read (bytes on the drives), and fp8's cut;
* ``DRAM / SSD hits``: hit tokens per tier (millions), and the hit ratio;
* ``CHAR``; ``retention``: ``(CHAR - CHAR_dram-only) / (CHAR_FD - CHAR_dram-only)``, each format
  against its own references, and fp8 against the bf16 references (``fp8 vs bf16 refs``: fp8's
  full duplicate gains too, so its own retention can fall while its CHAR rises);
* ``TTFT``: mean modeled TTFT (ms).

The issue's target (``ok``): no fewer hits, SSD bytes written and the reload bytes per SSD-hit
token fall by >= 45 % (``reads`` shows the total and, after ``/``, the cut per SSD-hit token:
where fp8 turns misses into SSD hits the total falls less, since it reads more chunks).

    python bench/bench_ssd_dtype.py                  # the table (about a minute on 2 cores)
    python bench/bench_ssd_dtype.py --quick          # a small synth trace at one tenth (a smoke run)
    python bench/bench_ssd_dtype.py --json out.json  # every record
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.replay.experiment import Experiment, Point, open_trace  # noqa: E402
from saria.replay.metrics import retention  # noqa: E402
from saria.replay.policies import BaseSettings, parse_policy  # noqa: E402
from saria.replay.replay import ReplaySettings  # noqa: E402
from saria.replay.traces import TraceError  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
GiB = 1 << 30
DTYPES = ("auto", "fp8")
SCALES = ((1.0, "paper capacities"), (0.1, "one tenth"), (0.01, "one hundredth"))
TARGET_CUT = 0.45  # the issue's: SSD bytes written (and read back) fall by at least this much


def replay_pair(spec: str, scale: float, policy: str, jobs: int | None) -> dict[str, dict] | None:
    """``policy`` replayed on ``spec`` with each SSD format: {dtype: result record + ``ssd_chunks``}."""
    try:
        trace = open_trace(spec)
    except TraceError as exc:
        print(f"note: {spec}: {exc} (skipped)", file=sys.stderr)
        return None
    out = {}
    for dtype in DTYPES:
        base = BaseSettings(dram_tokens=int(1_000_000 * scale), ssd_tokens=int(10_000_000 * scale), ssd_dtype=dtype)
        exp = Experiment(trace, spec, base, ReplaySettings(), arrivals="rewindow", workers=jobs, progress=False)
        points = [Point(label, parse_policy(label)) for label in (policy, "dram-only", "full-duplicate")]
        (result, dram_only, fd), (run, _, _) = exp.run(points, desc=f"{Path(spec).name} {dtype}")
        result["ssd_chunks"] = run.config.ssd_bytes // run.config.ssd_kv_bytes
        result["references_char"] = {"dram-only": dram_only["char_mean"], "full-duplicate": fd["char_mean"]}
        out[dtype] = result
    refs = out["auto"]["references_char"]
    out["fp8"]["retention_vs_auto_references"] = retention(out["fp8"]["char_mean"], refs["dram-only"],
                                                           refs["full-duplicate"])
    return out


def cut(auto: float, fp8: float) -> float:
    """fp8's fall against auto (0.4 = 40 % fewer); NaN when auto has none."""
    return 1.0 - fp8 / auto if auto else float("nan")


def verdict(pair: dict[str, dict]) -> dict:
    auto, fp8 = pair["auto"], pair["fp8"]
    hits = [r["dram_hit_tokens"] + r["ssd_hit_tokens"] for r in (auto, fp8)]
    write_cut = cut(auto["ssd_write_bytes"], fp8["ssd_write_bytes"])
    read_cut = cut(auto["ssd_read_bytes"], fp8["ssd_read_bytes"])
    # More SSD hits read more: the reload bytes per SSD-hit token are what the format cuts.
    per_hit = [r["ssd_read_bytes"] / r["ssd_hit_tokens"] if r["ssd_hit_tokens"] else 0.0 for r in (auto, fp8)]
    read_cut_per_hit = cut(*per_hit)
    return {"write_cut": write_cut, "read_cut": read_cut, "read_cut_per_ssd_hit": read_cut_per_hit,
            "hits_kept": hits[1] >= hits[0],
            "ok": hits[1] >= hits[0] and all(c != c or c >= TARGET_CUT for c in (write_cut, read_cut_per_hit))}


def _pct(v: float) -> str:
    return "-" if v != v else f"{v:.1%}"


def _arrow(auto: float, fp8: float, fmt: str) -> str:
    return f"{format(auto, fmt)} -> {format(fp8, fmt)}"


def table(rows: list[tuple[str, str, dict[str, dict]]]) -> str:
    lines = ["| trace | capacity | SSD chunks | writes GiB (cut) | reads GiB (cut / per SSD hit) | DRAM / SSD hits (M tokens) "
             "| hit ratio | CHAR | retention (fp8 vs bf16 refs) | TTFT mean ms | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for trace, scale, pair in rows:
        a, f = pair["auto"], pair["fp8"]
        v = verdict(pair)
        hits = (f"{a['dram_hit_tokens'] / 1e6:,.2f} / {a['ssd_hit_tokens'] / 1e6:,.2f} -> "
                f"{f['dram_hit_tokens'] / 1e6:,.2f} / {f['ssd_hit_tokens'] / 1e6:,.2f}")
        ret = ("-" if a["retention"] != a["retention"] else
               f"{_arrow(a['retention'], f['retention'], '.3f')} ({f['retention_vs_auto_references']:.3f})")
        lines.append(
            f"| {Path(trace).stem} | {scale} | {_arrow(a['ssd_chunks'], f['ssd_chunks'], ',')} "
            f"| {_arrow(a['ssd_write_bytes'] / GiB, f['ssd_write_bytes'] / GiB, ',.1f')} ({_pct(v['write_cut'])}) "
            f"| {_arrow(a['ssd_read_bytes'] / GiB, f['ssd_read_bytes'] / GiB, ',.1f')} ({_pct(v['read_cut'])} / "
            f"{_pct(v['read_cut_per_ssd_hit'])}) "
            f"| {hits} | {_arrow(a['hit_ratio'], f['hit_ratio'], '.2%')} "
            f"| {_arrow(a['char_mean'], f['char_mean'], '.2%')} | {ret} "
            f"| {_arrow(a['ttft_ms_mean'], f['ttft_ms_mean'], ',.1f')} | {'yes' if v['ok'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The saria policy with fp8 kv objects on SSD against bf16 at the "
                                                 "same SSD bytes, on every trace, at the paper's capacities and one "
                                                 "tenth of them.")
    parser.add_argument("--traces", type=Path, default=TRACES, help=f"the trace folder (default {TRACES})")
    parser.add_argument("--policy", default="saria", help="the policy compared (a saria replay --policy spec; "
                                                          "default saria)")
    parser.add_argument("--json", type=Path, help="write every record as JSON")
    parser.add_argument("--jobs", type=int, default=None, help="replays in parallel (default: the CPU count)")
    parser.add_argument("--quick", action="store_true", help="a small synth trace at one tenth capacity (a smoke run)")
    args = parser.parse_args(argv)
    parse_policy(args.policy)  # a bad spec fails before any replay
    start = time.perf_counter()
    if args.quick:
        specs = ["synth:sessions=60"]
    else:
        specs = sorted(str(p) for p in args.traces.glob("*.jsonl")) if args.traces.is_dir() else []
        if not specs:
            print(f"no traces in {args.traces}", file=sys.stderr)
            return 2
    scales = SCALES[1:2] if args.quick else SCALES
    rows = []
    for spec in specs:
        for scale, name in scales:
            pair = replay_pair(spec, scale, args.policy, args.jobs)
            if pair is None:
                continue
            rows.append((spec, name, pair))
            print(f"  {Path(spec).name}, {name}: done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{"trace": t, "capacity": s, "results": p, "verdict": verdict(p)}
                                         for t, s, p in rows], indent=1, default=str))
    print(json.dumps({"traces": len(specs), "rows": len(rows), "all_ok": all(verdict(p)["ok"] for _, _, p in rows),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
