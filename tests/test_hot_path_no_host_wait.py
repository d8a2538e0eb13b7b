"""The hot-path rule (docs/architecture.md, "No host wait on the device in a per-step hook"): no vLLM
hook blocks its thread until the device ran something. Checked on the CPU with a twin of a device
that runs behind the host (:mod:`device_twin`): while it lags, every per-step hook returns, and
what may only happen once the copies ran (a stored object published and its completion reported,
the request's blocks given back to vLLM, staging given back) waits for the device, off the hooks'
thread; once it catches up, all of it happens, with the right bytes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from saria.control import ObjectKey, ReloadPlan, StoreOrder, Tier
from saria.dataplane.transfer.streams import HostEvent
from saria.integrations.vllm.metadata import LoadSpec, RequestOrders, SariaConnectorMetadata
from saria.kernels import pack_pages

from device_twin import LaggingDevice
from test_vllm_connector_faults import CHUNK, KV_BYTES_PER_TOKEN, completions, store_and_write
from test_vllm_connector_layerwise import pages, plan, worker_for

SIZE = CHUNK * KV_BYTES_PER_TOKEN


def forward(worker, meta, layers=("l0",)) -> None:
    """One step's hooks before the transfer results: bind, start_load_kv, the forward's per-layer
    wait and save, wait_for_save."""
    worker.before_forward(meta)
    worker.start_load_kv(meta)
    for name in layers:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name)
    worker.wait_for_save(meta)


def test_a_layer_wise_store_ends_when_the_device_ran_it_and_no_hook_waits_for_that(tmp_path, monkeypatch):
    worker = worker_for(tmp_path)
    engine = worker.data.engine
    device = LaggingDevice(monkeypatch)
    meta = SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, ("h0",), (), SIZE),), {"h0": (2, 3)})])
    forward(worker, meta)
    # the device has not run the copies: nothing is published, completed or given back yet
    assert worker.get_finished(set()) == (set(), set())
    report = worker.build_worker_meta()
    assert report is None or report.completions == []
    assert engine.dram_object("h0") is None
    assert not any(event.is_set() for event in worker._reading["r0"])
    # vLLM finishes r0 and holds its blocks for saria: not sent while a copy may still read them
    forward(worker, SariaConnectorMetadata(held=["r0"]))
    assert worker.get_finished({"r0"}) == (set(), set())
    assert not engine.settle(timeout=0.2)  # the retire thread is waiting for the device
    assert device.violations == []

    device.run()
    assert engine.settle(timeout=30)
    assert [c.ok for c in completions(worker, 1)] == [True]
    obj = engine.dram_object("h0")
    stored = torch.cat(list(engine.dram.views(obj)))[:SIZE]
    assert torch.equal(stored, pack_pages(engine.kv_table, torch.tensor([2, 3])))
    forward(worker, SariaConnectorMetadata())
    assert worker.get_finished(set())[0] == {"r0"}
    assert device.violations == [] and device.synchronized > 0  # the device was waited for, off the hooks
    worker.shutdown()


@pytest.mark.parametrize("tier", [Tier.DRAM, Tier.SSD])
def test_an_in_step_load_reports_its_result_without_waiting_and_gives_staging_back_once_run(tmp_path, monkeypatch,
                                                                                            tier):
    worker = worker_for(tmp_path)
    engine = worker.data.engine
    store_and_write(worker, "h0", (2, 3))
    device = LaggingDevice(monkeypatch)
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], tier), ((5, 6),), layerwise=True)])
    forward(worker, meta)
    assert torch.equal(pages(worker, (5, 6)), pages(worker, (2, 3)))  # the CPU twin copies once issued
    assert worker.get_finished(set()) == (set(), set())  # in-step: never reported finished
    assert worker.take_error_blocks() == set() and worker.take_failed_requests() == set()
    (report,) = worker.build_worker_meta().loads  # the result is known on the host already
    assert report.req_id == "r" and report.failed == () and report.valid_chunks == 1
    retirer = engine.layerwise().retirer
    assert retirer.pending == 1  # the step's staging goes back once the device ran its copies
    assert device.violations == []

    device.run()
    assert engine.settle(timeout=30) and retirer.pending == 0
    assert device.violations == []
    worker.shutdown()


def test_a_forward_that_skipped_a_wait_is_ordered_after_the_copies_without_a_host_wait(tmp_path, monkeypatch):
    worker = worker_for(tmp_path)
    store_and_write(worker, "h0", (2, 3))
    device = LaggingDevice(monkeypatch)
    waited: list = []
    real_wait = type(worker.data.engine.layerwise().streams).wait
    monkeypatch.setattr(type(worker.data.engine.layerwise().streams), "wait",
                        lambda self, name, event: (waited.append((name, event)), real_wait(self, name, event))[1])
    meta = SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["h0"], Tier.DRAM), ((5, 6),), 1, layerwise=True)])
    worker.before_forward(meta)
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)  # no layer hook ran (a full CUDA graph)
    assert not any(name is None for name, _ in waited)
    worker.get_finished(set())
    assert worker.take_error_blocks() == {6}  # recomputed by vLLM, in a later step on the same stream...
    assert any(name is None for name, _ in waited)  # ...which was made to wait for every copy first
    assert device.violations == []
    device.run()
    worker.shutdown()


def test_the_twin_catches_a_hook_that_waits_for_the_device(tmp_path, monkeypatch):
    """The check itself: a hook that synchronizes an event is caught (the worker turns off, as on
    any fault in a hook, and the violation is recorded)."""
    worker = worker_for(tmp_path)
    device = LaggingDevice(monkeypatch, shut=False)
    real = worker.saves.start

    def waiting_start(meta):
        HostEvent().synchronize()
        real(meta)

    monkeypatch.setattr(worker.saves, "start", waiting_start)
    worker.wait_for_save(SariaConnectorMetadata())
    assert len(device.violations) == 1 and device.violations[0].startswith("wait_for_save")
    assert worker.off
    worker.shutdown()


def test_a_retired_step_survives_a_new_epoch_the_published_objects_are_dropped(tmp_path, monkeypatch):
    """A new epoch while a step's copies still run: it waits for them (not a per-step hook), then
    drops what the old control plane stored; nothing is left in DRAM or pending."""
    worker = worker_for(tmp_path)
    engine = worker.data.engine
    device = LaggingDevice(monkeypatch)
    meta = SariaConnectorMetadata(orders=[RequestOrders("r0", (StoreOrder(1, ("h0",), (), SIZE),), {"h0": (2, 3)})])
    forward(worker, meta)
    assert engine.dram_object("h0") is None
    threading.Timer(0.3, device.run).start()
    t0 = time.monotonic()
    worker._new_epoch(worker.epoch + 1)  # what vLLM's next metadata does (in _follow)
    assert time.monotonic() - t0 >= 0.25  # it waited for the step, which ended once the device ran it
    assert engine.settle(timeout=30)
    assert engine.dram_objects() == 0 and not worker.off
    assert device.violations == []
    worker.shutdown()


def test_a_launch_that_raises_part_way_keeps_the_ssd_staging_until_what_it_launched_ran(tmp_path, monkeypatch):
    """A step whose second layer's launch is refused after its first layer's was launched: the
    step's SSD staging (which that first launch reads) goes back only once the device ran it,
    never at once."""
    from saria.dataplane.dram.staging import StagingPool
    from saria.kernels import LayeredCopy
    from test_dataplane_layerwise import caches_of, plan as engine_plan, put, rig

    caches = caches_of(4, 2, 8, layers=3)
    with rig(tmp_path, caches, 4096, layers=[[0, 1], [2]]) as (engine, _, _):
        put(engine, ["a"], [Tier.SSD])
        device = LaggingDevice(monkeypatch)
        launches, given = [], []
        real_launch, real_give = LayeredCopy.launch, StagingPool.give

        def launch(copy, layer):
            launches.append(layer)
            if len(launches) == 2:
                raise RuntimeError("refused by the twin")
            real_launch(copy, layer)

        def give(pool, handle):
            given.append(device.gate.is_set())
            real_give(pool, handle)

        monkeypatch.setattr(LayeredCopy, "launch", launch)
        monkeypatch.setattr(StagingPool, "give", give)
        step = engine.load_layers([(engine_plan(["a"], [Tier.SSD]), [[40, 41]], 0)])
        (result,) = step.end(timeout=30)
        assert result.failed == (ObjectKey("a", "kv"),) and len(launches) == 2
        assert not engine.settle(timeout=0.3) and given == []  # the first copy may still read it
        device.run()
        assert engine.settle(timeout=30) and given == [True]
