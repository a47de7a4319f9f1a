"""The model seam: one module per model family saying what HyCo needs from it (``base.ModelFamily``).

Families: ``gemma4`` (:data:`vllm_hyco.models.gemma4.GEMMA4`), ``mimo`` (:data:`vllm_hyco.models.mimo.MIMO`)
and ``deepseek_v3`` (:data:`vllm_hyco.models.deepseek.DEEPSEEK_V3`, CPU build only). Pure Python: the engine's
three processes, the wire's byte counts (``vllm_hyco.handoff.sizes``), the endpoint, the phone and the lab's
fixtures all read it. A config no family serves is refused by name (:func:`family_of`).

>>> family_of({"model_type": "gemma4_text"}).name
'gemma4'
>>> family_of({"model_type": "llama"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
vllm_hyco.errors.ConfigError: HyCo serves model families gemma4 (...); this checkpoint (...) has model_type 'llama', ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.errors import ConfigError
from vllm_hyco.models.base import DEFAULT_HANDOFF_WINDOW, HIDDEN, DrafterKV, HandoffLayer, KVLayout, ModelFamily
from vllm_hyco.models.deepseek import DEEPSEEK_V3
from vllm_hyco.models.gemma4 import GEMMA4
from vllm_hyco.models.mimo import MIMO

FAMILIES: tuple[ModelFamily, ...] = (GEMMA4, MIMO, DEEPSEEK_V3)

__all__ = ["DEFAULT_HANDOFF_WINDOW", "FAMILIES", "HIDDEN", "DrafterKV", "HandoffLayer", "KVLayout", "ModelFamily",
           "family_of"]


def family_of(config: Mapping[str, Any]) -> ModelFamily:
    """The family serving a Hugging Face config (``config.json`` as a dict; a multimodal config is
    matched by its own ``model_type``, or its ``text_config``'s)."""
    types = [config.get("model_type"), (config.get("text_config") or {}).get("model_type")]
    for family in FAMILIES:
        if any(t in family.model_types for t in types if t):
            return family
    known = "; ".join(f"{f.name} (model_type {', '.join(f.model_types)})" for f in FAMILIES)
    arch = ", ".join(config.get("architectures") or []) or "no architectures listed"
    raise ConfigError(f"HyCo serves model families {known}; this checkpoint ({arch}) has model_type {types[0]!r}, "
                      f"which no family's model seam serves (vllm_hyco/models/)")
