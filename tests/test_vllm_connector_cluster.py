"""The connector's cluster tier without an engine: two replicas (each a scheduler half with its
control plane and a worker half with its data plane over CPU pages) share prefixes through a real
Mooncake master and storage node. vLLM's objects are plain stand-ins carrying the fields saria
reads; "computing" a chunk writes its true KV (a function of its hash) into its pages, and every
check of a reload is against that truth, bit for bit.

What must hold: a prefix computed on replica A is reloaded on replica B from the cluster, exactly;
every miss (removed, evicted between lookup and load, a value of the wrong size, the master dead,
no staging room, a full pool) is a miss: vLLM recomputes those tokens (their blocks are load
errors), the control plane never hears of it, and nothing fails."""

from __future__ import annotations

import hashlib
import logging
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from cluster_cases import raw_client, start_cluster
from saria.dataplane.cluster import Layout
from saria.dataplane.ssd.keys import object_key
from saria.integrations.vllm.geometry import EngineGeometry
from saria.integrations.vllm.layout import ParallelLayout
from saria.integrations.vllm.scheduler import SariaScheduler, open_cluster_index
from saria.integrations.vllm.settings import ConnectorSettings
from saria.integrations.vllm.worker import SariaWorker

BLOCK = 32
CHUNK = 64  # two blocks
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2  # one layer: K and V, 2 heads, head dim 64, bf16
GEOMETRY = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=("l0",),
                          kv_bytes_per_token=KV_BYTES_PER_TOKEN)
NUM_BLOCKS = 64
SIZE = CHUNK * KV_BYTES_PER_TOKEN


def truth(block_hash: bytes, rank: int = 0) -> torch.Tensor:
    """The KV a block with this hash holds on ``rank`` (one page of its shard): seeded by both, the
    same in every process."""
    seed = int.from_bytes(hashlib.blake2b(block_hash + bytes([rank]), digest_size=8).digest(), "little") >> 1
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, (BLOCK * KV_BYTES_PER_TOKEN // 2,), generator=g,
                         dtype=torch.int16).view(torch.bfloat16).view(2, BLOCK, 2, 64)


