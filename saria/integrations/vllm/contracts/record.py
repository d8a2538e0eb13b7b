"""Record what a vLLM release offers saria's connector, read from that release's wheel.

    python -m saria.integrations.vllm.contracts.record 0.32.0 0.33.0 0.34.0      # pip download each
    python -m saria.integrations.vllm.contracts.record /tmp/vllm-wheels/vllm-0.34.0-*.whl
    python -m saria.integrations.vllm.contracts.record --check 0.34.0            # compare, write nothing

The wheel is opened as a zip and its Python sources parsed with :mod:`ast`: vLLM is never
imported (the records of 0.33 and 0.34 are made on a machine that runs 0.32, or none). Each
release gets one small JSON of facts, ``vllm-X.Y.Z.json`` beside this file: the members of the
classes saria's connector reads or subclasses (fields, properties, methods with their parameter
names), enum members, and the order in which vLLM's scheduler and model runners call the
connector's hooks. Facts, not vLLM's code: names and orders, no bodies.

:mod:`saria.integrations.vllm.compat` is checked against every record (``tests/test_vllm_contracts.py``),
and the installed vLLM against its own record, live.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterable

RECORD_FORMAT = 1
HERE = Path(__file__).resolve().parent

# class -> the vLLM sources it may live in (first found wins; a class that moved adds a path)
CLASSES: dict[str, tuple[str, ...]] = {
    "SchedulerOutput": ("vllm/v1/core/sched/output.py",),
    "CachedRequestData": ("vllm/v1/core/sched/output.py",),
    "NewRequestData": ("vllm/v1/core/sched/output.py",),
    "Request": ("vllm/v1/request.py",),
    "PrefillStats": ("vllm/v1/metrics/stats.py",),
    "KVCacheBlocks": ("vllm/v1/core/kv_cache_manager.py",),
    "KVConnectorOutput": ("vllm/v1/outputs.py",),
    "KVConnectorBase_V1": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "SupportsHMA": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "KVConnectorMetadata": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "KVConnectorWorkerMetadata": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "KVConnectorRole": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "KVConnectorTransferResults": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",),
    "KVConnectorStats": ("vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",),
    "KVConnectorPromMetrics": ("vllm/distributed/kv_transfer/kv_connector/v1/metrics.py",),
    "CacheHitSource": ("vllm/v1/metrics/cache_hit_source.py",),
    "KVCacheConfig": ("vllm/v1/kv_cache_interface.py",),
    "KVCacheGroupSpec": ("vllm/v1/kv_cache_interface.py",),
    "KVCacheSpec": ("vllm/v1/kv_cache_interface.py",),
    "AttentionSpec": ("vllm/v1/kv_cache_interface.py",),
    "FullAttentionSpec": ("vllm/v1/kv_cache_interface.py",),
    "MambaSpec": ("vllm/v1/kv_cache_interface.py",),
    "VllmConfig": ("vllm/config/vllm.py",),
    "ParallelConfig": ("vllm/config/parallel.py",),
    "CacheConfig": ("vllm/config/cache.py",),
    "KVTransferConfig": ("vllm/config/kv_transfer.py",),
    "DeviceConfig": ("vllm/config/device.py",),
    "ModelConfig": ("vllm/config/model.py",),
    "SchedulerConfig": ("vllm/config/scheduler.py",),
    "KVEventsConfig": ("vllm/config/kv_events.py",),
    "SpeculativeConfig": ("vllm/config/speculative.py",),
    "BlockStored": ("vllm/distributed/kv_events.py",),
    "BlockRemoved": ("vllm/distributed/kv_events.py",),
    "LoRARequest": ("vllm/lora/request.py",),
}

# the classes whose method signatures a record holds (saria subclasses or calls these methods);
# of the others, only member names
SIGNATURES = frozenset({"KVConnectorBase_V1", "SupportsHMA", "KVConnectorStats", "KVConnectorPromMetrics",
                        "KVCacheBlocks", "SchedulerOutput", "CachedRequestData", "PrefillStats",
                        "KVConnectorTransferResults"})

# module-level functions saria calls: name -> sources
FUNCTIONS: dict[str, tuple[str, ...]] = {
    "get_pp_group": ("vllm/distributed/parallel_state.py",),
    "get_tensor_model_parallel_rank": ("vllm/distributed/parallel_state.py",),
    "maybe_convert_block_hash": ("vllm/v1/core/kv_cache_utils.py",),
}

# The connector's hooks as call sites name them (vLLM's scheduler and model runners).
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "request_finished_all_groups",
                   "get_external_cache_hit_sources", "may_load_async", "has_pending_block_frees",
                   "has_pending_push_work", "take_events", "reset_cache")
WORKER_HOOKS = ("register_kv_caches", "handle_preemptions", "bind_connector_metadata", "start_load_kv",
                "wait_for_save", "get_finished", "get_transfer_results", "get_block_ids_with_load_errors",
                "build_connector_worker_meta", "clear_connector_metadata", "unregister_kv_caches",
                "restore_kv_caches")
SCHEDULER_SOURCE = "vllm/v1/core/sched/scheduler.py"
WORKER_DIR = "vllm/v1/worker/"
EXTENSIBLE_KV_CACHE = "vllm/v1/worker/extensible_kv_cache.py"


# --- reading a class --------------------------------------------------------------------------------


def params_of(args: ast.arguments) -> list[str]:
    """Parameter names in order: ``x=`` has a default, ``*`` starts keyword-only ones, ``*args``,
    ``**kwargs``, ``/`` ends positional-only ones (the same form :func:`live_params` gives)."""
    out: list[str] = []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        out.append(arg.arg + ("=" if default is not None else ""))
        if args.posonlyargs and i == len(args.posonlyargs) - 1:
            out.append("/")
    if args.vararg is not None:
        out.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        out.append("*")
    for arg, default in zip(args.kwonlyargs, args.kw_defaults):
        out.append(arg.arg + ("=" if default is not None else ""))
    if args.kwarg is not None:
        out.append("**" + args.kwarg.arg)
    return out


def live_params(fn: Any) -> list[str]:
    """:func:`params_of` for a live function (the installed vLLM's, checked against its record)."""
    import inspect

    out: list[str] = []
    star = False
    params = list(inspect.signature(fn, follow_wrapped=False).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name + ("=" if p.default is not p.empty else ""))
            if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
                out.append("/")
    return out


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if isinstance(target, ast.Attribute):
            names.add(target.attr)
        elif isinstance(target, ast.Name):
            names.add(target.id)
    return names


def _self_attributes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """``self.X`` assigned anywhere in ``fn``."""
    out = set()
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and isinstance(t.ctx, ast.Store)):
                    out.add(t.attr)
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    out = []
    for b in node.bases:
        if isinstance(b, ast.Name):
            out.append(b.id)
        elif isinstance(b, ast.Attribute):
            out.append(b.attr)
        elif isinstance(b, ast.Subscript):  # Generic[T]
            v = b.value
            out.append(v.id if isinstance(v, ast.Name) else getattr(v, "attr", "?"))
    return out


