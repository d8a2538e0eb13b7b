"""Differential tests: the real :class:`ControlPlane` against the reference model (``control_model``).

Both get the same calls; after every call the test compares the return values (every plan and
every order, ids included, or that both refused the call with ``ControlPlaneError``), the counters,
the usage, every chunk's metadata the test ever named, and runs the real plane's audit. A refused
call must leave both unchanged.

Workloads cover every preset, dense and hybrid models (a checkpoint every 1-3 chunks), DRAM and SSD
from nothing or a chunk to more than the working set, metadata windows from shorter than one time
step to longer than the run, spans of many windows, held plans committed or released late (with
failed SSD reads), commits without a plan or with more chunks than planned, GDN states kept only
at some boundaries, completions in any order (ok, failed, partly failed), a clock that is handed an
earlier time, families of prefixes that branch and come back after their metadata was reclaimed,
the endurance governor, and bad calls. The window queue is compacted after every few touches
(``_COMPACT_SLACK = 0``) in the hypothesis runs and with its real thresholds in the long seeded runs.
"""

from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field

import pytest
from control_cases import PRESETS
from control_model import Model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import saria.control.tree as tree_module
from saria.config import POLICY_PRESETS, Capacity, ChunkSpec, Policy, SariaConfig, WriteBudget
from saria.control import ControlPlane, ControlPlaneError, DropOrder, ObjectKey, Tier

FAMILIES = 4
# Examples per preset and model; SARIA_DIFF_EXAMPLES=1000 for a longer hunt.
EXAMPLES = int(os.environ.get("SARIA_DIFF_EXAMPLES", "40"))


@dataclass(frozen=True)
class Setup:
    preset: str
    hybrid: bool
    checkpoint_chunks: int = 2
    dram_chunks: int = 6
    ssd_chunks: int = 16
    extra_states: int = 2  # capacity for this many state objects on top (hybrid)
    window_s: float = 300.0
    prewrite_depth: int = 4
    p_tau_s: float = 60.0
    r: float | None = None
    thetas: tuple[int | None, int | None] | None = None  # (theta_E, theta_R) over the preset's
    governor: bool = False
    compact_factor: int | None = 1  # None: the tree's own thresholds

    def config(self) -> SariaConfig:
        chunk = (ChunkSpec.for_model("qwen3-next-80b-a3b", checkpoint_tokens=1024 * self.checkpoint_chunks)
                 if self.hybrid else ChunkSpec())
        overrides: dict = {"metadata_window_s": self.window_s, "prewrite_depth": self.prewrite_depth}
        preset = POLICY_PRESETS[self.preset]
        if "p_tau_s" not in preset:
            overrides["p_tau_s"] = self.p_tau_s
        if "r" not in preset:
            overrides["r"] = self.r
        if self.thetas is not None and not preset.get("admit_all") and "theta_E" not in preset:
            overrides["theta_E"], overrides["theta_R"] = self.thetas
        policy = Policy.preset(self.preset, **overrides)
        dram = self.dram_chunks * chunk.kv_bytes + self.extra_states * chunk.state_bytes
        ssd = self.ssd_chunks * chunk.kv_bytes + self.extra_states * chunk.state_bytes
        governor = (self.governor and policy.theta_E is not None and not policy.admit_all and policy.use_ssd
                    and ssd > 0)
        budget = WriteBudget(dwpd=50.0, auto=True, interval_s=20.0, window_s=200.0, payback_s=200.0) if governor \
            else WriteBudget()
        return SariaConfig(dram=Capacity(nbytes=dram), ssd=Capacity(nbytes=ssd), chunk=chunk, policy=policy,
                           write_budget=budget)


@contextmanager
def compaction(factor: int | None):
    """Compact the window queue once it holds more than ``factor`` entries per node (None: as shipped)."""
    saved = tree_module._COMPACT_FACTOR, tree_module._COMPACT_SLACK
    if factor is not None:
        tree_module._COMPACT_FACTOR, tree_module._COMPACT_SLACK = factor, 0
    try:
        yield
    finally:
        tree_module._COMPACT_FACTOR, tree_module._COMPACT_SLACK = saved


def hashes_of(fam: int, length: int, branch_at: int, branch: int) -> list:
    """Prefix-chained ids: family ``fam``'s trunk, forking at ``branch_at`` into branch ``branch``."""
    if branch == 0 or branch_at >= length:
        return [(fam, j) for j in range(length)]
    return [(fam, j) for j in range(branch_at)] + [(fam, branch_at, branch, j) for j in range(branch_at, length)]


