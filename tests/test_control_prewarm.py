"""Prewarming (``ControlPlane.prewarm``) and the gap predictor.

Random sequences of plan / commit / release / complete / prewarm on small capacities (hypothesis),
checked after every call: a prewarm never evicts, never takes more than free DRAM or its cap,
promotes only SSD-ready chunks of the reusable prefix that have no DRAM copy (hybrid: the chunks a
plan would read, with the checkpoint), pins their SSD copies until it completes, and
``audit()`` stays clean; counters add up (hits + wasted + still marked <= chunks prewarmed).
"""

from __future__ import annotations

import math

import pytest
from control_cases import DENSE, chain, config, drain
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from saria.config import ChunkSpec, Policy
from saria.control import ControlPlane, ControlPlaneError, DropOrder, PromoteOrder, Tier
from saria.control.prewarm import GapPredictor

HYBRID_SMALL = ChunkSpec.for_model("qwen3-next-80b-a3b", checkpoint_tokens=2048)  # a checkpoint every 2 chunks


def info(cp: ControlPlane, h):
    return cp.chunk_info(h)


# ------------------------------------------------------------------------------------ examples
def test_prewarm_never_evicts_to_make_room():
    cp = ControlPlane(config(dram_chunks=4, ssd_chunks=32, theta_E=1))
    a, b = chain("a", 4), chain("b", 4)
    drain(cp, cp.commit_prefill(a, 1.0), 1.0)
    drain(cp, cp.commit_prefill(b, 2.0), 2.0)  # evicts a from DRAM; theta_E=1 writes it to SSD
    drain(cp, cp.commit_prefill(b, 2.5), 2.5)  # b's stores were skipped while a's writes held DRAM: now in
    assert all(info(cp, h).kv.dram == "absent" and info(cp, h).kv.ssd == "ready" for h in a)
    assert cp.usage().dram_used == cp.usage().dram_capacity
    before = cp.counters()
    assert cp.prewarm(a + chain("a", 6, 4), 3.0, max_bytes=10 * DENSE.kv_bytes) == []  # DRAM is full of b
    assert cp.counters().dram_evictions == before.dram_evictions
    assert cp.counters().prewarm_orders == 0
    assert cp.audit() == []


def _evicted_setup(dram_chunks: int = 8):
    """a (4 chunks) on SSD only, and DRAM half full of b: committing b (``dram_chunks`` chunks)
    evicted a (written to SSD: theta_E=1), whose slots its writes held, so only half of b was stored."""
    cp = ControlPlane(config(dram_chunks=dram_chunks, ssd_chunks=64, theta_E=1, prewrite=False))
    a = chain("a", 4)
    drain(cp, cp.commit_prefill(a, 1.0), 1.0)
    drain(cp, cp.commit_prefill(chain("b", dram_chunks), 2.0), 2.0)
    assert all(info(cp, h).kv.dram == "absent" and info(cp, h).kv.ssd == "ready" for h in a)
    return cp, a


def test_prewarm_takes_free_dram_from_the_first_ssd_chunk_and_stops_at_the_cap():
    cp, a = _evicted_setup()
    usage = cp.usage()
    free = usage.dram_capacity - usage.dram_used
    assert free >= 2 * DENSE.kv_bytes
    evictions = cp.counters().dram_evictions
    (order,) = cp.prewarm(a + chain("a", 9, 4), 4.0, max_bytes=2 * DENSE.kv_bytes + 1)
    assert isinstance(order, PromoteOrder) and order.source is Tier.SSD
    assert order.kv == tuple(a[:2]) and order.nbytes == 2 * DENSE.kv_bytes
    assert cp.counters().dram_evictions == evictions
    assert [info(cp, h).kv.dram for h in a[:2]] == ["filling", "filling"]
    assert [info(cp, h).kv.ssd_pins for h in a[:2]] == [1, 1]  # pinned while read
    assert cp.audit() == []
    plan = cp.plan(a, 5.0)  # filling copies are not readable: the plan reads SSD
    assert plan.kv_sources == (Tier.SSD,) * 4
    cp.release(plan, 5.0)
    cp.complete(order.order_id, True, 6.0)
    assert [info(cp, h).kv.dram for h in a[:2]] == ["ready", "ready"]
    assert [info(cp, h).kv.ssd_pins for h in a[:2]] == [0, 0]
    plan = cp.plan(a, 7.0)
    assert plan.kv_sources == (Tier.DRAM, Tier.DRAM, Tier.SSD, Tier.SSD)
    drain(cp, cp.commit_prefill(a, 8.0, plan=plan), 8.0)
    c = cp.counters()
    assert (c.prewarm_orders, c.prewarm_chunks, c.prewarm_bytes, c.prewarm_bytes_read) == (
        1, 2, 2 * DENSE.kv_bytes, 2 * DENSE.kv_bytes)
    assert c.prewarm_hits == 2 and c.prewarm_wasted == 0
    assert cp.audit() == []
    # A second read is not a prewarm hit any more.
    plan = cp.plan(a, 9.0)
    drain(cp, cp.commit_prefill(a, 10.0, plan=plan), 10.0)
    assert cp.counters().prewarm_hits == 2


