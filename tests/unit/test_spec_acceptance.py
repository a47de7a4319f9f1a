"""Acceptance: hand-built trees with exact expected paths, tie-breaks, ε = 1 == exact, monotone in ε,
batched == select_path on thousands of random trees, generator reproducibility, verdict extras."""

import random

import pytest
import torch

from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.tree_contract import NodeLabel
from vllm_hyco.spec_decode.acceptance import AcceptanceMode, acceptance_mode, select_path
from vllm_hyco.spec_decode.sampling import SamplingSpec, sample_rows, sampling_probs
from vllm_hyco.spec_decode.stats import RoundStats
from vllm_hyco.spec_decode.tree import TokenTree
from vllm_hyco.spec_decode.verify import PackedTrees, verify_batch, verify_batch_from_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 6


def _probs(rows):
    """[n, V] from a list of {token: p} dicts."""
    out = torch.zeros(len(rows), V)
    for r, d in enumerate(rows):
        for tok, p in d.items():
            out[r, tok] = p
    return out


def _both(tokens, parents, probs, samples, eps, labels=None):
    """select_path and the batched path; asserts they agree and returns the single-tree result."""
    single = select_path(tokens, parents, probs, samples, eps)
    tree = TokenTree.from_parents(tokens, parents, vocab_size=V, labels=labels)
    verdict = verify_batch_from_probs([tree], probs, torch.tensor(samples), [eps])
    assert (verdict.paths()[0], int(verdict.bonus[0])) == single
    return single