def request(req_id: str, chunks: int, prefix: str = "p", chunk_tokens: int = CHUNK):
    """A prompt of ``chunks`` chunks and one block more; requests of one ``prefix`` share it."""
    hashes = [f"{prefix}{i}".encode() for i in range(chunks * chunk_tokens // BLOCK + 1)]
    return types.SimpleNamespace(request_id=req_id, block_hashes=hashes, num_prompt_tokens=len(hashes) * BLOCK)


class Replica:
    """One vLLM server: its scheduler half and ``tp`` worker ranks (each its shard of the pages),
    driven step by step as vLLM does."""

    def __init__(self, cluster, tp: int = 1, num_blocks: int = NUM_BLOCKS, **extra):
        options = {"chunk_tokens": CHUNK, "dram_bytes": 16 * SIZE * tp, "log_interval_s": 0,
                   "cluster": cluster.master, "cluster_staging_bytes": 8 * SIZE, "cluster_timeout_s": 5.0,
                   "cluster_insecure": True}  # the tier's mechanics, unsealed (sealed: test_cluster_store_sealed.py)
        options.update(extra)
        self.settings = ConnectorSettings.from_extra_config(options)
        self.index = open_cluster_index(self.settings, tp)
        self.scheduler = SariaScheduler(self.settings, GEOMETRY, workers=tp, cluster=self.index)
        self.workers = [SariaWorker(self.settings, GEOMETRY, num_blocks=num_blocks,
                                    layout=ParallelLayout(tp_size=tp, tp_rank=r)) for r in range(tp)]
        self.pages = [torch.zeros(num_blocks, 2, BLOCK, 2, 64, dtype=torch.bfloat16) for _ in range(tp)]
        for worker, pages in zip(self.workers, self.pages):
            worker.register_kv_caches({"l0": pages})
            assert worker.data is not None and worker.cluster is not None
        self.worker = self.workers[0]
        self.exchange()  # the workers' first reports name their cluster layouts

    def exchange(self) -> None:
        reports = [r for r in (w.build_worker_meta() for w in self.workers) if r is not None]
        if reports:
            report = reports[0]
            for other in reports[1:]:
                report = report.aggregate(other)
            self.scheduler.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=report))

    def settle(self, timeout: float = 30.0) -> None:
        """Every order completed and reported, every cluster put ended."""
        deadline = time.monotonic() + timeout
        while self.scheduler.has_pending_work() and time.monotonic() < deadline:
            meta = self.scheduler.build_connector_meta(_output([], {}))
            for w in self.workers:
                w.wait_for_save(meta)
            self.exchange()
            time.sleep(0.01)
        assert not self.scheduler.has_pending_work()
        for w in self.workers:
            w.cluster.quiesce()

    def run(self, req, between=None) -> dict:
        """One request through lookup, load, the forward of the rest of its prompt and its commit
        (``between()`` runs after the lookup, before the load); what vLLM saw: tokens offered,
        blocks that failed to load, where it started computing, and whether every page of the
        request then held its true KV."""
        offered, asynchronous = self.scheduler.get_num_new_matched_tokens(req, 0)
        if between is not None:
            between()
        ids = list(range(1, 1 + len(req.block_hashes)))  # free again: the last request settled
        ids = ids[1::2] + ids[::2]  # not in order, as vLLM's free list hands them out after a while
        errors: set[int] = set()
        if offered:
            assert asynchronous
            self.scheduler.update_state_after_alloc(req, types.SimpleNamespace(get_block_ids=lambda: (ids,)), offered)
            meta = self.scheduler.build_connector_meta(_output([], {}))
            for w in self.workers:
                w.start_load_kv(meta)
                assert req.request_id in w.get_finished(set())[1]
                errors |= w.take_error_blocks()
                assert not w.take_failed_requests()
            self.exchange()
        computed = next((i * BLOCK for i, b in enumerate(ids) if b in errors), offered)  # vLLM: up to the first error
        for rank, pages in enumerate(self.pages):  # the forward computes the rest
            for i in range(computed // BLOCK, len(ids)):
                pages[ids[i]] = truth(req.block_hashes[i], rank)
        new = types.SimpleNamespace(req_id=req.request_id, block_ids=(ids,), num_computed_tokens=computed)
        meta = self.scheduler.build_connector_meta(_output([new], {req.request_id: req.num_prompt_tokens - computed}))
        for w in self.workers:
            w.wait_for_save(meta)
        self.exchange()
        self.scheduler.request_finished(req, ids)
        right = all(torch.equal(pages[ids[i]].view(torch.int16), truth(req.block_hashes[i], rank).view(torch.int16))
                    for rank, pages in enumerate(self.pages) for i in range(len(ids)))  # bits: pages hold NaNs
        self.settle()
        return dict(offered=offered, errors=errors, computed=computed, right=right)

    def totals(self) -> dict:
        return self.scheduler.totals()

    def shared(self) -> int:
        return sum(w.cluster.counters()["shared"] for w in self.workers)

    def closers(self) -> list:
        return [w.shutdown for w in self.workers] + [self.index.close]

    def close(self) -> None:
        close_all([self])


def close_all(replicas) -> None:
    """Close every Mooncake client of ``replicas`` at once (each takes about a second to close)."""
    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(close) for r in replicas for close in r.closers()]:
            future.result()


def _output(new, scheduled):
    return types.SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_new_reqs=new,
                                 scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                             resumed_req_ids=set(),
                                                                             num_computed_tokens=[]),
                                 preempted_req_ids=set())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory)
    yield c
    c.stop()


@pytest.fixture
def replicas(cluster):
    made = []

    def make(**extra):
        made.append(Replica(cluster, **extra))
        return made[-1]

    yield make
    close_all(made)


def cluster_keys(prefix: str, chunks: range) -> list[bytes]:
    """The object keys of chunks of a ``request(..., prefix)`` (chunk i's hash: its last block's)."""
    return [object_key(f"{prefix}{2 * i + 1}".encode(), "kv") for i in chunks]


def test_a_prefix_computed_on_one_replica_reloads_on_another_bit_for_bit(replicas):
    a, b = replicas(), replicas()
    first = a.run(request("a1", 4, "s"))
    assert first["offered"] == 0 and first["right"]
    assert a.shared() == 4  # every chunk it computed, once in DRAM
    # turn 2 of the session lands on replica B: its prefix from the cluster, the new chunk computed
    second = b.run(request("b1", 5, "s"))
    assert second["offered"] == 4 * CHUNK and not second["errors"] and second["right"]
    totals = b.totals()
    assert totals["hit_tokens_cluster"] == 4 * CHUNK and totals["cluster_chunks_missed"] == 0
    assert totals["loads_failed"] == 0 and totals["hit_tokens_dram"] == 0
    assert b.shared() == 1  # only what B computed: chunk 4
    # B's commit stored the cluster chunks in its own DRAM: turn 3 on B reloads them locally
    third = b.run(request("b2", 6, "s"))
    assert third["right"] and b.totals()["hit_tokens_dram"] == 5 * CHUNK
    assert b.totals()["hit_tokens_cluster"] == 4 * CHUNK  # chunk 5 is new: nobody holds it


