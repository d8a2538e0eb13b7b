"""``ControlPlane.recover_ssd``: SSD objects of a previous run taken over after a restart.

Recovered objects hold SSD bytes at once, join the tree when a request's chunks reach them (the
run right after the known prefix at plan time, any other at commit), are evicted first (in the
order given) when SSD room is needed, and are dropped when stale, repeated, of no kind the model
has, or beyond the free room. Every call here is audited (``AuditedPlane``).
"""

from __future__ import annotations

import math

import pytest
from control_cases import DENSE, HYBRID, chain, config, drain, request, snapshot, writes_of

from saria.control import ControlPlane, ControlPlaneError, DropOrder, ObjectKey, PromoteOrder, Tier, WriteOrder

KV_BYTES = DENSE.kv_bytes
H_KV, H_STATE = HYBRID.kv_bytes, HYBRID.state_bytes


class AuditedPlane(ControlPlane):
    """A control plane that audits itself after every mutating call (raised or not)."""

    def _audited(self, name, *args, **kwargs):
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            assert self.audit() == [], name

    def plan(self, *args, **kwargs):
        return self._audited("plan", *args, **kwargs)

    def release(self, *args, **kwargs):
        return self._audited("release", *args, **kwargs)

    def commit_prefill(self, *args, **kwargs):
        return self._audited("commit_prefill", *args, **kwargs)

    def complete(self, *args, **kwargs):
        return self._audited("complete", *args, **kwargs)

    def recover_ssd(self, *args, **kwargs):
        return self._audited("recover_ssd", *args, **kwargs)


def kv(*hashes) -> list[ObjectKey]:
    return [ObjectKey(h, "kv") for h in hashes]


def st(*hashes) -> list[ObjectKey]:
    return [ObjectKey(h, "state") for h in hashes]


def ssd_drops(orders) -> list[DropOrder]:
    return [o for o in orders if isinstance(o, DropOrder) and o.tier is Tier.SSD]


def dropped(orders) -> list[ObjectKey]:
    """Every object the SSD drop orders name, in order."""
    return [key for o in ssd_drops(orders) for key in kv(*o.kv) + st(*o.state)]


def ssd_state(cp: ControlPlane, h) -> str | None:
    info = cp.chunk_info(h)
    return None if info is None else info.kv.ssd


# ================================================================================== planning
def test_plan_after_recover_reads_every_recovered_chunk_from_ssd():
    cp = AuditedPlane(config())
    hashes = chain("a", 6)
    assert cp.recover_ssd(kv(*hashes), 0.0) == []
    assert cp.usage().ssd_used == 6 * KV_BYTES and cp.usage().nodes == 0
    assert [cp.chunk_info(h) for h in hashes] == [None] * 6  # no node until a request reaches them
    plan = cp.plan(hashes + ["a:6", "a:7"], 1.0)
    assert plan.chunk_hashes == tuple(hashes) and plan.kv_sources == (Tier.SSD,) * 6
    assert plan.ssd_bytes == 6 * KV_BYTES and plan.dram_bytes == 0 and plan.tokens == 6 * DENSE.chunk_tokens
    for h in hashes:
        info = cp.chunk_info(h)
        assert info.kv.ssd == "ready" and info.kv.ssd_pins == 1
    assert cp.chunk_info("a:6") is None  # not recovered: left to the commit
    c = cp.counters()
    assert (c.recovered, c.recovered_adopted, c.recovered_dropped) == (6, 6, 0)
    orders = drain(cp, cp.commit_prefill(hashes + ["a:6", "a:7"], 1.0, plan=plan), 1.0)
    assert not ssd_drops(orders)
    assert not written_of(orders, hashes)
    c = cp.counters()
    assert (c.hits_ssd_chunks, c.misses, c.ssd_reads, c.ssd_bytes_read) == (6, 2, 6, 6 * KV_BYTES)
    assert cp.usage().ssd_used == 6 * KV_BYTES


def written_of(orders, hashes) -> set:
    return {h for o in writes_of(orders) for h in (*o.kv, *o.state)} & set(hashes)


