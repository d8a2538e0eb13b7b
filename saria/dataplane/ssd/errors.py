"""Exceptions of the SSD store: start-up errors, refusals, and per-object failures.

Start-up problems (a bad path, a directory another store has open, a file that cannot be
preallocated, a file of another format) raise :class:`StoreConfigError` from the constructor. At
run time a refusal (:class:`StoreFull`, :class:`ObjectNotFound`, :class:`StoreClosed`,
:class:`DriveLost` when no drive is left, ``TypeError`` / ``ValueError`` for bad arguments) is
raised by the call itself, before anything changes; an I/O or verification failure reaches the
caller through the operation's Future.
"""

from __future__ import annotations

from pathlib import Path


class SSDStoreError(Exception):
    """Base class of every error the SSD store raises on purpose."""


class StoreConfigError(SSDStoreError):
    """The store cannot start: bad path, preallocation failure, foreign or mismatched file, backend."""


class StoreClosed(SSDStoreError):
    """The store was closed; no new operation is accepted."""


class StoreFull(SSDStoreError):
    """Not enough free slots for an object; nothing was changed."""


class DriveLost(SSDStoreError):
    """A drive file was deleted or replaced while the store had it open: the drive is out of service.

    Its objects are lost (gone from the index); a write with a part on it fails with
    :class:`ObjectWriteError` caused by this error; ``write`` raises it at once when no drive is left.
    ``path`` is the drive file, ``reason`` what happened to it (``None`` for "no drive left").
    """

    def __init__(self, message: str, path: Path | None = None, reason: str | None = None):
        super().__init__(message)
        self.path = path
        self.reason = reason


class ObjectNotFound(SSDStoreError, KeyError):
    """No committed object under this key."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectWriteError(SSDStoreError):
    """Writing an object failed (ENOSPC, EIO, short write, ...); nothing of it is served.

    ``errno`` is the OS error number when the cause was an ``OSError``, else ``None``.
    """

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ObjectReadError(SSDStoreError):
    """A read failed; the object was dropped from the store (its copy is not trusted any more)."""


class ObjectUnreadable(ObjectReadError):
    """An I/O error, or a short read that could not be completed. ``errno`` as in ObjectWriteError."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class ObjectCorrupt(ObjectReadError):
    """A part's bytes do not match the checksum recorded when it was written."""


class ObjectUnauthentic(ObjectCorrupt):
    """A sealed part failed its AES-GCM tag: its bytes, its name, its place, its tenant or its key
    are not the ones it was sealed with (docs/ssd.md, "Sealed objects"). Nothing of it is served;
    the message names no key, object name or hash."""


class ObjectEpochUnknown(ObjectUnauthentic):
    """A sealed part's key epoch is not in the key file (retired, or never had): it cannot be
    opened, so it is a miss like a failed tag."""
