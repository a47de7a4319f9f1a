"""Multi-pass SLM drafting on the one-pass SLM Drafter: HyCo-2P's second pass (Algorithm 3 line 15), the
SpecEdge-style trees (four sequential passes) and proactive drafting, all on ``SlmDrafter``.

``SlmDrafter.forward_rows`` runs ONE static forward: each row attends to the committed ring, the plan's
catch-up rows and its own ancestors among the rows of the same forward. A later pass's rows also attend to
nodes an earlier pass computed (their ancestors); the one-pass graph has no input for those pending K/V
columns. ``MultiPassSlm`` serves them without one: every forward recomputes, in the same static call, the
earlier passes' rows that the new rows attend to (their ancestors), so a second-pass row sees exactly the
keys of the same tokens decoded causally. The price is rows: a HyCo-2P second pass is the first pass's
new nodes (up to B = 32, more on score ties) plus their planted ancestors (at most 1 + K + D = 7), so the
graph needs more than the one-pass 32 rows. The torch step takes any row count (padded to a multiple of
8, at most ``ROWS`` = 96); a compiled static graph would need a 96-row SLM step (not built; the compiled
backend refuses HyCo-2P, docs/phone-build.md).

``context`` (optional): a callable giving the committed tokens before the session's current root; a
forward first commits any the SLM has not seen (a safety net: ``PhoneSession`` hands every such token to
the next forward as a catch-up row itself). ``pure(plan)`` runs a forward on a copy of the state and
restores it (proactive drafting while the verdict is in flight).

>>> from mobile_client.drafters.slm import SlmDrafter
>>> from mobile_client.drafters.spec import toy_slm_spec, random_slm_state_dict
>>> from mobile_client.tree import DraftTree, FrontierPlan
>>> spec = toy_slm_spec()
>>> slm = SlmDrafter(spec, random_slm_state_dict(spec), keep_ids=list(range(spec.vocab)), window=32)
>>> slm.prefill([5, 6, 7])
>>> t = DraftTree.make_dummy([8, 9, 10], [-1, 0, 1])
>>> _ = MultiPassSlm(slm).forward_rows(FrontierPlan((), (0, 1), t.tokens[:2], t.parents[:2]))
>>> second = FrontierPlan((), (2,), t.tokens, t.parents)  # row 2 attends to rows 0, 1: recomputed
>>> MultiPassSlm(slm).forward_rows(second).logprobs.shape
(1, 512)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

ROWS = 96  # the most rows one forward may take: a pass's rows + their ancestors + catch-up rows


class MultiPassSlm:
    """A ``RowDrafter`` over an ``SlmDrafter`` that also serves rows attending to earlier passes' rows."""

    def __init__(self, slm: Any, context: Callable[[], Sequence[int]] | None = None):
        self.slm = slm
        self.context = context  # committed tokens before the session's current root

    def _augment(self, plan, before_root: Sequence[int]):
        """The plan with every needed tree row (the rows and their ancestors) and the missing catch-up."""
        from mobile_client.tree import FrontierPlan

        c = len(plan.catch_up)
        anc = plan.attend_mask()[c:, c:]  # [rows, T] ancestors + self of each forward tree row
        need = sorted(set(np.nonzero(anc.any(axis=0))[0].tolist()) - set(plan.rows))
        missing = tuple(before_root[self.slm.committed: max(len(before_root) - c, self.slm.committed)])
        full = FrontierPlan(missing + tuple(plan.catch_up), tuple(need) + tuple(plan.rows), plan.tokens,
                            plan.parents)
        keep = list(range(len(missing), len(missing) + c))
        keep += list(range(len(missing) + c + len(need), full.num_rows))
        return full, keep

    def forward_rows(self, plan, before_root: Sequence[int] | None = None):
        from mobile_client.drafters.base import RowLogprobs

        if before_root is None:
            before_root = list(self.context()) if self.context is not None else []
            if len(before_root) < self.slm.committed + len(plan.catch_up):
                before_root = []  # no context to resync against: trust the plan
        full, keep = self._augment(plan, before_root)
        if full.num_rows > ROWS:
            raise RuntimeError(f"{full.num_rows} SLM rows exceed the multi-pass graph's {ROWS}")
        # pad to a multiple of 8 rows, not to the static 96: padded rows only attend to themselves, so the
        # real rows' outputs do not depend on it, and the CPU drafts faster
        self.slm.rows = -(-full.num_rows // 8) * 8
        try:
            out = self.slm.forward_rows(full)
        finally:
            self.slm.rows = ROWS
        return RowLogprobs(np.asarray(out.logprobs)[keep], out.ids)

    def pure(self, plan):
        """``forward_rows`` on a copy of the state (for proactive drafting; the bet's catch-up rows are the
        root and the bet path, which the real forward will commit later)."""
        saved = (copy.deepcopy(self.slm.rings), copy.deepcopy(self.slm.pos), self.slm.committed,
                 self.slm.pending)
        try:
            before = list(self.context()) if self.context is not None else []
            return self.forward_rows(plan, before_root=before if len(before) >= self.slm.committed else [])
        finally:
            self.slm.rings, self.slm.pos, self.slm.committed, self.slm.pending = saved


__all__ = ["ROWS", "MultiPassSlm"]