def info_tuple(info) -> tuple | None:
    if info is None:
        return None
    return (info.key, info.depth, info.parent, info.E_b, info.R_b, info.last_reuse, astuple(info.kv),
            None if info.state is None else astuple(info.state))


@dataclass
class Twin:
    """A real control plane and the model, fed the same calls."""

    setup: Setup
    cp: ControlPlane = field(init=False)
    model: Model = field(init=False)
    now: float = 0.0
    held: list = field(default_factory=list)     # (plan, hashes)
    pending: list = field(default_factory=list)  # orders awaiting completion
    keys: set = field(default_factory=set)       # every chunk hash named so far
    calls: int = 0

    def __post_init__(self) -> None:
        config = self.setup.config()
        self.cp, self.model = ControlPlane(config), Model(config)

    # ------------------------------------------------------------------------------ calls
    def call(self, name: str, *args, **kwargs):
        """Call both; the same result or both refuse; then compare everything observable."""
        self.calls += 1
        before = self.observe() if self.calls % 7 == 0 else None
        got = want = None
        try:
            got = getattr(self.cp, name)(*args, **kwargs)
        except ControlPlaneError as exc:
            got = exc
        try:
            want = getattr(self.model, name)(*args, **kwargs)
        except ControlPlaneError as exc:
            want = exc
        where = f"call {self.calls}: {name}{args!r} {kwargs!r}"
        if isinstance(got, ControlPlaneError) or isinstance(want, ControlPlaneError):
            assert isinstance(got, ControlPlaneError) and isinstance(want, ControlPlaneError), \
                f"{where}: control plane gave {got!r}, the model {want!r}"
            if before is not None:
                assert self.observe() == before, f"{where}: a refused call changed state"
            got = None
        else:
            assert got == want, f"{where}:\n control plane {got!r}\n model         {want!r}"
        self.compare(where)
        return got

    def observe(self) -> tuple:
        return (self.cp.counters(), astuple(self.cp.usage()),
                tuple(info_tuple(self.cp.chunk_info(k)) for k in sorted(self.keys, key=repr)))

    def compare(self, where: str) -> None:
        assert self.cp.audit() == [], where
        assert self.cp.counters() == self.model.counters, f"{where}: counters differ"
        assert astuple(self.cp.usage()) == self.model.usage(), f"{where}: usage differs"
        for key in self.keys:
            assert info_tuple(self.cp.chunk_info(key)) == self.model.chunk_info(key), f"{where}: chunk {key!r}"

    # ----------------------------------------------------------------------------- workload
    def take(self, orders: list | None) -> None:
        for order in orders or ():
            if not isinstance(order, DropOrder):
                self.pending.append(order)

    def failures(self, plan, how: int) -> list:
        """Names of failed SSD reads of ``plan``: none, its first SSD chunk, or its state object."""
        if plan is None or how == 0:
            return []
        ssd = [h for h, s in zip(plan.chunk_hashes, plan.kv_sources) if s is Tier.SSD]
        if how == 2 and plan.state_source is Tier.SSD:
            return [ObjectKey(plan.state_chunk, "state")]
        return ssd[:1] + ([plan.state_chunk] if how == 3 and plan.state_source is Tier.SSD else [])

    def states(self, hashes: list, mode: int):
        """``states`` for a hybrid commit: None (every checkpoint), every chunk, or only some."""
        if not self.setup.hybrid or mode == 0:
            return None
        return range(len(hashes)) if mode == 1 else [i for i in range(len(hashes)) if i % 3 == mode % 3]

    def commit(self, plan, hashes: list, fail: int, extra: int, states: int, skew: bool) -> None:
        if extra:
            fam = hashes[-1] if hashes else (9, 0)
            hashes = hashes + [(fam, "x", j) for j in range(extra)]
        self.keys.update(hashes)
        now = self.now - 5.0 if skew else self.now
        self.take(self.call("commit_prefill", hashes, now, plan=plan, failed=self.failures(plan, fail),
                            states=self.states(hashes, states)))

    def run(self, op: tuple) -> None:
        kind = op[0]
        if kind == "request":  # plan, then commit at once (prefill took no time)
            _, fam, length, branch_at, branch, fail, extra, states, skew = op
            hashes = hashes_of(fam, length, branch_at, branch)
            self.keys.update(hashes)
            plan = self.call("plan", hashes, self.now)
            self.commit(plan, hashes, fail, extra, states, skew)
        elif kind == "hold":
            _, fam, length, branch_at, branch = op
            hashes = hashes_of(fam, length, branch_at, branch)
            self.keys.update(hashes)
            self.held.append((self.call("plan", hashes, self.now), hashes))
        elif kind == "finish" and self.held:
            _, pick, commit, fail, extra, states = op
            plan, hashes = self.held.pop(pick % len(self.held))
            if commit:
                self.commit(plan, hashes, fail, extra, states, False)
            else:
                self.take(self.call("release", plan, self.now, failed=self.failures(plan, fail)))
        elif kind == "unplanned":
            _, fam, length = op
            self.commit(None, hashes_of(fam, length, 0, 0), 0, 0, 0, False)
        elif kind == "complete" and self.pending:
            _, pick, outcome = op
            order = self.pending.pop(pick % len(self.pending))
            if outcome == "partial" and len(order.kv) + len(order.state) > 1:
                failed = [order.kv[-1]] if order.kv else [ObjectKey(order.state[0], "state")]
                self.take(self.call("complete", order.order_id, True, self.now, failed=failed))
            else:
                self.take(self.call("complete", order.order_id, outcome != "fail", self.now))
        elif kind == "advance":
            self.now += op[1]
        elif kind == "advance-window":  # exactly one window: a node quiet since then is at the boundary
            self.now += self.setup.window_s
        elif kind == "bad":
            self.bad(op[1], op[2])

    def bad(self, kind: int, pick: int) -> None:
        """A call the control plane must refuse, changing nothing."""
        plan = self.held[pick % len(self.held)][0] if self.held else None
        known = sorted(self.model.nodes, key=repr)  # in the tree now
        calls = [
            ("plan", [(0, 0), (0, 0)], self.now),
            ("plan", [[1, 2]], self.now),
            ("plan", "abc", self.now),
            ("plan", [(1, 0)], math.nan),
            ("plan", [(1, 0)], True),
            ("plan", [(7, 9), known[pick % len(known)]] if known else [(7, 9), (7, 9)], self.now),
            ("release", 10**9, self.now),
            ("release", plan if plan is not None else -1, self.now, ["no such chunk"]),
            ("release", plan if plan is not None else -1, self.now, None),
            ("release", plan if plan is not None else -1, self.now, "xy"),
            ("commit_prefill", [(5, "z")], self.now, plan),  # does not begin with the plan (or no plan: fine)
            ("commit_prefill", [(1, 0)], self.now, None, [(1, 0)]),
            ("commit_prefill", [(1, 0)], self.now, None, None),
            ("commit_prefill", [(1, 0)], self.now, None, [[1]]),
            ("commit_prefill", [(1, 0)], self.now, None, (), 5),
            ("commit_prefill", [(1, 0)], self.now, None, (), "0"),
            ("commit_prefill", [(1, 0)], self.now, None, (), [1]),
            ("commit_prefill", [(1, 0)], self.now, None, (), [True]),
            ("complete", self.pending[pick % len(self.pending)].order_id if self.pending else 0, "yes", self.now),
            ("complete", self.pending[pick % len(self.pending)].order_id if self.pending else 0, True, self.now,
             ["no such chunk"]),
            ("complete", self.pending[pick % len(self.pending)].order_id if self.pending else 0, True, self.now,
             None),
            ("chunk_info", [1]),
        ]
        name, *args = calls[kind % len(calls)]
        if name == "commit_prefill" and len(args) == 3 and (plan is None or not plan.chunk_hashes):
            return  # committing an empty plan or no plan with new chunks is a valid call
        self.keys.add((1, 0))
        result = self.call(name, *args)
        assert result is None, f"{name}{args!r} was accepted"

    def finish(self) -> None:
        """Commit what is held, complete what is pending, then let every window pass."""
        while self.held:
            self.run(("finish", 0, True, 0, 0, 0))
        while self.pending:
            self.run(("complete", 0, "ok"))
        self.now += self.setup.window_s * 3 + 1
        self.run(("hold", 0, 1, 0, 0))
        self.run(("finish", 0, False, 0, 0, 0))


