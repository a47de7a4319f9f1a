"""The SLM-children step of Algorithm 3 (lines 9-14): an SLM forward's log q into the tree's new nodes.

Each frontier row proposes its ``topk`` most likely tokens (``top_candidates``: ties to the lower token id,
D5; ``-inf`` entries are never proposed); a token the row already has as a child is skipped, not replaced by
the next one. Candidate ``c`` of row ``v`` scores ``(s(v) + ln q(c|v)) + a``; theta is the ``node_budget``-th
highest score over the tree's nodes and all candidates (-inf when there are fewer, inf for a budget of 0),
and the candidates with ``s >= theta`` join the tree in frontier order, then by descending q, then by token
id (``expand``). ``logprob_rows`` and ``candidate_rows`` read an SLM output (a bare ``[rows, V]`` matrix or a
``RowLogprobs``; all forward rows or only the tree rows) for that step.

``mobile_client.tree`` drives it for HyCo's tree (one pass, two for HyCo-2P) and ``mobile_client.baselines``
for the SpecEdge-style grower (its own width and decay). Log-probabilities may be torch tensors or numpy
arrays; the scores are float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm_hyco.errors import TreeBuildError
from vllm_hyco.handoff.tree_contract import NodeLabel

if TYPE_CHECKING:
    from mobile_client.tree import FrontierPlan, _Nodes

_LOGQ_SLACK = 1e-3  # a log-probability above this is not one (logits passed by mistake)


def _topk_rows(lp: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest entries of each row, descending: (values float64 [R, k], cols int64 [R, k])."""
    if type(lp).__module__.startswith("torch"):
        vals, cols = lp.detach().topk(k, dim=1)
        return vals.double().cpu().numpy(), cols.cpu().numpy()
    lp = np.asarray(lp)
    V = lp.shape[1]
    cols = np.argpartition(lp, V - k, axis=1)[:, V - k:]  # [R, k] unordered
    vals = np.take_along_axis(lp, cols, axis=1).astype(np.float64)
    order = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(cols, order, axis=1).astype(np.int64)


def _row_exact(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Slow path for one row whose k-th and (k+1)-th values tie: the k best, ties to the lower column."""
    row = np.asarray(row, dtype=np.float64)
    thr = np.partition(row, row.size - k)[row.size - k]
    cols = np.nonzero(row >= thr)[0] if thr > -math.inf else np.nonzero(row > -math.inf)[0]
    cols = cols[np.lexsort((cols, -row[cols]))][:k]
    return row[cols], cols.astype(np.int64)


def _checked_ids(ids: Any, v: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    if ids.shape != (v,) or (v > 1 and not bool(np.all(ids[1:] > ids[:-1]))):
        raise TreeBuildError(f"keep_ids must be {v} strictly increasing full-vocabulary ids, one per "
                             f"column, got shape {ids.shape}")
    return ids


def top_candidates(lp: Any, k: int, ids: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's k most likely tokens, ties to the lower token id (D5); -inf entries are never proposed.

    ``lp``: [R, V] log q (torch tensor or numpy array); ``ids``: [V] keep-set -> full-vocabulary id map
    (sorted ascending), or None for the full vocabulary. Returns flat arrays ``(row, token, logq)``,
    sorted by (row, -logq, token).

    >>> r, t, q = top_candidates(np.log(np.array([[0.5, 0.25, 0.25]])), 2)
    >>> r.tolist(), t.tolist()
    ([0, 0], [0, 1])
    """
    R, V = lp.shape
    k = min(k, V)
    if R == 0 or k <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64)
    vals, cols = _topk_rows(lp, min(k + 1, V))  # [R, k(+1)]
    if np.isnan(vals).any():
        raise TreeBuildError("SLM log-probabilities contain NaN")
    if k < V:
        ties = np.nonzero(vals[:, k] == vals[:, k - 1])[0]
        vals, cols = vals[:, :k].copy(), cols[:, :k].copy()
        for r in ties.tolist():
            rv, rc = _row_exact(lp[r].detach().double().cpu().numpy() if hasattr(lp, "detach") else lp[r], k)
            vals[r, :] = -math.inf
            vals[r, : rv.size], cols[r, : rc.size] = rv, rc
    if vals.max(initial=-math.inf) > _LOGQ_SLACK:
        raise TreeBuildError(
            f"SLM rows must be log-probabilities (log_softmax), got a value {vals.max():.3g} > 0")
    rows = np.repeat(np.arange(R, dtype=np.int64), k)
    vals, cols = vals.reshape(-1), cols.reshape(-1)
    tokens = cols if ids is None else _checked_ids(ids, V)[cols]
    finite = vals > -math.inf
    rows, tokens, vals = rows[finite], tokens[finite], vals[finite]
    order = np.lexsort((tokens, -vals, rows))
    return rows[order], tokens[order], vals[order]


