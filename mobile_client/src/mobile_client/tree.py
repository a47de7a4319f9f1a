"""The phone's hybrid draft tree: paper Algorithm 3 (BuildTree) with docs/decisions.md D3 and D5.

A tree is a list of rows in insertion order. Row 0 is the root (the last committed token, the previous
round's bonus token); every other row is a drafted node whose parent is an earlier row:

    tokens[i]   token id of row i (full-vocabulary id)
    parents[i]  row index of its parent; parents[0] == -1

Scores (natural log) follow Algorithm 3, with ``a = ln(lam)`` (lam = 0.66, a ~ -0.4155):

    chain node y_k            s = s(y_{k-1}) + a             (y_0 is the root, s(root) = 0)
    runner-up y'_k (k <= D)   s = s(y_{k-1}) + 2a            only when y'_k != y_k
    SLM candidate c of v      s = (s(v) + ln q(c|v)) + a     skipped when v already has a child c

Worked example (paper Figure 2, K = 4, D = 2): root ``r``, chain ``[a1, a2, a3, a4]``, runner-ups
``[b1, b2]`` plant 7 rows in insertion order ``r, a1, a2, a3, a4, b1, b2`` with scores
``0, a, 2a, 3a, 4a, 2a, 3a``. The SLM frontier F is ordered by descending score, ties to the earlier row
(D5): ``r, a1, a2, b1, a3, b2, a4``. Each frontier row proposes its 32 most likely tokens (ties to the lower
id); the candidates join the tree in that order if they reach the B-th best score, and the tree is cut to
the B best nodes (ties to the earlier row). Since every edge adds at most ``a < 0``, a node always scores
below its parent, so the B best nodes are closed under ancestors.

``build_tree`` is the pure function of issue 7; ``build_draft_tree`` returns the richer ``DraftTree``;
``plant_tree`` + ``frontier_plan`` + ``grow_tree`` are the two-phase form a real SLM drafter drives (the
plan says which rows its one forward computes, catch-up rows included). The SLM-children step itself (top-k
candidates, theta, insertion) is ``mobile_client.candidates``. ``node_budget`` is B: drafted nodes, root
excluded. No vLLM here; torch is optional.

Sampled drafts (``mobile_client.drafters.sampling``): ``plant_tree(..., chain_q=...)`` keeps the
(ids, weights) each chain token was drawn from on its row (``DraftTree.draft_q``); growing, ``trim`` and
``value_order`` carry it with the row, and ``DraftTree.draft_q_dict()`` is the tree frame's ``draft_q``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mobile_client.candidates import candidate_rows, expand, logprob_rows
from vllm_hyco.errors import TreeBuildError, TreeValidationError
from vllm_hyco.handoff import tree_contract
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, MAX_TREE_ROWS, NodeLabel, PaddedTree

LAMBDA = 0.66  # per-edge acceptance factor (paper §3.1)
TOPK = 32  # SLM candidates per frontier row
DraftQRow = tuple[tuple[int, ...], tuple[int, ...]]  # (full-vocabulary ids, uint16 weights): q = w / sum(w)


@dataclass(frozen=True)
class DraftTree:
    """One drafted tree: rows in insertion order, the root first.

    >>> t = DraftTree.make_dummy([7, 8, 9, 5], [-1, 0, 1, 0])
    >>> t.num_nodes, t.depths()
    (3, [0, 1, 2, 1])
    """

    tokens: tuple[int, ...]  # [n + 1]
    parents: tuple[int, ...]  # [n + 1], parents[0] == -1, parents[i] < i
    scores: tuple[float, ...]  # [n + 1], float64 log-scores, scores[0] == 0
    sources: tuple[int, ...]  # [n + 1], NodeLabel values (the wire's per-node labels)
    node_budget: int = DEFAULT_NODE_BUDGET  # the node budget this tree was built for (pads to node_budget + 1 rows)
    # [n + 1] per row: the (ids, weights) a sampled chain node was drawn from, else None; None: no such row
    draft_q: tuple[DraftQRow | None, ...] | None = None

    @classmethod
    def make_dummy(cls, tokens: Sequence[int], parents: Sequence[int],
                   node_budget: int = DEFAULT_NODE_BUDGET) -> DraftTree:
        """A tree from plain lists (scores: one ``ln LAMBDA`` per edge; sources: CHAIN)."""
        a = math.log(LAMBDA)
        scores = [0.0]
        for p in parents[1:]:
            scores.append(scores[p] + a)
        sources = [NodeLabel.ROOT] + [NodeLabel.CHAIN] * (len(tokens) - 1)
        return cls(tuple(int(t) for t in tokens), tuple(int(p) for p in parents), tuple(scores),
                   tuple(int(s) for s in sources), node_budget)

    @property
    def num_nodes(self) -> int:
        """Drafted nodes, root excluded (the n <= B of D3)."""
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        """Each row's depth (the root's is 0), from the tree contract."""
        return tree_contract.depths(self.parents).tolist()

    def path(self, row: int) -> list[int]:
        """Rows from the root to ``row``, both included."""
        rows = [row]
        while self.parents[rows[-1]] >= 0:
            rows.append(self.parents[rows[-1]])
        return rows[::-1]

    def children(self, row: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == row]

    def ancestor_mask(self) -> np.ndarray:
        """[n + 1, n + 1] bool; ``[i, j]`` is True when row j is row i or one of its ancestors (any size;
        the tree contract's ``ancestor_matrix``)."""
        return tree_contract.ancestor_matrix(self.parents)

    def to_wire(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) with the root at row 0 and no padding, as D3 puts them on the wire."""
        return list(self.tokens), list(self.parents)

    def wire_dict(self, labels: bool = True) -> dict[str, list[int]]:
        """``{"tokens", "parents"[, "labels"]}``: the server's ``TokenTree.from_wire`` and
        ``TreeFrame.from_lists(round=..., **tree.wire_dict())`` take it as is."""
        out = {"tokens": list(self.tokens), "parents": list(self.parents)}
        if labels:
            out["labels"] = [int(s) for s in self.sources]
        return out

    def draft_q_dict(self) -> dict[int, DraftQRow] | None:
        """``{row: (ids, weights)}`` of the sampled rows (``TreeFrame.from_lists(draft_q=...)``), or None."""
        out = {r: q for r, q in enumerate(self.draft_q or ()) if q is not None}
        return out or None

    def _rows(self, rows: Sequence[int], parents: tuple[int, ...]) -> DraftTree:
        """The tree of ``rows`` (ancestors first), each row's fields carried, with the given ``parents``."""
        q = None if self.draft_q is None else tuple(self.draft_q[r] for r in rows)
        return DraftTree(tuple(self.tokens[r] for r in rows), parents, tuple(self.scores[r] for r in rows),
                         tuple(self.sources[r] for r in rows), self.node_budget,
                         q if q is not None and any(x is not None for x in q) else None)

    def head(self, k: int) -> DraftTree:
        """The root and the first ``k`` nodes: a tree, since parents come first (a value-ordered tree's
        head is its most valuable tree of ``k`` nodes).

        >>> DraftTree.make_dummy([7, 8, 9, 5], [-1, 0, 1, 0]).head(2).to_wire()
        ([7, 8, 9], [-1, 0, 1])
        """
        if k >= self.num_nodes:
            return self
        k = max(k, 0)
        return self._rows(range(k + 1), self.parents[:k + 1])

    def padded(self, rows: int | None = None) -> PaddedTree:
        """The static form (the tree contract's ``pad_tree``): ``rows`` (default node_budget + 1) rows, the last
        real row repeated; ``.ancestor_matrix()`` gives the [rows, rows] attention mask."""
        rows = self.node_budget + 1 if rows is None else rows
        try:
            return tree_contract.pad_tree(self.tokens, self.parents, rows)
        except TreeValidationError as e:
            raise TreeBuildError(str(e)) from e


@dataclass(frozen=True)
class FrontierPlan:
    """The rows one SLM forward computes (Algorithm 3 line 7-8, D5), in forward order.

    Forward row ``i < len(catch_up)`` is a catch-up row: a committed token before the root that has no SLM
    KV yet (oldest first). It is computed in the same pass and gets no candidates; after the forward the
    drafter holds its KV as committed context, so later plans no longer list it. The other forward rows
    are the tree rows ``rows`` (indices into ``tokens``), by descending score, ties to the earlier row.
    Position of forward row i = position of the root + ``positions()[i]`` (catch-up rows sit just before
    the root). Every forward row attends to the SLM's committed window plus ``attend_mask()[i]``.
    """

    catch_up: tuple[int, ...]  # committed tokens before the root without SLM KV, oldest first
    rows: tuple[int, ...]  # tree rows computed in this pass, forward order
    tokens: tuple[int, ...]  # all tree rows so far (insertion order)
    parents: tuple[int, ...]  # all tree rows so far

    @property
    def num_rows(self) -> int:
        return len(self.catch_up) + len(self.rows)

    def forward_tokens(self) -> list[int]:
        return list(self.catch_up) + [self.tokens[r] for r in self.rows]

    def positions(self) -> list[int]:
        """Offsets from the root's position: ``-c .. -1`` for catch-up rows, depth for tree rows."""
        depth = tree_contract.depths(self.parents)
        c = len(self.catch_up)
        return list(range(-c, 0)) + [int(depth[r]) for r in self.rows]

    def attend_mask(self) -> np.ndarray:
        """[num_rows, len(catch_up) + len(tokens)] bool over (catch-up tokens ++ all tree rows so far)."""
        c = len(self.catch_up)
        anc = tree_contract.ancestor_matrix(self.parents)
        mask = np.zeros((self.num_rows, c + len(self.tokens)), dtype=bool)
        mask[:c, :c] = np.tril(np.ones((c, c), dtype=bool))
        mask[c:, :c] = True
        mask[c:, c:] = anc[list(self.rows)]
        return mask

    def row_paths(self) -> list[list[int]]:
        """Each forward row's tokens from the first catch-up token to the row itself (for toy SLMs)."""
        tree = DraftTree.make_dummy(self.tokens, self.parents)
        out = [list(self.catch_up[: i + 1]) for i in range(len(self.catch_up))]
        out += [list(self.catch_up) + [self.tokens[j] for j in tree.path(r)] for r in self.rows]
        return out


class _Nodes:
    """Mutable rows while a tree grows (insertion order)."""

    def __init__(self, tree: DraftTree):
        self.tokens = list(tree.tokens)
        self.parents = list(tree.parents)
        self.scores = list(tree.scores)
        self.sources = list(tree.sources)
        self.q: list[DraftQRow | None] = list(tree.draft_q or [None] * len(self.tokens))
        self.kids: list[set[int]] = [set() for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            self.kids[self.parents[i]].add(self.tokens[i])

    def add(self, parent: int, token: int, score: float, source: NodeLabel,
            q: DraftQRow | None = None) -> int:
        self.tokens.append(token)
        self.q.append(q)
        self.parents.append(parent)
        self.scores.append(score)
        self.sources.append(int(source))
        self.kids.append(set())
        self.kids[parent].add(token)
        return len(self.tokens) - 1

    def freeze(self, node_budget: int) -> DraftTree:
        q = tuple(self.q) if any(x is not None for x in self.q) else None
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.scores), tuple(self.sources),
                         node_budget, q)


