"""Host pool: slots, alignment, allocation under pressure with the evict-and-retry hook, threads."""

from __future__ import annotations

import threading

import pytest
import torch

from saria.dataplane.dram.host_pool import HostPool, HostPoolFull

SLOT = 16 << 10


def test_slots_are_page_aligned_distinct_views():
    with HostPool(10 * SLOT, SLOT, segment_bytes=4 * SLOT) as pool:  # 3 segments: 4 + 4 + 2 slots
        assert pool.num_slots == 10 and pool.free_slots == 10
        assert pool.pinned == torch.cuda.is_available()
        slots = pool.allocate(10)
        addrs = {pool.slot(s).data_ptr() for s in slots}
        assert len(addrs) == 10 and all(a % 4096 == 0 for a in addrs)
        for i, s in enumerate(slots):
            pool.slot(s).fill_(i)
        assert all(int(pool.slot(s)[0]) == i and int(pool.slot(s)[-1]) == i for i, s in enumerate(slots))


def test_views_cover_an_object():
    with HostPool(4 * SLOT, SLOT) as pool:
        nbytes = 2 * SLOT + 100
        slots = pool.allocate(pool.slots_for(nbytes))
        assert len(slots) == 3
        pieces = pool.views(slots, nbytes)
        assert [p.numel() for p in pieces] == [SLOT, SLOT, 100]
        with pytest.raises(ValueError, match="takes 3 slots"):
            pool.views(slots[:2], nbytes)


def test_full_pool_refuses_clearly_then_recovers():
    with HostPool(3 * SLOT, SLOT) as pool:
        held = pool.allocate(3)
        with pytest.raises(HostPoolFull, match="1 slots requested, 0 free of 3"):
            pool.allocate(1)
        assert pool.counters.full_refusals == 1
        pool.free(held[:1])
        assert pool.allocate(1) == held[:1]
        with pytest.raises(HostPoolFull, match="only 3"):
            pool.allocate(4)


def test_evict_hook_frees_and_allocation_retries():
    resident: list[list[int]] = []
    asked = []

    def evict(shortfall):
        asked.append(shortfall)
        while shortfall > 0 and resident:
            victim = resident.pop(0)
            pool.free(victim)
            shortfall -= len(victim)

    pool = HostPool(4 * SLOT, SLOT, evict=evict)
    resident += [pool.allocate(2), pool.allocate(2)]
    got = pool.allocate(3)
    assert asked == [3] and len(got) == 3 and pool.counters.evict_calls == 1
    pool.close()


