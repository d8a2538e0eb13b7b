"""Prewarming in the replay: a session's SSD-only prefix comes back into DRAM before its predicted
next turn, from the gaps it has shown so far, and the report counts it."""

from __future__ import annotations

from saria.config import Capacity, ChunkSpec, Policy, SariaConfig
from saria.replay.arrivals import make_schedule
from saria.replay.metrics import RESULT_KEYS, summarize
from saria.replay.replay import replay
from saria.replay.report import format_table
from saria.replay.synth import SessionStats, synthesize
from saria.replay.traces import Request, Trace, chunk_keys

KV = ChunkSpec().kv_bytes

# One session, three turns 100 s apart, each extending the last. With 4 chunks of DRAM and
# theta_E=1, B's commit evicts A's four chunks (all written to SSD, their slots held until the
# writes end, so B's own two new chunks find no room): DRAM is empty and A's prefix is on SSD only
# when C comes.
A = Request(0.0, 4 * 512 + 10, 0, (1, 2, 3, 4, 5), "s")
B = Request(100.0, 6 * 512 + 10, 0, (1, 2, 3, 4, 6, 7, 8), "s")
C = Request(200.0, 8 * 512 + 10, 0, (1, 2, 3, 4, 6, 7, 9, 10, 11), "s")


def run(trace, **policy):
    cfg = SariaConfig(dram=Capacity(tokens=4 * 512), ssd=Capacity(tokens=100 * 512),
                      policy=Policy.preset("saria", theta_E=1, prewrite=False, **policy))
    chunks = [chunk_keys(r, trace.block_tokens, 512) for r in trace.requests]
    result = replay("p", trace, chunks, make_schedule(trace, "rewindow", window_hours=1.0), cfg, audit=True)
    assert result.audit == []
    return result


def test_prewarm_turns_the_next_turns_ssd_hits_into_dram_hits():
    trace = Trace("hand", (A, B, C), 512, "synthetic")
    cold = run(trace)
    warm = run(trace, prewarm=True, prewarm_dram_fraction=1.0, prewarm_lead_s=5.0)
    assert cold.hit_chunks == warm.hit_chunks == [0, 4, 4]
    c, w = summarize(cold), summarize(warm)
    assert tuple(w) == RESULT_KEYS
    # Without prewarming C reads A's four chunks from SSD; with it they were brought back 5 s before.
    assert (c["dram_hit_tokens"], c["ssd_hit_tokens"]) == (4 * 512, 4 * 512)
    assert (w["dram_hit_tokens"], w["ssd_hit_tokens"]) == (8 * 512, 0)
    assert (c["prewarm_read_bytes"], c["prewarm_hit_tokens"], c["prewarm_wasted_tokens"]) == (0, 0, 0)
    assert w["prewarm_read_bytes"] == 4 * KV and w["prewarm_hit_tokens"] == 4 * 512
    assert warm.transfer_s[2] < cold.transfer_s[2] and warm.ttft_s[2] < cold.ttft_s[2]
    assert warm.ttft_s[:2] == cold.ttft_s[:2]
    # The prewarm after C (nothing tells the replay the session ended) does not extend the replayed
    # span (nor the write budget it sets): C ends sooner, so does the replay.
    assert warm.end_s < cold.end_s
    assert warm.counters.prewarm_orders >= 1
    table = format_table([c, w])
    assert "prewarm hit tokens" in table and "prewarm reads (GiB)" in table


def test_no_prewarm_before_a_gap_was_seen_nor_when_the_turn_comes_first():
    # Two turns: A's completion has no observed gap yet, so nothing is prewarmed for B; B's own
    # completion has one, so B is prewarmed after (the session's end is unknown): never read.
    two = run(Trace("hand", (A, B), 512, "synthetic"), prewarm=True, prewarm_dram_fraction=1.0)
    assert two.counters.prewarm_orders == 1 and two.counters.prewarm_hits == 0
    assert two.ttft_s == run(Trace("hand", (A, B), 512, "synthetic")).ttft_s
    # C comes 1 s after B although the session's gap so far was 100 s and the lead is 5 s: the
    # prewarm is due after C arrived, so it is dropped.
    early = Request(101.0, C.input_tokens, 0, C.blocks, "s")
    quick = run(Trace("hand", (A, B, early), 512, "synthetic"), prewarm=True, prewarm_dram_fraction=1.0)
    assert quick.counters.prewarm_orders <= 1  # only the prewarm after C (the session's end) may run
    assert quick.counters.prewarm_hits == 0


def test_prewarm_is_off_by_default_and_a_synthetic_session_trace_replays_soundly_with_it():
    assert Policy().prewarm is False
    stats = SessionStats(sessions=12, requests_per_session=6, prompt_tokens=12000, first_prompt_tokens=4000,
                         interval_s=60, interval_median_s=40, span_hours=0.2, seed=0)
    trace = synthesize(stats)
    chunks = [chunk_keys(r, trace.block_tokens, 512) for r in trace.requests]
    schedule = make_schedule(trace, "rewindow", window_hours=0.2)
    results = []
    for prewarm in (False, True):
        cfg = SariaConfig(dram=Capacity(tokens=40_000), ssd=Capacity(tokens=400_000),
                          policy=Policy.preset("saria", prewarm=prewarm))
        result = replay("p", trace, chunks, schedule, cfg, audit=True, audit_every=7)
        assert result.audit == []
        results.append(result)
    off, on = results
    assert off.counters.prewarm_orders == 0
    assert on.counters.prewarm_orders > 0
    c = on.counters
    assert c.prewarm_hits + c.prewarm_wasted <= c.prewarm_chunks
    assert c.prewarm_bytes_read == c.prewarm_bytes  # every prewarm completed ok
