"""DeepSeek-V3: MLA attention and an MTP module with its own attention and KV (``model_type`` ``deepseek_v3``).

* Verifier: ``DeepseekV3ForCausalLM``, every layer full attention through MLA: its paged cache holds one
  latent row per token and layer, ``[blocks, 16, kv_lora_rank + rope]`` (``KVLayout.MLA_LATENT``). Tree rows
  run vLLM's MLA prefill path with the tree's mask, on vLLM's CPU build only (``worker/cpu_mla.py``); the
  latent rows compact like any cache row.
* MTP: ``num_nextn_predict_layers`` modules after the decoder layers (vLLM's ``deepseek_mtp``, ``{"method":
  "mtp"}`` with the verifier folder as ``model``); each is a whole MoE layer with MLA, about 11.6 B
  parameters of its own in the real model, so no phone runs it: phones draft SLM-only trees (the paper's
  Appendix H). The hand-off carries no per-position rows (an empty layer list, schema 3: e and h only), and
  the server keeps no h ring for its sessions; docs/engine.md says what a phone-sized MTP module would cost.
* W: the paper's 1,024.

>>> cfg = {"model_type": "deepseek_v3", "hidden_size": 8, "num_hidden_layers": 3, "num_nextn_predict_layers": 1}
>>> DEEPSEEK_V3.handoff_layers(cfg), DEEPSEEK_V3.phone_mtp
((), False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hyco.models.base import DrafterKV, HandoffLayer, KVLayout
from vllm_hyco.models.mimo import MiMo


class DeepseekV3(MiMo):
    """The seam's answers are MiMo's but for the KV layout, the types, the phone (no phone-sized MTP) and so the
    hand-off (no rows)."""

    name = "deepseek_v3"
    model_types: tuple[str, ...] = ("deepseek_v3",)
    drafter_kv = DrafterKV.OWN
    kv_layout = KVLayout.MLA_LATENT
    mtp_model_types: tuple[str, ...] = ("deepseek_v3",)
    phone_mtp = False  # its MTP module is a whole MoE layer: phones draft SLM-only trees

    def handoff_layers(self, config: Mapping[str, Any]) -> tuple[HandoffLayer, ...]:
        return ()  # no phone MTP head reads anything per position


DEEPSEEK_V3 = DeepseekV3()
