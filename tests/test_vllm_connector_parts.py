"""The connector's pieces without an engine: options, KV cache geometry, the worker's failure
reporting, the workers' report aggregation. vLLM's own config classes, saria's real engine."""

from __future__ import annotations

import types

import pytest
import torch

from saria.control import ObjectKey, ReloadPlan, Tier
from saria.integrations.vllm.geometry import engine_geometry
from saria.integrations.vllm.metadata import (CompletionReport, LoadReport, LoadSpec, SariaConnectorMetadata,
                                              SariaWorkerMetadata)
from saria.integrations.vllm.requests import summary_line
from saria.integrations.vllm.settings import ConnectorSettings
from saria.integrations.vllm.worker import SariaWorker
from saria.integrations.vllm.worker_start import page_views
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)

ATTN = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
GDN = MambaSpec(block_size=32, shapes=((3, 64), (2, 16, 16)), dtypes=(torch.bfloat16, torch.bfloat16),
                page_size_padded=ATTN.page_size_bytes)


def kv_config(*groups, num_blocks=16):
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups])


def cache_config(mode="none"):
    return types.SimpleNamespace(mamba_cache_mode=mode)


# --- options -------------------------------------------------------------------------------------

def test_defaults_and_sizes():
    s = ConnectorSettings.from_extra_config({"dram_gb": 2, "ssd_paths": ["/a", "/b"], "ssd_gb": 10, "theta_E": 3})
    assert s.dram_bytes == 2 << 30 and s.ssd_bytes == 10 << 30 and s.bandwidth.drives == 2
    config = s.saria_config(block_size=32, kv_bytes_per_token=1024)
    assert config.chunk.chunk_tokens == 512 and config.policy.theta_E == 3 and config.ssd_bytes == 10 << 30
    no_ssd = ConnectorSettings.from_extra_config({}).saria_config(block_size=16, kv_bytes_per_token=1024)
    assert no_ssd.ssd_bytes == 0  # no drives, no SSD tier
    assert ConnectorSettings().chunk_tokens_for(256, hybrid=True) == 256  # hybrid: one vLLM block
    assert ConnectorSettings().chunk_tokens_for(48, hybrid=False) == 528  # whole blocks near 512


def test_ssd_dtype_reaches_the_config_with_the_caches_element_size():
    s = ConnectorSettings.from_extra_config({"ssd_paths": ["/a"], "ssd_dtype": "fp8"})
    config = s.saria_config(block_size=32, kv_bytes_per_token=1024, kv_element_bytes=2)
    assert config.ssd_dtype == "fp8" and config.chunk.kv_element_bytes == 2
    assert config.ssd_kv_bytes == config.chunk.kv_bytes // 2 + config.chunk.kv_bytes // 2 // 128 * 4
    assert ConnectorSettings.from_extra_config({}).saria_config(block_size=32, kv_bytes_per_token=1024).ssd_dtype == "auto"
    with pytest.raises(ValueError, match="2- or 4-byte elements"):  # vLLM's own fp8 cache: nothing left to halve
        s.saria_config(block_size=32, kv_bytes_per_token=1024, kv_element_bytes=1)


