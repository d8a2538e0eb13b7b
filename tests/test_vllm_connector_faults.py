"""The connector's fault handling without an engine: the fault counter's policy, the scheduler
half behind its guard (rebuilds, epochs, cancels, turning off), the worker half failing only what
a fault touched, and at a new epoch dropping what the new control plane cannot vouch for while the
SSD tier survives. Real control plane, real data plane (host
pool, SSD store in a temp dir), vLLM's objects as plain stand-ins carrying the fields saria reads.
Faults are injected by making one method raise; a property test injects them in random hooks of
random requests over both halves wired together (``Rig``)."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import types
import zlib
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, given, settings as settings_, strategies as st

from saria.control import ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane.ssd.keys import object_key
from saria.integrations.vllm.faults import Faults
from saria.integrations.vllm.guard import SchedulerGuard
from saria.integrations.vllm.geometry import EngineGeometry
from saria.integrations.vllm.metadata import (CompletionReport, LoadReport, LoadSpec, RequestOrders,
                                              SariaConnectorMetadata, SariaWorkerMetadata)
from saria.integrations.vllm.scheduler import SariaScheduler
from saria.integrations.vllm.settings import ConnectorSettings
from saria.integrations.vllm.worker import SariaWorker

BLOCK = 32
CHUNK = 64  # two blocks
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2  # one layer: K and V, 2 heads, head dim 64, bf16
GEOMETRY = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=("l0",),
                          kv_bytes_per_token=KV_BYTES_PER_TOKEN)


def settings(tmp_path=None, **extra):
    options = {"chunk_tokens": CHUNK, "dram_bytes": 8 * CHUNK * KV_BYTES_PER_TOKEN, "log_interval_s": 0}
    if tmp_path is not None:
        options.update(ssd_paths=[str(tmp_path)], ssd_bytes=8 << 20)
    return ConnectorSettings.from_extra_config(dict(options, **extra))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# --- the fault counter -----------------------------------------------------------------------------

def test_first_fault_of_a_kind_logs_its_traceback_later_ones_one_line(caplog):
    faults = Faults("scheduler", clock=Clock())
    with caplog.at_level(logging.WARNING, logger="saria.vllm"):
        for _ in range(2):
            try:
                raise KeyError("chunk 7")
            except KeyError as exc:
                faults.record("build_connector_meta", exc)
        faults.record("request_finished", ValueError("x"))
    first, again, other = caplog.records

    def traceback_of(record) -> str:  # once a connector started in this process, its logger's
        # redaction filter (logs.Redact) has turned exc_info into redacted exc_text
        return record.exc_text or (logging.Formatter().formatException(record.exc_info) if record.exc_info else "")

    assert "KeyError: 'chunk 7'" in traceback_of(first) and "build_connector_meta" in first.getMessage()
    assert traceback_of(again) == "" and "again" in again.getMessage()
    assert "ValueError: x" in traceback_of(other)  # another kind: its own traceback
    assert faults.count == 3 and faults.by_where == {"build_connector_meta": 2, "request_finished": 1}


def test_three_faults_within_the_window_say_turn_off_spread_out_they_do_not():
    clock = Clock()
    faults = Faults("worker", limit=3, window_s=300, clock=clock)
    assert not faults.record("load", RuntimeError())
    clock.now = 200
    assert not faults.record("load", RuntimeError())
    clock.now = 550  # both earlier ones have left the window
    assert not faults.record("load", RuntimeError())
    clock.now = 560
    assert not faults.record("load", RuntimeError())
    clock.now = 600
    assert faults.record("load", RuntimeError())  # 550, 560, 600


# --- the scheduler half ----------------------------------------------------------------------------

class Engine:
    """What vLLM's scheduler hands the connector: requests with block hashes, and per-step outputs
    scheduling a request's whole prompt at once."""

    def __init__(self, guard: SchedulerGuard):
        self.guard = guard
        self.next_block = 1

    @staticmethod
    def request(req_id: str, chunks: int, prefix: str = "b"):
        """A prompt of ``chunks`` chunks and one block more; requests of one ``prefix`` share it."""
        hashes = [f"{prefix}{i}".encode() for i in range(chunks * CHUNK // BLOCK + 1)]
        return types.SimpleNamespace(request_id=req_id, block_hashes=hashes, num_prompt_tokens=len(hashes) * BLOCK)

    def blocks(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(self, *requests) -> SariaConnectorMetadata:
        """Schedule each request's whole prompt (its blocks new) and build the step's metadata."""
        new = [types.SimpleNamespace(req_id=r.request_id, block_ids=(self.blocks(len(r.block_hashes)),),
                                     num_computed_tokens=0) for r in requests]
        out = types.SimpleNamespace(
            num_scheduled_tokens={r.request_id: r.num_prompt_tokens for r in requests}, scheduled_new_reqs=new,
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                        num_computed_tokens=[]),
            preempted_req_ids=set())
        return self.guard.build_connector_meta(out)

    def report(self, epoch=0, loads=(), completions=(), off=False):
        self.guard.update_connector_output(types.SimpleNamespace(
            kv_connector_worker_meta=SariaWorkerMetadata(list(loads), list(completions), epoch, off)))

    def cache(self, req_id: str, chunks: int) -> None:
        """Run a request through so its chunks end up in saria's DRAM tier."""
        request = self.request(req_id, chunks)
        assert self.guard.get_num_new_matched_tokens(request, 0) == (0, False)
        meta = self.step(request)
        (batch,) = meta.orders
        self.report(meta.epoch, completions=[CompletionReport(o.order_id, True) for o in batch.orders])
        self.guard.request_finished(request, [])


def blocks_of(ids):
    return types.SimpleNamespace(get_block_ids=lambda: (list(ids),))


@pytest.fixture
def engine():
    guard = SchedulerGuard(lambda: SariaScheduler(settings(), GEOMETRY), faults=Faults("scheduler", clock=Clock()))
    return Engine(guard)


def test_a_lookup_fault_is_a_miss_and_rebuilds_the_control_plane(engine, monkeypatch):
    engine.cache("r1", 2)
    old = engine.guard.inner
    monkeypatch.setattr(old.control, "plan", lambda *a, **k: 1 / 0)
    assert engine.guard.get_num_new_matched_tokens(engine.request("r2", 2), 0) == (0, False)
    assert engine.guard.inner is not old and engine.guard.epoch == 1
    assert engine.guard.stats() == {"faults": 1, "by_where": {"get_num_new_matched_tokens": 1}, "epoch": 1,
                                    "off": False}
    meta = engine.step()
    assert meta.epoch == 1 and not meta.off and not meta.loads and not meta.cancels
    # The fresh control plane knows nothing: the next lookup is a miss, without a fault.
    assert engine.guard.get_num_new_matched_tokens(engine.request("r3", 2), 0) == (0, False)


def test_pins_and_sessions_outlive_a_fault_rebuild(tmp_path, monkeypatch):
    """The applications' cache hints are not the control plane's state but their intents: a plane
    rebuilt after a fault takes over the pins and sessions of the one it replaces."""
    clock = Clock()
    guard = SchedulerGuard(lambda: SariaScheduler(settings(tmp_path), GEOMETRY, clock=clock),
                           faults=Faults("scheduler", clock=clock))
    engine = Engine(guard)
    request = engine.request("r1", 2)
    request.kv_transfer_params = {"pin": True, "session": "s", "next_turn_s": 60}
    assert guard.get_num_new_matched_tokens(request, 0) == (0, False)
    meta = engine.step(request)
    (batch,) = meta.orders
    engine.report(meta.epoch, completions=[CompletionReport(o.order_id, True) for o in batch.orders])
    guard.request_finished(request, [])
    old = guard.inner
    pins, due = old.control.pins(None), old.control.next_hinted_prewarm()
    assert len(pins) == 2 and old.control.pinned_bytes(None) > 0 and due is not None
    monkeypatch.setattr(old.control, "plan", lambda *a, **k: 1 / 0)
    assert guard.get_num_new_matched_tokens(engine.request("r2", 2, "c"), 0) == (0, False)
    assert guard.inner is not old and guard.epoch == 1
    assert guard.inner.control.pins(None) == pins
    assert guard.inner.control.pinned_bytes(None) == old.control.pinned_bytes(None)
    assert guard.inner.control.next_hinted_prewarm() == due


def test_a_request_told_to_load_gets_a_cancel_when_a_fault_loses_its_load(engine, monkeypatch):
    """The dangerous window: vLLM waits for a load once ``update_state_after_alloc`` saw external
    tokens. A fault before the load reaches the metadata must not leave it waiting forever."""
    engine.cache("r1", 2)
    r2 = engine.request("r2", 3)
    assert engine.guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    monkeypatch.setattr(engine.guard.inner, "update_state_after_alloc", lambda *a: 1 / 0)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 2 * CHUNK)
    meta = engine.step()
    assert meta.cancels == ["r2"] and not meta.loads and meta.epoch == 1


def test_a_fault_while_building_the_metadata_cancels_the_loads_it_held(engine, monkeypatch):
    engine.cache("r1", 2)
    r2, r3 = engine.request("r2", 3), engine.request("r3", 1, prefix="other")
    assert engine.guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 2 * CHUNK)
    engine.guard.get_num_new_matched_tokens(r3, 0)
    monkeypatch.setattr(engine.guard.inner.control, "commit_prefill", lambda *a, **k: 1 / 0)  # r3's commit
    meta = engine.step(r3)
    assert meta.loads == [] and meta.orders == [] and meta.cancels == ["r2"] and meta.epoch == 1
    # Without a fault the load is sent, and nothing is cancelled.
    engine.cache("r4", 2)
    r5 = engine.request("r5", 3)
    engine.guard.get_num_new_matched_tokens(r5, 0)
    engine.guard.update_state_after_alloc(r5, blocks_of(engine.blocks(7)), 2 * CHUNK)
    meta = engine.step()
    assert [load.req_id for load in meta.loads] == ["r5"] and meta.cancels == []


