"""Tier sizing (``saria.sizing``): what the user asks for is what is taken, and what the control
plane admits always fits.

* (a) Over random object sizes (kv only; kv and a GDN state of another size; kv objects in their
  FP8 form on SSD), 1-4 drives, staging, tiny and huge capacities: the host pool's slots never
  pin more than the DRAM tier's bytes plus the staging asked for, each drive file is never larger
  than the SSD tier's bytes over the drives, nothing is left unused beyond one unit, and the
  layout is the SSD store's own (its geometry for that file size). A tier that cannot hold one
  object of each kind is refused with the least it needs, and that least is exact.
* (b) Differential: a real ``ControlPlane`` built with the layout drives random requests,
  completions (some failed), prewarms and a previous run's SSD objects, and every order runs
  against a model of the data plane's allocators (host slots; the SSD store's own
  ``SlotAllocator`` over the drives): no store, promotion or write ever lacks its slots or
  parts, and the pool's slots in use are exactly the control plane's DRAM charges.
* End to end: ``TieredCache`` over real pages, a real host pool and real drive files under
  pressure: the files and the pool are at most what was asked, and nothing is refused for room.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernel_cases import vllm_layers
from saria.config import Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import ControlPlane, DropOrder, PromoteOrder, StoreOrder, Tier, WriteOrder
from saria.dataplane.dram.host_pool import PAGE as POOL_PAGE
from saria.dataplane.dram.host_pool import HostPool
from saria.dataplane.ssd.alloc import SlotAllocator
from saria.dataplane.ssd.errors import StoreFull
from saria.dataplane.ssd.format import BLOCK, HEADER_BYTES, SUPERBLOCK_BYTES, Geometry
from saria.integrations.cache import TieredCache
from saria.orders import ObjectKey
from saria.sizing import (MAX_SLOT_BYTES, PAGE, SSD_HEADER_BYTES, SSD_SUPERBLOCK_BYTES, TierSizing, size_tiers,
                          slot_bytes_for)

MiB = 1 << 20


def test_the_layout_rule_uses_the_stores_format():
    assert (SSD_SUPERBLOCK_BYTES, SSD_HEADER_BYTES) == (SUPERBLOCK_BYTES, HEADER_BYTES)
    assert PAGE == BLOCK == POOL_PAGE


# --- (a) the layout never takes more than asked -------------------------------------------------

@st.composite
def configs(draw, *, small: bool = False):
    """A config (object sizes, ssd_dtype, capacities) and its drives and staging bytes."""
    tokens = draw(st.sampled_from([1, 2, 8, 16, 64, 512]))
    per_token = 256 * draw(st.integers(1, 12 if small else 96))  # whole FP8 groups of bf16 elements
    state = draw(st.one_of(st.just(0), st.integers(1, 3 * MiB if small else 80 * MiB)))
    chunk = ChunkSpec(chunk_tokens=tokens, kv_bytes_per_token=per_token, state_bytes=state,
                      checkpoint_tokens=tokens * draw(st.integers(1, 3)))
    ssd_dtype = draw(st.sampled_from(["auto", "fp8"]))
    drives = draw(st.integers(1, 4))
    largest = max(chunk.kv_bytes, state)
    if small:  # a few objects' worth, any byte count: every rounding matters
        dram = draw(st.integers(0, 12 * (largest + PAGE)))
        ssd = draw(st.integers(0, drives * (PAGE + 30 * (largest + 2 * PAGE))))
    else:  # anything from nothing to a large server (never allocated here)
        dram = draw(st.one_of(st.integers(0, 64 * MiB), st.integers(0, 4 << 40)))
        ssd = draw(st.one_of(st.integers(0, 64 * MiB), st.integers(0, 1 << 44)))
    staging = draw(st.one_of(st.just(0), st.integers(0, 1 << 30)))
    config = SariaConfig(dram=Capacity(nbytes=dram), ssd=Capacity(nbytes=ssd), chunk=chunk, ssd_dtype=ssd_dtype)
    return config, drives, staging


def object_sizes(config: SariaConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Each kind's size in DRAM and on SSD."""
    state = {"state": config.chunk.state_bytes} if config.chunk.hybrid else {}
    return {"kv": config.chunk.kv_bytes, **state}, {"kv": config.ssd_kv_bytes, **state}


