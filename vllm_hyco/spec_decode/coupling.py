"""Sampled drafts: the verifier's sample at a node coupled to the child the phone drew from q.

A phone may draw a node c (token x) from a distribution q instead of taking an argmax, and send q with the
tree (``TreeFrame.draft_q``). At c's parent v the server then draws its sample ŷ_v not independently but
coupled to x, the way speculative sampling does (vLLM's ``draft_sample_method: probabilistic``)::

    u1, u2 ~ U[0, 1)                       (u1: row v's own uniform; u2: one more from the same generator)
    ŷ_v = x                                 if u1 * q(x) < p̃(x)          (probability min(1, p̃(x) / q(x)))
    ŷ_v ~ r = max(p̃ - q, 0) / |.|_1       otherwise, by inverse CDF with u2 over p̃'s support in id order

For any q with x ~ q, ŷ_v is distributed exactly p̃(· | v) (P(ŷ = y) = min(p̃(y), q(y)) + (1 - Σ min) r(y) =
p̃(y)), so the rest of Algorithm 4 is unchanged: descend into the child equal to ŷ_v. Exact verification
stays lossless, and the sampled child is accepted with probability Σ_y min(p̃(y), q(y)) = 1 - TV(p̃, q)
instead of p̃(x). Independence across nodes holds because q and x are fixed before the server draws.

Only nodes of sampled (temperature > 0) requests are coupled; a greedy row keeps its argmax (its p̃ is
one-hot, so the coupling would give the same token). A node has at most one sampled child
(``tree_contract.check_draft_q``); deterministic siblings next to it are matched against ŷ_v as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

# q as the wire sends it, per tree: {local row of the sampled child: (ids, integer weights)}
from vllm_hyco.engine_contract import DraftQMap


@dataclass(frozen=True)
class SampledDrafts:
    """The sampled children of a step's packed trees (C of them, at most M q entries each)."""

    # [C] int64 global packed row of each sampled child
    rows: torch.Tensor
    # [C, M] int64 q's ids, -1 padding
    ids: torch.Tensor
    # [C, M] float64 q's integer weights, 0 padding
    weights: torch.Tensor
    # host ints: sampled children per tree (the extra uniforms each tree draws)
    per_tree: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.rows)

    def to(self, device: torch.device | str) -> SampledDrafts:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k in ("rows", "ids", "weights"):
            moved[k] = moved[k].to(device)
        return SampledDrafts(**moved)

    @classmethod
    def pack(cls, per_tree: Sequence[DraftQMap | None], offsets: Sequence[int],
             num_rows: Sequence[int] | None = None) -> SampledDrafts | None:
        """From each tree's ``{local row: (ids, weights)}`` (None: no sampled node); rows at or past
        ``num_rows[b]`` (a tree cut to a prefix) are dropped. None when no tree has a sampled node left.

        >>> d = SampledDrafts.pack([None, {1: ([4, 9], [1, 3]), 3: ([2], [5])}], [0, 3, 6], [3, 3])
        >>> d.rows.tolist(), d.ids.tolist(), d.per_tree
        ([4], [[4, 9]], (0, 1))
        """
        rows, ids, weights, per = [], [], [], []
        for b, q in enumerate(per_tree):
            n = 0
            limit = None if num_rows is None else int(num_rows[b])
            items: DraftQMap = q or {}
            for r in sorted(items):
                if limit is not None and r >= limit:
                    continue
                i, w = items[r]
                rows.append(int(offsets[b]) + int(r))
                ids.append([int(x) for x in i])
                weights.append([float(x) for x in w])
                n += 1
            per.append(n)
        if not rows:
            return None
        width = max(len(i) for i in ids)
        ids = [i + [-1] * (width - len(i)) for i in ids]
        weights = [w + [0.0] * (width - len(w)) for w in weights]
        return cls(rows=torch.tensor(rows, dtype=torch.int64), ids=torch.tensor(ids, dtype=torch.int64),
                   weights=torch.tensor(weights, dtype=torch.float64), per_tree=tuple(per))


def couple_samples(
    samples: torch.Tensor,
    probs: torch.Tensor,
    support_ids: torch.Tensor | None,
    parent_local: torch.Tensor,
    parent_rows: torch.Tensor,
    child_tokens: torch.Tensor,
    drafts: SampledDrafts,
    u1: torch.Tensor,
    u2: torch.Tensor,
) -> torch.Tensor:
    """``samples`` with the coupled draw at every sampled child's parent (module docstring).

    Shapes: samples [N] int64 (all packed rows); probs [R, S] p̃ on the support rows (support_ids [R, S]
    ascending ids, or None: dense [R, V]); parent_local [C] the parents' rows in ``probs``; parent_rows [C]
    their packed rows; child_tokens [C] x; u1, u2 [C] float64. Returns a new [N] int64 tensor.
    """
    p = probs[parent_local].to(torch.float64)  # [C, S]
    wsum = drafts.weights.sum(dim=1, keepdim=True)  # [C, 1]
    if support_ids is None:  # dense: q scattered over the vocabulary (padding ids land in a spare column)
        vocab = p.shape[1]
        q = torch.zeros(p.shape[0], vocab + 1, dtype=torch.float64, device=p.device)
        q.scatter_add_(1, torch.where(drafts.ids < 0, vocab, drafts.ids), drafts.weights)
        q = q[:, :vocab] / wsum
        cols = None
    else:
        cols = support_ids[parent_local]  # [C, S]
        match = cols.unsqueeze(2) == drafts.ids.unsqueeze(1)  # [C, S, M]
        q = (match.to(torch.float64) * drafts.weights.unsqueeze(1)).sum(dim=2) / wsum
    q_x = ((drafts.ids == child_tokens.unsqueeze(1)).to(torch.float64) * drafts.weights).sum(dim=1) / wsum[:, 0]
    if cols is None:
        p_x = p.gather(1, child_tokens.unsqueeze(1)).squeeze(1)
    else:
        p_x = torch.where(cols == child_tokens.unsqueeze(1), p, 0.0).sum(dim=1)
    accept = u1 * q_x < p_x
    resid = (p - q).clamp(min=0.0)
    cdf = torch.cumsum(resid, dim=1)
    total = cdf[:, -1]
    found = torch.searchsorted(cdf, (u2 * total).unsqueeze(1), right=True).clamp(max=cdf.shape[1] - 1)
    # u2 * total can round up to total: step back to the last entry with residual mass
    stray = (resid.gather(1, found) == 0).squeeze(1)
    found = found.squeeze(1)
    if bool(stray.any()):
        found[stray] = (resid[stray] > 0).cumsum(dim=1).argmax(dim=1)
    drawn = found if cols is None else cols.gather(1, found.unsqueeze(1)).squeeze(1)
    # no residual mass means p̃ <= q everywhere, i.e. p̃ == q: the ratio test always accepts then
    coupled = torch.where(accept | (total <= 0), child_tokens, drawn)
    return samples.index_copy(0, parent_rows, coupled.to(samples.dtype))