def test_a_failed_dram_reload_means_the_planes_disagree_and_rebuilds(engine):
    engine.cache("r1", 2)
    r2 = engine.request("r2", 3)
    engine.guard.get_num_new_matched_tokens(r2, 0)
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 2 * CHUNK)
    (load,) = engine.step().loads
    lost = ObjectKey(load.plan.chunk_hashes[1], "kv")
    engine.report(0, loads=[LoadReport("r2", load.plan.plan_id, (lost,), 1)])
    assert engine.guard.epoch == 1 and engine.guard.faults.by_where == {"update_connector_output": 1}


def test_a_load_for_a_request_vllm_does_not_wait_for_is_never_sent(engine, monkeypatch):
    spec = LoadSpec("stranger", plan(1, ["h0"], Tier.DRAM), ((5, 6),))
    monkeypatch.setattr(engine.guard.inner, "build_connector_meta", lambda out: SariaConnectorMetadata(loads=[spec]))
    meta = engine.step()
    assert meta.loads == [] and meta.epoch == 1 and engine.guard.faults.count == 1


def test_reports_of_a_replaced_control_plane_are_ignored(engine, monkeypatch):
    r1 = engine.request("r1", 2)
    engine.guard.get_num_new_matched_tokens(r1, 0)
    (batch,) = engine.step(r1).orders
    monkeypatch.setattr(engine.guard.inner, "request_finished", lambda *a: 1 / 0)
    assert engine.guard.request_finished(r1, []) == (False, None)  # blocks freed at once
    assert engine.guard.epoch == 1
    # The completion of epoch 0's store would be an unknown order to the new control plane.
    engine.report(0, completions=[CompletionReport(o.order_id, True) for o in batch.orders])
    engine.report(0, loads=[LoadReport("r1", 99, (), 0)])
    assert engine.guard.faults.count == 1 and engine.guard.inner.control.audit() == []
    assert not engine.guard.has_pending_work()


