#!/usr/bin/env python3
"""Check that two versions of ``saria.control`` make exactly the same decisions on a trace.

Each version runs in its own process (``PYTHONPATH`` = its source tree) and records everything the
control plane hands out: every plan, every list of orders (the dataclasses, field by field), every
completion's follow-ups, and at the end the counters, usage, audit, governor history and every
chunk's metadata. The two records must be equal.

Two drivers: ``instant`` (what ``bench_control.py`` does: every order completes ok at once) and
``delayed`` (a seeded driver: completions arrive late and shuffled, some orders fail wholly or in
part, some SSD reads fail, some plans are released or held across the next request, hybrid
commits keep only some checkpoints). The driver only reacts to what the control plane returns, so
equal control planes see equal calls.

    python bench/control_equivalence.py --ref 1e7d69d          # the whole trace, every config
    python bench/control_equivalence.py --ref HEAD~3 --requests 2000 --configs saria,hybrid

``tests/test_control_equivalence.py`` uses the same drivers on a prefix of the trace against
digests recorded from the control plane before the ctrlperf optimizations.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation.jsonl"

# name -> (preset, model or None, DRAM tokens, SSD tokens, governor, policy overrides)
CONFIGS = {
    "saria": ("saria", None, 1_000_000, 10_000_000, False, {}),
    "full-duplicate": ("full-duplicate", None, 1_000_000, 10_000_000, False, {}),
    "lmcache-plus": ("lmcache-plus", None, 1_000_000, 10_000_000, False, {}),
    "hybrid": ("saria", "qwen3-next-80b-a3b", 1_000_000, 10_000_000, False, {}),
    "hybrid-lmcache": ("lmcache-plus", "qwen3-next-80b-a3b", 1_000_000, 10_000_000, False, {}),
    # Small tiers and a short metadata window: SSD evictions, promotion evictions, node reclaim.
    "saria-small": ("saria", None, 200_000, 1_000_000, False, {"metadata_window_s": 120.0, "p_tau_s": 5.0}),
    "full-promotion-small": ("full-promotion", None, 200_000, 1_000_000, False, {"metadata_window_s": 300.0}),
    "hybrid-small": ("saria", "qwen3-next-80b-a3b", 200_000, 1_000_000, False,
                     {"metadata_window_s": 120.0, "unified_metadata": False}),
    "reuse-only": ("reuse-only", None, 1_000_000, 10_000_000, False, {}),
    "dram-only": ("dram-only", None, 1_000_000, 10_000_000, False, {}),
    "gds-only": ("gds-only", None, 1_000_000, 10_000_000, False, {}),
    "governor": ("saria", None, 1_000_000, 10_000_000, True, {}),
}
DRIVERS = ("instant", "delayed")


def load_trace(path: Path, requests: int | None = None) -> list[tuple[float, list[int]]]:
    """Mooncake JSON Lines, sorted by time (as ``bench_control.load_trace``); the first ``requests``."""
    out = []
    with path.open() as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                out.append((record["timestamp"] / 1000.0, list(record["hash_ids"])))
    out.sort(key=lambda r: r[0])
    return out if requests is None else out[:requests]


def make_config(name: str):
    from saria.config import Capacity, Policy, SariaConfig, WriteBudget
    from dataclasses import fields
    preset, model, dram, ssd, governor, overrides = CONFIGS[name]
    if "admission" in {f.name for f in fields(Policy)}:  # the decisions recorded were Eq. 1's alone
        overrides = {"admission": "eq1", **overrides}
    changes = dict(dram=Capacity(tokens=dram), ssd=Capacity(tokens=ssd), policy=Policy.preset(preset, **overrides))
    if governor:
        changes["write_budget"] = WriteBudget(dwpd=20.0, auto=True)
    if model is None:
        return SariaConfig(**changes)
    return SariaConfig.for_model(model, **changes)


def _since_recording(value, name: str) -> bool:
    """A field added after the recordings were taken, at the value every recorded order had: left
    out, so that the recordings still compare (``PromoteOrder.source``: GPU, lazy promotion)."""
    return name == "source" and type(value).__name__ == "PromoteOrder" and value.source == "gpu"


def _plain(value):
    """A dataclass (plan, order, counters ...) as plain tuples, enums as their values."""
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__,) + tuple(_plain(getattr(value, f.name)) for f in fields(value)
                                               if not _since_recording(value, f.name))
    if isinstance(value, tuple | list):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):
        return str(value)  # a Tier (StrEnum) becomes its plain value
    return value


def drive(cp, trace, driver: str, seed: int = 0) -> list:
    """Run ``trace`` through ``cp`` with ``driver``; returns the record of everything handed out."""
    from saria.control import DropOrder, ObjectKey
    log: list = []
    record = log.append
    plan_, commit, complete, release = cp.plan, cp.commit_prefill, cp.complete, cp.release
    if driver == "instant":
        for now, hashes in trace:
            plan = plan_(hashes, now)
            orders = commit(hashes, now, plan)
            record(("plan", _plain(plan)))
            record(("commit", _plain(orders)))
            while orders:
                follow_ups = []
                for order in orders:
                    if type(order) is not DropOrder:
                        done = complete(order.order_id, True, now)
                        record(("complete", order.order_id, _plain(done)))
                        follow_ups += done
                orders = follow_ups
        return log

    rng = random.Random(seed)
    hybrid = cp.config.chunk.hybrid
    pending: list = []  # (due request index, order)
    held = None         # (plan, hashes) planned at one request, committed at the next

    def finish(order, now):
        r = rng.random()
        ok, failed = True, ()
        if r < 0.03:
            ok = False
        elif r < 0.06:
            named = order.kv[:1] if order.kv else ()
            if order.state and rng.random() < 0.5:
                named = (ObjectKey(order.state[0], "state"),)
            failed = named
        record(("complete", order.order_id, ok, _plain(failed), _plain(complete(order.order_id, ok, now, failed))))

    def read_failures(plan):
        ssd = [h for h, s in zip(plan.chunk_hashes, plan.kv_sources) if s == "ssd"]
        if plan.state_source == "ssd" and rng.random() < 0.5:
            return [ObjectKey(plan.state_chunk, "state")]
        return [rng.choice(ssd)] if ssd else []

    def commit_one(plan, hashes, now):
        r = rng.random()
        failed = read_failures(plan) if r < 0.05 else []
        states = None
        if hybrid and rng.random() < 0.2:
            states = range(0, len(hashes), 2)
        orders = commit(hashes, now, plan, failed=failed, states=states)
        record(("commit", plan.plan_id, _plain(failed), _plain(orders)))
        for order in orders:
            if type(order) is not DropOrder:
                pending.append((index + rng.randint(0, 6), order))

    for index, (now, hashes) in enumerate(trace):
        due = [order for at, order in pending if at <= index]
        pending[:] = [(at, order) for at, order in pending if at > index]
        rng.shuffle(due)
        for order in due:
            finish(order, now)
        plan = plan_(hashes, now)
        record(("plan", _plain(plan)))
        if held is not None:
            commit_one(held[0], held[1], now)
            held = None
        r = rng.random()
        if r < 0.04:
            failed = read_failures(plan) if rng.random() < 0.5 else []
            record(("release", plan.plan_id, _plain(failed), _plain(release(plan, now, failed))))
        elif r < 0.08:
            held = (plan, hashes)
        else:
            commit_one(plan, hashes, now)
    end = trace[-1][0] if trace else 0.0
    if held is not None:
        index = len(trace)
        commit_one(held[0], held[1], end)
    while pending:
        due = [order for _, order in pending]
        pending.clear()
        rng.shuffle(due)
        for order in due:
            finish(order, end)
    return log


# Counters added after the recordings were taken (a replay without a restart leaves them at 0):
# left out, so that the recordings still compare.
COUNTERS_SINCE_RECORDING = ("recovered", "recovered_adopted", "recovered_dropped", "ssd_useful_write_bytes",
                            "prewarm_orders", "prewarm_chunks", "prewarm_bytes", "prewarm_bytes_read", "prewarm_failed",
                            "prewarm_hits", "prewarm_wasted", "prewarm_evictions", "learned_scored",
                            "learned_admitted", "learned_fallbacks", "learned_retrains")


def recorded_counters(counters) -> dict:
    """The counters as recorded: every field but those added since (``COUNTERS_SINCE_RECORDING``)."""
    return {k: v for k, v in asdict(counters).items() if k not in COUNTERS_SINCE_RECORDING}


def final_state(cp, trace) -> tuple:
    """Counters, usage, audit, governor history and the metadata of every chunk of ``trace``."""
    keys = sorted({h for _, hashes in trace for h in hashes})
    governor = None if cp.governor is None else (cp.governor.theta_E, tuple(cp.governor.history))
    return (tuple(sorted(recorded_counters(cp.counters()).items())), _plain(cp.usage()), tuple(cp.audit()), governor,
            tuple(_plain(cp.chunk_info(k)) for k in keys))


def run(config_name: str, driver: str, trace) -> tuple[list, tuple]:
    from saria.control import ControlPlane
    cp = ControlPlane(make_config(config_name))
    log = drive(cp, trace, driver)
    return log, final_state(cp, trace)


def digest(log: list) -> str:
    """A stable digest of a record (hash ids are ints, tiers plain strings)."""
    h = hashlib.sha256()
    for entry in log:
        h.update(repr(entry).encode())
    return h.hexdigest()


def _child(args: argparse.Namespace) -> int:
    import saria
    trace = load_trace(args.trace, args.requests)
    start = time.perf_counter()
    log, state = run(args.config, args.driver, trace)
    seconds = time.perf_counter() - start
    with open(args.out, "wb") as f:
        pickle.dump({"saria": saria.__file__, "log": log, "state": state, "seconds": seconds}, f, protocol=5)
    return 0


def _run_side(root: Path, config: str, driver: str, args: argparse.Namespace, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", config, "--driver", driver,
           "--trace", str(args.trace), "--out", str(out)]
    if args.requests is not None:
        cmd += ["--requests", str(args.requests)]
    subprocess.run(cmd, env=env, check=True, cwd=tempfile.gettempdir())
    with open(out, "rb") as f:
        return pickle.load(f)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"entry {i}:\n  baseline {x!r:.600}\n  current  {y!r:.600}"
    return f"lengths differ: baseline {len(a)}, current {len(b)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="1e7d69d", help="git revision of the baseline (default: the control plane "
                                                         "before the ctrlperf optimizations)")
    parser.add_argument("--baseline-root", type=Path, help="a source tree to use as the baseline instead of --ref")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--requests", type=int, help="only the first N requests (default: all)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--drivers", default=",".join(DRIVERS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        baseline = args.baseline_root
        if baseline is None:
            baseline = tmp / "baseline"
            baseline.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.ref, "saria"], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(baseline)], input=archive, check=True)
        failures = 0
        for config in args.configs.split(","):
            for driver in args.drivers.split(","):
                old = _run_side(baseline, config, driver, args, tmp / "old.pickle")
                new = _run_side(ROOT, config, driver, args, tmp / "new.pickle")
                assert old["saria"].startswith(str(baseline)) and new["saria"].startswith(str(ROOT)), \
                    (old["saria"], new["saria"])
                same_log, same_state = old["log"] == new["log"], old["state"] == new["state"]
                verdict = "identical" if same_log and same_state else "DIFFERENT"
                print(f"{config:22s} {driver:8s} {len(new['log']):7d} entries  {verdict}  "
                      f"(baseline {old['seconds']:.2f} s, current {new['seconds']:.2f} s)", flush=True)
                if not same_log:
                    print("  first difference in the record: " + _first_difference(old["log"], new["log"]))
                if not same_state:
                    for part, x, y in zip(("counters", "usage", "audit", "governor", "chunks"), old["state"],
                                          new["state"]):
                        if x != y:
                            print(f"  final {part} differ")
                failures += not (same_log and same_state)
                del old, new
        print("all identical" if not failures else f"{failures} runs differ")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
