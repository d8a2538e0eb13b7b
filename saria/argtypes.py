"""Argument types of the ``saria`` commands: each parses one value or raises
``argparse.ArgumentTypeError`` saying what it wanted, which argparse reports as
``saria CMD: error: argument --flag: ...`` with exit status 2."""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

__all__ = ["MAX_SIZE_BYTES", "MAX_TOKEN_COUNT", "float_range", "fraction", "host_name", "host_port", "int_range",
           "listed", "parse_size", "positive_float", "positive_int", "tokens"]

MAX_SIZE_BYTES = 10**18  # an exabyte: beyond any drive or memory saria could be given
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "pib": 2**50}


def parse_size(text: str) -> int:
    """Bytes from ``1.92TB``, ``800GiB``, ``3.84e12`` (decimal units for TB/GB/..., binary for
    TiB/GiB/...), from one byte to :data:`MAX_SIZE_BYTES`."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 3.84TB, 800GiB, 1e12)")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not math.isfinite(value) or not 1 <= value <= MAX_SIZE_BYTES:
        raise argparse.ArgumentTypeError(f"size must be from one byte to 1 EB, got {text!r}")
    return int(value)


def int_range(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in ``[low, high]`` (``high`` None: no upper bound); ``1,000`` and ``1_000`` read
    as 1000."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace(",", "").replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low:,}" if high is None else f"from {low:,} to {high:,}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text.strip()[:40]}")
        return value

    return parse


positive_int = int_range(1)


MAX_TOKEN_COUNT = 10**13  # ten trillion tokens: petabytes of KV for any model


def tokens(text: str) -> int:
    """A token count from 0 to :data:`MAX_TOKEN_COUNT`, accepting 1,000,000 / 1_000_000 / 1e6 /
    1M / 500K."""
    raw = text.strip().replace(",", "").replace("_", "")
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(raw[-1:].lower(), 1)
    if scale != 1:
        raw = raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole token count >= 0: {text!r}")
    if value > MAX_TOKEN_COUNT:
        raise argparse.ArgumentTypeError(f"at most {MAX_TOKEN_COUNT:.0e} tokens, got {text!r}")
    return int(value)


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def float_range(low: float, high: float) -> Callable[[str], float]:
    """A number in ``[low, high]``: for physical quantities, where a value off by orders of
    magnitude is a typo (a bandwidth of 1e-300 GB/s), not a setting."""

    def parse(text: str) -> float:
        value = _finite(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g}, got {text}")
        return value

    return parse


fraction = float_range(0.0, 1.0)  # a number in [0, 1]


def listed(kind: Callable[[str], object], *, allow_none: bool = True) -> Callable[[str], tuple]:
    """Comma-separated values of ``kind`` (a function of the text that raises ``ValueError`` or
    ``ArgumentTypeError``); ``none``/``off`` for None where ``allow_none``."""

    def parse(text: str) -> tuple:
        out = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            if item.lower() in ("none", "off"):
                if not allow_none:
                    raise argparse.ArgumentTypeError(f"{item!r} is not allowed here, in {text!r}")
                out.append(None)
                continue
            try:
                out.append(kind(item))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise argparse.ArgumentTypeError(f"bad value {item!r} in {text!r}: {exc}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        return tuple(out)

    return parse


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_name(text: str) -> str:
    """A host name or IPv4 address, as Mooncake's addresses take them (no port; not IPv6)."""
    host = text.strip()
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if not host or len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise argparse.ArgumentTypeError(f"not a host name or IPv4 address: {text!r:.60}")
    return host


def host_port(text: str) -> str:
    """``HOST:PORT`` (a host name or IPv4 address, a port from 1 to 65535), e.g. ``10.0.0.1:50051``."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port):
        raise argparse.ArgumentTypeError(f"must be HOST:PORT, e.g. 10.0.0.1:50051, got {text!r:.60}")
    if not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"the port must be from 1 to 65535, got {text!r:.60}")
    try:
        return f"{host_name(host)}:{int(port)}"
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT with HOST a host name or IPv4 address, got "
                                         f"{text!r:.60}") from None