def _log_lambda(lam: float) -> float:
    if not 0.0 < lam <= 1.0:
        raise TreeBuildError(f"lam must be in (0, 1], got {lam}; the paper uses 0.66")
    return math.log(lam)


def _check_token(t: Any, what: str) -> int:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or t < 0:
        raise TreeBuildError(f"{what} must be a non-negative int token id, got {t!r}")
    return int(t)


def plant_tree(root: int, chain: Sequence[int], runner_ups: Sequence[int], *, lam: float = LAMBDA,
               node_budget: int = DEFAULT_NODE_BUDGET, chain_q: Sequence[DraftQRow] | None = None) -> DraftTree:
    """Algorithm 3 lines 2-6: the root, the MTP chain and its runner-up siblings, with their scores.
    ``chain_q`` (sampled drafts): the (ids, weights) each chain token was drawn from, kept on its row."""
    a = _log_lambda(lam)
    if len(runner_ups) > len(chain):
        raise TreeBuildError(f"{len(runner_ups)} runner-ups for a chain of {len(chain)}: need D <= K")
    if chain_q is not None and len(chain_q) != len(chain):
        raise TreeBuildError(f"{len(chain_q)} draft distributions for a chain of {len(chain)}")
    nodes = _Nodes(DraftTree((_check_token(root, "root"),), (-1,), (0.0,), (int(NodeLabel.ROOT),), node_budget))
    u = [0]
    for k, y in enumerate(chain):
        q = None if chain_q is None else (tuple(map(int, chain_q[k][0])), tuple(map(int, chain_q[k][1])))
        u.append(nodes.add(u[-1], _check_token(y, "chain token"), nodes.scores[u[-1]] + a, NodeLabel.CHAIN,
                           q))
    for k, y2 in enumerate(runner_ups, start=1):
        if _check_token(y2, "runner-up") != int(chain[k - 1]):
            nodes.add(u[k - 1], int(y2), nodes.scores[u[k - 1]] + 2 * a, NodeLabel.RUNNER_UP)
    return nodes.freeze(node_budget)


