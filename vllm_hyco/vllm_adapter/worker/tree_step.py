"""One step's tree decision and KV compaction, on the runner's device, for all trees at once (worker process).

Matches vLLM 0.32 (V1 runner: ``input_batch.block_table[g]`` with its ``slot_mapping``/``block_table``
buffers, ``kv_cache_config.kv_cache_groups``, ``compilation_config.static_forward_context``). The runner
mixin's ``_sample`` calls, once per step with trees:

1. :meth:`StepTrees.build`: the step's index tensors (packed rows, their rows in the flattened batch,
   each tree's first row), built on the host from the trees' lists and moved to the device once.
2. :func:`decide`: the core's ``verify_batch_with_uniforms`` on the trees' logits rows, on the device: the
   candidate cut, p̃ on it and the samples for every sampled row in one batch, greedy rows by argmax,
   the acceptance rule for every tree. Uniforms: one float64 per row of a sampled tree, drawn on the host
   from the session's own ``torch.Generator`` (seeded from ``extra_args["hyco"]["seed"]``), in row order,
   then one per sampled child (``spec_decode.coupling``; docs/acceptance.md); they are the only
   host-to-device data of the decision besides the indices.
   What comes back to the host is one int64 tensor of ``O(rows)`` values (paths, bonuses, hits, samples).
3. :func:`compact`: every cache-owning layer's accepted rows moved from the slots of ``t + r_i`` to those
   of ``t + i`` by ``kernels.compact_kv`` (one Triton launch for all layers on a GPU; the torch twin on
   CPU_ATTN's transposed layout), slots read from vLLM's per-group slot mapping of this step.
4. the hand-off (``worker/handoff_step.py``), gathered after compaction.

Under tensor parallelism every rank runs these steps on its own KV heads (same decision: same logits, same
uniforms). The layer list: the cache owners and the hand-off layers of ``layers.discover`` (read from
vLLM's forward context, the hand-off layers by the model seam's rule; KV-shared layers own no cache and are
skipped). ``worker/warmup.py`` compiles the Triton variants the engine launches at load (GPU only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_hyco.handoff.tree_contract import NodeLabel
from vllm_hyco.handoff.tree_contract import depths as tree_depths
from vllm_hyco.kernels import compact_kv
from vllm_hyco.spec_decode.coupling import SampledDrafts
from vllm_hyco.spec_decode.sampling import SAMPLING_EPS, SamplingSpec, draw_uniforms
from vllm_hyco.spec_decode.verify import BatchVerdict, PackedTrees, verify_batch_with_uniforms
from vllm_hyco.vllm_adapter import surface
from vllm_hyco.vllm_adapter.worker.kv_view import BlockMajorKVView, cpu_kv_view, mla_kv_view
from vllm_hyco.vllm_adapter.worker.layers import KVLayers, discover
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows

ROOT_LABEL, OTHER_LABEL = int(NodeLabel.ROOT), int(NodeLabel.OTHER)  # the engine has no labels


@dataclass
class StepTrees:
    """The step's trees and their index tensors (built once per step)."""

    trees: list[TreeRows]
    packed: PackedTrees  # on the device
    # [N] int64 row of each packed row in the step's logits
    logit_rows: torch.Tensor
    # [B] int64 first row (the root) of each tree in the flattened batch (hidden states, slot mappings)
    q_start: torch.Tensor
    max_depth: int
    offsets: list[int]  # [B + 1] host row offsets
    # the trees' logits rows as one slice when they are back to back (no copy of [N, V] then)
    logit_slice: slice | None = None
    drafts: SampledDrafts | None = None  # the sampled children (on the device), None when no tree has one

    @classmethod
    def build(cls, trees: list[TreeRows], logit_starts: list[int], device: torch.device | str) -> StepTrees:
        """``logit_starts[b]``: tree b's first row in the step's logits (vLLM keeps one logits row per
        request without drafts, so it differs from the batch row ``q_start`` behind a prefill)."""
        tokens, parent, depth, req, labels, flat, offsets = [], [], [], [], [], [], [0]
        for b, (tr, lo) in enumerate(zip(trees, logit_starts)):
            base = offsets[-1]
            tokens += tr.tokens
            parent += [base] + [base + p for p in tr.parents[1:]]
            depth += tree_depths(tr.parents).tolist()
            req += [b] * tr.num_rows
            labels += [ROOT_LABEL] + [OTHER_LABEL] * (tr.num_rows - 1)
            flat += range(lo, lo + tr.num_rows)
            offsets.append(base + tr.num_rows)

        def as64(v):
            return torch.tensor(v, dtype=torch.int64)

        host = torch.stack([as64(tokens), as64(parent), as64(depth), as64(req), as64(labels), as64(flat)])
        dev = host.to(device, non_blocking=True)  # one host-to-device copy for the step's row indices
        small = as64(offsets + [tr.num_rows for tr in trees] + [tr.q_start for tr in trees]).to(device)
        num = len(trees)
        packed = PackedTrees(tokens=dev[0], parent=dev[1], depth=dev[2], req=dev[3],
                             valid=torch.ones_like(dev[0], dtype=torch.bool), labels=dev[4],
                             row_offsets=small[: num + 1], num_real=small[num + 1: 2 * num + 1])
        together = all(lo == logit_starts[0] + off for lo, off in zip(logit_starts, offsets))
        drafts = None
        if any(tr.draft_q for tr in trees):
            drafts = SampledDrafts.pack([tr.draft_q for tr in trees], offsets, [tr.num_rows for tr in trees])
        return cls(trees=list(trees), packed=packed, logit_rows=dev[5], q_start=small[2 * num + 1:],
                   max_depth=max(max(depth, default=0), 0), offsets=offsets,
                   logit_slice=slice(logit_starts[0], logit_starts[0] + offsets[-1]) if together and num else None,
                   drafts=None if drafts is None else drafts.to(device))


