"""Exact verification stays lossless on trees the node budget cut (the distribution side).

Same toy verifier, adversarial trees and chi-square test as tests/unit/test_spec_acceptance_lossless.py;
every tree is cut by :class:`BudgetPolicy` (a steep step-cost model, per-session acceptance learned from
the rounds) to a prefix before it is verified, so the verified trees are short and often lose the
likeliest branch. The first 3 committed tokens must still be distributed as sampling from p̃.
"""

import importlib.util
import random
from pathlib import Path

import numpy as np
import torch
from distcheck import cached_tree

from vllm_hyco.spec_decode.budget import BudgetPolicy, StepCostModel
from vllm_hyco.spec_decode.verify import PackedTrees, verify_batch

_spec = importlib.util.spec_from_file_location(
    "_lossless", Path(__file__).with_name("test_spec_acceptance_lossless.py"))
L = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(L)

ROUNDS = 20_000


def _policy() -> BudgetPolicy:
    pol = BudgetPolicy(32)
    cost = StepCostModel(min_steps=0)
    rng = np.random.default_rng(0)
    for _ in range(64):  # 20 ms fixed, 0.4 ms per row: the fixed share decides (sharing 1, 4 or 16)
        rows = int(rng.integers(1, 100))
        cost.observe(rows, rows * int(rng.integers(1, 500)) / 1000, 2e-2 + 4e-4 * rows)
    pol.cost = cost
    return pol


def decode_first3_cut(seed: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Counts of the first 3 generated tokens over ROUNDS decodes of cut trees, and (kept, sent) nodes."""
    rng = random.Random(seed)
    pol = _policy()
    ctxs = [L.PROMPT] * ROUNDS
    active = list(range(ROUNDS))
    kept: list[tuple[int, int]] = []
    for rnd in range(3):
        trees, rows, cut = [], [], []
        for i in active:
            toks, pars = L.build_tree(ctxs[i], rng.randrange(4), rng)
            plan = pol.plan(f"s{i % 8}", pars, sharing=rng.choice([1, 4, 16]))
            toks, pars = toks[:plan.nodes + 1], pars[:plan.nodes + 1]
            kept.append((plan.nodes, plan.sent))
            cut.append((toks, pars))
            trees.append(cached_tree(toks, pars, L.V))
            rows += L.table_rows(ctxs[i], toks, pars)
        gens = [torch.Generator().manual_seed(seed * 7919 + rnd * ROUNDS + i) for i in active]
        logits = torch.from_numpy(L.TABLE[rows]).float()
        verdict = verify_batch(PackedTrees.pack(trees), logits, L.SPEC, None, gens)
        for i, (toks, pars), committed, n in zip(active, cut, verdict.committed(), verdict.num_accepted.tolist()):
            ctxs[i] = ctxs[i] + tuple(committed)
            if i < 2000:  # the policy learns from a sample of the rounds (keeps the test fast)
                path = _path_rows(toks, pars, committed[:int(n)])
                pol.observe_round(f"s{i % 8}", pars, None, path)
        active = [i for i in active if len(ctxs[i]) < len(L.PROMPT) + 3]
        if not active:
            break
    assert not active
    idx = [c[2] * L.V * L.V + c[3] * L.V + c[4] for c in ctxs]
    return np.bincount(idx, minlength=L.V**3).astype(float), kept


def _path_rows(tokens, parents, accepted) -> list[int]:
    rows, node = [], 0
    for tok in accepted:
        node = next(j for j in range(1, len(tokens)) if parents[j] == node and tokens[j] == tok)
        rows.append(node)
    return rows


def test_exact_mode_is_lossless_on_budget_cut_trees():
    observed, kept = decode_first3_cut(seed=1)
    stat, crit = L.chi_square(observed, L.expected_first3())
    assert stat < crit, (stat, crit)
    kept, sent = np.asarray(kept).T
    assert np.all((kept >= 1) | (sent == 0)) and np.all(kept <= sent)  # no starvation, only prefixes
    assert (kept < sent).mean() > 0.3 and kept.max() > 4  # the cut is real and depends on the load
