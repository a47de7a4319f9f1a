"""p̃ against vLLM 0.32's own sampler functions, and the generator-consumption convention."""

import pytest
import torch
from tolerances import tol

from vllm_hyco.spec_decode.sampling import (
    SparseProbs,
    draw_uniforms,
    sample_rows,
    sampling_probs,
    sampling_support,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _vllm_probs(logits, temperature, top_k, top_p):
    """p̃ through vLLM's own pieces: Sampler.apply_temperature, apply_top_k_top_p, softmax."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    vocab = logits.shape[1]
    x = logits.to(torch.float32).clone()
    greedy = temperature < 1e-5
    x = Sampler.apply_temperature(x, temperature.clone(), all_random=False)
    k = top_k.clone().to(torch.int32)
    k = torch.where((k <= 0) | (k >= vocab), vocab, k)  # InputBatch: off -> vocab_size
    any_k, any_p = bool((k < vocab).any()), bool((top_p < 1).any())
    x = apply_top_k_top_p(x, k if any_k else None, top_p.clone() if any_p else None)
    probs = x.softmax(dim=-1, dtype=torch.float32)
    one_hot = torch.nn.functional.one_hot(logits.float().argmax(dim=1), vocab).float()
    return torch.where(greedy.unsqueeze(1), one_hot, probs), x


def _assert_same_p(ours, theirs, scaled_logits, case):
    """Equal up to the float tolerance; where the kept sets differ, only inside a tie at the nucleus
    boundary (vLLM leaves that order unspecified): the same count kept, and we keep the lowest ids."""
    torch.testing.assert_close(
        ours.sort(dim=1).values, theirs.sort(dim=1).values, **tol("probs", torch.float32),
        msg=lambda m: f"case {case}: {m}",
    )
    differ = (ours > 0) != (theirs > 0)
    for r in differ.any(dim=1).nonzero().flatten().tolist():
        assert (theirs[r] > 0).sum() == (ours[r] > 0).sum(), (case, r)
        cols = differ[r].nonzero().flatten()
        tied = scaled_logits[r, cols].unique()
        assert tied.numel() == 1, (case, r, tied)
        group = (scaled_logits[r] == tied).nonzero().flatten()
        kept = group[ours[r, group] > 0]
        assert kept.tolist() == group[: kept.numel()].tolist(), (case, r)


def _random_case(gen, rows, vocab, tie_rounding):
    logits = torch.randn(rows, vocab, generator=gen) * 3
    if tie_rounding:  # bf16 rounding plants many exact ties, as real bf16 logits have
        logits = logits.to(torch.bfloat16).float()
    temperature = torch.rand(rows, generator=gen) * 1.5 + 0.1
    temperature[::5] = 0.0
    top_k = torch.randint(-1, 80, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.6 + 0.4
    top_p[::3] = 1.0
    return logits, temperature, top_k, top_p


@pytest.mark.parametrize("tie_rounding", [False, True])
@pytest.mark.parametrize("case", range(6))
def test_matches_vllm_sampler_on_random_logits(case, tie_rounding):
    gen = torch.Generator().manual_seed(case)
    logits, temperature, top_k, top_p = _random_case(gen, 24, 3000, tie_rounding)
    if case % 2 == 1:  # every row with top-k on: exercises the no-full-sort path
        top_k = top_k.clamp(min=1)
    theirs, _ = _vllm_probs(logits, temperature, top_k, top_p)
    ours = sampling_probs(logits, temperature, top_k, top_p)
    scaled = logits / torch.where(temperature < 1e-5, 1.0, temperature)[:, None]
    _assert_same_p(ours, theirs, scaled, case)


def test_ties_at_the_kth_value_all_survive_like_vllm():
    logits = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 2.0]])
    for k in (2, 3, 4):
        ours = sampling_probs(logits, 1.0, k, 1.0)
        theirs, _ = _vllm_probs(logits, torch.ones(2), torch.full((2,), k), torch.ones(2))
        torch.testing.assert_close(ours, theirs, **tol("probs", torch.float32))
        assert (ours[0] > 0).sum() == 4 and (ours[1] > 0).sum() == 6


def test_tie_straddling_the_nucleus_keeps_the_lowest_ids_with_vllm_mass():
    # probs 0.4, 0.2 x3 (ids 1..3): the nucleus p=0.5 needs 0.4 + one 0.2
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2]]))
    ours = sampling_probs(logits, 1.0, -1, 0.5)
    assert (ours > 0).tolist() == [[True, True, False, False]]
    theirs, _ = _vllm_probs(logits, torch.ones(1), torch.full((1,), -1), torch.full((1,), 0.5))
    assert (theirs > 0).sum() == 2
    torch.testing.assert_close(ours.sort().values, theirs.sort().values, **tol("probs", torch.float32))


def test_tie_inside_or_outside_the_nucleus_matches_exactly():
    # ties at the top (fully kept) and at the bottom (fully dropped)
    logits = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.1, 0.1]]))
    for p in (0.55, 0.75, 0.95):
        ours = sampling_probs(logits, 1.0, -1, p)
        theirs, _ = _vllm_probs(logits, torch.ones(1), torch.full((1,), -1), torch.full((1,), p))
        torch.testing.assert_close(ours, theirs, **tol("probs", torch.float32))


def test_greedy_is_one_hot_at_the_first_max():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    probs = sampling_probs(logits, 0.0, 2, 0.5)
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]
    torch.testing.assert_close(sampling_probs(logits, 1e-6, -1, 1.0), probs)


def test_full_and_topk_candidate_paths_give_identical_bits():
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(40, 5000, generator=gen) * 2).to(torch.bfloat16).float()
    k = torch.randint(1, 70, (40,), generator=gen)
    p = torch.rand(40, generator=gen) * 0.5 + 0.5
    fast = sampling_probs(logits, 0.9, k, p)
    # one row with top-k off forces the whole batch onto the full-vocabulary path
    k_full = torch.cat([k, torch.tensor([-1])])
    full = sampling_probs(torch.cat([logits, logits[:1]]), 0.9, k_full, torch.cat([p, p[:1]]))[:40]
    assert torch.equal(fast, full)


def test_sample_rows_consumes_one_uniform_per_row_and_follows_the_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    g1 = torch.Generator().manual_seed(7)
    samples = sample_rows(probs, g1)
    g2 = torch.Generator().manual_seed(7)
    u = draw_uniforms(3, g2)
    expect = [1 if u[0] * 1.0 < 0.25 else 3, 0, 0 if u[2] < 0.5 else 1]
    assert samples.tolist() == expect
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))  # same state after


def test_sample_rows_frequencies_and_never_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(20000, 4).contiguous()
    samples = sample_rows(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(samples, minlength=4).float() / 20000
    assert freq[1] == 0
    assert torch.allclose(freq, probs[0], atol=0.015)


def test_sparse_round_trip():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 50, generator=gen)
    sup = sampling_support(logits, 1.0, 5, 0.9)
    dense = sup.to_dense()
    back = SparseProbs.from_dense(dense)
    assert torch.equal(back.to_dense(), dense)
    assert torch.equal(sup.lookup(torch.arange(8), dense.argmax(dim=1)), dense.max(dim=1).values)


def test_many_ties_at_the_kth_value_on_a_large_vocabulary_widen_the_candidates():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 1000, generator=gen)
    logits[:, 100:112] = 5.0  # 12 tied values at the top; top-k 3 must keep all 12
    logits[1, 7] = 9.0
    k = torch.tensor([3, 3, 20])
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        ours = sampling_probs(x, 0.8, k, 1.0)
        theirs, _ = _vllm_probs(x, torch.full((3,), 0.8), k, torch.ones(3))
        torch.testing.assert_close(ours, theirs, **tol("probs", torch.float32))
        assert (ours > 0).sum(dim=1).tolist() == [12, 13, 20]


def test_a_rows_p_tilde_does_not_depend_on_the_rows_batched_with_it():
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, 3000, generator=gen) * 2).to(torch.bfloat16)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 1.0, 0.9])
    top_k = torch.tensor([-1, -1, 40, 5, 0, 64])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.95, 0.95])
    batched = sampling_probs(logits, temperature, top_k, top_p)
    for r in range(6):
        alone = sampling_probs(logits[r : r + 1], temperature[r], top_k[r], top_p[r])
        assert torch.equal(alone[0], batched[r]), r
    theirs, _ = _vllm_probs(logits, temperature, top_k, top_p)
    scaled = logits.float() / torch.where(temperature < 1e-5, 1.0, temperature)[:, None]
    _assert_same_p(batched, theirs, scaled, "batch")


def test_a_uniform_at_the_top_of_the_cdf_never_picks_a_zero_mass_token():
    from vllm_hyco.spec_decode.sampling import sample_sparse

    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.5]])
    top = torch.full((2,), 1.0, dtype=torch.float64)  # beyond any torch.rand value: worst case
    assert sample_sparse(SparseProbs.from_dense(probs), top).tolist() == [2, 4]
    wide = torch.cat([torch.log(probs), torch.full((2, 35), float("-inf"))], dim=1)  # sparse path
    sparse = sampling_support(wide, 1.0, 2, 1.0)
    assert sparse.ids is not None and sample_sparse(sparse, top).tolist() == [2, 4]
    assert sample_sparse(SparseProbs.from_dense(probs), torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]
