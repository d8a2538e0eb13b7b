#!/usr/bin/env python3
"""Fleet replay on every trace: N = 1, 4, 16, 64 replicas, sticky and random routing, with and
without a shared cluster tier (``saria replay --replicas N --router R --cluster-gb G``).

For every trace in ``../shared/traces/`` (each format ``saria replay`` reads) and ``synth`` (the
paper-statistics trace), under the ``saria`` policy, default bandwidths and prefill speed:

* **Arrivals.** Sessions are re-windowed (inferred by prefix chaining where a trace has no ids)
  and their starts drawn within ``12 h / N``: N replicas serve the trace's sessions N times as
  fast, so each replica sees about the load one server sees at N = 1 (the replicas split the
  trace's load; its sessions are what N servers would each see a 1/N sample of). The router
  spreads arrivals: ``session`` sends all of a session's turns to one replica (by hash), ``random``
  sends each turn to a random replica (seed 0); N = 1 has one row per cluster setting.
* **Capacities per replica.** The paper's per-server DRAM 1M / SSD 10M tokens, scaled down by the
  trace's working set (distinct chunk tokens) against ``synth``'s, so each replica's tiers hold
  the same share of a small trace's context as the paper's server holds of TraceLab's (``synth``:
  1.0; never above the paper's, so the Mooncake trace gets 1M / 10M; at least 16 chunks of DRAM).
  Constant in N. Chunks are 512 tokens, or the trace's block where that is smaller (the agent
  traces' 64-token blocks: their prompts are a few thousand tokens).
* **Cluster tier.** N x the per-replica DRAM bytes (each server lends the pool as much DRAM as its
  own tier holds), 25 GB/s per replica (a 200 Gb/s NIC), admission ``all``; against none.

    python bench/bench_fleet.py                 # the table (a few minutes on 2 cores)
    python bench/bench_fleet.py --json out.json # every record, with each trace's settings
    python bench/bench_fleet.py --quick         # a small synth trace, N = 1 and 4 (a smoke run)

A missing trace folder leaves ``synth``, and says so.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.replay.arrivals import make_schedule  # noqa: E402
from saria.replay.experiment import open_trace  # noqa: E402
from saria.replay.fleet import FleetSettings  # noqa: E402
from saria.replay.fleet_report import FleetJob, format_fleet_table, run_fleets, summarize_fleet  # noqa: E402
from saria.replay.policies import BaseSettings, build_config, parse_policy  # noqa: E402
from saria.replay.replay import ReplaySettings  # noqa: E402
from saria.replay.report import json_text  # noqa: E402
from saria.replay.traces import TraceError, chunk_keys  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
PAPER_DRAM, PAPER_SSD = 1_000_000, 10_000_000
WINDOW_HOURS = 12.0
CLUSTER_GBPS = 25.0


def traces(folder: Path, quick: bool) -> list[str]:
    if quick:
        return ["synth:sessions=30,prompt_tokens=20000,first_prompt_tokens=4000"]
    specs = sorted(str(p) for p in folder.glob("*.jsonl")) if folder.is_dir() else []
    if not specs:
        print(f"note: no traces in {folder}; only synth", file=sys.stderr)
    return specs + ["synth"]


def working_set_tokens(spec: str, chunk_tokens: int) -> tuple[object, list, int]:
    """The trace, its chunk hashes, and its distinct chunk tokens."""
    trace = open_trace(spec)
    chunks = [chunk_keys(r, trace.block_tokens, chunk_tokens) for r in trace.requests]
    return trace, chunks, len({key for keys in chunks for key in keys}) * chunk_tokens


def bench_trace(spec: str, reference_tokens: int, replicas: list[int], jobs: int | None) -> tuple[dict, list[dict]]:
    chunk_tokens = min(BaseSettings().chunk().chunk_tokens, open_trace(spec).block_tokens)
    trace, chunks, tokens = working_set_tokens(spec, chunk_tokens)
    scale = min(1.0, tokens / reference_tokens)
    dram = max(16 * chunk_tokens, round(PAPER_DRAM * scale))
    base = BaseSettings(dram_tokens=dram, ssd_tokens=max(dram, round(PAPER_SSD * scale)), chunk_tokens=chunk_tokens)
    config = build_config(parse_policy("saria"), base)
    dram_bytes = config.dram_bytes
    info = {"trace": spec, "requests": len(trace.requests), "chunk_tokens": chunk_tokens,
            "working_set_tokens": tokens, "scale": scale,
            "dram_tokens": base.dram_tokens, "ssd_tokens": base.ssd_tokens}
    rows = []
    for n in replicas:
        schedule = make_schedule(trace, "rewindow", window_hours=WINDOW_HOURS / n, seed=0)
        fleets = [FleetSettings(n, router, cluster, CLUSTER_GBPS, "all", 0)
                  for router in (("session",) if n == 1 else ("session", "random"))
                  for cluster in (0, n * dram_bytes)]
        runs = run_fleets(trace, chunks, schedule, [FleetJob("saria", config, f) for f in fleets], ReplaySettings(),
                          workers=jobs)
        for run in runs:
            row = summarize_fleet(run)
            row["trace"] = Path(spec).stem if spec.endswith(".jsonl") else spec
            row["window_hours"] = WINDOW_HOURS / n
            rows.append(row)
    return info, rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, default=TRACES, help=f"the trace folder (default {TRACES})")
    parser.add_argument("--json", type=Path, help="write every record and each trace's settings")
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    parser.add_argument("--quick", action="store_true", help="a small synth trace, N = 1 and 4 (a smoke run)")
    args = parser.parse_args()
    replicas = [1, 4] if args.quick else [1, 4, 16, 64]
    chunk_tokens = BaseSettings().chunk().chunk_tokens
    reference = working_set_tokens("synth", chunk_tokens)[2]
    started = time.perf_counter()
    infos, rows = [], []
    for spec in traces(args.traces, args.quick):
        t0 = time.perf_counter()
        try:
            info, trace_rows = bench_trace(spec, reference, replicas, args.jobs)
        except (TraceError, ValueError) as exc:
            print(f"note: {spec}: {exc} (skipped)", file=sys.stderr)
            continue
        info["seconds"] = time.perf_counter() - t0
        print(f"{Path(spec).name}: {info['requests']:,} requests, {info['chunk_tokens']}-token chunks, working set {info['working_set_tokens']:,} tokens "
              f"(x{info['scale']:.3g} of synth): per replica DRAM {info['dram_tokens']:,} / SSD "
              f"{info['ssd_tokens']:,} tokens; {info['seconds']:.1f} s", file=sys.stderr)
        infos.append(info)
        rows += trace_rows
    print(format_fleet_table(rows, trace=True))
    print(f"\n{len(rows)} fleet replays in {time.perf_counter() - started:.0f} s; session starts within 12 h / N, "
          f"cluster tier N x per-replica DRAM at {CLUSTER_GBPS:g} GB/s, admission all")
    if args.json:
        args.json.write_text(json_text({"traces": infos, "results": rows}))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
