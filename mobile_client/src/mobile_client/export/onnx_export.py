"""Static-shape ONNX export of the drafter steps (float graph; QDQ is added by ``export.qdq``).

The exported weights are the quantized grid values when the module holds ``QLinear`` layers (so the QDQ
pass reproduces our integers exactly); activation quantizers are switched off for the trace.

>>> from mobile_client.drafters.spec import toy_mtp_spec
>>> feeds = mtp_dummy_feeds(toy_mtp_spec(), window=32)
>>> feeds["k_full"].shape
(1, 32, 64)
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn

from mobile_client.drafters.mtp import MTP_INPUTS, MTP_OUTPUTS
from mobile_client.drafters.spec import FULL, SLIDING, MtpSpec
from mobile_client.quant.fakequant import QLinear, act_points

OPSET = 20  # the TorchScript exporter's ceiling; 16-bit/4-bit Q/DQ then use the com.microsoft domain


def mtp_dummy_feeds(spec: MtpSpec, window: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds with the MTP step's static shapes (all masks live)."""
    rng = np.random.default_rng(seed)
    feeds = {"z": rng.standard_normal((1, 2 * spec.backbone)).astype(np.float32)}
    for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
        a = spec.attn[kind]
        feeds[f"k_{name}"] = rng.standard_normal((a.kv_heads, window, a.head_dim)).astype(np.float32)
        feeds[f"v_{name}"] = rng.standard_normal((a.kv_heads, window, a.head_dim)).astype(np.float32)
        feeds[f"mask_{name}"] = np.ones((1, window), np.float32)
        cos, sin = spec.rope[kind].cos_sin(torch.tensor([window - 1]), a.head_dim)
        feeds[f"cos_{name}"], feeds[f"sin_{name}"] = cos.numpy(), sin.numpy()
    return {n: feeds[n] for n in MTP_INPUTS}


@contextlib.contextmanager
def export_mode(module: nn.Module):
    """Activation quantizers off and QLinear weights replaced by their grid values, restored afterwards."""
    modes = {n: m.mode for n, m in act_points(module).items()}
    saved = {}
    for m in module.modules():
        if isinstance(m, QLinear):
            saved[m] = (m.weight.data, m.enabled)
            m.weight.data = m.qweight().detach().clone()
            m.enabled = False
    for m in act_points(module).values():
        m.mode = "off"
    try:
        yield module
    finally:
        for n, m in act_points(module).items():
            m.mode = modes[n]
        for m, (w, en) in saved.items():
            m.weight.data, m.enabled = w, en


def export_step(
    module: nn.Module, feeds: dict[str, np.ndarray], input_names, output_names, path: str | Path
) -> onnx.ModelProto:
    """Trace ``module`` on ``feeds`` (ordered as ``input_names``) into a static ONNX graph at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names)
    with export_mode(module), torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=list(input_names),
            output_names=list(output_names),
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
            external_data=_needs_external(module),
        )
    return onnx.load(str(path), load_external_data=False)


def export_mtp(head: nn.Module, spec: MtpSpec, window: int, path: str | Path) -> onnx.ModelProto:
    return export_step(head.eval(), mtp_dummy_feeds(spec, window), MTP_INPUTS, MTP_OUTPUTS, path)


def _needs_external(module: nn.Module) -> bool:
    return sum(p.numel() for p in module.parameters()) * 4 > 1.8e9  # protobuf's 2 GB ceiling


def op_types(model: onnx.ModelProto, ignore_qdq: bool = True) -> set[str]:
    """The set of op types of a graph (Q/DQ nodes left out by default)."""
    skip = {"QuantizeLinear", "DequantizeLinear"} if ignore_qdq else set()
    return {n.op_type for n in model.graph.node if n.op_type not in skip}
