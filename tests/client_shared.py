"""Shared pieces of the phone client's tests (no tests here): a MiMo verifier folder holding a toy MTP layer,
and the check that a QDQ graph's int4 weight scales are the simulator's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_mimo_verifier(root: Path, cfg: dict, vocab: int, sd: dict) -> dict:
    """A MiMo verifier folder ``root/verifier`` (config.json + model.safetensors) holding the MTP layer ``sd``
    of the toy widths ``cfg``; returns its config."""
    from safetensors.torch import save_file

    full = {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1,
            "vocab_size": vocab, **cfg}
    (root / "verifier").mkdir()
    (root / "verifier" / "config.json").write_text(json.dumps(full))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(root / "verifier" / "model.safetensors"))
    return full


def assert_int4_weights_are_our_encodings(art) -> int:
    """Every weight of ``art.encodings`` is dequantized in ``art.qdq_onnx`` from INT4 with the simulator's
    per-channel scales, bit for bit; returns how many such weights the graph holds."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(art.qdq_onnx))
    raw = {i.name: i for i in model.graph.initializer}
    int4 = 0
    for node in model.graph.node:
        name = node.input[0].removesuffix("_quantized") if node.op_type == "DequantizeLinear" else ""
        if name in art.encodings["weights"]:
            np.testing.assert_array_equal(numpy_helper.to_array(raw[node.input[1]]),
                                          np.asarray(art.encodings["weights"][name]["scale"], np.float32))
            assert raw[node.input[0]].data_type == onnx.TensorProto.INT4
            int4 += 1
    return int4
