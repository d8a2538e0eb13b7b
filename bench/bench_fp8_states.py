#!/usr/bin/env python3
"""What FP8 GDN states would cost: the hybrid model's outputs after an FP8 round trip of its cache.

``ssd_dtype="fp8"`` stores kv objects (full-attention K and V) as FP8 e4m3 with one float32 scale
per 128 elements and keeps GDN state objects (conv and recurrent state checkpoints) exact. This
bench measures what storing the states that way too would do to the tokens, and what it would save.

On saria's small hybrid model (:func:`saria.harness.model.build_model` ``"hybrid"``: Qwen3-Next with
random bf16 weights, a GDN layer and a full-attention layer alternating), run with transformers on
CPU, for every prompt (random token ids below ``VOCAB``): prefill the first 3/4 (the checkpoint a
reload would restore), then, on a copy of that cache per case, apply the FP8 round trip of
:func:`saria.integrations.vllm.audit.fp8_round_trip` to

* ``exact``: nothing (the reference);
* ``kv``: the attention K and V (what ``ssd_dtype=fp8`` does);
* ``conv`` / ``recurrent``: one kind of GDN state only;
* ``states``: the GDN conv and recurrent states (what the issue asks about);
* ``both``: K, V and the states,

then prefill the rest of the prompt and decode ``--gen`` tokens greedily. Each case is compared with
``exact``: ``match@1/4/16`` (the share of prompts whose first 1/4/16 generated tokens all agree),
``agree`` (the mean share of generated tokens before the first divergence), and ``|Δ logprob|`` of
the generated tokens up to the first divergence (mean, p50, p99, max over every such token of every
prompt), plus the relative RMS error the round trip puts on each kind of tensor.

Groups follow the layouts saria stores (vLLM's): K and V as ``[tokens, heads, head_dim]`` per layer,
the conv state as ``[kernel - 1, conv_dim]`` (transformers keeps ``kernel`` positions, the oldest of
which no later token reads: it is left as is) and the recurrent state as ``[HV, V, K]`` (transformers
keeps ``[HV, K, V]``). A tensor whose element count is not a multiple of 128 has its last group
padded with zeros (zeros leave a group's amax, so its scale, unchanged); the small model's and
Qwen3-Next-80B's states fill whole groups, so no padding happens there.

transformers initializes the GDN decay so that the random model forgets a state within a few tokens
(``A`` in [0, 16]); ``--decay long`` sets ``A`` in [0.001, 0.1] (half-lives of ~5 to ~500 tokens), so
that the checkpointed state still matters when the generated tokens are computed, as in a trained
model's slow heads. Either way a state's error also reaches later tokens through the full-attention
KV computed from it.

The bytes table gives, per model of :mod:`saria.models` with GDN layers, a checkpoint's state bytes as
stored (bf16 conv, fp32 recurrent) and in FP8 (:func:`saria.ssd_dtype.fp8_bytes`), and the share of
SSD bytes the state objects are with a checkpoint every ``--checkpoint-tokens``, with kv in bf16 or FP8.

    python bench/bench_fp8_states.py                  # 24 prompts of 256-1024 tokens (~30 s on 2 idle cores)
    python bench/bench_fp8_states.py --quick          # 2 short prompts, 4 tokens (a smoke run, ~30 s)
    python bench/bench_fp8_states.py --decay long     # GDN heads with long memories
    python bench/bench_fp8_states.py --json out.json  # every record
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from saria.harness.model import VOCAB, build_model  # noqa: E402
from saria.integrations.vllm.audit import fp8_round_trip  # noqa: E402
from saria.models import DTYPE_BYTES, MODELS  # noqa: E402
from saria.ssd_dtype import FP8_GROUP, fp8_bytes  # noqa: E402

# What each case rounds through FP8: a subset of {"kv", "conv", "recurrent"}.
CASES: dict[str, frozenset[str]] = {
    "exact": frozenset(),
    "kv": frozenset({"kv"}),
    "conv": frozenset({"conv"}),
    "recurrent": frozenset({"recurrent"}),
    "states": frozenset({"conv", "recurrent"}),
    "both": frozenset({"kv", "conv", "recurrent"}),
}
KINDS = ("kv", "conv", "recurrent")
MiB = 1 << 20


# --- the round trip on the cache ------------------------------------------------------------------

def round_trip_padded(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` after the FP8 round trip, grouped over its elements in order, and the zeros padded to
    fill the last group (0 when the count is whole groups)."""
    flat = x.contiguous().reshape(-1)
    pad = -flat.numel() % FP8_GROUP
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    out = fp8_round_trip(flat)
    return out[:x.numel()].reshape(x.shape), pad


