"""The CPU engine's padded tree attention (``tree_plan.PaddedTrees`` + ``kernels.tree_attention_padded``):
a step's trees in one gather and one attention give, row for row, what the per-tree path gives
(``tree_attention_dense_ref`` over each tree's own gathered prefix), with sliding windows, GQA, softcap
and a KV-shared layer's tree K/V read back from the cache."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_hyco.kernels.tree_attention import tree_attention_dense_ref, tree_attention_padded
from vllm_hyco.vllm_adapter.worker.tree_plan import PaddedTrees, TreeRows

BLOCK = 16
HQ, HKV, D = 4, 2, 8


def _random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(0, i) for i in range(1, n)]


def _step(rng: random.Random, sizes, contexts):
    """Trees laid out in one flattened batch, each request with its own shuffled blocks."""
    trees, q_start, tables = [], 0, []
    free = list(range(1, 64))
    rng.shuffle(free)
    for b, (n, t) in enumerate(zip(sizes, contexts)):
        nblocks = (t + n) // BLOCK + 1
        tables.append([free.pop() for _ in range(nblocks)] + [0] * (8 - nblocks))
        trees.append(TreeRows.build(req_id=str(b), batch_idx=b, q_start=q_start + 2, num_rows=n, context_len=t,
                                    round=0, tokens=list(range(n)), parents=_random_parents(n, rng), eps=None))
        q_start += n + 2  # two ordinary rows between trees
    return trees, torch.tensor(tables), q_start


def _slots(table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table_row[positions // BLOCK] * BLOCK + positions % BLOCK


@pytest.mark.parametrize("window,softcap,shared", [(None, None, False), (20, None, False), (None, 30.0, False),
                                                   (24, None, True)])
def test_padded_matches_the_per_tree_path(window, softcap, shared):
    rng = random.Random(7)
    torch.manual_seed(7)
    trees, table, rows = _step(rng, sizes=[5, 1, 17, 9], contexts=[30, 3, 70, 0])
    cache_k = torch.randn(64 * BLOCK, HKV, D)
    cache_v = torch.randn(64 * BLOCK, HKV, D)
    query = torch.randn(rows, HQ * D)
    key, value = torch.randn(rows, HKV * D), torch.randn(rows, HKV * D)
    if shared:  # the target layer wrote the tree rows at their sequential slots
        for tr in trees:
            s = _slots(table[tr.batch_idx], tr.context_len + torch.arange(tr.num_rows))
            r = slice(tr.q_start, tr.q_start + tr.num_rows)
            cache_k[s], cache_v[s] = key[r].view(-1, HKV, D), value[r].view(-1, HKV, D)
    pt = PaddedTrees.build(trees, window)
    prefix_slots, tree_slots = pt.slots(table, BLOCK)
    T, R = pt.rows.shape
    L = prefix_slots.shape[1]
    q = query.view(-1, HQ, D)[pt.rows]
    k_pre = cache_k[prefix_slots.reshape(-1)].view(T, L, HKV, D)
    v_pre = cache_v[prefix_slots.reshape(-1)].view(T, L, HKV, D)
    if shared:
        k_tree = cache_k[tree_slots.reshape(-1)].view(T, R, HKV, D)
        v_tree = cache_v[tree_slots.reshape(-1)].view(T, R, HKV, D)
    else:
        k_tree, v_tree = key.view(-1, HKV, D)[pt.rows], value.view(-1, HKV, D)[pt.rows]
    out = torch.zeros(rows, HQ * D)
    res = tree_attention_padded(q, k_pre, v_pre, k_tree, v_tree, pt.bias, 0.3, softcap=softcap)
    out[pt.rows[pt.valid]] = res[pt.valid].reshape(-1, HQ * D)
    for tr in trees:  # the per-tree path of the override (loop), row for row
        t = tr.context_len
        lo = 0 if not window else max(0, t - window + 1)
        pre = _slots(table[tr.batch_idx], torch.arange(lo, t))
        r = slice(tr.q_start, tr.q_start + tr.num_rows)
        k = torch.cat([cache_k[pre], key[r].view(-1, HKV, D)])
        v = torch.cat([cache_v[pre], value[r].view(-1, HKV, D)])
        ref = tree_attention_dense_ref(query[r].view(-1, HQ, D), k, v, t - lo, tr.masks, tr.depths, 0.3,
                                       sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out[r].view(-1, HQ, D), ref, atol=1e-5, rtol=1e-5)
    ordinary = torch.ones(rows, dtype=torch.bool)
    ordinary[pt.rows[pt.valid]] = False
    assert not out[ordinary].any()  # rows of other requests untouched


def test_padded_layout_masks_padding_and_every_row_sees_a_key():
    rng = random.Random(1)
    trees, table, _ = _step(rng, sizes=[3, 1], contexts=[5, 2])
    pt = PaddedTrees.build(trees, None)
    assert pt.vis.any(-1).all()  # no all-masked row (padded rows see themselves)
    L = pt.slots(table, BLOCK)[0].shape[1]
    assert not pt.vis[1, :, 2:L].any()  # the short tree's padded prefix keys are invisible
    assert pt.valid.sum().item() == 4 and pt.valid[1].tolist() == [True, False, False]


def test_padded_attention_rejects_disagreeing_shapes():
    from vllm_hyco.errors import KernelInputError

    with pytest.raises(KernelInputError, match="shapes disagree"):
        tree_attention_padded(torch.zeros(1, 2, 4, 8), torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8),
                              torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 4), 1.0)


def test_chains_are_left_to_the_stock_attention(monkeypatch):
    """``masked_trees`` drops the chains (causal mask, sequential positions) unless
    ``VLLM_HYCO_CHAIN_ATTN=tree``; ``active_trees`` keeps every tree (decision, compaction, hand-off)."""
    from vllm_hyco.vllm_adapter.worker import tree_plan

    def tree(req_id, parents):
        n = len(parents)
        return TreeRows.build(req_id=req_id, batch_idx=0, q_start=0, num_rows=n, context_len=7, round=0,
                              tokens=list(range(n)), parents=parents, eps=None)

    trees = [tree("chain", [-1, 0, 1, 2]), tree("root", [-1]), tree("fork", [-1, 0, 0]),
             tree("cut", [-1, 0, 1, 1])]
    assert [tree_plan.recomputed(t.parents) for t in trees] == [False, False, True, True]
    try:
        tree_plan.set_active_trees(trees)
        assert [t.req_id for t in tree_plan.masked_trees()] == ["fork", "cut"]
        assert tree_plan.active_step().row_counts == [3, 4]
        assert len(tree_plan.active_trees()) == 4
        tree_plan.set_active_trees(trees[:2])
        assert tree_plan.masked_trees() is None and tree_plan.active_step() is None
        monkeypatch.setenv("VLLM_HYCO_CHAIN_ATTN", "tree")
        tree_plan.set_active_trees(trees[:2])
        assert len(tree_plan.masked_trees()) == 2
    finally:
        tree_plan.set_active_trees(None)
