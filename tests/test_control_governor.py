"""Properties of the endurance governor's update (hypothesis), and theta_R moving with theta_E
through fractional admission."""

from __future__ import annotations

import copy
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from saria.config import Policy
from saria.control import EnduranceGovernor
from saria.control.admission import Admission, chunk_fraction
from saria.control.tree import Node

BUDGET = 1000.0
# A run of updates: (seconds since the previous one, write rate over them as a multiple of the budget).
steps = st.lists(st.tuples(st.floats(1.0, 4000.0), st.floats(0.0, 50.0)), min_size=1, max_size=120)
starts = st.floats(1.0, 16.0)


def feed(gov: EnduranceGovernor, run) -> list[tuple[float, float]]:
    t, written, seen = 0.0, 0, []
    for dt, rate in run:
        t += dt
        written += int(rate * BUDGET * dt)
        seen.append((gov.update(t, written), gov.theta_R))
    return seen


@settings(max_examples=200, deadline=None)
@given(run=steps, theta_E=starts, theta_R=st.one_of(st.none(), st.floats(1.0, 64.0)))
def test_same_updates_same_thresholds_within_bounds_never_nan(run, theta_E, theta_R):
    a = EnduranceGovernor(BUDGET, theta_E, theta_R=theta_R, theta_min=1.0, theta_max=16.0)
    b = EnduranceGovernor(BUDGET, theta_E, theta_R=theta_R, theta_min=1.0, theta_max=16.0)
    seen = feed(a, run)
    assert seen == feed(b, run) and a.history == b.history
    for theta, theta_r in seen:
        assert not math.isnan(theta) and 1.0 <= theta <= 16.0
        if theta_R is None:
            assert theta_r == math.inf
        else:  # theta_R moves by theta_E's factor, at least 1
            assert not math.isnan(theta_r)
            assert math.isclose(theta_r, max(1.0, theta_R * theta / a.history[0][1]), rel_tol=1e-12)
    assert not math.isnan(a.rate) and a.rate >= 0


@settings(max_examples=200, deadline=None)
@given(run=steps, last=st.tuples(st.floats(900.0, 4000.0), st.floats(0.0, 50.0)), theta_E=starts)
def test_theta_moves_toward_the_rate_error(run, last, theta_E):
    """A step raises theta_E only when the averaged rate is over the aim, lowers it only under it."""
    gov = EnduranceGovernor(BUDGET, theta_E)
    feed(gov, run)
    before = gov.theta_E
    t = sum(dt for dt, _ in run) + last[0]
    written = gov._last_bytes + int(last[1] * BUDGET * last[0])  # noqa: SLF001 (the cumulative count so far)
    after = gov.update(t, written)
    aim = gov.aim(t, written)
    if after > before:
        assert gov.rate > aim
    elif after < before:
        assert gov.rate < aim


@settings(max_examples=200, deadline=None)
@given(warmup=st.floats(0.05, 20.0), low=st.floats(0.0, 30.0), high=st.floats(0.0, 30.0), theta_E=starts)
def test_response_is_monotone_in_the_rate(warmup, low, high, theta_E):
    """From one state (no raise to judge yet), a higher write rate never gives a lower theta_E."""
    low, high = min(low, high), max(low, high)
    gov = EnduranceGovernor(BUDGET, theta_E)
    gov.update(0.0, 1)
    gov.update(900.0, 1 + int(warmup * BUDGET * 900))
    if gov.theta_E > theta_E:
        return  # it raised: the next raise is judged on its response, another property
    a, b = copy.deepcopy(gov), copy.deepcopy(gov)
    base = gov._last_bytes  # noqa: SLF001
    assert a.update(1800.0, base + int(low * BUDGET * 900)) <= b.update(1800.0, base + int(high * BUDGET * 900))


def test_it_stops_raising_when_raises_stop_lowering_the_rate():
    """Writes that do not fall with theta_E (a saturated server): one raise, then it holds while
    the rate has not fallen since, instead of running to theta_max."""
    gov = EnduranceGovernor(BUDGET, 2)
    t, written = 0.0, 1
    gov.update(t, written)
    for _ in range(8):  # 2 h at 3x the budget, whatever theta_E
        t += 900
        written += int(3 * BUDGET * 900)
        gov.update(t, written)
    assert 2.0 < gov.theta_E < 4.0
    responsive = EnduranceGovernor(BUDGET, 2)
    responsive.update(0.0, 1)
    t, written = 0.0, 1
    for _ in range(24):  # 6 h of writes that fall as 1 / theta_E: it keeps raising until they meet the aim
        t += 900
        written += int(12 * BUDGET / responsive.theta_E * 900)
        responsive.update(t, written)
    assert responsive.theta_E > gov.theta_E


def test_theta_R_dithers_like_theta_E():
    """A fractional theta_R admits by reuse when R_b + u_b >= theta_R; integer thresholds are Eq. 1."""
    policy = Policy(theta_E=2, theta_R=8, admission="eq1")  # reuse writes at once (not deferred)
    plain, dithered = Admission(policy, 1), Admission(policy, 1)
    dithered.dither = True
    nodes = [Node(i, None, 0.0, 1) for i in range(2000)]
    for r in range(12):
        for node in nodes[:100]:
            node.R_b, node.E_b = r, 0
            assert plain.admitted(node) == dithered.admitted(node) == plain.by_reuse(node) \
                == dithered.by_reuse(node) == (r >= 8)
    dithered.theta_R = 8.25
    for node in nodes:
        node.R_b, node.E_b = 8, 0
    assert [dithered.by_reuse(n) for n in nodes] == [chunk_fraction(n) >= 0.25 for n in nodes]
    assert [dithered.admitted(n) for n in nodes] == [chunk_fraction(n) >= 0.25 for n in nodes]
    assert 0.7 < sum(dithered.by_reuse(n) for n in nodes) / len(nodes) < 0.8
    gov = EnduranceGovernor(BUDGET, 2, theta_R=8)
    assert gov.theta_R == 8.0
    gov.update(0.0, 1)
    for i in range(1, 13):  # 3 h at 5x the budget, falling as 1 / theta: both thresholds rise together
        gov.update(900.0 * i, 1 + int(sum(5 * BUDGET * 900 for _ in range(i))))
    assert gov.theta_E > 2 and math.isclose(gov.theta_R, 4 * gov.theta_E)
