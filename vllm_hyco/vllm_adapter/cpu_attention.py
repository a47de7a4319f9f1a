"""CPU_ATTN override: the stock C++ op for every row, then tree rows recomputed with the torch twin.

Matches vLLM 0.32 (``v1/attention/backends/cpu_attn.py``).

* Why: the CPU build always selects CPU_ATTN (``CpuPlatform.get_attn_backend_cls``), whose op has no
  arbitrary mask; tree rows need "ancestors + itself + committed prefix, window from the row's own
  position" (docs/vllm-notes.md §5).
* What it replaces: the backend class registered for the **static** enum member
  ``AttentionBackendEnum.CPU_ATTN`` (never a new enum name: a dynamic member cannot be unpickled in a
  spawned engine core). ``forward`` runs the stock op for the whole batch, then overwrites the output of
  each tree request's rows with the kernels' torch twin (``tree_attention_dense_ref``) over the prefix
  K/V gathered through the KV view (only the window's tail for sliding layers; visibility depends on
  position differences only, so the tail is passed as a shorter prefix) plus the fresh tree K/V; from
  ``BATCH_TREES`` trees in a step, all trees of a layer in one batched masked attention (``_tree_rows``,
  the same rules; the per-tree loop's call overhead dominated at 16 sessions). A
  KV-shared layer (called with no key/value) reads the tree rows' K/V from its target's paged cache: vLLM
  hands it the target's cache, and the target's ``do_kv_cache_update`` wrote the rows at their sequential
  slots earlier in the same forward. ``do_kv_cache_update`` writes as stock and records that the layer was
  written this step (compaction and the hand-off read the paged cache afterwards); vLLM never calls it for
  a KV-shared layer. Batches without trees are untouched.
* Overrides: ``CPUAttentionBackendImpl.forward`` and ``do_kv_cache_update`` (above);
  ``CPUAttentionBackend.get_impl_cls`` (returns the HyCo impl). tests/unit/test_vllm_surface.py checks them.
* When it can go: when vLLM's CPU op takes a per-sequence tree mask and per-row positions.

The runner publishes the step's trees with ``tree_plan.set_active_trees`` before the forward and clears
them after sampling; everything runs in the worker process.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_hyco.vllm_adapter import tree_plan
from vllm_hyco.vllm_adapter.kv_view import cpu_kv_view, slots_for_positions
from vllm_hyco.kernels.tree_attention import tree_attention_dense_ref


def install() -> None:
    """Register the override over the static CPU_ATTN member (idempotent; call before model load)."""
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{__name__}.HycoCPUAttentionBackend"
    if AttentionBackendEnum.CPU_ATTN.get_path() != path:
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
        cached = getattr(selector, "_cached_get_attn_backend", None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


class HycoCPUAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        trees = tree_plan.active_trees()
        if not trees:
            return
        tree_plan.note_layer_written(getattr(layer, "layer_name", None) or str(id(layer)))

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        trees = tree_plan.active_trees()
        if not trees or attn_metadata is None:
            return out
        assert self.sinks is None and self.alibi_slopes is None, "tree rows: sinks/alibi not supported"
        view = cpu_kv_view(layer.isa, kv_cache, self.kv_cache_dtype)
        fn = _tree_rows if len(trees) >= BATCH_TREES else _tree_rows_loop
        fn(self, query, key, value, kv_cache, attn_metadata, out, trees, view)
        return out


#: from this many trees in a step, one batched call per layer (``_tree_rows``) beats the per-tree loop
#: (``_tree_rows_loop``) on the CPU build (measured: 16 five-row trees 2x faster batched; one or three
#: trees faster in the loop, which reads only the window's slots where the batch reads whole blocks)
BATCH_TREES = 8


def _tree_rows_loop(impl, query, key, value, kv_cache, attn_metadata, out, trees, view) -> None:
    """Every tree request's rows of one layer, one tree at a time: the torch twin
    (``tree_attention_dense_ref``) over the prefix K/V gathered through the KV view (only the window's
    tail for sliding layers) plus the fresh tree K/V (a KV-shared layer reads the tree rows' K/V from its
    target's cache, written at slots t .. t + n - 1 earlier in the same forward)."""
    block_size = kv_cache.shape[2]
    for tr in trees:
        rows = slice(tr.q_start, tr.q_start + tr.num_rows)
        t = tr.context_len
        lo = 0 if impl.sliding_window <= 0 else max(0, t - impl.sliding_window + 1)
        shared = key is None
        hi = t + tr.num_rows if shared else t
        slots = slots_for_positions(attn_metadata.block_table[tr.batch_idx], torch.arange(lo, hi), block_size)
        k_pre, v_pre = view.gather(kv_cache, slots)  # [L, Hkv, D] each
        q = query[rows].view(tr.num_rows, impl.num_heads, impl.head_size)
        if shared:
            k_pre, k_tree = k_pre[: t - lo], k_pre[t - lo:].to(q.dtype)
            v_pre, v_tree = v_pre[: t - lo], v_pre[t - lo:].to(q.dtype)
        else:
            k_tree = key[rows].view(tr.num_rows, impl.num_kv_heads, impl.head_size)
            v_tree = value[rows].view(tr.num_rows, impl.num_kv_heads, impl.head_size)
        window = impl.sliding_window if impl.sliding_window > 0 else None
        res = tree_attention_dense_ref(q, torch.cat([k_pre.to(q.dtype), k_tree]),
                                       torch.cat([v_pre.to(q.dtype), v_tree]), t - lo, tr.masks, tr.depths,
                                       impl.scale, sliding_window=window,
                                       softcap=float(impl.logits_soft_cap or 0.0) or None)
        out[rows] = res.reshape(out[rows].shape)


def _tree_rows(impl, query, key, value, kv_cache, attn_metadata, out, trees, view) -> None:
    """Every tree request's rows of one layer, recomputed in one batched masked attention.

    Keys are read in the cache's own layout, a whole block at a time (``view._split``: the CPU layout's K
    plane is transposed per block, so a per-slot gather is a strided copy, and was most of the cost): tree
    b's blocks ``[lo_b / bs, last position / bs]`` in one copy, every position of them scored and masked to
    the rows' visible keys, then the tree's own rows (this step's K/V; a KV-shared layer, called without
    key/value, reads them from those blocks: its target wrote them at slots ``t_b ..``). Row i of tree b
    sees committed position p in ``[lo_b, t_b)`` when ``p > t_b + depth_i - window`` and tree row j when j is
    i or an ancestor of i (and inside the window): the rules of ``kernels.tree_attention_dense_ref``, which
    this matches (fp32 math; tests/unit/test_cpu_tree_rows.py), in one call per layer for all trees."""
    num, hq, hkv, d = len(trees), impl.num_heads, impl.num_kv_heads, impl.head_size
    grp = hq // hkv
    shared = key is None
    k_planes, v_planes, block_size = view._split(kv_cache)  # [nb, Hkv, D, bs], [nb, Hkv, bs, D]
    blocks, qidx, mask, valid, n_max = _step_plan(
        trees, attn_metadata.block_table, block_size, impl.sliding_window if impl.sliding_window > 0 else 0,
        shared, grp)
    nblk = blocks.shape[1]
    kb = k_planes[blocks].permute(0, 2, 3, 1, 4).reshape(num, hkv, d, nblk * block_size)  # [B, Hkv, D, P]
    vb = v_planes[blocks].transpose(1, 2).reshape(num, hkv, nblk * block_size, d)  # [B, Hkv, P, D]
    flat = qidx.flatten()
    # [B, Hkv, grp * N, D]: query head h = kv * grp + g, rows ordered (g, row)
    q = query[flat].view(num, n_max, hkv, grp, d).permute(0, 2, 3, 1, 4).reshape(num, hkv, grp * n_max, d)
    q = q.float()
    scores = torch.matmul(q, kb.float())
    if not shared:
        k_tree = key[flat].view(num, n_max, hkv, d).transpose(1, 2).float()  # [B, Hkv, N, D]
        scores = torch.cat([scores, torch.matmul(q, k_tree.transpose(2, 3))], dim=3)
    scores = scores * impl.scale
    softcap = float(impl.logits_soft_cap or 0.0)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores + mask, dim=-1)
    o = torch.matmul(probs[..., : nblk * block_size], vb.float())
    if not shared:
        v_tree = value[flat].view(num, n_max, hkv, d).transpose(1, 2).float()
        o = o + torch.matmul(probs[..., nblk * block_size:], v_tree)
    o = o.view(num, hkv, grp, n_max, d).permute(0, 3, 1, 2, 4).reshape(num, n_max, hq * d).to(out.dtype)
    out_rows = out.view(out.shape[0], -1)
    out_rows[qidx[valid]] = o[valid]


