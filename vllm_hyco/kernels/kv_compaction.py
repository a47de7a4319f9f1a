"""KV compaction: after a verdict, move the accepted rows' K/V to contiguous slots in every layer at once.

A round writes the tree's rows at cache indices ``t .. t + n - 1``; the accepted path is the rows
``0 = r_0 < r_1 < ... < r_m`` and must end up at ``t, t + 1, ..., t + m``. Per layer cache (logical shape
``[num_blocks, block_size, *row]`` with ``row`` = ``[heads, width]`` or ``[width]``, last dim contiguous,
any other strides; e.g. vLLM's ``kv_cache.transpose(1, 2)`` view, which moves K and V together) each move
copies the whole slot row ``src -> dst``. Slots are flat: ``slot = block * block_size + offset``, taken in
the layer's KV-cache group (Gemma-4's sliding and full layers have separate block tables and block sizes,
so ``src_slots``/``dst_slots`` carry one row per group and ``layer_groups[l]`` picks the row of layer l).

Ordering rule: the kernel applies each request's moves in list order (requests in parallel); the twin
reads every source first and then writes. They agree whenever no move reads a slot that an earlier move
of the same request wrote, and requests touch disjoint slots. Compaction satisfies it: move i writes
``t + i`` and every later move k > i reads ``t + r_k >= t + k > t + i``. Moves with ``src == dst`` or a
negative slot (padding) are skipped. :func:`check_compaction_moves` tests the rule on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vllm_hyco.kernels._backend import KernelInputError, next_pow2


def _slot(block_table_row: list[int], index: int, block_size: int) -> int:
    return block_table_row[index // block_size] * block_size + index % block_size


def compaction_moves(
    block_table: torch.Tensor,
    block_size: int,
    prefix_lens: Sequence[int],
    accepted_rows: Sequence[Sequence[int]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of one KV group: ``(src [M] int64, dst [M] int64, move_start_loc [R + 1] int32)``.

    ``accepted_rows[r]`` lists request r's kept tree rows in tree order, root first; row ``r_i`` moves
    from cache index ``t + r_i`` to ``t + i``.

    >>> bt = torch.tensor([[2, 0]], dtype=torch.int32)
    >>> [x.tolist() for x in compaction_moves(bt, 4, [2], [[0, 2, 5]])]
    [[10, 0, 3], [10, 11, 0], [0, 3]]
    """
    src, dst, loc = [], [], [0]
    rows = block_table.tolist()
    for r, (t, acc) in enumerate(zip(prefix_lens, accepted_rows)):
        if any(b <= a for a, b in zip(acc, acc[1:])):
            raise KernelInputError(f"accepted rows of request {r} must increase: {list(acc)}")
        for i, row in enumerate(acc):
            src.append(_slot(rows[r], t + row, block_size))
            dst.append(_slot(rows[r], t + i, block_size))
        loc.append(len(src))
    as64 = lambda v: torch.tensor(v, dtype=torch.int64, device=block_table.device)  # noqa: E731
    return as64(src), as64(dst), torch.tensor(loc, dtype=torch.int32, device=block_table.device)



def check_compaction_moves(src: torch.Tensor, dst: torch.Tensor, move_start_loc: torch.Tensor | None) -> None:
    """Raise :class:`KernelInputError` if the moves break the ordering rule of this module (host sync)."""
    src2, dst2 = src.view(-1, src.shape[-1]).tolist(), dst.view(-1, dst.shape[-1]).tolist()
    loc = [0, len(src2[0])] if move_start_loc is None else move_start_loc.tolist()
    for g, (s_row, d_row) in enumerate(zip(src2, dst2)):
        seen_all: set[int] = set()
        for r in range(len(loc) - 1):
            written: set[int] = set()
            touched: set[int] = set()
            for s, d in zip(s_row[loc[r]:loc[r + 1]], d_row[loc[r]:loc[r + 1]]):
                if s < 0 or d < 0 or s == d:
                    continue
                if s in written or d in written:
                    raise KernelInputError(f"group {g}, request {r}: slot {s}->{d} reads or rewrites a "
                                           "slot an earlier move wrote")
                written.add(d)
                touched |= {s, d}
            if touched & seen_all:
                raise KernelInputError(f"group {g}: request {r} touches slots of another request")
            seen_all |= touched


