"""Comparing a run's outputs with vLLM's own, as exactly as vLLM's arithmetic allows.

Two things are checked separately (``docs/numerics.md`` has the measurements behind this):

* **Bytes.** Every page saria reloads must be bit-for-bit the page vLLM computed: the worker's
  audit (``audit_kv``, :mod:`.audit`) checks it, always exactly, on every CPU and GPU.
* **Outputs.** Greedy tokens and their logprobs against a reference run of plain vLLM whose own
  prefix cache held the same prefix for the turn (primed from an emptied cache: the same split
  of reused and computed tokens, so the same attention work in the step). What can still differ
  is how the reused prefix's KV was computed: by saria's run in earlier turns' steps, by the
  reference in one step of its own. vLLM's CPU attention tiles a step's queries from where the
  step's query starts, and its KV tiles are sized from the L2 cache, so on a CPU where a prefix is
  longer than one tile the same tokens round differently in their last bits when computed in
  another split. That is vLLM's arithmetic, not saria's, and the reference measures it on the
  spot: its own prefix cache against its own full recomputation of the same turns. That largest
  difference is the tolerance. Where vLLM's own two paths agree bit for bit (short prefixes, a
  large L2), the tolerance is zero and saria's outputs must be bit-identical.

Tokens must be identical, except on a turn where vLLM's own two paths already chose different
tokens (a near tie); logprobs are compared up to the first differing token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class OutputCheck:
    turns: int
    same_split_turns: int  # turns compared with a reference that reused exactly as many tokens
    tokens_identical: bool  # every token of every turn (turns at a tie of vLLM's own excepted)
    gap: float  # largest logprob difference from the reference
    vllm_gap: float  # largest logprob difference between vLLM's prefix cache and its full recomputation
    ties: tuple[int, ...]  # turns where vLLM's own two paths chose different tokens

    @property
    def tolerance(self) -> float:
        return self.vllm_gap

    @property
    def ok(self) -> bool:
        return self.tokens_identical and self.gap <= self.tolerance

    def describe(self) -> str:
        what = (f"{self.turns} turns against vLLM's own prefix cache holding the same prefix"
                + ("" if self.same_split_turns == self.turns else
                   f" ({self.turns - self.same_split_turns} against its full recomputation)"))
        tokens = "tokens identical" if self.tokens_identical else "TOKENS DIFFER"
        if self.vllm_gap == 0:
            logprobs = ("logprobs bit-identical" if self.gap == 0 else
                        f"logprobs differ by up to {self.gap:.3g} although vLLM's own paths agree bit for bit")
        else:
            logprobs = (f"largest logprob difference {self.gap:.3g}, within the {self.vllm_gap:.3g} by which vLLM's "
                        f"own prefix cache differs from its full recomputation on this CPU"
                        if self.gap <= self.vllm_gap else
                        f"largest logprob difference {self.gap:.3g}, MORE than the {self.vllm_gap:.3g} by which vLLM's "
                        f"own prefix cache differs from its full recomputation")
        ties = f"; vLLM's own paths chose different tokens on turn(s) {list(self.ties)}" if self.ties else ""
        return f"{what}: {tokens}, {logprobs}{ties}"


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


def _variants(reference: Mapping[str, Any], turn: int) -> dict[int, Mapping[str, Any]]:
    found = reference.get("variants") or []
    if turn >= len(found):
        raise ValueError(f"the reference has no variants for turn {turn}: run it with variants=[[0, ...], ...]")
    return {int(k): v for k, v in found[turn].items()}


def compare_outputs(turns: Sequence[Mapping[str, Any]], reference: Mapping[str, Any],
                    indices: Sequence[int] | None = None) -> OutputCheck:
    """Check a run's ``turns`` (``TurnResult`` dicts, in order; ``indices``: the reference turns they
    are, default 0, 1, ...) against a reference run with ``variants``, each turn with 0 (full
    recomputation) among them; see the module docstring."""
    indices = list(range(len(turns))) if indices is None else list(indices)
    if len(indices) != len(turns):
        raise ValueError(f"{len(turns)} turns but {len(indices)} reference indices")
    vllm_gap, gap, same_split, identical, ties = 0.0, 0.0, 0, True, []
    for index in sorted(set(indices)):  # the tolerance: vLLM's own variants against its recomputation
        variants = _variants(reference, index)
        if 0 not in variants:
            raise ValueError(f"the reference's turn {index} has no full recomputation (variant 0)")
        for count, turn in variants.items():
            if count:
                same_tokens, g = logprob_gap(turn, variants[0])
                vllm_gap = max(vllm_gap, g)
                if not same_tokens:
                    ties.append(index)
    for turn, index in zip(turns, indices):
        variants = _variants(reference, index)
        target = variants.get(turn["cached_tokens"])
        if target is None:
            target = variants[0]
        else:
            same_split += 1
        same_tokens, g = logprob_gap(turn, target)
        gap = max(gap, g)
        if not same_tokens and index not in ties:
            identical = False
    return OutputCheck(len(turns), same_split, identical, gap, vllm_gap, tuple(sorted(set(ties))))