def assert_recomputed_from(run: dict, chunk: int) -> None:
    """vLLM was offered the cluster chunks, got the ones before ``chunk`` and recomputed from there."""
    assert run["computed"] == chunk * CHUNK and run["right"]
    if run["offered"] > chunk * CHUNK:
        assert min(run["errors"]) == run["errors"] and run["errors"]


def test_an_object_evicted_between_lookup_and_load_is_a_miss_vllm_recomputes(replicas, cluster):
    a, b = replicas(), replicas()
    a.run(request("a1", 4, "e"))
    raw = raw_client(cluster)
    layout = Layout(a.worker.cluster.layout_identity)
    key = cluster_keys("e", range(2, 3))[0]
    run = b.run(request("b1", 5, "e"), between=lambda: raw.remove(layout.meta_key(key), True))
    assert run["offered"] == 4 * CHUNK and run["computed"] == 2 * CHUNK and run["right"]
    assert len(run["errors"]) == 2 * CHUNK // BLOCK  # chunks 2 and 3: vLLM recomputes them
    totals = b.totals()
    assert totals["hit_tokens_cluster"] == 2 * CHUNK and totals["cluster_chunks_missed"] == 2
    assert totals["loads_failed"] == 0  # a miss, not a failure: the control plane never heard of it
    assert b.worker.cluster.counters()["store"]["misses"]["absent"] == 1
    assert b.worker.faults.count == 0 and not b.worker.off


def test_a_value_of_the_wrong_size_is_a_corrupt_miss_and_is_dropped(replicas, cluster):
    a, b = replicas(), replicas()
    a.run(request("a1", 3, "w"))
    raw = raw_client(cluster)
    layout = Layout(a.worker.cluster.layout_identity)
    key = cluster_keys("w", range(1, 2))[0]
    meta = layout.decode(key, raw.get_batch([layout.meta_key(key)])[0])
    part = layout.part_keys(key, meta)[0]
    assert raw.remove(part, True) == 0 and raw.put(part, b"x" * 1000) == 0  # a short value
    run = b.run(request("b1", 3, "w"))
    assert run["offered"] == 3 * CHUNK and run["computed"] == CHUNK and run["right"]
    store = b.worker.cluster.counters()["store"]
    assert store["corrupt"] == 1 and store["dropped"] == 1
    assert b.totals()["cluster_chunks_missed"] == 2 and b.worker.faults.count == 0
    # the corrupt object was dropped and B recomputed and shared it again: a third replica finds all 3
    c = replicas()
    assert c.run(request("c1", 3, "w"))["offered"] == 3 * CHUNK
    assert c.totals()["hit_tokens_cluster"] == 3 * CHUNK


def test_without_staging_room_the_chunks_beyond_it_are_misses(replicas):
    a, b = replicas(), replicas(cluster_staging_bytes=2 * SIZE)
    a.run(request("a1", 4, "r"))
    run = b.run(request("b1", 4, "r"))
    assert run["offered"] == 2 * CHUNK  # the scheduler offers what one load's staging holds
    assert not run["errors"] and run["right"] and b.totals()["hit_tokens_cluster"] == 2 * CHUNK


def test_tensor_parallel_replicas_share_every_rank_shard_and_other_layouts_see_nothing(replicas):
    a, b, single = replicas(tp=2), replicas(tp=2), replicas()
    assert a.index.ready and b.index.ready
    a.run(request("a1", 3, "t"))
    assert a.shared() == 2 * 3  # each rank put its shard of every chunk
    run = b.run(request("b1", 4, "t"))
    assert run["offered"] == 3 * CHUNK and not run["errors"] and run["right"]
    assert b.totals()["hit_tokens_cluster"] == 3 * CHUNK
    # a TP=1 server's objects are other bytes (a whole object, not a shard): it finds none of these
    assert single.run(request("s1", 3, "t"))["offered"] == 0


def test_a_lookup_waits_for_every_rank_layout(replicas, cluster):
    a = replicas(tp=2)
    a.run(request("a1", 2, "l"))
    settings = a.settings
    index = open_cluster_index(settings, 2)
    try:
        keys = cluster_keys("l", range(2))
        assert index.leading(keys) == 0  # no rank reported yet
        index.add_layouts([a.workers[0].cluster.layout_identity])
        assert index.leading(keys) == 0  # one of two
        index.add_layouts([a.workers[1].cluster.layout_identity])
        assert index.leading(keys) == 2
        with pytest.raises(ValueError, match="more cluster layouts"):
            index.add_layouts(["another server's rank"])
    finally:
        index.close()


