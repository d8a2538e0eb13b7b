"""Cache hints end to end through ``saria serve``: an application sends ``pin``, ``retain_s``,
``next_turn_s`` and ``done`` (and OpenAI's ``prompt_cache_key`` / ``prompt_cache_retention``)
in the OpenAI client's ``extra_body``, as docs/vllm.md shows, and the server's ``/metrics`` and
the prompt tokens it reports cached show that each took effect.

One real server (vLLM's OpenAI server with saria, the small model with a real tokenizer) with a
DRAM tier of 24 chunks, an SSD tier, ``theta_E`` 2 (Eq. 1 admits no chunk at its first
eviction) and ``audit_kv`` (every reload checked against what vLLM computed). One tenant (a
``cache_salt``) runs the scenario; a second floods DRAM, a third keeps the engine stepping with
prompts too short to store anything (an idle engine takes no steps, so it issues no prewarm):

1. ``pin: 3600`` on a system prompt S (3 chunks; the tenant's cap is 4 chunks): pinned;
2. ``pin: true`` on a 5-chunk prompt, with a malformed ``retain_s``: refused whole, counted;
   the malformed key counted and warned about without its value;
3. a session's first turn, S plus its own text, with ``prompt_cache_key`` (the session),
   ``prompt_cache_retention: "24h"`` and ``next_turn_s: 8``;
4. the flood evicts every chunk of 1-3 from DRAM: only the hints write them to SSD (Eq. 1 writes
   nothing);
5. 3 s after the first turn ended (``next_turn_s`` less ``prewarm_lead_s``, 5 s) the server
   prewarms the session's chunks from SSD into DRAM, evicting flood copies idle for ``p_tau_s``;
6. the session's second turn (``session`` and ``done``) finds its whole prefix in DRAM (none from
   SSD), and its new chunks are not stored.
"""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from saria.harness import build_model

from serve_driver import SNAPSHOT_ARGS, SNAPSHOT_ENV, Server, metric, prometheus, text

CHUNK = 64
CHUNK_BYTES = CHUNK * 4 * 2 * 2 * 64 * 2  # 4 layers, K and V, 2 KV heads, head dim 64, bf16: 128 KiB
VLLM_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--block-size", "32", "--dtype", "bfloat16",
             "--enforce-eager", "--seed", "0", "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching",
             "--enable-prompt-tokens-details"]
SALT, FLOOD_SALT, FILLER_SALT = "tenant-h-8d2f", "tenant-f-01aa", "tenant-k-77c3"
SESSION = "conv-h-5e1b"


def prompt_of(tokenizer, seed: int, chunks: int, prefix: str = "") -> str:
    """``prefix`` and word salad to between ``chunks`` full chunks and 40 tokens more."""
    words = 10
    while True:
        body = prefix + ("\n" if prefix else "") + text(seed, words)
        n = len(tokenizer(body)["input_ids"])
        if n >= chunks * CHUNK + 8:
            assert n < chunks * CHUNK + 48, (seed, chunks, n)  # a word is a few tokens
            return body
        words += 1


class Client:
    def __init__(self, server: Server, model: str):
        self.server, self.model = server, model
        self.openai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120.0)

    def complete(self, prompt: str, salt: str, hints: dict | None = None, max_tokens: int = 4):
        extra = {"cache_salt": salt, "ignore_eos": True}
        if hints is not None:
            extra["kv_transfer_params"] = hints
        r = self.openai.completions.create(model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                           extra_body=extra)
        return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens

    def metrics(self) -> dict:
        return prometheus(self.server.get("/metrics"))


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


