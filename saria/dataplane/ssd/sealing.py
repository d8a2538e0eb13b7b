"""Sealed parts: what a store opened with a :class:`~saria.seal.Sealer` writes and reads instead of
plaintext payloads (docs/ssd.md, "Sealed objects").

A part is sealed with AES-256-GCM (:meth:`Sealer.seal_into`, associated data binding the store's
identity, the object's name and tenant, the key id and epoch, the part's index and count and the
object's and part's lengths) from its source into a private page-aligned bounce buffer, and that
ciphertext is the payload written (O_DIRECT-safe: the buffer and the rounded-up length are 4 KiB
aligned, the padding zeros). The epoch, the part's random value (its key is derived from it:
seal format 2), the tag and the key id go to the slot header (slot format version 3; headers of
version 2, with a format-1 part's 12-byte nonce, are still read and opened). The GCM tag replaces the payload checksum: one pass over the
bytes.

A read brings the ciphertext into a private bounce buffer (never straight into the destination),
puts the header's tag after it, and opens it (:meth:`Sealer.open_into`) into the destination when
that is CPU memory, or into a private host buffer and then copies it to a CUDA destination:
decryption runs on the CPU, so sealed parts never move by GDS. A tag that fails, or a key epoch the
key file lacks, raises :class:`~saria.seal.Unauthentic` / :class:`~saria.seal.UnknownEpoch` to
the read job, which counts it and drops the object; the destination is left zeroed (CPU) or
untouched (CUDA), never holding unverified bytes.

Sealed payloads always go through :class:`~saria.dataplane.ssd.files.DriveFile` (the POSIX path),
whatever the store's backend.
"""

from __future__ import annotations

import torch

from saria.seal import PartContext, SealedPart, Sealer
from saria.seal.aead import GCM_TAG_BYTES

from saria.dataplane.nvtx import SSD_READ, SSD_WRITE, VERIFY, nvtx_range
from saria.dataplane.ssd.files import AlignedPool, DriveFile, host_view
from saria.dataplane.ssd.format import SealFields, round_up


class SealedParts:
    """Seals parts on their way to the drive files ``files`` and opens them on their way back, for
    a store of ``part_bytes`` parts. Thread-safe (each call takes its own buffers from the pools)."""

    def __init__(self, sealer: Sealer, files: list[DriveFile], part_bytes: int):
        if not isinstance(sealer, Sealer):
            raise TypeError(f"sealer must be a saria.seal.Sealer, got {type(sealer).__name__}")
        self.sealer = sealer
        self.key_id = sealer.key_id
        self._files = files
        # ciphertext and its tag (a part's length rounded up to whole blocks, plus the tag, fits)
        self._cipher = AlignedPool(round_up(part_bytes + GCM_TAG_BYTES))
        # plaintext staging of CUDA sources and destinations (pinned where CUDA is; no buffer is
        # made until one is needed)
        self._plain = AlignedPool(part_bytes, pin=torch.cuda.is_available())

    def write_part(self, drive: int, offset: int, ctx: PartContext, src: torch.Tensor) -> SealFields:
        """Seal ``src`` (``ctx.part_length`` bytes, CPU or CUDA) as part ``ctx.index`` of the object
        named ``ctx.name`` and write its ciphertext at payload ``offset`` of drive ``drive``; the
        fields its header keeps."""
        f, n = self._files[drive], ctx.part_length
        size = round_up(n) if f.direct else n
        with self._cipher.acquire() as c:
            out = c.view[:n + GCM_TAG_BYTES]
            if src.device.type == "cpu":
                sealed = self.sealer.seal_into(ctx, host_view(src)[:n], out)
            else:
                with self._plain.acquire() as p:
                    p.tensor[:n].copy_(src[:n])  # returns once the copy is done (pinned or pageable)
                    sealed = self.sealer.seal_into(ctx, p.view[:n], out)
            if size > n:  # the tag lives in the header; a direct write's padding is zeros
                c.view[n:size] = bytes(size - n)
            with nvtx_range(SSD_WRITE):
                f.write_exact(c.view[:size], offset)
        return SealFields(sealed.epoch, sealed.nonce, sealed.tag, self.key_id)

    def read_part(self, drive: int, offset: int, ctx: PartContext, seal: SealedPart, dest: torch.Tensor) -> None:
        """Read the ciphertext of part ``ctx.index`` at payload ``offset`` of drive ``drive`` into a
        private buffer and open it into ``dest`` (``ctx.part_length`` bytes, CPU or CUDA).
        :class:`~saria.seal.Unauthentic` / :class:`~saria.seal.UnknownEpoch` if it must not be served."""
        f, n = self._files[drive], ctx.part_length
        with self._cipher.acquire() as c:
            with nvtx_range(SSD_READ):
                f.read_exact(c.view[:round_up(n) if f.direct else n], offset)
            c.view[n:n + GCM_TAG_BYTES] = seal.tag
            data = c.view[:n + GCM_TAG_BYTES]
            with nvtx_range(VERIFY):
                if dest.device.type == "cpu":
                    self.sealer.open_into(ctx, seal, data, host_view(dest)[:n])
                    return
                with self._plain.acquire() as p:
                    self.sealer.open_into(ctx, seal, data, p.view[:n])
                    dest[:n].copy_(p.tensor[:n])  # verified bytes only; returns once copied

    def close(self) -> None:
        self._cipher.close()
        self._plain.close()
