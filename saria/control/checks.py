"""Argument checks of the control plane's public calls.

Each check either returns the argument in the form the control plane works with or raises
:class:`~saria.orders.ControlPlaneError` naming what is wrong. The control plane runs every check
of a call before it changes anything, so a refused call leaves its state exactly as it was.
The common arguments (a tuple of hashes, no failures) take a fast path: these run
on every call of a serving engine's scheduler.

No message shows a chunk hash: a vLLM block hash or a sealed chunk id is token-derived
(docs/security.md). Messages name chunks and objects by their place in the call ("chunk 3",
"failed entry 0") and by count; reprs show a bytes hash by its length only (:func:`saria.orders.chunk_repr`).
"""

from __future__ import annotations

import math
import reprlib
from collections import abc
from typing import TYPE_CHECKING, Hashable, Iterable, Sequence

from saria.control.hints import Hints
from saria.orders import KV, STATE, ControlPlaneError, ObjectKey

_INF = math.inf

if TYPE_CHECKING:
    from saria.control.tree import CacheObject

__all__ = ["check_hashes", "check_id", "check_key", "check_max_bytes", "check_names", "check_now", "check_ok",
           "brief_index", "check_recovered", "check_states", "first_difference", "objects_named"]


def check_now(now: object, latest: float) -> float:
    """A finite number of seconds; one earlier than ``latest`` (the latest seen) counts as ``latest``."""
    if type(now) is float and -_INF < now < _INF:  # the common case (a clock's float; NaN fails here)
        return now if now > latest else latest
    try:
        finite = isinstance(now, (int, float)) and not isinstance(now, bool) and math.isfinite(now)
    except OverflowError:  # an int beyond any float
        finite = False
    if not finite:
        raise ControlPlaneError(f"now must be a finite number of seconds, got {_brief(now)}")
    return now if now > latest else latest  # type: ignore[return-value,operator]


def check_hashes(chunk_hashes: object) -> tuple:
    """A tuple of the hashes. (Hashability and repeats are checked as the tree resolves them.)"""
    kind = type(chunk_hashes)
    if kind is tuple:
        return chunk_hashes  # type: ignore[return-value]
    if kind is list or (isinstance(chunk_hashes, abc.Sequence) and not isinstance(chunk_hashes, (str, bytes))):
        return tuple(chunk_hashes)  # type: ignore[arg-type]
    raise ControlPlaneError(f"chunk hashes must be a sequence (list or tuple) of hashable ids, got {kind.__name__}")