def frontier_order(scores: Sequence[float], rows: Sequence[int]) -> list[int]:
    """``rows`` by descending score, ties to the earlier (lower) row (D5)."""
    return sorted(rows, key=lambda r: (-scores[r], r))


def frontier_plan(tree: DraftTree, rows: Sequence[int] | None = None,
                  catch_up: Sequence[int] = ()) -> FrontierPlan:
    """The plan of one SLM forward over ``rows`` (default: every row of ``tree``) after ``catch_up``."""
    rows = range(len(tree.tokens)) if rows is None else rows
    order = frontier_order(tree.scores, rows)
    return FrontierPlan(tuple(int(t) for t in catch_up), tuple(order), tree.tokens, tree.parents)




def trim(tree: DraftTree, node_budget: int) -> DraftTree:
    """Algorithm 3 lines 16-17: the ``node_budget`` best nodes (ties to the earlier row) and their ancestors,
    in insertion order, parents re-indexed."""
    n = len(tree.tokens)
    order = sorted(range(1, n), key=lambda r: (-tree.scores[r], r))[: max(node_budget, 0)]
    keep = {0}
    for r in order:
        while r not in keep:
            keep.add(r)
            r = tree.parents[r]
    kept = sorted(keep)
    new_row = {r: i for i, r in enumerate(kept)}
    return tree._rows(kept, tuple(-1 if r == 0 else new_row[tree.parents[r]] for r in kept))


