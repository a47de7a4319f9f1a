"""The baselines' tree builders (paper Table 5): SpecEdge-style trees and proactive drafting (PD).

SpecEdge-style (SpecExec-style beam growth, as kaist-ina/specedge drafts on the edge):
the SLM alone grows a tree in ``passes`` (4) sequential forwards. Each pass expands the best ``beams``
(32) not-yet-expanded nodes, ranked by score, ties to the earlier row. Each expanded node v proposes its
``width`` (16) most likely tokens c with score ``(s(v) + ln q(c|v)) + decay`` (decay = ln 0.9, s(root) =
0), and a candidate joins the tree if it reaches the ``node_budget``-th best score among the tree's nodes
and this pass's candidates. At the end the tree is cut to the ``node_budget`` (32) best nodes, ties to the
earlier row (closed under ancestors, since every edge lowers the score).

Proactive drafting (SpecEdge's "bonus bet"): while the verdict is in flight, one SLM forward over the
tree's leaves picks the most likely (leaf, next token) pair, ``s(leaf) + ln 0.95 + ln q``: the bet is that
the whole root-to-leaf path is accepted and that token is the bonus. A tree rooted at the bet token is
grown (3 passes, decay ln 0.95) with the root and the path as catch-up rows. When the verdict arrives,
``ProactiveDraft.matches`` says whether the bet held; only then is the pre-grown tree reused.

``slm`` callables take a ``FrontierPlan`` and return ``[plan.num_rows, V]`` (or ``[len(plan.rows), V]``)
log q, over the keep set when ``keep_ids`` is given. They see the committed window they hold themselves,
then ``plan.catch_up``, then the tree rows (``plan.attend_mask()``, ``plan.row_paths()``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mobile_client.candidates import candidate_rows, expand, logprob_rows, top_candidates
from mobile_client.tree import DraftTree, FrontierPlan, TreeBuildError, _Nodes, frontier_order, frontier_plan, trim
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET, NodeLabel

SlmFn = Callable[[FrontierPlan], Any]

PASSES = 4  # SpecEdge-style: four sequential SLM passes
BEAMS = 32  # nodes expanded per pass at most
WIDTH = 16  # children proposed per expanded node
DECAY = math.log(0.9)  # per-edge decay of the main tree
PROACTIVE_PASSES = 3
PROACTIVE_DECAY = math.log(0.95)


class SpecEdgeGrower:
    """A SpecEdge-style tree being grown pass by pass (kept between passes for proactive reuse)."""

    def __init__(self, root: int, *, node_budget: int = DEFAULT_NODE_BUDGET, beams: int = BEAMS,
                 width: int = WIDTH, decay: float = DECAY, keep_ids: Any = None, catch_up: Sequence[int] = ()):
        if node_budget < 0 or beams < 1 or width < 1 or not decay < 0:
            raise TreeBuildError(f"need node_budget >= 0, beams >= 1, width >= 1, decay < 0; got {node_budget}, "
                                 f"{beams}, {width}, {decay}")
        self.node_budget, self.beams, self.width, self.decay = node_budget, beams, width, decay
        self.keep_ids = keep_ids
        self.nodes = _Nodes(DraftTree((int(root),), (-1,), (0.0,), (int(NodeLabel.ROOT),), node_budget))
        self.expanded: set[int] = set()
        self.catch_up = tuple(int(t) for t in catch_up)  # consumed by the first forward
        self.passes_run = 0

    def next_plan(self) -> FrontierPlan | None:
        """The next pass's plan: the best ``beams`` unexpanded rows (None when nothing is left)."""
        if self.node_budget == 0:
            return None
        open_rows = [r for r in range(len(self.nodes.tokens)) if r not in self.expanded]
        if not open_rows:
            return None
        rows = frontier_order(self.nodes.scores, open_rows)[: self.beams]
        return frontier_plan(self.nodes.freeze(self.node_budget), rows, self.catch_up)

    def grow(self, slm: SlmFn, passes: int) -> int:
        """Run up to ``passes`` SLM passes; returns how many ran (fewer when no candidate can join)."""
        ran = 0
        for _ in range(passes):
            plan = self.next_plan()
            if plan is None:
                break
            lp, ids = logprob_rows(slm(plan))
            added = expand(self.nodes, plan.rows, candidate_rows(plan, lp), self.keep_ids if ids is None else ids,
                           topk=self.width, node_budget=self.node_budget, a=self.decay)
            self.expanded.update(plan.rows)
            self.catch_up = ()
            ran += 1
            self.passes_run += 1
            if not added:
                break
        return ran

    def untrimmed(self) -> DraftTree:
        return self.nodes.freeze(self.node_budget)

    def result(self) -> DraftTree:
        """The tree cut to the ``node_budget`` best nodes, rows in insertion order."""
        return trim(self.untrimmed(), self.node_budget)