def test_recovered_run_after_a_known_dram_prefix_mixes_sources():
    cp = AuditedPlane(config())
    request(cp, chain("a", 3), 0.0)  # a:0..2 in DRAM, never written (saria: not admitted yet)
    assert cp.recover_ssd(kv(*chain("a", 6, 3)), 1.0) == []
    plan = cp.plan(chain("a", 6), 2.0)
    assert plan.kv_sources == (Tier.DRAM,) * 3 + (Tier.SSD,) * 3
    assert plan.segments() == [(Tier.DRAM, 0, 3), (Tier.SSD, 3, 6)]
    cp.release(plan, 2.0)
    assert all(ssd_state(cp, h) == "ready" for h in chain("a", 6, 3))  # adopted even so
    assert cp.counters().recovered_adopted == 3


def test_recovered_run_stops_at_the_first_unrecovered_chunk():
    cp = AuditedPlane(config())
    cp.recover_ssd(kv("a:0", "a:1", "a:3", "a:4"), 0.0)
    plan = cp.plan(chain("a", 5), 1.0)
    assert plan.chunk_hashes == ("a:0", "a:1")
    assert cp.chunk_info("a:3") is None and cp.chunk_info("a:4") is None  # after a gap: not adopted by plan
    cp.release(plan, 1.0)
    assert cp.usage().ssd_used == 4 * KV_BYTES


@pytest.mark.parametrize("preset", ["saria", "full-duplicate", "gds-only"])
def test_recovered_chunk_after_a_gap_is_adopted_by_the_commit_and_not_written_again(preset):
    cp = AuditedPlane(config(preset))
    cp.recover_ssd(kv("a:2", "a:3"), 0.0)  # a:0 and a:1 unknown anywhere: a gap
    plan = cp.plan(chain("a", 5), 1.0)
    assert plan.num_chunks == 0 and cp.usage().nodes == 0
    orders = drain(cp, cp.commit_prefill(chain("a", 5), 1.0, plan=plan), 1.0)
    assert ssd_state(cp, "a:2") == ssd_state(cp, "a:3") == "ready"
    written = written_of(orders, chain("a", 5))
    assert not written & {"a:2", "a:3"}  # the drives' copy is theirs: no re-write
    if preset != "saria":  # written through: every other chunk
        assert written == {"a:0", "a:1", "a:4"}
    c = cp.counters()
    assert (c.recovered_adopted, c.misses, c.hits) == (2, 5, 0)
    assert cp.usage().ssd_used == (2 + len(written)) * KV_BYTES
    plan = cp.plan(chain("a", 5), 2.0)
    assert plan.num_chunks == 5
    if preset == "gds-only":
        assert plan.kv_sources == (Tier.SSD,) * 5
    cp.release(plan, 2.0)


def test_known_prefix_then_gap_then_recovered():
    cp = AuditedPlane(config())
    request(cp, chain("a", 2), 0.0)
    cp.recover_ssd(kv("a:3"), 1.0)
    plan = cp.plan(chain("a", 4), 2.0)
    assert plan.chunk_hashes == ("a:0", "a:1") and cp.chunk_info("a:3") is None
    drain(cp, cp.commit_prefill(chain("a", 4), 2.0, plan=plan), 2.0)
    assert ssd_state(cp, "a:2") == "absent" and ssd_state(cp, "a:3") == "ready"


def test_commit_without_a_plan_adopts_recovered_chunks_it_creates():
    cp = AuditedPlane(config("full-duplicate"))
    cp.recover_ssd(kv("a:0", "a:1"), 0.0)
    orders = drain(cp, cp.commit_prefill(chain("a", 3), 1.0), 1.0)
    assert written_of(orders, chain("a", 3)) == {"a:2"}
    assert cp.counters().recovered_adopted == 2 and cp.counters().misses == 3


