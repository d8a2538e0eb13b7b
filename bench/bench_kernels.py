#!/usr/bin/env python3
"""Pack / unpack bandwidth of saria's page kernels on realistic tables, side by side with
(1) a torch baseline: per-layer ``index_select`` + ``cat`` (pack) / ``index_copy_`` (unpack), and
(2) the bound: a torch device-to-device copy of the same number of bytes.

Tables: Qwen3-8B (36 FA layers, 8 KV heads, head dim 128, bf16, 16-token pages, 512-token chunks:
72 MiB a chunk) and a Qwen3-Next-like hybrid table (12 FA layers + 36 GDN layers whose state pages
are padded to the FA page). GB/s counts staging bytes once (bytes packed), the D2D bound likewise.

On a GPU: CUDA timings with ``triton.testing.do_bench`` (median). Target on an H200: the kernels at
>= 90% of the D2D copy and >= 3x the torch baseline. On a CPU-only machine: the torch backend
against the same baselines with wall-clock timing, plus a tiny Triton-interpreter smoke run, all
labelled as CPU; those numbers say nothing about the GPU.

Writes CSV (``--csv``); ``--sweep-block`` also times other per-iteration word counts and warp
counts of the kernel on a GPU.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter smoke run needs this before saria.kernels loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.kernels import PageTable, checksum, pack_pages, unpack_pages  # noqa: E402
from saria.kernels import pages as pages_mod  # noqa: E402
from saria.layouts import dense_layer_caches, hybrid_layer_caches  # noqa: E402
from saria.models import get_model  # noqa: E402

FIELDS = ["device", "table", "op", "impl", "chunks", "bytes", "ms", "gbps", "frac_of_d2d", "x_torch_baseline", "note"]


def timer(device: torch.device, min_seconds: float):
    """Returns bench(fn) -> median milliseconds."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    def bench(fn):
        fn()
        samples, start = [], time.perf_counter()
        while len(samples) < 3 or time.perf_counter() - start < min_seconds:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return bench


def baseline_pack(caches, ids):
    return torch.cat([c.index_select(0, ids).reshape(-1).view(torch.uint8) for c in caches])


def baseline_unpack(staging, caches, ids):
    offset = 0
    for c in caches:
        n = ids.numel() * c[0].numel() * c.element_size()
        page_shape = (ids.numel(),) + tuple(c.shape[1:])
        c.index_copy_(0, ids, staging[offset:offset + n].view(c.dtype).view(page_shape))
        offset += n


def build_tables(device, chunks: int):
    """(name, caches, ids [chunks, pages]) for the two realistic tables."""
    dense = get_model("qwen3-8b")
    pages = 512 // 16
    num_blocks = 2 * chunks * pages
    gen = torch.Generator().manual_seed(0)
    ids = torch.randperm(num_blocks, generator=gen)[:chunks * pages].view(chunks, pages)
    yield "qwen3-8b", dense_layer_caches(dense, num_blocks, 16, device=device), ids

    hybrid = get_model("qwen3-next-80b-a3b")
    caches, block_size = hybrid_layer_caches(hybrid, 2 * chunks, device=device)
    # One ~1K-token hybrid chunk is one vLLM page of `block_size` tokens.
    ids = torch.randperm(2 * chunks, generator=gen)[:chunks].view(chunks, 1)
    yield f"qwen3-next-like(bs={block_size})", caches, ids


