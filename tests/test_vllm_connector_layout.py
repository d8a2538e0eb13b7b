"""The connector under tensor and pipeline parallelism without an engine: a rank's place in the
parallel layout, its SSD directory and store identity, the capacity split over ranks, a worker
rank restarted on its own store (real files: inventory once, wiped for another layout, ranks never
lock each other out), and the scheduler taking over the previous run's SSD objects once every
rank's inventory is in. Real control plane, real data plane; vLLM's objects as plain stand-ins."""

from __future__ import annotations

import hashlib
import json
import logging
import types
from pathlib import Path

import pytest
import torch

from saria.control import DropOrder, ObjectKey, StoreOrder, Tier, WriteOrder
from saria.dataplane.ssd.keys import object_key
from saria.dataplane.ssd.format import FILE_NAME, MAX_IDENTITY_BYTES, encode_identity
from saria.integrations.vllm.faults import Faults
from saria.integrations.vllm.guard import SchedulerGuard
from saria.integrations.vllm.layout import (ParallelLayout, model_identity, page_format, rank_directories,
                                            store_identity)
from saria.integrations.vllm.metadata import (CompletionReport, LoadSpec, RequestOrders, SariaConnectorMetadata,
                                              SariaWorkerMetadata)
from saria.integrations.vllm.scheduler import SariaScheduler
from saria.integrations.vllm.worker import SariaWorker

from test_vllm_connector_faults import (BLOCK, CHUNK, GEOMETRY, KV_BYTES_PER_TOKEN, Clock, Engine, blocks_of, plan,
                                        settings, store_and_write)

TP2 = [ParallelLayout(tp_size=2, tp_rank=r) for r in range(2)]
CHUNK_BYTES = CHUNK * KV_BYTES_PER_TOKEN  # one object (one slot of the host pool and of the SSD store)


# --- the parallel layout ---------------------------------------------------------------------------

@pytest.mark.parametrize("layout, shards, rank, directory", [
    (ParallelLayout(), 1, 0, "rank0"),
    (ParallelLayout(tp_size=4, tp_rank=3), 4, 3, "rank3"),
    (ParallelLayout(pp_size=2, pp_rank=1), 2, 1, "rank1"),
    (ParallelLayout(tp_size=2, tp_rank=0, pp_size=2, pp_rank=1), 4, 2, "rank2"),  # PP stage major
    (ParallelLayout(tp_size=2, tp_rank=1, pp_size=3, pp_rank=2), 6, 5, "rank5"),
    (ParallelLayout(tp_size=2, tp_rank=1, dp_size=2, dp_rank=1), 2, 1, "dp1-rank1"),  # DP: replicas, not shards
    (ParallelLayout(dp_size=3, dp_rank=0), 1, 0, "dp0-rank0"),
])
def test_shards_rank_and_directory(layout, shards, rank, directory):
    assert (layout.shards, layout.rank, layout.directory_name) == (shards, rank, directory)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp_size": 2, "tp_rank": 2}, "tp rank 2 of 2"),
    ({"tp_size": 2, "tp_rank": -1}, "tp rank -1 of 2"),
    ({"tp_size": 0, "tp_rank": 0}, "tp rank 0 of 0"),
    ({"pp_size": 4, "pp_rank": 4}, "pp rank 4 of 4"),
    ({"dp_size": 1, "dp_rank": 1}, "dp rank 1 of 1"),
])
def test_a_rank_outside_its_layout_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=f"saria: {message} is not a parallel layout"):
        ParallelLayout(**kwargs)


def parallel_config(tp=1, pp=1, dp=1, dp_rank=0, **extra):
    return types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                                 data_parallel_rank=dp_rank, **extra)


def test_the_server_layout_comes_from_vllms_parallel_config():
    assert ParallelLayout.of_server(parallel_config(tp=2, pp=3, dp=2, dp_rank=1)) == ParallelLayout(
        tp_size=2, pp_size=3, dp_size=2, dp_rank=1)
    assert ParallelLayout.of_server(parallel_config(tp=4, prefill_context_parallel_size=1,
                                                    decode_context_parallel_size=1)).shards == 4
    from vllm.config import ParallelConfig  # vLLM's own class has the fields saria reads

    assert ParallelLayout.of_server(ParallelConfig()) == ParallelLayout()


@pytest.mark.parametrize("extra", [{"prefill_context_parallel_size": 2},
                                   {"decode_context_parallel_size": 2},
                                   {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 4}])
def test_context_parallelism_is_refused_clearly(extra):
    with pytest.raises(ValueError, match="saria does not support context parallelism") as info:
        ParallelLayout.of_server(parallel_config(tp=2, **extra))
    assert "tensor and pipeline parallelism are supported" in str(info.value)
    for name, size in extra.items():
        assert f"'{name}': {size}" in str(info.value)


# --- rank directories --------------------------------------------------------------------------------

