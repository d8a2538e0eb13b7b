"""The agent session a TTFT benchmark runs (``bench_cluster_ttft.py``, ``bench_layerwise_ttft.py``):
its command-line arguments, their checks, and its prompts.

Each round is a fresh session: a long system prompt (``--prefix-tokens``), then turns that append
``--step-tokens`` each, on a random-weight Qwen3 of ``--layers`` layers (8192 positions), with
saria's chunk of ``--chunk-tokens``; ``--quick`` makes it a smoke run."""

from __future__ import annotations

import argparse

from saria.harness import synthetic_session

POSITIONS = 8192  # the benchmark model's
TURNS = 2


def add_session_args(p: argparse.ArgumentParser) -> None:
    """The session's arguments (``--layers`` ... ``--rounds``)."""
    p.add_argument("--layers", type=int, default=8, help="layers of the (random-weight Qwen3) model (default 8)")
    p.add_argument("--prefix-tokens", type=int, default=6000, help="the session's system prompt (default 6000)")
    p.add_argument("--step-tokens", type=int, default=300, help="tokens each turn appends (default 300)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="saria's chunk (default 512)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each a fresh session (default 3)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """``--quick`` and ``--json``."""
    p.add_argument("--quick", action="store_true", help="2 layers, a 1500-token prefix, 1 round: a smoke run")
    p.add_argument("--json", help="write the results here")


def check_session_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``--quick`` applied, then every count >= 1 and the session within the model's positions
    (``p.error`` otherwise: exit status 2)."""
    if args.quick:
        args.layers, args.prefix_tokens, args.step_tokens, args.rounds = 2, 1500, 200, 1
    for name in ("layers", "prefix_tokens", "step_tokens", "chunk_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prefix_tokens + TURNS * args.step_tokens + 8 > POSITIONS:
        p.error(f"the session must fit the model's {POSITIONS} positions: lower --prefix-tokens or --step-tokens")
    return args


def session_prompts(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[int]]:
    """The round's session (two turns' prompts, token ids) and an unrelated warm-up prompt of the same length
    (each run begins with it, so no first-step cost lands on a measured turn)."""
    session = synthetic_session(TURNS, system_tokens=args.prefix_tokens, step_tokens=args.step_tokens, seed=seed)
    warm = synthetic_session(1, system_tokens=args.prefix_tokens, step_tokens=args.step_tokens, seed=seed + 10_000)[0]
    return session, warm