def check_id(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlPlaneError(f"{what} id must be an int, got {_brief(value)}")
    return value


def check_ok(ok: object) -> bool:
    if not isinstance(ok, bool):
        raise ControlPlaneError(f"ok must be a bool, got {_brief(ok)}")
    return ok


def check_key(key: object) -> Hashable:
    """One chunk hash (for lookups)."""
    try:
        hash(key)
    except TypeError:
        raise ControlPlaneError(f"a chunk hash must be hashable, got a {type(key).__name__}") from None
    return key  # type: ignore[return-value]


def check_hint_args(hints: object, tenant: object) -> None:
    """``hints``: a :class:`~saria.control.hints.Hints` or None; ``tenant``: hashable (named by its
    type only: a tenant is a salt's digest or a key's tag)."""
    if hints is not None and type(hints) is not Hints:
        raise ControlPlaneError(f"hints must be a saria.control.hints.Hints or None, got a {type(hints).__name__}")
    try:
        hash(tenant)
    except TypeError:
        raise ControlPlaneError(f"a tenant must be hashable, got a {type(tenant).__name__}") from None


def check_names(failed: object) -> tuple:
    """``failed``: an iterable (list, tuple, set) of chunk hashes and :class:`ObjectKey`\\ s. A string
    is refused, not taken as a sequence of one-character chunk hashes; so is None."""
    if type(failed) is tuple and not failed:
        return ()
    if isinstance(failed, (str, bytes)) or not isinstance(failed, abc.Iterable):
        raise ControlPlaneError(f"failed must be a list of chunk hashes or ObjectKeys (empty: none failed), "
                                f"got a {type(failed).__name__}")  # not its value: a bytes one is a chunk hash
    names = tuple(failed)
    for n, name in enumerate(names):
        try:
            hash(name)
        except TypeError:
            raise ControlPlaneError(f"failed entries must be chunk hashes or ObjectKeys: entry {n} is an "
                                    f"unhashable {type(name).__name__}") from None
    return names


def check_states(states: object, chunks: int) -> frozenset[int] | None:
    """``states``: None, or an iterable of chunk indices in ``[0, chunks)``."""
    if states is None:
        return None
    if isinstance(states, (str, bytes)) or not isinstance(states, abc.Iterable):
        raise ControlPlaneError(f"states must be chunk indices (a list of ints) or None, got "
                                f"{type(states).__name__} {_brief(states)}")
    items = list(states)
    bad = [i for i in items if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < chunks]
    if bad:
        raise ControlPlaneError(f"states names {', '.join(map(brief_index, bad[:6]))}: not chunk indices (ints) or "
                                f"outside the {chunks} committed chunks")
    return frozenset(items)


def objects_named(objects: Iterable[CacheObject], names: tuple, what: str) -> set[CacheObject]:
    """The objects among ``objects`` that ``names`` (checked by :func:`check_names`) name: a chunk hash
    names every object of that chunk there, an :class:`ObjectKey` one. A name that matches none is an
    error."""
    by_chunk: dict[Hashable, list[CacheObject]] = {}
    for obj in objects:
        by_chunk.setdefault(obj.node.key, []).append(obj)
    out: set[CacheObject] = set()
    for n, name in enumerate(names):
        if isinstance(name, ObjectKey):
            match = [obj for obj in by_chunk.get(name.chunk, ()) if obj.kind == name.kind]
        else:
            match = by_chunk.get(name, [])
        if not match:
            named = f"an ObjectKey of a {name.kind} object" if isinstance(name, ObjectKey) else "a chunk hash"
            raise ControlPlaneError(f"failed entry {n} ({named}) is not among the objects {what}")
        out.update(match)
    return out


def brief_index(value: object) -> str:
    """A value given as a chunk index, for a message: a number as itself (cut to a readable length),
    anything else by its type only (it may be a chunk hash given in an index's place)."""
    return _brief(value) if isinstance(value, (int, float)) else f"a {type(value).__name__}"


def _brief(value: object) -> str:
    """``repr`` cut to a readable length (a 400-digit int, a huge list)."""
    return reprlib.repr(value)


def first_difference(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length if one begins the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_recovered(keys: object) -> list[ObjectKey]:
    """``recover_ssd``'s keys, checked (raises :class:`ControlPlaneError`), repeats removed."""
    if isinstance(keys, (str, bytes, ObjectKey)) or not isinstance(keys, abc.Iterable):
        raise ControlPlaneError(f"keys must be a list of ObjectKeys, got {type(keys).__name__}")
    keys = list(keys)
    for n, key in enumerate(keys):
        if not isinstance(key, ObjectKey):
            raise ControlPlaneError(f"recover_ssd takes ObjectKeys, got a {type(key).__name__} (entry {n})")
        check_key(key.chunk)
        if key.kind not in (KV, STATE):  # ObjectKey checks its kind, unless it was got around
            raise ControlPlaneError(f"ObjectKey.kind must be 'kv' or 'state', got {key.kind!r}")
    return list(dict.fromkeys(keys))  # a repeat is the same object: one decision, one drop at most


def check_max_bytes(max_bytes: object, default: int) -> int:
    """``prewarm``'s byte cap: an int >= 0, or None for ``default``."""
    if max_bytes is None:
        return default
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ControlPlaneError(f"max_bytes must be an int >= 0 or None, got {max_bytes!r}")
    return max_bytes
