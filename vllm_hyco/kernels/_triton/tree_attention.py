"""@triton.jit body of paged tree attention (launcher and layout notes: ``kernels/tree_attention.py``).

One program = one block of BLOCK_Q query rows x one KV head x one split of the key range x one request.
The BLOCK_Q rows and the QPK_P query heads that share the KV head are packed into BLOCK_M = BLOCK_Q * QPK_P
rows of one tile, so K/V tiles are read once per KV head (GQA); the query block is the fastest grid axis, so
programs that read the same K/V tiles run side by side (L2 reuse). Keys are walked by cache index in tiles
of TILE_N; a key's position is its index in the committed prefix and ``t + depth`` for the step's rows.
With num_splits > 1 each split writes a normalized partial output and its log-sum-exp, and
``tree_attention_reduce_kernel`` merges them (flash-decoding), so batch-1 long contexts fill the GPU.
Written against the API common to Triton 3.6 and 3.9.
"""

import triton
import triton.language as tl


@triton.jit
def _softcap(s, cap):
    # cap * tanh(s / cap), tanh through exp(-2|x|) so large |x| cannot overflow
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -th, th)


@triton.jit
def _key_range(seq_len, prefix, q_block, split, num_splits, row_ok, row_pos, row_mask,
               BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr, SPLIT: tl.constexpr):
    """[lo, hi): the cache indices this program walks (window lower bound, causal upper bound, split)."""
    hi = tl.minimum(seq_len, prefix + (q_block + 1) * BLOCK_Q)  # rows see indices <= their own
    lo = hi * 0  # a tensor, not a constexpr 0, so both returns have one type whatever the branches
    if WINDOW > 0:
        min_pos = tl.min(tl.where(row_ok, row_pos, seq_len), axis=0)
        lo = tl.maximum(min_pos - WINDOW + 1, 0)
        any_tree = tl.max(tl.where(row_ok, row_mask, 0), axis=0) != 0
        lo = tl.where(any_tree, tl.minimum(lo, prefix), lo)  # tree keys: index != position
        lo = (lo // TILE_N) * TILE_N
    if SPLIT:
        per_split = tl.cdiv(tl.cdiv(hi - lo, TILE_N), num_splits)
        hi = tl.minimum(hi, lo + (split + 1) * per_split * TILE_N)
        lo = lo + split * per_split * TILE_N
    return lo, hi


@triton.jit
def _visible(kidx, k_ok, prefix, req_depth_ptr, row, row_ok, row_mask, row_pos, WINDOW: tl.constexpr):
    """[BLOCK_M, TILE_N] bool: prefix keys, then the step's keys by ancestor bit (or causally), windowed."""
    in_step = kidx >= prefix
    step_i = kidx - prefix  # [TILE_N] row index of a key written this step
    key_depth = tl.load(req_depth_ptr + step_i, mask=k_ok & in_step, other=0)
    key_pos = tl.where(in_step, prefix + key_depth, kidx)
    bit = tl.minimum(tl.maximum(step_i, 0), 63).to(tl.int64)
    tree_vis = ((row_mask[:, None] >> bit[None, :]) & 1) != 0
    causal_vis = step_i[None, :] <= row[:, None]
    step_vis = tl.where(row_mask[:, None] == 0, causal_vis, tree_vis)
    vis = k_ok[None, :] & row_ok[:, None] & ((~in_step)[None, :] | step_vis)
    if WINDOW > 0:
        vis = vis & (key_pos[None, :] > row_pos[:, None] - WINDOW)
    return vis


@triton.jit
def tree_attention_kernel(
    out_ptr,  # [num_rows, num_q_heads, head_dim]
    part_ptr,  # [num_rows, num_q_heads, num_splits, HEAD_DIM_P] fp32 (SPLIT only)
    lse_ptr,  # [num_rows, num_q_heads, num_splits] fp32 (SPLIT only)
    q_ptr,  # [num_rows, num_q_heads, head_dim]
    k_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (unused when K_EQ_V)
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    mask_ptr,  # [num_rows] int64 ancestor bits (0: causal row)
    depth_ptr,  # [num_rows] int32
    scale,
    softcap,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    num_splits,  # key-range splits per (request, KV head, query block); runtime, so no recompiles
    NUM_Q_HEADS: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for tree_attention_reduce_kernel
    QPK: tl.constexpr,  # query heads per KV head
    QPK_P: tl.constexpr,  # QPK rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # paged-cache block size
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # BLOCK_Q * QPK_P
    TILE_N: tl.constexpr,
    WINDOW: tl.constexpr,  # sliding window (0: none)
    USE_SOFTCAP: tl.constexpr,
    K_EQ_V: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (interpreter bf16, docs/vllm-notes.md P11)
    DOT_PREC: tl.constexpr,  # "ieee" for fp32 operands, so fp32 stays exact (no tf32)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    req = tl.program_id(2)

    q_start = tl.load(query_start_ptr + req)
    n_rows = tl.load(query_start_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= n_rows:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - n_rows  # t: rows of this step sit at cache indices t .. t + n - 1

    m = tl.arange(0, BLOCK_M)
    row = q_block * BLOCK_Q + m // QPK_P  # [BLOCK_M] row index inside the request
    head = kv_head * QPK + m % QPK_P
    row_ok = (row < n_rows) & (m % QPK_P < QPK)
    d = tl.arange(0, HEAD_DIM_P)
    d_ok = d < HEAD_DIM

    row_mask = tl.load(mask_ptr + q_start + row, mask=row_ok, other=0)  # [BLOCK_M] int64
    row_depth = tl.load(depth_ptr + q_start + row, mask=row_ok, other=0)
    row_pos = prefix + row_depth

    q = tl.load(
        q_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_P]
    if UPCAST:
        q = q.to(tl.float32)

    lo, hi = _key_range(seq_len, prefix, q_block, split, num_splits, row_ok, row_pos, row_mask,
                        BLOCK_Q, TILE_N, WINDOW, SPLIT)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)

    for start in range(lo, hi, TILE_N):
        kidx = start + tl.arange(0, TILE_N)  # [TILE_N] cache index
        k_ok = kidx < hi
        blk = tl.load(block_table_ptr + req * stride_bt + kidx // BLOCK_SIZE, mask=k_ok, other=0)
        slot_off = (kidx % BLOCK_SIZE).to(tl.int64)
        blk = blk.to(tl.int64)
        kt = tl.load(
            k_ptr + blk[None, :] * stride_kb + slot_off[None, :] * stride_ks + kv_head * stride_kh
            + d[:, None],
            mask=k_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_DIM_P, TILE_N]
        if K_EQ_V:
            v = tl.trans(kt)
        else:
            v = tl.load(
                v_ptr + blk[:, None] * stride_vb + slot_off[:, None] * stride_vs + kv_head * stride_vh
                + d[None, :],
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )  # [TILE_N, HEAD_DIM_P]
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)

        vis = _visible(kidx, k_ok, prefix, depth_ptr + q_start, row, row_ok, row_mask, row_pos, WINDOW)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * scale  # [BLOCK_M, TILE_N]
        if USE_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(vis, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    store_ok = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        tl.store(
            out_ptr + (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=store_ok,
        )
    else:
        slot = ((q_start + row) * NUM_Q_HEADS + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_ptr + slot[:, None].to(tl.int64) * HEAD_DIM_P + d[None, :], o, mask=store_ok)
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(lse_ptr + slot, lse, mask=row_ok)


@triton.jit
def tree_attention_reduce_kernel(
    out_ptr,  # [num_rows, num_q_heads, head_dim]
    part_ptr,  # [num_rows, num_q_heads, num_splits, HEAD_DIM_P] fp32
    lse_ptr,  # [num_rows, num_q_heads, num_splits] fp32
    stride_ot, stride_oh,
    num_splits,
    NUM_Q_HEADS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    base = (row * NUM_Q_HEADS + head) * num_splits
    lse = tl.load(lse_ptr + base + s, mask=s < num_splits, other=float("-inf"))  # [SPLITS_P]
    m = tl.max(lse, axis=0)
    w = tl.exp(lse - m)
    w = w / tl.sum(w, axis=0)
    parts = tl.load(part_ptr + (base + s)[:, None].to(tl.int64) * HEAD_DIM_P + d[None, :],
                    mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)  # [SPLITS_P, D_P]
    o = tl.sum(parts * w[:, None], axis=0)
    o = o.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o, mask=d < HEAD_DIM)
