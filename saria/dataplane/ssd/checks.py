"""Checks on the arguments of SSD store calls: the store's options, keys, tensors, checksums, and
the parts a write cuts its data into or a read writes into. Each raises ``TypeError`` /
``ValueError`` before the store changes anything. (Whether memory is shared with other operations
in flight, or writable, is checked in ``memory``.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from saria.dataplane.ssd.format import BLOCK, HEADER_BYTES, MAX_KEY_BYTES, SUPERBLOCK_BYTES, Geometry, encode_identity
from saria.dataplane.ssd.index import ObjectInfo
from saria.seal import Sealer

CHECKSUM_LIMIT = 1 << 64


def check_options(paths: Sequence[str | os.PathLike], capacity_bytes_per_drive: int, part_bytes: int,
                  direct: bool | str, read_threads: int, write_threads: int, identity: str, sealer: Any = None,
                  backend: str = "auto") -> tuple[Geometry, list[Path]]:
    """The geometry of each drive file and the drive directories of a store opened with these
    arguments (those of :class:`~saria.dataplane.ssd.store.SSDStore`)."""
    if sealer is not None and not isinstance(sealer, Sealer):
        raise TypeError(f"sealer must be a saria.seal.Sealer or None, got {type(sealer).__name__}")
    if sealer is not None and backend == "kvikio":
        raise ValueError("backend='kvikio' with a sealer: sealed parts are opened on the CPU, they never move by "
                         "kvikio or GDS (use backend='auto' or 'posix')")
    if isinstance(paths, (str, os.PathLike)) or not len(paths):
        raise ValueError("paths must be a non-empty list of directories, one per drive")
    if not isinstance(part_bytes, int) or part_bytes < BLOCK or part_bytes % BLOCK:
        raise ValueError(f"part_bytes must be a positive multiple of {BLOCK}, got {part_bytes}")
    if direct not in ("auto", True, False):
        raise ValueError(f"direct must be 'auto', True or False, got {direct!r}")
    if read_threads < 1 or write_threads < 1:
        raise ValueError("read_threads and write_threads must be >= 1")
    encode_identity(identity)
    geometry = Geometry.for_capacity(int(capacity_bytes_per_drive), part_bytes)
    if geometry.slots < 1:
        raise ValueError(f"capacity_bytes_per_drive={capacity_bytes_per_drive} holds no slot: one needs "
                         f"{SUPERBLOCK_BYTES + HEADER_BYTES + part_bytes} bytes with part_bytes={part_bytes}")
    dirs = [Path(p) for p in paths]
    if len({os.path.realpath(d) for d in dirs}) != len(dirs):
        raise ValueError(f"paths must be distinct directories, got {[str(d) for d in dirs]}")
    return geometry, dirs


def check_key(key: Any) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return key


def check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {t.dtype}")
    if t.layout != torch.strided:
        raise ValueError(f"{what} must be a contiguous tensor, got layout {t.layout}")
    if not t.is_contiguous():
        expanded = any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride()))
        note = " (an expanded tensor: stride 0 repeats the same bytes)" if expanded else ""
        raise ValueError(f"{what} must be a contiguous tensor, got shape {tuple(t.shape)} with strides "
                         f"{t.stride()}{note}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} must be on CPU or CUDA, not {t.device}")
    return t.reshape(-1)


def split(data: Any, part_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """``(name, part)`` of each part of a write's ``data``: a tensor cut into ``part_bytes``
    pieces, or a list of parts each ``part_bytes`` long but the last."""
    pb = part_bytes
    if isinstance(data, torch.Tensor):
        flat = check_tensor(data, "data")
        if flat.numel() == 0:
            raise ValueError("data is empty: an object has at least one byte")
        return [("data", t) for t in flat.split(pb)]
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError("data is an empty list of parts")
        parts = [check_tensor(t, f"data[{i}]") for i, t in enumerate(data)]
        for i, t in enumerate(parts):
            last = i == len(parts) - 1
            if (not last and t.numel() != pb) or not 0 < t.numel() <= pb:
                raise ValueError(f"data[{i}] has {t.numel()} bytes: every part but the last must have "
                                 f"part_bytes={pb} and the last 1..{pb}")
        return [(f"data[{i}]", t) for i, t in enumerate(parts)]
    raise TypeError(f"data must be a uint8 tensor or a list of them, got {type(data).__name__}")


def check_checksums(checksums: Any, n: int) -> list[int | None]:
    if checksums is None:
        return [None] * n
    sums = list(checksums)  # a part's None: not computed yet (a layer-wise save's), the write computes it
    if len(sums) != n or not all(c is None or (isinstance(c, int) and 0 <= c < CHECKSUM_LIMIT) for c in sums):
        raise ValueError(f"checksums must be {n} integers in [0, 2**64) or None, one per part")
    return sums


def read_targets(info: ObjectInfo, out: Any, part_bytes: int) -> list[tuple[str, torch.Tensor]]:
    """``(name, destination)`` of each part: exactly the bytes the read will write."""
    pb = part_bytes
    if isinstance(out, torch.Tensor):
        flat = check_tensor(out, "out")
        if flat.numel() < info.length:
            raise ValueError(f"out has {flat.numel()} bytes, the object has {info.length}")
        return [("out", flat[i * pb:i * pb + p.length]) for i, p in enumerate(info.parts)]
    if isinstance(out, (list, tuple)):
        if len(out) != len(info.parts):
            raise ValueError(f"out has {len(out)} tensors, the object has {len(info.parts)} parts")
        targets = []
        for i, (t, p) in enumerate(zip(out, info.parts)):
            flat = check_tensor(t, f"out[{i}]")
            if flat.numel() < p.length:
                raise ValueError(f"out[{i}] has {flat.numel()} bytes, part {i} has {p.length}")
            targets.append((f"out[{i}]", flat[:p.length]))
        return targets
    raise TypeError(f"out must be a uint8 tensor or a list of them, got {type(out).__name__}")
