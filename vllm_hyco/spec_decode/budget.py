"""The adaptive node budget: how many rows of each session's tree the server verifies (numpy only).

A round of a session costs the server its share of one engine step, and a step's cost grows with the rows
it schedules (wide trees load more experts at low load and cost arithmetic under load). A node is worth
its expected committed tokens. This module holds the three parts of the decision, all engine-agnostic:

* :class:`AcceptanceModel`: per-session running estimates of the *conditional* acceptance of a node given
  that its parent was accepted, by (depth, source label), from the rounds the server verified. Estimates
  shrink towards the engine-wide estimate of the same cell, which shrinks towards the label's pooled
  estimate, which starts from the paper's per-edge factor ``PRIOR_ACCEPT`` (λ = 0.66, Algorithm 3): λ for
  a chain node, λ (1 - λ) for any other node (a sibling of a likelier node: tried when it fails). A node's
  expected acceptance is the product of the conditional estimates along its path (siblings are exclusive
  and the likelier is tried first: one node's children, likeliest first, share at most 1, each keeping at
  most what the likelier ones left). Phone-sent values are
  untrusted until the session's verdicts show them to predict better than the server (``trust.ValueTrust``);
  until then :func:`bound_values`' ``min(phone, server)`` per node holds, so they can only lower a node.
  :func:`reliability_table` bins predicted against observed acceptance (calibration).
* :class:`StepCostModel`: the step's cost as ``c0 + c1 * rows + c2 * kctx + c3 * trees + c4 * branching +
  c5 * plain``, with ``rows`` the tokens the step scheduled, ``kctx`` the attention work (sum over
  requests of rows times context, in thousands of tokens), ``trees`` its HyCo rounds (what a tree costs
  whatever its size: its decision, KV compaction, hand-off and utility calls), ``branching`` those of its
  trees that are not chains (only those pay the tree-attention override) and ``plain`` its other requests
  (prefills, ordinary decodes), fitted online by recursive least squares on the measured steps. No cost
  constant is set by hand: until ``min_steps`` steps whose row counts spread (three distinct counts, the
  largest at least twice the smallest) were seen the model is not ``ready`` and the policy probes: it cuts
  trees in turn to all their nodes, their chain, a quarter, their chain and one node more, and a half (a
  lone phone's full trees would give every step the same rows, from which no per-row cost can be fitted,
  and big trees branch while small ones are chains).
* :func:`choose_nodes`: the cut rule. A session whose round shares a step with ``n`` requests pays
  ``c0 / n + c3`` (its share of the step's fixed cost and its own per-tree cost), ``c4`` when the kept
  prefix is not a chain, plus the marginal cost ``m = c1 + c2 * ctx / 1000`` per row (the root
  included). With nodes in value order, it keeps the prefix of ``k >= 1`` nodes that minimises its
  expected cost per committed token ``(c0 / n + c3 + c4 [k > chain] + m (k + 1)) / (1 + sum of the k
  values)`` (the bonus token counts): a node is kept only when its expected tokens per unit of cost beat
  the session's average, so no row is verified whose expected committed tokens are worth less than its
  cost. Every session keeps at least its first node (no starvation). Flat cost (``m`` ~ 0) keeps whole
  trees; steep cost keeps chains.

:class:`BudgetPolicy` ties them to sessions and steps (the HyCo scheduler calls it, through
``vllm_adapter/engine_core/node_budget.py``). Example::

    >>> choose_nodes([1.0, 0.9, 0.8, 0.1, 0.05], fixed=10.0, per_row=0.1)   # fixed cost dominates
    4
    >>> choose_nodes([1.0, 0.9, 0.8, 0.1, 0.05], fixed=0.5, per_row=1.0)    # rows cost: keep the best
    2
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_hyco import envs
from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import MAX_NODE_BUDGET, NodeLabel, depths
from vllm_hyco.spec_decode.step_cost import StepCostModel
from vllm_hyco.spec_decode.trust import ValueTrust

PRIOR_ACCEPT = 0.66  # the paper's per-edge acceptance factor λ (Algorithm 3): the estimate before any round
PRIOR_STRENGTH = 2.0  # pseudo-observations behind each level's prior
SESSION_HALF_LIFE = 64.0  # rounds after which a session's old observations count half
ENGINE_HALF_LIFE = 2048.0  # rounds (of any session) after which the engine-wide ones count half
NUM_LABELS = len(NodeLabel)
POLICIES = ("adaptive", "static")


# ---------------------------------------------------------------------------------------- acceptance


class _Counts:
    """Decayed (trials, accepted) by (depth, label); ``version`` counts the updates (for the cached tables)."""

    def __init__(self, max_depth: int, half_life: float):
        self.trials = np.zeros((max_depth + 1, NUM_LABELS))
        self.accepted = np.zeros((max_depth + 1, NUM_LABELS))
        self.keep = 0.5 ** (1.0 / half_life)
        self.version = 0

    def add(self, cells: Sequence[tuple[int, int, bool]]) -> None:
        """One round's trials, ``(depth, label, accepted)`` each (a handful: plain indexing beats np.add.at)."""
        self.trials *= self.keep
        self.accepted *= self.keep
        t, a = self.trials, self.accepted
        for d, lab, ok in cells:
            t[d, lab] += 1.0
            if ok:
                a[d, lab] += 1.0
        self.version += 1


