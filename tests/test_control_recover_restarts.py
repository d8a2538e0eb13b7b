"""Random workloads with RESTARTS (hypothesis): the control plane is thrown away and a fresh one
takes over what the drives hold through ``ControlPlane.recover_ssd``.

The drives are simulated as the data plane keeps them: an object is on them once a write of it
completed (``complete`` ok for it), and leaves with an SSD ``DropOrder`` naming it; orders act in
the order they are returned. At a restart, orders in flight are lost (a write among them may
have reached the drives before the crash), stray objects may turn up (recovered by the data plane
as whole and verified: objects a previous layout left, state objects of chunks that keep none, a
dense model's "state"), and the listing comes in one or two parts (a drive at a time), now or after
some requests already ran on the new plane. Checked after every call, on top of the invariants
of ``test_control_properties`` (audit, pins, plans equal to an oracle, admission, counters):

* every object a plan reads from SSD is on the drives, and so is every ready or bad SSD copy and
  every recovered object the plane keeps;
* what ``recover_ssd`` keeps, drops and leaves alone is exactly what its contract says, given the
  room the plane had;
* once every part is listed the drives hold nothing the plane does not count (after plan() only
  objects whose drop waits for the next orders), and so never more bytes than the SSD capacity;
* the plane's SSD use is the bytes of its copies plus the recovered objects it keeps, and those are
  the recovered objects no request reached and no drop named, in the order they were given;
* recovered objects go first when room is needed: in the order given, and before any LRU copy.

``SARIA_RECOVER_EXAMPLES`` (default 120) sets the examples per case, for longer hunts.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from control_cases import DENSE
from hypothesis import strategies as st
from test_control_properties import HYBRID_SMALL, Driver, hashes_of

from saria.config import Capacity, Policy, SariaConfig
from saria.control import ControlPlane, DropOrder, ObjectKey, ReloadPlan, Tier, WriteOrder

EXAMPLES = int(os.environ.get("SARIA_RECOVER_EXAMPLES", "120"))
KV, STATE = "kv", "state"

family = st.integers(0, 2)
# A stray object: a chunk hash of the workload's space (trunk or branch) and a kind.
stray = st.tuples(family, st.integers(0, 8), st.integers(0, 2), st.integers(0, 8), st.sampled_from([KV, STATE]))
request = st.tuples(st.just("request"), family, st.integers(1, 8), st.integers(0, 8), st.integers(0, 2), st.booleans())
# Again a request made before (a restart forgets nothing of these): the one ``back`` requests ago,
# its first ``cut`` chunks.
replay = st.tuples(st.just("replay"), st.integers(0, 5), st.integers(1, 8), st.booleans())
recent = st.tuples(st.just("replay"), st.integers(0, 2), st.integers(1, 8), st.just(False))
hold = st.tuples(st.just("hold"), family, st.integers(1, 8))
finish_held = st.tuples(st.just("finish-held"), st.integers(0, 99), st.booleans())
complete = st.tuples(st.just("complete"), st.integers(0, 999), st.sampled_from(["ok", "ok", "ok", "fail", "partial"]))
advance = st.tuples(st.just("advance"), st.sampled_from([0.5, 10.0, 61.0, 400.0]))
drain = st.tuples(st.just("drain"),)  # the data plane catches up: every order in flight completes ok
# The listing: now or later (``recover``), in one or two parts; in-flight writes that reached the
# drives (a mask), stray objects, state twins of kv objects (a mask).
restart = st.tuples(st.just("restart"), st.integers(0, 255), st.sampled_from([True, True, False]), st.integers(1, 2),
                    st.integers(0, 2**16), st.lists(stray, max_size=4), st.one_of(st.just(0), st.integers(0, 255)))
recover = st.tuples(st.just("recover"),)
ops = st.lists(st.one_of(
    request, request, hold, finish_held, complete, st.tuples(st.just("complete"), st.integers(0, 999), st.just("ok")),
    advance, drain, drain, restart, recover, replay, replay, recent,
), min_size=10, max_size=70)
# Focused: a run that mostly completes, a restart (listed at once, more often whole, with more
# twins), then mostly requests made before; twice.
restart_at_once = st.tuples(st.just("restart"), st.integers(0, 255), st.sampled_from([True, True, True, False]),
                            st.sampled_from([1, 1, 2]), st.integers(0, 2**16), st.lists(stray, max_size=2),
                            st.one_of(st.just(255), st.just(0), st.integers(0, 255)))
_phase = st.tuples(
    st.lists(st.one_of(request, request, recent, hold, finish_held, complete, drain), min_size=1, max_size=12),
    st.just([("drain",)]), st.lists(restart_at_once, min_size=1, max_size=1),
    st.lists(st.one_of(replay, recent, recent, request, hold, finish_held, complete, drain, recover, advance),
             min_size=1, max_size=12))
focused = st.lists(_phase, min_size=1, max_size=2).map(lambda phases: [op for ph in phases for part in ph for op in part])

CAPACITIES = {  # (dram, ssd) in (kv objects, state objects)
    "tiny": ((2, 1), (3, 1)),
    "small": ((4, 1), (6, 2)),
    "roomy": ((3, 1), (14, 5)),  # room for most of what a run writes: recovered objects live on
}


def make_config(preset: str, hybrid: bool, capacity: str) -> SariaConfig:
    chunk = HYBRID_SMALL if hybrid else DENSE
    (dram_kv, dram_state), (ssd_kv, ssd_state) = CAPACITIES[capacity]
    return SariaConfig(dram=Capacity(nbytes=dram_kv * chunk.kv_bytes + dram_state * chunk.state_bytes),
                       ssd=Capacity(nbytes=ssd_kv * chunk.kv_bytes + ssd_state * chunk.state_bytes),
                       chunk=chunk, policy=Policy.preset(preset, metadata_window_s=300.0, prewrite_depth=4))


def stray_key(spec: tuple) -> ObjectKey:
    fam, j, branch, branch_at, kind = spec
    return ObjectKey((fam, j) if branch == 0 else (fam, min(branch_at, j), branch, j), kind)


def keys_of(order) -> list[ObjectKey]:
    return [ObjectKey(h, KV) for h in order.kv] + [ObjectKey(h, STATE) for h in order.state]


@dataclass
class RestartDriver(Driver):
    drives: set = field(default_factory=set)       # ObjectKeys the simulated drives hold
    recovered: dict = field(default_factory=dict)  # the recovered objects the plane should keep, in order
    seen: set = field(default_factory=set)         # every chunk hash the tree may know
    parts: int = 1                                 # the listing of the last restart comes in parts
    parts_left: list = field(default_factory=list)  # parts of the listing not yet given to the plane
    part_seed: int = 0
    shuffle: random.Random = field(default_factory=lambda: random.Random(0))
    after_plan: bool = False                       # the last call was plan(): its drops wait
    evictions: int = 0                             # ssd_evictions as of the last call
    history: list = field(default_factory=list)    # the hashes of every request, across restarts

    # ------------------------------------------------------------------------------- helpers
    def size(self, key: ObjectKey) -> int:
        chunk = self.cp.config.chunk
        return chunk.kv_bytes if key.kind == KV else chunk.state_bytes

    def copy_of(self, key: ObjectKey):
        """The plane's view of ``key``: its CopyInfo, or None (no such object in the tree)."""
        info = self.cp.chunk_info(key.chunk)
        if info is None:
            return None
        return info.kv if key.kind == KV else info.state

    def tracked(self) -> dict[ObjectKey, str]:
        """Every object of the tree with an SSD copy (any status): its status."""
        out = {}
        for h in self.seen:
            info = self.cp.chunk_info(h)
            if info is None:
                continue
            if info.kv.ssd != "absent":
                out[ObjectKey(h, KV)] = info.kv.ssd
            if info.state is not None and info.state.ssd != "absent":
                out[ObjectKey(h, STATE)] = info.state.ssd
        return out

    def part_of(self, key: ObjectKey) -> int:
        return (zlib.crc32(repr(key).encode()) + self.part_seed) % self.parts

    # ---------------------------------------------------------------------------- operations
    def plan(self, hashes: list) -> ReloadPlan:
        self.seen.update(hashes)
        plan = super().plan(hashes)  # checked against oracle(), which knows the recovered objects
        for h, source in zip(plan.chunk_hashes, plan.kv_sources):
            if source is Tier.SSD:
                assert ObjectKey(h, KV) in self.drives, ("plan reads a kv object the drives lack", h, plan)
        if plan.state_source is Tier.SSD:
            assert ObjectKey(plan.state_chunk, STATE) in self.drives, ("plan reads a missing state", plan)
        self.after_call([])
        self.after_plan = True
        return plan

    def commit(self, plan, hashes: list, fail_read: bool) -> None:
        self.seen.update(hashes)
        self.history.append(hashes)
        super().commit(plan, hashes, fail_read)

    def take(self, orders: list) -> None:
        """Every order-returning call ends here: the drives act on the drops, in order."""
        for order in orders:
            if isinstance(order, DropOrder) and order.tier is Tier.SSD:
                keys = keys_of(order)
                assert len(set(keys)) == len(keys), ("an object dropped twice in one order", order)
                assert order.nbytes == sum(map(self.size, keys)), order
                self.drives.difference_update(keys)
        super().take(orders)
        self.after_call(orders)
        self.after_plan = False

    def complete(self, pick: int, outcome: str) -> None:
        if not self.pending:
            return
        order = self.pending.pop(pick % len(self.pending))
        failed, ok = [], outcome != "fail"
        if outcome == "partial" and (order.kv or order.state):
            failed = [order.kv[0]] if order.kv else [order.state[0]]
        if isinstance(order, WriteOrder) and ok:  # the data plane wrote them, then reports
            self.drives.update(k for k in keys_of(order) if k.chunk not in failed)
        self.take(self.cp.complete(order.order_id, ok, self.now, failed=failed))

    def restart(self, mask: int, recover_now: bool, parts: int, seed: int, strays: list, twins: int) -> None:
        written = [o for o in self.pending if isinstance(o, WriteOrder)]
        for i, order in enumerate(written):  # writes in flight at the crash may have finished on disk
            if mask >> (i % 8) & 1:
                self.drives.update(keys_of(order))
        self.drives.update(stray_key(s) for s in strays)
        # A "state object" beside some kv objects: one a previous layout checkpointed (or a dense
        # model's): off the boundaries, a state object no chunk of this layout keeps.
        kvs = sorted((k for k in self.drives if k.kind == KV), key=repr)
        self.drives.update(ObjectKey(k.chunk, STATE) for i, k in enumerate(kvs) if twins >> (i % 8) & 1)
        self.seen.update(key.chunk for key in self.drives)
        self.cp = ControlPlane(self.cp.config)
        self.held, self.pending, self.references, self.recovered = [], [], 0, {}
        self.evictions, self.after_plan = 0, False
        self.parts, self.part_seed, self.parts_left = parts, seed, list(range(parts))
        self.shuffle = random.Random(seed)
        if recover_now:
            self.recover()

    def recover(self) -> None:
        if not self.parts_left:
            self.relist()
            return
        waiting = self.pending_plan_drops() if self.after_plan else set()
        part = self.parts_left.pop(0)
        listing = sorted((k for k in self.drives if self.part_of(k) == part), key=repr)
        self.shuffle.shuffle(listing)
        if listing and self.shuffle.random() < 0.3:
            listing.append(self.shuffle.choice(listing))  # a repeat
        # The contract, given the room the plane has now.
        free = self.cp.usage().ssd_capacity - self.cp.usage().ssd_used
        keep, drop, alone = [], [], []
        for key in dict.fromkeys(listing):
            copy = self.copy_of(key)
            if copy is not None and copy.ssd != "absent":
                alone.append(key)
            elif self.cp.chunk_info(key.chunk) is not None or not self.size(key) or self.size(key) > free:
                drop.append(key)
            else:
                keep.append(key)
                free -= self.size(key)
        before = self.cp.counters()
        orders = self.cp.recover_ssd(listing, self.now)
        named = [k for o in orders for k in keys_of(o)]
        assert all(isinstance(o, DropOrder) and o.tier is Tier.SSD for o in orders), orders
        assert set(named) == set(drop) | waiting, (named, drop, waiting)
        c = self.cp.counters()
        assert c.recovered - before.recovered == len(keep)
        self.take(orders)
        for key in keep:
            self.recovered[key] = None
        self.check()

    def pending_plan_drops(self) -> set:
        """Objects on the drives the plane no longer counts because a plan() decided their drop,
        which the next orders carry: listed state objects of known chunks that keep none."""
        out = set()
        for key in self.drives:
            if key.kind == STATE and key not in self.recovered and self.part_of(key) not in self.parts_left:
                info = self.cp.chunk_info(key.chunk)
                if info is not None and info.state is None:
                    out.add(key)
        return out

    def relist(self) -> None:
        """Every part was given: a new full listing changes nothing but may carry the drops a
        plan() decided."""
        waiting = self.pending_plan_drops() if self.after_plan else set()
        listing = sorted(self.drives, key=repr)
        before = (self.cp.counters().recovered, self.cp.usage().ssd_used, dict(self.tracked()))
        orders = self.cp.recover_ssd(listing, self.now)
        assert {k for o in orders for k in keys_of(o)} == waiting, (orders, waiting)
        assert (self.cp.counters().recovered, self.cp.usage().ssd_used, self.tracked()) == before
        self.take(orders)

    def run(self, op: tuple) -> None:
        if op[0] == "restart":
            self.restart(*op[1:])
        elif op[0] == "recover":
            self.recover()
        elif op[0] == "drain":
            while self.pending:
                self.complete(0, "ok")
        elif op[0] == "replay" and self.history:
            _, back, cut, fail_read = op
            hashes = self.history[-1 - back % len(self.history)][:cut]
            self.commit(self.plan(hashes), hashes, fail_read)
        super().run(op)  # ignores these four, then check()

    def finish(self) -> None:
        while self.parts_left:
            self.recover()
        super().finish()
        self.relist()
        self.check()

    # -------------------------------------------------------------------------------- checks
    def readable(self, depth: int, h) -> tuple[bool, bool, bool, bool] | None:
        """As the tree shows a known chunk; an unknown one with a recovered kv object is an SSD copy
        (its state object too, on a checkpoint boundary)."""
        if self.cp.chunk_info(h) is not None:
            return super().readable(depth, h)
        if ObjectKey(h, KV) not in self.recovered:
            return None
        every = self.cp.config.chunk.checkpoint_chunks
        state = self.cp.config.chunk.hybrid and (depth + 1) % every == 0 and ObjectKey(h, STATE) in self.recovered
        return False, True, False, state

    def after_call(self, orders: list) -> None:
        """Update the recovered model after one call and check eviction order."""
        before = list(self.recovered)
        named = [k for o in orders if isinstance(o, DropOrder) and o.tier is Tier.SSD for k in keys_of(o)]
        unknown = [k for k in before if self.cp.chunk_info(k.chunk) is None]  # not adopted in this call
        evicted = [k for k in named if k in self.recovered and self.cp.chunk_info(k.chunk) is None]
        # A drop order lists kv objects, then state objects: the order shows across calls, and
        # within one call as the set of the first ones.
        assert set(evicted) == set(unknown[:len(evicted)]), ("recovered not evicted oldest first", evicted, unknown)
        named_set = set(named)
        self.recovered = {k: None for k in unknown if k not in named_set}
        evictions = self.cp.counters().ssd_evictions
        if evictions > self.evictions:
            assert not self.recovered, "an LRU copy was evicted while recovered objects were left"
        self.evictions = evictions

    def check(self) -> None:
        super().check()
        cp = self.cp
        assert list(cp._tiers.recovered) == list(self.recovered), (list(cp._tiers.recovered), self.recovered)
        tracked = self.tracked()
        for key, status in tracked.items():
            if status in ("ready", "bad"):
                assert key in self.drives, ("an SSD copy the drives do not hold", key, status)
        assert set(self.recovered) <= self.drives
        usage = cp.usage()
        assert usage.ssd_used == sum(map(self.size, tracked)) + sum(map(self.size, self.recovered))
        unaccounted = self.drives - set(tracked) - set(self.recovered)
        if self.parts_left:
            unaccounted = {k for k in unaccounted if self.part_of(k) not in self.parts_left}
        if self.after_plan:
            unaccounted -= self.pending_plan_drops()
        assert not unaccounted, ("the drives hold objects the plane does not count", unaccounted)
        if not self.parts_left:  # (after plan() too: a waiting drop's bytes were counted until then)
            assert sum(map(self.size, self.drives)) <= usage.ssd_capacity, "the drives hold more than the SSD"


