"""The hint vocabulary: what an application may say with a request (``kv_transfer_params`` and
vLLM's ``session_id``), read into :class:`Hints` by :func:`parse_hints`. Malformed or unknown keys
are counted, never raised; no value read here appears in a message. What the control plane does
with hints is :mod:`saria.control.hints` (docs/vllm.md has the vocabulary, docs/policy.md the rules).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["Hints", "parse_hints", "MAX_HINT_S", "MAX_SESSION_CHARS"]

MAX_HINT_S = 30 * 86400.0     # the longest retain_s, pin TTL or next_turn_s accepted (30 days)
MAX_SESSION_CHARS = 256       # a session key's longest accepted length

# kv_transfer_params keys of vLLM's other connectors (disaggregated prefill): not hints, not wrong.
_FOREIGN = re.compile(r"^(do_remote_|remote_)|^(tp_size|transfer_id|request_id)$")
_DURATION = re.compile(r"^([0-9]{1,7})([smhd])$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True, slots=True)
class Hints:
    """A request's hints, checked. ``pin``: a TTL in seconds (``math.inf``: until unpinned), None
    for no pin; ``unpin``: ``pin: false``; ``session``: the session key (a string, never logged);
    ``pin_chunks``: the pin covers the request's first that many chunks (None: all; not read from a
    request: a replay's platform pins, :mod:`saria.replay.hints`)."""

    retain_s: float | None = None
    pin: float | None = None
    unpin: bool = False
    session: str | None = None
    next_turn_s: float | None = None
    done: bool = False
    pin_chunks: int | None = None  # pin only the request's first this many chunks (a replay's platform pins)

    @property
    def empty(self) -> bool:
        return (self.retain_s is None and self.pin is None and not self.unpin and self.session is None
                and self.next_turn_s is None and not self.done)


def _seconds(value: Any, *, zero: bool) -> float | None:
    """A number of seconds in (0, MAX_HINT_S] ([0, ...] with ``zero``), else None (malformed)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > MAX_HINT_S or (value == 0 and not zero):
        return None
    return value


def _session(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_CHARS:
        return value
    return None


def _retention(value: Any) -> tuple[float | None, bool]:
    """OpenAI's ``prompt_cache_retention``: ``"in_memory"`` (no retention asked) or a duration such
    as ``"24h"``. Returns (seconds or None, well-formed)."""
    if not isinstance(value, str):
        return None, False
    if value in ("in_memory", "in-memory"):
        return None, True
    m = _DURATION.match(value)
    if m is None:
        return None, False
    seconds = int(m.group(1)) * _UNITS[m.group(2)]
    if not 0 < seconds <= MAX_HINT_S:
        return None, False
    return seconds, True


def parse_hints(params: Any, session_id: Any = None) -> tuple[Hints | None, int]:
    """The hints of a request's ``kv_transfer_params`` (``params``) and vLLM's ``session_id``:
    ``(hints or None, problems)``, ``problems`` counting the malformed or unknown keys ignored.
    Never raises. Keys: ``retain_s`` (seconds), ``pin`` (true, false or a TTL in seconds),
    ``session`` (a string), ``next_turn_s`` (seconds, with a session), ``done`` (a bool);
    OpenAI's ``prompt_cache_retention`` (``"24h"``: retain_s) and ``prompt_cache_key`` (the
    session) when ``retain_s`` or ``session`` is not given. Without a session key,
    ``session_id`` (vLLM's request field) is the session. The keys of vLLM's other connectors
    (``do_remote_*``, ``remote_*``, ...) are skipped silently."""
    problems = 0
    try:
        if params is None:
            params = {}
        if not isinstance(params, Mapping):
            return None, 1
        retain = pin = session = next_turn = None
        unpin = done = False
        for key, value in params.items():
            if not isinstance(key, str):
                problems += 1
            elif key == "retain_s":
                retain = _seconds(value, zero=True)
                problems += retain is None
            elif key == "pin":
                if value is True:
                    pin = math.inf
                elif value is False:
                    unpin = True
                else:
                    pin = _seconds(value, zero=False)
                    problems += pin is None
            elif key == "session":
                session = _session(value)
                problems += session is None
            elif key == "next_turn_s":
                next_turn = _seconds(value, zero=True)
                problems += next_turn is None
            elif key == "done":
                if isinstance(value, bool):
                    done = value
                else:
                    problems += 1
            elif key in ("prompt_cache_retention", "prompt_cache_key"):
                pass  # below: only where the native key is absent
            elif not _FOREIGN.search(key):
                problems += 1
        if "retain_s" not in params and "prompt_cache_retention" in params:
            retain, ok = _retention(params["prompt_cache_retention"])
            problems += not ok
        if "session" not in params and "prompt_cache_key" in params:
            session = _session(params["prompt_cache_key"])
            problems += session is None
        elif "prompt_cache_key" in params and _session(params["prompt_cache_key"]) is None:
            problems += 1
        if session is None and "session" not in params and "prompt_cache_key" not in params:
            session = _session(session_id)  # vLLM's own field; absent or empty is no problem
        if retain == 0.0:
            retain = None
        if next_turn is not None and session is None:
            next_turn = None  # a next turn of no session: nothing to prewarm
            problems += 1
        if done and session is None:
            done = False  # the end of no session: nothing to end
            problems += 1
        if pin is not None and unpin:
            pin = None
        hints = Hints(retain, pin, unpin, session, next_turn, done)
        return (None if hints.empty else hints), problems
    except Exception:  # noqa: BLE001 - a hint is never worth a failed request (a mapping that raises)
        return None, problems + 1