def test_rank_directories_are_made_under_each_drive(tmp_path):
    drives = [tmp_path / "nvme0", tmp_path / "nvme1"]
    for d in drives:
        d.mkdir()
    got = rank_directories(tuple(map(str, drives)), TP2[1])
    assert got == [str(d / "rank1") for d in drives] and all((d / "rank1").is_dir() for d in drives)
    assert rank_directories(tuple(map(str, drives)), TP2[1]) == got  # again: already there
    assert rank_directories((str(drives[0]),), ParallelLayout(dp_size=2, dp_rank=1)) == [str(drives[0] / "dp1-rank0")]
    assert sorted(p.name for p in drives[0].iterdir()) == ["dp1-rank0", "rank1"]
    assert rank_directories((), TP2[0]) == []


def test_a_missing_drive_is_an_error_not_a_new_folder(tmp_path):
    (tmp_path / "nvme0").mkdir()
    missing = tmp_path / "nvme1"
    with pytest.raises(ValueError, match=f"saria: SSD path {missing} is not an existing directory"):
        rank_directories((str(tmp_path / "nvme0"), str(missing)), TP2[0])
    assert not missing.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not an existing directory"):
        rank_directories((str(tmp_path / "file"),), TP2[0])


# --- store identity ----------------------------------------------------------------------------------

MODEL = {"model": "/models/m", "revision": "None", "hf_config": "00", "dtype": "torch.bfloat16",
         "cache_dtype": "auto", "hash": "sha256", "hash_seed": "11"}
SHAPE = dict(block_size=32, chunk_tokens=64, kv_bytes_per_token=512, state_bytes=0, pages="abcd")


def test_store_identity_is_canonical_json_of_everything_that_names_an_object():
    identity = store_identity(MODEL, TP2[1], **SHAPE)
    assert json.loads(identity) == dict(MODEL, **SHAPE, saria_objects=1, tp=2, pp=1, rank=1)
    assert " " not in identity and list(json.loads(identity)) == sorted(json.loads(identity))
    reordered = dict(reversed(list(MODEL.items())))
    assert store_identity(reordered, ParallelLayout(tp_size=2, tp_rank=1),
                          **dict(reversed(list(SHAPE.items())))) == identity


@pytest.mark.parametrize("model, layout, shape", [
    (MODEL, ParallelLayout(), SHAPE),  # another TP size
    (MODEL, TP2[0], SHAPE),  # another rank
    (MODEL, ParallelLayout(pp_size=2, pp_rank=1), SHAPE),  # rank 1 of a PP layout, not a TP one
    (MODEL, TP2[1], dict(SHAPE, chunk_tokens=128)),
    (dict(MODEL, dtype="torch.float16"), TP2[1], SHAPE),
    (dict(MODEL, cache_dtype="fp8"), TP2[1], SHAPE),
    (MODEL, TP2[1], dict(SHAPE, pages="abce")),
])
def test_store_identity_differs_for_anything_that_changes_the_bytes(model, layout, shape):
    assert store_identity(model, layout, **shape) != store_identity(MODEL, TP2[1], **SHAPE)


def test_the_dp_replica_is_not_part_of_the_identity_its_directory_tells_it():
    replica = ParallelLayout(tp_size=2, tp_rank=1, dp_size=2, dp_rank=1)
    assert store_identity(MODEL, replica, **SHAPE) == store_identity(MODEL, TP2[1], **SHAPE)
    assert replica.directory_name != TP2[1].directory_name


def vllm_config(model: str, hf_config=None, dtype=torch.bfloat16, hash_algo="sha256"):
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=model, revision=None, dtype=dtype, hf_config=hf_config),
        cache_config=types.SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo=hash_algo))


