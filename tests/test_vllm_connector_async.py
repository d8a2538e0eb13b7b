"""Stores that never stall a step, without an engine: the scheduler half holds a finished request's
blocks while its orders read them and tells the worker (``held``); the worker reports it sent only
once no order reads them, waits for them when vLLM preempts the request, and lets go of everything
when it turns off. Hits count what loads delivered. Real control plane, real data plane (host
pool, SSD store in a temp dir); vLLM's objects as the stand-ins of ``test_vllm_connector_faults``.
A store is held in flight by gating the pack kernel the transfer engine calls on its offload
thread."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

import saria.dataplane.transfer.packing as packing_module
from saria.kernels import pack_pages
from saria.control import ObjectKey, StoreOrder, Tier, WriteOrder
from saria.integrations.vllm.faults import Faults
from saria.integrations.vllm.guard import SchedulerGuard
from saria.integrations.vllm.metadata import (CompletionReport, LoadReport, RequestOrders, SariaConnectorMetadata,
                                              SariaWorkerMetadata)
from saria.integrations.vllm.scheduler import SariaScheduler

from test_vllm_connector_faults import (BLOCK, CHUNK, GEOMETRY, KV_BYTES_PER_TOKEN, Clock, Engine, blocks_of,
                                        completions, dense_worker, settings)

SIZE = CHUNK * KV_BYTES_PER_TOKEN


@pytest.fixture
def engine():
    guard = SchedulerGuard(lambda: SariaScheduler(settings(), GEOMETRY), faults=Faults("scheduler", clock=Clock()))
    return Engine(guard)


def output(finished_sending=(), **report):
    return types.SimpleNamespace(finished_sending=set(finished_sending),
                                 kv_connector_worker_meta=SariaWorkerMetadata(**report) if report else None)


# --- the scheduler half ------------------------------------------------------------------------------

def test_a_finished_request_whose_stores_read_its_blocks_is_held_until_the_worker_sends_it(engine):
    r1 = engine.request("r1", 2)
    engine.guard.get_num_new_matched_tokens(r1, 0)
    (batch,) = engine.step(r1).orders
    assert any(isinstance(o, StoreOrder) for o in batch.orders)
    assert engine.guard.request_finished(r1, []) == (True, None)
    assert engine.guard.has_pending_work()  # vLLM must step to hear that the blocks are free
    assert engine.guard.holds_blocks()  # a request short of blocks waits for these, preempting nobody
    meta = engine.step()
    assert meta.held == ["r1"]
    assert engine.step().held == []  # told once
    engine.guard.update_connector_output(output(completions=[CompletionReport(o.order_id, True)
                                                             for o in batch.orders]))
    assert engine.guard.has_pending_work()  # the orders completed, but vLLM still holds the blocks
    engine.guard.update_connector_output(output(finished_sending={"r1"}))
    assert not engine.guard.has_pending_work() and not engine.guard.holds_blocks()


def test_a_request_without_orders_that_read_its_blocks_is_freed_at_once(engine):
    engine.cache("r1", 2)  # stored: a second request with the same prompt has nothing new to store
    r2 = engine.request("r2", 2)
    assert engine.guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(5)), 2 * CHUNK)
    (load,) = engine.step().loads
    engine.report(0, loads=[LoadReport("r2", load.plan.plan_id, (), load.plan.num_chunks)])
    batches = [b for b in engine.step(r2).orders if b.req_id == "r2"]
    assert not any(isinstance(o, (StoreOrder, WriteOrder)) for b in batches for o in b.orders)
    assert engine.guard.request_finished(r2, []) == (False, None)
    # Aborted before its commit: nothing read its blocks either.
    r3 = engine.request("r3", 2, prefix="other")
    engine.guard.get_num_new_matched_tokens(r3, 0)
    assert engine.guard.request_finished(r3, []) == (False, None)
    assert engine.step().held == []


def test_held_requests_reach_the_worker_even_after_a_fault_or_turning_off(engine, monkeypatch):
    r1 = engine.request("r1", 2)
    engine.guard.get_num_new_matched_tokens(r1, 0)
    engine.step(r1)
    assert engine.guard.request_finished(r1, []) == (True, None)
    monkeypatch.setattr(engine.guard.inner, "build_connector_meta", lambda out: 1 / 0)
    meta = engine.step()
    assert meta.epoch == 1 and meta.held == ["r1"]  # the new control plane never knew r1: still sent
    engine.report(1, off=True)
    assert engine.guard.off and engine.guard.has_pending_work()  # off, but vLLM holds r1's blocks for saria
    engine.guard.update_connector_output(output(finished_sending={"r1"}))
    assert not engine.guard.has_pending_work()


def test_preempted_requests_are_named_in_the_metadata(engine):
    out = types.SimpleNamespace(num_scheduled_tokens={}, scheduled_new_reqs=[], preempted_req_ids={"b", "a"},
                                scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                            resumed_req_ids=set(),
                                                                            num_computed_tokens=[]))
    assert engine.guard.build_connector_meta(out).preempted == ["a", "b"]


def test_hits_count_only_the_tokens_a_load_delivered(engine):
    engine.cache("r1", 3)
    totals = engine.guard.totals()
    assert (totals["hit_tokens_dram"], totals["loads"]) == (0, 0)
    # vLLM holds the first chunk and a block of the second: saria loads the rest of the plan.
    r2 = engine.request("r2", 3)
    assert engine.guard.get_num_new_matched_tokens(r2, CHUNK + BLOCK) == (3 * CHUNK - CHUNK - BLOCK, True)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 3 * CHUNK - CHUNK - BLOCK)
    (load,) = engine.step().loads
    engine.report(0, loads=[LoadReport("r2", load.plan.plan_id, (), load.plan.num_chunks)])
    assert engine.guard.totals()["hit_tokens_dram"] == 2 * CHUNK - BLOCK
    assert engine.guard.hit_sources(r2, 3 * CHUNK - CHUNK - BLOCK) == {"dram": 2 * CHUNK - BLOCK}
    # A load that failed from its second chunk on delivered its first chunk only (dense models).
    r3 = engine.request("r3", 3)
    engine.guard.get_num_new_matched_tokens(r3, 0)
    engine.guard.update_state_after_alloc(r3, blocks_of(engine.blocks(7)), 3 * CHUNK)
    (load,) = engine.step().loads
    lost = ObjectKey(load.plan.chunk_hashes[1], "kv")
    engine.report(0, loads=[LoadReport("r3", load.plan.plan_id, (lost,), 1)])  # a DRAM loss: a rebuild follows
    totals = engine.guard.totals()
    assert totals["hit_tokens_dram"] == 2 * CHUNK - BLOCK + CHUNK and totals["loads_failed"] == 1
    assert totals["loads"] == 2 and engine.guard.epoch == 1  # monotonic over the rebuild


def test_a_load_of_the_chunks_vllm_lacks_carries_their_totals_not_the_plans(engine):
    """vLLM holds the plan's first chunk and a block of the second: the load names the plan's
    chunks from the second on, and its tokens and bytes are theirs, not the whole plan's."""
    engine.cache("r1", 3)
    r2 = engine.request("r2", 3)  # chunk i's hash is the block hash b"b{2i+1}"
    assert engine.guard.get_num_new_matched_tokens(r2, CHUNK + BLOCK) == (2 * CHUNK - BLOCK, True)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 2 * CHUNK - BLOCK)
    (load,) = engine.step().loads
    assert load.skip_pages == 1 and len(load.kv_blocks) == 2
    assert load.plan.chunk_hashes == (b"b3", b"b5") and load.plan.kv_sources == (Tier.DRAM, Tier.DRAM)
    assert (load.plan.tokens, load.plan.dram_bytes, load.plan.ssd_bytes) == (2 * CHUNK, 2 * SIZE, 0)


