"""The demo and test harness: real vLLM engines running agent sessions, with or without saria.

* ``model``: small models with real random weights, and a tokenizer for them;
* ``workload``: agent sessions as token-id prompts (from a trace, or a synthetic agent loop);
* ``run``: :func:`run_session` (one session through one ``vllm.LLM``), :func:`run_in_subprocess`
  (the same in a fresh process: vLLM keeps process-wide state); ``llm`` drives the engine;
* ``faults``: test faults (injected exceptions, slowed packs, corrupted SSD objects);
* ``compare``: saria's outputs held against plain vLLM's reference.

Nothing in saria's serving path imports this package.
"""

from saria.harness.compare import compare_outputs
from saria.harness.faults import FAULT_TARGETS, corrupt_ssd, patch_faults
from saria.harness.model import VOCAB, build_lora, build_model, build_tokenizer
from saria.harness.run import SessionResult, TurnResult, run_in_subprocess, run_session
from saria.harness.workload import synthetic_session, trace_session

__all__ = ["FAULT_TARGETS", "SessionResult", "TurnResult", "VOCAB", "build_lora", "build_model", "build_tokenizer",
           "compare_outputs", "corrupt_ssd", "patch_faults", "run_in_subprocess", "run_session",
           "synthetic_session", "trace_session"]
