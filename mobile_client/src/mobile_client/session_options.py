"""What a phone session asks for in ``start`` and how it drafts: ``SessionOptions`` (``mobile_client.session``
re-exports it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.client_frames import MIN_CLIENT_MESSAGE_BYTES
from vllm_hyco.handoff.limits import AIOHTTP_DEFAULT_MAX_MSG
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET

DRAFT_SAMPLING = ("greedy", "probabilistic")  # SessionOptions.draft_sampling
TREE_ORDERS = ("auto", "learned", "chain", "score")  # SessionOptions.order
OPENINGS = ("slm", "root")  # SessionOptions.opening
# tree [, catch_up=tokens] -> mobile_client.baselines.ProactiveDraft; ``catch_up`` (when the function takes
# it): committed tokens before the tree's root that the drafter has not seen yet
ProactiveFn = Callable[..., Any]


@dataclass(frozen=True)
class SessionOptions:
    """What the phone asks for in ``start`` and how it drafts."""

    mode: str = "exact"  # "exact" (lossless, the default) or "epsilon" (only if the operator enabled it)
    epsilon: float | None = None  # with "epsilon": a stricter ε than the operator's; None = the operator's
    node_budget: int = DEFAULT_NODE_BUDGET  # the largest tree this phone builds (capabilities.node_budget)
    labels: bool = True  # send per-node source labels (statistics only)
    values: bool = False  # send per-node values: round(255 * exp(the node's Algorithm-3 log-score))
    max_message_bytes: int = AIOHTTP_DEFAULT_MAX_MSG  # the client's WebSocket receive limit
    keep_set_hash: bytes | None = None
    fingerprint: bytes | None = None  # the model bundle's fingerprint; None: take it from ``spec``
    # proactive drafting (mobile_client.baselines.proactive_draft): called with the tree in flight; its
    # prepared tree is used when the verdict matches the bet. Needs a drafter whose SLM calls are pure.
    proactive: ProactiveFn | None = None
    # "probabilistic": with a sampled request (temperature > 0) the MTP chain is drawn from the head's
    # distribution, sent as the tree's draft_q (lossless, accepted more often). "greedy": the argmax
    draft_sampling: str = "greedy"
    # the order of the tree's rows (every prefix is a tree; the server's adaptive budget may verify only a
    # prefix): "learned", by the acceptance this session's verdicts showed per depth and source (a chain
    # of sampled drafts that is accepted 9 times in 10 goes before the runner-ups), or "score", by the
    # Algorithm-3 score alone. The node set is Algorithm 3's either way.
    # "chain": the MTP chain's rows first (in depth order), then the rest as "learned": every prefix of at
    # most K nodes is then a chain, which the server verifies with vLLM's own attention (a cut tree that
    # branches pays the tree attention: the engine's step-cost model charges it, docs/engine.md). "auto":
    # "chain" in exact mode (measured on two families: the adaptive cut keeps the chain, MAT up 0.2-0.4 at the
    # same server time, docs/benchmarks.md), "learned" in epsilon mode (not measured with the chain first)
    order: str = "auto"
    # round 0 (docs/decisions.md D2): "slm", the SLM's tree alone, rooted at the prompt's last token; "root",
    # the root alone: its verdict is the first token (the verifier's sample at the prompt's last position)
    # and the seed, so round 1 drafts the MTP chain from the prompt's last h, as vLLM's first MTP step does
    # after its prefill (the SLM is prefilled while the root is verified). "slm" is the default: on the shipped
    # family at 32-token answers "root" cost 10-12 % more server time in two runs (one more round per
    # session), for 35-50 ms less time to the first token (docs/benchmarks.md, "The root-only opening")
    opening: str = "slm"

    @property
    def tree_order(self) -> str:
        """The order the session uses: ``order``, with "auto" resolved by the mode."""
        if self.order != "auto":
            return self.order
        return "chain" if self.mode == "exact" else "learned"

    def __post_init__(self):
        if self.opening not in OPENINGS:
            raise ConfigError(f"SessionOptions.opening must be one of {', '.join(map(repr, OPENINGS))}, got "
                              f"{self.opening!r}")
        if self.order not in TREE_ORDERS:
            raise ConfigError(f"SessionOptions.order must be one of {', '.join(map(repr, TREE_ORDERS))}, got "
                              f"{self.order!r}")
        if self.draft_sampling not in DRAFT_SAMPLING:
            allowed = ", ".join(map(repr, DRAFT_SAMPLING))
            raise ConfigError(f"SessionOptions.draft_sampling must be one of {allowed}, got "
                              f"{self.draft_sampling!r}")
        if self.mode not in ("exact", "epsilon"):
            raise ConfigError(f"SessionOptions.mode must be 'exact' or 'epsilon', got {self.mode!r}")
        if self.epsilon is not None and (self.mode != "epsilon" or not 0.0 < self.epsilon < 1.0):
            raise ConfigError(f"SessionOptions.epsilon={self.epsilon!r}: only with mode 'epsilon', strictly "
                              f"between 0 and 1 (and no laxer than the operator's)")
        if not 1 <= self.node_budget <= 254 or self.max_message_bytes < MIN_CLIENT_MESSAGE_BYTES:
            raise ConfigError(f"SessionOptions: node_budget must be 1..254 (got {self.node_budget}), "
                              f"max_message_bytes >= {MIN_CLIENT_MESSAGE_BYTES} "
                              f"(got {self.max_message_bytes})")


__all__ = ["DRAFT_SAMPLING", "OPENINGS", "TREE_ORDERS", "ProactiveFn", "SessionOptions"]