def test_prewarm_of_unknown_or_dram_chunks_does_nothing_and_a_gap_ends_the_prefix():
    cp, a = _evicted_setup()
    assert cp.prewarm(chain("nope", 3), 4.0) == []
    assert cp.prewarm([], 4.0) == []
    assert cp.prewarm(chain("b", 2), 4.0) == []  # in DRAM already
    assert cp.prewarm(a, 4.0, max_bytes=0) == []
    assert cp.counters().prewarm_orders == 0
    with pytest.raises(ControlPlaneError, match="max_bytes"):
        cp.prewarm(a, 4.0, max_bytes=-1)
    with pytest.raises(ControlPlaneError, match="max_bytes"):
        cp.prewarm(a, 4.0, max_bytes=1.5)


def test_prewarmed_and_evicted_unread_counts_as_wasted():
    cp, a = _evicted_setup()
    (order,) = cp.prewarm(a, 4.0, max_bytes=DENSE.kv_bytes)
    cp.complete(order.order_id, True, 5.0)
    assert info(cp, a[0]).kv.dram == "ready"
    # Flood DRAM: the prewarmed copy is evicted before any plan read it.
    for i in range(4):
        drain(cp, cp.commit_prefill(chain(f"f{i}", 8), 6.0 + i), 6.0 + i)
    assert info(cp, a[0]).kv.dram == "absent"
    c = cp.counters()
    assert c.prewarm_wasted == 1 and c.prewarm_hits == 0
    assert cp.audit() == []


def test_failed_prewarm_leaves_the_chunk_on_ssd_and_unpinned():
    cp, a = _evicted_setup()
    (order,) = cp.prewarm(a, 4.0, max_bytes=2 * DENSE.kv_bytes)
    cp.complete(order.order_id, True, 5.0, failed=[a[1]])
    assert info(cp, a[0]).kv.dram == "ready" and info(cp, a[1]).kv.dram == "absent"
    assert info(cp, a[1]).kv.ssd == "ready" and info(cp, a[1]).kv.ssd_pins == 0
    c = cp.counters()
    assert c.prewarm_failed == 1 and c.prewarm_bytes_read == DENSE.kv_bytes
    assert cp.audit() == []


def test_default_cap_is_the_policy_fraction_of_dram():
    cp, a = _evicted_setup(dram_chunks=8)
    assert cp.config.prewarm_max_bytes == 2 * DENSE.kv_bytes  # 0.25 of 8 chunks
    (order,) = cp.prewarm(a, 4.0)
    assert order.nbytes == 2 * DENSE.kv_bytes


