"""Tree attention benchmark: a 33-row tree per request against decode and dense-mask baselines.

Providers (per point: layer type x context x batch):
  triton        the paged tree kernel, 33 rows per request (CUDA only)
  triton_1row   the same kernel on one decode row per request (CUDA only)
  twin          the torch twin (gathers each request's K/V, dense fp32 math)
  sdpa_mask     torch SDPA with a dense boolean tree mask over pre-gathered contiguous K/V
  sdpa_1row     torch SDPA over contiguous K/V for one decode row (flash decode where SDPA has it)
  flex          FlexAttention with a tree mask_mod over contiguous K/V (compiled; GPU, where present)
Sliding layers give the SDPA/flex baselines only the keys inside the window (a fair dense baseline).

Layer shapes are inferred from docs/decisions.md (Gemma-4 26B-A4B, D1 byte counts; no config is available):
sliding = 16 query / 8 KV heads, head_dim 256, window 1,024; full = 16 query / 4 KV heads, head_dim 512,
k_eq_v. Ratios are computed inside one run only; CPU timings are labelled CPU-measured (D8).

    .venv/bin/python benchmarks/bench_tree_attention.py            # small CPU subset -> benchmarks/out/
    python benchmarks/bench_tree_attention.py --sweep gpu --out $OUT/bench_tree_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hyco.kernels import HAS_TRITON, TreeAttentionMetadata  # noqa: E402
from vllm_hyco.kernels.tree_attention import (  # noqa: E402
    tree_attention_ref,
    tree_attention_triton,
    visibility_mask,
)

LAYERS = {
    "sliding": dict(hq=16, hkv=8, dim=256, window=1024, k_eq_v=False),
    "full": dict(hq=16, hkv=4, dim=512, window=None, k_eq_v=True),
}
SWEEPS = {
    "cpu": dict(contexts=[1024, 2048], batches=[1, 2], layers=["sliding", "full"]),
    # longest contexts first, so a time budget drops the least interesting points
    "gpu": dict(contexts=[32768, 16384, 8192, 4096, 1024], batches=[1, 4, 16, 64],
                layers=["sliding", "full"]),
}
BLOCK_SIZE = 16


def hyco_tree(n: int = 33, seed: int = 0) -> list[int]:
    """A HyCo-like tree: a chain of 4 from the root plus bushy SLM expansions (parents list)."""
    rng = random.Random(seed)
    parents = [-1, 0, 1, 2, 3]
    while len(parents) < n:
        parents.append(rng.randrange(max(0, len(parents) - 8), len(parents)))
    return parents


def time_ms(fn, device: str, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_point(layer: dict, ctx: int, batch: int, device: str, dtype: torch.dtype):
    """Paged caches + metadata for `batch` requests of `ctx` committed tokens and one 33-row tree each."""
    parents = hyco_tree()
    meta_tree = TreeAttentionMetadata.make_dummy([ctx] * batch, [parents] * batch, BLOCK_SIZE)
    meta_1row = TreeAttentionMetadata(  # the same caches, one decode row at index ctx
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx + 1, dtype=torch.int32),
        block_table=meta_tree.block_table, ancestor_mask=torch.zeros(batch, dtype=torch.int64),
        depths=torch.zeros(batch, dtype=torch.int32), max_query_len=1, max_seq_len=ctx + 1,
    )
    num_blocks = int(meta_tree.block_table.max()) + 1
    shape = (num_blocks, BLOCK_SIZE, layer["hkv"], layer["dim"])
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = k_cache if layer["k_eq_v"] else torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(batch * len(parents), layer["hq"], layer["dim"], device=device, dtype=dtype)
    return q, k_cache, v_cache, meta_tree.to(device), meta_1row.to(device), parents


def contiguous_kv(k_cache, v_cache, meta, start: int):
    """[batch, kv_heads, keys, D] K/V of cache indices [start, seq_len) of every request."""
    seq = int(meta.seq_lens[0])
    idx = torch.arange(start, seq, device=k_cache.device)
    blocks = meta.block_table.long()[:, idx // BLOCK_SIZE]  # [batch, keys]
    k = k_cache[blocks, idx % BLOCK_SIZE].transpose(1, 2).contiguous()
    v = k if v_cache is k_cache else v_cache[blocks, idx % BLOCK_SIZE].transpose(1, 2).contiguous()
    return k, v


def providers(layer, ctx, batch, device, dtype, wanted):
    """name -> zero-argument callable, for the providers that exist here."""
    q, kc, vc, meta, meta1, parents = build_point(layer, ctx, batch, device, dtype)
    scale, window = 1 / math.sqrt(layer["dim"]), layer["window"]
    n = len(parents)
    start = max(0, ctx - window + 1) if window else 0  # first key any row can see
    kq, vq = contiguous_kv(kc, vc, meta, start)
    vis = visibility_mask(n, ctx, meta.ancestor_mask[:n], meta.depths[:n], window)[:, start:]  # [33, keys]
    q4 = q.view(batch, n, layer["hq"], layer["dim"]).transpose(1, 2)  # [batch, hq, 33, D]
    q1 = q4[:, :, :1].contiguous()
    k1, v1 = kq[:, :, : ctx + 1 - start], vq[:, :, : ctx + 1 - start]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fns = {
        "twin": lambda: tree_attention_ref(q, kc, vc, meta, scale, window),
        "sdpa_mask": lambda: sdpa(q4, kq, vq, attn_mask=vis, scale=scale, enable_gqa=True),
        "sdpa_1row": lambda: sdpa(q1, k1, v1, scale=scale, enable_gqa=True),
    }
    if HAS_TRITON and device == "cuda":
        q_1row = q.view(batch, n, layer["hq"], layer["dim"])[:, 0].contiguous()
        fns["triton"] = lambda: tree_attention_triton(q, kc, vc, meta, scale, window)
        fns["triton_1row"] = lambda: tree_attention_triton(q_1row, kc, vc, meta1, scale, window)
    if "flex" in wanted:
        flex = _flex_fn(q4, kq, vq, vis, scale, device)
        if flex is not None:
            fns["flex"] = flex
    return {k: v for k, v in fns.items() if k in wanted}


def _flex_fn(q4, kq, vq, vis, scale, device):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    mask = vis.to(q4.device)

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx, kv_idx]

    block = create_block_mask(mask_mod, None, None, q4.shape[2], kq.shape[2], device=device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q4, kq, vq, block_mask=block, scale=scale, enable_gqa=True)


def ratios(rows: list[dict]) -> list[dict]:
    """Per point: triton tree / 1-row decode, and dense-mask SDPA / triton tree (issue 5's goals)."""
    by_point: dict[tuple, dict] = {}
    for r in rows:
        if r.get("ms") is not None:
            by_point.setdefault((r["layer"], r["context"], r["batch"]), {})[r["provider"]] = r["ms"]
    out = []
    for (layer, ctx, batch), ms in sorted(by_point.items()):
        entry = {"layer": layer, "context": ctx, "batch": batch}
        tree = ms.get("triton")
        if tree and ms.get("sdpa_1row"):
            entry["triton_over_sdpa_1row"] = tree / ms["sdpa_1row"]
        if tree and ms.get("triton_1row"):
            entry["triton_over_triton_1row"] = tree / ms["triton_1row"]
        if tree and ms.get("sdpa_mask"):
            entry["sdpa_mask_over_triton"] = ms["sdpa_mask"] / tree
        if ms.get("twin") and ms.get("sdpa_mask"):
            entry["twin_over_sdpa_mask"] = ms["twin"] / ms["sdpa_mask"]
        out.append(entry)
    return out


def run(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    sweep = SWEEPS[args.sweep]
    wanted = set(args.providers.split(",")) if args.providers else {
        "triton", "triton_1row", "twin", "sdpa_mask", "sdpa_1row"} | ({"flex"} if device == "cuda" else set())
    rows, t_start = [], time.time()
    for ctx in args.contexts or sweep["contexts"]:
        for batch in args.batches or sweep["batches"]:
            for layer_name in args.layers or sweep["layers"]:
                if time.time() - t_start > args.time_budget:
                    rows.append({"layer": layer_name, "context": ctx, "batch": batch,
                                 "skipped": "time budget"})
                    continue
                rows += run_point(layer_name, ctx, batch, device, dtype, wanted, args)
                _write(args.out, _report(rows, device, args))
    return _report(rows, device, args)


def run_point(layer_name, ctx, batch, device, dtype, wanted, args) -> list[dict]:
    layer, out = LAYERS[layer_name], []
    want = set(wanted)
    if batch * ctx > args.twin_max_keys:
        want.discard("twin")  # the twin loops over requests in Python; keep the sweep inside its budget
    if batch > args.flex_max_batch or (args.flex_contexts and ctx not in args.flex_contexts):
        want.discard("flex")  # one compile per shape: keep it to a few points
    try:
        fns = providers(layer, ctx, batch, device, dtype, want)
    except torch.OutOfMemoryError as e:  # pragma: no cover - GPU only
        return [{"layer": layer_name, "context": ctx, "batch": batch, "error": f"OOM: {e}"[:200]}]
    for name, fn in fns.items():
        entry = {"layer": layer_name, "context": ctx, "batch": batch, "rows": 33, "provider": name}
        try:
            entry["ms"] = time_ms(fn, device, args.reps)
        except Exception as e:  # a provider that cannot run this shape (e.g. flex at head_dim 512)
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps(entry), flush=True)
        out.append(entry)
    del fns
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _report(rows, device, args) -> dict:
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "label": f"GPU-measured on {name}" if device == "cuda"
        else "CPU-measured (ratios within this run only)",
        "device": name, "torch": torch.__version__, "triton": triton_version, "dtype": args.dtype,
        "layers": LAYERS, "block_size": BLOCK_SIZE, "tree_rows": 33, "reps": args.reps,
        "points": rows, "ratios": ratios(rows),
    }


def _write(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", choices=sorted(SWEEPS), default=None, help="default: gpu on CUDA, else cpu")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    p.add_argument("--layers", nargs="*", choices=sorted(LAYERS))
    p.add_argument("--contexts", nargs="*", type=int)
    p.add_argument("--batches", nargs="*", type=int)
    p.add_argument("--providers", default=None, help="comma list; default: all that exist here")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds; later points are skipped")
    p.add_argument("--twin-max-keys", type=int, default=256 * 1024)
    p.add_argument("--flex-max-batch", type=int, default=1)
    p.add_argument("--flex-contexts", nargs="*", type=int, default=[32768, 4096])
    p.add_argument("--out", default="benchmarks/out/bench_tree_attention.json")
    args = p.parse_args(argv)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    args.sweep = args.sweep or ("gpu" if cuda else "cpu")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.reps = args.reps or (20 if cuda else 3)
    report = run(args)
    _write(args.out, report)
    for r in report["ratios"]:
        print(json.dumps(r))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
