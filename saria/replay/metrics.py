"""Metrics of a replay, as the paper defines them (§5.1), and the result record of ``saria replay``.

* **CHAR** (cache hit achievement rate): actual cache-hit chunk occurrences over those achievable
  with unlimited capacity, summed over requests (``char_mean``: the paper's CHAR, i.e. the mean of
  per-request CHAR weighted by achievable chunks). Eligible requests are those with something
  achievable. **CHAR P25 bad**: the same ratio over the combined counts of the quarter (rounded
  up) of eligible requests with the lowest per-request CHAR (ties: earlier requests first).
* **P25 bad** of a latency: the mean of the largest quarter (rounded up) of its samples.
* **P90**: linear interpolation between order statistics (numpy's default).
* Transfer times count requests that reloaded something; TTFT counts every request.
* ``normalized_writes``: SSD bytes written over the configured SSD cache capacity (paper's
  normalized writes); ``write_budget_ratio``: SSD bytes written over the endurance budget of the
  replayed duration, ``dwpd x capacity x duration / 1 day`` (first arrival to last event, or the
  truncation horizon).
* Prewarming (``Policy.prewarm``): ``prewarm_read_bytes``, SSD bytes prewarms read into DRAM;
  ``prewarm_hit_tokens``, tokens of the chunks a request then read from DRAM that a prewarm had
  brought there (first read only); ``prewarm_wasted_tokens``, tokens of prewarmed chunks evicted
  from DRAM before any request read them. All 0 without prewarming.
"""

from __future__ import annotations

import math
from typing import Sequence

from saria.replay.replay import PolicyRun

__all__ = ["RESULT_KEYS", "add_retention", "char", "p25_bad", "percentile", "retention", "summarize"]

# The result record of `saria replay --json`, exactly (issue 4).
RESULT_KEYS = ("policy", "ssd_write_bytes", "ssd_read_bytes", "normalized_writes", "char_mean", "char_p25_bad",
               "hit_ratio", "dram_hit_tokens", "ssd_hit_tokens", "transfer_ms_mean", "transfer_ms_p90",
               "transfer_ms_p25_bad", "ttft_ms_mean", "ttft_ms_p90", "dram_evictions", "promotions",
               "write_budget_ratio", "useful_write_fraction", "ssd_useful_write_bytes", "retention",
               "prewarm_read_bytes", "prewarm_hit_tokens", "prewarm_wasted_tokens")


def char(actual: Sequence[int], achievable: Sequence[int]) -> tuple[float, float]:
    """(CHAR, CHAR P25 bad) of per-request actual and achievable hit counts. Requests with nothing
    achievable are not eligible; with none eligible both are NaN."""
    if len(actual) != len(achievable):
        raise ValueError(f"{len(actual)} actual counts but {len(achievable)} achievable counts")
    eligible = [(a / b, i, a, b) for i, (a, b) in enumerate(zip(actual, achievable)) if b > 0]
    for _, i, a, b in eligible:
        if not 0 <= a <= b:
            raise ValueError(f"request {i}: {a} hits but only {b} achievable")
    if not eligible:
        return math.nan, math.nan
    total = sum(e[3] for e in eligible)
    mean = sum(e[2] for e in eligible) / total
    eligible.sort()
    worst = eligible[:math.ceil(len(eligible) / 4)]
    return mean, sum(e[2] for e in worst) / sum(e[3] for e in worst)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between order statistics; NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def p25_bad(values: Sequence[float]) -> float:
    """Mean of the largest quarter (rounded up) of ``values``; NaN when empty."""
    data = sorted(values, reverse=True)
    if not data:
        return math.nan
    worst = data[:math.ceil(len(data) / 4)]
    return sum(worst) / len(worst)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def summarize(run: PolicyRun) -> dict:
    """The result record (keys :data:`RESULT_KEYS`, in that order) of one policy's replay."""
    c = run.counters
    config = run.config
    chunk_tokens = config.chunk.chunk_tokens
    transfers = [t * 1e3 for t in run.transfer_s if not math.isnan(t)]
    ttfts = [t * 1e3 for t in run.ttft_s if not math.isnan(t)]
    char_mean, char_bad = char(run.hit_chunks, run.achievable_chunks)
    ssd_capacity = config.ssd_bytes
    budget = config.write_budget_bytes_per_s * run.budget_s
    result = {
        "policy": run.name,
        "ssd_write_bytes": c.ssd_bytes_written,
        "ssd_read_bytes": c.ssd_bytes_read,
        "normalized_writes": c.ssd_bytes_written / ssd_capacity if ssd_capacity else 0.0,
        "char_mean": char_mean,
        "char_p25_bad": char_bad,
        "hit_ratio": c.hits / c.references if c.references else 0.0,
        "dram_hit_tokens": c.hits_dram_chunks * chunk_tokens,
        "ssd_hit_tokens": c.hits_ssd_chunks * chunk_tokens,
        "transfer_ms_mean": _mean(transfers),
        "transfer_ms_p90": percentile(transfers, 90),
        "transfer_ms_p25_bad": p25_bad(transfers),
        "ttft_ms_mean": _mean(ttfts),
        "ttft_ms_p90": percentile(ttfts, 90),
        "dram_evictions": c.dram_evictions,
        "promotions": c.promotions,
        "write_budget_ratio": c.ssd_bytes_written / budget if budget > 0 else 0.0,
        "useful_write_fraction": c.ssd_useful_write_bytes / c.ssd_bytes_written if c.ssd_bytes_written else math.nan,
        "ssd_useful_write_bytes": c.ssd_useful_write_bytes,
        "retention": math.nan,  # filled in against the run's references (add_retention)
        "prewarm_read_bytes": c.prewarm_bytes_read,
        "prewarm_hit_tokens": c.prewarm_hits * chunk_tokens,
        "prewarm_wasted_tokens": c.prewarm_wasted * chunk_tokens,
    }
    assert tuple(result) == RESULT_KEYS
    return result


def retention(char_policy: float, char_dram_only: float, char_full_duplicate: float) -> float:
    """The share of full duplicate's CHAR gain over DRAM-only that a policy keeps:
    ``(CHAR - CHAR_dram-only) / (CHAR_full-duplicate - CHAR_dram-only)``; NaN when full duplicate
    gains nothing (everything fits in DRAM: no policy can lose or win anything) or a CHAR is NaN."""
    gain = char_full_duplicate - char_dram_only
    if not gain > 1e-12:
        return math.nan
    return (char_policy - char_dram_only) / gain


def add_retention(results: list[dict], dram_only: dict, full_duplicate: dict) -> None:
    """Fill every result's ``retention`` in, against these two reference results of the same run."""
    for result in results:
        result["retention"] = retention(result["char_mean"], dram_only["char_mean"], full_duplicate["char_mean"])
