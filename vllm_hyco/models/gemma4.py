"""Gemma 4: the one model family HyCo serves today (``model_type`` ``gemma4`` / ``gemma4_text``).

* Layers: sliding-window and full attention (``layer_types``: ``sliding_attention`` / ``full_attention``;
  26B-A4B has 5 sliding : 1 full). With ``num_kv_shared_layers`` the trailing layers own no KV: each reads
  the last earlier layer of its type (vLLM's ``kv_sharing_target_layer_name``).
* The MTP drafter is the ``gemma4_assistant`` head: Q-only layers that read the verifier's K/V of its last
  full and last sliding cache-owning layer (vLLM 0.32 ``v1/spec_decode/gemma4.py``,
  ``_setup_gemma4_kv_sharing``): ``DrafterKV.SHARED``, and those two layers are the hand-off layers.
* Per-layer head counts and dims come from ``per_layer_config`` when the config has one (what transformers
  5.x writes), else full layers of a ``attention_k_eq_v`` model use ``num_global_key_value_heads`` and
  ``global_head_dim`` (the hub's keys). Both K and V are sent for ``k_eq_v`` layers: K is stored after
  k_norm and RoPE, V after v_norm only (vLLM 0.32 ``gemma4.py`` Gemma4Attention.forward).
* W defaults to the verifier's ``sliding_window`` (1,024 for 26B-A4B).

>>> cfg = {"model_type": "gemma4_text", "hidden_size": 8, "layer_types": ["sliding_attention", "full_attention",
...        "sliding_attention"], "num_key_value_heads": 2, "head_dim": 4, "sliding_window": 16}
>>> [(h.layer_id, h.kind) for h in GEMMA4.handoff_layers(cfg)], GEMMA4.handoff_window(cfg)
([(1, 'full'), (2, 'sliding')], 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.errors import ConfigError
from vllm_hyco.models.base import DEFAULT_HANDOFF_WINDOW, DrafterKV, HandoffLayer, KVLayout

SLIDING, FULL = "sliding", "full"
#: ``layer_types`` entries -> the hand-off's layer kinds
LAYER_TYPES = {"sliding_attention": SLIDING, "full_attention": FULL}


class Gemma4:
    name = "gemma4"
    model_types: tuple[str, ...] = ("gemma4", "gemma4_text")
    drafter_kv = DrafterKV.SHARED
    kv_layout = KVLayout.PER_HEAD
    mtp_method = "mtp"
    mtp_proposer = "vllm.v1.spec_decode.gemma4.Gemma4Proposer"
    mtp_model_types: tuple[str, ...] = ("gemma4_assistant",)
    phone_mtp = True  # the phone runs the assistant head (mobile_client/drafters/mtp.py)
    #: the hand-off sends the last cache-owning layer of each kind, in this order of kinds
    handoff_kinds = (SLIDING, FULL)

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        text: Mapping[str, Any] = config.get("text_config") or config
        return text

    def layer_kinds(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        text = self.text_config(config)
        try:
            return tuple(LAYER_TYPES[t] for t in text["layer_types"])
        except (KeyError, TypeError) as e:
            raise ConfigError(f"not a Gemma-4 text config with sliding and full layers: {e!r}") from e

    def kv_owners(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        kinds = self.layer_kinds(config)
        shared = int(self.text_config(config).get("num_kv_shared_layers") or 0)
        return tuple(range(len(kinds) - shared))

    def hidden_size(self, config: Mapping[str, Any]) -> int:
        return int(self.text_config(config)["hidden_size"])

    def handoff_layers(self, config: Mapping[str, Any]) -> tuple[HandoffLayer, ...]:
        text = self.text_config(config)
        kinds = self.layer_kinds(config)
        owners = self.kv_owners(config)
        k_eq_v = bool(text.get("attention_k_eq_v", False))
        layers = []
        try:
            for kind in self.handoff_kinds:
                lid = max(i for i in owners if kinds[i] == kind)
                heads, dim = _layer_dims(text, lid, kind == FULL and k_eq_v)
                window = int(text["sliding_window"]) if kind == SLIDING else 0
                layers.append(HandoffLayer(lid, kind, heads, dim, window, k_eq_v=kind == FULL and k_eq_v))
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise ConfigError(f"not a Gemma-4 text config with sliding and full layers: {e!r}") from e
        return tuple(sorted(layers, key=lambda layer: layer.layer_id))

    def handoff_window(self, config: Mapping[str, Any], override: int | None = None) -> int:
        return int(override or self.text_config(config).get("sliding_window") or DEFAULT_HANDOFF_WINDOW)


def _layer_dims(text: Mapping[str, Any], lid: int, global_kv: bool) -> tuple[int, int]:
    per_layer = text.get("per_layer_config")
    if per_layer is not None:
        # transformers writes zero-padded keys ("05" in a 12-layer model)
        over: Mapping[str, Any] = next((v for k, v in per_layer.items() if int(k) == lid), {})
        heads = over.get("num_key_value_heads", text["num_key_value_heads"])
        return int(heads), int(over.get("head_dim", text["head_dim"]))
    if global_kv:
        heads = text.get("num_global_key_value_heads") or text["num_key_value_heads"]
        return int(heads), int(text.get("global_head_dim", 512))
    return int(text["num_key_value_heads"]), int(text["head_dim"])


GEMMA4 = Gemma4()

# Gemma 4 26B-A4B. No config file is available offline: docs/decisions.md ("Gemma 4 26B-A4B") gives hidden
# 2,816, 30 layers (5 sliding : 1 full), window 1,024, full layers head dim 512 with unified K/V; the KV head
# counts (8 sliding, 2 global) are inferred: they are the split for which both layers' K and V make the
# paper's 6,144 values per position (8*256*2 + 2*512*2), and transformers' Gemma-4 EP plan comment says
# num_global_key_value_heads=2 for google/gemma-4-26B-A4B-it.
GEMMA4_26B_A4B_CONFIG = {
    "model_type": "gemma4_text",
    "hidden_size": 2816,
    "num_hidden_layers": 30,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
    "num_key_value_heads": 8,
    "num_global_key_value_heads": 2,
    "head_dim": 256,
    "global_head_dim": 512,
    "sliding_window": 1024,
    "attention_k_eq_v": True,
    "vocab_size": 262144,
}
