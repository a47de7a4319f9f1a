"""Graph-surgery building blocks shared by both drafters (export-friendly, static shapes).

Everything here lowers to plain ONNX ops that QNN's HTP backend takes: RMSNorm as one LpNormalization
node, rotary embedding from cos/sin tables fed by the CPU, masks as 0/1
multipliers with a bounded fill (a -1e4 fill would blow up a 16-bit activation range; docs/phone-build.md,
"16-bit activations and masks"). Each ``ActQuant`` point is the identity until the quantizer calibrates it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from mobile_client.quant.fakequant import ActQuant

#: masked attention scores are set to exactly this value after the live maximum is subtracted (bounded so a
#: 16-bit range stays fine)
MASK_FILL = -64.0
#: pushes masked scores below every live one while the live maximum is taken (exact in fp16 and bf16)
_MASK_FLOOR = 16384.0


class _L2Normalize(torch.autograd.Function):
    """x / ||x||_2 over the last dim; exported as one ONNX ``LpNormalization`` (p = 2) node."""

    @staticmethod
    def forward(ctx, x):
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-12)

    @staticmethod
    def symbolic(g, x):
        return g.op("LpNormalization", x, axis_i=-1, p_i=2)


class RMSNorm(nn.Module):
    """Gemma-4 RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` (no ``1 + w``); ``with_scale=False`` drops w.

    Graph surgery for fixed point: computed as ``l2normalize(x) * sqrt(dim)``, which equals the above up
    to the eps term (relative difference eps / (2 mean(x^2))). A decomposed Pow/ReduceMean/Sqrt/Div chain
    must quantize mean(x^2), whose range spans orders of magnitude across rows: a 16-bit encoding then
    rounds small rows' statistic to zero. One LpNormalization node keeps that statistic inside the op.
    """

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps, self.root = eps, math.sqrt(dim)
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            y = _L2Normalize.apply(x) * self.root
        else:
            y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return y * self.weight if self.weight is not None else y


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE with precomputed tables; x [..., d], cos/sin broadcastable to x."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim where ``mask`` (0/1 floats, broadcastable) is 1; masked scores: MASK_FILL.

    The scores are first shifted so that the largest live one is 0 (softmax does not change). A fixed fill
    is negligible only next to the live maximum: unshifted, live scores all below -64 (Gemma-4 scales q·k by
    1, so |q·k| reaches hundreds) would hand most of the weight to the masked columns."""
    live_max = (scores * mask + (mask - 1.0) * _MASK_FLOOR).amax(dim=-1, keepdim=True)
    scores = (scores - live_max) * mask + (mask - 1.0) * (-MASK_FILL)
    return torch.softmax(scores, dim=-1)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class GatedMLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)), Gemma's MLP."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.q_act = ActQuant()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = nn.functional.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(self.q_act(a * self.up_proj(x)))


class Sandwich(nn.Module):
    """The four norms around attention and MLP of a Gemma-4 decoder layer."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, quant: tuple[ActQuant, ActQuant]
) -> torch.Tensor:
    """Scaled-by-1 GQA attention (Gemma-4 normalizes q and k instead of scaling).

    Shape: q [kvh, g * rows, d] (query head h = kv head h // g), k and v [kvh, cols, d], mask
    broadcastable to [kvh, g * rows, cols]; returns [kvh, g * rows, d].
    """
    scores = quant[0](torch.matmul(q, k.transpose(-1, -2)))
    probs = quant[1](masked_softmax(scores, mask))
    return torch.matmul(probs, v)


def keep_lm_head(sd: dict[str, torch.Tensor], keep_ids) -> torch.Tensor:
    """The output layer restricted to the keep set: rows ``keep_ids`` of ``lm_head.weight``, or of the
    input embedding when the head is tied (Gemma checkpoints do not save a tied lm_head)."""
    lm = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return lm[torch.as_tensor(list(keep_ids), dtype=torch.long)]


def load_into(module: nn.Module, sd: dict[str, torch.Tensor], prefix: str = "") -> None:
    """Copy ``sd[prefix + name]`` into each parameter/buffer ``name`` of ``module`` (quantizer state is
    skipped); raises KeyError naming the first tensor the checkpoint lacks."""
    skip = {n for n, m in module.named_modules() if isinstance(m, ActQuant)}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner in skip or name.endswith("w_scale"):
            continue
        key = prefix + name
        if key not in sd:
            raise KeyError(f"checkpoint has no tensor {key!r}")
        with torch.no_grad():
            tensor.copy_(sd[key].to(tensor.dtype).reshape(tensor.shape))
