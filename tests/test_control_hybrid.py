"""Hybrid models: state objects at checkpoint boundaries, plans that end on a checkpoint, shared
admission evidence."""

from __future__ import annotations

from control_cases import HYBRID, chain, config, drain, request, writes_of, written_chunks

import pytest

from saria.config import ChunkSpec
from saria.control import ControlPlane, ControlPlaneError, ObjectKey, StoreOrder, Tier

EVERY = HYBRID.checkpoint_chunks  # 4 chunks of 1024 tokens per 4096-token checkpoint


def hybrid_plane(preset: str = "saria", **policy) -> ControlPlane:
    return ControlPlane(config(preset, dram_chunks=64, ssd_chunks=256, chunk=HYBRID, **policy))


def test_state_objects_sit_on_boundaries_and_consume_their_own_bytes():
    cp = hybrid_plane()
    hashes = chain("h", 9)
    _, orders = request(cp, hashes, 0.0)
    [store] = [o for o in orders if isinstance(o, StoreOrder)]
    assert store.kv == tuple(hashes) and store.state == ("h:3", "h:7")
    assert HYBRID.state_bytes > 0
    assert store.nbytes == 9 * HYBRID.kv_bytes + 2 * HYBRID.state_bytes
    assert cp.usage().dram_used == store.nbytes
    assert [cp.chunk_info(h).state is not None for h in hashes] == [i % EVERY == EVERY - 1 for i in range(9)]


def test_plan_is_cut_back_to_the_deepest_boundary_with_a_state_checkpoint():
    cp = hybrid_plane()
    request(cp, chain("h", 6), 0.0)  # kv of chunks 0-5, state at 3
    plan = cp.plan(chain("h", 10), 1.0)
    assert plan.chunk_hashes == tuple(chain("h", 4)) and plan.state_chunk == "h:3"
    assert plan.state_source is Tier.DRAM and plan.tokens == 4 * 1024
    assert plan.dram_bytes == 4 * HYBRID.kv_bytes + HYBRID.state_bytes
    orders = cp.commit_prefill(chain("h", 10), 1.0, plan)
    drain(cp, orders, 1.0, fail=[ObjectKey("h:7", "state")])  # kv of 4-9 stored, the state at 7 lost
    assert cp.chunk_info("h:7").kv.dram == "ready" and cp.chunk_info("h:7").state.dram == "absent"

    plan = cp.plan(chain("h", 10), 2.0)  # every kv object is there, but 7 has no checkpoint
    assert plan.num_chunks == 4 and plan.state_chunk == "h:3"
    cp.release(plan, 2.0)
    request(cp, chain("h", 11), 3.0)  # recomputes from 4 on: the state at 7 comes back
    plan = cp.plan(chain("h", 11), 4.0)
    assert plan.num_chunks == 8 and plan.state_chunk == "h:7"
    cp.release(plan, 4.0)


def test_the_part_of_a_plan_from_a_chunk_on_has_that_parts_totals():
    """``plan_from``: what a caller that holds a plan's first chunks still loads (the vLLM connector
    when vLLM computed them), with the tokens and bytes of that part, not of the whole plan."""
    cp = ControlPlane(config("full-duplicate", dram_chunks=5, ssd_chunks=256, chunk=HYBRID))
    request(cp, chain("h", 8), 0.0)  # written through to SSD; DRAM kept chunks 0-4
    plan = cp.plan(chain("h", 9), 1.0)
    assert plan.kv_sources == (Tier.DRAM,) * 5 + (Tier.SSD,) * 3 and plan.state_chunk == "h:7"
    tail = cp.plan_from(plan, 4)
    assert tail.plan_id == plan.plan_id and tail.chunk_hashes == tuple(chain("h", 8, 4))
    assert tail.kv_sources == (Tier.DRAM,) + (Tier.SSD,) * 3 and tail.serial == plan.serial
    assert (tail.state_chunk, tail.state_source) == ("h:7", Tier.SSD)
    assert tail.tokens == 4 * HYBRID.chunk_tokens
    assert (tail.dram_bytes, tail.ssd_bytes) == (HYBRID.kv_bytes, 3 * HYBRID.kv_bytes + HYBRID.state_bytes)
    assert cp.plan_from(plan, 0) is plan
    for first in (8, -1, True, "4"):
        with pytest.raises(ControlPlaneError, match="first must be a chunk index"):
            cp.plan_from(plan, first)
    with pytest.raises(ControlPlaneError, match="does not match"):
        cp.release(tail, 1.0)  # not a plan of its own
    cp.release(plan, 1.0)
    with pytest.raises(ControlPlaneError, match="already released"):
        cp.plan_from(plan, 4)
    assert cp.audit() == [] and cp.usage().live_plans == 0