def specedge_tree(root: int, slm: SlmFn, *, passes: int = PASSES, node_budget: int = DEFAULT_NODE_BUDGET,
                  beams: int = BEAMS, width: int = WIDTH, decay: float = DECAY, keep_ids: Any = None,
                  catch_up: Sequence[int] = ()) -> DraftTree:
    """A SpecEdge-style tree of at most ``node_budget`` nodes from ``passes`` sequential SLM passes.

    >>> import numpy as np
    >>> uniform = lambda plan: np.full((plan.num_rows, 3), np.log(1 / 3))
    >>> specedge_tree(9, uniform, passes=2, node_budget=4).to_wire()
    ([9, 0, 1, 2, 0], [-1, 0, 0, 0, 1])
    """
    grower = SpecEdgeGrower(root, node_budget=node_budget, beams=beams, width=width, decay=decay,
                            keep_ids=keep_ids, catch_up=catch_up)
    grower.grow(slm, passes)
    return grower.result()


@dataclass
class ProactiveDraft:
    """The next tree, prepared while the reply is in flight, on the bet that ``path_tokens`` are accepted
    and ``bonus`` is the verifier's bonus token."""

    leaf_row: int  # row of the current tree where the bet path ends (0: nothing accepted)
    path_tokens: tuple[int, ...]  # tokens of the bet path, root excluded
    bonus: int  # the bet bonus token: the root of the prepared tree
    grower: SpecEdgeGrower = field(repr=False)  # the prepared tree, grown ``grower.passes_run`` passes

    @property
    def tree(self) -> DraftTree:
        return self.grower.result()

    def matches(self, accepted: Sequence[int], bonus: int) -> bool:
        """Whether the verdict (accepted tokens below the root, then the bonus) is the bet."""
        return tuple(int(t) for t in accepted) == self.path_tokens and int(bonus) == self.bonus

    def reuse(self, accepted: Sequence[int], bonus: int) -> SpecEdgeGrower | None:
        """The prepared grower when the bet held (grow it further or take ``.result()``), else None."""
        return self.grower if self.matches(accepted, bonus) else None


def _bet(tree: DraftTree, slm: SlmFn, *, beams: int, decay: float, keep_ids: Any,
         catch_up: Sequence[int] = ()) -> tuple[int, int]:
    """One SLM forward over the best ``beams`` leaves; the (leaf row, token) maximizing
    ``(s(leaf) + ln q) + decay``, ties to the earlier frontier row then the lower token."""
    has_kids = set(tree.parents[1:])
    leaves = [r for r in range(len(tree.tokens)) if r not in has_kids]
    plan = frontier_plan(tree, frontier_order(tree.scores, leaves)[:beams], catch_up)
    lp, ids = logprob_rows(slm(plan))
    rows, toks, q = top_candidates(candidate_rows(plan, lp), 1, keep_ids if ids is None else ids)
    if rows.size == 0:
        raise TreeBuildError("the SLM gave no finite log-probability at any leaf; nothing to bet on")
    best = max(range(rows.size),
               key=lambda i: ((tree.scores[plan.rows[rows[i]]] + q[i]) + decay, -int(rows[i])))
    return plan.rows[int(rows[best])], int(toks[best])


def proactive_draft(tree: DraftTree, slm: SlmFn, *, passes: int = PROACTIVE_PASSES,
                    node_budget: int = DEFAULT_NODE_BUDGET, beams: int = BEAMS, width: int = WIDTH,
                    decay: float = PROACTIVE_DECAY,
                    keep_ids: Any = None, catch_up: Sequence[int] = ()) -> ProactiveDraft:
    """Prepare the next tree while ``tree``'s verdict is in flight (``passes`` + 1 SLM forwards).

    The bet: the most likely root-to-leaf path of ``tree`` is accepted whole and the SLM's best next token
    at its leaf is the bonus. The prepared tree is rooted at that token; its first forward carries the
    current root and the bet path as catch-up rows (committed tokens the SLM has no KV for).
    ``catch_up``: committed tokens before ``tree``'s root that the SLM has not seen either (the session
    passes them while a reused proactive tree is in flight); both forwards put them first.
    """
    catch_up = tuple(int(t) for t in catch_up)
    leaf, bonus = _bet(tree, slm, beams=beams, decay=decay, keep_ids=keep_ids, catch_up=catch_up)
    rows = tree.path(leaf)
    path_tokens = tuple(tree.tokens[r] for r in rows[1:])
    grower = SpecEdgeGrower(bonus, node_budget=node_budget, beams=beams, width=width, decay=decay,
                            keep_ids=keep_ids, catch_up=catch_up + (tree.tokens[0],) + path_tokens)
    grower.grow(slm, passes)
    return ProactiveDraft(leaf, path_tokens, bonus, grower)