def test_repeated_faults_turn_the_connector_off(engine, monkeypatch, caplog):
    broken = lambda *a, **k: 1 / 0  # noqa: E731
    monkeypatch.setattr(SariaScheduler, "get_num_new_matched_tokens", broken)
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        for i in range(3):
            assert engine.guard.get_num_new_matched_tokens(engine.request(f"r{i}", 1), 0) == (0, False)
    assert engine.guard.off and engine.guard.epoch == 2  # rebuilt twice, then off
    assert sum("turned off" in r.getMessage() for r in caplog.records) == 1
    # Off: misses, no orders, and a request vLLM still waits for gets its cancel.
    engine.guard.update_state_after_alloc(engine.request("r9", 1), blocks_of([1, 2, 3]), CHUNK)
    meta = engine.step(engine.request("r10", 1))
    assert meta.off and meta.cancels == ["r9"] and not meta.orders and not meta.loads
    assert not engine.guard.has_pending_work() and engine.guard.request_finished(engine.request("r9", 1), []) == (
        False, None)


def test_the_summary_line_counts_faults_and_rebuilds(caplog, monkeypatch):
    clock = Clock()
    guard = SchedulerGuard(lambda: SariaScheduler(settings(), GEOMETRY), log_interval_s=60, clock=clock)
    monkeypatch.setattr(guard.inner, "has_pending_work", lambda: 1 / 0)
    assert not guard.has_pending_work()
    clock.now = 61
    with caplog.at_level(logging.INFO, logger="saria.vllm"):
        Engine(guard).step()
    assert "faults 1 (control plane rebuilt 1x)" in caplog.records[-1].getMessage()


def test_a_prewarm_that_raises_is_a_fault_the_step_survives(tmp_path, monkeypatch):
    """Prewarming runs from the scheduler's own hooks with no request to blame: a control plane that
    raises while issuing a due prewarm (or while asked whether one is due) must cost a rebuild, never
    vLLM's step."""
    clock = Clock()
    guard = SchedulerGuard(lambda: SariaScheduler(settings(tmp_path, prewarm=True, prewarm_lead_s=0.0), GEOMETRY,
                                                  clock=clock), faults=Faults("scheduler", clock=clock), clock=clock)
    engine = Engine(guard)
    assert guard.inner.prewarm.enabled
    engine.cache("r1", 2)           # turn 1 ends at 0 s
    clock.now = 10.0
    r2 = engine.request("r2", 3)    # turn 2 continues it (its prompt holds turn 1's): a 10 s gap
    assert guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    guard.request_finished(r2, [])  # (aborted before it was scheduled: the turn still ends)
    assert guard.inner.prewarm.pending(20.0)  # turn 3 predicted at 20 s, prewarm due then
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("injected")

    monkeypatch.setattr(guard.inner.control, "prewarm", broken)
    clock.now = 20.0
    meta = engine.step()
    assert calls and meta.epoch == 1 and not meta.off and meta.orders == []
    assert guard.stats()["by_where"] == {"build_connector_meta": 1}
    assert guard.inner.control.audit() == [] and not guard.inner.prewarm.pending(1e9)  # rebuilt empty
    monkeypatch.setattr(guard.inner.prewarm, "pending", lambda now: 1 / 0)
    guard.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SariaWorkerMetadata(epoch=1),
                                                        finished_sending={"r1"}))  # r1's blocks are free
    assert guard.has_pending_work() is False and guard.epoch == 2
    assert guard.get_num_new_matched_tokens(engine.request("r3", 1), 0) == (0, False)