# ---------------------------------------------------------------------------------- workloads
family = st.integers(0, FAMILIES - 1)
length = st.integers(0, 9)
request = st.tuples(st.just("request"), family, length, st.integers(0, 8), st.integers(0, 2), st.integers(0, 3),
                    st.sampled_from([0, 0, 0, 1, 2]), st.integers(0, 3), st.booleans())
op = st.one_of(
    request, request, request,
    st.tuples(st.just("hold"), family, length, st.integers(0, 8), st.integers(0, 2)),
    st.tuples(st.just("finish"), st.integers(0, 99), st.booleans(), st.integers(0, 3), st.sampled_from([0, 0, 1]),
              st.integers(0, 3)),
    st.tuples(st.just("unplanned"), family, length),
    st.tuples(st.just("complete"), st.integers(0, 999), st.sampled_from(["ok", "ok", "ok", "fail", "partial"])),
    st.tuples(st.just("complete"), st.integers(0, 999), st.just("ok")),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.4, 3.0, 20.0, 70.0, 400.0])),
    st.tuples(st.just("advance-window")),
    st.tuples(st.just("bad"), st.integers(0, 40), st.integers(0, 99)),
)


def setups(preset: str, hybrid: bool):
    return st.builds(
        Setup, st.just(preset), st.just(hybrid),
        checkpoint_chunks=st.integers(1, 3),
        dram_chunks=st.sampled_from([0, 1, 2, 3, 5, 8, 60]),
        ssd_chunks=st.sampled_from([0, 1, 3, 8, 20, 200]),
        extra_states=st.integers(0, 3),
        window_s=st.sampled_from([0.25, 5.0, 60.0, 1e7]),
        prewrite_depth=st.sampled_from([0, 1, 4, 100]),
        p_tau_s=st.sampled_from([0.0, 10.0, 60.0]),
        r=st.sampled_from([None, 0.5, 1.0]),
        thetas=st.sampled_from([None, (1, 2), (3, None), (1, 1)]),
        governor=st.booleans(),
        compact_factor=st.sampled_from([1, 2, 4]),
    )


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("preset", PRESETS)
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_control_plane_matches_the_model(preset, hybrid, data):
    setup = data.draw(setups(preset, hybrid), label="setup")
    workload = data.draw(st.lists(op, min_size=30, max_size=150), label="workload")
    with compaction(setup.compact_factor):
        twin = Twin(setup)
        for step in workload:
            twin.run(step)
        twin.finish()


