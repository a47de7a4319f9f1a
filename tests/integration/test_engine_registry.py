"""SessionRegistry rules (vLLM-free; lives beside the engine tests it supports): rounds, timeouts, LRU cap."""

from __future__ import annotations

import pytest

from vllm_hyco.errors import SessionError
from vllm_hyco.vllm_adapter.engine_core.sessions import RoundTree, SessionRegistry, SessionState


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _parked(reg: SessionRegistry, sid: str, blocks: int = 0):
    s = reg.add(sid, req_id=f"r-{sid}", eps=None)
    s.num_kv_blocks = blocks
    reg.mark_parked(s)
    return s


def _code(fn) -> str:
    with pytest.raises(SessionError) as info:
        fn()
    return info.value.code


def test_round_rules():
    reg = SessionRegistry(clock=Clock())
    s = reg.add("a", req_id="r-a", eps=None)
    assert _code(lambda: reg.check_submit("a", 0)) == "session_busy"  # still prefilling
    assert _code(lambda: reg.check_submit("b", 0)) == "unknown_session"
    reg.mark_parked(s)
    assert _code(lambda: reg.check_submit("a", 1)) == "future_round"
    reg.start_round(reg.check_submit("a", 0), RoundTree(0, [5], [-1], None))
    assert s.state is SessionState.VERIFYING
    assert _code(lambda: reg.check_submit("a", 0)) == "session_busy"
    reg.finish_round(s, {"bonus": 7})
    reg.mark_parked(s)
    assert _code(lambda: reg.check_submit("a", 0)) == "duplicate_round"
    reg.start_round(reg.check_submit("a", 1), RoundTree(1, [7], [-1], None))
    reg.finish_round(s, {"bonus": 8})
    reg.mark_parked(s)
    assert _code(lambda: reg.check_submit("a", 0)) == "stale_round"
    assert reg.take_verdict("a", 1) == {"bonus": 8}
    assert _code(lambda: reg.take_verdict("a", 1)) == "no_verdict"
    reg.mark_finished(s, "session_timeout")
    assert _code(lambda: reg.check_submit("a", 2)) == "session_timeout"
    assert _code(lambda: reg.add("x", req_id="r-x", eps=None) and reg.add("x", req_id="r-y", eps=None)) \
        == "duplicate_session"


def test_idle_timeout_and_lru_cap():
    clock = Clock()
    reg = SessionRegistry(idle_timeout_s=10.0, max_parked_blocks=5, clock=clock)
    _parked(reg, "a", blocks=3)
    clock.now = 4.0
    b = _parked(reg, "b", blocks=2)
    clock.now = 6.0
    _parked(reg, "c", blocks=2)
    assert [s.sid for s in reg.lru_parked()] == ["a", "b", "c"]
    assert [s.sid for s in reg.over_cap()] == ["a"]  # 7 blocks pinned, cap 5: evict the LRU one
    clock.now = 12.0
    assert [s.sid for s in reg.idle_expired()] == ["a"]
    reg.start_round(b, RoundTree(0, [1], [-1], None))  # verifying sessions never time out or get evicted
    clock.now = 100.0
    assert [s.sid for s in reg.idle_expired()] == ["a", "c"]
    assert b not in reg.over_cap() and len(reg) == 3


def test_finished_sessions_are_forgotten_after_a_grace_period():
    clock = Clock()
    reg = SessionRegistry(idle_timeout_s=10.0, clock=clock)
    s = _parked(reg, "a")
    reg.mark_finished(s, "session_timeout")
    clock.now = 59.0
    assert reg.sweep_finished() == [] and _code(lambda: reg.check_submit("a", 0)) == "session_timeout"
    clock.now = 61.0
    assert reg.sweep_finished() == ["a"] and reg.by_req("r-a") is None
    assert _code(lambda: reg.check_submit("a", 0)) == "unknown_session"