@dataclass
class StepDecision:
    verdict: BatchVerdict  # on the device
    path_rows: list[list[int]]
    bonus: list[int]
    hits: list[int]
    samples: list[list[int]]


def _sampling(params) -> SamplingSpec:
    if params is None:
        return SamplingSpec(temperature=0.0)
    return SamplingSpec(temperature=float(params.temperature), top_k=int(params.top_k or -1),
                        top_p=float(params.top_p))


def _min_tokens_rows(runner, step: StepTrees, params_list) -> tuple[list[int], list[int]]:
    """(packed row, stop id) pairs masked by vLLM's min_tokens rule: row j samples output token
    n_out + depth_j, so while that index is below ``min_tokens`` the stop tokens (EOS included) are
    masked in row j, as plain decoding does."""
    rows, cols = [], []
    for b, (tr, params) in enumerate(zip(step.trees, params_list)):
        min_tokens = int(getattr(params, "min_tokens", 0) or 0)
        stop_ids = sorted(getattr(params, "all_stop_token_ids", None) or ())
        if not min_tokens or not stop_ids:
            continue
        n_out = len(runner.requests[tr.req_id].output_token_ids)
        for j, d in enumerate(tree_depths(tr.parents).tolist()):
            if n_out + d < min_tokens:
                rows += [step.offsets[b] + j] * len(stop_ids)
                cols += stop_ids
    return rows, cols


def decide(runner, step: StepTrees, logits: torch.Tensor, generator) -> StepDecision:
    """Every tree's decision on the device; ``generator(req_id, params)`` gives the session's generator.

    Shape: logits [num_tokens, V] (the step's, on the device); only ``O(rows)`` values come back.
    """
    params_list = [runner.requests[tr.req_id].sampling_params for tr in step.trees]
    specs = [_sampling(p) for p in params_list]
    eps = [None if s.temperature < SAMPLING_EPS else tr.eps for s, tr in zip(specs, step.trees)]
    mrows, mcols = _min_tokens_rows(runner, step, params_list)
    if step.logit_slice is not None:  # [N, V]: a view, copied only when min_tokens masks some of it
        rows_logits = logits[step.logit_slice].clone() if mrows else logits[step.logit_slice]
    else:
        rows_logits = logits[step.logit_rows]  # a copy
    if mrows:
        idx = torch.tensor([mrows, mcols], dtype=torch.int64).to(rows_logits.device)
        rows_logits[idx[0], idx[1]] = float("-inf")
    uniforms = torch.zeros(step.offsets[-1], dtype=torch.float64)
    extra = step.drafts.per_tree if step.drafts is not None else (0,) * len(step.trees)
    u2 = torch.zeros(sum(extra), dtype=torch.float64)
    at = 0
    for b, (tr, s, params) in enumerate(zip(step.trees, specs, params_list)):
        if s.temperature >= SAMPLING_EPS:  # greedy trees consume no randomness
            gen = generator(tr.req_id, params)
            u = draw_uniforms(tr.num_rows + extra[b], gen)  # a row's, then one per sampled child
            uniforms[step.offsets[b]: step.offsets[b + 1]] = u[: tr.num_rows]
            u2[at: at + extra[b]] = u[tr.num_rows:]
        at += extra[b]
    verdict = verify_batch_with_uniforms(step.packed, rows_logits, specs, eps, uniforms, step.offsets,
                                         drafts=step.drafts, draft_uniforms=u2 if step.drafts is not None else None)
    num = len(step.trees)
    flat = torch.cat([verdict.path_rows.flatten(), verdict.bonus, verdict.num_hits, verdict.samples])
    host = flat.cpu().tolist()  # the decision's one device-to-host copy: O(rows) int64 values
    width = verdict.path_rows.shape[1]
    paths = [[r for r in host[b * width: (b + 1) * width] if r >= 0] for b in range(num)]
    at = num * width
    bonus, hits = host[at: at + num], host[at + num: at + 2 * num]
    smp = host[at + 2 * num:]
    samples = [smp[step.offsets[b]: step.offsets[b + 1]] for b in range(num)]
    return StepDecision(verdict=verdict, path_rows=paths, bonus=bonus, hits=hits, samples=samples)