# the step's index tensors per (block table, block size, window, shared, heads per KV head), for the step's
# trees list (the object ``tree_plan.set_active_trees`` published: a new one every step; kept referenced,
# so its id is never reused while cached)
_PLAN: dict = {"trees": None, "plans": {}}


def _step_plan(trees, block_table, block_size: int, sw: int, shared: bool, grp: int):
    """(blocks [B, nblk], qidx [B, N], additive mask [B, 1, grp * N, keys], valid [B, N], N) of the step's
    trees for one KV group and kind of layer: built once per step, reused by the step's other layers."""
    if _PLAN["trees"] is not trees:
        _PLAN.update(trees=trees, plans={})
    key = (id(block_table), block_size, sw, shared, grp)
    hit = _PLAN["plans"].get(key)
    if hit is not None and hit[0] is block_table:
        return hit[1]
    num = len(trees)
    n = torch.tensor([tr.num_rows for tr in trees], dtype=torch.int64)
    t = torch.tensor([tr.context_len for tr in trees], dtype=torch.int64)
    lo = (t - sw + 1).clamp(min=0) if sw else torch.zeros_like(t)
    n_max = int(n.max())
    j_row = torch.arange(n_max)
    last = t + n - 1 if shared else t - 1  # the last position read from the cache
    first = lo // block_size
    nblk = int((last // block_size - first).max()) + 1
    table = block_table[torch.tensor([tr.batch_idx for tr in trees])].to(torch.int64)
    cols = (first[:, None] + torch.arange(nblk)[None, :]).clamp(max=table.shape[1] - 1)
    blocks = table.gather(1, cols)  # [B, nblk]
    qidx = torch.tensor([tr.q_start for tr in trees], dtype=torch.int64)[:, None] + torch.minimum(
        j_row[None, :], (n - 1)[:, None])  # [B, N] flattened batch rows (pads repeat the last row)
    depth = torch.zeros(num, n_max, dtype=torch.int64)
    anc = torch.zeros(num, n_max, n_max, dtype=torch.bool)
    for b, tr in enumerate(trees):
        m = tr.num_rows
        depth[b, :m] = tr.depths
        anc[b, :m, :m] = tr.anc
    anc |= torch.eye(n_max, dtype=torch.bool)[None]  # pad rows see themselves (their output is dropped)
    qpos = t[:, None] + depth  # [B, N] each row's position
    p = first[:, None] * block_size + torch.arange(nblk * block_size)[None, :]  # [B, P] the blocks' positions
    vis = ((p >= lo[:, None]) & (p < t[:, None]))[:, None, :] & torch.ones(1, n_max, 1, dtype=torch.bool)
    if sw:
        vis = vis & (p[:, None, :] > qpos[:, :, None] - sw)
    tree_vis = anc & (qpos[:, None, :] > qpos[:, :, None] - sw) if sw else anc  # [B, N, N]
    if shared:  # tree row j is in the cache at position t + j
        j = p - t[:, None]  # [B, P]
        in_tree = (j >= 0) & (j < n[:, None])
        jj = j.clamp(0, n_max - 1)
        vis = vis | (in_tree[:, None, :] & tree_vis.gather(2, jj[:, None, :].expand(num, n_max, p.shape[1])))
    else:
        vis = torch.cat([vis, tree_vis], dim=2)
    mask = torch.zeros(vis.shape, dtype=torch.float32).masked_fill_(~vis, float("-inf"))
    mask = mask[:, None, None].expand(num, 1, grp, n_max, mask.shape[-1]).reshape(num, 1, grp * n_max, -1)
    plan = (blocks, qidx, mask, j_row[None, :] < n[:, None], n_max)
    _PLAN["plans"][key] = (block_table, plan)
    return plan


class HycoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return HycoCPUAttentionImpl