@pytest.mark.parametrize("extra, match", [
    ({"ssd_dtype": "fp4"}, "unknown ssd_dtype .fp4.: must be auto or fp8"),
    ({"dram_gbs": 1}, "unknown saria connector option"),
    ({"policy": "fast"}, "unknown policy"),
    ({"ssd_paths": "/mnt/nvme0"}, "list of directories"),
    ({"dram_gb": 1, "dram_bytes": 5}, "not both"),
    ({"dram_bytes": -1}, ">= 0"),
    ({"coordinator": "eager"}, "coordinated, overlap or serial"),
    ({"theta_E": 0}, "theta_E"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"checkpoint_tokens": 0}, "checkpoint_tokens must be a positive int"),
    ({"checkpoint_tokens": "16k"}, "checkpoint_tokens must be a positive int"),
    ({"on_load_failure": "ignore"}, "recompute or fail"),
    ({"durable": "yes"}, "true or false"),
    ({"dram_gb": 1e400}, "dram_gb must be >= 0 and <= "),
    ({"dram_gb": float("nan")}, "dram_gb must be >= 0"),
    ({"dram_gb": True}, "dram_gb must be a number"),
    ({"dram_bytes": 2**70}, "dram_bytes must be an int >= 0 and <= 2[*][*]60"),
    ({"b_gpu_gbps": "fast"}, "b_gpu_gbps must be a number"),
    ({"b_disk_gbps": [20]}, "b_disk_gbps must be a number"),
    ({"b_dram_gbps": 0}, "b_dram_gbps must be > 0"),
    ({"ssd_paths": 5}, "list of directories"),
    ({"ssd_paths": None}, "list of directories"),
    ({"ssd_paths": [""]}, "list of directories"),
    ({"policy": ["saria"]}, "unknown policy"),
    ({"log_interval_s": float("inf")}, "log_interval_s must be >= 0"),
    ({"chunk_tokens": 2**64}, "chunk_tokens must be a positive int"),
    ({"policy": "oracle"}, "only a replay of a recorded trace"),
    ({"admission": "oracle"}, "only a replay of a recorded trace"),
    ({"admission": "eq1+bogus"}, "unknown rule"),
    ({"admission": "session"}, "refines nothing"),
    ({"session_p": 1.5}, "session_p must be <= 1.0"),
    ({"prewarm": "yes"}, "prewarm must be a bool"),
    ({"layerwise": "yes"}, 'layerwise must be true, false or "auto"'),
    ({"layerwise": 1}, 'layerwise must be true, false or "auto"'),
    ({"layerwise": None}, 'layerwise must be true, false or "auto"'),
    ({"layerwise_max_programs": -1}, "layerwise_max_programs must be"),
    ({"layerwise_max_programs": True}, "layerwise_max_programs must be"),
    ({"layerwise_max_programs": "many"}, "layerwise_max_programs must be"),
])
def test_bad_options_are_refused_clearly(extra, match):
    with pytest.raises(ValueError, match=match):
        ConnectorSettings.from_extra_config(extra)


def test_layerwise_max_programs_is_auto_a_cap_or_none():
    from saria.dataplane.transfer.layerwise import LayerwiseLoads
    assert ConnectorSettings.from_extra_config({}).layerwise_max_programs is None
    assert ConnectorSettings.from_extra_config({"layerwise_max_programs": "auto"}).layerwise_max_programs is None
    assert ConnectorSettings.from_extra_config({"layerwise_max_programs": 8}).layerwise_max_programs == 8
    assert ConnectorSettings.from_extra_config({"layerwise_max_programs": 0}).layerwise_max_programs == 0
    assert "max_programs" in LayerwiseLoads.__init__.__code__.co_varnames


def test_layerwise_resolves_per_device_and_never_for_hybrid_models():
    from saria.integrations.vllm.connector import SariaConnector
    from saria.integrations.vllm.settings import LAYERWISE_DEFAULT
    auto = ConnectorSettings.from_extra_config({})
    assert auto.layerwise is None
    for device, on in LAYERWISE_DEFAULT.items():
        assert auto.layerwise_for(device, hybrid=False) is on
        assert auto.layerwise_for(device, hybrid=True) is False  # vLLM cannot recompute a multi-group in-step load
    assert auto.layerwise_for("tpu", hybrid=False) is False  # a device nobody measured: whole reloads
    for value in (True, False):
        settings = ConnectorSettings.from_extra_config({"layerwise": value})
        assert settings.layerwise_for("cuda", hybrid=False) is value and not settings.layerwise_for("cuda", hybrid=True)
        assert not settings.layerwise_for("cuda", hybrid=False, drafter=True)  # a draft model's layers run late
    assert not auto.layerwise_for("cpu", hybrid=False, drafter=True)
    # a FULL CUDA graph would replay past the per-layer hooks: piecewise unless layerwise is off
    assert SariaConnector.requires_piecewise_for_cudagraph({}) is LAYERWISE_DEFAULT["cuda"]
    assert SariaConnector.requires_piecewise_for_cudagraph({"layerwise": True}) is True
    assert SariaConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False
    assert SariaConnector.requires_piecewise_for_cudagraph({"layerwise": "bad"}) is False  # the start reports it


def test_chunk_must_be_whole_blocks():
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        ConnectorSettings.from_extra_config({"chunk_tokens": 100}).saria_config(block_size=32, kv_bytes_per_token=64)


