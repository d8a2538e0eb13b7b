"""Cache hints (saria.control.hints): the parsing of every shape a request may send, and a
model-based check of the control plane fed hints over long random runs with small tiers.

After every call of a run: the control plane's invariants hold (``audit``); no tenant's pinned
bytes pass its cap, nor all tenants' half the SSD tier, nor its retained bytes their cap; a pinned chunk whose copy reached SSD is
never evicted from there before its pin ends; a done session's private chunks are never written
(until a request references them again); a chunk inside an accepted retention that left DRAM has an SSD
copy or write (unless SSD had no room for anything but other retained or pinned chunks); a hint of
tenant B (done, unpin, next turn with A's session name) changes none of tenant A's pins nor the
evidence of A's chunks; and hints that cannot be read never raise.
"""

from __future__ import annotations

import math

import pytest
from control_cases import DENSE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.config import Capacity, Policy, SariaConfig
from saria.control import ControlPlane, ControlPlaneError, DropOrder, PromoteOrder, Tier, WriteOrder
from saria.control.hints import MAX_HINT_S, MAX_SESSION_CHARS, Hints, parse_hints

# ------------------------------------------------------------------------------------------ parsing


def test_the_vocabulary_is_read():
    hints, problems = parse_hints({"retain_s": 300, "pin": 600, "session": "s1", "next_turn_s": 4.5, "done": False})
    assert problems == 0
    assert hints == Hints(retain_s=300.0, pin=600.0, session="s1", next_turn_s=4.5)
    assert parse_hints({"pin": True}) == (Hints(pin=math.inf), 0)
    assert parse_hints({"pin": False}) == (Hints(unpin=True), 0)
    assert parse_hints({"session": "s", "done": True}) == (Hints(session="s", done=True), 0)


def test_openai_fields_map_where_the_native_keys_are_absent():
    assert parse_hints({"prompt_cache_retention": "24h", "prompt_cache_key": "k"}) == (
        Hints(retain_s=86400.0, session="k"), 0)
    assert parse_hints({"prompt_cache_retention": "in_memory"}) == (None, 0)
    # the native keys win
    assert parse_hints({"retain_s": 5, "prompt_cache_retention": "24h", "session": "a", "prompt_cache_key": "b"}) == (
        Hints(retain_s=5.0, session="a"), 0)


def test_vllm_session_id_is_the_session_when_none_is_given():
    assert parse_hints(None, "conv-7") == (Hints(session="conv-7"), 0)
    assert parse_hints({"session": "mine"}, "conv-7") == (Hints(session="mine"), 0)
    assert parse_hints({}, None) == (None, 0)
    assert parse_hints({}, "") == (None, 0)  # an empty session id is none, not a problem


def test_other_connectors_keys_are_not_problems():
    assert parse_hints({"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "h",
                        "remote_engine_id": "e", "tp_size": 2}) == (None, 0)


class Raising(dict):
    def items(self):
        raise RuntimeError("a mapping that cannot be read")


MALFORMED = [
    pytest.param([("retain_s", 5)], 1, id="not-a-mapping"),
    pytest.param("retain_s=5", 1, id="a-string"),
    pytest.param({"retain_s": -1}, 1, id="negative-retain"),
    pytest.param({"retain_s": float("nan")}, 1, id="nan-retain"),
    pytest.param({"retain_s": float("inf")}, 1, id="inf-retain"),
    pytest.param({"retain_s": MAX_HINT_S + 1}, 1, id="retain-too-long"),
    pytest.param({"retain_s": "300"}, 1, id="retain-as-string"),
    pytest.param({"retain_s": True}, 1, id="retain-as-bool"),
    pytest.param({"retain_s": None}, 1, id="retain-none"),
    pytest.param({"pin": 0}, 1, id="pin-zero"),
    pytest.param({"pin": -3}, 1, id="pin-negative"),
    pytest.param({"pin": "yes"}, 1, id="pin-string"),
    pytest.param({"pin": [True]}, 1, id="pin-list"),
    pytest.param({"session": ""}, 1, id="session-empty"),
    pytest.param({"session": 7}, 1, id="session-int"),
    pytest.param({"session": "x" * (MAX_SESSION_CHARS + 1)}, 1, id="session-too-long"),
    pytest.param({"next_turn_s": 3}, 1, id="next-turn-without-session"),
    pytest.param({"next_turn_s": -1}, 1, id="next-turn-negative"),
    pytest.param({"done": 1}, 1, id="done-int"),
    pytest.param({"done": "true"}, 1, id="done-string"),
    pytest.param({"done": True}, 1, id="done-without-session"),
    pytest.param({"prompt_cache_retention": "forever"}, 1, id="retention-word"),
    pytest.param({"prompt_cache_retention": 86400}, 1, id="retention-number"),
    pytest.param({"prompt_cache_key": ["k"]}, 1, id="cache-key-list"),
    pytest.param({"retain": 5}, 1, id="unknown-key"),
    pytest.param({1: 5}, 1, id="non-string-key"),
    pytest.param({"retain_s": -1, "pin": "x", "bogus": 0}, 3, id="three-at-once"),
    pytest.param(Raising(retain_s=5), 1, id="mapping-that-raises"),
]


