"""KV cache events for routers: saria's DRAM and SSD tiers as vLLM's ``BlockStored`` /
``BlockRemoved`` events (``SariaConnector.take_events``; docs/vllm.md, "KV events for routers").

Routers (llm-d's KV cache manager, NVIDIA Dynamo) subscribe to vLLM's KV event stream to send a
request to the replica that holds its prefix. vLLM publishes its own GPU blocks; with this module
it also publishes, in the same batches, the blocks saria holds in host memory (``medium`` ``CPU``)
and on its SSD tier (``STORAGE``), the names vLLM's own offloading connector uses for those media.

What is published, per chunk (one saria object spans ``chunk_tokens / block_size`` vLLM blocks)
and per medium, exactly once per residency:

* ``BlockStored`` when the chunk's kv object becomes resident in the tier: its store, promotion or
  SSD write *completed* ok (an order sent is not yet a copy: a failed one is never announced). The
  event carries every block hash of the chunk as vLLM's own events carry them
  (``maybe_convert_block_hash``), the block before it as ``parent_block_hash``, the chunk's token
  ids, vLLM's block size, the request's LoRA id and name, and the attention group as ``group_idx``;
* ``BlockRemoved`` (the same hashes) when it leaves the tier: a drop order of the control plane
  (DRAM or SSD eviction, a corrupt copy), or every resident chunk
  when the control plane is rebuilt (:meth:`KVEvents.restart`) or saria turns off (:meth:`close`).
  ``AllBlocksCleared`` is never sent: it has no medium, and a router would forget vLLM's GPU
  blocks with saria's.

The control plane names chunks (vLLM's block hash of a chunk's last block, or with a key file the
tenant's chunk id); it never sees a request. The payload an event needs (the block hashes and
tokens) is taken from the request when its prompt is committed, for the chunks that commit sends
a store or write for, and kept while the chunk is resident in a tier or has an order in flight:
at most ``max_chunks`` chunks (``kv_events_max_chunks``), about 4.5 KB each for a 512-token chunk
of 16-token blocks. A chunk that finds the bound full is not announced (nor, later, removed): the
router then under-counts saria, which costs it a better choice, never a wrong answer. Objects taken
over from a previous run's SSD files have no payload (the files hold chunk names, not block hashes
or tokens) and are not announced; the SSD objects a control plane rebuilt within this run takes
over are announced again (:meth:`recovered`).

No value derived from a key or a salt is ever published: not the chunk id, not vLLM's
``extra_keys`` (which would carry the request's ``cache_salt``), no session id. The block hashes
are vLLM's own, which vLLM publishes itself for its GPU blocks whenever events are enabled.

Every public method is fail-safe: a fault in this bookkeeping turns events off for the rest of the
run with one warning (a router then learns nothing more from saria), and never reaches the control
plane or vLLM. Pure Python: the vLLM event types are imported where events are built.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Sequence

from saria.orders import DRAM, KV, SSD, DropOrder, Order, PromoteOrder, StoreOrder, Tier, WriteOrder

log = logging.getLogger("saria.vllm")

MEDIUM = {DRAM: "CPU", SSD: "STORAGE"}  # vllm.distributed.kv_events.MEDIUM_CPU / MEDIUM_STORAGE
DEFAULT_MAX_CHUNKS = 65_536


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``kv_events_config.enable_kv_cache_events``)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


@dataclass(frozen=True, slots=True)
class ChunkPayload:
    """What a chunk's ``BlockStored`` needs, taken from its request at commit: vLLM's raw block
    hashes of its blocks (at ``block_size``), the hash of the block before it, its tokens."""

    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: array
    lora_id: int | None
    lora_name: str | None


def chunk_payload(request: Any, index: int, *, chunk_tokens: int, block_size: int,
                  hash_tokens: int) -> ChunkPayload | None:
    """Chunk ``index``'s payload from ``request`` (``Request.block_hashes``, one every
    ``hash_tokens`` tokens, prefix-chained: a block's hash is the last one within it, as vLLM's
    ``BlockHashListWithBlockSize``); None if the request does not cover the chunk."""
    per_block = block_size // hash_tokens
    first = index * (chunk_tokens // hash_tokens)  # the chunk's first hash
    hashes = request.block_hashes
    blocks = chunk_tokens // block_size
    if per_block < 1 or first + blocks * per_block > len(hashes):
        return None
    start = index * chunk_tokens
    tokens = request.all_token_ids[start:start + chunk_tokens]
    if len(tokens) < chunk_tokens:
        return None
    lora = getattr(request, "lora_request", None)
    return ChunkPayload(tuple(bytes(hashes[first + (b + 1) * per_block - 1]) for b in range(blocks)),
                        bytes(hashes[first - 1]) if first else None, array("i", tokens),
                        None if lora is None else lora.adapter_id, None if lora is None else lora.name)


def _medium_of(order: Order) -> Tier | None:
    """The tier a completing order makes a kv copy resident in."""
    if isinstance(order, (StoreOrder, PromoteOrder)):
        return DRAM
    if isinstance(order, WriteOrder):
        return SSD
    return None


class KVEvents:
    """Residency of saria's chunks per medium, turned into vLLM KV events (module docstring).

    Fed by :class:`~.scheduler.SariaScheduler`: :meth:`remember` at a commit, :meth:`sent` with
    every order batch in metadata order, :meth:`completed` with every merged completion,
    :meth:`recovered` with the SSD objects a control plane took over, :meth:`restart` when a new
    control plane is built. :meth:`take` drains the events for vLLM's publisher."""

    def __init__(self, *, chunk_tokens: int, block_size: int, hash_tokens: int, group: int = 0,
                 max_chunks: int = DEFAULT_MAX_CHUNKS):
        if chunk_tokens % block_size or block_size % hash_tokens:
            raise ValueError(f"KVEvents: chunk_tokens ({chunk_tokens}) must be whole blocks ({block_size}) of whole "
                             f"hash blocks ({hash_tokens})")
        self.chunk_tokens, self.block_size, self.hash_tokens = chunk_tokens, block_size, hash_tokens
        self.group = group
        self.max_chunks = max_chunks
        self.on = True
        self._payloads: dict[Hashable, ChunkPayload] = {}  # chunk name -> payload (resident or pending)
        self._resident: dict[Hashable, set[Tier]] = {}
        self._pending: dict[int, tuple[Tier, tuple[Hashable, ...]]] = {}  # order id -> (tier, kv chunks)
        self._pending_refs: dict[Hashable, int] = {}  # chunk name -> orders in flight naming it
        self._recoverable: set[Hashable] = set()  # SSD chunks a rebuilt control plane may take over
        self._queue: list[tuple[bool, Tier, Hashable, ChunkPayload]] = []  # (stored?, tier, name, payload)
        self.skipped = 0  # chunks not announced: the bound was full

    # --- feeding -----------------------------------------------------------------------------------

    def remember(self, request: Any, names: Sequence[Hashable], orders: Iterable[Order]) -> None:
        """At a commit: keep the payload of each of the request's chunks (``names[i]`` is chunk
        ``i``) that ``orders`` store, promote or write, unless known already or the bound is full."""
        if not self.on:
            return
        try:
            index = {name: i for i, name in enumerate(names)}
            for order in orders:
                if _medium_of(order) is None:
                    continue
                for name in order.kv:
                    if name in self._payloads or name not in index:
                        continue
                    if len(self._payloads) >= self.max_chunks:
                        self.skipped += 1
                        continue
                    payload = chunk_payload(request, index[name], chunk_tokens=self.chunk_tokens,
                                            block_size=self.block_size, hash_tokens=self.hash_tokens)
                    if payload is not None:
                        self._payloads[name] = payload
        except Exception as exc:
            self._fault("remember", exc)

    def sent(self, orders: Iterable[Order]) -> None:
        """Orders going to the workers, in the order they run: a drop removes its chunks from its
        tier now (the control plane has taken the copy back); a store, promotion or write is
        pending until :meth:`completed`."""
        if not self.on:
            return
        try:
            orders = list(orders)
            # the copies first: a drop earlier in the batch (the control plane taking back an old
            # copy it writes again) must not forget the payload a later write announces
            for order in orders:
                tier = _medium_of(order)
                names = tuple(name for name in order.kv if name in self._payloads)
                if isinstance(order, DropOrder) or tier is None or not names:
                    continue
                self._pending[order.order_id] = (tier, names)
                for name in names:
                    self._pending_refs[name] = self._pending_refs.get(name, 0) + 1
            for order in orders:
                if isinstance(order, DropOrder):
                    for name in order.kv:
                        self._leave(name, order.tier)
        except Exception as exc:
            self._fault("sent", exc)

    def completed(self, order_id: int, ok: bool, failed: Iterable[Any] = ()) -> None:
        """An order ended on every worker: its kv copies that did not fail are resident now."""
        if not self.on:
            return
        try:
            entry = self._pending.pop(order_id, None)
            if entry is None:
                return
            tier, names = entry
            bad = {getattr(key, "chunk", key) for key in failed if getattr(key, "kind", KV) == KV}
            for name in names:
                refs = self._pending_refs.get(name, 1) - 1
                if refs > 0:
                    self._pending_refs[name] = refs
                else:
                    self._pending_refs.pop(name, None)
                if ok and name not in bad:
                    self._enter(name, tier)
                else:
                    self._forget_if_idle(name)
        except Exception as exc:
            self._fault("completed", exc)

    def recovered(self, keys: Iterable[Any]) -> None:
        """SSD objects a control plane took over (``ControlPlane.recover_ssd``): announced again
        if a control plane of this run had announced them before it was rebuilt."""
        if not self.on:
            return
        try:
            for key in keys:
                name = getattr(key, "chunk", key)
                if getattr(key, "kind", KV) == KV and name in self._recoverable:
                    self._enter(name, SSD)
            self._drop_recoverable()
        except Exception as exc:
            self._fault("recovered", exc)

    def restart(self) -> None:
        """A new control plane (a rebuild after a fault, a reset): it holds nothing yet, so every
        resident chunk is removed from every tier. The payloads of SSD chunks stay until the new
        control plane's SSD takeover (:meth:`recovered`), which may find them again."""
        if not self.on:
            return
        try:
            self._drop_recoverable()
            ssd = {name: self._payloads[name] for name, tiers in self._resident.items() if SSD in tiers}
            self._leave_all()
            self._payloads.update(ssd)
            self._recoverable = set(ssd)
        except Exception as exc:
            self._fault("restart", exc)

    def close(self) -> None:
        """saria turned off: every resident chunk is removed; nothing is recorded from now on."""
        if not self.on:
            return
        try:
            self._drop_recoverable()
            self._leave_all()
        except Exception as exc:
            self._fault("close", exc)
        self.on = False
        self._payloads.clear()

    # --- draining ----------------------------------------------------------------------------------

    def take(self) -> list:
        """The events since the last call, as vLLM's ``BlockStored`` / ``BlockRemoved``, in the
        order their changes happened (removals of one step and tier grouped into one event)."""
        queue, self._queue = self._queue, []
        if not queue:
            return []
        try:
            return self._build(queue)
        except Exception as exc:
            self._fault("take", exc)
            return []

    def stats(self) -> dict[str, int]:
        """Sizes of the bookkeeping (tests, debugging)."""
        return {"payloads": len(self._payloads), "resident": len(self._resident), "pending": len(self._pending),
                "skipped": self.skipped}

    def resident(self) -> dict[Hashable, frozenset[Tier]]:
        """The chunks announced as resident, with their tiers."""
        return {name: frozenset(tiers) for name, tiers in self._resident.items()}

    # --- internals ---------------------------------------------------------------------------------

    def _enter(self, name: Hashable, tier: Tier) -> None:
        payload = self._payloads.get(name)
        tiers = self._resident.setdefault(name, set())
        if payload is None or tier in tiers:
            if not tiers:
                del self._resident[name]
            return
        tiers.add(tier)
        self._queue.append((True, tier, name, payload))

    def _leave(self, name: Hashable, tier: Tier) -> None:
        tiers = self._resident.get(name)
        if tiers is not None and tier in tiers:
            tiers.discard(tier)
            self._queue.append((False, tier, name, self._payloads[name]))
            if not tiers:
                del self._resident[name]
        self._forget_if_idle(name)

    def _leave_all(self) -> None:
        for name, tiers in list(self._resident.items()):
            for tier in sorted(tiers):
                self._queue.append((False, tier, name, self._payloads[name]))
        self._resident.clear()
        self._pending.clear()
        self._pending_refs.clear()
        self._payloads.clear()

    def _drop_recoverable(self) -> None:
        recoverable, self._recoverable = self._recoverable, set()
        for name in recoverable:
            self._forget_if_idle(name)

    def _forget_if_idle(self, name: Hashable) -> None:
        if name not in self._resident and name not in self._pending_refs and name not in self._recoverable:
            self._payloads.pop(name, None)

    def _fault(self, where: str, exc: BaseException) -> None:
        # the exception's type only: its message may name a chunk (a key's repr), which no log line may carry
        log.warning("saria: KV events off for the rest of this run (%s failed: %s); routers learn nothing more "
                    "about saria's tiers", where, type(exc).__name__)
        self.on = False
        self._queue, self._payloads, self._resident, self._pending = [], {}, {}, {}
        self._pending_refs, self._recoverable = {}, set()

    def _build(self, queue: list) -> list:
        from .compat import BlockRemoved, BlockStored, maybe_convert_block_hash

        out: list = []
        removed: dict[Tier, list] = {}  # a run of removals, per tier, becomes one event per tier

        def flush() -> None:
            for tier, hashes in removed.items():
                out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM[tier], group_idx=self.group))
            removed.clear()

        for stored, tier, _, payload in queue:
            if not stored:
                removed.setdefault(tier, []).extend(maybe_convert_block_hash(h) for h in payload.block_hashes)
                continue
            flush()
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in payload.block_hashes],
                parent_block_hash=None if payload.parent is None else maybe_convert_block_hash(payload.parent),
                token_ids=payload.tokens.tolist(), block_size=self.block_size, lora_id=payload.lora_id,
                medium=MEDIUM[tier], lora_name=payload.lora_name, group_idx=self.group))
        flush()
        return out
