"""The paper's Figure 7 scenarios: (a) persistence-aware SSD admission, (b) mixed-source reload."""

from __future__ import annotations

from control_cases import chain, config, drain, request, writes_of, written_chunks

from saria.control import ControlPlane, DropOrder, Tier, WriteOrder

D, S = Tier.DRAM, Tier.SSD


def flood(cp: ControlPlane, name: str, n: int, now: float) -> list:
    """n single-use chunks, one request each: they push older chunks out of DRAM."""
    orders = []
    for i in range(n):
        orders += request(cp, [f"{name}{i}"], now)[1]
    return orders


# ------------------------------------------------------------------------------------------- (a)
def test_popular_prefix_is_written_when_reuse_reaches_theta_r_before_any_eviction():
    cp = ControlPlane(config("paper", dram_chunks=8, prewrite=False))  # theta_R = 8; saria defers it
    prefix = chain("sys", 3)
    for t in range(8):  # the first request creates the chunks, seven more reuse them: R_b = 7
        _, orders = request(cp, prefix, float(t))
        assert not writes_of(orders)
    _, orders = request(cp, prefix, 8.0)  # R_b = 8 = theta_R
    [write] = writes_of(orders)
    assert (write.reason, write.source, write.kv) == ("reuse", D, tuple(prefix))
    for h in prefix:
        info = cp.chunk_info(h)
        assert (info.E_b, info.R_b) == (0, 8)  # never evicted: persisted before eviction
        assert (info.kv.dram, info.kv.ssd) == ("ready", "ready")
    assert cp.counters().admissions_reuse == 3

    orders = flood(cp, "other", 8, 9.0)  # evict the prefix: already persisted, nothing more to write
    assert not written_chunks(orders) & set(prefix)
    assert all(cp.chunk_info(h).kv.dram == "absent" for h in prefix)
    plan, _ = request(cp, prefix, 10.0)
    assert plan.kv_sources == (S, S, S)


def test_repeatedly_evicted_chunk_is_written_at_its_theta_e_th_eviction_before_its_slot_is_reclaimed():
    cp = ControlPlane(config(dram_chunks=2, prewrite=False))  # theta_E = 2
    request(cp, ["x"], 0.0)
    orders = flood(cp, "a", 2, 1.0)  # first eviction of x: dropped, not written
    assert cp.chunk_info("x").E_b == 1 and cp.chunk_info("x").kv.dram == "absent"
    assert not writes_of(orders)

    request(cp, ["x"], 2.0)  # recomputed, stored again; its E_b survived the eviction
    assert cp.chunk_info("x").E_b == 1 and cp.chunk_info("x").R_b == 1
    plan = cp.plan(["b0"], 3.0)
    orders = cp.commit_prefill(["b0"], 3.0, plan)
    drain(cp, orders, 3.0)
    plan = cp.plan(["b1"], 3.0)
    orders = cp.commit_prefill(["b1"], 3.0, plan)  # second eviction of x: admitted, written first
    [write] = writes_of(orders)
    assert (write.reason, write.source, write.kv) == ("eviction", D, ("x",))
    info = cp.chunk_info("x")
    assert info.E_b == 2 and (info.kv.dram, info.kv.ssd) == ("draining", "filling")  # slot held
    assert cp.usage().dram_used == 2 * cp.config.chunk.kv_bytes  # x's slot is still counted (b1 got the other)
    follow_ups = cp.complete(write.order_id, True, 3.5)
    assert [(type(o), o.tier, o.kv) for o in follow_ups] == [(DropOrder, D, ("x",))]  # now reclaimed
    assert (cp.chunk_info("x").kv.dram, cp.chunk_info("x").kv.ssd) == ("absent", "ready")
    drain(cp, [o for o in orders if o is not write], 4.0)
    assert cp.counters().admissions_eviction == 1


def test_prewrite_writes_a_chunk_that_would_qualify_at_its_next_eviction_while_still_resident():
    cp = ControlPlane(config(dram_chunks=3))  # prewrite on, theta_E = 2
    request(cp, ["x"], 0.0)
    flood(cp, "a", 3, 1.0)  # x evicted once: E_b = 1
    _, orders = request(cp, ["x"], 2.0)
    assert cp.chunk_info("x").E_b == 1 and not writes_of(orders)  # x is most recently used
    orders = flood(cp, "b", 2, 3.0)  # x reaches the LRU end: E_b + 1 = 2 admits it
    assert written_chunks(orders, "prewrite") == {"x"}
    info = cp.chunk_info("x")
    assert info.E_b == 1 and (info.kv.dram, info.kv.ssd) == ("ready", "ready")  # written while resident


