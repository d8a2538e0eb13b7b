"""What CUDA refuses, refused on every machine: the data plane's CPU twins of events and pinned host
ranges keep CUDA's rules, so the bugs that only a GPU used to show (found by the first H200 run:
``elapsed_time`` on events made without ``enable_timing``, ``cudaHostRegister`` error 712 on a
range a collected pool never unregistered, host slots not given back) fail here first.

On a CUDA machine the same tests run against the real events and registrations."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_cases import vllm_layers
from saria.control import DropOrder, ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import HostPool, SSDStore
from saria.dataplane.dram.host_pool import REGISTRY, HostRegistry
from saria.dataplane.transfer.load_job import LoadJob
from saria.dataplane.transfer.stores import Stores
from saria.dataplane.transfer.streams import CudaEvent, Event, HostEvent, Streams
from test_dataplane_engine import PAGES, SLOT, blocks_of, engine_rig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NB = 48


# --- events ----------------------------------------------------------------------------------------

def test_elapsed_time_needs_two_recorded_timing_events():
    streams = Streams(DEVICE)
    plain = streams.record("dram")
    timed_a, timed_b = streams.record("dram", timing=True), streams.record("dram", timing=True)
    with pytest.raises(ValueError, match="enable_timing=True"):  # CUDA's own words
        plain.elapsed_time(timed_b)
    with pytest.raises(ValueError, match="enable_timing=True"):
        timed_a.elapsed_time(plain)
    timed_b.synchronize()
    assert timed_a.elapsed_time(timed_b) >= 0.0
    with pytest.raises(RuntimeError, match="recorded"):
        timed_a.elapsed_time(streams.event(timing=True))


def test_a_stream_refuses_to_wait_for_an_unrecorded_or_foreign_event():
    streams = Streams(DEVICE)
    with pytest.raises(RuntimeError, match="never recorded"):
        streams.wait("ssd", streams.event())
    with pytest.raises(TypeError, match="Event"):
        streams.wait("ssd", object())
    foreign = HostEvent() if DEVICE.type == "cuda" else _ForeignCudaEvent()
    foreign.record()
    with pytest.raises(ValueError, match="cannot order work"):
        streams.wait("ssd", foreign)
    with pytest.raises(ValueError, match="unknown stream"):
        streams.record("gpu")
    streams.wait("offload", streams.caller_event())
    streams.wait(None, streams.record("dram"))


class _ForeignCudaEvent(HostEvent):
    """A recorded event that claims to be CUDA's (what a CPU engine must never accept)."""

    device_type = "cuda"


def test_events_are_made_for_the_engine_device():
    streams = Streams(DEVICE)
    event = streams.caller_event(timing=True)
    assert isinstance(event, Event) and event.recorded and event.enable_timing and event.query()
    assert isinstance(event, CudaEvent if DEVICE.type == "cuda" else HostEvent)


def test_a_timeline_needs_timing_events():
    streams = Streams(DEVICE)
    plan = ReloadPlan(1, ("a",), (Tier.DRAM,), None, None, 8, 0, 0, False)
    with pytest.raises(ValueError, match="enable_timing"):
        LoadJob(plan, [], [], start_event=streams.record("dram"))
    job = LoadJob(plan, [], [], start_event=streams.record("dram", timing=True))
    with pytest.raises(ValueError, match="timing event"):
        job.mark("dram", 10, streams.record("dram"))
    job.mark("dram", 10, streams.record("dram", timing=True))
    job.mark("ssd", 10)
    job.wait()
    assert sorted(p for p, _, _ in job.timeline) == ["dram", "ssd"]
    assert all(isinstance(t, float) and t >= 0 for _, t, _ in job.timeline)


# --- host ranges -----------------------------------------------------------------------------------

def _ranges_of(pool_ptrs):
    return [r for r in REGISTRY.ranges() if r[0] in pool_ptrs]


def test_a_pool_unregisters_its_ranges_exactly_once_when_closed():
    pool = HostPool(8 * SLOT, SLOT, segment_bytes=4 * SLOT)
    ptrs = {seg.data_ptr() for seg in pool._segments}
    assert len(_ranges_of(ptrs)) == 2 and all(pinned == pool.pinned for _, _, pinned in _ranges_of(ptrs))
    pool.close()
    assert _ranges_of(ptrs) == [] and pool.closed
    pool.close()  # idempotent: nothing unregistered twice