class RoundTrip:
    """Applies the FP8 round trip in saria's (vLLM's) layouts to a Qwen3-Next ``DynamicCache`` in
    place, and keeps, per kind of tensor, its element count, padding and squared errors."""

    def __init__(self) -> None:
        self.stats = {kind: {"tensors": 0, "elements": 0, "padded": 0, "err2": 0.0, "ref2": 0.0} for kind in KINDS}

    def _apply(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        y, pad = round_trip_padded(x)
        s = self.stats[kind]
        s["tensors"] += 1
        s["elements"] += x.numel()
        s["padded"] += pad
        s["err2"] += float((y.double() - x.double()).square().sum())
        s["ref2"] += float(x.double().square().sum())
        return y

    def cache(self, cache, kinds: frozenset[str], conv_kernel: int) -> None:
        """Round-trip the ``kinds`` of ``cache`` (``layers[i].keys/values`` of attention layers,
        ``layers[i].conv_states[0]`` ``[B, conv_dim, kernel]`` and ``recurrent_states[0]``
        ``[B, HV, K, V]`` of GDN layers)."""
        for layer in cache.layers:
            if hasattr(layer, "recurrent_states"):
                if "conv" in kinds:
                    conv = layer.conv_states[0]
                    live = conv[..., -(conv_kernel - 1):]  # [B, conv_dim, kernel - 1]
                    for b in range(conv.shape[0]):  # one object per sequence: [kernel - 1, conv_dim]
                        conv[b, :, -(conv_kernel - 1):] = self._apply("conv", live[b].transpose(0, 1)).transpose(0, 1)
                if "recurrent" in kinds:
                    rec = layer.recurrent_states[0]
                    for b in range(rec.shape[0]):  # [HV, K, V] -> stored [HV, V, K]
                        rec[b] = self._apply("recurrent", rec[b].transpose(-1, -2)).transpose(-1, -2)
            elif "kv" in kinds and getattr(layer, "keys", None) is not None:
                for name in ("keys", "values"):
                    t = getattr(layer, name)  # [B, heads, tokens, head_dim]
                    for b in range(t.shape[0]):  # stored per token: [tokens, heads, head_dim]
                        t[b] = self._apply("kv", t[b].transpose(0, 1)).transpose(0, 1)

    def summary(self) -> dict[str, dict]:
        return {kind: {"tensors": s["tensors"], "elements": s["elements"], "padded": s["padded"],
                       "rel_rms": math.sqrt(s["err2"] / s["ref2"]) if s["ref2"] else 0.0}
                for kind, s in self.stats.items() if s["tensors"]}


# --- the model runs ---------------------------------------------------------------------------------

@torch.no_grad()
def continue_and_generate(model, cache, rest: torch.Tensor, gen: int) -> tuple[list[int], list[float]]:
    """Prefill ``rest`` on ``cache``, then decode ``gen`` tokens greedily (one forward per token):
    the tokens and their logprobs (fp32 log-softmax of the logits)."""
    tokens, logprobs = [], []
    logits = model(rest, past_key_values=cache, use_cache=True).logits[0, -1]
    for step in range(gen):
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        if step + 1 < gen:
            logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]
    return tokens, logprobs


def compare(ref: tuple[list[int], list[float]], got: tuple[list[int], list[float]]) -> dict:
    """``got`` against the exact run ``ref``: tokens agreeing before the first divergence and the
    |Δ logprob| of those tokens."""
    (rt, rl), (gt, gl) = ref, got
    agree = next((i for i, (a, b) in enumerate(zip(rt, gt)) if a != b), len(rt))
    return {"agree_tokens": agree, "gen": len(rt), "dlogprob": [abs(a - b) for a, b in zip(rl[:agree], gl[:agree])]}


