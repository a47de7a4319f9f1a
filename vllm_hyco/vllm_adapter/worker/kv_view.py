"""Read and write a layer's paged KV cache through one interface, one implementation per layout.

Matches vLLM 0.32. Why: tree attention on CPU needs the committed prefix K/V of a request, the tree step
(``tree_step.py``) compacts accepted rows and gathers the hand-off from the paged cache, and tests compare
the cache with a fresh prefill. vLLM has no public "read K/V of slots" API, and the two builds store K/V
differently. The engine's tree step uses ``kv_views`` (K and V as ``[blocks, block_size, kv_heads, D]``
views, no copy) and ``move_views`` (what one slot move copies) with the kernels of ``vllm_hyco.kernels``;
``gather`` serves the CPU attention override, ``scatter`` the layout check and the tests (it writes where
vLLM's writer writes):

* ``CpuAttnKVView`` (CPU_ATTN, ``v1/attention/backends/cpu_attn.py``): the per-layer cache is
  ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; per (block, head) the first half is the K
  plane and the second the V plane. With the ``vec``/``vec16`` ISAs the K plane is stored **transposed**
  (``[head_size, block_size]``, token n is column n) and V is ``[block_size, head_size]``. Other ISAs
  (``amx``, ``neon``, ...) were never verified and are refused. Every new (isa, dtype, block, head)
  combination is also checked once at run time by a round trip through vLLM's own writer
  (``cpu_attn_reshape_and_cache``) on a scratch cache: a mismatch raises HardwareUnsupportedError.
  Writes through ``scatter`` go through that op; the compaction twin moves slot rows through
  ``kv_views`` (strided indexing of the same layout the check verified).
* ``BlockMajorKVView`` (GPU Triton/flash layouts): ``kv_cache.transpose(1, 2).split(head_size, -1)`` gives
  ``[num_blocks, block_size, num_kv_heads, head_size]`` K and V views, as the Triton backend itself reads
  them (and as vLLM's ``triton_reshape_and_cache_flash`` writes them); ``move_views`` is the whole
  ``transpose(1, 2)`` slot row, K and V side by side, so one compaction move copies both. Tested on CPU
  tensors (round trips, the tree step's compaction and hand-off against a dense reference,
  ``tests/kernels/test_kernels_tree_rows.py``); GPU-unverified until a GPU engine run, docs/engine.md.

Slots: ``slot = block_table[p // block_size] * block_size + p % block_size`` (per KV group).
fp8 / quantized caches are refused (no scale handling yet).

When it can go: when vLLM exposes a per-layer KV accessor (none in 0.32 or 0.33).
"""

from __future__ import annotations

import functools

import torch

from vllm_hyco.errors import HardwareUnsupportedError

VERIFIED_CPU_ISAS = ("vec", "vec16")


