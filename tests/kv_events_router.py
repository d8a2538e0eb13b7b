"""A router's end of vLLM's KV event stream for the engine tests (:class:`Subscriber`), and what a
saria run's events must say (:func:`assert_events_match_the_run`): saria's ``take_events`` through
vLLM's own ZMQ publisher (``kv_events_config``), decoded as a router decodes them (msgpack
``KVEventBatch``). Used by ``test_vllm_connector.py``'s dense session; the bookkeeping's unit and
model-based tests are in ``test_vllm_events.py``."""

from __future__ import annotations

import threading

import msgspec
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

CHUNK = 64  # two 32-token vLLM blocks per chunk
BLOCK = 32
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2  # the dense test model: 4 layers, K and V, 2 KV heads, head dim 64, bf16


class Subscriber:
    """A router's end of vLLM's event stream: a SUB socket bound here (vLLM's publisher connects to
    a non-wildcard tcp endpoint), every batch decoded on a thread until :meth:`close`."""

    def __init__(self):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind("tcp://127.0.0.1:0")
        self.endpoint = self._sub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.batches: list[KVEventBatch] = []
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.batches.append(self._decoder.decode(payload))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        self._ctx.term()

    def events(self) -> list:
        return [e for batch in self.batches for e in batch.events]


def assert_events_match_the_run(run: dict, prompts: list[list[int]], events: list) -> None:
    """Every saria event is a whole chunk of a prompt vLLM hashed (``run`` with
    ``record_block_hashes``): its blocks' hashes as vLLM's events carry them, the block before as
    parent, the chunk's tokens, vLLM's block size; stores in CPU (DRAM) and STORAGE (SSD); each
    residency announced once and removed only after; every later turn's reused prefix is blocks
    saria had announced."""
    hashes = [[maybe_convert_block_hash(bytes.fromhex(h)) for h in request] for request in run["block_hashes"]]
    assert len(hashes) == len(prompts)
    ours = [e for e in events if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    stored = [e for e in ours if isinstance(e, BlockStored)]
    assert {e.medium for e in stored} == {"CPU", "STORAGE"}, [(type(e).__name__, e.medium) for e in ours]
    assert any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in ours)  # DRAM evictions

    # every stored event is a whole chunk of a prompt, exactly as vLLM names its blocks
    chunks = {}
    for turn, (prompt, blocks) in enumerate(zip(prompts, hashes)):
        for c in range(len(blocks) * BLOCK // CHUNK):
            run_ = blocks[c * 2:c * 2 + 2]
            chunks[tuple(run_)] = (blocks[c * 2 - 1] if c else None, prompt[c * CHUNK:(c + 1) * CHUNK])
    for e in stored:
        assert tuple(e.block_hashes) in chunks, "a stored event that is no chunk of any prompt"
        parent, tokens = chunks[tuple(e.block_hashes)]
        assert (e.parent_block_hash, e.token_ids, e.block_size, e.lora_id) == (parent, tokens, BLOCK, None)
        assert e.extra_keys is None and e.session_id is None

    # a router's view: each (block, medium) stored once, removed only once stored
    held: set = set()
    for e in ours:
        for h in e.block_hashes:
            if isinstance(e, BlockStored):
                assert (h, e.medium) not in held
                held.add((h, e.medium))
            else:
                assert (h, e.medium) in held
                held.discard((h, e.medium))

    # the prefixes the later turns reused are blocks saria announced
    announced = {h for e in stored for h in e.block_hashes}
    turns = run["turns"]
    assert any(t["cached_tokens"] > 0 for t in turns[1:]), [t["cached_tokens"] for t in turns]
    for turn, t in enumerate(turns[1:], start=1):  # (a turn after its SSD objects were corrupted may reuse none)
        reused = hashes[turn][:t["cached_tokens"] // BLOCK]
        assert set(reused) <= announced, turn
    assert any(t["ssd_tokens"] > 0 for t in turns)  # a reuse from the SSD chunks announced as STORAGE
