"""Backend choice for every kernel: Triton on CUDA tensors (or when forced), the torch twin elsewhere.

Triton is imported directly, never through ``vllm.triton_utils`` (docs/vllm-notes.md P10: vLLM replaces it by a
placeholder on CPU). The import is guarded, so this package imports on a machine without Triton.
``TRITON_INTERPRET=1`` must be set before the first ``import triton`` for the interpreter to run kernels on
CPU tensors; :func:`interpreting` reports it.
"""

from __future__ import annotations

import os

import torch

from vllm_hyco.errors import HardwareUnsupportedError, KernelInputError

try:  # pragma: no cover - depends on the machine
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # ImportError, or a broken driver probe
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(backend: str, ref: torch.Tensor) -> bool:
    """Decide once per call: ``auto`` picks Triton iff it exists and ``ref`` is a CUDA tensor.

    ``backend="triton"`` forces the kernel; on CPU tensors that needs ``TRITON_INTERPRET=1``, otherwise it
    raises :class:`HardwareUnsupportedError` (which the test suite turns into a skip).
    """
    if backend not in BACKENDS:
        raise KernelInputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":
        return HAS_TRITON and ref.is_cuda
    if not HAS_TRITON:
        raise HardwareUnsupportedError("backend='triton' needs the triton package; use backend='torch'")
    if not ref.is_cuda and not interpreting():
        raise HardwareUnsupportedError(
            "backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    return True


def upcast_dot(dtype: torch.dtype) -> bool:
    """bf16 ``tl.dot`` is wrong in the Triton interpreter (docs/vllm-notes.md P11): upcast its operands there."""
    return dtype == torch.bfloat16 and interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
