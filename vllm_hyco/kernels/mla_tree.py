"""Tree rows over an MLA latent cache (DeepSeek-V3's weight-absorbed attention), Triton with its torch twin.

DeepSeek's MLA keeps one row per token and layer: the compressed latent c (``kv_lora_rank`` values, 512 in
DeepSeek-V3) followed by the rotated rope key k_pe (64): ``[num_blocks, block_size, 576]`` (vLLM 0.32's
``MLAAttentionSpec``; spike-35 read it from a running CPU engine). In the absorbed form every query head is a
576-wide row ``[q_nope @ W_UK ; q_pe]`` that takes that one cache row as its key and the latent c, the
row's first ``kv_lora_rank`` values, as its value (``W_UV`` maps the output to ``v_head_dim`` afterwards,
outside attention). That is grouped-query attention with one KV head of head dim 576 whose values are the
keys' leading ``kv_lora_rank`` dims, so the tree rows here are the package's paged tree-rows attention
(``kernels/tree_rows.py``: prefix + ancestors + the row itself, the tree's rows already written at the
sequential slots t .. t + n - 1) run on the latent cache as K and as V, its first ``kv_lora_rank`` output
columns kept. ``backend="torch"`` is the twin (the same signature); ``"triton"`` needs a GPU or
``TRITON_INTERPRET=1``; ``"auto"`` picks Triton on CUDA tensors.

Not measured anywhere: the cost. The value read is 576 wide where 512 would do, and the Triton tiles pad the
head dim to 1,024 (GPU-unverified; no engine calls this yet: a DeepSeek family is not served, docs/engine.md).

    >>> import torch
    >>> cache = torch.randn(3, 16, 576)                     # [blocks, block_size, kv_lora_rank + rope]
    >>> out = mla_tree_rows_attention(torch.randn(3, 4, 576), cache, torch.tensor([[2, 0]]), [17], [3],
    ...                               torch.tensor([1, 3, 5]), torch.tensor([0, 1, 1]), scale=0.07,
    ...                               backend="torch")
    >>> out.shape
    torch.Size([3, 4, 512])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_hyco.kernels._backend import KernelInputError
from vllm_hyco.kernels.tree_rows import paged_tree_rows_attention

KV_LORA_RANK = 512  # DeepSeek-V3's compressed latent (the only one vLLM 0.32's CPU MLA kernel takes)
ROPE_DIM = 64


def latent_view(latent_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, 1, kv_lora_rank + rope]``: the latent cache as one KV head (no copy)."""
    if latent_cache.dim() != 3:
        raise KernelInputError(f"expected an MLA latent cache [blocks, block_size, kv_lora_rank + rope], got "
                               f"{tuple(latent_cache.shape)}")
    return latent_cache.unsqueeze(2)


def mla_tree_rows_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: Sequence[int],
    row_counts: Sequence[int],
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    scale: float,
    kv_lora_rank: int = KV_LORA_RANK,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Latent attention output ``[R, num_heads, kv_lora_rank]`` of the tree rows of ``T`` trees.

    ``q`` ``[R, num_heads, kv_lora_rank + rope]`` (absorbed queries, trees concatenated), ``latent_cache``
    ``[num_blocks, block_size, kv_lora_rank + rope]``, ``block_tables`` ``[T, max_blocks]``, ``context_lens``
    / ``row_counts`` host ints per tree, ``ancestor_mask`` ``[R]`` int64 and ``depths`` ``[R]`` (the tree
    contract's), ``scale`` the MLA softmax scale."""
    if q.dim() != 3 or q.shape[-1] != latent_cache.shape[-1] or not 0 < kv_lora_rank < q.shape[-1]:
        raise KernelInputError(f"q {tuple(q.shape)} and the latent cache {tuple(latent_cache.shape)} need the same "
                               f"row width, kv_lora_rank {kv_lora_rank} inside it")
    kv = latent_view(latent_cache)
    out = paged_tree_rows_attention(q, kv, kv, block_tables, context_lens, row_counts, ancestor_mask, depths,
                                    scale, backend=backend)
    return out[..., :kv_lora_rank]
