"""The CPU attention override's tree rows, batched (``cpu_attention._tree_rows``) and per tree
(``_tree_rows_loop``), against the per-tree torch twin (``kernels.tree_attention_dense_ref`` over the K/V gathered slot by slot): same outputs, for sliding and
full layers, KV-shared layers, trees of different sizes and contexts in one step, with and without softcap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_hyco.handoff import tree_contract  # noqa: E402
from vllm_hyco.kernels.tree_attention import tree_attention_dense_ref  # noqa: E402
from vllm_hyco.vllm_adapter import cpu_attention  # noqa: E402
from vllm_hyco.vllm_adapter.kv_view import CpuAttnKVView, slots_for_positions  # noqa: E402
from vllm_hyco.vllm_adapter.tree_plan import TreeRows  # noqa: E402

HQ, HKV, D, BS, NB = 4, 2, 16, 16, 40


def _reference(impl, query, key, value, kv_cache, table, out, trees, view):
    """The override's former per-tree loop."""
    for tr in trees:
        rows = slice(tr.q_start, tr.q_start + tr.num_rows)
        t = tr.context_len
        lo = 0 if impl.sliding_window <= 0 else max(0, t - impl.sliding_window + 1)
        shared = key is None
        hi = t + tr.num_rows if shared else t
        slots = slots_for_positions(table[tr.batch_idx], torch.arange(lo, hi), BS)
        k_pre, v_pre = view.gather(kv_cache, slots)
        q = query[rows].view(tr.num_rows, HQ, D)
        if shared:
            k_pre, k_tree, v_pre, v_tree = k_pre[: t - lo], k_pre[t - lo:], v_pre[: t - lo], v_pre[t - lo:]
        else:
            k_tree = key[rows].view(tr.num_rows, HKV, D)
            v_tree = value[rows].view(tr.num_rows, HKV, D)
        res = tree_attention_dense_ref(q, torch.cat([k_pre, k_tree]), torch.cat([v_pre, v_tree]), t - lo,
                                       tr.masks, tr.depths, impl.scale,
                                       sliding_window=impl.sliding_window if impl.sliding_window > 0 else None,
                                       softcap=float(impl.logits_soft_cap or 0.0) or None)
        out[rows] = res.reshape(out[rows].shape)


def _step(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, [-1, 0, 0, 1, 1, 2]), (5, [-1, 0]), (70, [-1, 0, 1, 2, 0, 4, 4, 1, 0])]
    trees, q_start, rows = [], 3, []  # 3 plain rows first (another request)
    perm = torch.randperm(NB - 1, generator=g) + 1
    table = torch.zeros(len(shapes), 8, dtype=torch.int32)
    for b, (t, parents) in enumerate(shapes):
        table[b] = perm[b * 8:(b + 1) * 8].to(torch.int32)
        n = len(parents)
        trees.append(TreeRows.build(req_id=f"r{b}", batch_idx=b, q_start=q_start, num_rows=n, context_len=t,
                                    round=1, tokens=list(range(n)), parents=parents, eps=None))
        q_start += n
    tokens = q_start
    return trees, table, tokens, g


@pytest.mark.parametrize("window", [0, 8, 40])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_batched_tree_rows_match_the_per_tree_twin(window, shared, softcap):
    trees, table, tokens, g = _step(window + 3 * shared)
    kv_cache = torch.randn(NB, HKV, BS, 2 * D, generator=g)
    view = CpuAttnKVView("vec")
    query = torch.randn(tokens, HQ * D, generator=g)
    key = None if shared else torch.randn(tokens, HKV * D, generator=g)
    value = None if shared else torch.randn(tokens, HKV * D, generator=g)
    impl = SimpleNamespace(num_heads=HQ, num_kv_heads=HKV, head_size=D, sliding_window=window, scale=0.25,
                           logits_soft_cap=softcap)
    meta = SimpleNamespace(block_table=table)
    base = torch.randn(tokens, HQ * D, generator=g)
    want = base.clone()
    _reference(impl, query, key, value, kv_cache, table, want, trees, view)
    for fn in (cpu_attention._tree_rows, cpu_attention._tree_rows_loop):
        got = base.clone()
        fn(impl, query, key, value, kv_cache, meta, got, trees, view)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:3], base[:3])  # the plain request's rows are untouched


def test_tree_contract_masks_are_what_the_batch_uses():
    parents = [-1, 0, 0, 1]
    anc = tree_contract.ancestor_matrix(parents)
    assert anc[3].tolist() == [True, True, False, True]
