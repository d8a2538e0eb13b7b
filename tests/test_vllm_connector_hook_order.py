"""The worker half under every hook order vLLM's runners use (docs/vllm.md, "Hook order"), without
an engine: real data plane, real stores, the hooks called as ``SariaConnector`` calls them.

vLLM reports a request's blocks free (``finished_sending``) at most once: a second report, after
vLLM freed the request, kills its scheduler (``assert req_id in self.requests``). With a speculator
vLLM asks for the transfer results before ``wait_for_save`` (0.32's ``defer_finalize``; 0.33/0.34's
V2 runner), and a step with nothing to run calls no layer hooks. The model below drives random
sequences of steps in those orders and checks, against a plain record of what vLLM was told, that
every request vLLM holds for saria is reported sent exactly once, never before vLLM held it."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st
import torch

from saria.control import StoreOrder
from saria.integrations.vllm.metadata import RequestOrders, SariaConnectorMetadata
from saria.integrations.vllm.worker import SariaWorker

from device_twin import LaggingDevice
from test_vllm_connector_faults import BLOCK, CHUNK, GEOMETRY, KV_BYTES_PER_TOKEN, completions, settings

SIZE = CHUNK * KV_BYTES_PER_TOKEN
ORDERS = {
    # vLLM 0.32's model runner without a speculator (and the V2 runner of 0.32)
    "plain": ("bind", "start_load_kv", "forward", "wait_for_save", "get_transfer_results", "worker_meta"),
    # with a speculator: wait_for_save after the draft forward, the results before it
    "speculator": ("bind", "start_load_kv", "forward", "get_transfer_results", "worker_meta", "wait_for_save"),
    # a step with nothing to run (kv_connector_no_forward): no layer hooks
    "no_forward": ("bind", "start_load_kv", "wait_for_save", "get_transfer_results", "worker_meta"),
}


def worker_for(tmp_path, layerwise: bool) -> SariaWorker:
    worker = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16, layerwise=layerwise)
    pages = torch.arange(16 * BLOCK * KV_BYTES_PER_TOKEN // 2, dtype=torch.int16).view(torch.bfloat16)
    worker.register_kv_caches({"l0": pages.view(16, 2, BLOCK, 2, 64)})
    assert worker.data is not None
    return worker


def run_step(worker: SariaWorker, meta: SariaConnectorMetadata, order: str, finished: set[str]) -> set[str]:
    """One engine step with the hooks in ``order``; the requests reported sent."""
    sent: set[str] = set()
    for hook in ORDERS[order]:
        if hook == "bind":
            worker.before_forward(meta)
        elif hook == "start_load_kv":
            worker.start_load_kv(meta)
        elif hook == "forward":
            for layer in GEOMETRY.attention_layers:
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer)
        elif hook == "wait_for_save":
            worker.wait_for_save(meta)
        elif hook == "get_transfer_results":
            sent, _ = worker.get_finished(finished)
            worker.take_failed_requests()
        else:
            worker.build_worker_meta()
    return sent


@st.composite
def histories(draw):
    """Steps: each its hook order, whether a new request stores a chunk, and which requests finish
    (vLLM holds their blocks for saria: the scheduler names them ``held`` in the next metadata)."""
    steps, live, stores = [], [], 0
    for i in range(draw(st.integers(1, 8))):
        store = stores < 6 and draw(st.booleans())
        finishing = sorted(draw(st.sets(st.sampled_from(live)))) if live else []
        live = [r for r in live if r not in finishing] + ([f"r{i}"] if store else [])
        stores += store
        steps.append((draw(st.sampled_from(sorted(ORDERS))), store, finishing))
    return steps


@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories(), layerwise=st.booleans())
def test_every_held_request_is_reported_sent_once_whatever_the_hook_order(tmp_path_factory, history, layerwise):
    with pytest.MonkeyPatch.context() as monkeypatch:
        device = LaggingDevice(monkeypatch, shut=False)  # and no hook ever waits for the device
        check_history(tmp_path_factory, history, layerwise)
        assert device.violations == []


def check_history(tmp_path_factory, history, layerwise):
    worker = worker_for(tmp_path_factory.mktemp("ssd"), layerwise)
    held: list[str] = []  # finished in the last step: named in the next metadata
    told: set[str] = set()  # named held to the worker so far
    reported: list[str] = []
    try:
        deadline = time.monotonic() + 30
        for i, (order, store, finishing) in enumerate(history + [("plain", False, [])] * 100_000):
            if i >= len(history):  # then steps with nothing new, until the stores in flight are done
                if (not held and set(reported) == told) or time.monotonic() > deadline:
                    break
                time.sleep(0.005)
            orders = [RequestOrders(f"r{i}", (StoreOrder(i + 1, (f"h{i}",), (), SIZE),), {f"h{i}": (2, 3)})] \
                if store else []
            meta = SariaConnectorMetadata(orders=orders, held=held)
            told.update(held)
            sent = run_step(worker, meta, order, set(held))
            assert sent <= told, f"step {i}: reported sent before vLLM held them: {sorted(sent - told)}"
            reported += sorted(sent)
            held = list(finishing)
        assert sorted(reported) == sorted(set(reported)), f"reported sent twice: {reported}"
        assert set(reported) == told, f"held but never reported sent: {sorted(told - set(reported))}"
    finally:
        worker.shutdown()


def test_a_held_request_is_reported_once_when_the_results_come_before_wait_for_save(tmp_path):
    """The ngram-speculator crash (issue 41): the step that names r1 held reports it sent before
    its ``wait_for_save``, which took the same metadata in again and held r1 a second time."""
    worker = worker_for(tmp_path, layerwise=True)
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r1", (StoreOrder(1, ("h0",), (), SIZE),),
                                                                     {"h0": (2, 3)})]))
    assert [c.ok for c in completions(worker, 1)] == [True]
    assert run_step(worker, SariaConnectorMetadata(held=["r1"]), "speculator", {"r1"}) == {"r1"}
    for _ in range(3):
        assert run_step(worker, SariaConnectorMetadata(), "speculator", set()) == set()
    worker.shutdown()