def _check_tree(par: list[int]) -> None:
    """``parents[0] == -1`` and ``0 <= parents[i] < i`` (``tree_contract``'s rule, as a TreeValidationError)."""
    if not par or par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
        depths(par)  # raises the contract's own error


def _labels(labels: Sequence[int] | None, n: int) -> np.ndarray:
    if labels is None:
        out = np.full(n, int(NodeLabel.OTHER), dtype=np.int64)
        out[0] = int(NodeLabel.ROOT)
        return out
    out = np.asarray(labels, dtype=np.int64)
    if out.shape != (n,):
        raise TreeValidationError(f"labels has {out.shape[0] if out.ndim else 0} rows but the tree has {n}",
                                  code="length_mismatch")
    return np.clip(out, 0, NUM_LABELS - 1)


class AcceptanceModel:
    """Conditional acceptance by (depth, label): one engine-wide table and one per session."""

    def __init__(self, max_depth: int = MAX_NODE_BUDGET, *, prior: float = PRIOR_ACCEPT,
                 strength: float = PRIOR_STRENGTH, session_half_life: float = SESSION_HALF_LIFE,
                 engine_half_life: float = ENGINE_HALF_LIFE):
        self.max_depth, self.prior, self.strength = max_depth, prior, strength
        self.session_half_life = session_half_life
        self.engine = _Counts(max_depth, engine_half_life)
        self.sessions: dict[str, _Counts] = {}
        # the shrunk tables, rebuilt only after an update: every tree of a step is planned before any of its
        # rounds is observed, so a step's plans share the engine's and reuse each session's
        self._engine_cell: tuple[int, np.ndarray] | None = None
        self._session_cell: dict[str, tuple[int, int, np.ndarray]] = {}

    def _session(self, sid: str) -> _Counts:
        c = self.sessions.get(sid)
        if c is None:
            c = self.sessions[sid] = _Counts(self.max_depth, self.session_half_life)
        return c

    def forget(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self._session_cell.pop(sid, None)

    def conditional(self, sid: str | None = None) -> np.ndarray:
        """[max_depth + 1, NUM_LABELS] P(node accepted | parent accepted), shrunk level by level (read only: a
        cached table)."""
        s, e = self.strength, self.engine
        if self._engine_cell is None or self._engine_cell[0] != e.version:
            prior = np.full(NUM_LABELS, self.prior * (1.0 - self.prior))
            prior[[NodeLabel.ROOT, NodeLabel.CHAIN]] = self.prior
            pooled = (e.accepted.sum(0) + s * prior) / (e.trials.sum(0) + s)  # [labels]
            self._engine_cell = (e.version, (e.accepted + s * pooled) / (e.trials + s))
        cell = self._engine_cell[1]
        c = self.sessions.get(sid) if sid is not None else None
        if c is None or sid is None:
            return cell
        hit = self._session_cell.get(sid)
        if hit is None or hit[0] != e.version or hit[1] != c.version:
            hit = self._session_cell[sid] = (e.version, c.version, (c.accepted + s * cell) / (c.trials + s))
        return hit[2]

    def node_values(self, parents: Sequence[int], labels: Sequence[int] | None = None,
                    sid: str | None = None) -> np.ndarray:
        """[n] float64 expected acceptance of every row (1 for the root): products along the paths."""
        par = [int(p) for p in parents]
        n = len(par)
        _check_tree(par)
        table = self.conditional(sid)
        lab = _labels(labels, n).tolist()
        depth = [0] * n
        cond = [1.0] * n
        for j in range(1, n):
            depth[j] = min(depth[par[j]] + 1, self.max_depth)
            cond[j] = float(table[depth[j], lab[j]])
        # siblings are exclusive (at most one child is accepted) and the likelier is tried first: each child,
        # likeliest first (ties to the earlier row), keeps at most what the ones before it left of 1
        if any(par[j] != j - 1 for j in range(1, n)):  # a chain has no siblings
            left = [1.0] * n
            for j in sorted(range(1, n), key=lambda j: (-cond[j], j)):
                cond[j] = min(cond[j], left[par[j]])
                left[par[j]] -= cond[j]
        vals = [1.0] * n
        for j in range(1, n):
            vals[j] = vals[par[j]] * cond[j]
        return np.asarray(vals)

    def observe(self, sid: str | None, parents: Sequence[int], labels: Sequence[int] | None,
                path_rows: Sequence[int]) -> None:
        """One verified round: every node whose parent was accepted is a trial at (depth, label)."""
        par = [int(p) for p in parents]
        n = len(par)
        if n < 2:
            return
        _check_tree(par)
        lab = _labels(labels, n).tolist()
        accepted = [False] * n
        accepted[0] = True
        for r in path_rows:
            if 0 < int(r) < n:
                accepted[int(r)] = True
        depth = [0] * n
        cells = []
        for j in range(1, n):
            depth[j] = depth[par[j]] + 1
            if accepted[par[j]]:
                cells.append((min(depth[j], self.max_depth), lab[j], accepted[j]))
        self.engine.add(cells)
        if sid is not None:
            self._session(sid).add(cells)


def bound_values(server: np.ndarray, phone: Sequence[float] | None) -> np.ndarray:
    """The values the cut uses: ``min(phone, server)`` per row (NaN or missing phone values: the server's),
    clipped to [0, 1]. Phone values can only lower a node, never raise it above the server's estimate."""
    if phone is None:
        return server
    ph = np.asarray(phone, dtype=np.float64)
    if ph.shape != server.shape:
        raise TreeValidationError(f"values has {ph.size} entries but the tree has {server.size} rows",
                                  code="length_mismatch")
    return np.clip(np.fmin(server, ph), 0.0, 1.0)


def reliability_table(predicted: Sequence[float], observed: Sequence[float], bins: int = 10) -> list[dict]:
    """Calibration: per bin of predicted acceptance, the rows, the mean prediction and the observed rate.

    >>> reliability_table([0.1, 0.1, 0.9, 0.9], [0, 0, 1, 1], bins=2)[1]
    {'lo': 0.5, 'hi': 1.0, 'n': 2, 'predicted': 0.9, 'observed': 1.0}
    """
    p = np.asarray(predicted, dtype=np.float64)
    o = np.asarray(observed, dtype=np.float64)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    out = []
    for b in range(bins):
        m = idx == b
        n = int(m.sum())
        out.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n,
                    "predicted": round(float(p[m].mean()), 4) if n else None,
                    "observed": round(float(o[m].mean()), 4) if n else None})
    return out


