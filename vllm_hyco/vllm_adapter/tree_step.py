"""One step's tree decision, KV compaction and hand-off gather, on the runner's device, for all trees at once.

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
4. :func:`handoff`: the two hand-off layers' K/V rows (root + path, after compaction), h at v* and
   e(bonus), gathered and quantized to int8 on the device with the model's fixed scales
   (``kernels.handoff_gather``), then copied to the host as int8 in one transfer. Round 0's seed (the last
   W positions) is gathered and quantized the same way. Under tensor parallelism every rank runs steps 1-3 on
   its own KV heads (same decision: same logits, same uniforms) and quantizes its heads here; the K/V
   pieces of the whole step are gathered to rank 0 in one collective (``tp_heads``).

The layer list: the cache owners and the two hand-off layers of ``layers.discover`` (read from vLLM's
forward context; KV-shared layers own no cache and are skipped). :func:`warm_up` compiles the Triton variants the engine launches at load (GPU only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_hyco.kernels import compact_kv, gather_quantize_kv, handoff_gather_quantize, quantize_int8
from vllm_hyco.spec_decode.coupling import SampledDrafts
from vllm_hyco.spec_decode.sampling import SAMPLING_EPS, SamplingSpec, draw_uniforms
from vllm_hyco.spec_decode.verify import BatchVerdict, PackedTrees, verify_batch_with_uniforms
from vllm_hyco.vllm_adapter.kv_view import BlockMajorKVView, cpu_kv_view, slots_for_positions
from vllm_hyco.handoff.tree_contract import NodeLabel
from vllm_hyco.handoff.tree_contract import depths as tree_depths
from vllm_hyco.vllm_adapter import tp_heads
from vllm_hyco.vllm_adapter.tree_plan import TreeRows

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
        as64 = lambda v: torch.tensor(v, dtype=torch.int64)
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


def cache_layers(runner) -> list[CacheLayer]:
    """Every attention layer that owns its KV cache (``layers.discover``, via the runner's
    ``_hyco_kv_layers``), with its KV-cache group and KV view (cached on the runner)."""
    st = runner._hyco_state()
    if st.get("cache_layers") is None:
        ctx = runner.compilation_config.static_forward_context
        group_of = {name: g for g, group in enumerate(runner.kv_cache_config.kv_cache_groups)
                    for name in group.layer_names}
        out = []
        for name in runner._hyco_kv_layers().owners:
            layer = ctx[name]
            cache = layer.kv_cache
            if hasattr(layer, "isa"):  # CPU_ATTN sets it on its layers
                view = cpu_kv_view(layer.isa, cache, getattr(layer, "kv_cache_dtype", "auto"))
            else:
                view = BlockMajorKVView(getattr(layer, "kv_cache_dtype", "auto"))
            out.append(CacheLayer(name, group_of[name], layer, view))
        st["cache_layers"] = out
    return st["cache_layers"]


def _slot_mapping(runner, group: int) -> torch.Tensor:
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
        sm = _slot_mapping(runner, g).to(path.device)
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


# -- hand-off ---------------------------------------------------------------------------------------
def handoff_scales(runner) -> dict:
    """The model's fixed int8 scales on the device: ``{"e", "h", kind: (k, v)}`` (loaded once)."""
    st = runner._hyco_state()
    if st.get("scales") is None:
        from vllm_hyco.serving.handoffs import ServerModel

        model = ServerModel.load(runner.model_config.model, runner._hyco_window())
        dev = runner.device
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
        out = {"e": as_t(model.scales.e), "h": as_t(model.scales.h)}
        for spec in model.spec.layers:
            k, v = model.scales.layer(spec.layer_id)
            out[spec.kind] = (as_t(k), as_t(v) if v is not None else as_t(k))
        st["scales"] = out
    return st["scales"]


def _layer(runner, name: str) -> CacheLayer | None:
    return next((lay for lay in cache_layers(runner) if lay.name == name), None)


