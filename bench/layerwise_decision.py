#!/usr/bin/env python3
"""One line deciding CUDA's ``layerwise`` default (``LAYERWISE_DEFAULT["cuda"]`` in
saria/integrations/vllm/settings.py) from ``bench_layerwise.py``'s benefit table (its ``--json``).

The rule: **on** when layer-wise reloads are never slower than sequential ones by more than 3%
(``layerwise / sequential <= 1.03`` at every measured P x N), are faster than sequential at the
median size, and every reload's pages were right; else **off**. The table's other targets (within
10% of the ideal at P = 8K, N = 1K; the forward slowed <= 5%) are printed beside it.

    python bench/layerwise_decision.py OUT/bench_layerwise.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

WORST = 1.03


def decide(data: dict) -> tuple[bool | None, str]:
    rows = data.get("benefit") or []
    if not rows:
        return None, "no benefit table (bench_layerwise ran without CUDA, or with --host): nothing decided"
    ratios = [r["layerwise_s"] / r["sequential_s"] for r in rows]
    worst, median = max(ratios), statistics.median(ratios)
    pages_ok = all(r.get("pages_ok", False) for r in rows) and data.get("host", {}).get("pages_ok", True)
    ideal = next((r["layerwise_s"] / r["ideal_s"] for r in rows if (r["P"], r["N"]) == (8192, 1024)), None)
    slow = max((r["forward_beside_copies_s"] / r["compute_s"] for r in rows), default=float("nan"))
    on = pages_ok and worst <= WORST and median < 1.0
    why = (f"layerwise/sequential median {median:.3f}, worst {worst:.3f} over {len(rows)} sizes (rule: worst <= "
           f"{WORST:g} and median < 1); layerwise/ideal at P=8K N=1K "
           f"{'n/a' if ideal is None else f'{ideal:.3f}'}; forward slowdown beside copies {slow:.3f}; pages "
           f"{'right' if pages_ok else 'WRONG'}")
    return on, why


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python bench/layerwise_decision.py BENCH_LAYERWISE.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if not path.exists():
        print(f"decision: CUDA layerwise default -> not decided ({path} missing: bench_layerwise did not finish)")
        return 0
    on, why = decide(json.loads(path.read_text()))
    verdict = "not decided" if on is None else ("ON (set LAYERWISE_DEFAULT['cuda'] = True)" if on else
                                                "OFF (keep LAYERWISE_DEFAULT['cuda'] = False)")
    print(f"decision: CUDA layerwise default -> {verdict}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