def test_no_checkpoint_no_plan_even_with_every_kv_object_resident():
    cp = hybrid_plane()
    request(cp, chain("h", 3), 0.0)
    assert all(cp.chunk_info(h).kv.dram == "ready" for h in chain("h", 3))
    plan = cp.plan(chain("h", 3), 2.0)  # 3 chunks: no boundary reached, nothing to resume from
    assert plan.num_chunks == 0 and plan.state_chunk is None
    cp.release(plan, 2.0)


def test_state_object_shares_its_chunks_admission_evidence():
    """Reuse-only admission at theta_R = 2 over 8 chunks: the checkpoint at chunk 3 is never read
    (plans end at 7) nor evicted, yet with unified metadata it is written with its chunk; with
    per-object metadata it has no evidence of its own and stays unwritten."""
    for unified, expect_state_3 in ((True, True), (False, False)):
        cp = hybrid_plane(theta_E=None, theta_R=2, prewrite=False, unified_metadata=unified, admission="eq1")
        hashes = chain("h", 8)
        writes = []
        for t in range(3):
            plan, orders = request(cp, hashes, float(t))
            writes += writes_of(orders)
            if t:
                assert plan.state_chunk == "h:7"
        assert {h for w in writes for h in w.kv} == set(hashes)  # R_b = 2 on every chunk
        states = {h for w in writes for h in w.state}
        assert ("h:3" in states) is expect_state_3, unified
        assert "h:7" in states  # read by both plans: its own evidence reached theta_R too
        assert all(w.reason == "reuse" for w in writes)


def test_failed_ssd_read_in_a_hybrid_plan_recomputes_the_whole_prefix_and_drops_the_copy():
    cp = hybrid_plane("full-duplicate")
    hashes = chain("h", 4)
    request(cp, hashes, 0.0)
    request(cp, chain("x", 64), 1.0)  # evicts h from DRAM; it stays on SSD
    plan = cp.plan(hashes, 2.0)
    assert plan.kv_sources == (Tier.SSD,) * 4 and plan.state_source is Tier.SSD
    orders = cp.commit_prefill(hashes, 2.0, plan, failed=["h:1"])
    c = cp.counters()
    assert (c.hits_ssd_chunks, c.ssd_read_failures) == (0, 1)
    assert c.misses == 4 + 64 + 4
    assert c.ssd_reads == 4  # three kv objects and the checkpoint were read fine
    drops = [o for o in orders if type(o).__name__ == "DropOrder" and o.tier is Tier.SSD]
    assert [d.kv for d in drops] == [("h:1",)]  # the bad copy is dropped at once (no other plan pins it)
    assert written_chunks(orders, "write-through") == {"h:1"}  # and, recomputed, written through again
    assert cp.chunk_info("h:2").kv.ssd == "ready"
    drain(cp, orders, 2.0)
    assert not cp.audit()


def test_evicting_a_chunk_with_its_checkpoint_counts_one_eviction():
    cp = ControlPlane(config("dram-only", dram_chunks=16, chunk=HYBRID))
    request(cp, chain("h", 4), 0.0)
    request(cp, chain("other", 16), 1.0)  # evicts every object of h, the state at h:3 included
    info = cp.chunk_info("h:3")
    assert (info.kv.dram, info.state.dram) == ("absent", "absent")
    assert [cp.chunk_info(h).E_b for h in chain("h", 4)] == [1, 1, 1, 1]
    assert cp.counters().dram_evictions >= 5


def test_only_the_checkpoints_prefill_left_readable_are_stored():
    """vLLM keeps a GDN state only where a scheduler step ended: commit says which survived."""
    every_chunk = ChunkSpec.for_model("qwen3-next-80b-a3b", chunk_tokens=1024, checkpoint_tokens=1024)
    cp = ControlPlane(config(chunk=every_chunk, dram_chunks=40))
    hashes = chain("s", 6)
    orders = cp.commit_prefill(hashes, 0.0, plan=cp.plan(hashes, 0.0), states=[3])
    stored_states = [c for o in orders if isinstance(o, StoreOrder) for c in o.state]
    assert stored_states == [hashes[3]]
    drain(cp, orders, 0.0)
    plan = cp.plan(hashes + ["s:extra"], 1.0)
    assert plan.num_chunks == 4 and plan.state_chunk == hashes[3]  # cut back to the stored checkpoint
    cp.release(plan, 1.0)
    before = cp.usage()
    with pytest.raises(ControlPlaneError, match="outside"):
        cp.commit_prefill(hashes, 2.0, states=[6])
    assert cp.usage() == before
