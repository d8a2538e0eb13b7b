"""A ``saria serve`` server in a subprocess and an OpenAI-client driver of agent sessions against
it, for tests/test_serve.py.

* :class:`Server` starts ``python -m saria.commands.cli serve MODEL ...`` with every cache (vLLM's,
  Hugging Face's, torch's) in a temp dir, waits for ``/health`` (failing at once if the process
  dies), keeps its output in a file, and stops it (SIGINT, then SIGKILL).
* :func:`agent_sessions` runs concurrent agent sessions through ``/v1/chat/completions``: a
  system prompt and tool schemas shared by every session, a history that grows each turn. Some
  requests are cancelled mid-flight (a stream dropped after its first tokens, a request given
  up on by timeout), some prompts are longer than the model's context (vLLM must refuse them with
  a 400). Every request's :class:`Outcome` says how it ended.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

# --- the server -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a server whose workers answer Server.snapshots(): vLLM's development endpoints on (tests only)
SNAPSHOT_ARGS = ["--worker-extension-cls", "saria.harness.llm.SnapshotExtension",
                 "--no-log-error-stack"]  # (dev mode would log each refused request as an ERROR)
SNAPSHOT_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def server_env(cache: Path) -> dict[str, str]:
    """The environment of a server under test: nothing cached outside ``cache``, no network."""
    env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"), HF_HOME=str(cache / "hf"),
               XDG_CACHE_HOME=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
               TRITON_CACHE_DIR=str(cache / "triton"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", VLLM_LOGGING_COLOR="0",
               VLLM_LOG_STATS_INTERVAL="2",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               OMP_NUM_THREADS="1")  # numerics pinned: one thread in both servers (docs/numerics.md)
    env.pop("TRITON_INTERPRET", None)  # set by conftest for the kernels; the server uses the fast torch paths
    return env


@dataclass
class Server:
    args: list[str]  # after `saria serve`
    log_path: Path
    cache: Path
    port: int = field(default_factory=free_port)
    program: tuple[str, ...] = ("-m", "saria.commands.cli", "serve")  # after the interpreter, before args
    env: dict[str, str] = field(default_factory=dict)  # on top of server_env
    proc: subprocess.Popen | None = None
    started_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> "Server":
        self.cache.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, *self.program, *self.args, "--port", str(self.port),
                                      "--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT,
                                     env=dict(server_env(self.cache), **self.env), start_new_session=True)
        log.close()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while starting:\n{self.tail()}")
            if self.healthy():
                self.started_s = time.monotonic() - t0
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.read().decode()

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    def snapshots(self) -> list[dict]:
        """Every worker rank's saria snapshot (``saria.harness.llm.SnapshotExtension``: a server
        started with it and ``VLLM_SERVER_DEV_MODE=1``, :data:`SNAPSHOT_ARGS`)."""
        return self.post("/collective_rpc", {"method": "saria_snapshot"})["results"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, n: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT to the server's process group (vLLM shuts its engine down), then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` text as ``{(name, ((label, value), ...)): value}`` (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = []
        for item in filter(None, labels.rstrip("}").split('",')):
            key, _, val = item.partition("=")
            pairs.append((key.strip(","), val.strip('"')))
        out[(name, tuple(sorted(pairs)))] = float(value)
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


# --- the workload ---------------------------------------------------------------------------------

WORDS = ("agent tool file search read write result value request cache token page block chunk prefix session "
         "model python json schema path line error test build query data step plan check update").split()


def text(seed: int, words: int) -> str:
    """Deterministic word salad."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def system_prompt(tools: int = 6) -> str:
    """What every session shares: instructions and tool schemas (JSON)."""
    schemas = [{"type": "function", "function": {"name": f"tool_{i}", "description": text(100 + i, 12),
                                                 "parameters": {"type": "object", "properties": {
                                                     "path": {"type": "string", "description": text(200 + i, 6)},
                                                     "limit": {"type": "integer"}}, "required": ["path"]}}}
               for i in range(tools)]
    return "You are a coding agent. " + text(1, 60) + "\nTools:\n" + "\n".join(json.dumps(s) for s in schemas)


@dataclass
class Outcome:
    session: int
    turn: int
    kind: str  # "turn", "cancel-stream", "timeout", "too-long"
    result: str  # "completed", "refused", "aborted", or "error: ..." (a failure)
    status: int | None = None
    finish_reason: str | None = None
    output: str = ""


async def _turn(client: openai.AsyncOpenAI, model: str, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    r = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                             extra_body={"ignore_eos": True})
    return r.choices[0].message.content or "", r.choices[0].finish_reason


