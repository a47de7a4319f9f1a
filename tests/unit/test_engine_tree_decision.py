"""The engine's batched device decision (``vllm_adapter/tree_step.decide``) equals the former per-tree host
decision (``tests/tree_reference.py``) on the same uniforms: random trees and logits, many trees per
step, greedy and sampled sessions mixed, exact and ε, and the edge cases of p̃ (top-k 1 and >= V, tiny
top-p, temperature just above the greedy threshold, ties at the k-th value and across the nucleus edge,
a -inf logit, min_tokens masking stop ids by row depth)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tree_reference import decide_one_tree

from vllm_hyco.vllm_adapter.worker import tree_step
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows

V = 300


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    tokens, parents = [rng.randrange(V)], [-1]
    for i in range(1, n):
        p = rng.randrange(i) if rng.random() < 0.6 else i - 1
        while True:
            tok = rng.randrange(8) if rng.random() < 0.7 else rng.randrange(V)  # often in the top few
            if all(not (pp == p and tt == tok) for tt, pp in zip(tokens, parents)):
                break
        tokens.append(tok)
        parents.append(p)
    return tokens, parents


SPECS = [  # (temperature, top_k, top_p)
    (0.0, -1, 1.0), (1.0, -1, 1.0), (0.8, 20, 0.9), (1.0, 1, 1.0), (1.0, V, 1.0), (1.0, V + 5, 0.5),
    (0.7, -1, 0.01), (1.2e-5, 50, 0.95), (1.5, 3, 1.0), (0.9, 8, 0.999), (1.0, -1, 0.3), (0.0, 5, 0.5),
]


def _logits(gen: torch.Generator, n: int, kind: str) -> torch.Tensor:
    x = torch.randn(n, V, generator=gen) * 2
    x[:, :8] += 3.0
    if kind == "ties":  # many equal values at the top: ties at the k-th value and across the nucleus
        x = torch.round(x)
        x[:, :6] = x[:, :6].max(dim=1, keepdim=True).values
    elif kind == "inf":
        x[:, 1] = float("-inf")
    elif kind == "flat":
        x = torch.zeros(n, V)
    return x


def _case(seed: int, num_trees: int, gaps: bool = True):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    trees, requests, blocks, logit_starts, q = [], {}, [], [], 0
    for b in range(num_trees):
        n = rng.choice([1, 2, 5, 17, 33])
        tokens, parents = _tree(rng, n)
        temp, top_k, top_p = rng.choice(SPECS)
        eps = rng.choice([None, 0.5, 0.05, 0.005])
        min_tokens = rng.choice([0, 0, 3])
        req = f"r{b}"
        params = SimpleNamespace(temperature=temp, top_k=top_k, top_p=top_p, min_tokens=min_tokens,
                                 all_stop_token_ids={0, 1} if min_tokens else set())
        requests[req] = SimpleNamespace(sampling_params=params, output_token_ids=[7] * rng.randrange(3))
        q += rng.randrange(3) if gaps else 0  # other requests' rows between trees (or none: one slice)
        trees.append(TreeRows.build(req_id=req, batch_idx=b, q_start=q, num_rows=n, context_len=10, round=1,
                                    tokens=tokens, parents=parents, eps=eps))
        logit_starts.append(q)
        blocks.append(_logits(gen, n, rng.choice(["plain", "ties", "inf", "flat", "plain"])))
        q += n
    logits = torch.randn(q + 2, V, generator=gen)  # rows of other requests hold garbage
    for tr, lo, blk in zip(trees, logit_starts, blocks):
        logits[lo: lo + tr.num_rows] = blk
    return trees, requests, logit_starts, logits


@pytest.mark.parametrize("seed", range(12))
def test_batched_device_decision_equals_the_per_tree_host_decision(seed):
    trees, requests, starts, logits = _case(seed, num_trees=9, gaps=seed % 2 == 0)
    before = logits.clone()
    runner = SimpleNamespace(requests=requests)
    gens = {}

    def generator(req_id, params):
        return gens.setdefault(req_id, torch.Generator().manual_seed(1000 + int(req_id[1:])))

    step = tree_step.StepTrees.build(trees, starts, "cpu")
    assert (step.logit_slice is not None) == (seed % 2 == 1 or starts == [starts[0] + o for o in step.offsets[:-1]])
    dec = tree_step.decide(runner, step, logits, generator)
    assert torch.equal(logits, before)  # min_tokens masks a copy, never the engine's logits
    for b, (tr, lo) in enumerate(zip(trees, starts)):
        p = requests[tr.req_id].sampling_params
        n_out = len(requests[tr.req_id].output_token_ids)
        masked = [j for j, d in enumerate(tr.depths.tolist()) if n_out + d < p.min_tokens]
        want = decide_one_tree(logits[lo: lo + tr.num_rows], tr.tokens, tr.parents, p.temperature,
                               int(p.top_k or -1), p.top_p, tr.eps,
                               torch.Generator().manual_seed(1000 + b), masked, sorted(p.all_stop_token_ids))
        got = {"path_rows": dec.path_rows[b], "bonus": dec.bonus[b], "hits": dec.hits[b],
               "samples": dec.samples[b]}
        assert got == want, (seed, b, p, tr.eps)


def test_greedy_trees_consume_no_uniforms_and_seeded_streams_continue():
    """A session's generator advances by one uniform per row of its sampled trees only, so a seeded session
    draws the same stream whatever shares its steps."""
    trees, requests, starts, logits = _case(3, num_trees=6)
    for r in requests.values():
        r.sampling_params.min_tokens = 0
    gens = {}

    def generator(req_id, params):
        return gens.setdefault(req_id, torch.Generator().manual_seed(7))

    tree_step.decide(SimpleNamespace(requests=requests), tree_step.StepTrees.build(trees, starts, "cpu"), logits,
                     generator)
    for tr in trees:
        sampled = requests[tr.req_id].sampling_params.temperature >= 1e-5
        assert (tr.req_id in gens) == sampled
        if sampled:
            fresh = torch.Generator().manual_seed(7)
            torch.rand(tr.num_rows, generator=fresh, dtype=torch.float64)
            assert torch.equal(torch.rand(3, generator=gens[tr.req_id], dtype=torch.float64),
                               torch.rand(3, generator=fresh, dtype=torch.float64))
