"""PCIe monitor: NVML's PCIe RX/TX throughput counters sampled on a thread, and the calibration of
the coordinator's bandwidth estimates from them.

``nvmlDeviceGetPcieThroughput(handle, NVML_PCIE_UTIL_RX_BYTES / _TX_BYTES)`` (nvidia-ml-py)
reports KB/s (taken as 1024 bytes) over NVML's own 20 ms window, and the call blocks for that
window: a sample (RX, then TX) takes about 40 ms, so its RX figure is the traffic of the 20 ms that
ended about 20 ms before the sample's time. RX is what the GPU receives (host -> device), TX what
it sends. Sampling faster than 20 ms adds nothing.

NVML counts the bytes on the link, packet headers included, not the payload a copy moves: on an
H200 (Gen5 x16, driver 580) its mean RX read 1.10-1.11 x the host-timed payload rate of pinned
DRAM -> GPU reloads, at every rate from 13 to 51 GB/s (bench/bench_pacer.py). Calibration
therefore scales what NVML shows by :data:`NVML_PAYLOAD_EFFICIENCY` before it compares it with
the coordinator's estimates, which are payload rates (a copy's bytes over its time). Without NVML (no GPU, no driver) the monitor is unavailable, it says why, and the
configured estimates stand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from saria.config import Bandwidths

log = logging.getLogger("saria.dataplane.transfer.pcie")

# A source returns (rx_bytes_per_s, tx_bytes_per_s) as seen by the GPU.
Source = Callable[[], tuple[float, float]]

KB = 1024  # NVML's PCIe throughput unit is KB/s
# Payload bytes per byte NVML's PCIe RX counter counts. Measured on an H200 (Gen5 x16, driver 580)
# with bench/bench_pacer.py, 6 runs on 3 machines: host-timed / NVML mean RX = 0.90-0.91 for pinned
# reloads at 51-53 GB/s (NVML 56.5-59.1 GB/s), and the same paced at 13 to 40 GB/s; 256 B of
# payload per TLP with its header, sequence number, CRC and framing is about 0.9 of the wire bytes.
NVML_PAYLOAD_EFFICIENCY = 0.90
# Usable bytes/s per lane by PCIe generation: GT/s x encoding (8b/10b for 1-2, 128b/130b for 3-5,
# 242/256 FLIT for 6) / 8.
LANE_BYTES_PER_S = {1: 2.5e9 * 8 / 10 / 8, 2: 5e9 * 8 / 10 / 8, 3: 8e9 * 128 / 130 / 8, 4: 16e9 * 128 / 130 / 8,
                    5: 32e9 * 128 / 130 / 8, 6: 64e9 * 242 / 256 / 8}


def link_bytes_per_s(generation: int, width: int) -> float | None:
    """The data rate of a PCIe ``generation`` x ``width`` link in one direction (bytes/s), before
    packet overhead; ``None`` for a generation or width it cannot tell."""
    lane = LANE_BYTES_PER_S.get(generation)
    return lane * width if lane is not None and width > 0 else None


@dataclass(frozen=True)
class Sample:
    t: float
    rx: float  # bytes/s into the GPU
    tx: float  # bytes/s out of the GPU


class NvmlSource:
    """NVML's PCIe counters of GPU ``device_index`` as a :data:`Source` (bytes/s). Raises
    RuntimeError saying why when NVML is unusable here. :meth:`close` balances its ``nvmlInit``.

    ``link``: ``"Gen5 x16"`` (the maximum the device and system allow) and ``link_bytes_per_s``
    its data rate, or ``None`` where NVML does not tell. ``payload_efficiency``: payload bytes
    per byte its counters count (:data:`NVML_PAYLOAD_EFFICIENCY`)."""

    payload_efficiency = NVML_PAYLOAD_EFFICIENCY

    def __init__(self, device_index: int = 0):
        try:
            import pynvml
        except ImportError as exc:
            raise RuntimeError(f"nvidia-ml-py is not importable: {exc}") from None
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise RuntimeError(f"NVML unavailable: {type(exc).__name__}: {exc}") from None
        self._open = True
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except pynvml.NVMLError as exc:
            self.close()
            raise RuntimeError(f"NVML has no GPU {device_index}: {type(exc).__name__}: {exc}") from None
        self._rx, self._tx = pynvml.NVML_PCIE_UTIL_RX_BYTES, pynvml.NVML_PCIE_UTIL_TX_BYTES
        self.link: str | None = None
        self.link_bytes_per_s: float | None = None
        try:
            gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(self._handle)
            width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(self._handle)
            self.link = f"Gen{gen} x{width}"
            self.link_bytes_per_s = link_bytes_per_s(int(gen), int(width))
        except Exception as exc:  # informational: a VM may not expose it
            log.debug("NVML link generation / width not available: %s", exc)

    def __call__(self) -> tuple[float, float]:
        get = self._nvml.nvmlDeviceGetPcieThroughput
        return get(self._handle, self._rx) * float(KB), get(self._handle, self._tx) * float(KB)

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._nvml.nvmlShutdown()
            except Exception as exc:
                log.debug("nvmlShutdown: %s", exc)


def nvml_source(device_index: int = 0) -> NvmlSource:
    """An NVML-backed source for GPU ``device_index``; raises RuntimeError saying why if NVML is
    unusable here."""
    return NvmlSource(device_index)


class PCIeMonitor:
    """Samples a throughput source every ``interval_s`` on a daemon thread and keeps the last
    ``history`` samples. ``source=None`` uses NVML for ``device_index`` (the monitor then owns it:
    :meth:`close` releases NVML). ``link_bytes_per_s``: the link's data rate, above which a sample is
    implausible (default: what the source tells, e.g. NVML's maximum link generation and width).
    ``payload_efficiency``: payload bytes per byte the source counts (default: what the source
    tells, :data:`NVML_PAYLOAD_EFFICIENCY` for NVML; 1.0 for a source that reports payload rates).

    :meth:`stop` (or leaving ``with``) stops the thread; the samples stay readable and
    :meth:`start` may sample again. ``errors`` counts failed reads, ``last_error`` says the latest."""

    def __init__(self, source: Source | None = None, *, device_index: int = 0, interval_s: float = 0.02,
                 history: int = 500, clock: Callable[[], float] = time.monotonic,
                 link_bytes_per_s: float | None = None, payload_efficiency: float | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if payload_efficiency is not None and not 0 < payload_efficiency <= 1:
            raise ValueError(f"payload_efficiency must be in (0, 1], got {payload_efficiency}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.unavailable_reason: str | None = None
        self._owned = False
        if source is None:
            try:
                source = nvml_source(device_index)
                self._owned = True
            except RuntimeError as exc:
                self.unavailable_reason = str(exc)
        self._source = source
        self.link_bytes_per_s = link_bytes_per_s if link_bytes_per_s is not None else \
            getattr(source, "link_bytes_per_s", None)
        self.link: str | None = getattr(source, "link", None)  # e.g. "Gen5 x16", where the source tells
        self.payload_efficiency = payload_efficiency if payload_efficiency is not None else \
            float(getattr(source, "payload_efficiency", 1.0))
        self._interval = interval_s
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0
        self.last_error: str | None = None

    @property
    def available(self) -> bool:
        return self._source is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def sample_once(self) -> Sample | None:
        """Read the source once and record it (what the thread does every interval)."""
        if self._source is None:
            return None
        try:
            rx, tx = self._source()
        except Exception as exc:  # a transient NVML error must not kill the sampler
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        sample = Sample(self._clock(), float(rx), float(tx))
        with self._lock:
            self._samples.append(sample)
        return sample

    def start(self) -> "PCIeMonitor":
        if self._source is None or self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="saria-pcie-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # A fixed-rate schedule: the time a read takes counts towards the interval. (An NVML
        # throughput read blocks for its 20 ms window, RX then TX: 40 ms; waiting a full interval
        # after that sampled every 60 ms and saw a third of the time.) A read longer than the
        # interval is followed at once by the next, never by a burst.
        due = time.monotonic()
        while True:
            due += self._interval
            now = time.monotonic()
            if due < now:
                due = now
            if self._stop.wait(due - now):
                return
            self.sample_once()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the sampling thread and wait for it (at most ``timeout`` s: a read stuck in the
        driver leaves a daemon thread behind, logged, rather than hanging the caller)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("PCIe monitor thread still in a counter read after %.1f s; left behind (daemon)",
                            timeout)

    def close(self) -> None:
        """Stop, and release the NVML source this monitor opened."""
        self.stop()
        if self._owned and self._source is not None:
            self._source.close()
            self._source = None
            self._owned = False
            self.unavailable_reason = "closed"

    def __enter__(self) -> "PCIeMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def samples(self, window_s: float | None = None) -> list[Sample]:
        """Samples of the last ``window_s`` seconds (all kept ones if None), oldest first."""
        with self._lock:
            samples = list(self._samples)
        if window_s is None or not samples:
            return samples
        cutoff = samples[-1].t - window_s
        return [s for s in samples if s.t >= cutoff]

    def samples_between(self, t0: float, t1: float) -> list[Sample]:
        """Samples taken at clock times ``t0 <= t <= t1``, oldest first."""
        return [s for s in self.samples() if t0 <= s.t <= t1]

    def plausible(self, samples: list[Sample]) -> list[Sample]:
        """``samples`` without those reading above the link's data rate (when known)."""
        limit = self.link_bytes_per_s
        return samples if limit is None else [s for s in samples if s.rx <= limit * 1.02]

    def peak_rx(self, window_s: float | None = None) -> float:
        return max((s.rx for s in self.samples(window_s)), default=0.0)

    def mean_rx(self, window_s: float | None = None) -> float:
        samples = self.samples(window_s)
        return sum(s.rx for s in samples) / len(samples) if samples else 0.0


def calibrate(configured: Bandwidths, monitor: PCIeMonitor | None, *, ssd_only_rx: float | None = None,
              window_s: float | None = None, min_gain: float = 1.02) -> Bandwidths:
    """Refine the coordinator's estimates from what the link was seen to do.

    * ``B_GPU`` rises to the peak RX payload rate the monitor saw (its peak sample times
      ``monitor.payload_efficiency``: NVML counts packet headers too) when that exceeds the
      estimate by more than ``min_gain`` (the link demonstrably carries at least that); it never
      drops below the configured value from a quiet window. Samples above the link's data rate
      (when the monitor knows it) are implausible and ignored.
    * ``B_disk`` becomes ``ssd_only_rx`` (payload bytes/s) when given: the rate measured while only
      SSD reads ran (the transfer engine measures that), which is what the pacing allowance must match.

    With no monitor (or NVML unavailable) the configured estimates stand.
    """
    if monitor is None or not monitor.available:
        return configured
    gpu = configured.gpu_gbps
    peak = max((s.rx for s in monitor.plausible(monitor.samples(window_s))), default=0.0)
    peak *= monitor.payload_efficiency / 1e9
    if peak > gpu * min_gain:
        gpu = peak
    per_drive = configured.disk_gbps_per_drive
    if ssd_only_rx is not None and ssd_only_rx > 0:
        per_drive = min(ssd_only_rx / 1e9, gpu) / configured.drives
    return replace(configured, gpu_gbps=gpu, disk_gbps_per_drive=per_drive)
