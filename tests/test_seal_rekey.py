"""Recovery from a leaked key file (``saria keys rekey``), store labels, and the weights in a store's
identity: nothing derived from an old key file survives a rekey, nothing on a drive names the model
a sealed store serves, and another checkpoint of a model reads as another store."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from saria.seal import KeyFile, Keyring, new_key_file, rekey_key_file, rotate_key_file
from saria.seal.keys import LABEL_PREFIX

ROOT = Path(__file__).resolve().parent.parent
STORE_FILE = "saria-ssd-store.bin"


def saria(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", "keys", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_rekey_replaces_every_derived_value_rotate_keeps_the_names(tmp_path):
    path = tmp_path / "k"
    new_key_file(path)
    old = Keyring.load(path)
    tenant = old.tenant("acme")
    names = old.chunk_ids(tenant, b"scope", [b"h" * 32])
    label = old.store_label('{"model":"m"}')
    rotated = Keyring(rotate_key_file(path))  # routine rotation: names, labels and key id stay
    assert rotated.chunk_ids(rotated.tenant("acme"), b"scope", [b"h" * 32]) == names
    assert (rotated.store_label('{"model":"m"}'), rotated.key_id) == (label, old.key_id)
    before = KeyFile.load(path)
    fresh = rekey_key_file(path)
    assert fresh.names != before.names and set(fresh.epochs) == {3} and fresh.current == 3
    assert not set(fresh.epochs.values()) & set(before.epochs.values())
    assert os.stat(path).st_mode & 0o777 == 0o400
    new = Keyring.load(path)
    assert new.key_id != old.key_id and new.store_label('{"model":"m"}') != label
    assert new.tenant("acme") != tenant and new.chunk_ids(new.tenant("acme"), b"scope", [b"h" * 32]) != names
    assert new.tenant_of(names[0]) != tenant  # an old name unmasks to no tenant of the new file


def test_a_store_label_is_a_mac_of_the_identity_under_the_naming_root(tmp_path):
    new_key_file(tmp_path / "a")
    new_key_file(tmp_path / "b")
    a, b = Keyring.load(tmp_path / "a"), Keyring.load(tmp_path / "b")
    identity = '{"model":"Qwen/Qwen3-8B","rank":0,"tp":2}'
    label = a.store_label(identity)
    assert label.startswith(LABEL_PREFIX) and len(label) == len(LABEL_PREFIX) + 32
    assert label == Keyring.load(tmp_path / "a").store_label(identity)  # every server of the key file agrees
    assert b.store_label(identity) != label  # another key file: another store
    assert a.store_label(identity.replace('"rank":0', '"rank":1')) != label
    assert "Qwen" not in label and "rank" not in label


def test_keys_rekey_command_says_what_it_costs_in_one_line(tmp_path):
    path = tmp_path / "k"
    new_key_file(path)
    old = KeyFile.load(path)
    proc = saria("rekey", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n") == 1 and "every object sealed under the old file is a miss" in proc.stdout
    new = KeyFile.load(path)
    for secret in (old.names, new.names, *old.epochs.values(), *new.epochs.values()):
        assert secret.hex() not in proc.stdout and secret.hex()[:16] not in proc.stdout
    os.chmod(path, 0o644)
    refused = saria("rekey", str(path))
    assert refused.returncode == 2 and "has mode 0644" in refused.stderr and refused.stderr.count("\n") == 1
    help_text = " ".join(saria("rekey", "--help").stdout.split())
    assert "leaked key file" in help_text and "rotate keeps the naming root" in help_text
    top = " ".join(saria("--help").stdout.split())
    assert "saria keys rekey" in top and "Rotate or rekey" not in top  # the epilog explains both
    assert "`saria keys rekey` replaces the naming root" in top


def sealed_worker(tmp_path: Path, key: Path):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from saria.integrations.vllm.geometry import engine_geometry
    from saria.integrations.vllm.settings import ConnectorSettings
    from saria.integrations.vllm.worker import SariaWorker

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    geometry = engine_geometry(config, types.SimpleNamespace(mamba_cache_mode="none"))
    settings = ConnectorSettings.from_extra_config({"dram_bytes": 1 << 20, "ssd_paths": [str(tmp_path / "ssd")],
                                                     "ssd_bytes": 8 << 20, "log_interval_s": 0,
                                                     "secret_file": str(key)})
    worker = SariaWorker(settings, geometry, num_blocks=16, keyring=Keyring.load(key),
                         model={"model": "/models/secret-model-name", "revision": "v7"})
    worker.register_kv_caches({"l0": torch.zeros(16, 2, 32, 128, dtype=torch.bfloat16)})
    assert not worker.off and worker.data.ssd is not None
    return worker


def test_a_sealed_drive_names_no_model_and_a_rekey_wipes_it_in_one_line(tmp_path, caplog):
    key = tmp_path / "k"
    new_key_file(key)
    (tmp_path / "ssd").mkdir()
    worker = sealed_worker(tmp_path, key)
    worker.data.ssd.write(b"kb" + bytes(32), torch.ones(4096, dtype=torch.uint8)).result()
    worker.shutdown()
    drive = tmp_path / "ssd" / "rank0" / STORE_FILE
    head = drive.read_bytes()[:4096]
    assert LABEL_PREFIX.encode() in head  # the label is on the drive, the identity is not
    for clear in (b"secret-model-name", b"models", b"revision", b"rank", b"tp"):
        assert clear not in head, clear
    rotate_key_file(key)  # a rotation keeps the store: same label, the object is still there
    again = sealed_worker(tmp_path, key)
    assert len(again.data.ssd.keys()) == 1
    again.shutdown()
    stored = head[head.index(LABEL_PREFIX.encode()):].split(b"\0")[0].decode()
    rekey_key_file(key)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        third = sealed_worker(tmp_path, key)
    assert third.data.ssd.keys() == []  # every object of the old key file: gone, a clean miss
    third.shutdown()
    wiped = [r.getMessage() for r in caplog.records if "wiped" in r.getMessage()]
    assert len(wiped) == 1 and "a sealed store's identity" in wiped[0], wiped
    text = caplog.text
    assert stored not in text and stored[len(LABEL_PREFIX):] not in text and "secret-model-name" not in text


def fake_hub(tmp_path: Path, repo: str, ref: str = "main", commit: str = "a" * 40) -> Path:
    refs = tmp_path / "hub" / f"models--{repo.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / ref).write_text(commit)
    return tmp_path / "hub"


def hub_config(name: str, revision=None, download_dir=None):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=name, revision=revision, dtype=torch.bfloat16, hf_config=None),
        cache_config=types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        load_config=types.SimpleNamespace(download_dir=download_dir))


def test_a_hub_model_is_named_by_the_commit_its_cache_resolves(tmp_path):
    from saria.integrations.vllm.layout import hub_commit, model_identity

    hub = fake_hub(tmp_path, "org/model")
    assert model_identity(hub_config("org/model", None, str(hub)))["weights"] == "hub:" + "a" * 40
    fake_hub(tmp_path, "org/model", commit="b" * 40)  # the hub's main moved and this server fetched it
    assert model_identity(hub_config("org/model", None, str(hub)))["weights"] == "hub:" + "b" * 40
    fake_hub(tmp_path, "org/model", ref="v2", commit="c" * 40)
    assert hub_commit("org/model", "v2", str(hub)) == "hub:" + "c" * 40
    assert hub_commit("org/model", "d" * 40, str(hub)) == "hub:" + "d" * 40  # a pinned commit names itself
    assert hub_commit("org/other", None, str(hub)) == ""  # not in this cache: unknown, the name stays
    assert hub_commit("org/model", "../../etc", str(hub)) == "" and hub_commit("org/model", "..", str(hub)) == ""
    fake_hub(tmp_path, "org/junk", commit="not a commit")
    assert hub_commit("org/junk", None, str(hub)) == ""
    refs = hub / "models--org--linked" / "refs"
    refs.mkdir(parents=True)
    (tmp_path / "elsewhere").write_text("e" * 40)
    (refs / "main").symlink_to(tmp_path / "elsewhere")  # a planted link is not followed
    assert hub_commit("org/linked", None, str(hub)) == ""
    fifo_refs = hub / "models--org--fifo" / "refs"
    fifo_refs.mkdir(parents=True)
    os.mkfifo(fifo_refs / "main")  # never blocks the start
    assert hub_commit("org/fifo", None, str(hub)) == ""


def test_a_local_directory_keeps_its_weight_file_digest(tmp_path):
    from saria.integrations.vllm.layout import model_identity

    (tmp_path / "model.safetensors").write_bytes(b"w" * 10)
    ident = model_identity(hub_config(str(tmp_path), None, str(tmp_path / "hub")))
    assert ident["weights"] and not ident["weights"].startswith("hub:")
