"""The coordinator (paper §4.5, Eq. 4): how DRAM->GPU copies share GPU ingress with SSD reads.

Left alone, DRAM copies (pinned H2D DMA, ~48 GB/s) take nearly all of the GPU's PCIe ingress and
the SSD reads that started with them crawl until the DRAM burst is over, leaving an SSD-only tail.
While any SSD read is runnable the coordinator therefore releases DRAM traffic in bounded slices at

    B_pace = min(B_DRAM, B_GPU - B_disk)

so both sources progress together. All DRAM work (every request's) goes through one coordinator,
so when one request's DRAM part is done the paced budget serves the next request's DRAM work (the
"residual ingress" of the paper's Figure 9). When no SSD read is runnable DRAM runs unthrottled.
When SSD reads alone can saturate ingress (B_disk >= ``saturation`` x B_GPU; the paper's two-SSD
case got 15.8% slower with pacing) coordination switches itself off.

Bandwidth estimates are :class:`saria.config.Bandwidths` (GB/s), possibly calibrated by the PCIe
monitor. Time is read through a :class:`Clock` so the schedule can be checked exactly in tests.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Protocol

from saria.config import COORDINATION_SATURATION, Bandwidths

GB = 1e9


def pace_bytes_per_s(bw: Bandwidths) -> float:
    """Eq. 4: the DRAM rate while SSD reads are runnable, min(B_DRAM, B_GPU - B_disk), in bytes/s."""
    return min(bw.dram_gbps, bw.gpu_gbps - bw.disk_gbps) * GB


class Clock(Protocol):
    def now(self) -> float: ...

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        """Wait on ``cond`` (held by the caller) for at most ``timeout`` seconds."""


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        cond.wait(timeout)


@dataclass
class CoordinatorCounters:
    slices: int = 0
    paced_slices: int = 0
    paced_bytes: int = 0
    unpaced_bytes: int = 0
    pace_waits: int = 0
    pace_wait_seconds: float = 0.0

    def snapshot(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}  # numbers: no deep copy (asdict)


class Coordinator:
    """Paces DRAM->GPU slices while SSD reads are runnable. Thread-safe.

    ``mode``: ``"coordinated"`` (pace per Eq. 4), ``"overlap"`` (never pace: uncoordinated overlap),
    or ``"serial"`` (DRAM waits until no SSD read is runnable: serial tier loading).
    """

    MODES = ("coordinated", "overlap", "serial")

    def __init__(self, bandwidths: Bandwidths, *, mode: str = "coordinated", saturation: float = COORDINATION_SATURATION,
                 clock: Clock | None = None):
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        if not 0 < saturation <= 1:
            raise ValueError(f"saturation must be in (0, 1], got {saturation}")
        self.mode = mode
        self.saturation = saturation
        self._bw = bandwidths
        self._clock = clock or MonotonicClock()
        self._cond = threading.Condition()
        self._ssd_runnable = 0
        self._next_release = -math.inf  # an idle path: the first slice goes at once, whatever the clock reads
        self._last_release = -math.inf  # when the last slice was let go (the path is busy if that was recent)
        self.counters = CoordinatorCounters()

    @property
    def bandwidths(self) -> Bandwidths:
        return self._bw

    def set_bandwidths(self, bandwidths: Bandwidths) -> None:
        """New estimates (from calibration); waiting slices re-plan at once."""
        with self._cond:
            self._bw = bandwidths
            self._cond.notify_all()

    @property
    def pacing_enabled(self) -> bool:
        """Coordinated mode and SSD alone does not saturate ingress."""
        bw = self._bw
        return (self.mode == "coordinated" and bw.disk_gbps < self.saturation * bw.gpu_gbps
                and pace_bytes_per_s(bw) > 0)

    # --- SSD side --------------------------------------------------------------------------------

    def ssd_begin(self, n: int = 1) -> None:
        with self._cond:
            self._ssd_runnable += n

    def ssd_end(self, n: int = 1) -> None:
        with self._cond:
            if n > self._ssd_runnable:
                raise ValueError(f"ssd_end({n}) but only {self._ssd_runnable} SSD reads are runnable")
            self._ssd_runnable -= n
            self._cond.notify_all()

    @contextmanager
    def ssd_reads(self, n: int = 1) -> Iterator[None]:
        """Mark ``n`` SSD reads runnable for the duration of the block."""
        self.ssd_begin(n)
        try:
            yield
        finally:
            self.ssd_end(n)

    @property
    def ssd_runnable(self) -> int:
        with self._cond:
            return self._ssd_runnable

    # --- DRAM side -------------------------------------------------------------------------------

    # A busy path's late wake-ups are made up for up to this long: a thread woken 50-200 us after its
    # release time (seen on the H200 VM with 4 MiB slices due every 108 us at 39 GB/s) otherwise
    # loses the difference on every slice (75% of the DRAM rate delivered 0.88-0.95 of it). 1 ms of
    # credit is at most ~50 MB at PCIe gen5 rates: no burst that SSD reads would notice.
    LATE_CREDIT_S = 1e-3

    def acquire(self, nbytes: int) -> float:
        """Block until a DRAM slice of ``nbytes`` may be issued; returns the seconds it waited.

        Paced slices are released on a schedule ``nbytes / B_pace`` apart. A busy path (its last
        slice went less than ``LATE_CREDIT_S`` ago) that wakes late keeps up to ``LATE_CREDIT_S``
        of credit, so its average rate is B_pace however the OS schedules it; an idle DRAM path
        banks at most one slice of credit, so no burst follows a pause.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        clock = self._clock
        with self._cond:
            start = clock.now()
            waited_once = False
            while True:
                now = clock.now()
                if self._ssd_runnable == 0 or self.mode == "overlap" or \
                        (self.mode == "coordinated" and not self.pacing_enabled):
                    self._next_release = now
                    self.counters.unpaced_bytes += nbytes
                    break
                if self.mode == "coordinated":
                    if self._next_release <= now:
                        # Credit for lateness: LATE_CREDIT_S on a busy path, one slice on an idle one.
                        interval = nbytes / pace_bytes_per_s(self._bw)
                        busy = now - self._last_release < self.LATE_CREDIT_S
                        credit = max(interval, self.LATE_CREDIT_S) if busy else interval
                        self._next_release = max(self._next_release, now - credit) + interval
                        self.counters.paced_bytes += nbytes
                        self.counters.paced_slices += 1
                        break
                    timeout = self._next_release - now
                else:  # serial: wait for the SSD reads to finish
                    timeout = 1.0
                waited_once = True
                clock.wait(self._cond, timeout)
            self._last_release = clock.now()
            waited = self._last_release - start
            self.counters.slices += 1
            if waited_once:
                self.counters.pace_waits += 1
                self.counters.pace_wait_seconds += waited
            return waited
