"""Baseline tree builders: SpecEdge-style (4 sequential SLM passes, 32 nodes) and proactive drafting."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from mobile_client.baselines import (
    DECAY,
    PROACTIVE_DECAY,
    SpecEdgeGrower,
    proactive_draft,
    specedge_tree,
)
from mobile_client.tree import FrontierPlan, TreeBuildError
from vllm_hyco.handoff.tree_contract import NodeLabel, validate_tree


def _toy_logq(context: tuple[int, ...], v: int, levels: int) -> list[float]:
    """A deterministic SLM row: log q depends only on the whole context; integer logits force ties."""
    g = torch.Generator().manual_seed(hash(context) % (2**31))
    return torch.randint(0, levels, (v,), generator=g).float().log_softmax(-1).double().tolist()


class ToySlm:
    """An SLM callable over a committed prefix it holds itself; records every plan it is given."""

    def __init__(self, prefix: list[int], v: int, levels: int = 50):
        self.prefix, self.v, self.levels = list(prefix), v, levels
        self.plans: list[FrontierPlan] = []

    def __call__(self, plan: FrontierPlan) -> torch.Tensor:
        self.plans.append(plan)
        rows = [_toy_logq(tuple(self.prefix + p), self.v, self.levels) for p in plan.row_paths()]
        self.prefix += plan.catch_up  # like a KV-caching SLM: catch-up rows are committed context now
        return torch.tensor(rows, dtype=torch.float64)


def _ref_specedge(root, logq_of_path, *, passes, node_budget, beams, width, decay, ids=None):
    """SpecExec-style growth written directly with lists and sorted()."""
    T = [[root, -1, 0.0]]
    done = set()

    def path(r):
        out = []
        while r >= 0:
            out.append(T[r][0])
            r = T[r][1]
        return tuple(out[::-1])

    for _ in range(passes):
        open_rows = sorted((r for r in range(len(T)) if r not in done), key=lambda r: (-T[r][2], r))[:beams]
        if not open_rows or node_budget == 0:
            break
        C = []
        for v in open_rows:
            q = logq_of_path(path(v))
            tok = ids if ids is not None else list(range(len(q)))
            for c in sorted(range(len(q)), key=lambda c: (-q[c], tok[c]))[:width]:
                C.append([tok[c], v, (T[v][2] + q[c]) + decay])
        done.update(open_rows)
        ranked = sorted([t[2] for t in T[1:]] + [c[2] for c in C], reverse=True)
        theta = ranked[node_budget - 1] if len(ranked) >= node_budget else -math.inf
        added = [c for c in C if c[2] >= theta]
        T.extend(added)
        if not added:
            break
    best = sorted(range(1, len(T)), key=lambda r: (-T[r][2], r))[:node_budget]
    kept = sorted(set(best) | {0})
    idx = {r: i for i, r in enumerate(kept)}
    return [T[r][0] for r in kept], [-1 if r == 0 else idx[T[r][1]] for r in kept]


def test_worked_example_uniform_slm():
    uniform = lambda plan: np.full((plan.num_rows, 3), np.log(1 / 3))  # noqa: E731
    tree = specedge_tree(9, uniform, passes=2, node_budget=4)
    assert tree.to_wire() == ([9, 0, 1, 2, 0], [-1, 0, 0, 0, 1])
    assert tree.scores[1] == (0.0 + math.log(1 / 3)) + DECAY
    assert set(tree.sources[1:]) == {NodeLabel.SLM}


def test_four_passes_32_nodes_shape():
    slm = ToySlm([1, 2, 3], v=300)
    tree = specedge_tree(7, slm)
    assert tree.num_nodes == 32
    assert 1 <= len(slm.plans) <= 4  # growth stops early once no candidate can reach the 32 best
    assert len(slm.plans[0].rows) == 1  # the first pass expands the root alone
    assert all(len(p.rows) <= 32 for p in slm.plans)
    assert max(tree.depths()) <= 4
    assert all(len(tree.children(r)) <= 16 for r in range(len(tree.tokens)))
    assert tree.padded().tokens.shape == (33,)


def test_peaked_slm_runs_all_four_passes():
    def peaked(plan):
        out = torch.full((plan.num_rows, 50), math.log(0.03 / 49), dtype=torch.float64)
        out[:, 0] = math.log(0.97)
        return out

    calls = []
    tree = specedge_tree(7, lambda plan: calls.append(plan) or peaked(plan))
    assert len(calls) == 4 and max(tree.depths()) == 4
    assert tree.num_nodes == 32


@pytest.mark.parametrize("seed", range(25))
def test_specedge_matches_reference(seed):
    rng = random.Random(seed)
    v = rng.choice([5, 30, 80])
    levels = rng.choice([2, 5, 60])
    kw = dict(passes=rng.randint(1, 4), node_budget=rng.choice([0, 1, 6, 32]), beams=rng.choice([1, 4, 32]),
              width=rng.choice([1, 3, 16]), decay=rng.choice([DECAY, PROACTIVE_DECAY]))
    ids = sorted(rng.sample(range(4 * v), v)) if rng.random() < 0.3 else None
    prefix = [rng.randrange(v) for _ in range(3)]
    root = rng.randrange(v)
    expect = _ref_specedge(root, lambda p: _toy_logq(tuple(prefix) + p, v, levels), ids=ids, **kw)
    keep = None if ids is None else np.array(ids)
    got = specedge_tree(root, ToySlm(prefix, v, levels), keep_ids=keep, **kw)
    assert got.to_wire() == tuple(expect), f"seed={seed} {kw}"


def test_catch_up_goes_to_the_first_forward_only():
    slm = ToySlm([1], v=40)
    specedge_tree(5, slm, catch_up=[8, 9])
    assert slm.plans[0].catch_up == (8, 9)
    assert all(p.catch_up == () for p in slm.plans[1:])


def test_output_passes_server_validation():
    tree = specedge_tree(7, ToySlm([1, 2], v=200))
    validate_tree(*tree.to_wire(), vocab_size=200, node_budget=32, labels=list(tree.sources))


def test_bad_config():
    with pytest.raises(TreeBuildError):
        SpecEdgeGrower(1, decay=0.0)


# ------------------------------------------------------------ proactive


def test_proactive_bet_is_the_best_leaf_and_next_token():
    v, prefix = 60, [4, 5, 6]
    tree = specedge_tree(7, ToySlm(prefix, v))
    slm = ToySlm(prefix, v)
    draft = proactive_draft(tree, slm)
    # brute force the bet over all leaves
    leaves = [r for r in range(len(tree.tokens)) if not tree.children(r)]
    best = None
    for r in sorted(leaves, key=lambda r: (-tree.scores[r], r)):
        path = tuple(tree.tokens[j] for j in tree.path(r))
        q = _toy_logq(tuple(prefix) + path, v, 50)
        c = min(range(v), key=lambda c: (-q[c], c))
        s = (tree.scores[r] + q[c]) + PROACTIVE_DECAY
        if best is None or s > best[0]:
            best = (s, r, c)
    assert (draft.leaf_row, draft.bonus) == (best[1], best[2])
    assert draft.path_tokens == tuple(tree.tokens[j] for j in tree.path(best[1])[1:])
    assert len(slm.plans) == 1 + 3  # the bet forward, then three passes
    assert slm.plans[1].catch_up == (7,) + draft.path_tokens


def test_proactive_reuse_equals_fresh_tree_after_commit():
    v, prefix = 60, [4, 5, 6]
    tree = specedge_tree(7, ToySlm(prefix, v))
    draft = proactive_draft(tree, ToySlm(prefix, v))
    assert draft.matches(draft.path_tokens, draft.bonus)
    assert not draft.matches(draft.path_tokens, draft.bonus + 1)
    assert not draft.matches(draft.path_tokens[:-1], draft.bonus) or not draft.path_tokens
    assert draft.reuse(draft.path_tokens, draft.bonus + 1) is None
    # after the verdict the phone commits the root and the path; a fresh tree from the bonus is identical
    committed = prefix + [7, *draft.path_tokens]
    fresh = specedge_tree(draft.bonus, ToySlm(committed, v), passes=3, decay=PROACTIVE_DECAY)
    assert draft.tree == fresh
    grower = draft.reuse(draft.path_tokens, draft.bonus)
    assert grower is not None and grower.passes_run == 3
    grower.grow(ToySlm(committed, v), 1)  # "included": one more pass after reuse
    assert grower.passes_run == 4 and grower.result().num_nodes <= 32


def test_proactive_on_root_only_tree():
    v = 20
    tree = specedge_tree(3, ToySlm([1], v), node_budget=0)
    assert tree.num_nodes == 0
    draft = proactive_draft(tree, ToySlm([1], v), passes=1)
    assert draft.leaf_row == 0 and draft.path_tokens == ()
    assert draft.tree.tokens[0] == draft.bonus
