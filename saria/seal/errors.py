"""Errors of the seal package. Their messages never carry a key, a salt, a name or any value
derived from one of them: they say what went wrong and where (a path the user gave, an epoch)."""

from __future__ import annotations


class SealError(Exception):
    """Misuse of the seal package (a bad argument, a key used past its limit)."""


class KeyFileError(SealError):
    """A key file that cannot be used: missing, readable by others, malformed. One line, the path."""


class SealFailure(SealError):
    """A sealed part that must not be served: its bytes are a miss, never plaintext."""


class Unauthentic(SealFailure):
    """The tag does not verify: the bytes, their name, their place or their key are not the ones
    sealed (a planted, moved, flipped, truncated or extended object, or another key file's)."""


class UnknownEpoch(SealFailure):
    """The part was sealed under a key epoch this key file does not hold (retired, or never had)."""
