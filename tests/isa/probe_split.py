"""Does vLLM's CPU attention tile by the emulated L2 size? (tests/isa/l2.py, docs/numerics.md)

Plain vLLM (no saria) on the tests' small dense model runs each turn of a 4-turn session twice:
computed in full, and over its own prefix cache primed with the first ``--prefix`` tokens. Once
the prompt's KV spans more than one attention tile, the two differ in their last bits. The tile is
a function of the L2 size, so the difference must appear at a few hundred tokens under a small
emulated L2 and not with this machine's 2 MiB. One engine per L2 setting; the table gives, per
turn, the largest logprob difference between the two (``-`` for 0, ``tok`` when the greedy tokens
differ too), and what the shim reported from inside the engine process.

    .venv/bin/python tests/isa/probe_split.py                       # native, 2048, 1024, 512, 256 KiB
    .venv/bin/python tests/isa/probe_split.py --isa avx2 --l2 native,512,256
    .venv/bin/python tests/isa/probe_split.py --threads 2 --l2 native,256

``--threads N`` runs the engine with N OpenMP threads (``run_in_subprocess`` pins one; the probe
sets ``SARIA_ENGINE_THREADS`` and also overrides ``OMP_NUM_THREADS`` and
``VLLM_CPU_OMP_THREADS_BIND`` in the child's environment, for harness versions without it). ``--logs DIR`` keeps each engine's stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import l2  # noqa: E402  (tests/isa/l2.py)


@contextmanager
def _environ(extra: dict[str, str]):
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _child_overrides(threads: int, stderr_path: Path | None):
    """run_in_subprocess pins OMP_NUM_THREADS=1 and throws the child's stderr away with its
    temporary folder: for ``threads`` != 1, or to keep the log, change the child's start."""
    real = subprocess.Popen
    if threads == 1 and stderr_path is None:
        yield
        return

    def popen(args, *a, env=None, stderr=None, **kw):
        if env is not None and threads != 1:
            env = dict(env, OMP_NUM_THREADS=str(threads),
                       VLLM_CPU_OMP_THREADS_BIND=f"0-{min(threads, os.cpu_count() or 1) - 1}")
        if stderr_path is not None:
            stderr = open(stderr_path, "w")  # noqa: SIM115 (the child keeps it)
        return real(args, *a, env=env, stderr=stderr, **kw)

    subprocess.Popen = popen
    try:
        yield
    finally:
        subprocess.Popen = real


def run_one(model: str, prompts: list[list[int]], prefixes: list[int], l2_kb: int | None, isa: str | None,
            threads: int, max_tokens: int, log_dir: Path | None, tag: str) -> dict:
    from saria.harness import run_in_subprocess
    from saria.harness.compare import logprob_gap

    with tempfile.TemporaryDirectory(prefix="saria-probe-") as tmp:
        debug = Path(tmp) / "shim.log"
        env = l2.emulation_env(l2_kb, isa)
        if l2_kb is not None:
            env["SARIA_EMULATE_L2_DEBUG"] = str(debug)
        if threads != 1:  # the harness's own knob where it has one (engine_env); _child_overrides otherwise
            env["SARIA_ENGINE_THREADS"] = str(threads)
        spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "enforce_eager": True,
                "prefix_caching": True, "variants": [[0, *prefixes]] * len(prompts)}
        stderr_path = log_dir / f"{tag}.log" if log_dir is not None else None
        t0 = time.perf_counter()
        with _environ(env), _child_overrides(threads, stderr_path):
            result = run_in_subprocess(spec)
        seconds = time.perf_counter() - t0
        shim = debug.read_text().splitlines() if debug.exists() else []
    turns = []
    for index, variants in enumerate(result["variants"]):
        full = variants["0"]
        row = {"prompt_tokens": full["prompt_tokens"], "full": full, "primed": {}}
        for count in prefixes:
            primed = variants[str(count)]
            same, gap = logprob_gap(primed, full)
            row["primed"][count] = {"cached_tokens": primed["cached_tokens"], "tokens_identical": same,
                                    "max_logprob_diff": gap, "result": primed}
        turns.append(row)
    return {"l2_kb": l2_kb, "isa": isa or "native", "threads": threads, "seconds": seconds, "shim": shim,
            "engine_seconds": result.get("seconds"), "turns": turns}


def cell(entry: dict) -> str:
    gap = entry["max_logprob_diff"]
    text = "-" if gap == 0 else f"{gap:.3g}"
    return text if entry["tokens_identical"] else f"{text} tok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--l2", default="native,2048,1024,512,256",
                        help="comma-separated L2 sizes in KiB, or 'native' (no shim)")
    parser.add_argument("--isa", choices=l2.ISAS, default="native")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefix", default="256", help="comma-separated primed prefix lengths (tokens)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=250)
    parser.add_argument("--step-tokens", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--json", type=Path, help="write every result here")
    parser.add_argument("--logs", type=Path, help="keep each engine's stderr in this folder")
    args = parser.parse_args(argv)

    from saria.harness import build_model, synthetic_session

    sizes = [None if s.strip() == "native" else int(s) for s in args.l2.split(",")]
    prefixes = [int(p) for p in args.prefix.split(",")]
    isa = None if args.isa == "native" else args.isa
    prompts = synthetic_session(args.turns, system_tokens=args.system_tokens, step_tokens=args.step_tokens, seed=1)
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="saria-probe-model-") as tmp:
        model = str(build_model(Path(tmp) / "model", "dense"))
        for size in sizes:
            tag = f"l2-{size or 'native'}-{args.isa}-t{args.threads}"
            print(f"{tag}: running ...", flush=True)
            run = run_one(model, prompts, prefixes, size, isa, args.threads, args.max_tokens, args.logs, tag)
            runs.append(run)
            print(f"{tag}: {run['seconds']:.1f} s", flush=True)
            for line in run["shim"]:
                print("   ", line, flush=True)

    lengths = [len(p) for p in prompts]
    print(f"\nISA {args.isa}, {args.threads} OpenMP thread(s); prompts {lengths} tokens; "
          f"largest |logprob difference| over {args.max_tokens} tokens, primed prefix vs full recomputation "
          "('-': bit-identical, 'tok': greedy tokens differ too)\n")
    for count in prefixes:
        header = ["L2 (KiB)", *(f"turn {i + 1} ({n} tok, {count} cached)" for i, n in enumerate(lengths)),
                  "engine run (s)"]
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for run in runs:
            cells = [cell(t["primed"][count]) for t in run["turns"]]
            print(f"| {run['l2_kb'] or 'native (2048)'} | " + " | ".join(cells) + f" | {run['seconds']:.0f} |")
        print()
    # the same full prefill (turn 1 computed in full) across the runs: it changes with the tiling only
    # where a tile ends inside the prompt, and with the thread count
    base = runs[0]
    print(f"full recomputation vs the first run ({base['l2_kb'] or 'native'}): largest |logprob difference| per turn")
    from saria.harness.compare import logprob_gap
    for run in runs[1:]:
        gaps = []
        for a, b in zip(run["turns"], base["turns"]):
            same, gap = logprob_gap(a["full"], b["full"])
            gaps.append(("-" if gap == 0 else f"{gap:.3g}") + ("" if same else " tok"))
        print(f"  {run['l2_kb'] or 'native'}: {', '.join(gaps)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"prompts": lengths, "prefixes": prefixes, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
