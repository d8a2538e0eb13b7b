"""`saria serve --secret-file KEY --cluster MASTER` on two replicas at once, two tenants: what the
issue's "done" asks of the sealed cluster tier, end to end through vLLM's OpenAI server (long: two
servers and a Mooncake cluster, about three minutes on 2 cores; ``SARIA_LONG_TESTS=1``).

Replica 1 serves tenant A's prompts; replica 2 then serves them again and loads their prefixes from
the cluster (A's sealed objects, put by replica 1); replica 2 serves tenant B the very same prompts
and finds nothing of A's; replica 1 then serves B and loads B's prefixes (put by replica 2). The
cluster's key names, each replica's ``/metrics`` and log hold no salt. Outputs: each tenant's are the
same tokens on both replicas (greedy), the cluster's bytes having been A's or B's own.
"""

from __future__ import annotations

import sys

import pytest

from cluster_cases import mooncake_keys, start_cluster
from saria.harness import build_model
from saria.seal import new_key_file

from serve_driver import Server, completions, metric, prometheus, system_prompt, text

pytestmark = pytest.mark.long

CHUNK = 64
SALTS = {"A": "tenant-a-serve-31f7", "B": "tenant-b-serve-8c02"}
VLLM_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "4", "--block-size", "32", "--dtype", "bfloat16",
             "--no-enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager", "--seed", "0",
             "--max-num-batched-tokens", "2048"]


def prompts() -> list[str]:
    return [system_prompt() + "\nTask: " + text(9100 + i, 120) for i in range(2)]


def cluster_hits(server: Server) -> float:
    return metric(prometheus(server.get("/metrics")), "vllm:saria_hit_tokens_total", tier="cluster")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-cluster")
    cluster = start_cluster(tmp_path_factory)
    key = root / "saria.key"
    new_key_file(key)
    model = str(build_model(root / "model", tokenizer=True))
    args = [model, "--secret-file", str(key), "--cluster", cluster.master, "--cluster-host", "127.0.0.1",
            "--dram-gb", "0.05", "--chunk-tokens", str(CHUNK), "--log-interval-s", "1", *VLLM_ARGS]
    one, two = Server(args, root / "one.log", root / "cache1"), Server(args, root / "two.log", root / "cache2")
    out: dict = {"cluster": cluster}
    try:
        with one, two:
            for name, server in (("one", one), ("two", two)):
                out[f"{name}_hits_0"] = cluster_hits(server)
            out["A@one"] = completions(one.url, model, prompts(), cache_salt=SALTS["A"])
            out["A@two"] = completions(two.url, model, prompts(), cache_salt=SALTS["A"])
            out["two_hits_A"] = cluster_hits(two)
            out["B@two"] = completions(two.url, model, prompts(), cache_salt=SALTS["B"])
            out["two_hits_B"] = cluster_hits(two)
            out["B@one"] = completions(one.url, model, prompts(), cache_salt=SALTS["B"])
            out["one_hits_B"] = cluster_hits(one)
            out["metrics"] = one.get("/metrics") + two.get("/metrics")
            out["logs"] = one.log() + two.log()
            out["keys"] = mooncake_keys(cluster)
    except BaseException:
        print(one.tail(), two.tail(), file=sys.stderr)
        cluster.stop()
        raise
    yield out
    cluster.stop()


def test_two_tenants_on_two_sealed_replicas_share_only_their_own_prefixes(replicas):
    r = replicas
    cached = {k: [x["cached_tokens"] for x in r[k]] for k in ("A@one", "A@two", "B@two", "B@one")}
    print(cached, {k: r[k] for k in ("two_hits_A", "two_hits_B", "one_hits_B")})
    assert cached["A@one"][0] == 0 and cached["B@two"][0] == 0, cached  # each tenant's first prompt: nothing
    assert cached["A@two"][0] > 0 and r["two_hits_A"] > r["two_hits_0"]  # A's prefix from the cluster
    assert r["two_hits_B"] == r["two_hits_A"]  # B on replica 2: not one cluster token (A's were there)
    assert cached["B@two"] == cached["A@one"]  # B is served as a new tenant is
    assert cached["B@one"][0] > 0 and r["one_hits_B"] > r["one_hits_0"]  # B's own prefix, put by replica 2
    for tenant in "AB":  # greedy: the same tokens wherever a tenant is served
        assert [x["token_ids"] for x in r[f"{tenant}@one"]] == [x["token_ids"] for x in r[f"{tenant}@two"]]


def test_no_salt_in_the_clusters_names_the_metrics_or_the_logs(replicas):
    names = "\n".join(replicas["keys"])
    assert any(k.startswith("saria/") for k in replicas["keys"])
    for salt in SALTS.values():
        assert salt not in names and salt.encode().hex() not in names
        assert salt not in replicas["metrics"]
        assert not [line for line in replicas["logs"].splitlines() if "saria" in line and salt in line]