@pytest.mark.parametrize("params,problems", MALFORMED)
def test_a_malformed_hint_is_ignored_and_counted(params, problems):
    hints, found = parse_hints(params)
    assert found == problems
    assert hints is None


def test_a_malformed_key_leaves_the_others():
    hints, problems = parse_hints({"retain_s": "soon", "pin": 60, "session": "s"})
    assert problems == 1
    assert hints == Hints(pin=60.0, session="s")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["retain_s", "pin", "session", "next_turn_s", "done", "prompt_cache_key",
                                        "prompt_cache_retention", "other"]), json_values, max_size=6) | json_values,
       json_values)
def test_no_shape_of_params_raises(params, session_id):
    hints, problems = parse_hints(params, session_id)
    assert hints is None or isinstance(hints, Hints)
    assert isinstance(problems, int) and problems >= 0


def test_the_control_plane_refuses_what_is_not_hints():
    cp = ControlPlane(SariaConfig(chunk=DENSE))
    with pytest.raises(ControlPlaneError, match="hints must be"):
        cp.commit_prefill([1, 2], 0.0, hints={"retain_s": 5})
    with pytest.raises(ControlPlaneError, match="tenant must be hashable"):
        cp.commit_prefill([1, 2], 0.0, hints=Hints(retain_s=5), tenant=[1])
    assert cp.counters().requests == 0


# -------------------------------------------------------------------------- the control plane

KV = DENSE.kv_bytes
PIN_CAP = 3 * KV
RETAIN_CAP = 4 * KV


def make_plane(retain_cap: int = RETAIN_CAP) -> ControlPlane:
    config = SariaConfig(dram=Capacity(nbytes=5 * KV), ssd=Capacity(nbytes=10 * KV), chunk=DENSE,
                         policy=Policy.preset("saria", metadata_window_s=200.0, prewrite_depth=2, prewarm_lead_s=1.0))
    return ControlPlane(config, pin_bytes_per_tenant=PIN_CAP, retain_bytes_per_tenant=retain_cap)


tenants = st.sampled_from(["A", "B"])
hint_kind = st.sampled_from(["none", "retain", "pin", "pin-ttl", "unpin", "next", "done", "session"])
request = st.tuples(st.just("request"), tenants, st.integers(0, 3), st.integers(1, 4), hint_kind,
                    st.integers(0, 3))
ops = st.lists(st.one_of(
    request, request,
    st.tuples(st.just("cross"), st.integers(0, 3), st.sampled_from(["done", "unpin", "next"])),  # B names A's session
    st.tuples(st.just("complete"), st.integers(0, 99)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 3.0, 20.0, 90.0])),
    st.tuples(st.just("prewarm"),),
), min_size=40, max_size=140)


