"""Comparing a run's outputs with plain vLLM that has the same history: bit for bit.

Two things are checked separately (``docs/numerics.md``):

* **Bytes.** Every page saria reloads must be bit-for-bit a page vLLM computed for that chunk:
  the worker's audit (``audit_kv``, :mod:`saria.integrations.vllm.audit`) checks it, on every CPU
  and GPU.
* **Outputs.** Greedy tokens and their logprobs against the reference
  (:mod:`saria.harness.reference`): plain vLLM running the same prompts in the same order, each
  loading exactly the tokens saria's run reused, from pages the reference itself kept when vLLM
  computed them, in the same steps as saria's run computed them. Every step of the reference then
  computes what the same step of saria's run computed, over the same KV, so the outputs must be
  identical: tokens equal, logprobs equal as floats, with no tolerance, on every CPU, whatever its
  cache sizes, ISA or thread count. A difference is saria's (a page in the wrong block, a token
  counted as reused but not loaded, ...), or a reference that could not replay the history (a
  block it never saw computed, or saria's audit named a version it does not hold), which the check
  reports as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

FAITHFUL_COUNTERS = ("missing", "unmatched", "ambiguous")  # each must be 0 on every rank


@dataclass(frozen=True)
class OutputCheck:
    turns: int
    differing: tuple[int, ...]  # turns (0-based) whose tokens or logprobs differ from the reference
    tokens_identical: bool
    gap: float  # largest logprob difference, up to each turn's first differing token
    problems: tuple[str, ...]  # why the reference did not replay saria's history, if it did not

    @property
    def ok(self) -> bool:
        return not self.differing and not self.problems

    def describe(self) -> str:
        what = f"{self.turns} turns against plain vLLM with the same history"
        if self.problems:
            return f"{what}: the REFERENCE DID NOT REPLAY IT ({'; '.join(self.problems)})"
        if not self.differing:
            return f"{what}: tokens identical, logprobs bit-identical"
        turns = ", ".join(str(i + 1) for i in self.differing)
        tokens = "tokens identical" if self.tokens_identical else "TOKENS DIFFER"
        return f"{what}: {tokens}, LOGPROBS DIFFER (by up to {self.gap:.3g}) on turn(s) {turns}"


def logprob_gap(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[bool, float]:
    """(tokens identical, largest logprob difference up to the first differing token) of two turns."""
    same = 0
    for x, y in zip(a["output_tokens"], b["output_tokens"]):
        if x != y:
            break
        same += 1
    identical = list(a["output_tokens"]) == list(b["output_tokens"])
    gap = max((abs(x - y) for x, y in zip(a["logprobs"][:same], b["logprobs"][:same])), default=0.0)
    return identical, gap


def replay_problems(turns: Sequence[Mapping[str, Any]], reference: Mapping[str, Any],
                    indices: Sequence[int]) -> list[str]:
    """Why ``reference`` is not a replay of these turns' history (empty: it is)."""
    problems = []
    counters = reference.get("reference") or []
    if not counters:
        return ["it reported no reference counters (not a reference run)"]
    for name in FAITHFUL_COUNTERS:
        found = sum(rank.get(name, 0) for rank in counters)
        if found:
            problems.append(f"{found} {name} page loads")
    for turn, index in zip(turns, indices):
        loaded = reference["turns"][index]["cached_tokens"]
        if loaded != turn["cached_tokens"]:
            problems.append(f"turn {index + 1} reused {turn['cached_tokens']} tokens, the reference {loaded}")
    return problems


def compare_outputs(turns: Sequence[Mapping[str, Any]], reference: Mapping[str, Any],
                    indices: Sequence[int] | None = None) -> OutputCheck:
    """Check a run's ``turns`` (``TurnResult`` dicts, in order; ``indices``: the reference turns they
    are, default 0, 1, ...) against ``reference``, a replay of that run's history
    (:func:`~saria.harness.reference_runs.replay`)."""
    indices = list(range(len(turns))) if indices is None else list(indices)
    if len(indices) != len(turns):
        raise ValueError(f"{len(turns)} turns but {len(indices)} reference indices")
    if any(not 0 <= i < len(reference["turns"]) for i in indices):
        raise ValueError(f"the reference has {len(reference['turns'])} turns, not {indices}")
    differing, gap, tokens = [], 0.0, True
    for n, (turn, index) in enumerate(zip(turns, indices)):
        target = reference["turns"][index]
        same_tokens, g = logprob_gap(turn, target)
        gap = max(gap, g)
        tokens &= same_tokens
        if not same_tokens or list(turn["logprobs"]) != list(target["logprobs"]):
            differing.append(index)
    return OutputCheck(len(turns), tuple(differing), tokens, gap, tuple(replay_problems(turns, reference, indices)))