def test_model_identity_digests_long_paths_so_the_identity_fits_a_superblock(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    short = "/m/" + "a" * 197
    assert len(short) == 200 and model_identity(vllm_config(short))["model"] == short
    long = "/models/" + "x" * 4000  # would not fit a superblock as it is
    name = model_identity(vllm_config(long))["model"]
    assert name == "blake2b:" + hashlib.blake2b(long.encode(), digest_size=16).hexdigest()
    assert model_identity(vllm_config(long + "y"))["model"] != name
    shape = dict(SHAPE, pages=page_format({"l0": [torch.zeros(4, 2, 32, 2, 64)]}))
    for path in ("/m/" + "b" * 250, long):
        identity = store_identity(model_identity(vllm_config(path)), ParallelLayout(tp_size=8, tp_rank=7), **shape)
        assert len(identity.encode()) <= MAX_IDENTITY_BYTES
        assert encode_identity(identity) == identity.encode()
    with pytest.raises(ValueError, match="at most 3000 fit"):  # what the digest avoids
        encode_identity(store_identity(dict(model_identity(vllm_config(short)), model=long), TP2[0], **shape))


def test_model_identity_reads_dtypes_hashing_and_the_model_config(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)

    class HFConfig:
        def __init__(self, text):
            self.text = text

        def to_json_string(self, use_diff=True):
            assert use_diff is False
            return self.text

    class Unprintable:
        def to_json_string(self, use_diff=True):
            raise RuntimeError("no")

        def __repr__(self):
            return "Unprintable()"

    base = model_identity(vllm_config("/m", HFConfig('{"layers": 2}')))
    assert base == {"model": "/m", "revision": "None",
                    "hf_config": hashlib.blake2b(b'{"layers": 2}', digest_size=8).hexdigest(),
                    "weights": "",  # not a local directory (tests/test_vllm_connector_resets.py: one that is)
                    "dtype": "torch.bfloat16", "cache_dtype": "auto", "hash": "sha256",
                    "hash_seed": hashlib.blake2b(b"vllm-none-hash", digest_size=8).hexdigest()}
    assert model_identity(vllm_config("/m", HFConfig('{"layers": 2}'))) == base  # deterministic
    assert model_identity(vllm_config("/m", HFConfig('{"layers": 3}')))["hf_config"] != base["hf_config"]
    assert model_identity(vllm_config("/m", Unprintable()))["hf_config"] == hashlib.blake2b(
        b"Unprintable()", digest_size=8).hexdigest()
    assert model_identity(vllm_config("/m", None))["hf_config"] == hashlib.blake2b(b"", digest_size=8).hexdigest()
    assert model_identity(vllm_config("/m", dtype=torch.float16))["dtype"] == "torch.float16"
    # A seeded run's block hashes repeat across runs, and so does its identity.
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    seeded = model_identity(vllm_config("/m", hash_algo="xxhash"))
    assert seeded == model_identity(vllm_config("/m", hash_algo="xxhash"))
    assert seeded["hash_seed"] == hashlib.blake2b(b"7", digest_size=8).hexdigest() and seeded["hash"] == "xxhash"
    # An unseeded non-cryptographic hash is random in every run: no identity repeats either.
    monkeypatch.delenv("PYTHONHASHSEED")
    assert model_identity(vllm_config("/m", hash_algo="xxhash")) != model_identity(vllm_config("/m",
                                                                                                hash_algo="xxhash"))


def test_page_format_tells_dimension_orders_and_dtypes_apart():
    pages = torch.zeros(16, 2, BLOCK, 2, 64, dtype=torch.bfloat16)
    other_order = torch.zeros(16, 2, 2, BLOCK, 64, dtype=torch.bfloat16).transpose(2, 3)  # heads outside tokens
    assert other_order.shape == pages.shape and other_order.stride() != pages.stride()
    digest = page_format({"l0": [pages]})
    assert len(digest) == 16 and page_format({"l0": [pages.clone()]}) == digest
    assert page_format({"l0": [torch.ones_like(pages)]}) == digest  # values do not matter
    assert page_format({"l0": [other_order]}) != digest
    assert page_format({"l0": [pages.to(torch.float16)]}) != digest
    assert page_format({"l1": [pages]}) != digest
    assert page_format({"l0": [pages, pages]}) != digest
    assert page_format({"l0": [pages[:8]]}) == digest  # the number of blocks is not the layout


# --- capacity split ----------------------------------------------------------------------------------

def test_each_rank_gets_its_share_of_the_servers_capacity(tmp_path):
    s = settings(tmp_path, dram_bytes=8 * CHUNK_BYTES + 1, ssd_bytes=(8 << 20) + 3)
    one = s.saria_config(block_size=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN)
    two = s.saria_config(block_size=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN, shards=2)
    four = s.saria_config(block_size=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN, shards=4)
    assert (one.dram_bytes, one.ssd_bytes) == (8 * CHUNK_BYTES + 1, (8 << 20) + 3)
    assert (two.dram_bytes, two.ssd_bytes) == (4 * CHUNK_BYTES, (4 << 20) + 1)
    assert (four.dram_bytes, four.ssd_bytes) == (2 * CHUNK_BYTES, (2 << 20) + 0)
    assert two.chunk == one.chunk and two.policy == one.policy
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="shards must be a positive int"):
            s.saria_config(block_size=BLOCK, kv_bytes_per_token=KV_BYTES_PER_TOKEN, shards=bad)


