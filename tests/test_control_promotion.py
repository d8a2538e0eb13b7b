"""Lazy partial promotion (paper Eqs. 2-3): P_target arithmetic, the P_tau recency guard, r = 0 / 1."""

from __future__ import annotations

import pytest
from control_cases import chain, config, drain, request

from saria.config import Bandwidths, SariaConfig
from saria.control import ControlPlane, PromoteOrder, Tier, promotion_target

D, S = Tier.DRAM, Tier.SSD


@pytest.mark.parametrize("r, d0, s0, expected", [
    pytest.param(0.4, 0, 10, 4, id="all-ssd"),
    pytest.param(0.4, 6, 4, 0, id="dram-already-above-share"),
    pytest.param(0.4, 4, 6, 0, id="dram-exactly-at-share"),
    pytest.param(0.7, 4, 6, 3, id="partial"),
    pytest.param(0.6, 1, 2, 0, id="rounds-down"),  # 0.6 * 3 - 1 = 0.8
    pytest.param(0.58, 0, 100, 58, id="float-noise"),  # 0.58 * 100 = 57.99999999999999
    pytest.param(1.0, 3, 5, 5, id="r1-every-ssd-hit"),
    pytest.param(0.0, 0, 9, 0, id="r0-none"),
    pytest.param(0.5, 0, 0, 0, id="empty"),
])
def test_promotion_target_arithmetic(r, d0, s0, expected):
    assert promotion_target(r, d0, s0) == expected


def test_promotion_target_rejects_bad_input():
    with pytest.raises(ValueError, match="r must be in"):
        promotion_target(1.5, 1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        promotion_target(0.5, -1, 1)


def test_auto_ratio_is_one_minus_disk_over_gpu_bandwidth():
    assert SariaConfig().promotion_ratio == pytest.approx(1 - 20 / 48)
    assert SariaConfig(bandwidth=Bandwidths(drives=2)).promotion_ratio == pytest.approx(1 - 40 / 48)
    assert SariaConfig(bandwidth=Bandwidths(drives=3)).promotion_ratio == 0.0  # SSDs alone saturate ingress


def on_ssd_only(preset="full-duplicate", n=10, dram_chunks=16, **policy) -> ControlPlane:
    """n chunks written through at t=0, then pushed out of DRAM (at t=1) by single-use chunks:
    the n chunks are only on SSD and DRAM is full of chunks last used at t=1."""
    cp = ControlPlane(config(preset, dram_chunks=dram_chunks, ssd_chunks=64, **policy))
    request(cp, chain("c", n), 0.0)
    for i in range(dram_chunks):
        request(cp, [f"fill{i}"], 1.0)
    assert all(cp.chunk_info(h).kv.dram == "absent" and cp.chunk_info(h).kv.ssd == "ready" for h in chain("c", n))
    return cp


def promoted(orders) -> list:
    return [h for o in orders if isinstance(o, PromoteOrder) for h in o.kv]


def test_promotes_p_target_first_ssd_hits_after_prefill():
    cp = on_ssd_only(r=0.4)
    plan, orders = request(cp, chain("c", 10), 100.0)  # D0 = 0, S0 = 10
    assert plan.kv_sources == (S,) * 10
    assert promoted(orders) == chain("c", 4)
    assert cp.counters().promotions == 4

    plan, orders = request(cp, chain("c", 10), 200.0)  # D0 = 4, S0 = 6: 0.4 * 10 - 4 = 0
    assert plan.kv_sources == (D,) * 4 + (S,) * 6
    assert promoted(orders) == []


def test_promotion_after_a_mixed_plan_fills_the_share_up_to_r():
    cp = on_ssd_only(r=0.4)
    request(cp, chain("c", 10), 100.0)  # c:0-3 promoted
    cp2_orders = request(cp, chain("c", 10), 200.0)[1]
    assert promoted(cp2_orders) == []
    cp = on_ssd_only(r=0.7)
    request(cp, chain("c", 10), 100.0)  # 7 promoted
    plan, orders = request(cp, chain("c", 10), 200.0)
    assert plan.kv_sources == (D,) * 7 + (S,) * 3 and promoted(orders) == []


def test_no_promotion_evicts_a_candidate_reused_less_than_p_tau_ago():
    cp = on_ssd_only(r=1.0, p_tau_s=60.0)  # DRAM full of chunks last reused at t = 1
    _, orders = request(cp, chain("c", 4), 60.5)  # candidates idle 59.5 s < 60 s
    assert promoted(orders) == [] and cp.counters().promotion_evictions == 0
    assert all(cp.chunk_info(f"fill{i}").kv.dram == "ready" for i in range(16))
    _, orders = request(cp, chain("c", 4), 61.0)  # idle exactly 60 s: may go
    assert promoted(orders) == chain("c", 4)
    assert cp.counters().promotion_evictions == 4
    evicted = [i for i in range(16) if cp.chunk_info(f"fill{i}").kv.dram == "absent"]
    assert evicted == [0, 1, 2, 3]  # the least recently used, only as many as needed


def test_promotion_is_capped_by_free_space_plus_idle_candidates():
    cp = on_ssd_only(r=1.0, p_tau_s=60.0)
    for i in range(16):  # refresh twelve of them at t = 50: only four candidates can be idle at t = 100
        if i >= 4:
            request(cp, [f"fill{i}"], 50.0)
    _, orders = request(cp, chain("c", 10), 100.0)
    assert promoted(orders) == chain("c", 4)


def test_r_zero_and_r_one_behave_as_zero_and_full_promotion():
    through = {"admit_all": True, "write_through": True}  # so that the chunks are on SSD to begin with
    for preset, policy, expect in (("full-duplicate", {"r": 0.0}, 0), ("zero-promotion", through, 0),
                                   ("full-duplicate", {"r": 1.0, "p_tau_s": 0.0}, 6),
                                   ("full-promotion", through, 6)):
        cp = on_ssd_only(preset, n=6, dram_chunks=8, **policy)
        plan, orders = request(cp, chain("c", 6), 2.0)  # candidates idle only 1 s: P_tau 0 lets them go
        assert plan.kv_sources == (S,) * 6
        assert len(promoted(orders)) == expect, (preset, policy)
        plan = cp.plan(chain("c", 6), 3.0)
        assert plan.kv_sources == ((D,) * 6 if expect else (S,) * 6)
        cp.release(plan, 3.0)


def test_failed_promotion_leaves_no_dram_copy():
    cp = on_ssd_only(r=0.4)
    plan = cp.plan(chain("c", 10), 100.0)
    orders = cp.commit_prefill(chain("c", 10), 100.0, plan)
    [promote] = [o for o in orders if isinstance(o, PromoteOrder)]
    drain(cp, [o for o in orders if o is not promote], 100.0)
    follow_ups = cp.complete(promote.order_id, False, 100.0)
    assert [o.kv for o in follow_ups] == [tuple(chain("c", 4))]  # slots released
    assert all(cp.chunk_info(h).kv.dram == "absent" for h in chain("c", 4))
    assert cp.counters().promotions_failed == 4 and not cp.audit()
