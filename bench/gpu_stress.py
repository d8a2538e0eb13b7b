#!/usr/bin/env python3
"""Reload stress: many reloads of random sizes, DRAM and SSD mixed, every byte and checksum checked.

The first H200 run logged checksum failures on SSD reloads; this is the run that says whether
healthy objects can ever fail their checksum, or come back with wrong bytes, on a real device with
real streams. Round after round, until ``--seconds`` (or ``--rounds``) are spent:

* fresh random bytes are written into a region of source pages (two regions, used in turn, so a
  round's sources stay intact while the next round is staged), and its chunks are stored into
  host-pool slots or written through to the SSD store, with a GDN-like state object (padded pages)
  in DRAM or on SSD about half the time;
* now and then one SSD object's payload is corrupted on disk (a flipped byte): exactly that
  object must fail its checksum and the others must not;
* 1-3 reloads are submitted at once into distinct target pages, each a random mix of DRAM and SSD
  chunks with random skipped leading pages, batch size, serial or parallel plan and coordinator
  mode; the NEXT round's stores and writes are issued while they are in flight (packs on the
  offload stream beside unpacks on the reload streams, staging memory reused all the while);
* every delivered object is compared with its source: the pages byte for byte, and the checksum
  of the packed target pages against the checksum of the packed source pages; every object that
  failed must be one that was corrupted; every skipped page must be untouched;
* everything is dropped at the end of a round and the host pool must be whole again.

Exit status 0 only when no healthy object failed, no byte differed and every corruption was
caught. ``--json`` prints a summary as the last line. On a machine without CUDA the same engine
runs on CPU tensors (small sizes by default): it checks the logic, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from saria.config import Bandwidths  # noqa: E402
from saria.control import DropOrder, ObjectKey, ReloadPlan, StoreOrder, Tier, WriteOrder  # noqa: E402
from saria.dataplane import Coordinator, HostPool, SSDStore, TransferEngine, object_key  # noqa: E402
from saria.kernels import PageTable, checksum, pack_pages  # noqa: E402

MARK = 0xA5  # what target pages hold before a reload: skipped and failed pages must keep it


class Geometry:
    def __init__(self, gpu: bool, layers: int | None, max_chunks: int):
        # GPU: 8 layers of [NB, 16, 2, 8, 128] bf16 (64 KiB a layer page), 32 pages a chunk (16 MiB
        # objects, four 4 MiB parts). CPU: 2 layers of [NB, 4, 2, 2, 8], 2 pages a chunk, 4 KiB parts.
        self.layers = layers or (8 if gpu else 2)
        self.block, self.heads, self.dim = (16, 8, 128) if gpu else (4, 2, 8)
        self.pages = 32 if gpu else 2
        self.slot = (4 << 20) if gpu else 4096
        self.max_chunks = max_chunks
        self.plans = 3
        self.state_stride, self.state_used = (256 << 10, 200_000) if gpu else (1024, 700)


class Rig:
    def __init__(self, g: Geometry, device: torch.device, root: Path):
        self.g, self.device = g, device
        region = g.max_chunks * g.pages
        self.src_base = [0, region]
        self.dst_base = [2 * region + k * region for k in range(g.plans)]
        nb = (2 + g.plans) * region
        self.caches = [torch.empty(nb, g.block, 2, g.heads, g.dim, dtype=torch.bfloat16, device=device)
                       for _ in range(g.layers)]
        raw = torch.zeros(4 + g.plans, g.state_stride, dtype=torch.int8, device=device)
        self.state = [raw.as_strided((raw.shape[0], g.state_used), (g.state_stride, 1))]
        self.kv_table, self.state_table = PageTable(self.caches), PageTable(self.state)
        kv_bytes = self.kv_table.staging_bytes(g.pages)
        slots = 2 * (g.max_chunks + 1) * -(-max(kv_bytes, g.state_used) // g.slot)
        self.pool = HostPool((slots + 8) * g.slot, g.slot)
        root.mkdir(parents=True, exist_ok=True)
        self.store = SSDStore([root], 4096 + (slots + 8) * (4096 + g.slot), g.slot)
        self.coordinator = Coordinator(Bandwidths())
        self.engine = TransferEngine(self.kv_table, host_pool=self.pool, coordinator=self.coordinator,
                                     pages_per_chunk=g.pages, ssd=self.store, state_table=self.state_table)

    def close(self):
        self.engine.close()
        self.store.close()
        self.pool.close()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


class Round:
    """One round's objects: chunks with their tiers and source pages, an optional state object."""

    def __init__(self, rig: Rig, number: int, rnd: random.Random, gen: torch.Generator):
        g = rig.g
        self.number = number
        self.side = number % 2
        self.n = rnd.randint(1, g.max_chunks)
        self.chunks = [f"r{number}c{i}" for i in range(self.n)]
        self.tiers = [rnd.choice([Tier.DRAM, Tier.SSD]) for _ in range(self.n)]
        base = rig.src_base[self.side]
        self.src = {c: list(range(base + i * g.pages, base + (i + 1) * g.pages)) for i, c in enumerate(self.chunks)}
        self.state_tier = rnd.choice([None, Tier.DRAM, Tier.SSD])
        self.state_src = self.side  # state pages 0 and 1 are the two sides' sources
        lo, hi = base, base + self.n * g.pages
        for t in rig.caches:  # fresh bytes for this round's sources (every bit pattern, NaNs included)
            region = t[lo:hi].view(torch.int16)
            region.copy_(torch.randint(-(1 << 15), 1 << 15, region.shape, dtype=torch.int16, device=rig.device,
                                       generator=gen))
        rig.state[0][self.state_src] = torch.randint(-128, 128, (g.state_used,), dtype=torch.int8,
                                                      device=rig.device, generator=gen)

    def stage(self, rig: Rig, order_ids) -> list:
        dram = tuple(c for c, t in zip(self.chunks, self.tiers) if t is Tier.DRAM)
        ssd = tuple(c for c, t in zip(self.chunks, self.tiers) if t is Tier.SSD)
        state = self.chunks[-1]
        orders = [StoreOrder(next(order_ids), dram, (state,) if self.state_tier is Tier.DRAM else (), 0),
                  WriteOrder(next(order_ids), ssd, (state,) if self.state_tier is Tier.SSD else (), 0, Tier.GPU,
                             "write-through")]
        return rig.engine.execute(orders, self.src, {state: [self.state_src]})

    def drop(self, rig: Rig, order_ids) -> None:
        state = (self.chunks[-1],)
        rig.engine.drop(DropOrder(next(order_ids), tuple(self.chunks), state, 0, Tier.DRAM))
        rig.engine.drop(DropOrder(next(order_ids), tuple(self.chunks), state, 0, Tier.SSD))


