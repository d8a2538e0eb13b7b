"""DramStore: the DRAM tier's index over a real host pool (slots freed on replace and drop, views,
contiguous views only where the slots really follow each other in memory)."""

from __future__ import annotations

import threading

import pytest
import torch

from saria.control import ObjectKey
from saria.dataplane import DramObject, DramStore, HostPool

SLOT = 4096


@pytest.fixture
def dram():
    with HostPool(8 * SLOT, SLOT, segment_bytes=4 * SLOT) as pool:
        yield DramStore(pool)


def stored(dram: DramStore, nbytes: int, fill: int) -> DramObject:
    slots = dram.host_pool.allocate(dram.host_pool.slots_for(nbytes))
    obj = DramObject(slots, nbytes, ())
    for piece in dram.views(obj):
        piece.fill_(fill)
    return obj


def test_put_get_drop_and_len(dram):
    pool = dram.host_pool
    a = stored(dram, 5000, 1)
    dram.put(ObjectKey("a", "kv"), a)
    assert dram.get(ObjectKey("a", "kv")) is a and dram.get("a", "kv") is a and dram.get("a") is a
    assert dram.get("a", "state") is None and len(dram) == 1 and ObjectKey("a", "kv") in dram
    assert [p.numel() for p in dram.views(a)] == [SLOT, 5000 - SLOT]
    assert dram.drop("a") is a and dram.drop("a") is None
    assert len(dram) == 0 and pool.free_slots == pool.num_slots
    assert DramStore.pop is DramStore.drop


def test_replacing_an_object_frees_the_old_slots(dram):
    pool = dram.host_pool
    old, new = stored(dram, 3 * SLOT, 1), stored(dram, SLOT, 2)
    dram.put(ObjectKey("k", "kv"), old)
    dram.put(ObjectKey("k", "kv"), new)
    assert dram.get("k") is new and pool.free_slots == pool.num_slots - 1
    dram.put(ObjectKey("k", "kv"), new)  # the same object again: nothing freed twice
    assert pool.free_slots == pool.num_slots - 1
    assert sorted(dram.keys()) == [ObjectKey("k", "kv")] and list(dram) == [ObjectKey("k", "kv")]


def test_bad_objects_are_refused(dram):
    with pytest.raises(TypeError):
        dram.put(ObjectKey("x", "kv"), (1, 2))
    with pytest.raises(ValueError, match="takes 2 slots"):
        dram.put(ObjectKey("x", "kv"), DramObject([0], 5000, ()))
    with pytest.raises(ValueError, match="given with kind"):
        dram.get(ObjectKey("x", "kv"), "state")


def test_contiguous_view_only_for_adjacent_slots_of_one_segment(dram):
    adjacent = stored(dram, 2 * SLOT + 100, 7)  # slots 0, 1, 2 of segment 0
    view = dram.contiguous(adjacent)
    assert view is not None and view.numel() == adjacent.nbytes and bool((view == 7).all())
    assert view.data_ptr() == dram.views(adjacent)[0].data_ptr()
    across = DramObject([3, 4], 2 * SLOT, ())  # last slot of segment 0, first of segment 1
    assert dram.contiguous(across) is None
    assert dram.contiguous(DramObject([6, 5], 2 * SLOT, ())) is None  # reversed order


def test_concurrent_puts_and_drops_keep_the_pool_consistent():
    with HostPool(64 * SLOT, SLOT) as pool:
        dram = DramStore(pool)
        errors = []

        def worker(w):
            try:
                for i in range(200):
                    key = ObjectKey(f"w{w}-{i % 5}", "kv")
                    dram.put(key, DramObject(pool.allocate(2), SLOT + 1, ()))
                    if i % 3 == 0:
                        dram.drop(key)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert pool.used_slots == 2 * len(dram)
        for key in dram.keys():
            dram.drop(key)
        assert pool.free_slots == pool.num_slots and torch.is_tensor(pool.slot(0))


def test_drop_many_frees_every_resident_objects_slots_at_once_and_keeps_only_a_bad_ones():
    """DramStore.drop_many: the objects resident leave the index and their slots go back in one
    free; absent keys are skipped; a slot the pool refuses (freed behind the store's back) keeps
    only that object's slots taken and raises."""
    with HostPool(16 * 4096, 4096) as pool:
        store = DramStore(pool)
        keys = [ObjectKey(c, "kv") for c in ("a", "b", "c", "d")]
        for key in keys:
            store.put(key, DramObject(pool.allocate(2), 8192, (None, None)))
        assert store.drop_many([keys[0], ObjectKey("zz", "kv"), keys[2]]) == 2
        assert store.keys() == [keys[1], keys[3]] and pool.free_slots == 16 - 4
        bad = store.get(keys[3])
        pool.free(bad.slots[:1])  # a bug elsewhere: one of d's slots freed already
        with pytest.raises(ValueError, match="not allocated"):
            store.drop_many([keys[1], keys[3]])
        assert len(store) == 0 and pool.free_slots == 16 - 1  # b's went back, d's other slot stays taken
        assert store.drop_many([]) == 0
