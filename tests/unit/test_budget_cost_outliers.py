"""The step-cost model leaves a one-off slow step out of its fit (spec_decode/step_cost.py): a 5-second stall
among 10-20 ms steps neither moves the fitted costs nor the residual, and the residual stays below the fitted
steps' own spread; without the gate (OUTLIER_K infinite) the same stall wrecks the fit, as it did in a
committed run."""

import math
import random

from vllm_hyco.spec_decode.step_cost import StepCostModel


def _fit(gate: bool) -> StepCostModel:
    m = StepCostModel()
    if not gate:
        m.OUTLIER_K = math.inf
    rng = random.Random(0)
    for i in range(400):
        rows = rng.choice((1, 5, 9, 17, 33))
        trees = rng.choice((1, 2))
        seconds = 0.004 + 0.0003 * rows + 0.002 * trees + rng.gauss(0, 0.0005)
        if i == 200:
            seconds = 5.0  # a stall
        m.observe(rows, 0.1, seconds, trees=trees, branching=trees - 1)
    return m


def test_a_stall_is_left_out_and_the_residual_stays_below_the_spread():
    m = _fit(gate=True)
    snap = m.snapshot()
    assert snap["outliers"] == 1
    assert abs(snap["per_row_ms"] - 0.3) < 0.05 and snap["rmse_ms"] < snap["spread_ms"]
    assert abs(m.predict(17, 0.1, trees=1) - (0.004 + 0.0003 * 17 + 0.002)) < 0.001


def test_without_the_gate_the_stall_wrecks_the_fit():
    snap = _fit(gate=False).snapshot()
    assert snap["outliers"] == 0 and snap["rmse_ms"] > snap["spread_ms"]


def test_a_fit_that_is_wrong_learns_again():
    """The gate leaves out slow stalls only: after a regime change to much cheaper steps (and after a run of
    much dearer ones) the fit follows the steps instead of rejecting them as outliers."""
    m = StepCostModel()
    rng = random.Random(1)
    for cost_per_row, n in ((0.003, 300), (0.0003, 600), (0.002, 600)):
        for _ in range(n):
            rows = rng.choice((1, 5, 9, 17, 33))
            m.observe(rows, 0.1, 0.004 + cost_per_row * rows + rng.gauss(0, 0.0002), trees=1)
        assert abs(m.snapshot()["per_row_ms"] - 1e3 * cost_per_row) < 0.3 * 1e3 * cost_per_row + 0.05  # not stuck
    assert m.snapshot()["rmse_ms"] < m.snapshot()["spread_ms"]