def class_facts(node: ast.ClassDef) -> dict[str, Any]:
    """What one class declares: annotated fields (dataclass fields and class attributes),
    attributes its ``__init__`` assigns, properties, methods with their parameters, enum members."""
    fields, members, properties = [], [], []
    methods: dict[str, dict[str, Any]] = {}
    attributes: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            fields.append(item.target.id)
        elif isinstance(item, ast.Assign):
            for t in item.targets:
                if isinstance(t, ast.Name):
                    members.append(t.id)
        elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = _decorators(item)
            if "property" in decorators or "cached_property" in decorators:
                properties.append(item.name)
                continue
            if "setter" in decorators or "deleter" in decorators:
                continue
            kind = ("classmethod" if "classmethod" in decorators else
                    "staticmethod" if "staticmethod" in decorators else "method")
            methods[item.name] = {"kind": kind, "params": params_of(item.args),
                                  "abstract": "abstractmethod" in decorators}
            if item.name == "__init__":
                attributes |= _self_attributes(item)
    out: dict[str, Any] = {"bases": _base_names(node), "fields": fields}
    if members:
        out["class_attributes"] = members
    if attributes:
        out["init_attributes"] = sorted(attributes)
    if properties:
        out["properties"] = sorted(properties)
    out["methods"] = dict(sorted(methods.items()))
    return out