class Model:
    """The test's own record of what the hints promised, checked against the control plane."""

    def __init__(self) -> None:
        self.cp = make_plane()
        self.now = 0.0
        self.turns: dict[tuple, int] = {}  # (tenant, session) -> its prompt length so far
        self.in_flight: list = []
        self.owners: dict = {}  # chunk -> the set of (tenant, session or None) that referenced it
        self.done: set = set()  # chunks private to a done session, not referenced since
        self.retained: dict = {}  # chunk -> retention end
        self.seen_on_ssd: set = set()

    def hashes(self, tenant: str, session: int, length: int) -> list:
        return [(tenant, session, j) for j in range(length)]

    def run(self, hashes: list, hints: Hints | None, tenant: str) -> None:
        cp, now = self.cp, self.now
        plan = cp.plan(hashes, now)
        refused = cp.hint_counters().retains_refused
        orders = cp.commit_prefill(hashes, now, plan=plan, hints=hints, tenant=tenant)
        accepted = cp.hint_counters().retains_refused == refused  # a retention over the tenant's cap is refused
        owner = (tenant, hints.session if hints is not None else None)
        for h in hashes:
            self.owners.setdefault(h, set()).add(owner)
            self.done.discard(h)
        if hints is not None and hints.retain_s is not None and accepted:
            for h in hashes:
                self.retained[h] = max(self.retained.get(h, -math.inf), now + hints.retain_s)
        if hints is not None and hints.done:
            private = [h for h in hashes if self.owners[h] == {owner} and not self.pinned(h)]
            self.done |= set(private)
            for h in private:
                self.retained.pop(h, None)
            # the done request's private chunks: none stored or written by its own commit
            for o in orders:
                if isinstance(o, WriteOrder):
                    assert not set(o.kv) & set(private), "a done session's chunk written at its own commit"
        self.take(orders)
        if hints is not None and hints.next_turn_s is not None:
            cp.turn_ended(hashes, now, hints, tenant)

    def pinned(self, h) -> bool:
        return any(self.cp.pins(t).get(h, -math.inf) > self.now for t in ("A", "B"))

    def take(self, orders) -> None:
        for o in orders:
            if isinstance(o, WriteOrder):
                written = set(o.kv) & self.done
                assert not written, "a done session's private chunk was written"
            if not isinstance(o, DropOrder):
                self.in_flight.append(o)

    def complete(self, i: int) -> None:
        if self.in_flight:
            order = self.in_flight.pop(i % len(self.in_flight))
            self.take(self.cp.complete(order.order_id, True, self.now))

    def check(self) -> None:
        cp, now = self.cp, self.now
        assert cp.audit() == []
        usage = cp.usage()
        assert usage.dram_used <= usage.dram_capacity and usage.ssd_used <= usage.ssd_capacity
        total = 0
        for t in ("A", "B"):
            assert cp.retained_bytes(t) <= RETAIN_CAP
            assert cp.pinned_bytes(t) <= PIN_CAP
            total += cp.pinned_bytes(t)
            for h, until in cp.pins(t).items():
                info = cp.chunk_info(h)
                if until <= now or info is None:
                    continue
                if info.kv.ssd == "ready":
                    self.seen_on_ssd.add(h)
                elif h in self.seen_on_ssd:
                    raise AssertionError(f"a pinned chunk left SSD before its pin ended ({info.kv.ssd})")
        assert total <= usage.ssd_capacity // 2
        for t in ("A", "B"):  # a pin that ended, or was released, protects no more
            for h in list(self.seen_on_ssd):
                if cp.pins(t).get(h, -math.inf) <= now and not self.pinned(h):
                    self.seen_on_ssd.discard(h)
        counters, hinted = cp.counters(), cp.hint_counters()
        room_ran_out = counters.writes_skipped or hinted.retained_evicted
        for h, until in self.retained.items():
            info = cp.chunk_info(h)
            if until > now and info is not None and info.kv.dram == "absent" and info.kv.ssd == "absent":
                assert room_ran_out, "a chunk inside its retention left DRAM without an SSD copy"

    def snapshot_a(self) -> tuple:
        cp = self.cp
        pins = {h: u for h, u in cp.pins("A").items() if u > self.now}
        live = len(pins) == len(cp.pins("A"))  # else a pin ends at the next call, whoever makes it
        evidence = {}
        for h in self.owners:
            if h[0] == "A":
                info = cp.chunk_info(h)
                if info is not None:
                    evidence[h] = (info.E_b, info.R_b)
        return pins, cp.pinned_bytes("A") if live else None, evidence