def test_a_tp2_workers_host_pool_and_store_are_sized_for_half(tmp_path):
    """A rank's host pool and drive file take no more than its share of what was asked
    (``saria.sizing``): 8 objects' bytes of DRAM -> 8 slots, a TP2 rank's 4 -> 4; 8 MiB of SSD ->
    a file of a 4 KiB superblock and 227 slots of a 4 KiB header and a 32 KiB part, a rank's
    4 MiB -> 113. The scheduler's control plane charges against exactly those."""
    whole = rank_worker(tmp_path / "a", ParallelLayout())
    half = rank_worker(tmp_path / "b", TP2[1])
    try:
        assert whole.data.host_pool.slot_bytes == half.data.host_pool.slot_bytes == CHUNK_BYTES
        assert (whole.data.host_pool.num_slots, half.data.host_pool.num_slots) == (8, 4)
        assert (whole.data.ssd.total_parts, half.data.ssd.total_parts) == (227, 113)
        for worker, shards in ((whole, 1), (half, 2)):
            [drive] = worker.data.ssd.paths
            size = drive.stat().st_size
            assert size == 4096 + worker.data.ssd.total_parts * (4096 + CHUNK_BYTES) <= (8 << 20) // shards
            control = SariaScheduler(worker.settings, GEOMETRY, workers=shards).control.usage()
            assert control.dram_capacity == worker.data.host_pool.num_slots * CHUNK_BYTES
            assert control.ssd_capacity == worker.data.ssd.total_parts * CHUNK_BYTES
    finally:
        whole.shutdown()
        half.shutdown()


def test_the_drops_completions_caused_go_out_before_the_commits_that_take_their_slots(tmp_path):
    """The control plane frees a DRAM copy's slots when a completion makes it drop the copy, and may
    give them to the next commit: with exactly as many slots as it charges, the drop must reach the
    worker first (drops before the step's commits, as within one order list)."""
    guard = SchedulerGuard(lambda: SariaScheduler(settings(tmp_path, dram_bytes=2 * CHUNK_BYTES, theta_E=1,
                                                           prewrite=False), GEOMETRY),
                           faults=Faults("scheduler", clock=Clock()))
    engine = Engine(guard)
    engine.cache("r1", 2)  # r1's two chunks fill the DRAM tier
    r2 = engine.request("r2", 2, prefix="c")
    guard.get_num_new_matched_tokens(r2, 0)
    meta = engine.step(r2)  # evicts r1's chunks: admitted, written from DRAM, their slots held meanwhile
    sent = [o for batch in meta.orders for o in batch.orders if not isinstance(o, DropOrder)]
    assert sent and all(isinstance(o, WriteOrder) and o.source is Tier.DRAM for o in sent)
    engine.report(meta.epoch, completions=[CompletionReport(o.order_id, True) for o in sent])
    guard.request_finished(r2, [])
    r3 = engine.request("r3", 2, prefix="d")
    guard.get_num_new_matched_tokens(r3, 0)
    meta = engine.step(r3)  # the writes' completions dropped r1's copies; r3's stores take their slots
    kinds = [(type(o), getattr(o, "tier", None)) for batch in meta.orders for o in batch.orders]
    drops = [i for i, kind in enumerate(kinds) if kind == (DropOrder, Tier.DRAM)]
    stores = [i for i, kind in enumerate(kinds) if kind[0] is StoreOrder]
    assert drops and stores and max(drops) < min(stores)


# --- a worker rank restarted on its own store -----------------------------------------------------

def pages(seed: int) -> torch.Tensor:
    """16 blocks of one layer ([num_blocks, K/V, tokens, heads, head dim]), distinct per seed."""
    n = 16 * BLOCK * KV_BYTES_PER_TOKEN // 2
    return (torch.arange(n, dtype=torch.int32) * (seed + 1) % 30_011).to(torch.int16).view(torch.bfloat16).view(
        16, 2, BLOCK, 2, 64)


def rank_worker(ssd_root, layout, kv=None, **extra):
    """A worker of ``layout`` whose SSD path is ``ssd_root``, on ``kv`` (fresh pages by default)."""
    ssd_root.mkdir(exist_ok=True)
    worker = SariaWorker(settings(ssd_root, **extra), GEOMETRY, num_blocks=16, layout=layout, model=dict(MODEL))
    worker.register_kv_caches({"l0": pages(layout.rank) if kv is None else kv})
    return worker


def inventory_of(worker):
    report = worker.build_worker_meta()
    assert report is not None and report.inventory_reports == 1 and report.loads == [] and report.completions == []
    assert worker.build_worker_meta() is None  # reported once
    return report.inventory


