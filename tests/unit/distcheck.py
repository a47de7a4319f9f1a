"""Shared pieces of the distribution tests (test_spec_acceptance_lossless, test_spec_coupling): the
chi-square check and a cache of validated trees (many decodes draw the same few small trees)."""

from functools import cache

import numpy as np

from vllm_hyco.spec_decode.tree import TokenTree


@cache
def _cached_tree(tokens: tuple, parents: tuple, vocab_size: int) -> TokenTree:
    return TokenTree.from_parents(tokens, parents, vocab_size=vocab_size)


def cached_tree(tokens, parents, vocab_size: int) -> TokenTree:
    """``TokenTree.from_parents``, built once per distinct (tokens, parents, vocabulary)."""
    return _cached_tree(tuple(tokens), tuple(parents), vocab_size)


def chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """(statistic, alpha = 1e-3 critical value), bins with expected count < 5 merged into one; the critical
    value by the Wilson-Hilferty approximation (fixed seeds make the outcome deterministic)."""
    expected = probs * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.0902  # one-sided normal quantile for alpha = 1e-3
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, crit
