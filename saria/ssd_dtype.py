"""The SSD tier's element format, ``ssd_dtype``: the one definition the kernels, the data plane, the
control plane and the replay share (torch-free, so the control plane may import it).

* ``"auto"``: a kv object is stored on SSD as the KV cache holds it (its packed bytes, bit-exact).
* ``"fp8"``: a kv object is stored as FP8 e4m3 (OCP ``e4m3fn``: no infinities, largest finite
  448) with one float32 scale per group of :data:`FP8_GROUP` consecutive elements of its packed
  bytes. The packed bytes are the pages of every tensor one after another (each page contiguous),
  and a page's element count is a multiple of the group, so a group never spans two pages: with
  vLLM's page layouts a group is one token's K (or V) of one head and part of the next, finer than
  one scale per (page, KV head).

Only kv objects of a bf16, fp16 or fp32 cache are quantized; GDN state objects (recurrent state,
where an error compounds over every later token) and DRAM copies stay exact.

FP8 object layout (``n`` elements of the packed kv object, ``n % FP8_GROUP == 0``)::

    bytes [0, n)                  the e4m3 codes, element i at byte i
    bytes [n, n + 4 * n / G)      the float32 scales (little-endian), group g at n + 4 g

Encoding of group ``g`` (elements ``x`` as float32): ``scale = amax(|x|) / 448`` (float32 division,
round to nearest even); each code is ``x / scale`` (float32 division) clamped to [-448, 448] and
rounded to e4m3, to nearest even; a group of zeros has scale 0 and codes 0. Decoding: ``code *
scale`` in float32, rounded to the cache dtype to nearest even. The error of one element is at most
half an e4m3 step at its magnitude: ``|x - x'| <= 2**-4 * |x| + 2**-10 * scale`` (3 mantissa
bits; the second term covers e4m3's subnormals) plus the cache dtype's own rounding of ``x'``.
"""

from __future__ import annotations

SSD_DTYPES = ("auto", "fp8")
FP8_GROUP = 128  # elements per scale
FP8_SCALE_BYTES = 4  # one float32 per group
FP8_MAX = 448.0  # largest finite e4m3fn value
QUANTIZED_ELEMENT_BYTES = (2, 4)  # bf16 / fp16, fp32: the cache element sizes fp8 applies to
# What an SSD store's identity records for FP8 objects (codes, group, scales): change it with the layout
FP8_FORMAT = "fp8-e4m3fn/group-128/float32-scales"


def check_ssd_dtype(value: object, owner: str = "ssd_dtype") -> str:
    """``value`` if it names an SSD format, else ``ValueError`` naming the choices."""
    if value not in SSD_DTYPES:
        raise ValueError(f"{owner} must be one of {', '.join(SSD_DTYPES)}, got {value!r}")
    return value  # type: ignore[return-value]


def fp8_bytes(nbytes: int, element_bytes: int) -> int:
    """Bytes of the FP8 form of ``nbytes`` of packed kv elements of ``element_bytes`` each:
    one byte per element plus one float32 per :data:`FP8_GROUP` elements. ``ValueError`` when the
    elements do not fill whole groups or the element size is not one fp8 applies to."""
    if element_bytes not in QUANTIZED_ELEMENT_BYTES:
        raise ValueError(f"ssd_dtype=fp8 quantizes 2- or 4-byte elements (bf16, fp16, fp32), got {element_bytes}-byte")
    elements, rest = divmod(nbytes, element_bytes)
    if rest or elements % FP8_GROUP:
        raise ValueError(f"ssd_dtype=fp8 needs whole groups of {FP8_GROUP} elements; an object of {nbytes} bytes "
                         f"holds {nbytes / element_bytes:g} {element_bytes}-byte elements")
    return elements + elements // FP8_GROUP * FP8_SCALE_BYTES


def ssd_kv_bytes(nbytes: int, ssd_dtype: str, element_bytes: int) -> int:
    """What a kv object of ``nbytes`` (as the cache holds it) weighs on SSD under ``ssd_dtype``."""
    return fp8_bytes(nbytes, element_bytes) if check_ssd_dtype(ssd_dtype) == "fp8" else nbytes