def test_a_restarted_rank_reports_its_objects_once_and_serves_them(tmp_path):
    root = tmp_path / "nvme0"
    written = {}
    for layout in TP2:  # one rank after the other, each its own store under the same drive path
        worker = rank_worker(root, layout)
        assert worker.data.ssd.paths == [root / layout.directory_name / FILE_NAME]
        assert inventory_of(worker) == {}  # a new store
        chunks = [f"r{layout.rank}c{i}" for i in range(layout.rank + 2)]
        for i, chunk in enumerate(chunks):
            store_and_write(worker, chunk, (2 * i + 2, 2 * i + 3))
        written[layout.rank] = chunks
        worker.shutdown()
    assert sorted(p.name for p in root.iterdir()) == ["rank0", "rank1"]

    for layout in TP2:
        kv = pages(layout.rank)
        kv[8:].zero_()  # where the reload goes
        worker = rank_worker(root, layout, kv=kv)
        assert inventory_of(worker) == {ObjectKey(chunk, "kv"): 1 for chunk in written[layout.rank]}
        ssd = worker.data.ssd.counters()
        assert (ssd["wiped_files"], ssd["wiped_at_open"], ssd["dropped_at_open"]) == (0, 0, 0)
        # The objects are this rank's shards as written: a reload gives the pages back.
        worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, [written[layout.rank][1]], Tier.SSD),
                                                                        ((8, 9),))]))
        assert worker.get_finished(set()) == (set(), {"r"}) and worker.take_failed_requests() == set()
        assert worker.build_worker_meta().loads[0].failed == ()
        assert torch.equal(kv[8:10], pages(layout.rank)[4:6])
        worker.shutdown()


def test_an_fp8_store_is_served_after_a_restart_and_wiped_by_a_bf16_one(tmp_path):
    """``ssd_dtype=fp8``: a restarted rank of the same form finds its FP8 objects (same identity)
    and reloads them as their round trip; a rank that stores bf16 wipes them (another identity,
    other parts) rather than read FP8 bytes as bf16."""
    from saria.integrations.vllm.audit import fp8_round_trip

    root, layout = tmp_path / "nvme0", ParallelLayout()
    worker = rank_worker(root, layout, ssd_dtype="fp8")
    assert inventory_of(worker) == {}
    store_and_write(worker, "c0", (2, 3))
    worker.shutdown()

    kv = pages(0)
    kv[8:].zero_()
    worker = rank_worker(root, layout, kv=kv, ssd_dtype="fp8")
    assert inventory_of(worker) == {ObjectKey("c0", "kv"): 1}
    worker.start_load_kv(SariaConnectorMetadata(loads=[LoadSpec("r", plan(1, ["c0"], Tier.SSD), ((8, 9),))]))
    assert worker.get_finished(set()) == (set(), {"r"}) and worker.build_worker_meta().loads[0].failed == ()
    assert all(torch.equal(kv[8 + i], fp8_round_trip(pages(0)[2 + i])) for i in range(2))
    assert not torch.equal(kv[8:10], pages(0)[2:4])  # the round trip is not the identity on these pages
    worker.shutdown()

    worker = rank_worker(root, layout)  # bf16
    try:
        assert inventory_of(worker) == {}
        ssd = worker.data.ssd.counters()
        assert (ssd["wiped_files"], ssd["wiped_at_open"]) == (1, 1)
    finally:
        worker.shutdown()


def test_the_inventory_is_reported_again_at_a_new_epoch(tmp_path):
    """The control plane replaced before the rank's first report: the rank reports its inventory
    at the new epoch instead (objects a previous run left and objects this run wrote alike), and
    the objects stay, for the new control plane to take over."""
    worker = rank_worker(tmp_path, TP2[0])
    store_and_write(worker, "h0")
    worker.shutdown()
    worker = rank_worker(tmp_path, TP2[0])
    store_and_write(worker, "h1", (4, 5))
    worker.start_load_kv(SariaConnectorMetadata(epoch=1))  # the control plane was replaced before any report
    report = worker.build_worker_meta()
    assert report.epoch == 1 and report.inventory_reports == 1
    assert report.inventory == {ObjectKey("h0", "kv"): 1, ObjectKey("h1", "kv"): 1}
    assert sorted(worker.data.ssd.keys()) == sorted(object_key(h, "kv") for h in ("h0", "h1"))
    worker.shutdown()


def test_keys_that_are_not_saria_objects_are_deleted_not_reported(tmp_path):
    worker = rank_worker(tmp_path, TP2[1])
    store_and_write(worker, "h0")
    foreign = b"\xffnot-ours"
    worker.data.ssd.write(foreign, torch.ones(4096, dtype=torch.uint8)).result(timeout=30)
    assert sorted(worker.data.ssd.keys()) == sorted([object_key("h0", "kv"), foreign])
    worker.shutdown()
    worker = rank_worker(tmp_path, TP2[1])
    assert inventory_of(worker) == {ObjectKey("h0", "kv"): 1}
    assert worker.data.ssd.keys() == [object_key("h0", "kv")]
    worker.shutdown()


