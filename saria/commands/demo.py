"""``saria demo``: the main job. A multi-turn agent session through real vLLM with saria.

1. Build a small Qwen3 model with real random weights (in a temp dir).
2. Rebuild one session of the Magentic-One agent trace (shipped with saria:
   ``saria/harness/data/``) as token prompts sharing prefixes exactly as the trace's requests do
   (``--trace``: another trace; a generated agent loop when the trace named is missing).
3. Run the turns through vLLM with saria: DRAM and SSD tiers in a temp dir, DRAM sized below the
   session's working set so some turns reload from SSD. Per turn: prompt tokens, tokens reused and
   from which tier, time to first token.
   saria's worker audits every reload (``audit_kv``): each reloaded page must be bit-for-bit a
   page vLLM computed for that chunk.
4. Run the same turns through plain vLLM with the same history (:mod:`saria.harness.reference`):
   a minimal reference connector keeps every page vLLM computes and loads, per turn, exactly the
   tokens saria reused, so every step computes what saria's step computed over the same KV. Its
   outputs must be saria's bit for bit (:func:`saria.harness.compare.compare_outputs`): tokens
   identical and logprobs equal, with no tolerance, on every CPU. Each turn is also computed in
   full (no reuse): the time-to-first-token baseline.
5. Replay the session's chunk sequence through the control plane under ``full-duplicate``: the
   SSD bytes that write-everything caching would have written, next to saria's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from saria.argtypes import int_range
from saria.harness.compare import compare_outputs, logprob_gap
from saria.config import POLICY_PRESETS
from saria.outputs import check_output, write_output

# one session of the Magentic-One agent trace (package data; its license: data/NOTICE)
DEFAULT_TRACE = Path(__file__).resolve().parent.parent / "harness" / "data" / "agent_magentic_one_session.jsonl"
CHUNK_TOKENS = 64  # the agent traces' block: prompts share prefixes in 64-token steps
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # the demo model: 4 layers, K+V, 2 KV heads, head dim 64, bf16
MAX_MODEL_LEN = 8192  # the demo engine's (run_session's default)
MAX_OUTPUT_TOKENS = 1024
MAX_TURNS = 1000
MAX_DRAM_CHUNKS = 1 << 14  # 1 GiB of pinned host memory


def chunk_hashes(prompt: list[int], chunk_tokens: int) -> list[bytes]:
    """Prefix-chained hashes of a prompt's full chunks (as vLLM's block hashes are chained)."""
    out, h = [], b""
    for i in range(len(prompt) // chunk_tokens):
        h = hashlib.sha256(h + str(prompt[i * chunk_tokens:(i + 1) * chunk_tokens]).encode()).digest()
        out.append(h)
    return out


def audit_verdict(worker: dict, hit_tokens: int) -> tuple[bool, str]:
    """Whether every reloaded page was bit-for-bit the page vLLM computed, and the line saying so."""
    audit = worker.get("audit")
    if audit is None:
        return False, "KV bytes: not audited (the worker reported no audit)"
    checked, bad = audit["checked_pages"], audit["mismatched_pages"]
    if bad:
        return False, f"KV bytes: {bad} of {checked} reloaded pages DIFFER from the pages vLLM computed"
    if checked == 0:
        return (False, f"KV bytes: {hit_tokens} tokens were reused but no reloaded page was checked") if hit_tokens \
            else (True, "KV bytes: nothing was reloaded")
    return True, (f"KV bytes: each of the {checked} pages saria reloaded is bit-for-bit the page vLLM computed "
                f"(every attention layer)" + (f"; {audit['unverified_pages']} unverified" if audit["unverified_pages"]
                                              else ""))


def full_duplicate_writes(prompts: list[list[int]], dram_bytes: int, ssd_bytes: int) -> int:
    """SSD bytes the control plane writes for these turns under the full-duplicate preset."""
    from saria.config import Capacity, ChunkSpec, SariaConfig
    from saria.control import ControlPlane, DropOrder

    config = SariaConfig.preset("full-duplicate", dram=Capacity(nbytes=dram_bytes), ssd=Capacity(nbytes=ssd_bytes),
                                chunk=ChunkSpec(chunk_tokens=CHUNK_TOKENS, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                                                checkpoint_tokens=CHUNK_TOKENS))
    cp = ControlPlane(config)
    for now, prompt in enumerate(prompts):
        plan = cp.plan(chunk_hashes(prompt, CHUNK_TOKENS)[:(len(prompt) - 1) // CHUNK_TOKENS], float(now))
        orders = cp.commit_prefill(chunk_hashes(prompt, CHUNK_TOKENS), float(now), plan=plan)
        while orders:
            orders = [f for o in orders if not isinstance(o, DropOrder) for f in cp.complete(o.order_id, True, now)]
    return cp.counters().ssd_bytes_written


def recompute_gap(turns: list[dict], baseline: list[dict]) -> tuple[int, float]:
    """(turns whose tokens differ, largest logprob difference) between saria's turns and the same
    turns computed in full: how much vLLM's own split moves outputs on this CPU (not a verdict)."""
    gaps = [logprob_gap(t, b) for t, b in zip(turns, baseline)]
    return sum(not same for same, _ in gaps), max((g for _, g in gaps), default=0.0)


