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

``--mode sealed`` measures a sealed store (a key file made for the run, objects named by chunk
ids, every part and metadata sealed with AES-256-GCM: no checksum, the tag is the check) against
the same Mooncake calls: "cluster get with keys / Mooncake batch get", target >= 0.80 (issue 33);
``--mode both`` (the default) runs the plain store, then the sealed one, on one cluster. Also the
host's AES-256-GCM open rate. From Python (``bench/bench_seal.py`` does)::

    from bench.bench_cluster import measure     # or with bench/ on sys.path: from bench_cluster import measure
    result = measure(sealed=True, quick=True)   # -> {"get": {"ratio": ...}, "put": {...}, ...}

    python bench/bench_cluster.py                        # 16 MiB objects, batches of 8, 5 rounds
    python bench/bench_cluster.py --quick                # a smoke run (seconds)
    python bench/bench_cluster.py --mode sealed          # the sealed store only
    python bench/bench_cluster.py --master 10.0.0.1:50051 --hostname 10.0.0.2   # a real cluster
"""

from __future__ import annotations

import argparse
import json
import os
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
from saria.seal import Keyring, PartContext, Sealer, new_key_file  # noqa: E402

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
    p.add_argument("--mode", choices=("plain", "sealed", "both"), default="both",
                   help="the plain store, the sealed one (a key file made for the run), or both (default)")
    p.add_argument("--quick", action="store_true", help="4 MiB objects, batches of 4, 2 rounds: a smoke run")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    return _quick(args) if args.quick else args


def _quick(args: argparse.Namespace) -> argparse.Namespace:
    args.object_mib, args.slot_mib, args.batch, args.batches, args.rounds = 4, 1, 4, 2, 2
    args.node_mib = min(args.node_mib, 256)
    return args


class Bench:
    """Both paths over one host pool: ``src`` slots hold one batch of objects, ``dst`` slots take it back."""

    def __init__(self, args: argparse.Namespace, master: str, sealer: Sealer | None = None,
                 node_pid: int | None = None):
        self.args = args
        self.sealer = sealer
        self.node_pid = node_pid  # the local storage node, whose CPU time counts too
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
        self.store = ClusterStore(master, "bench", self.pool, local_hostname=args.hostname, timeout_s=60.0,
                                  sealer=sealer)
        if not self.store.on:
            raise SystemExit(f"the master {master} is not reachable")
        self.raw = import_store_class()()
        if self.raw.setup(args.hostname, "P2PHANDSHAKE", 0, LOCAL_BUFFER_BYTES, "tcp", "", master) != 0:
            raise SystemExit("Mooncake client setup failed")
        for ptr, n in memory_ranges(self.pool):
            assert self.raw.register_buffer(ptr, n) == 0

    def _keys(self, r: int, b: int) -> list[bytes]:
        if self.sealer is None:
            return [object_key(f"bench-{r}-{b}-{i}", "kv") for i in range(self.args.batch)]
        keyring = self.sealer.keyring  # named as the connector names them with a key: chunk ids
        hashes = [f"bench-{r}-{b}-{i}".encode() for i in range(self.args.batch)]
        return [object_key(c, "kv") for c in keyring.chunk_ids(keyring.tenant("bench"), b"bench", hashes)]

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
        cpu = dict.fromkeys(seconds, 0.0)
        for r in range(self.args.rounds):
            order = ("saria", "mooncake") if r % 2 == 0 else ("mooncake", "saria")
            for op in ("put", "get"):
                for who in order:
                    c0 = self._cpu()
                    seconds[who, op] += getattr(self, who)(r, op)
                    cpu[who, op] += self._cpu() - c0
            for views_in, views_out in zip(self.src, self.dst):
                if not all(torch.equal(a, b) for a, b in zip(views_in, views_out)):
                    raise RuntimeError("bytes read back differ from the bytes written")
            self.clean(r)
        nbytes = self.args.rounds * self.args.batches * self.args.batch * self.obj
        out = {"sealed": self.sealer is not None, "object_bytes": self.obj, "part_bytes": self.pool.slot_bytes,
               "batch": self.args.batch, "batches": self.args.batches, "rounds": self.args.rounds,
               "bytes_per_path": nbytes}
        for op in ("put", "get"):
            s, m = (nbytes / seconds["saria", op] / 1e9, nbytes / seconds["mooncake", op] / 1e9)
            out[op] = {"saria_GBps": s, "mooncake_GBps": m, "ratio": s / m,
                       "saria_cpu_s_per_GB": cpu["saria", op] / nbytes * 1e9,
                       "mooncake_cpu_s_per_GB": cpu["mooncake", op] / nbytes * 1e9}
        t0 = time.perf_counter()
        for views in self.dst:
            for v in views:
                checksum(v)
        out["checksum_GBps"] = self.args.batch * self.obj / (time.perf_counter() - t0) / 1e9
        if self.sealer is not None:
            out["open_GBps"] = self._open_rate()
        out["counters"] = self.store.counters()
        return out

    def _cpu(self) -> float:
        """CPU seconds of this process (every thread) and of the local storage node so far."""
        total = time.process_time()
        if self.node_pid is not None:
            try:
                with open(f"/proc/{self.node_pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _open_rate(self) -> float:
        """AES-256-GCM open (verify and decrypt) on one thread, part by part, as a sealed get does."""
        v = self.src[0][0]
        n = v.numel()
        ctx = PartContext(b"bench", 0, 1, n, n)
        sealed_buf = torch.empty(n + 16, dtype=torch.uint8)
        sealed = self.sealer.seal_into(ctx, v.numpy(), sealed_buf.numpy())
        out = torch.empty(n, dtype=torch.uint8)
        reps = max(1, (self.args.batch * self.obj) // n)
        t0 = time.perf_counter()
        for _ in range(reps):
            self.sealer.open_into(ctx, sealed, sealed_buf.numpy(), out.numpy())
        return reps * n / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.store.close()
        self.raw.close()
        self.pool.close()


def _sealer(keydir: str) -> Sealer:
    path = os.path.join(keydir, "bench.key")
    new_key_file(path)
    return Sealer(Keyring.load(path), "cluster", "bench")


def _bench(args: argparse.Namespace, master: str, sealed: bool, keydir: str, node_pid: int | None) -> dict:
    bench = Bench(args, master, _sealer(keydir) if sealed else None, node_pid)
    try:
        return bench.run()
    finally:
        bench.close()


def _run(args: argparse.Namespace, modes: tuple[bool, ...]) -> dict[bool, dict]:
    """Each mode's result (``True``: sealed), on ``args.master`` or a local cluster started for them."""
    with tempfile.TemporaryDirectory(prefix="saria-bench-cluster-") as tmp:
        local = None if args.master else LocalCluster(tmp, args.node_mib * MiB).start()
        try:
            node = local.node_proc.pid if local is not None else None
            return {sealed: _bench(args, args.master or local.master, sealed, tmp, node) for sealed in modes}
        finally:
            if local is not None:
                local.stop()


