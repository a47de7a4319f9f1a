"""The model seam (vllm_hyco/models): what HyCo needs from a family, and that the wire, the endpoint and the
engine read it instead of assuming Gemma 4."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hyco.errors import ConfigError, HandoffSchemaError
from vllm_hyco.handoff.schema import HandoffHeader
from vllm_hyco.handoff.sizes import FIXTURE_VERIFIER_CONFIG, layers_from_hf_config
from vllm_hyco.models import DEFAULT_HANDOFF_WINDOW, FAMILIES, DrafterKV, KVLayout, family_of
from vllm_hyco.models.gemma4 import GEMMA4, GEMMA4_26B_A4B_CONFIG


def test_gemma4_26b_a4b_hands_off_its_last_sliding_and_last_full_layer():
    layers = GEMMA4.handoff_layers(GEMMA4_26B_A4B_CONFIG)
    assert [(h.layer_id, h.kind, h.kv_heads, h.head_dim, h.window, h.k_eq_v) for h in layers] == [
        (28, "sliding", 8, 256, 1024, False), (29, "full", 2, 512, 0, True)]
    assert GEMMA4.handoff_window(GEMMA4_26B_A4B_CONFIG) == 1024 and GEMMA4.hidden_size(GEMMA4_26B_A4B_CONFIG) == 2816
    assert GEMMA4.handoff_window(GEMMA4_26B_A4B_CONFIG, override=256) == 256  # the operator's window option


def test_kv_shared_trailing_layers_own_no_cache_and_are_never_handed_off():
    cfg = {**GEMMA4_26B_A4B_CONFIG, "num_kv_shared_layers": 8}  # layers 22..29 read earlier ones
    assert GEMMA4.kv_owners(cfg) == tuple(range(22))
    assert [(h.layer_id, h.kind) for h in GEMMA4.handoff_layers(cfg)] == [(17, "full"), (21, "sliding")]


def test_a_multimodal_config_is_read_through_its_text_config():
    wrapped = {"model_type": "gemma4", "text_config": FIXTURE_VERIFIER_CONFIG}
    assert family_of(wrapped) is GEMMA4 and GEMMA4.handoff_layers(wrapped) == GEMMA4.handoff_layers(
        FIXTURE_VERIFIER_CONFIG)


def test_what_the_engine_builds_on_today():
    # the tree step and the hand-off read a drafter that attends to the verifier's per-head K/V
    assert (GEMMA4.drafter_kv, GEMMA4.kv_layout) == (DrafterKV.SHARED, KVLayout.PER_HEAD)
    assert (GEMMA4.mtp_method, GEMMA4.mtp_model_types) == ("mtp", ("gemma4_assistant",))
    assert GEMMA4.mtp_proposer.rsplit(".", 1)[1] == "Gemma4Proposer"
    assert [f.name for f in FAMILIES] == ["gemma4", "mimo", "deepseek_v3"]
    assert [f.phone_mtp for f in FAMILIES] == [True, True, False]  # DeepSeek-V3: SLM-only phones


def test_the_wire_reads_the_seam():
    hidden, layers = layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)
    seam = GEMMA4.handoff_layers(FIXTURE_VERIFIER_CONFIG)
    assert hidden == GEMMA4.hidden_size(FIXTURE_VERIFIER_CONFIG)
    assert [(s.layer_id, s.kind, s.kv_heads, s.head_dim, s.window, s.k_eq_v) for s in layers] == [
        (h.layer_id, h.kind, h.kv_heads, h.head_dim, h.window, h.k_eq_v) for h in seam]


def test_unknown_families_and_broken_configs_are_refused_by_name():
    with pytest.raises(ConfigError, match="HyCo serves model families gemma4 .* model_type 'llama'"):
        family_of({"model_type": "llama"})
    with pytest.raises(ConfigError, match=r"\(Glm4MoeForCausalLM\) has model_type 'glm4_moe'"):
        family_of({"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]})
    with pytest.raises(ConfigError, match="not a Gemma-4 text config"):
        GEMMA4.handoff_layers({"model_type": "gemma4_text", "hidden_size": 8,
                               "layer_types": ["sliding_attention", "sliding_attention"]})  # no full layer
    assert GEMMA4.handoff_window({"model_type": "gemma4_text"}) == DEFAULT_HANDOFF_WINDOW


MIMO_CONFIG = {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "hidden_size": 16,
               "num_hidden_layers": 3, "num_nextn_predict_layers": 1}


def test_mimo_hands_off_h_rows_for_its_own_kv_mtp_layer():
    """MiMo's MTP layer owns its KV: the hand-off's one layer is the ``hidden`` rows (schema 3), id = the MTP
    layer's index in vLLM, no V, and the phone's scales for it are h's."""
    from vllm_hyco.handoff.quant import HandoffScales
    from vllm_hyco.handoff.schema import HandoffPayload, HandoffSpec, decode_handoff, encode_handoff
    from vllm_hyco.models import HIDDEN, MIMO

    assert family_of(MIMO_CONFIG) is MIMO and (MIMO.drafter_kv, MIMO.kv_layout) == (DrafterKV.OWN, KVLayout.PER_HEAD)
    hidden, layers = layers_from_hf_config(MIMO_CONFIG)
    assert hidden == 16 and [(s.layer_id, s.kind, s.kv_heads, s.head_dim, s.has_v) for s in layers] == [
        (3, HIDDEN, 1, 16, False)]
    scales = HandoffScales(e=np.full(16, 0.1, np.float32), h=np.full(16, 0.2, np.float32), layers=())
    spec = HandoffSpec.from_scales(MIMO_CONFIG, layers, scales)
    assert spec.version == 3 and spec.to_wire()["version"] == 3 and spec.values_per_position == 16
    assert HandoffSpec.from_wire(spec.to_wire()) == spec
    k, v = scales.rows(3, HIDDEN)
    assert v is None and np.array_equal(k, scales.h[None])
    rows = np.linspace(-1, 1, 5 * 16, dtype=np.float32).reshape(5, 1, 16)
    p = HandoffPayload.quantized(HandoffHeader(spec, 7, 12), scales, 9, np.zeros(16, np.float32),
                                 np.zeros(16, np.float32), [rows], [None])
    back = decode_handoff(encode_handoff(p), spec)
    assert back == p and back.k[0].shape == (5, 1, 16) and back.v[0] is None
    # a schema-2 map cannot carry h rows, and h rows share a schema with no K/V layer
    wire = spec.to_wire()
    with pytest.raises(HandoffSchemaError, match="needs schema 3"):
        HandoffSpec.from_wire({**wire, "version": 2})
    with pytest.raises(HandoffSchemaError, match="16 wide, the model's hidden size is 32"):
        HandoffSpec.from_wire({**wire, "hidden": 32})
    gemma = layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)[1][0].to_wire()
    with pytest.raises(HandoffSchemaError, match="no other layer"):
        HandoffSpec.from_wire({**wire, "layers": [*wire["layers"], gemma]})
    # a Gemma-4 schema is still written as 2 (its sessions keep their bytes)
    assert HandoffSpec.from_scales(FIXTURE_VERIFIER_CONFIG, layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)[1],
                                   scales).version == 2
    # the paper's byte count holds for h rows: 44 B + 2H + H per position (MiMo-7B: 4,096 B a position)
    from vllm_hyco.handoff.sizes import handoff_bytes, paper_handoff_bytes

    assert all(abs(handoff_bytes(spec, n) - paper_handoff_bytes(spec, n)) <= 4 for n in (1, 5, 1024))
    with pytest.raises(ConfigError, match="without MTP layers"):
        MIMO.handoff_layers({**MIMO_CONFIG, "num_nextn_predict_layers": 0})


