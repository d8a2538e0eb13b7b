"""The engine's device on every thread saria starts (saria.dataplane.devices, issue 42 item 2).

vLLM makes the worker's GPU current on its main thread only; every thread and pool worker saria
starts must make the engine's device current before it does any work. On CUDA that is
``torch.cuda.set_device``; on every machine :func:`bind_thread` records the device per thread, the
CPU twin these tests read: a real data plane (host pool, SSD store, every transfer path, layer-wise
loads and saves, prewarms, TieredCache's completions) is driven through each path, and every live
``saria-*`` thread must have bound the engine's device."""

from __future__ import annotations

import threading

import pytest
import torch

from kernel_cases import vllm_layers
from saria.config import Capacity, ChunkSpec, SariaConfig
from saria.control import PromoteOrder, ReloadPlan, StoreOrder, Tier, WriteOrder
from saria.dataplane import devices
from saria.integrations.cache import TieredCache

BLOCK_TOKENS = 4
PAGES = 2
SLOT = 4096


def blocks_of(i, base=0):
    return [base + PAGES * i, base + PAGES * i + 1]


def plan(chunks, tier, plan_id):
    return ReloadPlan(plan_id, tuple(chunks), tuple(tier for _ in chunks), None, None, len(chunks) * 8, 0, 0, False)


def saria_threads() -> list[threading.Thread]:
    """saria's live threads, but the kernels' CPU copy pool (``saria-pages``, shared by every engine
    in the process, host memory only: it has no device to bind)."""
    return [t for t in threading.enumerate() if t.name.startswith("saria-") and not t.name.startswith("saria-pages")]


def test_bind_thread_records_the_device_per_thread_and_pools_bind_before_their_first_task():
    seen = {}

    def run():
        seen["before"] = devices.bound_device()
        devices.bind_thread("cpu")
        seen["after"] = devices.bound_device()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"before": None, "after": torch.device("cpu")}
    assert devices.bound_device(t) == torch.device("cpu")
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2, initializer=devices.pool_initializer("cpu")) as pool:
        assert set(pool.map(lambda _: devices.bound_device(), range(4))) == {torch.device("cpu")}
    with pytest.raises(ValueError, match="index"):
        devices.bind_thread(torch.device("cuda"))  # a CUDA device must name its GPU


def test_resolve_keeps_an_index_and_never_initializes_cuda_where_nothing_did():
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve(None) == devices.current_device()
    if not torch.cuda.is_available():
        assert devices.current_device() == torch.device("cpu")


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_check.sh runs it)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_every_thread_a_data_plane_starts_binds_the_engines_device_before_its_work(tmp_path, device):
    caches = [t.to(device) for t in vllm_layers(48, BLOCK_TOKENS, 2, 8, torch.bfloat16, layers=3, seed=3)]
    config = SariaConfig.preset("full-duplicate", chunk=ChunkSpec(chunk_tokens=8, checkpoint_tokens=64),
                                dram=Capacity(nbytes=8 * SLOT), ssd=Capacity(nbytes=4096 + 40 * (4096 + SLOT)))
    before = {t.ident for t in saria_threads()}
    with TieredCache(config, caches, block_tokens=BLOCK_TOKENS, ssd_paths=[str(tmp_path)]) as cache:
        engine = cache.engine
        # stores and SSD writes (offload pool, SSD writers, completions pool)
        hashes = ["a", "b", "c"]
        cache.commit(hashes, {h: blocks_of(i) for i, h in enumerate(hashes)}, plan=cache.lookup(hashes))
        cache.drain()
        assert engine.write(WriteOrder(90, ("w",), (), 0, Tier.GPU, "write-through"), {"w": blocks_of(4)}).result().ok
        # whole reloads from DRAM (the DRAM thread and its CPU unpack pool) and SSD (readers, unpack thread)
        assert engine.load(plan(["a"], Tier.DRAM, 91), [blocks_of(0, 20)]).wait().ok
        assert engine.load(plan(["w"], Tier.SSD, 92), [blocks_of(0, 24)]).wait().ok
        # a prewarm (the prewarm pool)
        (run,) = engine.execute([PromoteOrder(93, ("w",), (), 0, source=Tier.SSD)])
        assert run.completion.result().ok
        # layer by layer: both path threads, then the save thread
        step = engine.load_layers([(plan(["a"], Tier.DRAM, 94), [blocks_of(0, 28)], 0),
                                   (plan(["w"], Tier.SSD, 95), [blocks_of(0, 32)], 0)])
        for layer in range(3):
            step.wait_layer(layer)
        assert all(r.ok for r in step.finish())
        save = engine.store_layers([StoreOrder(96, ("s",), (), 0)], {"s": blocks_of(0, 36)})
        for layer in range(3):
            save.save_layer(layer)
        assert all(r.completion.result().ok for r in save.finish())
        started = [t for t in saria_threads() if t.ident not in before]
        names = {t.name.rsplit("_", 1)[0] for t in started}  # pool workers are named prefix_N
        expected = {"saria-dram", "saria-dram-unpack", "saria-ssd-unpack", "saria-ssd-read", "saria-ssd-write",
                    "saria-offload", "saria-prewarm", "saria-layers-dram", "saria-layers-ssd",
                    "saria-layer-saves", "saria-complete", "saria-retire"}
        assert expected <= names, f"paths not exercised: {sorted(expected - names)}"
        unbound = {t.name: devices.bound_device(t) for t in started if devices.bound_device(t) != engine.device}
        assert not unbound, f"threads that did not bind the engine's device ({engine.device}): {unbound}"
        if engine.device.type == "cuda":  # CUDA's current device on the SSD readers is the engine's
            assert set(cache.ssd._readers.map(lambda _: torch.cuda.current_device(), range(8))) == {engine.device.index}


def test_a_vllm_workers_threads_bind_its_engines_device(tmp_path):
    """The connector's worker half, its hooks called as vLLM calls them (layer-wise saves, then the
    stores' SSD writes): every thread its data plane started bound the engine's device."""
    pytest.importorskip("vllm")
    from saria.integrations.vllm.metadata import RequestOrders, SariaConnectorMetadata
    from test_vllm_connector_hook_order import GEOMETRY, SIZE, worker_for
    from test_vllm_connector_faults import completions

    before = {t.ident for t in saria_threads()}
    worker = worker_for(tmp_path, layerwise=True)
    try:
        meta = SariaConnectorMetadata(orders=[RequestOrders("r1", (StoreOrder(1, ("h0",), (), SIZE),), {"h0": (2, 3)})])
        worker.before_forward(meta)
        worker.start_load_kv(meta)
        for layer in GEOMETRY.attention_layers:
            worker.wait_for_layer_load(layer)
            worker.save_kv_layer(layer)
        worker.wait_for_save(meta)
        assert [c.ok for c in completions(worker, 1)] == [True]
        started = [t for t in saria_threads() if t.ident not in before]
        assert "saria-layer-saves" in {t.name for t in started}
        device = worker.data.engine.device
        unbound = {t.name: devices.bound_device(t) for t in started if devices.bound_device(t) != device}
        assert not unbound, f"threads that did not bind the engine's device ({device}): {unbound}"
    finally:
        worker.shutdown()
