#!/usr/bin/env python3
"""What sealing costs (issue 33, docs/security.md): AES-256-GCM on this CPU, and the SSD and
cluster reloads with a key against without.

(a) **AEAD per core.** ``Sealer.seal_into`` / ``open_into`` (AES-256-GCM from ``cryptography``,
    associated data built and the tenant read from the name, as the stores call them) on 4 MiB
    parts, in 1 thread and in 2 (each with its own buffers), GB/s of plaintext. Beside it: the
    checksum the tag replaces (``saria.kernels.checksum``) on the same part, and whether a pure-
    Python thread keeps running during an open (the GIL released), which 1 vs 2 threads alone
    cannot tell on a machine whose two cores do not scale. And what a key per part costs (seal
    format 2): one HKDF-SHA256 and AES key setup a part in microseconds, its share of the part's
    AES-GCM, and the 1-thread seal rate under one fixed key (format 1's way) and with a key per
    part, side by side.
(b) **SSD-only reload, sealed / unsealed.** Two SSD stores in two directories under ``--ssd-dir``
    (one drive), the same chunks of a model's pages written to each (as vLLM block hashes become
    chunk ids with a key: 48-byte names), then reloaded through the transfer engine into pages
    (read, verify: checksum or GCM tag, unpack), the unsealed store and the sealed one taking turns
    (A/B/B/A...), the drive files' pages dropped from the page cache before every reload
    (``fsync`` + ``POSIX_FADV_DONTNEED``; O_DIRECT where the filesystem allows it). Every reloaded
    page is compared with its source. Target: sealed >= 0.90 of unsealed.
(c) **Cluster get, sealed / Mooncake's own.** bench_cluster.py's ``measure(sealed=True)``: a
    sealed ``ClusterStore`` (a key file made for the run, chunk-id names, parts and metadata sealed)
    put and get against Mooncake's ``batch_put_from`` / ``batch_get_into`` of the same bytes,
    interleaved round by round, on a master and storage node it starts (or ``--master``); and,
    beside it (not with ``--quick``), the plain store (checksums) the same way. Target: sealed get
    >= 0.80. Needs Mooncake; without it the row says why and its target is not measured.

Each target is printed as ``target <what> >= <goal>: <value> -> MET|MISSED`` (as gpu_check.sh
gathers them); a miss does not change the exit status, a reload that fails or a page that differs
does (status 1). ``--json PATH`` writes every number. ``--quick`` is a smoke run of a few seconds.

    python bench/bench_seal.py                    # Qwen3-8B pages, 4 chunks of 512 tokens (288 MiB)
    python bench/bench_seal.py --quick --json out.json
    python bench/bench_seal.py --ssd-dir /mnt/nvme0/bench --chunks 16 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:  # run from a checkout without installing; the sibling benches
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from saria.seal import Keyring, PartContext, Sealer, new_key_file  # noqa: E402

MiB = 1 << 20
PART = 4 * MiB
SSD_TARGET = 0.90
CLUSTER_TARGET = 0.80
IDENTITY = "bench_seal|{model}|bf16|{block} tokens|rank 0"


# ------------------------------------------------------------------ (a) AEAD per core


def aead_rates(keyring: Keyring, part_bytes: int, seconds: float) -> dict:
    """GB/s of ``seal_into`` and ``open_into`` on ``part_bytes`` parts, 1 and 2 threads."""
    sealer = Sealer(keyring, "ssd", "bench_seal")
    (chunk_id,) = keyring.chunk_ids(keyring.tenant("bench tenant"), b"bench", [b"\1" * 32])
    name = b"kb" + chunk_id
    ctx = PartContext(name, 0, 1, part_bytes, part_bytes)
    plain = torch.randint(0, 256, (part_bytes,), dtype=torch.uint8).numpy()
    sealed_buf = bytearray(part_bytes + 16)
    sealed = sealer.seal_into(ctx, plain, sealed_buf)

    def worker(op: str, stop_at: float, done: list):
        out = bytearray(part_bytes + 16 if op == "seal" else part_bytes)
        n = 0
        while time.perf_counter() < stop_at or n == 0:
            if op == "seal":
                sealer.seal_into(ctx, plain, out)
            else:
                sealer.open_into(ctx, sealed, sealed_buf, out)
            n += 1
        done.append(n)

    out = {}
    for op in ("seal", "open"):
        for threads in (1, 2):
            done: list[int] = []
            t0 = time.perf_counter()
            pool = [threading.Thread(target=worker, args=(op, t0 + seconds, done)) for _ in range(threads)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
            out[f"{op}_{threads}t_GBps"] = sum(done) * part_bytes / (time.perf_counter() - t0) / 1e9
    from saria.kernels.checksum import checksum

    src = torch.from_numpy(plain)
    checksum(src)  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 2 or n == 0:
        checksum(src)
        n += 1
    out["checksum_GBps"] = n * part_bytes / (time.perf_counter() - t0) / 1e9
    out["gil_released"] = gil_probe(sealer, ctx, sealed, sealed_buf, part_bytes)
    out.update(part_key_cost(sealer, ctx, plain, part_bytes, seconds))
    return out


def part_key_cost(sealer, ctx, plain, part_bytes: int, seconds: float) -> dict:
    """What a key per part costs (seal format 2, docs/security.md): one HKDF-SHA256 and an AES key
    setup per part (µs), against the same part's AES-GCM under one fixed key (format 1's way), and
    the seal rate each way side by side (1 thread)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from saria.seal import aead

    tenant = sealer.tenant_of_name(ctx.name)
    k_et = sealer.keyring.seal_key(sealer.keyring.current_epoch, tenant)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 4 or n < 100:
        AESGCM(aead.part_key(k_et, os.urandom(aead.NONCE_BYTES)))
        n += 1
    derive_s = (time.perf_counter() - t0) / n
    fixed, out = AESGCM(k_et), bytearray(part_bytes + 16)
    rates = {}
    for _ in range(4):  # interleaved, 4 times each: one fixed key, then a key per part (the best of each)
        for how in ("fixed", "per_part"):
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 8 or n == 0:
                if how == "fixed":  # as format 1 sealed: the tenant read, the associated data built, one key
                    t = sealer.tenant_of_name(ctx.name)
                    fixed.encrypt_into(os.urandom(12), plain, sealer.associated_data(ctx, t, 1), out)
                else:
                    sealer.seal_into(ctx, plain, out)
                n += 1
            rates.setdefault(how, []).append(n * part_bytes / (time.perf_counter() - t0) / 1e9)
    fixed_gbps, per_part_gbps = max(rates["fixed"]), max(rates["per_part"])
    gcm_s = part_bytes / (fixed_gbps * 1e9)
    return {"part_key_us": derive_s * 1e6, "part_gcm_us": gcm_s * 1e6, "part_key_share": derive_s / gcm_s,
            "seal_fixed_key_GBps": fixed_gbps, "seal_per_part_key_GBps": per_part_gbps,
            "per_part_key_ratio": per_part_gbps / fixed_gbps}