def test_failed_read_of_an_adopted_chunk_drops_it():
    cp = AuditedPlane(config())
    cp.recover_ssd(kv(*chain("a", 3)), 0.0)
    plan = cp.plan(chain("a", 3), 1.0)
    orders = cp.commit_prefill(chain("a", 3), 1.0, plan=plan, failed=["a:1"])
    assert dropped(orders) == kv("a:1")
    assert ssd_state(cp, "a:1") == "absent" and ssd_state(cp, "a:0") == "ready"
    assert cp.counters().hits_ssd_chunks == 1  # a:0 only: from the first failed read on, recomputed
    drain(cp, orders, 1.0)


def test_adopted_chunk_is_promoted_like_any_ssd_hit():
    cp = AuditedPlane(config(r=1.0))
    cp.recover_ssd(kv(*chain("a", 4)), 0.0)
    plan = cp.plan(chain("a", 4), 1.0)
    orders = cp.commit_prefill(chain("a", 4), 1.0, plan=plan)
    promoted = [h for o in orders if isinstance(o, PromoteOrder) for h in o.kv]
    assert promoted == chain("a", 4)
    drain(cp, orders, 1.0)
    assert cp.plan(chain("a", 4), 2.0).kv_sources == (Tier.DRAM,) * 4


# ==================================================================================== hybrid
def test_hybrid_plan_reads_recovered_kv_and_state_up_to_the_deepest_checkpoint():
    cp = AuditedPlane(config(chunk=HYBRID))  # a state object on every 4th chunk (a:3, a:7)
    hashes = chain("a", 8)
    cp.recover_ssd(kv(*hashes) + st("a:3", "a:7"), 0.0)
    assert cp.usage().ssd_used == 8 * H_KV + 2 * H_STATE
    plan = cp.plan(hashes, 1.0)
    assert plan.chunk_hashes == tuple(hashes) and plan.kv_sources == (Tier.SSD,) * 8
    assert (plan.state_chunk, plan.state_source) == ("a:7", Tier.SSD)
    assert plan.ssd_bytes == 8 * H_KV + H_STATE
    assert cp.chunk_info("a:3").state.ssd == "ready" and cp.chunk_info("a:7").state.ssd_pins == 1
    orders = drain(cp, cp.commit_prefill(hashes, 1.0, plan=plan), 1.0)
    assert not ssd_drops(orders)
    assert cp.counters().recovered_adopted == 10 and cp.counters().hits_ssd_chunks == 8


def test_hybrid_plan_is_cut_back_to_the_last_recovered_checkpoint():
    cp = AuditedPlane(config(chunk=HYBRID))
    hashes = chain("a", 8)
    cp.recover_ssd(kv(*hashes) + st("a:3"), 0.0)  # a:7's state is missing
    plan = cp.plan(hashes, 1.0)
    assert plan.chunk_hashes == tuple(hashes[:4]) and plan.state_chunk == "a:3"
    assert all(ssd_state(cp, h) == "ready" for h in hashes[4:])  # the run joined the tree all the same
    assert cp.chunk_info("a:7").state.ssd == "absent"
    cp.release(plan, 1.0)


def test_hybrid_recovered_kv_without_any_checkpoint_gives_no_plan():
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(kv(*chain("a", 4)), 0.0)
    plan = cp.plan(chain("a", 4), 1.0)
    assert plan.num_chunks == 0
    cp.release(plan, 1.0)
    assert cp.usage().ssd_used == 4 * H_KV


def test_hybrid_recovered_state_after_a_gap_is_adopted_by_the_commit():
    cp = AuditedPlane(config("full-duplicate", chunk=HYBRID))
    cp.recover_ssd(st("a:3"), 0.0)  # only the checkpoint: no kv recovered at all
    plan = cp.plan(chain("a", 4), 1.0)
    assert plan.num_chunks == 0 and cp.chunk_info("a:3") is None
    orders = drain(cp, cp.commit_prefill(chain("a", 4), 1.0, plan=plan), 1.0)
    assert cp.chunk_info("a:3").state.ssd == "ready"
    assert all("a:3" not in o.state for o in writes_of(orders))  # its kv is written through, not its state
    assert any("a:3" in o.kv for o in writes_of(orders))