def calibration_error(table: list[dict]) -> float:
    """Expected calibration error: the row-weighted mean |predicted - observed| over the bins."""
    n = sum(r["n"] for r in table)
    return sum(r["n"] * abs(r["predicted"] - r["observed"]) for r in table if r["n"]) / max(n, 1)


# ---------------------------------------------------------------------------------------------- cost


# ----------------------------------------------------------------------------------------------- cut


def chain_prefix(parents: Sequence[int]) -> int:
    """How many leading nodes (after the root) form one chain, each the child of the row before it: every
    prefix of at most that many nodes is a chain (vLLM's own attention verifies it).

    >>> chain_prefix([-1, 0, 1, 2, 1]), chain_prefix([-1, 0, 0]), chain_prefix([-1])
    (3, 1, 0)
    """
    par = np.asarray(parents, dtype=np.int64)
    off = np.flatnonzero(par[1:] != np.arange(len(par) - 1))
    return int(off[0]) if len(off) else len(par) - 1


def recomputed(parents: Sequence[int]) -> bool:
    """The attention overrides recompute this tree's rows: it is not a chain, or ``VLLM_HYCO_CHAIN_ATTN`` is
    ``tree``. A chain (every row the child of the row before it) has the causal mask and sequential
    positions, so vLLM's own attention already computes its rows exactly. The worker's tree plan
    (``masked_trees``) and the scheduler's step-cost model (its ``branching`` term) both ask this.

    >>> recomputed([-1, 0, 1]), recomputed([-1, 0, 0])
    (False, True)
    """
    return envs.VLLM_HYCO_CHAIN_ATTN != "stock" or chain_prefix(parents) < len(parents) - 1


