"""Every numeric tolerance of the suite, written down once: (op, dtype) -> (atol, rtol).

Token ids are always compared exactly. Add a row here rather than a literal in a test.
"""

import torch

TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("attention", torch.float32): (2e-5, 2e-5),
    ("attention", torch.float16): (2e-3, 2e-3),
    ("attention", torch.bfloat16): (1.6e-2, 1.6e-2),
    ("kv_copy", torch.float32): (0.0, 0.0),
    ("kv_copy", torch.float16): (0.0, 0.0),
    ("kv_copy", torch.bfloat16): (0.0, 0.0),
    ("probs", torch.float32): (1e-6, 1e-5),
    ("logits_engine_vs_prefill", torch.float32): (1e-3, 1e-3),
}


def tol(op: str, dtype: torch.dtype) -> dict[str, float]:
    """kwargs for torch.testing.assert_close / torch.allclose."""
    atol, rtol = TOLERANCES[(op, dtype)]
    return {"atol": atol, "rtol": rtol}
