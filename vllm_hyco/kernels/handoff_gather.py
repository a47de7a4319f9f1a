"""Hand-off gather + 8-bit quantize: K/V rows of the two hand-off layers at given slots, plus h and e(b).

Convention (shared with the wire-format owner, who implements the numpy side): symmetric int8 with FIXED
float32 scales per channel, ``q = clamp(round_half_away_from_zero(x / scale), -127, 127)`` computed in
fp32 (``x`` upcast first), and ``x ~ q * scale`` to dequantize. K and V of a layer have one scale per
(kv_head, head_dim) channel, ``[num_kv_heads, head_dim]``; h and e have one per hidden channel,
``[hidden]``. -128 is never produced; NaN maps to 0; scales must be positive.

Worked example: scale 0.5, x = [0.25, -0.25, 0.74, 100.0] -> x / scale = [0.5, -0.5, 1.48, 200]
-> q = [1, -1, 1, 127].

A layer whose V cache is ``None`` or the very tensor of its K cache sends K only: its V entry is ``None``.
Gemma-4's ``k_eq_v`` full layers store a distinct V (V = v_norm(k_raw), K = rope(k_norm(k_raw))), so they
send both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_hyco.kernels._backend import KernelInputError, next_pow2, use_triton

INT8_MAX = 127


@dataclass
class HandoffRowsInt8:
    """The quantized hand-off of one batch of positions (``num_pos`` rows per layer)."""

    # per layer: [num_pos, num_kv_heads, head_dim] int8
    k: list[torch.Tensor]
    # per layer: [num_pos, num_kv_heads, head_dim] int8, or None where V is the K tensor itself
    v: list[torch.Tensor | None]
    # [..., hidden] int8 (the verifier's hidden state h)
    h: torch.Tensor
    # [..., hidden] int8 (the embedding e(b) of the bonus token)
    e: torch.Tensor


def quantize_int8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin: int8 of ``x`` [..., C] with per-channel ``scale`` [C] (or broadcastable to x)."""
    y = x.float() / scale.float()
    a = y.abs()
    f = a.floor()
    r = (f + (a - f >= 0.5).float()).clamp(max=INT8_MAX)
    r = torch.where(y < 0, -r, r)
    r = torch.where(torch.isnan(y), torch.zeros_like(r), r)
    return r.to(torch.int8)


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` (the inverse up to rounding; the numpy twin lives with the wire format)."""
    return q.float() * scale.float()


def gather_quantize_kv_ref(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Torch twin: int8 [num_pos, num_kv_heads, D] of cache [blocks, block_size, num_kv_heads, D] at slots."""
    _check_kv(cache, slots, scale)
    s = slots.to(device=cache.device, dtype=torch.int64)
    bs = cache.shape[1]
    return quantize_int8_ref(cache[s // bs, s % bs], scale)


def _check_kv(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> None:
    if cache.dim() != 4 or slots.dim() != 1 or tuple(scale.shape) != tuple(cache.shape[2:]):
        raise KernelInputError(
            f"expected cache [blocks, bs, kv_heads, D], slots [num_pos] and scale [kv_heads, D]; got "
            f"{tuple(cache.shape)}, {tuple(slots.shape)}, {tuple(scale.shape)}"
        )


def gather_quantize_kv_triton(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`gather_quantize_kv_ref` (same result, bit for bit)."""
    from vllm_hyco.kernels._triton.handoff_gather import gather_quantize_kv_kernel

    _check_kv(cache, slots, scale)
    if cache.stride(3) != 1:
        raise KernelInputError("the head_dim axis of the cache must be contiguous")
    num_pos, heads, dim = slots.shape[0], cache.shape[2], cache.shape[3]
    out = torch.empty(num_pos, heads, dim, dtype=torch.int8, device=cache.device)
    if num_pos == 0:
        return out
    gather_quantize_kv_kernel[(num_pos, heads)](
        out, cache, slots.to(torch.int64).contiguous(), scale.float().contiguous(),
        cache.stride(0), cache.stride(1), cache.stride(2),
        BLOCK_SIZE=cache.shape[1], NUM_HEADS=heads, HEAD_DIM=dim, HEAD_DIM_P=next_pow2(dim),
    )
    return out


def quantize_int8_triton(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton launcher of :func:`quantize_int8_ref` for ``x`` [..., C] and ``scale`` [C]."""
    from vllm_hyco.kernels._triton.handoff_gather import quantize_int8_kernel

    channels = x.shape[-1]
    if tuple(scale.shape) != (channels,):
        raise KernelInputError(f"scale must be [{channels}] (one per channel), got {tuple(scale.shape)}")
    xc = x.contiguous().view(-1, channels)  # [num_vectors, C]
    out = torch.empty(xc.shape, dtype=torch.int8, device=x.device)
    if xc.shape[0] == 0:
        return out.view(x.shape)
    block = min(1024, next_pow2(channels))
    quantize_int8_kernel[(xc.shape[0], -(-channels // block))](
        out, xc, scale.float().contiguous(), CHANNELS=channels, BLOCK=block
    )
    return out.view(x.shape)


def handoff_gather_quantize(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor | None],
    slots: Sequence[torch.Tensor],
    k_scales: Sequence[torch.Tensor],
    v_scales: Sequence[torch.Tensor | None],
    h: torch.Tensor,
    e: torch.Tensor,
    h_scale: torch.Tensor,
    e_scale: torch.Tensor,
    *,
    backend: str = "auto",
) -> HandoffRowsInt8:
    """Gather + quantize the hand-off: per layer l, the rows at ``slots[l]`` (that layer's KV-group slots).

    A layer with ``v_caches[l]`` None or the same tensor as ``k_caches[l]`` gets ``v[l] = None``.
    """
    if not len(k_caches) == len(v_caches) == len(slots) == len(k_scales) == len(v_scales):
        raise KernelInputError("k_caches, v_caches, slots, k_scales and v_scales need one entry per layer")
    tri = use_triton(backend, k_caches[0] if k_caches else h)
    gather = gather_quantize_kv_triton if tri else gather_quantize_kv_ref
    quant = quantize_int8_triton if tri else quantize_int8_ref
    ks, vs = [], []
    for kc, vc, sl, kscale, vscale in zip(k_caches, v_caches, slots, k_scales, v_scales):
        ks.append(gather(kc, sl, kscale))
        same = vc is None or vc is kc or (vc.data_ptr() == kc.data_ptr() and vc.stride() == kc.stride())
        vs.append(None if same else gather(vc, sl, vscale))
    return HandoffRowsInt8(k=ks, v=vs, h=quant(h, h_scale), e=quant(e, e_scale))