@pytest.mark.parametrize("block_size, expected", [(256, 16_384), (384, 16_512), (544, 16_320), (32_768, 32_768)])
def test_default_checkpoints_fall_on_whole_chunks_of_any_hybrid_block_size(block_size, expected):
    """vLLM picks a hybrid model's block size from its state size and the hardware (256 or 384
    tokens for the test model on CPUs with and without AVX512-BF16): the default checkpoint
    interval follows it, and an explicit one must fit it."""
    settings = ConnectorSettings.from_extra_config({})
    chunk = settings.chunk_tokens_for(block_size, hybrid=True)
    assert settings.checkpoint_tokens_for(chunk) == expected
    assert settings.saria_config(block_size=block_size, kv_bytes_per_token=64, state_bytes=4096).chunk.chunk_tokens == chunk
    explicit = ConnectorSettings.from_extra_config({"checkpoint_tokens": 4 * block_size})
    assert explicit.checkpoint_tokens_for(block_size) == 4 * block_size
    with pytest.raises(ValueError, match=r"checkpoint_tokens \(16384\) must be a multiple of chunk_tokens \(384\)"):
        ConnectorSettings.from_extra_config({"checkpoint_tokens": 16_384}).saria_config(
            block_size=384, kv_bytes_per_token=64, state_bytes=4096)


# --- geometry ------------------------------------------------------------------------------------

def test_dense_and_hybrid_geometry():
    dense = engine_geometry(kv_config((["l0", "l1"], ATTN)), cache_config())
    assert dense.attention_layers == ("l0", "l1") and not dense.hybrid
    assert dense.kv_bytes_per_token == 2 * ATTN.page_size_bytes // 32
    hybrid = engine_geometry(kv_config((["g0"], GDN), (["l1"], ATTN)), cache_config("align"))
    assert hybrid.hybrid and hybrid.state_group == 0 and hybrid.attention_group == 1
    assert hybrid.state_bytes == 3 * 64 * 2 + 2 * 16 * 16 * 2


def test_chunk_hashes_follow_vllms_hash_granularity():
    """vLLM hashes a prompt every ``hash_block_size`` tokens, finer than a block for hybrid models
    with partial prefix hits: a chunk's hash must be the one at its last token, or two prompts that
    differ only late in a chunk would share a key (wrong KV)."""
    from saria.integrations.vllm.scheduler import SariaScheduler

    config = kv_config((["g0"], GDN), (["l1"], ATTN))
    config.hash_block_size = 8  # four hashes per 32-token block
    geometry = engine_geometry(config, cache_config("align"))
    assert geometry.hash_tokens == 8
    scheduler = SariaScheduler(ConnectorSettings.from_extra_config({"chunk_tokens": 64}), geometry)
    request = types.SimpleNamespace(block_hashes=[f"h{i}".encode() for i in range(20)])  # 160 tokens
    assert scheduler.chunk_hashes(request, 160) == [b"h7", b"h15"]  # tokens 0-63 and 64-127
    assert scheduler.chunk_hashes(request, 127) == [b"h7"]
    config.hash_block_size = 24
    with pytest.raises(ValueError, match="does not divide"):
        engine_geometry(config, cache_config("align"))


def test_geometry_refuses_what_saria_cannot_cache():
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        engine_geometry(kv_config((["g0"], GDN), (["l1"], ATTN)), cache_config("none"))
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128)
    with pytest.raises(ValueError, match="sliding-window"):
        engine_geometry(kv_config((["l0"], ATTN), (["s0"], swa)), cache_config())
    with pytest.raises(ValueError, match="no full-attention"):
        engine_geometry(kv_config((["g0"], GDN)), cache_config("align"))


def test_page_views_find_the_block_dimension():
    assert page_views("l", torch.zeros(16, 2, 32, 128), 16)[0].shape == (16, 2, 32, 128)
    halves = page_views("l", torch.zeros(2, 16, 32, 2, 64), 16)
    assert len(halves) == 2 and halves[0].shape == (16, 32, 2, 64)
    with pytest.raises(ValueError, match="block dimension"):
        page_views("l", torch.zeros(32, 16, 8), 16)


# --- worker --------------------------------------------------------------------------------------

