"""The KV audit (``audit_kv``): reloaded pages are checked bit for bit against the pages vLLM
computed, by digests of vLLM's own tensors taken when a store read them. Unit tests of the digest
bookkeeping, then a real worker (real host pool and SSD store, vLLM's KV tensor stood in by a
real paged tensor) whose stored object is corrupted behind the data plane's back in DRAM: the
audit sees what saria's own checks cannot (DRAM objects carry no checksum)."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings as settings_, strategies as st

from saria.control import StoreOrder, Tier
from saria.integrations.vllm.audit import KVAudit
from saria.integrations.vllm.metadata import LoadSpec, RequestOrders, SariaConnectorMetadata
from saria.integrations.vllm.settings import ConnectorSettings
from saria.integrations.vllm.worker import SariaWorker

from test_vllm_connector_faults import BLOCK, CHUNK, GEOMETRY, KV_BYTES_PER_TOKEN, completions, plan, settings


def layers(blocks=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 2, 4, 16, generator=g).bfloat16() for _ in range(3)]


def test_pages_copied_bit_for_bit_pass_and_any_flipped_byte_in_any_layer_is_caught(caplog):
    views = layers()
    audit = KVAudit(views)
    audit.stored("c0", [1, 2])
    for v in views:  # a reload into other blocks: the same bytes
        v[5].copy_(v[1])
        v[6].copy_(v[2])
    assert audit.check("c0", [5, 6]) == 0
    raw = views[2][6].view(torch.uint8)
    raw.view(-1)[77] ^= 1  # one bit of the last layer's second page
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        assert audit.check("c0", [5, 6]) == 1
    assert "differs from the KV vLLM computed in page(s) [1] of 2" in caplog.text
    assert audit.counters() == {"stored_pages": 2, "checked_pages": 4, "mismatched_pages": 1, "unverified_pages": 0}


def test_skipped_pages_are_vllms_own_and_not_checked():
    views = layers()
    audit = KVAudit(views)
    audit.stored("c0", [1, 2])
    for v in views:
        v[6].copy_(v[2])
        v[5].zero_()  # vLLM's own page: left alone by the reload, whatever it holds
    assert audit.check("c0", [5, 6], skip=1) == 0
    assert audit.counters()["checked_pages"] == 1


def test_an_unknown_chunk_is_unverified_and_a_chunk_stored_again_adds_a_version():
    views = layers()
    audit = KVAudit(views)
    assert audit.check("never", [3, 4]) == 0
    assert audit.counters()["unverified_pages"] == 2
    audit.stored("c0", [1, 2])
    for v in views:  # version 1, kept elsewhere (as saria's SSD copy keeps it)
        v[5].copy_(v[1])
        v[6].copy_(v[2])
        v[1].add_(1.0)  # recomputed in another step, rounding differently, then stored again
    audit.stored("c0", [1, 2])
    assert audit.check("c0", [1, 2]) == 0  # the newer version (a DRAM copy)
    assert audit.check("c0", [5, 6]) == 0  # the older one (an SSD copy written before)
    audit.forget()
    assert audit.check("c0", [1, 2]) == 0 and audit.counters()["unverified_pages"] == 4


def test_a_reload_must_be_one_version_whole(caplog):
    """Pages of two versions of a chunk mixed in one reload are no version vLLM computed."""
    views = layers()
    audit = KVAudit(views)
    audit.stored("c0", [1, 2])
    for v in views:
        v[5].copy_(v[1])  # version 1's first page
        v[1].add_(1.0)
        v[2].add_(1.0)
        v[6].copy_(v[2])  # version 2's second page
    audit.stored("c0", [1, 2])
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        assert audit.check("c0", [5, 6]) == 1
    assert audit.counters()["mismatched_pages"] == 1


def test_the_audit_records_the_digests_of_what_each_reload_served_in_order():
    """``served``: what a reference run picks the version saria served by (saria.harness.reference),
    unverified reloads included (objects from before a restart)."""
    views = layers()
    audit = KVAudit(views)
    audit.stored(b"\x01\x02", [1, 2])
    first = [audit.page_digest(b).hex() for b in (1, 2)]
    assert audit.check(b"\x01\x02", [1, 2]) == 0
    for v in views:
        v[1].add_(1.0)
    audit.stored(b"\x01\x02", [1, 2])
    second = [audit.page_digest(b).hex() for b in (1, 2)]
    assert audit.check(b"\x01\x02", [1, 2], skip=1) == 0
    assert audit.check("never", [3]) == 0
    assert audit.served == {"0102": [first, [None, second[1]]], "'never'": [[audit.page_digest(3).hex()]]}


@settings_(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       st.sampled_from(["normal", "zeros", "signed-zeros", "tiny", "wide", "one-big"]))
def test_the_audits_fp8_reference_is_saria_kernels_byte_for_byte(seed, dtype, kind):
    """The audit's FP8 round trip (torch's own float8_e4m3fn cast) and saria's encoding
    (quantize_staging / dequantize_staging, held by the kernels' tests against their oracle) agree
    on every byte: two independent implementations of saria/ssd_dtype.py."""
    from saria.kernels import dequantize_staging, quantize_staging
    from saria.integrations.vllm.audit import fp8_round_trip

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 2, 4, 16, generator=g)
    if kind == "zeros":
        x[:2] = 0
    elif kind == "signed-zeros":
        x[1::2] = -0.0
    elif kind == "tiny":
        x *= 1e-4
    elif kind == "wide":
        x *= torch.exp2(torch.randint(-20, 12, x.shape, generator=g).float())
    elif kind == "one-big":
        x.view(-1)[::128] = 3e4
    page = x.to(dtype)
    kernels = dequantize_staging(quantize_staging(page.view(torch.uint8).reshape(-1), dtype), dtype).view(dtype)
    assert torch.equal(fp8_round_trip(page).view(torch.uint8).reshape(-1), kernels.view(torch.uint8).reshape(-1))


def test_under_fp8_a_chunk_from_ssd_is_checked_against_its_round_trip_and_from_dram_exactly(caplog):
    from saria.integrations.vllm.audit import fp8_round_trip

    views = layers()
    audit = KVAudit(views, ssd_fp8=True)
    audit.stored("c0", [1, 2])
    for v in views:
        v[5].copy_(fp8_round_trip(v[1]))  # what an FP8 SSD object gives back
        v[6].copy_(fp8_round_trip(v[2]))
    assert audit.check("c0", [5, 6], from_ssd=True) == 0
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        assert audit.check("c0", [5, 6]) == 2  # from DRAM it must be exact: the round trip is not
    for v in views:
        v[5].copy_(v[1])
    assert audit.check("c0", [5, 6], from_ssd=True) == 1  # exact bytes where FP8 ones belong: wrong too


def test_the_option_is_a_boolean():
    assert ConnectorSettings.from_extra_config({}).audit_kv is False
    assert ConnectorSettings.from_extra_config({"audit_kv": True}).audit_kv is True
    with pytest.raises(ValueError, match="audit_kv must be true or false"):
        ConnectorSettings.from_extra_config({"audit_kv": "yes"})


def audited_worker(tmp_path) -> SariaWorker:
    worker = SariaWorker(settings(tmp_path, audit_kv=True), GEOMETRY, num_blocks=16)
    g = torch.Generator().manual_seed(1)
    pages = torch.randn(16 * BLOCK * KV_BYTES_PER_TOKEN // 2, generator=g).bfloat16()
    worker.register_kv_caches({"l0": pages.view(16, 2, BLOCK, 2, 64)})
    assert worker.audit is not None
    return worker


def store_and_reload(worker, corrupt: bool):
    order = StoreOrder(1, ("h0",), (), CHUNK * KV_BYTES_PER_TOKEN)
    worker.wait_for_save(SariaConnectorMetadata(orders=[RequestOrders("r1", (order,), {"h0": (2, 3)})]))
    assert [c.ok for c in completions(worker, 1)] == [True]
    if corrupt:  # behind saria's back: one byte of the object in the host pool
        obj = worker.engine.dram_object("h0")
        worker.data.host_pool.views(obj.slots, obj.nbytes)[0].view(torch.uint8).view(-1)[100] ^= 0x10
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r2", plan(1, ["h0"], Tier.DRAM), ((5, 6),))]))
    assert worker.get_finished(set()) == (set(), {"r2"})
    return worker.snapshot()["audit"]


def test_a_worker_audits_each_reload_against_the_blocks_its_store_read(tmp_path):
    worker = audited_worker(tmp_path)
    counters = store_and_reload(worker, corrupt=False)
    assert counters.pop("served") == {"'h0'": [[worker.audit.page_digest(b).hex() for b in (5, 6)]]}
    assert counters == {"stored_pages": 2, "checked_pages": 2, "mismatched_pages": 0, "unverified_pages": 0}
    worker.shutdown()


def test_a_worker_audit_catches_a_page_corrupted_in_dram(tmp_path, caplog):
    worker = audited_worker(tmp_path)
    with caplog.at_level(logging.ERROR, logger="saria.vllm"):
        counters = store_and_reload(worker, corrupt=True)
    assert counters["mismatched_pages"] == 1 and counters["checked_pages"] == 2
    assert "saria audit: reloaded chunk" in caplog.text
    worker.shutdown()


def test_without_the_option_there_is_no_audit(tmp_path):
    worker = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16)
    worker.register_kv_caches({"l0": torch.zeros(16, 2, BLOCK, 2, 64, dtype=torch.bfloat16)})
    assert worker.audit is None and "audit" not in worker.snapshot()
    worker.shutdown()