def resolved_members(name: str, classes: dict[str, dict[str, Any]]) -> list[str]:
    """Every member of ``name`` and of its bases that the record holds (inherited fields and methods)."""
    seen, out, todo = set(), set(), [name]
    while todo:
        cls = todo.pop()
        if cls in seen or cls not in classes:
            continue
        seen.add(cls)
        facts = classes[cls]
        out |= set(facts["fields"]) | set(facts.get("class_attributes", ())) | set(facts.get("init_attributes", ()))
        out |= set(facts.get("properties", ())) | set(facts["methods"])
        todo += facts["bases"]
    return sorted(out)


# --- hook order at vLLM's call sites --------------------------------------------------------------------


def _calls_in_order(fn: ast.AST, hooks: Iterable[str], receiver: re.Pattern) -> list[str]:
    """The hooks ``fn`` calls on a connector (``receiver`` matches the called object's name), in
    source order; ``?`` marks a call under an ``if`` (or a conditional expression) inside ``fn``."""
    hooks = set(hooks)
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, conditional: bool) -> None:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in hooks:
            obj = node.func.value
            name = obj.attr if isinstance(obj, ast.Attribute) else obj.id if isinstance(obj, ast.Name) else (
                obj.func.id if isinstance(obj, ast.Call) and isinstance(obj.func, ast.Name) else "")
            if receiver.search(name):
                found.append((node.lineno, node.col_offset, node.func.attr + ("?" if conditional else "")))
        for field_name, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                    continue  # nested definitions are their own sites
                cond = conditional or (isinstance(node, (ast.If, ast.IfExp)) and field_name in ("body", "orelse"))
                cond = cond or (isinstance(node, ast.BoolOp) and child is not node.values[0])
                visit(child, cond)

    for stmt in getattr(fn, "body", []):
        visit(stmt, False)
    return [name for _, _, name in sorted(found)]