def test_hybrid_recovered_state_of_a_non_boundary_chunk_is_dropped_by_the_next_orders_after_plan():
    """A drop decided while plan() creates nodes cannot go out with plan (it returns no orders):
    it must come first in the next orders returned, not be lost."""
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(kv(*chain("a", 4)) + st("a:1", "a:3"), 0.0)  # a:1 is no checkpoint boundary
    assert cp.usage().ssd_used == 4 * H_KV + 2 * H_STATE
    plan = cp.plan(chain("a", 4), 1.0)
    assert plan.num_chunks == 4 and plan.state_chunk == "a:3"
    assert cp.usage().ssd_used == 4 * H_KV + H_STATE  # its bytes are given back at once...
    assert cp.counters().recovered_dropped == 1
    orders = cp.commit_prefill(chain("a", 4), 1.0, plan=plan)
    assert isinstance(orders[0], DropOrder) and orders[0].tier is Tier.SSD
    assert dropped(orders) == st("a:1") and orders[0].nbytes == H_STATE  # ...and the drop goes out here
    drain(cp, orders, 1.0)


def test_hybrid_non_boundary_state_drop_after_plan_goes_out_with_release_or_a_completion():
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(kv(*chain("a", 4)) + st("a:2", "a:3"), 0.0)
    plan = cp.plan(chain("a", 4), 1.0)
    other = cp.plan(chain("a", 4), 1.0)  # a second plan decides nothing new: one drop, once
    assert dropped(cp.release(plan, 1.0)) == st("a:2")
    assert cp.release(other, 1.0) == []


def test_hybrid_object_listed_again_while_its_drop_waits_is_dropped_once():
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(kv(*chain("a", 4)) + st("a:1", "a:3"), 0.0)
    cp.plan(chain("a", 4), 1.0)  # decides the drop of a:1's state, which waits for the next orders
    orders = cp.recover_ssd(st("a:1"), 1.0)  # the data plane, still holding it, lists it again
    assert len(orders) == 1 and orders[0].state == ("a:1",) and orders[0].nbytes == H_STATE
    assert cp.counters().recovered_dropped == 1


def test_hybrid_non_boundary_state_is_dropped_when_a_commit_creates_its_node():
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(st("a:0", "a:3"), 0.0)
    orders = cp.commit_prefill(chain("a", 4), 1.0)
    assert isinstance(orders[0], DropOrder) and dropped(orders) == st("a:0")
    assert cp.chunk_info("a:3").state.ssd == "ready"
    drain(cp, orders, 1.0)


def test_dense_model_drops_every_recovered_state_object():
    cp = AuditedPlane(config())
    orders = cp.recover_ssd(kv("a:0") + st("a:0", "b:5"), 0.0)
    assert dropped(orders) == st("a:0", "b:5") and orders[0].nbytes == 0
    assert cp.usage().ssd_used == KV_BYTES
    c = cp.counters()
    assert (c.recovered, c.recovered_dropped) == (1, 2)


# ================================================================================== capacity
def test_more_recovered_than_fits_drops_the_rest_at_once():
    cp = AuditedPlane(config(ssd_chunks=4))
    keys = kv(*chain("r", 6))
    orders = cp.recover_ssd(keys, 0.0)
    assert len(orders) == 1 and dropped(orders) == keys[4:] and orders[0].nbytes == 2 * KV_BYTES
    assert cp.usage().ssd_used == 4 * KV_BYTES == cp.usage().ssd_capacity
    c = cp.counters()
    assert (c.recovered, c.recovered_dropped) == (4, 2)
    assert cp.plan(chain("r", 6), 1.0).num_chunks == 4


def test_recover_fills_only_the_free_room_and_never_evicts_tracked_copies():
    cp = AuditedPlane(config("full-duplicate", ssd_chunks=4))
    request(cp, chain("a", 3), 0.0)  # written through: 3 SSD copies
    assert cp.usage().ssd_used == 3 * KV_BYTES
    orders = cp.recover_ssd(kv("r:0", "r:1", "r:2"), 1.0)
    assert dropped(orders) == kv("r:1", "r:2")
    assert all(ssd_state(cp, h) == "ready" for h in chain("a", 3))
    assert cp.counters().ssd_evictions == 0


