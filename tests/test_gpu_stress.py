"""The reload stress of bench/gpu_stress.py, run short: on this machine it checks the stress's own
logic (and the engine's, on CPU tensors); on a GPU (bench/gpu_check.sh) it runs the same rounds on
real streams."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stress():
    spec = importlib.util.spec_from_file_location("gpu_stress", ROOT / "bench" / "gpu_stress.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seed", [0, 1])
def test_every_reloaded_object_matches_and_every_corruption_is_caught(stress, tmp_path, capsys, seed):
    rc = stress.main(["--rounds", "12", "--seed", str(seed), "--corrupt", "0.6", "--ssd-dir", str(tmp_path),
                      "--json"])
    out = capsys.readouterr().out
    summary = __import__("json").loads(out.strip().splitlines()[-1])
    assert rc == 0, out
    assert summary["ok"] and summary["rounds"] == 12 and summary["objects"] > 0
    assert summary["dram_objects"] and summary["ssd_objects"]
    assert summary["injected"] == summary["injected_caught"]
    assert summary["healthy_failed"] == summary["byte_mismatches"] == summary["slot_leaks"] == 0


def test_a_wrong_byte_would_be_reported(stress, tmp_path, capsys, monkeypatch):
    """The stress must be able to fail: an unpack that writes one wrong byte is caught."""
    from saria.dataplane.transfer import tables
    real = tables.unpack_pages

    def unpack_one_wrong(staging, table, ids, **kw):
        staging = staging.clone()
        staging.view(-1)[0] ^= 1
        return real(staging, table, ids, **kw)

    monkeypatch.setattr(tables, "unpack_pages", unpack_one_wrong)
    assert stress.main(["--rounds", "3", "--corrupt", "0", "--ssd-dir", str(tmp_path)]) == 1
    assert "differs from its source" in capsys.readouterr().out
