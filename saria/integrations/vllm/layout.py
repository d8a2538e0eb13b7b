"""Where a worker rank stands in vLLM's parallel layout, where its SSD store lives, and what its
objects are: the identity its store's superblock records.

Under tensor parallelism (TP) each worker holds some KV heads (and GDN state heads) of every
layer; under pipeline parallelism (PP) each stage holds some layers. Every rank of a server packs,
stores and reloads only its own shard of each object, so a chunk's objects are ``tp * pp`` shards,
one per rank. The scheduler's one control plane decides for all of them; each rank executes the
same orders on its shard.

Each rank keeps its own SSD store, in the directory ``rank<r>`` (``dp<d>-rank<r>`` for data
parallel replicas) under every one of the user's ``ssd_paths``: ranks never lock each other out,
and each store's superblock records the identity of what it holds (:func:`store_identity`): the
model, its dtypes, the page geometry and layout, the chunk size, vLLM's block hashing and the
parallel layout with the rank. A store written for another identity is wiped when opened, never
served (a server restarted with another TP size starts empty).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from saria.safe_files import UnsafePath, open_private_dir

IDENTITY_VERSION = 1


@dataclass(frozen=True)
class ParallelLayout:
    """One rank of a server: its TP and PP coordinates (and its data parallel replica)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, name in ((self.tp_size, self.tp_rank, "tp"), (self.pp_size, self.pp_rank, "pp"),
                                 (self.dp_size, self.dp_rank, "dp")):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"saria: {name} rank {rank} of {size} is not a parallel layout")

    @property
    def shards(self) -> int:
        """Worker ranks of one server (one engine): each holds a shard of every object."""
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """This worker's rank within its server, PP stage major (as vLLM numbers them)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def directory_name(self) -> str:
        return f"rank{self.rank}" if self.dp_size == 1 else f"dp{self.dp_rank}-rank{self.rank}"

    @classmethod
    def of_server(cls, parallel_config: Any) -> "ParallelLayout":
        """The server's sizes (rank 0): what the scheduler needs. Context parallelism (prefill or
        decode: a block's tokens split over ranks) is refused: saria does not shard objects so."""
        extra = {name: getattr(parallel_config, name, 1) for name in
                 ("prefill_context_parallel_size", "decode_context_parallel_size")}
        if any(size != 1 for size in extra.values()):
            raise ValueError(f"saria does not support context parallelism ({extra}); tensor and pipeline "
                             "parallelism are supported")
        return cls(tp_size=parallel_config.tensor_parallel_size, pp_size=parallel_config.pipeline_parallel_size,
                   dp_size=parallel_config.data_parallel_size, dp_rank=parallel_config.data_parallel_rank)

    @classmethod
    def of_this_worker(cls, parallel_config: Any) -> "ParallelLayout":
        """This worker process's coordinates, from vLLM's initialised process groups."""
        from .compat import get_pp_group, get_tensor_model_parallel_rank

        server = cls.of_server(parallel_config)
        return cls(tp_size=server.tp_size, tp_rank=get_tensor_model_parallel_rank(), pp_size=server.pp_size,
                   pp_rank=get_pp_group().rank_in_group, dp_size=server.dp_size, dp_rank=server.dp_rank)


def rank_directories(ssd_paths: tuple[str, ...], layout: ParallelLayout) -> list[str]:
    """This rank's store directory under each of the user's drive directories, created 0700 if
    missing (the drive directory itself must exist: a missing drive is an error, not a new folder).
    One that exists must be saria's own (docs/security.md, "Files on the box"): a real directory,
    not a symbolic link, owned by the user running saria, that group and other cannot write
    (another user may have made it first on a shared mount); it is made 0700 if group or other
    could read it. A ``ValueError`` of one line otherwise."""
    out = []
    for path in ssd_paths:
        drive = Path(path)
        if not drive.is_dir():
            raise ValueError(f"saria: SSD path {path} is not an existing directory")
        directory = drive / layout.directory_name
        try:
            os.close(open_private_dir(directory, create=True, tighten=True))
        except UnsafePath as exc:
            raise ValueError(f"saria: SSD rank directory {exc}: refused (saria keeps its store only in a "
                             "directory of its own user that no one else can write)") from None
        out.append(str(directory))
    return out


