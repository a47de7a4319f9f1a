"""Hand-off gather + int8 quantize: the convention on edge values, Triton vs twin bit for bit."""

from __future__ import annotations

import math
from decimal import ROUND_HALF_UP, Decimal

import pytest
import torch
from kernel_support import DEVICE, TRITON_OK

from vllm_hyco.kernels import (
    KernelInputError,
    dequantize_int8,
    gather_quantize_kv,
    handoff_gather_quantize,
    quantize_int8,
)

BACKENDS = ["torch"] + (["triton"] if TRITON_OK else [])


def reference_int8(x: float, scale: float) -> int:
    """Decimal arithmetic on the fp32 quotient: round half away from zero, clamp to +-127."""
    y = float(torch.tensor(x, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
    if math.isnan(y):
        return 0
    r = int(Decimal(abs(y)).quantize(Decimal(1), rounding=ROUND_HALF_UP)) if abs(y) < 1e6 else 10**6
    return int(math.copysign(min(r, 127), y)) if r else 0


EDGES = [0.0, -0.0, 0.25, -0.25, 0.75, -0.75, 0.24999999, 0.4999999, 1.25, -1.25, 63.5, -63.5, 63.49999,
         126.5, -126.5, 127.49, 200.0, -1e30, float("inf"), float("-inf"), float("nan"), 1e-30]


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_edges_follow_the_convention(backend):
    x = torch.tensor(EDGES, dtype=torch.float32)
    scale = torch.full((len(EDGES),), 0.5)
    got = quantize_int8(x.to(DEVICE), scale.to(DEVICE), backend=backend).cpu().tolist()
    assert got == [reference_int8(v, 0.5) for v in EDGES]
    assert min(got) >= -127


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_triton_equals_twin_and_dequantize_error(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 2816, generator=g) * 4).to(dtype).to(DEVICE)
    scale = (torch.rand(2816, generator=g) * 0.05 + 0.01).to(DEVICE)
    q = quantize_int8(x, scale, backend="torch")
    assert q.dtype == torch.int8 and q.shape == x.shape
    inside = (x.float().abs() / scale) <= 127
    err = (dequantize_int8(q, scale) - x.float()).abs()
    assert bool((err[inside] <= (scale / 2 + 1e-6).expand_as(err)[inside]).all())
    if TRITON_OK:
        assert torch.equal(quantize_int8(x, scale, backend="triton"), q)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_quantize_kv_matches_explicit_rows(backend, dtype):
    g = torch.Generator().manual_seed(2)
    kv = torch.randn(6, 4, 16, 2 * 64, generator=g).to(dtype)  # vLLM storage [B, H, N, 2D]
    k_cache, v_cache = kv.transpose(1, 2).split(64, dim=-1)  # [B, N, H, D] views
    slots = torch.tensor([0, 17, 95, 33, 34, 35, 64])
    scale = torch.rand(4, 64, generator=g) * 0.03 + 0.005
    got = gather_quantize_kv(v_cache.to(DEVICE), slots.to(DEVICE), scale.to(DEVICE), backend=backend).cpu()
    rows = torch.stack([v_cache[s // 16, s % 16] for s in slots.tolist()])  # [7, H, D]
    want = torch.tensor([[[reference_int8(float(x), float(sc)) for x, sc in zip(r, s)]
                          for r, s in zip(pos, scale)] for pos in rows.float()], dtype=torch.int8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_handoff_two_layers_k_eq_v_and_vectors(backend):
    g = torch.Generator().manual_seed(3)
    sliding = torch.randn(5, 2, 16, 2 * 32, generator=g).transpose(1, 2)  # [B, N, H, 2D]
    ks, vs = sliding.split(32, dim=-1)
    full = torch.randn(4, 8, 1, 64, generator=g)  # k_eq_v layer: one cache
    h, e = torch.randn(2, 96, generator=g), torch.randn(2, 96, generator=g)
    sc = lambda *s: torch.rand(*s, generator=g) * 0.05 + 0.01  # noqa: E731
    k_scales, v_scales = [sc(2, 32), sc(1, 64)], [sc(2, 32), None]
    slots = [torch.tensor([3, 4, 70]), torch.tensor([9, 10, 31])]
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    out = handoff_gather_quantize(
        [dev(ks), dev(full)], [dev(vs), dev(full)], [dev(s) for s in slots],
        [dev(s) for s in k_scales], [dev(s) for s in v_scales], dev(h), dev(e), dev(sc(96)), dev(sc(96)),
        backend=backend,
    )
    assert out.v[1] is None and out.v[0].shape == (3, 2, 32) and out.k[1].shape == (3, 1, 64)
    assert out.h.shape == (2, 96) and out.e.dtype == torch.int8
    ref = gather_quantize_kv(ks, slots[0], k_scales[0], backend="torch")
    assert torch.equal(out.k[0].cpu(), ref)
    with pytest.raises(KernelInputError):
        gather_quantize_kv(ks, slots[0], k_scales[1], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_integers_as_the_wire_formats_numpy_quantizer(backend):
    """Contract with vllm_hyco.handoff.quant (the phone-facing numpy side): same int8 for the same floats."""
    quant = pytest.importorskip("vllm_hyco.handoff.quant")
    g = torch.Generator().manual_seed(5)
    scale = torch.rand(2, 256, generator=g) * 0.02 + 0.002
    x = torch.randn(9, 2, 256, generator=g) * 0.5
    halves = (torch.randint(-300, 300, (9, 2, 256), generator=g).float() + 0.5) * scale  # exact-ish ties
    for values in (x, halves, torch.tensor(EDGES[:18]).view(1, 1, 18).expand(9, 2, 18)):
        sc = scale[:, : values.shape[-1]].contiguous()
        got = gather_free_quantize(values, sc, backend)
        want = torch.from_numpy(quant.quantize(values.numpy(), sc.numpy()))
        assert torch.equal(got, want)


def gather_free_quantize(values: torch.Tensor, scale: torch.Tensor, backend: str) -> torch.Tensor:
    """[..., H, D] values with a [H, D] scale through the 1-D-scale quantizer (flatten the channels)."""
    flat = values.reshape(*values.shape[:-2], -1).to(DEVICE)
    return quantize_int8(flat, scale.reshape(-1).to(DEVICE), backend=backend).reshape(values.shape).cpu()
