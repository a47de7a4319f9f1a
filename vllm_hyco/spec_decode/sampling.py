"""p̃: the request's own sampling distribution, as vLLM 0.32's sampler builds it (decisions.md D4).

Order (vLLM 0.32 ``Sampler.sample`` + ``apply_top_k_top_p_pytorch``, the path its CPU build runs):

1. logits to float32; a row with temperature < 1e-5 is greedy: p̃ is one-hot at ``torch.argmax`` (the
   first maximal index);
2. divide by the temperature;
3. top-k (``0 < k < V``; otherwise off): keep every logit >= the k-th largest value, so *all ties at
   the k-th value survive* (more than k tokens may remain);
4. top-p (``p < 1``; otherwise off): order the survivors ascending, softmax, cumulative sum; drop the
   ascending prefix whose cumulative mass is <= 1 - p; the largest token always survives;
5. softmax over the survivors.

Ties that straddle the nucleus boundary (some tied tokens inside the minimal nucleus, some outside) are
not specified by vLLM: its torch path uses an unstable ``torch.sort`` (arbitrary but fixed order), its GPU
Triton kernel keeps the lowest token ids. We keep the lowest token ids (as the Triton kernel does); the
number kept and the probabilities are exactly vLLM's. See docs/acceptance.md.

The computation runs on a *candidate set* per row: the top ``kk`` logits when every sampled row has
top-k on (the paper's top-k 64 case: one ``topk`` pass, no full-vocabulary sort or scaling), the
whole vocabulary otherwise. The
denominators are sequential float32 cumulative sums in ascending order, so extra zero-mass candidates do
not change a single bit: both candidate sets give identical p̃.

Sampling (``sample_rows``) is inverse-CDF: each row consumes exactly one float64 uniform from the
request's generator, ``torch.rand(num_rows, generator=g, dtype=torch.float64)`` in row order, and picks
the first token id whose float64 cumulative mass (in token-id order) exceeds ``u * total``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM 0.32 v1/sample/sampler.py: temperatures below this are greedy.
SAMPLING_EPS = 1e-5
# Rows are processed in chunks of this many rows to bound float32 temporaries at large vocabularies.
_CHUNK_ROWS = 256


@dataclass(frozen=True)
class SamplingSpec:
    """One request's sampling parameters, with vLLM's meanings (top_k <= 0 or >= V, top_p 1.0: off)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


