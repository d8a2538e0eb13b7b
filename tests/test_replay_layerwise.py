"""The replay's layer-wise reload model (issue 34, saria.replay.layerwise): the FLOPs and the step's
end on hand-computed numbers (the issue's own example among them), its bounds against the
sequential model and a layer-by-layer simulation, the replays that use it, and the command line
that shows TTFT with and without it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.config import Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig
from saria.models import get_model
from saria.orders import DRAM, SSD, ReloadPlan
from saria.replay.arrivals import make_schedule
from saria.replay.experiment import open_trace
from saria.replay.fleet import FleetSettings, replay_fleet
from saria.replay.layerwise import (DEVICES, StepModel, exposed_seconds, layerwise_end, prefill_flops,
                                    sequential_end)
from saria.replay.policies import BaseSettings, build_config, parse_policy
from saria.replay.replay import ReplaySettings, replay
from saria.replay.traces import Request, Trace, chunk_keys

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
QWEN3_8B = get_model("qwen3-8b")
H100 = DEVICES["h100"]
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ================================================================================== FLOPs and profiles
def test_prefill_flops_of_qwen3_8b_by_hand():
    # linear: 2 x 36 layers x (4096 x (4096 + 1024 + 1024) + 4096 x 4096 + 3 x 4096 x 12288) per token
    per_layer = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 12288
    assert per_layer == 192_937_984 and QWEN3_8B.compute_params == pytest.approx(36 * per_layer, rel=1e-4)
    n, p = 1024, 8192
    attention = 36 * 4 * 32 * 128 * n * (p + (n + 1) / 2)  # QK^T and PV over the reused and (causal) new tokens
    assert prefill_flops(QWEN3_8B, n, p) == pytest.approx(2 * 6.946e9 * n + attention)
    assert prefill_flops(QWEN3_8B, 0, p) == 0.0
    # the issue's per-layer estimate: a token's linear layers take ~0.73 us per layer on an H100
    us = 2 * per_layer / H100.flops_per_s * 1e6
    assert us == pytest.approx(0.73, rel=0.05)
    # the paper's 6,500 tokens/s prefill on its A30 is the same efficiency on short prompts
    tps = 512 / StepModel(6500.0, model=QWEN3_8B, device=DEVICES["a30"]).compute_seconds(512, 0)
    assert 6000 < tps < 7000
    with pytest.raises(ValueError, match=">= 0"):
        prefill_flops(QWEN3_8B, -1, 0)


def test_hybrid_flops_count_the_delta_rule_and_only_the_attention_layers():
    hybrid = get_model("qwen3.5-9b")
    n, p = 1000, 4000
    expected = (2 * 8.0e9 * n + 8 * 4 * 16 * 256 * n * (p + (n + 1) / 2) + 24 * 6 * 32 * 128 * 128 * n)
    assert prefill_flops(hybrid, n, p) == pytest.approx(expected)


def test_profiles_are_sane_and_checked():
    assert {"a30", "h100", "h200", "cpu-2c-avx2"} <= set(DEVICES)
    for profile in DEVICES.values():
        assert 0 < profile.efficiency <= 1 and profile.tflops > 0 and profile.source
    assert DEVICES["h200"].tflops == DEVICES["h100"].tflops  # the same compute, more HBM
    with pytest.raises(ValueError, match="device-efficiency"):
        ReplaySettings(device="h100", device_efficiency=1.5, model="qwen3-8b")
    with pytest.raises(ValueError, match="unknown device"):
        ReplaySettings(device="tpu", model="qwen3-8b")
    with pytest.raises(ValueError, match="needs --device"):
        ReplaySettings(device_efficiency=0.5, model="qwen3-8b")
    with pytest.raises(ValueError, match="need the model"):
        ReplaySettings(layerwise=True)


# ======================================================================================== the step's end
def test_the_issues_example_on_its_own_per_layer_figures():
    """Issue 34: a layer's load P x 82 ns, its compute N x 0.73 us, 36 layers, P = 8K, N = 1K."""
    load_layer, compute_layer = 8192 * 82e-9, 1024 * 0.73e-6
    load, compute = 36 * load_layer, 36 * compute_layer
    sequential = sequential_end(0.0, 0.0, load, compute)
    overlapped = layerwise_end(0.0, 0.0, load, 0.0, compute, 36)
    assert sequential == pytest.approx(0.05109, rel=1e-3)  # the issue says ~53 ms
    # compute-bound: the first layer's load, then 36 layers' compute (the issue says ~33 ms)
    assert overlapped == pytest.approx(load_layer + compute) == pytest.approx(0.02758, rel=1e-3)