def hints_for(kind: str, session: int, n: int) -> Hints | None:
    name = f"s{session}"
    return {"none": None, "session": Hints(session=name), "retain": Hints(retain_s=[5.0, 30.0, 200.0, 1e4][n]),
            "pin": Hints(pin=math.inf, session=name), "pin-ttl": Hints(pin=[2.0, 10.0, 60.0, 300.0][n]),
            "unpin": Hints(unpin=True), "next": Hints(session=name, next_turn_s=[0.0, 2.0, 10.0, 60.0][n]),
            "done": Hints(session=name, done=True)}[kind]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_hints_keep_their_promises_over_long_runs(ops):
    model = Model()
    for op in ops:
        if op[0] == "request":
            _, tenant, session, grow, kind, n = op
            key = (tenant, session)
            length = self_len = min(model.turns.get(key, 0) + grow, 8)
            model.turns[key] = self_len
            model.run(model.hashes(tenant, session, length), hints_for(kind, session, n), tenant)
        elif op[0] == "cross":  # tenant B sends a hint naming A's session (B's own chunks)
            _, session, kind = op
            before = model.snapshot_a()
            hints = {"done": Hints(session=f"s{session}", done=True), "unpin": Hints(unpin=True),
                     "next": Hints(session=f"s{session}", next_turn_s=0.0)}[kind]
            model.run(model.hashes("B", session, 2), hints, "B")
            pins, pinned, evidence = model.snapshot_a()
            assert pins == before[0]
            assert before[1] is None or pinned == before[1]
            for h, (e, r) in evidence.items():  # evictions may add to E_b; nothing of B's resets A's evidence
                if h in before[2]:
                    assert r == before[2][h][1] and e >= before[2][h][0]
        elif op[0] == "complete":
            model.complete(op[1])
        elif op[0] == "advance":
            model.now += op[1]
        else:
            model.take(model.cp.hinted_prewarms(model.now))
        model.check()
    while model.in_flight:
        model.complete(0)
        model.check()


# ---------------------------------------------------------------------------- single rules, by hand


def drive(cp: ControlPlane, hashes, now, **kw):
    orders = cp.commit_prefill(hashes, now, plan=cp.plan(hashes, now), **kw)
    out = list(orders)
    while orders:
        follow = []
        for o in orders:
            if not isinstance(o, DropOrder):
                follow += cp.complete(o.order_id, True, now)
        out += follow
        orders = follow
    return out


def test_retain_s_admits_at_the_first_eviction_and_eq1_does_not():
    for hints, written in ((None, False), (Hints(retain_s=100.0), True)):
        cp = make_plane()
        drive(cp, [("r", 0)], 0.0, hints=hints, tenant="A")
        for i in range(6):  # one eviction of ("r", 0): Eq. 1 (theta_E = 2) does not admit it
            drive(cp, [("x", i)], 1.0 + i)
        assert (cp.chunk_info(("r", 0)).kv.ssd == "ready") is written
        assert cp.hint_counters().hinted_admissions == int(written)


def test_an_over_cap_pin_is_refused_whole_and_counted():
    cp = make_plane()
    drive(cp, [("p", j) for j in range(4)], 0.0, hints=Hints(pin=math.inf), tenant="A")  # 4 chunks > cap of 3
    assert cp.pins("A") == {} and cp.pinned_bytes("A") == 0
    assert cp.hint_counters().pins_refused == 1
    drive(cp, [("q", j) for j in range(3)], 1.0, hints=Hints(pin=10.0), tenant="A")
    assert cp.pinned_bytes("A") == 3 * KV and cp.hint_counters().pinned_bytes == 3 * KV
    drive(cp, [("q", 0)], 2.0, hints=Hints(unpin=True), tenant="B")  # another tenant's unpin: nothing
    assert cp.pinned_bytes("A") == 3 * KV
    drive(cp, [("y", 0)], 11.5)  # the TTL ended
    assert cp.pinned_bytes("A") == 0 and cp.hint_counters().pins_expired == 3


def test_done_drops_a_sessions_evidence_and_stores_nothing_new():
    cp = make_plane()
    for turn in range(1, 4):
        drive(cp, [("d", j) for j in range(turn)], float(turn), hints=Hints(session="s"), tenant="A")
    assert cp.chunk_info(("d", 0)).R_b == 2
    orders = drive(cp, [("d", j) for j in range(4)], 5.0, hints=Hints(session="s", done=True), tenant="A")
    assert cp.chunk_info(("d", 0)).R_b == 0 and cp.chunk_info(("d", 0)).E_b == 0
    assert cp.chunk_info(("d", 3)).kv.dram == "absent"  # the done turn's new chunk: not stored
    assert not [o for o in orders if isinstance(o, WriteOrder)]
    assert cp.hint_counters().sessions_done == 1
    for i in range(8):  # the done chunks go first and are never written
        assert not [o for o in drive(cp, [("x", i), ("x", i, 1)], 6.0 + i) if isinstance(o, WriteOrder)
                    and set(o.kv) & {("d", 0), ("d", 1), ("d", 2)}]