def hybrid_worker(tmp_path):
    geometry = engine_geometry(kv_config((["g0"], GDN), (["l1"], ATTN)), cache_config("align"))
    settings = ConnectorSettings.from_extra_config({"dram_bytes": 1 << 20, "ssd_paths": [str(tmp_path)],
                                                     "ssd_bytes": 8 << 20, "log_interval_s": 0})
    worker = SariaWorker(settings, geometry, num_blocks=16)
    raw = torch.zeros(16, ATTN.page_size_bytes, dtype=torch.int8)
    worker.register_kv_caches({"l1": torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16),
                               "g0": raw.as_strided((16, geometry.state_bytes), (ATTN.page_size_bytes, 1))})
    return worker


def test_hybrid_load_failure_is_reported_per_request(tmp_path):
    worker = hybrid_worker(tmp_path)
    plan = ReloadPlan(1, ("h0",), (Tier.SSD,), "h0", Tier.SSD, 32, 0, 0, False)  # nothing stored: the read fails
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r1", plan, ((3,),), 0, (5,))]))
    done = set()
    for _ in range(200):
        _, done = worker.get_finished(set())
        if done:
            break
    assert done == {"r1"}
    assert worker.take_failed_requests() == {"r1"} and worker.take_error_blocks() == set()
    report = worker.build_worker_meta()
    assert report.loads[0].failed == (ObjectKey("h0", "kv"), ObjectKey("h0", "state"))
    worker.shutdown()


def test_reports_of_several_workers_combine():
    a = SariaWorkerMetadata([LoadReport("r", 1, (), 3)], [CompletionReport(7, True)])
    b = SariaWorkerMetadata([LoadReport("r", 1, (ObjectKey("x", "kv"),), 1)], [CompletionReport(7, False)])
    both = a.aggregate(b)
    assert both.loads == [LoadReport("r", 1, (ObjectKey("x", "kv"),), 1, 2)]
    assert both.completions == [CompletionReport(7, False, (), 2)]


def test_summary_line_names_tiers_and_writes():
    totals = dict.fromkeys(("requests", "hit_tokens_dram", "hit_tokens_ssd", "loads", "loads_failed", "ssd_writes",
                            "ssd_bytes_written", "admissions_eviction", "admissions_reuse", "admissions_prewrite",
                            "promotions", "scheduler_faults"), 0)
    line = summary_line(dict(totals, hit_tokens_dram=512, hit_tokens_ssd=256, scheduler_faults=2), rebuilds=1)
    for words in ("512 tokens from DRAM", "256 from SSD", "admissions", "promotions", "faults 2",
                  "rebuilt 1x"):
        assert words in line


@pytest.mark.parametrize("kwargs", [{"prime": [0]}, {"prime": [0, 0], "prefix_caching": True},
                                    {"prime": [0], "prefix_caching": True, "extra_config": {}},
                                    {"variants": [[0]]}, {"variants": [[]], "prefix_caching": True},
                                    {"variants": [[0, 3]], "prefix_caching": True},
                                    {"variants": [[0]], "prime": [0], "prefix_caching": True},
                                    {"variants": [[0], [0]], "prefix_caching": True, "batches": [2]}])
def test_session_priming_is_refused_where_it_would_not_give_the_same_split(kwargs):
    """``prime`` and ``variants`` (the references of the output comparisons) need vLLM's own prefix
    cache, no connector, counts for every prompt shorter than it, one prompt per turn; anything
    else is refused before an engine starts."""
    from saria.harness import run_session

    with pytest.raises(ValueError, match="prime or variants|shorter than its prompt|not both|one prompt per turn"):
        run_session("no-such-model", [[1, 2, 3]] * (2 if "batches" in kwargs else 1), **kwargs)


@pytest.mark.parametrize("extra", [["policy", "saria"], "saria", 5])
def test_extra_config_that_is_not_a_mapping_is_refused(extra):
    with pytest.raises(ValueError, match="must be a mapping"):
        ConnectorSettings.from_extra_config(extra)