def _functions(tree: ast.Module) -> Iterable[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def _self_calls(fn: ast.AST) -> list[str]:
    return [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]


def scheduler_facts(tree: ast.Module) -> dict[str, Any]:
    """The scheduler's calls of the connector's scheduler-side hooks, per method, and where
    ``update_state_after_alloc`` is called from (``schedule``: the same pass that builds the
    step's metadata; any other method: a later pass)."""
    receiver = re.compile(r"^connector$")
    sites = {}
    methods = {}
    for name, fn in _functions(tree):
        if not name.startswith("Scheduler."):
            continue
        short = name.split(".", 1)[1]
        methods[short] = fn
        calls = _calls_in_order(fn, SCHEDULER_HOOKS, receiver)
        if calls:
            sites[short] = calls
    callers: dict[str, list[str]] = {}
    for short, fn in methods.items():
        for callee in set(_self_calls(fn)):
            callers.setdefault(callee, []).append(short)
    # build_connector_meta is called from a helper of schedule() in every release: name the helper
    builds = sorted(m for m, calls in sites.items() if any(c.rstrip("?") == "build_connector_meta" for c in calls))
    allocs = sorted(m for m, calls in sites.items() if any(c.rstrip("?") == "update_state_after_alloc" for c in calls))

    def reached_from_schedule(method: str) -> bool:
        return method == "schedule" or "schedule" in callers.get(method, ())

    schedule_fn = methods.get("schedule")
    resumed_list = schedule_fn is not None and any(
        isinstance(n, ast.Name) and n.id == "scheduled_resumed_reqs" and isinstance(n.ctx, ast.Store)
        for n in ast.walk(schedule_fn))
    return {
        "sites": dict(sorted(sites.items())),
        "build_connector_meta_in_schedule": all(reached_from_schedule(m) for m in builds) and bool(builds),
        "update_state_after_alloc_outside_schedule": {
            m: sorted(callers.get(m, ())) for m in allocs if not reached_from_schedule(m)},
        "schedule_keeps_resumed_list": resumed_list,
    }


def worker_facts(sources: dict[str, str]) -> dict[str, Any]:
    """The model runners' calls of the connector's worker-side hooks, per function that makes
    any, file by file (``?``: under an ``if``). ``results_before_save``: the functions that collect
    transfer results (``get_transfer_results`` / ``get_finished`` / ``build_connector_worker_meta``)
    where ``wait_for_save`` is conditional or comes after them: a step whose results reach the
    scheduler before its saves were waited for. ``deferred_finalize``: the calls passing
    ``defer_finalize`` (a runner asking for exactly that)."""
    receiver = re.compile(r"(?i)(?<!ec_)connector|kv_transfer_group")  # not the encoder cache's connector
    sites: dict[str, dict[str, list[str]]] = {}
    deferred: list[str] = []
    for path, text in sorted(sources.items()):
        if not path.startswith(WORKER_DIR):
            continue
        tree = ast.parse(text)
        rel = path[len("vllm/"):]
        for name, fn in _functions(tree):
            calls = _calls_in_order(fn, WORKER_HOOKS, receiver)
            if calls:
                sites.setdefault(rel, {})[name] = calls
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and any(k.arg == "defer_finalize" for k in node.keywords):
                    deferred.append(f"{rel}:{name}")
    results = ("get_transfer_results", "get_finished", "build_connector_worker_meta")
    before = []
    for rel, functions in sites.items():
        for name, calls in functions.items():
            plain = [c.rstrip("?") for c in calls]
            if not any(r in plain for r in results):
                continue
            if "wait_for_save" not in plain:
                continue
            first_result = min(plain.index(r) for r in results if r in plain)
            save = plain.index("wait_for_save")
            if save > first_result or calls[save].endswith("?"):
                before.append(f"{rel}:{name}")
    return {"sites": sites, "results_before_save": sorted(before), "deferred_finalize": sorted(set(deferred))}


# --- a wheel ------------------------------------------------------------------------------------------


def _wanted(path: str) -> bool:
    """Whether a record reads the source at ``path`` (relative to the wheel's root, ``vllm/...``)."""
    wanted = {p for paths in CLASSES.values() for p in paths} | {p for paths in FUNCTIONS.values() for p in paths}
    return path in wanted or path == SCHEDULER_SOURCE or (path.startswith(WORKER_DIR) and path.endswith(".py"))


def installed_sources(package_dir: str) -> dict[str, str]:
    """The sources a record reads, from an installed ``vllm`` package directory (the live check of
    the installed vLLM against its record)."""
    root = Path(package_dir).parent
    out = {}
    for path in sorted(Path(package_dir).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _wanted(rel):
            out[rel] = path.read_text(encoding="utf-8")
    return out


def wheel_sources(wheel: str) -> tuple[str, dict[str, str]]:
    """(version, {path: text}) of the Python sources a record reads from ``wheel``."""
    out: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if _wanted(name):
                out[name] = z.read(name).decode("utf-8")
        version = None
        for name in z.namelist():
            m = re.match(r"vllm-([^/]+)\.dist-info/METADATA$", name)
            if m:
                meta = z.read(name).decode("utf-8")
                v = re.search(r"^Version: (\S+)", meta, re.M)
                version = v.group(1) if v else None
    if version is None:
        raise ValueError(f"{wheel}: not a vLLM wheel (no vllm-*.dist-info/METADATA)")
    return version, out


def facts_from_sources(version: str, sources: dict[str, str]) -> dict[str, Any]:
    """The record of one release from its sources (``{path under the wheel: text}``)."""
    trees = {path: ast.parse(text) for path, text in sources.items() if path.endswith(".py")}
    classes: dict[str, dict[str, Any]] = {}
    for cls, paths in CLASSES.items():
        for path in paths:
            tree = trees.get(path)
            node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None) if tree else None
            if node is not None:
                facts = class_facts(node)
                if cls not in SIGNATURES:
                    facts["methods"] = sorted(facts["methods"])
                classes[cls] = {"module": path[:-3].replace("/", "."), **facts}
                break
    for cls in classes:
        classes[cls]["members"] = resolved_members(cls, classes)
    functions = {}
    for fn, paths in FUNCTIONS.items():
        for path in paths:
            tree = trees.get(path)
            if tree and any(isinstance(n, ast.FunctionDef) and n.name == fn for n in tree.body):
                functions[fn] = path[:-3].replace("/", ".")
                break
    enums = {}
    for cls in ("KVConnectorRole", "CacheHitSource"):
        path = CLASSES[cls][0]
        tree = trees.get(path)
        node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None) if tree else None
        if node is not None:
            enums[cls] = [t.id for item in node.body if isinstance(item, ast.Assign) for t in item.targets
                          if isinstance(t, ast.Name)]
    hooks: dict[str, Any] = {}
    if SCHEDULER_SOURCE in trees:
        hooks["scheduler"] = scheduler_facts(trees[SCHEDULER_SOURCE])
    hooks["model_runner"] = worker_facts(sources)
    worker_files = sorted(p[len("vllm/"):] for p in sources if p.startswith(WORKER_DIR))
    features = {
        # the extensible KV cache builds the connector after warmup over the blocks committed then
        "extensible_kv_cache": EXTENSIBLE_KV_CACHE in sources,
        # the V1 GPU model runner (0.32, 0.33) beside the V2 one (vllm/v1/worker/gpu/)
        "v1_gpu_model_runner": "v1/worker/gpu_model_runner.py" in worker_files,
    }
    return {"record_format": RECORD_FORMAT, "vllm": version, "classes": dict(sorted(classes.items())),
            "enums": enums, "functions": functions, "hooks": hooks, "features": features}


