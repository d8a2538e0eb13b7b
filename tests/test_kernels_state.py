"""pack_state / unpack_state: saria-format GDN checkpoints."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEVICE, fresh_like, random_bytes
from saria.kernels import pack_pages, pack_state, resolve_backend, unpack_state

BACKENDS = sorted({resolve_backend("auto", DEVICE), "torch"})


def _states(layers, slots, hv, v, k, conv_len, conv_dim, temporal_dtype, seed=0):
    temporal = [random_bytes((slots, hv, v, k), temporal_dtype, seed + l) for l in range(layers)]
    conv = [random_bytes((slots, conv_len, conv_dim), torch.bfloat16, seed + 100 + l) for l in range(layers)]
    return temporal, conv


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temporal_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dims", [pytest.param((2, 4, 8), id="aligned"), pytest.param((1, 3, 5), id="odd")])
def test_round_trip(backend, temporal_dtype, dims):
    hv, v, k = dims
    temporal, conv = _states(3, 5, hv, v, k, 3, 7, temporal_dtype)
    slots = torch.tensor([4, 1])
    staging = pack_state(temporal, conv, slots, backend=backend)
    per_slot = sum(t[0].numel() * t.element_size() + c[0].numel() * c.element_size() for t, c in zip(temporal, conv))
    assert staging.numel() == 2 * per_slot
    t_fresh, c_fresh = fresh_like(temporal), fresh_like(conv)
    unpack_state(staging, t_fresh, c_fresh, slots, backend=backend)
    for fresh, orig in zip(t_fresh + c_fresh, temporal + conv):
        fb, ob = fresh.view(torch.uint8), orig.view(torch.uint8)
        assert torch.equal(fb[slots], ob[slots])
        assert not fb[torch.tensor([0, 2, 3])].any()


def test_layout_is_conv_then_temporal_per_layer():
    temporal, conv = _states(2, 3, 2, 4, 4, 3, 8, torch.float32, seed=7)
    slots = torch.tensor([2])
    expected = pack_pages([conv[0], temporal[0], conv[1], temporal[1]], slots)
    assert torch.equal(pack_state(temporal, conv, slots), expected)


def test_single_layer_tensors_accepted():
    temporal, conv = _states(1, 2, 2, 4, 4, 3, 8, torch.float32)
    assert torch.equal(pack_state(temporal[0], conv[0], torch.tensor([1])),
                       pack_state(temporal, conv, torch.tensor([1])))


@pytest.mark.parametrize("mutate, match", [
    pytest.param(lambda t, c: (t[:1], c), "temporal state tensors but", id="layer-count"),
    pytest.param(lambda t, c: ([x.to(torch.float16) for x in t], c), "float32 or bfloat16", id="temporal-dtype"),
    pytest.param(lambda t, c: (t, [x.to(torch.int16) for x in c]), "float tensor", id="conv-dtype"),
    pytest.param(lambda t, c: ([x[:, 0] for x in t], c), r"\[slots, HV, V, K\]", id="temporal-rank"),
    pytest.param(lambda t, c: (t, [x[0] for x in c]), r"\[slots, conv_len, conv_dim\]", id="conv-rank"),
    pytest.param(lambda t, c: (t, [x[:2] for x in c]), "slots", id="slot-mismatch"),
    pytest.param(lambda t, c: ([], []), "no GDN layers", id="empty"),
    pytest.param(lambda t, c: ([x.transpose(2, 3) for x in t], c), "not contiguous", id="non-contiguous"),
])
def test_bad_state_tensors(mutate, match):
    temporal, conv = _states(2, 3, 2, 4, 4, 3, 8, torch.float32)
    t, c = mutate(temporal, conv)
    with pytest.raises(ValueError, match=match):
        pack_state(t, c, torch.tensor([0]))


def test_bad_slots():
    temporal, conv = _states(1, 3, 2, 4, 4, 3, 8, torch.float32)
    with pytest.raises(IndexError, match="out of range"):
        pack_state(temporal, conv, torch.tensor([3]))
    staging = pack_state(temporal, conv, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="more than once"):
        unpack_state(staging, temporal, conv, torch.tensor([1, 1]))
