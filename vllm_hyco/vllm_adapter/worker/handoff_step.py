"""One step's hand-off: int8 K/V rows (or h rows), h and e(bonus) of every tree, gathered on the device
(worker process).

Matches vLLM 0.32 (V1 runner: ``input_batch.block_table[g]``, ``model.embed_input_ids``). The runner mixin's
``_sample`` calls :func:`handoff` after the decision and the compaction (``worker/tree_step.py``): per tree,
the hand-off layers' K/V rows (the root and the compacted path), h at v* and e(bonus), gathered and
quantized to int8 on the device with the model's fixed scales (``kernels.handoff_gather``), then copied to
the host as int8 in one transfer, as an ``engine_contract.Handoff``. The seed (the last W positions, at
round 0 and at the round after server mode) is gathered and quantized the same way. Under tensor
parallelism every rank quantizes its own KV heads here; the K/V pieces of the whole step are gathered to
rank 0 in one collective (``tp_heads``). A family whose MTP layer owns its KV (MiMo) hands off h rows instead
of K/V rows (``hidden_rows.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_hyco.engine_contract import Handoff, HandoffSeed, KVRows
from vllm_hyco.kernels import gather_quantize_kv, handoff_gather_quantize, quantize_int8
from vllm_hyco.models import HIDDEN
from vllm_hyco.vllm_adapter.worker import hidden_rows, tp_heads
from vllm_hyco.vllm_adapter.worker.kv_view import slots_for_positions
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows
from vllm_hyco.vllm_adapter.worker.tree_step import StepDecision, StepTrees, cache_layer, kv_layers, slot_mapping


def handoff_scales(runner: Any) -> dict[str, Any]:
    """The model's fixed int8 scales on the device: ``{"e", "h", kind: (k, v)}`` (loaded once)."""
    st = runner.hyco
    if st.scales is None:
        from vllm_hyco.handoff.server_model import ServerModel

        model = ServerModel.load(runner.model_config.model, st.window)
        dev = runner.device

        def to_device(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        out = {"e": to_device(model.scales.e), "h": to_device(model.scales.h)}
        for spec in model.spec.layers:
            if spec.kind == HIDDEN:  # h rows: h's scales
                continue
            k, v = model.scales.layer(spec.layer_id)
            out[spec.kind] = (to_device(k), to_device(v) if v is not None else to_device(k))
        st.scales = out
    return st.scales


def handoff(runner: Any, step: StepTrees, dec: StepDecision, hidden: torch.Tensor | None) -> list[Handoff | None]:
    """Per tree: the int8 hand-off (D1) gathered after compaction (``kernels.handoff_gather_quantize``: K and
    V rows of both hand-off layers, h at v* and e(bonus), quantized on the device), one copy to the host.

    Under TP each rank quantizes its own KV heads with its slice of the per-head scales, and the K/V rows
    of every tree and every round-0 seed of the step are gathered across ranks in one collective
    (``tp_heads.gather_heads``); the other ranks return None (only rank 0's output reaches the scheduler)."""
    scales = handoff_scales(runner)
    shard = head_shard(runner)
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
    h_rows = _hidden_rows(runner, step, dec, hidden, lengths) if runner.hyco.hidden_rows else None
    layers, lays = {}, []
    for kind, name in kv_layers(runner).handoff.items():
        lay = cache_layer(runner, name)
        if lay is not None:
            layers[kind] = name
            lays.append((kind, lay))
    views = [lay.view.kv_views(lay.layer.kv_cache) for _, lay in lays]
    local = [k.shape[2] for k, _ in views]  # this rank's KV heads of each hand-off layer
    q = handoff_gather_quantize(
        [k for k, _ in views], [v for _, v in views],
        [slot_mapping(runner, lay.group).to(dev)[pos] for _, lay in lays],
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
    # the seeds (round 0, the round after server mode): (start, end, {kind: (k, v)}) of this rank's heads
    seeds = {b: _seed(runner, tr, layers, scales, tr.context_len + len(dec.path_rows[b]) + 1, shard)
             for b, tr in enumerate(step.trees) if tr.seed}
    hidden_seeds = {b: hidden_rows.seed(runner, tr.req_id, tr.context_len + len(dec.path_rows[b]) + 1, e)
                    for b, tr in enumerate(step.trees) if tr.seed and h_rows is not None}
    seed_pieces = [(b, kind) for b in seeds for kind in layers]
    for b, kind in seed_pieces:
        kv += list(seeds[b][2][kind])
        heads += [total[kind]] * 2
    kv = tp_heads.gather_heads(kv, shard, heads)  # one all_gather for the whole step (none on one rank)
    if shard.rank != 0:
        return [None for _ in step.trees]
    gathered = iter(kv[len(names):])
    seed_rows: dict[int, dict[str, KVRows]] = {b: {} for b in seeds}
    for b, kind in seed_pieces:
        seed_rows[b][kind] = KVRows(next(gathered).cpu(), next(gathered).cpu())
    parts, names = [q.e, q.h, *kv[: len(names)]], ["e_bonus", "h", *names]
    if h_rows is not None:  # complete on every rank (hidden states are all-reduced): no head gather
        parts, names = parts + [h_rows], names + [f"{HIDDEN}_k"]
        layers[HIDDEN] = HIDDEN
        for b, (start, rows) in hidden_seeds.items():  # h rows only (no K/V layer): their start is the seed's
            seeds[b] = (start, seeds[b][1], seeds[b][2])
            seed_rows[b][HIDDEN] = KVRows(rows.cpu(), rows.cpu())
    sizes = [p.numel() for p in parts]
    host = torch.cat([p.flatten() for p in parts]).cpu() if parts else torch.empty(0, dtype=torch.int8)
    pieces = dict(zip(names, torch.split(host, sizes)))
    starts = [sum(lengths[:b]) for b in range(num)]
    out: list[Handoff | None] = []
    for b, tr in enumerate(step.trees):
        d = len(dec.path_rows[b])

        def rows_of(kv_name: str, b: int = b, d: int = d) -> torch.Tensor:
            kv_rows = pieces[kv_name].view(-1, *parts[names.index(kv_name)].shape[1:])
            return kv_rows[starts[b]: starts[b] + d + 1]

        seed = HandoffSeed(seeds[b][0], seeds[b][1], seed_rows[b]) if b in seeds else None
        out.append(Handoff(position=tr.context_len + d, start=tr.context_len,
                           e_bonus=pieces["e_bonus"].view(num, -1)[b], h=pieces["h"].view(num, -1)[b],
                           layers=dict(layers), kv={kind: KVRows(rows_of(f"{kind}_k"), rows_of(
                               f"{kind}_v" if kind != HIDDEN else f"{kind}_k")) for kind in layers}, seed=seed))
    return out


def _hidden_rows(runner: Any, step: StepTrees, dec: StepDecision, hidden: torch.Tensor | None,
                 lengths: list[int]) -> torch.Tensor:
    """int8 [rows, 1, hidden]: h of every tree's root and accepted path (tree rows 0 and ``path_rows``, not
    yet compacted in ``hidden``), recorded in the sessions' rings for later seeds."""
    assert hidden is not None, "a family with hidden hand-off rows needs the step's hidden states"
    idx = [tr.q_start + r for tr, p in zip(step.trees, dec.path_rows) for r in (0, *p)]
    rows = hidden[torch.tensor(idx, dtype=torch.int64).to(hidden.device)]
    at = 0
    for tr, n in zip(step.trees, lengths):
        hidden_rows.record_rows(runner, tr.req_id, tr.context_len, rows[at: at + n])
        at += n
    return quantize_int8(rows.float(), runner.hyco.scales["h"])[:, None, :]


def head_shard(runner: Any) -> tp_heads.HeadShard:
    """This rank's place in the tensor-parallel group (read once)."""
    st = runner.hyco
    if st.shard is None:
        st.shard = tp_heads.shard_of(runner)
    return st.shard


def _seed(runner: Any, tr: TreeRows, layers: dict[str, str], scales: dict[str, Any], num_committed: int,
          shard: tp_heads.HeadShard) -> tuple[int, int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(start, end, {kind: (K, V)}): the int8 K/V of positions [start, end) = [max(0, T - W), T) of the
    hand-off layers, read from the paged cache: this rank's KV heads, on the device (the caller gathers
    every head and copies them to the host)."""
    lo = max(0, num_committed - runner.hyco.window)
    positions = torch.arange(lo, num_committed, dtype=torch.int64)
    rows = {}
    for kind, name in layers.items():
        lay = cache_layer(runner, name)
        assert lay is not None, name
        table = runner.input_batch.block_table[lay.group]
        slots = slots_for_positions(table.block_table.gpu[tr.batch_idx], positions, table.block_size)
        k_view, v_view = lay.view.kv_views(lay.layer.kv_cache)
        k_scale, v_scale = (shard.scale_slice(s, k_view.shape[2]) for s in scales[kind])
        rows[kind] = (gather_quantize_kv(k_view, slots, k_scale), gather_quantize_kv(v_view, slots, v_scale))
    return lo, num_committed, rows
