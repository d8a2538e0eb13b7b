"""What saria needs to know about vLLM's KV cache: its groups, block size and object sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .compat import AttentionSpec, FullAttentionSpec, MambaSpec


@dataclass(frozen=True)
class EngineGeometry:
    block_size: int
    attention_group: int  # index of the full-attention group in kv_cache_config.kv_cache_groups
    attention_layers: tuple[str, ...]
    kv_bytes_per_token: int
    kv_element_bytes: int = 2  # bytes of one element of the attention pages (bf16: 2)
    state_group: int | None = None  # hybrid models: the GDN (mamba) group
    state_layers: tuple[str, ...] = ()
    state_bytes: int = 0  # one checkpoint: every GDN layer's conv and temporal state
    hash_block_size: int = 0  # tokens per vLLM block hash (Request.block_hashes); 0: the block size

    @property
    def hash_tokens(self) -> int:
        return self.hash_block_size or self.block_size

    @property
    def hybrid(self) -> bool:
        return bool(self.state_layers)


def _state_bytes_per_layer(spec: MambaSpec) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))


def engine_geometry(kv_cache_config: Any, cache_config: Any) -> EngineGeometry:
    """Read the groups of ``kv_cache_config``; clear errors for layouts saria cannot cache."""
    attention = None
    state = None
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if state is not None:
                raise ValueError("saria: more than one GDN/mamba KV cache group is not supported")
            state = (index, tuple(group.layer_names), spec)
        elif isinstance(spec, FullAttentionSpec) and not getattr(spec, "sliding_window", None):
            if attention is not None:
                raise ValueError("saria: more than one full-attention KV cache group is not supported")
            attention = (index, tuple(group.layer_names), spec)
        elif isinstance(spec, AttentionSpec):
            raise ValueError(f"saria: {type(spec).__name__} layers {list(group.layer_names)} are not supported: a "
                             "sliding-window or chunked layer's KV cannot be reused at any prefix length")
        else:
            raise ValueError(f"saria: KV cache group of {type(spec).__name__} is not supported")
    if attention is None:
        raise ValueError("saria: the model has no full-attention layers")
    index, layers, spec = attention
    # vLLM hashes prompts every hash_block_size tokens (finer than a block for hybrid models with
    # partial prefix hits): a chunk's hash is the one at its last token, whatever the granularity.
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or spec.block_size
    if spec.block_size % hash_block_size:
        raise ValueError(f"saria: vLLM's block hash every {hash_block_size} tokens does not divide its block size "
                         f"{spec.block_size}")
    geometry = EngineGeometry(block_size=spec.block_size, attention_group=index, attention_layers=layers,
                              kv_bytes_per_token=len(layers) * spec.page_size_bytes // spec.block_size,
                              kv_element_bytes=spec.dtype.itemsize, hash_block_size=hash_block_size)
    if state is None:
        return geometry
    s_index, s_layers, s_spec = state
    mode = getattr(cache_config, "mamba_cache_mode", None)
    if mode != "align":
        raise ValueError("saria: hybrid (GDN) models need vLLM to keep recurrent states at block boundaries: run with "
                         f"enable_prefix_caching=True (mamba_cache_mode 'align'; it is {mode!r})")
    if s_spec.block_size != spec.block_size:
        raise ValueError(f"saria: GDN block size {s_spec.block_size} differs from attention block size {spec.block_size}")
    return EngineGeometry(block_size=spec.block_size, attention_group=index, attention_layers=layers,
                          kv_bytes_per_token=geometry.kv_bytes_per_token,
                          kv_element_bytes=geometry.kv_element_bytes, state_group=s_index, state_layers=s_layers,
                          state_bytes=len(s_layers) * _state_bytes_per_layer(s_spec), hash_block_size=hash_block_size)
