"""p̃: the request's own sampling distribution, as vLLM 0.32's sampler builds it (docs/decisions.md D4).

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

Implementation: rows without truncation (top-k and top-p off) are a plain softmax. Otherwise the work
runs on a *candidate set* per row: the top ``kk`` logits when every sampled row has top-k on (the paper's
top-k 64 case: one ``topk`` pass, no full-vocabulary sort or scaling; the result is sparse), the whole
vocabulary otherwise (the result is dense, [R, V]). Every denominator is a sequential float32 cumulative
sum (ascending values after truncation, id order for the plain softmax), so extra zero-mass candidates
change no bit and a row's p̃ never depends on the rows batched with it.

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
    onwards), so a float64 cumulative sum along a row visits tokens in id order. ``ids`` None means the
    support is the whole vocabulary: ``probs`` is then the dense [R, V] p̃ (the top-k-off case).
    """

    # [R, S] int64, or None for dense rows
    ids: torch.Tensor | None
    # [R, S] float32 ([R, V] when ids is None)
    probs: torch.Tensor
    vocab_size: int

    def to_dense(self) -> torch.Tensor:
        """[R, V] float32."""
        if self.ids is None:
            return self.probs
        num_rows = self.probs.shape[0]
        out = torch.zeros(num_rows, self.vocab_size + 1, dtype=torch.float32, device=self.probs.device)
        # Padding entries (ids >= V, probability 0) all land in the spare last column.
        out.scatter_(1, self.ids.clamp(max=self.vocab_size), self.probs)
        return out[:, : self.vocab_size].contiguous()

    def lookup(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[M] float32: p̃(tokens[m] | rows[m])."""
        if self.ids is None:
            return self.probs[rows, tokens]
        out = torch.empty(rows.shape, dtype=torch.float32, device=self.probs.device)
        step = _rows_per_chunk(self.ids.shape[1])
        for s in range(0, rows.numel(), step):
            r, t = rows[s : s + step], tokens[s : s + step].unsqueeze(1)
            ids = self.ids[r]  # [m, S], ascending
            pos = torch.searchsorted(ids, t).clamp(max=ids.shape[1] - 1)  # [m, 1]
            hit = ids.gather(1, pos) == t
            out[s : s + step] = torch.where(hit, self.probs[r].gather(1, pos), 0.0).squeeze(1)
        return out

    def token_at(self, pos: torch.Tensor) -> torch.Tensor:
        """[R] int64: the token id of column ``pos[r]`` of each row."""
        return pos if self.ids is None else self.ids.gather(1, pos.unsqueeze(1)).squeeze(1)

    @classmethod
    def from_dense(cls, probs: torch.Tensor) -> SparseProbs:
        """Wrap a dense [R, V] p̃ (no copy for float32)."""
        return cls(ids=None, probs=probs.to(torch.float32), vocab_size=probs.shape[1])


def _rows_per_chunk(width: int) -> int:
    """Rows per chunk so that a [rows, width] temporary stays near 2^22 elements."""
    return max(1, (1 << 22) // max(width, 1))


def _per_row(
    value: float | torch.Tensor, num_rows: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.dim() == 0:
        t = t.expand(num_rows)
    assert t.shape == (num_rows,), f"per-row parameter has shape {tuple(t.shape)}, want ({num_rows},)"
    return t.to(dtype)


def _candidates(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    k_on: torch.Tensor,
    k: torch.Tensor,
    random_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
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
                return vals, ids, False
            width *= 2
    x = logits.to(torch.float32) / scale  # [R, V]
    return x, torch.arange(vocab, device=logits.device).expand(num_rows, vocab), True


def _ascending(vals: torch.Tensor, ids: torch.Tensor, dense: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Order candidates ascending by value, ties by *descending* id (so the lowest ids come last)."""
    if dense:  # ids = arange(V) on every row: descending id order is a flip
        vals, ids = vals.flip(1), ids.flip(1)
    else:
        by_id = ids.argsort(dim=1, descending=True, stable=True)  # [R, S]
        vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = vals.argsort(dim=1, stable=True)
    return vals.gather(1, by_val), ids.gather(1, by_val)


def _truncate(asc: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p on ascending logits [R, S]; returns the renormalized p̃ [R, S] (0 where dropped)."""
    width = asc.shape[1]
    # Top-k: keep logits >= the k-th largest (all ties at the k-th value survive).
    kth_pos = (width - k.clamp(1, width)).unsqueeze(1)  # [R, 1]
    kth = asc.gather(1, kth_pos)
    asc = torch.where(k_on.unsqueeze(1) & (asc < kth), float("-inf"), asc)
    # Top-p on the softmax of the top-k survivors, in ascending order.
    e = torch.exp(asc - asc[:, -1:])  # [R, S], masked entries exp(-inf) = 0
    total = torch.cumsum(e, dim=1)[:, -1:]
    cum = torch.cumsum(e / total, dim=1)
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    drop &= (p < 1).unsqueeze(1)
    kept = torch.isfinite(asc) & ~drop
    e = torch.where(kept, e, 0.0)
    return e / torch.cumsum(e, dim=1)[:, -1:]


def _support_chunk(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> SparseProbs:
    """p̃ of one chunk of rows: sparse (ids ascending, padding ids >= V) or dense over the vocabulary."""
    num_rows, vocab = logits.shape
    dev = logits.device
    greedy = temperature < SAMPLING_EPS
    random_rows = ~greedy
    k_on = (top_k > 0) & (top_k < vocab)
    scale = torch.where(greedy, 1.0, temperature)
    rows = greedy.nonzero().squeeze(1)
    arg = logits[rows].to(torch.float32).argmax(dim=1)  # greedy: the first maximal index
    plain = random_rows & ~k_on & (top_p >= 1)  # no truncation: p̃ is the softmax
    if bool((random_rows & ~plain).any()):
        vals, ids, dense = _candidates(logits, scale, k_on, top_k, random_rows)
        vals, ids = _ascending(vals, ids, dense)
        probs = _truncate(vals, top_k, k_on, top_p.to(torch.float32))  # [R, S]
        if not dense:  # only when every sampled row has top-k on, so no row is plain
            return _sparse_chunk(ids, probs, rows, arg, vocab)
        # ids is a permutation of the vocabulary on every row
        out = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev).scatter_(1, ids, probs)
    else:
        out = torch.zeros(num_rows, vocab, dtype=torch.float32, device=dev)
    if bool(plain.any()):
        out[plain] = _softmax_rows(logits[plain], scale[plain])
    out[rows] = 0.0
    out[rows, arg] = 1.0
    return SparseProbs(ids=None, probs=out, vocab_size=vocab)


def _softmax_rows(logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[r, V] softmax of logits / T; the denominator is a sequential float32 sum in id order, so a row's
    p̃ never depends on the rows batched with it (``torch.sum`` may split a row across threads)."""
    x = logits.to(torch.float32) / scale.unsqueeze(1)
    e = torch.exp(x - x.max(dim=1, keepdim=True).values)
    return e / torch.cumsum(e, dim=1)[:, -1:]


def _sparse_chunk(
    ids: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, arg: torch.Tensor, vocab: int
) -> SparseProbs:
    """Greedy rows to one-hot, zero-mass entries to padding, columns in id order."""
    first = torch.arange(ids.shape[1], device=ids.device) == 0
    ids[rows] = torch.where(first, arg.unsqueeze(1), ids[rows])
    probs[rows] = first.to(torch.float32)
    # Zero-mass entries become padding (ids past the vocabulary), then sort by id.
    ids = torch.where(probs > 0, ids, vocab + torch.arange(ids.shape[1], device=ids.device))
    order = ids.argsort(dim=1)
    return SparseProbs(ids=ids.gather(1, order), probs=probs.gather(1, order), vocab_size=vocab)


def sampling_support(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = -1,
    top_p: float | torch.Tensor = 1.0,
) -> SparseProbs:
    """p̃ per row on its support (see the module docstring).

    Shape: logits [R, V] (any float dtype); temperature/top_k/top_p scalars or [R] -> SparseProbs [R, S].
    """
    num_rows, vocab = logits.shape
    dev = logits.device
    temperature = _per_row(temperature, num_rows, torch.float32, dev)
    top_k = _per_row(top_k, num_rows, torch.int64, dev)
    top_p = _per_row(top_p, num_rows, torch.float32, dev)
    parts = []
    for s in range(0, max(num_rows, 1), _CHUNK_ROWS):
        sl = slice(s, s + _CHUNK_ROWS)
        parts.append(_support_chunk(logits[sl], temperature[sl], top_k[sl], top_p[sl]))
    if any(p.ids is None for p in parts):
        return SparseProbs(ids=None, probs=torch.cat([p.to_dense() for p in parts]), vocab_size=vocab)
    part_ids = [p.ids for p in parts if p.ids is not None]  # every part, all sparse here
    width = max(i.shape[1] for i in part_ids)
    ids = torch.cat([_pad_support(i, width, vocab) for i in part_ids])
    probs = torch.cat([torch.nn.functional.pad(p.probs, (0, width - p.probs.shape[1])) for p in parts])
    # Trim columns that are padding in every row.
    used = max(int((ids < vocab).sum(dim=1).max()) if num_rows else 1, 1)
    return SparseProbs(ids=ids[:, :used], probs=probs[:, :used], vocab_size=vocab)


def _pad_support(ids: torch.Tensor, width: int, vocab: int) -> torch.Tensor:
    extra = width - ids.shape[1]
    if extra == 0:
        return ids
    pad = vocab + ids.shape[1] + torch.arange(extra, device=ids.device).expand(ids.shape[0], extra)
    return torch.cat([ids, pad], dim=1)


def sampling_probs(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = -1,
    top_p: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """p̃ [R, V] float32: the distribution vLLM 0.32's sampler samples from for these parameters.

    Shape: logits [R, V]; temperature, top_k, top_p: scalars or [R] tensors -> [R, V] float32.

    >>> sampling_probs(torch.tensor([[2.0, 1.0, 1.0, 0.0]]), 1.0, 2, 1.0)  # ties at the k-th survive
    tensor([[0.5761, 0.2119, 0.2119, 0.0000]])
    """
    return sampling_support(logits, temperature, top_k, top_p).to_dense()


def draw_uniforms(num_rows: int, generator: torch.Generator | None) -> torch.Tensor:
    """[num_rows] float64: the only randomness a tree consumes (one uniform per real row, row order)."""
    device = generator.device if generator is not None else None
    return torch.rand(num_rows, generator=generator, dtype=torch.float64, device=device)


def sample_sparse(support: SparseProbs, uniforms: torch.Tensor) -> torch.Tensor:
    """[R] int64 inverse-CDF samples: first id (in id order) whose float64 cumulative mass > u * total.

    Sparse and dense rows holding the same p̃ give the same token: zero-mass entries add exactly 0.
    """
    num_rows, width = support.probs.shape
    pos = torch.empty(num_rows, dtype=torch.int64, device=support.probs.device)
    step = _rows_per_chunk(width)
    for s in range(0, num_rows, step):
        p = support.probs[s : s + step]
        cdf = torch.cumsum(p.to(torch.float64), dim=1)  # [r, S]
        target = (uniforms[s : s + step] * cdf[:, -1]).unsqueeze(1)  # [r, 1]
        found = torch.searchsorted(cdf, target, right=True).clamp(max=width - 1)  # [r, 1]
        # u * total can round up to total: then step back to the row's last nonzero entry
        stray = (p.gather(1, found) == 0).squeeze(1)
        found = found.squeeze(1)
        if bool(stray.any()):
            found[stray] = (p[stray] > 0).cumsum(dim=1).argmax(dim=1)
        pos[s : s + step] = found
    return support.token_at(pos)


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[R] int64: one sample per row of p̃ [R, V], consuming ``draw_uniforms(R, generator)``.

    Reproducible given the generator's seed and the tree: row r uses the r-th uniform.
    """
    uniforms = draw_uniforms(probs.shape[0], generator).to(probs.device)
    return sample_sparse(SparseProbs.from_dense(probs), uniforms)
