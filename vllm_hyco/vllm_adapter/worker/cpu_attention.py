"""CPU_ATTN override: the stock C++ op for every row, then tree rows recomputed with the torch twin.

Matches vLLM 0.32 (``v1/attention/backends/cpu_attn.py``).

* Why: the CPU build always selects CPU_ATTN (``CpuPlatform.get_attn_backend_cls``), whose op has no
  arbitrary mask; tree rows need "ancestors + itself + committed prefix, window from the row's own
  position" (docs/vllm-notes.md §5).
* What it replaces: the backend class registered for the **static** enum member
  ``AttentionBackendEnum.CPU_ATTN`` (never a new enum name: a dynamic member cannot be unpickled in a
  spawned engine core). ``forward`` runs the stock op for the whole batch, then overwrites the output of
  the tree requests' rows: all trees at once, padded to one batch (``tree_plan.PaddedTrees``, built once
  per step and KV-cache group): one gather of every tree's prefix K/V through the KV view (only the
  window's tail for sliding layers) and one masked attention (``kernels.tree_attention_padded``) over
  the prefix K/V and the fresh tree K/V. ``VLLM_HYCO_CPU_TREE_ATTN=loop`` keeps the earlier path, one gather and one
  ``tree_attention_dense_ref`` per tree and layer (the benchmarks compare the two in one run; the
  per-tree loop was most of a 16-tree step's per-request cost, docs/benchmarks.md). A
  KV-shared layer (called with no key/value) reads the tree rows' K/V from its target's paged cache: vLLM
  hands it the target's cache, and the target's ``do_kv_cache_update`` wrote the rows at their sequential
  slots earlier in the same forward. ``do_kv_cache_update`` writes as stock and records that the layer was
  written this step (compaction and the hand-off read the paged cache afterwards); vLLM never calls it for
  a KV-shared layer. Batches without trees are untouched, and so are the rows of a tree that is a chain
  (``tree_plan.masked_trees``: its mask is the causal one the stock op applied).
* Overrides: ``CPUAttentionBackendImpl.forward`` and ``do_kv_cache_update`` (above);
  ``CPUAttentionBackend.get_impl_cls`` (returns the HyCo impl). tests/unit/test_vllm_surface.py checks them.
* When it can go: when vLLM's CPU op takes a per-sequence tree mask and per-row positions.

The runner publishes the step's trees with ``tree_plan.set_active_trees`` before the forward and clears
them after sampling; everything runs in the worker process.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_hyco import envs
from vllm_hyco.kernels.tree_attention import tree_attention_dense_ref, tree_attention_padded
from vllm_hyco.vllm_adapter import surface
from vllm_hyco.vllm_adapter.worker import tree_plan
from vllm_hyco.vllm_adapter.worker.kv_view import cpu_kv_view, slots_for_positions


def install() -> None:
    """Register the override over the static CPU_ATTN member (idempotent; call before model load)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = f"{__name__}.HycoCPUAttentionBackend"
    if AttentionBackendEnum.CPU_ATTN.get_path() != path:
        register_backend(AttentionBackendEnum.CPU_ATTN, path)
        surface.clear_attn_backend_cache()


class HycoCPUAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        tree_plan.note_layer_written(layer)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                              output_scale, output_block_scale)
        if not tree_plan.active_trees() or attn_metadata is None:
            return out
        assert self.sinks is None and self.alibi_slopes is None, "tree rows: sinks/alibi not supported"
        trees = tree_plan.masked_trees()  # chains keep the stock op's rows (their mask is causal)
        if not trees:
            return out
        view = cpu_kv_view(layer.isa, kv_cache, self.kv_cache_dtype)
        if envs.VLLM_HYCO_CPU_TREE_ATTN != "loop":
            return self._padded(trees, view, query, key, value, kv_cache, attn_metadata, out)
        block_size = kv_cache.shape[2]
        for tr in trees:
            rows = slice(tr.q_start, tr.q_start + tr.num_rows)
            t = tr.context_len
            lo = 0 if self.sliding_window <= 0 else max(0, t - self.sliding_window + 1)
            shared = key is None  # a KV-shared layer: its target wrote the tree rows at slots t .. t + n - 1
            hi = t + tr.num_rows if shared else t
            prefix_pos = torch.arange(lo, hi, dtype=torch.int64)  # [L] (+ the tree rows when shared)
            slots = slots_for_positions(attn_metadata.block_table[tr.batch_idx], prefix_pos, block_size)
            k_pre, v_pre = view.gather(kv_cache, slots)  # [L, Hkv, D] each
            q = query[rows].view(tr.num_rows, self.num_heads, self.head_size)
            if shared:
                k_pre, k_tree = k_pre[: t - lo], k_pre[t - lo:].to(q.dtype)
                v_pre, v_tree = v_pre[: t - lo], v_pre[t - lo:].to(q.dtype)
            else:
                k_tree = key[rows].view(tr.num_rows, self.num_kv_heads, self.head_size)
                v_tree = value[rows].view(tr.num_rows, self.num_kv_heads, self.head_size)
            window = self.sliding_window if self.sliding_window > 0 else None
            k_all = torch.cat([k_pre.to(q.dtype), k_tree])  # [L + rows, Hkv, D]
            v_all = torch.cat([v_pre.to(q.dtype), v_tree])
            res = tree_attention_dense_ref(q, k_all, v_all, t - lo, tr.masks, tr.depths, self.scale,
                                           sliding_window=window, softcap=float(self.logits_soft_cap or 0.0) or None)
            out[rows] = res.reshape(out[rows].shape)
        return out

    def _padded(self, trees, view, query, key, value, kv_cache, attn_metadata, out):
        """Every tree of the step in one gather and one attention (``tree_plan.PaddedTrees``)."""
        window = self.sliding_window if self.sliding_window > 0 else None
        bt = attn_metadata.block_table
        block_size = kv_cache.shape[2]
        # the layout is the same for every layer with this window; the slots follow the layer's block table,
        # one per KV-cache group, so they are built once per group and step
        pt = tree_plan.step_cached(("cpu_padded", window), lambda: tree_plan.PaddedTrees.build(trees, window))
        prefix_slots, tree_slots = tree_plan.step_cached(("cpu_slots", window, bt.data_ptr(), block_size),
                                                         lambda: pt.slots(bt, block_size))
        T, R = pt.rows.shape
        L = prefix_slots.shape[1]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query.reshape(-1, hq, d)[pt.rows]  # [T, R, hq, D]
        # padding gathers slots that may hold anything (a freed block): zero it, a NaN key poisons the row
        pad = ~pt.prefix_ok[:, :, None, None]
        k_pre, v_pre = view.gather(kv_cache, prefix_slots.reshape(-1))  # fresh copies: zeroed in place
        k_pre = k_pre.view(T, L, hkv, d).masked_fill_(pad, 0.0)
        v_pre = v_pre.view(T, L, hkv, d).masked_fill_(pad, 0.0)
        if key is None:  # KV-shared: the target wrote the tree rows at their sequential slots
            k_tree, v_tree = view.gather(kv_cache, tree_slots.reshape(-1))
            pad_rows = ~pt.valid[:, :, None, None]
            k_tree = k_tree.view(T, R, hkv, d).masked_fill_(pad_rows, 0.0)
            v_tree = v_tree.view(T, R, hkv, d).masked_fill_(pad_rows, 0.0)
        else:
            k_tree, v_tree = key.reshape(-1, hkv, d)[pt.rows], value.reshape(-1, hkv, d)[pt.rows]
        res = tree_attention_padded(q, k_pre, v_pre, k_tree, v_tree, pt.bias,
                                    self.scale, softcap=float(self.logits_soft_cap or 0.0) or None)  # [T, R, hq, D]
        flat = out.view(out.shape[0], -1)
        flat[pt.rows[pt.valid]] = res[pt.valid].reshape(-1, hq * d).to(out.dtype)
        return out


class HycoCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return HycoCPUAttentionImpl
