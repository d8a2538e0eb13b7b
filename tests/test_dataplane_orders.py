"""The order dispatch (``TransferEngine.execute``): one :class:`OrderRun` per order, its ``released``
event (the source pages are free) and its completion; ``capture_state`` for GDN checkpoints.

"After the pack" is checked without clocks: the engine's pack is gated on an event the test opens,
so ``released`` must still be clear while the pack is held and set once it has run."""

from __future__ import annotations

import threading

import pytest
import torch

from kernel_cases import gdn_pages, vllm_layers
from saria.config import SariaConfig
from saria.control import DropOrder, ObjectKey, PromoteOrder, StoreOrder, Tier, WriteOrder
from saria.dataplane import Coordinator, HostPool, OrderRun, SSDStore, TransferEngine, object_key
from saria.dataplane.transfer import packing as packing_module
from saria.kernels import PageTable, pack_pages

PAGES = 2
NB = 32
SLOT = 4096


def blocks_of(i, base=0):
    return [base + PAGES * i, base + PAGES * i + 1]


@pytest.fixture
def parts(tmp_path):
    caches = vllm_layers(NB, 4, 2, 8, torch.bfloat16, layers=3, seed=11)
    gdn = gdn_pages(NB, 768, 600, seed=12)
    pool = HostPool(16 * SLOT, SLOT)
    (tmp_path / "d").mkdir()
    store = SSDStore([tmp_path / "d"], 4096 + 16 * (4096 + SLOT), SLOT)
    engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                            pages_per_chunk=PAGES, ssd=store, state_table=PageTable(gdn), state_pages=1)
    yield caches, gdn, engine, store, pool
    engine.close()
    store.close()
    pool.close()


class GatedPack:
    """Replaces the engine's ``pack_pages``: each call waits for ``gate`` and is then counted."""

    def __init__(self, fail: bool = False):
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        self.fail = fail

    def __call__(self, *args, **kwargs):
        self.entered.set()
        self.gate.wait()
        self.calls += 1
        if self.fail:
            raise RuntimeError("pack failed (injected)")
        return pack_pages(*args, **kwargs)


def test_execute_returns_one_run_per_order_in_order(parts):
    caches, gdn, engine, store, pool = parts
    src = {c: blocks_of(i) for i, c in enumerate("abc")}
    orders = [StoreOrder(1, ("a",), (), 0), WriteOrder(2, ("b",), (), 0, Tier.GPU, "write-through"),
              PromoteOrder(3, ("c",), (), 0), DropOrder(4, ("zz",), (), 0, Tier.DRAM)]
    runs = engine.execute(orders, src)
    assert [r.order for r in runs] == orders and all(isinstance(r, OrderRun) for r in runs)
    assert runs[3].completion is None and runs[3].released.is_set()
    for r in runs[:3]:
        done = r.completion.result()
        assert r.released.is_set() and done.order_id == r.order.order_id and done.ok and not done.failed
    assert engine.dram_object("a") is not None and engine.dram_object("c") is not None
    assert store.contains(object_key("b", "kv"))
    with pytest.raises(Exception):
        runs[0].released = threading.Event()  # frozen


def test_released_is_set_only_after_the_pack_ran(parts, monkeypatch):
    caches, gdn, engine, store, pool = parts
    gated = GatedPack()
    monkeypatch.setattr(packing_module, "pack_pages", gated)
    src = {c: blocks_of(i) for i, c in enumerate("ab")}
    store_run, write_run = engine.execute([StoreOrder(1, ("a", "b"), (), 0),
                                           WriteOrder(2, ("a",), (), 0, Tier.GPU, "write-through")], src)
    assert gated.entered.wait(30)
    assert not store_run.released.is_set() and not write_run.released.is_set()
    gated.gate.set()
    assert store_run.released.wait(30) and write_run.released.wait(30)
    assert gated.calls == 2  # one launch per order: both objects of the store in one pack
    assert store_run.completion.result().ok and write_run.completion.result().ok


