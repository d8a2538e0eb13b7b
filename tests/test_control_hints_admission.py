"""Hints drive SSD admission (saria.control.hints, issue 44 item 4): where a session announced its
next turn, its word replaces Eq. 1's guess for the session's private chunks of its latest prompt
(written at DRAM eviction when the turn comes within the SSD's retention, never when beyond it);
a done session's private chunks are never written; shared chunks and sessions that announced
nothing keep Eq. 1 exactly; one tenant's hints never decide another's chunks."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from control_cases import DENSE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.config import Capacity, Policy, SariaConfig
from saria.control import ControlPlane, WriteOrder
from saria.control.hints import Hints

from test_control_hints import drive  # commit a request, complete every order it leads to

KV = DENSE.kv_bytes
ROOT = Path(__file__).resolve().parent.parent


def make_plane(dram: int = 4, ssd: int = 6) -> ControlPlane:
    config = SariaConfig(dram=Capacity(nbytes=dram * KV), ssd=Capacity(nbytes=ssd * KV), chunk=DENSE,
                         policy=Policy.preset("saria", metadata_window_s=1e6, prewrite_depth=0))
    return ControlPlane(config)


def written(orders) -> set:
    return {h for o in orders if isinstance(o, WriteOrder) for h in o.kv}


def flood(cp: ControlPlane, start: float, n: int, tag: str = "x") -> list:
    out = []
    for i in range(n):
        out += drive(cp, [(tag, i)], start + i)
    return out


def test_an_announced_turn_within_the_ssds_retention_admits_at_the_first_eviction():
    for hints, expect in ((None, False), (Hints(session="s"), False), (Hints(session="s", next_turn_s=30.0), True)):
        cp = make_plane()
        drive(cp, [("a", 0)], 0.0, hints=hints, tenant="A")
        orders = flood(cp, 1.0, 5)  # evicts ("a", 0) once: Eq. 1 (theta_E = 2) does not admit it
        assert (("a", 0) in written(orders)) is expect
        assert cp.hint_counters().announced_admits == int(expect)


def test_an_announced_turn_beyond_the_ssds_retention_is_not_written_where_eq1_would():
    def run(next_turn_s):
        cp = make_plane()
        # the SSD fills and evicts: its retention (the age of its latest victim) becomes some seconds
        for i in range(14):  # sessions of tenant W announcing their next turns: each written at its eviction
            drive(cp, [("w", i)], i * 0.5, hints=Hints(session=f"w{i}", next_turn_s=0.1), tenant="W")
        assert cp.counters().ssd_evictions > 0
        hints = Hints(session="s", next_turn_s=next_turn_s)
        out = []
        for turn in range(3):  # reused twice: evicted twice, E_b reaches theta_E = 2
            out += drive(cp, [("a", 0)], 20.0 + 20 * turn, hints=hints, tenant="A")
            out += flood(cp, 21.0 + 20 * turn, 5, f"f{turn}")
        return cp, written(out)

    cp, plain = run(None)
    assert ("a", 0) in plain  # Eq. 1 writes it at its second eviction
    cp, far = run(1e6)  # the session says it comes back in 11 days: past what the SSD keeps
    assert ("a", 0) not in far
    assert cp.hint_counters().announced_skips >= 1
    cp, near = run(5.0)
    assert ("a", 0) in near


def test_a_done_sessions_older_private_chunks_are_never_written():
    def run(last: Hints):
        cp = make_plane()
        t1 = [("t1", 0)]
        drive(cp, t1, 0.0, hints=Hints(session="s"), tenant="A")
        flood(cp, 1.0, 5, "f0")  # t1 evicted once (E_b 1: Eq. 1 does not write it)
        drive(cp, t1, 10.0, hints=Hints(session="s"), tenant="A")  # back in DRAM (recomputed)
        # the session's last turn is another prompt: t1 is outside it, still the session's private chunk
        drive(cp, [("t2", 0)], 11.0, hints=last, tenant="A")
        return written(flood(cp, 12.0, 5, "f1"))  # t1's second eviction: E_b 2, Eq. 1 would write it

    assert ("t1", 0) in run(Hints(session="s"))
    assert ("t1", 0) not in run(Hints(session="s", done=True))


def test_a_shared_chunk_keeps_eq1():
    for hints_b in (None, Hints(session="other")):
        cp = make_plane()
        drive(cp, [("sys", 0)], 0.0, hints=Hints(session="s", next_turn_s=1e6), tenant="A")
        drive(cp, [("sys", 0)], 0.5, hints=hints_b, tenant="A")  # another session's (or none's) reference
        orders = []
        for turn in range(2):
            orders += flood(cp, 1.0 + 10 * turn, 5, f"f{turn}")
            orders += drive(cp, [("sys", 0)], 8.0 + 10 * turn)
        assert ("sys", 0) in written(orders)  # Eq. 1: written at its second eviction, whatever "s" said
        assert cp.hint_counters().announced_skips == 0


def test_another_tenants_announcement_decides_nothing_of_mine():
    cp = make_plane()
    drive(cp, [("a", 0)], 0.0, hints=Hints(session="s"), tenant="A")
    drive(cp, [("b", 0)], 0.5, hints=Hints(session="s", next_turn_s=30.0), tenant="B")  # B's session "s"
    orders = flood(cp, 1.0, 5)
    assert ("a", 0) not in written(orders)  # A announced nothing: Eq. 1 (one eviction: not admitted)
    assert ("b", 0) in written(orders)  # B's own chunk: its announcement admits it


def test_the_next_turn_clears_the_announcement():
    cp = make_plane()
    drive(cp, [("a", 0)], 0.0, hints=Hints(session="s", next_turn_s=30.0), tenant="A")
    drive(cp, [("a", 0), ("a", 1)], 1.0, hints=Hints(session="s"), tenant="A")  # came, announces nothing
    orders = flood(cp, 2.0, 5)
    assert not written(orders) & {("a", 0), ("a", 1)}  # Eq. 1 again: one eviction each


# --------------------------------------------------- a session that announces nothing is Eq. 1's, exactly

request = st.tuples(st.sampled_from(["A", "B"]), st.integers(0, 3), st.integers(1, 4), st.booleans())
ops = st.lists(st.one_of(st.tuples(st.just("request"), request), st.tuples(st.just("advance"), st.floats(0.1, 50.0))),
               min_size=20, max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_sessions_without_announcements_decide_exactly_as_eq1(ops):
    """Two planes, one fed session keys (and tenants) on every request, the other nothing: the same
    orders and counters at every step, on tiers small enough that DRAM and SSD evict."""
    plain, hinted = make_plane(3, 5), make_plane(3, 5)
    now, lengths = 0.0, {}
    for op in ops:
        if op[0] == "advance":
            now += op[1]
            continue
        tenant, session, grow, fresh = op[1]
        key = (tenant, session)
        lengths[key] = 1 if fresh else min(lengths.get(key, 0) + grow, 6)
        hashes = [(tenant, session, j) for j in range(lengths[key])]
        a = drive(plain, hashes, now)
        b = drive(hinted, hashes, now, hints=Hints(session=f"s{session}"), tenant=tenant)
        assert [(type(o).__name__, o.kv) for o in a] == [(type(o).__name__, o.kv) for o in b]
        assert plain.counters() == hinted.counters()
        now += 0.5


# ----------------------------------------------------------------------------------- the bench's smoke run

def test_bench_hints_quick_prints_its_verdicts(tmp_path):
    trace = ROOT.parent / "shared" / "traces" / "agent_magentic_one.jsonl"
    if not trace.exists():
        import pytest
        pytest.skip("the shared traces are not here")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_hints.py"), "--quick", "--jobs", "1",
                          "--json", str(tmp_path / "h.json")], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "without hints: identical to saria: MET" in out.stdout
    assert "accuracy 1.0" in out.stdout and ("MET" in out.stdout or "MISSED" in out.stdout)
    import json
    data = json.loads((tmp_path / "h.json").read_text())
    row = data["rows"][0]["results"]
    assert row["saria+hints@1.0"]["retention"] > row["saria"]["retention"]  # the hints keep more
    assert row["saria+hints@1.0"]["ssd_write_bytes"] < row["saria"]["ssd_write_bytes"]  # for fewer bytes
    assert not math.isnan(row["oracle"]["retention"])


def test_the_replays_hint_kinds():
    import pytest

    from saria.replay.arrivals import Schedule, SessionPlan
    from saria.replay.hints import derive_hints

    chunks = [("sys", "a1"), ("sys", "a1", "a2"), ("sys", "b1"), ("sys", "c1")]
    schedule = Schedule("rewindow", (SessionPlan(0.0, (0, 1), (4.0,)), SessionPlan(1.0, (2,), ()),
                                     SessionPlan(2.0, (3,), ())))
    trace = derive_hints(schedule, chunks)  # multi-turn sessions: the session hints
    assert trace == derive_hints(schedule, chunks, kind="sessions")
    assert trace[0] == Hints(session="session-0", next_turn_s=4.0) and trace[1].done and trace[2].done
    pins = derive_hints(schedule, chunks, kind="pins")  # the platform's: "sys" begins three sessions' requests
    assert [h.pin_chunks if h else None for h in pins] == [1, 1, 1, 1]
    assert all(h.session is None and not h.done for h in pins)
    with pytest.raises(ValueError, match="hints"):
        derive_hints(schedule, chunks, kind="guess")


# ------------------------------------------------------------------------ across a control-plane rebuild

def test_pins_retentions_and_sessions_outlive_a_rebuilt_control_plane():
    old = make_plane(dram=4, ssd=40)
    drive(old, [("p", 0), ("p", 1)], 0.0, hints=Hints(pin=math.inf), tenant="A")
    drive(old, [("p", 9)], 0.5, hints=Hints(pin=5.0), tenant="A")  # ends before the rebuild
    drive(old, [("r", 0)], 1.0, hints=Hints(retain_s=100.0), tenant="B")
    drive(old, [("a", 0)], 2.0, hints=Hints(session="s", next_turn_s=30.0), tenant="A")
    old.turn_ended([("a", 0)], 2.0, Hints(session="s", next_turn_s=30.0), tenant="A")
    assert old.pins("A")[("p", 9)] == 5.5
    state = old.hint_state()
    new = make_plane(dram=4, ssd=40)
    new.restore_hints(state, 10.0)
    assert new.pins("A") == {("p", 0): math.inf, ("p", 1): math.inf}  # the ended TTL pin is not taken over
    assert new.pinned_bytes("A") == 2 * KV and new.retained_bytes("B") == KV
    assert new.next_hinted_prewarm() == old.next_hinted_prewarm() == 27.0  # due again (lead 5 s)
    # the pinned prefix and the retained chunk, referenced again (no hints), are written at their
    # first eviction and the pinned one stays on SSD through a flood
    drive(new, [("p", 0), ("p", 1)], 11.0)
    drive(new, [("r", 0)], 11.5)
    orders = flood(new, 12.0, 6)
    assert {("p", 0), ("p", 1), ("r", 0)} <= written(orders)
    assert new.hint_counters().hinted_admissions == 3
    # a fresh plane without the state: the same traffic writes none of them (Eq. 1, one eviction)
    fresh = make_plane(dram=4, ssd=40)
    drive(fresh, [("p", 0), ("p", 1)], 11.0)
    drive(fresh, [("r", 0)], 11.5)
    assert not written(flood(fresh, 12.0, 6)) & {("p", 0), ("p", 1), ("r", 0)}
    assert new.hint_counters().pins == 0 and new.pinned_bytes("A") == 2 * KV  # taken over, not pinned anew


def test_a_restored_pin_past_a_smaller_tiers_cap_is_refused():
    old = make_plane(dram=4, ssd=40)  # a tenth: 4 chunks
    drive(old, [("p", j) for j in range(4)], 0.0, hints=Hints(pin=math.inf), tenant="A")
    new = make_plane(dram=4, ssd=20)  # a tenth: 2 chunks
    new.restore_hints(old.hint_state(), 1.0)
    assert new.pinned_bytes("A") == 2 * KV and new.hint_counters().pins_refused == 2


def test_restore_hints_refuses_what_is_not_a_hint_state():
    import pytest

    from saria.control import ControlPlaneError

    with pytest.raises(ControlPlaneError, match="hint_state"):
        make_plane().restore_hints([("pins", {})], 0.0)


def test_recovered_ssd_objects_of_restored_pins_stay_until_a_request_reaches_them():
    """After a rebuild, a previous plane's pinned chunks are on the drives (recovered, no node yet) and
    their pins restored: SSD room is made from the other recovered objects (retained ones last), never
    from a pinned chunk's, and a request that reaches the pinned chunks later reloads them from SSD."""
    from saria.control import ObjectKey
    from saria.orders import SSD

    old = make_plane(dram=4, ssd=40)
    drive(old, [("p", 0), ("p", 1)], 0.0, hints=Hints(pin=math.inf), tenant="A")
    drive(old, [("r", 0)], 0.5, hints=Hints(retain_s=1e5), tenant="B")
    config = SariaConfig(dram=Capacity(nbytes=4 * KV), ssd=Capacity(nbytes=8 * KV), chunk=DENSE,
                         policy=Policy.preset("saria", theta_E=1, metadata_window_s=1e6, prewrite_depth=0))
    new = ControlPlane(config, pin_bytes_per_tenant=2 * KV, retain_bytes_per_tenant=KV)
    new.restore_hints(old.hint_state(), 1.0)
    assert new.pinned_bytes("A") == 2 * KV and new.retained_bytes("B") == KV
    recovered = [("p", 0), ("p", 1), ("r", 0), ("o", 0), ("o", 1), ("o", 2)]  # pinned and retained first: oldest
    assert new.recover_ssd([ObjectKey(h, "kv") for h in recovered], 1.0) == []
    assert new.counters().recovered == 6
    flood(new, 2.0, 10)  # theta_E 1: the 6 flood chunks DRAM evicts are written, and need 4 chunks of SSD room
    counters = new.counters()
    assert counters.recovered_dropped == 4 and counters.recovered_adopted == 0  # the 3 others, then the retained one
    plan = new.plan((("p", 0), ("p", 1)), 20.0)
    assert plan.kv_sources == (SSD, SSD)
    new.release(plan, 20.0)
