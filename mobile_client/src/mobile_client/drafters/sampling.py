"""Sampled drafts: the MTP chain drawn from the head's distribution instead of its argmax.

At each chain step the MTP Drafter turns the head's logits over the keep set into a small integer
distribution (``draft_q``) and draws the chain token from exactly those integers:

    q = softmax(logits / T), cut to its ``min(top_k, 64)`` best entries (64 when top_k <= 0), then to the
        top-p nucleus (the smallest best-first prefix holding ``top_p`` of the cut mass; the best entry
        always stays), then quantized: w_i = max(1, round(65535 * q_i / q_max)) (uint16, >= 1)
    y ~ w / sum(w)   (an integer draw in [0, sum(w)), so the q the server sees is the q drawn from)

The tree frame carries ``(ids, weights)`` of each sampled chain row (``TreeFrame.draft_q``); the server's
sample at the row's parent is coupled to it (ratio test, then the residual), which keeps verification
lossless while accepting a drawn token more often than a greedy one. Ties sort to the lower keep index.

>>> s = DraftSampling(temperature=1.0, top_k=2, rng=np.random.default_rng(0))
>>> ids, w = draft_distribution(np.array([0.0, 2.0, 1.0, -1.0]), s)
>>> ids.tolist(), w.tolist()
([1, 2], [65535, 24109])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.tree_contract import MAX_DRAFT_Q_ENTRIES as MAX_Q_ENTRIES  # the wire's ids per row

WEIGHT_MAX = 65535  # uint16
GREEDY_BELOW = 1e-5  # a temperature below this drafts greedily (vLLM's own greedy threshold)


@dataclass
class DraftSampling:
    """How the MTP Drafter draws its chain: the request's temperature, top-k (<= 0: none) and top-p, and the
    generator it draws from (the session seeds one per round)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    rng: np.random.Generator | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0 or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"DraftSampling: temperature must be >= 0 and top_p in (0, 1], got "
                              f"{self.temperature!r}, {self.top_p!r}")
        if self.rng is None:
            self.rng = np.random.default_rng()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def draft_distribution(logits: np.ndarray, s: DraftSampling) -> tuple[np.ndarray, np.ndarray]:
    """(keep indices, uint16 weights >= 1), best first, for one step's ``logits`` [Vk]."""
    o = np.asarray(logits).reshape(-1)
    k = min(s.top_k if s.top_k > 0 else MAX_Q_ENTRIES, MAX_Q_ENTRIES, o.size)
    thr = np.partition(o, o.size - k)[o.size - k]  # the k-th best logit (no full sort of the keep set)
    cand = np.nonzero(o >= thr)[0]
    order = cand[np.lexsort((cand, -o[cand]))][:k]  # best first, ties to the lower index
    z = o[order].astype(np.float64) / s.temperature
    p = np.exp(z - z[0])
    p /= p.sum()
    if s.top_p < 1.0:
        p = p[: int(np.searchsorted(np.cumsum(p), s.top_p)) + 1]  # the nucleus; the best entry always stays
    w = np.maximum(1, np.rint(WEIGHT_MAX * p / p[0])).astype(np.uint16)
    return order[: w.size], w


def chain_token(logits: np.ndarray, keep_ids: np.ndarray, sampling: DraftSampling | None,
                runner_up: bool) -> tuple[int, tuple | None, int | None]:
    """One MTP chain step's choice over the keep set: (keep index of the chain token, its (full ids, uint16
    weights) when drawn, else None, the runner-up's full id when asked, else None). Greedy (``sampling`` None
    or ~0 temperature): the argmax, first among equals. Sampled: drawn from :func:`draft_distribution`; the
    runner-up is then the best token other than the drawn one."""
    o = np.asarray(logits).reshape(-1)
    q = None
    if sampling is not None and not sampling.greedy:
        cols, w = draft_distribution(o, sampling)
        i = int(cols[draw(w, sampling.rng)])
        q = (tuple(int(t) for t in keep_ids[cols]), tuple(int(x) for x in w))
    else:
        i = int(np.argmax(o))  # numpy argmax returns the first maximal index
    second = None
    if runner_up:
        o2 = o.copy()
        o2[i] = -np.inf
        second = int(keep_ids[int(np.argmax(o2))])
    return i, q, second


def draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """An index drawn with probability ``weights[i] / sum(weights)``, exactly (integer arithmetic)."""
    cum = np.cumsum(np.asarray(weights, np.int64))
    return int(np.searchsorted(cum, int(rng.integers(0, int(cum[-1]))), side="right"))


def session_rng(seed: int | None, *stream: int) -> np.random.Generator:
    """The generator of one round's drafts: from the request's ``seed`` (any int) and ``stream`` (e.g.
    the failover count and the round), or from fresh entropy when there is no seed."""
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, *(int(x) for x in stream)])
