"""The phone's hybrid tree builder (paper Algorithm 3, decisions D3/D5): worked examples, edge cases, and an
independent brute-force reference on random inputs (ties forced by quantized log-probabilities)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from mobile_client.candidates import top_candidates
from mobile_client.tree import (
    DraftTree,
    TreeBuildError,
    build_draft_tree,
    build_tree,
    frontier_plan,
    grow_tree,
    plant_tree,
)
from vllm_hyco.handoff.client_frames import TreeFrame
from vllm_hyco.handoff.tree_contract import NodeLabel, validate_tree

A = math.log(0.66)
R, C1, C2, C3, C4, S1, S2 = 100, 11, 12, 13, 14, 21, 22  # Figure 2: root, chain y1..y4, runner-ups y'1, y'2


def _rows(v: int, probs: dict[int, dict[int, float]], n: int) -> torch.Tensor:
    """[n, v] log q: row r puts ``probs[r]`` on its tokens and spreads the rest evenly."""
    out = torch.empty(n, v, dtype=torch.float64)
    for r in range(n):
        p = probs.get(r, {})
        rest = (1.0 - sum(p.values())) / (v - len(p))
        out[r] = rest
        for t, pt in p.items():
            out[r, t] = pt
    return out.log()


# ------------------------------------------------------------ worked examples


def test_figure2_planted_scores_and_frontier_order():
    t = plant_tree(R, [C1, C2, C3, C4], [S1, S2])
    assert t.tokens == (R, C1, C2, C3, C4, S1, S2)
    assert t.parents == (-1, 0, 1, 2, 3, 0, 1)
    assert t.sources == (NodeLabel.ROOT, NodeLabel.CHAIN, NodeLabel.CHAIN, NodeLabel.CHAIN, NodeLabel.CHAIN,
                         NodeLabel.RUNNER_UP, NodeLabel.RUNNER_UP)
    assert t.scores == (0.0, A, A + A, A + A + A, A + A + A + A, 2 * A, A + 2 * A)
    # Runner-up at depth k ties the chain node at depth k + 1; ties go to the earlier row (D5).
    plan = frontier_plan(t)
    assert plan.rows == (0, 1, 2, 5, 3, 6, 4)
    assert [t.tokens[r] for r in plan.rows] == [R, C1, C2, S1, C3, S2, C4]


def test_figure2_tree_two_candidates_per_row_twelve_nodes():
    """Figure 2 draws at most two SLM candidates per node and 12 kept nodes; build exactly that tree."""
    v = 64
    probs = {i: {30 + 2 * i: 0.6, 31 + 2 * i: 0.3} for i in range(7)}  # row i's two likely tokens
    lp = _rows(v, probs, 7)
    tokens, parents = build_tree(R, [C1, C2, C3, C4], [S1, S2], lp, node_budget=12, topk=2)
    # Non-root scores, best first: y1 A=-.42, y2 and y'1 2A=-.83, root's 30 ln .6+A=-.93, y3 and y'2 -1.25,
    # y1's 32 -1.34, root's 31 -1.62, y4 -1.66, y2's 34 and y'1's 40 -1.76, y1's 33 -2.03 (12th), ...
    expect_rows = [
        (R, -1), (C1, 0), (C2, 1), (C3, 2), (C4, 3), (S1, 0), (S2, 1),  # planted, insertion order
        (30, 0), (31, 0),  # root's candidates (frontier row 0)
        (32, 1), (33, 1),  # y1's (frontier row 1)
        (34, 2),  # y2's best (frontier row 2)
        (40, 5),  # y'1's best (frontier row 3)
    ]
    assert list(zip(tokens, parents)) == expect_rows
    assert len(tokens) == 13


def test_hand_computed_scores_and_sources():
    lp = _rows(8, {0: {5: 0.5}, 1: {6: 0.9}}, 2)
    tree = build_draft_tree(3, [4], [], lp, node_budget=3)
    assert tree.tokens == (3, 4, 5, 6)
    assert tree.parents == (-1, 0, 0, 1)
    assert tree.sources == (NodeLabel.ROOT, NodeLabel.CHAIN, NodeLabel.SLM, NodeLabel.SLM)
    assert tree.scores[2] == (0.0 + math.log(0.5)) + A
    assert tree.scores[3] == (A + math.log(0.9)) + A


# ------------------------------------------------------------ edge cases


def test_duplicate_slm_candidate_of_existing_child_is_skipped_not_replaced():
    # Root's SLM ranks the chain token first; it is skipped, and the 2 candidates are then only token 7.
    lp = _rows(10, {0: {4: 0.7, 7: 0.2}}, 2)
    tree = build_draft_tree(3, [4], [], lp, node_budget=32, topk=2)
    root_kids = [tree.tokens[r] for r in tree.children(0)]
    assert root_kids == [4, 7]
    assert sorted(root_kids) == sorted(set(root_kids))


def test_duplicate_of_runner_up_is_skipped():
    lp = _rows(10, {0: {5: 0.5, 8: 0.3}}, 3)
    tree = build_draft_tree(3, [4], [5], lp, node_budget=32, topk=2)
    assert [tree.tokens[r] for r in tree.children(0)] == [4, 5, 8]


def test_runner_up_equal_to_chain_token_is_not_planted():
    t = plant_tree(R, [C1, C2], [C1, S2])
    assert t.tokens == (R, C1, C2, S2)
    assert t.parents == (-1, 0, 1, 1)
    with pytest.raises(TreeBuildError, match="expected 4"):
        build_tree(R, [C1, C2], [C1, S2], torch.zeros(5, 50).log_softmax(-1))
    tokens, parents = build_tree(R, [C1, C2], [C1, S2], torch.zeros(4, 50).log_softmax(-1))
    assert len(tokens) == 33 and tokens[:4] == [R, C1, C2, S2]


def test_fewer_candidates_than_budget_keeps_everything():
    v = 5
    lp = torch.randn(7, v, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    tree = build_draft_tree(R, [C1, C2, C3, C4], [S1, S2], lp, node_budget=32)
    # 6 planted + 7 rows x 5 candidates (no duplicates: candidates are ids < 5), all kept: 41 > 32 -> trimmed
    assert tree.num_nodes == 32
    small = build_draft_tree(R, [C1], [], lp[:2], node_budget=32)
    assert small.num_nodes == 1 + 2 * v  # theta = -inf: every candidate joins


def test_minus_inf_entries_are_never_proposed():
    lp = torch.full((2, 6), -math.inf)
    lp[0, 2], lp[1, 3] = 0.0, 0.0
    tree = build_draft_tree(R, [C1], [], lp, node_budget=32)
    assert tree.tokens == (R, C1, 2, 3)


def test_budget_smaller_than_chain():
    lp = torch.zeros(7, 40).log_softmax(-1)
    assert build_tree(R, [C1, C2, C3, C4], [S1, S2], lp, node_budget=2) == ([R, C1, C2], [-1, 0, 1])
    # y'1 (2A) ties y2 (A + A): the earlier row wins
    assert build_tree(R, [C1, C2, C3, C4], [S1, S2], lp, node_budget=3) == ([R, C1, C2, S1], [-1, 0, 1, 0])
    assert build_tree(R, [C1, C2, C3, C4], [S1, S2], lp, node_budget=0) == ([R], [-1])


def test_ties_in_q_go_to_lower_token_id_and_across_rows_to_earlier_row():
    lp = torch.zeros(2, 20).log_softmax(-1)  # uniform: every candidate of a row ties
    tree = build_draft_tree(R, [C1], [], lp, node_budget=6, topk=8)
    # root's candidates (-ln 20 + A) beat y1's (A - ln 20 + A); lowest ids first
    assert tree.tokens == (R, C1, 0, 1, 2, 3, 4)


def test_topk_boundary_ties_take_lower_ids():
    row = torch.tensor([[0.1, 0.3, 0.3, 0.3, 0.0]]).log_softmax(-1)
    r, t, q = top_candidates(row, 2)
    assert t.tolist() == [1, 2]
    r, t, q = top_candidates(row.numpy(), 2)
    assert t.tolist() == [1, 2]


def test_chainless_first_round_tree():
    """D2: the first tree is the SLM's alone, rooted at the last prompt token."""
    lp = torch.randn(1, 100, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    tree = build_draft_tree(R, [], [], lp)
    assert tree.num_nodes == 32 and set(tree.parents[1:]) == {0}
    assert list(tree.tokens[1:]) == torch.topk(lp[0], 32).indices.tolist()


@pytest.mark.parametrize("bad, match", [
    (lambda: build_tree(R, [C1], [S1, S2], torch.zeros(3, 9)), "D <= K"),
    (lambda: build_tree(R, [C1], [], torch.zeros(2, 9), lam=1.5), "lam"),
    (lambda: build_tree(R, [C1], [], torch.randn(2, 9) + 5.0), "log-probabilities"),
    (lambda: build_tree(R, [C1], [], torch.full((2, 9), float("nan"))), "NaN"),
    (lambda: build_tree(-1, [C1], [], torch.zeros(2, 9)), "root"),
    (lambda: build_draft_tree(R, [], [], torch.zeros(1, 3), keep_ids=np.array([4, 2, 9])), "increasing"),
    (lambda: build_draft_tree(R, [], [], torch.zeros(1, 3), keep_ids=np.array([2, 4])), "increasing"),
])
def test_bad_inputs_raise_typed_errors(bad, match):
    with pytest.raises(TreeBuildError, match=match):
        bad()


# ------------------------------------------------------------ forms and plans


def test_padded_form_repeats_last_row():
    tree = DraftTree.make_dummy([7, 8, 9, 5], [-1, 0, 1, 0], node_budget=5)
    pad = tree.padded()
    assert pad.tokens.tolist() == [7, 8, 9, 5, 5, 5]
    assert pad.parents.tolist() == [-1, 0, 1, 0, 0, 0]
    assert pad.depths.tolist() == [0, 1, 2, 1, 1, 1]
    assert pad.valid.tolist() == [True] * 4 + [False] * 2
    assert pad.ancestor_mask.tolist() == [1, 3, 7, 9, 9, 9]
    m = pad.ancestor_matrix()
    assert m[:4, :4].tolist() == tree.ancestor_mask().tolist()
    assert m[4].tolist() == m[3].tolist() == [True, False, False, True, False, False]
    assert not m[:, 4:].any()
    with pytest.raises(TreeBuildError):
        tree.padded(3)


def test_ancestor_mask_matches_paths():
    lp = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)).log_softmax(-1)
    tree = build_draft_tree(R, [C1, C2, C3, C4], [S1, S2], lp)
    m = tree.ancestor_mask()
    for i in range(len(tree.tokens)):
        assert set(np.nonzero(m[i])[0].tolist()) == set(tree.path(i))
    assert tree.padded().tokens.shape == (33,)