def least_given(message: str) -> int:
    return int(message.split("give it at least ")[1].split(" bytes")[0].replace(",", ""))


@settings(max_examples=1500, deadline=None, database=None)
@given(case=st.one_of(configs(), configs(small=True)))
def test_the_tiers_never_take_more_than_the_bytes_given(case):
    config, drives, staging = case
    dram_sizes, ssd_sizes = object_sizes(config)
    try:
        sizing = size_tiers(config, drives, staging)
    except ValueError as exc:
        # refused: the tier cannot hold one object of each kind, and the least it names is exact
        tier, other = ("dram", "ssd") if "DRAM tier" in str(exc) else ("ssd", "dram")
        least = least_given(str(exc))
        assert least > getattr(config, f"{tier}_bytes") > 0
        for given_bytes, holds in ((least, True), (least - 1, False)):  # (the other tier off)
            changed = dataclasses.replace(config, **{tier: Capacity(nbytes=given_bytes), other: Capacity(nbytes=0)})
            if holds:
                size_tiers(changed, drives, staging)  # the least suffices ...
            else:
                with pytest.raises(ValueError, match="give it at least"):
                    size_tiers(changed, drives, staging)  # ... and one byte less does not
        return
    dram, ssd = sizing.dram, sizing.ssd
    slot = dram.unit_bytes
    assert slot == slot_bytes_for(list(dram_sizes.values())) and slot % PAGE == 0 and slot <= MAX_SLOT_BYTES
    # the host pool: whole slots of the DRAM tier's bytes, and of the staging's, never more
    assert dram.capacity <= config.dram_bytes < dram.capacity + slot
    assert sizing.staging_slots * slot <= staging < (sizing.staging_slots + 1) * slot
    assert sizing.pinned_bytes == dram.footprint + sizing.staging_slots * slot <= config.dram_bytes + staging
    if config.dram_bytes:
        assert all(dram.units >= dram.units_for(n) for n in dram_sizes.values())  # one of each kind fits
    # the SSD: per drive a superblock and whole slots, within the tier's bytes over the drives
    if config.ssd_bytes:
        part = ssd.unit_bytes
        assert ssd.drives == drives and ssd.units == drives * ssd.units_per_drive
        assert part == (slot if config.ssd_dtype == "auto" else slot_bytes_for(list(ssd_sizes.values())))
        per_drive = config.ssd_bytes // drives
        assert ssd.file_bytes == SSD_SUPERBLOCK_BYTES + ssd.units_per_drive * (SSD_HEADER_BYTES + part)
        assert ssd.file_bytes <= per_drive < ssd.file_bytes + SSD_HEADER_BYTES + part
        assert ssd.footprint == drives * ssd.file_bytes <= config.ssd_bytes
        assert ssd.capacity + drives * SSD_SUPERBLOCK_BYTES + ssd.units * SSD_HEADER_BYTES == ssd.footprint
        geometry = Geometry.for_capacity(ssd.file_bytes, part)  # what SSDStore makes of that file size
        assert (geometry.slots, geometry.file_bytes) == (ssd.units_per_drive, ssd.file_bytes)
        assert all(ssd.units >= ssd.units_for(n) for n in ssd_sizes.values())
    else:
        assert ssd.units == 0 and ssd.footprint == 0
    # a charge is the object's whole units: what the host pool and the store give it
    for n in dram_sizes.values():
        assert dram.charge(n) == HostPool.slots_for(SimpleNamespace(slot_bytes=slot), n) * slot
        assert n <= dram.charge(n) < n + slot
    for n in ssd_sizes.values():
        assert ssd.charge(n) == -(-n // ssd.unit_bytes) * ssd.unit_bytes


@pytest.mark.parametrize("tier, given_bytes, drives, message", [
    pytest.param("dram", 100 << 10, 1, r"DRAM tier's 102,400 bytes hold no kv object \(131,072 bytes, 1 slot",
                 id="dram"),
    pytest.param("ssd", 100 << 10, 1, r"SSD tier's 102,400 bytes hold no kv object .* at least 139,264 bytes",
                 id="ssd-one-drive"),
    # 3 drives, 400 KiB: 136 KiB each, the superblock leaves less than one 132 KiB slot per drive
    pytest.param("ssd", 400 << 10, 3, r"at least 3 drive|at least 417,792 bytes", id="ssd-split-over-drives"),
])
def test_a_tier_smaller_than_one_object_is_refused_with_the_least_it_needs(tier, given_bytes, drives, message):
    config = SariaConfig(dram=Capacity(nbytes=1 << 20), ssd=Capacity(nbytes=1 << 30),
                         chunk=ChunkSpec(chunk_tokens=64, kv_bytes_per_token=2048, checkpoint_tokens=64))
    config = dataclasses.replace(config, **{tier: Capacity(nbytes=given_bytes)})
    with pytest.raises(ValueError, match=message):
        size_tiers(config, drives)


def test_a_state_object_larger_than_the_tier_is_refused_too():
    config = SariaConfig(dram=Capacity(nbytes=1 << 20), ssd=Capacity(nbytes=1 << 30),
                         chunk=ChunkSpec(chunk_tokens=64, kv_bytes_per_token=2048, state_bytes=(3 << 20) + 5,
                                         checkpoint_tokens=128))
    with pytest.raises(ValueError, match=r"DRAM tier's 1,048,576 bytes hold no state object \(3,145,733 bytes, "
                                         r"25 slot\(s\) in whole 131,072-byte slots\): give it at least 3,276,800"):
        size_tiers(config, 1)


def test_ssd_bytes_not_divisible_among_drives_and_no_drives():
    config = SariaConfig(dram=Capacity(nbytes=0), ssd=Capacity(nbytes=(256 << 20) + 2),
                         chunk=ChunkSpec(chunk_tokens=64, kv_bytes_per_token=2048, checkpoint_tokens=64))
    sizing = size_tiers(config, 3)
    per_drive = ((256 << 20) + 2) // 3
    assert sizing.ssd.file_bytes <= per_drive and 3 * sizing.ssd.file_bytes <= config.ssd_bytes
    assert sizing.ssd.units == 3 * ((per_drive - 4096) // (4096 + (128 << 10)))
    assert sizing.pinned_bytes == 0 and sizing.dram.units == 0  # no DRAM tier: nothing pinned
    with pytest.raises(ValueError, match="no ssd_paths"):
        size_tiers(config, 0)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="drives"):
            size_tiers(config, bad)
    with pytest.raises(ValueError, match="staging_bytes"):
        size_tiers(config, 1, staging_bytes=-1)


def test_the_demo_and_a_qwen3_8b_server_take_what_they_ask():
    """The figures docs/dataplane.md quotes (before this layout the demo's file was 528.3 MiB and
    its pool 2.1 MiB; the Qwen3-8B server pinned 67.6 GiB and preallocated 1,585 GiB)."""
    demo = SariaConfig(dram=Capacity(nbytes=8 * 64 * 2048), ssd=Capacity(nbytes=256 << 20),
                       chunk=ChunkSpec(chunk_tokens=64, kv_bytes_per_token=2048, checkpoint_tokens=64))
    sizing = size_tiers(demo, 1)
    assert (sizing.pinned_bytes, sizing.dram.units) == (1 << 20, 8)
    assert (sizing.ssd.units, sizing.ssd.file_bytes) == (1985, 4096 + 1985 * (4096 + (128 << 10)))
    qwen = SariaConfig.for_model("qwen3-8b", dram=Capacity(nbytes=64 << 30), ssd=Capacity(nbytes=1500 << 30))
    sizing = size_tiers(qwen, 4)
    assert sizing.pinned_bytes == 64 << 30 and sizing.dram.capacity // sizing.dram.charge(qwen.chunk.kv_bytes) == 910
    assert sizing.ssd.footprint <= 1500 << 30 and sizing.ssd.capacity // sizing.ssd.charge(qwen.chunk.kv_bytes) == 21312
    assert "DRAM 64.00 GiB asked, 64.00 GiB pinned (16,384 slots of 4.00 MiB)" in sizing.describe()


def test_without_a_sizing_objects_charge_their_sizes():
    """A replay's control plane (no data plane behind it) keeps byte accounting."""
    config = SariaConfig(dram=Capacity(nbytes=10_000), ssd=Capacity(nbytes=50_000),
                         chunk=ChunkSpec(chunk_tokens=1, kv_bytes_per_token=1000, checkpoint_tokens=1))
    cp = ControlPlane(config)
    assert cp.sizing == TierSizing.in_bytes(10_000, 50_000)
    usage = cp.usage()
    assert (usage.dram_capacity, usage.ssd_capacity) == (10_000, 50_000)


# --- (b) whatever the control plane admits fits the allocated slots and parts ---------------------

class ModelDataPlane:
    """The data plane's allocators: a host pool of ``sizing.dram.units`` slots (an object takes its
    whole slots at once, as a store, promotion or prewarm order runs) and the SSD store's own
    ``SlotAllocator`` over the drives (a write takes one free part per ``part_bytes``, from any
    drive). Orders run in list order; a failed order's slots are freed before its completion is
    reported, as the data plane does."""

    def __init__(self, sizing: TierSizing, dram_sizes: dict[str, int], ssd_sizes: dict[str, int]):
        self.sizing = sizing
        self.dram_units = {k: sizing.dram.units_for(n) for k, n in dram_sizes.items()}
        self.ssd_units = {k: sizing.ssd.units_for(n) for k, n in ssd_sizes.items()}
        self.free_slots = sizing.dram.units
        drives = max(1, sizing.ssd.drives)
        self.alloc = SlotAllocator([range(sizing.ssd.units_per_drive)] * drives)
        self.dram: dict[ObjectKey, int] = {}
        self.ssd: dict[ObjectKey, list] = {}
        self.moved: dict[int, list[tuple[Tier, ObjectKey]]] = {}  # order id -> what it allocated

    def hold_recovered(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        """A previous run's objects on the drives (as many as fit)."""
        held = []
        for key in keys:
            try:
                self.ssd[key] = self.alloc.allocate(self.ssd_units[key.kind])
            except StoreFull:
                break
            held.append(key)
        return held

    def run(self, order) -> None:
        keys = order.keys()
        if isinstance(order, DropOrder):
            for key in keys:
                if order.tier is Tier.DRAM:
                    self.free_slots += self.dram.pop(key, 0)
                else:
                    self.alloc.release(self.ssd.pop(key, []))
            return
        moved = self.moved[order.order_id] = []
        for key in keys:
            if isinstance(order, (StoreOrder, PromoteOrder)):
                need = self.dram_units[key.kind]
                assert key not in self.dram, f"{key} stored twice"
                assert need <= self.free_slots, f"host pool full: {key} needs {need} slots, {self.free_slots} free"
                self.free_slots -= need
                self.dram[key] = need
                moved.append((Tier.DRAM, key))
            else:
                assert isinstance(order, WriteOrder) and key not in self.ssd, f"{key} written twice"
                self.ssd[key] = self.alloc.allocate(self.ssd_units[key.kind])  # StoreFull fails the test
                moved.append((Tier.SSD, key))

    def failed(self, order_id: int, keys) -> None:
        for tier, key in self.moved[order_id]:
            if key in keys:
                if tier is Tier.DRAM:
                    self.free_slots += self.dram.pop(key)
                else:
                    self.alloc.release(self.ssd.pop(key))

    def used_slots(self) -> int:
        return self.sizing.dram.units - self.free_slots


PRESETS = ["saria", "full-duplicate", "full-promotion", "gds-only", "dram-only", "lmcache-plus", "reuse-only"]


@st.composite
def workloads(draw):
    config, drives, _ = draw(configs(small=True))
    policy = Policy.preset(draw(st.sampled_from(PRESETS)), prewrite_depth=3, metadata_window_s=200.0,
                           prewarm_dram_fraction=1.0)
    config = dataclasses.replace(config, policy=policy)
    try:
        sizing = size_tiers(config, drives)
    except ValueError:
        assume(False)
    steps = draw(st.lists(st.tuples(st.sampled_from(["request", "request", "complete", "complete", "prewarm",
                                                     "advance"]),
                                    st.integers(0, 3), st.integers(1, 10), st.integers(0, 1 << 30)),
                          min_size=5, max_size=60))
    return config, sizing, steps, draw(st.integers(0, 6))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(case=workloads())
def test_what_the_control_plane_admits_always_fits_the_allocated_slots_and_parts(case):
    config, sizing, steps, recovered = case
    dram_sizes, ssd_sizes = object_sizes(config)
    data = ModelDataPlane(sizing, dram_sizes, ssd_sizes)
    cp = ControlPlane(config, sizing=sizing)
    pending: list = []
    now = 0.0

    def take(orders) -> None:
        for order in orders:
            data.run(order)
            if not isinstance(order, DropOrder):
                pending.append(order)
        usage = cp.usage()
        assert data.used_slots() * sizing.dram.unit_bytes == usage.dram_used <= usage.dram_capacity
        assert usage.ssd_used <= usage.ssd_capacity == sizing.ssd.capacity
        assert not cp.audit()

    def family(f: int, n: int) -> list:
        return [(f, j) for j in range(n)]

    if config.ssd_bytes and recovered:  # a previous run's objects on the drives
        held = data.hold_recovered([ObjectKey((f, j), "kv") for f in range(2) for j in range(recovered)])
        take(cp.recover_ssd(held, now))
    for op, f, n, seed in steps:
        rng = random.Random(seed)
        now += 1.0
        if op == "request":
            hashes = family(f, n)
            plan = cp.plan(hashes, now)
            from_ssd = [h for h, s in zip(plan.chunk_hashes, plan.kv_sources) if s is Tier.SSD]
            failed = from_ssd[:1] if rng.random() < 0.2 else []  # a failed SSD read now and then
            take(cp.commit_prefill(hashes, now, plan=plan, failed=failed))
        elif op == "complete" and pending:
            for order in [pending.pop(rng.randrange(len(pending))) for _ in range(min(len(pending), n))]:
                outcome = rng.choice(["ok", "ok", "ok", "fail", "partial"])
                keys = order.keys()
                failed = set(keys) if outcome == "fail" else set(keys[:1]) if outcome == "partial" else set()
                data.failed(order.order_id, failed)
                take(cp.complete(order.order_id, outcome != "fail", now,
                                 failed=list(failed) if outcome == "partial" else ()))
        elif op == "prewarm":
            take(cp.prewarm(family(f, n), now))
        elif op == "advance":
            now += (61.0, 500.0)[seed % 2]
    while pending:  # everything completes: the pool holds exactly what the control plane charges
        order = pending.pop(0)
        data.failed(order.order_id, set())
        take(cp.complete(order.order_id, True, now))


# --- end to end: real pages, a real host pool, real drive files -----------------------------------

@settings(max_examples=8, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(heads=st.integers(1, 3), head_dim=st.sampled_from([64, 128, 192]), fp8=st.booleans(),
       drives=st.integers(1, 3), dram_extra=st.integers(0, 8191), ssd_extra=st.integers(0, 40_000),
       preset=st.sampled_from(["full-duplicate", "saria", "gds-only"]))
def test_a_tiered_cache_under_pressure_takes_what_was_asked_and_refuses_nothing(
        tmp_path_factory, heads, head_dim, fp8, drives, dram_extra, ssd_extra, preset):
    block_tokens, pages = 4, 2
    caches = vllm_layers(64, block_tokens, heads, head_dim, torch.bfloat16, layers=2, seed=heads)
    kv_bytes = 2 * pages * block_tokens * 2 * heads * head_dim * 2  # 2 layers x pages x tokens x K,V x heads x dim
    root = tmp_path_factory.mktemp("sizing")
    paths = []
    for d in range(drives):
        (root / f"nvme{d}").mkdir()
        paths.append(str(root / f"nvme{d}"))
    dram = 3 * kv_bytes + dram_extra  # 3 objects' bytes and some: the pool holds 3 or 4 of them at most
    ssd = drives * (4096 + 6 * (4096 + kv_bytes)) + ssd_extra  # about 6 objects per drive
    config = SariaConfig.preset(preset, chunk=ChunkSpec(chunk_tokens=block_tokens * pages, checkpoint_tokens=64),
                                dram=Capacity(nbytes=dram), ssd=Capacity(nbytes=ssd),
                                ssd_dtype="fp8" if fp8 else "auto").with_policy(p_tau_s=0.0)
    rng = random.Random(heads * 1000 + head_dim + drives)
    with TieredCache(config, caches, block_tokens=block_tokens, ssd_paths=paths, durable=False) as cache:
        pool, store = cache.host_pool, cache.ssd
        assert pool.num_slots * pool.slot_bytes <= cache.config.dram_bytes
        for path in store.paths:
            assert path.stat().st_size <= ssd // drives
        for turn in range(8):  # sessions of up to 12 chunks over 24 page pairs: DRAM and SSD overflow
            f = rng.randrange(3)
            hashes = [f"s{f}-{j}" for j in range(rng.randrange(2, 12))]
            own = {h: [2 * (j % 24), 2 * (j % 24) + 1] for j, h in enumerate(hashes)}
            plan = cache.lookup(hashes)
            result = cache.load(plan, [[48 + 2 * (j % 8), 49 + 2 * (j % 8)] for j in range(plan.num_chunks)]).wait()
            cache.commit(hashes, own, plan=plan, failed=result.failed)
            cache.drain()
        counters = cache.counters()
        data, control = counters["data"], counters["control"]
        assert data["host_pool"]["full_refusals"] == 0 and data["engine"]["store_failures"] == 0
        assert data["ssd"]["store_full"] == 0 and data["ssd"]["write_failures"] == 0
        assert data["engine"]["ssd_write_failures"] == 0 and data["engine"]["host_pool_full"] == 0
        assert control["stores_failed"] == control["writes_failed"] == control["promotions_failed"] == 0
        assert control["ssd_writes"] > 0 or preset == "saria"  # admission may not have written yet
        usage = cache.control.usage()
        assert usage.dram_used == pool.used_slots * pool.slot_bytes
        assert usage.ssd_used == (store.total_parts - store.free_parts) * store.part_bytes
        assert not cache.control.audit()


def test_without_a_dram_tier_nothing_is_pinned_and_ssd_still_serves(tmp_path):
    caches = vllm_layers(16, 4, 2, 64, torch.bfloat16, layers=2)
    config = SariaConfig.preset("gds-only", chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                                dram=Capacity(nbytes=1 << 20), ssd=Capacity(nbytes=1 << 20))
    with TieredCache(config, caches, block_tokens=4, ssd_paths=[str(tmp_path)]) as cache:
        assert cache.host_pool.num_slots == 0 and cache.control.sizing.pinned_bytes == 0
        hashes = ["a", "b"]
        cache.commit(hashes, {"a": [0, 1], "b": [2, 3]}, plan=cache.lookup(hashes))
        cache.drain()
        plan = cache.lookup(hashes)
        assert plan.kv_sources == (Tier.SSD, Tier.SSD)
        assert cache.load(plan, [[8, 9], [10, 11]]).wait().ok
        same = [torch.equal(c[a].view(torch.uint8), c[b].view(torch.uint8)) for c in caches for a, b in ((8, 0), (11, 3))]
        assert all(same)  # bytes (random bf16 bytes hold NaNs)
        cache.release(plan)
        cache.drain()