def test_released_at_once_for_drops_and_dram_source_writes(parts, monkeypatch):
    caches, gdn, engine, store, pool = parts
    assert engine.store(StoreOrder(1, ("a",), (), 0), {"a": blocks_of(0)}).result().ok
    gated = GatedPack()  # never opened: a DRAM-source write and a drop must not pack
    monkeypatch.setattr(packing_module, "pack_pages", gated)
    write_run, drop_run = engine.execute([WriteOrder(2, ("a",), (), 0, Tier.DRAM, "eviction"),
                                          DropOrder(3, ("a",), (), 0, Tier.DRAM)])
    assert write_run.released.is_set() and drop_run.released.is_set() and drop_run.completion is None
    assert write_run.completion.result().ok and gated.calls == 0
    assert engine.dram_object("a") is None and store.contains(object_key("a", "kv"))


def test_released_is_set_when_the_pack_fails(parts, monkeypatch):
    caches, gdn, engine, store, pool = parts
    gated = GatedPack(fail=True)
    gated.gate.set()
    monkeypatch.setattr(packing_module, "pack_pages", gated)
    runs = engine.execute([StoreOrder(1, ("a", "b"), (), 0), WriteOrder(2, ("a",), (), 0, Tier.GPU, "x")],
                          {c: blocks_of(i) for i, c in enumerate("ab")})
    for run in runs:
        done = run.completion.result()
        assert run.released.is_set() and not done.ok
    assert engine.dram_objects() == 0 and pool.free_slots == pool.num_slots


def test_released_is_set_when_the_order_dies_part_way(parts, monkeypatch):
    """And the failure path synchronizes the offload stream (the packs and copies queued there may
    still read the pages and write the slots) before it frees the slots: on CUDA, freeing first is
    a use after free. Here the CPU twin records the call."""
    caches, gdn, engine, store, pool = parts
    synced = []
    monkeypatch.setattr(engine._packer.streams, "synchronize", synced.append)

    def broken(*args):
        raise RuntimeError("device lost (injected)")

    monkeypatch.setattr(engine._packer, "packed_on_device", broken)
    run, = engine.execute([StoreOrder(1, ("a",), (), 0)], {"a": blocks_of(0)})
    with pytest.raises(RuntimeError, match="device lost"):
        run.completion.result()
    assert run.released.is_set() and pool.free_slots == pool.num_slots
    assert synced == ["offload"]


def test_queued_orders_are_released_by_close(tmp_path, monkeypatch):
    caches = vllm_layers(NB, 4, 2, 8, torch.bfloat16, layers=2, seed=3)
    with HostPool(16 * SLOT, SLOT) as pool:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES)
        gated = GatedPack()
        monkeypatch.setattr(packing_module, "pack_pages", gated)
        runs = engine.execute([StoreOrder(i, (f"c{i}",), (), 0) for i in range(3)],
                              {f"c{i}": blocks_of(i) for i in range(3)})
        assert gated.entered.wait(30)
        gated.gate.set()
        engine.close()  # drains the queue
        assert all(r.released.is_set() and r.completion.done() for r in runs)


