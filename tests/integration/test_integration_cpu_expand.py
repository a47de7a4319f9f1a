"""vLLM 0.32 CPU ``expand_kernel`` fallback: the stock one loses float/int32 outputs, the patch fixes it.

Real vLLM, no engine: the rejection sampler's own ``expand_batch_to_tokens`` with the CPU platform's
kernel overrides registered as a worker registers them (vllm_hyco/vllm_adapter/patches/cpu_expand_kernel.py).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_hyco.vllm_adapter.patches import cpu_expand_kernel  # noqa: E402

CU = torch.tensor([2, 5, 6], dtype=torch.int32)


def _expand(x: torch.Tensor, **kw) -> torch.Tensor:
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if not current_platform.is_cpu():
        pytest.skip("the CPU fallback is registered on the CPU build only")
    current_platform.register_triton_kernel_overrides()
    return expand_batch_to_tokens(x, CU, 6, **kw)


def test_stock_cpu_fallback_still_drops_float_outputs():
    """If this fails, vLLM fixed its fallback: drop the patch (its Removal note)."""
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU fallback is registered on the CPU build only")
    current_platform.import_kernels()  # loads torch.ops._C
    stock = cpu_expand_kernel.PATCH._original if cpu_expand_kernel.PATCH.applied else cpu_tl._expand_kernel_impl
    out = torch.full((6,), -7.0)
    stock(out, torch.tensor([0.7, 1.0, 0.5]), CU, -1, 1)
    assert out.tolist() == [-7.0] * 6, "stock CPU expand now writes float outputs: remove the patch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_patched_expand_matches_the_triton_contract(dtype):
    cpu_expand_kernel.apply_if_present()
    x = torch.tensor([7, -1, 5], dtype=dtype) if dtype != torch.float32 else torch.tensor([0.7, -1.0, 0.5])
    got = _expand(x, replace_from=-1, replace_to=1)
    want = torch.repeat_interleave(torch.where(x == -1, torch.ones_like(x), x), torch.tensor([2, 3, 1]))
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
