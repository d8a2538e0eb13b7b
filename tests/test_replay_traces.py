"""Trace loaders: Mooncake JSON Lines and TraceLab rounds, malformed lines, empty traces, units,
block sizes, chunk hashes, the synthetic generator, arrivals and session inference."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from saria.replay.arrivals import infer_sessions, make_schedule, sessions_of
from saria.replay.synth import SessionStats, parse_synth_spec, synthesize
from saria.replay.traces import Request, Trace, TraceError, check_time_units, chunk_keys, load_trace

TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def mooncake_line(ts, n, ids, session=None, **extra) -> str:
    record = {"timestamp": ts, "input_length": n, "output_length": 10, "hash_ids": ids, **extra}
    if session is not None:
        record["session_id"] = session
    return json.dumps(record)


def write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = [
    mooncake_line(0, 130, [1, 2, 3]),               # line 1: 64-token blocks: ceil(130/64) = 3
    mooncake_line(1500, 200, [1, 2, 4, 5]),         # line 2
    "{not json",                                    # line 3
    mooncake_line(2500, 64, [1], "s"),              # line 4
    json.dumps({"timestamp": 3000, "input_length": 64}),  # line 5: no hash_ids
    mooncake_line(3500, 100, [1, 2, 3]),            # line 6: 3 ids but ceil(100/64) = 2
    mooncake_line(4000, 130, [9, 2, 3]),            # line 7: 2 follows 9 here, 1 on line 1
    mooncake_line("12:00", 64, [1]),                # line 8: a string timestamp
    mooncake_line(5000, 128, [1, 2]),               # line 9
]
BAD_LINES = (3, 5, 6, 7, 8)


def test_malformed_lines_are_all_named_and_nothing_is_replayed(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(TraceError) as info:
        load_trace(path, block_tokens=64)
    message = str(info.value)
    assert f"{len(BAD_LINES)} malformed line(s)" in message
    for line in BAD_LINES:
        assert f"{path}:{line}:" in message
    assert f"{path}:1:" not in message and f"{path}:9:" not in message
    assert "not JSON" in message and "'hash_ids'" in message and "wrong --block-tokens" in message
    assert "not prefix-chained" in message and "line 1" in message and "string" in message


def test_skip_bad_lines_keeps_every_good_line(tmp_path):
    path = write(tmp_path, GOOD)
    trace = load_trace(path, block_tokens=64, skip_bad_lines=True)
    assert [r.line for r in trace.requests] == [1, 2, 4, 9]
    assert [int(s.split(":")[1]) for s in (x[len(str(path)):] for x in trace.skipped)] == list(BAD_LINES)
    first, second, third, fourth = trace.requests
    assert first == Request(0.0, 130, 10, (1, 2, 3), None, 1)
    assert second.arrival_s == 1.5 and second.blocks == (1, 2, 4, 5)
    assert third.session == "s" and fourth.blocks == (1, 2)


def test_empty_traces(tmp_path):
    with pytest.raises(TraceError, match="empty trace"):
        load_trace(write(tmp_path, [""], "empty.jsonl"))
    (tmp_path / "zero.jsonl").write_text("")
    with pytest.raises(TraceError, match="empty trace"):
        load_trace(tmp_path / "zero.jsonl")
    with pytest.raises(TraceError, match="no requests left after skipping"):
        load_trace(write(tmp_path, ["{bad", "[1, 2]"], "allbad.jsonl"), fmt="mooncake", skip_bad_lines=True)
    with pytest.raises(TraceError, match="not found"):
        load_trace(tmp_path / "missing.jsonl")


def test_block_size_is_inferred_and_checked(tmp_path):
    path = write(tmp_path, [mooncake_line(0, 1000, list(range(16))), mooncake_line(10, 700, [0, 1, 2, 3, 4, 5, 6,
                                                                                              7, 8, 9, 99])])
    assert load_trace(path).block_tokens == 64
    with pytest.raises(TraceError, match="wrong --block-tokens"):
        load_trace(path, block_tokens=512)
    ambiguous = write(tmp_path, [mooncake_line(0, 10, [0])], "ambiguous.jsonl")
    with pytest.raises(TraceError, match="ambiguous"):
        load_trace(ambiguous)
    assert load_trace(ambiguous, block_tokens=16).block_tokens == 16


def test_timestamps_in_seconds_read_as_milliseconds(tmp_path):
    lines = [mooncake_line(i * 0.5, 64, [i]) for i in range(200)]  # 100 s of requests, written in seconds
    path = write(tmp_path, lines)
    with pytest.raises(TraceError, match=r"look like seconds; pass --time-unit s"):
        load_trace(path, block_tokens=64)
    trace = load_trace(path, block_tokens=64, time_unit="s")
    assert trace.span_s == pytest.approx(99.5)
    assert load_trace(path, block_tokens=64, check_units=False).span_s == pytest.approx(0.0995)


def test_session_gaps_in_seconds_read_as_milliseconds(tmp_path):
    # 3 sessions of 10 turns 5 s apart, in seconds: as ms the turns would be 5 ms apart.
    lines = [mooncake_line(s * 100 + t * 5, 64, [s * 100 + t], f"s{s}") for s in range(3) for t in range(10)]
    with pytest.raises(TraceError, match="median gap between a session's requests"):
        load_trace(write(tmp_path, lines), block_tokens=64)
    assert len(load_trace(write(tmp_path, lines), block_tokens=64, time_unit="s").requests) == 30


def test_mixed_units_name_the_line(tmp_path):
    lines = [mooncake_line(i * 1000, 64, [i]) for i in range(5)]
    lines.append(mooncake_line(1_780_000_000_000, 64, [99]))  # an absolute epoch-ms time among offsets
    with pytest.raises(TraceError, match=r"t.jsonl:6: arrives .* days after"):
        load_trace(write(tmp_path, lines), block_tokens=64)


def test_tracelab_prefix_chains_from_lengths(tmp_path):
    def round_line(session, index, tokens, when):
        return json.dumps({"session_id": session, "round_index": index, "input_tokens_total": tokens,
                           "output_tokens": 5, "timing_events": [{"timestamp": when}]})

    lines = [round_line("a", 0, 1000, "2026-01-01T00:00:00Z"), round_line("a", 1, 1500, "2026-01-01T00:00:10Z"),
             round_line("a", 2, 1200, "2026-01-01T00:00:30.5Z"), round_line("b", 0, 640, "2026-01-01T00:00:01Z")]
    trace = load_trace(write(tmp_path, lines), block_tokens=64)
    assert trace.fmt == "tracelab" and trace.has_sessions
    a0, b0, a1, a2 = trace.requests
    assert (a0.arrival_s, b0.arrival_s, a1.arrival_s, a2.arrival_s) == (0.0, 1.0, 10.0, 30.5)
    assert len(a0.blocks) == 16 and len(a1.blocks) == 24 and len(a2.blocks) == 19 and len(b0.blocks) == 10
    assert a1.blocks[:15] == a0.blocks[:15] and a1.blocks[15] != a0.blocks[15]  # a0's 16th block is partial
    assert a2.blocks[:18] == a1.blocks[:18] and a2.blocks[18] != a1.blocks[18]  # shorter: a truncation
    assert not set(b0.blocks) & set(a0.blocks + a1.blocks + a2.blocks)
    bad = lines + [json.dumps({"session_id": "c", "round_index": 0, "input_tokens_total": 5})]
    with pytest.raises(TraceError, match=r"t.jsonl:5: 'timing_events'"):
        load_trace(write(tmp_path, bad), block_tokens=64)


def test_shared_traces_load_with_their_units():
    if not TRACES.exists():
        pytest.skip("../shared/traces is absent")
    mooncake = load_trace(TRACES / "mooncake_conversation.jsonl")
    assert (len(mooncake.requests), mooncake.block_tokens, mooncake.has_sessions) == (12_031, 512, False)
    assert mooncake.span_s == pytest.approx(3536.999)  # 59 min: milliseconds
    agent = load_trace(TRACES / "agent_magentic_one.jsonl")
    assert (len(agent.requests), agent.block_tokens, agent.has_sessions) == (746, 64, True)
    rounds = load_trace(TRACES / "tracelab_rounds_sample.jsonl")
    assert rounds.fmt == "tracelab" and len(rounds.requests) == 19
    # The same arrivals written in seconds where the format says milliseconds: 12K requests in 3.5 "ms".
    shrunk = Trace(mooncake.name, tuple(Request(r.arrival_s / 1000, r.input_tokens, r.output_tokens, r.blocks,
                                                r.session, r.line) for r in mooncake.requests), 512, "mooncake")
    with pytest.raises(TraceError, match="look like seconds"):
        check_time_units(shrunk, "ms")


def test_chunk_keys_take_the_last_block_of_each_full_chunk():
    r = Request(0.0, 64 * 7 + 10, 0, tuple(range(100, 108)))
    assert chunk_keys(r, 64, 64) == tuple(range(100, 107))
    assert chunk_keys(r, 64, 128) == (101, 103, 105)
    assert chunk_keys(r, 64, 512) == ()
    with pytest.raises(TraceError, match="not a multiple"):
        chunk_keys(r, 64, 100)


def test_synthetic_trace_follows_the_paper_statistics_and_its_seed():
    trace = synthesize(SessionStats(seed=3))
    assert trace == synthesize(SessionStats(seed=3))
    assert trace != synthesize(SessionStats(seed=4))
    sessions = defaultdict(list)
    for r in trace.requests:
        sessions[r.session].append(r)
    assert len(sessions) == 350
    assert 15 < len(trace.requests) / 350 < 22  # 18.4 on average, geometric per session
    assert 70_000 < statistics.mean(r.input_tokens for r in trace.requests) < 100_000  # 83.7K
    gaps = [b.arrival_s - a.arrival_s for s in sessions.values() for a, b in zip(s, s[1:])]
    assert 80 < statistics.mean(gaps) < 150 and 6 < statistics.median(gaps) < 11
    for turns in sessions.values():
        for a, b in zip(turns, turns[1:]):  # every turn extends the previous prompt
            assert b.blocks[:a.input_tokens // 512] == a.blocks[:a.input_tokens // 512]
            assert b.input_tokens >= a.input_tokens
    assert max(r.input_tokens for r in trace.requests) <= 450_000
    assert parse_synth_spec("synth:sessions=5,seed=2") == SessionStats(sessions=5, seed=2)
    with pytest.raises(ValueError, match="bad synthetic trace setting"):
        parse_synth_spec("synth:sesions=5")


def test_rewindow_keeps_sessions_and_gaps_and_draws_starts_in_the_window():
    trace = synthesize(SessionStats(sessions=40, seed=1))
    schedule = make_schedule(trace, "rewindow", window_hours=2.0, seed=7)
    assert schedule.mode == "rewindow" and not schedule.inferred_sessions
    starts = [s.start_s for s in schedule.sessions]
    assert starts == sorted(starts) and 0 < starts[0] and starts[-1] < 7200
    assert schedule.num_requests == len(trace.requests)
    for plan in schedule.sessions:
        reqs = [trace.requests[i] for i in plan.requests]
        assert len({r.session for r in reqs}) == 1
        assert plan.gaps_s == tuple(b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert make_schedule(trace, "rewindow", window_hours=2.0, seed=7) == schedule
    assert make_schedule(trace, "rewindow", window_hours=2.0, seed=8) != schedule
    recorded = make_schedule(trace, "recorded")
    assert [s.start_s for s in recorded.sessions] == [r.arrival_s for r in trace.requests]


def test_sessions_are_inferred_by_prefix_chaining():
    # Two conversations sharing a system-prompt block 0; a third request repeats conversation A.
    reqs = (Request(0.0, 64 * 3, 0, (0, 1, 2)), Request(1.0, 64 * 3, 0, (0, 5, 6)),
            Request(2.0, 64 * 5 + 3, 0, (0, 1, 2, 3, 4, 40)), Request(3.0, 64 * 4, 0, (0, 5, 6, 7)),
            Request(4.0, 64 * 2, 0, (0, 9)), Request(5.0, 64 * 6, 0, (0, 1, 2, 3, 4, 8)))
    trace = Trace("t", reqs, 64, "mooncake")
    assert infer_sessions(trace) == [[0, 2, 5], [1, 3], [4]]
    groups, inferred = sessions_of(trace)
    assert inferred and groups == [[0, 2, 5], [1, 3], [4]]


# ======================================================================= out-of-range numbers
HUGE = 10**400  # a JSON integer no float holds


@pytest.mark.parametrize("field, value", [
    ("timestamp", HUGE), ("timestamp", 1e300), ("input_length", HUGE), ("input_length", 10**9),
    ("output_length", HUGE), ("output_length", -1), ("input_length", 64.5), ("timestamp", float("nan")),
])
def test_out_of_range_numbers_are_malformed_lines_that_skipping_skips(tmp_path, field, value):
    good = json.loads(mooncake_line(0, 64, [1]))
    bad = dict(json.loads(mooncake_line(1000, 64, [2])), **{field: value})
    path = write(tmp_path, [json.dumps(good), json.dumps(bad)])
    with pytest.raises(TraceError) as info:
        load_trace(path, block_tokens=64)
    assert f"{path}:2: '{field}' must be" in str(info.value)
    assert len(str(info.value)) < 400  # a 400-digit number is shown cut short
    trace = load_trace(path, block_tokens=64, skip_bad_lines=True)
    assert [r.line for r in trace.requests] == [1] and len(trace.skipped) == 1


@pytest.mark.parametrize("tokens", [HUGE, 100_000_000_000, -5, "many"])
def test_tracelab_lengths_are_bounded_before_blocks_are_built(tmp_path, tokens):
    """A round's blocks are built from its length: an absurd one is refused, not allocated."""
    rounds = [{"session_id": "a", "round_index": 0, "input_tokens_total": 200,
               "timing_events": [{"timestamp": "2025-01-01T00:00:00+00:00"}]},
              {"session_id": "a", "round_index": 1, "input_tokens_total": tokens,
               "timing_events": [{"timestamp": "2025-01-01T00:01:00+00:00"}]}]
    path = write(tmp_path, [json.dumps(r) for r in rounds])
    with pytest.raises(TraceError, match=r":2: 'input_tokens_total' must be an integer"):
        load_trace(path)
    assert len(load_trace(path, skip_bad_lines=True).requests) == 1


# ============================================================================ synth settings
@pytest.mark.parametrize("spec, message", [
    ("synth:sessions=2,requests_per_session=1e30", "requests_per_session must be >= 1 and <= 10,000"),
    ("synth:sessions=2,sessions=3", "sessions is given twice"),
    ("synth:span_hours=inf", "span_hours must be > 0"),
    ("synth:interval_s=nan", "interval_s must be > 0"),
    ("synth:sessions=1.5", "sessions needs an integer"),
    ("synth:sessions=1000000,requests_per_session=1000", "block references"),
    ("synth:prompt_tokens=1e12", "prompt_tokens must be > 0 and <= 100,000,000"),
    ("synth:seed=-1", "seed must be >= 0"),
])
def test_synthetic_specs_out_of_range_are_refused_before_generating(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_synth_spec(spec)


def test_synthetic_stats_refuse_wrong_types_from_python():
    with pytest.raises(ValueError, match="sessions must be an integer"):
        SessionStats(sessions=2.5)
    with pytest.raises(ValueError, match="span_hours must be a number"):
        SessionStats(span_hours="12")