def test_once_used_chunks_are_never_written_under_saria_but_are_under_full_duplicate():
    for preset, expect_written in (("saria", False), ("full-duplicate", True)):
        cp = ControlPlane(config(preset, dram_chunks=4))
        _, first = request(cp, ["once"], 0.0)
        later = flood(cp, "single", 20, 1.0)  # twenty more single-use chunks: "once" is long evicted
        assert cp.chunk_info("once").kv.dram == "absent"
        written = written_chunks(first + later)
        assert ("once" in written) is expect_written, preset
        if expect_written:
            assert written_chunks(first, "write-through") == {"once"}
            assert cp.counters().ssd_writes == 21
        else:
            assert cp.counters().ssd_writes == 0 and cp.counters().admissions == 0


# ------------------------------------------------------------------------------------------- (b)
def _dram_ssd_dram(cp: ControlPlane) -> None:
    """Drive saria to a DRAM-SSD-DRAM prefix the natural way: a and b are evicted twice (admitted,
    written), a is promoted back after an SSD reload, c is new and only in DRAM."""
    request(cp, ["a", "b"], 0.0)
    flood(cp, "f", 4, 1.0)  # a, b evicted once
    request(cp, ["a", "b"], 2.0)  # recomputed
    orders = flood(cp, "g", 4, 3.0)  # evicted again: E_b = 2, written on the way out
    assert written_chunks(orders, "eviction") == {"a", "b"}
    plan, orders = request(cp, ["a", "b", "c"], 100.0)  # SSD, SSD; c computed; promote P_target chunks
    assert plan.kv_sources == (S, S)
    # r* = 1 - 20/48; D0 = 0, S0 = 2: P_target = floor(2 r*) = 1, the first SSD hit
    assert [o.kv for o in orders if type(o).__name__ == "PromoteOrder"] == [("a",)]


def test_unified_planning_recovers_a_dram_ssd_dram_prefix_and_tier_prefix_lookup_stops_at_the_switch():
    for lookup, expected in (("unified", (D, S, D)), ("tier-prefix", (D, S))):
        cp = ControlPlane(config(dram_chunks=4, ssd_chunks=16, prewrite=False, lookup=lookup))
        _dram_ssd_dram(cp)
        plan = cp.plan(["a", "b", "c"], 101.0)
        assert plan.kv_sources == expected, lookup
        assert plan.chunk_hashes == ("a", "b", "c")[:len(expected)]
        assert plan.segments() == [(D, 0, 1), (S, 1, 2), (D, 2, 3)][:len(expected)]
        assert plan.tokens == 512 * len(expected)
        cp.release(plan, 101.0)


def test_lmcache_plus_stops_at_the_switch_where_full_duplicate_plans_the_whole_prefix():
    """Both write through; failed writes and a failed store leave a: DRAM only, b: SSD only,
    c: DRAM only."""
    for preset, expected, serial in (("full-duplicate", (D, S, D), False), ("lmcache-plus", (D, S), True)):
        cp = ControlPlane(config(preset))
        plan = cp.plan(["a", "b", "c"], 0.0)
        orders = cp.commit_prefill(["a", "b", "c"], 0.0, plan)
        for order in orders:
            if isinstance(order, WriteOrder):
                cp.complete(order.order_id, True, 0.0, failed=["a", "c"])
            elif not isinstance(order, DropOrder):
                cp.complete(order.order_id, True, 0.0, failed=["b"])
        plan = cp.plan(["a", "b", "c"], 1.0)
        assert (plan.kv_sources, plan.serial) == (expected, serial), preset
        orders = cp.commit_prefill(["a", "b", "c"], 1.0, plan)
        c = cp.counters()
        assert (c.hits_dram_chunks, c.hits_ssd_chunks, c.misses) == (expected.count(D), 1, 3 + 3 - len(expected))
        drain(cp, orders, 1.0)
        assert not cp.audit()
