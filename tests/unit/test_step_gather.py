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
    g.taken("a", 0.0); g.submitted("a", 0.2)
    g.taken("a", 1.0); g.submitted("a", 1.1)
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
