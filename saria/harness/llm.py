"""Driving one ``vllm.LLM`` for a session: a turn's result from vLLM's output, primed and aborted
turns, emptying vLLM's prefix cache, idle gaps, and each worker rank's saria counters."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int  # reused (vLLM's num_cached_tokens: saria's loads, or its own prefix cache)
    dram_tokens: int  # of those, loaded from saria's DRAM tier
    ssd_tokens: int  # of those, loaded from saria's SSD tier
    output_tokens: list[int]
    logprobs: list[float]
    ttft_s: float
    ranks: list[dict[str, int]] = field(default_factory=list)  # per worker rank: bytes loaded per tier this turn
    cluster_tokens: int = 0  # of the reused tokens, loaded from the cluster tier


def rank_snapshot(worker: Any = None) -> dict[str, Any]:
    """This worker process's saria counters (``SariaWorker.snapshot``) with its rank: run on every
    worker by ``LLM.collective_rpc`` (vLLM passes its worker object, unused)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    saria = getattr(get_kv_transfer_group(), "_worker", None) if has_kv_transfer_group() else None
    if saria is None:
        return {}
    out = saria.snapshot()
    out["layout"] = {"rank": saria.layout.rank, "shards": saria.layout.shards,
                     "kv_bytes_per_token": saria.geometry.kv_bytes_per_token}
    return out


class SnapshotExtension:
    """A vLLM worker extension (``--worker-extension-cls saria.harness.llm.SnapshotExtension``):
    ``collective_rpc("saria_snapshot")`` returns :func:`rank_snapshot` of every rank, JSON only (no
    pickled function), so a server under test answers it too, through vLLM's development endpoint
    (``VLLM_SERVER_DEV_MODE=1``: ``POST /collective_rpc {"method": "saria_snapshot"}``; never in
    production: it runs methods on the workers)."""

    def saria_snapshot(self) -> dict[str, Any]:
        return rank_snapshot(self)


def rank_loads(snapshots: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Bytes each rank has loaded so far, per tier."""
    return [{"dram": s.get("engine", {}).get("dram_to_gpu_bytes", 0), "ssd": s.get("engine", {}).get("ssd_to_gpu_bytes", 0),
             "kv_bytes_per_token": s.get("layout", {}).get("kv_bytes_per_token", 0)} for s in snapshots]


def connectors(llm: Any) -> tuple[Any | None, Any | None]:
    """(scheduler-side, worker-side) SariaConnector when the engine runs in this process."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:  # multiprocess engine: the connectors live in the engine process
        return None, None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return scheduler, (get_kv_transfer_group() if has_kv_transfer_group() else None)


def generate_and_abort(llm: Any, prompt: list[int], params: Any, name: str) -> Any:
    """Run ``prompt`` until its first output token, then abort it (as a client that went away):
    the output so far."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    streaming = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, logprobs=1, detokenize=False,
                               output_kind=RequestOutputKind.CUMULATIVE)
    engine.add_request(name, TokensPrompt(prompt_token_ids=prompt), streaming)
    while True:
        for out in engine.step():
            if out.request_id == name and out.outputs and out.outputs[0].token_ids:
                if not out.finished:
                    engine.abort_request([name])
                return out


def prime_cache(llm: Any, prefix: list[int]) -> None:
    """Put ``prefix`` into vLLM's (emptied) prefix cache by running it alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=prefix)], SamplingParams(max_tokens=1, temperature=0.0,
                                                                         detokenize=False), use_tqdm=False)


def primed_turn(llm: Any, prompt: list[int], count: int, params: Any) -> TurnResult:
    """``prompt`` run from an emptied prefix cache primed with its first ``count`` tokens."""
    from vllm.inputs import TokensPrompt

    empty_prefix_cache(llm)
    if count:
        prime_cache(llm, prompt[:count])
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return turn_result(out, len(prompt), time.perf_counter() - t0)


def sampling_params(max_tokens: int, sampling: dict | None = None, **more: Any) -> Any:
    """The sampling parameters of every turn the harness runs: greedy, one logprob per token, no
    detokenization (no tokenizer), overridden by ``sampling`` (more of vLLM's ``SamplingParams``,
    as JSON: ``n``, ``seed``, ``temperature``, ``prompt_logprobs``, ``structured_outputs`` as a dict
    of vLLM's ``StructuredOutputsParams``, ...)."""
    from vllm import SamplingParams

    options = dict({"max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1, "detokenize": False},
                   **(sampling or {}), **more)
    if isinstance(options.get("structured_outputs"), dict):
        from vllm.sampling_params import StructuredOutputsParams

        options["structured_outputs"] = StructuredOutputsParams(**options["structured_outputs"])
    return SamplingParams(**options)


def lora_requests(loras: list[str | None] | None, count: int) -> list[Any]:
    """Per prompt, vLLM's ``LoRARequest`` for the adapter directory ``loras[i]`` (None: the base
    model): one name and id per directory, in order of first use."""
    if loras is None:
        return [None] * count
    if len(loras) != count:
        raise ValueError(f"loras needs one adapter directory (or None) per prompt: {count} prompts, {len(loras)} given")
    from vllm.lora.request import LoRARequest

    ids: dict[str, int] = {}
    for path in loras:
        if path is not None:
            ids.setdefault(path, len(ids) + 1)
    return [None if p is None else LoRARequest(f"adapter-{ids[p]}", ids[p], p) for p in loras]


def turn_result(out: Any, prompt_tokens: int, wall: float, dram: int = 0, ssd: int = 0,
                 ranks: list[dict[str, int]] | None = None, cluster: int = 0) -> TurnResult:
    """One request's ``TurnResult`` from vLLM's ``RequestOutput`` (``wall``: the time to first token
    when vLLM reports none). With several completions (``n``), their tokens and logprobs one after
    another, in vLLM's index order."""
    completions = sorted(out.outputs, key=lambda c: c.index)
    tokens = [t for c in completions for t in c.token_ids]
    logprobs = [next(iter(lp.values())).logprob if lp else 0.0 for c in completions for lp in c.logprobs or []]
    ttft = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics is not None else 0.0
    return TurnResult(prompt_tokens, out.num_cached_tokens or 0, dram, ssd, tokens, logprobs,
                      ttft if ttft > 0 else wall, list(ranks or []), cluster)


def empty_prefix_cache(llm: Any, timeout_s: float = 60.0) -> None:
    """Empty vLLM's prefix cache. vLLM refuses while any block is in use, and after a turn saria
    may still hold a finished request's blocks for its stores (freed in a later step): step the
    engine (in this process; a separate engine process steps by itself) until it succeeds."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's prefix cache could not be emptied within {timeout_s:g} s: blocks still held")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            llm.llm_engine.step()
        else:
            time.sleep(0.02)


def idle(llm: Any, guard: Any, seconds: float, *, until_done: bool = False) -> None:
    """An idle gap between turns: step the engine (in this process) while saria has work pending,
    as a serving engine's loop does (``has_pending_push_work``), else sleep. ``until_done``: end
    as soon as nothing is pending (``seconds`` is then a bound)."""
    deadline = time.monotonic() + seconds
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    while time.monotonic() < deadline:
        if until_done and not (in_process and guard is not None and guard.has_pending_work()):
            return
        if in_process and guard is not None and guard.has_pending_work():
            llm.llm_engine.step()
            time.sleep(0.001)  # an empty step is pure Python: give saria's copy threads the GIL between steps
        else:
            time.sleep(0.01)
