#!/usr/bin/env python3
"""GPU ingress under mixed DRAM + SSD reloads: the paper's Figure 16 experiment.

One request reloads N tokens of the Qwen3-8B layout (36 layers, 8 KV heads, head dim 128, bf16,
16-token pages, 512-token chunks), half of its chunks from the host pool (DRAM) and half from the
SSD store, three ways, through saria's transfer engine:

* serial: the DRAM part, then the SSD part (serial tier loading);
* overlap: both at once, uncoordinated;
* coordinated: both at once, DRAM paced at B_pace = min(B_DRAM, B_GPU - B_disk) while SSD reads
  are runnable (paper Eq. 4).

Bandwidth estimates are measured first (``--no-calibrate`` takes ``--b-gpu/--b-disk/--b-dram``
instead): a DRAM-only reload (B_DRAM, and B_GPU when no larger figure is known) and an SSD-only
reload (B_disk). The DRAM-only reload is also reported as a fraction of a plain pinned ``copy_``
of the same bytes (target >= 90% on a GPU, >= 50% on CPU), the SSD-only reload as a fraction of
an O_DIRECT read of the same drive-file extents by the store's reader thread count (no checksum,
no unpack; target >= 60%). Both one-tier reloads are the best of three, like their baselines.

On a GPU this is the real thing: pinned H2D copies on their own stream, SSD reads through kvikio
(GDS or compat mode) or POSIX O_DIRECT into GPU staging, unpack kernels into the pages. On a
CPU-only machine the same engine and pacer run against files and host buffers, labelled CPU:
it shows the pacer holding its rate, not GPU numbers. SSD files are read with O_DIRECT where the
filesystem allows it (else the page cache is dropped for them first and the run says so).

Prints a table, writes a traffic timeline in 20 ms bins (``--png``, needs matplotlib; ``--csv``),
and with ``--json`` prints as its last line
``{"device", "tokens", "serial_s", "overlap_s", "coordinated_s", "dram_only_gbps", "copy_gbps",
"dram_vs_copy", "ssd_only_gbps", "direct_read_gbps", "ssd_vs_direct", ...}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.config import Bandwidths  # noqa: E402
from saria.control import ReloadPlan, StoreOrder, Tier, WriteOrder  # noqa: E402
from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine, object_key  # noqa: E402
from saria.dataplane.coordinator import pace_bytes_per_s  # noqa: E402
from saria.kernels import INTERPRETED, PageTable  # noqa: E402
from saria.layouts import dense_layer_caches  # noqa: E402
from saria.models import get_model  # noqa: E402

BLOCK = 16
CHUNK_TOKENS = 512
PAGES = CHUNK_TOKENS // BLOCK
SLOT = 4 << 20
BIN_S = 0.020


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def drop_page_cache(paths):
    """Evict the SSD files from the page cache (buffered mode), so reads come from the device."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Rig:
    """Caches, host pool, SSD store and engine for one experiment; half the chunks staged in each tier."""

    def __init__(self, tokens: int, ssd_dir: str, device: torch.device, bw: Bandwidths):
        spec = get_model("qwen3-8b")
        self.device = device
        self.chunks = tokens // CHUNK_TOKENS
        if self.chunks < 2 or self.chunks % 2:
            raise SystemExit(f"--tokens must be an even number of {CHUNK_TOKENS}-token chunks (>= 2), got {tokens}")
        pages = self.chunks * PAGES
        # Source pages (what is staged) and target pages (what reloads fill), in one cache.
        self.caches = dense_layer_caches(spec, 2 * pages, BLOCK, device=device, seed=7)
        self.table = PageTable(self.caches)
        self.kv_bytes = self.table.staging_bytes(PAGES)
        half = self.chunks // 2
        slots_per = -(-self.kv_bytes // SLOT)
        self.pool = HostPool(self.chunks * slots_per * SLOT, SLOT)
        self.store = SSDStore([ssd_dir], 4096 + (half * slots_per + 2) * (4096 + SLOT), SLOT)
        self.coordinator = Coordinator(bw)
        self.engine = TransferEngine(self.table, host_pool=self.pool, coordinator=self.coordinator,
                                     pages_per_chunk=PAGES, ssd=self.store)
        self.hashes = [f"chunk{i}" for i in range(self.chunks)]
        self.src = {h: list(range(i * PAGES, (i + 1) * PAGES)) for i, h in enumerate(self.hashes)}
        self.dst = [list(range(pages + i * PAGES, pages + (i + 1) * PAGES)) for i in range(self.chunks)]
        # Equal split, interleaved: even chunks in DRAM, odd chunks on SSD.
        self.sources = [Tier.DRAM if i % 2 == 0 else Tier.SSD for i in range(self.chunks)]
        dram = tuple(h for h, s in zip(self.hashes, self.sources) if s is Tier.DRAM)
        ssd = tuple(h for h, s in zip(self.hashes, self.sources) if s is Tier.SSD)
        done = self.engine.store(StoreOrder(1, dram, (), 0), self.src).result()
        if not done.ok or done.failed:
            raise SystemExit(f"staging into DRAM failed: {done}")
        done = self.engine.write(WriteOrder(2, ssd, (), 0, Tier.GPU, "write-through"), self.src).result()
        if not done.ok or done.failed:
            raise SystemExit(f"staging onto SSD failed: {done}")
        self.direct = self.store.direct_io
        if not self.direct:
            drop_page_cache(self.store.paths)
        self._plan_id = 10

    def plan(self, indices, serial=False) -> ReloadPlan:
        self._plan_id += 1
        chunks = tuple(self.hashes[i] for i in indices)
        sources = tuple(self.sources[i] for i in indices)
        return ReloadPlan(self._plan_id, chunks, sources, None, None, len(indices) * CHUNK_TOKENS, 0, 0, serial)

    def reload(self, indices, *, serial=False, mode="overlap"):
        """One reload; returns (seconds, timeline)."""
        if not self.direct:
            drop_page_cache(self.store.paths)
        self.coordinator.mode = mode
        timeline = []
        sync(self.device)
        t0 = time.perf_counter()
        job = self.engine.load(self.plan(indices, serial), [self.dst[i] for i in indices], timeline=timeline)
        result = job.wait()
        seconds = time.perf_counter() - t0
        if not result.ok:
            raise SystemExit(f"reload failed: {result.failed}")
        return seconds, timeline

    def verify(self, indices) -> bool:
        for i in indices:
            for c in self.caches:
                if not torch.equal(c[self.src[self.hashes[i]]].view(torch.uint8), c[self.dst[i]].view(torch.uint8)):
                    return False
        return True

    def close(self):
        self.engine.close()
        self.store.close()
        self.pool.close()


def plain_copy_gbps(nbytes: int, device: torch.device, repeats: int = 3) -> float:
    """A plain pinned host -> device copy_ of nbytes (CPU: host -> host), best of ``repeats``."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def direct_read_gbps(store, keys, threads: int, repeats: int = 3) -> tuple[float, bool]:
    """The same bytes as an SSD-only reload of ``keys``, read straight from the store's drive
    files by ``threads`` threads (the store's reader count) with O_DIRECT into page-aligned
    buffers: no checksum, no staging, no unpack. Best of ``repeats``. Returns (GB/s, O_DIRECT used);
    where the filesystem refuses O_DIRECT the files are read buffered after dropping their pages."""
    import mmap
    import queue
    import threading

    extents = [e for key in keys for e in store.part_extents(key)]
    nbytes = sum(length for _, _, length in extents)
    paths = sorted({str(path) for path, _, _ in extents})
    direct = store.direct_io and hasattr(os, "O_DIRECT")
    fds = {p: os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths}
    size = max(length for _, _, length in extents)
    size = -(-size // 4096) * 4096
    buffers = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(threads)]
    for b in buffers:
        b.write(b"\1" * size)  # touched before the clock starts, as the engine's reused buffers are
    best = float("inf")
    try:
        for _ in range(repeats):
            if not direct:
                drop_page_cache(paths)
            work: queue.SimpleQueue = queue.SimpleQueue()
            for path, offset, length in extents:
                work.put((fds[str(path)], offset, -(-length // 4096) * 4096 if direct else length))

            def reader(buf):
                view = memoryview(buf)
                while True:
                    try:
                        fd, offset, length = work.get_nowait()
                    except queue.Empty:
                        return
                    done = 0
                    while done < length:
                        got = os.preadv(fd, [view[done:length]], offset + done)
                        if got <= 0:
                            raise OSError(f"short read at {offset + done}")
                        done += got

            pool = [threading.Thread(target=reader, args=(b,)) for b in buffers]
            t0 = time.perf_counter()
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            best = min(best, time.perf_counter() - t0)
    finally:
        for fd in fds.values():
            os.close(fd)
        for b in buffers:
            b.close()
    return nbytes / best / 1e9, direct


def bins(timeline, horizon):
    n = int(horizon / BIN_S) + 1
    out = {"dram": [0.0] * n, "ssd": [0.0] * n}
    for path, t, nbytes in timeline:
        out[path][min(n - 1, int(t / BIN_S))] += nbytes
    return out


def dram_rate_mixed(timeline):
    """The DRAM part's rate in a mixed reload: its bytes over the time its last slice landed. With
    SSD reads runnable throughout, this is the rate the coordinator let DRAM run at."""
    dram = [(t, n) for p, t, n in timeline if p == "dram"]
    return sum(n for _, n in dram) / max(t for t, _ in dram) if dram else 0.0


def plot(png, runs, device_label):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no PNG: matplotlib is not installed; pip install 'saria[plot]')")
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True)
    for ax, (name, (seconds, timeline)) in zip(axes, runs.items()):
        b = bins(timeline, seconds)
        xs = [i * BIN_S * 1e3 for i in range(len(b["dram"]))]
        ax.step(xs, [v / BIN_S / 1e9 for v in b["dram"]], where="post", label="DRAM -> GPU")
        ax.step(xs, [v / BIN_S / 1e9 for v in b["ssd"]], where="post", label="SSD -> GPU")
        ax.set_title(f"{name}: {seconds * 1e3:.0f} ms")
        ax.set_ylabel("GB/s")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel(f"ms since submission (20 ms bins) - {device_label}")
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens reloaded (default 32768 on a GPU, 4096 on CPU; the paper used 135168)")
    parser.add_argument("--ssd-dir", default=None, help="directory on the SSD under test (default: a temp dir)")
    parser.add_argument("--no-calibrate", action="store_true", help="use --b-* instead of measured bandwidths")
    parser.add_argument("--b-gpu", type=float, default=48.0, help="GPU ingress GB/s (default 48)")
    parser.add_argument("--b-disk", type=float, default=20.0, help="SSD read GB/s, all drives (default 20)")
    parser.add_argument("--b-dram", type=float, default=48.0, help="pinned DRAM->GPU GB/s (default 48)")
    parser.add_argument("--png", default="results/ingress_timeline.png", help="timeline plot (needs matplotlib)")
    parser.add_argument("--csv", default="results/ingress_timeline.csv", help="timeline bins as CSV")
    parser.add_argument("--json", action="store_true", help="print the JSON summary as the last line")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no CUDA): files and host buffers"
    tokens = args.tokens or (32768 if device.type == "cuda" else 4096)
    bw = Bandwidths(gpu_gbps=args.b_gpu, disk_gbps_per_drive=args.b_disk, dram_gbps=args.b_dram)
    tmp = None
    if args.ssd_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="saria-ingress-")
        args.ssd_dir = tmp.name
    print(f"device: {label}; reloading {tokens} Qwen3-8B tokens, half from DRAM, half from SSD ({args.ssd_dir})")
    rig = Rig(tokens, args.ssd_dir, device, bw)
    try:
        print(f"  SSD store: {rig.store.backend_name}, {'O_DIRECT' if rig.direct else 'buffered (page cache dropped)'}")
        everything = list(range(rig.chunks))
        dram_half = [i for i in everything if rig.sources[i] is Tier.DRAM]
        ssd_half = [i for i in everything if rig.sources[i] is Tier.SSD]
        nbytes_half = len(dram_half) * rig.kv_bytes
        rig.reload(everything)  # warm-up: kernels compiled, staging allocated
        # One-tier reloads, best of 3, as their baselines are: a plain copy_ of the same bytes, and
        # an O_DIRECT read of the same file extents by as many threads as the store reads with.
        # (Once under Triton's interpreter, where a reload takes minutes and measures nothing.)
        repeats = 1 if INTERPRETED else 3
        dram_s = min(rig.reload(dram_half)[0] for _ in range(repeats))
        ssd_s = min(rig.reload(ssd_half)[0] for _ in range(repeats))
        dram_gbps, ssd_gbps = nbytes_half / dram_s / 1e9, nbytes_half / ssd_s / 1e9
        copy_gbps = plain_copy_gbps(nbytes_half, device)
        ssd_keys = [object_key(rig.hashes[i], "kv") for i in ssd_half]
        direct_gbps, direct_used = direct_read_gbps(rig.store, ssd_keys, rig.store.read_threads)
        if not args.no_calibrate:
            # B_GPU: on a GPU the shared PCIe ingress, which a plain pinned copy_ saturates; on CPU
            # there is no shared link, so the engine's own DRAM path stands in for it.
            link = max(dram_gbps, copy_gbps) if device.type == "cuda" else dram_gbps
            bw = Bandwidths(gpu_gbps=max(link, ssd_gbps), disk_gbps_per_drive=ssd_gbps, dram_gbps=dram_gbps)
            rig.coordinator.set_bandwidths(bw)
        pace = pace_bytes_per_s(bw) / 1e9
        pacing = bw.disk_gbps < rig.coordinator.saturation * bw.gpu_gbps
        print(f"  DRAM-only reload {dram_gbps:.2f} GB/s = {dram_gbps / copy_gbps:.1%} of a plain copy_ "
              f"({copy_gbps:.2f} GB/s)")
        print(f"  SSD-only reload {ssd_gbps:.2f} GB/s = {ssd_gbps / direct_gbps:.1%} of a "
              f"{'direct-I/O (O_DIRECT)' if direct_used else 'buffered (page cache dropped)'} read of the same "
              f"extents by {rig.store.read_threads} threads ({direct_gbps:.2f} GB/s)")
        print(f"  coordinator: B_GPU {bw.gpu_gbps:.2f}, B_disk {bw.disk_gbps:.2f}, B_DRAM {bw.dram_gbps:.2f} GB/s "
              f"-> B_pace {pace:.2f} GB/s, pacing {'on' if pacing else 'off (SSD alone saturates ingress)'}")
        # Pacer check: SSD reads held runnable, a DRAM-only reload paced at a quarter and at half
        # of the DRAM rate: the delivered rate must follow the target.
        pacer = []
        for fraction in (0.25, 0.5):
            target = fraction * dram_gbps
            rig.coordinator.set_bandwidths(Bandwidths(gpu_gbps=2 * target, disk_gbps_per_drive=target,
                                                      dram_gbps=dram_gbps))
            with rig.coordinator.ssd_reads():
                seconds, _ = rig.reload(dram_half, mode="coordinated")
            pacer.append((target, nbytes_half / seconds / 1e9))
        rig.coordinator.set_bandwidths(bw)
        print("  pacer check (SSD held runnable): " + ", ".join(
            f"target {t:.2f} -> delivered {m:.2f} GB/s" for t, m in pacer))
        runs = {
            "serial": rig.reload(everything, serial=True, mode="overlap"),
            "overlap": rig.reload(everything, mode="overlap"),
            "coordinated": rig.reload(everything, mode="coordinated"),
        }
        ok = rig.verify(everything)
        total = 2 * nbytes_half
        print(f"  {'mode':<12} {'seconds':>8} {'GB/s':>7} {'vs serial':>9} {'DRAM part GB/s':>15}")
        for name, (seconds, timeline) in runs.items():
            print(f"  {name:<12} {seconds:8.3f} {total / seconds / 1e9:7.2f} {runs['serial'][0] / seconds:8.2f}x "
                  f"{dram_rate_mixed(timeline) / 1e9:15.2f}")
        print(f"  every reloaded page verified byte for byte: {ok}")
        plot(args.png, runs, label)
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["mode", "bin_ms", "dram_gbps", "ssd_gbps"])
            for name, (seconds, timeline) in runs.items():
                b = bins(timeline, seconds)
                for i in range(len(b["dram"])):
                    writer.writerow([name, round(i * BIN_S * 1e3), round(b["dram"][i] / BIN_S / 1e9, 3),
                                     round(b["ssd"][i] / BIN_S / 1e9, 3)])
        summary = {"device": device.type, "tokens": tokens,
                   "serial_s": round(runs["serial"][0], 4), "overlap_s": round(runs["overlap"][0], 4),
                   "coordinated_s": round(runs["coordinated"][0], 4),
                   "dram_only_gbps": round(dram_gbps, 3), "copy_gbps": round(copy_gbps, 3),
                   "dram_vs_copy": round(dram_gbps / copy_gbps, 4),
                   "ssd_only_gbps": round(ssd_gbps, 3), "direct_read_gbps": round(direct_gbps, 3),
                   "direct_read_o_direct": direct_used, "read_threads": rig.store.read_threads,
                   "ssd_vs_direct": round(ssd_gbps / direct_gbps, 4), "pace_gbps": round(pace, 3),
                   "coordinated_dram_part_gbps": round(dram_rate_mixed(runs["coordinated"][1]) / 1e9, 3),
                   "pacing": pacing, "pacer_targets_gbps": [round(t, 3) for t, _ in pacer],
                   "pacer_delivered_gbps": [round(m, 3) for _, m in pacer], "ssd_backend": rig.store.backend_name, "o_direct": rig.direct, "verified": ok}
        if args.json:
            print(json.dumps(summary))
        return 0 if ok else 1
    finally:
        rig.close()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
