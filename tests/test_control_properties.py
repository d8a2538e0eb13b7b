"""Random workloads on every preset (hypothesis), checked after every call:

* capacities are never exceeded, and every internal invariant holds (``ControlPlane.audit``);
* every object a live plan reads is resident in its chosen tier while the plan pins it;
* plans are prefixes of their request, in order, equal to an oracle computed from the chunks'
  residency before the call (hybrid: ending on a checkpoint);
* under admission presets nothing is written that Eq. 1 does not admit;
* hits + misses = references = the chunks committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from control_cases import DENSE, PRESETS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.config import Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import (ControlPlane, ControlPlaneError, DropOrder, PromoteOrder, ReloadPlan, StoreOrder, Tier,
                           WriteOrder)

HYBRID_SMALL = ChunkSpec.for_model("qwen3-next-80b-a3b", checkpoint_tokens=2048)  # a checkpoint every 2 chunks
READABLE_DRAM = ("ready", "draining")

family = st.integers(0, 3)
request_op = st.tuples(st.just("request"), family, st.integers(1, 9), st.integers(0, 9), st.integers(0, 2),
                       st.booleans())
ops = st.lists(st.one_of(
    request_op,
    st.tuples(st.just("hold"), family, st.integers(1, 9)),      # plan now, commit or release later
    st.tuples(st.just("finish-held"), st.integers(0, 99), st.booleans()),  # commit (True) or release
    st.tuples(st.just("complete"), st.integers(0, 999), st.sampled_from(["ok", "ok", "ok", "fail", "partial"])),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 10.0, 61.0, 400.0])),
), min_size=5, max_size=45)


def hashes_of(fam: int, length: int, branch_at: int, branch: int) -> list:
    """Prefix-chained ids: a family's trunk, optionally forking at ``branch_at`` into ``branch``."""
    if branch == 0 or branch_at >= length:
        return [(fam, j) for j in range(length)]
    return [(fam, j) for j in range(branch_at)] + [(fam, branch_at, branch, j) for j in range(branch_at, length)]


def make_config(preset: str, hybrid: bool) -> SariaConfig:
    chunk = HYBRID_SMALL if hybrid else DENSE
    dram = 6 * chunk.kv_bytes + 2 * chunk.state_bytes
    ssd = 16 * chunk.kv_bytes + 5 * chunk.state_bytes
    return SariaConfig(dram=Capacity(nbytes=dram), ssd=Capacity(nbytes=ssd), chunk=chunk,
                       policy=Policy.preset(preset, metadata_window_s=300.0, prewrite_depth=4))


def expected_sources(hashes: list, readable, hybrid: bool, tier_prefix: bool) -> tuple:
    """A plan's (kv sources, state source) by the planning rule (the ``unified`` or ``tier-prefix``
    lookup, a hybrid plan cut back to its deepest readable checkpoint), given ``readable(depth, h)``:
    chunk ``h``'s (kv in DRAM, kv in SSD, state in DRAM, state in SSD), or None where it stops."""
    sources, in_dram_phase, cut, state_source = [], True, 0, None
    for depth, h in enumerate(hashes):
        where = readable(depth, h)
        if where is None:
            break
        in_dram, in_ssd, state_dram, state_ssd = where
        if tier_prefix:
            if in_dram_phase and in_dram:
                sources.append(Tier.DRAM)
            elif in_ssd:
                in_dram_phase = False
                sources.append(Tier.SSD)
            else:
                break
        elif in_dram or in_ssd:
            sources.append(Tier.DRAM if in_dram else Tier.SSD)
        else:
            break
        if hybrid and (state_dram or state_ssd):
            cut, state_source = len(sources), Tier.DRAM if state_dram else Tier.SSD
    return (tuple(sources[:cut]), state_source) if hybrid else (tuple(sources), None)