def slots_for_positions(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] int64 slots of ``positions`` for one request, given its block-table row of one KV group."""
    positions = positions.to(device=block_table_row.device, dtype=torch.int64)
    blocks = block_table_row.to(torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


class CpuAttnKVView:
    """CPU_ATTN layout with the K plane transposed per (block, head) (``vec``/``vec16`` ISAs)."""

    layout = "cpu_attn_k_transposed"

    def __init__(self, isa: str, kv_cache_dtype: str = "auto"):
        if isa not in VERIFIED_CPU_ISAS:
            raise HardwareUnsupportedError(
                f"CPU_ATTN KV layout for isa={isa!r} was never verified by vllm_hyco (verified: "
                f"{VERIFIED_CPU_ISAS}); tree verification would read a wrong cache. On an AMX host serve in "
                f"float32 (--dtype float32: vLLM then uses the 'vec' layout), run on an AVX-512/AVX2 x86 host, "
                f"or add and verify a KV view for this ISA in vllm_hyco/vllm_adapter/worker/kv_view.py."
            )
        if kv_cache_dtype != "auto":
            raise HardwareUnsupportedError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the KV view yet")
        self.isa = isa
        self.kv_cache_dtype = kv_cache_dtype

    @staticmethod
    def _split(kv_cache: torch.Tensor):
        num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
        head_size = two_d // 2
        planes = kv_cache.view(num_blocks, num_kv_heads, 2, block_size * head_size)
        k = planes[:, :, 0].view(num_blocks, num_kv_heads, head_size, block_size)  # [B, Hkv, D, bs]
        v = planes[:, :, 1].view(num_blocks, num_kv_heads, block_size, head_size)  # [B, Hkv, bs, D]
        return k, v, block_size

    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[num_blocks, block_size, num_kv_heads, head_size]`` views (no copy; K's last dim is
        strided: the plane is transposed). What the hand-off gather and the compaction twin index."""
        k_planes, v_planes, _ = self._split(kv_cache)
        return k_planes.permute(0, 3, 1, 2), v_planes.transpose(1, 2)

    def move_views(self, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """The caches a slot move must copy (``kernels.compact_kv``): K and V separately here."""
        return list(self.kv_views(kv_cache))

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots``: each [n, num_kv_heads, head_size] (copies: advanced indexing never returns a
        view, so the caller may write into them)."""
        k_planes, v_planes, block_size = self._split(kv_cache)
        slots = slots.to(torch.int64)
        blk, off = slots // block_size, slots % block_size
        return k_planes[blk, :, :, off], v_planes[blk, :, off, :]

    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write K/V rows ``[n, num_kv_heads, head_size]`` to ``slots`` with vLLM's own CPU writer."""
        from vllm import _custom_ops as ops

        num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                                       slots.to(torch.int64), self.isa, k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=self.kv_cache_dtype)


class BlockMajorKVView:
    """GPU layouts (Triton/flash): logical ``[B, Hkv, bs, 2D]`` read as ``[B, bs, Hkv, D]`` K and V."""

    layout = "block_major"
    UNQUANTIZED = ("auto", "float16", "bfloat16", "float32", "half", "float")

    def __init__(self, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in self.UNQUANTIZED:
            raise HardwareUnsupportedError(f"kv_cache_dtype={kv_cache_dtype!r}: quantized KV caches (fp8, int8, "
                                           f"int4 per token-head) are not supported by the tree path yet; "
                                           f"use --kv-cache-dtype auto")
        self.kv_cache_dtype = kv_cache_dtype

    @staticmethod
    def _split(kv_cache: torch.Tensor):
        head_size = kv_cache.shape[-1] // 2
        k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)  # [B, bs, Hkv, D] each
        return k, v, kv_cache.shape[2]

    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_blocks, block_size, num_kv_heads, head_size]`` views (contiguous last dim)."""
        k, v, _ = self._split(kv_cache)
        return k, v

    def move_views(self, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        """One ``[num_blocks, block_size, num_kv_heads, 2 * head_size]`` view: a slot row holds K and V
        side by side, so one move copies both (``kernels.compact_kv``, one Triton launch for all layers)."""
        return [kv_cache.transpose(1, 2)]

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``slots``: each [n, num_kv_heads, head_size] (copies: advanced indexing)."""
        k, v, block_size = self._split(kv_cache)
        slots = slots.to(device=kv_cache.device, dtype=torch.int64)
        blk, off = slots // block_size, slots % block_size
        return k[blk, off], v[blk, off]

    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write K/V rows ``[n, num_kv_heads, head_size]`` to ``slots`` (unquantized caches: scales unused)."""
        k, v, block_size = self._split(kv_cache)
        slots = slots.to(device=kv_cache.device, dtype=torch.int64)
        blk, off = slots // block_size, slots % block_size
        k[blk, off] = key.to(device=k.device, dtype=k.dtype)
        v[blk, off] = value.to(device=v.device, dtype=v.dtype)


@functools.cache
def _verify_cpu_layout(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int, head_size: int) -> None:
    """Round-trip random rows through vLLM's writer and our reader on a scratch 2-block cache."""
    view = CpuAttnKVView(isa)
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    slots = torch.tensor([0, 1, block_size - 1, block_size, 2 * block_size - 1], dtype=torch.int64)
    k = torch.randn(len(slots), num_kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_size, generator=gen).to(dtype)
    view.scatter(cache, slots, k, v)
    k2, v2 = view.gather(cache, slots)
    if not (torch.equal(k, k2) and torch.equal(v, v2)):
        raise HardwareUnsupportedError(
            f"CPU_ATTN KV layout check failed for isa={isa} dtype={dtype} block_size={block_size} "
            f"head_size={head_size}: vLLM's writer does not store K/V where vllm_hyco reads them"
        )