def _bth_highest(scores: np.ndarray, b: int) -> float:
    """theta of Algorithm 3 line 14: the b-th highest score, -inf when fewer than b (inf when b == 0)."""
    if b <= 0:
        return math.inf
    if scores.size < b:
        return -math.inf
    return float(np.partition(scores, scores.size - b)[scores.size - b])


def expand(nodes: _Nodes, rows: Sequence[int], lp: Any, ids: Any, *, topk: int, node_budget: int,
           a: float, lp_rows: Sequence[int] | None = None) -> list[int]:
    """Algorithm 3 lines 9-14 for one SLM pass: candidates under ``rows`` (F order), threshold, insert into
    ``nodes`` (the rows of the growing tree, ``mobile_client.tree._Nodes``).

    ``lp`` row i belongs to frontier position i, or, with ``lp_rows`` (a permutation), frontier position
    i's log q is ``lp[lp_rows[i]]`` (saves copying a [R, V] matrix into F order). Returns inserted rows."""
    prow, tok, q = top_candidates(lp, topk, ids)
    if lp_rows is not None:
        pos = np.empty(len(lp_rows), dtype=np.int64)  # [R] lp row -> frontier position
        pos[np.asarray(lp_rows, dtype=np.int64)] = np.arange(len(lp_rows))
        prow = pos[prow]
        order = np.lexsort((tok, -q, prow))
        prow, tok, q = prow[order], tok[order], q[order]
    parent = np.asarray(rows, dtype=np.int64)[prow]
    score = (np.asarray(nodes.scores, dtype=np.float64)[parent] + q) + a  # [n_cand] float64
    fresh = np.array([t not in nodes.kids[p] for p, t in zip(parent.tolist(), tok.tolist())], dtype=bool)
    parent, tok, score = parent[fresh], tok[fresh], score[fresh]
    theta = _bth_highest(np.concatenate([np.asarray(nodes.scores[1:], dtype=np.float64), score]), node_budget)
    sel = np.nonzero(score >= theta)[0]
    return [nodes.add(int(parent[i]), int(tok[i]), float(score[i]), NodeLabel.SLM) for i in sel.tolist()]


def logprob_rows(out: Any) -> tuple[Any, Any]:
    """Accept a bare [rows, V] tensor/array or an object with ``.logprobs`` (and optional ``.ids``)."""
    if hasattr(out, "logprobs"):
        return out.logprobs, getattr(out, "ids", None)
    return out, None


def candidate_rows(plan: FrontierPlan, lp: Any) -> Any:
    """The tree-row part of an SLM output: all forward rows (catch-up first) or just the tree rows."""
    if lp.shape[0] == plan.num_rows:
        return lp[len(plan.catch_up):]
    if lp.shape[0] == len(plan.rows):
        return lp
    raise TreeBuildError(f"SLM output has {lp.shape[0]} rows; the plan has {len(plan.catch_up)} catch-up and "
                         f"{len(plan.rows)} tree rows")