def test_hybrid_prewarm_keeps_the_checkpoint_rule():
    chunk = HYBRID_SMALL  # a checkpoint after every second chunk
    cp = ControlPlane(config(dram_chunks=8, ssd_chunks=64, chunk=chunk, theta_E=1, prewrite=False))
    a = chain("a", 5)
    drain(cp, cp.commit_prefill(a, 1.0), 1.0)
    drain(cp, cp.commit_prefill(chain("b", 8), 2.0), 2.0)  # a leaves DRAM, partly written to SSD
    plan = cp.plan(a, 2.5)
    length, state = plan.num_chunks, plan.state_chunk
    cp.release(plan, 2.5)
    assert length % 2 == 0 and length >= 2 and plan.state_source is Tier.SSD
    assert info(cp, a[length]).kv.ssd != "ready" or info(cp, a[length + 1]).state.ssd != "ready"
    (order,) = cp.prewarm(a, 3.0, max_bytes=10 ** 13)
    assert order.kv == tuple(a[:length])  # never beyond the deepest readable checkpoint
    assert order.state == (state,)  # the checkpoint comes along
    assert order.nbytes == length * chunk.kv_bytes + chunk.state_bytes
    assert cp.audit() == []
    cp.complete(order.order_id, True, 4.0)
    plan = cp.plan(a, 5.0)
    assert plan.kv_sources == (Tier.DRAM,) * length and plan.state_source is Tier.DRAM
    drain(cp, cp.commit_prefill(a, 6.0, plan=plan), 6.0)
    assert cp.counters().prewarm_hits == length
    assert cp.audit() == []
    # Only room for the first chunk and not its checkpoint group: a cap smaller than a group
    cp2 = ControlPlane(config(dram_chunks=8, ssd_chunks=64, chunk=chunk, theta_E=1, prewrite=False))
    drain(cp2, cp2.commit_prefill(a, 1.0), 1.0)
    drain(cp2, cp2.commit_prefill(chain("b", 8), 2.0), 2.0)
    (order,) = cp2.prewarm(a, 3.0, max_bytes=chunk.kv_bytes)
    assert order.kv == (a[0],) and order.state == ()


# ------------------------------------------------------------------------------ random sequences
family = st.integers(0, 3)
ops = st.lists(st.one_of(
    st.tuples(st.just("request"), family, st.integers(1, 7), st.booleans()),
    st.tuples(st.just("hold"), family, st.integers(1, 7)),
    st.tuples(st.just("finish-held"), st.integers(0, 99), st.booleans()),
    st.tuples(st.just("complete"), st.integers(0, 999), st.sampled_from(["ok", "ok", "fail", "partial"])),
    st.tuples(st.just("prewarm"), family, st.integers(1, 7), st.integers(0, 5)),
    st.tuples(st.just("drain")),
    st.tuples(st.just("cycle"), family, family, st.integers(1, 5), st.integers(0, 5)),                                  # complete everything pending, ok
    st.tuples(st.just("advance"), st.sampled_from([0.5, 10.0, 400.0])),
), min_size=5, max_size=50)


def _snapshot(cp: ControlPlane, hashes) -> dict:
    return {h: info(cp, h) for h in hashes}


