"""Several threads plan, commit, release and complete on one control plane at once."""

from __future__ import annotations

import random
import threading

from control_cases import HYBRID, config

from saria.control import ControlPlane, DropOrder, Tier

THREADS = 4
REQUESTS = 150


def worker(cp: ControlPlane, seed: int, clock: list, committed: list, errors: list) -> None:
    rng = random.Random(seed)
    pending = []
    try:
        for _ in range(REQUESTS):
            fam, length = rng.randrange(6), rng.randrange(1, 14)
            hashes = [(fam, j) for j in range(length)]
            now = clock[0] + rng.random()  # threads' clocks interleave out of order: the plane clamps
            plan = cp.plan(hashes, now)
            assert plan.chunk_hashes == tuple(hashes[:plan.num_chunks])
            for h, source in zip(plan.chunk_hashes, plan.kv_sources):  # pinned: still there
                kv = cp.chunk_info(h).kv
                assert (kv.dram in ("ready", "draining")) if source is Tier.DRAM else (kv.ssd in ("ready", "bad"))
            if rng.random() < 0.15:
                pending += cp.release(plan, now)
                continue
            failed = [plan.chunk_hashes[plan.kv_sources.index(Tier.SSD)]] \
                if Tier.SSD in plan.kv_sources and rng.random() < 0.1 else []
            pending += cp.commit_prefill(hashes, now, plan, failed=failed)
            committed.append(len(hashes))
            clock[0] += 1.0
            while pending and rng.random() < 0.8:
                order = pending.pop(rng.randrange(len(pending)))
                if not isinstance(order, DropOrder):
                    pending += cp.complete(order.order_id, rng.random() < 0.9, now)
        for order in pending:
            if not isinstance(order, DropOrder):
                cp.complete(order.order_id, True, clock[0])
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def auditor(cp: ControlPlane, stop: threading.Event, problems: list) -> None:
    while not stop.is_set():
        problems += cp.audit()
        c = cp.counters()
        if c.hits + c.misses != c.references:
            problems.append(f"counters do not add up: {c}")


def run_threads(cp: ControlPlane) -> list:
    clock, committed, errors, problems = [0.0], [], [], []
    stop = threading.Event()
    watcher = threading.Thread(target=auditor, args=(cp, stop, problems))
    workers = [threading.Thread(target=worker, args=(cp, seed, clock, committed, errors)) for seed in range(THREADS)]
    watcher.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=120)
    stop.set()
    watcher.join(timeout=120)
    assert not any(t.is_alive() for t in workers + [watcher]), "deadlock"
    assert not errors, errors
    assert not problems, problems[:5]
    return committed


def test_threads_share_one_control_plane():
    cp = ControlPlane(config("saria", dram_chunks=12, ssd_chunks=40, prewrite_depth=4))
    committed = run_threads(cp)
    c = cp.counters()
    assert c.references == sum(committed) and c.requests == len(committed)
    assert c.hits_dram_chunks > 0 and c.hits_ssd_chunks > 0 and c.ssd_writes > 0
    usage = cp.usage()
    assert usage.live_plans == 0 and usage.orders_in_flight == 0
    assert cp.audit() == []


def test_threads_share_one_hybrid_full_duplicate_plane():
    cp = ControlPlane(config("full-duplicate", dram_chunks=16, ssd_chunks=64, chunk=HYBRID))
    committed = run_threads(cp)
    assert cp.counters().references == sum(committed)
    assert cp.audit() == []