def test_next_turn_prewarms_the_session_before_its_turn():
    cp = make_plane()
    hashes = [("n", j) for j in range(2)]
    drive(cp, hashes, 0.0, hints=Hints(retain_s=100.0, session="s"), tenant="A")
    # another request's stores evict the session's chunks (written for their retention) and fail:
    # DRAM is left free, the session's chunks on SSD only
    others = [("f", j) for j in range(5)]
    for o in cp.commit_prefill(others, 1.0, plan=cp.plan(others, 1.0)):
        if not isinstance(o, DropOrder):
            cp.complete(o.order_id, isinstance(o, WriteOrder), 1.0)
    assert [cp.chunk_info(h).kv.ssd for h in hashes] == ["ready", "ready"]
    assert [cp.chunk_info(h).kv.dram for h in hashes] == ["absent", "absent"]
    cp.turn_ended(hashes, 2.0, Hints(session="s", next_turn_s=10.0), tenant="A")
    cp.turn_ended([("b", 0)], 2.0, Hints(session="s", next_turn_s=10.0), tenant="B")  # B's session "s": B's own
    assert cp.next_hinted_prewarm() == 11.0  # lead 1 s
    assert cp.hinted_prewarms(10.5) == []
    orders = cp.hinted_prewarms(11.0, max_bytes=2 * KV)
    assert len(orders) == 1 and isinstance(orders[0], PromoteOrder) and orders[0].source is Tier.SSD
    assert set(orders[0].kv) == set(hashes)
    assert cp.hint_counters().prewarms_hinted == 1  # B's chunk is nowhere: nothing to bring
    cp.complete(orders[0].order_id, True, 11.5)
    plan = cp.plan(hashes + [("n", 2)], 12.0)
    assert plan.kv_sources == (Tier.DRAM, Tier.DRAM)  # the next turn hits DRAM
    cp.release(plan, 12.0)
    assert cp.next_hinted_prewarm() is None  # handed out once


def test_the_next_turn_cancels_its_prewarm():
    cp = make_plane()
    hashes = [("c", 0)]
    drive(cp, hashes, 0.0, hints=Hints(session="s"), tenant="A")
    cp.turn_ended(hashes, 1.0, Hints(session="s", next_turn_s=30.0), tenant="A")
    drive(cp, hashes + [("c", 1)], 5.0, hints=Hints(session="s"), tenant="A")  # the turn came early
    assert cp.next_hinted_prewarm() is None and cp.hint_counters().prewarms_cancelled == 1


def test_done_leaves_chunks_another_request_saw_first():
    cp = make_plane()
    drive(cp, [("w", 0), ("w", 1)], 0.0)  # a request of no session
    drive(cp, [("w", 0), ("w", 1), ("w", 2)], 1.0, hints=Hints(session="s"), tenant="A")
    drive(cp, [("w", 0), ("w", 1), ("w", 2), ("w", 3)], 2.0, hints=Hints(session="s", done=True), tenant="A")
    assert [cp.chunk_info(("w", j)).R_b for j in range(4)] == [2, 2, 0, 0]  # only the session's own lose it
    assert cp.hint_counters().done_chunks == 2


def test_a_pinned_chunk_outlives_a_flood_of_writes_and_goes_once_unpinned():
    cp = make_plane(retain_cap=100 * KV)  # SSD: 10 chunks; B may retain all it floods
    drive(cp, [("pin", 0)], 0.0, hints=Hints(pin=math.inf), tenant="A")
    for i in range(40):  # each retained: written at its eviction, so SSD fills and evicts
        drive(cp, [("flood", i)], 1.0 + i, hints=Hints(retain_s=100.0), tenant="B")
        if i >= 6:
            assert cp.chunk_info(("pin", 0)).kv.ssd == "ready"
    assert cp.counters().ssd_evictions > 20
    drive(cp, [("pin", 0)], 50.0, hints=Hints(unpin=True), tenant="B")  # B's unpin: not B's pin
    assert cp.pins("A") == {("pin", 0): math.inf}
    drive(cp, [("pin", 0)], 51.0, hints=Hints(unpin=True), tenant="A")
    assert cp.pins("A") == {} and cp.pinned_bytes("A") == 0
    for i in range(40, 60):
        drive(cp, [("flood", i)], 52.0 + i, hints=Hints(retain_s=100.0), tenant="B")
    assert cp.chunk_info(("pin", 0)).kv.ssd == "absent"


