"""FP8 KV on the SSD tier (``ssd_dtype=fp8``): pages <-> FP8 objects, and the same encoding on
packed bytes.

An FP8 object is saria/ssd_dtype.py's layout (the contract with the SSD store) of the kv object
:func:`~saria.kernels.pack_pages` packs: its ``n`` elements (tensor after tensor, pages in id order,
in the cache dtype: bf16, fp16 or fp32) as e4m3 codes, element ``i`` at byte ``i``, then ``n / 128``
little-endian float32 scales, one per group of 128 consecutive elements. 2-D ids give one object a
row, each encoded on its own::

    fp8[c] = codes(raw[c]) ++ scales(raw[c])       raw = pack_pages(caches, block_ids)

* :mod:`.api`: ``pack_pages_fp8``, ``unpack_pages_fp8`` (with ``skip``), ``quantize_staging``,
  ``dequantize_staging``, ``fp8_staging_bytes``;
* :mod:`.triton`: the kernel that quantizes while it gathers (and decodes while it scatters), its
  launch rule and launcher (``backend="triton"``);
* :mod:`.cpu`: the torch path (pack then quantize; decode then unpack) and the encoding on packed
  bytes (``backend="torch"``, and ``quantize_staging`` / ``dequantize_staging`` everywhere);
* :mod:`.naive`: the naive reference, one group at a time: the tests' oracle;
* :mod:`.checks`: the FP8 ops' own argument checks.
"""

from .api import dequantize_staging, fp8_staging_bytes, pack_pages_fp8, quantize_staging, unpack_pages_fp8
from .naive import dequantize_naive, pack_pages_fp8_naive, quantize_naive, unpack_pages_fp8_naive

__all__ = ["dequantize_naive", "dequantize_staging", "fp8_staging_bytes", "pack_pages_fp8", "pack_pages_fp8_naive",
           "quantize_naive", "quantize_staging", "unpack_pages_fp8", "unpack_pages_fp8_naive"]
