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

# mobile_client drafters (float torch reference vs transformers on the same weights)
TOLERANCES[("mtp_step", torch.float32)] = (1e-4, 1e-4)
TOLERANCES[("slm_logits", torch.float32)] = (1e-3, 1e-4)
TOLERANCES[("mtp_step_int8_kv", torch.float32)] = (0.25, 0.05)  # 8-bit K/V rows vs float rows, logits ~ +-30