@pytest.mark.parametrize("dbo,ubatch_size,off", [
    pytest.param(True, 0, True, id="dual-batch-overlap"),
    pytest.param(False, 2, True, id="ubatch-size-2"),
    pytest.param(False, 1, False, id="one-ubatch"),
    pytest.param(False, 0, False, id="no-ubatching"),
])
def test_layerwise_is_off_under_vllms_micro_batching_with_one_line(dbo, ubatch_size, off):
    """vLLM's dual-batch overlap runs every layer once per micro-batch: save_kv_layer would come
    twice per layer in a step ("saved already", a fault) with half the pages each. Layer-wise goes
    off, in one warning, read off vLLM's own ParallelConfig."""
    import logging

    from vllm.config import ParallelConfig

    from saria.integrations.vllm.compat import uses_ubatching
    from saria.integrations.vllm.connector import decide_layerwise

    parallel = ParallelConfig(enable_dbo=dbo, ubatch_size=ubatch_size)
    config = types.SimpleNamespace(parallel_config=parallel, speculative_config=None,
                                   device_config=types.SimpleNamespace(device_type="cuda"))
    assert uses_ubatching(config) is parallel.use_ubatching is off  # vLLM's own rule, from its two fields
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("saria.vllm")
    logger.addHandler(handler)
    try:
        for extra, asked in (({"layerwise": True}, True), ({}, None), ({"layerwise": False}, False)):
            records.clear()
            settings = ConnectorSettings.from_extra_config(extra)
            would = settings.layerwise_for("cuda", hybrid=False)
            assert decide_layerwise(settings, config, hybrid=False) is (would and not off)
            lines = [r.getMessage() for r in records if "micro-batching" in r.getMessage()]
            assert len(lines) == (1 if off and would else 0), (asked, lines)
        assert not decide_layerwise(ConnectorSettings.from_extra_config({"layerwise": True}), config, hybrid=True)
    finally:
        logger.removeHandler(handler)


def test_a_step_commits_the_open_requests_in_lookup_order_also_after_a_committed_one_is_planned_again():
    """The scheduler half follows, loads and commits only the requests not yet committed (its
    ``_open`` map), in the order of its requests: a committed request planned again (e.g. after a
    preemption) takes its old place, as it does in ``_requests``, and a cached request is found by
    id among many running ones."""
    from saria.integrations.vllm.scheduler import SariaScheduler

    geometry = engine_geometry(kv_config((["l0"], ATTN)), cache_config())
    scheduler = SariaScheduler(ConnectorSettings.from_extra_config({"chunk_tokens": 64}), geometry)
    def request(name):  # two full chunks of prompt, and one token more
        hashes = [f"{name}{i}".encode() for i in range(4)]
        return types.SimpleNamespace(request_id=name, block_hashes=hashes, num_prompt_tokens=129)

    def step(new=(), cached=(), running=0):
        new_reqs = [types.SimpleNamespace(req_id=r.request_id, block_ids=([10, 11, 12, 13, 14],),
                                          num_computed_tokens=0) for r in new]
        ids = [f"other{i}" for i in range(running)] + [r.request_id for r in cached]
        cached_reqs = types.SimpleNamespace(req_ids=ids, new_block_ids=[None] * len(ids),
                                            num_computed_tokens=[0] * running + [129] * len(cached),
                                            resumed_req_ids=set())
        out = types.SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                                    num_scheduled_tokens={**{r.request_id: 129 for r in new},
                                                          **{i: 1 for i in ids}}, preempted_req_ids=set())
        return [batch.req_id for batch in scheduler.build_connector_meta(out).orders if batch.req_id]

    a, b, c = request("a"), request("b"), request("c")
    for r in (a, b):
        assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    assert step(new=(a, b), running=40) == ["a", "b"]
    assert list(scheduler._open) == []
    scheduler.get_num_new_matched_tokens(c, 0)
    scheduler.get_num_new_matched_tokens(a, 0)  # planned again: it keeps its place before c
    assert list(scheduler._open) == ["a", "c"] and list(scheduler._requests) == ["a", "b", "c"]
    assert step(new=(c, a), running=40) == ["a", "c"]
    assert step(cached=(a, b, c), running=40) == [] and all(s.committed for s in scheduler._requests.values())


