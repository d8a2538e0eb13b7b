"""The compiled kernels (pages, scattered pages, checksum, FP8), checked without a GPU: Triton
compiles them to PTX for an H100/H200 (sm_90) here, so the claim that aligned pages move in 16-byte
words is checked in the generated code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
checksum = importlib.import_module('saria.kernels.checksum.triton')
pages = importlib.import_module('saria.kernels.pages.triton')

def ptx(fn, signature, constexprs, aligned=()):
    # At run time Triton specializes pointer and integer arguments that are multiples of 16 the
    # same way; `aligned` names those arguments (a fresh staging buffer, a whole number of pages).
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]

copy_sig = {"p_table": "*i64", "p_ids": "*i64", "staging_addr": "i64", "pages_per_chunk": "i64",
            "chunk_bytes": "i64", "tiles": "i32", "PACK": "constexpr", "WORDS": "constexpr", "BYTES": "constexpr",
            "TILE_MAJOR": "constexpr"}
out = {}
for pack in (True, False):
    for tile_major in (False, True):
        text = ptx(pages._copy_pages_kernel, copy_sig, {"PACK": pack, "WORDS": pages.TILE_WORDS,
                                                        "BYTES": pages.BYTES_PER_ITER, "TILE_MAJOR": tile_major})
        name = ("pack" if pack else "unpack") + ("_tile_major" if tile_major else "")
        out[name] = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", text)))
text = ptx(checksum._checksum_kernel, {"p_words": "*i32", "n_words": "i64", "p_bytes": "*u8", "n_bytes": "i64",
                                       "p_sum": "*i64", "BLOCK": "constexpr"}, {"BLOCK": checksum.BLOCK_WORDS},
           aligned=("p_words",))  # p_bytes' and p_sum's alignment is not specialized
out["checksum"] = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", text)))
out["checksum_atomics"] = re.findall(r"(?:atom|red)\.global[.\w]*", text)
fp8 = importlib.import_module('saria.kernels.fp8.triton')
fp8_sig = {"p_table": "*i64", "p_ids": "*i64", "staging_addr": "i64", "per_chunk": "i64", "ids_per_chunk": "i64",
           "skip": "i64", "page_id_bytes": "i64", "tiles": "i32", "PACK": "constexpr", "DTYPE": "constexpr",
           "ESIZE": "constexpr", "GROUPS": "constexpr"}
for pack in (True, False):
    text = ptx(fp8._fp8_pages_kernel, fp8_sig, {"PACK": pack, "DTYPE": 0, "ESIZE": 2, "GROUPS": fp8.TILE_GROUPS})
    name = "fp8_" + ("pack" if pack else "unpack")
    out[name] = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", text)))
    out[name + "_float"] = sorted(set(re.findall(r"(?:div|rcp|fma|mul|cvt)\.[.\w]*f32[.\w]*", text)))
scattered = importlib.import_module('saria.kernels.pages.scattered')
scattered_sig = {"p_work": "*i64", "row0": "i32", "n": "i32", "tensors": "i32", "tiles": "i32", "total": "i64", "WORDS": "constexpr",
                 "BYTES": "constexpr", "PERSISTENT": "constexpr"}
for persistent in (False, True):
    # p_work's alignment is not specialized (do_not_specialize_on_alignment): compiled as it runs.
    text = ptx(scattered._scattered_kernel, scattered_sig, {"WORDS": 8192, "BYTES": 2048, "PERSISTENT": persistent})
    out[f"scattered_persistent_{persistent}"] = sorted(set(re.findall(r"(?:ld|st)\.global[.\w]*", text)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def global_memory_ops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("direction", ["pack", "unpack", "pack_tile_major", "unpack_tile_major"])
def test_aligned_pages_copy_in_16_byte_words(global_memory_ops, direction):
    ops = global_memory_ops[direction]
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert "ld.global.b8" in ops and "st.global.b8" in ops, ops  # the narrow path is there too


def test_checksum_reads_16_byte_words(global_memory_ops):
    assert any(op.startswith("ld.global.v4") for op in global_memory_ops["checksum"]), global_memory_ops


def test_checksum_reduces_on_the_device_with_one_64_bit_atomic_per_program(global_memory_ops):
    atomics = global_memory_ops["checksum_atomics"]
    assert len(atomics) == 1 and atomics[0].endswith(".add.u64"), atomics
    assert not any(op.startswith("st.global") for op in global_memory_ops["checksum"]), global_memory_ops


@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_fp8_kernel_moves_aligned_rows_in_16_byte_words(global_memory_ops, direction):
    ops = global_memory_ops["fp8_" + direction]
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops  # the hinted path (aligned pages)
    narrow = "ld.global.b16" if direction == "pack" else "st.global.b16"
    assert narrow in ops, ops  # the unhinted path for unaligned pages is there too


def test_fp8_kernel_divides_in_ieee_and_never_flushes_subnormals(global_memory_ops):
    floats = global_memory_ops["fp8_pack_float"] + global_memory_ops["fp8_unpack_float"]
    assert "div.rn.f32" in global_memory_ops["fp8_pack_float"], floats  # tl.math.div_rn, as the format says
    assert not [op for op in floats if "approx" in op or "full" in op or "ftz" in op or op.startswith("fma")], floats


@pytest.mark.parametrize("persistent", [False, True])
def test_scattered_kernel_copies_aligned_pages_in_16_byte_words(global_memory_ops, persistent):
    """The scattered copy (``prepare_scattered``), both grids: aligned pages move in
    ld/st.global.v4.b32 and the byte path is there for the others."""
    ops = global_memory_ops[f"scattered_persistent_{persistent}"]
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert "ld.global.b8" in ops and "st.global.b8" in ops, ops