def test_hybrid_capacity_counts_state_bytes():
    cp = AuditedPlane(config(chunk=HYBRID, ssd_chunks=6))  # 6 kv objects' worth: a state takes 3.07
    orders = cp.recover_ssd(st("a:3") + kv("a:0", "a:1", "a:2"), 0.0)
    assert dropped(orders) == kv("a:2")
    assert cp.usage().ssd_used == H_STATE + 2 * H_KV


def test_a_write_evicts_recovered_objects_first_in_the_order_given_before_any_lru_copy():
    cp = AuditedPlane(config("full-duplicate", ssd_chunks=4))
    request(cp, chain("a", 2), 0.0)                      # two tracked SSD copies (LRU)
    cp.recover_ssd(kv("r:9", "r:1"), 1.0)                # fill the rest: "oldest" is r:9, the first given
    assert cp.usage().ssd_used == cp.usage().ssd_capacity
    orders = cp.commit_prefill(["c:0"], 2.0)
    assert dropped(orders) == kv("r:9")
    drops = [i for i, o in enumerate(orders) if isinstance(o, DropOrder) and o.tier is Tier.SSD]
    write = next(i for i, o in enumerate(orders) if isinstance(o, WriteOrder))
    assert drops and max(drops) < write  # the drop runs before the write that takes its room
    drain(cp, orders, 2.0)
    assert dropped(drain(cp, cp.commit_prefill(["d:0"], 3.0), 3.0)) == kv("r:1")
    assert cp.counters().ssd_evictions == 0 and ssd_state(cp, "a:0") == "ready"
    # No recovered object left: now the LRU pays.
    assert dropped(drain(cp, cp.commit_prefill(["e:0"], 4.0), 4.0)) == kv("a:0")
    assert cp.counters().ssd_evictions == 1
    assert cp.counters().recovered_dropped == 2


def test_recovered_objects_of_two_calls_are_evicted_in_call_order():
    cp = AuditedPlane(config("gds-only", ssd_chunks=3))
    cp.recover_ssd(kv("x:0"), 0.0)
    cp.recover_ssd(kv("y:0", "z:0"), 0.0)
    orders = drain(cp, cp.commit_prefill(chain("c", 2), 1.0), 1.0)
    assert dropped(orders) == kv("x:0", "y:0")


def test_a_write_larger_than_the_drive_drops_no_recovered_object():
    cp = AuditedPlane(config("full-duplicate", chunk=HYBRID, ssd_chunks=2))  # a state object never fits
    cp.recover_ssd(kv("r:0"), 0.0)
    orders = drain(cp, cp.commit_prefill(chain("a", 4), 1.0), 1.0)
    assert kv("r:0")[0] in dropped(orders)  # the kv writes took its room...
    assert all("a:3" not in o.state for o in writes_of(orders))  # ...the state write could not


def test_recovered_pinned_by_a_plan_is_not_evicted():
    cp = AuditedPlane(config("gds-only", ssd_chunks=2))
    cp.recover_ssd(kv("a:0", "a:1"), 0.0)
    plan = cp.plan(chain("a", 2), 1.0)  # adopted and pinned: no longer first to go, and not evictable
    orders = drain(cp, cp.commit_prefill(["b:0"], 1.0), 1.0)
    assert not dropped(orders) and not writes_of(orders)
    assert cp.counters().writes_skipped == 1
    cp.release(plan, 1.0)


# ================================================================= repeats, stale and this run's
def test_repeats_are_ignored_within_a_call_and_across_calls():
    cp = AuditedPlane(config())
    assert cp.recover_ssd(kv("a:0", "a:0", "a:1") + kv("a:0"), 0.0) == []
    before = snapshot(cp, ["a:0", "a:1"])
    assert cp.recover_ssd(kv("a:1", "a:0"), 1.0) == []
    assert snapshot(cp, ["a:0", "a:1"]) == before
    assert cp.counters().recovered == 2 and cp.usage().ssd_used == 2 * KV_BYTES


