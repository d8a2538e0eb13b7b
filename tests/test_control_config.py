"""The typed configuration, the presets, and what the control plane promises around them:
no torch, metadata window, counters."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from control_cases import DENSE, HYBRID, PRESETS, chain, config, request

from saria.config import POLICY_PRESETS, Bandwidths, Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import ControlPlane
from saria.models import get_model

ROOT = Path(__file__).resolve().parent.parent


def test_control_and_config_never_import_torch():
    code = ("import sys; import saria.config, saria.control; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') "
            "or m.startswith(('saria.kernels', 'saria.harness.paged_caches'))); print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stdout + result.stderr


def test_defaults_are_the_papers():
    cfg = SariaConfig()
    p = cfg.policy
    assert (p.name, p.theta_E, p.theta_R, p.prewrite, p.r, p.p_tau_s) == ("saria", 2, 8, True, None, 60.0)
    assert (cfg.chunk.chunk_tokens, cfg.chunk.checkpoint_tokens) == (512, 16_384)
    assert (cfg.bandwidth.gpu_gbps, cfg.bandwidth.disk_gbps_per_drive, cfg.bandwidth.drives,
            cfg.bandwidth.dram_gbps) == (48.0, 20.0, 1, 48.0)
    assert cfg.dram_bytes == 1_000_000 * get_model("qwen3-8b").kv_bytes_per_token
    assert cfg.ssd_bytes == 10 * cfg.dram_bytes


def test_sizes_come_from_a_model_spec():
    dense = ChunkSpec.for_model("qwen3-8b")
    assert (dense.chunk_tokens, dense.state_bytes, dense.hybrid) == (512, 0, False)
    assert dense.kv_bytes == 512 * 36 * 2 * 8 * 128 * 2
    spec = get_model("qwen3-next-80b-a3b")
    hybrid = SariaConfig.for_model(spec).chunk
    assert (hybrid.chunk_tokens, hybrid.checkpoint_chunks) == (1024, 16)
    assert hybrid.state_bytes == spec.state_bytes > 0 and hybrid.kv_bytes_per_token == spec.kv_bytes_per_token
    # token budgets are full-attention equivalents; state objects still cost their bytes
    assert SariaConfig.for_model(spec, dram=Capacity(tokens=1000)).dram_bytes == 1000 * spec.kv_bytes_per_token
    assert SariaConfig(dram=Capacity(nbytes=12345)).dram_bytes == 12345


def test_presets_are_settings_of_one_policy():
    for name in PRESETS:
        policy = Policy.preset(name)
        assert policy.name == name
        assert {f: getattr(policy, f) for f in POLICY_PRESETS[name]} == dict(POLICY_PRESETS[name])
    assert set(PRESETS) == {"saria", "full-duplicate", "dram-only", "gds-only", "zero-promotion",
                            "full-promotion", "reuse-only", "lmcache-plus", "paper"}  # + oracle: replay only
    assert set(POLICY_PRESETS) == set(PRESETS) | {"oracle"}
    assert SariaConfig.preset("dram-only").ssd_bytes == 0
    assert SariaConfig.preset("gds-only").dram_bytes == 0
    lmc = Policy.preset("lmcache-plus", p_tau_s=5.0)  # every knob settable on any preset
    assert (lmc.lookup, lmc.serial_loading, lmc.unified_metadata, lmc.r, lmc.p_tau_s) == \
        ("tier-prefix", True, False, 0.0, 5.0)
    assert SariaConfig().with_policy(theta_R=3).policy.theta_R == 3


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: Capacity(tokens=-1), "Capacity.tokens must be >= 0", id="negative-tokens"),
    pytest.param(lambda: Capacity(nbytes=-5), "Capacity.nbytes must be >= 0", id="negative-bytes"),
    pytest.param(lambda: Capacity(), "exactly one", id="no-capacity"),
    pytest.param(lambda: Capacity(tokens=1, nbytes=1), "exactly one", id="both"),
    pytest.param(lambda: Capacity(tokens=1.5), "must be an int", id="float-tokens"),
    pytest.param(lambda: Policy(theta_E=0), "theta_E must be from 1 to 1,000,000", id="theta-e-0"),
    pytest.param(lambda: Policy(theta_R=-2), "theta_R must be from 1 to 1,000,000", id="theta-r-negative"),
    pytest.param(lambda: Policy(theta_E=10**400), "theta_E must be from 1 to 1,000,000", id="theta-e-huge"),
    pytest.param(lambda: Policy(theta_E=1.5), "theta_E must be an int", id="theta-e-float"),
    pytest.param(lambda: Policy(r=1.5), "r must be <= 1", id="r-above-1"),
    pytest.param(lambda: Policy(r=-0.1), "r must be >= 0", id="r-negative"),
    pytest.param(lambda: Policy(p_tau_s=-1.0), "p_tau_s must be >= 0", id="p-tau-negative"),
    pytest.param(lambda: Policy(p_tau_s=float("nan")), "finite", id="p-tau-nan"),
    pytest.param(lambda: Policy(prewrite_depth=-1), "prewrite_depth must be >= 0", id="depth"),
    pytest.param(lambda: Policy(metadata_window_s=0.0), "metadata_window_s must be > 0", id="window"),
    pytest.param(lambda: Policy(lookup="prefix"), "lookup must be one of", id="lookup"),
    pytest.param(lambda: Policy(prewrite="yes"), "prewrite must be a bool", id="flag"),
    pytest.param(lambda: Policy.preset("lru"), "unknown policy preset 'lru'", id="preset"),
    pytest.param(lambda: Policy.preset("saria", theta=3), "unknown Policy field", id="preset-field"),
    pytest.param(lambda: ChunkSpec(chunk_tokens=0), "chunk_tokens must be >= 1", id="chunk-tokens"),
    pytest.param(lambda: ChunkSpec(checkpoint_tokens=1000), "multiple of chunk_tokens", id="checkpoint"),
    pytest.param(lambda: ChunkSpec(state_bytes=-1), "state_bytes must be >= 0", id="state-bytes"),
    pytest.param(lambda: Bandwidths(gpu_gbps=0.0), "gpu_gbps must be > 0", id="bandwidth"),
    pytest.param(lambda: Bandwidths(drives=0), "drives must be >= 1", id="drives"),
    pytest.param(lambda: Bandwidths(drives=10**400), "drives must be <= 1024", id="drives-huge"),
    pytest.param(lambda: SariaConfig(dram=1_000_000), "dram must be a Capacity", id="raw-capacity"),
    pytest.param(lambda: SariaConfig(ssd_paths=["/mnt/nvme0"]), "ssd_paths must be a tuple", id="paths"),
    pytest.param(lambda: ControlPlane("saria"), "needs a SariaConfig", id="plane"),
])
def test_bad_configuration_is_a_clear_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------------------ metadata window
def tick(cp: ControlPlane, now: float) -> None:
    """A call that changes nothing but the clock."""
    cp.release(cp.plan([], now), now)


def test_counters_survive_eviction_and_metadata_goes_only_after_a_whole_quiet_window():
    """Reclaimed only after a whole window with no reuse and nothing resident."""
    cp = ControlPlane(config("dram-only", dram_chunks=4, metadata_window_s=100.0))
    request(cp, chain("k", 2), 0.0)
    request(cp, chain("k", 2), 10.0)  # R_b = 1
    request(cp, chain("o", 2), 20.0)
    request(cp, chain("m", 2), 21.0)  # evicts k: E_b = 1, nothing resident from t = 21 on
    assert (cp.chunk_info("k:1").E_b, cp.chunk_info("k:1").R_b) == (1, 1)
    tick(cp, 120.0)  # 110 s after the last reuse, but only 99 s with nothing resident: kept
    assert cp.chunk_info("k:0") is not None and cp.chunk_info("k:1") is not None
    tick(cp, 121.0)  # a whole quiet window: both chunks (child first) reclaimed
    assert cp.chunk_info("k:0") is None and cp.chunk_info("k:1") is None
    assert cp.counters().nodes_reclaimed == 2
    tick(cp, 125.0)  # o is past its reuse window, but still resident: kept
    assert cp.chunk_info("o:0").kv.dram == "ready" and cp.chunk_info("o:1").kv.dram == "ready"
    request(cp, ["p"], 126.0)  # evicts o:0 (LRU): nothing resident from 126 on
    request(cp, ["q"], 127.0)  # evicts o:1
    tick(cp, 226.5)
    assert cp.chunk_info("o:0") is not None and cp.chunk_info("o:1") is not None
    tick(cp, 227.0)  # o:1 goes a window after it lost its copy, and takes its parent along
    assert cp.chunk_info("o:0") is None and cp.chunk_info("o:1") is None
    assert cp.chunk_info("m:0").kv.dram == "ready"  # m is past its window, resident: kept
    request(cp, chain("k", 2), 228.0)  # a returning context starts over
    assert (cp.chunk_info("k:1").E_b, cp.chunk_info("k:1").R_b) == (0, 0)
    assert cp.audit() == []


def test_reuse_restarts_the_window():
    cp = ControlPlane(config("dram-only", dram_chunks=1, metadata_window_s=100.0))
    request(cp, ["k"], 0.0)
    request(cp, ["o"], 1.0)  # k evicted
    request(cp, ["k"], 90.0)  # recomputed at 90: the window restarts; stored again, evicts o
    request(cp, ["o"], 91.0)  # o recomputed, k evicted again (E_b = 2): quiet from 91 on
    request(cp, ["z"], 150.0)
    assert cp.chunk_info("k").E_b == 2
    tick(cp, 190.5)
    assert cp.chunk_info("k").E_b == 2
    tick(cp, 191.0)
    assert cp.chunk_info("k") is None


def test_window_queue_stays_bounded_and_exact_under_many_touches():
    """Every touch appends a window-queue entry; stale ones are compacted away, and the window still
    runs from each chunk's last touch."""
    cp = ControlPlane(config("dram-only", dram_chunks=4, metadata_window_s=100.0))
    for i in range(3000):  # two chunks touched 3,000 times each: 6,000 entries for 2 nodes
        request(cp, ["a", "b"], i * 0.01)
        assert cp.audit() == [] if i % 500 == 0 else True
    request(cp, ["c"], 29.995)
    queue = cp._tree._queue
    assert len(queue) <= 4 * len(cp._tree) + 4096 + 3
    assert cp.audit() == []
    request(cp, ["x"], 60.0)  # DRAM full: a, b, c, x
    request(cp, ["y"], 61.0)  # evicts a: nothing of a resident from 61 on
    request(cp, ["z"], 62.0)  # evicts b
    tick(cp, 161.0)  # a whole window since a lost its copy, but b (its child) holds it
    assert cp.chunk_info("a") is not None and cp.chunk_info("b") is not None
    tick(cp, 161.5)
    assert cp.chunk_info("b") is not None
    tick(cp, 162.0)  # b's window: b goes, and takes its parent along
    assert cp.chunk_info("b") is None and cp.chunk_info("a") is None
    assert cp.chunk_info("c").kv.dram == "ready"  # past its window but resident: kept
    assert cp.audit() == []

def test_hit_bytes_count_every_object_read():
    cp = ControlPlane(config(dram_chunks=64, chunk=HYBRID))
    request(cp, chain("h", 4), 0.0)
    request(cp, chain("h", 4), 1.0)
    c = cp.counters()
    assert (c.hits_dram_chunks, c.misses, c.references) == (4, 4, 8)
    assert c.hits_dram_bytes == 4 * HYBRID.kv_bytes + HYBRID.state_bytes
    assert c.stores == 5 and c.store_bytes == c.hits_dram_bytes
    dense = ControlPlane(config(dram_chunks=4, chunk=DENSE))
    request(dense, chain("d", 3), 0.0)
    request(dense, chain("d", 2), 0.0)
    assert dense.counters().hits_dram_bytes == 2 * DENSE.kv_bytes
