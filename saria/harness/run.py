"""Multi-turn agent sessions through real vLLM, with or without saria: what the demo and the
connector tests run.

* :func:`build_model` writes a small model with real random weights (transformers ``from_config``
  + ``save_pretrained``): a Qwen3 dense model or a Qwen3-Next hybrid (GDN) model. Real weights
  matter: wrong KV then changes tokens and logprobs, which the comparisons check.
* :func:`trace_session` turns one session of an agent trace (``hash_ids`` of 64-token blocks) into
  token-id prompts that share prefixes exactly as the trace's requests do.
* :func:`run_session` runs the prompts turn after turn through one ``vllm.LLM`` and returns each
  turn's tokens, logprobs, reused tokens by tier and time to first token.

vLLM keeps process-wide state, so each run belongs in a process of its own:
``python -m saria.harness.run SPEC.json OUT.json`` runs :func:`run_session` with the
spec's arguments and writes the results (``VLLM_*`` variables are set before vLLM is imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from saria.harness.engine import ENGINE_DEFAULTS, engine_env, open_llm
from saria.harness.faults import corrupt_ssd, patch_faults, slow_packs
from saria.harness.llm import (TurnResult, connectors, generate_and_abort, idle, prime_cache, primed_turn, rank_loads,
                               rank_snapshot, empty_prefix_cache, lora_requests, sampling_params, turn_result)

__all__ = ["SessionResult", "TurnResult", "run_in_subprocess", "run_session"]


@dataclass
class SessionResult:
    turns: list[TurnResult]
    control: dict[str, Any] = field(default_factory=dict)  # saria's control-plane counters (in-process)
    worker: dict[str, Any] = field(default_factory=dict)  # saria's data-plane counters (in-process)
    faults: dict[str, Any] = field(default_factory=dict)  # each half's faults, epoch, off (in-process)
    seconds: float = 0.0
    block_size: int = 0  # vLLM's KV block size in tokens (its own choice for hybrid models)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each worker rank's snapshot at the end
    totals: dict[str, int] = field(default_factory=dict)  # the scheduler half's counters (SchedulerGuard.totals)
    variants: list[dict[int, TurnResult]] = field(default_factory=list)  # per turn: primed prefix length -> result
    baseline: list[TurnResult] = field(default_factory=list)  # a reference's turns computed in full (its job's baseline)
    reference: list[dict[str, int]] = field(default_factory=list)  # a reference's connector counters, per rank
    block_hashes: list[list[str]] = field(default_factory=list)  # record_block_hashes: vLLM's, per request looked up
    hints: dict[str, int] = field(default_factory=dict)  # the control plane's hint counters (in-process)


def run_session(model: str, prompts: list[list[int]], *, extra_config: dict | None = None, max_tokens: int = 8,
                block_size: int | None = ENGINE_DEFAULTS["block_size"],
                max_model_len: int = ENGINE_DEFAULTS["max_model_len"], corrupt_before: list[int] = (),
                prefix_caching: bool = False, reset_prefix_cache: bool = True,
                prime: list[int] | None = None, variants: list[list[int]] | None = None,
                inject_faults: dict[str, list[int]] | None = None, progress: bool = False,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                corrupt_rank: int | None = None, enforce_eager: bool = False, batches: list[int] | None = None,
                num_gpu_blocks: int | None = None, slow_stores_s: float = 0.0,
                abort_turns: list[int] = (), gap_s: float = 0.0, settle: bool = False, kv_cache_dtype: str = "auto",
                emulate_ssd_fp8: bool | str = False, reference: dict | None = None,
                cache_salts: list[str | None] | None = None, record_block_hashes: bool = False,
                engine_args: dict | None = None, sampling: dict | None = None,
                loras: list[str | None] | None = None,
                kv_transfer_params: list[dict | None] | None = None) -> SessionResult:
    """Run ``prompts`` one turn after another through a new ``vllm.LLM`` (greedy, logprobs).
    ``extra_config``: saria's connector options, or None for plain vLLM. vLLM's own prefix cache is
    off, or (``prefix_caching``, which hybrid models need for their GDN checkpoints) emptied before
    every turn (unless ``reset_prefix_cache`` is False: the reference a hybrid model's reloads must
    match, since a GDN state computed in other step splits differs in its last bits): either way
    every reused token is saria's. ``corrupt_before``: turns before which
    every SSD object is corrupted on disk. ``block_size`` None: vLLM's choice (hybrid models).
    ``prime`` (with ``prefix_caching``): per turn, how many leading tokens of its prompt to put into
    vLLM's own (emptied) prefix cache first, by running them alone: the turn then reuses exactly
    those tokens from vLLM's cache, the same split of reused and computed tokens as a run with saria
    that reused them. ``variants`` (with ``prefix_caching``, one prompt per turn): per turn, the
    prefix lengths to run it over, each from an emptied cache primed as ``prime`` does (0: full
    recomputation); the first is the turn's result, all are in ``SessionResult.variants`` (the
    references of :func:`compare_outputs`).
    ``inject_faults``: test faults, ``{target: [turn, ...]}`` (:func:`patch_faults`); needs the
    engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``tensor_parallel_size`` /
    ``pipeline_parallel_size``: vLLM's, with worker processes (the engine runs in its own process:
    the per-turn tier split then comes from the ranks' byte counters, ``TurnResult.ranks``).
    ``corrupt_rank``: corrupt only that rank's SSD objects (``corrupt_before``). ``enforce_eager``:
    vLLM's (no graph capture: an engine starts in seconds less). ``batches``: how many consecutive
    prompts each ``generate`` call takes (default one each; a batch's reused tokens by tier are
    counted on its first turn). ``num_gpu_blocks``: vLLM's KV cache size in blocks (small: blocks are
    reused at once, and a batch may be preempted). ``slow_stores_s``: test delay, in this process:
    every pack on the transfer engine's own threads first sleeps this long, so a request's stores are
    still reading its blocks when it finishes. ``abort_turns``: turns (one prompt each) whose request
    is aborted as soon as it has its first output token (its prompt's stores just started).
    ``gap_s``: an idle gap after every turn but the last, during which the engine (in this process)
    steps whenever saria has pending work, as a server's engine does (orders completing, a prewarm
    falling due), and sleeps otherwise. ``settle``: after every turn but the last, the engine (in this
    process) steps until saria has nothing pending (every order sent and completed: the SSD writes of
    the turn's evictions ended, their DRAM copies dropped), for at most 60 s, so which tier serves the
    next turn does not depend on how loaded the machine is. ``kv_cache_dtype``: vLLM's (``auto``: the model's dtype;
    ``fp8``: vLLM's own FP8 KV cache, scales 1.0 without calibrated ones). ``emulate_ssd_fp8``: every
    kv object saria reloads from SSD goes through an FP8 round trip first: True or ``"saria"`` the
    SSD tier's format, ``"vllm"`` vLLM's FP8 KV format with scale 1.0
    (:func:`~saria.harness.fp8.emulate_fp8_ssd_reloads`; an engine in this process).
    ``reference``: instead of all that, replay a saria run's history through plain vLLM with the
    reference connector (a job of :func:`~saria.harness.reference_runs.reference_job`; with
    ``batches``, ``max_tokens`` and the engine's arguments, nothing else).
    ``cache_salts``: per prompt, vLLM's ``cache_salt`` (a tenant: vLLM folds it into the prompt's
    block hashes; with a key file saria derives the tenant's keys from it), or None for none.
    ``record_block_hashes``: keep vLLM's block hashes of every request saria looks up, hex
    (``SessionResult.block_hashes``: what must never appear in saria's files, logs or metrics; an
    engine in this process). ``engine_args``: more of vLLM's engine arguments, as given
    (``speculative_config``, ``max_num_batched_tokens``, ...); a reference replaying the run
    passes the same ones. ``sampling``: more of vLLM's ``SamplingParams`` for every turn (JSON:
    ``n``, ``seed``, ``temperature``, ``prompt_logprobs``, ...; :func:`~saria.harness.llm.sampling_params`),
    a reference's too. ``loras``: per prompt, a LoRA adapter's directory or None (the base model;
    the engine needs ``engine_args`` ``enable_lora``). ``kv_transfer_params``: per prompt, what its
    request carries in ``SamplingParams(extra_args={"kv_transfer_params": ...})`` (saria's cache
    hints, docs/vllm.md), or None; the control plane's hint counters are in ``SessionResult.hints``."""
    from vllm.inputs import TokensPrompt

    if reference is not None:
        return _run_reference(model, prompts, reference, max_tokens=max_tokens, block_size=block_size,
                              max_model_len=max_model_len, enforce_eager=enforce_eager, batches=batches,
                              prefix_caching=prefix_caching, extra_config=extra_config, variants=variants,
                              prime=prime, tensor_parallel_size=tensor_parallel_size,
                              pipeline_parallel_size=pipeline_parallel_size, progress=progress,
                              num_gpu_blocks=num_gpu_blocks, engine_args=engine_args, sampling=sampling,
                              loras=loras)

    if prime is not None and variants is not None:
        raise ValueError("give prime or variants, not both")
    if prime is not None:
        variants = [[count] for count in prime]
    if variants is not None and (not prefix_caching or extra_config is not None or len(variants) != len(prompts)
                                 or not all(variants)):
        raise ValueError("prime or variants need prefix_caching, no saria connector, and counts for every prompt")
    if variants is not None and any(not 0 <= c < len(p) for counts, p in zip(variants, prompts) for c in counts):
        raise ValueError("a primed prefix must be shorter than its prompt")
    if cache_salts is not None and (len(cache_salts) != len(prompts) or variants is not None or abort_turns):
        raise ValueError("cache_salts needs one salt (or None) per prompt, and no prime, variants or abort_turns")
    salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
    adapters = lora_requests(loras, len(prompts))
    if loras is not None and (variants is not None or abort_turns):
        raise ValueError("loras runs every turn through generate: no prime, variants or abort_turns")

    def prompt_of(i: int) -> Any:
        return TokensPrompt(prompt_token_ids=prompts[i], **({"cache_salt": salts[i]} if salts[i] is not None else {}))

    kwargs: dict[str, Any] = dict(engine_args or {})
    if extra_config is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "SariaConnector",
                                        "kv_connector_module_path": "saria.integrations.vllm",
                                        "kv_role": "kv_both", "kv_connector_extra_config": extra_config}
    if block_size is not None:
        kwargs["block_size"] = block_size
    if num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_gpu_blocks
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    batches = list(batches) if batches is not None else [1] * len(prompts)
    if sum(batches) != len(prompts) or min(batches, default=1) < 1:
        raise ValueError(f"batches {batches} must be positive and add up to the {len(prompts)} prompts")
    if variants is not None and max(batches, default=1) > 1:
        raise ValueError("prime and variants run one prompt per turn: batches must all be 1")
    starts = {sum(batches[:i]): size for i, size in enumerate(batches)}
    if any(starts.get(turn) != 1 for turn in abort_turns):
        raise ValueError(f"abort_turns {list(abort_turns)} must name turns of one prompt each")
    parallel = tensor_parallel_size * pipeline_parallel_size > 1
    kwargs.update(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    llm = open_llm(model, max_model_len=max_model_len, prefix_caching=prefix_caching, enforce_eager=enforce_eager,
                   **kwargs)
    ranks = (lambda: rank_loads(llm.collective_rpc(rank_snapshot))) if parallel and extra_config is not None else None
    params = sampling_params(max_tokens, sampling)
    if kv_transfer_params is not None and (len(kv_transfer_params) != len(prompts) or abort_turns or variants):
        raise ValueError("kv_transfer_params needs one entry (or None) per prompt, and no abort_turns or variants")

    def params_of(i: int) -> Any:
        kv = kv_transfer_params[i] if kv_transfer_params is not None else None
        return params if kv is None else sampling_params(max_tokens, sampling, extra_args={"kv_transfer_params": kv})

    scheduler_side, worker_side = connectors(llm) if extra_config is not None else (None, None)
    guard = getattr(scheduler_side, "_scheduler", None)  # SchedulerGuard; guard.inner: the current SariaScheduler
    arm, restore = (None, None)
    if inject_faults:
        if guard is None:
            raise ValueError("inject_faults needs saria in an engine in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        arm, restore = patch_faults(inject_faults)
    if slow_stores_s:
        if guard is None:
            raise ValueError("slow_stores_s needs saria in an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        restore = slow_packs(slow_stores_s, restore)
    if settle and extra_config is not None and guard is None:
        raise ValueError("settle needs saria in an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if emulate_ssd_fp8:
        if guard is None:
            raise ValueError("emulate_ssd_fp8 needs saria in an engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        from saria.harness.fp8 import emulate_fp8_ssd_reloads

        restore = emulate_fp8_ssd_reloads(restore, fmt="saria" if emulate_ssd_fp8 is True else emulate_ssd_fp8)
    result = SessionResult([], block_size=llm.llm_engine.vllm_config.cache_config.block_size)
    if record_block_hashes:
        if guard is None:
            raise ValueError("record_block_hashes needs saria in an engine in this process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        _record_block_hashes(scheduler_side, result.block_hashes)
    start = time.perf_counter()
    first = 0
    for size in batches:
        turn, group = first, prompts[first:first + size]
        first += size
        if turn in corrupt_before and extra_config is not None:
            corrupt_ssd(extra_config.get("ssd_paths", []), rank=corrupt_rank)
        if variants is not None:  # the other variants first; the turn's result is the first one
            result.variants.append({})
            for count in variants[turn][1:]:
                result.variants[turn][count] = primed_turn(llm, prompts[turn], count, params)
        if prefix_caching and reset_prefix_cache:
            empty_prefix_cache(llm)
        if variants is not None and variants[turn][0]:
            prime_cache(llm, prompts[turn][:variants[turn][0]])
        before = guard.totals() if guard else None
        if arm is not None:
            arm(turn)
        loaded = ranks() if ranks is not None else None
        t0 = time.perf_counter()
        if turn in abort_turns:
            outs = [generate_and_abort(llm, group[0], params, f"abort-{turn}")]
        else:
            outs = llm.generate([prompt_of(i) for i in range(turn, turn + size)],
                                [params_of(i) for i in range(turn, turn + size)], use_tqdm=False,
                                **({"lora_request": adapters[turn:turn + size]} if loras is not None else {}))
        wall = time.perf_counter() - t0
        dram = ssd = cluster = 0
        if guard is not None:  # tokens the loads delivered (SchedulerGuard.totals: over rebuilds too)
            after = guard.totals()
            dram = after["hit_tokens_dram"] - before.get("hit_tokens_dram", 0)
            ssd = after["hit_tokens_ssd"] - before.get("hit_tokens_ssd", 0)
            cluster = after.get("hit_tokens_cluster", 0) - before.get("hit_tokens_cluster", 0)
        per_rank = []
        if loaded is not None:  # the tier split from rank 0's byte counters (GDN state bytes count as tokens)
            per_rank = [{tier: now[tier] - was[tier] for tier in ("dram", "ssd")}
                        for was, now in zip(loaded, ranks())]
            per_token = max(1, loaded[0]["kv_bytes_per_token"])
            dram, ssd = per_rank[0]["dram"] // per_token, per_rank[0]["ssd"] // per_token
        for n, (prompt, out) in enumerate(zip(group, outs)):
            lead = n == 0  # a batch's reused tokens by tier count on its first turn
            result.turns.append(turn_result(out, len(prompt), wall, dram if lead else 0, ssd if lead else 0,
                                             per_rank if lead else None, cluster if lead else 0))
            if variants is not None:
                result.variants[turn][variants[turn][0]] = result.turns[-1]
            if progress:
                t = result.turns[-1]
                print(f"  turn {turn + n + 1:>2}/{len(prompts)}: {t.prompt_tokens:>5} prompt tokens, "
                      f"{t.cached_tokens:>5} reused (DRAM {t.dram_tokens}, SSD {t.ssd_tokens}"
                      f"{f', cluster {t.cluster_tokens}' if t.cluster_tokens else ''}), "
                      f"TTFT {t.ttft_s * 1e3:7.1f} ms", flush=True)
        if gap_s and first < len(prompts):
            idle(llm, guard, gap_s)
        if settle and guard is not None and first < len(prompts):
            idle(llm, guard, 60.0, until_done=True)
    result.seconds = time.perf_counter() - start
    worker = getattr(worker_side, "_worker", None)
    if extra_config and extra_config.get("cluster") and guard is not None:
        # a replica's last stores and their cluster puts land before it reports (and exits)
        idle(llm, guard, 60.0, until_done=True)
        if worker is not None and worker.cluster is not None:
            worker.cluster.quiesce()
    if restore is not None:
        restore()
    if guard is not None:
        result.control = asdict(guard.inner.control.counters())
        result.hints = asdict(guard.inner.control.hint_counters())
        result.totals = guard.totals()
        result.faults["scheduler"] = guard.stats()
    if worker is not None:
        result.worker = worker.snapshot()
        result.faults["worker"] = result.worker["connector"]
    if ranks is not None:
        result.ranks = llm.collective_rpc(rank_snapshot)
    return result


def _record_block_hashes(connector: Any, into: list[list[str]]) -> None:
    """Keep vLLM's block hashes (hex) of each request the scheduler half looks up (once per request)."""
    lookup, seen = connector.get_num_new_matched_tokens, set()

    def recording(request: Any, num_computed_tokens: int) -> Any:
        if request.request_id not in seen:
            seen.add(request.request_id)
            into.append([bytes(h).hex() for h in request.block_hashes])
        return lookup(request, num_computed_tokens)

    connector.get_num_new_matched_tokens = recording


def _run_reference(model: str, prompts: list[list[int]], job: dict, *, max_tokens: int, block_size: int | None,
                   max_model_len: int, enforce_eager: bool, batches: list[int] | None, prefix_caching: bool,
                   extra_config: dict | None, variants: Any, prime: Any, tensor_parallel_size: int,
                   pipeline_parallel_size: int, progress: bool, num_gpu_blocks: int | None,
                   engine_args: dict | None, sampling: dict | None, loras: list | None) -> SessionResult:
    """:func:`run_session` with ``reference``."""
    from saria.harness.reference_runs import CONNECTOR, replay

    if extra_config is not None or prefix_caching or variants is not None or prime is not None:
        raise ValueError("a reference replay runs plain vLLM with its own prefix cache off: no extra_config, "
                         "prefix_caching, variants or prime")
    kwargs: dict[str, Any] = dict(engine_args or {})
    if block_size is not None:
        kwargs["block_size"] = block_size
    if num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_gpu_blocks
    llm = open_llm(model, max_model_len=max_model_len, enforce_eager=enforce_eager, kv_transfer_config=CONNECTOR,
                   tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size, **kwargs)
    start = time.perf_counter()
    out = replay(llm, prompts, job, max_tokens=max_tokens, batches=batches, progress=progress, sampling=sampling,
                 loras=loras)
    return SessionResult([TurnResult(**t) for t in out["turns"]], seconds=time.perf_counter() - start,
                         block_size=out["block_size"], baseline=[TurnResult(**t) for t in out["baseline"]],
                         reference=out["reference"])


def run_in_subprocess(spec: dict, *, multiprocessing: bool = False, timeout: float = 900,
                      echo: str | None = None, keep_log: bool = False) -> dict:
    """:func:`run_session` in a fresh Python process (vLLM's process-wide state stays there).
    ``echo``: print the child's per-turn progress lines as they come, prefixed with ``echo``.
    ``keep_log``: the child's output in the result's ``log`` (its stdout, where vLLM's handler writes
    vLLM's and saria's log lines, then its stderr)."""
    with tempfile.TemporaryDirectory(prefix="saria-session-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(dict(spec, progress=echo is not None)))
        ranks = spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1)
        env = engine_env(ranks, Path(tmp), multiprocessing=multiprocessing)
        log_path = Path(tmp) / "log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "saria.harness.run", str(spec_path),
                                     str(out_path)], env=env, stdout=subprocess.PIPE, stderr=log, text=True)
            lines = []
            watchdog = threading.Timer(timeout, proc.kill)
            watchdog.start()
            try:
                for line in proc.stdout:
                    lines.append(line)
                    if echo is not None and line.startswith("  turn"):
                        print(echo + line.strip(), flush=True)
                proc.wait()
            finally:
                timed_out = not watchdog.is_alive()
                watchdog.cancel()
            if timed_out:
                raise TimeoutError(f"vLLM session still running after {timeout} s: killed")
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM session failed (exit {proc.returncode}):\n{''.join(lines)[-3000:]}\n"
                               f"{log_path.read_text()[-6000:]}")
        result = json.loads(out_path.read_text())
        if keep_log:
            result["log"] = "".join(lines) + log_path.read_text()  # vLLM logs to stdout, Python to stderr
        return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m saria.harness.run SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run_session(**spec)
    Path(argv[1]).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
