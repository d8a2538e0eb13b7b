"""saria.kernels.variants: the variant keys are Triton's own specialization (the shortcuts for
unspecialized ints and alignment-free tensors give what Triton's function gives), warming records a
variant once, and a launch of a variant not warmed is recorded as late (a compile while serving)."""

from __future__ import annotations

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from saria.kernels import PageTable, variants, warm_kernels
from saria.kernels.backend import INTERPRETED
from saria.kernels.pages.triton import _copy_pages_kernel


@pytest.mark.parametrize("value", [0, 1, 16, 17, 2**31 - 1, 2**31, 2**32, 2**40, 2**63 - 1, 2**63, -1, -2**31,
                                   -2**31 - 1, torch.zeros(3, dtype=torch.int64), torch.zeros(5, dtype=torch.uint8)[1:]])
@pytest.mark.parametrize("specialize", [False, True])
@pytest.mark.parametrize("align", [False, True])
def test_the_shortcuts_give_what_triton_gives(value, specialize, align):
    assert tuple(variants._spec(value, specialize, align)) == tuple(
        native_specialize_impl(BaseBackend, value, False, specialize, align))


@pytest.mark.skipif(not INTERPRETED, reason="the CPU path launches through the interpreter")
def test_warmed_variants_are_not_late_and_a_new_one_is(monkeypatch):
    monkeypatch.setattr(variants, "SEEN", {})
    monkeypatch.setattr(variants, "LATE", [])
    table = PageTable([torch.arange(4 * 64, dtype=torch.int16).view(4, 64)])
    keys = warm_kernels(table, 2)
    assert len(keys) == 2 and all(k[0] == "_copy_pages_kernel" for k in keys)  # pack and unpack
    assert warm_kernels(table, 2) == keys and len(variants.SEEN) == 2  # warming again adds nothing
    from saria.kernels import pack_pages, unpack_pages
    staging = pack_pages(table, torch.tensor([[1, 2], [3, 0]]), backend="triton")
    unpack_pages(staging[0, :128].contiguous(), table, torch.tensor([2]), backend="triton")  # one page: an int == 1, unspecialized
    assert variants.LATE == []
    # A launch rule the warm-up did not cover (an override): recorded as a late variant.
    from saria.kernels.pages import triton as pages_triton
    pages_triton.launch(table, torch.tensor([1]), staging, 1, True, words=16)
    assert len(variants.LATE) == 1 and variants.LATE[0][0] == _copy_pages_kernel.__name__
