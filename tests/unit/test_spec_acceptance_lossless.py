"""Exact verification is lossless: decoding with adversarial trees commits tokens distributed exactly as
sampling from p̃ one token at a time.

Toy verifier: vocabulary 5, p̃(. | context) from a fixed random logit table indexed by a hash of the
context's last two tokens and its length (so every tree row has its own p̃), with temperature 0.9,
top-k 4, top-p 0.95. The expected distribution of the first 3 generated tokens is the product of p̃'s,
computed by an independent numpy reference. 20,000 seeded decodes (each up to 3 rounds, batched) are
compared by a chi-square test: bins with expected count < 5 are merged, and the threshold is the
alpha = 1e-3 critical value (Wilson-Hilferty approximation; fixed seeds make the outcome deterministic).
The same statistic on a lossy ε = 0.3 run must exceed it (the test can fail).
"""

import random

import numpy as np
import pytest
import torch
from distcheck import cached_tree, chi_square

from vllm_hyco.spec_decode.sampling import SamplingSpec
from vllm_hyco.spec_decode.tree import TokenTree
from vllm_hyco.spec_decode.verify import PackedTrees, verify_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


V, M = 5, 97
TABLE = np.random.RandomState(1234).randn(M, V) * 1.5
SPEC = SamplingSpec(temperature=0.9, top_k=4, top_p=0.95)
PROMPT = (1, 2)
ROUNDS = 20_000


def _row(last: int, prev: int, length: int) -> int:
    return (31 * last + 7 * prev + 3 * length) % M


def np_ptilde(logits: np.ndarray) -> np.ndarray:
    """Independent reference: keep the top-k, then every token whose strictly-higher mass is < top_p."""
    x = logits / SPEC.temperature
    order = np.argsort(-x, kind="stable")
    kth = x[order[SPEC.top_k - 1]]
    keep = x >= kth
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    desc = np.argsort(-p, kind="stable")
    above = np.concatenate([[0.0], np.cumsum(p[desc])[:-1]])
    nucleus = np.zeros(V, dtype=bool)
    nucleus[desc[above < SPEC.top_p]] = True
    p = np.where(nucleus & keep, p, 0.0)
    return p / p.sum()


P_ALL = np.stack([np_ptilde(TABLE[r]) for r in range(M)])  # [M, V]


def p_next(ctx: tuple[int, ...]) -> np.ndarray:
    return P_ALL[_row(ctx[-1], ctx[-2], len(ctx))]


def expected_first3() -> np.ndarray:
    out = np.zeros((V, V, V))
    for a, pa in enumerate(p_next(PROMPT)):
        for b, pb in enumerate(p_next(PROMPT + (a,))):
            out[a, b] = pa * pb * p_next(PROMPT + (a, b))
    return out.reshape(-1)


def _chain(ctx, depth):
    toks, c = [], tuple(ctx)
    for _ in range(depth):
        toks.append(int(np.argmax(p_next(c))))
        c += (toks[-1],)
    return toks


def build_tree(ctx: tuple[int, ...], kind: int, rng: random.Random):
    """Adversarial trees: 0 right chain deep (depth 4-5) + sibling, 1 right token only as a second
    sibling, 2 only zero-mass tokens (or root alone), 3 random shape and tokens."""
    root = ctx[-1]
    if kind == 0:
        chain = _chain(ctx, rng.choice([4, 5]))
        tokens, parents = [root] + chain, [-1] + list(range(len(chain)))
        other = rng.choice([t for t in range(V) if t != chain[0]])
        return tokens + [other], parents + [0]
    if kind == 1:
        right = _chain(ctx, 2)
        wrong = int(np.argmin(p_next(ctx)))
        wrong = wrong if wrong != right[0] else (right[0] + 1) % V
        return [root, wrong, rng.randrange(V), right[0], right[1]], [-1, 0, 1, 0, 3]
    if kind == 2:
        zero = [t for t in range(V) if p_next(ctx)[t] == 0]
        if not zero or rng.random() < 0.3:
            return [root], [-1]
        return [root] + zero, [-1] + [0] * len(zero)
    tree = TokenTree.make_dummy(rng.randrange(3, 13), kind="random", vocab_size=V,
                                seed=rng.randrange(10**9))
    return [root] + tree.tokens.tolist()[1:], tree.parents.tolist()


