"""Prometheus metrics of HyCo sessions, served by vLLM's own ``/metrics`` route.

The WebSocket route runs in the API-server process, so these live in that process's
``prometheus_client`` registry, which vLLM's ``/metrics`` exposes. Multiprocess caveat: with several API
servers (``--api-server-count > 1``, refused for HyCo by docs/decisions.md D7) vLLM switches
prometheus_client to multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``); counters would then aggregate across
processes and the gauge would need a ``multiprocess_mode``. Created once per process (idempotent :func:`get`).

The metrics, each as ``name`` (type): labels:

* ``vllm_hyco_sessions_total`` (counter): ``outcome``: opened, finished, resumed, expired, refused
* ``vllm_hyco_rounds_total`` (counter): none
* ``vllm_hyco_accepted_tokens_total`` (counter): ``depth`` (1..32), ``source`` (chain, runner_up, slm, other,
  unlabelled)
* ``vllm_hyco_bonus_tokens_total`` (counter): none
* ``vllm_hyco_bytes_total`` (counter): ``direction``: up (frames received), down (frames sent)
* ``vllm_hyco_parked_sessions`` (gauge): sessions held by the endpoint (connected or waiting for a resume)
* ``vllm_hyco_rejected_trees_total`` (counter): ``code`` (bad_round, bad_tree, budget_exceeded, ...)
* ``vllm_hyco_error_frames_total`` (counter): ``code``
* ``vllm_hyco_node_budget`` (histogram): nodes granted per verdict (the budget policy's choice)
* ``vllm_hyco_verified_nodes`` (histogram): nodes of the phone's tree the server verified (after its cut)
* ``vllm_hyco_step_cost_seconds`` (gauge): ``term``: fixed, per_row, per_row_kctx, per_tree, per_branching,
  per_plain, per_head, rmse: the step-cost model's fit
* ``vllm_hyco_step_cost_steps`` (gauge): steps the cost model was fitted on
* ``vllm_hyco_mode_tokens_total`` (counter): ``mode``: phone, server: committed tokens by the mode that drafted
  them (the mode shares; no per-session label, a session's own share is in its engine info)
* ``vllm_hyco_mode_switches_total`` (counter): ``to``: phone, server; ``vllm_hyco_mode_refusals_total``
  (counter): ``code`` (server_mode_unavailable, server_mode_full, server_busy, ...)
* ``vllm_hyco_server_mode_sessions`` (gauge): sessions in server mode now; ``vllm_hyco_server_mode_paused_total``
  (counter): stretches paused because the phone's credit window ran out (or its socket went)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hyco.engine_contract import BudgetInfo

SOURCES = {0: "root", 1: "chain", 2: "runner_up", 3: "slm", 4: "other"}
NODE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)


@dataclass
class HycoMetrics:
    sessions: Any
    rounds: Any
    accepted: Any
    bonus: Any
    bytes: Any
    parked: Any
    rejected: Any
    errors: Any
    budget: Any = None
    verified: Any = None
    cost: Any = None
    cost_steps: Any = None
    mode_tokens: Any = None
    switches: Any = None
    mode_refusals: Any = None
    server_sessions: Any = None
    paused: Any = None

    def node_budget(self, info: BudgetInfo | None, granted: int) -> None:
        """One verdict's budget: the nodes granted, the nodes verified, the cost model's current fit."""
        self.budget.observe(granted)
        if info is None:
            return
        if info.nodes_verified is not None:
            self.verified.observe(info.nodes_verified)
        cost = info.cost
        for term, ms in (("fixed", cost.fixed_ms), ("per_row", cost.per_row_ms), ("per_row_kctx", cost.per_krow_ctx_ms),
                         ("per_tree", cost.per_tree_ms), ("per_branching", cost.per_branching_ms),
                         ("per_plain", cost.per_plain_ms), ("per_head", cost.per_head_ms), ("rmse", cost.rmse_ms),
                         ("spread", cost.spread_ms)):
            if ms is not None:
                self.cost.labels(term=term).set(ms / 1e3)
        self.cost_steps.set(cost.steps)

    def accepted_path(self, path_rows: list[int], labels: tuple[int, ...] | None) -> None:
        for depth, row in enumerate(path_rows, start=1):
            src = "unlabelled" if labels is None else SOURCES.get(labels[row], "other")
            self.accepted.labels(depth=str(depth), source=src).inc()


_METRICS: HycoMetrics | None = None


def get() -> HycoMetrics:
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Gauge, Histogram

        p = "vllm_hyco_"
        _METRICS = HycoMetrics(
            sessions=Counter(p + "sessions", "HyCo phone sessions by outcome", ["outcome"]),
            rounds=Counter(p + "rounds", "HyCo rounds verified (one tree each)"),
            accepted=Counter(p + "accepted_tokens", "Accepted draft tokens by depth and source",
                             ["depth", "source"]),
            bonus=Counter(p + "bonus_tokens", "Bonus tokens committed by HyCo rounds"),
            bytes=Counter(p + "bytes", "HyCo WebSocket frame bytes", ["direction"]),
            parked=Gauge(p + "parked_sessions", "HyCo sessions held by the endpoint"),
            rejected=Counter(p + "rejected_trees", "Trees refused before verification", ["code"]),
            errors=Counter(p + "error_frames", "Error frames sent to phones", ["code"]),
            budget=Histogram(p + "node_budget", "Draft nodes granted per verdict (budget policy)",
                             buckets=NODE_BUCKETS),
            verified=Histogram(p + "verified_nodes", "Tree nodes verified per round (after the budget cut)",
                               buckets=NODE_BUCKETS),
            cost=Gauge(p + "step_cost_seconds", "Engine step-cost model: fixed, per row, per row x 1000 "
                       "context tokens, per request, and its RMSE", ["term"]),
            cost_steps=Gauge(p + "step_cost_steps", "Engine steps the step-cost model was fitted on"),
            mode_tokens=Counter(p + "mode_tokens", "Committed tokens of phone sessions by mode", ["mode"]),
            switches=Counter(p + "mode_switches", "Session mode switches done", ["to"]),
            mode_refusals=Counter(p + "mode_refusals", "Session mode switches refused", ["code"]),
            server_sessions=Gauge(p + "server_mode_sessions", "Phone sessions in server mode now"),
            paused=Counter(p + "server_mode_paused", "Server-mode stretches paused for want of credit"),
        )
    return _METRICS
