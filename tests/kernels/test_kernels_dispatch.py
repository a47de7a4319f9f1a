"""Backend choice: auto -> twin on CPU tensors; triton forced needs the interpreter; no-triton import."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.kernels import KernelInputError, interpreting, use_triton


def test_auto_and_torch_pick_the_twin_on_cpu():
    x = torch.zeros(1)
    assert use_triton("auto", x) is False
    assert use_triton("torch", x) is False
    with pytest.raises(KernelInputError):
        use_triton("cuda", x)


@pytest.mark.skipif(interpreting(), reason="checks the refusal without TRITON_INTERPRET")
def test_forcing_triton_on_cpu_without_interpreter_is_a_hardware_error():
    with pytest.raises(HardwareUnsupportedError):
        use_triton("triton", torch.zeros(1))


def test_kernels_import_and_run_without_triton():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton -> ImportError
        import torch
        from vllm_hyco import kernels as k
        assert not k.HAS_TRITON
        meta = k.TreeAttentionMetadata.make_dummy([5], [[-1, 0, 0]], block_size=4)
        kc = torch.randn(2, 4, 1, 16)
        out = k.tree_attention(torch.randn(3, 2, 16), kc, kc, meta, 0.25)
        assert out.shape == (3, 2, 16)
        from vllm_hyco.errors import HardwareUnsupportedError
        try:
            k.tree_attention(torch.randn(3, 2, 16), kc, kc, meta, 0.25, backend="triton")
            raise SystemExit("forcing triton without triton must fail")
        except HardwareUnsupportedError:
            pass
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