@pytest.mark.parametrize("preset", ["saria", "full-duplicate", "lmcache-plus", "dram-only", "gds-only"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops)
def test_random_sequences_with_prewarms_keep_every_invariant(preset, hybrid, workload):
    chunk = HYBRID_SMALL if hybrid else DENSE
    from saria.config import Capacity, SariaConfig
    cfg = SariaConfig(dram=Capacity(nbytes=5 * chunk.kv_bytes + 2 * chunk.state_bytes),
                      ssd=Capacity(nbytes=14 * chunk.kv_bytes + 4 * chunk.state_bytes), chunk=chunk,
                      policy=Policy.preset(preset, metadata_window_s=300.0, prewrite_depth=3, theta_E=1)
                      if preset in ("saria",) else Policy.preset(preset, metadata_window_s=300.0))
    cp = ControlPlane(cfg)
    now = 0.0
    pending: list = []
    held: list = []

    def prewarm(fam: int, n: int, cap_chunks: int) -> None:
        hashes = chain(f"f{fam}", n)
        before = _snapshot(cp, hashes)
        usage = cp.usage()
        free = usage.dram_capacity - usage.dram_used
        c0 = cp.counters()
        cap = cap_chunks * chunk.kv_bytes
        plan = cp.plan(hashes, now)  # what a plan would read now (released at once)
        reads = dict(zip(plan.chunk_hashes, plan.kv_sources))
        cp.release(plan, now)
        orders = cp.prewarm(hashes, now, max_bytes=cap)
        c1 = cp.counters()
        assert c1.dram_evictions == c0.dram_evictions
        assert not any(isinstance(o, DropOrder) and o.tier is Tier.DRAM for o in orders)
        warm = [o for o in orders if isinstance(o, PromoteOrder)]
        event("prewarm issued an order" if warm else "prewarm issued nothing")
        assert len(warm) <= 1
        for o in warm:
            assert o.source is Tier.SSD
            assert o.nbytes <= min(cap, free)
            assert cp.usage().dram_used <= cp.usage().dram_capacity
            for h in o.kv:
                assert reads.get(h) is Tier.SSD  # in the reusable prefix, read from SSD now
                assert before[h].kv.ssd == "ready" and before[h].kv.dram == "absent"
                assert info(cp, h).kv.dram == "filling"
            for h in o.state:
                assert before[h].state.ssd == "ready" and before[h].state.dram == "absent"
                assert h == plan.state_chunk
            # From the first SSD-read chunk, contiguous among the SSD-read ones.
            ssd_read = [h for h in plan.chunk_hashes if reads[h] is Tier.SSD and before[h].kv.dram == "absent"]
            assert list(o.kv) == ssd_read[:len(o.kv)]
            pending.append(o)
        if not warm:
            assert c1.prewarm_orders == c0.prewarm_orders

    def drain_all() -> None:
        while pending:
            orders = cp.complete(pending.pop(0).order_id, True, now)
            pending.extend(o for o in orders if not isinstance(o, DropOrder))

    for op in workload:
        if op[0] == "request":
            _, fam, n, use_plan = op
            hashes = chain(f"f{fam}", n)
            plan = cp.plan(hashes, now) if use_plan else None
            pending += [o for o in cp.commit_prefill(hashes, now, plan) if not isinstance(o, DropOrder)]
        elif op[0] == "hold":
            hashes = chain(f"f{op[1]}", op[2])
            held.append((cp.plan(hashes, now), hashes))
        elif op[0] == "finish-held":
            if held:
                plan, hashes = held.pop(op[1] % len(held))
                orders = cp.commit_prefill(hashes, now, plan) if op[2] else cp.release(plan, now)
                pending += [o for o in orders if not isinstance(o, DropOrder)]
        elif op[0] == "complete":
            if pending:
                order = pending.pop(op[1] % len(pending))
                if op[2] == "partial" and order.kv:
                    orders = cp.complete(order.order_id, True, now, failed=[order.kv[0]])
                else:
                    orders = cp.complete(order.order_id, op[2] != "fail", now)
                pending += [o for o in orders if not isinstance(o, DropOrder)]
        elif op[0] == "prewarm":
            prewarm(*op[1:])
        elif op[0] == "cycle":  # a session's context leaves DRAM for SSD, then is prewarmed
            _, fam, other, n, cap_chunks = op
            for f, length in ((fam, n), (other if other != fam else fam + 1, 7)):
                pending += [o for o in cp.commit_prefill(chain(f"f{f}", length), now) if not isinstance(o, DropOrder)]
                drain_all()
            prewarm(fam, n, cap_chunks)
        elif op[0] == "drain":
            drain_all()
        else:
            now += op[1]
        problems = cp.audit()
        assert problems == [], problems
        c = cp.counters()
        assert c.prewarm_hits + c.prewarm_wasted <= c.prewarm_chunks
        assert cp.usage().dram_used <= cp.usage().dram_capacity
    for order in pending:
        cp.complete(order.order_id, True, now)
    for plan, _ in held:
        cp.release(plan, now)
    assert cp.audit() == []
    assert cp.usage().orders_in_flight == 0


# ------------------------------------------------------------------------------------ predictor
def test_gap_predictor_needs_a_gap_and_follows_an_ewma():
    p = GapPredictor(alpha=0.5)
    assert p.next_arrival() is None
    p.completed(10.0)
    assert p.next_arrival() is None and p.prewarm_at(5.0) is None  # no gap observed yet
    p.arrived(30.0)  # gap 20
    assert p.next_arrival() is None  # a request in progress
    p.completed(40.0)
    assert p.next_arrival() == 60.0
    assert p.prewarm_at(5.0) == 55.0
    assert p.prewarm_at(100.0) == 40.0  # never before the completion
    p.arrived(50.0)  # gap 10: EWMA 15
    p.completed(51.0)
    assert p.next_arrival() == pytest.approx(66.0)
    p.arrived(math.inf)
    assert p.gaps == 2
    with pytest.raises(ValueError):
        GapPredictor(alpha=0.0)


def test_policy_prewarm_fields_validate():
    assert Policy().prewarm is False
    Policy(prewarm=True, prewarm_lead_s=0.0, prewarm_dram_fraction=1.0, prewarm_gbps=1.0)
    for bad in ({"prewarm": 1}, {"prewarm_lead_s": -1.0}, {"prewarm_dram_fraction": 1.5},
                {"prewarm_gbps": 0.0}, {"prewarm_lead_s": math.nan}):
        with pytest.raises(ValueError, match="Policy.prewarm"):
            Policy(**bad)