def handoff(runner, step: StepTrees, dec: StepDecision, hidden: torch.Tensor | None) -> list[dict]:
    """Per tree: the int8 hand-off (D1) gathered after compaction (``kernels.handoff_gather_quantize``: K and
    V rows of both hand-off layers, h at v* and e(bonus), quantized on the device), one copy to the host.

    Under TP each rank quantizes its own KV heads with its slice of the per-head scales, and the K/V rows
    of every tree and every round-0 seed of the step are gathered across ranks in one collective
    (``tp_heads.gather_heads``); the other ranks return empty hand-offs (only rank 0's output reaches the
    scheduler)."""
    scales = handoff_scales(runner)
    shard = _shard(runner)
    verdict, num = dec.verdict, len(step.trees)
    dev = verdict.bonus.device
    # batch rows of positions t .. t + d of every tree (the root and the compacted path: exactly the rows
    # that leave), then each tree's v* (h); one host-to-device copy
    lengths = [len(p) + 1 for p in dec.path_rows]
    rows = [tr.q_start + i for tr, n in zip(step.trees, lengths) for i in range(n)]
    ends = [tr.q_start + (p[-1] if p else 0) for tr, p in zip(step.trees, dec.path_rows)]
    idx = torch.tensor(rows + ends, dtype=torch.int64).to(dev, non_blocking=True)
    pos, end_rows = idx[: len(rows)], idx[len(rows):]
    with torch.no_grad():
        e = runner.model.embed_input_ids(verdict.bonus).float()  # [B, hidden] (all-reduced under TP)
    h = hidden[end_rows].float() if hidden is not None else torch.zeros_like(e)
    layers, lays = {}, []
    for kind, name in runner._hyco_handoff_layers().items():
        lay = _layer(runner, name)
        if lay is not None:
            layers[kind] = name
            lays.append((kind, lay))
    views = [lay.view.kv_views(lay.layer.kv_cache) for _, lay in lays]
    local = [k.shape[2] for k, _ in views]  # this rank's KV heads of each hand-off layer
    q = handoff_gather_quantize(
        [k for k, _ in views], [v for _, v in views],
        [_slot_mapping(runner, lay.group).to(dev)[pos] for _, lay in lays],
        [shard.scale_slice(scales[kind][0], n) for (kind, _), n in zip(lays, local)],
        [shard.scale_slice(scales[kind][1], n) for (kind, _), n in zip(lays, local)], h, e, scales["h"],
        scales["e"])
    # the step's K/V pieces [rows, local heads, D]: both layers' rows of all trees, then the round-0 seeds
    total = {kind: scales[kind][0].shape[0] for kind in layers}  # the model's KV heads of each layer
    names, kv, heads = [], [], []
    for (kind, _), k_rows, v_rows in zip(lays, q.k, q.v):
        names += [f"{kind}_k", f"{kind}_v"]
        kv += [k_rows, v_rows if v_rows is not None else k_rows]
        heads += [total[kind]] * 2
    seed_of = {b: _seed(runner, tr, layers, scales, tr.context_len + len(dec.path_rows[b]) + 1, shard)
               for b, tr in enumerate(step.trees) if tr.round == 0}
    seed_keys = [(b, kind, f"{kind}_{x}") for b in seed_of for kind in layers for x in ("k", "v")]
    kv += [seed_of[b][key] for b, _, key in seed_keys]
    heads += [total[kind] for _, kind, _ in seed_keys]
    kv = tp_heads.gather_heads(kv, shard, heads)  # one all_gather for the whole step (none on one rank)
    if shard.rank != 0:
        return [{} for _ in step.trees]
    for (b, _, key), rows_b in zip(seed_keys, kv[len(names):]):
        seed_of[b][key] = rows_b.cpu()
    parts, names = [q.e, q.h, *kv[: len(names)]], ["e_bonus", "h", *names]
    sizes = [p.numel() for p in parts]
    host = torch.cat([p.flatten() for p in parts]).cpu() if parts else torch.empty(0, dtype=torch.int8)
    pieces = dict(zip(names, torch.split(host, sizes)))
    starts = [sum(lengths[:b]) for b in range(num)]
    out = []
    for b, tr in enumerate(step.trees):
        d = len(dec.path_rows[b])
        ho = {"position": tr.context_len + d, "start": tr.context_len, "layers": dict(layers)}
        ho["e_bonus"] = pieces["e_bonus"].view(num, -1)[b]
        ho["h"] = pieces["h"].view(num, -1)[b]
        for kind in layers:
            for kv_name in (f"{kind}_k", f"{kind}_v"):
                kv_rows = pieces[kv_name].view(-1, *parts[names.index(kv_name)].shape[1:])
                ho[kv_name] = kv_rows[starts[b]: starts[b] + d + 1]
        if b in seed_of:
            ho["seed"] = seed_of[b]
        out.append(ho)
    return out


