"""Metrics and the model of time on hand-computed cases, and the replay loop driving a real
ControlPlane on small traces whose outcome is worked out by hand."""

from __future__ import annotations

import math

import pytest

from saria.config import Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig
from saria.models import get_model
from saria.replay.arrivals import make_schedule
from saria.replay.metrics import RESULT_KEYS, char, p25_bad, percentile, summarize
from saria.replay.replay import ReplaySettings, replay
from saria.replay.timing import transfer_seconds
from saria.replay.traces import Request, Trace, chunk_keys

GB = 1e9
KV = 512 * get_model("qwen3-8b").kv_bytes_per_token  # one 512-token Qwen3-8B chunk: 75,497,472 bytes


# ============================================================================================ metrics
def test_char_is_hits_over_achievable_and_p25_bad_recomputes_it_over_the_worst_quarter():
    actual = [2, 0, 3, 5, 1]
    achievable = [2, 4, 0, 10, 1]  # request 2 has nothing achievable: not eligible
    mean, bad = char(actual, achievable)
    assert mean == pytest.approx(8 / 17)  # (2 + 0 + 5 + 1) / (2 + 4 + 10 + 1), not a mean of ratios
    assert bad == 0.0  # ceil(4 / 4) = 1 worst request: 0 / 4
    # 6 eligible: the worst ceil(6 / 4) = 2 are 1/4 and 1/2 -> (1 + 1) / (4 + 2), recomputed, not averaged
    mean, bad = char([1, 1, 4, 3, 9, 2], [4, 2, 4, 3, 10, 2])
    assert mean == pytest.approx(20 / 25) and bad == pytest.approx(2 / 6)
    # 5 eligible, worst 2: 0/4, then a tie at 1/2 goes to the earlier request (of 2 chunks, not of 10)
    assert char([0, 1, 5, 4, 3], [4, 2, 10, 4, 3])[1] == pytest.approx(1 / 6)
    assert all(math.isnan(x) for x in char([0, 0], [0, 0]))
    with pytest.raises(ValueError, match="only 2 achievable"):
        char([3], [2])


def test_tail_statistics():
    assert p25_bad([1, 2, 3, 4, 5, 6, 7, 8]) == 7.5  # the largest 2 of 8
    assert p25_bad([5, 1, 4, 2, 3]) == 4.5  # the largest ceil(5 / 4) = 2
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)  # numpy's linear
    assert percentile([7], 90) == 7
    assert math.isnan(p25_bad([])) and math.isnan(percentile([], 50))


# ====================================================================================== model of time
PAPER = Bandwidths()  # 48 / 20 / 48 GB/s


@pytest.mark.parametrize("d, s, bw, mode, seconds", [
    pytest.param(48e9, 48e9, PAPER, "serial", 48 / 48 + 48 / 20, id="serial"),
    # the DRAM burst takes all 48 GB/s of ingress: the SSD part waits, as serial (paper Fig. 16)
    pytest.param(48e9, 48e9, PAPER, "overlap", 1 + 2.4, id="overlap-stalls"),
    # Eq. 4: DRAM paced at min(48, 48 - 20) = 28 GB/s while SSD reads at 20: 2.4 s covers 67.2 GB of DRAM
    pytest.param(48e9, 48e9, PAPER, "coordinated", 2.4, id="coordinated-hides-dram"),
    pytest.param(96e9, 20e9, PAPER, "coordinated", 1 + (96 - 28) / 48, id="coordinated-dram-tail"),
    pytest.param(96e9, 20e9, PAPER, "serial", 2 + 1, id="serial-dram-heavy"),
    pytest.param(96e9, 20e9, PAPER, "ideal", 116 / 48, id="ideal-ingress-bound"),
    pytest.param(48e9, 48e9, PAPER, "ideal", 2.4, id="ideal-disk-bound"),
    # DRAM at 40 leaves 8 GB/s of ingress to the SSD: 19.2 GB in 2.4 s, 0.8 GB after at 20
    pytest.param(96e9, 20e9, Bandwidths(dram_gbps=40.0), "overlap", 2.4 + 0.8 / 20, id="overlap-residual"),
    # two drives at 24 saturate a 48 GB/s link: coordination switches itself off (= overlap)
    pytest.param(48e9, 48e9, Bandwidths(disk_gbps_per_drive=24.0, drives=2), "coordinated", 1 + 1, id="saturated"),
    pytest.param(48e9, 0, PAPER, "coordinated", 1.0, id="dram-only"),
    pytest.param(0, 20e9, PAPER, "overlap", 1.0, id="ssd-only"),
])
def test_transfer_seconds(d, s, bw, mode, seconds):
    assert transfer_seconds(d, s, bw, mode) == pytest.approx(seconds)


