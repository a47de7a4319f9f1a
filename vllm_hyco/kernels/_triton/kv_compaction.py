"""@triton.jit body of KV compaction (launcher and ordering rule: ``kernels/kv_compaction.py``).

One program = one layer x one request x one (head, chunk) of the slot row. It applies the request's moves
in list order, each move as a load then a store of the same elements by the same threads, so a later move
never reads what an earlier move wrote only if the caller's precondition holds (see the launcher).
Layers are reached through a table of base addresses, so every layer moves in the same launch.
"""

import triton
import triton.language as tl


@triton.jit
def compact_kv_kernel(
    table_ptr,  # [num_layers, 8] int64: address, stride_blk, stride_off, stride_h, heads, width, bs, group
    src_ptr,  # [num_groups, num_moves] int64 slots (negative: skip)
    dst_ptr,  # [num_groups, num_moves] int64 slots
    move_start_ptr,  # [num_reqs + 1] int32
    stride_group,
    UNIT_BYTES: tl.constexpr,  # element type the rows are moved as (8, 4, 2 or 1 bytes)
    CHUNKS: tl.constexpr,  # chunks of BLOCK units per head row (the widest layer's)
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0)
    req = tl.program_id(1)
    head = tl.program_id(2) // CHUNKS
    chunk = tl.program_id(2) % CHUNKS
    row = table_ptr + layer * 8
    heads = tl.load(row + 4)
    width = tl.load(row + 5)
    if (head >= heads) | (chunk * BLOCK >= width):
        return
    address = tl.load(row + 0)
    if UNIT_BYTES == 8:
        base = address.to(tl.pointer_type(tl.int64))
    elif UNIT_BYTES == 4:
        base = address.to(tl.pointer_type(tl.int32))
    elif UNIT_BYTES == 2:
        base = address.to(tl.pointer_type(tl.int16))
    else:
        base = address.to(tl.pointer_type(tl.int8))
    stride_blk = tl.load(row + 1)
    stride_off = tl.load(row + 2)
    stride_h = tl.load(row + 3)
    block_size = tl.load(row + 6)
    group = tl.load(row + 7)

    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < width
    head_off = head.to(tl.int64) * stride_h + offs
    first = tl.load(move_start_ptr + req)
    last = tl.load(move_start_ptr + req + 1)
    for mv in range(first, last):
        src = tl.load(src_ptr + group * stride_group + mv)
        dst = tl.load(dst_ptr + group * stride_group + mv)
        if (src >= 0) & (dst >= 0) & (src != dst):
            s_ptr = base + (src // block_size) * stride_blk + (src % block_size) * stride_off + head_off
            d_ptr = base + (dst // block_size) * stride_blk + (dst % block_size) * stride_off + head_off
            tl.store(d_ptr, tl.load(s_ptr, mask=ok), mask=ok)