def gil_probe(sealer, ctx, sealed, blob, part_bytes) -> float:
    """How much of its own rate a pure-Python counting thread keeps while this thread opens parts:
    near 0 if ``open_into`` holds the GIL, well above 0 if it lets go."""
    count, stop = [0], [False]

    def spin():
        while not stop[0]:
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        c0, t0 = count[0], time.perf_counter()
        time.sleep(0.1)
        alone = (count[0] - c0) / (time.perf_counter() - t0)
        out = bytearray(part_bytes)
        c0, t0 = count[0], time.perf_counter()
        for _ in range(8):
            sealer.open_into(ctx, sealed, blob, out)
        during = (count[0] - c0) / (time.perf_counter() - t0)
    finally:
        stop[0] = True
        t.join()
    return during / alone if alone else 0.0


# ------------------------------------------------------------------ (b) SSD-only reload


class SsdRig:
    """One page table (source pages, then target pages) and two SSD stores on one drive: ``plain``
    (checksums) and ``sealed`` (AES-256-GCM), each with its own transfer engine, each holding the
    same chunks under the same chunk-id names."""

    def __init__(self, args, keyring: Keyring, device: torch.device, ssd_dir: Path):
        from saria.config import Bandwidths
        from saria.control import Tier, WriteOrder
        from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine
        from saria.harness.paged_caches import dense_layer_caches
        from saria.kernels import PageTable
        from saria.models import get_model

        self.device, self.chunks = device, args.chunks
        self.pages, self.tokens = args.chunk_tokens // args.block, args.chunk_tokens
        spec = get_model(args.model)
        self.caches = dense_layer_caches(spec, 2 * self.chunks * self.pages, args.block, device=device, seed=11)
        self.table = PageTable(self.caches)
        self.kv_bytes = self.table.staging_bytes(self.pages)
        parts = -(-self.kv_bytes // PART) * self.chunks
        capacity = 4096 + (parts + 4) * (4096 + PART)
        identity = IDENTITY.format(model=args.model, block=args.block)
        tenant = keyring.tenant("bench tenant")
        self.names = keyring.chunk_ids(tenant, identity.encode(), [os.urandom(32) for _ in range(self.chunks)])
        self.src = [list(range(i * self.pages, (i + 1) * self.pages)) for i in range(self.chunks)]
        base = self.chunks * self.pages
        self.dst = [list(range(base + i * self.pages, base + (i + 1) * self.pages)) for i in range(self.chunks)]
        self.parts: dict[str, tuple] = {}
        self._tier, self._plan_id = Tier, 100
        for which, sealer in (("plain", None), ("sealed", Sealer(keyring, "ssd", identity))):
            d = ssd_dir / which
            d.mkdir(parents=True, exist_ok=True)
            store = SSDStore([str(d)], capacity, PART, identity=identity, sealer=sealer)
            pool = HostPool(PART, PART)
            engine = TransferEngine(self.table, host_pool=pool, coordinator=Coordinator(Bandwidths()), pages_per_chunk=self.pages,
                                    ssd=store)
            self.parts[which] = (store, pool, engine)
            done = engine.write(WriteOrder(1, tuple(self.names), (), 0, Tier.GPU, "write-through"),
                                dict(zip(self.names, self.src))).result()
            if not done.ok or done.failed:
                raise SystemExit(f"writing the {which} objects failed: {done}")

    def store(self, which: str):
        return self.parts[which][0]

    def reload(self, which: str) -> float:
        """Seconds of one SSD-only reload of every chunk from ``which`` (its drive file's pages
        dropped first); the target pages are zeroed before, compared after."""
        from bench_ingress import drop_page_cache
        from saria.control import ReloadPlan

        store, _, engine = self.parts[which]
        for c in self.caches:
            c[self.chunks * self.pages:].view(torch.uint8).zero_()
        drop_page_cache(store.paths)
        self._plan_id += 1
        plan = ReloadPlan(self._plan_id, tuple(self.names), (self._tier.SSD,) * self.chunks, None, None,
                          self.chunks * self.tokens, 0, self.chunks * self.kv_bytes, False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        result = engine.load(plan, self.dst).wait()
        seconds = time.perf_counter() - t0
        if not result.ok:
            raise SystemExit(f"the {which} reload failed: {result.failed}")
        for c in self.caches:
            raw = c.view(torch.uint8)
            for s, d in zip(self.src, self.dst):
                if not torch.equal(raw[s], raw[d]):
                    raise SystemExit(f"the {which} reload restored pages that differ from their source")
        return seconds

    def close(self) -> None:
        for store, pool, engine in self.parts.values():
            engine.close()
            store.close()
            pool.close()


def ssd_ab(args, keyring: Keyring, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory(prefix="saria-bench-seal-", dir=args.ssd_dir) as tmp:
        rig = SsdRig(args, keyring, device, Path(tmp))
        try:
            for which in ("plain", "sealed"):
                rig.reload(which)  # warm-up: staging allocated, kernels compiled
            times: dict[str, list[float]] = {"plain": [], "sealed": []}
            for r in range(args.rounds):
                for which in (("plain", "sealed") if r % 2 == 0 else ("sealed", "plain")):
                    times[which].append(rig.reload(which))
            plain, sealed = rig.store("plain"), rig.store("sealed")
            nbytes = rig.chunks * rig.kv_bytes
            out = {"chunks": rig.chunks, "chunk_bytes": rig.kv_bytes, "bytes_per_reload": nbytes,
                   "rounds": args.rounds, "device": device.type, "plain_backend": plain.backend_name,
                   "sealed_backend": "posix (decrypted on the CPU)", "o_direct": plain.direct_io and sealed.direct_io,
                   "read_threads": plain.read_threads, "seconds": times}
            for which in ("plain", "sealed"):
                out[f"{which}_GBps"] = len(times[which]) * nbytes / sum(times[which]) / 1e9
            out["ratio"] = out["sealed_GBps"] / out["plain_GBps"]
            out["round_ratios"] = [p / s for p, s in zip(times["plain"], times["sealed"])]
            out["sealed_counters"] = {k: v for k, v in sealed.counters().items() if "auth" in k or "seal" in k}
            return out
        finally:
            rig.close()


# ------------------------------------------------------------------ (c) cluster get


def cluster_ab(args) -> dict:
    """bench_cluster.py's :func:`measure`: the sealed store's put and get against Mooncake's own
    batch calls (interleaved, alternating which goes first), and, unless ``--quick``, the plain store
    (checksums) the same way for comparison; ``{"skipped": why}`` where Mooncake cannot run here."""
    try:
        import bench_cluster
    except ImportError as exc:  # Mooncake (the cluster extra) or its libibverbs missing
        return {"skipped": f"bench_cluster cannot be imported: {exc}"}
    if not hasattr(bench_cluster, "measure"):
        return {"skipped": "bench_cluster.py has no measure() (its sealed mode) in this tree"}
    from saria.dataplane.cluster.connection import MooncakeMissing, import_store_class

    try:
        import_store_class()
    except MooncakeMissing as exc:
        return {"skipped": f"Mooncake Store cannot be imported: {exc}"}
    sizes = {} if args.cluster_rounds is None else {"rounds": args.cluster_rounds}
    out = {"sealed": bench_cluster.measure(sealed=True, quick=args.quick, master=args.master, **sizes)}
    if not args.quick:
        out["plain"] = bench_cluster.measure(sealed=False, quick=False, master=args.master, **sizes)
    return out


# ------------------------------------------------------------------ main


def parse_args(argv):
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds (CI): small chunks, 2 rounds")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH")
    p.add_argument("--ssd-dir", default=None, help="directory on the drive under test (default: the temp dir)")
    p.add_argument("--model", default="qwen3-8b", help="the page layout of the chunks (default qwen3-8b)")
    p.add_argument("--chunks", type=int, default=None, help="chunks per reload (default 4; 16 on a GPU)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (default 512)")
    p.add_argument("--block", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--rounds", type=int, default=6, help="reloads of each store, alternating (default 6)")
    p.add_argument("--aead-seconds", type=float, default=1.0, help="seconds per AEAD measurement (default 1)")
    p.add_argument("--cluster-rounds", type=int, default=None, help="rounds of the cluster A/B (its default)")
    p.add_argument("--master", help="a running Mooncake master's host:port for (c) (default: start one here)")
    p.add_argument("--skip", action="append", default=[], choices=["aead", "ssd", "cluster"],
                   help="leave a part out (repeatable)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.quick:
        args.model, args.chunk_tokens, args.chunks, args.rounds, args.aead_seconds = "qwen3-1.7b", 128, 2, 2, 0.2
    if args.chunks is None:
        args.chunks = 16 if gpu else 4
    if args.chunks < 1 or args.rounds < 1 or args.block < 1 or args.chunk_tokens % args.block:
        p.error("--chunks and --rounds must be >= 1 and --chunk-tokens a multiple of --block")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (no CUDA)"
    with tempfile.TemporaryDirectory(prefix="saria-bench-seal-key-") as tmp:
        keyring = Keyring(new_key_file(Path(tmp) / "bench.key"))
    result: dict = {"device": label, "cpus": os.cpu_count(), "quick": args.quick, "targets": []}

    def target(name, value, goal):
        met = value >= goal
        result["targets"].append({"name": name, "value": round(value, 4), "relation": ">=", "target": goal,
                                  "met": met})

    print(f"bench_seal on {label}, {os.cpu_count()} CPUs{' (--quick)' if args.quick else ''}")
    if "aead" not in args.skip:
        a = result["aead"] = aead_rates(keyring, PART, args.aead_seconds)
        print("(a) AES-256-GCM on 4 MiB parts, GB/s of plaintext")
        print(f"    {'':6} {'1 thread':>9} {'2 threads':>10}")
        for op in ("seal", "open"):
            print(f"    {op:6} {a[f'{op}_1t_GBps']:9.2f} {a[f'{op}_2t_GBps']:10.2f}")
        print(f"    the checksum a tag replaces: {a['checksum_GBps']:.2f} GB/s; a Python thread kept "
              f"{a['gil_released']:.0%} of its rate during opens (the GIL is "
              f"{'released' if a['gil_released'] > 0.25 else 'held'})")
        print(f"    a key per part (HKDF-SHA256 + AES key setup): {a['part_key_us']:.1f} us a part, "
              f"{a['part_key_share']:.2%} of the part's AES-GCM ({a['part_gcm_us']:.0f} us); seal GB/s "
              f"one fixed key {a['seal_fixed_key_GBps']:.2f} | a key per part {a['seal_per_part_key_GBps']:.2f} "
              f"(ratio {a['per_part_key_ratio']:.3f})")
    if "ssd" not in args.skip:
        s = result["ssd"] = ssd_ab(args, keyring, device)
        print(f"(b) SSD-only reload of {s['chunks']} chunks of {s['chunk_bytes'] / MiB:.0f} MiB ({args.model}), "
              f"{s['rounds']} rounds each, interleaved; {'O_DIRECT' if s['o_direct'] else 'buffered reads'}, "
              f"page cache dropped before each")
        print(f"    unsealed ({s['plain_backend']}, checksums): {s['plain_GBps']:.2f} GB/s; sealed "
              f"({s['sealed_backend']}): {s['sealed_GBps']:.2f} GB/s; ratio {s['ratio']:.2f} (per round "
              f"{', '.join(f'{r:.2f}' for r in s['round_ratios'])})")
        target("SSD-only reload sealed / unsealed", s["ratio"], SSD_TARGET)
    if "cluster" not in args.skip:
        c = result["cluster"] = cluster_ab(args)
        if "skipped" in c:
            print(f"(c) cluster get: not measured: {c['skipped']}")
        else:
            sealed = c["sealed"]
            print(f"(c) cluster tier: {sealed['rounds']} rounds x {sealed['batches']} batches x {sealed['batch']} objects "
                  f"of {sealed['object_bytes'] / MiB:.0f} MiB ({sealed['part_bytes'] / MiB:.0f} MiB parts), "
                  f"{args.master or 'local'} cluster, saria and Mooncake's batch calls interleaved; GB/s")
            print(f"    {'store':22} {'put':>6} {'Mooncake':>9} {'ratio':>6} {'get':>6} {'Mooncake':>9} {'ratio':>6}")
            for which in ("plain", "sealed"):
                if which in c:
                    r = c[which]
                    print(f"    {which + (' (keys)' if which == 'sealed' else ' (checksums)'):22} "
                          f"{r['put']['saria_GBps']:6.2f} {r['put']['mooncake_GBps']:9.2f} {r['put']['ratio']:6.2f} "
                          f"{r['get']['saria_GBps']:6.2f} {r['get']['mooncake_GBps']:9.2f} {r['get']['ratio']:6.2f}")
            target("cluster get sealed / Mooncake batch get", sealed["get"]["ratio"], CLUSTER_TARGET)
    for t in result["targets"]:
        print(f"target {t['name']} {t['relation']} {t['target']}: {t['value']:.3f} -> {'MET' if t['met'] else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