def test_a_pool_dropped_without_close_unregisters_when_collected():
    """The H200's error 712: a pool nobody closed was unmapped with its range still registered, and
    the next pool mapped at that address could not register. Now collection unregisters it."""
    pool = HostPool(4 * SLOT, SLOT)
    ptrs = {seg.data_ptr() for seg in pool._segments}
    del pool
    gc.collect()
    assert _ranges_of(ptrs) == []
    for _ in range(3):  # new pools (often at the same addresses) register fine
        with HostPool(4 * SLOT, SLOT):
            pass


def test_the_registry_refuses_overlaps_and_double_unregistration():
    registry = HostRegistry()
    registry.register(1 << 20, 8192, pin=False)
    for start, nbytes in ((1 << 20, 8192), ((1 << 20) + 4096, 100), ((1 << 20) - 4096, 4097)):
        with pytest.raises(RuntimeError, match="712"):
            registry.register(start, nbytes, pin=False)
    registry.register((1 << 20) + 8192, 4096, pin=False)  # adjacent is fine
    registry.unregister(1 << 20)
    with pytest.raises(RuntimeError, match="not registered"):
        registry.unregister(1 << 20)
    assert registry.ranges() == [((1 << 20) + 8192, 4096, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a failed cudaHostRegister needs CUDA")
def test_a_failed_registration_leaves_no_error_for_the_next_launch():
    registry = HostRegistry()
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        registry.register(4096, 4096, pin=True)  # not host memory of this process
    assert torch.equal(torch.ones(4, device="cuda").clone() + 1, torch.full((4,), 2.0, device="cuda"))


# --- slots ---------------------------------------------------------------------------------------

@pytest.fixture
def rig(tmp_path):
    caches = [c.to(DEVICE) for c in vllm_layers(NB, 4, 2, 8, torch.bfloat16, layers=3, seed=5)]
    with engine_rig(caches, [tmp_path / "d"], 24) as parts:
        yield parts


def test_a_store_whose_copy_fails_gives_its_slots_back(rig, monkeypatch):
    caches, engine, store, pool = rig
    real = Stores._copy_to_slots
    calls = []

    def flaky(self, staging, slots):
        calls.append(slots)
        if len(calls) == 2:
            raise RuntimeError("copy failed (injected)")
        return real(self, staging, slots)

    monkeypatch.setattr(Stores, "_copy_to_slots", flaky)
    done = engine.store(StoreOrder(1, ("a", "b", "c"), (), 0), {c: blocks_of(i) for i, c in enumerate("abc")}).result()
    assert done.ok and done.failed == (ObjectKey("b", "kv"),)
    assert engine.dram_object("b") is None and engine.dram_object("a") and engine.dram_object("c")
    assert pool.used_slots == engine.dram.held_slots() == 2 * len(calls[0])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["store", "write", "drop", "load", "fault"]),
                                st.integers(0, 5), st.booleans()), min_size=1, max_size=25))
def test_every_slot_taken_is_owned_or_given_back(rig, monkeypatch, steps):
    """Model: a random run of stores (some with an injected copy failure), write-throughs, drops and
    reloads (some of missing objects) never leaves a slot that no DRAM object owns, and every
    reload either lands the source bytes or fails the object."""
    caches, engine, store, pool = rig
    for key in engine.dram.keys():
        engine.dram.drop(key)
    real = Stores._copy_to_slots
    fail = threading.Event()

    def maybe_fail(self, staging, slots):
        if fail.is_set():
            raise RuntimeError("copy failed (injected)")
        return real(self, staging, slots)

    monkeypatch.setattr(Stores, "_copy_to_slots", maybe_fail)
    order = 100
    for op, i, flag in steps:
        chunk = f"k{i}"
        order += 1
        if op in ("store", "fault"):
            fail.clear() if op == "store" else fail.set()
            engine.store(StoreOrder(order, (chunk,), (), 0), {chunk: blocks_of(i)}).result()
            fail.clear()
        elif op == "write":
            engine.write(WriteOrder(order, (chunk,), (), 0, Tier.GPU, "write-through"), {chunk: blocks_of(i)}).result()
        elif op == "drop":
            engine.drop(DropOrder(order, (chunk,), (), 0, Tier.DRAM if flag else Tier.SSD))
        else:
            tier = Tier.DRAM if flag else Tier.SSD
            present = engine.dram_object(chunk) is not None if flag else store.contains(_ssd_key(chunk))
            target = [40, 41]
            result = engine.load(ReloadPlan(order, (chunk,), (tier,), None, None, 8, 0, 0, False), [target]).wait()
            assert result.ok == present
            if present:
                for c in caches:
                    assert torch.equal(c[target].view(torch.uint8), c[blocks_of(i)].view(torch.uint8))
        assert pool.used_slots == engine.dram.held_slots()


