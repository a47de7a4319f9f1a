"""The node budget's step-cost model (numpy only): what a verification step costs the server, fitted online on
the steps the scheduler measures (``vllm_adapter/engine_core/node_budget.py``); ``budget.BudgetPolicy`` cuts
trees with it. Re-exported by ``vllm_hyco.spec_decode.budget``.
"""

from __future__ import annotations

import math

import numpy as np


class StepCostModel:
    """Step seconds ~ ``c0 + c1 * rows + c2 * kctx + c3 * trees + c4 * branching + c5 * plain + c6 * head``,
    recursive least squares with forgetting.

    Features are scaled internally (rows / 64, kctx / 64, trees, branching and plain / 16, head / 64) so the fit is
    well conditioned; the prior is a wide ridge around zero (``prior_var``), so the first steps decide the
    fit. Steps scheduling more than ``max_rows`` tokens (prefill chunks far outside any verification step)
    are not fitted. ``trees`` separates what a tree costs from what a row costs: on the CPU build, at 16
    trees a step, the per-tree work (decision, hand-off, utility calls) is most of a step
    (docs/benchmarks.md), and a model without the term charged it to rows and cut trees to 1-2 nodes.
    ``branching`` counts the step's trees that are not chains: only those pay the tree-attention override
    (a chain keeps vLLM's own attention, ``vllm_adapter/tree_plan.masked_trees``), so the cut sees that a
    tree cut to its chain costs less than one that keeps a sibling. Big trees branch and small ones are
    chains, so the term is collinear with the rows unless the steps include chains and branching trees of
    nearly the same size: the policy's probes (:meth:`BudgetPolicy.plan`) cut trees to their chain and to
    one node more. ``plain`` keeps the requests without a tree apart: a prefill step has no decision, no
    compaction and no hand-off, and with one ``reqs`` term for both, the tree steps' own work was charged
    to ``branching`` (10 ms per branching tree against about 1.3 ms measured; docs/engine.md). ``head`` is
    the MTP head work of the step's ordinary requests on a server that drafts them (vLLM's MTP, the hyco
    option ``model``): ordinary requests drafted times the drafts each (K), so the head's forward passes are
    charged to them, not to the rows a tree adds (with a constant K it moves with ``plain``, and the ridge
    prior shares the two; with vLLM's per-batch-size K it does not).

    **Outliers.** A step far *slower* than the fit (its residual over ``OUTLIER_K`` times the larger of the fit's
    RMSE and the steps' own spread, once ``min_steps`` are in) is counted (``outliers``) and left out of the fit:
    a one-off multi-second step (a first-use compilation, a stall) once moved the whole fit (an RMSE of 2.5 s
    and 335 ms per branching tree in a committed run). Only slow steps are gated, and never more than
    ``MAX_IN_ROW`` in a row: a step far *faster* than the fit, or a run of slow ones, is the fit being wrong
    (the workload changed), and a gate on those locked a wrong fit in (a link sweep ran with 54 ms per
    branching tree, cutting phone trees to 1.7 verified nodes). ``spread_ms`` is the decayed standard
    deviation of the fitted steps' seconds: a sane fit has ``rmse_ms`` below it.
    """

    OUTLIER_K = 8.0
    MAX_IN_ROW = 3

    SCALE = np.array([1.0, 64.0, 64.0, 16.0, 16.0, 16.0, 64.0])

    def __init__(self, *, forget: float = 0.995, min_steps: int = 16, max_rows: int | None = None,
                 prior_var: float = 1e4):
        self.forget, self.min_steps, self.max_rows = forget, min_steps, max_rows
        self.theta = np.zeros(len(self.SCALE))
        self.P = np.eye(len(self.SCALE)) * prior_var
        self.steps = 0
        self.row_counts: set[int] = set()
        self.rows_lo, self.rows_hi = math.inf, 0  # the fewest and most rows of a fitted step
        self.sq_err = 0.0  # decayed squared residual (before each update)
        self.weight = 0.0
        self.sum_s = self.sum_s2 = 0.0  # decayed sums of the fitted steps' seconds (their spread)
        self.outliers = 0
        self._in_row = 0  # slow steps left out in a row
        self._snapshot: tuple[tuple[int, int], dict] | None = None  # (steps, outliers) -> snapshot

    def _x(self, rows: float, kctx: float, trees: float, branching: float = 0.0, plain: float = 0.0,
           head: float = 0.0) -> np.ndarray:
        return np.array([1.0, rows, kctx, trees, branching, plain, head]) / self.SCALE

    def observe(self, rows: int, kctx: float, seconds: float, trees: int = 1, branching: int = 0,
                plain: int = 0, head: int = 0) -> bool:
        """One measured step: ``trees`` HyCo rounds (``branching`` of them not chains), ``plain`` other
        requests and ``head`` MTP draft tokens made for them."""
        if rows <= 0 or not math.isfinite(seconds) or seconds < 0 or \
                (self.max_rows is not None and rows > self.max_rows):
            return False
        x = self._x(rows, kctx, max(int(trees), 0), max(int(branching), 0), max(int(plain), 0), max(int(head), 0))
        err = seconds - float(x @ self.theta)
        if (self.steps >= self.min_steps and self._in_row < self.MAX_IN_ROW
                and err > self.OUTLIER_K * max(self.rmse or 0.0, self.spread_s)):
            self.outliers += 1
            self._in_row += 1
            return False
        self._in_row = 0
        Px = self.P @ x
        gain = Px / (self.forget + float(x @ Px))
        self.theta = self.theta + gain * err
        self.P = (self.P - np.outer(gain, Px)) / self.forget
        self.steps += 1
        if len(self.row_counts) < 8:
            self.row_counts.add(int(rows))
        self.rows_lo, self.rows_hi = min(self.rows_lo, rows), max(self.rows_hi, rows)
        self.sq_err = self.forget * self.sq_err + err * err
        self.weight = self.forget * self.weight + 1.0
        self.sum_s = self.forget * self.sum_s + seconds
        self.sum_s2 = self.forget * self.sum_s2 + seconds * seconds
        return True

    @property
    def rmse(self) -> float | None:
        """The fit's decayed root-mean-square residual, seconds (each residual taken before its update)."""
        return math.sqrt(self.sq_err / self.weight) if self.weight else None

    @property
    def spread_s(self) -> float:
        """The decayed standard deviation of the fitted steps' seconds."""
        if not self.weight:
            return 0.0
        mean = self.sum_s / self.weight
        return math.sqrt(max(self.sum_s2 / self.weight - mean * mean, 0.0))

    @property
    def spread(self) -> bool:
        """The fitted steps' row counts are varied enough to separate the per-row cost from the fixed one:
        three distinct counts, the largest at least twice the smallest."""
        return len(self.row_counts) >= 3 and self.rows_hi >= 2 * self.rows_lo

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps and self.spread

    @property
    def coef(self) -> tuple[float, float, float]:
        """(fixed s, per-row s, per-(row x 1000 context tokens) s), each clipped at >= 0."""
        c = self.theta / self.SCALE
        return float(max(c[0], 0.0)), float(max(c[1], 0.0)), float(max(c[2], 0.0))

    @property
    def per_tree(self) -> float:
        """Seconds each HyCo round adds to a step whatever its rows (clipped at >= 0)."""
        return float(max(self.theta[3] / self.SCALE[3], 0.0))

    @property
    def per_plain(self) -> float:
        """Seconds each request without a tree adds to a step whatever its rows (clipped at >= 0)."""
        return float(max(self.theta[5] / self.SCALE[5], 0.0))

    @property
    def per_head(self) -> float:
        """Seconds each MTP draft token made for an ordinary request adds to a step (clipped at >= 0)."""
        return float(max(self.theta[6] / self.SCALE[6], 0.0))

    @property
    def per_branching(self) -> float:
        """Seconds each tree that is not a chain adds to a step (clipped at >= 0)."""
        return float(max(self.theta[4] / self.SCALE[4], 0.0))

    def predict(self, rows: float, kctx: float = 0.0, trees: int = 1, branching: int = 0, plain: int = 0,
                head: int = 0) -> float:
        """Predicted seconds of a step (the fit itself, unclipped: at one request a step, the fixed and
        per-tree terms are known only as their sum, and clipping one of them would bias it)."""
        x = self._x(rows, kctx, max(int(trees), 0), max(int(branching), 0), max(int(plain), 0), max(int(head), 0))
        return max(float(x @ self.theta), 0.0)

    def marginal(self, ctx: int) -> float:
        """Seconds one more row costs for a request with ``ctx`` tokens of context."""
        _, c1, c2 = self.coef
        return c1 + c2 * ctx / 1000.0

    def snapshot(self) -> dict:
        """The fit as plain numbers (ms), rebuilt only after an observed step (every round of a step asks)."""
        key = (self.steps, self.outliers)
        if self._snapshot is None or self._snapshot[0] != key:
            self._snapshot = (key, self._build_snapshot())
        return dict(self._snapshot[1])

    def _build_snapshot(self) -> dict:
        c0, c1, c2 = self.coef
        rmse = self.rmse
        return {"fixed_ms": round(c0 * 1e3, 6), "per_row_ms": round(c1 * 1e3, 6),
                "per_krow_ctx_ms": round(c2 * 1e3, 6), "per_tree_ms": round(self.per_tree * 1e3, 6),
                "per_branching_ms": round(self.per_branching * 1e3, 6), "per_plain_ms": round(self.per_plain * 1e3, 6),
                "per_head_ms": round(self.per_head * 1e3, 6),
                "steps": self.steps, "ready": self.ready,
                "rmse_ms": None if rmse is None else round(rmse * 1e3, 6),
                "spread_ms": round(self.spread_s * 1e3, 6), "outliers": self.outliers}
