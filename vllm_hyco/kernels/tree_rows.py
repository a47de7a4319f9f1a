"""Tree rows over a paged block-major cache: the engine-agnostic half of the GPU tree-attention backend.

The GPU engine (``vllm_hyco/vllm_adapter/worker/gpu_attention.py``) runs vLLM's stock Triton attention for every row of
a step, then recomputes the rows of each tree request here. This module takes only tensors and host ints,
no vLLM object, so the device machine (torch + Triton, no vLLM) can test exactly what the engine calls:

* ``q`` ``[R, num_q_heads, D]``: the tree rows of ``T`` trees, concatenated tree after tree;
* ``k_cache``, ``v_cache`` ``[num_blocks, block_size, num_kv_heads, D]``: one layer's cache as vLLM's
  Triton backend views it (:func:`block_major_views`); any strides with a contiguous last dim;
* ``block_tables`` ``[T, max_blocks]``: each tree request's block-table row in that layer's KV group;
* ``context_lens`` (t, host ints): committed positions ``[0, t)`` are in the cache; the tree's own K/V
  are already written at cache indices ``t .. t + n - 1`` (vLLM's sequential slots, as its writer stores
  them before attention), so nothing is gathered: the kernel reads the pages through the block table;
* ``ancestor_mask`` ``[R]`` int64 (nonzero for every tree row) and ``depths`` ``[R]``: the tree plan.

The output is tree attention with the semantics of ``kernels/tree_attention.py``: prefix + ancestors +
the row itself, the sliding window measured from each row's own position ``t + depth``, optional logit
softcap, GQA by head groups. ``backend="auto"`` runs the Triton kernel on CUDA tensors and the torch twin
otherwise; ``"triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (as for every op of the package).

Example (one tree of 3 rows over a 2-block cache)::

    >>> import torch
    >>> kv = torch.randn(2, 1, 4, 2 * 8)                       # vLLM's [blocks, kv_heads, bs, 2 * D]
    >>> k, v = block_major_views(kv, 8)                         # [2, 4, 1, 8] each
    >>> from vllm_hyco.handoff.tree_contract import ancestor_mask, depths
    >>> masks, dep = ancestor_mask([-1, 0, 0]), depths([-1, 0, 0])    # the tree contract's int64 arrays
    >>> out = tree_rows_attention(torch.randn(3, 2, 8), k, v, torch.tensor([1, 0]), 4,
    ...                           torch.from_numpy(masks), torch.from_numpy(dep), scale=0.35)
    >>> out.shape
    torch.Size([3, 2, 8])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hyco.kernels import tree_attention
from vllm_hyco.kernels._backend import KernelInputError
from vllm_hyco.kernels.tree_attention import TreeAttentionMetadata


def block_major_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_blocks, block_size, num_kv_heads, head_size]`` views of vLLM's logical
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` cache (``transpose(1, 2).split``, no copy)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise KernelInputError(f"expected a [blocks, kv_heads, block_size, 2 * {head_size}] cache, "
                               f"got {tuple(kv_cache.shape)}")
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


def tree_rows_metadata(
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    row_counts: Sequence[int],
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
) -> TreeAttentionMetadata:
    """Kernel metadata of ``T`` tree requests (host ints in, no device sync).

    ``query_start_loc`` ``[T + 1]`` / ``seq_lens`` ``[T]`` (int32, on the device) may be passed prebuilt,
    as the engine does once per step, to spare two host-to-device copies per layer; they must equal the
    cumulative ``row_counts`` and ``context_lens + row_counts``.
    """
    if len(context_lens) != len(row_counts) or block_tables.shape[0] != len(row_counts):
        raise KernelInputError(f"{block_tables.shape[0]} block-table rows, {len(context_lens)} context lengths "
                               f"and {len(row_counts)} row counts: one each per tree")
    num_rows = sum(row_counts)
    if ancestor_mask.shape[0] != num_rows or depths.shape[0] != num_rows:
        raise KernelInputError(f"ancestor_mask/depths need {num_rows} rows, got "
                               f"{ancestor_mask.shape[0]}/{depths.shape[0]}")
    dev = ancestor_mask.device
    seq = [int(t) + int(n) for t, n in zip(context_lens, row_counts)]
    qsl = [0]
    for n in row_counts:
        qsl.append(qsl[-1] + int(n))
    if query_start_loc is None:
        query_start_loc = torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True)
    if seq_lens is None:
        seq_lens = torch.tensor(seq, dtype=torch.int32).to(dev, non_blocking=True)
    return TreeAttentionMetadata(
        query_start_loc=query_start_loc.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        block_table=block_tables.to(device=dev, dtype=torch.int32),
        ancestor_mask=ancestor_mask.to(torch.int64),
        depths=depths.to(torch.int32),
        max_query_len=max(list(row_counts) + [0]),
        max_seq_len=max(seq + [0]),
    )


def paged_tree_rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    row_counts: Sequence[int],
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    query_start_loc: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention output ``[R, num_q_heads, D]`` of the tree rows of ``T`` trees in one launch (see above).

    ``query_start_loc``/``seq_lens``: optional prebuilt device copies (see :func:`tree_rows_metadata`).

    A row with mask 0 would be taken as causal; tree rows always carry at least their own bit, so a zero
    there is a caller's bug and is refused (checked on CPU tensors only: on CUDA it would cost a sync).
    """
    if not ancestor_mask.is_cuda and bool((ancestor_mask == 0).any()):
        raise KernelInputError("every tree row needs a nonzero ancestor mask (its own bit at least)")
    meta = tree_rows_metadata(block_tables, context_lens, row_counts, ancestor_mask, depths, query_start_loc,
                              seq_lens)
    return tree_attention(q, k_cache, v_cache, meta, scale, sliding_window or None, softcap or None, out,
                          backend=backend)


def tree_rows_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    context_len: int,
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One tree: ``q`` ``[n, num_q_heads, D]``, ``block_table_row`` ``[max_blocks]``, ``context_len`` t."""
    return paged_tree_rows_attention(q, k_cache, v_cache, block_table_row.view(1, -1), [int(context_len)],
                                     [q.shape[0]], ancestor_mask, depths, scale, sliding_window, softcap, out,
                                     backend=backend)