def test_the_worker_turning_off_turns_the_scheduler_off(engine):
    engine.report(0, off=True)
    assert engine.guard.off and engine.step().off


def test_reports_merge_across_workers_with_epoch_and_off():
    a = SariaWorkerMetadata([LoadReport("r", 1, (), 1)], [], epoch=1)
    b = SariaWorkerMetadata([LoadReport("r", 1, (), 1)], [], epoch=1, off=True)
    both = a.aggregate(b)
    assert both.off and both.epoch == 1 and both.loads[0].reports == 2
    stale = SariaWorkerMetadata([LoadReport("q", 1, (), 1)], [], epoch=0)
    assert a.aggregate(stale).loads == a.loads and stale.aggregate(a).epoch == 1


# --- the worker half -------------------------------------------------------------------------------

PAGES = torch.arange(16 * BLOCK * KV_BYTES_PER_TOKEN // 2, dtype=torch.int16).view(torch.bfloat16)


def dense_worker(tmp_path, ssd=True):
    """A worker on 16 blocks of distinct bf16 values (``PAGES``: each test's own copy, ``worker.pages``)."""
    worker = SariaWorker(settings(tmp_path if ssd else None), GEOMETRY, num_blocks=16)
    worker.pages = PAGES.clone()
    worker.register_kv_caches({"l0": worker.pages.view(16, 2, BLOCK, 2, 64)})
    assert worker.data is not None
    return worker


def plan(plan_id, chunks, tier):
    return ReloadPlan(plan_id, tuple(chunks), (tier,) * len(chunks), None, None, CHUNK * len(chunks), 0, 0, False)


def completions(worker, n):
    """The worker's next ``n`` order completions (stores run in the background)."""
    done = []
    deadline = time.monotonic() + 30
    while len(done) < n and time.monotonic() < deadline:
        report = worker.build_worker_meta()
        done += report.completions if report else []
        time.sleep(0.01)
    return done


SIZE = CHUNK * KV_BYTES_PER_TOKEN


def store_and_write(worker, chunk="h0", blocks=(2, 3)):
    """Store a chunk's pages in DRAM and, once stored (as the control plane orders it: an object
    is written from DRAM only once its store completed), write it to SSD, through the worker's hooks."""
    size = CHUNK * KV_BYTES_PER_TOKEN
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, (chunk,), (), size),),
                                                                   {chunk: blocks})]))
    assert [c.ok for c in completions(worker, 1)] == [True]
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders(None, (
        WriteOrder(2, (chunk,), (), size, Tier.DRAM, "eviction"),))]))
    assert [c.ok for c in completions(worker, 1)] == [True]


def test_a_load_that_raises_fails_its_request_alone(tmp_path, monkeypatch):
    worker = dense_worker(tmp_path)
    store_and_write(worker)
    original = worker.engine.load

    def load(p, *args, **kwargs):
        if p.plan_id == 2:
            raise RuntimeError("injected")
        return original(p, *args, **kwargs)

    monkeypatch.setattr(worker.engine, "load", load)
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("ok", plan(1, ["h0"], Tier.DRAM), ((5, 6),)),
                                                       LoadSpec("bad", plan(2, ["h0"], Tier.SSD), ((7, 8),))],
                                                cancels=["lost"]))
    assert worker.get_finished(set()) == (set(), {"ok", "bad", "lost"})
    assert worker.take_failed_requests() == {"bad", "lost"} and worker.take_error_blocks() == set()
    reports = {r.req_id: r for r in worker.build_worker_meta().loads}
    assert reports["ok"].failed == () and reports["bad"].failed == (ObjectKey("h0", "kv"),)
    assert worker.faults.count == 1 and not worker.off
    assert worker.stats_delta()["faults"] == 1 and "faults" not in worker.stats_delta()
    worker.shutdown()


def test_an_order_that_raises_reports_a_failed_completion(tmp_path, monkeypatch):
    worker = dense_worker(tmp_path)
    monkeypatch.setattr(worker.engine, "store", lambda *a, **k: 1 / 0)
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, ("h0",), (), 1),),
                                                                   {"h0": (2, 3)})]))
    assert worker.build_worker_meta().completions == [CompletionReport(1, False)]
    assert worker.faults.by_where == {"StoreOrder": 1} and not worker.off
    worker.shutdown()


