"""HyCo's phone drafter as the session sees it: a ``Drafter`` plus the hooks ``PhoneSession`` calls.

``mobile_client.session`` drives any ``Drafter`` (``propose(context, node_budget) -> DraftTree``) and calls
the optional hooks ``prefill(tokens)``, ``accept(rows[, tokens]) -> int`` and
``apply_handoff(payload) -> x_hat | None`` when a drafter has them. ``HycoPhoneDrafter`` supplies them for
HyCo's two drafters: the SLM's KV cache (prefill, accepted rows) and the MTP head's hand-off ring.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mobile_client.drafters.base import DraftContext, Drafter
from mobile_client.tree import DraftTree
from vllm_hyco.errors import SessionError
from vllm_hyco.handoff.quant import HandoffScales, dequantize
from vllm_hyco.handoff.schema import HandoffPayload


def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes the keyword argument ``name``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(q.name == name or q.kind is q.VAR_KEYWORD for q in params)


class HycoPhoneDrafter:
    """HyCo's phone: a ``Drafter`` (``HybridDrafter`` over the MTP and SLM Drafters) plus the session hooks.

    ``slm`` (``SlmDrafter``-like: ``prefill``, ``accept``) keeps the last committed tokens' KV; ``mtp``
    (``MtpDrafter``-like: ``apply_handoff(t, a, rows)``) keeps the hand-off's K/V ring. ``scales`` are the
    model's fixed hand-off scales (dequantization of the 8-bit rows and of e, h).
    """

    KINDS = {"sliding": "sliding_attention", "full": "full_attention"}

    def __init__(self, drafter: Drafter, *, slm: Any = None, mtp: Any = None,
                 scales: HandoffScales | None = None):
        if mtp is not None and scales is None:
            raise SessionError("an MTP drafter needs the model's hand-off scales", code="bad_config")
        self.drafter, self.slm, self.mtp, self.scales = drafter, slm, mtp, scales

    def propose(self, context: DraftContext, node_budget: int) -> DraftTree:
        return self.drafter.propose(context, node_budget)

    def prefill(self, tokens: Sequence[int]) -> None:
        if self.slm is not None and len(tokens):
            self.slm.prefill(list(tokens))

    def accept(self, rows: Sequence[int], tokens: Sequence[int] | None = None) -> int:
        """The SLM keeps the KV of the accepted rows it computed; ``tokens`` (root first) find them by their
        token path (the tree sent was trimmed after the forward, so its row indices need not be the
        forward's)."""
        if self.slm is None:
            return 0
        if tokens is not None and takes_keyword(self.slm.accept, "tokens"):
            return self.slm.accept(list(rows), tokens=list(tokens))
        return self.slm.accept(list(rows))

    def apply_handoff(self, h: HandoffPayload, tokens: Sequence[int] | None = None) -> np.ndarray | None:
        """Dequantize the hand-off, write its K/V rows into the MTP ring, return ``x_hat`` = [e ; h] [2H].

        A ``hidden`` row layer (an MTP layer with its own KV: ``drafters.own_mtp``) extends the MTP layer's
        cache from h_p and the committed ``tokens`` (all of them, by position) and returns its x_hat."""
        if self.mtp is None:
            return None
        layers = h.header.spec.layers
        if len(layers) == 1 and layers[0].kind == "hidden":
            if tokens is None:
                raise SessionError("an MTP layer with its own KV needs the committed tokens with the hand-off",
                                   code="bad_config")
            rows_h = dequantize(h.k[0][:, 0, :], self.scales.h)  # [P, hidden]
            return self.mtp.apply_handoff(h.header.root_position, h.header.span_start, rows_h, tokens)
        rows = {}
        for layer, k, v in zip(h.header.spec.layers, h.k, h.v):
            k_scale, v_scale = self.scales.layer(layer.layer_id)
            kf = dequantize(k, k_scale)  # [P, kv_heads, head_dim]
            rows[self.KINDS[layer.kind]] = (kf, kf if v is None else dequantize(v, v_scale))
        self.mtp.apply_handoff(h.header.root_position, h.header.span_start, rows)
        return np.concatenate([dequantize(h.e_bonus, self.scales.e), dequantize(h.h, self.scales.h)])



__all__ = ["HycoPhoneDrafter", "takes_keyword"]
