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