def test_a_repeat_beyond_the_room_is_dropped_once():
    cp = AuditedPlane(config(ssd_chunks=1))
    orders = cp.recover_ssd(kv("x", "y", "y"), 0.0)
    assert len(orders) == 1 and orders[0].kv == ("y",) and orders[0].nbytes == KV_BYTES
    assert cp.counters().recovered_dropped == 1


def test_adopted_objects_are_not_recovered_again():
    cp = AuditedPlane(config())
    cp.recover_ssd(kv("a:0"), 0.0)
    request(cp, ["a:0"], 1.0)
    before = snapshot(cp, ["a:0"])
    assert cp.recover_ssd(kv("a:0"), 2.0) == []
    assert snapshot(cp, ["a:0"]) == before


def test_stale_objects_the_tree_knows_without_an_ssd_copy_are_dropped():
    cp = AuditedPlane(config())
    request(cp, chain("a", 2), 0.0)  # in DRAM only
    before = snapshot(cp, chain("a", 2))
    orders = cp.recover_ssd(kv("a:0", "a:1", "b:0"), 1.0)
    assert dropped(orders) == kv("a:0", "a:1")
    assert snapshot(cp, chain("a", 2))[2] == before[2]  # their chunks as they were
    assert cp.usage().ssd_used == KV_BYTES  # b:0 alone
    assert cp.counters().recovered_dropped == 2


def test_objects_this_run_wrote_are_left_alone():
    cp = AuditedPlane(config("full-duplicate"))
    request(cp, chain("a", 2), 0.0)
    before = snapshot(cp, chain("a", 2))
    assert cp.recover_ssd(kv("a:0", "a:1"), 1.0) == []
    assert snapshot(cp, chain("a", 2)) == before


@pytest.mark.parametrize("ok", [True, False])
def test_objects_this_run_is_writing_are_left_to_the_write(ok):
    cp = AuditedPlane(config("full-duplicate"))
    _, orders = request(cp, chain("a", 2), 0.0, complete=False)
    assert cp.chunk_info("a:0").kv.ssd == "filling"
    used = cp.usage().ssd_used
    assert cp.recover_ssd(kv("a:0", "a:1"), 1.0) == []
    assert cp.usage().ssd_used == used and cp.counters().recovered == 0
    follow = []
    for order in orders:
        if not isinstance(order, DropOrder):
            follow += cp.complete(order.order_id, ok or not isinstance(order, WriteOrder), 1.0)
    if ok:
        assert not follow and ssd_state(cp, "a:0") == "ready"
    else:  # the write failed: its slot goes, the drives' copy with it
        assert set(dropped(follow)) == set(kv("a:0", "a:1")) and ssd_state(cp, "a:0") == "absent"


def test_bad_copy_this_run_holds_is_left_alone():
    cp = AuditedPlane(config("gds-only"))
    request(cp, ["a:0"], 0.0)
    plan = cp.plan(["a:0"], 1.0)
    other = cp.plan(["a:0"], 1.0)
    assert plan.kv_sources == (Tier.SSD,)
    assert cp.release(plan, 1.0, failed=["a:0"]) == []  # bad, still pinned by the other plan
    assert cp.chunk_info("a:0").kv.ssd == "bad"
    assert cp.recover_ssd(kv("a:0"), 2.0) == []
    assert cp.counters().recovered == cp.counters().recovered_dropped == 0
    assert dropped(cp.release(other, 2.0)) == kv("a:0")


# ======================================================================== refused input
@pytest.mark.parametrize("keys", [
    None, 5, 3.5, "a:0", b"a:0", ObjectKey("a:0", "kv"),
    ["a:0"], [("a:0", "kv")], [ObjectKey("a:0", "kv"), "a:1"], [ObjectKey("a:0", "kv"), None],
    [ObjectKey(["unhashable"], "kv")], [ObjectKey("a:1", "kv"), ObjectKey({"x": 1}, "state")],
], ids=lambda k: type(k).__name__ + repr(k)[:20])
def test_wrong_types_are_refused_and_change_nothing(keys):
    cp = AuditedPlane(config(chunk=HYBRID))
    cp.recover_ssd(kv("z:0"), 0.0)
    request(cp, chain("a", 2), 0.0)
    before = snapshot(cp, ["z:0", "a:0", "a:1"])
    with pytest.raises(ControlPlaneError):
        cp.recover_ssd(keys, 1.0)
    assert snapshot(cp, ["z:0", "a:0", "a:1"]) == before
    assert cp.recover_ssd([], 1.0) == []  # and the plane goes on


