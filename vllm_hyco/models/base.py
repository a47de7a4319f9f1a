"""What HyCo needs from a model family, stated once (pure Python; every process and the phone may import it).

HyCo touches a verifier in four places, and model families differ in each:

1. **Which layers the hand-off sends.** The phone's MTP drafter reads some of the verifier's K/V (Gemma 4's
   assistant reads its last full and last sliding layer): :meth:`ModelFamily.handoff_layers`, with the
   attention kind of every layer (:meth:`ModelFamily.layer_kinds`) and which layers own a KV cache
   (:meth:`ModelFamily.kv_owners`: Gemma 4's trailing KV-shared layers read an earlier layer's).
2. **How the drafter gets its KV** (:class:`DrafterKV`): ``SHARED``, the drafter attends to verifier
   layers' K/V, so the hand-off carries those rows (Gemma 4); ``OWN``, the MTP layer has its own attention
   and KV cache (DeepSeek-V3, MiMo, GLM-4.5), so the phone must extend its copy of that cache from what the
   server sends per committed position (the hidden state h of each position, and e where needed).
3. **The KV layout** (:class:`KVLayout`): ``PER_HEAD`` K and V per KV head (what the tree step, the
   compaction and the hand-off gather read today) or ``MLA_LATENT``, DeepSeek's one compressed latent plus a
   rope part per token.
4. **vLLM's own drafting for ordinary requests**: the speculative method and the proposer vLLM uses for
   this family's MTP head (``mtp`` and ``Gemma4Proposer`` for Gemma 4), for a server that drafts requests
   without a phone.

Every family is one module of this package implementing :class:`ModelFamily`;
``vllm_hyco.models.family_of(config)`` picks it from a Hugging Face config (``config.json`` as a dict).
The engine, the wire's byte counts, the endpoint and the fixtures read the seam instead of assuming a
family; what a family does not support yet is refused by name at startup.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

#: the hand-off window W when the config names none (the paper's 1,024 positions)
DEFAULT_HANDOFF_WINDOW = 1024
#: the hand-off "layer" kind of a ``DrafterKV.OWN`` family: the verifier's hidden state h_p of every committed
#: position (one row of ``hidden`` values, h's scales), from which the phone extends its MTP layer's own KV
HIDDEN = "hidden"


class DrafterKV(str, enum.Enum):
    """Where the family's MTP drafter gets the K/V it attends to."""

    SHARED = "shared"  # verifier layers' K/V (the hand-off carries their rows)
    OWN = "own"  # the MTP layer's own attention and KV cache


class KVLayout(str, enum.Enum):
    """How the verifier's paged KV cache holds a token."""

    PER_HEAD = "per_head"  # K and V per KV head: [blocks, block_size, kv_heads, head_dim] each
    MLA_LATENT = "mla_latent"  # one compressed latent plus a rope part (DeepSeek's MLA): [blocks, block_size, 576]


@dataclass(frozen=True)
class HandoffLayer:
    """A verifier attention layer whose K/V rows the hand-off carries (the wire's ``LayerSpec`` is built
    from it: ``vllm_hyco.handoff.schema``)."""

    layer_id: int
    kind: str  # the layer's attention kind in the family's terms ("full" | "sliding" for Gemma 4)
    kv_heads: int
    head_dim: int
    window: int  # sliding window in positions; 0 for full attention
    k_eq_v: bool = False  # one projection makes K and V (V is still sent: it is normed differently)
    has_v: bool = True  # V rows are sent (False for the ``HIDDEN`` rows: one row per position)


class ModelFamily(Protocol):
    """One model family's answers (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]  # Hugging Face ``model_type`` values of its verifiers
    drafter_kv: DrafterKV
    kv_layout: KVLayout
    mtp_method: str  # vLLM's speculative method that drafts with this family's MTP head
    mtp_proposer: str  # the vLLM proposer class that runs it (qualified name)
    mtp_model_types: tuple[str, ...]  # ``model_type`` of the MTP drafters vLLM supports for this family
    phone_mtp: bool  # a phone can run its MTP drafter (else phones draft SLM-only trees: DeepSeek-V3)

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The text model's config (a multimodal checkpoint nests it)."""
        ...

    def layer_kinds(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        """The attention kind of every decoder layer, in layer order."""
        ...

    def kv_owners(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        """The layers that own a KV cache (the rest read another layer's)."""
        ...

    def hidden_size(self, config: Mapping[str, Any]) -> int:
        ...

    def handoff_layers(self, config: Mapping[str, Any]) -> tuple[HandoffLayer, ...]:
        """The layers the hand-off sends, by layer id (for ``DrafterKV.OWN``: one ``HIDDEN`` row layer, id =
        the MTP layer's)."""
        ...

    def handoff_window(self, config: Mapping[str, Any], override: int | None = None) -> int:
        """W: the K/V positions the phone keeps (``override``: the operator's ``window`` option)."""
        ...
