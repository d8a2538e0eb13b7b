"""Paged layouts for the kernel tests: small enough for Triton's interpreter (about 1 ms a program),
shaped like the real engines' caches."""

from __future__ import annotations

import torch

from saria.kernels import PageTable
from saria.harness.paged_caches import zeros_like_caches as fresh_like  # noqa: F401 (re-exported for the tests)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "int8": torch.int8,
}


def random_bytes(shape, dtype, seed: int) -> torch.Tensor:
    """A tensor of random bit patterns (NaNs and all): copies must preserve every byte."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(shape, dtype=dtype).view(torch.uint8).numel()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(DEVICE)


def vllm_layers(nb, bs, h, d, dtype, layers=2, seed=0):
    """vLLM 0.32 per-layer views: [NB, BS, 2, H, D], one tensor per layer."""
    return [random_bytes((nb, bs, 2, h, d), dtype, seed + i) for i in range(layers)]


def legacy_halves(nb, bs, h, d, dtype, seed=0):
    """A legacy [2, NB, BS, H, D] cache passed as its K and V halves."""
    return list(random_bytes((2, nb, bs, h, d), dtype, seed).unbind(0))


def flashinfer(nb, bs, h, d, dtype, seed=0):
    """FlashInfer [NB, 2, BS, H, D]."""
    return [random_bytes((nb, 2, bs, h, d), dtype, seed)]


def mla(nb, bs, d, dtype, seed=0):
    """MLA latent cache [NB, BS, D]."""
    return [random_bytes((nb, bs, d), dtype, seed)]


def gdn_pages(nb, page_stride, used, seed=0):
    """A GDN layer's page as int8 with a padded stride: [NB, used] over [NB, page_stride]."""
    raw = random_bytes((nb, page_stride), torch.int8, seed)
    return [raw.as_strided((nb, used), (page_stride, 1))]


def byte_pages(t: torch.Tensor) -> torch.Tensor:
    """[NB, page_bytes] uint8 view (pages compared as bytes: NaN-safe)."""
    return PageTable([t]).byte_pages(0)


def assert_round_trip(fresh, original, ids: torch.Tensor) -> None:
    """Touched pages equal byte for byte; every untouched page (and padding) still zero."""
    touched = torch.zeros(original[0].shape[0], dtype=torch.bool, device=DEVICE)
    touched[ids.reshape(-1).to(DEVICE)] = True
    for t, (f, o) in enumerate(zip(fresh, original)):
        fb, ob = byte_pages(f), byte_pages(o)
        assert torch.equal(fb[touched], ob[touched]), f"tensor {t}: touched pages differ"
        assert not fb[~touched].any(), f"tensor {t}: an untouched page was written"
        whole = torch.empty(0, dtype=torch.uint8, device=f.device).set_(f.untyped_storage())
        assert int(whole.ne(0).sum()) == int(fb[touched].ne(0).sum()), f"tensor {t}: bytes outside pages written"
