"""@triton.jit bodies of the hand-off gather + int8 quantizer (launchers: ``kernels/handoff_gather.py``).

Convention: q = clamp(round_half_away_from_zero(x / scale), -127, 127) with x / scale in fp32; the
rounding is computed exactly as floor(|y|) + (|y| - floor(|y|) >= 0.5), never as floor(|y| + 0.5).
"""

import triton
import triton.language as tl


@triton.jit
def _quantize(x, scale):
    y = x.to(tl.float32) / scale
    a = tl.minimum(tl.abs(y), 256.0)  # beyond 127.5 everything clamps to 127; keeps inf out
    f = tl.floor(a)
    r = f + tl.where(a - f >= 0.5, 1.0, 0.0)  # a - f is exact in fp32
    r = tl.minimum(r, 127.0)
    r = tl.where(y < 0, -r, r)
    r = tl.where(y != y, 0.0, r)  # NaN -> 0
    return r.to(tl.int8)


@triton.jit
def gather_quantize_kv_kernel(
    out_ptr,  # [num_pos, num_kv_heads, head_dim] int8
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slots_ptr,  # [num_pos] int64
    scale_ptr,  # [num_kv_heads, head_dim] float32
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
):
    pos = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + pos)
    d = tl.arange(0, HEAD_DIM_P)
    ok = d < HEAD_DIM
    x = tl.load(
        cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + head * stride_ch + d,
        mask=ok, other=0.0,
    )
    scale = tl.load(scale_ptr + head * HEAD_DIM + d, mask=ok, other=1.0)
    tl.store(out_ptr + (pos * NUM_HEADS + head) * HEAD_DIM + d, _quantize(x, scale), mask=ok)


@triton.jit
def quantize_int8_kernel(
    out_ptr,  # [num_vectors, channels] int8
    x_ptr,  # [num_vectors, channels]
    scale_ptr,  # [channels] float32
    CHANNELS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    vec = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < CHANNELS
    x = tl.load(x_ptr + vec * CHANNELS + c, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + c, mask=ok, other=1.0)
    tl.store(out_ptr + vec * CHANNELS + c, _quantize(x, scale), mask=ok)
