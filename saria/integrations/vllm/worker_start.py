"""Starting a worker rank's data plane on vLLM's paged KV cache: vLLM's layer tensors as saria's
page tables (one over every full-attention layer, one over the GDN state layers of a hybrid
model), the configuration sized by the connector's options and the rank's share, the SSD store's
identity and directories for this rank, and the objects a previous run left in that store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from saria.dataplane.build import DataPlaneParts, open_data_plane
from saria.dataplane.ssd.keys import parse_object_key
from saria.kernels import PageTable
from saria.orders import ObjectKey
from saria.seal import Keyring, Sealer
from saria.ssd_dtype import FP8_FORMAT

from .cluster import WorkerCluster
from .geometry import EngineGeometry
from .layout import ParallelLayout, page_format, rank_directories, store_identity
from .resets import forget_previous_weights
from .settings import ConnectorSettings

log = logging.getLogger("saria.vllm")


def page_views(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """A layer's KV cache as paged tensors whose dim 0 indexes vLLM blocks.

    vLLM 0.32 layer views put the block id first (``[num_blocks, ...]``, whatever the order inside
    a block); the older ``[2, num_blocks, ...]`` layout is two paged tensors (K and V).
    """
    if tensor.dim() >= 1 and tensor.shape[0] == num_blocks:
        return [tensor]
    if tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        return [tensor[0], tensor[1]]
    raise ValueError(f"saria cannot find the block dimension of layer {name!r}: shape {tuple(tensor.shape)}, "
                     f"{num_blocks} blocks (expected [num_blocks, ...] or [2, num_blocks, ...])")


@dataclass
class RankDataPlane:
    """A worker rank's open data plane: ``parts`` (close them), the pages it moves (``kv_views``:
    every full-attention layer's paged tensors; ``state_table`` for a hybrid model) and
    ``inventory``: the objects its SSD store holds from a previous run (``{key: 1}``); ``cluster``:
    its cluster tier (close it before ``parts``), when the settings name a master; ``layer_tensors``:
    how many of ``kv_views`` each full-attention layer is, in order (the layer-wise reload's layers)."""

    parts: DataPlaneParts
    kv_views: list[torch.Tensor]
    state_table: PageTable | None
    inventory: dict[ObjectKey, int]
    cluster: WorkerCluster | None = None
    layer_tensors: tuple[int, ...] = ()  # per full-attention layer, how many of kv_views are its (in order)


def open_rank(settings: ConnectorSettings, geometry: EngineGeometry, layout: ParallelLayout, model: dict[str, Any],
              num_blocks: int, kv_caches: dict[str, torch.Tensor], *, keyring: Keyring | None = None,
              start: bool = True) -> RankDataPlane:
    """Open this rank's data plane over vLLM's registered ``kv_caches``; ``ValueError`` where they
    are not what vLLM's spec said. ``keyring`` (the connector's ``secret_file``): the SSD store and
    the cluster tier seal their objects, each with a :class:`~saria.seal.Sealer` bound to its kind
    and its identity (this rank's: an object moved to another rank, model or layout fails its tag).
    ``start``: the server's start, where a store a previous run reset is emptied
    (:func:`~.resets.forget_previous_weights`); False for a reopen within the run."""
    g = geometry
    block_size = g.block_size
    views = _views(g.attention_layers + g.state_layers, kv_caches, num_blocks)
    kv_views = [v for name in g.attention_layers for v in views[name]]
    table = PageTable(kv_views)
    if table.bytes_per_page != g.kv_bytes_per_token * block_size:
        raise ValueError(f"saria: attention pages hold {table.bytes_per_page} B, vLLM's spec says "
                         f"{g.kv_bytes_per_token * block_size}")
    state_table = None
    if g.hybrid:
        state_table = PageTable([v for name in g.state_layers for v in views[name]])
        if state_table.bytes_per_page != g.state_bytes:
            raise ValueError(f"saria: GDN pages hold {state_table.bytes_per_page} B of state, vLLM's spec "
                             f"says {g.state_bytes}")
    config = settings.saria_config(block_size=block_size, kv_bytes_per_token=g.kv_bytes_per_token,
                                   state_bytes=g.state_bytes, shards=layout.shards,
                                   kv_element_bytes=g.kv_element_bytes)
    # an FP8 store's objects are not a bf16 store's: the identity says so (and a store written in
    # the other form is wiped at open, with a log line); "auto" keeps the identity of earlier runs
    stored = {"ssd_format": FP8_FORMAT} if config.ssd_dtype == "fp8" else {}
    geometry = dict(block_size=block_size, chunk_tokens=config.chunk.chunk_tokens,
                    kv_bytes_per_token=g.kv_bytes_per_token, state_bytes=g.state_bytes, pages=page_format(views))
    identity = store_identity(model, layout, **geometry, **stored)
    directories = rank_directories(settings.ssd_paths, layout) if config.ssd_bytes else []
    # sealed: the superblock records a MAC of the identity under the key file's naming root (no model
    # name on the drive; another key file, or a rekey, reads as another identity: wiped at open);
    # the parts' associated data binds the identity itself
    sealed = {} if keyring is None else {"ssd_sealer": Sealer(keyring, "ssd", identity)}
    recorded = identity if keyring is None else keyring.store_label(identity)
    parts = open_data_plane(config, table, block_tokens=block_size, state_table=state_table,
                            ssd_paths=directories, ssd_identity=recorded, coordinator_mode=settings.coordinator,
                            durable=settings.durable,
                            staging_bytes=settings.cluster_staging_bytes if settings.cluster else 0, **sealed)
    if start:  # a previous run's objects of weights this one does not load (not this run's: a reopen)
        forget_previous_weights(parts.ssd, directories)
    inventory = take_inventory(parts)
    cluster = None
    if settings.cluster:
        if g.hybrid:
            parts.close()
            raise ValueError("saria: the cluster tier serves dense (attention-only) models; this one is hybrid")
        try:  # cluster objects are the DRAM tier's exact bytes, whatever the SSD stores
            cluster_identity = store_identity(model, layout, **geometry)
            sealer = {} if keyring is None else {"sealer": Sealer(keyring, "cluster", cluster_identity)}
            # sealed: object keys are derived from the label, never from the model's identity itself
            named = cluster_identity if keyring is None else keyring.store_label(cluster_identity)
            cluster = WorkerCluster(parts.engine, settings.cluster, named,
                                    staging_bytes=settings.cluster_staging_bytes, local_hostname=settings.cluster_host,
                                    timeout_s=settings.cluster_timeout_s, **sealer)
        except BaseException:
            parts.close()
            raise
    # what the user asked for and what is taken: pinned host memory, preallocated drive files
    log.info("saria worker rank %d of %d: %d attention + %d GDN layers, %d B per page; %s%s%s",
             layout.rank, layout.shards, len(g.attention_layers), len(g.state_layers), table.bytes_per_page,
             parts.sizing.describe(), f"; SSD store {parts.ssd.backend_name}, {len(inventory)} object(s) from a "
             "previous run" if parts.ssd else "",
             "; SSD and cluster objects sealed" if keyring is not None else "")
    return RankDataPlane(parts, kv_views, state_table, inventory, cluster,
                         tuple(len(views[name]) for name in g.attention_layers))


def _views(layers: tuple[str, ...], kv_caches: dict[str, torch.Tensor], num_blocks: int
           ) -> dict[str, list[torch.Tensor]]:
    """Each layer's paged tensors (:func:`page_views`)."""
    missing = [name for name in layers if name not in kv_caches]
    if missing:
        raise ValueError(f"saria: vLLM registered no KV cache for layer(s) {missing}")
    return {name: page_views(name, kv_caches[name], num_blocks) for name in layers}


def take_inventory(parts: DataPlaneParts) -> dict[ObjectKey, int]:
    """The objects in this rank's SSD store (``{key: 1}``, one rank's count): at start, those a
    previous run left; after the scheduler replaced its control plane, those this run kept. Only
    committed objects are in a store's index (a write in flight is not, one that failed never
    is). A key no saria object has (not ours) is deleted."""
    ssd = parts.ssd
    inventory: dict[ObjectKey, int] = {}
    for key in ssd.keys() if ssd is not None else ():
        try:
            chunk, kind = parse_object_key(key)
        except ValueError:
            ssd.delete(key)
            continue
        inventory[ObjectKey(chunk, kind)] = 1
    return inventory