def test_a_forged_object_kind_is_refused():
    key = ObjectKey("a:0", "kv")
    object.__setattr__(key, "kind", "bogus")
    cp = AuditedPlane(config())
    with pytest.raises(ControlPlaneError):
        cp.recover_ssd([key], 0.0)
    assert cp.usage().ssd_used == 0


@pytest.mark.parametrize("now", [math.nan, math.inf, None, "1", True])
def test_bad_now_is_refused(now):
    cp = AuditedPlane(config())
    with pytest.raises(ControlPlaneError):
        cp.recover_ssd(kv("a:0"), now)
    assert cp.usage().ssd_used == 0 and cp.counters().recovered == 0


def test_any_iterable_of_keys_is_taken():
    cp = AuditedPlane(config())
    assert cp.recover_ssd((k for k in kv("a:0", "a:1")), 0.0) == []
    assert cp.recover_ssd({ObjectKey("b:0", "kv")}, 0.0) == []
    assert cp.recover_ssd((), 0.0) == []
    assert cp.counters().recovered == 3


def test_earlier_now_counts_as_the_latest():
    cp = AuditedPlane(config())
    request(cp, ["a:0"], 10.0)
    cp.recover_ssd(kv("b:0"), 5.0)
    cp.plan(["b:0"], 10.0)  # not an error: time did not run backwards


# ============================================================================== no SSD tier
@pytest.mark.parametrize("cfg", [config("dram-only"), config(ssd_chunks=0), config("dram-only", chunk=HYBRID)],
                         ids=["dram-only", "ssd-0", "dram-only-hybrid"])
def test_without_an_ssd_tier_everything_is_dropped(cfg):
    cp = AuditedPlane(cfg)
    keys = kv(*chain("a", 4)) + st("a:3")
    orders = cp.recover_ssd(keys, 0.0)
    assert len(orders) == 1 and orders[0].tier is Tier.SSD and set(dropped(orders)) == set(keys)
    assert cp.usage().ssd_used == 0 and cp.counters().recovered == 0
    assert cp.plan(chain("a", 4), 1.0).num_chunks == 0
    assert cp.usage().nodes == 0


# ================================================================================ usage
def test_usage_counts_recovered_bytes_through_adoption_and_drops():
    cp = AuditedPlane(config("gds-only", chunk=HYBRID, ssd_chunks=20))
    cp.recover_ssd(kv(*chain("a", 4)) + st("a:3") + kv("r:0"), 0.0)
    full = 5 * H_KV + H_STATE
    assert cp.usage().ssd_used == full
    plan = cp.plan(chain("a", 4), 1.0)
    assert cp.usage().ssd_used == full  # adoption moves bytes, adds none
    cp.release(plan, 1.0)
    orders = cp.recover_ssd(kv("a:0"), 2.0)
    assert orders == [] and cp.usage().ssd_used == full
    c = cp.counters()
    assert (c.recovered, c.recovered_adopted, c.recovered_dropped) == (6, 5, 0)


def test_chunk_info_of_adopted_chunks_is_fresh_metadata():
    cp = AuditedPlane(config())
    cp.recover_ssd(kv("a:0"), 0.0)
    plan = cp.plan(["a:0"], 7.0)
    info = cp.chunk_info("a:0")
    assert (info.depth, info.parent, info.E_b, info.R_b, info.last_reuse) == (0, None, 0, 0, 7.0)
    cp.commit_prefill(["a:0"], 8.0, plan=plan)
    assert cp.chunk_info("a:0").R_b == 1  # reused: the previous run computed it
