"""The FP8 rows of bench/bench_kernels.py (``ssd_dtype=fp8``): ``pack_pages_fp8`` /
``unpack_pages_fp8`` side by side with the plain pack / unpack and the D2D copy of the raw bytes.

GB/s and the fraction of the D2D copy count the raw (cache dtype) bytes packed, as the plain rows
do, so the rows compare directly: the FP8 object itself is 33/64 of that for bf16. Caches are
refilled with normal values first (random bit patterns would make ~40% of bf16 groups NaN ones).
Tables of several dtypes (the hybrid table: GDN pages are int8, and stay exact) are skipped.

On a GPU: the public ops (ids on the CPU) and the kernel alone (ids on the GPU), after a
correctness check (the kernel's object equals ``quantize_staging`` of the torch pack, its unpack
equals ``dequantize_staging``), plus ``quantize_staging`` / ``dequantize_staging`` on the device;
target: the kernel >= 0.80 of the D2D copy. On a CPU: the torch path, wall clock, and an
interpreter smoke run.
"""

from __future__ import annotations

import time

import torch

from saria.kernels import (PageTable, check_block_ids, dequantize_staging, pack_pages, pack_pages_fp8,
                           quantize_staging, unpack_pages_fp8)
from saria.kernels.fp8 import triton as fp8_mod
from saria.kernels.fp8.checks import check_fp8_table
from saria.harness.paged_caches import dense_layer_caches, zeros_like_caches
from saria.models import get_model
from saria.ssd_dtype import FP8_GROUP

FP8_TARGET = 0.80
FP8_KERNEL = "saria triton fp8 kernel (auto)"


def _skip_reason(table: PageTable) -> str | None:
    try:
        check_fp8_table(table, FP8_GROUP)
    except ValueError as exc:
        return str(exc)
    return None


SWEEP = [(8, 4), (16, 4), (16, 8), (32, 4), (32, 8)]  # (groups per tile, warps), one program per tile


def run_fp8(device, name, table: PageTable, caches, ids, bench, backend, row, checker, sweep=False) -> None:
    """FP8 rows for one table and chunk count through ``row(op, impl, ms, note)`` (bench_kernels'
    row maker: GB/s and the fraction of the D2D copy over the raw bytes); ``sweep`` (GPU): the
    kernel at each :data:`SWEEP` configuration too, each checked first."""
    why = _skip_reason(table)
    if why:
        print(f"fp8 rows skipped for {name}: {why}", flush=True)
        return
    gen = torch.Generator(device=device).manual_seed(1)
    for c in caches:
        c.normal_(generator=gen)
    dtype, cuda = table.element_dtype, device.type == "cuda"
    per_chunk = ids.shape[1]
    stored = pack_pages_fp8(table, ids, backend=backend)
    raw = pack_pages(table, ids, backend="torch")
    if cuda:
        checker.expect(torch.equal(stored, quantize_staging(raw, dtype)),
                       f"{name} x{ids.shape[0]}: fp8 pack differs from quantize_staging(pack_pages)")
        fresh = zeros_like_caches(caches)
        unpack_pages_fp8(stored, fresh, ids, backend=backend)
        checker.expect(torch.equal(pack_pages(fresh, ids, backend="torch"), dequantize_staging(stored, dtype)),
                       f"{name} x{ids.shape[0]}: fp8 unpack differs from dequantize_staging")
    size = f"object {stored.numel()} B ({stored.numel() / raw.numel():.3f} of raw)"
    for op, pack in (("pack fp8", True), ("unpack fp8", False)):
        if pack:
            ms = bench(lambda: pack_pages_fp8(table, ids, out=stored, backend=backend))
        else:
            ms = bench(lambda: unpack_pages_fp8(stored, table, ids, backend=backend))
        row(op, f"saria {backend} fp8", ms, f"{size}; ids on the CPU" if cuda else f"{size}; CPU wall clock")
        if cuda:
            checked = check_block_ids(table, ids, unique=True).on(device)
            cfg = fp8_mod.launch_config(table)
            ms = bench(lambda: fp8_mod.launch(table, checked, stored, per_chunk, pack))
            row(op, FP8_KERNEL, ms, f"groups={cfg.groups} tiles={cfg.tiles} warps={cfg.num_warps}; ids on the GPU")
    if sweep and cuda:
        _sweep(table, ids, stored, bench, row, checker, f"{name} x{ids.shape[0]}")
    out_q, out_d = torch.empty_like(stored), torch.empty_like(raw)
    row("quantize fp8", f"quantize_staging ({device.type})", bench(lambda: quantize_staging(raw, dtype, out=out_q)),
        "torch ops on packed bytes")
    row("dequantize fp8", f"dequantize_staging ({device.type})",
        bench(lambda: dequantize_staging(stored, dtype, out=out_d)), "torch ops on packed bytes")


