"""Patch: vLLM 0.32's CPU ``expand_kernel`` fallback leaves float and int32 outputs uninitialised.

Why:      the rejection sampler expands per-request temperature (float32), top-k (int32) and top-p
          (float32) to one value per draft row with ``expand_batch_to_tokens``. On the CPU build the
          Triton kernel is replaced by ``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands
          ``_ensure_int64(output)`` to the C++ op: for any output that is not int64 that is a *copy*, so
          the result is thrown away and the caller reads ``new_empty`` memory. Measured on this machine:
          temperatures ``[0.7, 1.0, 0.5]`` expand to ``0.0`` (so ``logits.div_(temperature)`` gives
          ±inf and every sampled spec-decode request with T > 0 accepts almost nothing: Cloud+MTP MAT
          1.01 at T = 1), and top-k 64 expands to garbage ids (``index 4096 is out of bounds``). Greedy
          never expands, so greedy spec decode was right all along.
How:      replace ``_expand_kernel_impl`` in ``vllm.utils.cpu_triton_utils`` **before** the CPU platform
          registers it (``WorkerWrapperBase.init_worker`` loads the general plugins first, then calls
          ``register_triton_kernel_overrides``, which reads the module attribute) with a torch version:
          ``repeat_interleave`` of the values (``replace_from`` -> ``replace_to``) over the row counts of
          ``cu_num_tokens``, written into ``output`` in its own dtype. Rows past ``cu_num_tokens[-1]``
          are left as the Triton kernel leaves them. Applied by ``plugin.register()`` on every build where
          the module exists; on GPU builds the CPU fallback is never registered, so it changes nothing.
Upstream: the CPU fallback (``vllm/utils/cpu_triton_utils.py``) should copy back like its siblings
          (``_rejection_random_sample_kernel_impl`` does ``output.copy_(output_i64.to(orig_dtype))``) and
          must not round float inputs through int64.
Removal:  when a vLLM CPU release expands float/int32 tensors correctly;
          ``tests/integration/test_integration_cpu_expand.py`` fails loudly once the patch is no longer
          needed (it checks the stock function too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_hyco.vllm_adapter.patches import Patch

TARGET = "vllm.utils.cpu_triton_utils"


def expand_rows(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803
    """Write ``input_val[b]`` (``replace_from`` -> ``replace_to``) into rows ``[cu[b-1], cu[b])`` of ``output``.

    >>> import torch
    >>> out = torch.full((6,), -1.0)
    >>> expand_rows(out, torch.tensor([0.7, -1.0, 0.5]), torch.tensor([2, 5, 6]), -1, 1)
    >>> out.tolist()
    [0.699999988079071, 0.699999988079071, 1.0, 1.0, 1.0, 0.5]
    """
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype),
                         input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(values, counts, output_size=n).to(output.dtype))


def _make(original: Callable[..., Any]) -> Callable[..., Any]:
    return expand_rows


PATCH = Patch(
    target=TARGET, attr="_expand_kernel_impl", make=_make,
    why="the CPU expand fallback writes into an int64 copy: float/int32 outputs stay uninitialised "
        "(T>0 spec decode samples with temperature 0, top-k crashes)",
    how="torch repeat_interleave into output, in output's dtype",
    upstream="vllm/utils/cpu_triton_utils.py _expand_kernel_impl", removal="a CPU release that expands floats",
)


def apply_if_present() -> bool:
    """Apply the patch when this vLLM build has the CPU fallback module; return whether it is applied."""
    import importlib.util

    if importlib.util.find_spec(TARGET) is None:
        return False
    PATCH.apply()
    return True
