"""Admission rules beyond Eq. 1 (issue 15): parsing, each rule's decision, the session tracker, the
oracle's future, and the useful-write count, against simple references."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saria.config import ADMISSION_RULES, POLICY_PRESETS, Bandwidths, ChunkSpec, Policy, SariaConfig, admission_rules
from saria.control import ControlPlane, DropOrder, WriteOrder
from saria.control.admission import Admission
from saria.control.sessions import SessionTracker
from saria.control.tree import ABSENT, READY, Node
from saria.orders import SSD
from saria.replay.arrivals import Schedule, SessionPlan
from saria.replay.metrics import retention
from saria.replay.oracle import TraceFuture

from control_cases import chain, config, drain


# ------------------------------------------------------------------------------------------ parsing
def test_rules_parse_and_refuse_with_a_reason():
    assert admission_rules("eq1") == {"eq1"}
    assert admission_rules(" eq1 + session+prefix ") == {"eq1", "session", "prefix"}
    assert admission_rules("oracle") == {"oracle"}
    for bad, words in (("", "joined by"), ("eq2", "unknown rule"), ("oracle+eq1", "stands alone"),
                       ("session", "refines nothing"), ("eq1+", "unknown rule"), (None, "joined by")):
        with pytest.raises(ValueError, match=words):
            admission_rules(bad)
    with pytest.raises(ValueError, match="session_p"):
        Policy(session_p=1.5)
    with pytest.raises(ValueError, match="prefill_tps"):
        Policy(prefill_tps=0)
    assert set(ADMISSION_RULES) == {"eq1", "session", "deferred", "prefix", "cost", "learned", "oracle"}


def test_presets_name_their_admission():
    assert Policy.preset("saria").admission == "eq1+deferred"
    assert Policy.preset("paper").admission == "eq1"
    assert (Policy.preset("paper").theta_E, Policy.preset("paper").theta_R) == (2, 8)
    oracle = Policy.preset("oracle")
    assert oracle.admission == "oracle" and oracle.theta_R is None
    assert POLICY_PRESETS["saria"] == {}  # saria is the Policy defaults


def test_oracle_needs_a_future():
    with pytest.raises(ValueError, match="only a replay"):
        ControlPlane(config("oracle"))


# ------------------------------------------------------------------------------------ each rule
def _admission(**policy) -> tuple[Admission, list[float]]:
    now = [0.0]
    cfg = SariaConfig(policy=Policy(**policy))
    return Admission(cfg.policy, cfg.ssd_bytes, config=cfg, clock=lambda: now[0]), now


def test_prefix_rule_refuses_a_chunk_whose_parent_has_no_copy():
    adm, _ = _admission(admission="eq1+prefix", theta_E=1)
    parent = Node("p", None, 0.0, 1)
    child = Node("c", parent, 0.0, 1)
    child.E_b = 1
    assert not adm.admits(child)  # parent nowhere: the write could never be read
    parent.dram = READY
    assert adm.admits(child)
    parent.dram, parent.ssd = ABSENT, READY
    assert adm.admits(child)
    root = Node("r", None, 0.0, 1)
    root.E_b = 1
    assert adm.admits(root)  # a first chunk has no parent to miss
    plain, _ = _admission(admission="eq1", theta_E=1)
    parent.ssd = ABSENT
    assert plain.admits(child)


def test_cost_rule_writes_only_what_reloads_faster_than_it_recomputes():
    chunk = ChunkSpec()  # 512 tokens of Qwen3-8B, 75.5 MB
    read_s = chunk.kv_bytes / 20e9
    for tps, overhead in ((6500.0, 0.002), (6500.0, 1.0), (1e9, 0.002)):
        adm, _ = _admission(admission="eq1+cost", theta_E=1, prefill_tps=tps, reload_overhead_s=overhead)
        nodes = [Node(0, None, 0.0, 1)]
        for i in range(1, 64):
            nodes.append(Node(i, nodes[-1], 0.0, 1))
        for depth, node in enumerate(nodes):
            node.E_b = 1
            n = depth + 1
            beats = overhead + n * read_s < n * chunk.chunk_tokens / tps
            assert adm.admits(node) == beats, (tps, overhead, depth)
    with pytest.raises(ValueError, match="prefill throughput"):
        _admission(admission="eq1+cost")


def test_deferred_reuse_writes_wait_for_the_first_dram_eviction():
    def popular(preset: str, dram_chunks: int) -> tuple[int, int]:
        cp = ControlPlane(config(preset, dram_chunks=dram_chunks, ssd_chunks=64, theta_R=3))
        t = 0.0
        for _ in range(6):  # the same 4-chunk prompt, reused: R_b climbs past theta_R
            t += 1.0
            plan = cp.plan(chain("a", 4), t)
            drain(cp, cp.commit_prefill(chain("a", 4), t, plan=plan), t)
        reuse_writes = cp.counters().admissions_reuse
        for i in range(12):  # other prompts push "a" out of DRAM
            t += 1.0
            plan = cp.plan(chain(f"b{i}", 4), t)
            drain(cp, cp.commit_prefill(chain(f"b{i}", 4), t, plan=plan), t)
        return reuse_writes, cp.chunk_info("a:0").kv.ssd

    assert popular("paper", 64)[0] == 4  # Eq. 1 writes the popular chunks at once
    assert popular("saria", 64)[0] == 0  # nothing evicted yet: nothing to fear
    writes, on_ssd = popular("saria", 8)  # DRAM full: "a" is admitted at its eviction all the same
    assert writes == 0 and on_ssd == "ready"
    cp = ControlPlane(config("saria", dram_chunks=4, ssd_chunks=64, theta_R=2))
    t = 0.0
    for name in ("x", "y", "x", "x", "x"):  # y evicts x once; then x's reuse writes go at once
        t += 1.0
        plan = cp.plan(chain(name, 4), t)
        drain(cp, cp.commit_prefill(chain(name, 4), t, plan=plan), t)
    assert cp.counters().dram_evictions and cp.counters().admissions_reuse > 0


# ------------------------------------------------------------------------------- session tracker
class _N:
    """A stand-in chunk for the tracker: the fields it reads and writes."""

    def __init__(self, key: str, now: float) -> None:
        self.key, self.last_reuse, self.session, self.evicted_as, self.E_b = key, now, None, None, 0


def test_sessions_follow_their_tips_and_learn_returns():
    tracker = SessionTracker(p=0.5)
    sys_prompt = [_N("s0", 0.0), _N("s1", 0.0)]
    a1 = sys_prompt + [_N("a2", 0.0)]
    tracker.commit(a1, 0, 0.0)
    a = a1[-1].session
    assert a.turns == 1 and a.tip is a1[-1]
    b1 = sys_prompt + [_N("b2", 5.0)]  # shares the system prompt only: a new session
    tracker.commit(b1, 2, 5.0)
    assert b1[-1].session is not a and tracker.sessions_started == 2
    a2 = a1 + [_N("a3", 60.0)]  # holds a's whole prompt: a's second turn, 60 s later
    for node in a2:
        node.last_reuse = 60.0
    tracker.commit(a2, 3, 60.0)
    assert a.turns == 2 and a.gap == 60.0 and a.tip is a2[-1] and all(n.session is a for n in a2)
    assert tracker.population_gap == 60.0
    # Evict a's chunks; a third turn comes back to them: their situation learns a return.
    for node in a2:
        node.E_b = 1
        tracker.evicted(node, 200.0)
    situation = a2[0].evicted_as
    assert situation == tracker.situation(a2[0], 1, 200.0) and situation[0] == 1
    assert tracker.return_rate(situation) == pytest.approx(1 / (4 + 2))
    a3 = a2 + [_N("a4", 300.0)]
    tracker.commit(a3, 4, 300.0)
    assert tracker.return_rate(situation) == pytest.approx(5 / 6) and a.comebacks == 1
    assert all(n.evicted_as is None for n in a2)
    assert tracker.returns(a2[0], 1, 200.0 + 0.0) == (tracker.return_rate(tracker.situation(a2[0], 1, 200.0)) >= 0.5)


def test_session_rule_writes_at_the_first_eviction_once_returns_are_learned():
    """Sessions whose turns come back after DRAM evicted them: Eq. 1 (E2) loses the first comeback
    of every chunk; the session rule learns that such chunks return and writes them at once."""
    def run(admission: str) -> tuple[int, int]:
        cp = ControlPlane(config("saria", dram_chunks=8, ssd_chunks=256, admission=admission, theta_R=None,
                                 session_p=0.5))
        t = 0.0
        for turn in range(1, 5):
            for s in range(12):  # 12 sessions of 4 chunks a turn, round robin: DRAM holds two
                t += 1.0
                keys = chain(f"s{s}", 4 * turn)
                plan = cp.plan(keys, t)
                drain(cp, cp.commit_prefill(keys, t, plan=plan), t)
        c = cp.counters()
        return c.hits_ssd_chunks, c.admissions

    e2_hits, _ = run("eq1")
    session_hits, session_writes = run("eq1+session")
    assert session_writes > 0 and session_hits > e2_hits


# ---------------------------------------------------------------------------------- useful writes
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6)), min_size=1, max_size=60),
       st.sampled_from(["saria", "paper", "full-duplicate", "reuse-only"]), st.integers(3, 10),
       st.integers(2, 12))
def test_useful_write_bytes_match_a_shadow_of_the_orders(requests, preset, dram_chunks, ssd_chunks):
    """The count of written bytes later read from SSD equals a reference built from the orders and
    plans alone: a completed write makes a copy unread, an SSD drop forgets it, a plan that reads
    the copy from SSD counts it once."""
    cp = ControlPlane(config(preset, dram_chunks=dram_chunks, ssd_chunks=ssd_chunks, theta_R=2))
    unread: set = set()
    useful = 0
    kv = config().chunk.kv_bytes
    pending: list = []

    def run_orders(orders, now):
        while orders:
            order = orders.pop(0)
            if isinstance(order, DropOrder):
                if order.tier is SSD:
                    unread.difference_update(order.kv)
                continue
            more = cp.complete(order.order_id, True, now)
            if isinstance(order, WriteOrder):
                unread.update(order.kv)
            orders.extend(more)

    for t, (name, n) in enumerate(requests, 1):
        keys = chain(f"c{name}", n)
        plan = cp.plan(keys, float(t))
        for key, source in zip(plan.chunk_hashes, plan.kv_sources):
            if source is SSD and key in unread:
                unread.discard(key)
                useful += kv
        pending = cp.commit_prefill(keys, float(t), plan=plan)
        run_orders(pending, float(t))
    c = cp.counters()
    assert c.ssd_useful_write_bytes == useful
    assert 0 <= c.ssd_useful_write_bytes <= c.ssd_bytes_written
    assert cp.audit() == []


# ------------------------------------------------------------------------------------- the oracle
@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), min_size=0, max_size=5), min_size=1, max_size=12),
       st.randoms(use_true_random=False), st.floats(0, 50))
def test_trace_future_is_the_earliest_unplanned_use(chunks, rng, now):
    chunks = [tuple(c) for c in chunks]
    n = len(chunks)
    # Random sessions: a partition of the requests, each with a start and gaps.
    order = list(range(n))
    rng.shuffle(order)
    sessions, i = [], 0
    while i < n:
        k = rng.randint(1, n - i)
        reqs = tuple(order[i:i + k])
        sessions.append(SessionPlan(rng.uniform(0, 20), reqs, tuple(rng.uniform(0, 10) for _ in reqs[1:])))
        i += k
    schedule = Schedule("rewindow", tuple(sessions))
    estimate = {}
    for s in sessions:
        at = s.start_s
        for pos, r in enumerate(s.requests):
            at += s.gaps_s[pos - 1] if pos else 0.0
            estimate[r] = at
    future = TraceFuture(chunks, schedule)
    planned: set = set()
    for step in rng.sample(range(n), n) + [None]:
        for key in range(8):
            expected = min((max(estimate[r], now) for r in range(n) if r not in planned and key in chunks[r]),
                           default=math.inf)
            assert future.next_use(key, now) == expected
        if step is not None:
            future.planned(step)
            planned.add(step)


def test_retention_against_the_references():
    assert retention(0.8, 0.6, 1.0) == pytest.approx(0.5)
    assert retention(1.0, 0.6, 1.0) == 1.0 and retention(0.6, 0.6, 1.0) == 0.0
    assert math.isnan(retention(1.0, 1.0, 1.0))  # everything fit in DRAM: nothing to retain
    assert math.isnan(retention(math.nan, 0.5, 0.9))


def test_bandwidths_reach_the_cost_rule():
    slow = SariaConfig(bandwidth=Bandwidths(disk_gbps_per_drive=0.001), policy=Policy(admission="eq1+cost",
                                                                                      prefill_tps=6500.0))
    adm = Admission(slow.policy, slow.ssd_bytes, config=slow, clock=lambda: 0.0)
    node = Node(0, None, 0.0, 1)
    node.E_b = 5
    assert not adm.admits(node)  # a 1 MB/s drive never beats recomputing


# -------------------------------------------------------------------------------- in the replay
def test_replay_reports_the_oracle_useful_writes_and_retention():
    from saria.replay.experiment import Experiment, Point, open_trace
    from saria.replay.policies import BaseSettings, parse_policy
    from saria.replay.replay import ReplaySettings

    trace = open_trace("synth:sessions=40")
    exp = Experiment(trace, "synth", BaseSettings(dram_tokens=100_000, ssd_tokens=1_000_000), ReplaySettings(),
                     arrivals="rewindow", workers=1, progress=False)
    labels = ("paper", "oracle", "saria", "dram-only")
    results, runs = exp.run([Point(label, parse_policy(label)) for label in labels])
    by = dict(zip(labels, results))
    assert [r["policy"] for r in results] == list(labels)  # the full-duplicate reference is not listed
    assert by["dram-only"]["retention"] == 0.0
    for r in results:
        assert 0.0 <= r["ssd_useful_write_bytes"] <= r["ssd_write_bytes"]
        if r["ssd_write_bytes"]:
            assert r["useful_write_fraction"] == r["ssd_useful_write_bytes"] / r["ssd_write_bytes"]
    # The oracle writes what will be read: a larger useful share, and it keeps more of the gain.
    assert by["oracle"]["useful_write_fraction"] > by["paper"]["useful_write_fraction"]
    assert by["oracle"]["retention"] > by["paper"]["retention"] > 0.0
    assert by["oracle"]["ssd_write_bytes"] > 0
    plain, _ = exp.run([Point("paper", parse_policy("paper"))], references=False)
    assert math.isnan(plain[0]["retention"]) and plain[0]["char_mean"] == by["paper"]["char_mean"]


def test_oracle_writes_only_what_a_later_request_reads():
    """A chunk never referenced again is never written, even while the SSD has room to spare;
    one referenced again is written at its eviction while the SSD keeps chunks that long."""

    class Future:
        def __init__(self, uses: dict) -> None:
            self.uses = uses

        def next_use(self, key, now):
            return self.uses.get(key, math.inf)

    future = Future({"a:0": 100.0, "a:1": 100.0})
    cp = ControlPlane(config("oracle", dram_chunks=4, ssd_chunks=64), future=future)
    t = 0.0
    for name in ("a", "b", "c"):  # b and c push a out of DRAM; nobody wants b or c again
        t += 1.0
        keys = chain(name, 2 if name == "a" else 4)
        plan = cp.plan(keys, t)
        drain(cp, cp.commit_prefill(keys, t, plan=plan), t)
    written = {k for k in ("a:0", "a:1", "b:0", "b:1", "b:2", "b:3") if cp.chunk_info(k).kv.ssd != "absent"}
    assert written == {"a:0", "a:1"} and cp.counters().dram_evictions >= 4
    cp._admission.ssd_retention_s = 10.0  # the SSD keeps chunks 10 s: a use 100 s away is too late
    future.uses = {"c:0": 100.0}
    for name in ("d", "e"):
        t += 1.0
        plan = cp.plan(chain(name, 4), t)
        drain(cp, cp.commit_prefill(chain(name, 4), t, plan=plan), t)
    assert cp.chunk_info("c:0").kv.ssd == "absent" and cp.chunk_info("c:0").kv.dram == "absent"