def _row_geometry(cache: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(stride_blk, stride_off, stride_h, heads, width) in elements, for [blocks, bs, heads?, width]."""
    if cache.dim() == 3:
        cache = cache.unsqueeze(2)
    if cache.dim() != 4 or cache.stride(3) != 1:
        raise KernelInputError(f"a cache must be [blocks, block_size, (heads,) width] with a contiguous "
                               f"last dim; got shape {tuple(cache.shape)} strides {cache.stride()}")
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.shape[2], cache.shape[3]


def _normalize(src, dst, move_start_loc, layer_groups, num_layers):
    src2 = src.view(1, -1) if src.dim() == 1 else src
    dst2 = dst.view(1, -1) if dst.dim() == 1 else dst
    if src2.shape != dst2.shape:
        raise KernelInputError(f"src_slots {tuple(src.shape)} and dst_slots {tuple(dst.shape)} differ")
    groups = list(layer_groups) if layer_groups is not None else [0] * num_layers
    if len(groups) != num_layers or any(not 0 <= g < src2.shape[0] for g in groups):
        raise KernelInputError(f"layer_groups {groups} must name a row of src_slots per layer")
    if move_start_loc is None:
        move_start_loc = torch.tensor([0, src2.shape[1]], dtype=torch.int32, device=src.device)
    return src2, dst2, move_start_loc, groups


def compact_kv_ref(
    caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    move_start_loc: torch.Tensor | None = None,
    layer_groups: Sequence[int] | None = None,
) -> None:
    """Torch twin of :func:`compact_kv_triton`, in place: per layer, gather every source, then scatter.

    Shape: caches[l] [num_blocks, block_size, *row]; src/dst [num_groups, num_moves] or [num_moves].
    """
    src2, dst2, _, groups = _normalize(src_slots, dst_slots, move_start_loc, layer_groups, len(caches))
    for cache, g in zip(caches, groups):
        bs = cache.shape[1]
        s, d = src2[g].to(torch.int64), dst2[g].to(torch.int64)
        keep = (s >= 0) & (d >= 0) & (s != d)
        s, d = s[keep].to(cache.device), d[keep].to(cache.device)
        rows = cache[s // bs, s % bs]  # [moves, *row] (a copy)
        cache[d // bs, d % bs] = rows


def compact_kv_triton(
    caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    move_start_loc: torch.Tensor | None = None,
    layer_groups: Sequence[int] | None = None,
) -> None:
    """One launch for every layer: a table of base addresses, strides and row widths (in move units)."""
    from vllm_hyco.kernels._triton.kv_compaction import compact_kv_kernel

    src2, dst2, loc, groups = _normalize(src_slots, dst_slots, move_start_loc, layer_groups, len(caches))
    if not caches or src2.shape[1] == 0:
        return
    geoms = [_row_geometry(c) for c in caches]
    sizes = [c.element_size() for c in caches]
    # the widest unit (<= 8 bytes) that divides every address, stride and width
    g = 8
    for c, geom, es in zip(caches, geoms, sizes):
        for v in (c.data_ptr(), *[x * es for x in geom[:3]], geom[4] * es):
            g = math.gcd(g, int(v)) if v else g
    unit = next(u for u in (8, 4, 2, 1) if g % u == 0)
    rows = []
    for c, (sb, so, sh, heads, width), es, grp in zip(caches, geoms, sizes, groups):
        u = lambda elems, es=es: elems * es // unit  # noqa: E731  (unit divides every byte count)
        rows.append([c.data_ptr(), u(sb), u(so), u(sh), heads, u(width), c.shape[1], grp])
    table = torch.tensor(rows, dtype=torch.int64, device=src2.device)
    max_w = max(r[5] for r in rows)
    block = min(1024, next_pow2(max_w))
    chunks = -(-max_w // block)
    num_reqs = loc.shape[0] - 1
    grid = (len(caches), num_reqs, max(r[4] for r in rows) * chunks)
    compact_kv_kernel[grid](
        table, src2.to(torch.int64).contiguous(), dst2.to(torch.int64).contiguous(), loc.to(torch.int32),
        src2.shape[1], UNIT_BYTES=unit, CHUNKS=chunks, BLOCK=block,
    )
