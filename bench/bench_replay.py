#!/usr/bin/env python3
"""Replay throughput: the 12K-request Mooncake trace under three policies, end to end.

Times what ``saria replay`` does (parse the trace, compute chunk hashes, build the schedule,
replay every policy through its own ControlPlane in parallel processes, summarize), and splits
out the time in the control plane with ``--profile`` (one policy, in process, under cProfile).

    python bench/bench_replay.py                       # ../shared/traces/mooncake_conversation.jsonl
    python bench/bench_replay.py --jobs 1              # one process: policies one after another
    python bench/bench_replay.py --profile             # where one policy's replay spends its time

The last line printed is JSON: ``{"requests", "policies", "jobs", "load_s", "replay_s", "total_s",
"chunk_refs_per_s"}``. A missing trace file falls back to the synthetic agent-session generator
(paper §5.1 statistics), and says so.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.replay.experiment import Experiment, Point, open_trace  # noqa: E402
from saria.replay.policies import BaseSettings, parse_policy  # noqa: E402
from saria.replay.replay import ReplaySettings, replay  # noqa: E402

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time saria replay on a 12K-request trace with several policies.")
    parser.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace file or synth[:...] spec")
    parser.add_argument("--policy", action="append", help="policies (default saria, full-duplicate, dram-only)")
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: one per CPU)")
    parser.add_argument("--prefill-tps", type=float, default=6500.0)
    parser.add_argument("--profile", action="store_true", help="profile one policy's replay in process")
    args = parser.parse_args(argv)
    policies = args.policy or ["saria", "full-duplicate", "dram-only"]
    spec = args.trace
    if not spec.startswith("synth") and not Path(spec).exists():
        print(f"no trace at {spec}: using the synthetic agent-session trace", file=sys.stderr)
        spec = "synth"

    start = time.perf_counter()
    trace = open_trace(spec)
    exp = Experiment(trace, spec, BaseSettings(), ReplaySettings(prefill_tps=args.prefill_tps), workers=args.jobs,
                     progress=False)
    loaded = time.perf_counter()
    refs = sum(len(c) for c in exp.chunks)
    if args.profile:
        profiler = cProfile.Profile()
        config = exp.config_for(parse_policy(policies[0]))
        profiler.enable()
        replay(policies[0], trace, exp.chunks, exp.schedule(None), config, exp.settings)
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(15)
        print(out.getvalue())
        control = sum(t for (path, _, _), (_, _, t, _, _) in stats.stats.items() if "saria/control" in path)
        total = stats.total_tt
        print(f"{policies[0]}: {total:.2f} s under the profiler, {control / total:.0%} of it in saria/control "
              f"(own time of its functions)")
        start = time.perf_counter()
        trace = open_trace(spec)
        exp = Experiment(trace, spec, BaseSettings(), ReplaySettings(prefill_tps=args.prefill_tps),
                         workers=args.jobs, progress=False)
        loaded = time.perf_counter()
    results, runs = exp.run([Point(p, parse_policy(p)) for p in policies])
    done = time.perf_counter()
    for record in results:
        print(f"{record['policy']:>16}: CHAR {record['char_mean']:.1%}, "
              f"writes {record['ssd_write_bytes'] / 2**30:,.0f} GiB, hit ratio {record['hit_ratio']:.1%}")
    print(json.dumps({"requests": len(trace.requests), "policies": len(policies), "jobs": exp.workers or "auto",
                      "load_s": round(loaded - start, 3), "replay_s": round(done - loaded, 3),
                      "total_s": round(done - start, 3),
                      "chunk_refs_per_s": round(refs * len(policies) / (done - loaded))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
