"""The reference that saria's outputs are held against (``saria.harness.reference``): the job a
saria run's result becomes, and the strict comparison. The engine tests run the reference itself
(``tests/test_vllm_connector*.py``: every saria run on vLLM is compared with its replay)."""

from __future__ import annotations

import pytest

from saria.harness.compare import compare_outputs
from saria.harness.reference_runs import check_job, reference_job


def turn(tokens, logprobs, cached=0):
    return {"output_tokens": list(tokens), "logprobs": list(logprobs), "cached_tokens": cached}


def replayed(turns, **counters):
    return {"turns": turns, "reference": [dict({"missing": 0, "unmatched": 0, "ambiguous": 0}, **counters)]}


def test_identical_turns_pass_and_any_last_bit_of_a_logprob_fails():
    ref = replayed([turn([1, 2], [-1.0, -2.0]), turn([3], [-0.5], cached=64)])
    assert compare_outputs(ref["turns"], ref).ok
    assert "tokens identical, logprobs bit-identical" in compare_outputs(ref["turns"], ref).describe()
    nudged = [turn([1, 2], [-1.0, -2.0 + 2 ** -20]), turn([3], [-0.5], cached=64)]
    check = compare_outputs(nudged, ref)
    assert not check.ok and check.differing == (0,) and check.tokens_identical and check.gap == 2 ** -20
    assert "LOGPROBS DIFFER" in check.describe() and "turn(s) 1" in check.describe()


def test_a_different_token_fails_and_the_gap_stops_at_the_first_differing_token():
    ref = replayed([turn([1, 2, 3], [-1.0, -2.0, -3.0])])
    check = compare_outputs([turn([1, 5, 3], [-1.5, -9.0, -3.0])], ref)
    assert not check.ok and not check.tokens_identical and check.gap == 0.5
    assert "TOKENS DIFFER" in check.describe()


@pytest.mark.parametrize("counters, cached, why", [
    ({"missing": 2}, 0, "2 missing page loads"),
    ({"unmatched": 1}, 0, "1 unmatched page loads"),
    ({"ambiguous": 3}, 0, "3 ambiguous page loads"),
    ({}, 64, "turn 1 reused 64 tokens, the reference 0"),
])
def test_a_reference_that_did_not_replay_the_history_fails_whatever_the_outputs(counters, cached, why):
    ref = replayed([turn([1], [-1.0])], **counters)
    check = compare_outputs([turn([1], [-1.0], cached=cached)], ref)
    assert not check.ok and why in check.describe() and "REFERENCE DID NOT REPLAY IT" in check.describe()
    assert not compare_outputs([turn([1], [-1.0])], {"turns": ref["turns"]}).ok  # no counters: no reference


def test_compare_picks_the_reference_turns_named_and_refuses_others():
    ref = replayed([turn([1], [-1.0]), turn([2], [-2.0])])
    assert compare_outputs([turn([2], [-2.0])], ref, [1]).ok
    with pytest.raises(ValueError, match="has 2 turns"):
        compare_outputs([turn([2], [-2.0])], ref, [2])
    with pytest.raises(ValueError, match="1 turns but 2"):
        compare_outputs([turn([2], [-2.0])], ref, [0, 1])


def test_a_job_joins_the_runs_of_one_history_and_their_picks_per_rank_in_order():
    a = {"turns": [turn([], [], 0), turn([], [], 128)],
         "ranks": [{"audit": {"served": {"c1": [["d1", "d2"]]}}}, {"audit": {"served": {"c1": [["e1", "e2"]]}}}]}
    b = {"turns": [turn([], [], 128)],
         "ranks": [{"audit": {"served": {"c1": [["d3", "d4"]], "c2": [["d5"]]}}}, {"audit": {"served": {}}}]}
    job = reference_job(a, dict(b, block_size=32), baseline=True)
    assert job == {"loads": [0, 128, 128], "baseline": True, "block_size": 32,
                   "picks": [{"c1": [["d1", "d2"], ["d3", "d4"]], "c2": [["d5"]]}, {"c1": [["e1", "e2"]]}]}
    assert reference_job(a, b, turns=2)["loads"] == [0, 128]
    assert reference_job({"turns": [turn([], [], 0)], "worker": {}})["picks"] is None  # no audit, no picks


def test_runs_of_one_history_and_the_engine_replaying_them_page_alike():
    with pytest.raises(ValueError, match="one block size"):
        reference_job({"turns": [], "block_size": 32}, {"turns": [], "block_size": 128})
    with pytest.raises(ValueError, match="paged its KV by 32 tokens, the reference engine by 128"):
        check_job({"loads": [0], "block_size": 32}, [[1] * 40], block_size=128)
    check_job({"loads": [0], "block_size": 32}, [[1] * 40], block_size=32)


@pytest.mark.parametrize("loads, error", [
    ([0], "one load per prompt"),
    ([0, 32, 0], "one load per prompt"),
    ([0, 48], "cannot load 48"),
    ([0, 64], "cannot load 64 of its 64 tokens"),
    ([-32, 0], "cannot load -32"),
])
def test_a_job_that_cannot_replay_its_prompts_is_refused(loads, error):
    with pytest.raises(ValueError, match=error):
        check_job({"loads": loads}, [[1] * 40, [2] * 64], block_size=32)
