#!/usr/bin/env python3
"""Does the coordinator's pacer hold DRAM -> GPU reloads at the rate it is told (paper Eq. 4),
and does NVML's PCIe RX counter see the same rate?

A DRAM-only reload rig (Qwen3-8B layout: 36 layers, 8 KV heads, head dim 128, bf16, 16-token pages,
512-token chunks; every chunk staged in the host pool, reloaded into other pages of the same cache
by saria's transfer engine), and a PCIeMonitor sampling NVML's PCIe counters (a read blocks for
NVML's 20 ms window, RX then TX: about one sample every 40 ms):

1. Unpaced: DRAM-only reloads back to back for at least --seconds (each submitted before the one
   before it is waited for: two in flight, so the DRAM path never runs dry between reloads); their
   rate (bytes over host time, first submission to last page written) is the unpaced rate R.
   NVML's peak and mean RX during that run, against R, are the PCIe monitor's calibration (and
   what ``calibrate()`` would make of B_GPU).
2. Paced, for each target fraction f (default 25%, 50%, 75% of R): the coordinator's estimates
   set so that B_pace = min(B_DRAM, B_GPU - B_disk) = f x R, SSD reads held runnable (what turns
   pacing on), DRAM-only reloads back to back as above for at least --seconds. Reported per
   target: the delivered rate (bytes over host time) and, where NVML works, the mean NVML RX over
   the samples inside the run minus the idle RX measured just before it.

Per target it prints
    target pacer 25%: delivered/target = 0.99 -> MET
    target pacer 25% NVML: payload/target = 1.01 -> MET
(MET within +-10%, --tolerance; else MISSED; a miss is reported, not an error), and the
calibration line. NVML counts packet headers too (on the H200 its RX read 1.11 x the host-timed
payload rate): the NVML figure is its RX times the monitor's payload efficiency (0.90), and the
calibration line shows the factor this run saw. ``--json`` prints a JSON summary as the last line:
{"device", "label", "tokens", "reload_bytes", "unpaced_gbps", "nvml": {"available", "reason", ...},
"calibration": {...}, "targets": [{"fraction", "target_gbps", "delivered_gbps", "ratio", "met",
"nvml_rx_gbps", "nvml_payload_gbps", "nvml_ratio", "nvml_met", ...}], "all_met", "verified", "seconds"}.

On a GPU this is the real path: pinned host slots copied on the DRAM stream, unpacked by the
Triton kernel, NVML counters on the GPU's link (default 8192 tokens = 1.2 GB per reload; the whole
run takes 8-13 s on an H200, CUDA start and kernel compilation included). Without CUDA the same
engine and pacer run on CPU tensors (default 1024 tokens, a few seconds), NVML is reported
unavailable with the reason, and only host-timed figures are given; that shows the pacer holding
its rate, not GPU numbers. --slot-mib and --batch-mib are diagnostics: on the H200 the 75% target
read 0.88-0.95 with the default 4 MiB slices and 256 MiB batches, 0.98-0.99 with 16 MiB slices or
one batch per reload (per-slice and per-batch host costs the pacer does not make up).
Exit status 0 unless a reload fails or the reloaded pages differ from the staged ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.config import Bandwidths  # noqa: E402
from saria.dataplane import Coordinator, HostPool, TransferEngine  # noqa: E402
from saria.dataplane.transfer.coordinator import pace_bytes_per_s  # noqa: E402
from saria.dataplane.transfer.pcie import PCIeMonitor, calibrate  # noqa: E402
from saria.kernels import INTERPRETED, PageTable  # noqa: E402
from saria.harness.paged_caches import dense_layer_caches  # noqa: E402
from saria.models import get_model  # noqa: E402
from saria.orders import ReloadPlan, StoreOrder, Tier  # noqa: E402

BLOCK = 16
CHUNK_TOKENS = 512
PAGES = CHUNK_TOKENS // BLOCK
SLOT = 4 << 20
INTERVAL_S = 0.02  # NVML averages PCIe throughput over 20 ms: sampling faster adds nothing
# A sample's RX is the 20 ms window that ended about 20 ms before its time (the read blocks for the
# window, RX then TX): samples less than this after a run's start still see time before it.
NVML_LAG_S = 0.045
IDLE_S = 0.2  # idle RX baseline measured before each run (about 4 samples at 40 ms a read)
DEPTH = 2  # reloads in flight in a back-to-back run


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Rig:
    """A DRAM-only reload rig: caches, host pool, coordinator and engine, every chunk in DRAM."""

    def __init__(self, tokens: int, device: torch.device, slot_bytes: int = SLOT, batch_bytes: int | None = None):
        self.device = device
        self.chunks = tokens // CHUNK_TOKENS
        if self.chunks < 1 or tokens % CHUNK_TOKENS:
            raise SystemExit(f"--tokens must be a positive multiple of {CHUNK_TOKENS}, got {tokens}")
        pages = self.chunks * PAGES
        # Source pages (staged into DRAM) and target pages (what reloads fill), in one cache.
        self.caches = dense_layer_caches(get_model("qwen3-8b"), 2 * pages, BLOCK, device=device, seed=11)
        self.table = PageTable(self.caches)
        self.kv_bytes = self.table.staging_bytes(PAGES)
        self.reload_bytes = self.chunks * self.kv_bytes
        slots_per = -(-self.kv_bytes // slot_bytes)
        self.pool = HostPool(self.chunks * slots_per * slot_bytes, slot_bytes)  # a host slot is a paced slice
        self.coordinator = Coordinator(Bandwidths())
        self.engine = TransferEngine(self.table, host_pool=self.pool, coordinator=self.coordinator,
                                     pages_per_chunk=PAGES)
        if batch_bytes is not None:
            self.engine.batch_bytes = batch_bytes
        self.hashes = [f"chunk{i}" for i in range(self.chunks)]
        self.src = {h: list(range(i * PAGES, (i + 1) * PAGES)) for i, h in enumerate(self.hashes)}
        self.dst = [list(range(pages + i * PAGES, pages + (i + 1) * PAGES)) for i in range(self.chunks)]
        done = self.engine.store(StoreOrder(1, tuple(self.hashes), (), 0), self.src).result()
        if not done.ok or done.failed:
            raise SystemExit(f"staging into DRAM failed: {done}")
        self._plan_id = 10

    def submit(self):
        """Start one DRAM-only reload of every chunk into the target pages; its LoadJob."""
        self._plan_id += 1
        plan = ReloadPlan(self._plan_id, tuple(self.hashes), (Tier.DRAM,) * self.chunks, None, None,
                          self.chunks * CHUNK_TOKENS, self.reload_bytes, 0, False)
        return self.engine.load(plan, self.dst)

    @staticmethod
    def finish(job) -> None:
        result = job.wait()
        if not result.ok:
            raise SystemExit(f"reload failed: {result.failed}")

    def reload(self) -> float:
        """One reload, alone; its host seconds (submission to every page written)."""
        sync(self.device)
        t0 = time.perf_counter()
        self.finish(self.submit())
        return time.perf_counter() - t0

    def reload_for(self, min_seconds: float) -> tuple[int, float, float, float]:
        """Reloads back to back until ``min_seconds`` have passed, the next one always submitted
        before the previous is waited for (DEPTH in flight), so the DRAM path never runs dry between
        them: what is timed is the DRAM path's sustained rate, not each reload's start and end.
        Returns (reloads, host seconds from the first submission to the last page written,
        monotonic start, monotonic end)."""
        sync(self.device)
        start = time.monotonic()
        t0 = time.perf_counter()
        inflight: deque = deque()
        n = 0
        while True:
            while len(inflight) < DEPTH and (n == 0 or time.monotonic() - start < min_seconds):
                inflight.append(self.submit())
                n += 1
            if not inflight:
                break
            self.finish(inflight.popleft())
        return n, time.perf_counter() - t0, start, time.monotonic()

    def verify(self) -> bool:
        sync(self.device)
        for h, dst in zip(self.hashes, self.dst):
            for c in self.caches:
                if not torch.equal(c[self.src[h]].view(torch.uint8), c[dst].view(torch.uint8)):
                    return False
        return True

    def close(self) -> None:
        self.engine.close()
        self.pool.close()


def open_monitor(device: torch.device, nvml_index: int) -> tuple[PCIeMonitor | None, dict]:
    """The NVML PCIe monitor (running), or None; and what to report about NVML."""
    monitor = PCIeMonitor(device_index=nvml_index, interval_s=INTERVAL_S, history=100_000)
    if not monitor.available:
        return None, {"available": False, "reason": monitor.unavailable_reason}
    if device.type != "cuda":
        monitor.close()
        return None, {"available": False, "reason": "NVML is there but the reloads run on CPU tensors (no CUDA): "
                                                    "its PCIe counters would not see them"}
    probe = monitor.sample_once()
    if probe is None:
        info = {"available": False, "reason": f"NVML PCIe throughput read failed: {monitor.last_error}"}
        monitor.close()
        return None, info
    link = monitor.link_bytes_per_s
    info = {"available": True, "reason": None, "nvml_index": nvml_index,
            "link": monitor.link, "link_gbps": None if link is None else round(link / 1e9, 2)}
    return monitor.start(), info


def mean_rx(monitor: PCIeMonitor, t0: float, t1: float) -> tuple[float | None, int]:
    """Mean NVML RX (bytes/s) of the samples taken inside [t0, t1], leaving out the first
    NVML_LAG_S (their window still covers time before t0); (None, n) with fewer than 2 samples."""
    samples = monitor.plausible(monitor.samples_between(t0 + NVML_LAG_S, t1))
    if len(samples) < 2:
        return None, len(samples)
    return sum(s.rx for s in samples) / len(samples), len(samples)


def idle_rx(monitor: PCIeMonitor | None, device: torch.device) -> float:
    """RX while nothing of ours moves (bytes/s), measured over IDLE_S just before a run."""
    if monitor is None:
        return 0.0
    sync(device)
    t0 = time.monotonic()
    time.sleep(IDLE_S)
    rx, _ = mean_rx(monitor, t0, time.monotonic())
    return rx or 0.0


def verdict(ratio: float, tolerance: float) -> str:
    return "MET" if abs(ratio - 1.0) <= tolerance else "MISSED"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per reload, a multiple of 512 (default 8192 on a GPU = 1.2 GB, 1024 on CPU)")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="least seconds of back-to-back reloads per measurement (default 0.5)")
    parser.add_argument("--fractions", default="0.25,0.5,0.75",
                        help="pace targets as fractions of the unpaced rate (default 0.25,0.5,0.75)")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="a target is MET when measured/target is within 1 +- this (default 0.10)")
    parser.add_argument("--nvml-index", type=int, default=0, help="NVML index of the GPU under test (default 0)")
    parser.add_argument("--slot-mib", type=int, default=SLOT >> 20,
                        help="host slot size in MiB, which is the paced slice (default 4; a diagnostic)")
    parser.add_argument("--batch-mib", type=int, default=None,
                        help="the engine's reload batch size in MiB (default the engine's 256; a diagnostic)")
    parser.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    args = parser.parse_args(argv)
    try:
        fractions = [float(f) for f in args.fractions.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--fractions: comma-separated numbers, got {args.fractions!r}")
    if not fractions or not all(0 < f < 1 for f in fractions):
        parser.error(f"--fractions must each be in (0, 1), got {args.fractions!r}")
    if args.seconds <= 0 or not 0 < args.tolerance < 1:
        parser.error("--seconds must be > 0 and --tolerance in (0, 1)")
    if args.slot_mib < 1 or (args.batch_mib is not None and args.batch_mib < 1):
        parser.error("--slot-mib and --batch-mib must be >= 1")
    if args.tokens is not None and (args.tokens < CHUNK_TOKENS or args.tokens % CHUNK_TOKENS):
        parser.error(f"--tokens must be a positive multiple of {CHUNK_TOKENS}, got {args.tokens}")

    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA): host buffers"
    tokens = args.tokens or (8192 if device.type == "cuda" else 1024)
    monitor, nvml = open_monitor(device, args.nvml_index)
    print(f"device: {label}; DRAM-only reloads of {tokens} Qwen3-8B tokens, >= {args.seconds:g} s per measurement")
    if INTERPRETED and device.type == "cpu":
        print("  note: TRITON_INTERPRET=1: unpacks run under Triton's interpreter (slow); unset it for this bench")
    print("  NVML: " + (f"PCIe counters of GPU {args.nvml_index} sampled every {INTERVAL_S * 1e3:.0f} ms or as fast as NVML answers"
                        + (f", link {nvml['link']} = {nvml['link_gbps']} GB/s" if nvml.get("link") else "")
                        if monitor is not None else f"unavailable: {nvml['reason']}; host-timed figures only"))
    rig = None
    lines = []
    try:
        rig = Rig(tokens, device, args.slot_mib << 20, None if args.batch_mib is None else args.batch_mib << 20)
        rig.reload()  # warm-up: kernels compiled, staging allocated
        print(f"  reload: {rig.chunks} chunks, {rig.reload_bytes / 1e6:.1f} MB")

        # 1. Unpaced (no SSD read runnable: the coordinator lets DRAM run free).
        base = idle_rx(monitor, device)
        n, busy, t0, t1 = rig.reload_for(args.seconds)
        unpaced = n * rig.reload_bytes / busy
        calibration = {"host_gbps": round(unpaced / 1e9, 3)}
        line = f"  unpaced: {n} reloads in {busy:.3f} s -> {unpaced / 1e9:.2f} GB/s (host-timed)"
        if monitor is not None:
            rx, count = mean_rx(monitor, t0, t1)
            run = monitor.plausible(monitor.samples_between(t0 + NVML_LAG_S, t1))
            peak = max((s.rx for s in run), default=0.0)
            configured = Bandwidths(gpu_gbps=unpaced / 1e9, disk_gbps_per_drive=unpaced / 2e9,
                                    dram_gbps=unpaced / 1e9)
            calibrated = calibrate(configured, monitor, window_s=t1 - t0)
            calibration.update(
                nvml_samples=count, nvml_idle_gbps=round(base / 1e9, 3),
                nvml_peak_rx_gbps=round(peak / 1e9, 3),
                nvml_mean_rx_gbps=None if rx is None else round((rx - base) / 1e9, 3),
                peak_vs_host=round(peak / unpaced, 3),
                mean_vs_host=None if rx is None else round((rx - base) / unpaced, 3),
                calibrated_gpu_gbps=round(calibrated.gpu_gbps, 3),
                payload_efficiency=monitor.payload_efficiency,
                seen_efficiency=None if not rx or rx <= base else round(unpaced / (rx - base), 3),
                peak_within_link=None if monitor.link_bytes_per_s is None else peak <= monitor.link_bytes_per_s * 1.02,
                read_errors=monitor.errors, last_error=monitor.last_error)
            if rx is not None:
                line += f"; NVML RX mean {(rx - base) / 1e9:.2f} GB/s over {count} samples (idle {base / 1e9:.2f})"
        print(line)
        if monitor is not None:
            c = calibration
            print(f"  PCIe calibration: NVML peak RX {c['nvml_peak_rx_gbps']:.2f} GB/s during the unpaced run timed at "
                  f"{c['host_gbps']:.2f} GB/s by the host (peak/host {c['peak_vs_host']:.2f}"
                  + (f", mean/host {c['mean_vs_host']:.2f}" if c["mean_vs_host"] is not None else "")
                  + f"); payload efficiency {c['payload_efficiency']:.2f} assumed"
                  + (f", {c['seen_efficiency']:.2f} seen (host / NVML mean)" if c["seen_efficiency"] else "")
                  + f"; calibrate() -> B_GPU {c['calibrated_gpu_gbps']:.2f} GB/s")

        # 2. Paced: SSD reads held runnable, B_pace = f x unpaced.
        targets = []
        for fraction in fractions:
            target = fraction * unpaced
            bw = Bandwidths(gpu_gbps=2 * target / 1e9, disk_gbps_per_drive=target / 1e9, dram_gbps=unpaced / 1e9)
            rig.coordinator.set_bandwidths(bw)
            pace = pace_bytes_per_s(bw)
            base = idle_rx(monitor, device)
            before = rig.coordinator.counters.snapshot()
            with rig.coordinator.ssd_reads():
                if not rig.coordinator.pacing_enabled:
                    raise SystemExit(f"pacing is off for target {target / 1e9:.2f} GB/s ({bw}): the bench is wrong")
                n, busy, t0, t1 = rig.reload_for(args.seconds)
            after = rig.coordinator.counters.snapshot()
            delivered = n * rig.reload_bytes / busy
            ratio = delivered / target
            row = {"fraction": fraction, "target_gbps": round(target / 1e9, 3), "pace_gbps": round(pace / 1e9, 3),
                   "delivered_gbps": round(delivered / 1e9, 3), "ratio": round(ratio, 4),
                   "met": verdict(ratio, args.tolerance) == "MET", "reloads": n, "seconds": round(busy, 4),
                   "paced_slices": after["paced_slices"] - before["paced_slices"],
                   "pace_wait_seconds": round(after["pace_wait_seconds"] - before["pace_wait_seconds"], 4)}
            pct = f"{fraction * 100:g}%"
            print(f"  paced {pct}: target {target / 1e9:.2f} GB/s (B_pace {pace / 1e9:.2f}), delivered "
                  f"{delivered / 1e9:.2f} GB/s over {n} reloads in {busy:.3f} s, {row['paced_slices']} paced slices")
            lines.append(f"target pacer {pct}: delivered/target = {ratio:.2f} -> {verdict(ratio, args.tolerance)}")
            if monitor is not None:
                rx, count = mean_rx(monitor, t0, t1)
                row.update(nvml_samples=count, nvml_idle_gbps=round(base / 1e9, 3))
                if rx is None:
                    row.update(nvml_rx_gbps=None, nvml_payload_gbps=None, nvml_ratio=None, nvml_met=False)
                    lines.append(f"target pacer {pct} NVML: too few samples ({count}) -> MISSED")
                else:
                    # NVML counts packet headers too: its RX times the payload efficiency is the
                    # payload rate the target is set in (the calibration line shows the factor).
                    payload = (rx - base) * monitor.payload_efficiency
                    nratio = payload / target
                    row.update(nvml_rx_gbps=round((rx - base) / 1e9, 3), nvml_payload_gbps=round(payload / 1e9, 3),
                               nvml_ratio=round(nratio, 4), nvml_met=verdict(nratio, args.tolerance) == "MET")
                    print(f"      NVML RX {(rx - base) / 1e9:.2f} GB/s over {count} samples (idle {base / 1e9:.2f} "
                          f"subtracted) x {monitor.payload_efficiency:.2f} payload = {payload / 1e9:.2f} GB/s")
                    lines.append(f"target pacer {pct} NVML: payload/target = {nratio:.2f} -> "
                                 f"{verdict(nratio, args.tolerance)}")
            targets.append(row)
        rig.coordinator.set_bandwidths(Bandwidths())
        ok = rig.verify()
        print(f"  every reloaded page verified byte for byte: {ok}")
        for line in lines:
            print(line)
        if monitor is not None and monitor.errors:
            print(f"  NVML read errors: {monitor.errors} (last: {monitor.last_error})")
        summary = {"device": device.type, "label": label, "tokens": tokens, "reload_bytes": rig.reload_bytes,
                   "slot_bytes": rig.pool.slot_bytes, "batch_bytes": rig.engine.batch_bytes,
                   "unpaced_gbps": round(unpaced / 1e9, 3), "tolerance": args.tolerance, "nvml": nvml,
                   "calibration": calibration, "targets": targets,
                   "all_met": all(t["met"] and t.get("nvml_met", True) for t in targets),
                   "verified": ok, "seconds": round(time.perf_counter() - started, 2)}
        if args.json:
            print(json.dumps(summary))
        return 0 if ok else 1
    finally:
        if rig is not None:
            rig.close()
        if monitor is not None:
            monitor.close()


if __name__ == "__main__":
    sys.exit(main())