def test_a_new_epoch_drops_dram_keeps_ssd_and_reports_the_inventory_again(tmp_path):
    """A fault says nothing about the SSD tier: at a new epoch the DRAM objects go (the new control
    plane knows none of them) but the SSD objects stay, offered to the new control plane in the
    rank's next report, and they reload bit for bit."""
    worker = dense_worker(tmp_path)
    assert worker.build_worker_meta().inventory == {}  # at start: an empty store
    store_and_write(worker, "h0", (2, 3))
    store_and_write(worker, "h1", (4, 5))
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r1", (StoreOrder(7, ("h2",), (), SIZE),),
                                                                   {"h2": (6, 7)})]))
    assert [c.ok for c in completions(worker, 1)] == [True]
    assert worker.engine.dram_objects() == 3 and len(worker.data.ssd.keys()) == 2
    worker.start_load_kv(SariaConnectorMetadata(epoch=1))
    assert worker.engine.dram_objects() == 0 and worker.data.host_pool.used_slots == 0
    assert sorted(worker.data.ssd.keys()) == sorted(object_key(h, "kv") for h in ("h0", "h1"))
    assert worker.epoch == 1 and not worker.off
    report = worker.build_worker_meta()
    assert report.epoch == 1 and report.inventory_reports == 1
    assert report.inventory == {ObjectKey("h0", "kv"): 1, ObjectKey("h1", "kv"): 1}
    assert worker.build_worker_meta() is None  # reported once per epoch
    # The SSD objects reload whole; nothing of the old epoch's DRAM tier can be read any more.
    blocks = worker.pages.view(16, -1)
    blocks[10:14].zero_()
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r", plan(3, ["h1"], Tier.SSD), ((10, 11),)),
                                                       LoadSpec("q", plan(4, ["h2"], Tier.DRAM), ((12, 13),))],
                                                epoch=1))
    assert worker.get_finished(set()) == (set(), {"r", "q"})
    reports = {r.req_id: r for r in worker.build_worker_meta().loads}
    assert reports["r"].failed == () and reports["q"].failed == (ObjectKey("h2", "kv"),)
    assert torch.equal(blocks[10:12].view(torch.int16), PAGES.view(16, -1)[4:6].view(torch.int16))
    assert not blocks[12:14].view(torch.int16).any()  # (bits compared: some of these bf16 values are NaN)
    worker.shutdown()


def test_a_new_epoch_deletes_the_ssd_objects_whose_write_had_not_ended(tmp_path, monkeypatch):
    """A write still in flight when the control plane was replaced: the worker waits for it, then
    deletes its object (the new control plane cannot vouch for it), and leaves it out of the
    inventory; objects written before stay."""
    worker = dense_worker(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r1", (StoreOrder(7, ("h1",), (), SIZE),),
                                                                   {"h1": (4, 5)})]))
    assert [c.ok for c in completions(worker, 1)] == [True]
    ssd, gate = worker.data.ssd, threading.Event()
    write = ssd.write

    def held_write(key, *args, **kwargs):  # the write starts once the gate opens
        out = Future()

        def run():
            gate.wait(30)
            done = write(key, *args, **kwargs)
            done.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else
                                   out.set_result(f.result()))
        threading.Thread(target=run, daemon=True).start()
        return out

    monkeypatch.setattr(ssd, "write", held_write)
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders(None, (
        WriteOrder(8, ("h1",), (), SIZE, Tier.DRAM, "eviction"),))]))
    threading.Timer(0.2, gate.set).start()  # it ends after the epoch changed, before the worker goes on
    worker.start_load_kv(SariaConnectorMetadata(epoch=1))
    assert gate.is_set() and ssd.keys() == [object_key("h0", "kv")]  # h1 committed, then deleted
    report = worker.build_worker_meta()
    assert report.inventory == {ObjectKey("h0", "kv"): 1} and report.completions == []  # the old epoch's: never sent
    assert not worker.off and worker.faults.count == 0
    worker.shutdown()


