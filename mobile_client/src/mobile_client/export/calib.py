"""Calibration and golden feeds for the drafter steps.

Random-weight fixtures get synthetic feeds shaped like the phone's real inputs (rings partly filled,
masks per layer window, z = [8-bit LUT row ; h]); trained fixtures should pass captures of the verifier
instead (``feeds_from_captures``), which is what the paper's fixed ranges come from.
"""

from __future__ import annotations

import numpy as np

from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
from mobile_client.drafters.spec import MtpSpec


def mtp_feeds(
    spec: MtpSpec, head: MtpHead, lut: EmbedLut, keep_ids, window: int, n: int, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """``n`` step inputs from a drafter fed random hand-offs of random lengths (1 .. 1.5 W positions)."""
    rng = np.random.default_rng(seed)
    drafter = MtpDrafter(spec, keep_ids, lut, torch_step(head), window=window)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, int(1.5 * window) + 1))
        rows = {
            kind: (
                rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
                rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
            )
            for kind, a in spec.attn.items()
        }
        drafter.apply_handoff(t, 0, rows)
        z = np.concatenate([lut[int(rng.integers(len(keep_ids)))], rng.standard_normal(spec.backbone)])
        out.append(drafter.feeds(z.astype(np.float32)))
        drafter.t0 = -1  # next feed is a new request
    return out


def feeds_from_captures(captures: list[dict[str, np.ndarray]], names) -> list[dict[str, np.ndarray]]:
    """Captured step inputs (e.g. from the trained fixtures' verifier) -> feeds, checked for names."""
    for c in captures:
        missing = set(names) - set(c)
        assert not missing, f"capture lacks {sorted(missing)}"
    return [{n: np.asarray(c[n], np.float32) for n in names} for c in captures]
