"""What the saria before per-part keys wrote, for the tests that check it still opens: a sealer of
seal format 1 (the code path removed from saria/seal/aead.py, kept here as it was)."""

from __future__ import annotations

import os

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from saria.seal import SealedPart, Sealer


class Version1Sealer(Sealer):
    """Seals as saria's seal format 1 did: a 12-byte random nonce, directly under K_eT, the
    version-1 associated data. A store opened with it writes what a store of that saria wrote
    (SSD slot headers of version 2; the cluster's parts, its metadata is written by the test)."""

    def seal_into(self, ctx, plaintext, out):
        plain, dest = memoryview(plaintext).cast("B"), memoryview(out).cast("B")
        tenant = self.tenant_of_name(ctx.name)
        epoch = self.keyring.current_epoch
        nonce = os.urandom(12)
        AESGCM(self._seal_key(epoch, tenant)).encrypt_into(nonce, plain, self.associated_data(ctx, tenant, epoch),
                                                           dest)
        return SealedPart(epoch, nonce, bytes(dest[ctx.part_length:]))
