#!/usr/bin/env python3
"""Control-plane soak: many long replays with the audit on, until something breaks.

Every policy preset x traces (``synth`` sessions with several seeds, dense and hybrid, and every
trace in ``../shared/traces/``) x capacities relative to the trace's working set (the distinct
chunks it references): ``tiny`` (DRAM 4 chunks, SSD 40), ``medium`` (DRAM 5 %, SSD 50 % of the
working set) and ``large`` (both twice the working set), each with a metadata window that many
requests outlive (2 minutes of replay time) and with the preset's own (1 hour). Each replay
checks every control-plane invariant (``ControlPlane.audit``) every ``--audit-every`` requests and
at the end.

One line per replay, a summary, and exit status 1 if any replay raised or failed the audit (the
first failures are printed with their tracebacks), 0 otherwise.

    python bench/control_soak.py                 # the full soak (about 25 minutes on 2 cores)
    python bench/control_soak.py --quick         # what `make test` runs (a few minutes)
    python bench/control_soak.py --json out.json # also the per-replay records
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.config import POLICY_PRESETS  # noqa: E402
from saria.ssd_dtype import SSD_DTYPES  # noqa: E402
from saria.replay.experiment import Experiment, open_trace  # noqa: E402
from saria.replay.policies import BaseSettings, build_config, parse_policy  # noqa: E402
from saria.replay.replay import ReplaySettings, replay  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces"
CAPACITIES = ("tiny", "medium", "large")
# Every preset, and every admission rule together on saria (the learned sessions, the prefix and
# cost vetoes: no preset runs them).
POLICIES = tuple(POLICY_PRESETS) + ("saria:admission=eq1+session+prefix+cost,prefill_tps=6500,session_p=0.4",)
SHORT_WINDOW_S = 120.0


@dataclass(frozen=True)
class Source:
    """A trace to soak: a file or a ``synth:`` spec, and the model its chunks are sized for."""

    name: str
    spec: str
    model: str = "qwen3-8b"
    window_hours: float = 1.0  # session starts are re-windowed into this many hours


def sources(quick: bool, seeds: list[int]) -> list[Source]:
    out = []
    sessions = 60 if quick else 300
    for seed in seeds:
        spec = f"synth:sessions={sessions},seed={seed},span_hours=1"
        out.append(Source(f"synth{seed}", spec))
        out.append(Source(f"synth{seed}-hybrid", spec, model="qwen3-next-80b-a3b"))
    if TRACES.is_dir():
        for path in sorted(TRACES.glob("*.jsonl")):
            if quick and path.stat().st_size > 2 << 20:
                continue  # the quick run leaves out the 12,000-request Mooncake trace
            out.append(Source(path.stem, str(path)))
    return out


def capacities(level: str, working_tokens: int, chunk_tokens: int) -> tuple[int, int]:
    """(DRAM, SSD) tokens for a capacity level, given the working set in tokens."""
    if level == "tiny":
        return 4 * chunk_tokens, 40 * chunk_tokens
    if level == "medium":
        return max(chunk_tokens, working_tokens // 20), max(chunk_tokens, working_tokens // 2)
    return 2 * working_tokens, 2 * working_tokens


# Set in each worker (fork inherits it): the parsed sources, so traces are read once.
_EXPERIMENTS: dict[str, Experiment] = {}


def experiment(source: Source) -> Experiment:
    if source.name not in _EXPERIMENTS:
        trace = open_trace(source.spec)
        base = BaseSettings(model=source.model)
        _EXPERIMENTS[source.name] = Experiment(trace, source.name, base, ReplaySettings(), arrivals="auto",
                                               window_hours=source.window_hours, progress=False, workers=1)
    return _EXPERIMENTS[source.name]


def run_one(job: tuple[Source, str, str, float | None, int, str]) -> dict:
    source, preset, level, window_s, audit_every, ssd_dtype = job
    record = {"trace": source.name, "model": source.model, "policy": preset, "capacity": level,
              "window_s": window_s, "ssd_dtype": ssd_dtype, "ok": False}
    started = time.perf_counter()
    try:
        exp = experiment(source)
        chunk_tokens = exp.chunk_tokens
        working = len({key for keys in exp.chunks for key in keys}) * chunk_tokens
        dram, ssd = capacities(level, working, chunk_tokens)
        base = BaseSettings(model=source.model, dram_tokens=dram, ssd_tokens=ssd, ssd_dtype=ssd_dtype)
        spec = preset if window_s is None else f"{preset}{',' if ':' in preset else ':'}metadata_window_s={window_s:g}"
        config = build_config(parse_policy(spec), base)
        run = replay(spec, exp.trace, exp.chunks, exp.schedule(None), config, exp.settings, audit=True,
                     audit_every=audit_every)
        c = run.counters
        record.update(requests=c.requests, references=c.references, hits=c.hits, ssd_writes=c.ssd_writes,
                      nodes_created=c.nodes_created, nodes_reclaimed=c.nodes_reclaimed, dram_tokens=dram,
                      ssd_tokens=ssd, working_tokens=working, audit=run.audit)
        record["ok"] = not run.audit
        if run.audit:
            record["error"] = "audit: " + "; ".join(run.audit[:3])
    except Exception as exc:  # the soak reports every failure and goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="a reduced soak (fewer synth sessions and seeds, no Mooncake trace): a few minutes")
    parser.add_argument("--seeds", default=None, help="synth seeds, comma-separated (default 1,2,3; --quick: 1,2)")
    parser.add_argument("--audit-every", type=int, default=None,
                        help="audit after every this many requests (default 100; --quick: 50)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: the CPUs this process may use)")
    parser.add_argument("--json", metavar="PATH", help="also write every replay's record as JSON")
    parser.add_argument("--ssd-dtype", choices=SSD_DTYPES, default="auto",
                        help="the SSD tier's format (fp8: the control plane counts FP8 sizes on the SSD side)")
    args = parser.parse_args(argv)
    try:
        seeds = [int(s) for s in (args.seeds or ("1,2" if args.quick else "1,2,3")).split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be integers separated by commas, got {args.seeds!r}")
    audit_every = args.audit_every if args.audit_every is not None else (50 if args.quick else 100)
    if audit_every < 1:
        parser.error(f"--audit-every must be >= 1, got {audit_every}")
    if args.json:
        target = Path(args.json).resolve().parent
        if not target.is_dir():
            parser.error(f"--json: no such directory {target}")

    jobs = [(source, preset, level, window, audit_every, args.ssd_dtype)
            for source in sources(args.quick, seeds)
            for level in CAPACITIES
            for window in (SHORT_WINDOW_S, None)
            for preset in POLICIES
            if not (args.quick and window is None and level != "medium")]
    workers = args.workers or len(os.sched_getaffinity(0))
    print(f"control soak: {len(jobs)} replays on {workers} processes, audit every {audit_every} requests",
          flush=True)
    started = time.perf_counter()
    records = []
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ctx.Pool(workers) as pool:
        for record in pool.imap(run_one, jobs):
            records.append(record)
            status = "ok  " if record["ok"] else "FAIL"
            detail = (f"{record.get('requests', 0):6d} req {record.get('references', 0):8d} refs "
                      f"{record.get('nodes_reclaimed', 0):7d} reclaimed" if record["ok"] else record["error"][:160])
            window = "short" if record["window_s"] else "preset"
            print(f"{status} {record['trace']:<28} {record['policy']:<15} {record['capacity']:<6} window {window:<6} "
                  f"{detail} ({record['seconds']:.1f} s)", flush=True)
    failures = [r for r in records if not r["ok"]]
    elapsed = time.perf_counter() - started
    print(f"summary: {len(records) - len(failures)} of {len(records)} replays ok, {len(failures)} failed, "
          f"{sum(r.get('requests', 0) for r in records):,} requests, "
          f"{sum(r.get('references', 0) for r in records):,} chunk references, {elapsed:.0f} s")
    for record in failures[:3]:
        print(f"\n--- {record['trace']} {record['policy']} {record['capacity']} window {record['window_s']}:\n"
              f"{record.get('traceback') or record['error']}", file=sys.stderr)
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=1, default=str))
        tmp.replace(args.json)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
