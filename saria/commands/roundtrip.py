"""``saria roundtrip``: a verified kernel round trip on a Qwen3-8B layout.

Packs a batch of 512-token chunks of a Qwen3-8B-shaped paged KV cache into staging, checksums each
chunk, unpacks into a fresh zeroed cache and checks every byte, with the Triton kernels and with
the fast torch path, and checks that both produced the same staging bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from saria.outputs import check_output, write_output

# The round trip holds the source caches, a fresh copy and one staging buffer per backend:
# 2 + 2 + 2 = 6 bytes of memory per byte of chunks moved (the caches hold twice the pages moved).
MEMORY_PER_CHUNK_BYTE = 6
MEMORY_SHARE = 0.8  # of what the device reports free
CPU_MAX_TOKENS = 512  # the default chunk: seconds under the Triton interpreter


def _prepare_backend() -> None:
    """Without CUDA the Triton kernels run under the interpreter, which must be chosen before
    saria.kernels is imported."""
    import torch

    if not torch.cuda.is_available() and "saria.kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pages_match(fresh, original, touched) -> bool:
    """Touched pages equal byte for byte (NaN bit patterns included), untouched pages still zero."""
    import torch

    f, o = fresh.view(torch.uint8), original.view(torch.uint8)
    return torch.equal(f[touched], o[touched]) and not f[~touched].any()


def _free_bytes(device) -> int | None:
    """What ``device`` can still allocate: CUDA's free memory, or the kernel's MemAvailable."""
    import torch

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    from saria.commands.doctor import _meminfo_bytes

    return _meminfo_bytes("MemAvailable")


def _check_memory(moved_bytes: int, device) -> None:
    """Refuse, before allocating, a round trip that would not fit in ``device``'s memory."""
    need = MEMORY_PER_CHUNK_BYTE * moved_bytes
    free = _free_bytes(device)
    if free is not None and need > MEMORY_SHARE * free:
        raise ValueError(f"--chunks x --chunk-tokens moves {moved_bytes / 2**30:,.2f} GiB, and the round trip needs "
                         f"{MEMORY_PER_CHUNK_BYTE}x that ({need / 2**30:,.2f} GiB) but {device.type} has "
                         f"{free / 2**30:,.2f} GiB free: ask for fewer or smaller chunks")


def run(chunks: int | None, chunk_tokens: int, block_size: int = 16) -> dict:
    import torch

    from saria.kernels import PageTable, checksum, pack_pages, resolve_backend, unpack_pages
    from saria.harness.paged_caches import dense_layer_caches, zeros_like_caches
    from saria.models import get_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if chunks is None:
        chunks = 2 if device.type == "cuda" else 1  # the interpreter moves ~10 MB/s
    if chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {chunks}")
    if chunk_tokens < block_size or chunk_tokens % block_size:
        raise ValueError(f"--chunk-tokens must be a positive multiple of the {block_size}-token page, got {chunk_tokens}")
    spec = get_model("qwen3-8b")
    moved = chunks * chunk_tokens * spec.kv_bytes_per_token
    if device.type == "cpu" and chunk_tokens * chunks > CPU_MAX_TOKENS:  # the interpreter: ~10 MB/s
        raise ValueError(f"--chunks x --chunk-tokens is {chunks * chunk_tokens:,} tokens ({moved / 2**20:,.0f} MiB); "
                         f"without CUDA the Triton interpreter moves about 10 MB/s, so a round trip here takes at "
                         f"most {CPU_MAX_TOKENS} tokens (one 512-token chunk)")
    _check_memory(moved, device)
    pages = chunk_tokens // block_size
    num_blocks = 2 * chunks * pages  # half the pages stay untouched: the round trip must not write them
    caches = dense_layer_caches(spec, num_blocks, block_size, device=device, seed=1)
    table = PageTable(caches)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randperm(num_blocks, generator=gen)[:chunks * pages].view(chunks, pages)
    touched = torch.zeros(num_blocks, dtype=torch.bool)
    touched[ids.reshape(-1)] = True

    result = {"model": spec.name, "device": str(device), "layers": spec.fa_layers, "block_size": block_size,
              "chunks": chunks, "chunk_tokens": chunk_tokens, "chunk_bytes": table.staging_bytes(pages),
              "backends": {}}
    staged = {}
    for requested in ("triton", "torch"):
        backend = resolve_backend(requested, device)
        label = backend + (" (interpreter)" if backend == "triton" and device.type == "cpu" else "")
        print(f"  {label:<22} packing {chunks} x {chunk_tokens} tokens x {spec.fa_layers} layers ...",
              end="", flush=True)
        _sync(device)
        t0 = time.perf_counter()
        staging = pack_pages(table, ids, backend=backend)
        _sync(device)
        t_pack = time.perf_counter() - t0
        sums = [checksum(staging[c], backend=backend) for c in range(chunks)]
        fresh = zeros_like_caches(caches)
        _sync(device)
        t0 = time.perf_counter()
        unpack_pages(staging, fresh, ids, backend=backend)
        _sync(device)
        t_unpack = time.perf_counter() - t0
        ok = all(_pages_match(f, c, touched.to(device)) for f, c in zip(fresh, caches))
        nbytes = staging.numel()
        print(f" {nbytes / 2**20:.1f} MiB, pack {nbytes / t_pack / 1e9:.2f} GB/s, "
              f"unpack {nbytes / t_unpack / 1e9:.2f} GB/s, round trip {'exact' if ok else 'WRONG'}")
        result["backends"][label] = {"bytes": nbytes, "pack_s": t_pack, "unpack_s": t_unpack,
                                     "checksums": [f"{s:016x}" for s in sums], "round_trip_exact": ok}
        staged[label] = staging
    first, second = staged.values()
    result["backends_agree"] = bool(torch.equal(first, second))
    result["ok"] = result["backends_agree"] and all(b["round_trip_exact"] for b in result["backends"].values())
    return result


def main(args: argparse.Namespace) -> int:
    if args.json is not None:
        check_output(args.json, "--json")
    _prepare_backend()
    print(f"== kernel round trip: Qwen3-8B layout, chunks of {args.chunk_tokens} tokens")
    result = run(args.chunks, args.chunk_tokens)
    for label, b in result["backends"].items():
        print(f"  {label:<22} chunk checksums: {', '.join(b['checksums'])}")
    print(f"  staging identical across backends: {result['backends_agree']}")
    print("roundtrip: OK" if result["ok"] else "roundtrip: FAILED (bytes differ)")
    if args.json:
        write_output(args.json, json.dumps(result, indent=2) + "\n", "--json")
        print(f"wrote {args.json}")
    return 0 if result["ok"] else 1