# --- the worker half ----------------------------------------------------------------------------------

@pytest.fixture
def gate(monkeypatch):
    """Packs on the engine's offload thread wait until the gate opens (a store in flight)."""
    opened = threading.Event()
    original = packing_module.pack_pages
    caller = threading.get_ident()

    def pack_pages(*args, **kwargs):
        if threading.get_ident() != caller:
            assert opened.wait(30), "the test never opened the gate"
        return original(*args, **kwargs)

    monkeypatch.setattr(packing_module, "pack_pages", pack_pages)
    yield opened
    opened.set()


def store(worker, req_id="r1", order_id=1, chunk="h0", blocks=(2, 3), write_from_gpu=False):
    order = (WriteOrder(order_id, (chunk,), (), SIZE, Tier.GPU, "write-through") if write_from_gpu
             else StoreOrder(order_id, (chunk,), (), SIZE))
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders(req_id, (order,), {chunk: blocks})]))


@pytest.mark.parametrize("write_from_gpu", [False, True])
def test_wait_for_save_returns_at_once_and_a_held_request_is_sent_once_its_blocks_are_free(tmp_path, gate,
                                                                                          write_from_gpu):
    worker = dense_worker(tmp_path)
    store(worker, write_from_gpu=write_from_gpu)  # returns with the pack still waiting at the gate
    # The step after r1 finished: its metadata says vLLM holds r1's blocks, then vLLM asks what ended.
    worker.start_load_kv(SariaConnectorMetadata(held=["r1"]))
    assert worker.get_finished({"r1"}) == (set(), set())
    for _ in range(3):
        assert worker.get_finished(set()) == (set(), set())
    gate.set()
    deadline = time.monotonic() + 30
    sent: set[str] = set()
    while not sent and time.monotonic() < deadline:
        sent, _ = worker.get_finished(set())
    assert sent == {"r1"}
    assert [c.ok for c in completions(worker, 1)] == [True]
    assert worker.get_finished(set()) == (set(), set())  # reported once
    worker.shutdown()


