"""Replaying a saria run's history through plain vLLM with the reference connector.

A saria run's result says, per prompt, how many tokens saria reused (``cached_tokens``) and, with
``audit_kv``, the digest of every page it reloaded (``worker.audit.served``, per rank under
TP/PP). :func:`reference_job` turns that into a job for :class:`~.reference.ReferenceConnector`;
:func:`replay` runs a job's prompts through an engine that has it, in the same order and the same
batches, each loading exactly what saria's run reused; optionally each turn is first computed in
full without the connector's help (``baseline``: the time-to-first-token baseline of plain vLLM).

Two ways to run a job: in a fresh process (``run_in_subprocess(dict(spec, reference=job))``, one
engine start, what ``saria demo`` does), or in a :class:`ReferenceEngine`, one engine process that
replays job after job (what the engine tests share: one engine start for every run they compare).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from saria.harness.engine import ENGINE_DEFAULTS

CONNECTOR = {"kv_connector": "ReferenceConnector", "kv_connector_module_path": "saria.harness.reference",
             "kv_role": "kv_both"}
DONE = "saria-reference: job done"
_histories = itertools.count()


def reference_job(*runs: Mapping[str, Any], baseline: bool = False, turns: int | None = None) -> dict[str, Any]:
    """The job that replays ``runs`` (saria ``SessionResult`` dicts of one history: a server and
    the same server restarted on its drives, say) one after another: per prompt the tokens it
    reused, per rank the audit's digests of the pages it served, in order (none without
    ``audit_kv``). ``turns``: replay only that many prompts (from the first run's first)."""
    loads: list[int] = []
    picks: list[dict[str, list]] = []
    sizes = {run.get("block_size") for run in runs} - {0, None}
    if len(sizes) > 1:
        raise ValueError(f"runs of one history page by one block size, not {sorted(sizes)}")
    for run in runs:
        loads += [t["cached_tokens"] for t in run["turns"]]
        snapshots = run.get("ranks") or [run.get("worker") or {}]
        for rank, snapshot in enumerate(snapshots):
            if rank == len(picks):
                picks.append({})
            for chunk, served in (snapshot.get("audit", {}).get("served") or {}).items():
                picks[rank].setdefault(chunk, []).extend(served)
    job = {"loads": loads[:turns], "picks": picks if any(picks) else None, "baseline": baseline}
    if sizes:
        job["block_size"] = sizes.pop()
    return job


def check_job(job: Mapping[str, Any], prompts: Sequence[Sequence[int]], block_size: int) -> None:
    """ValueError unless ``job`` can replay ``prompts`` on an engine with ``block_size``-token blocks."""
    if job.get("block_size") not in (None, block_size):
        raise ValueError(f"the run paged its KV by {job['block_size']} tokens, the reference engine by {block_size}: "
                         "a replay must run the same engine")
    loads = job.get("loads")
    if not isinstance(loads, list) or len(loads) != len(prompts):
        raise ValueError(f"a reference job needs one load per prompt: {len(prompts)} prompts, loads {loads!r}")
    for i, (load, prompt) in enumerate(zip(loads, prompts)):
        if not isinstance(load, int) or load < 0 or load % block_size or load >= len(prompt):
            raise ValueError(f"prompt {i}: cannot load {load!r} of its {len(prompt)} tokens in {block_size}-token "
                             "blocks (whole blocks, fewer than the prompt)")


def replay(llm: Any, prompts: Sequence[Sequence[int]], job: Mapping[str, Any], *, max_tokens: int,
           batches: Sequence[int] | None = None, progress: bool = False,
           sampling: dict | None = None, loras: list[str | None] | None = None) -> dict[str, Any]:
    """Run ``job`` on ``llm`` (an engine with the reference connector): the ``turns`` (each prompt
    loading ``job["loads"]`` tokens, keeping what it computes), the ``baseline`` turns (each
    computed in full first, when ``job["baseline"]``), and the connector's counters per rank
    (``reference``). ``sampling``: more of vLLM's ``SamplingParams``, and ``loras``: per prompt its
    LoRA adapter's directory or None, as the run had them."""
    from vllm.inputs import TokensPrompt

    from saria.harness.llm import lora_requests, sampling_params, turn_result
    from saria.harness.reference import reference_snapshot

    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    check_job(job, prompts, block_size)
    adapters = lora_requests(loras, len(prompts))
    batches = list(batches) if batches is not None else [1] * len(prompts)
    if sum(batches) != len(prompts) or min(batches, default=1) < 1:
        raise ValueError(f"batches {batches} must be positive and add up to the {len(prompts)} prompts")
    history = f"h{os.getpid()}-{next(_histories)}"
    before = _counters(llm, reference_snapshot)  # an engine replays job after job: report this job's

    def params(load: int, save: bool) -> Any:
        kv = {"load_tokens": load, "save": save, "history": history}
        if job.get("picks"):
            kv["picks"] = job["picks"]
        return sampling_params(max_tokens, sampling, extra_args={"kv_transfer_params": kv})

    out: dict[str, Any] = {"turns": [], "baseline": [], "block_size": block_size}
    first = 0
    for size in batches:
        group = list(range(first, first + size))
        first += size
        if job.get("baseline"):
            for i in group:  # full recomputation, one prompt at a time: what plain vLLM's TTFT is
                t0 = time.perf_counter()
                (res,) = llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i]))], params(0, False),
                                      use_tqdm=False, lora_request=adapters[i])
                out["baseline"].append(asdict(turn_result(res, len(prompts[i]), time.perf_counter() - t0)))
        t0 = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=list(prompts[i])) for i in group],
                               [params(job["loads"][i], True) for i in group], use_tqdm=False,
                               lora_request=[adapters[i] for i in group])
        wall = time.perf_counter() - t0
        for i, res in zip(group, results):
            out["turns"].append(asdict(turn_result(res, len(prompts[i]), wall)))
            if progress:
                print(f"  reference turn {i + 1}/{len(prompts)}: {job['loads'][i]} tokens loaded", flush=True)
    out["reference"] = [{name: value if name == "versions_max" else value - was.get(name, 0)
                         for name, value in now.items()} for was, now in zip(before, _counters(llm, reference_snapshot))]
    return out