# -- layers -----------------------------------------------------------------------------------------
@dataclass
class CacheLayer:
    name: str
    group: int
    layer: object
    view: object  # kv_view.CpuAttnKVView or BlockMajorKVView


def kv_layers(runner: Any) -> KVLayers:
    """The cache-owning attention layers and the hand-off layers, as vLLM built them (``layers.discover``,
    the hand-off layers by the model seam's rule), read once."""
    st = runner.hyco
    if st.kv_layers is None:
        cfg = getattr(runner, "kv_cache_config", None)
        st.kv_layers = discover(runner.compilation_config.static_forward_context,
                                getattr(cfg, "kv_cache_groups", None), handoff=st.handoff_ids,
                                drafter=surface.draft_attention_layers(runner))
    return st.kv_layers


def cache_layers(runner: Any) -> list[CacheLayer]:
    """Every attention layer that owns its KV cache (:func:`kv_layers`), with its KV-cache group and KV
    view (built once)."""
    st = runner.hyco
    if st.cache_layers is None:
        ctx = runner.compilation_config.static_forward_context
        group_of = {name: g for g, group in enumerate(runner.kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        out = []
        for name in kv_layers(runner).owners:
            layer = ctx[name]
            cache = layer.kv_cache
            if hasattr(layer, "isa"):  # CPU_ATTN sets it on its layers
                view = cpu_kv_view(layer.isa, cache, getattr(layer, "kv_cache_dtype", "auto"))
            elif cache.dim() == 3:  # CPU_MLA's latent rows [blocks, block_size, kv_lora_rank + rope]
                view = mla_kv_view(layer.impl, cache, getattr(layer, "kv_cache_dtype", "auto"))
            else:
                view = BlockMajorKVView(getattr(layer, "kv_cache_dtype", "auto"))
            out.append(CacheLayer(name, group_of[name], layer, view))
        st.cache_layers = out
    return st.cache_layers


def slot_mapping(runner: Any, group: int) -> torch.Tensor:
    """[max_tokens] int64 slots of this step's flattened rows in a KV group (vLLM's, sequential positions)."""
    return runner.input_batch.block_table[group].slot_mapping.gpu


# -- compaction -------------------------------------------------------------------------------------
def compact(runner, step: StepTrees, verdict: BatchVerdict) -> None:
    """Move row r_i's K/V (slot of t + r_i) to the slot of t + i in every cache-owning layer, in place."""
    depth = verdict.path_rows.shape[1]
    if depth == 0:
        return
    layers = cache_layers(runner)
    path = verdict.path_rows  # [B, D] local rows, -1 past the end
    on = path >= 0
    src_flat = step.q_start.unsqueeze(1) + path.clamp(min=0)
    dst_flat = step.q_start.unsqueeze(1) + torch.arange(1, depth + 1, device=path.device)
    groups = sorted({lay.group for lay in layers})
    src, dst = [], []
    for g in groups:
        sm = slot_mapping(runner, g).to(path.device)
        src.append(torch.where(on, sm[src_flat], -1).flatten())
        dst.append(torch.where(on, sm[dst_flat], -1).flatten())
    caches, layer_groups = [], []
    for lay in layers:
        for c in lay.view.move_views(lay.layer.kv_cache):
            caches.append(c)
            layer_groups.append(groups.index(lay.group))
    num = path.shape[0]
    loc = torch.arange(0, (num + 1) * depth, depth, dtype=torch.int32, device=path.device)
    compact_kv(caches, torch.stack(src), torch.stack(dst), loc, layer_groups)


def cache_layer(runner: Any, name: str) -> CacheLayer | None:
    """The :class:`CacheLayer` named ``name`` (None when it owns no cache here)."""
    return next((lay for lay in cache_layers(runner) if lay.name == name), None)