def test_plan_with_catch_up_rows():
    planted = plant_tree(R, [C1, C2], [S1])
    plan = frontier_plan(planted, catch_up=[91, 92])
    assert plan.num_rows == 6
    assert plan.forward_tokens() == [91, 92, R, C1, C2, S1]  # C2 (2A) ties S1 (2A): earlier row first
    assert plan.positions() == [-2, -1, 0, 1, 2, 1]
    assert plan.row_paths() == [[91], [91, 92], [91, 92, R], [91, 92, R, C1], [91, 92, R, C1, C2],
                                [91, 92, R, S1]]
    mask = plan.attend_mask()  # over (91, 92, R, C1, C2, S1)
    assert mask.astype(int).tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    lp = torch.randn(6, 40, generator=torch.Generator().manual_seed(4)).log_softmax(-1)
    with_catch_up = grow_tree(planted, plan, lp)
    without = grow_tree(planted, plan, lp[2:])
    assert with_catch_up == without
    with pytest.raises(TreeBuildError, match="catch-up"):
        grow_tree(planted, plan, lp[1:])


def test_keep_set_candidates_map_to_full_ids():
    keep = np.array([2, 5, 9, 40, 41, 77], dtype=np.int64)
    lp = torch.tensor([[0.1, 0.5, 0.1, 0.1, 0.1, 0.1]]).log()
    tree = build_draft_tree(R, [], [], lp, node_budget=3, topk=2, keep_ids=keep)
    # q = .5 on keep column 1 (full id 5), then ties -> lowest full id 2
    assert tree.tokens == (R, 5, 2)
    assert top_candidates(lp, 3, keep)[1].tolist() == [5, 2, 9]