def run_table(device, name, caches, ids, bench, backend, note, rows, sweep=False):
    table = PageTable(caches)
    flat = ids.reshape(-1)
    flat_dev = flat.to(device)
    chunks = ids.shape[0]
    staging = pack_pages(table, ids, backend=backend)
    nbytes = staging.numel()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Baselines have duplicate-free ids by construction; the kernels validate ids on every call.
    ms_d2d = bench(lambda: dst.copy_(src))
    ms_base = {"pack": bench(lambda: baseline_pack(caches, flat_dev)),
               "unpack": bench(lambda: baseline_unpack(staging.view(-1), caches, flat_dev))}
    ms_kernel = {"pack": bench(lambda: pack_pages(table, ids, out=staging, backend=backend)),
                 "unpack": bench(lambda: unpack_pages(staging, table, ids, backend=backend))}

    def row(op, impl, ms, row_note=note):
        rows.append({"device": device.type, "table": name, "op": op, "impl": impl, "chunks": chunks,
                     "bytes": nbytes, "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 2),
                     "frac_of_d2d": round(ms_d2d / ms, 3), "x_torch_baseline": round(ms_base[op] / ms, 2)
                     if op in ms_base else "", "note": row_note})

    row("copy", "torch d2d copy (bound)", ms_d2d, "same bytes, contiguous")
    for op in ("pack", "unpack"):
        row(op, "torch baseline", ms_base[op], "per-layer index_select+cat / index_copy_")
        row(op, f"saria {backend}", ms_kernel[op])
    # checksum of the same staging bytes: the Triton kernel on a GPU; on CPU tensors ``auto`` runs the
    # blocked host path (also what SSD parts in pinned host memory get on a GPU machine), wall clock.
    if device.type == "cuda":
        row("checksum", "saria checksum triton", bench(lambda: checksum(staging)), "device staging, incl. host sync")
    host = staging if device.type == "cpu" else staging.cpu()
    row("checksum", "saria checksum host (blocked)", timer(torch.device("cpu"), 0.2)(lambda: checksum(host)),
        "CPU tensor, wall clock, one thread")
    if sweep and device.type == "cuda":
        ids_dev = flat.to(device)
        for words in (512, 1024, 2048, 4096, 8192):
            for warps in (2, 4, 8):
                for op, pack in (("pack", True), ("unpack", False)):
                    ms = bench(lambda: pages_mod._launch(table, ids_dev, staging, ids.shape[1], pack,
                                                         words=words, num_warps=warps))
                    row(op, f"saria triton words={words} warps={warps}", ms, "sweep")


def interpreter_smoke(rows):
    """A few pages through the Triton interpreter: proves the kernel path runs here, not its speed."""
    spec = get_model("qwen3-8b")
    caches = dense_layer_caches(spec, 4, 16)[:4]  # 4 layers x 2 pages = 8 programs
    ids = torch.tensor([3, 1])
    t0 = time.perf_counter()
    staging = pack_pages(caches, ids, backend="triton")
    ms = (time.perf_counter() - t0) * 1e3
    ok = torch.equal(staging, pack_pages(caches, ids, backend="torch"))
    rows.append({"device": "cpu", "table": "qwen3-8b (4 layers)", "op": "pack", "impl": "saria triton (interpreter)",
                 "chunks": 1, "bytes": staging.numel(), "ms": round(ms, 2),
                 "gbps": round(staging.numel() / ms / 1e6, 4), "frac_of_d2d": "", "x_torch_baseline": "",
                 "note": f"interpreter smoke, matches torch: {ok}"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="chunks per call to measure (default: 1 8 on a GPU, 1 on CPU)")
    parser.add_argument("--csv", default="results/bench_kernels.csv", help="CSV output path")
    parser.add_argument("--sweep-block", action="store_true", help="GPU only: also sweep words per iteration and warps")
    parser.add_argument("--min-seconds", type=float, default=0.5, help="CPU: time each case at least this long")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chunk_list = args.chunks or ([1, 8] if device.type == "cuda" else [1])
    if any(c < 1 for c in chunk_list):
        parser.error("--chunks must be >= 1")
    bench = timer(device, args.min_seconds)
    backend = "triton" if device.type == "cuda" else "torch"
    note = "" if device.type == "cuda" else "CPU: torch backend, wall clock; not a GPU number"
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    else:
        print("device: CPU (no CUDA): torch backend vs baselines, then an interpreter smoke run")
    rows: list[dict] = []
    for chunks in chunk_list:
        for name, caches, ids in build_tables(device, chunks):
            run_table(device, name, caches, ids, bench, backend, note, rows, sweep=args.sweep_block)
            del caches
    if device.type == "cpu":
        interpreter_smoke(rows)

    widths = {f: max(len(f), *(len(str(r[f])) for r in rows)) for f in FIELDS if f != "note"}
    print("  ".join(f"{f:>{widths[f]}}" for f in widths))
    for r in rows:
        print("  ".join(f"{str(r[f]):>{widths[f]}}" for f in widths) + (f"  {r['note']}" if r["note"] else ""))
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