def test_deepseek_hand_offs_carry_no_rows_for_its_slm_only_phones():
    """DeepSeek-V3's MTP module is no phone's: its schema lists no layer (schema 3), so a hand-off is e and h."""
    from vllm_hyco.handoff.quant import HandoffScales
    from vllm_hyco.handoff.schema import HandoffPayload, HandoffSpec, decode_handoff, encode_handoff
    from vllm_hyco.handoff.sizes import handoff_bytes

    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 16,
           "num_hidden_layers": 3, "num_nextn_predict_layers": 0}
    hidden, layers = layers_from_hf_config(cfg)
    scales = HandoffScales(e=np.full(16, 0.1, np.float32), h=np.full(16, 0.2, np.float32), layers=())
    spec = HandoffSpec.from_scales(cfg, layers, scales)
    assert layers == () and spec.version == 3 and HandoffSpec.from_wire(spec.to_wire()) == spec
    p = HandoffPayload.make_dummy(spec, span_start=0, root_position=40)
    assert decode_handoff(encode_handoff(p), spec) == p
    assert handoff_bytes(spec, 1) == handoff_bytes(spec, 1000) < 100  # nothing per position
    with pytest.raises(HandoffSchemaError, match="expected 1"):
        HandoffSpec.from_wire({**spec.to_wire(), "version": 2})
