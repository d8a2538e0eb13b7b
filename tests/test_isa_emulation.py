"""The CPU emulation of tests/isa (tests/isa/l2.py): another L2 size through an LD_PRELOAD shim of
torch's ``at::cpu::get_cpu_capabilities()``, alone and with the AVX2 emulation (docs/numerics.md)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ISA_DIR = Path(__file__).resolve().parent / "isa"


def _load_l2():
    spec = importlib.util.spec_from_file_location("saria_tests_isa_l2", ISA_DIR / "l2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


l2 = _load_l2()


@pytest.fixture(scope="module")
def shim() -> Path:
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not on PATH): the L2 shim cannot be built")
    return l2.shim_path()


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True,
                          text=True, timeout=120)


CAPS = "import torch; c = torch.cpu.get_capabilities(); print(c['l2_cache_size'], c['avx512_f'], " \
       "torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported())"


def test_shim_builds_and_exports_only_the_symbol(shim):
    assert shim.is_file() and shim.parent == l2.CACHE
    assert l2.shim_path() == shim  # cached: not rebuilt
    nm = shutil.which("nm")
    if nm is not None:
        defined = subprocess.run([nm, "-D", "--defined-only", str(shim)], capture_output=True, text=True).stdout
        assert [line.split()[-1] for line in defined.splitlines()] == [l2.SYMBOL]
    # LD_PRELOAD loads it into every process: one without torch must run as before
    assert subprocess.run(["sh", "-c", "exit 0"], env=dict(os.environ, LD_PRELOAD=str(shim))).returncode == 0


def test_child_process_sees_the_emulated_l2(shim):
    import torch

    native = torch.cpu.get_capabilities()["l2_cache_size"]
    env = l2.emulation_env(256, debug="1")
    assert env["LD_PRELOAD"].split()[0] == str(shim) and env["SARIA_EMULATE_L2_KB"] == "256"
    out = _child(CAPS, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(256 * 1024)
    assert f"l2_cache_size {native} -> {256 * 1024}" in out.stderr  # the shim saw torch's real value
    # preloaded without a size, it changes nothing
    out = _child(CAPS, {"LD_PRELOAD": str(shim)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == str(native)


def test_combined_with_the_avx2_emulation(shim):
    env = l2.emulation_env(512, "avx2")
    assert env["SARIA_EMULATE_ISA"] == "avx2" and env["PYTHONPATH"].split(os.pathsep)[0] == str(ISA_DIR)
    out = _child(CAPS, env)
    assert out.returncode == 0, out.stderr
    l2_bytes, _avx512_f, avx512, amx = out.stdout.split()
    # sitecustomize hides AVX-512 and AMX from vLLM's checks; the shim sets the L2
    assert (l2_bytes, avx512, amx) == (str(512 * 1024), "False", "False")


def test_bad_values_are_refused(shim):
    for bad in (0, -1, True, "256"):
        with pytest.raises(ValueError):
            l2.emulation_env(bad)
    with pytest.raises(ValueError):
        l2.emulation_env(None, "avx512")
    assert l2.emulation_env(None, None) == {} and l2.emulation_env(None, "native") == {}
    # a size the shim cannot read aborts the process instead of measuring the native CPU
    out = _child(CAPS, {"LD_PRELOAD": str(shim), "SARIA_EMULATE_L2_KB": "lots"})
    assert out.returncode != 0 and "SARIA_EMULATE_L2_KB=lots" in out.stderr


@pytest.mark.long
def test_small_l2_splits_a_400_token_prefill(shim, tmp_path, monkeypatch):
    """vLLM's prefill of a 400-token prompt over 256 cached tokens against its full recomputation:
    bit-identical with a 2 MiB L2 (one KV tile), not with 256 KiB (several tiles). A 2 MiB L2 is
    this machine's own; on a CPU with less it is emulated too."""
    import torch

    from saria.harness import build_model, run_in_subprocess, synthetic_session
    from saria.harness.compare import logprob_gap

    model = str(build_model(tmp_path / "model", "dense"))
    prompts = synthetic_session(1, system_tokens=250, step_tokens=150, seed=1)  # 400 tokens
    spec = {"model": model, "prompts": prompts, "max_tokens": 6, "enforce_eager": True, "prefix_caching": True,
            "variants": [[0, 256]]}

    def gap(l2_kb):
        with monkeypatch.context() as m:
            if l2_kb is not None:
                for name, value in l2.emulation_env(l2_kb, debug=str(tmp_path / "shim.log")).items():
                    m.setenv(name, value)
            variants = run_in_subprocess(spec)["variants"][0]
        assert variants["256"]["cached_tokens"] == 256
        return logprob_gap(variants["256"], variants["0"])[1]

    large = None if torch.cpu.get_capabilities()["l2_cache_size"] == 2048 * 1024 else 2048
    assert gap(large) == 0  # one KV tile (docs/numerics.md)
    assert gap(256) > 0
    # the engine's attention kernels read the emulated size (vLLM's _C, _C_AVX512 or _C_AVX2)
    log = (tmp_path / "shim.log").read_text()
    assert any("/vllm/_C" in line and f"-> {256 * 1024} " in line for line in log.splitlines()), log
