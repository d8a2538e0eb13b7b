"""``pack_state`` / ``unpack_state``: GDN (gated delta net) checkpoints in saria's own format.

For engines that keep recurrent state outside the paged KV cache. Per GDN layer ``l``:

* temporal state ``[slots, HV, V, K]``, fp32 or bf16;
* conv state ``[slots, conv_len, conv_dim]``, any float dtype.

A state object packs the given slots of every layer with the same machinery (and the same single
launch) as :func:`~saria.kernels.pack_pages`, the table being
``[conv_0, temporal_0, conv_1, temporal_1, ...]``: conv then temporal per layer, the order of a
vLLM GDN page. So for one slot the state object is ``cat_l(conv_l[slot] bytes, temporal_l[slot] bytes)``.

* :mod:`.api`: ``state_table`` and the public ops; no kernel of their own: the Triton kernel and
  the torch path are those of :mod:`saria.kernels.pages`;
* :mod:`.naive`: the naive reference (the pages' one over the layers in this order): the tests' oracle.
"""

from .api import pack_state, state_table, unpack_state
from .naive import pack_state_naive, unpack_state_naive

__all__ = ["pack_state", "pack_state_naive", "state_table", "unpack_state", "unpack_state_naive"]
