#!/usr/bin/env python3
"""Pack / unpack bandwidth of saria's page kernels on realistic tables, side by side with
(1) a torch baseline: per-layer ``index_select`` + ``cat`` (pack) / ``index_copy_`` (unpack), and
(2) the bound: a torch device-to-device copy of the same number of bytes.

Tables: Qwen3-8B (36 FA layers, 8 KV heads, head dim 128, bf16, 16-token pages, 512-token chunks:
72 MiB a chunk) and a Qwen3-Next-like hybrid table (12 FA layers + 36 GDN layers whose state pages
are padded to the FA page). GB/s counts staging bytes once (bytes packed), the D2D bound likewise.

On a GPU: CUDA timings with ``triton.testing.do_bench`` (median), after a correctness check of
every configuration timed (pack equals the torch path's, an unpack into zeroed caches restores
exactly the packed pages, the checksum equals the torch path's; a mismatch makes the exit
status 1). Rows per table and chunk count:

* ``saria triton``: the public ops with their automatic launch configuration (``launch_config``,
  noted), ids on the CPU as the data plane passes them (each call validates them and copies them to
  the GPU); the note also gives the host time one call takes;
* ``saria triton kernel (auto)``: the same launch alone, ids already on the GPU;
* ``saria checksum triton``: ``checksum(staging)`` including the host sync that returns the int
  (do_bench, as the target); ``(call latency)``: the wall-clock time of one call from its start,
  host checks and launch included; ``... kernel only``: its one launch;
* ``--sweep-block``: a compact sweep of the launch knobs (tile words, warps, tiles per page;
  checksum block, warps, programs) so the rule can be re-tuned from the CSV.

The run ends with one line per target, ``target <what>: <value> -> MET`` (or ``-> MISSED``): pack and
unpack >= 0.90 of the D2D copy per table and chunk count, as launched (the kernel) and as the public
ops with ids on the CPU, and the checksum >= 0.50 of it incl. the host sync; FP8 pack and unpack
(``ssd_dtype=fp8``, bench/bench_kernels_fp8.py: quantized in the gather kernel, bandwidth counted in
raw bytes) >= 0.80 of it, kernel alone. Misses do not change the exit status. Target on an H200 besides: >= 3x the torch baseline.

On a CPU-only machine: the torch backend against the same baselines with wall-clock timing, plus a
tiny Triton-interpreter smoke run, all labelled as CPU; those numbers say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the interpreter smoke run needs this before saria.kernels loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.kernels import PageTable, check_block_ids, checksum, pack_pages, unpack_pages  # noqa: E402
from saria.kernels.pages import triton as pages_mod  # noqa: E402
from saria.harness.paged_caches import dense_layer_caches, hybrid_layer_caches, zeros_like_caches  # noqa: E402
from saria.models import get_model  # noqa: E402
from bench_kernels_fp8 import fp8_interpreter_smoke, fp8_target_lines, run_fp8  # noqa: E402

checksum_mod = importlib.import_module("saria.kernels.checksum.triton")

FIELDS = ["device", "table", "op", "impl", "chunks", "bytes", "ms", "gbps", "frac_of_d2d", "x_torch_baseline", "note"]
AUTO = "saria triton"
KERNEL_AUTO = "saria triton kernel (auto)"
CHECKSUM_SYNC = "saria checksum triton"
CHECKSUM_KERNEL = "saria checksum triton kernel only"
CHECKSUM_LATENCY = "saria checksum triton (call latency)"
COPY_TARGET, CHECKSUM_TARGET = 0.90, 0.50

# --sweep-block: tile words x warps with one program per tile; then, at the auto tile, no split
# (the a82655d kernel: one program per page), half the split (two tiles per program) and the
# tile-major grid (the tiles of one page launched one after another).
SWEEP_TILES = [(4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8)]
# Checksum: (block words, warps) x programs per SM (0: one block per program).
SWEEP_CHECKSUM = [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]
SWEEP_PROGRAMS_PER_SM = [4, 8, 16, 0]


def timer(device: torch.device, min_seconds: float):
    """Returns bench(fn, quick=False) -> median milliseconds."""
    if device.type == "cuda":
        import triton.testing

        def bench(fn, quick=False):
            if quick:  # sweep rows: shorter runs (the whole --sweep-block run stays near a minute)
                return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
            return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        return bench

    def bench(fn, quick=False):
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


def describe(cfg) -> str:
    if isinstance(cfg, pages_mod.LaunchConfig):
        return f"words={cfg.words} warps={cfg.num_warps} tiles={cfg.tiles}" + (
            f" order={cfg.order}" if cfg.order != "page" else "")
    return f"block={cfg.block} warps={cfg.num_warps} programs={cfg.programs}"


class Checker:
    """GPU correctness checks run before timing; failures are reported and set the exit status."""

    def __init__(self):
        self.failures: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            print(f"CHECK FAILED: {what}", flush=True)

    def copies(self, name, caches, ids, want, launch) -> None:
        """``launch(pack, staging, caches)`` packs ``ids`` of ``caches`` into staging (pack=True) or
        unpacks staging into them: the pack must equal ``want`` (the torch path, poisoned
        buffer first), and the unpack into zeroed caches must restore exactly the packed pages."""
        staging = torch.full_like(want, 0xA5)
        launch(True, staging, caches)
        self.expect(torch.equal(staging.reshape(-1), want.reshape(-1)),
                    f"{name}: pack differs from the torch path")
        fresh = zeros_like_caches(caches)
        launch(False, want, fresh)
        repacked = pack_pages(fresh, ids, backend="torch").reshape(-1)
        self.expect(torch.equal(repacked, want.reshape(-1)), f"{name}: unpack did not restore the packed pages")
        written = sum(int(torch.count_nonzero(torch.empty(0, dtype=torch.uint8, device=f.device)
                                              .set_(f.untyped_storage()))) for f in fresh)
        self.expect(written == int(torch.count_nonzero(want)), f"{name}: unpack wrote bytes outside the packed pages")


def host_us_per_call(fn, calls: int = 20) -> float:
    """Host time one call takes (the GPU is not waited for inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def call_latency_ms(fn, calls: int = 50) -> float:
    """Median wall-clock time of ``fn()`` (which synchronizes), each call after an L2 flush and a
    device sync: what a caller waits, host work before the launch included (do_bench hides that part
    behind its L2 flush)."""
    import triton

    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    fn()
    samples = []
    for _ in range(calls):
        triton.runtime.driver.active.clear_cache(cache)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def run_table(device, name, caches, ids, bench, backend, note, rows, checker, sweep=False):
    table = PageTable(caches)
    flat = ids.reshape(-1)
    flat_dev = flat.to(device)
    chunks, per_chunk = ids.shape
    staging = pack_pages(table, ids, backend=backend)
    nbytes = staging.numel()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"
    checked_ids = check_block_ids(table, ids, unique=True).on(device) if cuda else None
    auto = pages_mod.launch_config(table, flat.numel())

    if cuda:  # correctness of what is timed below, before any timing
        want = pack_pages(table, ids, backend="torch").reshape(-1)
        checker.copies(f"{name} x{chunks} auto", caches, ids, want, lambda pack, st, cs: (
            pack_pages(cs, ids, out=st) if pack else unpack_pages(st, cs, ids)))
        checker.expect(checksum(staging) == checksum(staging, backend="torch"), f"{name} x{chunks}: checksum "
                       "differs from the torch path's")

    # Baselines have duplicate-free ids by construction; the kernels validate ids on every call.
    ms_d2d = bench(lambda: dst.copy_(src))
    ms_base = {"pack": bench(lambda: baseline_pack(caches, flat_dev)),
               "unpack": bench(lambda: baseline_unpack(staging.view(-1), caches, flat_dev))}
    calls = {"pack": lambda: pack_pages(table, ids, out=staging, backend=backend),
             "unpack": lambda: unpack_pages(staging, table, ids, backend=backend)}
    ms_kernel = {op: bench(fn) for op, fn in calls.items()}

    def row(op, impl, ms, row_note=note):
        rows.append({"device": device.type, "table": name, "op": op, "impl": impl, "chunks": chunks,
                     "bytes": nbytes, "ms": round(ms, 4), "gbps": round(nbytes / ms / 1e6, 2),
                     "frac_of_d2d": round(ms_d2d / ms, 3), "x_torch_baseline": round(ms_base[op] / ms, 2)
                     if op in ms_base else "", "note": row_note})

    def launch(pack, **override):
        return pages_mod.launch(table, checked_ids, staging, per_chunk, pack, **override)

    row("copy", "torch d2d copy (bound)", ms_d2d, "same bytes, contiguous")
    for op in ("pack", "unpack"):
        row(op, "torch baseline", ms_base[op], "per-layer index_select+cat / index_copy_")
        if cuda:
            host = host_us_per_call(calls[op])
            row(op, f"saria {backend}", ms_kernel[op],
                f"auto: {describe(auto)}; ids on the CPU; host {host:.0f} us/call")
            row(op, KERNEL_AUTO, bench(lambda: launch(op == "pack")), "ids on the GPU, launch only")
        else:
            row(op, f"saria {backend}", ms_kernel[op])
    # checksum of the same staging bytes: the Triton kernel on a GPU; on CPU tensors ``auto`` runs the
    # blocked host path (also what SSD parts in pinned host memory get on a GPU machine), wall clock.
    if cuda:
        cfg = checksum_mod.checksum_config(nbytes // 4, device)
        row("checksum", CHECKSUM_SYNC, bench(lambda: checksum(staging)),
            f"device staging, incl. host sync; {describe(cfg)}")
        row("checksum", CHECKSUM_LATENCY, call_latency_ms(lambda: checksum(staging)),
            "wall clock from the call to the int, L2 flushed, median of 50")
        out = torch.zeros(1, dtype=torch.int64, device=device)
        row("checksum", CHECKSUM_KERNEL, bench(lambda: checksum_mod.launch_checksum(staging, out)),
            "one launch, no sync")
    host = staging if device.type == "cpu" else staging.cpu()
    row("checksum", "saria checksum host (blocked)", timer(torch.device("cpu"), 0.2)(lambda: checksum(host)),
        "CPU tensor, wall clock, one thread")
    if sweep and cuda:
        sweep_table(table, caches, ids, staging, launch, auto, bench, row, checker, f"{name} x{chunks}")
    run_fp8(device, name, table, caches, ids, bench, backend, row, checker, sweep)  # last: refills the caches


def sweep_table(table, caches, ids, staging, launch, auto, bench, row, checker, label):
    largest = max(s.page_bytes for s in table.segments)
    configs = [dict(words=w, num_warps=n, tiles=min(pages_mod.MAX_GRID_YZ, -(-largest // (4 * w))))
               for w, n in SWEEP_TILES]
    configs += [dict(words=auto.words, num_warps=auto.num_warps, tiles=1),
                dict(words=auto.words, num_warps=auto.num_warps, tiles=max(1, -(-auto.tiles // 2))),
                dict(words=auto.words, num_warps=auto.num_warps, tiles=auto.tiles, order="tile")]
    want = staging.reshape(-1).clone()  # checked above against the torch path
    seen = set()
    for cfg in configs:
        key = tuple(sorted(cfg.items()))
        if key in seen:
            continue
        seen.add(key)
        text = f"words={cfg['words']} warps={cfg['num_warps']} tiles={cfg['tiles']}" + (
            f" order={cfg['order']}" if "order" in cfg else "")
        fresh_table = {}

        def run(pack, st, cs, cfg=cfg):
            t = table if cs is caches else fresh_table.setdefault(id(cs), PageTable(cs))
            ids_dev = check_block_ids(t, ids, unique=True).on(t.device)
            pages_mod.launch(t, ids_dev, st, ids.shape[1], pack, **cfg)

        checker.copies(f"{label} {text}", caches, ids, want, run)
        for op, pack in (("pack", True), ("unpack", False)):
            row(op, f"saria triton {text}", bench(lambda: launch(pack, **cfg), quick=True), "sweep")
    staging.view(-1).copy_(want)
    out = torch.zeros(1, dtype=torch.int64, device=staging.device)
    n_words = staging.numel() // 4
    sms = torch.cuda.get_device_properties(staging.device).multi_processor_count
    truth = checksum(staging, backend="torch")
    for block, warps in SWEEP_CHECKSUM:
        blocks = -(-n_words // block)
        for per_sm in SWEEP_PROGRAMS_PER_SM:
            programs = blocks if per_sm == 0 else min(blocks, per_sm * sms)
            override = dict(block=block, programs=programs, num_warps=warps)
            checker.expect(checksum_mod.checksum_triton(staging, **override) == truth,
                           f"{label} checksum {override} differs from the torch path's")
            ms = bench(lambda: checksum_mod.launch_checksum(staging, out, **override), quick=True)
            per = "one block each" if per_sm == 0 else f"{per_sm}/SM"
            row("checksum", f"saria checksum triton block={block} warps={warps} programs={programs}", ms,
                f"sweep, kernel only, programs {per}")


def interpreter_smoke(rows):
    """A few pages through the Triton interpreter: proves the kernel path runs here, not its speed."""
    spec = get_model("qwen3-8b")
    caches = dense_layer_caches(spec, 4, 16)[:4]  # 4 layers x 2 pages = 8 programs
    ids = torch.tensor([3, 1])
    t0 = time.perf_counter()
    staging = pack_pages(caches, ids, backend="triton")
    ms = (time.perf_counter() - t0) * 1e3
    ok = torch.equal(staging, pack_pages(caches, ids, backend="torch"))
    ok = ok and checksum(staging, backend="triton") == checksum(staging, backend="torch")
    rows.append({"device": "cpu", "table": "qwen3-8b (4 layers)", "op": "pack", "impl": "saria triton (interpreter)",
                 "chunks": 1, "bytes": staging.numel(), "ms": round(ms, 2),
                 "gbps": round(staging.numel() / ms / 1e6, 4), "frac_of_d2d": "", "x_torch_baseline": "",
                 "note": f"interpreter smoke, matches torch: {ok}"})


def target_lines(rows) -> list[str]:
    """``target <what>: <value> -> MET|MISSED`` for every table and chunk count measured on a GPU:
    pack and unpack as launched (auto configuration, ids on the GPU: the kernel), then as the public
    ops with ids on the CPU (host validation and the ids' copy included), then the checksum."""
    lines = []
    found = {(r["table"], r["chunks"], r["op"], r["impl"]): r for r in rows if r["device"] == "cuda"}
    keys = sorted({(t, c) for t, c, _, _ in found}, key=lambda k: (k[1], k[0]))

    def line(what, r, target):
        value = float(r["frac_of_d2d"])
        return f"target {what} >= {target:.2f} of the D2D copy: {value:.3f} -> {'MET' if value >= target else 'MISSED'}"

    for impl, how in ((KERNEL_AUTO, "kernel, auto launch"), (AUTO, "pack_pages/unpack_pages, ids on the CPU")):
        for table, chunks in keys:
            for op in ("pack", "unpack"):
                r = found.get((table, chunks, op, impl))
                if r:
                    lines.append(line(f"{op} {table} {chunks} {'chunk' if chunks == 1 else 'chunks'} ({how})", r,
                                      COPY_TARGET))
    for table, chunks in keys:
        r = found.get((table, chunks, "checksum", CHECKSUM_SYNC))
        if r:
            lines.append(line(f"checksum {table} {chunks} {'chunk' if chunks == 1 else 'chunks'} incl. host sync", r,
                              CHECKSUM_TARGET))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=None,
                        help="chunks per call to measure (default: 1 8 on a GPU, 1 on CPU)")
    parser.add_argument("--csv", default="results/bench_kernels.csv", help="CSV output path")
    parser.add_argument("--sweep-block", action="store_true",
                        help="GPU only: also sweep tile words, warps and tiles per page, and the checksum's "
                             "block, warps and programs (a minute or so on an H200)")
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
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    else:
        print("device: CPU (no CUDA): torch backend vs baselines, then an interpreter smoke run", flush=True)
    rows: list[dict] = []
    checker = Checker()
    for chunks in chunk_list:
        for name, caches, ids in build_tables(device, chunks):
            run_table(device, name, caches, ids, bench, backend, note, rows, checker, sweep=args.sweep_block)
            del caches
    if device.type == "cpu":
        interpreter_smoke(rows)
        fp8_interpreter_smoke(rows)

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
    for line in target_lines(rows) + fp8_target_lines(rows):
        print(line)
    if checker.failures:
        print(f"correctness: {len(checker.failures)} check(s) FAILED: " + "; ".join(checker.failures))
        return 1
    if device.type == "cuda":
        print("correctness: every configuration timed matched the torch path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
