"""``pack_pages`` / ``unpack_pages``: gather paged KV into contiguous staging bytes and scatter back.

Staging layout (the contract with the data plane and the SSD format). For ``block_ids`` of shape
``[C, P]`` (1-D ids are one chunk: ``C = 1``), chunk ``c`` occupies bytes
``[c * P * B, (c + 1) * P * B)`` where ``B = table.bytes_per_page``; inside a chunk the order is
tensor after tensor, and inside a tensor's region page after page in ``block_ids`` order::

    staging[c] = cat_t( cat_j( bytes of caches[t][block_ids[c, j]] ) )      # [tensor][page]

So one chunk's kv object is one contiguous run of bytes, whatever the engine's layout.

* :mod:`.api`: the public ops (checks, backend choice), and ``drop_leading_pages``;
* :mod:`.triton`: the Triton kernel, its launch rule and launcher (``backend="triton"``);
* :mod:`.cpu`: the torch path, fast on the CPU (``backend="torch"``);
* :mod:`.naive`: the naive reference, plain loops over the layout above: the tests' oracle;
* :mod:`.scattered`: ``prepare_scattered``, pages to and from bytes at given offsets of one buffer
  (no staging layout: the caller places each page), checked once and launched many times;
* :mod:`.layered`: ``prepare_layered``, a layer-wise step's scattered copies of every layer built
  in one pass (one work array), launched layer by layer.
"""

from .api import drop_leading_pages, pack_pages, unpack_pages
from .cpu import pack_pages_torch, unpack_pages_torch
from .naive import pack_pages_naive, scattered_copy_naive, unpack_pages_naive
from .layered import COPY_MAX_PROGRAMS, LayeredCopy, default_max_programs, prepare_layered
from .scattered import ScatteredCopy, prepare_scattered

__all__ = ["COPY_MAX_PROGRAMS", "LayeredCopy", "ScatteredCopy", "default_max_programs", "prepare_layered", "drop_leading_pages", "pack_pages", "pack_pages_naive", "pack_pages_torch",
           "prepare_scattered", "scattered_copy_naive", "unpack_pages", "unpack_pages_naive", "unpack_pages_torch"]