def measure(*, sealed: bool = True, quick: bool = False, master: str | None = None, hostname: str = "127.0.0.1",
            node_mib: int = 1024, object_mib: int = 16, slot_mib: int = 4, batch: int = 8, batches: int = 2,
            rounds: int = 5) -> dict:
    """Run the bench for one store (``sealed``: with a key file made for the run, else plain) and
    return its result: ``{"sealed", "put": {"saria_GBps", "mooncake_GBps", "ratio"}, "get": {...},
    "checksum_GBps", "open_GBps" (sealed), "counters", sizes...}``; ``result["get"]["ratio"]`` is
    "cluster get with keys / Mooncake batch get" when sealed (target :data:`TARGET`). Without
    ``master`` it starts a master and a storage node of ``node_mib`` here (stopped after);
    ``quick``: the ``--quick`` sizes (a smoke run of seconds)."""
    args = argparse.Namespace(master=master, hostname=hostname, node_mib=node_mib, object_mib=object_mib,
                              slot_mib=slot_mib, batch=batch, batches=batches, rounds=rounds, mode=None, json=None)
    return _run(_quick(args) if quick else args, (sealed,))[sealed]


def report(result: dict) -> bool:
    """Print one mode's table and targets; whether both targets were met."""
    what = "sealed store (keys)" if result["sealed"] else "plain store"
    print(f"{what}: {'op':4} {'saria GB/s':>11} {'Mooncake GB/s':>14} {'ratio':>6}   (CPU: this process and a "
          "local storage node, per GB moved: saria vs Mooncake)")
    for op in ("put", "get"):
        r = result[op]
        print(f"{what}: {op:4} {r['saria_GBps']:11.2f} {r['mooncake_GBps']:14.2f} {r['ratio']:6.2f}   CPU s/GB "
              f"{r['saria_cpu_s_per_GB']:.2f} vs {r['mooncake_cpu_s_per_GB']:.2f}")
    if result["sealed"]:
        print(f"AES-256-GCM open on this host: {result['open_GBps']:.2f} GB/s on one thread (the tag replaces the "
              "checksum: nothing else is computed over the bytes)")
    else:
        verify = result["checksum_GBps"]
        bound = 1 / (1 / result["get"]["mooncake_GBps"] + 1 / verify)
        print(f"checksum on this host: {verify:.2f} GB/s; a get verifies every byte, so where the verification "
              f"cannot overlap the transfer (no spare core) a get is bound by {bound:.2f} GB/s "
              f"({bound / result['get']['mooncake_GBps']:.2f} of Mooncake's own)")
    met = True
    for op in ("put", "get"):
        ok = result[op]["ratio"] >= TARGET
        met &= ok
        label = f"{op} (sealed)" if result["sealed"] else op
        print(f"target {label} >= {TARGET:.2f} of Mooncake's own: {result[op]['ratio']:.2f} -> {'MET' if ok else 'MISSED'}")
    return met


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = {"plain": (False,), "sealed": (True,), "both": (False, True)}[args.mode]
    results = _run(args, modes)
    print(f"{args.rounds} rounds x {args.batches} batches x {args.batch} objects of {args.object_mib} MiB "
          f"({args.slot_mib} MiB parts), {args.master or 'local'} cluster")
    for sealed in modes:
        report(results[sealed])
    if args.json:
        doc = results[modes[0]] if len(modes) == 1 else {"plain": results[False], "sealed": results[True]}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
