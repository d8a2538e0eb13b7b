"""The worker half with ``layerwise`` (in-step loads, layer-wise stores), driven through its vLLM hooks
on real tensors, a real host pool and a real SSD store, without an engine: what vLLM hears of an
in-step load (never "finished"; what did not arrive, as error blocks), a forward that skipped a
layer's wait, a cancel, a fault mid-step, and stores copied layer by layer."""

from __future__ import annotations

import time

import pytest
import torch

from saria.control import ObjectKey, ReloadPlan, StoreOrder, Tier
from saria.dataplane.ssd.keys import object_key
from saria.kernels import pack_pages
from saria.integrations.vllm.metadata import LoadSpec, RequestOrders, SariaConnectorMetadata
from saria.integrations.vllm.worker import SariaWorker
from ssd_cases import drive_file, flip_byte
from test_vllm_connector_faults import BLOCK, CHUNK, GEOMETRY, KV_BYTES_PER_TOKEN, completions, settings, \
    store_and_write

LAYERS = ("l0",)


def worker_for(tmp_path) -> SariaWorker:
    worker = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16, layerwise=True)
    pages = torch.randn(16 * BLOCK * KV_BYTES_PER_TOKEN // 2).to(torch.bfloat16)
    worker.register_kv_caches({"l0": pages.view(16, 2, BLOCK, 2, 64)})
    assert worker.data is not None and worker.layers is not None and worker.layers.capable
    return worker


def plan(plan_id, chunks, tier):
    return ReloadPlan(plan_id, tuple(chunks), (tier,) * len(chunks), None, None, CHUNK * len(chunks), 0, 0, False)


def pages(worker, blocks) -> torch.Tensor:
    return torch.stack([worker.data.engine.kv_table.tensors[0][b].view(torch.uint8) for b in blocks])


def step(worker, meta, *, wait: bool = True) -> tuple:
    """One engine step with the worker's hooks in vLLM's order: bind, start_load_kv, the forward's
    per-layer wait and save, wait_for_save, then the transfer results."""
    worker.before_forward(meta)
    worker.start_load_kv(meta)
    for name in LAYERS:
        if wait:
            worker.wait_for_layer_load(name)
        worker.save_kv_layer(name)
    worker.wait_for_save(meta)
    sent, loaded = worker.get_finished(set())
    return sent, loaded, worker.take_failed_requests(), worker.take_error_blocks()


def test_an_in_step_load_lands_before_its_layer_reads_and_is_never_reported_finished(tmp_path):
    worker = worker_for(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),), layerwise=True)])
    worker.before_forward(meta)
    worker.start_load_kv(meta)
    worker.wait_for_layer_load("l0")
    assert torch.equal(pages(worker, (5, 6)), pages(worker, (2, 3)))  # there when the layer reads it
    worker.wait_for_save(meta)
    assert worker.get_finished(set()) == (set(), set())  # vLLM ran it in this step: nothing to report
    assert worker.take_failed_requests() == set() and worker.take_error_blocks() == set()
    (report,) = worker.build_worker_meta().loads
    assert report.req_id == "r" and report.failed == () and report.valid_chunks == 1
    snap = worker.snapshot()
    assert snap["layerwise"]["steps"] == 1 and snap["layerwise"]["layer_waits"] == 1 == snap["engine"]["layer_waits"]
    worker.shutdown()


def test_a_corrupt_ssd_object_goes_back_as_error_blocks_from_its_chunk_on(tmp_path):
    worker = worker_for(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    store_and_write(worker, "h1", (4, 5))
    ssd = worker.data.ssd
    part = ssd.info(object_key("h1", "kv")).parts[0]
    directory = ssd.paths[part.drive].parent
    flip_byte(drive_file(directory), ssd._geometry.payload_offset(part.slot) + 7)
    before = pages(worker, (9, 10)).clone()
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0", "h1"], Tier.SSD), ((7, 8), (9, 10)),
                                                  layerwise=True)])
    sent, loaded, failed, errors = step(worker, meta)
    assert loaded == set() and failed == set() and errors == {9, 10}  # from the failed chunk on
    assert torch.equal(pages(worker, (9, 10)), before)  # no byte of it landed
    assert torch.equal(pages(worker, (7, 8)), pages(worker, (2, 3)))
    (report,) = worker.build_worker_meta().loads
    assert report.failed == (ObjectKey("h1", "kv"),) and report.valid_chunks == 1
    worker.shutdown()


