"""Bad input raises a clear error and leaves the control plane exactly as it was."""

from __future__ import annotations

import math

import pytest
from control_cases import chain, config, drain, request, snapshot

from saria.control import ControlPlane, ControlPlaneError, DropOrder, ObjectKey, StoreOrder, Tier, WriteOrder

KNOWN = ["a", "b", "c", "x", "y", "z"]


@pytest.fixture
def cp():
    """a-b-c known and in DRAM, x-y on SSD only; a live plan, a store and a write awaiting completion."""
    cp = ControlPlane(config("full-duplicate", dram_chunks=4))
    request(cp, ["x", "y"], 0.0)
    request(cp, chain("fill", 4), 1.0)  # x, y now only on SSD
    request(cp, ["a", "b", "c"], 2.0)
    return cp


def unchanged(cp: ControlPlane, call, match: str) -> None:
    before = snapshot(cp, KNOWN)
    with pytest.raises(ControlPlaneError, match=match):
        call()
    assert snapshot(cp, KNOWN) == before
    assert cp.audit() == []


def test_unknown_and_finished_ids(cp):
    plan = cp.plan(["a", "b"], 3.0)
    orders = cp.commit_prefill(["z"], 3.0)
    store = next(o for o in orders if isinstance(o, StoreOrder))
    write = next(o for o in orders if isinstance(o, WriteOrder))
    unchanged(cp, lambda: cp.complete(10_000, True, 4.0), "unknown order id 10000: never issued")
    unchanged(cp, lambda: cp.complete(plan.plan_id, True, 4.0), "is a reload plan")
    unchanged(cp, lambda: cp.complete("7", True, 4.0), "order id must be an int")
    unchanged(cp, lambda: cp.complete(store.order_id, "yes", 4.0), "ok must be a bool")
    unchanged(cp, lambda: cp.complete(store.order_id, True, 4.0, failed=["a"]), "failed entry 0 .a chunk hash. is not among the objects")
    unchanged(cp, lambda: cp.complete(store.order_id, True, 4.0, failed=[ObjectKey("z", "state")]), "not among")
    cp.complete(store.order_id, True, 4.0)
    unchanged(cp, lambda: cp.complete(store.order_id, True, 4.0), "not awaiting completion: already completed")
    drops = [o for o in cp.complete(write.order_id, True, 4.0) + orders if isinstance(o, DropOrder)]
    for drop in drops:
        unchanged(cp, lambda: cp.complete(drop.order_id, True, 4.0), "drop order")
    unchanged(cp, lambda: cp.release(store.order_id, 4.0), "already released or committed")
    unchanged(cp, lambda: cp.release(10_000, 4.0), "unknown plan id 10000")
    cp.release(plan, 4.0)
    unchanged(cp, lambda: cp.release(plan, 4.0), f"plan {plan.plan_id} was already released or committed")
    unchanged(cp, lambda: cp.commit_prefill(["a", "b"], 4.0, plan), "already released or committed")


def test_plans_must_match_what_they_commit(cp):
    plan = cp.plan(["a", "b", "c"], 3.0)
    unchanged(cp, lambda: cp.commit_prefill(["a", "x"], 3.0, plan), "do not begin the committed chunk hashes")
    unchanged(cp, lambda: cp.commit_prefill(["a", "b"], 3.0, plan), "do not begin")
    unchanged(cp, lambda: cp.commit_prefill(["a", "b", "c"], 3.0, plan, failed=["a"]),
              "failed entry 0 .a chunk hash. is not among the objects plan .* reads from SSD")  # a DRAM read cannot fail
    unchanged(cp, lambda: cp.commit_prefill(["a", "b", "c"], 3.0, plan, failed=["q"]), "not among")
    forged = plan.__class__(**{**{f: getattr(plan, f) for f in plan.__slots__}, "tokens": 1})
    unchanged(cp, lambda: cp.commit_prefill(["a", "b", "c"], 3.0, forged), "does not match")
    cp.commit_prefill(["a", "b", "c", "d"], 3.0, plan)


def test_chunk_sequences_that_contradict_the_tree(cp):
    for bad, match in ((["b"], "chunk 0 comes at the root, but the tree has it under another chunk .depth 1."),
                       (["x", "b"], "chunk 1 comes under chunk 0, but the tree has it under another chunk"),
                       (["a", "new", "c"], "chunk 2 comes after chunk 1, which the tree does not know"),
                       (["a", "b", "a"], "contradicts the context tree"),
                       (["n1", "n2", "n1"], "chunk 2 repeats the hash of chunk 0 in one request"),
                       ([["unhashable"]], "must be hashable"),
                       ("abc", "must be a sequence"),
                       (42, "must be a sequence")):
        unchanged(cp, lambda: cp.plan(bad, 3.0), match)
        unchanged(cp, lambda: cp.commit_prefill(bad, 3.0), match)


def test_bad_times(cp):
    for now in (math.nan, math.inf, -math.inf, "3", None, True):
        unchanged(cp, lambda: cp.plan(["a"], now), "now must be a finite number")
        unchanged(cp, lambda: cp.commit_prefill(["a"], now), "now must be a finite number")