def choose_nodes(values: Sequence[float] | np.ndarray, *, fixed: float, per_row: float, branch: float = 0.0,
                 chain: int | None = None, least: int = 1) -> int:
    """Nodes to keep (``min(least, n) <= k <= n``; 0 for a root-only tree): the prefix minimising the
    expected cost per committed token ``(fixed + per_row * (k + 1) + branch * [k > chain]) / (1 + values[1]
    + ... + values[k])``, first minimum. ``branch``: what a tree that is not a chain adds (its tree
    attention); ``chain``: how many leading nodes form a chain (:func:`chain_prefix`; None: every prefix is
    charged alike); ``least``: the fewest nodes kept (the operator's ``budget_floor``), the best prefix of
    at least that many is chosen.

    ``values``: [n + 1] expected acceptance per row in tree order (row 0 the root, ignored).

    >>> choose_nodes([1.0, 0.9, 0.1, 0.05, 0.01], fixed=0.5, per_row=1.0)
    1
    >>> choose_nodes([1.0, 0.9, 0.1, 0.05, 0.01], fixed=0.5, per_row=1.0, least=3)
    3
    """
    v = values.tolist() if isinstance(values, np.ndarray) else list(values)
    n = len(v) - 1
    if n <= 0:
        return 0
    fixed, per_row, branch = max(fixed, 0.0), max(per_row, 0.0), max(branch, 0.0)
    least = min(max(int(least), 1), n)
    if fixed == 0.0 and per_row == 0.0 and (chain is None or branch == 0.0 or chain >= n):
        return n  # nothing costs anything: verify it all
    # a plain loop: trees have at most MAX_NODE_BUDGET nodes, and numpy's per-call cost is most of it there
    best, best_k, tokens = math.inf, least, 1.0
    for k in range(1, n + 1):
        tokens += max(float(v[k]), 0.0)
        cost = fixed + per_row * (k + 1) + (branch if chain is not None and k > chain else 0.0)
        if k >= least and cost / tokens < best:
            best, best_k = cost / tokens, k
    return best_k


@dataclass
class Plan:
    """One session's cut: ``nodes`` of ``sent`` kept; ``values`` the bounded value of every kept row."""

    nodes: int
    sent: int
    values: np.ndarray  # [nodes + 1]
    predicted: np.ndarray  # [nodes + 1] the server's own estimate (for the reliability table)
    phone: np.ndarray | None = None  # [nodes + 1] the phone's values, when it sent them (its trust is learnt)