def record_wheel(wheel: str) -> dict[str, Any]:
    version, sources = wheel_sources(wheel)
    return facts_from_sources(version, sources)


def record_path(version: str, directory: Path = HERE) -> Path:
    return directory / f"vllm-{version}.json"


def dumps(record: dict[str, Any]) -> str:
    """JSON, one key per line, a list of names on one line (records diff well in review)."""

    def fmt(value: Any, depth: int) -> str:
        flat = isinstance(value, dict) and not any(isinstance(v, dict) for v in value.values())
        if isinstance(value, dict) and value and not (flat and len(json.dumps(value)) < 120):
            pad = " " * (depth + 1)
            items = [f"{pad}{json.dumps(k)}: {fmt(v, depth + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
        return json.dumps(value)

    return fmt(record, 0) + "\n"


def download(version: str, directory: str) -> str:
    """``pip download vllm==VERSION --no-deps`` into ``directory`` (reused when already there)."""
    found = glob.glob(os.path.join(directory, f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--only-binary", ":all:", f"vllm=={version}", "-d", directory], check=True)
    found = glob.glob(os.path.join(directory, f"vllm-{version}-*.whl"))
    if not found:
        raise FileNotFoundError(f"pip downloaded no vllm-{version} wheel into {directory}")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m saria.integrations.vllm.contracts.record",
                                     description="Record the facts saria's connector relies on from vLLM wheels.")
    parser.add_argument("releases", nargs="+", help="a vLLM version (downloaded with pip) or a wheel file")
    parser.add_argument("--wheels", default=os.path.join(tempfile.gettempdir(), "vllm-wheels"),
                        help="where downloaded wheels go (default: %(default)s)")
    parser.add_argument("--out", default=str(HERE), help="where records go (default: beside this script)")
    parser.add_argument("--check", action="store_true", help="compare with the records there; write nothing")
    args = parser.parse_args(argv)
    os.makedirs(args.wheels, exist_ok=True)
    status = 0
    for release in args.releases:
        wheel = release if release.endswith(".whl") else download(release, args.wheels)
        record = record_wheel(wheel)
        path = record_path(record["vllm"], Path(args.out))
        if args.check:
            same = path.exists() and path.read_text() == dumps(record)
            print(f"{path}: {'matches' if same else 'DIFFERS from'} vLLM {record['vllm']}'s wheel")
            status |= not same
        else:
            path.write_text(dumps(record))
            print(f"wrote {path}")
    return status


if __name__ == "__main__":
    sys.exit(main())