def random_op(rng: random.Random) -> tuple:
    roll = rng.random()
    fam, n = rng.randrange(FAMILIES), rng.randrange(12)
    if roll < 0.45:
        return ("request", fam, n, rng.randrange(9), rng.choice([0, 0, 1, 2]), rng.choice([0, 0, 0, 0, 1, 2, 3]),
                rng.choice([0] * 8 + [1, 2]), rng.randrange(4), rng.random() < 0.05)
    if roll < 0.52:
        return ("hold", fam, n, rng.randrange(9), rng.choice([0, 1, 2]))
    if roll < 0.58:
        return ("finish", rng.randrange(99), rng.random() < 0.7, rng.choice([0, 0, 1, 2]), 0, rng.randrange(4))
    if roll < 0.60:
        return ("unplanned", fam, n)
    if roll < 0.88:
        return ("complete", rng.randrange(999), rng.choice(["ok"] * 12 + ["fail", "partial"]))
    if roll < 0.98:
        return ("advance", rng.choice([0.0, 0.5, 2.0, 10.0, 45.0, 200.0]))
    if roll < 0.99:
        return ("advance-window",)
    return ("bad", rng.randrange(40), rng.randrange(99))


def _long_run_cases() -> list:
    """Every preset on both model kinds; ``make test`` runs each preset on one kind, alternating (the
    hypothesis differential above runs every preset on both), the other half is ``long``."""
    return [pytest.param(preset, hybrid, id=f"{preset}-{'hybrid' if hybrid else 'dense'}",
                         marks=() if hybrid == bool(i % 2) else (pytest.mark.long,))
            for i, preset in enumerate(PRESETS) for hybrid in (False, True)]


