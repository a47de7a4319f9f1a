"""The model seam (vllm_hyco/models): what HyCo needs from a family, and that the wire, the endpoint and the
engine read it instead of assuming Gemma 4."""

from __future__ import annotations

import pytest

from vllm_hyco.errors import ConfigError
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
    assert [f.name for f in FAMILIES] == ["gemma4"]


def test_the_wire_reads_the_seam():
    hidden, layers = layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)
    seam = GEMMA4.handoff_layers(FIXTURE_VERIFIER_CONFIG)
    assert hidden == GEMMA4.hidden_size(FIXTURE_VERIFIER_CONFIG)
    assert [(s.layer_id, s.kind, s.kv_heads, s.head_dim, s.window, s.k_eq_v) for s in layers] == [
        (h.layer_id, h.kind, h.kv_heads, h.head_dim, h.window, h.k_eq_v) for h in seam]


def test_unknown_families_and_broken_configs_are_refused_by_name():
    with pytest.raises(ConfigError, match="HyCo serves model families gemma4 .* model_type 'llama'"):
        family_of({"model_type": "llama"})
    with pytest.raises(ConfigError, match=r"\(MiMoForCausalLM\) has model_type 'mimo'"):  # named by architecture
        family_of({"model_type": "mimo", "architectures": ["MiMoForCausalLM"]})
    with pytest.raises(ConfigError, match="not a Gemma-4 text config"):
        GEMMA4.handoff_layers({"model_type": "gemma4_text", "hidden_size": 8,
                               "layer_types": ["sliding_attention", "sliding_attention"]})  # no full layer
    assert GEMMA4.handoff_window({"model_type": "gemma4_text"}) == DEFAULT_HANDOFF_WINDOW
