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