def model_identity(vllm_config: Any) -> dict[str, Any]:
    """What of vLLM's configuration decides the bytes of an object and the hashes that name it, and
    what identifies the weights: for a local model directory, its weight files as they are
    (:func:`weight_files_digest`); for a hub name, the commit the local cache resolves it to
    (:func:`hub_commit`)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf_config = getattr(model, "hf_config", None)
    try:
        config_text = hf_config.to_json_string(use_diff=False) if hf_config is not None else ""
    except Exception:  # a config that cannot print itself: its repr still tells models apart
        config_text = repr(hf_config)
    name = str(model.model)
    if len(name) > 200:  # the identity must fit a superblock: a long path by its digest
        name = "blake2b:" + hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    return {"model": name, "revision": str(getattr(model, "revision", None)),
            "hf_config": hashlib.blake2b(config_text.encode(), digest_size=8).hexdigest(),
            "weights": weight_files_digest(str(model.model))
            or hub_commit(str(model.model), getattr(model, "revision", None),
                          getattr(getattr(vllm_config, "load_config", None), "download_dir", None)),
            "dtype": str(model.dtype), "cache_dtype": str(cache.cache_dtype),
            "hash": str(getattr(cache, "prefix_caching_hash_algo", None)),
            "hash_seed": hashlib.blake2b(_hash_seed(cache).encode(), digest_size=8).hexdigest()}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weight_files_digest(model: str) -> str:
    """For a model in a local directory: a digest of its weight files' names, sizes and modification
    times, so that checkpoint files rewritten in place (a trainer saving new weights where the server
    loads them) give another identity, and a restart does not serve the old weights' SSD objects.
    ``""`` for a model that is not a local directory (a hub name: :func:`hub_commit` names it)."""
    path = Path(model)
    try:
        if not path.is_dir():
            return ""
        files = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file())
        h = hashlib.blake2b(digest_size=8)
        for p in files:
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return h.hexdigest()
    except OSError:  # unreadable: the identity still names the model by its path
        return ""


_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_commit(model: str, revision: str | None, cache_dir: str | None = None) -> str:
    """For a hub model name: ``"hub:<commit>"``, the commit its weights come from as far as this
    machine knows, with no network: ``revision`` itself when it is a commit, else what the local
    Hugging Face cache resolves ``revision`` (default ``main``) to (``refs/<revision>``, written when
    vLLM fetched the model). A server whose cache resolves ``main`` to another commit has other
    weights: another identity, clean misses. ``""`` when unknown (no cache entry, another hub)."""
    if revision is not None and _COMMIT.fullmatch(str(revision)):
        return f"hub:{revision}"
    if revision is not None and ("/" in str(revision) or str(revision) in (".", "..")):
        return ""  # a branch name with a slash resolves in a subfolder of refs/: not followed here
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
        from huggingface_hub.file_download import repo_folder_name

        ref = (Path(cache_dir or HF_HUB_CACHE) / repo_folder_name(repo_id=model, repo_type="model") / "refs"
               / str(revision or "main"))
        fd = os.open(ref, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            commit = os.read(fd, 64).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
    except Exception:  # not in the cache, a name the hub would refuse, no huggingface_hub: unknown
        return ""
    return f"hub:{commit}" if _COMMIT.fullmatch(commit) else ""


def _hash_seed(cache_config: Any) -> str:
    """The seed vLLM's block hashes start from (``vllm.v1.core.kv_cache_utils.init_none_hash``, which
    runs in the engine process, not in a worker): ``PYTHONHASHSEED``, else a fixed one for
    cryptographic hashes; a non-cryptographic hash without it gets a random seed in every run, so
    no block hash repeats across runs, and neither does this (a store of such a run is wiped)."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if "xxhash" in str(getattr(cache_config, "prefix_caching_hash_algo", "sha256")):
        return os.urandom(16).hex()
    return "vllm-none-hash"


def page_format(views: Mapping[str, list[Any]]) -> str:
    """A digest of how the pages are laid out: per layer, each paged tensor's dtype, page shape and
    dimension order (what a packed object's bytes mean; two attention backends can give pages of
    the same size whose bytes mean different things)."""
    parts = []
    for name, tensors in views.items():
        for t in tensors:
            order = sorted(range(1, t.dim()), key=lambda d: -t.stride(d))
            parts.append(f"{name}:{t.dtype}:{tuple(t.shape[1:])}:{order}")
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def store_identity(model: Mapping[str, Any], layout: ParallelLayout, **geometry: Any) -> str:
    """The identity a rank's SSD store records: canonical JSON of the model identity, the object
    geometry (``geometry``: chunk tokens, bytes per token and per state, page layout digest, ...)
    and the parallel layout with the rank."""
    identity = {"saria_objects": IDENTITY_VERSION, **model, **geometry, "tp": layout.tp_size, "pp": layout.pp_size,
                "rank": layout.rank}
    return json.dumps(identity, sort_keys=True, separators=(",", ":"))