def table_rows(ctx, tokens, parents) -> list[int]:
    """Logit-table row of every tree row: row j sees ctx + the tokens on its path."""
    depth, prev = [0] * len(tokens), [ctx[-2]] + [0] * (len(tokens) - 1)
    for j in range(1, len(tokens)):
        depth[j] = depth[parents[j]] + 1
        prev[j] = tokens[parents[j]]
    return [_row(tokens[j], prev[j], len(ctx) + depth[j]) for j in range(len(tokens))]


def tree_logits(ctx, tokens, parents) -> torch.Tensor:
    """[n, V]"""
    return torch.from_numpy(TABLE[table_rows(ctx, tokens, parents)]).float()


def decode_first3(epsilon, seed: int) -> np.ndarray:
    """Counts of the first 3 generated tokens over ROUNDS independent decodes."""
    rng = random.Random(seed)
    ctxs = [PROMPT] * ROUNDS
    active = list(range(ROUNDS))
    for rnd in range(3):
        trees, rows = [], []
        for i in active:
            toks, pars = build_tree(ctxs[i], rng.randrange(4), rng)
            trees.append(cached_tree(toks, pars, V))
            rows += table_rows(ctxs[i], toks, pars)
        gens = [torch.Generator().manual_seed(seed * 7919 + rnd * ROUNDS + i) for i in active]
        logits = torch.from_numpy(TABLE[rows]).float()
        verdict = verify_batch(PackedTrees.pack(trees), logits, SPEC, epsilon, gens)
        for i, committed in zip(active, verdict.committed()):
            ctxs[i] = ctxs[i] + tuple(committed)
        active = [i for i in active if len(ctxs[i]) < len(PROMPT) + 3]
        if not active:
            break
    assert not active
    idx = [c[2] * V * V + c[3] * V + c[4] for c in ctxs]
    return np.bincount(idx, minlength=V**3).astype(float)



def test_reference_p_tilde_matches_sampling_probs():
    from vllm_hyco.spec_decode.sampling import sampling_probs

    ours = sampling_probs(torch.from_numpy(TABLE).float(), SPEC.temperature, SPEC.top_k, SPEC.top_p)
    ref = np.stack([np_ptilde(TABLE[r]) for r in range(M)])
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-6)
    assert ((ref > 0).sum(axis=1) < V).all()  # truncation is active on every row


def test_exact_mode_is_lossless_on_adversarial_trees():
    probs = expected_first3()
    observed = decode_first3(None, seed=0)
    stat, crit = chi_square(observed, probs)
    assert stat < crit, (stat, crit)
    # the test has teeth: the lossy rule with a loose threshold is detected
    lossy_stat, _ = chi_square(decode_first3(0.3, seed=0), probs)
    assert lossy_stat > crit, (lossy_stat, crit)


def test_mean_accepted_length_matches_its_analytic_value():
    ctx = PROMPT
    rng = random.Random(5)
    for kind in (0, 1, 3):
        tokens, parents = build_tree(ctx, kind, rng)
        # analytic: E|P| = sum over nodes of the product of p̃ along the node's path
        reach = [1.0] + [0.0] * (len(tokens) - 1)
        path_ctx = [ctx] + [None] * (len(tokens) - 1)
        for j in range(1, len(tokens)):
            v = parents[j]
            path_ctx[j] = path_ctx[v] + (tokens[j],)
            reach[j] = reach[v] * p_next(path_ctx[v])[tokens[j]]
        analytic = sum(reach[1:])
        tree = TokenTree.from_parents(tokens, parents, vocab_size=V)
        logits = tree_logits(ctx, tokens, parents)
        gens = [torch.Generator().manual_seed(10_000 * kind + i) for i in range(ROUNDS)]
        verdict = verify_batch(PackedTrees.pack([tree] * ROUNDS), logits.repeat(ROUNDS, 1), SPEC,
                               None, gens)
        lengths = verdict.num_accepted.double()
        se = float(lengths.std()) / ROUNDS**0.5
        assert abs(float(lengths.mean()) - analytic) < 4.5 * se + 1e-9, (kind, analytic, lengths.mean())
        if kind == 0:
            assert analytic > 1.0  # a verifier that never accepts would fail