def test_coordinated_never_slower_than_serial_and_ideal_is_a_bound():
    for d in (0, 1e9, 10e9, 50e9):
        for s in (0, 1e9, 10e9, 50e9):
            modes = {m: transfer_seconds(d, s, PAPER, m) for m in ("serial", "overlap", "coordinated", "ideal")}
            assert modes["ideal"] <= modes["coordinated"] + 1e-12 <= modes["serial"] + 2e-12
            assert modes["coordinated"] <= modes["overlap"] + 1e-12
    with pytest.raises(ValueError, match="loading mode"):
        transfer_seconds(1, 1, PAPER, "parallel")


# ============================================================================================= replay
def config(preset="saria", dram_chunks=100, ssd_chunks=1000, chunk=ChunkSpec(), **policy) -> SariaConfig:
    return SariaConfig(dram=Capacity(tokens=dram_chunks * chunk.chunk_tokens),
                       ssd=Capacity(tokens=ssd_chunks * chunk.chunk_tokens), chunk=chunk,
                       policy=Policy.preset(preset, **policy))


def run(requests, cfg, settings=ReplaySettings(), mode="recorded", chunk_tokens=512, block=512):
    trace = Trace("hand", tuple(requests), block, "synthetic")
    chunks = [chunk_keys(r, block, chunk_tokens) for r in trace.requests]
    result = replay("p", trace, chunks, make_schedule(trace, mode, window_hours=1.0), cfg, settings, audit=True)
    assert result.audit == []
    return result


A = Request(0.0, 4 * 512 + 100, 0, (1, 2, 3, 4, 5), "s")              # 4 full chunks
B = Request(100.0, 6 * 512 + 10, 0, (1, 2, 3, 4, 6, 7, 8), "s")       # extends A to 6


def test_a_session_turn_reloads_its_prefix_from_dram():
    result = run([A, B], config())
    tps = 6500.0
    assert math.isnan(result.transfer_s[0]) and result.ttft_s[0] == pytest.approx(2148 / tps)
    transfer = 4 * KV / (48 * GB)
    assert result.transfer_s[1] == pytest.approx(transfer)
    assert result.ttft_s[1] == pytest.approx(transfer + (3082 - 2048) / tps)
    assert (result.hit_chunks, result.achievable_chunks) == ([0, 4], [0, 4])
    record = summarize(result)
    assert tuple(record) == RESULT_KEYS
    assert record["char_mean"] == 1.0 and record["hit_ratio"] == pytest.approx(4 / 10)
    assert (record["dram_hit_tokens"], record["ssd_hit_tokens"], record["ssd_write_bytes"]) == (2048, 0, 0)
    assert record["transfer_ms_mean"] == pytest.approx(transfer * 1e3)


def test_a_small_dram_caps_the_hits_and_char_sees_it():
    # 2 chunks of DRAM: A's store gets slots for its first 2 chunks only (the others find nothing to
    # evict: the first two are still filling); B reloads those 2, then its 4 computed chunks evict them
    # for 2 slots and skip 2 more.
    result = run([A, B], config("dram-only", dram_chunks=2))
    assert (result.hit_chunks, result.achievable_chunks) == ([0, 2], [0, 4])
    record = summarize(result)
    assert record["char_mean"] == 0.5 and record["char_p25_bad"] == 0.5
    assert (result.counters.stores_skipped, record["dram_evictions"]) == (2 + 2, 2)