def test_docstring_examples():
    probs = torch.tensor([[0.0, 0.9, 0.1], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    assert select_path([0, 1, 2], [-1, 0, 0], probs, [1, 0, 0], None) == ([1], 0)
    assert select_path([0, 2, 1], [-1, 0, 1], probs, [2, 2, 0], 0.05) == ([1, 2], 0)


# A tree: root 0; chain 1 -> 2 -> 3 -> 4 (rows 1-4); sibling 5 under the root (row 5); leaf 3 under row 1.
TOK = [0, 1, 2, 3, 4, 5, 3]
PAR = [-1, 0, 1, 2, 3, 0, 1]
UNIFORM = _probs([{t: 1 / 6 for t in range(6)}] * 7)


def test_exact_follows_the_samples_deep():
    assert _both(TOK, PAR, UNIFORM, [1, 2, 3, 4, 0, 0, 0], None) == ([1, 2, 3, 4], 0)


def test_exact_takes_the_matching_sibling_and_stops_at_a_miss():
    assert _both(TOK, PAR, UNIFORM, [5, 0, 0, 0, 0, 2, 0], None) == ([5], 2)
    assert _both(TOK, PAR, UNIFORM, [1, 3, 0, 0, 0, 0, 5], None) == ([1, 6], 5)
    assert _both(TOK, PAR, UNIFORM, [2, 0, 0, 0, 0, 0, 0], None) == ([], 2)


def test_epsilon_accepts_by_threshold_and_prefers_depth():
    probs = _probs([{1: 0.5, 5: 0.5}, {2: 0.3, 3: 0.7}, {3: 0.9, 0: 0.1}, {4: 0.2, 0: 0.8},
                    {0: 1.0}, {0: 1.0}, {0: 1.0}])
    # samples: root -> 5 (hit on row 5, depth 1); the chain is accepted by threshold only, depth 4
    samples = [5, 3, 0, 0, 0, 0, 0]
    assert _both(TOK, PAR, probs, samples, 0.1) == ([1, 2, 3, 4], 0)
    # with a stricter ε row 4 (p 0.2) fails: depth 3 via rows 1, 2, 3 beats row 6 (depth 2, one hit)
    assert _both(TOK, PAR, probs, samples, 0.25) == ([1, 2, 3], 0)
    assert _both(TOK, PAR, probs, samples, None) == ([5], 0)


def test_tie_break_more_hits_wins_at_equal_depth():
    # row 2 (1 -> 2) and row 6 (1 -> 3) both depth 2; the sample at row 1 is 3: row 6 is a hit.
    probs = _probs([{1: 1.0}, {2: 0.6, 3: 0.4}] + [{0: 1.0}] * 5)
    tok, par = [0, 1, 2, 5, 3], [-1, 0, 1, 0, 1]
    assert _both(tok, par, probs[:5], [1, 3, 0, 0, 0], 0.3) == ([1, 4], 0)


def test_tie_break_higher_probability_product_at_equal_hits():
    probs = _probs([{1: 0.5, 5: 0.5}, {2: 0.6, 3: 0.4}, {0: 1.0}, {0: 1.0}, {0: 1.0}])
    tok, par = [0, 1, 2, 5, 3], [-1, 0, 1, 0, 1]
    # the root samples 1 (hit), row 1 samples 0: rows 2 (p 0.6) and 4 (p 0.4) are ε-only at depth 2
    assert _both(tok, par, probs, [1, 0, 0, 0, 0], 0.3) == ([1, 2], 0)
    probs[1, 2], probs[1, 3] = 0.4, 0.6
    assert _both(tok, par, probs, [1, 0, 0, 0, 0], 0.3) == ([1, 4], 0)


def test_tie_break_lowest_row_when_everything_ties():
    probs = _probs([{1: 0.5, 5: 0.5}, {2: 0.5, 3: 0.5}, {0: 1.0}, {0: 1.0}, {0: 1.0}])
    tok, par = [0, 1, 3, 5, 2], [-1, 0, 1, 0, 1]
    assert _both(tok, par, probs, [1, 0, 0, 0, 0], 0.3) == ([1, 2], 0)


def test_epsilon_modes():
    assert acceptance_mode(None) is AcceptanceMode.EXACT
    assert acceptance_mode(1.0) is AcceptanceMode.EXACT
    assert acceptance_mode(0.005) is AcceptanceMode.EPSILON
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ConfigError):
            acceptance_mode(bad)


def _random_case(rng: random.Random, gen: torch.Generator):
    n = rng.randrange(1, 34)
    tree = TokenTree.make_dummy(n - 1, kind="random", vocab_size=V, seed=rng.randrange(10**9),
                                labelled=rng.random() < 0.5)
    logits = torch.randn(n, V, generator=gen) * 2
    logits[torch.rand(n, V, generator=gen) < 0.2] = -1e4  # some tokens effectively impossible
    probs = sampling_probs(logits, 1.0, rng.choice([-1, 2, 4]), rng.choice([1.0, 0.8]))
    if rng.random() < 0.3:  # exact probability ties
        probs = torch.where(probs > 0, 1.0, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    samples = sample_rows(probs, gen)
    return tree, probs, samples


def _phone_rule(tree, yhat):
    """Algorithm 1 line 8 on the phone: the deepest path of children equal to ŷ, lowest row on ties."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    ok = [True] + [False] * (len(toks) - 1)
    depth = [0] * len(toks)
    for r in range(1, len(toks)):
        ok[r] = ok[pars[r]] and toks[r] == yhat[pars[r]]
        depth[r] = depth[pars[r]] + 1
    best = max((r for r in range(len(toks)) if ok[r]), key=lambda r: (depth[r], -r))
    path, cur = [], best
    while cur:
        path.append(cur)
        cur = pars[cur]
    return path[::-1], yhat[best]


def test_batched_agrees_with_select_path_on_thousands_of_random_trees():
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    cases = [_random_case(rng, gen) for _ in range(2500)]
    eps = [rng.choice([None, 1.0, 0.5, 0.2, 0.05, 0.005]) for _ in cases]
    expect = [select_path(t.tokens, t.parents, p, s, e) for (t, p, s), e in zip(cases, eps)]
    for pad in (None, 33):
        packed = PackedTrees.pack([c[0] for c in cases], rows_per_tree=pad)
        rows = packed.tokens.numel()
        probs = torch.zeros(rows, V)
        samples = torch.zeros(rows, dtype=torch.int64)
        for b, (tree, p, s) in enumerate(cases):
            start = int(packed.row_offsets[b])
            probs[start : start + tree.num_rows] = p
            samples[start : start + tree.num_rows] = s
        verdict = verify_batch_from_probs(packed, probs, samples, eps)
        got = list(zip(verdict.paths(), verdict.bonus.tolist()))
        assert got == [(path, bonus) for path, bonus in expect], pad
        committed, yhat = verdict.committed(), verdict.yhat.tolist()
        for b, (tree, _, _) in enumerate(cases):
            assert committed[b] == tree.tokens[expect[b][0]].tolist() + [expect[b][1]]
            start = int(packed.row_offsets[b])
            phone = _phone_rule(tree, yhat[start : start + tree.num_rows])
            assert phone == expect[b], b


def test_epsilon_one_is_exact_and_length_is_monotone_in_epsilon():
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    cases = [_random_case(rng, gen) for _ in range(400)]
    trees = [c[0] for c in cases]
    probs = torch.cat([c[1] for c in cases])
    samples = torch.cat([c[2] for c in cases])
    exact = verify_batch_from_probs(trees, probs, samples, None)
    for one in (1.0, 2.0):
        same = verify_batch_from_probs(trees, probs, samples, one)
        assert same.paths() == exact.paths() and torch.equal(same.bonus, exact.bonus)
    assert torch.equal(exact.num_hits, exact.num_accepted)
    prev = exact.num_accepted
    for eps in (0.9, 0.5, 0.3, 0.1, 0.03, 0.01, 0.001, 1e-6):
        cur = verify_batch_from_probs(trees, probs, samples, eps).num_accepted
        assert bool((cur >= prev).all()), eps
        prev = cur
    assert int(prev.sum()) > int(exact.num_accepted.sum())


def test_verify_batch_reproduces_per_tree_sampling_and_ignores_padding():
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    trees = [TokenTree.make_dummy(rng.randrange(0, 33), kind="random", vocab_size=V, seed=s)
             for s in range(60)]
    specs = [SamplingSpec(rng.choice([0.0, 0.7, 1.0]), rng.choice([-1, 3]), rng.choice([1.0, 0.9]))
             for _ in trees]
    eps = [rng.choice([None, 0.1]) for _ in trees]
    logits = [torch.randn(t.num_rows, V, generator=gen) for t in trees]
    results = []
    for pad in (None, 33):
        packed = PackedTrees.pack(trees, rows_per_tree=pad)
        rows = torch.randn(packed.tokens.numel(), V)  # padding rows hold garbage
        for b, t in enumerate(trees):
            start = int(packed.row_offsets[b])
            rows[start : start + t.num_rows] = logits[b]
        gens = [torch.Generator().manual_seed(100 + b) for b in range(len(trees))]
        verdict = verify_batch(packed, rows, specs, eps, gens)
        results.append((verdict.paths(), verdict.bonus.tolist()))
    assert results[0] == results[1]
    for b, t in enumerate(trees):
        s = specs[b]
        probs = sampling_probs(logits[b], s.temperature, s.top_k, s.top_p)
        samples = sample_rows(probs, torch.Generator().manual_seed(100 + b))
        expect = select_path(t.tokens, t.parents, probs, samples, eps[b])
        assert (results[0][0][b], results[0][1][b]) == expect


def test_verdict_counts_sources_depths_and_compaction():
    probs = _probs([{1: 0.5, 5: 0.5}, {2: 0.3, 3: 0.7}, {3: 0.9, 0: 0.1}, {4: 0.2, 0: 0.8},
                    {0: 1.0}, {0: 1.0}, {0: 1.0}])
    labels = [0, 1, 1, 3, 3, 2, 3]
    tree = TokenTree.from_parents(TOK, PAR, vocab_size=V, labels=labels)
    other = TokenTree.from_parents([4], [-1], vocab_size=V)
    samples = torch.tensor([5, 2, 0, 0, 0, 0, 0] + [3])
    verdict = verify_batch_from_probs([tree, other], torch.cat([probs, _probs([{3: 1.0}])]),
                                      samples, [0.1, None])
    assert verdict.paths() == [[1, 2, 3, 4], []]
    # Algorithm 4 line 11: ŷ rewritten along the path (rows 0-3 now name their path child)
    assert verdict.yhat.tolist() == [1, 2, 3, 4, 0, 0, 0, 3]
    assert verdict.samples.tolist() == [5, 2, 0, 0, 0, 0, 0, 3]
    assert verdict.committed() == [[1, 2, 3, 4, 0], [3]]
    assert verdict.num_hits.tolist() == [1, 0] and verdict.num_eps_only.tolist() == [3, 0]
    assert verdict.accepted_per_depth.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert verdict.accepted_per_source[0].tolist() == [0, 2, 0, 2, 0]
    assert verdict.eps_only_per_source[0].tolist() == [0, 1, 0, 2, 0]
    plan = verdict.compaction
    assert plan.src_rows.tolist() == [0, 1, 2, 3, 4, 7]
    assert plan.dst_offsets.tolist() == [0, 1, 2, 3, 4, 0]
    assert plan.req.tolist() == [0, 0, 0, 0, 0, 1]
    stats = verdict.round_stats(0, num_drafted=6) + verdict.round_stats(1)
    d = stats.to_dict()
    assert d["rounds"] == 2 and d["accepted"] == 4 and d["hits"] == 1 and d["eps_only"] == 3
    assert d["per_source"]["slm"] == 2 and d["eps_only_per_source"]["chain"] == 1
    assert d["mean_accepted_length"] == 2.0 and d["drafted"] == 6
    assert isinstance(RoundStats() + stats, RoundStats)
    assert verdict.total_stats().to_dict() == (stats + RoundStats()).to_dict() | {"drafted": 0}
    assert NodeLabel.SLM == 3


def test_sparse_support_path_matches_dense_reference_on_a_larger_vocabulary():
    """Top-k on a vocabulary > 4k: verify_batch runs on a sparse support; the reference is dense."""
    vocab, rng, gen = 400, random.Random(3), torch.Generator().manual_seed(3)
    trees = [TokenTree.make_dummy(rng.randrange(0, 33), kind="random", vocab_size=8, seed=s)
             for s in range(40)]  # tokens < 8: the drafted tokens often sit in the top-k
    spec = SamplingSpec(temperature=0.8, top_k=8, top_p=0.9)
    logits = torch.randn(sum(t.num_rows for t in trees), vocab, generator=gen)
    logits[:, :8] += 3.0
    gens = [torch.Generator().manual_seed(b) for b in range(len(trees))]
    verdict = verify_batch(trees, logits, spec, 0.05, gens)
    assert int(verdict.num_accepted.sum()) > 0
    start = 0
    for b, t in enumerate(trees):
        probs = sampling_probs(logits[start : start + t.num_rows], spec.temperature, spec.top_k, spec.top_p)
        samples = sample_rows(probs, torch.Generator().manual_seed(b))
        assert (verdict.paths()[b], int(verdict.bonus[b])) == select_path(t.tokens, t.parents, probs,
                                                                          samples, 0.05)
        start += t.num_rows
