"""``bench/bench_fp8_states.py --quick`` runs end to end: every case is compared with the exact cache,
the exact case against itself is exact, the FP8 round trip reaches the tensors each case names and
changes the outputs; the padding of a last partial group and the checkpoint byte counts agree with
:mod:`saria.ssd_dtype` and :mod:`saria.models`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

from saria.integrations.vllm.audit import fp8_round_trip
from saria.models import MODELS
from saria.ssd_dtype import FP8_GROUP

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fp8_states", ROOT / "bench" / "bench_fp8_states.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_fp8_states_table(tmp_path):
    out = tmp_path / "states.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_fp8_states.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| case (FP8 round trip on) |" in proc.stdout and "qwen3-next-80b-a3b" in proc.stdout
    result = json.loads(out.read_text())
    cases = ["exact", "kv", "conv", "recurrent", "states", "both"]
    assert list(result["summary"]) == cases
    assert len(result["records"]) == result["config"]["prompts"] == 2
    gen = result["config"]["gen"]

    exact = result["summary"]["exact"]
    assert exact["agree"] == 1.0 and all(v == 1.0 for v in exact["match"].values())
    assert exact["dlogprob"]["max"] == 0.0 and exact["dlogprob"]["tokens"] == 2 * gen
    assert exact["round_trip"] == {}  # nothing rounded

    kinds = {"kv": {"kv"}, "conv": {"conv"}, "recurrent": {"recurrent"}, "states": {"conv", "recurrent"},
             "both": {"kv", "conv", "recurrent"}}
    differs = []
    for case, want in kinds.items():
        s = result["summary"][case]
        assert set(s["round_trip"]) == want
        assert all(r["tensors"] > 0 and r["padded"] == 0 and 0 < r["rel_rms"] < 0.05 for r in s["round_trip"].values())
        differs.append(s["agree"] < 1.0 or s["dlogprob"]["max"] > 0.0)
        for rec in result["records"]:
            c = rec["cases"][case]
            assert 0 <= c["agree_tokens"] <= gen and len(c["dlogprob"]) == c["agree_tokens"]
    assert all(differs), differs  # every FP8 case moves a logprob or a token somewhere

    rows = {r["model"]: r for r in result["bytes"]}
    assert set(rows) == {name for name, spec in MODELS.items() if spec.hybrid}
    r = rows["qwen3-next-80b-a3b"]
    assert r["stored"] == MODELS["qwen3-next-80b-a3b"].state_bytes and r["whole_groups"]
    assert 0 < r["share_kv_bf16"] < r["share_kv_fp8"] < 1 and 0 < r["saving_if_states_fp8"] < 1


def test_round_trip_pads_the_last_group_only():
    bench = _bench()
    torch.manual_seed(0)
    whole = torch.randn(3 * FP8_GROUP, dtype=torch.float32)
    y, pad = bench.round_trip_padded(whole)
    assert pad == 0 and torch.equal(y, fp8_round_trip(whole))
    part = torch.randn(2 * FP8_GROUP + 5, dtype=torch.bfloat16)
    y, pad = bench.round_trip_padded(part)
    assert pad == FP8_GROUP - 5 and y.shape == part.shape and y.dtype == part.dtype
    assert torch.equal(y[:2 * FP8_GROUP], fp8_round_trip(part[:2 * FP8_GROUP]))  # whole groups as unpadded
    assert not torch.equal(y, part)


def test_state_bytes_of_a_checkpoint():
    bench = _bench()
    spec = MODELS["qwen3-next-80b-a3b"]
    st = bench.state_bytes(spec)
    # 36 layers x (conv 3 x 8192 bf16 + recurrent 32 x 128 x 128 fp32), FP8: 1 byte + 4 per 128 elements
    assert st["stored"] == 36 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)
    assert st["fp8"] == 36 * ((3 * 8192 + 32 * 128 * 128) * (1 + 4 / FP8_GROUP))
