"""QDQ quantization of an exported float step from *our* encodings (the same ones the torch simulator uses).

* Weights: every Linear's initializer gets our per-channel W4 scales (``QLinear.w_scale``, zero point 0,
  int4) as ONNX Runtime tensor overrides, so the QDQ integers equal the simulator's bit for bit.
* Activations: one fixed uint16 range per tensor, from percentiles over calibration feeds of the float
  graph (``activation_ranges``), written as ``rmin``/``rmax`` overrides. The torch simulator calibrates its
  own quantization points with the same feeds and the same percentile rule.
* Other initializers (norm weights, constants) are 16-bit.
* LpNormalization outputs (the RMSNorms, ``drafters.layers.RMSNorm``) get the op's own bound, [-1, 1] widened
  by the same margin, not a calibrated range: a row with one dominant channel reaches the end of a calibrated
  range, and there QNN's HTP LpNormalization (x86 emulator, QAIRT 2.47) wraps around instead of saturating
  (an element of -0.536 at the low end of its uint16 range came back as +0.788, 65,536 steps higher).

The encodings are returned (and written to JSON by the build) so a phone app or the native QAIRT
converter can reuse them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch.nn as nn
from onnx import numpy_helper

from mobile_client.quant.fakequant import QLinear

PERCENTILE = 99.99
MARGIN = 1.25  # ranges are the percentiles widened by this factor (16 bits leave room; clipping costs more)


def _key(arr: np.ndarray) -> tuple:
    return arr.shape, hashlib.sha1(np.ascontiguousarray(arr, dtype=np.float32).tobytes()).hexdigest()


def weight_encodings(model: onnx.ModelProto, module: nn.Module) -> dict[str, dict]:
    """Map each QLinear of ``module`` to its initializer in ``model`` (matched by value, MatMul layout
    [in, out] -> axis 1) -> {name: {"axis", "scale" [out], "bits", "linear"}}."""
    by_value = {_key(numpy_helper.to_array(i)): i.name for i in model.graph.initializer}
    out = {}
    for name, m in module.named_modules():
        if not isinstance(m, QLinear):
            continue
        grid = m.qweight().detach().numpy()  # the grid values (export_mode stores exactly these)
        for layout, axis in ((grid.T, 1), (grid, 0)):
            init = by_value.get(_key(layout))
            if init is not None:
                out[init] = {
                    "axis": axis,
                    "scale": m.w_scale.numpy().astype(np.float32).tolist(),
                    "bits": m.bits,
                    "linear": name,
                }
                break
        else:
            raise KeyError(f"no initializer holds the quantized weight of {name}")
    return out


def activation_ranges(
    model_path: str | Path,
    feeds: Iterable[dict[str, np.ndarray]],
    percentile: float = PERCENTILE,
    margin: float = MARGIN,
) -> dict[str, list[float]]:
    """[lo, hi] * margin (zero included) of every float tensor (graph inputs, node outputs) over ``feeds``."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(model_path)))
    known = {o.name for o in model.graph.output}
    for vi in model.graph.value_info:
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and vi.name not in known:
            model.graph.output.append(vi)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    samples: dict[str, list[np.ndarray]] = {n: [] for n in names}
    input_names = [i.name for i in sess.get_inputs()]
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            samples[n].append(np.asarray(v, np.float32).reshape(-1))
        for n in input_names:
            samples.setdefault(n, []).append(np.asarray(f[n], np.float32).reshape(-1))
    ranges = {}
    for n, chunks in samples.items():
        data = np.concatenate(chunks)
        lo, hi = np.percentile(data, [100 - percentile, percentile])
        lo, hi = min(lo, 0.0) * margin, max(hi, 0.0) * margin
        ranges[n] = [float(lo), float(max(hi, lo + 1e-4))]
    for node in model.graph.node:  # x / ||x|| lies in [-1, 1] whatever the row (see the module docstring)
        if node.op_type == "LpNormalization" and node.output[0] in ranges:
            ranges[node.output[0]] = [-margin, margin]
    return ranges


class _Reader:
    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):
        pass


def quantize_qdq(
    float_path: str | Path,
    out_path: str | Path,
    weights: dict[str, dict],
    activations: dict[str, list[float]],
    calib_feeds: list[dict[str, np.ndarray]],
) -> onnx.ModelProto:
    """Write the QDQ model (uint16 activations, int4 per-channel Linear weights) for QNN's HTP."""
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    model = onnx.load(str(float_path))
    overrides: dict[str, list[dict]] = {}
    for name, enc in weights.items():
        qt = QuantType.QInt4 if enc["bits"] == 4 else QuantType.QInt8
        overrides[name] = [
            {"axis": enc["axis"], "quant_type": qt, "scale": np.float32(s), "zero_point": np.int8(0)}
            for s in enc["scale"]
        ]
    for init in model.graph.initializer:
        if init.name not in overrides and init.data_type == onnx.TensorProto.FLOAT:
            overrides[init.name] = [{"quant_type": QuantType.QUInt16}]
    for name, (lo, hi) in activations.items():
        overrides.setdefault(name, [{"rmin": np.float32(lo), "rmax": np.float32(hi)}])
    cfg = get_qnn_qdq_config(
        model,
        _Reader(calib_feeds[:1]),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt4,
        weight_symmetric=True,
        init_overrides=overrides,
    )
    quantize(model, str(out_path), cfg)
    return onnx.load(str(out_path))
