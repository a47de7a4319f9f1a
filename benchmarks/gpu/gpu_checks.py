"""Compiled-kernel checks for a GPU machine (torch + Triton, no vLLM, no pytest needed).

Runs Gemma-4-shaped cases the CPU interpreter cannot afford (contexts to 32K, head_dim 256/512, bf16,
automatic key splits), KV compaction over 30 layers, the int8 hand-off bit for bit, and replays recorded
engine batches (``benchmarks/gpu/replay/*.pt``) plus one synthetic recording. Every check compares the
Triton kernel with the torch twin on the same GPU; tolerances come from ``tests/tolerances.py``.

    python benchmarks/gpu/gpu_checks.py --out $OUT/gpu_checks.json
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu/gpu_checks.py --smoke   # CPU dry run, tiny shapes
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tolerances import tol  # noqa: E402

from vllm_hyco.kernels import (  # noqa: E402
    TreeAttentionMetadata,
    compact_kv,
    compaction_moves,
    gather_quantize_kv,
    quantize_int8,
    tree_attention,
)
from vllm_hyco.kernels.replay import record_tree_attention_case, replay_tree_attention_case  # noqa: E402

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHRINK = 1  # --smoke divides contexts and sizes by 64 so the script can be dry-run under the interpreter


def tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1, 0, 1, 2, 3][:n] + [rng.randrange(max(0, j - 8), j) for j in range(5, n)]


# name: (prefix_lens, rows, hq, hkv, dim, block_size, window, softcap, k_eq_v)
ATTN_CASES = {
    "sliding_4k_b2": ([4096, 4000], [tree(33, 1), tree(20, 2)], 16, 8, 256, 16, 1024, None, False),
    "sliding_32k_b1": ([32768], [tree(33, 3)], 16, 8, 256, 16, 1024, None, False),
    "full_32k_b1_keqv": ([32768], [tree(33, 4)], 16, 4, 512, 16, None, None, True),
    "full_8k_b4_keqv": ([8192, 100, 5000, 1], [tree(33, 5), tree(33, 6), tree(7, 7), tree(1, 8)], 16, 4, 512,
                        16, None, None, True),
    "mixed_prefill_decode": ([2000, 0, 777, 4095], [tree(33, 9), 512, 1, tree(33, 10)], 16, 8, 256, 16, 1024,
                             None, False),
    "softcap_bs32": ([3000], [tree(33, 11)], 8, 4, 256, 32, None, 50.0, False),
    "gqa3_d128": ([1500, 1499], [tree(33, 12), tree(33, 13)], 12, 4, 128, 16, 256, None, False),
}


def attn_case(name: str, dtype: torch.dtype, seed: int = 0) -> dict:
    prefix, rows, hq, hkv, dim, bs, window, cap, k_eq_v = ATTN_CASES[name]
    prefix = [t // SHRINK for t in prefix]
    window = window // SHRINK if window else window
    meta = TreeAttentionMetadata.make_dummy(prefix, rows, bs, seed=seed).to(DEVICE)
    nb = int(meta.block_table.max()) + 2
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    kv = torch.randn(nb, hkv, bs, 2 * dim, generator=g, device=DEVICE).to(dtype)  # vLLM storage [B, H, N, 2D]
    k, v = kv.transpose(1, 2).split(dim, dim=-1)
    v = k if k_eq_v else v
    q = torch.randn(meta.depths.shape[0], hq, dim, generator=g, device=DEVICE).to(dtype)
    return dict(q=q, k=k, v=v, meta=meta, scale=dim ** -0.5, window=window, cap=cap)


def check_attention(name: str, dtype_name: str) -> dict:
    dtype = DT[dtype_name]
    c = attn_case(name, dtype)
    args = (c["q"], c["k"], c["v"], c["meta"], c["scale"], c["window"], c["cap"])
    got = tree_attention(*args, backend="triton")
    want = tree_attention(*args, backend="torch")
    t = tol("attention", dtype)
    diff = (got.float() - want.float()).abs()
    bound = t["atol"] + t["rtol"] * want.float().abs()
    ok = bool((diff <= bound).all() and torch.isfinite(got).all())
    return {"max_abs_diff": float(diff.max()), "ok": ok}


def _group_moves(prefix, accepted, bs):
    per = [-(-(t + 33) // bs) for t in prefix]
    ids = torch.randperm(sum(per)).tolist()
    table = torch.zeros(len(prefix), max(per), dtype=torch.int32)
    for r, n in enumerate(per):
        table[r, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    return (*compaction_moves(table, bs, prefix, accepted), sum(per))


def check_compaction(dtype_name: str) -> dict:
    """30 Gemma-like layers (25 sliding [B,N,8,2*256] + 5 full [B,N,4,512]) in one launch vs the twin."""
    dtype, rng = DT[dtype_name], random.Random(0)
    prefix = [rng.randint(0, 3000 // SHRINK) for _ in range(16)]
    accepted = [[0] + sorted(rng.sample(range(1, 33), rng.randint(0, 8))) for _ in prefix]
    s16, d16, loc, nb16 = _group_moves(prefix, accepted, 16)
    s32, d32, _, nb32 = _group_moves(prefix, accepted, 32)
    n_sliding, n_full = (25, 5) if SHRINK == 1 else (2, 1)
    layers = [torch.randn(nb16, 8, 16, 512, device=DEVICE).to(dtype).transpose(1, 2)
              for _ in range(n_sliding)]
    layers += [torch.randn(nb32, 32, 4, 512, device=DEVICE).to(dtype) for _ in range(n_full)]
    groups = [0] * n_sliding + [1] * n_full
    twin = [x.clone() for x in layers]
    s2, d2 = torch.stack([s16, s32]).to(DEVICE), torch.stack([d16, d32]).to(DEVICE)
    compact_kv(twin, s2, d2, loc.to(DEVICE), groups, backend="torch")
    compact_kv(layers, s2, d2, loc.to(DEVICE), groups, backend="triton")
    same = all(torch.equal(a, b) for a, b in zip(layers, twin))
    return {"ok": same, "moves": int(s2.shape[1]), "layers": len(layers)}


def check_handoff(dtype_name: str) -> dict:
    dtype = DT[dtype_name]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    cache = torch.randn(64, 16, 8, 256, generator=g, device=DEVICE).to(dtype) * 3
    scale = torch.rand(8, 256, generator=g, device=DEVICE) * 0.05 + 0.005
    slots = torch.randperm(64 * 16, device=DEVICE)[: 1024 // SHRINK]
    a = gather_quantize_kv(cache, slots, scale, backend="triton")
    b = gather_quantize_kv(cache, slots, scale, backend="torch")
    x = torch.randn(64 // SHRINK + 1, 2816, generator=g, device=DEVICE).to(dtype) * 2
    xs = torch.rand(2816, generator=g, device=DEVICE) * 0.03 + 0.001
    ties = (torch.randint(-200, 200, x.shape, generator=g, device=DEVICE).float() + 0.5) * xs
    ok_vec = all(torch.equal(quantize_int8(v, xs, backend="triton"), quantize_int8(v, xs, backend="torch"))
                 for v in (x, ties))
    return {"ok": bool(torch.equal(a, b)) and ok_vec, "mismatches": int((a != b).sum())}


def check_replays(tmp: Path) -> list[dict]:
    c = attn_case("mixed_prefill_decode", torch.bfloat16, seed=3)
    synthetic = record_tree_attention_case(tmp / "synthetic_mixed.pt", c["q"], c["k"], c["v"], c["meta"],
                                           c["scale"], c["window"], None, note="synthetic, twin output")
    out = []
    for path in sorted(glob.glob(str(ROOT / "benchmarks/gpu/replay/*.pt"))) + [str(synthetic)]:
        rep = replay_tree_attention_case(path, backend="triton", device=DEVICE)
        t = tol("attention", getattr(torch, rep["dtype"].removeprefix("torch.")))
        rep["ok"] = rep["finite"] and rep["max_abs_diff"] <= t["atol"] + t["rtol"] * rep["max_abs_out"]
        out.append(rep)
    return out


def compiled_resources() -> list[dict]:
    """Registers, spills and shared memory of every kernel variant compiled in this run (best effort)."""
    from vllm_hyco.kernels._triton import handoff_gather, kv_compaction, tree_attention as ta

    kernels = {"tree_attention": ta.tree_attention_kernel, "reduce": ta.tree_attention_reduce_kernel,
               "compact_kv": kv_compaction.compact_kv_kernel,
               "gather_quantize_kv": handoff_gather.gather_quantize_kv_kernel}
    rows = []
    for name, fn in kernels.items():
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for compiled in getattr(cache, "values", lambda: [])():
                meta = getattr(compiled, "metadata", None)
                rows.append({"kernel": name, "n_regs": getattr(compiled, "n_regs", None),
                             "n_spills": getattr(compiled, "n_spills", None),
                             "shared": getattr(meta, "shared", None),
                             "num_warps": getattr(meta, "num_warps", None)})
    return rows


def run_all(out_path: Path) -> dict:
    cuda = DEVICE == "cuda"
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter smoke run)",
              "torch": torch.__version__, "shrink": SHRINK,
              "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
              "checks": []}
    import triton

    report["triton"] = triton.__version__
    jobs = [(f"attention/{n}/{d}", check_attention, (n, d)) for n in ATTN_CASES for d in ("bf16", "fp32")]
    jobs += [("attention/sliding_4k_b2/fp16", check_attention, ("sliding_4k_b2", "fp16"))]
    jobs += [(f"compaction/{d}", check_compaction, (d,)) for d in ("bf16", "fp32")]
    jobs += [(f"handoff/{d}", check_handoff, (d,)) for d in ("bf16", "fp16", "fp32")]
    for name, fn, args in jobs:
        t0 = time.time()
        try:
            res = fn(*args)
        except Exception as e:  # record and go on: one failure must not hide the others
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        res.update(name=name, seconds=round(time.time() - t0, 2))
        print(json.dumps({k: v for k, v in res.items() if k != "trace"}), flush=True)
        report["checks"].append(res)
        out_path.write_text(json.dumps(report, indent=1))
    try:
        for rep in check_replays(out_path.parent):
            rep["name"] = f"replay/{Path(rep['case']).name}"
            report["checks"].append(rep)
            print(json.dumps(rep), flush=True)
    except Exception as e:
        report["checks"].append({"name": "replay", "ok": False, "error": f"{type(e).__name__}: {e}"})
    try:
        report["compiled_resources"] = compiled_resources()
    except Exception as e:
        report["compiled_resources"] = f"unavailable: {type(e).__name__}: {e}"
    report["all_ok"] = all(c.get("ok") for c in report["checks"])
    out_path.write_text(json.dumps(report, indent=1))
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks/out/gpu/gpu_checks.json"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU dry run under TRITON_INTERPRET=1)")
    args = p.parse_args()
    global SHRINK
    SHRINK = 64 if args.smoke else 1
    if DEVICE != "cuda" and not args.smoke:
        raise SystemExit("gpu_checks.py needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = run_all(out)
    print(f"all_ok={report['all_ok']} -> {out}")


if __name__ == "__main__":
    main()