@dataclass(frozen=True)
class SparseProbs:
    """p̃ on a per-row support: ``probs[r, j]`` is p̃(``ids[r, j]`` | row r); padding entries have p 0.

    ``ids`` ascend along each row (padding entries hold ids past the vocabulary end, ``vocab_size``
    onwards), so a float64 cumulative sum along a row visits tokens in id order.
    """

    # [R, S] int64
    ids: torch.Tensor
    # [R, S] float32
    probs: torch.Tensor
    vocab_size: int

    def to_dense(self) -> torch.Tensor:
        """[R, V] float32."""
        num_rows = self.probs.shape[0]
        out = torch.zeros(num_rows, self.vocab_size + 1, dtype=torch.float32)
        # Padding entries (ids >= V, probability 0) all land in the spare last column.
        out.scatter_(1, self.ids.clamp(max=self.vocab_size), self.probs)
        return out[:, : self.vocab_size].contiguous()

    def lookup(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[M] float32: p̃(tokens[m] | rows[m])."""
        ids = self.ids[rows]  # [M, S]
        hit = ids == tokens.unsqueeze(1)  # [M, S]
        return (self.probs[rows] * hit).sum(dim=1)

    @classmethod
    def from_dense(cls, probs: torch.Tensor) -> SparseProbs:
        """Support = the nonzero entries of each row of a dense [R, V] p̃."""
        num_rows, vocab = probs.shape
        nz = probs > 0  # [R, V]
        width = max(int(nz.sum(dim=1).max().item()) if num_rows else 1, 1)
        # Nonzero columns first, in id order; zero columns get keys past the vocabulary.
        key = torch.where(nz, torch.arange(vocab), vocab + torch.arange(vocab))  # [R, V]
        ids = key.topk(width, dim=1, largest=False, sorted=True).values  # [R, S]
        keep = ids < vocab
        ids = torch.where(keep, ids, vocab + torch.arange(width))
        p = torch.where(keep, probs.gather(1, ids.clamp(max=vocab - 1)), torch.zeros(()))
        return cls(ids=ids, probs=p.float(), vocab_size=vocab)


def _per_row(value, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype)
    if t.dim() == 0:
        t = t.expand(num_rows)
    assert t.shape == (num_rows,), f"per-row parameter has shape {tuple(t.shape)}, want ({num_rows},)"
    return t.to(dtype)


def _candidates(logits, temperature, k_on, k, random_rows):
    """Scaled candidate logits and their ids per row: enough of the top to cover every value >= the
    k-th largest (ties included), or the whole vocabulary. Returns ([R, S] float32, [R, S] int64).

    The top is taken on the raw logits (float32 conversion and division by T > 0 are monotone), then
    only the candidates are scaled, exactly as vLLM scales every logit. A row is covered when its
    smallest candidate scales strictly below its k-th value: every other logit scales <= that one.
    """
    num_rows, vocab = logits.shape
    scale = temperature.unsqueeze(1)  # [R, 1], 1.0 on greedy rows
    if bool(random_rows.any()) and bool((k_on | ~random_rows).all()):
        width = int(k[random_rows].max()) + 1
        while width * 4 < vocab:
            raw, ids = logits.topk(width, dim=1, sorted=True)  # [R, width], descending
            vals = raw.to(torch.float32) / scale
            kth = vals.gather(1, (k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
            if bool(((vals[:, -1] < kth) | ~random_rows).all()):
                return vals, ids
            width *= 2
    x = logits.to(torch.float32) / scale  # [R, V]
    return x, torch.arange(vocab).expand(num_rows, vocab)


def _ascending(vals: torch.Tensor, ids: torch.Tensor):
    """Order candidates ascending by value, ties by *descending* id (so the lowest ids come last)."""
    by_id = ids.argsort(dim=1, descending=True, stable=True)  # [R, S]
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = vals.argsort(dim=1, stable=True)
    return vals.gather(1, by_val), ids.gather(1, by_val)


def _truncate(asc: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor, p: torch.Tensor):
    """Top-k then top-p on ascending logits [R, S]; returns the kept mask and the renormalized p̃."""
    width = asc.shape[1]
    neg_inf = torch.tensor(float("-inf"))
    # Top-k: keep logits >= the k-th largest (all ties at the k-th value survive).
    kth_pos = (width - k.clamp(1, width)).unsqueeze(1)  # [R, 1]
    kth = asc.gather(1, kth_pos)
    asc = torch.where(k_on.unsqueeze(1) & (asc < kth), neg_inf, asc)
    # Top-p on the softmax of the top-k survivors, in ascending order.
    e = torch.exp(asc - asc[:, -1:])  # [R, S], masked entries exp(-inf) = 0
    total = torch.cumsum(e, dim=1)[:, -1:]
    cum = torch.cumsum(e / total, dim=1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    drop &= (p < 1).unsqueeze(1)
    kept = torch.isfinite(asc) & ~drop
    e = torch.where(kept, e, torch.zeros(()))
    return e / torch.cumsum(e, dim=1)[:, -1:]


def _support_chunk(logits, temperature, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [R, S], probs [R, S]) for one chunk; ids in ascending order, padding ids >= V."""
    num_rows, vocab = logits.shape
    greedy = temperature < SAMPLING_EPS
    random_rows = ~greedy
    k_on = (top_k > 0) & (top_k < vocab)
    scale = torch.where(greedy, 1.0, temperature)
    vals, ids = _candidates(logits, scale, k_on, top_k, random_rows)
    vals, ids = _ascending(vals, ids)
    probs = _truncate(vals, top_k, k_on, top_p.to(torch.float32))  # [R, S]
    if greedy.any():
        arg = torch.zeros(num_rows, dtype=torch.int64)
        arg[greedy] = logits[greedy].to(torch.float32).argmax(dim=1)  # first maximal index
        one_hot_ids = torch.full_like(ids, vocab) + torch.arange(ids.shape[1])
        one_hot_ids[:, 0] = arg
        one_hot = torch.zeros_like(probs)
        one_hot[:, 0] = 1.0
        ids = torch.where(greedy.unsqueeze(1), one_hot_ids, ids)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    # Zero-mass entries become padding (ids past the vocabulary), then sort by id.
    ids = torch.where(probs > 0, ids, vocab + torch.arange(ids.shape[1]))
    order = ids.argsort(dim=1)
    return ids.gather(1, order), probs.gather(1, order)


def sampling_support(logits, temperature=1.0, top_k=-1, top_p=1.0) -> SparseProbs:
    """p̃ per row on its support (see the module docstring).

    Shape: logits [R, V] (any float dtype); temperature/top_k/top_p scalars or [R] -> SparseProbs [R, S].
    """
    num_rows, vocab = logits.shape
    temperature = _per_row(temperature, num_rows, torch.float32)
    top_k = _per_row(top_k, num_rows, torch.int64)
    top_p = _per_row(top_p, num_rows, torch.float32)
    parts = []
    for s in range(0, max(num_rows, 1), _CHUNK_ROWS):
        sl = slice(s, s + _CHUNK_ROWS)
        parts.append(_support_chunk(logits[sl], temperature[sl], top_k[sl], top_p[sl]))
    width = max(p[0].shape[1] for p in parts)
    ids = torch.cat([_pad_support(i, width, vocab) for i, _ in parts])
    probs = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for _, p in parts])
    # Trim columns that are padding in every row.
    used = int((ids < vocab).sum(dim=1).max()) if num_rows else 1
    return SparseProbs(ids=ids[:, : max(used, 1)], probs=probs[:, : max(used, 1)], vocab_size=vocab)