def test_writes_run_on_their_own_lane_and_count_against_the_budget():
    result = run([A], config("full-duplicate"))
    commit = 2148 / 6500
    assert result.counters.ssd_bytes_written == 4 * KV
    assert result.end_s == pytest.approx(commit + 4 * KV / (20 * GB))  # 302 MB written at 20 GB/s
    record = summarize(result)
    budget = 1000 * KV / 86400 * result.duration_s  # 1 DWPD of the 1000-chunk SSD
    assert record["write_budget_ratio"] == pytest.approx(4 * KV / budget)
    assert record["normalized_writes"] == pytest.approx(4 * KV / (1000 * KV))


def test_inflight_lets_a_load_overlap_another_requests_prefill():
    w = Request(0.0, 2 * 512 + 10, 0, (1, 2, 3))
    x = Request(1.0, 6500, 0, tuple(range(100, 113)))  # 1 s of prefill
    y = Request(1.5, 3 * 512 + 5, 0, (1, 2, 4, 5))
    load, compute = 2 * KV / (48 * GB), (1541 - 1024) / 6500
    one = run([w, x, y], config(), ReplaySettings(inflight=1))
    assert one.ttft_s[2] == pytest.approx(0.5 + load + compute)  # waits for x, then loads, then computes
    two = run([w, x, y], config(), ReplaySettings(inflight=2))
    assert two.ttft_s[2] == pytest.approx(0.5 + compute)  # loaded while x computed
    assert two.transfer_s[2] == pytest.approx(load)


def test_a_sessions_successor_arrives_its_gap_after_the_predecessor_completes():
    result = run([A, B], config(), mode="rewindow")
    first_done = result.arrival_s[0] + result.ttft_s[0]
    assert result.arrival_s[1] == pytest.approx(first_done + 100.0)
    assert 0 < result.arrival_s[0] < 3600


def test_hybrid_plans_and_achievable_hits_end_on_a_checkpoint():
    chunk = ChunkSpec.for_model("qwen3.5-9b", checkpoint_tokens=2048)  # 1024-token chunks, a state every 2
    a = Request(0.0, 3 * 1024 + 7, 0, (1, 2, 3, 4), "h")
    b = Request(50.0, 5 * 1024, 0, (1, 2, 3, 5, 6), "h")
    result = run([a, b], config(chunk=chunk, dram_chunks=50, ssd_chunks=500), chunk_tokens=1024, block=1024)
    assert result.achievable_chunks == [0, 2] and result.hit_chunks == [0, 2]  # 3 known, cut back to 2
    assert result.transfer_s[1] == pytest.approx((2 * chunk.kv_bytes + chunk.state_bytes) / (48 * GB))
    assert result.ttft_s[1] == pytest.approx(result.transfer_s[1] + 3 * 1024 / 6500)


def test_model_footprints():
    assert get_model("qwen3-8b").kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    hybrid = get_model("qwen3.5-9b")
    assert (hybrid.fa_layers, hybrid.gdn_layers, hybrid.kv_bytes_per_token) == (8, 24, 8 * 2 * 4 * 256 * 2)
    temporal = 32 * 128 * 128 * 4  # [HV, V, K] fp32
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2  # [kernel - 1, conv_dim] bf16
    assert hybrid.state_bytes == 24 * (temporal + conv)
    assert get_model("qwen3-1.7b-paper").fa_layers == 20
    small = get_model("qwen3.5-5.6b-paper")
    assert (small.fa_layers, small.gdn_layers, small.state_bytes) == (5, 15, 15 * (temporal + conv))
    for name in ("qwen3.5-9b", "qwen3-1.7b-paper", "qwen3.5-5.6b-paper"):
        assert get_model(name).source


def test_progress_counts_every_request_once_truncated_or_not():
    requests = [Request(float(i), 2 * 512 + 1, 0, (i * 10, i * 10 + 1, i * 10 + 2)) for i in range(600)]
    for hours, replayed in ((None, 600), (300 / 3600, 300)):
        counted = []
        trace = Trace("p", tuple(requests), 512, "synthetic")
        chunks = [chunk_keys(r, 512, 512) for r in trace.requests]
        result = replay("p", trace, chunks, make_schedule(trace, "recorded"), config(),
                        ReplaySettings(truncate_hours=hours), counted.append)
        assert sum(counted) == 600 and result.truncated == 600 - replayed
        assert sum(not math.isnan(t) for t in result.ttft_s) == replayed
        if hours:
            assert result.budget_s == 300.0
