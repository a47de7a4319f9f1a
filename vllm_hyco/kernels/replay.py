"""Record tree-attention calls (metadata, inputs, output) and replay them against another backend.

The CPU engine records a few real tree batches (its twin output included) with
:func:`record_tree_attention_case`; ``tests/kernels/test_kernels_replay.py`` replays every
``benchmarks/gpu/replay/*.pt`` through the Triton kernel (the interpreter on CPU, the compiled kernel when
run by hand on a GPU), so the kernel sees the metadata the engine really produces. The GPU check script
no longer runs them: they are tiny fp32 batches, not the variant the engine launches on a GPU. The caches
are stored compactly: only the blocks the batch uses, renumbered.

K/V must be given in the Triton layout ``[num_blocks, block_size, num_kv_heads, head_dim]``; the CPU
engine converts its own (K-transposed) layout first, or records gathered K/V through a trivial block table
(one request's keys laid out in order).
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_hyco.kernels.tree_attention import TreeAttentionMetadata, _same_storage, tree_attention_ref

FORMAT = "hyco-tree-attention-case-v1"
_META = ("query_start_loc", "seq_lens", "block_table", "ancestor_mask", "depths")


def record_tree_attention_case(
    path: str | Path,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    note: str = "",
) -> Path:
    """Save one call. ``out`` is the recorder's result (default: the torch twin's). Returns the path."""
    if out is None:
        out = tree_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, softcap)
    bs = k_cache.shape[1]
    needed = (meta.seq_lens.to(torch.int64) + bs - 1) // bs  # [num_reqs]
    cols = torch.arange(meta.block_table.shape[1], device=meta.block_table.device)
    used_mask = cols.view(1, -1) < needed.view(-1, 1)  # [num_reqs, max_blocks]
    used = torch.unique(meta.block_table[used_mask].to(torch.int64))
    remap = torch.zeros(k_cache.shape[0], dtype=torch.int64, device=used.device)
    remap[used] = torch.arange(used.numel(), device=used.device)
    table = torch.where(used_mask, remap[meta.block_table.to(torch.int64)], 0).to(torch.int32)
    k_eq_v = _same_storage(k_cache, v_cache)
    case = {
        "format": FORMAT, "note": note, "scale": float(scale), "sliding_window": sliding_window,
        "softcap": softcap, "k_eq_v": k_eq_v,
        "max_query_len": meta.max_query_len, "max_seq_len": meta.max_seq_len,
        "q": q.cpu(), "out": out.cpu(), "k_cache": k_cache[used].cpu().contiguous(),
        "v_cache": None if k_eq_v else v_cache[used].cpu().contiguous(),
        **{name: getattr(meta, name).cpu() for name in _META if name != "block_table"},
        "block_table": table.cpu(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(case, path)
    return path


def load_tree_attention_case(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """The recorded call as ready-to-use tensors on ``device`` (``meta`` is a TreeAttentionMetadata)."""
    case = torch.load(path, map_location="cpu", weights_only=True)
    if case.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    meta = TreeAttentionMetadata(
        **{name: case[name] for name in _META},
        max_query_len=case["max_query_len"], max_seq_len=case["max_seq_len"],
    ).to(device)
    k = case["k_cache"].to(device)
    v = k if case["k_eq_v"] else case["v_cache"].to(device)
    return {**case, "meta": meta, "q": case["q"].to(device), "k_cache": k, "v_cache": v}


def replay_tree_attention_case(path: str | Path, backend: str = "auto", device: str | None = None) -> dict:
    """Run the recorded call through ``backend``; report the max abs difference to the recorded output."""
    from vllm_hyco.kernels import tree_attention

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    c = load_tree_attention_case(path, device)
    got = tree_attention(c["q"], c["k_cache"], c["v_cache"], c["meta"], c["scale"], c["sliding_window"],
                         c["softcap"], backend=backend)
    diff = (got.float().cpu() - c["out"].float()).abs()
    return {
        "case": str(path), "note": c["note"], "dtype": str(c["q"].dtype), "rows": c["q"].shape[0],
        "reqs": c["meta"].num_reqs, "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "max_abs_out": float(c["out"].float().abs().max()) if diff.numel() else 0.0,
        "finite": bool(torch.isfinite(got).all()),
    }


def record_dense_calls(path: str | Path, calls: list[dict], block_size: int = 16, note: str = "") -> Path:
    """Pack recorded :func:`tree_attention_dense_ref` calls (one request each) into one paged batch case.

    Each call dict holds that function's arguments (``q, k, v, prefix_len, ancestor_mask, depths, scale,
    sliding_window, softcap, key_offset``) and its result ``out``. All calls must share heads, head_dim,
    dtype, scale, window and softcap. Keys sit in consecutive blocks per request (a shortened prefix
    ``prefix_len - key_offset`` is equivalent: visibility depends on position differences only).
    """
    first = calls[0]
    keys = ("scale", "sliding_window", "softcap")
    if any(tuple(c.get(k) for k in keys) != tuple(first.get(k) for k in keys) for c in calls):
        raise ValueError("record_dense_calls: every call must share scale, window and softcap")
    k_eq_v = all(c["k"] is c["v"] for c in calls)
    k_blocks, v_blocks, table_rows, qsl, seq_lens = [], [], [], [0], []
    for c in calls:
        s = c["k"].shape[0]
        nb = -(-s // block_size)
        pad = nb * block_size - s
        kp = torch.nn.functional.pad(c["k"].detach().cpu(), (0, 0, 0, 0, 0, pad))  # [nb * bs, H, D]
        vp = torch.nn.functional.pad(c["v"].detach().cpu(), (0, 0, 0, 0, 0, pad))
        start = sum(x.shape[0] for x in k_blocks)
        table_rows.append(list(range(start, start + nb)))
        k_blocks.append(kp.view(nb, block_size, *kp.shape[1:]))
        v_blocks.append(vp.view(nb, block_size, *vp.shape[1:]))
        qsl.append(qsl[-1] + c["q"].shape[0])
        seq_lens.append(s)
    width = max(len(r) for r in table_rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in table_rows], dtype=torch.int32)
    meta = TreeAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        ancestor_mask=torch.cat([c["ancestor_mask"].cpu().to(torch.int64) for c in calls]),
        depths=torch.cat([c["depths"].cpu().to(torch.int32) for c in calls]),
        max_query_len=max(c["q"].shape[0] for c in calls), max_seq_len=max(seq_lens),
    )
    k_cache = torch.cat(k_blocks)
    v_cache = k_cache if k_eq_v else torch.cat(v_blocks)
    q = torch.cat([c["q"].detach().cpu() for c in calls])
    out = torch.cat([c["out"].detach().cpu() for c in calls])
    return record_tree_attention_case(path, q, k_cache, v_cache, meta, first["scale"],
                                      first.get("sliding_window"), first.get("softcap"), out=out, note=note)