def cpu_kv_view(isa: str, kv_cache: torch.Tensor, kv_cache_dtype: str = "auto") -> CpuAttnKVView:
    """A verified CPU_ATTN view for this layer's cache (checks the layout once per shape/ISA)."""
    view = CpuAttnKVView(isa, kv_cache_dtype)
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    _verify_cpu_layout(isa, kv_cache.dtype, block_size, num_kv_heads, two_d // 2)
    return view


class MlaLatentKVView:
    """CPU_MLA (DeepSeek's MLA): one latent row per token and layer, ``[num_blocks, block_size, kv_lora_rank +
    rope]`` (vLLM's ``MLAAttentionSpec``; ``CPUMLAImpl.do_kv_cache_update`` writes ``[kv_c_normed | k_pe]`` at
    the slot). K and V are the same row (its first ``kv_lora_rank`` values are the value in the absorbed form),
    viewed as one KV head; a compaction move copies the whole row."""

    layout = "mla_latent"

    def __init__(self, kv_cache_dtype: str = "auto"):
        if kv_cache_dtype not in BlockMajorKVView.UNQUANTIZED:
            raise HardwareUnsupportedError(f"kv_cache_dtype={kv_cache_dtype!r}: quantized MLA caches are not "
                                           f"supported by the tree path; use --kv-cache-dtype auto")
        self.kv_cache_dtype = kv_cache_dtype

    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        row = kv_cache.unsqueeze(2)  # [num_blocks, block_size, 1, width]
        return row, row

    def move_views(self, kv_cache: torch.Tensor) -> list[torch.Tensor]:
        return [kv_cache.unsqueeze(2)]

    def gather(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = kv_cache.view(-1, 1, kv_cache.shape[-1])
        rows = flat[slots.to(device=kv_cache.device, dtype=torch.int64)]
        return rows, rows

    def scatter(self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        kv_cache.view(-1, 1, kv_cache.shape[-1])[slots.to(device=kv_cache.device, dtype=torch.int64)] = \
            key.to(device=kv_cache.device, dtype=kv_cache.dtype)


def mla_kv_view(impl: object, kv_cache: torch.Tensor, kv_cache_dtype: str = "auto") -> MlaLatentKVView:
    """A verified MLA latent view: the cache must be ``[blocks, block_size, width]`` and vLLM's own writer
    (``impl.do_kv_cache_update``) must put a row where :meth:`MlaLatentKVView.gather` reads it (checked once per
    layer impl and shape on a scratch cache), else HardwareUnsupportedError at startup."""
    view = MlaLatentKVView(kv_cache_dtype)
    if kv_cache.dim() != 3:
        raise HardwareUnsupportedError(f"MLA KV cache of shape {tuple(kv_cache.shape)}: the tree path knows the "
                                       f"[blocks, block_size, kv_lora_rank + rope] latent layout only")
    _verify_mla_layout(impl, kv_cache.shape[1], kv_cache.shape[2], kv_cache.dtype)
    return view


@functools.cache
def _verify_mla_layout(impl: object, block_size: int, width: int, dtype: torch.dtype) -> None:
    rank = int(getattr(impl, "kv_lora_rank", width - 64))
    scratch = torch.zeros(3, block_size, width, dtype=dtype)
    slots = torch.tensor([block_size + 1, 2 * block_size + block_size - 1, 3], dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, width, generator=gen).to(dtype)
    impl.do_kv_cache_update(rows[:, :rank], rows[:, None, rank:], scratch, slots, "auto", None)
    got, _ = MlaLatentKVView().gather(scratch, slots)
    if not torch.equal(got[:, 0], rows):
        raise HardwareUnsupportedError(f"CPU_MLA latent KV layout (block {block_size}, width {width}, {dtype}) is "
                                       f"not the one vllm_hyco verified; tree verification would read a wrong cache")