def test_the_issues_example_from_flops_and_the_replays_bandwidth():
    """The same step from the model's FLOPs on the h100 profile and a 48 GB/s DRAM -> GPU link:
    ~61 ms sequential, ~36 ms layer-wise (the issue: ~53 and ~33; the attention FLOPs over the 8K
    prefix, which its per-token figure leaves out, make the compute longer)."""
    load = 8192 * QWEN3_8B.kv_bytes_per_token / (48 * GB)
    compute = prefill_flops(QWEN3_8B, 1024, 8192) / H100.flops_per_s
    assert load == pytest.approx(0.02517, rel=1e-3) and compute == pytest.approx(0.03580, rel=1e-3)
    step = StepModel(6500.0, layerwise=True, model=QWEN3_8B, device=H100)
    assert step.compute_seconds(1024, 8192) == pytest.approx(compute)
    overlapped = step.end(0.0, 0.0, load, 0.0, compute)
    assert overlapped == pytest.approx(load / 36 + compute)
    assert sequential_end(0.0, 0.0, load, compute) == pytest.approx(0.06097, rel=1e-3)
    assert 0.025 < overlapped < 0.045


def test_load_bound_steps_end_with_the_last_layers_compute():
    # 36 layers of 2 ms load, 0.5 ms compute: the last byte lands at 72 ms, its layer computes 0.5 ms
    assert layerwise_end(0.0, 0.0, 0.072, 0.0, 0.018, 36) == pytest.approx(0.0725)
    # the exposed part (GDN state, SSD reads) comes first, whole: 10 ms, then the same
    assert layerwise_end(0.0, 0.0, 0.082, 0.010, 0.018, 36) == pytest.approx(0.0825)
    # a busy GPU: the forward starts when it is free
    assert layerwise_end(0.0, 1.0, 0.072, 0.0, 0.018, 36) == pytest.approx(1.018)
    with pytest.raises(ValueError, match="within the load"):
        layerwise_end(0.0, 0.0, 0.01, 0.02, 0.018, 36)


def _simulated(a, g, load, exposed, compute, layers):
    """Layer by layer: layer k's bytes land at a + exposed + k l; its compute starts after them and
    after layer k-1's compute."""
    per_load, per_compute = (load - exposed) / layers, compute / layers
    done = g
    for k in range(1, layers + 1):
        done = max(done, a + exposed + k * per_load) + per_compute
    return done


seconds = st.floats(0.0, 10.0, allow_nan=False)


@FAST
@given(a=seconds, g=seconds, load=seconds, share=st.floats(0.0, 1.0), compute=seconds,
       layers=st.integers(1, 80))
def test_layerwise_is_the_layer_by_layer_pipeline_and_within_its_bounds(a, g, load, share, compute, layers):
    exposed = load * share
    end = layerwise_end(a, g, load, exposed, compute, layers)
    tol = 1e-9 * (1 + a + g + load + compute)
    assert end == pytest.approx(_simulated(a, g, load, exposed, compute, layers), abs=tol)
    assert end <= sequential_end(a, g, load, compute) + tol  # never slower than loading whole first
    # never faster than the load with one layer's compute after it, the compute, or the exposed part
    assert end >= max(a + load + compute / layers, g + compute, a + exposed + compute) - tol
    # issue 34's "first layer + sum of max(load, compute) per layer" is an upper bound
    per_load, per_compute = (load - exposed) / layers, compute / layers
    assert end <= max(g, a + exposed) + per_load + layers * max(per_load, per_compute) + tol
    if layers > 1:  # more layers, more overlap
        assert end <= layerwise_end(a, g, load, exposed, compute, layers - 1) + tol
    # one layer is loading whole first
    assert layerwise_end(a, g, load, exposed, compute, 1) == pytest.approx(sequential_end(a, g, load, compute),
                                                                            abs=tol)


