"""The MLA tree kernel (``kernels.mla_tree``) on DeepSeek-V3's latent cache layout, on CPU tensors.

A paged ``[blocks, 16, 576]`` latent cache (random rows, blocks drawn out of order, contexts across block
boundaries), trees whose rows sit at the sequential slots after each context (where vLLM's writer puts them):

* ``backend="triton"`` (compiled on a GPU, ``TRITON_INTERPRET=1`` on CPU; skipped without either) against
  ``backend="torch"``, its twin;
* the twin against a dense reference written from MLA's definition: per row, softmax over the visible
  positions (the context, the row's ancestors, itself) of ``scale * q . row``, times the rows' latents.

The twin against vLLM's own CPU MLA decode kernel on a chain is ``tests/unit/test_mla_tree_vllm.py`` (this
file imports no vLLM: the device machine runs it).
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_support import needs_triton, random_tree
from tolerances import tol

from vllm_hyco.handoff import tree_contract
from vllm_hyco.kernels.mla_tree import KV_LORA_RANK, mla_tree_rows_attention

pytestmark = pytest.mark.kernels
WIDTH, BLOCK, HEADS, SCALE = 576, 16, 4, 576 ** -0.5 * 0.7


def paged(context_lens, trees, seed=0, spare=3):
    """(latent cache, block tables, q, masks, depths, dense rows per tree)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(t + len(p)) // BLOCK) for t, p in zip(context_lens, trees)]
    pool = list(range(sum(need) + spare))
    random.Random(seed).shuffle(pool)
    cache = torch.randn(len(pool), BLOCK, WIDTH, generator=gen)
    tables = torch.zeros(len(trees), max(need), dtype=torch.int32)
    dense = []
    for r, nb in enumerate(need):
        tables[r, :nb] = torch.tensor(pool[:nb], dtype=torch.int32)
        pool = pool[nb:]
        n = context_lens[r] + len(trees[r])
        rows = cache[tables[r, :nb].long()].reshape(-1, WIDTH)[:n]  # positions 0 .. t + n - 1
        dense.append(rows)
    masks = torch.cat([torch.from_numpy(tree_contract.ancestor_mask(p)) for p in trees])
    deps = torch.cat([torch.from_numpy(tree_contract.depths(p)) for p in trees])
    q = torch.randn(sum(len(p) for p in trees), HEADS, WIDTH, generator=gen)
    return cache, tables, q, masks, deps, dense


def dense_reference(q, context_lens, trees, dense):
    out, at = [], 0
    for t, parents, rows in zip(context_lens, trees, dense):
        anc = tree_contract.ancestor_mask(parents)
        for i in range(len(parents)):
            visible = list(range(t)) + [t + j for j in range(len(parents)) if (int(anc[i]) >> j) & 1]
            keys = rows[visible]  # [V, 576]
            p = torch.softmax(SCALE * q[at + i] @ keys.T, dim=-1)  # [H, V]
            out.append(p @ keys[:, :KV_LORA_RANK])
        at += len(parents)
    return torch.stack(out)


CASES = [([37], [[-1, 0, 1, 2]]), ([5, 40], [random_tree(9, 1), random_tree(17, 2)]),
         ([16, 0], [[-1], random_tree(6, 3)])]


@pytest.mark.parametrize("context_lens,trees", CASES)
def test_the_twin_is_mla_tree_attention(context_lens, trees):
    cache, tables, q, masks, deps, dense = paged(context_lens, trees)
    got = mla_tree_rows_attention(q, cache, tables, context_lens, [len(p) for p in trees], masks, deps, SCALE,
                                  backend="torch")
    torch.testing.assert_close(got, dense_reference(q, context_lens, trees, dense), **tol("attention", torch.float32))


@needs_triton
@pytest.mark.parametrize("context_lens,trees", CASES)
def test_triton_matches_its_twin(context_lens, trees):
    cache, tables, q, masks, deps, _ = paged(context_lens, trees, seed=4)
    args = (q, cache, tables, context_lens, [len(p) for p in trees], masks, deps, SCALE)
    torch.testing.assert_close(mla_tree_rows_attention(*args, backend="triton"),
                               mla_tree_rows_attention(*args, backend="torch"), **tol("attention", torch.float32))
