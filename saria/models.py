"""KV footprints of the models saria is measured on, as plain data (no torch: control and replay use it).

Numbers come from each model's published ``config.json`` on its model card; the source is noted
beside each entry. Entries named ``*-paper`` are the SARIA paper's scaled-down configurations (no
released checkpoint): their layer counts are the paper's, their per-layer shapes are assumed from
the released model they shrink, as each source says. Byte counts are per token for full-attention
(FA) KV and per checkpoint for a GDN layer's recurrent state.

``q_heads`` and ``compute_params`` feed the replay's prefill FLOPs (``saria.replay.layerwise``):
the query heads of an FA layer, and the non-embedding parameters one token goes through (the
active ones of a mixture of experts; embeddings and the LM head are left out, as prefill computes
logits for the last token only). ``compute_source`` says where each figure comes from; 0 means
unknown (the FLOPs model then refuses the model).
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    fa_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"
    # Hybrid (gated delta net) layers; zero for dense models.
    gdn_layers: int = 0
    gdn_value_heads: int = 0  # HV
    gdn_key_heads: int = 0
    gdn_key_dim: int = 0  # K
    gdn_value_dim: int = 0  # V
    gdn_conv_kernel: int = 0  # conv state keeps kernel - 1 positions
    gdn_state_dtype: str = "fp32"
    source: str = ""
    # Prefill compute (saria.replay.layerwise); 0: unknown.
    q_heads: int = 0
    compute_params: float = 0.0
    compute_source: str = ""

    @property
    def hybrid(self) -> bool:
        return self.gdn_layers > 0

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one FA layer."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.fa_layers * self.kv_bytes_per_token_layer

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_heads * self.gdn_key_dim + self.gdn_value_heads * self.gdn_value_dim

    @property
    def gdn_temporal_shape(self) -> tuple[int, int, int]:
        """``[HV, V, K]`` of one layer's temporal state."""
        return (self.gdn_value_heads, self.gdn_value_dim, self.gdn_key_dim)

    @property
    def gdn_conv_shape(self) -> tuple[int, int]:
        """``[conv_len, conv_dim]`` of one layer's conv state."""
        return (self.gdn_conv_kernel - 1, self.gdn_conv_dim)

    @property
    def gdn_temporal_bytes(self) -> int:
        hv, v, k = self.gdn_temporal_shape
        return hv * v * k * DTYPE_BYTES[self.gdn_state_dtype]

    @property
    def gdn_conv_bytes(self) -> int:
        length, dim = self.gdn_conv_shape
        return length * dim * DTYPE_BYTES[self.kv_dtype] if self.hybrid else 0

    @property
    def state_bytes_per_layer(self) -> int:
        return self.gdn_conv_bytes + self.gdn_temporal_bytes if self.hybrid else 0

    @property
    def state_bytes(self) -> int:
        """One checkpoint: every GDN layer's conv and temporal state."""
        return self.gdn_layers * self.state_bytes_per_layer


MODELS: dict[str, ModelSpec] = {
    "qwen3-8b": ModelSpec(
        "qwen3-8b", fa_layers=36, kv_heads=8, head_dim=128,
        q_heads=32, compute_params=6.946e9,
        compute_source=("Qwen/Qwen3-8B config.json: hidden 4096, 32 query heads, intermediate 12288; per layer "
                        "q, k, v, o 4096x(4096+1024+1024) + 4096x4096, MLP 3x4096x12288 = 192.9M; x 36 = 6.95B, "
                        "the model card's 6.95B non-embedding parameters"),
        source="Qwen/Qwen3-8B config.json: num_hidden_layers 36, num_key_value_heads 8, head_dim 128, bf16"),
    "qwen3-1.7b": ModelSpec(
        "qwen3-1.7b", fa_layers=28, kv_heads=8, head_dim=128,
        q_heads=16, compute_params=1.409e9,
        compute_source=("Qwen/Qwen3-1.7B config.json: hidden 2048, 16 query heads, intermediate 6144; per layer "
                        "2048x(2048+1024+1024) + 2048x2048 + 3x2048x6144 = 50.3M; x 28 = 1.41B, the model card's "
                        "1.4B non-embedding parameters"),
        source="Qwen/Qwen3-1.7B config.json: num_hidden_layers 28, num_key_value_heads 8, head_dim 128, bf16"),
    "qwen3-next-80b-a3b": ModelSpec(
        "qwen3-next-80b-a3b", fa_layers=12, kv_heads=2, head_dim=256,
        gdn_layers=36, gdn_value_heads=32, gdn_key_heads=16, gdn_key_dim=128, gdn_value_dim=128,
        gdn_conv_kernel=4, q_heads=16, compute_params=3.0e9,
        compute_source=("Qwen/Qwen3-Next-80B-A3B-Instruct model card: 3B activated parameters (10 of 512 "
                        "experts and a shared one per token); num_attention_heads 16"),
        source=("Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, full_attention_interval 4, "
                "num_key_value_heads 2, head_dim 256, linear_num_value_heads 32, linear_num_key_heads 16, "
                "linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4; "
                "GDN temporal state fp32 as vLLM keeps it")),
    # The paper's hybrid model (§5.1: "Qwen3.5-9B with 8 full-attention and 24 gated-delta-network layers").
    "qwen3.5-9b": ModelSpec(
        "qwen3.5-9b", fa_layers=8, kv_heads=4, head_dim=256,
        gdn_layers=24, gdn_value_heads=32, gdn_key_heads=16, gdn_key_dim=128, gdn_value_dim=128,
        gdn_conv_kernel=4, q_heads=16, compute_params=8.0e9,
        compute_source=("estimate: the model card's 9B parameters less about 1B of embeddings; 16 query heads "
                        "of 256 assumed as Qwen3-Next's"),
        source=("Qwen/Qwen3.5-9B model card and text_config: 32 layers, full_attention_interval 4 "
                "(8 gated-attention + 24 Gated DeltaNet), num_key_value_heads 4, head_dim 256, "
                "linear_num_value_heads 32, linear_num_key_heads 16, linear key/value head dim 128, "
                "linear_conv_kernel_dim 4, mamba_ssm_dtype float32; bf16 KV and conv state")),
    # The paper's scaled-down A30 models (§5.1): not released checkpoints, so their per-layer shapes
    # are assumed to be those of the released model they shrink (stated in each source).
    "qwen3-1.7b-paper": ModelSpec(
        "qwen3-1.7b-paper", fa_layers=20, kv_heads=8, head_dim=128,
        q_heads=16, compute_params=1.007e9,
        compute_source="qwen3-1.7b's 50.3M parameters per layer x 20 layers",
        source=("SARIA paper §5.1: 'Qwen3-1.7B with 20 full-attention layers' (scaled down for a 24-GB A30); "
                "per-layer shape assumed from Qwen/Qwen3-1.7B config.json: 8 KV heads, head_dim 128, bf16")),
    "qwen3.5-5.6b-paper": ModelSpec(
        "qwen3.5-5.6b-paper", fa_layers=5, kv_heads=4, head_dim=256,
        gdn_layers=15, gdn_value_heads=32, gdn_key_heads=16, gdn_key_dim=128, gdn_value_dim=128,
        gdn_conv_kernel=4, q_heads=16, compute_params=5.0e9,
        compute_source="qwen3.5-9b's estimate scaled by its layers, 20 of 32",
        source=("SARIA paper §5.1: 'Qwen3.5-5.6B with 5 full-attention and 15 GDN layers' (scaled down for a "
                "24-GB A30); per-layer shapes assumed from qwen3.5-9b above")),
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
