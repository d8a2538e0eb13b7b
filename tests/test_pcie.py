"""The PCIe monitor: NVML's counters in bytes/s, the sampling thread's life, and calibration that
ignores what the link cannot carry. Sources other than NVML are plain callables (the monitor's
interface); NVML itself is checked where there is one."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from saria.config import Bandwidths
from saria.dataplane.transfer.pcie import PCIeMonitor, Sample, calibrate, link_bytes_per_s, nvml_source


def nvml_usable() -> bool:
    try:
        nvml_source().close()
        return True
    except RuntimeError:
        return False


NVML = nvml_usable()


def test_link_rates():
    assert link_bytes_per_s(5, 16) == pytest.approx(63.0e9, rel=1e-3)  # Gen5 x16, 128b/130b
    assert link_bytes_per_s(4, 16) == pytest.approx(31.5e9, rel=1e-3)
    assert link_bytes_per_s(3, 8) == pytest.approx(7.88e9, rel=1e-3)
    assert link_bytes_per_s(1, 1) == 0.25e9  # 8b/10b
    assert link_bytes_per_s(9, 16) is None and link_bytes_per_s(5, 0) is None


@pytest.mark.skipif(NVML, reason="checks a machine without NVML")
def test_without_nvml_the_monitor_says_why():
    with pytest.raises(RuntimeError, match="NVML unavailable: NVMLError_LibraryNotFound|nvidia-ml-py"):
        nvml_source()
    monitor = PCIeMonitor()
    assert not monitor.available and "NVML" in monitor.unavailable_reason
    assert monitor.sample_once() is None and monitor.link_bytes_per_s is None
    monitor.start()
    assert not monitor.running
    monitor.close()
    monitor.close()


def test_thread_stops_and_restarts():
    calls = []
    monitor = PCIeMonitor(lambda: calls.append(1) or (2e9, 1e9), interval_s=0.002)
    assert not monitor.running
    monitor.stop()  # never started: nothing to do
    with monitor:
        assert monitor.running
        deadline = time.monotonic() + 5
        while len(monitor.samples()) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    assert not monitor.running
    assert not any(t.name == "saria-pcie-monitor" and t.is_alive() for t in threading.enumerate())
    n = len(calls)
    time.sleep(0.03)
    assert len(calls) == n, "no sample after stop"
    monitor.start()
    deadline = time.monotonic() + 5
    while len(calls) == n and time.monotonic() < deadline:
        time.sleep(0.005)
    monitor.close()
    assert len(calls) > n and not monitor.running


def test_stop_does_not_hang_on_a_stuck_read(caplog):
    release = threading.Event()
    entered = threading.Event()

    def stuck():
        entered.set()
        release.wait(10)
        return 1e9, 0.0

    monitor = PCIeMonitor(stuck, interval_s=0.001).start()
    assert entered.wait(5)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="saria.dataplane.transfer.pcie"):
        monitor.stop(timeout=0.2)
    assert time.monotonic() - t0 < 2
    assert "left behind" in caplog.text
    release.set()


def test_errors_are_counted_and_the_last_one_kept():
    def broken():
        raise OSError("NVML_ERROR_NOT_SUPPORTED")

    monitor = PCIeMonitor(broken)
    assert monitor.sample_once() is None and monitor.sample_once() is None
    assert monitor.errors == 2 and monitor.last_error == "OSError: NVML_ERROR_NOT_SUPPORTED"


def test_samples_between():
    t = [0.0]
    monitor = PCIeMonitor(lambda: (t[0] * 1e9, 0.0), clock=lambda: t[0])
    for i in range(10):
        t[0] = float(i)
        monitor.sample_once()
    assert [s.t for s in monitor.samples_between(2.0, 4.5)] == [2.0, 3.0, 4.0]
    assert monitor.samples_between(20, 30) == []


def test_calibration_ignores_samples_the_link_cannot_carry():
    values = iter([30e9, 500e9, 29e9])  # one garbage reading far above a Gen4 x16 link
    monitor = PCIeMonitor(lambda: (next(values), 0.0), link_bytes_per_s=link_bytes_per_s(4, 16))
    for _ in range(3):
        monitor.sample_once()
    assert monitor.plausible(monitor.samples()) == [s for s in monitor.samples() if s.rx < 100e9]
    bw = calibrate(Bandwidths(gpu_gbps=25.0), monitor)
    assert bw.gpu_gbps == pytest.approx(30.0)
    unknown_link = PCIeMonitor(lambda: (500e9, 0.0))
    unknown_link.sample_once()
    assert calibrate(Bandwidths(gpu_gbps=25.0), unknown_link).gpu_gbps == pytest.approx(500.0)


def test_the_link_comes_from_the_source():
    class Source:
        link = "Gen5 x16"
        link_bytes_per_s = link_bytes_per_s(5, 16)

        def __call__(self):
            return 1e9, 1e9

    monitor = PCIeMonitor(Source())
    assert monitor.link == "Gen5 x16" and monitor.link_bytes_per_s == pytest.approx(63e9, rel=1e-3)
    assert isinstance(monitor.sample_once(), Sample)


@pytest.mark.skipif(not (NVML and torch.cuda.is_available()), reason="needs NVML and a CUDA device")
def test_nvml_rx_follows_a_pinned_copy():
    """NVML's RX counter during back-to-back pinned H2D copies, scaled to payload, reads about the
    host-timed rate (KB/s x 1024 = bytes/s; a unit slip would be 1000x off)."""
    device = torch.device("cuda")
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    monitor = PCIeMonitor(interval_s=0.02)
    try:
        assert monitor.available and monitor.link_bytes_per_s is not None and monitor.link_bytes_per_s > 1e9
        monitor.start()
        torch.cuda.synchronize()
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 0.5:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            n += 1
        t1 = time.monotonic()
        host = n * src.numel() / (t1 - t0)
        time.sleep(0.05)
        inside = monitor.samples_between(t0 + 0.02, t1)
        assert len(inside) >= 5
        mean = sum(s.rx for s in inside) / len(inside)
        assert 0.75 < mean * monitor.payload_efficiency / host < 1.25, (mean, host)
    finally:
        monitor.close()


def test_a_slow_read_counts_towards_the_interval():
    """NVML's read blocks for its 20 ms window: the thread must not add a whole interval after it."""
    def slow():
        time.sleep(0.05)
        return 1e9, 0.0

    with PCIeMonitor(slow, interval_s=0.05) as monitor:
        time.sleep(0.8)
    # Back to back: about 16 samples (waiting an interval after each read: about 8).
    assert len(monitor.samples()) >= 11