def test_retain_s_is_capped_per_tenant_and_refused_whole():
    cp = make_plane()  # each tenant may retain 4 chunks
    drive(cp, [("r", j) for j in range(3)], 0.0, hints=Hints(retain_s=10.0), tenant="A")
    assert cp.retained_bytes("A") == 3 * KV
    drive(cp, [("r", 0), ("s", 0), ("s", 1)], 1.0, hints=Hints(retain_s=10.0), tenant="A")  # 2 new: 5 > 4
    assert cp.retained_bytes("A") == 3 * KV and cp.hint_counters().retains_refused == 1
    assert cp.chunk_info(("s", 0)).kv.dram == "ready"  # the request itself is served as any other
    drive(cp, [("r", 0), ("s", 0)], 2.0, hints=Hints(retain_s=30.0), tenant="A")  # 1 new: 4, and r0 extended
    assert cp.retained_bytes("A") == 4 * KV
    drive(cp, [("b", 0), ("b", 1), ("b", 2)], 3.0, hints=Hints(retain_s=10.0), tenant="B")  # B's cap is B's
    assert cp.retained_bytes("B") == 3 * KV and cp.hint_counters().retains_refused == 1
    drive(cp, [("y", 0)], 13.5)  # r1, r2 (11) and B's (13) ended; r0, s0 held until 32
    assert cp.retained_bytes("A") == 2 * KV and cp.retained_bytes("B") == 0
    assert cp.hint_counters().retained_bytes == 2 * KV
    drive(cp, [("y", 1)], 32.5)
    assert cp.retained_bytes("A") == 0


def _full_dram_with_the_session_on_ssd(cp: ControlPlane, hashes) -> None:
    drive(cp, hashes, 0.0, hints=Hints(retain_s=1000.0, session="s"), tenant="A")
    for i in range(6):  # one-chunk requests fill DRAM: the session's chunks are written (retained) and evicted
        drive(cp, [("f", i)], 1.0 + i)
    assert [cp.chunk_info(h).kv.ssd for h in hashes] == ["ready"] * len(hashes)
    assert [cp.chunk_info(h).kv.dram for h in hashes] == ["absent"] * len(hashes)
    assert [cp.chunk_info(("f", i)).kv.dram for i in range(1, 6)] == ["ready"] * 5  # DRAM is full


def test_a_hinted_prewarm_makes_room_from_copies_idle_for_p_tau():
    """A serving DRAM tier is full: a hinted prewarm evicts copies idle for P_tau (60 s), the
    least recently used first and only as many as it needs, as a promotion would."""
    cp = make_plane()  # DRAM 5 chunks
    hashes = [("n", j) for j in range(3)]
    _full_dram_with_the_session_on_ssd(cp, hashes)
    cp.turn_ended(hashes, 10.0, Hints(session="s", next_turn_s=100.0), tenant="A")
    orders = cp.hinted_prewarms(109.0, max_bytes=3 * KV)  # the f copies were last reused 103-107 s ago
    promotes = [o for o in orders if isinstance(o, PromoteOrder)]
    assert len(promotes) == 1 and set(promotes[0].kv) == set(hashes) and promotes[0].source is Tier.SSD
    assert cp.counters().prewarm_evictions == 3
    assert [cp.chunk_info(("f", i)).kv.dram for i in range(1, 6)] == ["absent"] * 3 + ["ready"] * 2  # LRU first
    cp.complete(promotes[0].order_id, True, 109.5)
    plan = cp.plan(hashes, 110.0)
    assert plan.kv_sources == (Tier.DRAM,) * 3  # the next turn hits DRAM
    cp.release(plan, 110.0)


def test_a_hinted_prewarm_never_evicts_copies_reused_within_p_tau():
    cp = make_plane()
    hashes = [("n", j) for j in range(3)]
    _full_dram_with_the_session_on_ssd(cp, hashes)
    cp.turn_ended(hashes, 10.0, Hints(session="s", next_turn_s=30.0), tenant="A")
    assert not [o for o in cp.hinted_prewarms(39.0, max_bytes=3 * KV) if isinstance(o, PromoteOrder)]
    assert cp.counters().prewarm_evictions == 0
    assert [cp.chunk_info(("f", i)).kv.dram for i in range(1, 6)] == ["ready"] * 5


def test_a_hinted_prewarm_passes_over_its_own_prompts_copies():
    cp = make_plane()
    tiers = cp._tiers  # the room rule itself: the prompt's own DRAM copy is never a candidate
    drive(cp, [("k", 0)], 0.0)
    drive(cp, [("o", 0)], 1.0)
    (k,), (o,) = cp._resolve([("k", 0)]), cp._resolve([("o", 0)])
    assert tiers.idle_candidates(50.0, 2 * KV) == [k, o]
    assert tiers.idle_candidates(50.0, 2 * KV, keep={k}) == [o]