def _plan(dram_bytes, ssd_bytes, state_source=None):
    return ReloadPlan(1, ("a",), (DRAM,), "a" if state_source else None, state_source, 512, dram_bytes, ssd_bytes,
                      False)


def test_exposed_part_is_ssd_reads_and_the_gdn_state():
    bw = Bandwidths()  # 48 GB/s ingress, 20 GB/s SSD, 48 GB/s DRAM
    assert exposed_seconds(_plan(48 * GB, 0), 0, bw, 1.0) == 0.0  # all DRAM: every layer's part is per layer
    assert exposed_seconds(_plan(48 * GB, 20 * GB), 0, bw, 2.4) == pytest.approx(1.0)  # SSD reads, whole
    assert exposed_seconds(_plan(48 * GB + 4.8e9, 0, DRAM), int(4.8e9), bw, 1.1) == pytest.approx(0.1)
    # a state read from SSD is in the plan's SSD bytes already; never more than the load
    assert exposed_seconds(_plan(0, 20 * GB, SSD), int(4.8e9), bw, 0.5) == 0.5


# ============================================================================================ replays
A = Request(0.0, 4 * 512 + 100, 0, (1, 2, 3, 4, 5), "s")  # 4 full chunks
B = Request(100.0, 6 * 512 + 10, 0, (1, 2, 3, 4, 6, 7, 8), "s")  # reloads A's 4 from DRAM, computes 1,034


def _hand_run(replay_settings):
    trace = Trace("hand", (A, B), 512, "synthetic")
    chunks = [chunk_keys(r, 512, 512) for r in trace.requests]
    cfg = SariaConfig(dram=Capacity(tokens=100 * 512), ssd=Capacity(tokens=1000 * 512), chunk=ChunkSpec(),
                      policy=Policy.preset("saria"))
    result = replay("p", trace, chunks, make_schedule(trace, "recorded", window_hours=1.0), cfg, replay_settings,
                    audit=True)
    assert result.audit == []
    return result


@pytest.mark.parametrize("device", [None, "h100"])
def test_a_turn_that_reloads_from_dram_by_hand(device):
    load = 4 * 512 * QWEN3_8B.kv_bytes_per_token / (48 * GB)
    step = StepModel(6500.0, model=QWEN3_8B, device=DEVICES[device] if device else None)
    compute_a, compute_b = step.compute_seconds(2148, 0), step.compute_seconds(1034, 2048)
    sequential = _hand_run(ReplaySettings(device=device, model="qwen3-8b"))
    layerwise = _hand_run(ReplaySettings(layerwise=True, device=device, model="qwen3-8b"))
    for run in (sequential, layerwise):
        assert run.ttft_s[0] == pytest.approx(compute_a) and run.transfer_s[1] == pytest.approx(load)
    assert sequential.ttft_s[1] == pytest.approx(load + compute_b)
    assert layerwise.ttft_s[1] == pytest.approx(max(load / 36 + compute_b, load + compute_b / 36))
    if device is None:  # the default step model is today's arithmetic
        assert sequential.ttft_s == _hand_run(ReplaySettings()).ttft_s


def _setup(model="qwen3-8b", dram=16_384, ssd=60_000, checkpoint=16_384):
    trace = open_trace("synth:sessions=10,prompt_tokens=6000,first_prompt_tokens=2000,shared_prefix_tokens=1024,"
                       "prefix_variants=2,seed=4")
    config = build_config(parse_policy("saria"), BaseSettings(model=model, dram_tokens=dram, ssd_tokens=ssd,
                                                              checkpoint_tokens=checkpoint))
    chunks = [chunk_keys(r, trace.block_tokens, config.chunk.chunk_tokens) for r in trace.requests]
    return trace, config, chunks, make_schedule(trace, "rewindow", window_hours=0.2, seed=4)


