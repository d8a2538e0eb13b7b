"""A synthetic agent-session trace with the paper's TraceLab statistics (§3, §5.1).

Sessions are independent contexts that grow turn by turn, like a coding agent's: turn 1's prompt
is the system prompt, tools and first message; each later turn's prompt is the previous one plus
the reply and the new input, so it extends the previous prompt (a prefix hit on every earlier
turn). Per session, drawn from one seeded ``random.Random``:

* turns: ``1 + Geometric`` with mean ``requests_per_session`` (the paper: 18.4);
* first prompt: lognormal with mean ``first_prompt_tokens`` (sigma 0.5);
* growth per turn: lognormal (sigma 1.0) whose mean makes the mean prompt over all requests
  ``prompt_tokens`` (the paper: 83.7K): for geometric turns the request-weighted mean prompt is
  ``first + growth * (requests_per_session - 1)``;
* gap before each later turn: lognormal with mean ``interval_s`` (the paper: 112.1 s) and median
  ``interval_median_s`` (default 8 s, the median gap between rounds in the TraceLab sample in
  ``../shared/traces/``: agent tool loops come back within seconds, and a heavy tail of human pauses
  makes the mean);
* a session ends at ``context_limit_tokens`` (the paper: 450K);
* recorded session starts: uniform over ``span_hours`` (only ``--arrivals recorded`` uses them;
  re-windowing draws its own).

Optionally ``shared_prefix_tokens`` of a common system prompt (``prefix_variants`` versions) open
every session, for cross-session reuse; the paper's reconstruction has none, so the default is 0.
Block ids are fresh integers per session (prefix-chained by construction). Same parameters and
seed, same trace.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Callable

from saria.replay.traces import MAX_GAP_S, MAX_SPAN_S, MAX_TOKENS, Request, Trace, TraceError

__all__ = ["SessionStats", "fresh_ids", "synthesize", "parse_synth_spec"]


# Each field's range: (low, high); fields in _POSITIVE must exceed low, the others may equal it.
# The highs keep a trace replayable: prompts no model could hold, a span beyond what trace files
# may span (saria.replay.traces), or more requests than a replay can hold in memory are refused.
_BOUNDS = {
    "sessions": (0, 1_000_000), "requests_per_session": (1, 10_000), "prompt_tokens": (0, MAX_TOKENS),
    "first_prompt_tokens": (0, MAX_TOKENS), "interval_s": (1e-3, MAX_GAP_S),
    "interval_median_s": (1e-3, MAX_GAP_S),
    "output_tokens": (0, MAX_TOKENS), "context_limit_tokens": (0, MAX_TOKENS), "span_hours": (0, MAX_SPAN_S / 3600),
    "shared_prefix_tokens": (0, MAX_TOKENS), "prefix_variants": (0, 10_000), "block_tokens": (0, MAX_TOKENS),
    "seed": (0, 2**64 - 1),
}
_POSITIVE = frozenset(("sessions", "prompt_tokens", "first_prompt_tokens", "interval_s", "interval_median_s",
                       "context_limit_tokens", "span_hours", "prefix_variants", "block_tokens"))
MAX_BLOCK_REFERENCES = 100_000_000  # block ids over all requests: about 1 GB of tuples


@dataclass(frozen=True)
class SessionStats:
    sessions: int = 350
    requests_per_session: float = 18.4
    prompt_tokens: float = 83_700.0
    first_prompt_tokens: float = 30_000.0
    interval_s: float = 112.1
    interval_median_s: float = 8.0
    output_tokens: float = 500.0
    context_limit_tokens: int = 450_000
    span_hours: float = 12.0
    shared_prefix_tokens: int = 0
    prefix_variants: int = 1
    block_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            integer = f.type in ("int", int)
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise ValueError(f"synthetic trace: {f.name} must be {'an integer' if integer else 'a number'}, "
                                 f"got {value!r}")
            low, high = _BOUNDS[f.name]
            if not (value > low if f.name in _POSITIVE else value >= low) or not value <= high:
                raise ValueError(f"synthetic trace: {f.name} must be {'>' if f.name in _POSITIVE else '>='} "
                                 f"{low:g} and <= {high:,.0f}, got {value!r}")
        references = self.sessions * self.requests_per_session * min(self.prompt_tokens, self.context_limit_tokens)
        if references / self.block_tokens > MAX_BLOCK_REFERENCES:
            raise ValueError(f"synthetic trace: {self.sessions:,} sessions x {self.requests_per_session:g} requests "
                             f"x {min(self.prompt_tokens, self.context_limit_tokens):,.0f} tokens in "
                             f"{self.block_tokens}-token blocks would hold about "
                             f"{references / self.block_tokens:,.0f} block references, more than "
                             f"{MAX_BLOCK_REFERENCES:,}: ask for fewer sessions or requests, or larger blocks")
        if self.interval_median_s > self.interval_s:
            raise ValueError(f"synthetic trace: interval_median_s ({self.interval_median_s:g}) must not exceed "
                             f"interval_s ({self.interval_s:g}): the gaps are lognormal, whose median is below "
                             f"its mean")
        if self.requests_per_session < 1:
            raise ValueError(f"synthetic trace: requests_per_session must be >= 1, got {self.requests_per_session}")
        if self.prompt_tokens < self.first_prompt_tokens + self.shared_prefix_tokens and self.requests_per_session > 1:
            raise ValueError(f"synthetic trace: prompt_tokens ({self.prompt_tokens:g}) must be at least "
                             f"first_prompt_tokens + shared_prefix_tokens "
                             f"({self.first_prompt_tokens + self.shared_prefix_tokens:g}): prompts only grow")

    @property
    def interval_sigma(self) -> float:
        """The lognormal sigma of the gaps: mean / median = exp(sigma^2 / 2)."""
        return math.sqrt(2.0 * math.log(self.interval_s / self.interval_median_s))

    @property
    def growth_tokens(self) -> float:
        """Mean tokens added per turn so that the request-weighted mean prompt is ``prompt_tokens``."""
        if self.requests_per_session <= 1:
            return 0.0
        return (self.prompt_tokens - self.first_prompt_tokens - self.shared_prefix_tokens) / (
            self.requests_per_session - 1)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw with the given mean (not median)."""
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma) if mean > 0 and sigma > 0 else mean