@pytest.mark.parametrize("layout, extra, wiped_rank", [
    (ParallelLayout(), {}, 0),  # the server restarted with TP=1: rank 0's directory, another identity
    (TP2[1], {"chunk_tokens": 2 * CHUNK}, 1),  # another chunk size
    (TP2[1], {"dram_bytes": 4 * CHUNK_BYTES, "ssd_bytes": 4 << 20}, None),  # capacities are not the identity
])
def test_a_store_of_another_layout_is_wiped_at_open(tmp_path, layout, extra, wiped_rank):
    for rank in TP2:
        worker = rank_worker(tmp_path, rank)
        store_and_write(worker, "h0")
        store_and_write(worker, "h1", (4, 5))
        worker.shutdown()
    worker = rank_worker(tmp_path, layout, **extra)
    ssd = worker.data.ssd.counters()
    if wiped_rank is None:
        assert inventory_of(worker) == {ObjectKey("h0", "kv"): 1, ObjectKey("h1", "kv"): 1}
        assert (ssd["wiped_files"], ssd["wiped_at_open"]) == (0, 0)
    else:
        assert inventory_of(worker) == {} and worker.data.ssd.keys() == []
        assert (ssd["wiped_files"], ssd["wiped_at_open"]) == (1, 2)
        assert worker.data.ssd.identity == store_identity(
            MODEL, layout, block_size=BLOCK, chunk_tokens=extra.get("chunk_tokens", CHUNK),
            kv_bytes_per_token=KV_BYTES_PER_TOKEN, state_bytes=0,
            pages=page_format({"l0": [pages(0)]}))
    worker.shutdown()
    # The other rank's store was not touched.
    other = 1 - (layout.rank if wiped_rank is None else wiped_rank)
    worker = rank_worker(tmp_path, TP2[other])
    assert inventory_of(worker) == {ObjectKey("h0", "kv"): 1, ObjectKey("h1", "kv"): 1}
    worker.shutdown()


def test_a_store_of_another_model_is_wiped_at_open(tmp_path):
    worker = rank_worker(tmp_path, TP2[0])
    store_and_write(worker, "h0")
    worker.shutdown()
    worker = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16, layout=TP2[0], model=dict(MODEL, model="/x"))
    worker.register_kv_caches({"l0": pages(0)})
    assert inventory_of(worker) == {} and worker.data.ssd.counters()["wiped_files"] == 1
    worker.shutdown()


def test_ranks_open_side_by_side_on_one_drive_path(tmp_path):
    """The user-visible bug: rank 1 failed with "in use by another SSD store (locked)" when every
    rank opened its store in the drive path itself."""
    workers = [rank_worker(tmp_path, layout) for layout in TP2]
    try:
        assert [w.off for w in workers] == [False, False] and all(w.data is not None for w in workers)
        assert [w.data.ssd.paths for w in workers] == [[tmp_path / "rank0" / FILE_NAME], [tmp_path / "rank1" / FILE_NAME]]
        for w in workers:
            store_and_write(w, "h0")
        assert [w.data.ssd.keys() for w in workers] == [[object_key("h0", "kv")]] * 2
        # The lock is real: a second worker of the same rank (a misconfigured second server) is refused.
        twin = SariaWorker(settings(tmp_path), GEOMETRY, num_blocks=16, layout=TP2[1], model=dict(MODEL))
        twin.register_kv_caches({"l0": pages(1)})
        assert twin.off and twin.data is None and twin.faults.by_where == {"register_kv_caches": 1}
    finally:
        for w in workers:
            w.shutdown()


# --- the scheduler taking over a previous run's objects ------------------------------------------

def kv(*chunks):
    return [ObjectKey(c, "kv") for c in chunks]


def inventory(keys, epoch=0):
    """One rank's first report."""
    return SariaWorkerMetadata(epoch=epoch, inventory={k: 1 for k in keys}, inventory_reports=1)


def report(engine, meta):
    engine.guard.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=meta))


# Requests of Engine.request(..., prefix="b") have chunk hashes b"b1", b"b3", b"b5", ...
RANK0 = kv(b"b1", b"b3", b"z9")
RANK1 = kv(b"b3", b"b1", b"y8")


def recovering(clock, wait_s=30.0):
    """A TP=2 server's scheduler at start (its drive path is never opened by the scheduler)."""
    return Engine(SchedulerGuard(lambda: SariaScheduler(settings(Path("/nvme0")), GEOMETRY, workers=2, recover=True,
                                                        recover_wait_s=wait_s, clock=clock),
                                 faults=Faults("scheduler", clock=clock), clock=clock))


