"""One drafter step from torch to a QNN context binary: export -> encodings -> QDQ -> compile.

``build_step`` is shared by both drafters and by the tests; it returns the paths, the encodings and the
compile report that the manifest records. Every stage is labelled as in docs/phone-build.md, "The agreement ladder":
float and fake-quant are *simulated* (torch), ORT-CPU on the QDQ graph is *simulated(cpu-qdq)*, the
context binary run on x86 is *emulated(x86-HTP)*; nothing here is a phone measurement.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from mobile_client.export import qnn
from mobile_client.export.onnx_export import export_step, op_types
from mobile_client.export.qdq import activation_ranges, quantize_qdq, weight_encodings
from mobile_client.quant.fakequant import calibrate, quantize_linears


@dataclass
class StepArtifacts:
    name: str
    float_onnx: Path
    qdq_onnx: Path
    ctx_onnx: Path | None
    encodings: dict
    compile: dict | None
    ops: list[str]
    input_shapes: dict[str, list[int]] = field(default_factory=dict)

    def files(self) -> list[Path]:
        out = [self.float_onnx, self.qdq_onnx, self.float_onnx.with_suffix(".encodings.json")]
        if self.ctx_onnx is not None:
            out.append(self.ctx_onnx)
            if self.compile and self.compile.get("bin"):
                out.append(self.ctx_onnx.parent / self.compile["bin"])
        return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fake_quant_copy(
    module: nn.Module, calib_feeds: list[dict[str, np.ndarray]], input_names, bits: int = 4
) -> nn.Module:
    """W4 (MSE clip search) + A16 calibrated copy of ``module`` (the simulator's rung), unless it is
    already quantized (a QAT result), in which case only its activation ranges are (re)calibrated."""
    q = copy.deepcopy(module).eval()
    quantize_linears(q, bits)

    def run(m, f):
        m(*(torch.from_numpy(f[n]) for n in input_names))

    calibrate(q, calib_feeds, run)
    return q


def build_step(
    name: str,
    module: nn.Module,
    out_dir: Path,
    input_names,
    output_names,
    calib_feeds: list[dict[str, np.ndarray]],
    compile: bool = True,
) -> StepArtifacts:
    """Export ``module`` (already fake-quantized: QLinear weights) and compile it for HTP v81."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f_path, q_path, c_path = (
        out_dir / f"{name}.onnx",
        out_dir / f"{name}.qdq.onnx",
        out_dir / f"{name}_ctx.onnx",
    )
    model = export_step(module, calib_feeds[0], input_names, output_names, f_path)
    enc = {
        "weights": weight_encodings(model, module),
        "activations": activation_ranges(f_path, calib_feeds),
        "activation_bits": 16,
        "activation_rule": "percentile 99.99 x 1.25, zero included; LpNormalization outputs [-1.25, 1.25]",
    }
    f_path.with_suffix(".encodings.json").write_text(json.dumps(enc, indent=1, sort_keys=True))
    quantize_qdq(f_path, q_path, enc["weights"], enc["activations"], calib_feeds)
    report = qnn.compile_context(q_path, c_path) if compile else None
    shapes = {n: list(calib_feeds[0][n].shape) for n in input_names}
    return StepArtifacts(
        name, f_path, q_path, c_path if compile else None, enc, report, sorted(op_types(model)), shapes
    )


@dataclass
class Ladder:
    """Per-rung outputs of one feed: float, fake-quant (torch), ORT-CPU (QDQ), HTP emulator."""

    outputs: dict[str, np.ndarray]

    def compare(self, a: str, b: str, k: int = 5) -> dict:
        """max |a - b| / max |a| (worst row and median row), top-1 agreement and top-k overlap per row."""
        x = self.outputs[a].reshape(-1, self.outputs[a].shape[-1])
        y = self.outputs[b].reshape(-1, self.outputs[b].shape[-1])
        scale = max(float(np.abs(x).max()), 1e-9)
        per_row = np.abs(x - y).max(axis=1) / scale
        topk = [
            len(set(np.argsort(-xr, kind="stable")[:k]) & set(np.argsort(-yr, kind="stable")[:k])) / k
            for xr, yr in zip(x, y)
        ]
        return {
            "max_abs": float(np.abs(x - y).max()),
            "rel_to_max": float(per_row.max()),
            "median_row_rel": float(np.median(per_row)),
            "worst_row": int(per_row.argmax()),
            "top1_agree": float(np.mean(x.argmax(-1) == y.argmax(-1))),
            f"top{k}_overlap": float(np.mean(topk)),
        }


def run_ladder(
    float_module: nn.Module,
    quant_module: nn.Module,
    art: StepArtifacts,
    feeds: dict[str, np.ndarray],
    input_names,
    htp: bool = True,
    sessions: dict | None = None,
    output: int = 0,
) -> Ladder:
    """Output number ``output`` (the logits: the first of the MTP and SLM steps) of every rung on ``feeds``."""
    args = [torch.from_numpy(feeds[n]) for n in input_names]
    with torch.no_grad():
        out = {"float": float_module(*args)[output].numpy(), "fake_quant": quant_module(*args)[output].numpy()}
    sessions = sessions if sessions is not None else {}
    if "cpu" not in sessions:
        sessions["cpu"] = qnn.cpu_session(art.qdq_onnx)
    out["ort_cpu_qdq"] = qnn.run(sessions["cpu"], feeds)[output]
    if htp and art.ctx_onnx is not None:
        if "htp" not in sessions:
            sessions["htp"] = qnn.htp_session(art.ctx_onnx)
        out["htp_emulator"] = qnn.run(sessions["htp"], feeds)[output]
    return Ladder(out)


def write_golden(
    path: Path, float_m, quant_m, art: StepArtifacts, feeds, names, emulate: bool, output: int = 0
) -> dict:
    """Save inputs and per-rung outputs (output number ``output``, the logits) of the golden feeds to ``path``
    (npz); return the ladder comparisons.

    Shared by the drafters' builds (``export.build`` for the MTP steps, ``export.slm_build`` for the SLM step).
    """
    sessions: dict = {}
    arrays, stats = {}, []
    for i, f in enumerate(feeds):
        lad = run_ladder(float_m, quant_m, art, f, names, htp=emulate, sessions=sessions, output=output)
        for n in names:
            arrays[f"{i}/in/{n}"] = f[n]
        for rung, v in lad.outputs.items():
            arrays[f"{i}/out/{rung}"] = v
        pairs = [("float", "fake_quant"), ("fake_quant", "ort_cpu_qdq")]
        if emulate:
            pairs.append(("ort_cpu_qdq", "htp_emulator"))
        stats.append({f"{a}->{b}": lad.compare(a, b) for a, b in pairs})
    np.savez(path, **arrays)
    return {"feeds": len(feeds), "per_feed": stats}