def test_a_failed_ssd_read_marks_the_copy_bad_and_drops_it_after_the_last_pin(cp):
    first = cp.plan(["x", "y"], 3.0)
    second = cp.plan(["x", "y"], 3.0)
    assert first.kv_sources == second.kv_sources == (Tier.SSD, Tier.SSD)
    orders = cp.release(first, 3.0, failed=["x"])
    assert orders == [] and cp.chunk_info("x").kv.ssd == "bad"  # second still pins (and reads) it
    assert cp.plan(["x"], 3.0).num_chunks == 0  # nobody plans a bad copy
    orders = cp.release(second, 3.0)
    assert [(o.tier, o.kv) for o in orders] == [(Tier.SSD, ("x",))]
    assert cp.chunk_info("x").kv.ssd == "absent" and cp.counters().ssd_read_failures == 1


def test_failed_write_leaves_the_chunk_non_persisted(cp):
    orders = cp.commit_prefill(["w"], 3.0)  # full duplicate: stored and written through
    drain(cp, orders, 3.0, fail_writes=True)
    info = cp.chunk_info("w")
    assert (info.kv.dram, info.kv.ssd) == ("ready", "absent")
    assert cp.counters().writes_failed == 1 and cp.counters().ssd_writes == 9  # every earlier chunk
    assert cp.audit() == []


def test_a_request_keeps_its_chunks_metadata_even_when_its_reads_free_their_last_copy():
    """a is past its metadata window and held only by its SSD copy; the request's read of that
    copy fails, which drops the copy: a must be woken by the request, not reclaimed under it."""
    cp = ControlPlane(config("full-duplicate", dram_chunks=2, metadata_window_s=10.0))
    request(cp, ["a"], 0.0)
    request(cp, ["f0"], 1.0)
    request(cp, ["f1"], 1.0)  # a is only on SSD now, with E_b = 1
    plan = cp.plan(["a"], 50.0)  # a's window has passed: parked until its copy goes
    assert plan.kv_sources == (Tier.SSD,)
    orders = cp.commit_prefill(["a"], 50.0, plan, failed=["a"])
    info = cp.chunk_info("a")
    assert (info.E_b, info.R_b, info.last_reuse) == (1, 1, 50.0)
    drain(cp, orders, 50.0)
    assert cp.audit() == []


def test_malformed_arguments_are_refused_before_anything_changes(cp):
    """Arguments of the wrong type raise ControlPlaneError, never a raw TypeError, and change nothing;
    a string is never taken as a sequence of one-character chunk hashes."""
    plan = cp.plan(["x", "y"], 3.0)  # both from SSD
    orders = cp.commit_prefill(["z"], 3.0)
    store = next(o for o in orders if isinstance(o, StoreOrder))
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, failed=None), "failed must be a list")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, failed="xy"), "failed must be a list")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, failed=[["x"]]), "failed entries")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, failed=5), "failed must be a list")
    unchanged(cp, lambda: cp.release(plan, 4.0, failed=None), "failed must be a list")
    unchanged(cp, lambda: cp.release(plan, 4.0, failed=[{"x"}]), "failed entries")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, states=5), "states must be")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, states="01"), "states must be")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, states=[True]), "states names")
    unchanged(cp, lambda: cp.commit_prefill(["x", "y"], 4.0, plan=plan, states=[0.5]), "states names")
    unchanged(cp, lambda: cp.commit_prefill(["q"], 4.0, failed=["q"]), "no plan")
    unchanged(cp, lambda: cp.complete(store.order_id, True, 4.0, failed=None), "failed must be a list")
    unchanged(cp, lambda: cp.complete(store.order_id, True, 4.0, failed=[["z"]]), "failed entries")
    unchanged(cp, lambda: cp.complete(store.order_id, 1, 4.0), "ok must be a bool")
    unchanged(cp, lambda: cp.plan(["x"], 10**400), "finite number")
    unchanged(cp, lambda: cp.plan(["x"], "4"), "finite number")
    unchanged(cp, lambda: cp.plan([["x"]], 4.0), "hashable")
    with pytest.raises(ControlPlaneError, match="hashable"):
        cp.chunk_info(["a"])
    # Still usable, and the same calls done right work.
    drain(cp, cp.commit_prefill(["x", "y"], 4.0, plan=plan, failed=("y",), states=None), 4.0)
    drain(cp, orders, 4.0)
    assert cp.counters().ssd_read_failures == 1 and cp.audit() == []


def test_policy_values_that_would_break_a_commit_are_refused_up_front():
    from saria.config import Policy, WriteBudget

    with pytest.raises(ValueError, match="prewrite_depth must be <="):
        Policy(prewrite_depth=2**63)
    with pytest.raises(ValueError, match="theta_max must be <="):
        WriteBudget(theta_max=2**1100)
    cp = ControlPlane(config("saria", prewrite_depth=1 << 30))  # the largest depth works
    request(cp, chain("p", 12), 0.0)
    request(cp, chain("q", 12), 1.0)
    assert cp.audit() == []