@pytest.mark.parametrize("merged", [False, True])
def test_lookups_wait_for_every_ranks_inventory_then_recovered_chunks_load_from_ssd(merged):
    clock = Clock()
    engine = recovering(clock)
    inner = engine.guard.inner
    request = engine.request("r1", 3)
    assert engine.guard.has_pending_work()
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)
    meta = engine.step()
    assert meta.orders == [] and meta.loads == []
    if merged:  # both ranks' reports of one step, aggregated by vLLM
        both = inventory(RANK0).aggregate(inventory(RANK1))
        assert both.inventory_reports == 2 and both.inventory == {ObjectKey(b"b1", "kv"): 2, ObjectKey(b"b3", "kv"): 2,
                                                                  ObjectKey(b"z9", "kv"): 1, ObjectKey(b"y8", "kv"): 1}
        report(engine, both)
    else:  # one rank's report per step
        report(engine, inventory(RANK0))
        clock.now = 5.0
        assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)
        assert engine.guard.has_pending_work() and inner.control.counters().recovered == 0
        assert engine.step().orders == []
        report(engine, inventory(RANK1))
    assert inner.control.counters().recovered == 2 and inner.control.usage().ssd_used == 2 * CHUNK_BYTES
    assert engine.guard.has_pending_work()  # the drop of the partial objects is still to send
    # The recovered chunks load from SSD: b1 and b3 (b5 was never written).
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    assert engine.guard.hit_sources(request, 2 * CHUNK) == {"ssd": 2 * CHUNK}
    engine.guard.update_state_after_alloc(request, blocks_of(engine.blocks(7)), 2 * CHUNK)
    other = engine.request("r2", 1, prefix="other")
    assert engine.guard.get_num_new_matched_tokens(other, 0) == (0, False)
    meta = engine.step(other)
    # The objects only one rank held go first, deleted on every rank; then the other orders.
    assert meta.orders[0] == RequestOrders(None, (DropOrder(-1, (b"z9", b"y8"), (), 0, Tier.SSD),))
    assert [batch.req_id for batch in meta.orders] == [None, "r2"]
    (load,) = meta.loads
    assert load.plan.chunk_hashes == (b"b1", b"b3") and load.plan.kv_sources == (Tier.SSD, Tier.SSD)
    assert engine.step().orders == []  # sent once
    assert engine.guard.stats()["faults"] == 0


def test_a_rebuilt_control_plane_takes_over_what_every_rank_reports_at_its_epoch(monkeypatch):
    """TP=2: a fault replaces the control plane after start; it takes over, as at start, the
    objects both ranks report with their first reports of the new epoch (an inventory of the old
    epoch, late, counts for nothing), and serves them from SSD."""
    clock = Clock()
    engine = recovering(clock)
    report(engine, inventory(RANK0).aggregate(inventory(RANK1)))  # at start
    assert engine.guard.inner.control.counters().recovered == 2
    monkeypatch.setattr(engine.guard.inner, "build_connector_meta", lambda out: 1 / 0)
    assert engine.step().epoch == 1  # the ranks see the new epoch and report their stores again
    inner = engine.guard.inner
    request = engine.request("r1", 3)
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)  # "not yet"
    report(engine, inventory(RANK0 + kv(b"b5")).aggregate(inventory(RANK1)))  # epoch 0's, late: ignored
    assert inner.control.counters().recovered == 0 and engine.guard.has_pending_work()
    report(engine, inventory(kv(b"b1", b"b3", b"b5"), epoch=1).aggregate(inventory(kv(b"b3", b"b1"), epoch=1)))
    assert inner.control.counters().recovered == 2
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, True)
    assert engine.guard.hit_sources(request, 2 * CHUNK) == {"ssd": 2 * CHUNK}
    engine.guard.update_state_after_alloc(request, blocks_of(engine.blocks(7)), 2 * CHUNK)
    meta = engine.step()
    assert meta.epoch == 1 and meta.orders[0] == RequestOrders(None, (DropOrder(-1, (b"b5",), (), 0, Tier.SSD),))
    (load,) = meta.loads
    assert load.plan.chunk_hashes == (b"b1", b"b3") and load.plan.kv_sources == (Tier.SSD, Tier.SSD)


def test_half_shared_is_nothing_shared_with_one_rank_only():
    """An object one rank of two holds is dropped; with every rank reporting nothing, nothing waits."""
    clock = Clock()
    engine = recovering(clock)
    report(engine, inventory([]))
    report(engine, inventory(kv(b"b1")))
    assert engine.guard.inner.control.counters().recovered == 0
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 3), 0) == (0, False)
    assert engine.step().orders == [RequestOrders(None, (DropOrder(-1, (b"b1",), (), 0, Tier.SSD),))]
    assert not engine.guard.has_pending_work()

    empty = recovering(Clock())
    report(empty, inventory([]).aggregate(inventory([])))
    assert not empty.guard.has_pending_work() and empty.step().orders == []
    assert empty.guard.get_num_new_matched_tokens(empty.request("r", 3), 0) == (0, False)


def test_state_objects_of_a_model_without_states_are_dropped_by_the_control_plane():
    engine = recovering(Clock())
    keys = kv(b"b1") + [ObjectKey(b"b1", "state")]
    report(engine, inventory(keys).aggregate(inventory(keys)))
    counters = engine.guard.inner.control.counters()
    assert (counters.recovered, counters.recovered_dropped) == (1, 1)
    (batch,) = engine.step().orders
    (drop,) = batch.orders
    assert isinstance(drop, DropOrder) and (drop.kv, drop.state, drop.tier) == ((), (b"b1",), Tier.SSD)