def test_a_forward_that_skipped_a_layers_wait_has_every_loaded_block_recomputed(tmp_path):
    worker = worker_for(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),), 1, layerwise=True)])
    sent, loaded, failed, errors = step(worker, meta, wait=False)
    assert errors == {6} and loaded == set() and failed == set()  # block 5 is the engine's own (skip_pages=1)
    assert worker.snapshot()["layerwise"]["missed_steps"] == 1
    worker.shutdown()


def test_a_cancelled_in_step_load_reports_the_requests_blocks_in_error(tmp_path):
    worker = worker_for(tmp_path)
    meta = SariaConnectorMetadata(cancels=["lost", "waiting"], cancel_blocks={"lost": (3, 4, 5)})
    sent, loaded, failed, errors = step(worker, meta)
    assert errors == {3, 4, 5}
    assert loaded == {"waiting"} and failed == {"waiting"}  # an asynchronous load's cancel, as before
    worker.shutdown()


def test_a_fault_in_a_layers_wait_turns_the_worker_off_and_the_load_goes_back_in_error(tmp_path, monkeypatch):
    worker = worker_for(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    monkeypatch.setattr(type(worker.layers), "wait", lambda self, name: 1 / 0)
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),), layerwise=True)])
    sent, loaded, failed, errors = step(worker, meta)
    assert worker.off and errors == {5, 6} and loaded == set()
    assert worker.snapshot()["connector"]["by_where"] == {"wait_for_layer_load": 1}


def test_an_in_step_load_while_off_or_refused_goes_back_in_error(tmp_path):
    worker = worker_for(tmp_path)
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["nowhere"], Tier.SSD), ((0, 16),), layerwise=True)])
    sent, loaded, failed, errors = step(worker, meta)  # block 16 is outside the cache: refused before anything moved
    assert errors == {0, 16} and loaded == set() and worker.faults.count == 1 and not worker.off
    worker.shutdown()


def test_stores_go_layer_by_layer_and_land_once_their_copies_ran_after_wait_for_save(tmp_path):
    worker = worker_for(tmp_path)
    size = CHUNK * KV_BYTES_PER_TOKEN
    meta = SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, ("h0",), (), size),), {"h0": (2, 3)})])
    worker.before_forward(meta)
    assert worker.saves.step is not None and worker._reading["r0"]  # the pages are read from now on
    worker.save_kv_layer("l0")
    worker.wait_for_save(meta)  # hands the step over: it ends on the engine's retire thread
    assert worker.data.engine.settle(timeout=30)
    assert all(event.is_set() for event in worker._reading["r0"])  # every copy ran: vLLM may reuse the pages
    assert [c.ok for c in completions(worker, 1)] == [True]
    engine = worker.data.engine
    obj = engine.dram_object("h0")
    stored = torch.cat([piece for piece in engine.dram.views(obj)])[:size]
    assert torch.equal(stored, pack_pages(engine.kv_table, torch.tensor([2, 3])))
    counters = worker.snapshot()["engine"]
    assert counters["layer_saves"] == 1 and counters["layer_saves_late"] == 0 and counters["store_failures"] == 0
    worker.shutdown()


