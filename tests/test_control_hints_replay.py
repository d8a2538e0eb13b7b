"""Without hints, the hints plumbing changes no figure: a replay of a shared agent trace through a
control plane whose every commit carries a session hint and a tenant (so every chunk gets a hint
mark and every eviction, SSD reservation, promotion and prewrite goes through the hinted paths)
gives exactly the replay without, field by field: every counter, every request's arrival,
transfer and TTFT, every hit; and the audit is clean. Small tiers, so DRAM and SSD both evict."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest

from saria.config import Capacity, ChunkSpec, Policy, SariaConfig
from saria.control import ControlPlane
from saria.control.hints import Hints
from saria.replay.arrivals import make_schedule
from saria.replay.replay import replay
from saria.replay.traces import chunk_keys, load_trace

replay_module = importlib.import_module("saria.replay.replay")  # the package exports a function of that name
TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "agent_magentic_one.jsonl"


EXTRA: dict = {}  # what the hinted commits add (none: the test; a check of the check gives retain_s)


class SessionHintedPlane(ControlPlane):
    """A control plane whose callers send what an application that names its sessions sends, and
    nothing that asks for a change: a session (the request's first chunk) and a tenant."""

    commits = 0

    def commit_prefill(self, chunk_hashes, now, plan=None, failed=(), states=None, hints=None, tenant=None):
        hints = Hints(session=f"s{hash(chunk_hashes[0]) & 0xff}", **EXTRA) if chunk_hashes else None
        SessionHintedPlane.commits += 1
        orders = super().commit_prefill(chunk_hashes, now, plan=plan, failed=failed, states=states, hints=hints,
                                        tenant="tenant")
        self.turn_ended(chunk_hashes, now, hints, tenant="tenant")  # no next_turn_s: schedules nothing
        assert self.hinted_prewarms(now) == []
        return orders


def run(policy: str, hinted: bool, monkeypatch) -> dict:
    trace = load_trace(TRACE)
    chunk = ChunkSpec.for_model("qwen3-8b", chunk_tokens=64)
    chunks = [chunk_keys(r, trace.block_tokens, chunk.chunk_tokens) for r in trace.requests]
    schedule = make_schedule(trace, "auto", window_hours=0.2, seed=3)
    config = SariaConfig(dram=Capacity(tokens=8_000), ssd=Capacity(tokens=40_000), chunk=chunk,
                         policy=Policy.preset(policy))
    with monkeypatch.context() as patch:
        if hinted:
            patch.setattr(replay_module, "ControlPlane", SessionHintedPlane)
        result = replay(policy, trace, chunks, schedule, config, audit=True)
    assert result.audit == []
    out = dataclasses.asdict(result)
    out.pop("labels")
    return out


@pytest.mark.skipif(not TRACE.exists(), reason="the shared traces are not here")
@pytest.mark.parametrize("policy", ["saria", "full-duplicate"])
def test_a_replay_with_hints_plumbed_but_none_given_is_the_replay_without(policy, monkeypatch):
    plain = run(policy, False, monkeypatch)
    SessionHintedPlane.commits = 0
    hinted = run(policy, True, monkeypatch)
    assert SessionHintedPlane.commits == plain["counters"]["requests"] > 600
    assert plain["counters"]["dram_evictions"] > 0 and plain["counters"]["ssd_writes"] > 0  # the tiers are busy
    assert hinted == plain


@pytest.mark.skipif(not TRACE.exists(), reason="the shared traces are not here")
def test_a_replay_with_an_agents_hints_prewarms_and_ends_its_sessions():
    from saria.replay.hints import derive_hints

    trace = load_trace(TRACE)
    chunk = ChunkSpec.for_model("qwen3-8b", chunk_tokens=64)
    chunks = [chunk_keys(r, trace.block_tokens, chunk.chunk_tokens) for r in trace.requests]
    schedule = make_schedule(trace, "auto", window_hours=0.2, seed=3)
    config = SariaConfig(dram=Capacity(tokens=8_000), ssd=Capacity(tokens=40_000), chunk=chunk,
                         policy=Policy.preset("saria"))
    hints = derive_hints(schedule, chunks, accuracy=1.0)
    sessions = schedule.sessions
    assert sum(h.done for h in hints if h is not None) == len(sessions)
    for s in sessions:  # the next turn's gap, exactly, at accuracy 1
        assert [hints[r].next_turn_s for r in s.requests[:-1]] == list(s.gaps_s)
    wrong = derive_hints(schedule, chunks, accuracy=0.5, seed=1)
    differ = sum(a.next_turn_s != b.next_turn_s for a, b in zip(hints, wrong) if a.next_turn_s is not None)
    assert 0 < differ < len(trace.requests)
    run = replay("saria+hints", trace, chunks, schedule, config, hints=hints, audit=True)
    assert run.audit == []
    assert run.hints["sessions_done"] == len(sessions) and run.hints["prewarms_hinted"] > 0
    assert run.hints["hinted_requests"] == len(trace.requests)


def test_a_chat_platform_pins_the_prefixes_shared_across_sessions():
    from saria.replay.arrivals import Schedule, SessionPlan
    from saria.replay.hints import derive_hints

    chunks = [("sys", "a1"), ("sys", "b1"), ("sys", "c1", "c2"), ("own",)]
    schedule = Schedule("recorded", tuple(SessionPlan(float(i), (i,), ()) for i in range(4)))
    hints = derive_hints(schedule, chunks)
    assert [h.pin_chunks if h else None for h in hints] == [1, 1, 1, None]
    assert all(h.session is None and h.next_turn_s is None for h in hints if h)


@pytest.mark.skipif(not TRACE.exists(), reason="the shared traces are not here")
def test_saria_replay_hints_adds_each_policy_with_hints(capsys):
    from saria.commands.cli import main

    assert main(["replay", str(TRACE), "--chunk-tokens", "64", "--dram-tokens", "8000", "--ssd-tokens", "40000",
                 "--policy", "saria", "--hints", "trace", "--hint-accuracy", "0.8", "--jobs", "1",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "saria+hints" in out and "accuracy 0.8" in out
    hits = next(line for line in out.splitlines() if line.startswith("prewarm hit tokens")).split()
    assert hits[-1] != "0"  # saria+hints, last column: its next_turn_s prewarms were read
    with pytest.raises(SystemExit):
        main(["replay", str(TRACE), "--hints", "trace", "--hint-accuracy", "1.5"])


@pytest.mark.skipif(not TRACE.exists(), reason="the shared traces are not here")
def test_saria_sweep_hints_replays_its_points_with_hints_and_its_references_without(capsys, monkeypatch):
    from saria.commands.cli import main
    from saria.replay import runner

    seen = []
    real = runner.job_hints
    monkeypatch.setattr(runner, "job_hints", lambda job, *a: seen.append((job.name, job.hint_accuracy)) or real(job, *a))
    assert main(["sweep", str(TRACE), "--chunk-tokens", "64", "--dram-tokens", "8000", "--ssd-tokens", "40000",
                 "--theta-e", "2", "--hints", "trace", "--hint-accuracy", "0.9", "--jobs", "1", "--no-progress"]) == 0
    assert "cache hints derived from the trace (accuracy 0.9" in capsys.readouterr().out
    hinted = {name for name, accuracy in seen if accuracy == 0.9}
    plain = {name for name, accuracy in seen if accuracy is None}
    assert hinted == {"saria E2"} and {"full-duplicate", "dram-only (reference)"} <= plain
    assert len(hinted) + len(plain) == len(set(seen))
