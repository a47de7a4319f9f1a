"""Sampled drafts stay lossless: a chain drawn from q (not p̃) plus a deterministic sibling, verified with
the coupled sample (``spec_decode.coupling``), commits tokens distributed exactly as p̃ one token at a
time, and accepts the sampled child with probability 1 - TV(p̃, q).

Toy verifier: vocabulary 6, p̃(. | context) from a fixed logit table indexed by a hash of the context
(temperature 0.9, top-k 5, top-p 0.95: truncation active); q from a second table, full support (it puts
mass where p̃ has none). 20,000 seeded two-token decodes are compared with the product of p̃'s by a
chi-square test (alpha = 1e-3, bins with expected count < 5 merged). The test has teeth: a phone that
draws from q but declares another q' is detected by the same statistic.
"""

import numpy as np
import pytest
import torch
from distcheck import cached_tree, chi_square

from vllm_hyco.spec_decode.coupling import SampledDrafts
from vllm_hyco.spec_decode.sampling import SamplingSpec, sampling_probs
from vllm_hyco.spec_decode.tree import TokenTree
from vllm_hyco.spec_decode.verify import PackedTrees, verify_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


V, M = 6, 53
SPEC = SamplingSpec(temperature=0.9, top_k=5, top_p=0.95)
TABLE = np.random.RandomState(7).randn(M, V) * 1.5
QTABLE = np.random.RandomState(8).randn(M, V)
PROMPT = (1, 2)
TRIALS = 20_000
P_ALL = sampling_probs(torch.from_numpy(TABLE).float(), SPEC.temperature, SPEC.top_k, SPEC.top_p).double().numpy()


def _row(ctx) -> int:
    return (31 * ctx[-1] + 7 * ctx[-2] + 3 * len(ctx)) % M


DENSE = SamplingSpec(temperature=1.0)  # no top-k / top-p: p̃ is dense over the vocabulary
P_DENSE = sampling_probs(torch.from_numpy(TABLE).float(), 1.0, -1, 1.0).double().numpy()


def p_next(ctx, table=P_ALL) -> np.ndarray:
    return table[_row(ctx)]


def q_weights(ctx) -> np.ndarray:
    """Integer weights (what the wire carries): q = w / w.sum(), every token >= 1."""
    x = np.exp(QTABLE[_row(ctx)])
    return np.maximum(1, np.round(1000 * x / x.sum())).astype(np.int64)


def decode_two(seed: int, declared=None, spec=SPEC):
    """Counts of the first two committed tokens, and the sampled depth-1 child's acceptance rate.

    Each round's tree: root, x1 ~ q(ctx), x2 ~ q(ctx + x1) under it (both sampled, q on the wire), and
    the argmax of p̃(ctx) as a deterministic sibling of x1 when it differs. ``declared(ctx)`` overrides
    the weights sent (the phone lies about q)."""
    rng = np.random.default_rng(seed)
    ctxs = [PROMPT] * TRIALS
    active, hits, firsts = list(range(TRIALS)), 0, 0
    for rnd in range(2):
        trees, qs, rows = [], [], []
        for i in active:
            c = ctxs[i]
            w1 = q_weights(c)
            x1 = int(rng.choice(V, p=w1 / w1.sum()))
            w2 = q_weights(c + (x1,))
            x2 = int(rng.choice(V, p=w2 / w2.sum()))
            tokens, parents = [c[-1], x1, x2], [-1, 0, 1]
            top = int(np.argmax(p_next(c)))
            if top != x1:
                tokens, parents = tokens + [top], parents + [0]
            send = declared or q_weights
            qs.append({1: (list(range(V)), send(c).tolist()), 2: (list(range(V)), send(c + (x1,)).tolist())})
            trees.append(cached_tree(tokens, parents, V))
            ctx_rows = [c, c + (tokens[1],), c + (tokens[1], tokens[2])] + ([c + (top,)] if len(tokens) == 4 else [])
            rows += [_row(x) for x in ctx_rows]
        gens = [torch.Generator().manual_seed(seed * 7919 + rnd * TRIALS + i) for i in active]
        logits = torch.from_numpy(TABLE[rows]).float()
        verdict = verify_batch(PackedTrees.pack(trees), logits, spec, None, gens, draft_q=qs)
        for k, (i, committed) in enumerate(zip(active, verdict.committed())):
            if rnd == 0:
                firsts += 1
                hits += int(verdict.path_rows[k, 0].item() == 1)
            ctxs[i] = ctxs[i] + tuple(committed)
        active = [i for i in active if len(ctxs[i]) < len(PROMPT) + 2]
        if not active:
            break
    idx = [c[2] * V + c[3] for c in ctxs]
    return np.bincount(idx, minlength=V * V).astype(float), hits / firsts


def expected_two(table=P_ALL) -> np.ndarray:
    out = np.zeros((V, V))
    for a, pa in enumerate(p_next(PROMPT, table)):
        out[a] = pa * p_next(PROMPT + (a,), table)
    return out.reshape(-1)



def test_sampled_drafts_are_lossless_and_accept_one_minus_tv():
    assert (P_ALL == 0).any(axis=1).all()  # truncation active: q has mass where p̃ has none
    observed, accept = decode_two(seed=0)
    stat, crit = chi_square(observed, expected_two())
    assert stat < crit, (stat, crit)
    w = q_weights(PROMPT)
    q = w / w.sum()
    analytic = float(np.minimum(p_next(PROMPT), q).sum())  # 1 - TV(p̃, q)
    assert abs(accept - analytic) < 0.015, (accept, analytic)
    assert analytic > p_next(PROMPT)[int(np.argmax(q))] - 1  # sanity: a probability
    # teeth: declaring a flat q while drawing from the real one biases the committed tokens
    lying, _ = decode_two(seed=0, declared=lambda c: np.full(V, 7, dtype=np.int64))
    assert chi_square(lying, expected_two())[0] > crit


def test_sampled_drafts_are_lossless_on_a_dense_p_tilde():
    """No top-k / top-p: p̃ is dense (the support covers the vocabulary), the coupling's other code path."""
    observed, accept = decode_two(seed=1, spec=DENSE)
    stat, crit = chi_square(observed, expected_two(P_DENSE))
    assert stat < crit, (stat, crit)
    w = q_weights(PROMPT)
    analytic = float(np.minimum(p_next(PROMPT, P_DENSE), w / w.sum()).sum())
    assert abs(accept - analytic) < 0.015, (accept, analytic)


def test_pack_drops_rows_past_a_cut_and_counts_per_tree():
    d = SampledDrafts.pack([{1: ([3], [2]), 2: ([4, 5], [1, 1])}, None, {1: ([0], [9])}], [0, 4, 6, 9], [2, 2, 3])
    assert d.rows.tolist() == [1, 7] and d.per_tree == (1, 0, 1)
    assert d.ids.tolist() == [[3], [0]]
    assert SampledDrafts.pack([None, {3: ([1], [1])}], [0, 2, 4], [2, 2]) is None


def test_greedy_requests_ignore_q_and_keep_the_argmax():
    logits = torch.from_numpy(TABLE[[0, 1]]).float()
    top = int(logits[0].argmax())
    other = (top + 1) % V
    tree = TokenTree.from_parents([PROMPT[-1], other], [-1, 0], vocab_size=V)
    v = verify_batch(PackedTrees.pack([tree]), logits, SamplingSpec(temperature=0.0), None,
                     [torch.Generator().manual_seed(0)], draft_q=[{1: ([other], [1])}])
    assert v.committed() == [[top]]