async def _cancelled_stream(client: openai.AsyncOpenAI, model: str, messages: list[dict]) -> str:
    """Start a long streamed answer, read a few chunks, drop the connection (vLLM aborts)."""
    stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=1000, temperature=0.0,
                                                  stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen >= 3:
            break
    await stream.close()
    return "aborted" if seen >= 3 else "completed"


async def _one(session: int, turn: int, kind: str, coro) -> Outcome:
    try:
        value = await coro
    except (asyncio.TimeoutError, asyncio.CancelledError):
        return Outcome(session, turn, kind, "aborted")
    except openai.APIStatusError as exc:
        result = "refused" if 400 <= exc.status_code < 500 else f"error: {exc.status_code} {exc.message[:200]}"
        return Outcome(session, turn, kind, result, status=exc.status_code)
    except Exception as exc:  # noqa: BLE001 - a connection error, a bad response: the test fails on it
        return Outcome(session, turn, kind, f"error: {type(exc).__name__}: {exc}"[:300])
    if isinstance(value, tuple):
        return Outcome(session, turn, kind, "completed", finish_reason=value[1], output=value[0])
    return Outcome(session, turn, kind, value)


async def agent_sessions(base_url: str, model: str, *, sessions: int = 4, turns: int = 3, max_tokens: int = 8,
                         max_model_len: int = 2048) -> list[Outcome]:
    """``sessions`` concurrent agent sessions of ``turns`` turns each: every turn a chat request
    on the shared system prompt plus the session's history (each earlier turn's tool result and
    answer). Beside the turns, per session: in turn 1 a streamed request dropped after three
    chunks (sessions 0 and 2) or a request given up on after 0.3 s (sessions 1 and 3); in turn 2
    a prompt longer than ``max_model_len`` tokens (every other session)."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120.0)
    system = {"role": "system", "content": system_prompt()}

    async def session(s: int) -> list[Outcome]:
        out: list[Outcome] = []
        history: list[dict] = []
        for t in range(turns):
            history.append({"role": "user", "content": f"tool_{(s + t) % 6} returned: " + text(1000 * s + t, 40)})
            messages = [system, *history]
            side = []
            if t == 1:
                if s % 2 == 0:
                    side.append(_one(s, t, "cancel-stream", _cancelled_stream(client, model, messages)))
                else:
                    side.append(_one(s, t, "timeout", asyncio.wait_for(
                        _turn(client, model, messages + [{"role": "user", "content": "think long"}], 1000), 0.3)))
            if t == 2 and s % 2 == 0:
                too_long = [system, {"role": "user", "content": text(5000 + s, max_model_len * 2)}]
                side.append(_one(s, t, "too-long", _turn(client, model, too_long, max_tokens)))
            main, *others = await asyncio.gather(_one(s, t, "turn", _turn(client, model, messages, max_tokens)), *side)
            out += [main, *others]
            history.append({"role": "assistant", "content": main.output or "ok"})
        return out

    try:
        results = await asyncio.gather(*(session(s) for s in range(sessions)))
    finally:
        await client.close()
    return [o for r in results for o in r]


def completions(base_url: str, model: str, prompts: list[str], *, max_tokens: int = 6,
                cache_salt: str | None = None, kv_transfer_params: list[dict] | None = None) -> list[dict]:
    """Greedy completions of ``prompts``, one after another: token ids and logprobs of each, and
    the prompt tokens the server reused (``cached_tokens``: a server started with
    ``--enable-prompt-tokens-details``, else None). ``cache_salt``: vLLM's, which keys its prefix
    cache and saria's objects (a new salt: nothing cached is reused). ``kv_transfer_params``: per
    prompt, for the server's KV connector (the reference connector's ``load_tokens``)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120.0)
    out = []
    try:
        for i, prompt in enumerate(prompts):
            extra_body = {"ignore_eos": True, "return_token_ids": True,
                          **({"cache_salt": cache_salt} if cache_salt else {}),
                          **({"kv_transfer_params": kv_transfer_params[i]} if kv_transfer_params else {})}
            r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, logprobs=1,
                                          extra_body=extra_body)
            choice = r.choices[0]
            extra = choice.model_extra or {}
            details = r.usage.prompt_tokens_details
            out.append({"token_ids": list(extra.get("token_ids") or []), "text": choice.text,
                        "logprobs": list(choice.logprobs.token_logprobs) if choice.logprobs else [],
                        "prompt_tokens": r.usage.prompt_tokens,
                        "cached_tokens": details.cached_tokens if details is not None else None})
    finally:
        client.close()
    return out