def _pad_support(ids: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
    extra = width - ids.shape[1]
    if extra == 0:
        return ids
    pad = vocab + ids.shape[1] + torch.arange(extra).expand(ids.shape[0], extra)
    return torch.cat([ids, pad], dim=1)


def sampling_probs(logits, temperature=1.0, top_k=-1, top_p=1.0) -> torch.Tensor:
    """p̃ [R, V] float32: the distribution vLLM 0.32's sampler samples from for these parameters.

    Shape: logits [R, V]; temperature, top_k, top_p: scalars or [R] tensors -> [R, V] float32.

    >>> sampling_probs(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), 1.0, 2, 1.0)  # ties at the k-th survive
    tensor([[0.5761, 0.2119, 0.2119, 0.0000]])
    """
    return sampling_support(logits, temperature, top_k, top_p).to_dense()


def draw_uniforms(num_rows: int, generator: torch.Generator | None) -> torch.Tensor:
    """[num_rows] float64: the only randomness a tree consumes (one uniform per real row, row order)."""
    return torch.rand(num_rows, generator=generator, dtype=torch.float64)


def sample_sparse(support: SparseProbs, uniforms: torch.Tensor) -> torch.Tensor:
    """[R] int64 inverse-CDF samples: first id (in id order) whose float64 cumulative mass > u * total."""
    cdf = torch.cumsum(support.probs.to(torch.float64), dim=1)  # [R, S]
    target = (uniforms * cdf[:, -1]).unsqueeze(1)  # [R, 1]
    pos = torch.searchsorted(cdf, target, right=True).squeeze(1)  # [R]
    last = (support.probs > 0).sum(dim=1) - 1  # the last nonzero entry (u * total can round to total)
    pos = torch.minimum(pos, last.clamp(min=0))
    return support.ids.gather(1, pos.unsqueeze(1)).squeeze(1)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[R] int64: one sample per row of p̃ [R, V], consuming ``draw_uniforms(R, generator)``.

    Reproducible given the generator's seed and the tree: row r uses the r-th uniform.
    """
    uniforms = draw_uniforms(probs.shape[0], generator)
    return sample_sparse(SparseProbs.from_dense(probs), uniforms)