def value_order(tree: DraftTree, values: Sequence[float] | None = None) -> DraftTree:
    """The same nodes, rows by descending value, the root first, parents re-indexed.

    ``values`` None: the value is the Algorithm-3 score (ties to the earlier row). A node scores strictly
    below its parent (every edge adds ``ln q + a`` with ``a < 0``; with ``lam = 1`` a tie goes to the
    parent, the earlier row), so parents still come before children, and every prefix of ``k`` nodes is the
    ``trim(tree, k)`` node set: the most valuable tree of its size. The server may verify only a prefix
    (its adaptive budget), so the phone sends trees in this order.

    ``values`` [n + 1] in insertion order: an expected acceptance per row that never exceeds its parent's
    (a product of conditional rates along the path, ``vllm_hyco.spec_decode.budget.AcceptanceModel``); rows
    by descending value, ties by score, then the earlier row. The node set is unchanged; a prefix is then
    the most valuable tree of its size by those values. An order that would put a child before its parent
    falls back to the tree as it is.

    >>> t = DraftTree.make_dummy([7, 8, 9, 5], [-1, 0, 1, 0])   # scores 0, a, 2a, a
    >>> value_order(t).to_wire()
    ([7, 8, 5, 9], [-1, 0, 0, 1])
    >>> value_order(t, [1.0, 0.9, 0.8, 0.05]).to_wire()   # the chain pays more than the sibling
    ([7, 8, 9, 5], [-1, 0, 1, 0])
    """
    if values is not None and len(values) != len(tree.tokens):
        raise TreeBuildError(f"value_order: {len(values)} values for a tree of {len(tree.tokens)} rows")
    def key(r: int) -> tuple:  # by value (when given), then by score, then by row
        return (-tree.scores[r], r) if values is None else (-float(values[r]), -tree.scores[r], r)

    order = [0] + sorted(range(1, len(tree.tokens)), key=key)
    new_row = {r: i for i, r in enumerate(order)}
    parents = tuple(-1 if r == 0 else new_row[tree.parents[r]] for r in order)
    if any(p >= i for i, p in enumerate(parents) if i):  # values not decreasing along a path: keep as is
        return tree
    return tree._rows(order, parents)




def chain_rows(parents: Sequence[int], sources: Sequence[int]) -> list[int]:
    """The MTP chain's rows in depth order: from the root, each node's first CHAIN-labelled child.

    >>> chain_rows([-1, 0, 1, 0, 2], [0, 1, 1, 2, 3])  # row 3 a runner-up, row 4 an SLM child
    [1, 2]
    """
    rows, node = [], 0
    while True:
        child = next((i for i in range(1, len(parents)) if parents[i] == node and sources[i] == NodeLabel.CHAIN),
                     None)
        if child is None:
            return rows
        rows.append(child)
        node = child


def chain_first(tree: DraftTree, values: Sequence[float]) -> list[float]:
    """``values`` raised so that the MTP chain (:func:`chain_rows`) sorts first in depth order under
    :func:`value_order`; every other row keeps its value (at most 1, an acceptance estimate). Every prefix of
    at most the chain's length is then a chain.

    >>> t = DraftTree.make_dummy([7, 8, 9, 5], [-1, 0, 1, 0])  # rows 1, 2: the chain; row 3 a sibling
    >>> value_order(t, chain_first(t, [1.0, 0.5, 0.1, 0.3])).to_wire()
    ([7, 8, 9, 5], [-1, 0, 1, 0])
    """
    out = [float(v) for v in values]
    for depth, row in enumerate(chain_rows(tree.parents, tree.sources), start=1):
        out[row] = 2.0 - depth / MAX_TREE_ROWS
    return out