def test_past_the_wait_lookups_go_on_without_the_missing_ranks(caplog):
    clock = Clock()
    engine = recovering(clock, wait_s=30.0)
    request = engine.request("r1", 3)
    report(engine, inventory(RANK0))
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)  # the wait starts now
    clock.now = 29.9
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)
    assert engine.guard.has_pending_work()
    clock.now = 30.0
    with caplog.at_level(logging.WARNING, logger="saria.vllm"):
        assert engine.guard.get_num_new_matched_tokens(request, 0) == (0, False)  # nothing recovered: a miss
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "SSD inventories came from 1 of 2 worker rank(s) within 30 s" in warning.getMessage()
    assert not engine.guard.has_pending_work()
    assert engine.guard.inner.control.counters().recovered == 0


def test_an_idle_engine_steps_for_the_inventories_at_most_the_wait():
    """vLLM asks ``has_pending_push_work`` when it has no request: True makes an idle engine step
    (each step brings the workers' reports), but not forever if an inventory never comes."""
    clock = Clock()
    engine = recovering(clock, wait_s=10.0)
    assert engine.guard.has_pending_work()  # the wait starts now
    clock.now = 9.9
    assert engine.guard.has_pending_work()
    clock.now = 10.0
    assert not engine.guard.has_pending_work()
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 2), 0) == (0, False)


def test_the_wait_starts_at_the_first_question_not_at_start():
    clock = Clock()
    clock.now = 100.0
    engine = recovering(clock, wait_s=10.0)
    clock.now = 200.0
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 2), 0) == (None, False)
    clock.now = 209.0
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 2), 0) == (None, False)
    clock.now = 210.0
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 2), 0) == (0, False)


def test_an_inventory_of_a_replaced_control_plane_is_ignored(monkeypatch):
    clock = Clock()
    engine = recovering(clock)
    monkeypatch.setattr(engine.guard.inner, "get_num_new_matched_tokens", lambda *a: 1 / 0)
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 3), 0) == (0, False)
    assert engine.guard.epoch == 1
    inner = engine.guard.inner  # a fresh one, recovering (this test's build always recovers)
    both = inventory(RANK0).aggregate(inventory(RANK1))
    report(engine, both)  # epoch 0: ignored
    assert inner.takeover.active and inner.takeover.reports == 0 and inner.control.counters().recovered == 0
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 3), 0) == (None, False)
    both.epoch = 1
    report(engine, both)
    assert not inner.takeover.active and inner.control.counters().recovered == 2
    # vLLM's aggregation keeps only the newer epoch's inventory.
    stale = inventory(RANK0, epoch=0).aggregate(SariaWorkerMetadata(epoch=1))
    assert stale.epoch == 1 and stale.inventory is None and stale.inventory_reports == 0
    assert SariaWorkerMetadata(epoch=1).aggregate(inventory(RANK0, epoch=0)).inventory is None


def test_a_scheduler_without_recovery_never_waits():
    engine = Engine(SchedulerGuard(lambda: SariaScheduler(settings(), GEOMETRY, workers=2), clock=Clock()))
    assert not engine.guard.has_pending_work()
    assert engine.guard.get_num_new_matched_tokens(engine.request("r", 3), 0) == (0, False)


def test_a_late_inventory_does_not_delete_what_this_run_wrote():
    """Past the wait, requests are served and written (write-through here); a rank's inventory that
    arrives then must not delete an object this run has on SSD: the control plane counts it there,
    and its next SSD reload would fail (or fail the request, with ``on_load_failure=fail``)."""
    clock = Clock()
    engine = Engine(SchedulerGuard(lambda: SariaScheduler(settings(Path("/nvme0"), policy="full-duplicate"), GEOMETRY,
                                                          workers=2, recover=True, clock=clock), clock=clock))
    report(engine, inventory(kv(b"b1")))  # rank 0 held the previous run's b1; rank 1's report is late
    request = engine.request("r1", 2)
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (None, False)
    clock.now = 30.0
    assert engine.guard.get_num_new_matched_tokens(request, 0) == (0, False)
    (batch,) = engine.step(request).orders
    assert [type(o).__name__ for o in batch.orders] == ["StoreOrder", "WriteOrder"]
    done = [CompletionReport(o.order_id, True) for o in batch.orders]
    report(engine, SariaWorkerMetadata([], done).aggregate(SariaWorkerMetadata([], done)))
    engine.guard.request_finished(request, [])
    assert engine.guard.inner.control.chunk_info(b"b1").kv.ssd == "ready"
    report(engine, inventory([]))  # rank 1's inventory, late
    drops = [o for b in engine.step().orders for o in b.orders if isinstance(o, DropOrder) and o.tier is Tier.SSD]
    assert all(b"b1" not in o.kv for o in drops)