def _shard(runner) -> tp_heads.HeadShard:
    st = runner._hyco_state()
    if st.get("shard") is None:
        st["shard"] = tp_heads.shard_of(runner)
    return st["shard"]


def _seed(runner, tr: TreeRows, layers: dict, scales: dict, num_committed: int,
          shard: tp_heads.HeadShard) -> dict:
    """int8 K/V of positions [max(0, T - W), T) of the two hand-off layers, read from the paged cache: this
    rank's KV heads, on the device (the caller gathers every head and copies them to the host)."""
    lo = max(0, num_committed - runner._hyco_window())
    positions = torch.arange(lo, num_committed, dtype=torch.int64)
    seed = {"start": lo, "end": num_committed}
    for kind, name in layers.items():
        lay = _layer(runner, name)
        table = runner.input_batch.block_table[lay.group]
        slots = slots_for_positions(table.block_table.gpu[tr.batch_idx], positions, table.block_size)
        k_view, v_view = lay.view.kv_views(lay.layer.kv_cache)
        k_scale, v_scale = (shard.scale_slice(s, k_view.shape[2]) for s in scales[kind])
        seed[f"{kind}_k"] = gather_quantize_kv(k_view, slots, k_scale)
        seed[f"{kind}_v"] = gather_quantize_kv(v_view, slots, v_scale)
    return seed


# -- warm-up ----------------------------------------------------------------------------------------
WARM_TREE_ROWS = (1, 2, 4, 8, 16, 33)  # max rows per tree: BLOCK_Q follows next_pow2 of it, up to its cap
WARM_CONTEXTS = (0, 8192)  # without and with key splits (flash-decoding) on a GPU


def warm_up(runner) -> list[str]:
    """Compile, at load, the Triton variants the engine's tree steps launch (GPU runners only).

    Tree attention: every distinct layer configuration (heads, head size, window, softcap, dtype, block
    size) for each tree-row bucket of :data:`WARM_TREE_ROWS`, without and with key splits, reading block 0
    (vLLM's null block); compaction over every cache-owning layer with only skipped moves (slot -1); the
    int8 gather of both hand-off layers and the h/e quantizer (loads the scales: a missing or mismatched
    scales file fails here, not at the first round). Nothing in the cache changes. Returns what it ran.
    """
    if runner.device.type != "cuda":
        return []  # the torch twins run on CPU: nothing to compile
    from vllm_hyco.kernels.tree_attention import ancestor_masks_from_parents
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
            masks, depths = ancestor_masks_from_parents([-1] + list(range(rows - 1)))
            masks_t = torch.tensor(masks, dtype=torch.int64, device=dev)
            depths_t = torch.tensor(depths, dtype=torch.int32, device=dev)
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
    for kind, name in runner._hyco_handoff_layers().items():
        lay = _layer(runner, name)
        if lay is None:
            continue
        for view, scale in zip(lay.view.kv_views(lay.layer.kv_cache), scales[kind]):
            gather_quantize_kv(view, torch.zeros(34, dtype=torch.int64, device=dev),
                               _shard(runner).scale_slice(scale, view.shape[2]))
        done.append(f"gather_quantize_kv {kind}")
    for name in ("e", "h"):
        quantize_int8(torch.zeros(2, hidden, dtype=torch.float32, device=dev), scales[name])
    torch.cuda.synchronize(dev)
    return done
