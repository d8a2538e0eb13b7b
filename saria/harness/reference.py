"""The reference a saria run's outputs are held against: plain vLLM with the same history.

``ReferenceConnector`` is a KV connector for vLLM that is obviously correct and knows nothing of
saria (no saria module is imported here). It keeps, in a dict, a copy of every full prompt page
vLLM computes, keyed by vLLM's block hash, and at a request's start loads exactly as many leading
tokens as it is told to (``kv_transfer_params["load_tokens"]``), copying the pages it kept into
the request's blocks before the forward (a synchronous load). Run the same prompts in the same
order, each told to load what saria's run reused, and every step of the reference computes
exactly what the same step of saria's run computed, over the same KV: by induction, wherever saria
restored the bytes vLLM computed (its audit checks that), the outputs are bit-identical on every
CPU, however vLLM's arithmetic rounds a prefix computed in one split or another
(``docs/numerics.md``).

One subtlety makes it more than a dict. A block computed in two steps of the run (recomputed
after saria dropped it, or because an earlier chunk of its prompt was missing) may hold two
*versions* whose last bits differ (vLLM tiles a step's attention from where its query starts).
Which one saria kept is saria's business (a DRAM copy may be newer than its SSD copy); the
reference keeps every version and loads the one saria served, named by the digest saria's audit
took of each page it reloaded (``picks``: per rank, per chunk hash, the digest tuples in the order
saria served them). A digest names a version among pages vLLM computed in this run; it never puts
saria's bytes in the reference. Where a block has one version the pick is not needed.

Per request (``SamplingParams(extra_args={"kv_transfer_params": {...}})``):

* ``load_tokens``: leading prompt tokens to load (whole blocks; 0: compute everything);
* ``save``: keep the pages this request computes (False for the full-recomputation baseline,
  whose pages are not part of the history);
* ``history``: a name; pages are kept and found per history, so one engine can replay several
  runs one after another without one seeing another's pages;
* ``picks`` (optional): ``[{chunk hash hex: [[page digest hex, ...], ...]}]`` per worker rank.

The worker's counters (:func:`reference_snapshot`): ``loaded_pages``, ``saved_pages``,
``versions_max`` (most versions of one block), ``ambiguous`` (loads of a block with several
versions and no pick: the newest was taken), ``unmatched`` (a pick that names no version: saria
served a page vLLM never computed, which its audit reports too) and ``missing`` (a block to load
that the history never computed: vLLM recomputes it). A faithful reference has the last three 0.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

log = logging.getLogger("saria.reference")
DIGEST_BYTES = 16  # the page digest of saria's audit: blake2b, 16 bytes, over every attention layer


def page_digest(pages: list[torch.Tensor]) -> str:
    """blake2b over one block's page of every attention layer, in layer order (as saria's audit)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for page in pages:
        h.update(page.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class BlockLoad:
    history: str
    block_hash: bytes
    block_id: int
    picks: list[str | None]  # per rank: the digest of the version to load (None: not named)


@dataclass
class BlockSave:
    history: str
    block_hash: bytes
    block_id: int


@dataclass
class ReferenceMetadata(KVConnectorMetadata):
    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


class ReferenceConnector(KVConnectorBase_V1):
    """See the module docstring. Dense (attention-only) models."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        # scheduler side
        self._requests: dict[str, Any] = {}  # request id -> vLLM's Request
        self._loads: list[BlockLoad] = []  # this step's, from update_state_after_alloc
        self._picks: dict[str, list[dict[str, list[list[str]]]]] = {}  # history -> per rank: chunk -> digests
        self._served: dict[tuple[str, int, str], int] = {}  # (history, rank, chunk hex) -> picks consumed
        # worker side
        self._layers: list[torch.Tensor] = []
        self._num_blocks = 0
        self._versions: dict[tuple[str, bytes], list[tuple[str, list[torch.Tensor]]]] = {}
        self._errors: set[int] = set()
        self.counters = {"loaded_pages": 0, "saved_pages": 0, "versions_max": 0, "ambiguous": 0, "unmatched": 0,
                         "missing": 0}

    # --- scheduler side ----------------------------------------------------------------------------

    @staticmethod
    def _params(request: Any) -> dict[str, Any]:
        return request.kv_transfer_params or {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = self._params(request)
        self._requests[request.request_id] = request
        history = str(params.get("history", ""))
        if "picks" in params and history not in self._picks:
            self._picks[history] = params["picks"]
        load = int(params.get("load_tokens", 0))
        if load % self.block_size or load >= request.num_prompt_tokens or load > len(request.block_hashes) * \
                self.block_size:
            raise ValueError(f"reference: cannot load {load} tokens of a {request.num_prompt_tokens}-token prompt "
                             f"in {self.block_size}-token blocks")
        return max(0, load - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        params = self._params(request)
        history = str(params.get("history", ""))
        if request.num_computed_tokens:
            raise ValueError("the reference connector runs with vLLM's prefix cache off")
        block_ids = blocks.get_block_ids()[0]
        hashes = request.block_hashes[:num_external_tokens // self.block_size]
        picks = self._pick(history, hashes)
        self._loads += [BlockLoad(history, h, block_ids[i], picks[i]) for i, h in enumerate(hashes)]

    def _pick(self, history: str, hashes: list[bytes]) -> list[list[str | None]]:
        """Per block of ``hashes`` (a prompt's leading blocks), per rank: the digest of the version
        saria served, from its audit's picks in the order it served them (a chunk's digests cover
        the blocks ending at the block whose hash is the chunk's)."""
        ranks = self._picks.get(history) or []
        out: list[list[str | None]] = [[None] * max(1, len(ranks)) for _ in hashes]
        for j, h in enumerate(hashes):
            key = h.hex() if isinstance(h, bytes) else str(h)
            for r, served in enumerate(ranks):
                seen = served.get(key)
                if not seen:
                    continue
                n = self._served.get((history, r, key), 0)
                if n >= len(seen):
                    continue  # served fewer times than loaded: the worker takes the only version
                self._served[(history, r, key)] = n + 1
                digests = seen[n]
                for i, digest in enumerate(digests):
                    if 0 <= j - len(digests) + 1 + i < len(hashes):
                        out[j - len(digests) + 1 + i][r] = digest
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ReferenceMetadata(loads=self._loads)
        self._loads = []
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            params = self._params(request) if request is not None else {}
            if request is None or not params.get("save", False):
                continue
            done = min(request.num_computed_tokens + scheduled, request.num_prompt_tokens)
            first, last = -(-request.num_computed_tokens // self.block_size), done // self.block_size
            if last <= first:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            history = str(params.get("history", ""))
            meta.saves += [BlockSave(history, request.block_hashes[i], block_ids[i]) for i in range(first, last)]
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return False, None

    # --- worker side -------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups = self._kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError("the reference connector holds dense (attention-only) models")
        names = [name for name in groups[0].layer_names if name in kv_caches]
        self._num_blocks = self._kv_cache_config.num_blocks
        self._layers = [self._paged(kv_caches[name]) for name in names]

    def _paged(self, tensor: torch.Tensor) -> torch.Tensor:
        """The layer's cache with the block id first (vLLM 0.32: it already is)."""
        if tensor.shape[0] != self._num_blocks:
            raise ValueError(f"the reference connector expects [num_blocks, ...] layer caches, got "
                             f"{tuple(tensor.shape)} for {self._num_blocks} blocks")
        return tensor

    def _rank(self) -> int:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, \
            get_tensor_model_parallel_world_size

        return get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + \
            get_tensor_model_parallel_rank()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        rank = self._rank() if meta.loads else 0
        for load in meta.loads:
            versions = self._versions.get((load.history, load.block_hash))
            if not versions:
                self._count("missing", load)
                self._errors.add(load.block_id)
                continue
            pick = load.picks[rank] if rank < len(load.picks) else None
            chosen = versions[-1]
            if pick is not None:
                named = [v for v in versions if v[0] == pick]
                if named:
                    chosen = named[0]
                else:
                    self._count("unmatched", load)
            elif len(versions) > 1:
                self._count("ambiguous", load)
            for layer, page in zip(self._layers, chosen[1]):
                layer[load.block_id].copy_(page)
            self.counters["loaded_pages"] += 1

    def _count(self, what: str, load: BlockLoad) -> None:
        """A load the reference could not replay faithfully: counted, and said (a server's log)."""
        self.counters[what] += 1
        log.warning("saria reference: %s page load of block %d", what, load.block_id)  # (a history may be named by a salt)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        """After the forward: keep a copy of every prompt page this step completed."""
        for save in self._get_connector_metadata().saves:
            pages = [layer[save.block_id].clone() for layer in self._layers]
            digest = page_digest(pages)
            versions = self._versions.setdefault((save.history, save.block_hash), [])
            if all(d != digest for d, _ in versions):
                versions.append((digest, pages))
                self.counters["versions_max"] = max(self.counters["versions_max"], len(versions))
            self.counters["saved_pages"] += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


def reference_snapshot(worker: Any = None) -> dict[str, int]:
    """This worker's reference counters (run on every worker by ``LLM.collective_rpc``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    connector = get_kv_transfer_group() if has_kv_transfer_group() else None
    return dict(connector.counters) if isinstance(connector, ReferenceConnector) else {}
