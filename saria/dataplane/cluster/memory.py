"""The host memory a cluster store moves bytes from and into: registered with Mooncake once per
client, and every view a call names checked against it before anything is sent (Mooncake reads
or writes an unregistered pointer without a check: the process crashes)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from saria.dataplane.dram.host_pool import HostPool


def memory_ranges(memory: HostPool | Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``(pointer, bytes)`` of each contiguous range of ``memory``: a host pool's segments (found
    from its slots: adjacent slots join), or each given CPU uint8 tensor; sorted, disjoint."""
    if isinstance(memory, HostPool):
        if memory.closed:
            raise ValueError("the host pool is closed")
        ranges: list[list[int]] = []
        for s in range(memory.num_slots):
            ptr = memory.slot(s).data_ptr()
            if ranges and ranges[-1][0] + ranges[-1][1] == ptr:
                ranges[-1][1] += memory.slot_bytes
            else:
                ranges.append([ptr, memory.slot_bytes])
        out = [(p, n) for p, n in ranges]
    else:
        out = []
        for t in memory:
            check_view(t, "a registered buffer")
            out.append((t.data_ptr(), t.numel()))
    out.sort()
    for (p0, n0), (p1, _) in zip(out, out[1:]):
        if p0 + n0 > p1:
            raise ValueError("registered buffers overlap")
    if not out:
        raise ValueError("no memory to register")
    return out


def check_view(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
        raise ValueError(f"{what} must be a contiguous 1-D uint8 CPU tensor (host memory), got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if t.numel() < 1:
        raise ValueError(f"{what} is empty")
    return t


class Registered:
    """Lookup of a store's memory ranges: whether a view lies wholly inside one. ``mooncake``: the
    ranges are registered with Mooncake (a plain store's); else they are the store's private
    memory, which only its own sealing and opening touch (a sealed store's)."""

    def __init__(self, ranges: Sequence[tuple[int, int]], mooncake: bool = True):
        self.ranges = list(ranges)
        self._starts = [p for p, _ in self.ranges]
        self._what = ("the memory registered with the cluster store (the host pool it was opened with)" if mooncake
                      else "the memory the sealed cluster store was opened with (not registered with Mooncake)")

    def check(self, t: torch.Tensor, what: str, max_bytes: int) -> None:
        check_view(t, what)
        if t.numel() > max_bytes:
            raise ValueError(f"{what} is {t.numel()} bytes, more than a part may be ({max_bytes})")
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr + t.numel() > self.ranges[i][0] + self.ranges[i][1]:
            raise ValueError(f"{what} is not inside {self._what}")
