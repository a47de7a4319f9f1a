"""Fake quantization for the phone's drafters: W4 per-channel symmetric weights, A16 fixed-point activations.

The simulator ("simulated(fake-quant)" rung of the agreement ladder) uses the same encodings that the
QDQ ONNX export writes (``mobile_client.export.qdq``):

* weights: per output channel ``w_q = clamp(round(w / s), -8, 7) * s`` with ``s = ratio * max|w| / 7`` and the
  clipping ratio picked per channel from 1.0 down to 0.6 by mean-squared error (paper Table 4);
* activations: unsigned 16-bit with a fixed range ``[lo, hi]`` (zero included), from percentiles of
  calibration captures; ``x_q = (clamp(round(x / s) + zp, 0, 65535) - zp) * s``.

Rounding uses a straight-through estimator so QAT can train through it.

>>> w = torch.tensor([[1.0, -0.5, 0.25], [0.1, 0.2, -0.3]])
>>> s = mse_clip_scales(w, bits=4)
>>> s.shape
torch.Size([2])
"""

from __future__ import annotations

import torch
import torch.nn as nn

A_BITS = 16
A_QMAX = 2**A_BITS - 1


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round() forward, identity gradient."""
    return x + (torch.round(x) - x).detach()


def fake_quant_weight(w: torch.Tensor, scale: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Symmetric per-row fake quant; w [out, in], scale [out]."""
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.clamp(round_ste(w / scale[:, None]), qmin, qmax)
    return q * scale[:, None]


def mse_clip_scales(w: torch.Tensor, bits: int = 4, ratios: torch.Tensor | None = None) -> torch.Tensor:
    """Per-channel symmetric scales [out] minimizing ||w - Q(w)||^2 over clip ratios 1.0 ... 0.6.

    The grid is searched per row, so each output channel gets its own ratio.
    """
    if ratios is None:
        ratios = torch.linspace(1.0, 0.6, 21)
    qmax = 2 ** (bits - 1) - 1
    absmax = w.abs().amax(dim=1).clamp_min(1e-12)  # [out]
    best_err = torch.full_like(absmax, float("inf"))
    best = absmax / qmax
    with torch.no_grad():
        for r in ratios.tolist():
            s = absmax * r / qmax
            err = (fake_quant_weight(w, s, bits) - w).pow(2).sum(dim=1)
            better = err < best_err
            best = torch.where(better, s, best)
            best_err = torch.where(better, err, best_err)
    return best


class QLinear(nn.Linear):
    """nn.Linear whose weight is fake-quantized per output channel (W4 by default); STE gradients."""

    def __init__(self, linear: nn.Linear, bits: int = 4, clip_search: bool = True):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        self.weight = nn.Parameter(linear.weight.detach().clone())
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())
        self.bits = bits
        scales = (
            mse_clip_scales(self.weight.data, bits)
            if clip_search
            else self.weight.data.abs().amax(1).clamp_min(1e-12) / (2 ** (bits - 1) - 1)
        )
        self.register_buffer("w_scale", scales)
        self.enabled = True

    def qweight(self) -> torch.Tensor:
        return fake_quant_weight(self.weight, self.w_scale, self.bits) if self.enabled else self.weight

    def int_weight(self) -> torch.Tensor:
        """The stored integers [out, in] (int8 container for int4 values)."""
        qmax = 2 ** (self.bits - 1) - 1
        return torch.clamp(torch.round(self.weight / self.w_scale[:, None]), -qmax - 1, qmax).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.qweight(), self.bias)


class ActQuant(nn.Module):
    """A 16-bit activation quantization point. Modes: ``off`` (identity), ``observe`` (collects samples for
    a percentile range), ``quant`` (fake-quantizes with the fixed range ``[lo, hi]``)."""

    def __init__(self):
        super().__init__()
        self.mode = "off"
        self.register_buffer("lo", torch.tensor(0.0))
        self.register_buffer("hi", torch.tensor(0.0))
        self._samples: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "observe":
            flat = x.detach().reshape(-1).float()
            if flat.numel() > 65536:
                flat = flat[torch.linspace(0, flat.numel() - 1, 65536).long()]
            self._samples.append(flat)
            return x
        if self.mode == "quant":
            scale, zp = self.encoding()
            q = torch.clamp(round_ste(x / scale) + zp, 0, A_QMAX)
            return (q - zp) * scale
        return x

    def finish_observe(self, percentile: float = 99.99, margin: float = 1.25) -> None:
        """Fix the range from the collected samples: [pct_low, pct_high] * margin, zero included."""
        assert self._samples, "no calibration samples reached this point"
        data = torch.cat(self._samples)
        self._samples = []
        lo = torch.quantile(data, 1.0 - percentile / 100.0) if data.numel() > 1 else data.min()
        hi = torch.quantile(data, percentile / 100.0) if data.numel() > 1 else data.max()
        self.lo.fill_(min(float(lo) * margin, 0.0))
        self.hi.fill_(max(float(hi) * margin, 0.0, float(self.lo) + 1e-4))

    def encoding(self) -> tuple[float, float]:
        """(scale, zero_point) of the uint16 encoding of [lo, hi]."""
        lo, hi = float(self.lo), float(self.hi)
        scale = max(hi - lo, 1e-4) / A_QMAX
        return scale, float(round(-lo / scale))


def quantize_linears(
    model: nn.Module, bits: int = 4, clip_search: bool = True, skip: tuple[str, ...] = ()
) -> nn.Module:
    """Replace every nn.Linear of ``model`` (in place) by a QLinear; names in ``skip`` stay float."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and not isinstance(child, QLinear):
            if name not in skip:
                setattr(model, name, QLinear(child, bits, clip_search))
        else:
            quantize_linears(child, bits, clip_search, skip)
    return model


def act_points(model: nn.Module) -> dict[str, ActQuant]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ActQuant)}


def set_act_mode(model: nn.Module, mode: str) -> None:
    for m in act_points(model).values():
        m.mode = mode


def set_weight_quant(model: nn.Module, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, QLinear):
            m.enabled = enabled


@torch.no_grad()
def calibrate(model: nn.Module, batches, run, percentile: float = 99.99, margin: float = 1.25) -> None:
    """Fix every ActQuant range from ``run(model, batch)`` over ``batches``; points never reached stay off."""
    set_act_mode(model, "observe")
    for batch in batches:
        run(model, batch)
    for m in act_points(model).values():
        if m._samples:
            m.finish_observe(percentile, margin)
            m.mode = "quant"
        else:
            m.mode = "off"