def test_the_stored_object_is_the_blocks_byte_for_byte(tmp_path, gate):
    worker = dense_worker(tmp_path)
    expected = pack_pages(worker.engine.kv_table, torch.tensor([2, 3]))
    store(worker)
    gate.set()
    assert [c.ok for c in completions(worker, 1)] == [True]
    obj = worker.engine.dram_object("h0")
    got = torch.cat([v.reshape(-1) for v in worker.data.host_pool.views(obj.slots, obj.nbytes)])
    assert torch.equal(got[:expected.numel()], expected)
    worker.shutdown()


def test_preemption_waits_until_no_order_reads_the_blocks(tmp_path, gate):
    worker = dense_worker(tmp_path)
    store(worker)
    waited = threading.Event()

    def preempt():
        worker.handle_preemptions(SariaConnectorMetadata(preempted=["r1"]))
        waited.set()

    thread = threading.Thread(target=preempt)
    thread.start()
    assert not waited.wait(0.3)  # vLLM's next forward may not write r1's blocks yet
    gate.set()
    assert waited.wait(30)
    thread.join()
    assert worker.snapshot()["connector"]["preemption_waits"] == 1
    assert worker.engine.dram_object("h0") is not None or completions(worker, 1)
    worker.shutdown()


def test_a_worker_that_turns_off_sends_every_held_request(tmp_path, gate):
    worker = dense_worker(tmp_path)
    store(worker)
    worker.start_load_kv(SariaConnectorMetadata(held=["r1", "r2"]))  # r2: its orders never reached this rank
    gate.set()  # closing the data plane waits for the store
    worker.start_load_kv(SariaConnectorMetadata(off=True))
    assert worker.off and worker.get_finished(set()) == ({"r1", "r2"}, set())


def test_a_request_freed_at_once_leaves_nothing_behind(tmp_path, gate):
    worker = dense_worker(tmp_path)
    store(worker)
    worker.get_finished({"r1"})  # finished, not held (the scheduler faulted: its new epoch drops the objects)
    assert worker._reading == {}
    gate.set()
    worker.shutdown()