def test_a_bad_order_raises_before_it_starts_and_earlier_ones_run(parts):
    caches, gdn, engine, store, pool = parts
    good = StoreOrder(1, ("a",), (), 0)
    for bad, blocks, match in [
        (StoreOrder(2, ("b",), (), 0), {"a": blocks_of(0)}, "no block ids"),
        (StoreOrder(2, ("b",), (), 0), {"a": blocks_of(0), "b": [1, 2, 3]}, "needs 2 block ids"),
        (StoreOrder(2, ("b",), (), 0), {"a": blocks_of(0), "b": [1, NB]}, "outside"),
        (StoreOrder(2, ("b",), (), 0), {"a": blocks_of(0), "b": ["x", "y"]}, "not integers"),
        (WriteOrder(2, ("b",), (), 0, Tier.SSD, "x"), {"a": blocks_of(0)}, "expected DRAM or GPU"),
        (DropOrder(2, ("b",), (), 0, Tier.GPU), {"a": blocks_of(0)}, "expected DRAM or SSD"),
        ("not an order", {"a": blocks_of(0)}, "unknown order type"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.execute([good, bad], blocks)
    engine._packer.pool.submit(lambda: None).result()  # the good orders ran
    assert engine.dram_object("a") is not None and engine.dram_object("b") is None


def test_capture_state_is_the_packed_state_and_stores_as_prepacked(parts):
    caches, gdn, engine, store, pool = parts
    expected = pack_pages(gdn, torch.tensor([7]))
    snapshot = engine.capture_state(7)
    assert snapshot.dtype == torch.uint8 and snapshot.numel() == engine.state_bytes
    assert torch.equal(snapshot, expected)
    gdn[0][7].fill_(3)  # the engine's next step overwrites the state page
    runs = engine.execute([StoreOrder(1, (), ("s",), 0), WriteOrder(2, (), ("s",), 0, Tier.GPU, "write-through")],
                          prepacked={ObjectKey("s", "state"): snapshot})
    assert all(r.completion.result().ok for r in runs)
    stored = engine.dram_object("s", "state")
    assert torch.equal(pool.views(stored.slots, stored.nbytes)[0], expected.cpu())  # host slots vs device
    out = torch.empty(engine.state_bytes, dtype=torch.uint8)
    store.read(object_key("s", "state"), out).result()
    assert torch.equal(out, expected.cpu())
    assert torch.equal(engine.capture_state([7]), pack_pages(gdn, torch.tensor([7])))
    with pytest.raises(ValueError, match="needs 1 block ids"):
        engine.capture_state([1, 2])
    with pytest.raises(ValueError, match="outside"):
        engine.capture_state(NB)


def test_capture_state_without_a_state_table_is_refused(tmp_path):
    caches = vllm_layers(NB, 4, 2, 8, torch.bfloat16, layers=2, seed=3)
    with HostPool(4 * SLOT, SLOT) as pool:
        engine = TransferEngine(PageTable(caches), host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                                pages_per_chunk=PAGES)
        with pytest.raises(ValueError, match="state_table"):
            engine.capture_state(0)
        engine.close()


# --- the contract: Order.keys(), split_keys, the DataPlane protocol, the dispatch table ------------

from hypothesis import given, strategies as st  # noqa: E402

from saria.orders import DataPlane, split_keys  # noqa: E402

chunk_lists = st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=6, unique=True)


@given(chunk_lists, chunk_lists)
def test_order_keys_and_split_keys_are_inverse(kv, state):
    order = WriteOrder(1, tuple(kv), tuple(state), 0, Tier.DRAM, "eviction")
    keys = order.keys()
    assert keys == [ObjectKey(c, "kv") for c in kv] + [ObjectKey(c, "state") for c in state]
    assert split_keys(keys) == (tuple(kv), tuple(state))


def test_the_transfer_engine_is_a_data_plane(parts):
    _, _, engine, _, _ = parts
    assert isinstance(engine, DataPlane)
    assert not isinstance(object(), DataPlane)


def test_every_order_type_and_source_has_one_run(parts):
    """An order type the table does not know is refused; a source its run cannot serve is refused by
    that run, with its own message, before anything started."""
    _, _, engine, _, pool = parts

    class Unknown(StoreOrder):
        pass

    with pytest.raises(ValueError, match="unknown order type Unknown"):
        engine.execute([Unknown(1, ("a",), (), 0)], {"a": blocks_of(0)})
    with pytest.raises(ValueError, match="copies from HBM"):
        engine.execute([PromoteOrder(2, ("a",), (), 0, Tier.DRAM)], {"a": blocks_of(0)})
    with pytest.raises(ValueError, match="expected DRAM or GPU"):
        engine.execute([WriteOrder(3, ("a",), (), 0, Tier.SSD, "eviction")], {"a": blocks_of(0)})
    with pytest.raises(ValueError, match="expected DRAM or SSD"):
        engine.execute([DropOrder(4, ("a",), (), 0, Tier.GPU)])
    assert pool.free_slots == pool.num_slots