def main(args: argparse.Namespace) -> int:
    from saria.commands import doctor
    from saria.harness.model import build_model
    from saria.harness.reference_runs import reference_job
    from saria.harness.engine import shared_cache
    from saria.harness.run import run_in_subprocess
    from saria.harness.workload import synthetic_session, trace_session

    if args.json is not None:
        check_output(args.json, "--json")
    trace = Path(args.trace) if args.trace is not None else DEFAULT_TRACE
    if trace.exists():  # read before vLLM starts: a malformed trace is refused here
        prompts = trace_session(trace, turns=args.turns, max_tokens=args.max_prompt_tokens)
        source = f"{trace.name} (the first {len(prompts)} requests of its first session)"
    else:
        prompts = synthetic_session(args.turns)
        source = f"a generated agent loop ({trace} not found)"
    report = doctor.collect()
    device = report["kernel_backend"]
    print(f"saria {report['saria']}: torch {report['torch']['version']}, kernels {device['backend']} on "
          f"{device['device']}, storage {report['storage_backend']}")
    print(f"session: {len(prompts)} turns from {source}, {sum(map(len, prompts))} prompt tokens")

    with tempfile.TemporaryDirectory(prefix="saria-demo-") as tmp, shared_cache(Path(tmp) / "vllm-cache"):
        tmp = Path(tmp)
        model = str(build_model(tmp / "model", "dense"))
        (tmp / "ssd").mkdir()
        dram_bytes = args.dram_chunks * CHUNK_TOKENS * KV_BYTES_PER_TOKEN
        ssd_bytes = 256 << 20
        config = {"chunk_tokens": CHUNK_TOKENS, "dram_bytes": dram_bytes, "ssd_paths": [str(tmp / "ssd")],
                  "ssd_bytes": ssd_bytes, "policy": args.policy, "log_interval_s": 0, "audit_kv": True}
        spec = {"model": model, "prompts": prompts, "max_tokens": args.max_tokens}
        print(f"\n[1/2] vLLM + saria ({args.policy}): DRAM {dram_bytes >> 10} KiB ({args.dram_chunks} chunks of "
              f"{CHUNK_TOKENS} tokens), SSD in {tmp / 'ssd'}", flush=True)
        t0 = time.perf_counter()
        saria = run_in_subprocess(dict(spec, extra_config=config), echo="")
        print(f"      {time.perf_counter() - t0:.0f} s (engine start included)")
        print("[2/2] the same turns through plain vLLM with the same history (each reusing what saria reused, "
              "computed in the same steps), and each computed in full", flush=True)
        t0 = time.perf_counter()
        plain = run_in_subprocess(dict(spec, reference=reference_job(saria, baseline=True)))
        print(f"      {time.perf_counter() - t0:.0f} s")

    turns, base = saria["turns"], plain["baseline"]
    hit = sum(t["cached_tokens"] for t in turns)
    check = compare_outputs(turns, plain)
    bytes_ok, bytes_line = audit_verdict(saria["worker"], hit)
    recompute_differs, recompute_diff = recompute_gap(turns, base)
    control = saria["control"]
    duplicate = full_duplicate_writes(prompts, dram_bytes, ssd_bytes)
    audit = saria["worker"].get("audit")
    result = {
        "requests": len(turns),
        "hit_tokens": hit,
        "dram_hit_tokens": sum(t["dram_tokens"] for t in turns),
        "ssd_hit_tokens": sum(t["ssd_tokens"] for t in turns),
        "ssd_write_bytes": control["ssd_bytes_written"],
        "kv_bytes_identical": bytes_ok,
        "audit": None if audit is None else {k: v for k, v in audit.items() if k != "served"},
        "outputs_ok": check.ok,
        "tokens_identical": check.tokens_identical,
        "differing_turns": [i + 1 for i in check.differing],
        "max_logprob_diff": check.gap,
        "reference": plain["reference"],
        "verdict": check.describe(),
        "recompute_differing_turns": recompute_differs,
        "recompute_max_logprob_diff": recompute_diff,
        "full_duplicate_write_bytes": duplicate,
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "ttft_ms_saria": [round(t["ttft_s"] * 1e3, 1) for t in turns],
        "ttft_ms_recompute": [round(t["ttft_s"] * 1e3, 1) for t in base],
    }
    print(f"\n{'turn':>4} {'prompt':>7} {'reused':>7} {'DRAM':>6} {'SSD':>6} {'TTFT saria':>11} {'TTFT recompute':>15}")
    for i, (t, b) in enumerate(zip(turns, base), 1):
        print(f"{i:>4} {t['prompt_tokens']:>7} {t['cached_tokens']:>7} {t['dram_tokens']:>6} {t['ssd_tokens']:>6} "
              f"{t['ttft_s'] * 1e3:>8.1f} ms {b['ttft_s'] * 1e3:>12.1f} ms")
    print(f"\nreused {hit} of {result['prompt_tokens']} prompt tokens: {result['dram_hit_tokens']} from DRAM, "
          f"{result['ssd_hit_tokens']} from SSD")
    print(f"SSD writes: saria {control['ssd_bytes_written'] / 2**20:.2f} MiB ({control['ssd_writes']} objects: "
          f"{control['admissions_eviction']} at eviction, {control['admissions_reuse']} on reuse, "
          f"{control['admissions_prewrite']} prewritten) vs full-duplicate {duplicate / 2**20:.2f} MiB")
    print(bytes_line)
    print(f"outputs: {check.describe()}")
    print(f"(for information: against full recomputation, {recompute_differs} turn(s) differ in tokens and logprobs "
          f"differ by up to {recompute_diff:.3g}: vLLM's own rounding of a prefix computed in another split on "
          f"this CPU, docs/numerics.md)" if recompute_differs or recompute_diff else
          "(for information: full recomputation gives the same outputs on this CPU too)")
    verdict = bytes_ok and check.ok
    print(f"verdict: {'PASS' if verdict else 'FAIL'}: saria restored the KV vLLM computed"
          + (" and its outputs are vLLM's" if verdict else ""))
    if args.json:
        write_output(args.json, json.dumps(result, indent=2) + "\n", "--json")
        print(f"wrote {args.json}")
    return 0 if verdict else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None, help="agent trace with session_id and hash_ids, 64-token blocks "
                   "(default: the Magentic-One session shipped with saria; a trace named here that is missing: "
                   "a generated agent loop)")
    p.add_argument("--turns", type=int_range(2, MAX_TURNS), default=12,
                   help=f"turns of the session to run, 2 to {MAX_TURNS} (default 12)")
    p.add_argument("--max-tokens", type=int_range(1, MAX_OUTPUT_TOKENS), default=8,
                   help=f"tokens generated per turn, 1 to {MAX_OUTPUT_TOKENS} (default 8)")
    p.add_argument("--max-prompt-tokens", type=int_range(CHUNK_TOKENS, MAX_MODEL_LEN - MAX_OUTPUT_TOKENS),
                   default=3000, help=f"prompts are cut to this length, {CHUNK_TOKENS} to "
                                      f"{MAX_MODEL_LEN - MAX_OUTPUT_TOKENS} (default 3000)")
    p.add_argument("--dram-chunks", type=int_range(1, MAX_DRAM_CHUNKS), default=8,
                   help=f"DRAM tier size in {CHUNK_TOKENS}-token chunks, 1 to {MAX_DRAM_CHUNKS} (default 8: below "
                        f"the session's working set)")
    p.add_argument("--policy", default="saria", choices=POLICY_PRESETS, metavar="POLICY",
                   help="policy preset (default saria; " + ", ".join(POLICY_PRESETS) + ")")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON to PATH")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