class BudgetPolicy:
    """The engine's node-budget policy: ``adaptive`` (cut trees, adapt the granted budget) or ``static``.

    ``cap``: the operator's ``node_budget`` (never exceeded). ``floor``: the operator's ``budget_floor``,
    the fewest nodes of a tree verified and granted (1..cap; a tree of fewer nodes is verified whole): set to
    Cloud+MTP's K, the server never verifies fewer rows of a phone's tree than vLLM's MTP would draft.
    ``log_size``: (predicted, observed) node pairs kept for :meth:`reliability`.
    """

    def __init__(self, cap: int, policy: str = "adaptive", *, floor: int = 1, max_rows: int | None = None,
                 min_steps: int = 16, log_size: int = 20_000):
        if policy not in POLICIES:
            raise ValueError(f"budget_policy {policy!r}: choose from {', '.join(POLICIES)}")
        if not 1 <= int(floor) <= int(cap):
            raise ValueError(f"budget_floor {floor}: between 1 and the node budget ({cap})")
        self.cap, self.policy, self.floor = int(cap), policy, int(floor)
        self.acceptance = AcceptanceModel()
        self.trust = ValueTrust()
        self.cost = StepCostModel(max_rows=max_rows, min_steps=min_steps)
        self.log: deque[tuple[float, float]] = deque(maxlen=log_size)
        self.last_nodes: int | None = None  # the last cut's kept nodes (for the metrics)
        self.probes = 0  # trees cut short to vary the steps' rows and shapes while the cost model is not ready

    @property
    def adaptive(self) -> bool:
        return self.policy == "adaptive"

    def plan(self, sid: str | None, parents: Sequence[int], labels: Sequence[int] | None = None,
             phone_values: Sequence[float] | None = None, *, ctx: int = 0, sharing: int = 1) -> Plan:
        """The cut of one tree verified in a step with ``sharing`` requests, context ``ctx`` tokens."""
        server = self.acceptance.node_values(parents, labels, sid)
        vals = server if phone_values is None else self._trusted(sid, server, phone_values)
        sent = len(vals) - 1
        nodes = sent
        chain = chain_prefix(parents)
        if self.adaptive and self.cost.ready and sent > 1:
            c0, _, _ = self.cost.coef
            nodes = choose_nodes(vals, fixed=c0 / max(sharing, 1) + self.cost.per_tree,
                                 per_row=self.cost.marginal(ctx), branch=self.cost.per_branching, chain=chain,
                                 least=self.floor)
        elif self.adaptive and sent > 1:
            # until the model is ready, probe: a lone phone sends full trees, so every step would have the
            # same rows and the fit could not tell a row's cost from the step's, nor a branching tree's
            # from a chain's; cut each tree in turn to all of it, its chain, a quarter, its chain and one
            # node more (a branching tree of nearly the chain's rows), a half
            sizes = (sent, chain, sent // 4, chain + 1, sent // 2)
            nodes = min(sent, max(self.floor, sizes[self.probes % len(sizes)]))
            self.probes += 1
        self.last_nodes = nodes
        phone = None if phone_values is None else np.asarray(phone_values, dtype=np.float64)[: nodes + 1]
        return Plan(nodes, sent, vals[: nodes + 1], server[: nodes + 1], phone)

    def _trusted(self, sid: str | None, server: np.ndarray, phone_values: Sequence[float]) -> np.ndarray:
        bound_values(server, phone_values)  # the shape check (length_mismatch)
        return self.trust.values(sid, server, phone_values)

    def observe_round(self, sid: str | None, parents: Sequence[int], labels: Sequence[int] | None,
                      path_rows: Sequence[int], predicted: np.ndarray | None = None,
                      phone: np.ndarray | None = None) -> None:
        self.acceptance.observe(sid, parents, labels, path_rows)
        if predicted is not None and len(predicted) > 1:
            hit = np.zeros(len(predicted), dtype=bool)
            hit[[r for r in path_rows if 0 < r < len(predicted)]] = True
            self.log.extend(zip(predicted[1:].tolist(), hit[1:].astype(float).tolist()))
            if phone is not None:
                self.trust.observe(sid, predicted, phone[: len(predicted)], hit, depths(list(parents))[: len(hit)])

    def observe_step(self, rows: int, kctx: float, seconds: float, trees: int = 1, branching: int = 0,
                     plain: int = 0, head: int = 0) -> bool:
        return self.cost.observe(rows, kctx, seconds, trees, branching, plain, head)

    def next_budget(self, plan: Plan | None, *, first_round: bool = False) -> int:
        """Nodes granted for the session's next round: the cap (static, or after the session's first round,
        whose tree is the SLM's alone (docs/decisions.md D2) and so says nothing about the size of the
        hybrid trees that follow); else the nodes kept when the server cut the tree (a probe included); the
        cap while the cost model is not ready; else twice the nodes (up to the cap) when it kept every node
        sent, so a session whose trees pay grows back to the cap. So after any round but the first, the
        phone knows how many of its nodes were verified: ``min(sent, budget)``. Never below the floor (a
        cut keeps at least the floor's nodes, so a cut session is still granted what it kept)."""
        if not self.adaptive or plan is None or first_round:
            return self.cap
        if plan.nodes < plan.sent:
            return max(self.floor, min(plan.nodes, self.cap))
        if not self.cost.ready:
            return self.cap
        return max(self.floor, min(2 * max(plan.nodes, 1), self.cap))

    def forget(self, sid: str) -> None:
        self.acceptance.forget(sid)
        self.trust.forget(sid)

    def reliability(self, bins: int = 10) -> list[dict]:
        if not self.log:
            return reliability_table([], [], bins)
        p, o = zip(*self.log)
        return reliability_table(p, o, bins)

    def snapshot(self) -> dict:
        return {"policy": self.policy, "cap": self.cap, "floor": self.floor, "last_nodes": self.last_nodes,
                **self.cost.snapshot()}
