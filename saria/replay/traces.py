"""Request traces: loaders for Mooncake JSON Lines and TraceLab rounds, and chunking.

A :class:`Trace` is a list of :class:`Request`\\ s, each with its recorded arrival (seconds from the
trace start), prompt and output lengths, its prompt's prefix-chained block ids (``block_tokens``
tokens each; the last block may be partial) and its session, if known.

* **Mooncake** (``timestamp`` in ms since the trace start, ``input_length``, ``output_length``,
  ``hash_ids``, optional ``session_id``): a request has ``ceil(input_length / block_tokens)``
  block ids, which is how the block size is checked (or inferred when not given).
* **TraceLab rounds** (``session_id``, ``round_index``, ``input_tokens_total``, ``output_tokens``,
  ``timing_events`` with ISO-8601 timestamps): no block ids, so each session's prefix chain is
  reconstructed from its request lengths, as the paper does: a round's prompt is the first
  ``input_tokens_total`` tokens of its session's context, which it shares with the previous
  round up to the shorter of the two lengths (a shorter round is a truncation of the context);
  the tokens past that are new. Its arrival is its first timing event.

Bad input raises :class:`TraceError` naming the file and line: every malformed line is listed (up
to :data:`MAX_REPORTED`), or with ``skip_bad_lines`` they are left out and reported in
``Trace.skipped`` while every other line is loaded. Timestamps are checked for units
(:func:`check_time_units`): a trace whose spacing only makes sense in another unit is an error
that says which unit it looks like.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Hashable, Sequence

__all__ = ["BLOCK_SIZES", "MAX_GAP_S", "MAX_REPORTED", "MAX_SPAN_S", "MAX_TOKENS", "Request", "Trace", "TraceError",
           "check_time_units", "chunk_keys", "load_trace"]

# Block sizes tried when a Mooncake trace's block size is not given.
BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_REPORTED = 10
TIME_UNITS = {"ms": 1e-3, "s": 1.0}

# Unit checks (check_time_units): how dense or sparse a trace's timestamps may be in its declared
# unit before it is more likely that the unit is wrong.
MAX_REQUESTS_PER_S = 1000.0      # one deployment's trace; denser "ms" are seconds written as ms
MIN_SESSION_GAP_S = 0.05         # median gap between turns of one session
MAX_SPAN_S = 90 * 86_400.0       # a replayable trace spans days, not months
MAX_GAP_S = 30 * 86_400.0        # one silent month inside a trace: mixed units or absolute times

# Range checks on each line's numbers, before any arithmetic: no model holds a prompt (or writes
# an output) of 100M tokens, and a TraceLab round's blocks are built from its length, so a bigger
# one is garbage that would allocate without bound. Timestamps beyond 1e15 (ms: 30,000 years)
# cannot be offsets from a trace's start.
MAX_TOKENS = 100_000_000
MAX_TIMESTAMP = 1e15
MAX_ROUND_INDEX = 10_000_000


class TraceError(ValueError):
    """A trace that cannot be replayed: missing, empty, malformed lines (named by number), or
    timestamps in another unit than declared."""


@dataclass(frozen=True, slots=True)
class Request:
    """One recorded request. ``blocks``: prefix-chained ids of its prompt's blocks (the trace's
    ``block_tokens`` each, the last one possibly partial). ``line``: where it came from (1-based;
    0 for generated requests)."""

    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[Hashable, ...]
    session: str | None = None
    line: int = 0


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order (ties keep file order), their block size, and what was skipped."""

    name: str
    requests: tuple[Request, ...]
    block_tokens: int
    fmt: str  # "mooncake", "tracelab" or "synthetic"
    skipped: tuple[str, ...] = field(default=())  # "path:line: why" for lines left out (skip_bad_lines)

    @property
    def has_sessions(self) -> bool:
        return any(r.session is not None for r in self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0


def chunk_keys(request: Request, block_tokens: int, chunk_tokens: int) -> tuple[Hashable, ...]:
    """The control plane's chunk hashes of ``request``: one per *full* chunk of its prompt, the id of
    the chunk's last block (prefix-chained ids name their whole prefix, so this names the chunk and
    everything before it). ``chunk_tokens`` must be a multiple of ``block_tokens``."""
    if chunk_tokens % block_tokens:
        raise TraceError(f"chunk size {chunk_tokens} tokens is not a multiple of the trace's {block_tokens}-token "
                         f"blocks")
    per = chunk_tokens // block_tokens
    full = request.input_tokens // chunk_tokens
    if per == 1:
        return request.blocks[:full]
    return request.blocks[per - 1:full * per:per]


def _shown(path: str | Path) -> str:
    """``path`` as an error message shows it: quoted where it holds a newline or another character
    that would break the message's one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


# ============================================================================================ loading
def load_trace(path: str | Path, *, block_tokens: int | None = None, time_unit: str = "ms", fmt: str = "auto",
               skip_bad_lines: bool = False, check_units: bool = True) -> Trace:
    """Load a Mooncake JSON Lines trace or a TraceLab rounds file (``fmt="auto"`` looks at the first
    record). ``block_tokens``: the Mooncake block size (inferred from ``hash_ids`` lengths when
    None; the reconstruction's block size for TraceLab, default 64). ``time_unit``: of Mooncake
    ``timestamp`` (``"ms"`` as the format specifies, or ``"s"``)."""
    path = Path(path)
    if time_unit not in TIME_UNITS:
        raise TraceError(f"time unit must be one of {sorted(TIME_UNITS)}, got {time_unit!r}")
    if block_tokens is not None and (isinstance(block_tokens, bool) or not isinstance(block_tokens, int)
                                     or block_tokens < 1):
        raise TraceError(f"block size must be a positive number of tokens, got {block_tokens!r}")
    if not path.exists():
        raise TraceError(f"trace file not found: {_shown(path)}")
    if not path.is_file():
        raise TraceError(f"not a trace file: {_shown(path)}")
    records, bad = _read_json_lines(path)
    if fmt == "auto":
        fmt = _detect_format(path, records, bad)
    if fmt == "mooncake":
        trace = _mooncake(path, records, bad, block_tokens, TIME_UNITS[time_unit], skip_bad_lines)
    elif fmt == "tracelab":
        trace = _tracelab(path, records, bad, block_tokens or 64, skip_bad_lines)
    else:
        raise TraceError(f"unknown trace format {fmt!r}; known: auto, mooncake, tracelab")
    if check_units and fmt == "mooncake":  # TraceLab's ISO-8601 times carry their own units
        check_time_units(trace, time_unit)
    return trace


def _read_json_lines(path: Path) -> tuple[list[tuple[int, object]], list[tuple[int, str]]]:
    """(line number, decoded JSON) of every non-blank line, and (line number, why) of the lines
    that are not JSON."""
    records: list[tuple[int, object]] = []
    bad: list[tuple[int, str]] = []
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    records.append((line_no, json.loads(raw)))
                except (ValueError, UnicodeDecodeError) as exc:
                    bad.append((line_no, f"not JSON ({_short_json_error(exc)})"))
    except OSError as exc:
        raise TraceError(f"cannot read trace {_shown(path)}: {exc}") from None
    if not records and not bad:
        raise TraceError(f"empty trace: {_shown(path)} has no requests")
    return records, bad


def _short_json_error(exc: Exception) -> str:
    text = str(exc)
    return text if len(text) < 80 else text[:77] + "..."


def _detect_format(path: Path, records: list[tuple[int, object]], bad: list[tuple[int, str]]) -> str:
    for _, record in records:
        if isinstance(record, dict):
            if "hash_ids" in record:
                return "mooncake"
            if "input_tokens_total" in record or "round_index" in record:
                return "tracelab"
    where = f"{_shown(path)}:{records[0][0]}" if records else f"{_shown(path)}:{bad[0][0]}"
    raise TraceError(f"{where}: not a Mooncake trace (no 'hash_ids') nor TraceLab rounds (no 'input_tokens_total'); "
                     f"pass --format to say which")


def _finish(path: Path, bad: list[tuple[int, str]], skip: bool) -> tuple[str, ...]:
    """Raise for malformed lines unless skipping; returns the skip report."""
    if not bad:
        return ()
    bad.sort()
    lines = [f"{_shown(path)}:{line}: {why}" for line, why in bad]
    if not skip:
        shown = "\n  ".join(lines[:MAX_REPORTED])
        more = f"\n  ... and {len(lines) - MAX_REPORTED} more" if len(lines) > MAX_REPORTED else ""
        raise TraceError(f"{len(lines)} malformed line(s) in {_shown(path)} (nothing was loaded; "
                         f"--skip-bad-lines loads the others):\n  {shown}{more}")
    return tuple(lines)


def _number(record: dict, key: str, *, integer: bool, maximum: float, required: bool = True) -> float | int | None:
    """``record[key]`` checked to be a number (an integral one if ``integer``) in ``[0, maximum]``;
    ``None`` if it is absent and not ``required``. Any JSON value is judged without arithmetic
    that could overflow (JSON integers have no bound)."""
    if key not in record or record[key] is None:
        if required:
            raise ValueError(f"missing {key!r}")
        return None
    value = record[key]
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key!r} must be {kind}, got {_show(value)}")
    if not (0 <= value <= maximum):  # False for NaN; exact for integers of any size
        raise ValueError(f"{key!r} must be {kind} from 0 to {maximum:,.0f}, got {_show(value)}")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{key!r} must be {kind}, got {_show(value)}")
    return int(value) if integer else float(value)


def _show(value: object) -> str:
    """``value`` for an error message, cut short (a JSON integer may have thousands of digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


# =========================================================================================== Mooncake
def _mooncake(path: Path, records: list[tuple[int, object]], bad: list[tuple[int, str]], block_tokens: int | None,
              unit_s: float, skip: bool) -> Trace:
    parsed: list[tuple[int, float, int, int, tuple, str | None]] = []
    for line_no, record in records:
        try:
            if not isinstance(record, dict):
                raise ValueError(f"a request must be a JSON object, got {type(record).__name__}")
            timestamp = record.get("timestamp")
            if isinstance(timestamp, str):
                raise ValueError(f"'timestamp' must be a number of {'milliseconds' if unit_s == 1e-3 else 'seconds'} "
                                 f"since the trace start, got the string {timestamp[:40]!r}")
            arrival = _number(record, "timestamp", integer=False, maximum=MAX_TIMESTAMP) * unit_s
            input_tokens = _number(record, "input_length", integer=True, maximum=MAX_TOKENS)
            output_tokens = _number(record, "output_length", integer=True, maximum=MAX_TOKENS, required=False) or 0
            ids = record.get("hash_ids")
            if not isinstance(ids, list):
                raise ValueError(f"'hash_ids' must be a list of block ids, got {ids!r:.60}")
            for block in ids:
                if isinstance(block, bool) or not isinstance(block, (int, str)):
                    raise ValueError(f"block ids must be integers or strings, got {block!r:.40}")
            session = record.get("session_id")
            if session is not None and not isinstance(session, (str, int)):
                raise ValueError(f"'session_id' must be a string or an integer, got {session!r:.40}")
            parsed.append((line_no, arrival, input_tokens, output_tokens, tuple(ids),
                           None if session is None else str(session)))
        except ValueError as exc:
            bad.append((line_no, str(exc)))
    if block_tokens is None and parsed:
        block_tokens = _infer_block_tokens(path, parsed)
    requests: list[Request] = []
    parents: dict[Hashable, tuple[Hashable | None, int]] = {}  # block id -> (parent id, first line)
    for line_no, arrival, input_tokens, output_tokens, ids, session in parsed:
        expected = -(-input_tokens // block_tokens)
        if len(ids) != expected:
            bad.append((line_no, f"{len(ids)} hash_ids for input_length {input_tokens}, but {block_tokens}-token "
                                 f"blocks make {expected}: wrong --block-tokens?"))
            continue
        why = _chain_conflict(ids, parents, line_no)
        if why:
            bad.append((line_no, why))
            continue
        requests.append(Request(arrival, input_tokens, output_tokens, ids, session, line_no))
    skipped = _finish(path, bad, skip)
    if not requests:
        raise TraceError(f"empty trace: {_shown(path)} has no requests" + (" left after skipping bad lines" if skipped else ""))
    requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    return Trace(path.name, tuple(requests), block_tokens, "mooncake", skipped)


def _infer_block_tokens(path: Path, parsed: Sequence[tuple]) -> int:
    """The block size for which every request has ``ceil(input_length / B)`` hash_ids."""
    fits = [b for b in BLOCK_SIZES
            if all(len(ids) == -(-n // b) for _, _, n, _, ids, _ in parsed)]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        line, _, n, _, ids, _ = parsed[0]
        raise TraceError(f"{_shown(path)}: cannot infer the block size: no size in {BLOCK_SIZES} gives every request "
                         f"ceil(input_length / size) hash_ids (line {line}: input_length {n}, {len(ids)} hash_ids); "
                         f"pass --block-tokens")
    raise TraceError(f"{_shown(path)}: the block size is ambiguous (any of {fits} tokens fits every request); "
                     f"pass --block-tokens")


def _chain_conflict(ids: tuple, parents: dict, line_no: int) -> str:
    """Record ``ids``' parent links; a reason if they contradict earlier lines (prefix chaining
    means an id always follows the same parent), else ''."""
    parent = None
    for depth, block in enumerate(ids):
        known = parents.get(block)
        if known is None:
            parents[block] = (parent, line_no)
        elif known[0] != parent:
            # Forget what this line added, so the next lines are judged against the good ones.
            for undo in ids[:depth]:
                if parents[undo][1] == line_no:
                    del parents[undo]
            return (f"block id {block!r} (position {depth}) follows {parent!r} here but {known[0]!r} on line "
                    f"{known[1]}: hash_ids are not prefix-chained")
        parent = block
    return ""


# =========================================================================================== TraceLab
def _tracelab(path: Path, records: list[tuple[int, object]], bad: list[tuple[int, str]], block_tokens: int,
              skip: bool) -> Trace:
    rounds: list[tuple[str, int, datetime, int, int, int]] = []
    for line_no, record in records:
        try:
            if not isinstance(record, dict):
                raise ValueError(f"a round must be a JSON object, got {type(record).__name__}")
            session = record.get("session_id")
            if not isinstance(session, str) or not session:
                raise ValueError(f"'session_id' must be a non-empty string, got {session!r:.40}")
            index = _number(record, "round_index", integer=True, maximum=MAX_ROUND_INDEX)
            tokens = _number(record, "input_tokens_total", integer=True, maximum=MAX_TOKENS)
            output = _number(record, "output_tokens", integer=True, maximum=MAX_TOKENS, required=False) or 0
            rounds.append((session, index, _first_event(record), tokens, output, line_no))
        except ValueError as exc:
            bad.append((line_no, str(exc)))
    by_session: dict[str, list[tuple]] = defaultdict(list)
    for r in rounds:
        by_session[r[0]].append(r)
    good: list[list[tuple]] = []
    for session, items in by_session.items():
        items.sort(key=lambda r: r[1])
        kept: list[tuple] = []
        for r in items:
            if kept and r[1] == kept[-1][1]:
                bad.append((r[5], f"round_index {r[1]} of session {session!r} also on line {kept[-1][5]}"))
            elif kept and r[2] < kept[-1][2]:
                bad.append((r[5], f"round {r[1]} of session {session!r} starts at {r[2].isoformat()}, before "
                                  f"round {kept[-1][1]} (line {kept[-1][5]}) at {kept[-1][2].isoformat()}"))
            else:
                kept.append(r)
        good.append(kept)
    skipped = _finish(path, bad, skip)
    if not any(good):
        raise TraceError(f"empty trace: {_shown(path)} has no rounds" + (" left after skipping bad lines" if skipped else ""))
    start = min(r[2] for items in good for r in items)
    requests: list[Request] = []
    next_id = 0
    for items in good:
        prev_len, prev_blocks = 0, ()
        for session, _, when, tokens, output, line_no in items:
            shared = min(prev_len, tokens) // block_tokens  # full blocks shared with the previous round
            count = -(-tokens // block_tokens)
            fresh = count - shared
            blocks = prev_blocks[:shared] + tuple(range(next_id, next_id + fresh))
            next_id += fresh
            requests.append(Request((when - start).total_seconds(), tokens, output, blocks, session, line_no))
            prev_len, prev_blocks = tokens, blocks
    requests.sort(key=lambda r: r.arrival_s)
    return Trace(path.name, tuple(requests), block_tokens, "tracelab", skipped)


def _first_event(record: dict) -> datetime:
    events = record.get("timing_events")
    if not isinstance(events, list) or not events:
        raise ValueError("'timing_events' must be a non-empty list (a round's arrival is its first event)")
    times = []
    for event in events:
        stamp = event.get("timestamp") if isinstance(event, dict) else None
        if not isinstance(stamp, str):
            raise ValueError(f"timing event timestamps must be ISO-8601 strings, got {stamp!r:.40}")
        try:
            when = datetime.fromisoformat(stamp)
        except ValueError:
            raise ValueError(f"timing event timestamp {stamp!r:.40} is not ISO-8601") from None
        if when.tzinfo is None:
            raise ValueError(f"timing event timestamp {stamp!r:.40} has no time zone")
        times.append(when)
    return min(times)


# ============================================================================================== units
def check_time_units(trace: Trace, unit: str) -> None:
    """Raise :class:`TraceError` if the arrivals only make sense in another unit than ``unit``:
    a silent gap over 30 days between two consecutive arrivals (a few lines in other units, or
    absolute times among offsets) or a span over 90 days; and, for milliseconds, more than 1,000
    requests/s over the trace (of 100 or more) or a median gap between a session's turns under
    50 ms (seconds written where milliseconds belong). Milliseconds read as seconds only stretch
    a trace, which the span check catches only past 90 days."""
    requests = trace.requests
    if len(requests) < 2:
        return
    times = [r.arrival_s for r in requests]
    span = times[-1] - times[0]
    other = "seconds" if unit == "ms" else "milliseconds"
    flag = "--time-unit s" if unit == "ms" else "--time-unit ms"
    declared = "milliseconds" if unit == "ms" else "seconds"
    gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(times, times[1:]))]
    widest, where = max(gaps)
    if widest > MAX_GAP_S:
        raise TraceError(f"{trace.name}:{requests[where].line}: arrives {widest / 86_400:,.0f} days after the "
                         f"previous request: timestamps in mixed units (or absolute times among offsets)?")
    if span > MAX_SPAN_S:
        raise TraceError(f"{trace.name}: arrivals span {span / 86_400:,.0f} days read as {declared}: mixed units, "
                         f"absolute times, or not {declared}" + (f" ({flag}?)" if unit == "s" else ""))
    if unit != "ms":
        return
    if span > 0 and len(requests) / span > MAX_REQUESTS_PER_S and len(requests) >= 100:
        raise TraceError(f"{trace.name}: {len(requests):,} requests arrive within {span:.3g} s read as {declared} "
                         f"({len(requests) / span:,.0f} requests/s): the timestamps look like {other}; "
                         f"pass {flag}")
    by_session: dict[str, list[float]] = defaultdict(list)
    for r in requests:
        if r.session is not None:
            by_session[r.session].append(r.arrival_s)
    session_gaps = sorted(b - a for ts in by_session.values() for a, b in zip(ts, ts[1:]))
    if len(session_gaps) >= 10:
        median = session_gaps[len(session_gaps) // 2]
        if median < MIN_SESSION_GAP_S:
            raise TraceError(f"{trace.name}: the median gap between a session's requests is {median * 1e3:.3g} ms "
                             f"read as {declared}: the timestamps look like {other}; pass {flag}")

