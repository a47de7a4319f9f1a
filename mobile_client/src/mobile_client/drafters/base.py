"""The drafter contracts the tree builders drive, and the two drafters composed from them.

Three roles (structural ``Protocol``s: implement the methods, no base class needed):

* ``ChainDrafter`` (the MTP Drafter, Algorithm 2): ``draft(x_hat) -> ChainResult`` with the K-token chain
  and the D runner-ups, full-vocabulary ids. ``mobile_client.drafters.mtp.MtpDrafter`` fits it. With sampled
  drafts (``DraftContext.sampling``) it is called ``draft(x_hat, sampling=...)`` and its result's ``chain_q``
  holds the (ids, weights) each chain token was drawn from.
* ``RowDrafter`` (the SLM Drafter): ``forward_rows(plan) -> RowLogprobs`` runs ONE forward over a
  ``FrontierPlan`` (catch-up rows first, then tree rows in frontier order, each attending to the committed
  window plus ``plan.attend_mask()``) and returns log q for every forward row, over the keep set.
  After the call it holds KV for the catch-up rows (committed) and for the tree rows (until the verdict).
* ``Drafter``: ``propose(context, node_budget) -> DraftTree``, what the phone loop calls each round: a tree
  of at most ``node_budget`` drafted nodes (root excluded) rooted at ``context.root``.

``HybridDrafter`` (HyCo, HyCo-2P, and the SLM-only first round of docs/decisions.md D2) and
``SpecEdgeDrafter`` (the SpecEdge-style baseline) implement ``Drafter`` on top of the other two.

>>> import numpy as np
>>> class Uniform:  # a RowDrafter over a 4-token keep set
...     keep_ids = np.array([3, 5, 8, 13])
...     def forward_rows(self, plan):
...         return RowLogprobs(np.full((plan.num_rows, 4), np.log(0.25)), self.keep_ids)
>>> HybridDrafter(None, Uniform()).propose(DraftContext(root=1), node_budget=2).to_wire()
([1, 3, 5], [-1, 0, 0])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from mobile_client.baselines import PASSES, SpecEdgeGrower
from mobile_client.tree import LAMBDA, TOPK, DraftTree, FrontierPlan, frontier_plan, grow_tree, plant_tree


@dataclass(frozen=True)
class ChainDraft:
    """An MTP draft: chain y_1..y_K and runner-ups y'_1..y'_D (full-vocabulary ids)."""

    chain: tuple[int, ...]  # [K]
    runner_ups: tuple[int, ...]  # [D], D <= K
    chain_q: tuple | None = None  # [K] (ids, weights) each chain token was drawn from; None: greedy


@dataclass(frozen=True)
class RowLogprobs:
    """One SLM forward's output: log q per forward row, and the column -> full-id map."""

    logprobs: Any  # [plan.num_rows, V_keep] torch.Tensor or np.ndarray, log_softmax over the keep set
    ids: np.ndarray | None = None  # [V_keep] int64 keep -> full id, sorted; None = full vocabulary


@dataclass(frozen=True)
class DraftContext:
    """What a round's drafting starts from."""

    root: int  # x_{t+1}: the last committed token (the previous verdict's bonus token)
    catch_up: tuple[int, ...] = ()  # committed tokens before the root without SLM KV, oldest first
    x_hat: np.ndarray | None = None  # [2H] the MTP head's first input from the hand-off; None = SLM only
    sampling: Any = None  # mobile_client.drafters.sampling.DraftSampling: sampled MTP drafts; None = greedy


class ChainResult(Protocol):
    chain: Sequence[int]
    runner_ups: Sequence[int]


@runtime_checkable
class ChainDrafter(Protocol):
    def draft(self, x_hat: np.ndarray, sampling: Any = None) -> ChainResult: ...


@runtime_checkable
class RowDrafter(Protocol):
    def forward_rows(self, plan: FrontierPlan) -> RowLogprobs | Any: ...


@runtime_checkable
class Drafter(Protocol):
    def propose(self, context: DraftContext, node_budget: int) -> DraftTree: ...


class HybridDrafter:
    """HyCo's tree: MTP chain + runner-ups planted, one SLM pass (two with ``two_pass``), trimmed.

    With no chain drafter or no ``x_hat`` (the first round, D2) the tree is the SLM's alone.
    """

    def __init__(self, chain_drafter: ChainDrafter | None, row_drafter: RowDrafter, *, lam: float = LAMBDA,
                 topk: int = TOPK, two_pass: bool = False):
        self.chain_drafter, self.row_drafter = chain_drafter, row_drafter
        self.lam, self.topk, self.two_pass = lam, topk, two_pass
        self.last_chain: ChainDraft | None = None

    def draft_chain(self, context: DraftContext) -> ChainDraft:
        """The MTP chain and runner-ups of this round (empty without a chain drafter or a hand-off)."""
        if self.chain_drafter is None or context.x_hat is None:
            return ChainDraft((), ())
        if context.sampling is None:
            d = self.chain_drafter.draft(context.x_hat)
        else:
            d = self.chain_drafter.draft(context.x_hat, sampling=context.sampling)
        chain_q = getattr(d, "chain_q", None)
        return ChainDraft(tuple(d.chain), tuple(d.runner_ups), None if chain_q is None else tuple(chain_q))

    def propose(self, context: DraftContext, node_budget: int) -> DraftTree:
        c = self.last_chain = self.draft_chain(context)
        planted = plant_tree(context.root, c.chain, c.runner_ups, lam=self.lam, node_budget=node_budget,
                             chain_q=c.chain_q)
        plan = frontier_plan(planted, catch_up=context.catch_up)
        out = self.row_drafter.forward_rows(plan)
        second = self.row_drafter.forward_rows if self.two_pass else None
        return grow_tree(planted, plan, out, topk=self.topk, lam=self.lam, second_pass=second)


class SpecEdgeDrafter:
    """The SpecEdge-style baseline: the SLM alone, ``passes`` sequential forwards, ``node_budget`` nodes."""

    def __init__(self, row_drafter: RowDrafter, *, passes: int = PASSES, **grower_kw: Any):
        self.row_drafter, self.passes, self.grower_kw = row_drafter, passes, grower_kw

    def propose(self, context: DraftContext, node_budget: int) -> DraftTree:
        grower = SpecEdgeGrower(context.root, node_budget=node_budget, catch_up=context.catch_up,
                                **self.grower_kw)
        grower.grow(self.row_drafter.forward_rows, self.passes)
        return grower.result()