def _turns(rng: random.Random, mean: float) -> int:
    """1 + Geometric(p) with mean ``mean``."""
    if mean <= 1:
        return 1
    p = 1.0 / mean
    u = 1.0 - rng.random()  # (0, 1]
    return 1 + int(math.log(u) / math.log(1.0 - p))


def fresh_ids() -> Callable[[int], list[int]]:
    """A source of block ids never handed out before: each call ``fresh(n)`` returns the next ``n``
    consecutive integers (from 0), so contexts built from them are prefix-chained by construction."""
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    return fresh


def synthesize(stats: SessionStats = SessionStats()) -> Trace:
    """Generate the trace (see the module docstring)."""
    rng = random.Random(stats.seed)
    block = stats.block_tokens
    fresh = fresh_ids()
    shared_blocks = stats.shared_prefix_tokens // block
    prefixes = [fresh(shared_blocks) for _ in range(stats.prefix_variants)] if shared_blocks else [[]]
    requests: list[Request] = []
    span = stats.span_hours * 3600.0
    growth = stats.growth_tokens
    sigma = stats.interval_sigma
    for s in range(stats.sessions):
        session = f"synth-{s}"
        start = rng.random() * span
        turns = _turns(rng, stats.requests_per_session)
        prefix = rng.choice(prefixes)
        length = shared_blocks * block + max(1, round(_lognormal(rng, stats.first_prompt_tokens, 0.5)))
        kept: list[int] = list(prefix)  # full blocks of the previous prompt: the next one keeps them
        now = start
        for turn in range(turns):
            if turn:
                length += max(1, round(_lognormal(rng, growth, 1.0)))
                now += _lognormal(rng, stats.interval_s, sigma)
            if length > stats.context_limit_tokens:
                break
            # New full blocks and the partial tail are fresh ids: a partial block never shares its
            # id with the full block it becomes in a later turn.
            blocks = kept + fresh(-(-length // block) - len(kept))
            requests.append(Request(now, length, max(0, round(_lognormal(rng, stats.output_tokens, 0.7))),
                                    tuple(blocks), session, 0))
            kept = blocks[:length // block]
    if not requests:
        raise TraceError(f"the synthetic trace has no requests: context_limit_tokens ({stats.context_limit_tokens:,}) "
                         f"is below every session's first prompt (first_prompt_tokens {stats.first_prompt_tokens:,.0f} "
                         f"on average, plus shared_prefix_tokens {stats.shared_prefix_tokens:,})")
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(f"synth(seed={stats.seed})", tuple(requests), block, "synthetic")


def parse_synth_spec(spec: str) -> SessionStats:
    """``synth`` or ``synth:key=value,...`` (keys: the :class:`SessionStats` fields) -> stats."""
    if spec == "synth":
        return SessionStats()
    if not spec.startswith("synth:"):
        raise ValueError(f"not a synthetic trace spec: {spec!r} (use synth or synth:key=value,...)")
    types = {f.name: f.type for f in fields(SessionStats)}
    values: dict[str, object] = {}
    for item in spec[len("synth:"):].split(","):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise ValueError(f"bad synthetic trace setting {item!r}; use key=value with keys "
                             f"{', '.join(types)}")
        if key in values:
            raise ValueError(f"synthetic trace setting {key} is given twice in {spec!r}")
        integer = types[key] in ("int", int)
        try:
            values[key] = int(raw) if integer else float(raw)
        except ValueError:
            raise ValueError(f"synthetic trace setting {key} needs {'an integer' if integer else 'a number'}, "
                             f"got {raw!r}") from None
    return SessionStats(**values)