@pytest.mark.parametrize("hook", [False, True])
def test_a_layer_whose_save_hook_never_ran_is_copied_by_wait_for_save(tmp_path, hook):
    worker = worker_for(tmp_path)
    size = CHUNK * KV_BYTES_PER_TOKEN
    meta = SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, ("h0",), (), size),), {"h0": (2, 3)})])
    worker.before_forward(meta)
    if hook:
        worker.save_kv_layer("l0")
    worker.wait_for_save(meta)
    assert [c.ok for c in completions(worker, 1)] == [True]
    assert worker.snapshot()["engine"]["layer_saves_late"] == (0 if hook else 1)
    worker.shutdown()


@pytest.mark.parametrize("ssd_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.long)])
def test_serving_launches_only_kernel_variants_warmed_at_start(tmp_path, monkeypatch, ssd_dtype):
    """Every Triton variant a session launches was warmed by register_kv_caches on this thread: none
    is compiled while serving (a compile takes hundreds of ms, and from the path, save and SSD
    threads at once Triton's compile path is not thread-safe). The keys are Triton's own
    specialization (saria.kernels.variants): under the interpreter nothing compiles, but a launch
    whose key was not warmed is exactly one a GPU would compile then."""
    from saria.kernels import variants
    monkeypatch.setattr(variants, "SEEN", {})  # this process's earlier tests launched variants of their own
    monkeypatch.setattr(variants, "LATE", [])
    monkeypatch.setattr(variants, "LAUNCHES", variants.Counter())
    worker = SariaWorker(settings(tmp_path, ssd_dtype=ssd_dtype), GEOMETRY, num_blocks=16, layerwise=True)
    pages_ = torch.randn(16 * BLOCK * KV_BYTES_PER_TOKEN // 2).to(torch.bfloat16)
    worker.register_kv_caches({"l0": pages_.view(16, 2, BLOCK, 2, 64)})
    warmed = dict(variants.SEEN)
    assert warmed and set(warmed.values()) == {"warm"} and not variants.LAUNCHES
    store_and_write(worker, "h0", (2, 3))  # a whole store, then a write to SSD
    size = CHUNK * KV_BYTES_PER_TOKEN
    for n, (chunk, blocks) in enumerate((("h1", (4, 5)), ("h2", (6, 7)))):  # stores layer by layer
        step(worker, SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(10 + n, (chunk,), (), size),),
                                                                  {chunk: blocks})]))
    assert all(c.ok for c in completions(worker, 2))
    loads = [LoadSpec("a", plan(20, ["h0"], Tier.DRAM), ((8, 9),), layerwise=True),
             LoadSpec("b", plan(21, ["h0"], Tier.SSD), ((10, 11),), layerwise=True),
             LoadSpec("c", plan(22, ["h1"], Tier.DRAM), ((12, 13),)),
             LoadSpec("d", plan(23, ["h0"], Tier.SSD), ((14, 15),)),
             LoadSpec("e", plan(24, ["h0"], Tier.SSD), ((3, 14),), skip_pages=1),  # one page: an int == 1
             LoadSpec("f", plan(25, ["h2"], Tier.DRAM), ((1, 15),), skip_pages=1, layerwise=True)]
    for spec in loads:  # in-step (DRAM, SSD) and whole reloads, some skipping the engine's own page
        sent, loaded, failed, errors = step(worker, SariaConnectorMetadata(loads=[spec]))
        assert not failed and not errors
    for _ in range(100):
        if worker.get_finished(set())[1]:
            break
        time.sleep(0.05)
    assert torch.equal(pages(worker, (8, 9)), pages(worker, (2, 3)))
    assert torch.equal(pages(worker, (12, 13)), pages(worker, (4, 5)))
    kernels = {key[0] for key in variants.LAUNCHES}
    assert {"_copy_pages_kernel", "_scattered_kernel"} <= kernels, kernels  # the session did launch kernels
    if ssd_dtype == "fp8":
        assert "_fp8_pages_kernel" in kernels
    assert variants.LATE == [] and set(variants.LAUNCHES) <= set(warmed)
    worker.shutdown()