@pytest.fixture(scope="module")
def hinted(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("serve-hints")
    model = str(build_model(root / "model", tokenizer=True))
    tokenizer = AutoTokenizer.from_pretrained(model)
    system = prompt_of(tokenizer, 11, 3)
    prompts = {"pin": system, "over_cap": prompt_of(tokenizer, 12, 5),
               "turn1": prompt_of(tokenizer, 13, 6, prefix=system),
               "floods": [prompt_of(tokenizer, 20 + i, 14) for i in range(3)]}
    prompts["turn2"] = prompts["turn1"] + "\n" + text(14, 120)
    args = [model, "--ssd-path", str(root / "ssd"), "--ssd-gb", "0.05", "--chunk-tokens", str(CHUNK),
            "--log-interval-s", "1",
            "--saria-option", f"dram_bytes={24 * CHUNK_BYTES}",
            "--saria-option", f"pin_bytes_per_tenant={4 * CHUNK_BYTES}",
            "--saria-option", "p_tau_s=1",  # the test's clock is seconds, a server's minutes
            "--saria-option", "prewarm_dram_fraction=0.5",
            "--saria-option", "audit_kv=true", *VLLM_ARGS, *SNAPSHOT_ARGS]
    out: dict = {"prompts": prompts}
    with Server(args, root / "saria.log", root / "cache", env=SNAPSHOT_ENV) as server:
        client = Client(server, model)
        try:
            out["m0"] = client.metrics()
            client.complete(prompts["pin"], SALT, {"pin": 3600})
            out["m_pin"] = client.metrics()
            client.complete(prompts["over_cap"], SALT, {"pin": True, "retain_s": "soon"})
            out["m_refused"] = client.metrics()
            out["turn1"] = client.complete(prompts["turn1"], SALT, {
                "prompt_cache_key": SESSION, "prompt_cache_retention": "24h", "next_turn_s": 8})
            ended = time.monotonic()
            for flood in prompts["floods"]:
                client.complete(flood, FLOOD_SALT)
            out["m_flood"] = client.metrics()
            # the prewarm is due 3 s after the turn ended: keep the engine stepping until it is issued
            # and a few steps more (its completion comes back with a later step)
            issued_at = None
            while time.monotonic() - ended < 60:
                client.complete("hi", FILLER_SALT, max_tokens=1)
                m = client.metrics()
                if issued_at is None and delta(m, out["m0"], "vllm:saria_hinted_prewarms_total") > 0:
                    issued_at = time.monotonic()
                if issued_at is not None and time.monotonic() - issued_at > 1.5:
                    break
                time.sleep(0.2)
            out["prewarm_after_s"] = None if issued_at is None else issued_at - ended
            out["m_warm"] = client.metrics()
            out["turn2"] = client.complete(prompts["turn2"], SALT, {"session": SESSION, "done": True})
            time.sleep(1.5)  # a store of the done turn would have completed by now
            client.complete("hi", FILLER_SALT, max_tokens=1)
            out["m_end"] = client.metrics()
            out["snapshots"] = server.snapshots()
            out["log"] = server.log()
        except BaseException:
            print(server.tail(), flush=True)
            raise
        finally:
            client.openai.close()
    return out


def test_a_pin_within_the_cap_holds_its_chunks_and_one_over_it_is_refused(hinted):
    pinned = metric(hinted["m_pin"], "vllm:saria_pinned_bytes")
    assert pinned == 3 * CHUNK_BYTES, pinned
    refused = hinted["m_refused"]
    assert delta(refused, hinted["m_pin"], "vllm:saria_pins_refused_total") == 1
    assert metric(refused, "vllm:saria_pinned_bytes") == pinned  # refused whole, never an error to the request
    assert metric(hinted["m_end"], "vllm:saria_pinned_bytes") == pinned


def test_a_malformed_hint_is_counted_and_warned_about_without_its_value(hinted):
    assert delta(hinted["m_refused"], hinted["m_pin"], "vllm:saria_hints_malformed_total") == 1
    saria_lines = [line for line in hinted["log"].splitlines() if "saria" in line]
    assert any("malformed or unknown cache hint" in line for line in saria_lines)
    for line in saria_lines:
        assert "soon" not in line and SESSION not in line and SALT not in line, line


def test_only_the_hints_wrote_the_evicted_chunks_to_ssd(hinted):
    before, after = hinted["m0"], hinted["m_flood"]
    # S (pinned, 3 chunks) and the session's own 3 chunks, retained for 24 h: written at their
    # eviction, which Eq. 1 (theta_E 2) refused; it admitted nothing of the flood's
    assert delta(after, before, "vllm:saria_hinted_admissions_total") >= 6
    assert delta(after, before, "vllm:saria_admissions_total", reason="eviction") == 0
    assert delta(after, before, "vllm:saria_ssd_writes_total") >= 6


def test_the_next_turn_was_prewarmed_and_hit_dram_only(hinted):
    assert hinted["prewarm_after_s"] is not None, "no hinted prewarm was issued within 60 s"
    assert 2.0 < hinted["prewarm_after_s"] < 20.0  # due 3 s after the turn ended, at the next step
    prompt_tokens, cached = hinted["turn2"]
    turn1_tokens, _ = hinted["turn1"]
    whole = turn1_tokens // CHUNK * CHUNK
    assert whole == 6 * CHUNK and cached == whole, (cached, whole)
    before, after = hinted["m_warm"], hinted["m_end"]
    assert delta(after, before, "vllm:saria_hit_tokens_total", tier="dram") == whole
    assert delta(after, before, "vllm:saria_hit_tokens_total", tier="ssd") == 0
    assert delta(after, before, "vllm:saria_loads_failed_total") == 0
    audit = hinted["snapshots"][0]["audit"]  # every reload checked against what vLLM computed
    assert audit["mismatched_pages"] == 0 and audit["checked_pages"] > 0, audit


def test_done_ends_the_session_and_stores_nothing_of_its_last_turn(hinted):
    before, after = hinted["m_warm"], hinted["m_end"]
    assert delta(after, before, "vllm:saria_sessions_done_total") == 1
    prompt_tokens, _ = hinted["turn2"]
    assert prompt_tokens // CHUNK > 6  # the last turn had new whole chunks of its own ...
    assert delta(after, before, "vllm:saria_transfer_bytes_total", path="gpu_to_dram") == 0  # ... none stored
    assert metric(after, "vllm:saria_faults_total") == 0
    assert " ERROR " not in hinted["log"] and "Traceback" not in hinted["log"]
