#!/usr/bin/env python3
"""The layer-wise hot path against a late forward stream (issue 42): CUDA only.

vLLM runs its forward on a stream of its own, made current on the worker's thread (set here
first, as vLLM does), and calls saria's hooks from the host while the forward's kernels are still
queued. This delays that stream with ``torch.cuda._sleep`` before the hooks run, then drives
steps as vLLM would: per layer ``StepLoad.wait_layer`` then the forward's read of the reloaded
pages (a copy on the forward stream), the forward's write of the step's new KV into other pages,
then ``StepSave.save_layer``; then ``StepLoad.end`` / ``StepSave.end``, then their blocking ``finish``. Afterwards it
checks every byte: what the forward read of each layer is the reloaded object's bytes (a reload
not ordered before the read shows as the poison left in the pages), and every stored object holds
what the forward wrote (a save not ordered after the write shows as the pages' old bytes).

It also reports the host time of ``StepLoad.end`` and ``StepSave.end`` (what the per-step hooks
call; ``finish`` is their blocking form, for closing and benchmarks) while the forward stream is
still asleep: one that waits on the device shows as about the sleep's length.

    python bench/gpu_race.py [--rounds N] [--sleep-ms MS] [--layers L] [--json OUT]
    python bench/gpu_race.py --cpu-dry-run --rounds 2 --layers 4   # the script itself, without CUDA

Exit 1 when a byte differs; every target prints ``target <what>: <value> -> MET|MISSED``.
Without CUDA it refuses in one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

MiB = 1 << 20
END_TARGET_US = 1000.0  # no host wait: well under the forward stream's delay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--sleep-ms", type=float, default=50.0, help="how long the forward stream is held (default 50)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--chunks", type=int, default=4, help="objects reloaded and stored per step (default 4)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="check this script on a machine without CUDA: the same steps and byte checks on CPU "
                         "tensors, without a stream to delay (says nothing about races)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_race: needs CUDA (no CUDA device here); nothing run", file=sys.stderr)
        return 2

    from bench_layerwise import Rig
    from saria.kernels import pack_pages
    from saria.orders import DropOrder, StoreOrder, Tier

    cuda = not args.cpu_dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        forward = torch.cuda.Stream()
        torch.cuda.set_stream(forward)  # as vLLM's model runner does
        khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_980_000  # SM clock (H100 boost)
        cycles = int(args.sleep_ms * khz)  # ms x kHz
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    chunk_pages, chunks, layers = 32, args.chunks, args.layers
    n = chunks * chunk_pages
    page = 16 * 2 * 8 * 128 * 2
    rig = Rig(device, layers=layers, heads=8, head_dim=128, block=16, num_blocks=3 * n, chunk_pages=chunk_pages,
              pool_bytes=(2 * chunks + 2) * (-(-layers * chunk_pages * page // (4 * MiB)) * 4 * MiB),
              slot_bytes=4 * MiB)
    bad_reads = bad_stores = 0
    load_end, save_end, hooks = [], [], []
    try:
        names = rig.store(chunks)  # blocks [0, n): the sources of every reload
        sources = [c[:n].view(torch.uint8).clone() for c in rig.caches]
        load_at, store_at = n, 2 * n
        for r in range(args.rounds + 1):  # round 0 warms up (first launches, allocations)
            for c in rig.caches:  # poison the reload's target pages: a reload that did not land shows
                c[load_at:load_at + n].view(torch.uint8).fill_(0xA5)
            fresh = [torch.randn_like(c[store_at:store_at + n]) for c in rig.caches]  # this step's new KV
            sync()
            plan, blocks = rig.plan(names, load_at, plan_id=10 + r)
            orders = [StoreOrder(1000 + r * chunks + i, (f"r{r}.{i}",), (), 0) for i in range(chunks)]
            store_blocks = {o.kv[0]: list(range(store_at + i * chunk_pages, store_at + (i + 1) * chunk_pages))
                            for i, o in enumerate(orders)}
            if cuda:
                torch.cuda._sleep(cycles)  # the forward stream is late: everything after waits on it
            t0 = time.perf_counter()
            step = rig.engine.load_layers([(plan, blocks, 0)])
            save = rig.engine.store_layers(orders, store_blocks)
            reads = []
            for layer in range(layers):
                step.wait_layer(layer)
                reads.append(rig.caches[layer][load_at:load_at + n].view(torch.uint8).clone())  # the forward reads
                rig.caches[layer][store_at:store_at + n].copy_(fresh[layer])  # the forward writes
                save.save_layer(layer)
            t1 = time.perf_counter()
            step.end()  # what the per-step hooks call (get_finished, wait_for_save): never a wait on the device
            t2 = time.perf_counter()
            save.end()
            t3 = time.perf_counter()
            step.finish(timeout=60)  # now wait (this script checks the bytes): the blocking forms
            runs = save.finish(timeout=60)
            sync()
            deadline = time.monotonic() + 60
            for run in runs:
                try:
                    result = run.completion.result(timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:  # concurrent.futures' TimeoutError is this one from Python 3.11
                    print(f"gpu_race: order {run.order.order_id}'s completion not reported 60 s after the device "
                          "finished", file=sys.stderr)
                    bad_stores += 1
                    continue
                if not result.ok:
                    bad_stores += 1
            if r:
                hooks.append((t1 - t0) / layers)
                load_end.append(t2 - t1)
                save_end.append(t3 - t2)
            for layer, got in enumerate(reads):
                if not torch.equal(got, sources[layer]):
                    bad_reads += 1
            for i, o in enumerate(orders):
                obj = rig.engine.dram_object(o.kv[0])
                ids = torch.tensor(store_blocks[o.kv[0]])
                want = pack_pages(rig.engine.kv_table, ids).cpu()
                got = torch.cat([v.view(-1) for v in rig.engine.dram.views(obj)])[:want.numel()] if obj else None
                if got is None or not torch.equal(got.cpu(), want):
                    bad_stores += 1
            rig.engine.drop(DropOrder(5000 + r, tuple(o.kv[0] for o in orders), (), 0, Tier.DRAM))
    finally:
        rig.close()
    out = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (dry run)", "rounds": args.rounds,
           "sleep_ms": args.sleep_ms,
           "layers": layers, "chunks": chunks, "bad_layer_reads": bad_reads, "bad_stored_objects": bad_stores,
           "step_load_end_host_us_p50": statistics.median(load_end) * 1e6,
           "step_save_end_host_us_p50": statistics.median(save_end) * 1e6,
           "hooks_per_layer_host_us_p50": statistics.median(hooks) * 1e6}
    print(f"gpu_race on {out['device']}: {args.rounds} steps of {chunks} reloads and {chunks} stores x {layers} "
          f"layers, "
          f"the forward stream held {args.sleep_ms:g} ms before the hooks; layer reads wrong: {bad_reads}, "
          f"stored objects wrong: {bad_stores}")
    print(f"host time: StepLoad.end {out['step_load_end_host_us_p50']:.0f} us, StepSave.end "
          f"{out['step_save_end_host_us_p50']:.0f} us p50 (a wait on the device would be ~{args.sleep_ms:g} ms); "
          f"the hooks per layer (wait_layer + save_layer) {out['hooks_per_layer_host_us_p50']:.1f} us")
    for key in ("step_load_end_host_us_p50", "step_save_end_host_us_p50"):
        v = out[key]
        print(f"target {key} <= {END_TARGET_US:g}: {v:.0f} -> {'MET' if v <= END_TARGET_US else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if bad_reads or bad_stores:
        print("gpu_race: FAILED: bytes differ (a copy not ordered against the forward stream)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
