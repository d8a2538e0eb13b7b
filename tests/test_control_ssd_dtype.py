"""``ssd_dtype``: the configuration, and the control plane counting SSD bytes on the SSD side.

* config: ``SariaConfig.ssd_dtype`` and ``ChunkSpec.kv_element_bytes`` are checked, fp8 sizes a
  kv object at 0.515625x (bf16) on SSD and leaves state objects and the SSD capacity in bytes;
* random workloads (hypothesis, small capacities, long runs), dense and hybrid, every preset
  with an SSD tier: with ``ssd_dtype="fp8"`` the SSD never holds more bytes than its capacity,
  what it holds is exactly the SSD sizes of the copies on it (summed from ``chunk_info``, not from
  the plane's own bookkeeping), SSD bytes written are the SSD sizes of the writes that completed,
  SSD bytes read those of the committed plans, and every plan's ``ssd_bytes`` is its SSD reads'
  SSD sizes while DRAM bytes and hits stay full size;
* at equal SSD bytes fp8 keeps at least as many kv objects on SSD (an SSD-only LRU tier, where
  the same calls give the larger tier a superset of the smaller one's chunks);
* ``ssd_dtype="auto"`` is today's behaviour: the same calls give the same orders, plans and
  counters as a config without the field.
"""

from __future__ import annotations

import pytest
from control_cases import DENSE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.config import Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import ControlPlane, DropOrder, Tier, WriteOrder
from saria.ssd_dtype import ssd_kv_bytes

HYBRID_SMALL = ChunkSpec.for_model("qwen3-next-80b-a3b", checkpoint_tokens=2048)  # a checkpoint every 2 chunks
SSD_PRESETS = ("saria", "paper", "full-duplicate", "gds-only", "zero-promotion", "full-promotion", "reuse-only",
               "lmcache-plus")

family = st.integers(0, 5)
ops = st.lists(st.one_of(
    st.tuples(st.just("request"), family, st.integers(1, 10), st.integers(0, 10), st.integers(0, 2)),
    st.tuples(st.just("complete"), st.integers(0, 999), st.sampled_from(["ok", "ok", "ok", "fail"])),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 30.0, 90.0])),
), min_size=20, max_size=120)


def hashes_of(fam: int, length: int, branch_at: int, branch: int) -> list:
    if branch == 0 or branch_at >= length:
        return [(fam, j) for j in range(length)]
    return [(fam, j) for j in range(branch_at)] + [(fam, branch_at, branch, j) for j in range(branch_at, length)]


def make_config(preset: str, hybrid: bool, ssd_dtype: str, **policy) -> SariaConfig:
    chunk = HYBRID_SMALL if hybrid else DENSE
    dram = 5 * chunk.kv_bytes + 2 * chunk.state_bytes
    ssd = 9 * chunk.kv_bytes + 3 * chunk.state_bytes  # the same bytes for both formats
    return SariaConfig(dram=Capacity(nbytes=dram), ssd=Capacity(nbytes=ssd), chunk=chunk, ssd_dtype=ssd_dtype,
                       policy=Policy.preset(preset, metadata_window_s=300.0, prewrite_depth=4, **policy))


# ============================================================================================ config
def test_config_fields_and_sizes():
    auto, fp8 = SariaConfig(), SariaConfig(ssd_dtype="fp8")
    assert auto.ssd_dtype == "auto" and auto.chunk.kv_element_bytes == 2
    assert auto.ssd_kv_bytes == auto.chunk.kv_bytes
    assert fp8.ssd_kv_bytes == auto.chunk.kv_bytes * 33 // 64 == ssd_kv_bytes(auto.chunk.kv_bytes, "fp8", 2)
    assert fp8.ssd_bytes == auto.ssd_bytes  # the capacity stays bytes: fp8 holds ~1.94x the kv objects
    assert fp8.ssd_bytes // fp8.ssd_kv_bytes >= 1.93 * (auto.ssd_bytes // auto.ssd_kv_bytes)
    assert fp8.ssd_bytes_of(3, 0) == 3 * fp8.ssd_kv_bytes
    hybrid = SariaConfig.for_model("qwen3-next-80b-a3b", ssd_dtype="fp8")
    assert hybrid.ssd_bytes_of(2, 1) == 2 * hybrid.ssd_kv_bytes + hybrid.chunk.state_bytes  # states stay exact
    assert ChunkSpec.for_model("qwen3-8b").kv_element_bytes == 2


@pytest.mark.parametrize("value", ["fp16", "FP8", "", None, 8, ("fp8",)])
def test_bad_ssd_dtype_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"SariaConfig\.ssd_dtype must be one of auto, fp8"):
        SariaConfig(ssd_dtype=value)


@pytest.mark.parametrize("value", [0, 9, -2, True, 2.0, "2"])
def test_bad_element_size_is_refused(value):
    with pytest.raises(ValueError, match=r"ChunkSpec\.kv_element_bytes"):
        ChunkSpec(kv_element_bytes=value)


def test_fp8_that_does_not_fit_the_cache_is_refused():
    with pytest.raises(ValueError, match="ssd_dtype='fp8' does not fit this cache.*whole groups"):
        SariaConfig(ssd_dtype="fp8", chunk=ChunkSpec(chunk_tokens=1, kv_bytes_per_token=6, checkpoint_tokens=1))
    with pytest.raises(ValueError, match="ssd_dtype='fp8' does not fit this cache.*2- or 4-byte"):
        SariaConfig(ssd_dtype="fp8", chunk=ChunkSpec(kv_element_bytes=1))
    SariaConfig(ssd_dtype="auto", chunk=ChunkSpec(kv_element_bytes=1))  # auto stores any cache as it is


