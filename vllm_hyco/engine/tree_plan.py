"""Per-step tree plan shared by the runner mixin and the CPU attention override (vLLM-free, torch only).

For every HyCo request scheduled with a tree this step, the runner builds one :class:`TreeRows`: where
its rows sit in the flattened batch, the committed context length ``t`` (the root's position), each
row's depth and its ancestor mask. The attention override reads it to mask tree rows; the runner reads
the K/V rows the override captured to compact the accepted path and to build the hand-off.

Masks and depths come from ``vllm_hyco.kernels.tree_attention.ancestor_masks_from_parents`` (int64 bit
masks, the form the kernels and their torch twin take); ``anc`` is the same mask as a bool matrix.

Example (a root with two children, the second having one child)::

    >>> depths_from_parents([-1, 0, 0, 2])
    [0, 1, 1, 2]
    >>> ancestor_mask([-1, 0, 0, 2]).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def depths_from_parents(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool; ``mask[i, j]`` is True iff row j is row i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if i > 0:
            mask[i] |= mask[parents[i]]
    return mask


@dataclass
class CapturedKV:
    """The K/V rows one layer wrote for one tree request this step, and the slots it wrote them to."""

    # [n, num_kv_heads, head_size]
    key: torch.Tensor
    # [n, num_kv_heads, head_size]
    value: torch.Tensor
    # [n] sequential slots of positions t .. t+n-1 (where the rows were written)
    slots: torch.Tensor
    layer: object  # the vLLM attention layer (scales, isa)
    kv_cache: torch.Tensor  # the layer's paged cache


@dataclass
class TreeRows:
    """One tree request in one step."""

    req_id: str
    batch_idx: int
    q_start: int  # first row of this request in the flattened batch
    num_rows: int  # rows scheduled (root + nodes; may be cut short by the token budget)
    context_len: int  # t: committed positions [0, t) are in the cache; the root sits at t
    round: int
    tokens: list[int]  # [num_rows] root first
    parents: list[int]  # [num_rows]
    eps: float | None
    depths: torch.Tensor  # [num_rows] int64
    anc: torch.Tensor  # [num_rows, num_rows] bool
    masks: torch.Tensor  # [num_rows] int64 ancestor bitmask (bit j: row j is an ancestor or the row)
    captured: dict[str, CapturedKV] = field(default_factory=dict)
    # layer name -> [max_blocks] block-table row of this request in that layer's KV group
    block_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    host_s: float = 0.0  # host time spent on this tree outside the model (plan, decision, compaction, hand-off)

    @classmethod
    def build(cls, *, req_id: str, batch_idx: int, q_start: int, num_rows: int, context_len: int,
              round: int, tokens: list[int], parents: list[int], eps: float | None) -> TreeRows:
        from vllm_hyco.kernels.tree_attention import ancestor_masks_from_parents

        tokens, parents = list(tokens[:num_rows]), list(parents[:num_rows])
        masks, depths = ancestor_masks_from_parents(parents)
        return cls(req_id=req_id, batch_idx=batch_idx, q_start=q_start, num_rows=num_rows,
                   context_len=context_len, round=round, tokens=tokens, parents=parents, eps=eps,
                   depths=torch.tensor(depths, dtype=torch.int64), anc=ancestor_mask(parents),
                   masks=torch.tensor(masks, dtype=torch.int64))

    @property
    def positions(self) -> torch.Tensor:
        """[num_rows] int64: t + depth."""
        return self.context_len + self.depths