def _sweep(table, ids, stored, bench, row, checker, label) -> None:
    checked = check_block_ids(table, ids, unique=True).on(stored.device)
    want = stored.clone()  # checked against quantize_staging above
    largest = max(s.page_bytes for s in table.segments) // table.tensors[0].element_size() // FP8_GROUP
    for groups, warps in SWEEP:
        cfg = dict(groups=groups, num_warps=warps, tiles=min(fp8_mod.MAX_GRID_YZ, -(-largest // groups)))
        stored.fill_(0)
        fp8_mod.launch(table, checked, stored, ids.shape[1], True, **cfg)
        checker.expect(torch.equal(stored, want), f"{label} fp8 {cfg}: pack differs")
        for op, pack in (("pack fp8", True), ("unpack fp8", False)):
            ms = bench(lambda: fp8_mod.launch(table, checked, stored if pack else want, ids.shape[1], pack, **cfg),
                       quick=True)
            row(op, f"saria triton fp8 groups={groups} warps={warps} tiles={cfg['tiles']}", ms, "sweep")
    stored.copy_(want)


def fp8_interpreter_smoke(rows) -> None:
    """A few pages through the FP8 kernel under the interpreter: it runs and matches the torch path."""
    caches = dense_layer_caches(get_model("qwen3-8b"), 4, 16)[:4]
    for c in caches:
        c.normal_()
    ids = torch.tensor([3, 1])
    t0 = time.perf_counter()
    stored = pack_pages_fp8(caches, ids, backend="triton")
    ms = (time.perf_counter() - t0) * 1e3
    ok = torch.equal(stored, quantize_staging(pack_pages(caches, ids, backend="torch"), caches[0].dtype))
    fresh = zeros_like_caches(caches)
    unpack_pages_fp8(stored, fresh, ids, backend="triton")
    ok = ok and torch.equal(pack_pages(fresh, ids), dequantize_staging(stored, caches[0].dtype))
    raw_bytes = PageTable(caches).staging_bytes(2)
    rows.append({"device": "cpu", "table": "qwen3-8b (4 layers)", "op": "pack fp8",
                 "impl": "saria triton fp8 (interpreter)", "chunks": 1, "bytes": raw_bytes, "ms": round(ms, 2),
                 "gbps": round(raw_bytes / ms / 1e6, 4), "frac_of_d2d": "", "x_torch_baseline": "",
                 "note": f"interpreter smoke, pack and unpack match torch: {ok}"})


def fp8_target_lines(rows) -> list[str]:
    """``target fp8 <op> <table> <n> chunk(s) (kernel) >= 0.80 of the D2D copy: <v> -> MET|MISSED``."""
    lines = []
    for r in rows:
        if r["device"] == "cuda" and r["impl"] == FP8_KERNEL:
            value, n = float(r["frac_of_d2d"]), r["chunks"]
            lines.append(f"target {r['op']} {r['table']} {n} {'chunk' if n == 1 else 'chunks'} (kernel, raw bytes) "
                         f">= {FP8_TARGET:.2f} of the D2D copy: {value:.3f} -> {'MET' if value >= FP8_TARGET else 'MISSED'}")
    return lines
