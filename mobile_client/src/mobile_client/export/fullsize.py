"""The slow, compile-only check of full-size drafter graphs (random weights; never in CI).

``python -m mobile_client.export.fullsize OUT [--slm-layers 7] [--no-compile] [--record]`` exports

* the 26B-A4B-assistant-shaped MTP step (``spec.full_mtp_spec``: backbone 2,816, one query over 1,024
  columns, sliding 8 KV heads x 256 and global 2 KV heads x 512, keep set 86,089 rows), and
* the Gemma-4 E2B-shaped SLM step (``spec.e2b_slm_spec``: hidden 1,536, 8 heads, 1 KV head, head dims
  256 / 512, 32 rows, rings 1,024 / 512, PLE 256, keep set 86,089 rows),

quantizes them W4 / A16 as the toy twins are (max-abs weight scales, ranges from two random feeds) and
compiles them for SM8850 / HTP v81 with CPU fallback disabled: a successful compile shows every node
lowers onto HTP. The E2B graph keeps the full widths with ``--slm-layers`` layers (default 7: the 4:1
pattern with two KV-shared layers; 35 repeats the same layer graphs and needs ~10 GB more memory than this
shared box has to spare). ``--record`` writes the op-type sets to ``fullsize_ops.json`` beside this file,
which the CI test compares with the toy exports.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from mobile_client.drafters.mtp import MTP_INPUTS, MTP_OUTPUTS, MtpHead
from mobile_client.drafters.slm import SlmStep, slm_input_names, slm_output_names
from mobile_client.drafters.spec import FULL, SLIDING, SlmSpec, e2b_slm_spec, full_mtp_spec
from mobile_client.export.onnx_export import export_step, mtp_dummy_feeds, op_types

KEEP = 86_089
RECORD = Path(__file__).with_name("fullsize_ops.json")


def slm_dummy_feeds(
    spec: SlmSpec, window: int = 1024, rows: int = 32, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random feeds with the SLM step's static shapes (all ring columns live, causal self mask)."""
    rng = np.random.default_rng(seed)
    f = {
        "x": rng.standard_normal((rows, spec.hidden)).astype(np.float32),
        "ple": rng.standard_normal((rows, spec.num_layers, spec.ple_dim)).astype(np.float32),
    }
    pos = torch.arange(window, window + rows)
    for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
        cos, sin = spec.rope[kind].cos_sin(pos, spec.attn[kind].head_dim)
        f[f"cos_{name}"], f[f"sin_{name}"] = cos.numpy(), sin.numpy()
        cols = window if kind == FULL else window // 2
        f[f"ring_mask_{name}"] = np.ones((rows, cols), np.float32)
        f[f"self_mask_{name}"] = np.tril(np.ones((rows, rows), np.float32))
    for j in range(spec.first_shared):
        a = spec.attn[spec.layer_types[j]]
        cols = window if spec.layer_types[j] == FULL else window // 2
        f[f"k_{j}"] = rng.standard_normal((a.kv_heads, cols, a.head_dim)).astype(np.float32)
        f[f"v_{j}"] = rng.standard_normal((a.kv_heads, cols, a.head_dim)).astype(np.float32)
    return {n: f[n] for n in slm_input_names(spec)}


def _check(name: str, module, feeds: list[dict], names, outs, out: Path, compile: bool) -> dict:
    from mobile_client.export import qnn
    from mobile_client.export.qdq import activation_ranges, quantize_qdq, weight_encodings
    from mobile_client.quant.fakequant import quantize_linears

    t0 = time.perf_counter()
    quantize_linears(module, clip_search=False)
    model = export_step(module, feeds[0], names, outs, out / f"{name}.onnx")
    rep = {
        "ops": sorted(op_types(model)),
        "params": sum(p.numel() for p in module.parameters()),
        "export_s": round(time.perf_counter() - t0, 1),
    }
    if compile:
        enc_w = weight_encodings(model, module)
        del model
        ranges = activation_ranges(out / f"{name}.onnx", feeds)
        quantize_qdq(out / f"{name}.onnx", out / f"{name}.qdq.onnx", enc_w, ranges, feeds)
        rep["compile"] = qnn.compile_context(out / f"{name}.qdq.onnx", out / f"{name}_ctx.onnx")
    rep["total_s"] = round(time.perf_counter() - t0, 1)
    return rep


def run(out: Path, slm_layers: int = 7, compile: bool = True, which=("mtp", "slm")) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report = {}
    if "mtp" in which:
        spec = full_mtp_spec()
        head = MtpHead(spec, KEEP).eval()
        feeds = [mtp_dummy_feeds(spec, 1024, seed=s) for s in range(2)]
        report["mtp"] = _check("mtp_full", head, feeds, MTP_INPUTS, MTP_OUTPUTS, out, compile)
        del head
    if "slm" in which:
        spec = e2b_slm_spec(num_layers=slm_layers)
        step = SlmStep(spec, KEEP).eval()
        feeds = [slm_dummy_feeds(spec, seed=s) for s in range(2)]
        report["slm"] = _check(
            "slm_full", step, feeds, slm_input_names(spec), slm_output_names(spec), out, compile
        )
        report["slm"]["layers"] = slm_layers
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mobile_client.export.fullsize")
    ap.add_argument("out", type=Path)
    ap.add_argument("--slm-layers", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", choices=["mtp", "slm"])
    ap.add_argument("--record", action="store_true", help=f"write the op-type sets to {RECORD.name}")
    args = ap.parse_args(argv)
    rep = run(args.out, args.slm_layers, not args.no_compile, (args.only,) if args.only else ("mtp", "slm"))
    (args.out / "fullsize_report.json").write_text(json.dumps(rep, indent=1))
    print(json.dumps(rep, indent=1))
    if args.record:
        old = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        old.update({k: v["ops"] for k, v in rep.items()})
        RECORD.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