@pytest.mark.parametrize("preset,hybrid", _long_run_cases())
def test_long_runs_over_many_windows_match_the_model(preset, hybrid):
    """2,500 calls on small tiers over some 200 windows of a few requests each; the window queue is
    compacted at the tree's own factor (4 entries per node), without the slack of 4,096 entries
    that keeps a small tree from ever compacting. Seeded: each case replays the same calls every run."""
    rng = random.Random(f"{preset}-{hybrid}")
    setup = Setup(preset, hybrid, checkpoint_chunks=2, dram_chunks=5, ssd_chunks=12, window_s=60.0,
                  prewrite_depth=3, governor=preset == "saria", compact_factor=4)
    with compaction(setup.compact_factor):
        twin = Twin(setup)
        while twin.calls < 2500:
            twin.run(random_op(rng))
        twin.finish()
    counters = twin.cp.counters()
    assert counters.nodes_reclaimed > 100 and counters.requests > 500


@pytest.mark.parametrize("preset,dram_chunks", [("saria", 3), ("dram-only", 3), ("dram-only", 0)])
def test_expiry_right_after_compaction_with_the_shipped_thresholds(preset, dram_chunks):
    """Within one window the window queue grows to just below the shipped compaction threshold (4
    entries a node + 4,096); then the window passes and the next request pushes the queue over it,
    so that call compacts and expires in one go: every node is reclaimed exactly once, as the model
    says, and chunks that come back afterwards are new nodes. (6ee4006 walked the deque that
    compaction had just replaced: nodes were reclaimed twice, a KeyError or a live node lost.)"""
    twin = Twin(Setup(preset, False, dram_chunks=dram_chunks, ssd_chunks=6, window_s=600.0, compact_factor=None))
    tree = twin.cp._tree
    i = 0
    while len(tree._queue) < tree_module._COMPACT_FACTOR * len(tree.nodes) + tree_module._COMPACT_SLACK - 3:
        twin.now = i * 0.01  # some 4,000 requests in 40 s: all within one window
        twin.run(("request", i % 3, 4, 0, 0, 0, 0, 0, False))
        while twin.pending:
            twin.run(("complete", 0, "ok"))
        i += 1
        assert i < 20_000
    twin.run(("hold", 2, 4, 0, 0))  # planned before the window passes: this call expires nothing
    twin.now += 601.0
    twin.run(("finish", 0, True, 0, 0, 0))  # committed after: compacts, then expires families 0 and 1
    assert len(tree._queue) <= 4 * len(tree.nodes)
    twin.now += 1.0
    twin.run(("request", 0, 4, 0, 0, 0, 0, 0, False))  # family 0 comes back after its reclaim
    counters = twin.cp.counters()
    assert counters.nodes_reclaimed == counters.nodes_created - len(tree.nodes) > 0


def test_promotion_never_evicts_a_state_object_its_own_chunk_made_admissible():
    """A chunk's kv and state objects share E_b. When promotion makes room by evicting an idle kv
    object (it has an SSD copy, so its slot frees at once) and then that chunk's state object, the
    kv eviction raised E_b to theta_E: the state object is admitted and written, its slot held, and
    the promotion must not count on it (the soak's synth hybrid runs found DRAM 75 MB over capacity).
    Here: DRAM holds one chunk; x's kv is prewritten (E_b + 1 reaches 2), its state is not (a state
    adds no eviction of its own); then an SSD hit of z asks for promotion."""
    twin = Twin(Setup("saria", True, checkpoint_chunks=1, dram_chunks=1, ssd_chunks=20, extra_states=1,
                      window_s=1e7, prewrite_depth=100, p_tau_s=0.0, r=1.0))

    def commit(hashes: list, plan=None) -> None:
        twin.keys.update(hashes)
        twin.take(twin.call("commit_prefill", hashes, twin.now, plan=plan))
        while twin.pending:
            twin.run(("complete", 0, "ok"))
        twin.now += 1.0

    for hashes in (["z"], ["y"], ["z"], ["y"]):  # z evicted twice: written to SSD, kv and state
        commit(hashes)
    assert twin.cp.chunk_info("z").state.ssd == "ready"
    for hashes in (["x"], ["w"], ["x"], []):  # x evicted once, stored again, then prewritten
        commit(hashes)
    x = twin.cp.chunk_info("x")
    assert (x.E_b, x.kv.dram, x.kv.ssd, x.state.dram, x.state.ssd) == (1, "ready", "ready", "ready", "absent")
    plan = twin.call("plan", ["z"], twin.now)
    assert plan.kv_sources == (Tier.SSD,) and plan.state_source is Tier.SSD
    commit(["z"], plan)
    usage = twin.cp.usage()
    assert usage.dram_used <= usage.dram_capacity
