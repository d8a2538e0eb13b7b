"""Small models with real random weights for the demo and the engine tests, and a real tokenizer
for them (``saria serve``'s tests talk text to it).

:func:`build_model` writes a Qwen3 dense model or a Qwen3-Next hybrid (GDN) model (transformers
``from_config`` + ``save_pretrained``); :func:`build_lora` a random LoRA adapter for the dense one. Real weights matter: wrong KV then changes tokens and
logprobs, which the comparisons check.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 4096


# --- models --------------------------------------------------------------------------------------

def build_model(path: str | Path, kind: str = "dense", *, seed: int = 0, layers: int = 4,
                tokenizer: bool = False) -> Path:
    """Save a small model with random bf16 weights at ``path``: ``dense`` (Qwen3: ``layers``
    full-attention layers) or ``hybrid`` (Qwen3-Next: GDN layers with head dim 128 and a
    full-attention layer every second one). ``tie_word_embeddings=False`` as the real models.
    ``tokenizer``: also save a real tokenizer beside it (:func:`build_tokenizer`: a byte-level BPE
    of at most ``VOCAB`` tokens, with a chat template), so that the model can be served over
    vLLM's OpenAI API (``/v1/completions`` and ``/v1/chat/completions``); the model's end-of-text
    token is then the tokenizer's ``<|im_end|>``. Without it, run vLLM with
    ``skip_tokenizer_init=True`` and token-id prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    if kind == "dense":
        from transformers import Qwen3Config

        config = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                             tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=10000.0)
    elif kind == "hybrid":
        from transformers import Qwen3NextConfig

        config = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                 linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=2,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128, decoder_sparse_step=1,
                                 max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16")
    else:
        raise ValueError(f"model kind must be 'dense' or 'hybrid', got {kind!r}")
    special = build_tokenizer(path) if tokenizer else None
    if special is not None:  # generation stops at the chat template's end of turn
        config.eos_token_id = special["<|im_end|>"]
        config.pad_token_id = special["<|endoftext|>"]
        config.bos_token_id = None
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    with torch.no_grad():  # random init is tiny for some tensors: make every layer matter
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(path)
    if special is not None:
        model.generation_config.eos_token_id = special["<|im_end|>"]
        model.generation_config.pad_token_id = special["<|endoftext|>"]
        model.generation_config.bos_token_id = None
        model.generation_config.save_pretrained(path)
    return path


def build_lora(path: str | Path, model: str | Path, *, seed: int = 1, rank: int = 8) -> Path:
    """Save a LoRA adapter with random weights for the dense model at ``model`` (``build_model``),
    in PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``), at ``path``: every
    attention projection adapted, K and V included, so the KV a prompt leaves differs under each
    adapter and under the base model (KV served across them would change tokens and logprobs)."""
    import torch
    from safetensors.torch import save_file

    path, config = Path(path), json.loads((Path(model) / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out_features, in_features) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator) * 0.05
                                                  ).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator) * 0.05
                                                  ).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(shapes)}))
    return path


# --- a real tokenizer for the small models ----------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's models use it (without tools and thinking): enough for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORDS = ("the agent tool call result file search read write list run test build error value request "
          "response model cache token memory disk page block chunk prefix session user system assistant "
          "function argument return string number object array true false null name type description "
          "schema required properties path line code python json http server client query data time "
          "step plan check update create delete open close start stop wait load save hit miss tier").split()


def tokenizer_corpus(seed: int = 0, lines: int = 4000) -> list[str]:
    """Deterministic training text for :func:`build_tokenizer`: word salad, JSON tool schemas,
    code-like lines and numbers (no download: this runs on machines without internet)."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(4, 16))]
        kind = i % 4
        if kind == 0:
            out.append(" ".join(words).capitalize() + ".")
        elif kind == 1:
            out.append(json.dumps({"name": "_".join(words[:2]), "description": " ".join(words[2:]),
                                   "parameters": {"type": "object", "properties": {words[0]: {"type": "string"}},
                                                  "required": [words[0]]}}))
        elif kind == 2:
            out.append(f"def {words[0]}_{words[1]}({words[2]}, {words[3]}={rng.randrange(100)}):\n"
                       f"    return {words[2]}.{words[-1]}({rng.random():.4f})")
        else:
            out.append(f"{rng.randrange(10**6)} {' '.join(words)} {rng.randrange(10**3)}/{rng.randrange(10**3)}")
    return out


def build_tokenizer(path: str | Path, *, vocab_size: int = VOCAB, seed: int = 0) -> dict[str, int]:
    """Train a byte-level BPE (the ``tokenizers`` library, as GPT-2 and Qwen) of at most
    ``vocab_size`` tokens on :func:`tokenizer_corpus` and save it at ``path``
    (``tokenizer.json``, ``tokenizer_config.json`` with ChatML's chat template, ``<|im_end|>`` as
    end of text). Byte-level: every text has an encoding. Returns the special tokens' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 256 + len(SPECIAL_TOKENS) <= vocab_size <= VOCAB:
        raise ValueError(f"vocab_size must be in [{256 + len(SPECIAL_TOKENS)}, {VOCAB}] (the model's vocabulary), "
                         f"got {vocab_size}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tokenizer_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, more than {vocab_size}")
    tok.save(str(path / "tokenizer.json"))
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in special.items()},
    }, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2))
    return special