def test_torch_numpy_and_dtypes_agree():
    lp = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)).log_softmax(-1)
    args = (R, [C1, C2, C3, C4], [S1, S2])
    ref = build_tree(*args, lp)
    assert build_tree(*args, lp.numpy()) == ref
    assert build_tree(*args, lp.double()) == ref


# ------------------------------------------------------------ brute force


def _toy_logq(path: tuple[int, ...], v: int, levels: int) -> list[float]:
    """A deterministic SLM row for a token path; integer logits force ties."""
    g = torch.Generator().manual_seed(hash(path) % (2**31))
    logits = torch.randint(0, levels, (v,), generator=g).float()
    return logits.log_softmax(-1).double().tolist()


def _ref_build(root, chain, rus, row_logq, node_budget, lam, topk, ids=None, slm2=None):
    """Algorithm 3 straight from the paper's text, with python lists and sorted()."""
    a = math.log(lam)
    T = [[root, -1, 0.0]]
    u = [0]
    for y in chain:
        T.append([y, u[-1], T[u[-1]][2] + a])
        u.append(len(T) - 1)
    for k, y2 in enumerate(rus, start=1):
        if y2 != chain[k - 1]:
            T.append([y2, u[k - 1], T[u[k - 1]][2] + 2 * a])

    def path(r):
        out = []
        while r >= 0:
            out.append(T[r][0])
            r = T[r][1]
        return tuple(out[::-1])

    def one_pass(frontier, logq_of):
        F = sorted(frontier, key=lambda r: (-T[r][2], r))
        C = []
        for v in F:
            q = logq_of(v)
            tok = ids if ids is not None else list(range(len(q)))
            best = sorted(range(len(q)), key=lambda c: (-q[c], tok[c]))[:topk]
            kids = {T[i][0] for i in range(len(T)) if T[i][1] == v}
            for c in best:
                if q[c] > -math.inf and tok[c] not in kids:
                    C.append([tok[c], v, (T[v][2] + q[c]) + a])
        ranked = sorted([t[2] for t in T[1:]] + [c[2] for c in C], reverse=True)
        theta = math.inf if node_budget == 0 else (ranked[node_budget - 1] if len(ranked) >= node_budget else -math.inf)
        new = []
        for c in C:
            if c[2] >= theta:
                T.append(c)
                new.append(len(T) - 1)
        return new

    new = one_pass(range(len(T)), lambda r: row_logq[r])
    if slm2 is not None and new:
        one_pass(new, lambda r: slm2(path(r)))
    best = sorted(range(1, len(T)), key=lambda r: (-T[r][2], r))[:node_budget]
    keep = set(best) | {0}
    for r in best:
        while r >= 0:
            keep.add(r)
            r = T[r][1]
    kept = sorted(keep)
    idx = {r: i for i, r in enumerate(kept)}
    return [T[r][0] for r in kept], [-1 if r == 0 else idx[T[r][1]] for r in kept]


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_reference(seed):
    rng = random.Random(seed)
    v = rng.choice([6, 20, 45])
    levels = rng.choice([2, 4, 50])
    k = rng.randint(0, 4)
    d = rng.randint(0, min(k, 2))
    chain = [rng.randrange(v) for _ in range(k)]
    rus = [chain[i] if rng.random() < 0.3 else rng.randrange(v) for i in range(d)]
    root = rng.randrange(v)
    node_budget = rng.choice([0, 1, 3, 8, 12, 32])
    topk = rng.choice([1, 3, 8, 32])
    lam = rng.choice([0.66, 0.5, 1.0])
    use_keep = rng.random() < 0.4
    ids = sorted(rng.sample(range(3 * v), v)) if use_keep else None
    planted = plant_tree(root, chain, rus, lam=lam)
    paths = [tuple(planted.tokens[j] for j in planted.path(r)) for r in range(len(planted.tokens))]
    row_logq = [_toy_logq(p, v, levels) for p in paths]
    two_pass = rng.random() < 0.4
    slm2 = (lambda p: _toy_logq(p, v, levels)) if two_pass else None

    def second(plan):
        return torch.tensor([_toy_logq(tuple(p), v, levels) for p in plan.row_paths()], dtype=torch.float64)

    expect = _ref_build(root, chain, rus, row_logq, node_budget, lam, topk, ids, slm2)
    lp = torch.tensor(row_logq, dtype=torch.float64)
    got = build_draft_tree(root, chain, rus, lp, node_budget=node_budget, lam=lam, topk=topk,
                           keep_ids=None if ids is None else np.array(ids),
                           second_pass=second if two_pass else None)
    assert got.to_wire() == tuple(expect), f"seed={seed} v={v} node_budget={node_budget} topk={topk} lam={lam}"
    assert got.num_nodes <= node_budget
    if not use_keep and not two_pass:
        assert build_tree(root, chain, rus, lp, node_budget=node_budget, lam=lam, topk=topk) == expect


