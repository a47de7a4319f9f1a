"""The MLA tree kernel's twin (``kernels.mla_tree``) against vLLM 0.32's own CPU MLA decode kernel
(``torch.ops._C.mla_decode_kvcache``, what ``CPUMLAImpl.forward_mqa`` calls) on a chain-shaped tree: row i of
the chain is a decode step with ``t + i + 1`` visible positions. The Triton kernel matches the twin in the
kernels tier (``tests/kernels/test_kernels_mla_tree.py``)."""

from __future__ import annotations

import pytest
import torch

from vllm_hyco.handoff import tree_contract
from vllm_hyco.kernels.mla_tree import KV_LORA_RANK, mla_tree_rows_attention


def test_a_chain_is_vllm_mla_decode_row_by_row():
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "mla_decode_kvcache"):
        pytest.skip("this vLLM build has no CPU MLA decode kernel")
    gen = torch.Generator().manual_seed(0)
    heads, t, n, scale = 4, 37, 5, 192 ** -0.5
    cache = torch.randn(6, 16, 576, generator=gen)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)  # 64 slots for 42 positions, out of order
    parents = [-1, 0, 1, 2, 3]
    q = torch.randn(n, heads, 576, generator=gen)
    got = mla_tree_rows_attention(q, cache, table, [t], [n], torch.from_numpy(tree_contract.ancestor_mask(parents)),
                                  torch.from_numpy(tree_contract.depths(parents)), scale, backend="torch")
    for i in range(n):
        out = torch.zeros(1, heads, KV_LORA_RANK)
        ops.mla_decode_kvcache_cpu(out, q[i:i + 1].contiguous(), cache, scale, table,
                                   torch.tensor([t + i + 1], dtype=torch.int32))
        torch.testing.assert_close(got[i], out[0], atol=1e-4, rtol=1e-4)
