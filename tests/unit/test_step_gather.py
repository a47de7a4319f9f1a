"""Step gathering (``vllm_hyco.spec_decode.gather``, issue 16): a tree-only step waits at most one predicted
step time, and only for sessions expected within it; the option is validated like the others."""

from __future__ import annotations

import pytest

from vllm_hyco.config import HycoConfig
from vllm_hyco.errors import ConfigError
from vllm_hyco.spec_decode.gather import StepGather


def _gather(gap: float = 0.1) -> StepGather:
    g = StepGather()
    for sid in ("a", "b", "c"):
        g.taken(sid, 0.0)
        g.submitted(sid, gap)
    return g


def test_no_hold_without_an_expected_session():
    g = _gather()
    g.taken("a", 1.0)
    assert g.hold_until(1.0, 0.05, [], now=1.0) is None  # nobody in a round trip
    assert g.hold_until(1.0, 0.05, ["b"], now=1.0) is None  # b never had its verdict taken: no estimate
    assert g.hold_until(1.0, 0.05, ["a"], now=1.0) is None  # a is expected at 1.1, after 1.0 + 0.05


def test_hold_is_bounded_by_one_predicted_step():
    g = _gather()
    g.taken("a", 0.96)  # expected at 1.06
    assert g.hold_until(1.0, 0.08, ["a"], now=1.01) == pytest.approx(1.08)
    assert g.hold_until(1.0, 0.08, ["a"], now=1.08) is None  # the deadline passed: run
    assert g.hold_until(1.0, 0.0, ["a"], now=1.0) is None  # no fitted cost: never hold
    g.taken("c", 0.5)  # expected at 0.6: overdue by more than one step at 1.01, not waited for
    assert g.hold_until(1.0, 0.08, ["c"], now=1.01) is None


def test_round_trip_is_an_average_and_submission_ends_the_wait():
    g = StepGather(alpha=0.5)
    g.taken("a", 0.0)
    g.submitted("a", 0.2)
    g.taken("a", 1.0)
    g.submitted("a", 1.1)
    assert g.gap["a"] == pytest.approx(0.15)
    assert g.expected("a") is None  # submitted: no longer in its round trip
    g.taken("a", 2.0)
    assert g.expected("a") == pytest.approx(2.15)
    g.forget("a")
    assert g.expected("a") is None and "a" not in g.gap


def test_step_gather_option():
    assert HycoConfig().gathers and not HycoConfig(budget_policy="static").gathers
    assert HycoConfig(budget_policy="static", step_gather="on").gathers
    assert not HycoConfig(step_gather="off").gathers
    with pytest.raises(ConfigError, match="step_gather"):
        HycoConfig(step_gather="always")


def test_a_late_round_shifts_every_expected_arrival():
    # three sessions with 100 ms round trips; this round all of them run 80 ms late (phones released
    # together, a slow link): without the shift b and c look overdue when a's tree comes and nothing holds
    g = _gather(0.1)
    for sid in ("a", "b", "c"):
        g.taken(sid, 1.0)
    g.submitted("a", 1.18)  # 80 ms later than its average said
    assert g.late["a"] == pytest.approx(0.08)
    assert g.hold_until(1.18, 0.05, ["b", "c"], now=1.18) is None  # no shift: overdue, not waited for
    assert g.hold_until(1.18, 0.05, ["b", "c"], now=1.18, pending=["a"]) == pytest.approx(1.23)
    # an early round likewise: b and c are expected 50 ms early, inside the window
    h = _gather(0.2)
    for sid in ("a", "b", "c"):
        h.taken(sid, 1.0)
    h.submitted("a", 1.15)
    assert h.hold_until(1.15, 0.03, ["b"], now=1.15) is None
    assert h.hold_until(1.15, 0.03, ["b"], now=1.15, pending=["a"]) == pytest.approx(1.18)


def test_the_shift_is_bounded_by_the_waited_sessions_round_trip():
    g = _gather(0.1)
    for sid in ("a", "b"):
        g.taken(sid, 1.0)
    g.submitted("a", 3.0)  # 1.9 s late: b's shift is capped at its own 0.1 s round trip (expected 1.2)
    assert g.lateness(["a"]) == pytest.approx(1.9)
    assert g.hold_until(3.0, 0.05, ["b"], now=3.0, pending=["a"]) is None
    g.forget("a")
    assert g.lateness(["a"]) == 0.0


def test_the_window_grows_with_the_trees_expected_to_join():
    # a burst of 8 sessions expected 5 ms apart: a step of the pending tree alone is predicted at 10 ms
    # (only the first two fit), a step with k more trees at 10 + 5k ms (all eight fit)
    g = StepGather()
    names = [f"s{i}" for i in range(8)]
    for i, sid in enumerate(names):
        g.taken(sid, 0.0)
        g.submitted(sid, 0.1)
        g.taken(sid, 1.0)
        g.gap[sid] = 0.1 + 0.005 * (i + 1)  # expected at 1.105, 1.110, ..., 1.140
    assert g.hold_until(1.1, 0.01, names, now=1.1) == pytest.approx(1.11)
    end = g.hold_until(1.1, lambda k: 0.01 + 0.005 * k, names, now=1.1)
    assert end == pytest.approx(1.1 + 0.01 + 0.005 * 8)
    # a session expected long after every step it could join is not waited for
    assert g.hold_until(1.1, lambda k: 0.01 + 0.005 * k, ["s7"], now=1.1) is None
