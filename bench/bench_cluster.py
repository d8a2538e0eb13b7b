#!/usr/bin/env python3
"""The cluster store's put and get against Mooncake's own batch calls, on the same objects and buffers.

Objects of ``--object-mib`` (host pool slots of ``--slot-mib``: one Mooncake key per slot) in
batches of ``--batch``, ``--batches`` batches per phase, one batch at a time. Each round runs, on
fresh keys and alternating which goes first:

* saria: ``ClusterStore.put_many`` (checksums given, as the engine has them from packing) and
  ``get_many`` (metadata fetched, every part's length and checksum verified);
* Mooncake: ``batch_put_from`` / ``batch_get_into`` of the same slots, one key per slot, nothing
  verified;

and both remove their objects after it. Reported: GB/s per path (bytes over time summed over
rounds) and saria's ratio to Mooncake's own; the target is >= 0.80 for put and get. Also the
host's checksum rate, which bounds a get where verification cannot overlap the transfer. Without
``--master`` it starts a master and one storage node of ``--node-mib`` on this host.

    python bench/bench_cluster.py                        # 16 MiB objects, batches of 8, 5 rounds
    python bench/bench_cluster.py --quick                # a smoke run (seconds)
    python bench/bench_cluster.py --master 10.0.0.1:50051 --hostname 10.0.0.2   # a real cluster
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from saria.dataplane.cluster import ClusterStore  # noqa: E402
from saria.dataplane.cluster.connection import LOCAL_BUFFER_BYTES, import_store_class  # noqa: E402
from saria.dataplane.cluster.local import LocalCluster  # noqa: E402
from saria.dataplane.cluster.memory import memory_ranges  # noqa: E402
from saria.dataplane.dram.host_pool import HostPool  # noqa: E402
from saria.dataplane.ssd.keys import object_key  # noqa: E402
from saria.kernels.checksum import checksum  # noqa: E402

MiB = 1 << 20
TARGET = 0.80


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--master", help="a running master's host:port (default: start one and a storage node here)")
    p.add_argument("--hostname", default="127.0.0.1", help="this host's address as the storage nodes reach it")
    p.add_argument("--node-mib", type=int, default=1024, help="pool memory of the local storage node (default 1024)")
    p.add_argument("--object-mib", type=int, default=16, help="object size (default 16)")
    p.add_argument("--slot-mib", type=int, default=4, help="host pool slot = part size (default 4)")
    p.add_argument("--batch", type=int, default=8, help="objects per batch (default 8)")
    p.add_argument("--batches", type=int, default=2, help="batches per phase and round (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    p.add_argument("--quick", action="store_true", help="4 MiB objects, batches of 4, 2 rounds: a smoke run")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.object_mib, args.slot_mib, args.batch, args.batches, args.rounds = 4, 1, 4, 2, 2
        args.node_mib = min(args.node_mib, 256)
    return args


class Bench:
    """Both paths over one host pool: ``src`` slots hold one batch of objects, ``dst`` slots take it back."""

    def __init__(self, args: argparse.Namespace, master: str):
        self.args = args
        self.obj = args.object_mib * MiB
        self.pool = HostPool(2 * args.batch * self.obj, slot_bytes=args.slot_mib * MiB)
        per = self.pool.slots_for(self.obj)
        self.src = [self.pool.views(self.pool.allocate(per), self.obj) for _ in range(args.batch)]
        self.dst = [self.pool.views(self.pool.allocate(per), self.obj) for _ in range(args.batch)]
        g = torch.Generator().manual_seed(7)
        for views in self.src:
            for v in views:
                v.copy_(torch.randint(0, 256, (v.numel(),), generator=g, dtype=torch.uint8))
        self.sums = [[checksum(v) for v in views] for views in self.src]
        self.store = ClusterStore(master, "bench", self.pool, local_hostname=args.hostname, timeout_s=60.0)
        if not self.store.on:
            raise SystemExit(f"the master {master} is not reachable")
        self.raw = import_store_class()()
        if self.raw.setup(args.hostname, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, "tcp", "", master) != 0:
            raise SystemExit("Mooncake client setup failed")
        for ptr, n in memory_ranges(self.pool):
            assert self.raw.register_buffer(ptr, n) == 0

    def _keys(self, r: int, b: int) -> list[bytes]:
        return [object_key(f"bench-{r}-{b}-{i}", "kv") for i in range(self.args.batch)]

    def _raw_keys(self, r: int, b: int) -> list[str]:
        return [f"bench-raw/{r}/{b}/{i}/{j}" for i in range(self.args.batch) for j in range(len(self.src[0]))]

    def _flat(self, objects):
        views = [v for views in objects for v in views]
        return [v.data_ptr() for v in views], [v.numel() for v in views]

    def saria(self, r: int, op: str) -> float:
        t0 = time.perf_counter()
        for b in range(self.args.batches):
            if op == "put":
                futures = self.store.put_many(self._keys(r, b), self.src, self.sums)
            else:
                futures = self.store.get_many(self._keys(r, b), self.dst)
            for f in futures:
                f.result()  # a miss raises: the bench needs every object
        return time.perf_counter() - t0

    def mooncake(self, r: int, op: str) -> float:
        t0 = time.perf_counter()
        for b in range(self.args.batches):
            keys = self._raw_keys(r, b)
            if op == "put":
                ptrs, sizes = self._flat(self.src)
                codes = self.raw.batch_put_from(keys, ptrs, sizes)
                ok = all(c == 0 for c in codes)
            else:
                ptrs, sizes = self._flat(self.dst)
                codes = self.raw.batch_get_into(keys, ptrs, sizes)
                ok = list(codes) == sizes
            if not ok:
                raise RuntimeError(f"Mooncake {op} failed: {list(codes)}")
        return time.perf_counter() - t0

    def clean(self, r: int) -> None:
        self.store.remove_many([k for b in range(self.args.batches) for k in self._keys(r, b)])
        self.raw.batch_remove([k for b in range(self.args.batches) for k in self._raw_keys(r, b)], True)

    def run(self) -> dict:
        seconds = {(who, op): 0.0 for who in ("saria", "mooncake") for op in ("put", "get")}
        for r in range(self.args.rounds):
            order = ("saria", "mooncake") if r % 2 == 0 else ("mooncake", "saria")
            for op in ("put", "get"):
                for who in order:
                    seconds[who, op] += getattr(self, who)(r, op)
            for views_in, views_out in zip(self.src, self.dst):
                if not all(torch.equal(a, b) for a, b in zip(views_in, views_out)):
                    raise RuntimeError("bytes read back differ from the bytes written")
            self.clean(r)
        nbytes = self.args.rounds * self.args.batches * self.args.batch * self.obj
        out = {"object_bytes": self.obj, "part_bytes": self.pool.slot_bytes, "batch": self.args.batch,
               "batches": self.args.batches, "rounds": self.args.rounds, "bytes_per_path": nbytes}
        for op in ("put", "get"):
            s, m = (nbytes / seconds["saria", op] / 1e9, nbytes / seconds["mooncake", op] / 1e9)
            out[op] = {"saria_GBps": s, "mooncake_GBps": m, "ratio": s / m}
        t0 = time.perf_counter()
        for views in self.dst:
            for v in views:
                checksum(v)
        out["checksum_GBps"] = self.args.batch * self.obj / (time.perf_counter() - t0) / 1e9
        out["counters"] = self.store.counters()
        return out

    def close(self) -> None:
        self.store.close()
        self.raw.close()
        self.pool.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="saria-bench-cluster-") as tmp:
        local = None if args.master else LocalCluster(tmp, args.node_mib * MiB).start()
        try:
            bench = Bench(args, args.master or local.master)
            try:
                result = bench.run()
            finally:
                bench.close()
        finally:
            if local is not None:
                local.stop()
    print(f"{args.rounds} rounds x {args.batches} batches x {args.batch} objects of {args.object_mib} MiB "
          f"({args.slot_mib} MiB parts), {'local' if local else args.master} cluster")
    print(f"{'op':4} {'saria GB/s':>11} {'Mooncake GB/s':>14} {'ratio':>6}")
    met = True
    for op in ("put", "get"):
        r = result[op]
        print(f"{op:4} {r['saria_GBps']:11.2f} {r['mooncake_GBps']:14.2f} {r['ratio']:6.2f}")
    verify = result["checksum_GBps"]
    bound = 1 / (1 / result["get"]["mooncake_GBps"] + 1 / verify)
    print(f"checksum on this host: {verify:.2f} GB/s; a get verifies every byte, so where the verification "
          f"cannot overlap the transfer (no spare core) a get is bound by {bound:.2f} GB/s "
          f"({bound / result['get']['mooncake_GBps']:.2f} of Mooncake's own)")
    for op in ("put", "get"):
        ok = result[op]["ratio"] >= TARGET
        met &= ok
        print(f"target {op} >= {TARGET:.2f} of Mooncake's own: {result[op]['ratio']:.2f} -> {'MET' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
