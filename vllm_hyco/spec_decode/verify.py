"""Batched verification: many requests' trees, one [num_rows, V] logits tensor, one decision.

The engine lays every request's tree rows out back to back (optionally padded per tree to a fixed row
count by repeating the last row; padding never counts) and hands the logits of all rows here:

    packed = PackedTrees.pack(trees, rows_per_tree=33)      # or rows_per_tree=None: no padding
    verdict = verify_batch(packed, logits, sampling, epsilon, generators)
    verdict.path_rows[b]      # accepted rows of request b (local row indices, root excluded)
    verdict.compaction        # which rows' KV move to which committed slots

Randomness: request b draws ``torch.rand(n_b + 1, generator=generators[b], dtype=torch.float64)``, one
uniform per *real* row in row order (``sampling.draw_uniforms``), so ``verify_batch`` reproduces
``sample_rows`` + ``select_path`` on each tree alone, whatever the padding or the batch around it.
The one per-request loop is that draw; everything else is vectorized (loops run over depth only).
``verify_batch_with_uniforms`` is the same decision with the uniforms given (the engine draws them from
each session's own generator, docs/acceptance.md); greedy requests take the argmax and consume none,
and p̃ is built only for the rows of sampled requests, next to the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import NodeLabel
from vllm_hyco.spec_decode.acceptance import Decision, decide, normalize_epsilon
from vllm_hyco.spec_decode.coupling import DraftQMap, SampledDrafts, couple_samples
from vllm_hyco.spec_decode.sampling import (
    SAMPLING_EPS,
    SamplingSpec,
    SparseProbs,
    draw_uniforms,
    sample_sparse,
    sampling_support,
)
from vllm_hyco.spec_decode.stats import NUM_SOURCES, RoundStats
from vllm_hyco.spec_decode.tree import TokenTree

_OTHER = int(NodeLabel.OTHER)


def as_long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@dataclass(frozen=True)
class PackedTrees:
    """Rows of B trees back to back (request b owns rows ``row_offsets[b]:row_offsets[b + 1]``)."""

    # [N] int64
    tokens: torch.Tensor
    # [N] int64 global row of the parent; a root points at itself
    parent: torch.Tensor
    # [N] int64
    depth: torch.Tensor
    # [N] int64 request index of the row
    req: torch.Tensor
    # [N] bool, False on padding rows
    valid: torch.Tensor
    # [N] int64 NodeLabel values (ROOT on roots, OTHER where the client sent no labels)
    labels: torch.Tensor
    # [B + 1] int64
    row_offsets: torch.Tensor
    # [B] int64 real rows per request (n_b + 1)
    num_real: torch.Tensor

    @property
    def num_requests(self) -> int:
        return int(self.num_real.numel())

    def to(self, device: torch.device | str) -> PackedTrees:
        """The same rows on ``device`` (the engine packs on the CPU, verifies next to its logits)."""
        if self.tokens.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)}
        return PackedTrees(**moved)

    @classmethod
    def pack(cls, trees: Sequence[TokenTree], rows_per_tree: int | None = None) -> PackedTrees:
        """Concatenate trees; with ``rows_per_tree`` each is padded to that many rows (repeating the
        last row, ``valid`` False)."""
        tokens, parent, depth, req, valid, labels = [], [], [], [], [], []
        offsets, num_real = [0], []
        for b, tree in enumerate(trees):
            n = tree.num_rows
            rows = n if rows_per_tree is None else rows_per_tree
            if rows < n:
                raise TreeValidationError(f"cannot pad a {n}-row tree to {rows} rows",
                                          code="tree_too_large")
            extra = rows - n
            tok, par, dep = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
            lab = tree.labels.tolist() if tree.labels is not None else [0] + [_OTHER] * (n - 1)
            base = offsets[-1]
            glob = [base] + [base + p for p in par[1:]]  # a root points at itself
            tokens += tok + tok[-1:] * extra
            parent += glob + glob[-1:] * extra
            depth += dep + dep[-1:] * extra
            labels += lab + lab[-1:] * extra
            req += [b] * rows
            valid += [True] * n + [False] * extra
            offsets.append(base + rows)
            num_real.append(n)
        return cls(
            tokens=as_long(tokens), parent=as_long(parent), depth=as_long(depth), req=as_long(req),
            valid=torch.tensor(valid, dtype=torch.bool), labels=as_long(labels),
            row_offsets=as_long(offsets), num_real=as_long(num_real),
        )


@dataclass(frozen=True)
class CompactionPlan:
    """KV moves for the engine: packed row ``src_rows[i]`` goes to committed slot ``t_b + dst_offsets[i]``
    of request ``req[i]`` (the root to offset 0, the path's node at depth d to offset d)."""

    # [M] int64 global packed rows
    src_rows: torch.Tensor
    # [M] int64 offsets from the request's root position t
    dst_offsets: torch.Tensor
    # [M] int64 request index
    req: torch.Tensor


@dataclass(frozen=True)
class BatchVerdict:
    """Per-request results of one verification step (B requests, D = deepest tree in the batch)."""

    # [B, D] int64 local rows of the accepted path (root excluded), -1 past its end
    path_rows: torch.Tensor
    # [B, D] int64 accepted tokens, -1 past the end
    accepted_tokens: torch.Tensor
    # [B] int64 accepted path length |P|
    num_accepted: torch.Tensor
    # [B] int64 bonus token ŷ_{v*}
    bonus: torch.Tensor
    # [B] int64 accepted nodes that matched the sample / accepted only by the ε threshold
    num_hits: torch.Tensor
    num_eps_only: torch.Tensor
    # [B, D] int64 1 where the path reaches depth d + 1
    accepted_per_depth: torch.Tensor
    # [B, NUM_SOURCES] int64 accepted nodes per NodeLabel, and those of them that were ε-only
    accepted_per_source: torch.Tensor
    eps_only_per_source: torch.Tensor
    # [N] int64 the verifier's sample ŷ at every packed row (padding rows: -1)
    samples: torch.Tensor
    # [N] int64 ŷ after Algorithm 4 line 11: on the accepted path ŷ_v is the accepted child's token,
    # so the phone's rule (Algorithm 1 line 8: follow children equal to ŷ) ends exactly at v*
    yhat: torch.Tensor
    compaction: CompactionPlan

    def paths(self) -> list[list[int]]:
        """Accepted local rows per request, as Python lists."""
        return [[r for r in row if r >= 0] for row in self.path_rows.tolist()]

    def committed(self) -> list[list[int]]:
        """Committed tokens per request: the accepted tokens then the bonus."""
        toks = self.accepted_tokens.tolist()
        return [[t for t in row if t >= 0] + [b] for row, b in zip(toks, self.bonus.tolist())]

    def round_stats(self, b: int, num_drafted: int = 0) -> RoundStats:
        """This round's RoundStats for request b."""
        return RoundStats.from_counts(
            accepted=int(self.num_accepted[b]),
            hits=int(self.num_hits[b]),
            per_depth=self.accepted_per_depth[b].tolist(),
            per_source=self.accepted_per_source[b].tolist(),
            eps_only_per_source=self.eps_only_per_source[b].tolist(),
            drafted=num_drafted,
        )


    def total_stats(self) -> RoundStats:
        """RoundStats summed over every request of this step (one round each)."""
        total = RoundStats()
        for b in range(self.bonus.numel()):
            total = total + self.round_stats(b)
        return total


def _as_packed(trees: Sequence[TokenTree] | PackedTrees, device: torch.device) -> PackedTrees:
    packed = trees if isinstance(trees, PackedTrees) else PackedTrees.pack(list(trees))
    return packed.to(device)


def _eps_rows(
    packed: PackedTrees, epsilon: Sequence[float | None] | float | None
) -> tuple[torch.Tensor, bool]:
    if epsilon is None or isinstance(epsilon, (float, int)):
        epsilon = [epsilon] * packed.num_requests
    eps = [normalize_epsilon(e) for e in epsilon]
    assert len(eps) == packed.num_requests, "one epsilon per request"
    per_req = torch.tensor([float("inf") if e is None else e for e in eps], dtype=torch.float64,
                           device=packed.req.device)
    return per_req[packed.req], any(e is not None for e in eps)


def verify_batch_from_probs(
    trees: Sequence[TokenTree] | PackedTrees,
    probs: torch.Tensor | SparseProbs,
    samples: torch.Tensor,
    epsilon: Sequence[float | None] | float | None,
) -> BatchVerdict:
    """Decide with precomputed p̃ and samples (the engine may reuse its own sampler's output).

    Shape: probs [N, V] dense or SparseProbs over the N packed rows; samples [N] int64.
    """
    packed = _as_packed(trees, probs.probs.device if isinstance(probs, SparseProbs) else probs.device)
    support = probs if isinstance(probs, SparseProbs) else SparseProbs.from_dense(probs)
    eps_row, any_lossy = _eps_rows(packed, epsilon)
    samples = samples.to(torch.int64)
    p_edge = None
    if any_lossy:  # EXACT never looks p̃ up
        p_edge = support.lookup(packed.parent, packed.tokens)
    dec = decide(packed.tokens, packed.parent, packed.depth, packed.req, packed.valid, samples,
                 p_edge, eps_row, packed.num_requests)
    return _verdict(packed, dec, samples)


def verify_batch(
    trees: Sequence[TokenTree] | PackedTrees,
    logits: torch.Tensor,
    sampling: Sequence[SamplingSpec] | SamplingSpec,
    epsilon: Sequence[float | None] | float | None,
    generators: Sequence[torch.Generator | None],
    draft_q: Sequence[DraftQMap | None] | None = None,
) -> BatchVerdict:
    """p̃ from logits, one sample per real row from each request's generator, then the decision.

    Shape: logits [N, V] over the packed rows (padding rows included; their values are ignored).
    Every request draws its uniforms, greedy ones included (``verify_batch_with_uniforms`` ignores them):
    one per real row, then one per sampled child (``draft_q[b]``: ``{local row: (ids, weights)}``).
    """
    packed = trees if isinstance(trees, PackedTrees) else PackedTrees.pack(list(trees))
    assert len(generators) == packed.num_requests, "one generator (or None) per request"
    uniforms = torch.zeros(packed.tokens.numel(), dtype=torch.float64)
    starts, counts = packed.row_offsets.tolist(), packed.num_real.tolist()
    drafts = None if draft_q is None else SampledDrafts.pack(draft_q, starts, counts)
    extra = drafts.per_tree if drafts is not None else (0,) * len(counts)
    more = []
    for b, gen in enumerate(generators):  # the only per-request loop: drawing the uniforms
        u = draw_uniforms(counts[b] + extra[b], gen).cpu()
        uniforms[starts[b] : starts[b] + counts[b]] = u[: counts[b]]
        more.append(u[counts[b]:])
    u2 = torch.cat(more) if drafts is not None else None
    return verify_batch_with_uniforms(packed, logits, sampling, epsilon, uniforms, drafts=drafts,
                                      draft_uniforms=u2)


def verify_batch_with_uniforms(
    trees: Sequence[TokenTree] | PackedTrees,
    logits: torch.Tensor,
    sampling: Sequence[SamplingSpec] | SamplingSpec,
    epsilon: Sequence[float | None] | float | None,
    uniforms: torch.Tensor,
    row_offsets: Sequence[int] | None = None,
    drafts: SampledDrafts | None = None,
    draft_uniforms: torch.Tensor | None = None,
) -> BatchVerdict:
    """The decision for every tree at once, on ``logits``' device, with the uniforms given.

    Shape: logits [N, V] over the packed rows; uniforms [N] float64 (any device; row r of a sampled
    request uses ``uniforms[r]``; greedy requests' and padding rows' entries are ignored). Greedy requests
    (temperature < 1e-5) sample the argmax; p̃ (``sampling_support``) is built for the sampled requests'
    rows only, in one batch. Nothing of vocabulary size leaves the device; the host work is per request
    (which rows are sampled): ``row_offsets`` (host ints, ``packed.row_offsets``) spares reading them back
    when ``trees`` is already on the device. ``drafts``: the sampled children (``coupling``), with
    ``draft_uniforms`` [C] float64 (one more uniform per sampled child, in ``drafts.rows`` order).
    """
    packed = trees if isinstance(trees, PackedTrees) else PackedTrees.pack(list(trees))
    if isinstance(sampling, SamplingSpec):
        sampling = [sampling] * packed.num_requests
    assert len(sampling) == packed.num_requests, "one SamplingSpec per request"
    assert logits.shape[0] == packed.tokens.numel(), "one logits row per packed row"
    greedy = [s.temperature < SAMPLING_EPS for s in sampling]
    offsets = list(row_offsets) if row_offsets is not None else packed.row_offsets.tolist()
    sub = [r for b, g in enumerate(greedy) if not g for r in range(offsets[b], offsets[b + 1])]
    dev = logits.device
    packed = packed.to(dev)
    num_rows = packed.tokens.numel()
    samples = logits.argmax(dim=-1) if any(greedy) else torch.zeros(num_rows, dtype=torch.int64, device=dev)
    # greedy p̃ is one-hot at the sample: p̃(token | parent) is 1 on a hit, else 0
    p_edge = (packed.tokens == samples[packed.parent]).to(torch.float32)
    if sub:
        every = len(sub) == num_rows
        rows = None if every else torch.tensor(sub, dtype=torch.int64).to(dev, non_blocking=True)
        req = packed.req if every else packed.req[rows]

        def pick(vals: torch.Tensor) -> torch.Tensor:
            return vals[req]  # per-request values to the sampled rows

        temp = pick(torch.tensor([s.temperature for s in sampling], dtype=torch.float32).to(dev))
        top_k = pick(torch.tensor([s.top_k for s in sampling], dtype=torch.int64).to(dev))
        top_p = pick(torch.tensor([s.top_p for s in sampling], dtype=torch.float32).to(dev))
        support = sampling_support(logits if every else logits[rows], temp, top_k, top_p)
        u = uniforms.to(device=dev, dtype=torch.float64)
        drawn = sample_sparse(support, u if every else u[rows])
        if rows is None:  # every row is sampled
            samples = drawn
            local = torch.arange(num_rows, device=dev)
        else:
            samples = samples.index_copy(0, rows, drawn)
            local = torch.full((num_rows,), -1, dtype=torch.int64, device=dev)
            local[rows] = torch.arange(len(sub), device=dev)
        if drafts is not None:  # before p_edge: ε's p̃ lookup does not depend on the samples
            assert draft_uniforms is not None, "drafts come with their draft_uniforms"
            samples = _couple(samples, support, local, packed, drafts.to(dev), u,
                              draft_uniforms.to(device=dev, dtype=torch.float64))
        if rows is None:  # every row is sampled
            p_edge = support.lookup(packed.parent, packed.tokens)
        else:
            p_edge = p_edge.index_copy(0, rows, support.lookup(local[packed.parent[rows]], packed.tokens[rows]))
    eps_row, any_lossy = _eps_rows(packed, epsilon)
    dec = decide(packed.tokens, packed.parent, packed.depth, packed.req, packed.valid, samples.to(torch.int64),
                 p_edge if any_lossy else None, eps_row, packed.num_requests)
    return _verdict(packed, dec, samples.to(torch.int64))


def _couple(
    samples: torch.Tensor,
    support: SparseProbs,
    local: torch.Tensor,
    packed: PackedTrees,
    drafts: SampledDrafts,
    u: torch.Tensor,
    u2: torch.Tensor,
) -> torch.Tensor:
    """The coupled draw at the parents of sampled children in sampled requests (greedy rows keep argmax)."""
    parents = packed.parent[drafts.rows]
    loc = local[parents]
    keep = loc >= 0
    if not bool(keep.all()):
        drafts = SampledDrafts(rows=drafts.rows[keep], ids=drafts.ids[keep], weights=drafts.weights[keep],
                               per_tree=())
        parents, loc, u2 = parents[keep], loc[keep], u2[keep]
        if not drafts.count:
            return samples
    return couple_samples(samples, support.probs, support.ids, loc, parents, packed.tokens[drafts.rows],
                          drafts, u[parents], u2)


def _verdict(packed: PackedTrees, dec: Decision, samples: torch.Tensor) -> BatchVerdict:
    num_req = packed.num_requests
    path = dec.path  # [B, D] global rows
    on = path >= 0
    safe = path.clamp(min=0)
    local = torch.where(on, path - packed.row_offsets[:num_req].unsqueeze(1), -1)
    tokens = torch.where(on, packed.tokens[safe], -1)
    src = torch.where(on.unsqueeze(-1), torch.nn.functional.one_hot(packed.labels[safe], NUM_SOURCES), 0)
    eps_only = on & ~dec.hit[safe]
    src_eps = torch.where(eps_only.unsqueeze(-1), src, 0)
    yhat = samples.clone()
    yhat[packed.parent[path[on]]] = packed.tokens[path[on]]
    roots = packed.row_offsets[:num_req].unsqueeze(1)  # [B, 1]
    all_src = torch.cat([roots, path], dim=1)  # [B, D + 1]
    keep = all_src >= 0
    offsets = torch.arange(all_src.shape[1], device=path.device).expand_as(all_src)
    plan = CompactionPlan(
        src_rows=all_src[keep],
        dst_offsets=offsets[keep],
        req=torch.arange(num_req, device=path.device).unsqueeze(1).expand_as(all_src)[keep],
    )
    return BatchVerdict(
        path_rows=local,
        accepted_tokens=tokens,
        num_accepted=dec.length,
        bonus=samples[dec.endpoint],
        num_hits=dec.hits,
        num_eps_only=dec.length - dec.hits,
        accepted_per_depth=on.to(torch.int64),
        accepted_per_source=src.sum(dim=1),
        eps_only_per_source=src_eps.sum(dim=1),
        samples=torch.where(packed.valid, samples, -1),
        yhat=torch.where(packed.valid, yhat, -1),
        compaction=plan,
    )