@pytest.mark.parametrize("model, checkpoint", [("qwen3-8b", 16_384), ("qwen3.5-9b", 2048)])
def test_one_replica_fleet_is_the_single_server_replay_layerwise_too(model, checkpoint):
    trace, config, chunks, schedule = _setup(model, checkpoint=checkpoint)
    replay_settings = ReplaySettings(layerwise=True, device="h100", model=model)
    single = replay("p", trace, chunks, schedule, config, replay_settings)
    fleet = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(), replay_settings)
    assert fleet.counters == [single.counters]
    assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(fleet.ttft_s, single.ttft_s, strict=True))
    sequential = replay("p", trace, chunks, schedule, config, ReplaySettings(device="h100", model=model))
    assert sum(single.ttft_s) < sum(sequential.ttft_s)
    assert single.counters.ssd_bytes_read > 0  # some reloads read SSD, whose reads stay exposed


# ======================================================================================= command line
SMALL = "synth:sessions=24,prompt_tokens=6000,first_prompt_tokens=2000,seed=5"
CACHE = ["--dram-tokens", "20000", "--ssd-tokens", "200000", "--window-hours", "1", "--no-progress"]


def saria(*args):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def _row(table: str, label: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(label))
    return line[len(label):].split()


def test_replay_layerwise_both_shows_ttft_with_and_without(tmp_path):
    out = tmp_path / "r.json"
    proc = saria("replay", SMALL, *CACHE, "--policy", "saria", "--policy", "dram-only", "--device", "h100",
                 "--layerwise", "both", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "prefill from FLOPs on h100 (989.4 TFLOP/s x 0.55); reloads sequential and layer-wise (+lw)" in proc.stdout
    assert _row(proc.stdout, " ") == ["saria", "saria+lw", "dram-only", "dram-only+lw"]
    ttft = [float(v) for v in _row(proc.stdout, "TTFT mean (ms)")]
    assert ttft[1] < ttft[0] and ttft[3] < ttft[2]
    document = json.loads(out.read_text())
    assert [r["policy"] for r in document["results"]] == ["saria", "saria+lw", "dram-only", "dram-only+lw"]
    assert document["config"]["device"]["name"] == "h100" and document["config"]["layerwise"] is False
    assert all(r["retention"] is not None for r in document["results"])  # each against its own references


def test_fleet_replay_layerwise_both_has_a_row_pair_per_fleet(tmp_path):
    out = tmp_path / "fleet.json"
    proc = saria("replay", SMALL, *CACHE, "--policy", "full-duplicate", "--replicas", "2", "--cluster-gb", "5",
                 "--layerwise", "both", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("full-duplicate")] == \
        ["full-duplicate", "full-duplicate+lw"] * 2
    rows = json.loads(out.read_text())["results"]
    assert [(r["policy"], r["cluster_gb"]) for r in rows] == [("full-duplicate", 0), ("full-duplicate+lw", 0),
                                                            ("full-duplicate", 5), ("full-duplicate+lw", 5)]
    assert rows[1]["ttft_ms_mean"] < rows[0]["ttft_ms_mean"] and rows[3]["ttft_ms_mean"] < rows[2]["ttft_ms_mean"]


@pytest.mark.parametrize("args, message", [
    (["replay", "--device", "h100", "--prefill-tps", "100"], "--prefill-tps and --device: give one"),
    (["sweep", "--theta-e", "1", "--layerwise", "both"], "--layerwise both: saria sweep replays one"),
    (["replay", "--device-efficiency", "0.5"], "--device-efficiency needs --device"),
    (["replay", "--device", "h100", "--device-efficiency", "2"], "argument --device-efficiency"),
])
def test_bad_step_options_are_one_line_exit_2(args, message):
    proc = saria(args[0], "synth:sessions=2", "--no-progress", *args[1:])
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