def test_calibration_counts_payload_not_nvml_wire_bytes():
    """NVML counts headers too: on the H200 its RX read 1.11 x the payload rate. B_GPU is a payload
    rate, so calibration scales what the monitor saw by its payload efficiency."""
    from saria.dataplane.transfer.pcie import NVML_PAYLOAD_EFFICIENCY, NvmlSource

    assert NvmlSource.payload_efficiency == NVML_PAYLOAD_EFFICIENCY == 0.90
    wire = PCIeMonitor(lambda: (57e9, 0.0), payload_efficiency=NVML_PAYLOAD_EFFICIENCY)
    wire.sample_once()
    assert calibrate(Bandwidths(gpu_gbps=48.0), wire).gpu_gbps == pytest.approx(51.3)
    assert calibrate(Bandwidths(gpu_gbps=52.0), wire).gpu_gbps == 52.0  # 51.3 payload: below the estimate
    payload = PCIeMonitor(lambda: (57e9, 0.0))  # a plain source reports payload rates
    payload.sample_once()
    assert payload.payload_efficiency == 1.0 and calibrate(Bandwidths(gpu_gbps=48.0), payload).gpu_gbps == 57.0
    with pytest.raises(ValueError, match="payload_efficiency"):
        PCIeMonitor(lambda: (1.0, 0.0), payload_efficiency=1.5)