@dataclass
class Driver:
    cp: ControlPlane
    now: float = 0.0
    references: int = 0
    pending: list = field(default_factory=list)   # orders awaiting completion
    held: list = field(default_factory=list)      # (plan, hashes) of live plans

    @property
    def policy(self) -> Policy:
        return self.cp.config.policy

    # ----------------------------------------------------------------------------- operations
    def plan(self, hashes: list) -> ReloadPlan:
        expected = self.oracle(hashes)
        plan = self.cp.plan(hashes, self.now)
        assert plan.chunk_hashes == tuple(hashes[:plan.num_chunks])  # a prefix, in request order
        assert (plan.kv_sources, plan.state_source) == expected
        if self.cp.config.chunk.hybrid and plan.num_chunks:
            assert plan.num_chunks % self.cp.config.chunk.checkpoint_chunks == 0
            assert plan.state_chunk == plan.chunk_hashes[-1]
        self.check_pinned(plan)
        return plan

    def commit(self, plan: ReloadPlan | None, hashes: list, fail_read: bool) -> None:
        failed = []
        if fail_read and plan is not None and Tier.SSD in plan.kv_sources:
            failed = [plan.chunk_hashes[plan.kv_sources.index(Tier.SSD)]]
        self.take(self.cp.commit_prefill(hashes, self.now, plan, failed=failed))
        self.references += len(hashes)

    def take(self, orders: list) -> None:
        for order in orders:
            self.check_admitted(order)
            if isinstance(order, (StoreOrder, PromoteOrder)):
                assert self.policy.use_dram
            if not isinstance(order, DropOrder):
                self.pending.append(order)
            elif order.order_id % 7 == 0:  # drop orders need (and take) no completion
                with pytest.raises(ControlPlaneError, match="not awaiting completion"):
                    self.cp.complete(order.order_id, True, self.now)

    def complete(self, pick: int, outcome: str) -> None:
        if not self.pending:
            return
        order = self.pending.pop(pick % len(self.pending))
        if outcome == "partial" and (order.kv or order.state):
            failed = [order.kv[0]] if order.kv else [order.state[0]]
            self.take(self.cp.complete(order.order_id, True, self.now, failed=failed))
        else:
            self.take(self.cp.complete(order.order_id, outcome != "fail", self.now))

    def run(self, op: tuple) -> None:
        kind = op[0]
        if kind == "request":
            _, fam, length, branch_at, branch, fail_read = op
            hashes = hashes_of(fam, length, branch_at, branch)
            self.commit(self.plan(hashes), hashes, fail_read)
        elif kind == "hold":
            hashes = hashes_of(op[1], op[2], 0, 0)
            self.held.append((self.plan(hashes), hashes))
        elif kind == "finish-held" and self.held:
            plan, hashes = self.held.pop(op[1] % len(self.held))
            if op[2]:
                self.commit(plan, hashes, False)
            else:
                self.take(self.cp.release(plan, self.now))
        elif kind == "complete":
            self.complete(op[1], op[2])
        elif kind == "advance":
            self.now += op[1]
        self.check()

    # ------------------------------------------------------------------------------- checks
    def oracle(self, hashes: list) -> tuple:
        """The plan's sources, from the chunks' residency as chunk_info shows it."""
        return expected_sources(hashes, self.readable, self.cp.config.chunk.hybrid,
                                self.policy.lookup == "tier-prefix")

    def readable(self, depth: int, h) -> tuple[bool, bool, bool, bool] | None:
        """Chunk ``h`` (at ``depth``): its kv object readable in DRAM, in SSD, its state object in
        DRAM, in SSD; None if the tree does not know it."""
        info = self.cp.chunk_info(h)
        if info is None:
            return None
        state = info.state
        return (info.kv.dram in READABLE_DRAM, info.kv.ssd == "ready", state is not None and state.dram in READABLE_DRAM,
                state is not None and state.ssd == "ready")

    def check_pinned(self, plan: ReloadPlan, fresh: bool = True) -> None:
        """Every object of ``plan`` is resident in its source tier and pinned. An SSD copy that
        another plan's read found bad keeps its slot while pinned (``fresh``: just planned)."""
        on_ssd = ("ready",) if fresh else ("ready", "bad")
        objects = [(self.cp.chunk_info(h).kv, source) for h, source in zip(plan.chunk_hashes, plan.kv_sources)]
        if plan.state_chunk is not None:
            objects.append((self.cp.chunk_info(plan.state_chunk).state, plan.state_source))
        for copy, source in objects:
            if source is Tier.DRAM:
                assert copy.dram in READABLE_DRAM and copy.dram_pins >= 1, (plan, copy)
            else:
                assert copy.ssd in on_ssd and copy.ssd_pins >= 1, (plan, copy)

    def check_admitted(self, order) -> None:
        if not isinstance(order, WriteOrder):
            return
        policy = self.policy
        assert policy.use_ssd
        if policy.admit_all:
            return
        assert order.reason in ("eviction", "reuse", "prewrite")  # never written through
        theta_E = policy.theta_E if policy.theta_E is not None else float("inf")
        theta_R = policy.theta_R if policy.theta_R is not None else float("inf")
        extra = 1 if order.reason == "prewrite" else 0
        for h in set(order.kv) | set(order.state):
            info = self.cp.chunk_info(h)
            assert info.E_b + extra >= theta_E or info.R_b >= theta_R, (order, info)

    def check(self) -> None:
        assert self.cp.audit() == []
        usage = self.cp.usage()
        assert 0 <= usage.dram_used <= usage.dram_capacity and 0 <= usage.ssd_used <= usage.ssd_capacity
        assert usage.live_plans == len(self.held) and usage.orders_in_flight == len(self.pending)
        for plan, _ in self.held:
            self.check_pinned(plan, fresh=False)
        c = self.cp.counters()
        assert c.hits_dram_chunks + c.hits_ssd_chunks + c.misses == c.references == self.references

    def finish(self) -> None:
        while self.held:
            self.run(("finish-held", 0, True))
        while self.pending:
            self.run(("complete", 0, "ok"))
        usage = self.cp.usage()
        assert usage.live_plans == usage.orders_in_flight == 0


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops)
def test_random_workloads_keep_every_invariant(preset, hybrid, workload):
    driver = Driver(ControlPlane(make_config(preset, hybrid)))
    for op in workload:
        driver.run(op)
    driver.finish()


@settings(max_examples=15, deadline=None)
@given(workload=ops)
def test_same_calls_same_decisions(workload):
    """Deterministic: two planes fed the same calls hand out the same plans and orders."""
    runs = []
    for _ in range(2):
        driver = Driver(ControlPlane(make_config("saria", False)))
        seen = []
        take = driver.take
        driver.take = lambda orders, take=take, seen=seen: (seen.extend(orders), take(orders))[1]
        for op in workload:
            driver.run(op)
        driver.finish()
        runs.append((seen, driver.cp.counters()))
    assert runs[0] == runs[1]