# ========================================================================================== workloads
class Driver:
    """Runs ops on a control plane and keeps its own account of SSD bytes to check the counters."""

    def __init__(self, config: SariaConfig, fail: bool = True) -> None:
        self.cp = ControlPlane(config)
        self.config = config
        self.fail = fail
        self.now = 0.0
        self.pending: list = []
        self.seen: set = set()
        self.written = 0  # SSD bytes of the writes completed ok
        self.read = 0     # SSD bytes of the committed plans
        self.hit_bytes = 0  # cache bytes of their SSD hits
        self.orders: list = []

    def take(self, orders: list) -> None:
        self.orders += orders
        self.pending += [o for o in orders if not isinstance(o, DropOrder)]

    def run(self, op: tuple) -> None:
        config, chunk = self.config, self.config.chunk
        if op[0] == "request":
            hashes = hashes_of(*op[1:])
            self.seen.update(hashes)
            plan = self.cp.plan(hashes, self.now)
            ssd_chunks = plan.kv_sources.count(Tier.SSD)
            state_ssd = plan.state_source is Tier.SSD
            assert plan.ssd_bytes == config.ssd_bytes_of(ssd_chunks, state_ssd)
            assert plan.dram_bytes == (plan.num_chunks - ssd_chunks) * chunk.kv_bytes + (
                chunk.state_bytes if plan.state_source is Tier.DRAM else 0)
            self.read += plan.ssd_bytes
            self.hit_bytes += ssd_chunks * chunk.kv_bytes + (chunk.state_bytes if state_ssd else 0)
            self.take(self.cp.commit_prefill(hashes, self.now, plan))
        elif op[0] == "complete" and self.pending:
            order = self.pending.pop(op[1] % len(self.pending))
            ok = op[2] == "ok" or not self.fail
            if ok and isinstance(order, WriteOrder):
                self.written += config.ssd_bytes_of(len(order.kv), len(order.state))
            self.take(self.cp.complete(order.order_id, ok, self.now))
        elif op[0] == "advance":
            self.now += op[1]
        self.check()

    def drain(self) -> None:
        while self.pending:
            self.run(("complete", 0, "ok"))

    def ssd_kv_objects(self) -> int:
        infos = [self.cp.chunk_info(h) for h in self.seen]
        return sum(1 for info in infos if info is not None and info.kv.ssd != "absent")

    def check(self) -> None:
        usage, c, config = self.cp.usage(), self.cp.counters(), self.config
        assert usage.ssd_capacity == config.ssd_bytes and 0 <= usage.ssd_used <= usage.ssd_capacity
        on_ssd = 0
        for h in self.seen:
            info = self.cp.chunk_info(h)
            if info is None:
                continue
            assert info.kv.nbytes == config.chunk.kv_bytes  # DRAM copies stay full size
            on_ssd += config.ssd_kv_bytes if info.kv.ssd != "absent" else 0
            if info.state is not None and info.state.ssd != "absent":
                on_ssd += config.chunk.state_bytes
        assert usage.ssd_used == on_ssd
        assert c.ssd_bytes_written == self.written
        assert c.ssd_bytes_read == self.read
        assert 0 <= c.ssd_useful_write_bytes <= c.ssd_bytes_written
        assert c.hits_ssd_bytes == self.hit_bytes  # hits count the cache's bytes, whatever the SSD format


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("preset", SSD_PRESETS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops)
def test_fp8_ssd_holds_its_bytes_and_the_counters_add_up(preset, hybrid, workload):
    driver = Driver(make_config(preset, hybrid, "fp8"))
    for op in workload:
        driver.run(op)
    driver.drain()
    assert driver.cp.audit() == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops)
def test_fp8_keeps_at_least_as_many_kv_objects_at_equal_ssd_bytes(workload):
    # gds-only: SSD is the one tier (an LRU of every chunk written through, touched when referenced),
    # so a larger tier holds a superset of a smaller one's chunks after the same requests.
    drivers = [Driver(make_config("gds-only", False, dtype), fail=False) for dtype in ("auto", "fp8")]
    for op in workload:
        for driver in drivers:
            driver.run(op)
            driver.drain()
        auto, fp8 = (d.ssd_kv_objects() for d in drivers)
        assert fp8 >= auto
    hits = [d.cp.counters().hits for d in drivers]
    assert hits[1] >= hits[0]
    assert drivers[1].cp.counters().ssd_bytes_written <= drivers[0].cp.counters().ssd_bytes_written


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
@pytest.mark.parametrize("preset", SSD_PRESETS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=ops)
def test_auto_is_todays_behaviour(preset, hybrid, workload):
    with_field = Driver(make_config(preset, hybrid, "auto"))
    chunk = with_field.config.chunk
    without = Driver(SariaConfig(dram=with_field.config.dram, ssd=with_field.config.ssd, chunk=chunk,
                                 policy=with_field.config.policy))
    for op in workload:
        with_field.run(op)
        without.run(op)
    assert with_field.orders == without.orders
    assert with_field.cp.counters() == without.cp.counters()
    assert with_field.config.ssd_kv_bytes == chunk.kv_bytes
