"""Engine-shaped paged caches for a :class:`~saria.models.ModelSpec`: what the demo, the benchmarks
and the tests pack and unpack. Each builder returns the list of paged tensors a page table takes.
"""

from __future__ import annotations

import torch

from saria.models import ModelSpec

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8": torch.float8_e4m3fn}


def _fill_random(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Random bytes (every bit pattern, NaNs included): a copy must preserve them all.
    Generated on the tensor's device, so filling gigabytes on a GPU takes milliseconds."""
    gen = torch.Generator(device=t.device).manual_seed(seed)
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=t.device, generator=gen))
    return t


def dense_layer_caches(spec: ModelSpec, num_blocks: int, block_size: int = 16, *, device="cpu",
                       random: bool = True, seed: int = 0) -> list[torch.Tensor]:
    """One ``[num_blocks, block_size, 2, kv_heads, head_dim]`` tensor per FA layer: the vLLM 0.32
    per-layer view with K and V interleaved per token (FlashAttention)."""
    dtype = TORCH_DTYPES[spec.kv_dtype]
    caches = []
    for layer in range(spec.fa_layers):
        t = torch.empty(num_blocks, block_size, 2, spec.kv_heads, spec.head_dim, dtype=dtype, device=device)
        caches.append(_fill_random(t, seed * 1000 + layer) if random else t.zero_())
    return caches


def hybrid_block_size(spec: ModelSpec, multiple: int = 16) -> int:
    """The smallest FA block size (a multiple of ``multiple`` tokens) whose page holds one GDN
    layer's state, as vLLM's hybrid allocator unifies page sizes."""
    per_token = spec.kv_bytes_per_token_layer
    tokens = -(-spec.state_bytes_per_layer // per_token)
    return -(-tokens // multiple) * multiple


def hybrid_layer_caches(spec: ModelSpec, num_blocks: int, block_size: int | None = None, *, device="cpu",
                        random: bool = True, seed: int = 0) -> tuple[list[torch.Tensor], int]:
    """A hybrid model's table: FA layers as in :func:`dense_layer_caches`, then each GDN layer's page
    (conv state bytes then temporal state bytes) as an int8 view ``[num_blocks, used]`` with the
    padded page stride of the FA page. Returns (tensors, block_size)."""
    if not spec.hybrid:
        raise ValueError(f"{spec.name} has no GDN layers")
    block_size = block_size or hybrid_block_size(spec)
    caches = dense_layer_caches(spec, num_blocks, block_size, device=device, random=random, seed=seed)
    page = block_size * spec.kv_bytes_per_token_layer
    used = spec.state_bytes_per_layer
    if used > page:
        raise ValueError(f"block size {block_size} gives {page}-byte pages, smaller than a GDN state of {used}")
    for layer in range(spec.gdn_layers):
        raw = torch.empty(num_blocks, page, dtype=torch.int8, device=device)
        raw = _fill_random(raw, seed * 1000 + 500 + layer) if random else raw.zero_()
        caches.append(raw.as_strided((num_blocks, used), (page, 1)))
    return caches, block_size


def zeros_like_caches(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh zeroed tensors with the same shapes, strides and dtypes (padded views included)."""
    out = []
    for c in caches:
        base = torch.zeros(c.untyped_storage().nbytes(), dtype=torch.uint8, device=c.device)
        out.append(torch.empty(0, dtype=c.dtype, device=c.device).set_(
            base.untyped_storage(), c.storage_offset(), c.shape, c.stride()))
    return out
