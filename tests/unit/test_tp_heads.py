"""Issue 17 item 3 without an engine: the KV heads each TP rank holds (vLLM's split and replication rule)
and the hand-off's one gather, with the ranks simulated: every piece comes back whole, in head order, each
head from one rank, through exactly one all_gather, and a rank's slice of the per-head int8 scales
quantizes its heads to the bytes one rank would produce for all of them."""

from __future__ import annotations

import pytest
import torch

from vllm_hyco.kernels import quantize_int8
from vllm_hyco.vllm_adapter.worker.tp_heads import HeadShard, gather_heads


def _simulate(pieces_full: list[torch.Tensor], tp: int) -> tuple[list[torch.Tensor], int]:
    """Every rank's local pieces, one all_gather of their packed buffers; rank 0's result and the number of
    collectives it made."""
    shards = [HeadShard(rank=r, size=tp) for r in range(tp)]
    local_heads = [max(1, p.shape[1] // tp) for p in pieces_full]
    per_rank = [[p[:, s.heads(p.shape[1], n)] for p, n in zip(pieces_full, local_heads)] for s in shards]
    buffers: list[torch.Tensor] = []

    def send(buf):  # ranks 1.. : record what each sends (their own results are not looked at)
        buffers.append(buf)
        return torch.stack([buf] * tp)

    for r in range(1, tp):
        gather_heads(per_rank[r], shards[r], [p.shape[1] for p in pieces_full], all_gather=send)
    calls = []

    def rank0(buf):  # vLLM's all_gather: every rank's buffer, in rank order
        calls.append(buf)
        return torch.stack([buf, *buffers])

    out = gather_heads(per_rank[0], shards[0], [p.shape[1] for p in pieces_full], all_gather=rank0)
    return out, len(calls)


@pytest.mark.parametrize("tp, heads", [(2, (2, 2)), (4, (4, 8)), (2, (2, 1)), (4, (2, 1))])
def test_every_head_comes_back_in_order_with_one_gather(tp, heads):
    gen = torch.Generator().manual_seed(tp)
    # both hand-off layers' rows of a step (7 rows), then a round-0 seed (5 positions), odd head dims
    pieces = [torch.randint(-127, 128, (rows, h, dim), generator=gen, dtype=torch.int8)
              for rows, h, dim in ((7, heads[0], 6), (7, heads[1], 10), (5, heads[0], 6), (5, heads[1], 3))]
    out, calls = _simulate(pieces, tp)
    assert calls == 1
    for got, want in zip(out, pieces):
        assert got.dtype == torch.int8 and torch.equal(got, want)


def test_one_rank_gathers_nothing():
    piece = torch.ones(3, 2, 4, dtype=torch.int8)

    def never(buf):
        raise AssertionError("no collective on one rank")

    assert gather_heads([piece], HeadShard(), [2], all_gather=never)[0] is piece


def test_rank_heads_follow_vllm_split_and_replication():
    # tp <= heads: contiguous blocks; tp > heads: head r // (tp / heads), one owner per head
    assert [HeadShard(r, 2).heads(4, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert [HeadShard(r, 4).heads(2, 1) for r in range(4)] == [slice(0, 1), slice(0, 1), slice(1, 2),
                                                               slice(1, 2)]
    assert HeadShard(0, 4).owners(2, 1) == [0, 2] and HeadShard(0, 2).owners(2, 1) == [0, 1]
    with pytest.raises(ValueError):
        HeadShard(0, 2).heads(4, 1)  # 4 heads over 2 ranks hold 2 each


def test_per_rank_quantization_with_the_scale_slice_is_the_one_rank_bytes():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4, 16, generator=gen) * 3  # [rows, 4 KV heads, D] float
    scale = torch.rand(4, 16, generator=gen) * 0.05 + 0.01  # per (head, channel)
    whole = quantize_int8(x, scale, backend="torch")
    for tp in (2, 4):
        shards = [HeadShard(r, tp) for r in range(tp)]
        local = [quantize_int8(x[:, s.heads(4, 4 // tp)], s.scale_slice(scale, 4 // tp), backend="torch")
                 for s in shards]
        assert torch.equal(torch.cat(local, dim=1), whole)
