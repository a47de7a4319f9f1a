"""Triton kernels and their torch twins (the twin is the CPU path and the test oracle).

Each public op below takes ``backend="auto" | "triton" | "torch"``: ``auto`` runs the Triton kernel on CUDA
tensors when Triton is installed and the torch twin otherwise; ``triton`` forces the kernel (on CPU tensors
only under ``TRITON_INTERPRET=1``). Layouts, tolerances and what is GPU-unverified: docs/kernels.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hyco.kernels._backend import HAS_TRITON, KernelInputError, interpreting, use_triton
from vllm_hyco.kernels.handoff_gather import (
    HandoffRowsInt8,
    dequantize_int8,
    gather_quantize_kv_ref,
    gather_quantize_kv_triton,
    handoff_gather_quantize,
    quantize_int8_ref,
    quantize_int8_triton,
)
from vllm_hyco.kernels.kv_compaction import compact_kv_ref, compact_kv_triton, compaction_moves
from vllm_hyco.kernels.tree_attention import (
    TreeAttentionMetadata,
    tree_attention_dense_ref,
    tree_attention_ref,
    tree_attention_triton,
)

__all__ = [
    "HAS_TRITON", "KernelInputError", "interpreting", "use_triton",
    "TreeAttentionMetadata",
    "tree_attention", "tree_attention_ref", "tree_attention_dense_ref", "tree_attention_triton",
    "compact_kv", "compact_kv_ref", "compact_kv_triton", "compaction_moves",
    "gather_quantize_kv", "gather_quantize_kv_ref", "quantize_int8", "quantize_int8_ref",
    "dequantize_int8", "handoff_gather_quantize", "HandoffRowsInt8",
]


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Paged tree attention (see ``kernels/tree_attention.py``). q, out: [num_rows, num_q_heads, D]."""
    impl = tree_attention_triton if use_triton(backend, q) else tree_attention_ref
    return impl(q, k_cache, v_cache, meta, scale, sliding_window, softcap, out)


def compact_kv(
    caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    move_start_loc: torch.Tensor | None = None,
    layer_groups: Sequence[int] | None = None,
    *,
    backend: str = "auto",
) -> None:
    """Copy the accepted rows' K/V to their new slots in every layer (see ``kernels/kv_compaction.py``)."""
    impl = compact_kv_triton if use_triton(backend, src_slots) else compact_kv_ref
    impl(caches, src_slots, dst_slots, move_start_loc, layer_groups)


def gather_quantize_kv(
    cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """int8 [num_pos, num_kv_heads, D] rows of one layer's cache at ``slots`` (see handoff_gather.py)."""
    impl = gather_quantize_kv_triton if use_triton(backend, cache) else gather_quantize_kv_ref
    return impl(cache, slots, scale)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Symmetric int8 with fixed per-channel scales over the last dim (see handoff_gather.py)."""
    impl = quantize_int8_triton if use_triton(backend, x) else quantize_int8_ref
    return impl(x, scale)
