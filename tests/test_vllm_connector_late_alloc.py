"""vLLM 0.33 and 0.34 may allocate a request's blocks (``update_state_after_alloc``) passes after
saria offered it a load, or never: HiSparse defers the call to ``update_from_output``, and
``--max-num-inflight-kv-loads`` leaves the request waiting, asked again next step (docs/vllm.md,
"Supported vLLM versions"). The scheduler half through its hooks, as vLLM calls them there: a load
is sent only in the metadata after its allocation, nothing is cancelled that vLLM does not wait
for, and a plan offered to a request asked again, or ended before its allocation, is released."""

from __future__ import annotations

from test_vllm_connector_faults import CHUNK, blocks_of, engine  # noqa: F401  (engine: a fixture)


def pins(engine, chunk: bytes) -> int:
    return engine.guard.inner.control.chunk_info(chunk).kv.dram_pins


def test_a_load_allocated_passes_later_is_sent_then_and_only_then(engine):
    engine.cache("r1", 2)
    r2 = engine.request("r2", 3)
    assert engine.guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
    for _ in range(2):  # steps while vLLM has deferred the allocation: no load, no cancel
        meta = engine.step()
        assert not meta.loads and not meta.cancels
    engine.guard.update_state_after_alloc(r2, blocks_of(engine.blocks(7)), 2 * CHUNK)
    (load,) = engine.step().loads
    assert load.req_id == "r2" and load.plan.chunk_hashes == (b"b1", b"b3")
    assert engine.guard.stats()["faults"] == 0


def test_a_request_asked_again_without_its_allocation_holds_one_plan(engine):
    engine.cache("r1", 2)
    r2 = engine.request("r2", 3)
    for _ in range(3):  # offered, never allocated, asked again next step
        assert engine.guard.get_num_new_matched_tokens(r2, 0) == (2 * CHUNK, True)
        assert pins(engine, b"b1") == pins(engine, b"b3") == 1
        meta = engine.step()
        assert not meta.loads and not meta.cancels
    engine.guard.request_finished(r2, [])  # it ends (aborted) before vLLM allocated it: the plan goes
    assert pins(engine, b"b1") == pins(engine, b"b3") == 0
    assert engine.guard.stats()["faults"] == 0