def test_the_schedulers_makers_build_what_the_metadatas_constructors_build():
    """The scheduler half builds its per-request LoadSpec and RequestOrders with makers
    (saria.control.makers: instances with a __dict__); each is what the constructor builds."""
    from saria.control import StoreOrder
    from saria.integrations.vllm.metadata import RequestOrders
    from test_control_makers import check_maker
    plan = ReloadPlan(7, (b"a" * 32,), (Tier.DRAM,), None, None, 512, 100, 0, False)
    check_maker(LoadSpec, ("req-1", plan, ((1, 2), (3, 4)), 1, None, (), (), True))
    check_maker(LoadSpec, ("req-1", plan, ((1, 2),), 0, (9,), (b"c",), (b"d",), False))
    check_maker(RequestOrders, ("req-2", (StoreOrder(3, (1,), (), 100),), {1: (5, 6)}, frozenset({1})))


def test_a_dense_request_past_its_prompt_is_no_longer_followed_until_a_preemption_resets_it():
    """A dense model's request that has computed its prompt but waits for its (layer-wise) load's
    report to commit is no longer followed through vLLM's output (its later blocks and tokens are
    not read); a preemption before its commit still resets it, and the blocks it commits are the
    ones it computed its prompt in after resuming."""
    from saria.control import StoreOrder
    from saria.integrations.vllm.scheduler import SariaScheduler

    geometry = engine_geometry(kv_config((["l0"], ATTN)), cache_config())
    scheduler = SariaScheduler(ConnectorSettings.from_extra_config({"chunk_tokens": 64}), geometry, layerwise=True)

    def request(name, prefix):  # two full chunks of prompt (the first shared), and one token more
        hashes = [f"{prefix}{i}".encode() for i in range(2)] + [f"{name}{i}".encode() for i in range(2, 4)]
        return types.SimpleNamespace(request_id=name, block_hashes=hashes, num_prompt_tokens=129)

    def step(new=(), cached=(), preempted=(), report=None):
        new_reqs = [types.SimpleNamespace(req_id=r.request_id, block_ids=(list(ids),), num_computed_tokens=c)
                    for r, ids, c in new]
        cached_reqs = types.SimpleNamespace(req_ids=[r.request_id for r, _, _ in cached],
                                            new_block_ids=[(list(ids),) for _, ids, _ in cached],
                                            num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set())
        out = types.SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                                    num_scheduled_tokens={r.request_id: 129 - c for r, _, c in new}
                                    | {r.request_id: 1 for r, _, _ in cached}, preempted_req_ids=set(preempted))
        meta = scheduler.build_connector_meta(out)
        if report is not None:
            scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=report))
        return meta

    first = request("a", "p")
    scheduler.get_num_new_matched_tokens(first, 0)
    meta = step(new=[(first, range(1, 6), 0)])
    stores = [o for batch in meta.orders for o in batch.orders if isinstance(o, StoreOrder)]
    assert stores  # its chunks go to DRAM
    scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SariaWorkerMetadata(
        completions=[CompletionReport(o.order_id, True) for o in stores])))
    second = request("b", "p")
    assert scheduler.get_num_new_matched_tokens(second, 0) == (64, False)  # the shared chunk, in-step
    scheduler.update_state_after_alloc(second, types.SimpleNamespace(get_block_ids=lambda: ([20, 21, 22, 23, 24],)), 64)
    meta = step(new=[(second, [20, 21, 22, 23, 24], 64)])
    (load,) = meta.loads
    assert not meta.orders and list(scheduler._computing) == []  # past its prompt: waits for its load's report
    step(cached=[(second, [25], 129)], preempted=["b"])  # preempted before its commit
    assert list(scheduler._computing) == ["b"] and scheduler._requests["b"].block_ids == []
    report = SariaWorkerMetadata(loads=[LoadReport("b", load.plan.plan_id, (), load.plan.num_chunks)])
    meta = step(new=[(second, [30, 31, 32, 33, 34], 64)], report=report)  # resumed (vLLM 0.34: sent in full)
    assert [batch.req_id for batch in meta.orders] == []  # the report came after this step's metadata
    meta = step(cached=[(second, [35], 130)])  # its later blocks are not followed, nor read
    (orders,) = [batch for batch in meta.orders if batch.req_id == "b"]
    assert orders.kv_blocks[second.block_hashes[3]] == (32, 33) and list(scheduler._computing) == []
    assert scheduler._requests["b"].block_ids == [30, 31, 32, 33, 34]