def _ssd_key(chunk):
    from saria.dataplane import object_key

    return object_key(chunk, "kv")


# --- the SSD store's bounce buffers ------------------------------------------------------------------

def test_bounce_buffers_are_registered_and_unregistered_once(tmp_path):
    """The POSIX backend's bounce buffers (pinned where CUDA is, so copies to and from GPU memory
    are DMA, not CUDA's pageable path) are registered ranges like a host pool's: unregistered when
    the store closes, and when a pool nobody closed is collected."""
    from saria.dataplane.ssd.files import AlignedPool

    part = 2 * SLOT  # bounce buffers are a part long; header blocks (also registered) are 4 KiB
    (tmp_path / "d").mkdir()
    store = SSDStore([tmp_path / "d"], 4096 + 4 * (4096 + part), part, backend="posix")
    before = set(REGISTRY.ranges())
    data = torch.arange(part + 100, dtype=torch.int64).to(torch.uint8).to(DEVICE)
    store.write(b"k", data).result()
    out = torch.empty(part + 100, dtype=torch.uint8, device=DEVICE)
    store.read(b"k", out).result()  # the partial last part (and, on a GPU, every part) goes through a bounce
    assert torch.equal(out, data)
    bounce = {r for r in set(REGISTRY.ranges()) - before if r[1] == part}
    assert bounce and all(pinned == torch.cuda.is_available() for _, _, pinned in bounce)
    store.close()
    assert not bounce & set(REGISTRY.ranges())

    pool = AlignedPool(8192, pin=False)
    with pool.acquire() as buf:
        ptr = buf.tensor.data_ptr()
    assert any(r[0] == ptr for r in REGISTRY.ranges())
    del pool, buf
    gc.collect()
    assert not any(r[0] == ptr for r in REGISTRY.ranges())



_COLLECTED_INSIDE = """
import gc, json
from saria.dataplane import HostPool
from saria.dataplane.dram.host_pool import REGISTRY
from saria.dataplane.ssd.files import AlignedBuffer, AlignedPool

bounce = AlignedPool(4096)
with bounce.acquire() as buf:
    dropped = [buf.tensor.data_ptr()]
host = HostPool(4 * 4096, 4096, segment_bytes=2 * 4096)
dropped += [seg.data_ptr() for seg in host._segments]
bounce.cycle, host.cycle = bounce, host  # garbage only collection frees
del bounce, host, buf
inside = []

class CollectingPtr(int):
    def __add__(self, other):  # register's overlap check adds: collection strikes there
        if not inside:
            gc.collect()
            inside.extend(p for p in dropped if p in REGISTRY._ranges)
        return int(self) + other

mine = AlignedBuffer(4096)
REGISTRY.register(CollectingPtr(mine.tensor.data_ptr()), 4096, pin=False)
after = {start for start, _, _ in REGISTRY.ranges()}
REGISTRY.unregister(mine.tensor.data_ptr())
print(json.dumps({"dropped": len(dropped), "held_inside": len(inside), "left": len(after & set(dropped))}))
"""


def test_pools_collected_inside_a_registry_call_never_deadlock(tmp_path):
    """Collection runs finalizers inside any code: ``make test`` on a fresh clone once hung 15
    minutes (in test_ssd_store_faults), a dropped bounce pool collected while the same thread's
    ``register`` held the registry's lock, its finalizer waiting for that lock. Here collection
    strikes inside ``register`` on purpose, with a bounce pool and a host pool waiting as garbage, in
    a child process (a deadlock fails the test instead of hanging the suite): their ranges stay
    registered while the call runs (their memory still mapped) and none is left when it ends."""
    import json
    import subprocess
    import sys

    script = tmp_path / "collected_inside.py"
    script.write_text(_COLLECTED_INSIDE)
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a pool's finalizer deadlocked on the host registry's lock")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"dropped": 3, "held_inside": 3, "left": 0}
