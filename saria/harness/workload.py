"""Agent sessions as token-id prompts: one session of an agent trace (:func:`trace_session`) with
prefixes shared exactly as the trace's requests share them, or a synthetic agent loop
(:func:`synthetic_session`)."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

from saria.harness.model import VOCAB

BLOCK_TOKENS_IN_TRACE = 64  # the agent traces' block size


def block_tokens(hash_id: int | str, n: int = BLOCK_TOKENS_IN_TRACE) -> list[int]:
    """The same pseudo-random tokens for the same trace block, in every prompt that holds it."""
    if not isinstance(hash_id, int):  # string ids: a stable number of their own
        hash_id = int.from_bytes(hashlib.blake2b(str(hash_id).encode(), digest_size=8).digest(), "little")
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def trace_session(path: str | Path, *, turns: int = 12, max_tokens: int = 4000, session: str | None = None
                  ) -> list[list[int]]:
    """Prompts of one session of a ``session_id`` + ``hash_ids`` JSON Lines trace: the first
    session with at least ``turns`` non-empty requests (or ``session``), each prompt rebuilt from
    its blocks and cut to its ``input_length`` (at most ``max_tokens``). The trace is read by
    :func:`saria.replay.traces.load_trace` (Mooncake, 64-token blocks), so a malformed file is a
    :class:`~saria.replay.traces.TraceError` naming its line."""
    from saria.replay.traces import TraceError, load_trace

    trace = load_trace(path, fmt="mooncake", block_tokens=BLOCK_TOKENS_IN_TRACE)
    by_session: dict[str, list] = {}
    for request in sorted(trace.requests, key=lambda r: r.line):  # sessions in the order the file opens them
        if request.session is not None and request.input_tokens > 0:
            by_session.setdefault(request.session, []).append(request)
    for requests in by_session.values():
        requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    if session is not None:
        if session not in by_session:
            raise TraceError(f"session {session!r} is not in {path}")
        requests = by_session[session]
    else:
        long_enough = [r for r in by_session.values() if len(r) >= turns]
        if not long_enough:
            raise TraceError(f"{path} has no session with {turns} non-empty requests")
        requests = long_enough[0]
    prompts = []
    for request in requests[:turns]:
        tokens = [t for h in request.blocks for t in block_tokens(h)]
        prompts.append(tokens[:min(request.input_tokens, max_tokens)])
    return prompts


def synthetic_session(turns: int = 12, *, system_tokens: int = 768, step_tokens: int = 160, seed: int = 0
                      ) -> list[list[int]]:
    """An agent loop: a fixed system prompt, then each turn appends the last tool call and result."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(system_tokens)]
    prompts = []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(step_tokens)]
        prompts.append(list(prompt))
    return prompts
