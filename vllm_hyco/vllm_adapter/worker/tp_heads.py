"""Tensor parallelism: which KV heads a rank holds, and the hand-off's one gather of every head per step.

Matches vLLM 0.32 (``QKVParallelLinear``: with ``H`` KV heads and TP size ``tp``, rank ``r`` holds heads
``[r * H / tp, (r + 1) * H / tp)`` when ``tp <= H``; when ``tp > H`` each head is replicated on
``tp / H`` consecutive ranks and rank ``r`` holds head ``r // (tp / H)``). Every rank runs the same tree
step on its own heads (tree attention, decision, compaction: ``tree_step``); only the hand-off needs all
of them, on rank 0, whose ``ModelRunnerOutput`` is the one vLLM hands to the scheduler.

:func:`gather_heads` takes the rank's int8 hand-off pieces of the step (K/V rows of both hand-off layers
for every tree, and every round-0 seed), each ``[rows, local_heads, D]``, packs them into one flat
buffer and gathers it with **one** ``all_gather`` over the TP group (``get_tp_group()``), then puts each
piece back together as ``[rows, H, D]`` in head order, taking each head from one rank only. The int8
scales are per (head, channel), so each rank quantizes its heads with its slice of the scales
(:meth:`HeadShard.scale_slice`) and the result is the bytes a one-rank server would quantize.

Example (two ranks, one piece of 3 rows, 2 heads of dim 4; the all_gather is simulated)::

    >>> import torch
    >>> full = torch.arange(24, dtype=torch.int8).view(3, 2, 4)
    >>> shards = [HeadShard(rank=r, size=2) for r in (0, 1)]
    >>> local = [full[:, s.heads(2, 1)] for s in shards]  # what each rank holds
    >>> flat = torch.stack([x.flatten() for x in local])
    >>> out = gather_heads([local[0]], shards[0], [2], all_gather=lambda buf: flat.view(torch.float32))
    >>> torch.equal(out[0], full)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShard:
    """This worker's place in the TP group: ``rank`` in ``[0, size)``."""

    rank: int = 0
    size: int = 1

    def _replicas(self, total: int, local: int) -> int:
        if self.size <= total:
            if local * self.size != total:
                raise ValueError(f"{total} KV heads over {self.size} ranks cannot hold {local} per rank")
            return 1
        if local != 1 or self.size % total:
            raise ValueError(f"{total} KV heads over {self.size} ranks: vLLM replicates one head per rank")
        return self.size // total

    def heads(self, total: int, local: int) -> slice:
        """The heads (of ``total``) this rank holds, ``local`` of them."""
        first = (self.rank // self._replicas(total, local)) * local
        return slice(first, first + local)

    def owners(self, total: int, local: int) -> list[int]:
        """The ranks whose heads, in rank order, give every head once (one rank per replicated head)."""
        return list(range(0, self.size, self._replicas(total, local)))

    def scale_slice(self, scale: torch.Tensor, local: int) -> torch.Tensor:
        """``scale`` [total_heads, D] -> this rank's rows [local, D] (identity on one rank)."""
        return scale if self.size == 1 else scale[self.heads(scale.shape[0], local)]


def shard_of(runner) -> HeadShard:
    """The runner's TP rank and size (vLLM's TP group; one rank when TP is off)."""
    size = int(runner.vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return HeadShard()
    from vllm.distributed import get_tensor_model_parallel_rank

    return HeadShard(rank=int(get_tensor_model_parallel_rank()), size=size)


def _all_gather(buf: torch.Tensor) -> torch.Tensor:
    """[n] float32 on each rank -> [tp, n] (vLLM's TP group all_gather; concat along dim 0)."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    return group.all_gather(buf.unsqueeze(0), dim=0)


def gather_heads(pieces: Sequence[torch.Tensor], shard: HeadShard, totals: Sequence[int],
                 all_gather: Callable[[torch.Tensor], torch.Tensor] = _all_gather) -> list[torch.Tensor]:
    """Every KV head of each int8 piece [rows, local, D] (``totals[i]``: the piece's heads in the model),
    with one collective for all of them. One rank: the pieces as they are, nothing gathered."""
    if shard.size == 1 or not pieces:
        return list(pieces)
    sizes = [p.numel() for p in pieces]
    flat = torch.cat([p.reshape(-1) for p in pieces])
    pad = -flat.numel() % 4  # sent as float32 words: the CPU shared-memory all_gather copies float tensors
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    got = all_gather(flat.view(torch.float32)).reshape(shard.size, -1).contiguous().view(torch.int8)
    out, at = [], 0
    for p, n, total in zip(pieces, sizes, totals):
        rows, local, dim = p.shape
        per_rank = got[:, at: at + n].reshape(shard.size, rows, local, dim)
        out.append(torch.cat([per_rank[r] for r in shard.owners(total, local)], dim=1))
        at += n
    return out
