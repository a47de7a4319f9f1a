"""Compile the kernels ahead of time for a GPU architecture on a machine without a GPU; report resources.

Uses the launcher's own tile choice (``tree_attention._launch_config``) for Gemma-4 layer shapes. Each
kernel is compiled through Triton to a cubin for ``sm_<arch>``, and the cubin's registers, stack (register
spills) and shared memory are read with the ``cuobjdump`` bundled in the Triton wheel. A config with stack > 0
spills; shared memory above the architecture's limit fails at launch. This checks codegen only: numbers
and speed still need a GPU.

    .venv/bin/python benchmarks/gpu/aot_compile_check.py [--arch 90] [--out benchmarks/out/aot_sm90.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_hyco.kernels._backend import next_pow2  # noqa: E402
from vllm_hyco.kernels._triton.handoff_gather import (  # noqa: E402
    gather_quantize_kv_kernel,
    quantize_int8_kernel,
)
from vllm_hyco.kernels._triton.kv_compaction import compact_kv_kernel  # noqa: E402
from vllm_hyco.kernels._triton.tree_attention import tree_attention_kernel  # noqa: E402
from vllm_hyco.kernels.tree_attention import _launch_config  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
TRITON_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
LAYERS = {"sliding": (16, 8, 256, 1024, False), "full": (16, 4, 512, 0, True)}  # hq, hkv, D, window, k_eq_v


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, arch: int) -> dict:
    full_signature = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=full_signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        Path(path).write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(CUOBJDUMP), "-res-usage", path], capture_output=True, text=True)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res.stdout + res.stderr)
    regs, stack = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    shared = kernel.metadata.shared
    ok = stack == 0 and shared <= SHARED_LIMIT.get(arch, 227 * 1024)
    return {"registers": regs, "stack_bytes": stack, "shared_bytes": shared, "ok": ok}


def tree_signature(dtype: torch.dtype) -> dict:
    t = TRITON_DT[dtype]
    sig = {n: f"*{t}" for n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")}
    sig.update(part_ptr="*fp32", lse_ptr="*fp32", block_table_ptr="*i32", query_start_ptr="*i32",
               seq_lens_ptr="*i32", mask_ptr="*i64", depth_ptr="*i32", scale="fp32", softcap="fp32")
    for n in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh",
              "stride_vb", "stride_vs", "stride_vh", "stride_bt", "num_splits"):
        sig[n] = "i32"
    return sig


def tree_case(layer: str, dtype: torch.dtype, split: bool, arch: int) -> dict:
    hq, hkv, dim, window, k_eq_v = LAYERS[layer]
    qpk = hq // hkv
    qpk_p, dim_p = next_pow2(qpk), max(16, next_pow2(dim))
    fp32_dot = dtype == torch.float32
    block_q, tile_n, warps = _launch_config(dim_p, qpk_p, 33, fp32_dot)
    consts = dict(NUM_Q_HEADS=hq, SPLIT=split, QPK=qpk, QPK_P=qpk_p, HEAD_DIM=dim, HEAD_DIM_P=dim_p,
                  BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_q * qpk_p, TILE_N=tile_n, WINDOW=window,
                  USE_SOFTCAP=False, K_EQ_V=k_eq_v, UPCAST=False, DOT_PREC="ieee" if fp32_dot else "tf32")
    res = resources(tree_attention_kernel, tree_signature(dtype), consts, warps, 2, arch)
    return {"kernel": "tree_attention", "layer": layer, "dtype": TRITON_DT[dtype], "split": split,
            "BLOCK_M": block_q * qpk_p, "TILE_N": tile_n, "num_warps": warps, **res}


def other_cases(arch: int) -> list[dict]:
    """KV compaction (int64 -> pointer casts) and the int8 hand-off kernels, at their launch settings."""
    cases = [
        ("compact_kv", compact_kv_kernel,
         dict(table_ptr="*i64", src_ptr="*i64", dst_ptr="*i64", move_start_ptr="*i32", stride_group="i32"),
         dict(UNIT_BYTES=8, CHUNKS=1, BLOCK=256)),
        ("gather_quantize_kv", gather_quantize_kv_kernel,
         dict(out_ptr="*i8", cache_ptr="*bf16", slots_ptr="*i64", scale_ptr="*fp32", stride_cb="i32",
              stride_cs="i32", stride_ch="i32"),
         dict(BLOCK_SIZE=16, NUM_HEADS=8, HEAD_DIM=256, HEAD_DIM_P=256)),
        ("quantize_int8", quantize_int8_kernel, dict(out_ptr="*i8", x_ptr="*bf16", scale_ptr="*fp32"),
         dict(CHANNELS=2816, BLOCK=1024)),
    ]
    rows = []
    for name, fn, sig, consts in cases:
        try:
            rows.append({"kernel": name, **resources(fn, sig, consts, 4, 3, arch)})
        except Exception as e:
            rows.append({"kernel": name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--out", default="benchmarks/out/aot_compile_check.json")
    args = p.parse_args()
    rows = []
    for layer in LAYERS:
        for dtype in TRITON_DT:
            for split in (False, True):
                try:
                    row = tree_case(layer, dtype, split, args.arch)
                except Exception as e:  # a codegen failure is a result too
                    row = {"layer": layer, "dtype": TRITON_DT[dtype], "split": split, "ok": False,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
    rows += other_cases(args.arch)
    report = {"arch": f"sm_{args.arch}", "triton": triton.__version__, "rows": rows,
              "all_ok": all(r["ok"] for r in rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"all_ok={report['all_ok']} -> {args.out}")


if __name__ == "__main__":
    main()
