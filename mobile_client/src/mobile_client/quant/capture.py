"""Captures of the MTP head's real inputs from a verifier (transformers, float), for calibration, QAT and
the top-1 agreement measurement (paper Appendix A: the training inputs are the input embedding, the last
hidden state and the K/V of the two hand-off layers, captured by the verifier).

For a token sequence x_0 .. x_{n-1} and every root position t in [1, n): ``x_hat = [e(x_t) * sqrt(H) ;
h_{t-1}]`` (h after the final norm, docs/decisions.md D1) and K/V of positions [max(0, t - W), t) of the
verifier's last sliding and last full-attention layers, turned into step feeds by an ``MtpDrafter``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead
from mobile_client.drafters.spec import FULL, SLIDING, MtpSpec


@torch.no_grad()
def verifier_states(verifier, tokens: Sequence[int]) -> tuple[np.ndarray, dict]:
    """Run a transformers Gemma-4 verifier (``Gemma4ForCausalLM``) over ``tokens``.

    Returns h [n, H] (post-norm) and, per layer kind, K and V [n, kvh, d] of the last layer of that kind
    (rotated keys, as the KV cache stores them).
    """
    model = getattr(verifier, "model", verifier)
    out = model(input_ids=torch.tensor([list(tokens)]), return_shared_kv_states=True, use_cache=False)
    kv = {
        kind: tuple(t[0].transpose(0, 1).float().numpy() for t in out.shared_kv_states[kind])
        for kind in (SLIDING, FULL)
    }
    return out.last_hidden_state[0].float().numpy(), kv


def capture_feeds(
    spec: MtpSpec,
    verifier,
    sequences: Sequence[Sequence[int]],
    keep_ids: Sequence[int],
    window: int,
    every: int = 1,
    lut_bits: int | None = 8,
) -> list[dict[str, np.ndarray]]:
    """Step feeds (MTP_INPUTS) for every ``every``-th root position of each sequence."""
    embed = verifier.get_input_embeddings().weight.detach().float()  # [V, H]
    lut = EmbedLut.from_embedding(embed, keep_ids, bits=lut_bits)
    drafter = MtpDrafter(spec, keep_ids, lut, step=None, window=window)
    feeds = []
    scale = math.sqrt(embed.shape[1])
    for seq in sequences:
        h, kv = verifier_states(verifier, seq)
        for t in range(1, len(seq), every):
            lo = max(0, t - window)
            drafter.t0 = -1  # each capture is its own hand-off
            drafter.apply_handoff(t, lo, {k: (a[lo:t], b[lo:t]) for k, (a, b) in kv.items()})
            x_hat = np.concatenate([embed[seq[t]].numpy() * scale, h[t - 1]]).astype(np.float32)
            feeds.append({k: v.copy() for k, v in drafter.feeds(x_hat).items()})
    return feeds


def head_from_dir(path, keep_ids: Sequence[int]) -> tuple[MtpSpec, MtpHead]:
    """Load a ``gemma4_assistant`` folder (config.json + safetensors) as our float head."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(path)
    spec = MtpSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    sd = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update({k: v.float() for k, v in load_file(str(f)).items()})
    return spec, MtpHead.from_hf_state_dict(spec, sd, keep_ids)
