"""The fleet replay (``saria.replay.fleet``) and its cluster tier (``saria.replay.cluster_tier``).

* differential: one replica without a cluster tier is the single-server replay, exactly; a cluster
  tier smaller than one chunk (every put refused) is no cluster tier, exactly;
* with sticky ``session`` routing and no cluster tier, each replica is a single server replaying
  the sessions routed to it (the replicas share nothing but the clock): per request, the same
  hits, transfer and TTFT, and the same control-plane counters per replica;
* the cluster LRU against a plain reference model (a list, oldest first): same contents and
  order, never over its bytes, the oldest evicted first;
* a cluster hit is only ever a chunk the pool holds at that moment (never one it evicted), and the
  cluster hits the requests count are the chunks the pool served;
* routers are deterministic under a seed; the CLI refuses bad fleet options with one line, exit 2.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from saria.replay.arrivals import Schedule, make_schedule
from saria.replay.cluster_tier import ClusterTier
from saria.replay.experiment import open_trace
from saria.replay.fleet import FleetSettings, replay_fleet, route_session
from saria.replay.policies import BaseSettings, build_config, parse_policy
from saria.replay.replay import ReplaySettings, replay
from saria.replay.traces import chunk_keys

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("saria", "full-duplicate", "dram-only", "lmcache-plus", "saria:theta_R=none,theta_E=3")
FAST = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _setup(sessions: int, seed: int, policy: str, dram: int, ssd: int, window: float, model: str = "qwen3-8b",
           checkpoint_tokens: int = 16_384):
    trace = open_trace(f"synth:sessions={sessions},prompt_tokens=6000,first_prompt_tokens=2000,"
                       f"shared_prefix_tokens=1024,prefix_variants=2,seed={seed}")
    config = build_config(parse_policy(policy), BaseSettings(model=model, dram_tokens=dram, ssd_tokens=ssd,
                                                             checkpoint_tokens=checkpoint_tokens))
    chunks = [chunk_keys(r, trace.block_tokens, config.chunk.chunk_tokens) for r in trace.requests]
    return trace, config, chunks, make_schedule(trace, "rewindow", window_hours=window, seed=seed)


def _same(a: list[float], b: list[float]) -> bool:
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


sizes = st.sampled_from([(0, 20_000), (8_192, 0), (16_384, 60_000), (60_000, 600_000)])


@FAST
@given(policy=st.sampled_from(POLICIES), capacity=sizes, seed=st.integers(0, 50), window=st.sampled_from([0.2, 2.0]),
       inflight=st.sampled_from([1, 4]), truncate=st.sampled_from([None, 0.3]))
def test_one_replica_without_cluster_is_the_single_server_replay(policy, capacity, seed, window, inflight, truncate):
    trace, config, chunks, schedule = _setup(12, seed, policy, *capacity, window)
    replay_settings = ReplaySettings(inflight=inflight, truncate_hours=truncate)
    single = replay("p", trace, chunks, schedule, config, replay_settings)
    fleet = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(router="random", seed=seed),
                         replay_settings, audit=True)
    assert fleet.counters == [single.counters] and fleet.audit == []
    assert _same(fleet.ttft_s, single.ttft_s) and _same(fleet.transfer_s, single.transfer_s)
    assert _same(fleet.arrival_s, single.arrival_s)
    assert fleet.hit_chunks == single.hit_chunks and fleet.achievable_chunks == single.achievable_chunks
    assert (fleet.start_s, fleet.end_s, fleet.truncated) == (single.start_s, single.end_s, single.truncated)
    assert sum(fleet.cluster_chunks) == 0


def test_hybrid_model_one_replica_matches_too():
    trace, config, chunks, schedule = _setup(8, 3, "saria", 12_000, 40_000, 0.5, model="qwen3.5-9b",
                                             checkpoint_tokens=2048)
    single = replay("p", trace, chunks, schedule, config)
    fleet = replay_fleet("p", trace, chunks, schedule, config, FleetSettings())
    assert fleet.counters == [single.counters] and _same(fleet.ttft_s, single.ttft_s)


@FAST
@given(policy=st.sampled_from(POLICIES), capacity=sizes, seed=st.integers(0, 50), replicas=st.integers(2, 6),
       router=st.sampled_from(["random", "session", "least-loaded"]))
def test_a_cluster_smaller_than_a_chunk_is_no_cluster(policy, capacity, seed, replicas, router):
    trace, config, chunks, schedule = _setup(10, seed, policy, *capacity, 0.3)
    base = FleetSettings(replicas=replicas, router=router, seed=seed)
    none = replay_fleet("p", trace, chunks, schedule, config, base)
    tiny = replay_fleet("p", trace, chunks, schedule, config,
                        FleetSettings(replicas, router, config.chunk.kv_bytes - 1, 25.0, "all", seed))
    assert tiny.counters == none.counters and _same(tiny.ttft_s, none.ttft_s) and tiny.replica == none.replica
    assert tiny.cluster["put_chunks"] == 0 and tiny.cluster["put_refused"] > 0 and sum(tiny.cluster_chunks) == 0


@FAST
@given(policy=st.sampled_from(POLICIES), capacity=sizes, seed=st.integers(0, 50), replicas=st.integers(2, 5))
def test_session_routing_without_cluster_is_each_replica_alone(policy, capacity, seed, replicas):
    trace, config, chunks, schedule = _setup(14, seed, policy, *capacity, 0.3)
    fleet = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(replicas, "session", seed=seed))
    for r in range(replicas):
        mine = tuple(s for i, s in enumerate(schedule.sessions) if route_session(i, seed, replicas) == r)
        alone = replay("p", trace, chunks, Schedule("rewindow", mine), config)
        assert alone.counters == fleet.counters[r]
        served = [i for s in mine for i in s.requests]
        assert all(fleet.replica[i] == r for i in served)
        for i in served:
            assert fleet.hit_chunks[i] == alone.hit_chunks[i]
            assert _same([fleet.ttft_s[i], fleet.transfer_s[i]], [alone.ttft_s[i], alone.transfer_s[i]])


# ------------------------------------------------------------------------------------- cluster LRU
ops = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, 12), st.integers(1, 40)),
                         st.tuples(st.just("get"), st.lists(st.integers(0, 12), max_size=5), st.just(0))),
               max_size=80)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 120), ops=ops)
def test_cluster_lru_against_a_reference(capacity, ops):
    pool, model = ClusterTier(capacity), []  # model: [key, size], oldest first
    for op, arg, size in ops:
        if op == "put":
            held = [k for k, _ in model]
            if arg in held:
                model.append(model.pop(held.index(arg)))
                assert not pool.put(arg, size)
            elif size > capacity:
                assert not pool.put(arg, size)
            else:
                evicted = []
                while sum(s for _, s in model) + size > capacity:
                    evicted.append(model.pop(0)[0])
                before = pool.keys()
                model.append([arg, size])
                assert pool.put(arg, size)
                assert before[:len(evicted)] == evicted  # the oldest went first
        else:
            run = pool.prefix(arg)
            held = [k for k, _ in model]
            expect = 0
            while expect < len(arg) and arg[expect] in held:
                expect += 1
            assert run == expect
            got = pool.get(arg[:run])
            sizes = dict((k, s) for k, s in model)
            assert got == sum(sizes[k] for k in arg[:run])
            for key in arg[:run]:
                model.append(model.pop([k for k, _ in model].index(key)))
        assert pool.keys() == [k for k, _ in model]
        assert pool.used_bytes == sum(s for _, s in model) <= capacity


def test_cluster_prefix_stops_at_a_checkpoint():
    pool = ClusterTier(100)
    for key in "abcde":
        pool.put(key, 10)
    assert pool.prefix("abcdex", 0, step=2) == 4 and pool.prefix("abcdex", 2, step=2) == 2
    assert pool.prefix("axcde", 0, step=2) == 0 and pool.prefix("abcde", 1, step=4) == 3


def test_a_cluster_hit_is_never_an_evicted_chunk(monkeypatch):
    served: list[int] = []
    real_get = ClusterTier.get

    def checked_get(self, keys):
        assert all(key in self for key in keys), "a cluster hit on a chunk the pool does not hold"
        served.append(len(keys))
        return real_get(self, keys)

    monkeypatch.setattr(ClusterTier, "get", checked_get)
    trace, config, chunks, schedule = _setup(30, 4, "saria", 16_384, 60_000, 0.3)
    for admission in ("all", "evicted", "shared"):
        served.clear()
        run = replay_fleet("p", trace, chunks, schedule, config,
                           FleetSettings(8, "random", 6 * config.chunk.kv_bytes, 25.0, admission, 1))
        assert sum(run.cluster_chunks) == sum(served) == run.cluster["get_chunks"]
        assert run.cluster["used_bytes"] <= run.cluster["capacity_bytes"]
        if admission != "shared":
            assert run.cluster["evicted_chunks"] > 0 and sum(run.cluster_chunks) > 0


def test_the_cluster_tier_helps_random_routing():
    trace, config, chunks, schedule = _setup(30, 2, "saria", 60_000, 600_000, 0.5)
    none = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(8, "random"))
    pool = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(8, "random", 10**12))
    assert sum(pool.cluster_chunks) > 0
    assert sum(pool.ttft_s) < sum(none.ttft_s)


# ----------------------------------------------------------------------------------------- routers
@pytest.mark.parametrize("router", ["random", "session", "least-loaded"])
def test_routers_are_deterministic_under_a_seed(router):
    trace, config, chunks, schedule = _setup(20, 1, "saria", 16_384, 60_000, 0.3)
    runs = [replay_fleet("p", trace, chunks, schedule, config, FleetSettings(4, router, seed=seed))
            for seed in (3, 3, 4)]
    assert runs[0].replica == runs[1].replica and _same(runs[0].ttft_s, runs[1].ttft_s)
    assert len(set(runs[0].replica)) == 4  # every replica got work
    if router != "least-loaded":  # the seed picks other replicas
        assert runs[0].replica != runs[2].replica
    if router == "session":
        for session in schedule.sessions:
            assert len({runs[0].replica[i] for i in session.requests}) == 1


# --------------------------------------------------------------------------------------------- CLI
def saria(*args):
    return subprocess.run([sys.executable, "-m", "saria.commands.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


SMALL = ["synth:sessions=12,prompt_tokens=6000,first_prompt_tokens=2000", "--dram-tokens", "20000",
         "--ssd-tokens", "200000", "--window-hours", "0.5", "--no-progress", "--policy", "saria"]


@pytest.mark.parametrize("extra, named", [
    (["--replicas", "0"], "--replicas"), (["--replicas", "5000"], "--replicas"), (["--router", "rr"], "--router"),
    (["--cluster-gb", "-1"], "--cluster-gb"), (["--cluster-gb", "nan"], "--cluster-gb"),
    (["--cluster-gbps", "0"], "--cluster-gbps"), (["--cluster-admission", "some"], "--cluster-admission"),
    (["--replicas", "2", "--plot", "x.png"], "--plot"),
    (["--replicas", "2", "--policy", "saria:prewarm=true"], "--policy"),
    (["--cluster-gb", "5", "--policy", "saria:admission=oracle"], "--policy"),
])
def test_bad_fleet_options_are_one_line_exit_2(extra, named):
    proc = saria("replay", *SMALL[:-2], *(extra if "--policy" in extra else SMALL[-2:] + extra))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("saria replay: error:") and named in lines[-1], proc.stderr
    assert "Traceback" not in proc.stderr and "SSD writes (GiB)" not in proc.stdout


def test_fleet_replay_writes_json_and_csv(tmp_path):
    import csv
    import json

    from saria.replay.fleet_report import FLEET_KEYS

    out, table = tmp_path / "f.json", tmp_path / "f.csv"
    proc = saria("replay", *SMALL, "--replicas", "3", "--router", "random", "--cluster-gb", "20",
                 "--json", out, "--csv", table)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["fleet"]["replicas"] == 3 and len(doc["results"]) == 2
    without, with_ = doc["results"]
    assert tuple(without) == FLEET_KEYS and without["cluster_gb"] == 0 and with_["cluster_gb"] == 20
    assert without["cluster_hit_chunks"] == 0 and with_["cluster_put_bytes"] > 0
    assert without["requests"] == with_["requests"] == sum(1 for _ in open_trace(SMALL[0]).requests)
    assert len(list(csv.DictReader(table.open()))) == 2


def test_bench_fleet_quick_runs():
    proc = subprocess.run([sys.executable, "bench/bench_fleet.py", "--quick"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "synth" in proc.stdout and "cluster" in proc.stdout


def test_hybrid_cluster_hits_end_on_a_checkpoint():
    trace, config, chunks, schedule = _setup(10, 6, "saria", 12_000, 40_000, 0.3, model="qwen3.5-9b",
                                             checkpoint_tokens=2048)
    run = replay_fleet("p", trace, chunks, schedule, config, FleetSettings(4, "random", 10**12), audit=True)
    every = config.chunk.checkpoint_chunks
    assert run.audit == [] and sum(run.cluster_chunks) > 0
    for local, remote in zip(run.hit_chunks, run.cluster_chunks):
        assert local % every == 0 and (remote == 0 or (local + remote) % every == 0)
    assert run.cluster["put_bytes"] % config.chunk.kv_bytes != 0  # GDN states travel with their chunks