def test_the_ssd_tier_survives_faults_in_consecutive_steps_and_is_served_after(tmp_path, monkeypatch):
    """Both halves wired as vLLM wires them (the step's metadata to the worker, its report back):
    the scheduler half faults in two consecutive steps (two rebuilds, below the limit that turns
    saria off), the second before the worker's report of the first epoch came back (vLLM's async
    scheduling builds a step before the previous one's output). Then it heals: the control plane
    built last has taken over the SSD objects written before the faults, and a request sharing the
    prefix reloads them from SSD, bit for bit."""
    s = settings(tmp_path, policy="full-duplicate")  # every chunk stored to DRAM and written to SSD
    clock = Clock()
    guard = SchedulerGuard(lambda: SariaScheduler(s, GEOMETRY, recover=True, clock=clock),
                           faults=Faults("scheduler", clock=clock))
    worker = SariaWorker(s, GEOMETRY, num_blocks=16)
    kv = PAGES.clone().view(16, 2, BLOCK, 2, 64)
    worker.register_kv_caches({"l0": kv})
    engine = Engine(guard)

    def run(meta):
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        sent, _ = worker.get_finished(set())
        return types.SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta(), finished_sending=sent)

    def settle():
        for _ in range(200):
            guard.update_connector_output(run(engine.step()))
            if not guard.has_pending_work():
                return
            time.sleep(0.01)
        raise AssertionError("saria still has pending work")

    settle()  # the start-up inventory (empty)
    r1 = engine.request("r1", 2)
    assert guard.get_num_new_matched_tokens(r1, 0) == (0, False)
    guard.update_connector_output(run(engine.step(r1)))  # r1's chunks: stored and written through
    guard.request_finished(r1, [])
    settle()
    assert len(worker.data.ssd.keys()) == 2 and worker.engine.dram_objects() == 2
    written = {h: kv[1 + 2 * i:3 + 2 * i].view(torch.int16).clone() for i, h in enumerate(("b1", "b3"))}

    build = SariaScheduler.build_connector_meta
    monkeypatch.setattr(SariaScheduler, "build_connector_meta", lambda self, out: 1 / 0)
    first = run(engine.step())  # epoch 1: the worker drops DRAM, keeps SSD, reports its inventory...
    second = run(engine.step())  # ...which comes back only after the next step faulted too (epoch 2)
    guard.update_connector_output(first)
    guard.update_connector_output(second)
    assert guard.epoch == 2 and not guard.off and worker.epoch == 2 and guard.faults.count == 2
    assert first.kv_connector_worker_meta.inventory == second.kv_connector_worker_meta.inventory == {
        ObjectKey(b"b1", "kv"): 1, ObjectKey(b"b3", "kv"): 1}
    assert worker.engine.dram_objects() == 0 and len(worker.data.ssd.keys()) == 2
    monkeypatch.setattr(SariaScheduler, "build_connector_meta", build)  # healed

    r2 = engine.request("r2", 3)
    assert guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    assert guard.hit_sources(r2, 2 * CHUNK) == {"ssd": 2 * CHUNK}
    target = [9, 10, 11, 12, 13, 14, 15]
    kv[9:13].zero_()
    guard.update_state_after_alloc(r2, blocks_of(target), 2 * CHUNK)
    meta = engine.step()
    (load,) = meta.loads
    assert load.plan.kv_sources == (Tier.SSD, Tier.SSD)
    guard.update_connector_output(run(meta))
    assert guard.totals()["hit_tokens_ssd"] == 2 * CHUNK
    bits = kv.view(torch.int16)  # some of these bf16 values are NaN: compare bits
    assert torch.equal(bits[9:11], written["b1"]) and torch.equal(bits[11:13], written["b3"])
    worker.shutdown()


def test_a_control_plane_built_on_a_reset_waits_for_no_inventory(tmp_path, monkeypatch):
    """Every control plane is built to take over the ranks' SSD objects (one rebuilt after a fault
    waits for their inventories of its epoch), but on a reset (the weights may have changed) every
    rank deletes its SSD objects: that one waits for nothing, so a paused vLLM, which steps no more,
    sees no pending work (``release_kv_cache_memory`` requires none)."""
    clock = Clock()
    guard = SchedulerGuard(lambda: SariaScheduler(settings(tmp_path), GEOMETRY, recover=True, clock=clock),
                           faults=Faults("scheduler", clock=clock))
    start = SariaWorkerMetadata(inventory={}, inventory_reports=1)
    guard.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=start))
    assert not guard.has_pending_work()
    guard.reset()
    assert guard.epoch == 1 and not guard.has_pending_work()
    assert guard.get_num_new_matched_tokens(Engine.request("r1", 2), 0) == (0, False)
    monkeypatch.setattr(guard.inner, "build_connector_meta", lambda out: 1 / 0)
    assert Engine(guard).step().epoch == 2  # a fault: the rebuilt one waits for the ranks' inventories
    assert guard.has_pending_work() and guard.get_num_new_matched_tokens(Engine.request("r2", 2), 0) == (None, False)


FAULT_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished")
FAULT_EXAMPLES = int(os.environ.get("SARIA_FAULT_EXAMPLES", "8"))  # SARIA_FAULT_EXAMPLES=200: a longer hunt