def _counters(llm: Any, snapshot: Any) -> list[dict[str, int]]:
    """The reference connector's counters of every worker rank."""
    parallel = llm.llm_engine.vllm_config.parallel_config.world_size > 1
    if parallel or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return llm.collective_rpc(snapshot)
    return [snapshot()]


# --- one engine, many jobs -------------------------------------------------------------------------

class ReferenceEngine:
    """A vLLM engine with the reference connector in a process of its own, replaying job after job
    (:meth:`replay`). ``spec``: the engine's arguments as :func:`~saria.harness.run.run_session`
    takes them (``model``, ``max_tokens``, ``block_size``, ``max_model_len``, ``enforce_eager``,
    ``tensor_parallel_size``, ``pipeline_parallel_size``, ``num_gpu_blocks``, ``engine_args``); prompts come with each job.
    The process starts at the first job and ends with :meth:`close`."""

    ENGINE_KEYS = ("model", "block_size", "max_model_len", "enforce_eager", "tensor_parallel_size",
                   "pipeline_parallel_size", "num_gpu_blocks", "engine_args")

    def __init__(self, spec: Mapping[str, Any], *, timeout: float = 900):
        self.spec = dict(spec)
        self.timeout = timeout
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._proc: subprocess.Popen | None = None
        self._log: Any = None
        self._jobs = itertools.count()

    def _start(self) -> subprocess.Popen:
        """The engine process, started at the first job."""
        from saria.harness.engine import engine_env

        if self._proc is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="saria-reference-")
            tmp = Path(self._tmp.name)
            ranks = self.spec.get("tensor_parallel_size", 1) * self.spec.get("pipeline_parallel_size", 1)
            engine = dict(ENGINE_DEFAULTS, **{k: self.spec[k] for k in self.ENGINE_KEYS if k in self.spec})
            if engine["block_size"] is None:  # vLLM's choice
                del engine["block_size"]
            (tmp / "engine.json").write_text(json.dumps(engine))
            self._log = open(tmp / "log", "w")
            self._proc = subprocess.Popen([sys.executable, "-m", "saria.harness.reference_runs",
                                           str(tmp / "engine.json")], env=engine_env(ranks, tmp),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
        return self._proc

    def replay(self, prompts: Sequence[Sequence[int]], job: Mapping[str, Any], *,
               batches: Sequence[int] | None = None, max_tokens: int | None = None,
               loras: Sequence[str | None] | None = None) -> dict[str, Any]:
        """``job`` (:func:`reference_job`) over ``prompts`` (``loras``: per prompt its LoRA adapter,
        as :func:`replay`): the result of :func:`replay`."""
        proc = self._start()
        out = Path(self._tmp.name) / f"job-{next(self._jobs)}.json"
        line = json.dumps({"prompts": [list(p) for p in prompts], "job": dict(job), "batches": batches,
                           "max_tokens": max_tokens or self.spec.get("max_tokens", 8),
                           "sampling": self.spec.get("sampling"), "loras": None if loras is None else list(loras),
                           "out": str(out)})
        if proc.poll() is not None:
            raise RuntimeError(f"the reference engine exited ({proc.returncode}):\n{self._tail()}")
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        watchdog = threading.Timer(self.timeout, proc.kill)
        watchdog.start()
        try:
            for text in proc.stdout:
                if text.startswith(DONE):
                    break
        finally:
            watchdog.cancel()
        if not out.exists():
            raise RuntimeError(f"the reference engine failed a job:\n{self._tail()}")
        result = json.loads(out.read_text())
        if "error" in result:
            raise ValueError(result["error"])
        return result

    def _tail(self) -> str:
        self._log.flush()
        return (Path(self._tmp.name) / "log").read_text()[-6000:]

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        self._tmp.cleanup()
        self._proc = None

    def __enter__(self) -> "ReferenceEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """The engine process of :class:`ReferenceEngine`: one job per line on stdin."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m saria.harness.reference_runs ENGINE.json  (jobs on stdin)", file=sys.stderr)
        return 2
    from saria.harness.engine import open_llm

    done = os.fdopen(os.dup(1), "w")  # the caller reads job ends here; whatever else prints goes to the log
    os.dup2(2, 1)
    engine = json.loads(Path(argv[0]).read_text())
    if engine.get("num_gpu_blocks") is not None:
        engine["num_gpu_blocks_override"] = engine.pop("num_gpu_blocks")
    engine.update(engine.pop("engine_args", None) or {})
    llm = open_llm(**dict(engine, kv_transfer_config=CONNECTOR))
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = replay(llm, request["prompts"], request["job"], max_tokens=request["max_tokens"],
                            sampling=request.get("sampling"), loras=request.get("loras"),
                            batches=request["batches"])
        except ValueError as exc:  # a job that cannot replay: the caller's error, the engine stays up
            result = {"error": str(exc)}
        Path(request["out"]).write_text(json.dumps(result))
        print(DONE, file=done, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
