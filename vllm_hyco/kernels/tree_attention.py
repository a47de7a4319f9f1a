"""Paged tree attention: the Triton launcher, its torch twin, and the dense building block.

Layout (vLLM 0.32's Triton attention backend, ``v1/attention/backends/triton_attn.py``): the per-layer
cache viewed as ``kv_cache.transpose(1, 2).split(head_size, -1)`` gives ``k_cache`` and ``v_cache`` of
logical shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides (last dim contiguous).
Cache index ``i`` of request ``r`` lives at block ``block_table[r, i // block_size]``, offset
``i % block_size``. A model whose V is its K may pass the same tensor twice; Gemma-4's ``k_eq_v`` full
layers are not one (K = rope(k_norm(k_raw)), V = v_norm(k_raw)): pass both caches.

Per request ``r`` with ``n = query_start_loc[r + 1] - query_start_loc[r]`` rows and ``seq_lens[r]`` keys:
the committed prefix is ``[0, t)`` with ``t = seq_lens[r] - n``, and the step's own K/V are already in the
cache at indices ``t .. t + n - 1`` (as vLLM writes them before attention). Each row has a ``depth`` and an
``ancestor_mask`` (int64, bit ``i`` set iff row ``i`` is an ancestor of the row or the row itself; a tree's
masks and depths come from ``vllm_hyco.handoff.tree_contract``, at most ``MAX_TREE_ROWS`` = 64 rows):

* tree row ``j`` (mask != 0): position ``t + depth[j]``; sees the prefix and the rows in its mask;
* causal row ``j`` (mask == 0, ordinary decode/prefill, ``depth[j] = j``): sees cache indices ``<= t + j``.

A key at index ``k`` has position ``k`` in the prefix and ``t + depth[k - t]`` among the step's rows. With a
sliding window ``W``, a key at position ``p`` is visible to a row at position ``P`` iff ``p > P - W``
(vLLM's convention: the row itself plus ``W - 1`` keys before it). An optional logit softcap computes
``cap * tanh(scale * q.k / cap)``.

Worked example: prefix t = 3, tree root -> {a, b}, a -> c (rows 0..3, parents [-1, 0, 0, 1]):
depths [0, 1, 1, 2], masks [0b0001, 0b0011, 0b0101, 0b1011]; row 3 (c, position 5) sees cache indices
0, 1, 2 (prefix), 3 (root), 4 (a) and 6 (itself), but not 5 (b).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm_hyco.handoff import tree_contract
from vllm_hyco.kernels._backend import KernelInputError, next_pow2, upcast_dot


@dataclass
class TreeAttentionMetadata:
    """Per-step metadata of a (mixed) batch; one row per query token, rows of a request contiguous."""

    # [num_reqs + 1] int32, cumulative rows (vLLM's query_start_loc)
    query_start_loc: torch.Tensor
    # [num_reqs] int32, keys in the cache per request including this step's rows (vLLM's seq_lens)
    seq_lens: torch.Tensor
    # [num_reqs, max_blocks_per_req] int32
    block_table: torch.Tensor
    # [num_rows] int64, ancestor bits of tree rows; 0 marks a causal row
    ancestor_mask: torch.Tensor
    # [num_rows] int32, depth of a tree row (its position is t + depth); j for causal row j
    depths: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    def to(self, device: torch.device | str) -> TreeAttentionMetadata:
        moved = {k: getattr(self, k).to(device) for k in
                 ("query_start_loc", "seq_lens", "block_table", "ancestor_mask", "depths")}
        return TreeAttentionMetadata(**moved, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len)

    @staticmethod
    def causal_depths(query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
        """[num_rows] int32: each row's index inside its request (the depth of a causal row). No sync."""
        counts = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)  # [num_reqs]
        starts = query_start_loc[:-1].to(torch.int64).repeat_interleave(counts, output_size=num_rows)
        return (torch.arange(num_rows, device=query_start_loc.device) - starts).to(torch.int32)

    @classmethod
    def from_vllm(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        max_query_len: int,
        max_seq_len: int,
        num_rows: int,
        ancestor_mask: torch.Tensor | None = None,
        depths: torch.Tensor | None = None,
    ) -> TreeAttentionMetadata:
        """Wrap vLLM's per-step metadata (``CommonAttentionMetadata`` fields of one KV-cache group).

        Rows without a tree need mask 0 and depth = row index: pass ``ancestor_mask``/``depths`` with the
        tree rows filled in and the rest from zeros / :meth:`causal_depths`; both default to all-causal.
        """
        dev = query_start_loc.device
        if ancestor_mask is None:
            ancestor_mask = torch.zeros(num_rows, dtype=torch.int64, device=dev)
        if depths is None:
            depths = cls.causal_depths(query_start_loc, num_rows)
        return cls(query_start_loc.to(torch.int32), seq_lens.to(torch.int32), block_table.to(torch.int32),
                   ancestor_mask.to(torch.int64), depths.to(torch.int32), max_query_len, max_seq_len)

    @classmethod
    def make_dummy(
        cls,
        prefix_lens: list[int],
        rows: list[list[int] | int],
        block_size: int,
        num_blocks: int | None = None,
        seed: int = 0,
    ) -> TreeAttentionMetadata:
        """Build metadata from plain lists; blocks are drawn at random (without reuse) from the pool.

        ``rows[r]`` is either a parents list (tree request; ``parents[0] == -1``, parents[j] < j) or an int
        ``n`` (causal request of n rows). ``num_blocks`` defaults to exactly the blocks needed.

        >>> m = TreeAttentionMetadata.make_dummy([3, 5], [[-1, 0, 0, 1], 2], block_size=4)
        >>> m.ancestor_mask.tolist(), m.depths.tolist(), m.seq_lens.tolist()
        ([1, 3, 5, 11, 0, 0], [0, 1, 1, 2, 0, 1], [7, 7])
        """
        masks, row_depths, counts = [], [], []
        for spec in rows:
            if isinstance(spec, int):
                masks += [0] * spec
                row_depths += list(range(spec))
                counts.append(spec)
            else:  # the contract's int64 masks and depths (TreeValidationError on a bad tree)
                masks += tree_contract.ancestor_mask(spec).tolist()
                row_depths += tree_contract.depths(spec).tolist()
                counts.append(len(spec))
        seq = [t + n for t, n in zip(prefix_lens, counts)]
        per_req = [-(-s // block_size) for s in seq]
        total = num_blocks if num_blocks is not None else sum(per_req)
        if total < sum(per_req):
            raise KernelInputError(f"num_blocks={total} < {sum(per_req)} blocks needed")
        pool = list(range(total))
        random.Random(seed).shuffle(pool)
        width = max(per_req + [1])
        table = torch.zeros(len(seq), width, dtype=torch.int32)
        for r, nb in enumerate(per_req):
            table[r, :nb] = torch.tensor(pool[:nb], dtype=torch.int32)
            pool = pool[nb:]
        qsl = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
        return cls(
            query_start_loc=qsl,
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            block_table=table,
            ancestor_mask=torch.tensor(masks, dtype=torch.int64),
            depths=torch.tensor(row_depths, dtype=torch.int32),
            max_query_len=max(counts + [0]),
            max_seq_len=max(seq + [0]),
        )


def visibility_mask(
    n_rows: int,
    prefix_len: int,
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """[n_rows, prefix_len + n_rows] bool: which keys each row of one request sees (rules above)."""
    dev = ancestor_mask.device
    mask = ancestor_mask.to(torch.int64).view(-1, 1)  # [n, 1]
    i = torch.arange(n_rows, device=dev)
    bits = ((mask >> i.clamp(max=63).view(1, -1)) & 1) != 0  # [n, n]
    causal = i.view(1, -1) <= i.view(-1, 1)
    step = torch.where(mask == 0, causal, bits)
    vis = torch.cat([torch.ones(n_rows, prefix_len, dtype=torch.bool, device=dev), step], dim=1)
    if sliding_window:
        row_pos = prefix_len + depths.to(torch.int64)  # [n]
        key_pos = torch.cat([torch.arange(prefix_len, device=dev), row_pos])  # [t + n]
        vis &= key_pos.view(1, -1) > row_pos.view(-1, 1) - sliding_window
    return vis


def tree_attention_dense_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    ancestor_mask: torch.Tensor,
    depths: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    key_offset: int = 0,
) -> torch.Tensor:
    """Tree attention of ONE request over gathered contiguous K/V (fp32 math, output in ``q.dtype``).

    Shape: q [n, num_q_heads, D]; k, v [prefix_len - key_offset + n, num_kv_heads, D] (k may be v), the
    keys of cache indices ``[key_offset, prefix_len + n)``; masks/depths [n]. With a sliding window, pass
    ``key_offset = first_visible_key(prefix_len, depths, window)`` and gather only those keys. This is what
    the CPU engine calls on K/V it gathers from its own cache layout.

    >>> q = torch.randn(2, 2, 16); kv = torch.randn(5, 1, 16)
    >>> tree_attention_dense_ref(q, kv, kv, 3, torch.tensor([1, 3]), torch.tensor([0, 1]), 0.25).shape
    torch.Size([2, 2, 16])
    """
    n, hq, _ = q.shape
    hkv = k.shape[1]
    if k.shape[0] != prefix_len - key_offset + n or hq % hkv:
        raise KernelInputError(f"k has {k.shape[0]} rows for keys [{key_offset}, {prefix_len} + {n}); "
                               f"heads {hq}/{hkv}")
    if key_offset > first_visible_key(prefix_len, depths, sliding_window):
        raise KernelInputError(f"key_offset {key_offset} drops keys a row can see")
    vis = visibility_mask(n, prefix_len, ancestor_mask, depths, sliding_window)[:, key_offset:]  # [n, keys]
    qf = q.float().transpose(0, 1)  # [hq, n, D]
    kf = k.float().transpose(0, 1)  # [hkv, t + n, D]
    vf = v.float().transpose(0, 1)
    if not softcap:  # fused fp32 SDPA; every row sees at least itself, so no row is all -inf
        o = torch.nn.functional.scaled_dot_product_attention(  # 4-D inputs take the fused CPU kernel
            qf[None], kf[None], vf[None], attn_mask=vis, scale=scale, enable_gqa=hq != hkv)  # [1, hq, n, D]
        return o[0].transpose(0, 1).to(q.dtype)
    kf, vf = kf.repeat_interleave(hq // hkv, dim=0), vf.repeat_interleave(hq // hkv, dim=0)  # [hq, t + n, D]
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [hq, n, t + n]
    s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1), vf)  # [hq, n, D]
    return o.transpose(0, 1).to(q.dtype)


def tree_attention_padded(
    q: torch.Tensor,
    k_prefix: torch.Tensor,
    v_prefix: torch.Tensor,
    k_tree: torch.Tensor,
    v_tree: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Tree attention of MANY requests padded to one batch (fp32 math, output in ``q.dtype``): the CPU
    engine's path for a step's trees, one call per layer instead of one per tree and layer.

    Shape: q [T, R, num_q_heads, D]; the prefix keys k/v_prefix [T, L, num_kv_heads, D] and the tree rows'
    own k/v_tree [T, R, num_kv_heads, D] (kept apart: concatenating them copied more than the attention
    computed); bias [T, R, L + R] float, 0 where a row sees a key and -inf elsewhere, every row seeing at
    least one key (``vllm_adapter.worker.tree_plan.PaddedTrees`` builds it from :func:`visibility_mask`). Per
    tree it computes what :func:`tree_attention_dense_ref` computes.

    >>> q = torch.randn(2, 3, 2, 16); kp = torch.randn(2, 5, 1, 16); kt = torch.randn(2, 3, 1, 16)
    >>> tree_attention_padded(q, kp, kp, kt, kt, torch.zeros(2, 3, 8), 0.25).shape
    torch.Size([2, 3, 2, 16])
    """
    T, R, hq, d = q.shape
    L, hkv = k_prefix.shape[1], k_prefix.shape[2]
    if (k_prefix.shape != v_prefix.shape or k_tree.shape != v_tree.shape or k_tree.shape[:2] != (T, R)
            or k_prefix.shape[0] != T or bias.shape != (T, R, L + R) or hq % hkv):
        raise KernelInputError(f"q {tuple(q.shape)}, k_prefix {tuple(k_prefix.shape)}, k_tree {tuple(k_tree.shape)}, "
                               f"bias {tuple(bias.shape)}: shapes disagree")
    g = hq // hkv
    # query heads grouped under their KV head: [T, hkv, g * R, D]
    qg = q.float().reshape(T, R, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(T, hkv, g * R, d)
    kp, kt = k_prefix.float().permute(0, 2, 3, 1), k_tree.float().permute(0, 2, 3, 1)  # [T, hkv, D, keys]
    s = torch.cat([torch.matmul(qg, kp), torch.matmul(qg, kt)], -1) * scale  # [T, hkv, g * R, L + R]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.view(T, hkv, g, R, L + R) + bias[:, None, None]
    p = torch.softmax(s, dim=-1).view(T, hkv, g * R, L + R)
    o = torch.matmul(p[..., :L], v_prefix.float().transpose(1, 2)) + torch.matmul(p[..., L:],
                                                                                 v_tree.float().transpose(1, 2))
    return o.view(T, hkv, g, R, d).permute(0, 3, 1, 2, 4).reshape(T, R, hq, d).to(q.dtype)


def first_visible_key(prefix_len: int, depths: torch.Tensor, sliding_window: int | None) -> int:
    """The lowest cache index any row of the request can see (0 without a window)."""
    if not sliding_window or depths.numel() == 0:
        return 0
    return max(0, min(prefix_len, prefix_len + int(depths.min()) - sliding_window + 1))


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, start: int = 0
) -> torch.Tensor:
    """[seq_len - start, num_kv_heads, D]: cache indices [start, seq_len) of one request, contiguous."""
    bs = cache.shape[1]
    idx = torch.arange(start, seq_len, device=cache.device)
    blocks = block_table_row.to(torch.int64)[idx // bs]
    return cache[blocks, idx % bs]


def _check_inputs(q, k_cache, v_cache, meta: TreeAttentionMetadata) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise KernelInputError(
            f"expected q [rows, heads, D] and caches [blocks, block_size, kv_heads, D]; got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise KernelInputError(f"head_dim / GQA mismatch: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if meta.ancestor_mask.shape[0] != q.shape[0] or meta.depths.shape[0] != q.shape[0]:
        raise KernelInputError("ancestor_mask and depths need one entry per query row")


def tree_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of :func:`tree_attention_triton`: gather each request's K/V, then the dense reference.

    Shape: q, out [num_rows, num_q_heads, D]; caches [num_blocks, block_size, num_kv_heads, D].
    """
    _check_inputs(q, k_cache, v_cache, meta)
    out = torch.empty_like(q) if out is None else out
    qsl = meta.query_start_loc.tolist()
    seq = meta.seq_lens.tolist()
    for r in range(meta.num_reqs):
        a, b = qsl[r], qsl[r + 1]
        if b == a:
            continue
        t, depths = seq[r] - (b - a), meta.depths[a:b]
        first = first_visible_key(t, depths, sliding_window)
        k = gather_request_kv(k_cache, meta.block_table[r], seq[r], first)
        same = _same_storage(k_cache, v_cache)
        v = k if same else gather_request_kv(v_cache, meta.block_table[r], seq[r], first)
        out[a:b] = tree_attention_dense_ref(
            q[a:b], k, v, t, meta.ancestor_mask[a:b], depths, scale, sliding_window, softcap, first
        )
    return out


# (BLOCK_M, TILE_N, num_warps) by (16-bit or fp32 operands, padded head_dim): the largest tiles that
# compile for sm_90 without register spills (Triton 3.9 AOT, benchmarks/gpu/aot_compile_check.py).
_TILES = {
    (False, 128): (64, 64, 4), (False, 256): (64, 16, 8), (False, 512): (32, 32, 8),
    (True, 128): (32, 32, 4), (True, 256): (32, 16, 8), (True, 512): (16, 16, 4),
}


def _launch_config(head_dim_p: int, qpk_p: int, max_query_len: int, fp32_dot: bool) -> tuple[int, int, int]:
    """(BLOCK_Q, TILE_N, num_warps). BLOCK_M = BLOCK_Q * QPK_P rows per program, at least 16 (tl.dot).

    A 33-row bf16 tree with 2 query heads per KV head fills 64 rows: 2 programs per KV head at D = 256.
    """
    block_m, tile_n, warps = _TILES[(fp32_dot, max(128, min(head_dim_p, 512)))]
    block_q = max(1, block_m // qpk_p)
    block_q = min(block_q, next_pow2(max(max_query_len, 1)))
    block_q = max(block_q, -(-16 // qpk_p))
    return block_q, tile_n, warps


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """k_eq_v: the V cache is the K cache (same object, or the same view of the same memory)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape)


def _num_splits(meta: TreeAttentionMetadata, programs: int, tile_n: int, device: torch.device) -> int:
    """Key-range splits so that about two waves of programs cover the GPU (1 on CPU / small contexts)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    by_occupancy = -(-2 * sms // max(programs, 1))
    by_length = max(1, meta.max_seq_len // (tile_n * 8))  # at least ~8 key tiles per split
    return max(1, min(by_occupancy, by_length, 32))


def tree_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton launcher (same signature and result as :func:`tree_attention_ref`).

    ``num_splits`` (launcher only) splits each request's key range across programs and merges the partial
    results (flash-decoding); ``None`` picks it from the GPU's SM count, 1 on CPU.
    """
    from vllm_hyco.kernels._triton.tree_attention import tree_attention_kernel, tree_attention_reduce_kernel

    _check_inputs(q, k_cache, v_cache, meta)
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise KernelInputError("the head_dim axis of q and of the caches must be contiguous")
    out = torch.empty_like(q) if out is None else out
    num_rows, num_q_heads = q.shape[0], q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    qpk = num_q_heads // num_kv_heads
    qpk_p, head_dim_p = next_pow2(qpk), max(16, next_pow2(head_dim))
    upcast = upcast_dot(q.dtype)
    fp32_dot = q.dtype == torch.float32 or upcast
    block_q, tile_n, num_warps = _launch_config(head_dim_p, qpk_p, meta.max_query_len, fp32_dot)
    q_blocks = max(1, -(-meta.max_query_len // block_q))
    programs = meta.num_reqs * num_kv_heads * q_blocks
    splits = num_splits or _num_splits(meta, programs, tile_n, q.device)
    part = lse = out  # placeholders: unused when splits == 1
    if splits > 1:
        part = torch.empty(num_rows, num_q_heads, splits, head_dim_p, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_rows, num_q_heads, splits, dtype=torch.float32, device=q.device)
    dot_prec = "ieee" if fp32_dot else "tf32"
    tree_attention_kernel[(q_blocks, num_kv_heads * splits, meta.num_reqs)](
        out, part, lse, q, k_cache, v_cache,
        meta.block_table, meta.query_start_loc, meta.seq_lens, meta.ancestor_mask, meta.depths,
        float(scale), float(softcap or 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        meta.block_table.stride(0), splits,
        NUM_Q_HEADS=num_q_heads, SPLIT=splits > 1,
        QPK=qpk, QPK_P=qpk_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_q * qpk_p, TILE_N=tile_n,
        WINDOW=int(sliding_window or 0), USE_SOFTCAP=bool(softcap), K_EQ_V=_same_storage(k_cache, v_cache),
        UPCAST=upcast, DOT_PREC=dot_prec, num_warps=num_warps, num_stages=2,
    )
    if splits > 1 and num_rows:
        tree_attention_reduce_kernel[(num_rows, num_q_heads)](
            out, part, lse, out.stride(0), out.stride(1), splits,
            NUM_Q_HEADS=num_q_heads, SPLITS_P=next_pow2(splits),
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        )
    return out