def computed_pages(chunk: bytes) -> torch.Tensor:
    """What vLLM computes for ``chunk``: its two blocks' bytes (int16), a function of the chunk alone."""
    generator = torch.Generator().manual_seed(zlib.crc32(chunk))
    return torch.randint(-30000, 30000, (2, BLOCK * KV_BYTES_PER_TOKEN // 2), generator=generator, dtype=torch.int16)


class Rig:
    """The two halves wired as vLLM wires them, one request at a time on blocks 1..7: the step's
    metadata to the worker, its report back (``lag``: one step late, as under vLLM's async
    scheduling); every chunk's pages are :func:`computed_pages`."""

    def __init__(self, root, lag: bool):
        s = settings(root, policy="full-duplicate", durable=False)  # every chunk stored to DRAM and written to SSD
        self.clock = Clock()
        self.guard = SchedulerGuard(lambda: SariaScheduler(s, GEOMETRY, recover=True, clock=self.clock),
                                    faults=Faults("scheduler", clock=self.clock))
        self.worker = SariaWorker(s, GEOMETRY, num_blocks=16)
        self.kv = torch.zeros(16, 2, BLOCK, 2, 64, dtype=torch.bfloat16)
        self.bits = self.kv.view(16, -1).view(torch.int16)
        self.worker.register_kv_caches({"l0": self.kv})
        self.lag, self.late = lag, None
        self.served = 0  # chunks whose reload was checked

    def step(self, new=(), scheduled=None):
        out = types.SimpleNamespace(
            num_scheduled_tokens=scheduled or {}, scheduled_new_reqs=list(new),
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                        num_computed_tokens=[]), preempted_req_ids=set())
        meta = self.guard.build_connector_meta(out)
        worker = self.worker
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        sent, loaded = worker.get_finished(set())
        failed = worker.take_failed_requests()
        report = types.SimpleNamespace(kv_connector_worker_meta=worker.build_worker_meta(), finished_sending=sent)
        for spec in meta.loads:  # what a load delivered is what vLLM computed
            if spec.req_id in loaded and spec.req_id not in failed:
                for chunk, blocks in zip(spec.plan.chunk_hashes, spec.kv_blocks):
                    assert torch.equal(self.bits[list(blocks)], computed_pages(chunk))
                    self.served += 1
        report, self.late = (self.late, report) if self.lag else (report, None)
        if report is not None:
            self.guard.update_connector_output(report)
        return loaded, failed

    def settle(self):
        for _ in range(300):
            self.step()
            if self.late is not None and not self.guard.has_pending_work():  # the last report, late
                late, self.late = self.late, None
                self.guard.update_connector_output(late)
            if self.late is None and not self.guard.has_pending_work():
                return
            time.sleep(0.005)
        raise AssertionError("saria still has pending work")

    def lookup(self, request):
        for _ in range(50):  # "not yet": a rebuilt control plane awaits the ranks' inventories
            tokens, asynchronous = self.guard.get_num_new_matched_tokens(request, 0)
            if tokens is not None:
                return tokens
            self.step()
        raise AssertionError("the lookup never got an answer")

    def run(self, request) -> int:
        """One request through vLLM's hooks: lookup, load, compute, commit, finish. Its tokens loaded."""
        tokens = self.lookup(request)
        ids = list(range(1, len(request.block_hashes) + 1))
        self.bits[ids] = 0
        self.guard.update_state_after_alloc(request, blocks_of(ids), tokens)
        if tokens:
            for _ in range(50):
                loaded, failed = self.step()
                if request.request_id in loaded:
                    break
            else:
                raise AssertionError("the load never finished")
            tokens = 0 if request.request_id in failed else tokens  # vLLM recomputes a failed load
        for i in range(len(request.block_hashes) // 2):  # the forward: every chunk's pages
            self.bits[ids[2 * i:2 * i + 2]] = computed_pages(request.block_hashes[2 * i + 1])
        new = types.SimpleNamespace(req_id=request.request_id, block_ids=(ids,), num_computed_tokens=tokens)
        self.step([new], {request.request_id: request.num_prompt_tokens - tokens})
        self.guard.request_finished(request, ids)
        self.settle()
        return tokens

    def on_ssd(self) -> set:
        return set(self.worker.data.ssd.keys())


@settings_(max_examples=FAULT_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 3)), min_size=2, max_size=6),
       faults=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(FAULT_HOOKS)), max_size=2), lag=st.booleans())
def test_faults_anywhere_never_shrink_the_ssd_tier_and_it_stays_served(requests, faults, lag):
    """Random requests over two prefixes, with up to two scheduler faults in random hooks of random
    requests (fewer than turn saria off), reports on time or a step late. Every reload delivers the
    pages vLLM computed; the SSD objects written before a fault survive it (a fault drops nothing
    but the writes in flight, and between requests none is); and in the end every SSD object is
    served: a request over each prefix reloads the leading chunks the SSD store holds, whole."""
    with tempfile.TemporaryDirectory() as root:
        rig = Rig(root, lag)
        rig.settle()  # the start-up inventory
        armed = {}
        originals = {hook: getattr(SariaScheduler, hook) for hook in FAULT_HOOKS}

        def one_shot(hook):
            def method(self, *args, **kwargs):
                if armed.pop(hook, False):
                    raise RuntimeError(f"injected fault in {hook}")
                return originals[hook](self, *args, **kwargs)
            return method

        try:
            for hook in FAULT_HOOKS:
                setattr(SariaScheduler, hook, one_shot(hook))
            for i, (prefix, chunks) in enumerate(requests):
                before = rig.on_ssd()
                armed.update({hook: True for at, hook in faults if at == i})
                rig.run(Engine.request(f"r{i}", chunks, prefix))
                armed.clear()
                assert rig.on_ssd() >= before  # nothing the SSD tier held is gone
        finally:
            for hook, method in originals.items():
                setattr(SariaScheduler, hook, method)
        assert not rig.guard.off and rig.guard.epoch == rig.guard.faults.count <= 2
        on_ssd = rig.on_ssd()
        for prefix in "ab":  # heal: each prefix's chunks on SSD are served
            request = Engine.request(f"last-{prefix}", 3, prefix)
            hashes = [request.block_hashes[2 * c + 1] for c in range(3)]
            leading = next((c for c, h in enumerate(hashes) if object_key(h, "kv") not in on_ssd), 3)
            served = rig.served
            assert rig.run(request) == leading * CHUNK
            assert rig.served == served + leading
        rig.worker.shutdown()


