"""Compile, at load, the Triton variants the engine's tree steps launch (worker process, GPU runners only;
vLLM 0.32 V1 runner and HyCo's Triton attention backend, ``worker/gpu_attention.py``)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_hyco.kernels import compact_kv, gather_quantize_kv, quantize_int8
from vllm_hyco.vllm_adapter.worker.handoff_step import handoff_scales, head_shard
from vllm_hyco.vllm_adapter.worker.tree_step import cache_layer, cache_layers, kv_layers

WARM_TREE_ROWS = (1, 2, 4, 8, 16, 33)  # max rows per tree: BLOCK_Q follows next_pow2 of it, up to its cap
WARM_CONTEXTS = (0, 8192)  # without and with key splits (flash-decoding) on a GPU


def warm_up(runner: Any) -> list[str]:
    """Compile, at load, the Triton variants the engine's tree steps launch (GPU runners only).

    Tree attention: every distinct layer configuration (heads, head size, window, softcap, dtype, block
    size) for each tree-row bucket of :data:`WARM_TREE_ROWS`, without and with key splits, reading block 0
    (vLLM's null block); compaction over every cache-owning layer with only skipped moves (slot -1); the
    int8 gather of both hand-off layers and the h/e quantizer (loads the scales: a missing or mismatched
    scales file fails here, not at the first round). Nothing in the cache changes. Returns what it ran.
    """
    if runner.device.type != "cuda":
        return []  # the torch twins run on CPU: nothing to compile
    from vllm_hyco.handoff import tree_contract
    from vllm_hyco.kernels.tree_rows import block_major_views, paged_tree_rows_attention

    dev, done, seen = runner.device, [], set()
    layers = cache_layers(runner)
    for lay in layers:
        impl = getattr(lay.layer, "impl", None)
        if not hasattr(impl, "_tree_window"):
            continue
        cache = lay.layer.kv_cache
        key = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl._tree_window(), impl.logits_soft_cap,
               cache.dtype, cache.shape[2], cache.stride())
        if key in seen:
            continue
        seen.add(key)
        k_cache, v_cache = block_major_views(cache, impl.head_size)
        for rows in WARM_TREE_ROWS:
            chain = [-1] + list(range(rows - 1))
            masks_t = torch.from_numpy(tree_contract.ancestor_mask(chain)).to(dev)  # [rows] int64
            depths_t = torch.from_numpy(tree_contract.depths(chain)).to(device=dev, dtype=torch.int32)  # [rows]
            q = torch.zeros(rows, impl.num_heads, impl.head_size, dtype=cache.dtype, device=dev)
            for ctx in WARM_CONTEXTS:
                table = torch.zeros(1, -(-(ctx + rows) // cache.shape[2]), dtype=torch.int32, device=dev)
                paged_tree_rows_attention(q, k_cache, v_cache, table, [ctx], [rows], masks_t, depths_t,
                                          impl.scale, impl._tree_window(),
                                          float(impl.logits_soft_cap or 0.0) or None)
        done.append(f"tree_attention {key[:6]}")
    caches, groups = [], sorted({lay.group for lay in layers})
    layer_groups = []
    for lay in layers:
        for c in lay.view.move_views(lay.layer.kv_cache):
            caches.append(c)
            layer_groups.append(groups.index(lay.group))
    for moves in (1, 16, 33):
        skip = torch.full((len(groups), moves), -1, dtype=torch.int64, device=dev)
        compact_kv(caches, skip, skip, torch.tensor([0, moves], dtype=torch.int32, device=dev), layer_groups)
    done.append(f"compact_kv {len(caches)} caches")
    scales = handoff_scales(runner)
    hidden = scales["h"].shape[0]
    for kind, name in kv_layers(runner).handoff.items():
        lay = cache_layer(runner, name)
        if lay is None:
            continue
        for view, scale in zip(lay.view.kv_views(lay.layer.kv_cache), scales[kind]):
            gather_quantize_kv(view, torch.zeros(34, dtype=torch.int64, device=dev),
                               head_shard(runner).scale_slice(scale, view.shape[2]))
        done.append(f"gather_quantize_kv {kind}")
    for name in ("e", "h"):
        quantize_int8(torch.zeros(2, hidden, dtype=torch.float32, device=dev), scales[name])
    torch.cuda.synchronize(dev)
    return done
