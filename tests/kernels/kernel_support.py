"""What every kernel test module shares: the device, whether Triton can run here, a random tree.

Triton runs on a GPU, or on CPU tensors under ``TRITON_INTERPRET=1`` (tier 2 of scripts/test.sh); the
torch twins run everywhere. No vLLM import: the device machine (torch + Triton only) runs these files.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_hyco.kernels import HAS_TRITON, interpreting

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = HAS_TRITON and (DEVICE == "cuda" or interpreting())
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs a GPU or TRITON_INTERPRET=1")


def random_tree(n: int, seed: int, reach: int = 6) -> list[int]:
    """Parents of an ``n``-row tree (row 0 the root); each row's parent is one of the ``reach`` rows before it."""
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, j - reach), j) for j in range(1, n)]