def _grow(planted: DraftTree, plan: FrontierPlan, lp: Any, ids: Any, *, node_budget: int | None, topk: int,
          lam: float, second_pass: Callable[[FrontierPlan], Any] | None,
          lp_rows: Sequence[int] | None = None) -> DraftTree:
    node_budget = planted.node_budget if node_budget is None else node_budget
    if node_budget < 0:
        raise TreeBuildError(f"node_budget must be >= 0, got {node_budget}")
    a = _log_lambda(lam)
    nodes = _Nodes(planted)
    added = expand(nodes, plan.rows, lp, ids, topk=topk, node_budget=node_budget, a=a, lp_rows=lp_rows)
    if second_pass is not None and added:
        plan2 = frontier_plan(nodes.freeze(node_budget), added)
        lp2, ids2 = logprob_rows(second_pass(plan2))
        expand(nodes, plan2.rows, candidate_rows(plan2, lp2), ids if ids2 is None else ids2,
               topk=topk, node_budget=node_budget, a=a)
    return trim(nodes.freeze(node_budget), node_budget)


def grow_tree(planted: DraftTree, plan: FrontierPlan, slm_logprobs: Any, *, node_budget: int | None = None,
              topk: int = TOPK, lam: float = LAMBDA, keep_ids: Any = None,
              second_pass: Callable[[FrontierPlan], Any] | None = None) -> DraftTree:
    """Algorithm 3 lines 9-17 on a planted tree, given the SLM output for ``plan`` (forward-row order).

    ``slm_logprobs``: [plan.num_rows or len(plan.rows), V] log q over the keep set (``keep_ids`` maps
    column -> full id) or the full vocabulary, or a ``RowLogprobs``-like object (``.logprobs``, ``.ids``).
    ``second_pass`` (HyCo-2P, line 15) runs the SLM over a new plan whose rows are the nodes the first
    pass added and returns their log q the same way.
    """
    lp, ids = logprob_rows(slm_logprobs)
    return _grow(planted, plan, candidate_rows(plan, lp), keep_ids if ids is None else ids,
                 node_budget=node_budget, topk=topk, lam=lam, second_pass=second_pass)


def build_draft_tree(root: int, chain: Sequence[int], runner_ups: Sequence[int], slm_logprobs: Any, *,
                     node_budget: int = DEFAULT_NODE_BUDGET, lam: float = LAMBDA, topk: int = TOPK,
                     keep_ids: Any = None,
                     second_pass: Callable[[FrontierPlan], Any] | None = None) -> DraftTree:
    """``build_tree`` returning the whole ``DraftTree`` (scores, sources, padding, masks).

    ``slm_logprobs``: [R, V] log q of the planted rows in insertion order (root, chain tokens, then each
    planted runner-up), R = 1 + K + #planted runner-ups; over the keep set when ``keep_ids`` is given.
    """
    planted = plant_tree(root, chain, runner_ups, lam=lam, node_budget=node_budget)
    lp, ids = logprob_rows(slm_logprobs)
    if lp.shape[0] != len(planted.tokens):
        raise TreeBuildError(
            f"slm_logprobs has {lp.shape[0]} rows; expected {len(planted.tokens)} (root, {len(chain)} chain "
            f"tokens, {len(planted.tokens) - 1 - len(chain)} planted runner-ups, in insertion order)")
    plan = frontier_plan(planted)
    return _grow(planted, plan, lp, keep_ids if ids is None else ids, node_budget=node_budget, topk=topk,
                 lam=lam, second_pass=second_pass, lp_rows=plan.rows)


def build_tree(root: int, chain: Sequence[int], runner_ups: Sequence[int], slm_logprobs: Any, *,
               node_budget: int = DEFAULT_NODE_BUDGET, lam: float = LAMBDA,
               topk: int = TOPK) -> tuple[list[int], list[int]]:
    """Algorithm 3 (issue 7 item 1): the kept rows' ``(tokens, parents)`` in insertion order, unpadded.

    Shape: slm_logprobs [1 + K + #planted runner-ups, V] over the full vocabulary.

    >>> import math
    >>> lp = np.full((2, 4), math.log(0.25))
    >>> build_tree(5, [1], [], lp, node_budget=3)
    ([5, 1, 0, 2], [-1, 0, 0, 0])
    """
    tree = build_draft_tree(root, chain, runner_ups, slm_logprobs, node_budget=node_budget, lam=lam, topk=topk)
    return tree.to_wire()