# ------------------------------------------------------------ server contract


@pytest.mark.parametrize("seed", range(5))
def test_output_passes_server_validation(seed):
    v = 500
    g = torch.Generator().manual_seed(seed)
    chain = torch.randint(0, v, (4,), generator=g).tolist()
    rus = torch.randint(0, v, (2,), generator=g).tolist()
    planted = plant_tree(7, chain, rus)
    lp = torch.randn(len(planted.tokens), v, generator=g).mul(2).log_softmax(-1)
    tokens, parents = build_tree(7, chain, rus, lp)
    validate_tree(tokens, parents, vocab_size=v, node_budget=32)
    tree = build_draft_tree(7, chain, rus, lp, node_budget=16)
    validate_tree(*tree.to_wire(), vocab_size=v, node_budget=16, labels=list(tree.sources))
    server = pytest.importorskip("vllm_hyco.spec_decode.tree", reason="the server's TokenTree needs torch")
    assert server.TokenTree.from_wire(tree.wire_dict(), vocab_size=v, node_budget=16).to_wire() == tree.wire_dict()


def test_wire_dict_fits_the_tree_frame():
    lp = torch.randn(7, 64, generator=torch.Generator().manual_seed(9)).log_softmax(-1)
    tree = build_draft_tree(R, [C1, C2, C3, C4], [S1, S2], lp)
    frame = TreeFrame.from_lists(round=3, **tree.wire_dict())
    assert list(frame.tokens) == list(tree.tokens) and list(frame.parents) == list(tree.parents)
    assert list(frame.labels) == list(tree.sources)
