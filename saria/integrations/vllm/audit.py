"""An opt-in audit of what saria restores: every reloaded page holds the bytes vLLM computed.

With the connector option ``audit_kv: true`` the worker digests, page by page, the attention KV of
each chunk a store or SSD write reads out of vLLM's blocks (after the forward that computed it,
when ``wait_for_save`` starts the order), and digests the pages a reload wrote once it has landed
(``get_finished``). A reloaded page must be bit-for-bit the page vLLM computed; one that is not is
counted and logged as an error. The digests read vLLM's own tensors directly, with none of saria's
kernels, staging buffers, tiers or checksums in between, so the audit checks the whole path
(pack, host pool, SSD, unpack) independently of it.

Why a byte check and not only an output check: two runs of vLLM compute the same prefix's KV in
different steps (a whole prompt at once, or a new turn over a cached prefix), and on some CPUs
vLLM's attention rounds the two differently (``docs/numerics.md``). Outputs then differ in their
last bits for reasons that are vLLM's, not saria's; the bytes saria restores must never differ.

Under ``ssd_dtype="fp8"`` a chunk reloaded from SSD is checked against the FP8 round trip of the
page vLLM computed (each 128-element group scaled to e4m3's range, cast with torch's own
``float8_e4m3fn`` and back: the format of :mod:`saria.ssd_dtype`, computed here without saria's
kernels), bit for bit; a chunk reloaded from DRAM against the page itself.

Cost: a device-to-host copy and a hash of every page stored and reloaded, on the engine's thread.
For tests, ``saria demo`` and debugging a deployment, not for serving at speed. Objects that a
previous run left on SSD were computed before this process started: their reloads count as
``unverified``.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Hashable, Sequence

import torch

from saria.ssd_dtype import FP8_GROUP, FP8_MAX

log = logging.getLogger("saria.vllm")

DIGEST_BYTES = 16
MAX_SERVED = 1 << 16  # reloads whose digests ``served`` keeps (an audited test or demo needs far fewer)


class KVAudit:
    """Page digests of stored chunks, checked against the pages their reloads wrote.

    ``views``: every attention layer's paged tensors (dim 0 indexes vLLM blocks), as the page
    table sees them. A chunk stored again (recomputed: after its DRAM copy was dropped, or because
    an earlier chunk of its prompt was missing) adds a version: vLLM computed it in another step,
    whose split may round its last bits differently (``docs/numerics.md``), and saria may serve
    either (a DRAM copy newer than its SSD copy). A reload must be one version, whole.

    ``served``: per chunk (hex), the page digests of each reload in the order they landed (at most
    :data:`MAX_SERVED` reloads are kept): what a reference run with the same history needs to pick
    the version saria served (:mod:`saria.harness.reference`)."""

    def __init__(self, views: Sequence[torch.Tensor], *, ssd_fp8: bool = False):
        if not views:
            raise ValueError("KVAudit needs at least one paged tensor")
        self.views = list(views)
        self.ssd_fp8 = ssd_fp8
        # per chunk, per version vLLM computed: the pages' digests, and under ssd_fp8 their FP8 round trips'
        self._stored: dict[Hashable, list[tuple[tuple[bytes, ...], tuple[bytes, ...] | None]]] = {}
        self.served: dict[str, list[list[str]]] = {}
        self._served_count = 0
        self.stored_pages = 0
        self.checked_pages = 0
        self.mismatched_pages = 0
        self.unverified_pages = 0
        self._reported: set[Hashable] = set()

    def page_digest(self, block: int, *, fp8: bool = False) -> bytes:
        """The digest of one vLLM block over every attention layer, in layer order (``fp8``: of
        its FP8 round trip, :func:`fp8_round_trip`)."""
        h = hashlib.blake2b(digest_size=DIGEST_BYTES)
        for view in self.views:
            page = view[block].detach().cpu().contiguous()
            if fp8:
                page = fp8_round_trip(page)
            h.update(page.view(torch.uint8).numpy().tobytes())
        return h.digest()

    def stored(self, chunk: Hashable, blocks: Sequence[int]) -> None:
        """A store or write is about to read ``chunk`` from ``blocks``: what they hold now is what
        vLLM computed."""
        rounded = tuple(self.page_digest(b, fp8=True) for b in blocks) if self.ssd_fp8 else None
        version = (tuple(self.page_digest(b) for b in blocks), rounded)
        versions = self._stored.setdefault(chunk, [])
        if version not in versions:
            versions.append(version)
        self.stored_pages += len(blocks)

    def check(self, chunk: Hashable, blocks: Sequence[int], skip: int = 0, *, from_ssd: bool = False,
              served_as: Hashable | None = None) -> int:
        """A reload wrote ``chunk`` into ``blocks[skip:]`` (the first ``skip`` pages are vLLM's own
        and were left alone); returns how many of those pages differ from what was stored (its
        FP8 round trip when it came ``from_ssd`` under ``ssd_fp8``). ``served_as``: the name
        ``served`` records it under (vLLM's block hash where chunks are named by chunk ids)."""
        written = range(skip, len(blocks))
        candidates = [rounded if from_ssd and self.ssd_fp8 else exact for exact, rounded in self._stored.get(chunk, ())]
        candidates = [c for c in candidates if c is not None and len(c) == len(blocks)]
        got = [self.page_digest(blocks[i]) if i in written else None for i in range(len(blocks))]
        self._record_served(chunk if served_as is None else served_as, got)
        if not candidates:
            self.unverified_pages += len(written)
            return 0
        bad = min(([i for i in written if got[i] != expected[i]] for expected in candidates), key=len)
        self.checked_pages += len(written)
        self.mismatched_pages += len(bad)
        if bad and chunk not in self._reported:
            self._reported.add(chunk)
            # the chunk is not named: its hash is token-derived (docs/security.md); the blocks are vLLM's ids
            log.error("saria audit: reloaded chunk in vLLM blocks %s differs from the KV vLLM computed in page(s) "
                      "%s of %d", list(blocks)[:4], bad, len(blocks))
        return len(bad)

    def _record_served(self, chunk: Hashable, digests: list[bytes | None]) -> None:
        if self._served_count >= MAX_SERVED:
            return
        self._served_count += 1
        key = chunk.hex() if isinstance(chunk, bytes) else repr(chunk)
        self.served.setdefault(key, []).append([d.hex() if d is not None else None for d in digests])

    def forget(self) -> None:
        """Every object is gone (a new epoch): nothing stored before can be reloaded."""
        self._stored.clear()

    def counters(self) -> dict[str, int]:
        return {"stored_pages": self.stored_pages, "checked_pages": self.checked_pages,
                "mismatched_pages": self.mismatched_pages, "unverified_pages": self.unverified_pages}


def fp8_round_trip(page: torch.Tensor) -> torch.Tensor:
    """What an FP8 SSD object gives back for ``page`` (a contiguous CPU tensor of bf16, fp16 or
    fp32 whose elements fill whole groups): per :data:`~saria.ssd_dtype.FP8_GROUP` consecutive
    elements, ``scale = amax / 448``, codes ``x / scale`` cast to ``float8_e4m3fn`` by torch, decoded
    as ``code * scale`` in float32 and rounded to the page's dtype (a zero group stays zero)."""
    x = page.reshape(-1, FP8_GROUP).float()
    scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.where(scale > 0, x / safe, torch.zeros_like(x)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).to(page.dtype).reshape(page.shape)