def test_evict_hook_that_cannot_help_ends_in_refusal():
    calls = []
    pool = HostPool(2 * SLOT, SLOT, evict=calls.append, evict_attempts=2)
    pool.allocate(2)
    with pytest.raises(HostPoolFull):
        pool.allocate(1)
    assert calls == [1, 1]
    pool.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity_bytes=SLOT, slot_bytes=1000), "multiple of 4096"),
    (dict(capacity_bytes=100, slot_bytes=SLOT), "at least one"),
    (dict(capacity_bytes=4 * SLOT, slot_bytes=SLOT, segment_bytes=100), "segment_bytes"),
    (dict(capacity_bytes=1 << 62, slot_bytes=SLOT), "does not fit in this machine's"),  # before any allocation
    (dict(capacity_bytes=4.0 * SLOT, slot_bytes=SLOT), "capacity_bytes must be an int"),
    (dict(capacity_bytes=4 * SLOT, slot_bytes=True), "slot_bytes must be an int"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HostPool(**kwargs)


def test_bad_frees_change_nothing():
    with HostPool(4 * SLOT, SLOT) as pool:
        slots = pool.allocate(2)
        with pytest.raises(ValueError, match="not allocated"):
            pool.free([slots[0], 3])
        with pytest.raises(ValueError, match="not in this pool"):
            pool.free([7])
        with pytest.raises(ValueError, match="twice"):
            pool.free([slots[0], slots[0]])
        assert pool.free_slots == 2
        pool.free(slots)
        assert pool.free_slots == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pin_without_cuda_refused():
    with pytest.raises(ValueError, match="needs CUDA"):
        HostPool(SLOT, SLOT, pin=True)


def test_threads_never_share_a_slot():
    pool = HostPool(64 * SLOT, SLOT)
    errors = []

    def worker(seed):
        try:
            for i in range(200):
                n = 1 + (seed + i) % 3
                try:
                    slots = pool.allocate(n)
                except HostPoolFull:
                    continue
                for s in slots:
                    pool.slot(s)[:8].fill_(seed)
                for s in slots:
                    if int(pool.slot(s)[:8].max()) != seed or int(pool.slot(s)[:8].min()) != seed:
                        errors.append(f"slot {s} overwritten")
                pool.free(slots)
        except Exception as exc:  # surfaced below
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pool.free_slots == 64
    pool.close()


# --- registered host memory read at its host address (issue 42 item 6) ----------------------------

def _cuda_answers(attribute_value, pointers):
    """A twin of CUDA's answers: the attribute for any GPU, and each host address's device pointer."""
    asked = []

    def attribute(index):
        asked.append(("attribute", index))
        return attribute_value

    def device_pointer(address, index):
        asked.append(("pointer", address, index))
        return pointers.get(address, address)

    return attribute, device_pointer, asked


@pytest.mark.parametrize("device,attribute_value,pinned,pointers,match", [
    pytest.param("cpu", 0, False, {}, None, id="cpu-the-device-is-the-host"),
    pytest.param("cuda:1", 1, True, {}, None, id="cuda-same-address"),
    pytest.param("cuda:1", 0, True, {}, r"GPU 1 cannot read registered host memory at its host address "
                 r"\(cudaDevAttrCanUseHostPointerForRegisteredMem is 0\)", id="cuda-attribute-0"),
    pytest.param("cuda:0", None, True, {}, "cannot ask CUDA whether GPU 0", id="cuda-unknown"),
    pytest.param("cuda:0", 1, False, {}, "not registered with CUDA", id="cuda-pageable-pool"),
    pytest.param("cuda:2", 1, True, {0x20000: 0x7000}, r"segment at 0x20000 has device pointer 0x7000 on GPU 2",
                 id="cuda-other-device-pointer"),
    pytest.param("cuda:2", 1, True, {0x20000: None}, "device pointer none", id="cuda-no-device-pointer"),
])
def test_host_address_refusal_decides_from_cudas_answers(device, attribute_value, pinned, pointers, match):
    from saria.dataplane.dram.host_pool import host_address_refusal
    attribute, device_pointer, asked = _cuda_answers(attribute_value, pointers)
    refusal = host_address_refusal(device, [0x10000, 0x20000], pinned, attribute=attribute,
                                   device_pointer=device_pointer)
    if match is None:
        assert refusal is None
    else:
        assert refusal is not None and __import__("re").search(match, refusal), refusal
    if device == "cpu":
        assert asked == []  # nothing to ask: the CPU reads its own memory
    elif refusal is None:
        index = torch.device(device).index
        assert asked == [("attribute", index), ("pointer", 0x10000, index), ("pointer", 0x20000, index)]


def test_a_refusal_turns_layer_wise_copies_off_for_the_engine(monkeypatch):
    """The check is made once, when the layer-wise paths start; a refusal makes them not capable
    (every reload and store then goes whole), saying why. Here the twin is put where the paths ask."""
    from saria.config import SariaConfig
    from saria.control import ReloadPlan, Tier
    from saria.dataplane import Coordinator, TransferEngine
    from saria.dataplane.transfer import layerwise
    from saria.kernels import PageTable

    caches = [torch.zeros(8, 4096, dtype=torch.uint8) for _ in range(2)]
    seen = []

    def refusing(device, segments, pinned):
        seen.append((torch.device(device), list(segments), pinned))
        return "GPU 0 cannot read registered host memory at its host address (twin)"

    with HostPool(4 * 4096, 4096) as pool:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=1)
        try:
            assert engine.layerwise().capable and engine.layerwise().refusal is None  # the CPU: by address
        finally:
            engine.close()
        monkeypatch.setattr(layerwise, "host_address_refusal", refusing)
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=1)
        try:
            paths = engine.layerwise()
            assert seen == [(torch.device("cpu"), pool.segment_addresses(), pool.pinned)]
            assert not paths.capable and "twin" in paths.refusal
            plan = ReloadPlan(1, ("a",), (Tier.DRAM,), None, None, 8, 0, 0, False)
            assert not engine.layerwise_ok(plan)
        finally:
            engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")
def test_on_cuda_the_gpu_reads_the_pools_segments_at_their_host_address():
    """CUDA's real answers: on a 64-bit Linux machine with a current GPU, registered host memory is
    read at its host address, so layer-wise copies stay on."""
    from saria.dataplane.dram.host_pool import cuda_device_pointer, cuda_host_pointer_attribute, host_address_refusal
    index = torch.cuda.current_device()
    with HostPool(4 << 20, 1 << 20, segment_bytes=2 << 20) as pool:
        assert pool.pinned and cuda_host_pointer_attribute(index) == 1
        assert [cuda_device_pointer(a, index) for a in pool.segment_addresses()] == pool.segment_addresses()
        assert host_address_refusal(torch.device("cuda", index), pool.segment_addresses(), pool.pinned) is None