def test_a_worker_whose_data_plane_cannot_open_is_off_and_answers_everything(tmp_path, monkeypatch, caplog):
    import saria.integrations.vllm.worker_start as worker_start

    monkeypatch.setattr(worker_start, "open_data_plane", lambda *a, **k: 1 / 0)
    worker = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16)
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        worker.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 2, 64, dtype=torch.bfloat16)})
    assert worker.off and worker.data is None
    assert any("turned off" in r.getMessage() for r in caplog.records)
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),))],
                                  orders=[RequestOrders("q", (StoreOrder(4, ("h1",), (), 1),), {"h1": (2, 3)})])
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.get_finished(set()) == (set(), {"r"}) and worker.take_failed_requests() == {"r"}
    report = worker.build_worker_meta()
    assert report.off and report.completions == [CompletionReport(4, False)] and report.loads[0].valid_chunks == 0
    assert worker.snapshot()["connector"]["off"] and worker.stats_delta() == {"faults": 1}


def test_a_fault_outside_one_load_turns_the_worker_off_and_fails_its_loads(tmp_path, monkeypatch):
    worker = dense_worker(tmp_path)
    store_and_write(worker)
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),))]))
    (_, job), = worker._loads.values()
    monkeypatch.setattr(job, "ready", lambda: 1 / 0)
    assert worker.get_finished(set()) == (set(), {"r"}) and worker.take_failed_requests() == {"r"}
    assert worker.off and worker.data is None and worker.build_worker_meta().off
    assert worker.snapshot()["engine"]["loads"] == 1  # counters kept after the data plane closed


def test_the_engine_fails_an_ssd_read_it_cannot_start_instead_of_raising(tmp_path, monkeypatch):
    """``load()`` raises only before any read started (the worker relies on it: a load that
    raised has nothing in flight); a read that cannot start later is a failed object."""
    worker = dense_worker(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    store_and_write(worker, "h1", (4, 5))
    engine = worker.engine
    engine.batch_bytes = SIZE  # one object per read submission
    pool = engine._ssd_loads.staging
    take, calls = pool.take, []

    def staging(nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("no staging memory")
        return take(nbytes)

    monkeypatch.setattr(pool, "take", staging)
    result = engine.load(plan(1, ["h0", "h1"], Tier.SSD), [(5, 6), (7, 8)]).wait(timeout=60)
    assert result.failed == (ObjectKey("h1", "kv"),) and result.valid_chunks == 1
    worker.shutdown()


@pytest.mark.parametrize("path", ["dram", "ssd"])
def test_an_unpack_that_cannot_start_fails_its_objects_and_the_path_goes_on(tmp_path, monkeypatch, path):
    """A path's thread never dies and never leaves a job waiting: an unpack whose stream cannot be
    entered fails its objects; the next load on the same path is served."""
    worker = dense_worker(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    engine, tier = worker.engine, Tier.DRAM if path == "dram" else Tier.SSD
    original, armed = engine._streams.on, [True]

    def stream(name):
        if name == path and armed and threading.current_thread() is not threading.main_thread():
            armed.clear()
            raise MemoryError("injected")
        return original(name)

    monkeypatch.setattr(engine._streams, "on", stream)
    result = engine.load(plan(1, ["h0"], tier), [(5, 6)]).wait(timeout=60)
    assert result.failed == (ObjectKey("h0", "kv"),) and not armed
    assert engine.load(plan(2, ["h0"], tier), [(7, 8)]).wait(timeout=60).ok
    worker.shutdown()


def test_session_fault_injection_raises_once_in_its_turn_and_restores():
    from saria.config import SariaConfig
    from saria.control import ControlPlane
    from saria.harness import patch_faults

    with pytest.raises(ValueError, match="unknown fault target"):
        patch_faults({"commit": [1]})
    original = ControlPlane.plan
    arm, restore = patch_faults({"plan": [1]})
    try:
        control = ControlPlane(SariaConfig())
        arm(0)
        control.release(control.plan(["a"], 0.0), 0.0)
        arm(1)
        with pytest.raises(RuntimeError, match="injected fault in plan"):
            control.plan(["a"], 0.0)
        control.release(control.plan(["a"], 0.0), 0.0)  # once per turn
    finally:
        restore()
    assert ControlPlane.plan is original