def long_memory(model, seed: int) -> None:
    """Give every GDN head a long memory: ``A_log = log(A)``, ``A`` uniform in [0.001, 0.1], so the
    per-token decay ``exp(-A * softplus(a + dt_bias))`` keeps a state for ~5 to ~500 tokens (half-life).
    transformers initializes ``A`` in [0, 16], so that the random model forgets its state within a
    few tokens; trained models keep slow heads, which is where a state's error lives longest."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = getattr(layer, "linear_attn", None)
            if attn is not None:
                a = torch.empty(attn.A_log.shape).uniform_(0.001, 0.1, generator=gen)
                attn.A_log.copy_(a.log().to(attn.A_log.dtype))


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts of random token ids below ``VOCAB``, lengths uniform in [lo, hi]."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(args) -> dict:
    """Every prompt under every case; returns the records and the per-case summary."""
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "hybrid", "hybrid", seed=args.seed, layers=args.layers)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    if args.decay == "long":
        long_memory(model, args.seed)
    kernel = model.config.linear_conv_kernel_dim
    trips = {case: RoundTrip() for case in args.cases}
    records = []
    t0 = time.time()
    for i, ids in enumerate(prompts(args.prompts, args.min_tokens, args.max_tokens, args.seed)):
        cut = len(ids) * 3 // 4
        with torch.no_grad():
            base = model(torch.tensor([ids[:cut]]), use_cache=True).past_key_values
        outs = {}
        for case in args.cases:
            cache = copy.deepcopy(base)
            trips[case].cache(cache, CASES[case], kernel)
            outs[case] = continue_and_generate(model, cache, torch.tensor([ids[cut:]]), args.gen)
        rec = {"prompt": i, "tokens": len(ids), "prefix": cut, "exact_tokens": outs["exact"][0],
               "cases": {case: compare(outs["exact"], outs[case]) for case in args.cases}}
        records.append(rec)
        agree = " ".join(f"{c}={rec['cases'][c]['agree_tokens']}" for c in args.cases if c != "exact")
        print(f"[{i + 1}/{args.prompts}] {len(ids)} tokens (prefix {cut}) agree: {agree} "
              f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    summary = {case: summarize([r["cases"][case] for r in records], args.gen) | {"round_trip": trips[case].summary()}
               for case in args.cases}
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "records": records, "summary": summary}


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(comparisons: list[dict], gen: int) -> dict:
    """match@k (share of prompts whose first k tokens all agree), agree (mean share before the first
    divergence) and the |Δ logprob| statistics over the agreeing tokens."""
    d = [x for c in comparisons for x in c["dlogprob"]]
    ks = sorted({k for k in (1, 4, 16, gen) if k <= gen})
    return {"prompts": len(comparisons),
            "match": {k: sum(c["agree_tokens"] >= k for c in comparisons) / len(comparisons) for k in ks},
            "agree": sum(c["agree_tokens"] / c["gen"] for c in comparisons) / len(comparisons),
            "dlogprob": {"tokens": len(d), "mean": sum(d) / len(d) if d else float("nan"),
                         "p50": _quantile(d, 0.5), "p99": _quantile(d, 0.99), "max": max(d, default=float("nan"))}}


# --- bytes --------------------------------------------------------------------------------------------

def state_bytes(spec) -> dict:
    """One checkpoint of ``spec`` (every GDN layer's conv and recurrent state) as stored and in FP8,
    and whether each tensor fills whole FP8 groups."""
    conv_el = math.prod(spec.gdn_conv_shape)
    rec_el = math.prod(spec.gdn_temporal_shape)
    conv_eb, rec_eb = DTYPE_BYTES[spec.kv_dtype], DTYPE_BYTES[spec.gdn_state_dtype]
    padded = lambda el: el + (-el % FP8_GROUP)  # noqa: E731 - the last group padded, as the bench does
    conv_fp8 = fp8_bytes(padded(conv_el) * conv_eb, conv_eb)
    rec_fp8 = fp8_bytes(padded(rec_el) * rec_eb, rec_eb)
    return {"conv_elements": conv_el, "recurrent_elements": rec_el,
            "whole_groups": conv_el % FP8_GROUP == 0 and rec_el % FP8_GROUP == 0,
            "stored": spec.gdn_layers * (conv_el * conv_eb + rec_el * rec_eb),
            "fp8": spec.gdn_layers * (conv_fp8 + rec_fp8)}


def bytes_rows(checkpoint_tokens: int) -> list[dict]:
    """Per hybrid model: a checkpoint's bytes and the state objects' share of SSD bytes per
    checkpoint interval (``checkpoint_tokens`` of kv plus one state object)."""
    rows = []
    for name, spec in MODELS.items():
        if not spec.hybrid:
            continue
        st = state_bytes(spec)
        kv = spec.kv_bytes_per_token * checkpoint_tokens
        kv_fp8 = fp8_bytes(kv, DTYPE_BYTES[spec.kv_dtype])
        rows.append({"model": name, "kv_bytes_per_token": spec.kv_bytes_per_token, "checkpoint_tokens": checkpoint_tokens,
                     **st, "kv_per_checkpoint": kv, "kv_fp8_per_checkpoint": kv_fp8,
                     "share_kv_bf16": st["stored"] / (kv + st["stored"]),
                     "share_kv_fp8": st["stored"] / (kv_fp8 + st["stored"]),
                     # SSD bytes per interval: kv fp8 + states exact, against kv fp8 + states fp8
                     "saving_if_states_fp8": 1 - (kv_fp8 + st["fp8"]) / (kv_fp8 + st["stored"])})
    return rows


# --- output -------------------------------------------------------------------------------------------

def table(summary: dict, gen: int) -> str:
    ks = sorted(next(iter(summary.values()))["match"])
    head = " | ".join(f"match@{k}" for k in ks)
    lines = [f"| case (FP8 round trip on) | {head} | agree | |Δ logprob| mean / p50 / p99 / max (tokens) "
             "| rel. RMS error kv / conv / recurrent |",
             "|---|" + "---|" * len(ks) + "---|---|---|"]
    for case, s in summary.items():
        d = s["dlogprob"]
        rt = s["round_trip"]
        err = " / ".join(f"{rt[k]['rel_rms']:.4f}" if k in rt else "-" for k in KINDS)
        lines.append(f"| {case} | " + " | ".join(f"{s['match'][k]:.2f}" for k in ks)
                     + f" | {s['agree']:.3f} | {d['mean']:.4f} / {d['p50']:.4f} / {d['p99']:.4f} / {d['max']:.4f} "
                       f"({d['tokens']}) | {err} |")
    return "\n".join(lines)


def bytes_table(rows: list[dict]) -> str:
    lines = ["| model | state per checkpoint, stored -> FP8 (MiB) | kv per checkpoint bf16 / FP8 (MiB) "
             "| state share of SSD bytes (kv bf16 / kv FP8) | saving if states FP8 too (kv FP8) | whole groups |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['stored'] / MiB:,.1f} -> {r['fp8'] / MiB:,.1f} "
                     f"| {r['kv_per_checkpoint'] / MiB:,.0f} / {r['kv_fp8_per_checkpoint'] / MiB:,.0f} "
                     f"| {r['share_kv_bf16']:.1%} / {r['share_kv_fp8']:.1%} | {r['saving_if_states_fp8']:.1%} "
                     f"| {'yes' if r['whole_groups'] else 'no (last group padded)'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="What FP8 GDN states would cost: greedy tokens and logprobs of saria's small hybrid model "
                    "(Qwen3-Next, random bf16 weights, transformers on CPU) after an FP8 round trip (e4m3, one float32 "
                    "scale per 128 elements) of its cache at 3/4 of each prompt, on the attention KV, the GDN conv "
                    "and/or recurrent states, against the exact cache; plus each hybrid model's checkpoint bytes "
                    "stored vs FP8 and the state objects' share of SSD bytes.",
        epilog="Cases: " + ", ".join(f"{c} ({'+'.join(sorted(k)) or 'none'})" for c, k in CASES.items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="prompts (random token ids)")
    p.add_argument("--min-tokens", type=int, default=256, help="shortest prompt")
    p.add_argument("--max-tokens", type=int, default=1024, help="longest prompt")
    p.add_argument("--gen", type=int, default=16, help="tokens generated greedily per prompt and case")
    p.add_argument("--layers", type=int, default=4, help="model layers (GDN and full attention alternate)")
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES), help="cases ('exact' is always run)")
    p.add_argument("--checkpoint-tokens", type=int, default=16_384, help="tokens per GDN checkpoint (bytes table)")
    p.add_argument("--decay", choices=("init", "long"), default="init",
                   help="GDN decay: transformers' init (A in [0, 16]: a state is forgotten within a few tokens) or "
                        "'long' (A in [0.001, 0.1]: half-lives of ~5-500 tokens, closer to a trained model's slow heads)")
    p.add_argument("--seed", type=int, default=0, help="model weights and prompts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="2 prompts of 32-64 tokens, 4 generated (a smoke run)")
    p.add_argument("--json", metavar="PATH", help="write every record here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.min_tokens, args.max_tokens, args.gen = 2, 32, 64, 4
    if args.min_tokens < 4 or args.max_tokens < args.min_tokens or args.prompts < 1 or args.gen < 1:
        p.error("need 1+ prompts, 1+ generated tokens and 4 <= --min-tokens <= --max-tokens")
    args.cases = ["exact"] + [c for c in dict.fromkeys(args.cases) if c != "exact"]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["bytes"] = bytes_rows(args.checkpoint_tokens)
    print(f"\n{args.prompts} prompts of {args.min_tokens}-{args.max_tokens} tokens, GDN decay '{args.decay}', "
          f"FP8 round trip at 3/4, "
          f"{args.gen} tokens generated greedily; against 'exact':\n")
    print(table(result["summary"], args.gen))
    print(f"\nGDN checkpoint bytes (a checkpoint every {args.checkpoint_tokens:,} tokens):\n")
    print(bytes_table(result["bytes"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"\nrecords: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