def test_evicted_admission_puts_a_chunk_when_its_dram_copy_is_dropped(replicas):
    a = replicas(dram_bytes=2 * SIZE, cluster_admission="evicted")
    first = a.run(request("a1", 2, "v"))
    assert a.shared() == 0  # both chunks are in A's DRAM: nothing evicted, nothing shared
    a.run(request("a2", 3, "x"))  # another session's chunks push the first ones out of A's DRAM
    assert first["right"] and a.shared() >= 1
    assert a.worker.engine.counters()["engine"]["dram_drops"] >= a.shared()
    b = replicas()
    run = b.run(request("b1", 2, "v"))
    assert run["offered"] >= CHUNK and not run["errors"] and run["right"]


def test_hybrid_models_are_refused_with_the_cluster_option(cluster):
    hybrid = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=("l0",),
                            kv_bytes_per_token=KV_BYTES_PER_TOKEN, state_group=1, state_layers=("g0",),
                            state_bytes=4096)
    settings = ConnectorSettings.from_extra_config({"cluster": cluster.master, "chunk_tokens": BLOCK,
                                                    "cluster_insecure": True})
    index = open_cluster_index(settings, 1)
    try:
        with pytest.raises(ValueError, match="dense .attention-only. models"):
            SariaScheduler(settings, hybrid, cluster=index)
    finally:
        index.close()


@pytest.fixture
def own_cluster(tmp_path_factory):
    c = start_cluster(tmp_path_factory, node_bytes=64 << 20)
    yield c
    c.stop()


def test_a_dead_master_turns_the_tier_off_and_every_request_computes(own_cluster, caplog):
    a = Replica(own_cluster)
    b = Replica(own_cluster)
    try:
        a.run(request("a1", 3, "d"))
        own_cluster.kill_master()
        with caplog.at_level(logging.WARNING, logger="saria.dataplane.cluster"):
            run = b.run(request("b1", 3, "d"))
            assert run["offered"] == 0 and run["right"]  # found nothing: computed it all, as without saria
            again = a.run(request("a2", 3, "q"))  # A's puts fail quietly: misses, never faults
            assert again["right"]
            b.run(request("b2", 3, "q"))
        off = [r for r in caplog.records if "cluster tier off" in r.getMessage()]
        assert 1 <= len(off) <= 4  # at most one per client (each replica: its index and its store)
        assert a.worker.faults.count == 0 and b.worker.faults.count == 0
        assert not a.worker.off and not b.worker.off
        assert a.worker.cluster.counters()["share_failed"] >= 1 or not a.worker.cluster.counters()["on"]
    finally:
        close_all([a, b])


def test_a_full_pool_evicts_the_oldest_chunks_and_their_lookups_miss(own_cluster):
    """A 64 MiB pool and chunks of 1 MiB (2048 tokens): ten sessions of 8 chunks put by A, the
    oldest evicted; B finds more of the newest session's prefix than of the oldest, whose chunks
    are misses, and every page it reloads is right."""
    chunk = 2048
    big = dict(chunk_tokens=chunk, dram_bytes=16 << 20, cluster_staging_bytes=16 << 20)
    a = Replica(own_cluster, num_blocks=8 * chunk // BLOCK + 2, **big)
    b = Replica(own_cluster, num_blocks=8 * chunk // BLOCK + 2, **big)
    try:
        for i in range(10):
            a.run(request(f"a{i}", 8, f"f{i}-", chunk))
        counts = [w.cluster.counters() for w in a.workers]
        assert sum(c["shared"] + c["share_failed"] for c in counts) == 80  # a put into a full pool may be refused
        assert a.shared() >= 70
        oldest, newest = b.run(request("b0", 8, "f0-", chunk)), b.run(request("b9", 8, "f9-", chunk))
        assert oldest["right"] and newest["right"]
        assert oldest["offered"] < 8 * chunk  # evicted: a lookup that finds less, never an error
        assert newest["offered"] > oldest["offered"] and not newest["errors"]  # (a put into the full pool
        # may have been refused while Mooncake evicts: then the newest prefix is found in part)
        assert b.worker.faults.count == 0 and b.totals()["loads_failed"] == 0
    finally:
        close_all([a, b])


def test_staging_that_holds_no_chunk_is_refused_at_start(cluster):
    settings = ConnectorSettings.from_extra_config({"cluster": cluster.master, "chunk_tokens": CHUNK,
                                                    "cluster_staging_bytes": SIZE - 1, "cluster_insecure": True})
    index = open_cluster_index(settings, 1)
    try:
        with pytest.raises(ValueError, match="holds no chunk"):
            SariaScheduler(settings, GEOMETRY, cluster=index)
    finally:
        index.close()
