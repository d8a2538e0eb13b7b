"""Triton kernels that move paged KV blocks and GDN checkpoints between an engine's cache and
contiguous staging buffers, and checksum staging. Kernels know nothing about tiers.

Each op has a ``@triton.jit`` kernel, a launcher that validates its input before anything runs, and
a pure-torch reference (``backend="torch"``).
"""

from .backend import BACKENDS, INTERPRETED, default_backend, resolve_backend
from .checksum import checksum, checksum_reference
from .page_table import PageTable, Segment, StaleTableError, extent_bytes
from .pages import drop_leading_pages, pack_pages, pack_pages_reference, unpack_pages, unpack_pages_reference
from .state import pack_state, state_table, unpack_state

__all__ = [
    "BACKENDS", "INTERPRETED", "PageTable", "Segment", "StaleTableError", "checksum", "checksum_reference",
    "default_backend", "drop_leading_pages", "extent_bytes", "pack_pages", "pack_pages_reference", "pack_state",
    "resolve_backend", "state_table", "unpack_pages", "unpack_pages_reference", "unpack_state",
]