def packed(table: PageTable, ids) -> torch.Tensor:
    return pack_pages(table, torch.tensor(ids))


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    g = Geometry(gpu, args.layers, args.max_chunks or (8 if gpu else 3))
    rnd = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    order_ids = iter(range(1, 1 << 62))
    tmp = tempfile.TemporaryDirectory(prefix="saria-stress-") if args.ssd_dir is None else None
    root = Path(args.ssd_dir or tmp.name) / "stress"
    rig = Rig(g, device, root)
    stats = {"device": device.type, "rounds": 0, "reloads": 0, "objects": 0, "bytes": 0, "ssd_objects": 0,
             "dram_objects": 0, "state_objects": 0, "injected": 0, "injected_caught": 0, "healthy_failed": 0,
             "byte_mismatches": 0, "checksum_mismatches": 0, "touched_skipped_pages": 0, "slot_leaks": 0}
    problems: list[str] = []
    deadline = time.monotonic() + args.seconds
    try:
        current = Round(rig, 0, rnd, gen)
        runs = current.stage(rig, order_ids)
        while True:
            for r in runs:  # this round's objects are in their tiers
                if not r.completion.result().ok:
                    raise SystemExit(f"staging round {current.number} failed: {r.completion.result()}")
            corrupted = set()
            ssd_chunks = [c for c, t in zip(current.chunks, current.tiers) if t is Tier.SSD]
            if ssd_chunks and rnd.random() < args.corrupt:
                victim = rnd.choice(ssd_chunks)
                path, offset, length = rnd.choice(rig.store.part_extents(object_key(victim, "kv")))
                flip_byte(path, offset + rnd.randrange(length))
                corrupted.add(ObjectKey(victim, "kv"))
            # 1-3 reloads at once, each a random slice of the round's chunks into its own pages.
            jobs = []
            for k in range(rnd.randint(1, g.plans)):
                start = rnd.randrange(current.n)
                stop = rnd.randint(start + 1, current.n)
                idx = list(range(start, stop))
                with_state = current.state_tier is not None and stop == current.n and rnd.random() < 0.7
                dst = [list(range(rig.dst_base[k] + j * g.pages, rig.dst_base[k] + (j + 1) * g.pages))
                       for j in range(len(idx))]
                for t in rig.caches:
                    t[rig.dst_base[k]:rig.dst_base[k] + len(idx) * g.pages].view(torch.uint8).fill_(MARK)
                state_dst = 4 + k
                rig.state[0][state_dst].view(torch.uint8).fill_(MARK)
                skip = rnd.randrange(g.pages)
                rig.engine.batch_bytes = rnd.choice([1, rig.engine.kv_bytes * 2, 1 << 30])
                rig.coordinator.mode = rnd.choice(Coordinator.MODES)
                plan = ReloadPlan(next(order_ids), tuple(current.chunks[i] for i in idx),
                                  tuple(current.tiers[i] for i in idx), current.chunks[-1] if with_state else None,
                                  current.state_tier if with_state else None, len(idx) * 16, 0, 0,
                                  rnd.random() < 0.3)
                job = rig.engine.load(plan, dst, [state_dst] if with_state else None, skip_pages=skip)
                jobs.append((job, idx, dst, skip, with_state, state_dst))
            # The next round is staged while these reloads run.
            nxt = Round(rig, current.number + 1, rnd, gen)
            next_runs = nxt.stage(rig, order_ids)
            for job, idx, dst, skip, with_state, state_dst in jobs:
                result = job.wait(timeout=120)
                failed = set(result.failed)
                stats["reloads"] += 1
                for key in failed - corrupted:
                    stats["healthy_failed"] += 1
                    problems.append(f"round {current.number}: healthy {key} failed")
                for j, i in enumerate(idx):
                    chunk = current.chunks[i]
                    key = ObjectKey(chunk, "kv")
                    lo = skip if j == 0 else 0
                    if key in corrupted:
                        stats["injected"] += 1
                        if key in failed:
                            stats["injected_caught"] += 1
                        else:
                            problems.append(f"round {current.number}: corrupted {key} was delivered")
                    if key in failed:  # nothing of it may have been written
                        if not bool((packed(rig.kv_table, dst[j]) == MARK).all()):
                            stats["touched_skipped_pages"] += 1
                            problems.append(f"round {current.number}: pages of failed {key} were written")
                        continue
                    want, got = packed(rig.kv_table, current.src[chunk][lo:]), packed(rig.kv_table, dst[j][lo:])
                    stats["objects"] += 1
                    stats["bytes"] += got.numel()
                    stats["ssd_objects" if current.tiers[i] is Tier.SSD else "dram_objects"] += 1
                    if not torch.equal(want, got):
                        stats["byte_mismatches"] += 1
                        problems.append(f"round {current.number}: {key} differs from its source")
                    if checksum(want) != checksum(got):
                        stats["checksum_mismatches"] += 1
                        problems.append(f"round {current.number}: {key} checksum differs from its source's")
                    if lo and not bool((packed(rig.kv_table, dst[j][:lo]) == MARK).all()):
                        stats["touched_skipped_pages"] += 1
                        problems.append(f"round {current.number}: skipped pages of {key} were written")
                if with_state and ObjectKey(current.chunks[-1], "state") not in failed:
                    stats["state_objects"] += 1
                    if not torch.equal(rig.state[0][state_dst], rig.state[0][current.state_src]):
                        stats["byte_mismatches"] += 1
                        problems.append(f"round {current.number}: state object differs from its source")
            current.drop(rig, order_ids)
            stats["rounds"] += 1
            for r in next_runs:
                r.completion.result()
            if rig.pool.used_slots != rig.engine.dram.held_slots():
                stats["slot_leaks"] += 1
                problems.append(f"round {current.number}: {rig.pool.used_slots} slots used, "
                                f"{rig.engine.dram.held_slots()} owned by DRAM objects")
            current, runs = nxt, next_runs
            done = stats["rounds"] >= args.rounds if args.rounds else time.monotonic() >= deadline
            if done or len(problems) > 20:
                break
        current.drop(rig, order_ids)
        if rig.pool.used_slots:
            stats["slot_leaks"] += 1
            problems.append(f"{rig.pool.used_slots} slots still used after everything was dropped")
    finally:
        rig.close()
        if tmp is not None:
            tmp.cleanup()
    stats["problems"] = problems[:20]
    stats["ok"] = not problems and stats["injected_caught"] == stats["injected"]
    return stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="run this long (default 30)")
    parser.add_argument("--rounds", type=int, default=0, help="run this many rounds instead of --seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=None, help="KV layers (default 8 on a GPU, 2 on CPU)")
    parser.add_argument("--max-chunks", type=int, default=None, help="chunks per round (default 8 on a GPU, 3 on CPU)")
    parser.add_argument("--corrupt", type=float, default=0.3, help="chance a round corrupts one SSD object (0.3)")
    parser.add_argument("--ssd-dir", default=None, help="directory on the SSD under test (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rounds < 0 or not 0 <= args.corrupt <= 1:
        parser.error("--seconds must be > 0, --rounds >= 0, --corrupt in [0, 1]")
    t0 = time.perf_counter()
    stats = run(args)
    seconds = time.perf_counter() - t0
    print(f"stress on {stats['device']}: {stats['rounds']} rounds, {stats['reloads']} reloads, {stats['objects']} objects "
          f"delivered ({stats['dram_objects']} DRAM, {stats['ssd_objects']} SSD, {stats['state_objects']} state), "
          f"{stats['bytes'] / 1e9:.2f} GB compared, in {seconds:.0f} s")
    print(f"  healthy objects failed: {stats['healthy_failed']}; byte mismatches: {stats['byte_mismatches']}; "
          f"checksum mismatches: {stats['checksum_mismatches']}; skipped pages written: "
          f"{stats['touched_skipped_pages']}; slot leaks: {stats['slot_leaks']}")
    print(f"  corruptions injected: {stats['injected']}, caught: {stats['injected_caught']}")
    for p in stats["problems"]:
        print(f"  PROBLEM: {p}")
    print(f"stress: {'PASS' if stats['ok'] else 'FAIL'}")
    if args.json:
        print(json.dumps(stats))
    return 0 if stats["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
