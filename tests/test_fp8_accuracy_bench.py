"""``bench/bench_fp8_accuracy.py``: its metrics, the torch reference of the SSD tier's FP8 format,
and, in ``long`` tests, its ``--quick`` mode end to end on real vLLM: (c) saria with
``ssd_dtype=auto`` reloading from SSD is identical to vLLM's own prefix cache (two engines); (b)
vLLM's own ``kv_cache_dtype=fp8`` and (ae) the emulated FP8 SSD reloads are measured (three
engines). The FP8 SSD tier itself is checked by ``tests/test_vllm_connector_fp8.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_fp8_accuracy.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_fp8_accuracy", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agreement_compares_logprobs_only_up_to_the_first_differing_token():
    bench = load_bench()
    ref = [{"output_tokens": [1, 2, 3, 4], "logprobs": [-1.0, -2.0, -3.0, -4.0]}] * 2
    got = [{"output_tokens": [1, 2, 3, 4], "logprobs": [-1.0, -2.0, -3.0, -4.0]},
           {"output_tokens": [1, 2, 9, 9], "logprobs": [-1.5, -2.0, -7.0, -7.0]}]
    m = bench.agreement(got, ref, 4)
    assert m["match_at"] == {"1": 1.0, "4": 0.5} and m["all_tokens_match"] == 0.5
    assert m["token_agreement"] == (4 + 2) / 8
    assert m["dlogprob"]["n"] == 6 and m["dlogprob"]["max"] == 0.5  # positions 0-3 and 0-1, not 2-3
    assert m["first_token_dlogprob"]["max"] == 0.5
    worse = dict(m, dlogprob=dict(m["dlogprob"], mean=1.0))
    assert bench.no_worse(m, m) and bench.no_worse(m, worse) and not bench.no_worse(worse, m)


def test_fp8_round_trip_keeps_the_formats_error_bound():
    from saria.harness.fp8 import fp8_round_trip

    torch.manual_seed(0)
    x = (torch.randn(64, 128) * torch.logspace(-3, 2, 64)[:, None]).to(torch.bfloat16)
    x[3] = 0
    y = fp8_round_trip(x)
    assert y.dtype == x.dtype and y.shape == x.shape and not y[3].any()
    xf, yf = x.float(), y.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 448
    # saria/ssd_dtype.py: |x - x'| <= 2^-4 |x| + 2^-10 scale, plus bf16's own rounding of x'
    assert ((xf - yf).abs() <= 2 ** -4 * xf.abs() + 2 ** -10 * scale + 2 ** -8 * yf.abs()).all()
    assert (yf.abs().amax(dim=1) <= xf.abs().amax(dim=1) * (1 + 2 ** -8)).all()  # amax maps to 448: kept
    assert torch.equal(fp8_round_trip(y), y)  # decoded values are codes times the same scale


def test_configuration_b_is_refused_before_vllm_starts_where_it_cannot_run(tmp_path, monkeypatch):
    """vLLM refuses its FP8 KV cache on a CPU without AVX-512 or AMX only once its engine has started
    (a traceback from a worker): the bench says so in one line first."""
    bench = load_bench()
    monkeypatch.setattr(bench, "vllm_fp8_cache_runs_here", lambda: False)
    args = bench.parse_args(["--quick", "--configs", "a,b", "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="AVX-512 or AMX"):
        bench.main(args)
    assert not (tmp_path / "x.json").exists()


def run_bench(tmp_path: Path, configs: str) -> tuple[subprocess.CompletedProcess, dict, str]:
    out, table = tmp_path / "fp8.json", tmp_path / "fp8.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--configs", configs, "--json", str(out),
                           "--markdown", str(table)], capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), table.read_text()


@pytest.mark.long  # a benchmark's own check (two engines); the FP8 SSD tier's engine test runs by default
def test_quick_bf16_ssd_reloads_are_vllms_prefix_cache(tmp_path):
    proc, result, table = run_bench(tmp_path, "c")
    assert result["c_identical_to_vllm_prefix_cache"] is True
    assert result["c_audit"]["checked_pages"] > 0 and result["c_audit"]["mismatched_pages"] == 0
    for name, w in result["workloads"].items():
        c = w["configs"]["c"]
        assert c["dram_tokens"] == 0 and c["ssd_tokens"] > 0, name  # every reload came from SSD
        assert c["ssd_reloaded_prompts"] == c["reused_prompts"] > 0, name  # the session's first turn reuses nothing
        assert c["vs_vllm_prefix_cache"] == {"tokens_identical": True, "max_dlogprob": 0.0}
    batch = result["workloads"]["batch"]
    assert batch["configs"]["c"]["reused_prompts"] == batch["prompts"]  # each prompt reloaded its prefix
    assert "(c) saria ssd_dtype=auto" in table and "identical to vLLM's own prefix-cache reuse: True" in proc.stdout


@pytest.mark.long
def test_quick_fp8_configurations_are_measured(tmp_path):
    if not load_bench().vllm_fp8_cache_runs_here():
        pytest.skip("vLLM's own FP8 KV cache (configuration b) needs AVX-512 or AMX on a CPU")
    proc, result, table = run_bench(tmp_path, "a,ae,b")
    for name, w in result["workloads"].items():
        ae, b = w["configs"]["ae"], w["configs"]["b"]
        assert ae["dram_tokens"] == 0 and ae["ssd_reloaded_prompts"] == ae["reused_prompts"] > 0, name
        assert b["prompts"] == ae["prompts"] == w["prompts"]
        assert b["first_token_dlogprob"]["max"] > 0  # vLLM's FP8 cache moves every logprob
        assert isinstance(w["ae_no_worse_than_b"], bool)
    assert result["a_audit_clean"] is True  # every FP8 reload is the format's round trip of vLLM's KV
    for name, w in result["workloads"].items():
        a = w["configs"]["a"]
        assert a["dram_tokens"] == 0 and a["ssd_reloaded_prompts"] == a["reused_prompts"] > 0, name
        assert isinstance(w["a_no_worse_than_b"], bool)
        assert w["a_equals_emulation"] is True and w["a_equals_emulation_prompts"] > 0, name