def run_workload(preset: str, hybrid: bool, capacity: str, workload: list) -> RestartDriver:
    driver = RestartDriver(ControlPlane(make_config(preset, hybrid, capacity)))
    for op in workload:
        driver.run(op)
    driver.finish()
    return driver


WORKLOADS = {"random": ops, "restart-then-same-requests": focused}


@pytest.mark.parametrize("shape", sorted(WORKLOADS))
@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("preset", ["saria", "full-duplicate", "gds-only"])
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), capacity=st.sampled_from(sorted(CAPACITIES)))
def test_restarts_keep_every_invariant(preset, hybrid, shape, capacity, data):
    run_workload(preset, hybrid, capacity, data.draw(WORKLOADS[shape]))


OTHER_PRESETS = ["dram-only", "lmcache-plus", "zero-promotion", "full-promotion", "reuse-only"]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops, preset=st.sampled_from(OTHER_PRESETS), hybrid=st.booleans(),
       capacity=st.sampled_from(sorted(CAPACITIES)))
def test_restarts_keep_every_invariant_other_presets(preset, hybrid, capacity, workload):
    run_workload(preset, hybrid, capacity, workload)


def test_a_restart_recovers_what_was_written():
    """A fixed walk through the model: write, restart, recover, read back from SSD."""
    ops_ = [("request", 0, 4, 0, 0, False), ("drain",), ("restart", 0, True, 1, 0, [], 0)]
    driver = RestartDriver(ControlPlane(make_config("full-duplicate", False, "small")))
    for op in ops_:
        driver.run(op)
    assert len(driver.recovered) == 4 and driver.cp.counters().recovered == 4
    plan = driver.plan(hashes_of(0, 4, 0, 0))
    assert plan.kv_sources == (Tier.SSD,) * 4
    driver.held.append((plan, hashes_of(0, 4, 0, 0)))
    driver.finish()
