"""PCIe monitor: NVML's PCIe RX/TX throughput counters sampled on a thread, and the calibration of
the coordinator's bandwidth estimates from them.

``nvmlDeviceGetPcieThroughput`` reports KB/s averaged over NVML's own 20 ms window, so sampling
faster than that adds nothing. Without NVML (no GPU, no driver) the monitor is unavailable, it says
why, and the configured estimates stand.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

from saria.config import Bandwidths

# A source returns (rx_bytes_per_s, tx_bytes_per_s) as seen by the GPU.
Source = Callable[[], tuple[float, float]]


@dataclass(frozen=True)
class Sample:
    t: float
    rx: float  # bytes/s into the GPU
    tx: float  # bytes/s out of the GPU


def nvml_source(device_index: int = 0) -> Source:
    """An NVML-backed source for GPU ``device_index``; raises RuntimeError saying why if NVML is
    unusable here."""
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError(f"nvidia-ml-py is not importable: {exc}") from None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML unavailable: {type(exc).__name__}: {exc}") from None
    rx_counter, tx_counter = pynvml.NVML_PCIE_UTIL_RX_BYTES, pynvml.NVML_PCIE_UTIL_TX_BYTES

    def read() -> tuple[float, float]:
        return (pynvml.nvmlDeviceGetPcieThroughput(handle, rx_counter) * 1024.0,
                pynvml.nvmlDeviceGetPcieThroughput(handle, tx_counter) * 1024.0)

    return read


class PCIeMonitor:
    """Samples a throughput source every ``interval_s`` on a daemon thread and keeps the last
    ``history`` samples. ``source=None`` uses NVML for ``device_index``."""

    def __init__(self, source: Source | None = None, *, device_index: int = 0, interval_s: float = 0.02,
                 history: int = 500, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.unavailable_reason: str | None = None
        if source is None:
            try:
                source = nvml_source(device_index)
            except RuntimeError as exc:
                self.unavailable_reason = str(exc)
        self._source = source
        self._interval = interval_s
        self._clock = clock
        self._samples: deque[Sample] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    @property
    def available(self) -> bool:
        return self._source is not None

    def sample_once(self) -> Sample | None:
        """Read the source once and record it (what the thread does every interval)."""
        if self._source is None:
            return None
        try:
            rx, tx = self._source()
        except Exception:  # a transient NVML error must not kill the sampler
            self.errors += 1
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
        while not self._stop.wait(self._interval):
            self.sample_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

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

    def peak_rx(self, window_s: float | None = None) -> float:
        return max((s.rx for s in self.samples(window_s)), default=0.0)

    def mean_rx(self, window_s: float | None = None) -> float:
        samples = self.samples(window_s)
        return sum(s.rx for s in samples) / len(samples) if samples else 0.0


def calibrate(configured: Bandwidths, monitor: PCIeMonitor | None, *, ssd_only_rx: float | None = None,
              window_s: float | None = None, min_gain: float = 1.02) -> Bandwidths:
    """Refine the coordinator's estimates from what the link was seen to do.

    * ``B_GPU`` rises to the peak RX throughput NVML saw when that exceeds the estimate by more than
      ``min_gain`` (the link demonstrably carries at least that); it never drops below the
      configured value from a quiet window.
    * ``B_disk`` becomes ``ssd_only_rx`` (bytes/s) when given: the RX rate measured while only SSD
      reads ran (the transfer engine measures that), which is what the pacing allowance must match.

    With no monitor (or NVML unavailable) the configured estimates stand.
    """
    if monitor is None or not monitor.available:
        return configured
    gpu = configured.gpu_gbps
    peak = monitor.peak_rx(window_s) / 1e9
    if peak > gpu * min_gain:
        gpu = peak
    per_drive = configured.disk_gbps_per_drive
    if ssd_only_rx is not None and ssd_only_rx > 0:
        per_drive = min(ssd_only_rx / 1e9, gpu) / configured.drives
    return replace(configured, gpu_gbps=gpu, disk_gbps_per_drive=per_drive)
