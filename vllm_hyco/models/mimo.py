"""MiMo: a Qwen2 decoder whose MTP layers own their attention and KV cache (``model_type`` ``mimo``).

* Verifier: ``MiMoForCausalLM`` (vLLM 0.32 ``model_executor/models/mimo.py``), every layer full attention,
  per-head K/V (the tree step, compaction and KV views of Gemma 4 apply unchanged).
* MTP: ``num_nextn_predict_layers`` layers under ``model.mtp_layers.N`` of the same checkpoint; vLLM drafts
  with the first (``mimo_mtp``, ``{"method": "mtp"}`` with the verifier folder as ``model``; its
  ``EagleProposer`` only calls layer 0). The layer is a whole Qwen2 decoder block with its own attention, so
  its KV cache is its own (``DrafterKV.OWN``): at position p it reads ``[hidden_norm(h_p) ;
  token_norm(e(x_{p+1}))]`` with h_p the verifier's last hidden state *before* the final norm (vLLM's
  ``MiMoModel.forward`` returns ``hidden + residual``) and writes its K/V at p.
* The hand-off therefore carries no verifier K/V: it carries h_p of every committed position as int8 rows
  with h's per-channel scales, one pseudo-layer of kind ``hidden`` (``HIDDEN``; hand-off schema 3), from
  which the phone extends its own copy of the MTP layer's cache. The next tokens are the committed ones,
  which the phone holds.
* W: the paper's 1,024 (the config has no sliding window).

>>> cfg = {"model_type": "mimo", "hidden_size": 8, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}
>>> [(h.layer_id, h.kind, h.head_dim, h.has_v) for h in MIMO.handoff_layers(cfg)], MIMO.handoff_window(cfg)
([(3, 'hidden', 8, False)], 1024)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.errors import ConfigError
from vllm_hyco.models.base import DEFAULT_HANDOFF_WINDOW, HIDDEN, DrafterKV, HandoffLayer, KVLayout


class MiMo:
    name = "mimo"
    model_types: tuple[str, ...] = ("mimo",)
    drafter_kv = DrafterKV.OWN
    kv_layout = KVLayout.PER_HEAD
    mtp_method = "mtp"
    mtp_proposer = "vllm.v1.spec_decode.eagle.EagleProposer"
    mtp_model_types: tuple[str, ...] = ("mimo",)  # the drafter is the verifier's own folder
    phone_mtp = True  # the phone runs the checkpoint's first MTP layer (mobile_client/drafters/own_mtp.py)

    def text_config(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        return config

    def layer_kinds(self, config: Mapping[str, Any]) -> tuple[str, ...]:
        return ("full",) * self._int(config, "num_hidden_layers")

    def kv_owners(self, config: Mapping[str, Any]) -> tuple[int, ...]:
        return tuple(range(len(self.layer_kinds(config))))

    def hidden_size(self, config: Mapping[str, Any]) -> int:
        return self._int(config, "hidden_size")

    def handoff_layers(self, config: Mapping[str, Any]) -> tuple[HandoffLayer, ...]:
        if self._int(config, "num_nextn_predict_layers", 0) < 1:
            raise ConfigError(f"a {self.name} checkpoint without MTP layers (num_nextn_predict_layers 0): HyCo's "
                              f"hand-off feeds the checkpoint's first MTP layer")
        # the MTP layer's index in vLLM (num_hidden_layers + 0): the h rows feed that layer's own cache
        return (HandoffLayer(self._int(config, "num_hidden_layers"), HIDDEN, 1, self.hidden_size(config), 0,
                             has_v=False),)

    def handoff_window(self, config: Mapping[str, Any], override: int | None = None) -> int:
        return int(override or DEFAULT_HANDOFF_WINDOW)

    @staticmethod
    def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if value is None:
            raise ConfigError(f"not a MiMo or DeepSeek-V3 config: it has no {key!r}")
        return int(value)


MIMO = MiMo()
