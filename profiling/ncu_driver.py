#!/usr/bin/env python3
"""A few launches of saria's kernels for Nsight Compute (``profiling/ncu_kernels.sh``): pack, unpack
and checksum, once each, on the Qwen3-8B and the Qwen3-Next-like hybrid tables at 1 and 8 chunks
(12 kernel launches; no timing loops). Every kernel is compiled and run once first, outside the
profiled range (``cudaProfilerStart`` / ``Stop``: run ncu with ``--profile-from-start off``).

``--labels FILE`` writes the profiled launches in order as JSON (``[{"label", "kernel"}]``), which
the summary in ``ncu_kernels.sh`` pairs with ncu's rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.kernels import PageTable, checksum, pack_pages, unpack_pages  # noqa: E402
from saria.harness.paged_caches import dense_layer_caches, hybrid_layer_caches  # noqa: E402
from saria.models import get_model  # noqa: E402

COPY, CHECKSUM = "_copy_pages_kernel", "_checksum_kernel"


def tables(device: torch.device, chunks: int):
    """(name, table, ids [chunks, pages]) shaped as in bench/bench_kernels.py."""
    gen = torch.Generator().manual_seed(0)
    pages = 512 // 16
    dense = dense_layer_caches(get_model("qwen3-8b"), 2 * chunks * pages, 16, device=device)
    ids = torch.randperm(2 * chunks * pages, generator=gen)[:chunks * pages].view(chunks, pages)
    yield "qwen3-8b", PageTable(dense), ids
    hybrid, _ = hybrid_layer_caches(get_model("qwen3-next-80b-a3b"), 2 * chunks, device=device)
    yield "qwen3-next-like", PageTable(hybrid), torch.randperm(2 * chunks, generator=gen)[:chunks].view(chunks, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--labels", help="write the profiled launches, in order, to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("ncu_driver: no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cases = [(f"{name} x{chunks}", table, ids) for chunks in args.chunks for name, table, ids in tables(device, chunks)]
    stagings = []
    for _, table, ids in cases:  # compile and warm up outside the profiled range
        staging = pack_pages(table, ids)
        unpack_pages(staging, table, ids)
        checksum(staging)
        stagings.append(staging)
    torch.cuda.synchronize()
    labels = []
    torch.cuda.profiler.start()
    for (label, table, ids), staging in zip(cases, stagings):
        pack_pages(table, ids, out=staging)
        unpack_pages(staging, table, ids)
        checksum(staging)  # synchronizes
        labels += [{"label": f"pack {label}", "kernel": COPY}, {"label": f"unpack {label}", "kernel": COPY},
                   {"label": f"checksum {label}", "kernel": CHECKSUM}]
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    if args.labels:
        Path(args.labels).write_text(json.dumps(labels, indent=1))
    print(f"ncu_driver: {len(labels)} launches profiled: " + ", ".join(x["label"] for x in labels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
