"""Byte counts (vllm_hyco.handoff.sizes): 26B-A4B against the paper's numbers, the fixture layout."""

import pytest

from vllm_hyco.handoff.limits import AIOHTTP_DEFAULT_MAX_MSG
from vllm_hyco.handoff.sizes import (
    FIXTURE_VERIFIER_CONFIG,
    handoff_bytes,
    layers_from_hf_config,
    paper_handoff_bytes,
    seed_bytes,
    session_frame_bytes,
    size_report,
    spec_from_hf_config,
    tree_frame_bytes,
)
from vllm_hyco.models.gemma4 import GEMMA4_26B_A4B_CONFIG


def test_26b_a4b_value_counts_match_the_paper():
    spec = spec_from_hf_config(GEMMA4_26B_A4B_CONFIG)
    assert spec.values_per_round == 5632 and spec.values_per_position == 6144
    assert [(ly.layer_id, ly.kind) for ly in spec.layers] == [(28, "sliding"), (29, "full")]
    assert paper_handoff_bytes(spec, 1) == 44 + 5632 + 6144


def test_each_position_costs_exactly_its_int8_values_on_the_wire():
    for cfg in (GEMMA4_26B_A4B_CONFIG, FIXTURE_VERIFIER_CONFIG):
        spec = spec_from_hf_config(cfg)
        assert handoff_bytes(spec, 3) - handoff_bytes(spec, 2) == spec.values_per_position


@pytest.mark.parametrize("positions", [1, 2, 5, 64])
def test_per_round_handoff_is_within_64_bytes_of_the_paper(positions):
    """Protocol 2: the schema travels once per session, a hand-off carries span, bonus and framing only."""
    spec = spec_from_hf_config(GEMMA4_26B_A4B_CONFIG)
    extra = handoff_bytes(spec, positions) - paper_handoff_bytes(spec, positions)
    assert 0 < extra <= 64


def test_the_schema_costs_once_per_session():
    spec = spec_from_hf_config(GEMMA4_26B_A4B_CONFIG)
    assert 0 < session_frame_bytes(spec) <= 512
    r = size_report(GEMMA4_26B_A4B_CONFIG, 1024, max_accepted=0)
    assert r["handoff_over_paper_bytes"] <= 64 and r["session_frame_bytes"] == session_frame_bytes(spec)


def test_seed_is_about_6_3_mb_and_every_chunk_frame_fits_aiohttp_default():
    seed = seed_bytes(spec_from_hf_config(GEMMA4_26B_A4B_CONFIG), 1024)
    assert 6_290_000 < seed["handoff"] < 6_300_000 and seed["chunks"] == 7
    assert seed["max_frame"] < AIOHTTP_DEFAULT_MAX_MSG


@pytest.mark.parametrize("labels", [True, False])
def test_32_node_tree_frame_is_at_most_256_bytes(labels):
    assert tree_frame_bytes(32, labels=labels, round=2**31 - 1, token=262_000) <= 256


def test_node_values_and_the_schema_confirmation_cost_their_bytes_only():
    base = tree_frame_bytes(32)
    assert tree_frame_bytes(32, values=True) == base + len("values") + 1 + 2 + 33
    assert tree_frame_bytes(32, schema=True) == base + len("schema") + 1 + 2 + 8


def test_fixture_config_matches_the_fixture_generator_defaults():
    build = pytest.importorskip("hyco_lab.fixtures.build")
    o = build.FixtureOptions()
    want = {
        "hidden_size": o.verifier_hidden,
        "layer_types": list(o.verifier_layers),
        "num_key_value_heads": o.verifier_kv_heads,
        "num_global_key_value_heads": o.verifier_global_kv_heads,
        "head_dim": o.verifier_head_dim,
        "global_head_dim": o.verifier_global_head_dim,
        "sliding_window": o.window,
    }
    assert {k: FIXTURE_VERIFIER_CONFIG[k] for k in want} == want
    hidden, layers = layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)
    assert hidden == 256 and [ly.row_values for ly in layers] == [1024, 1024]


def test_report_has_up_and_down_per_round():
    r = size_report(FIXTURE_VERIFIER_CONFIG, 128, max_accepted=2)
    assert r["handoff_bytes_per_position"] == 2048 and set(r["rounds"]) == {0, 1, 2}
    assert r["rounds"][1]["verdict"] > r["rounds"][1]["handoff"] > r["rounds"][1]["paper_handoff"]


def test_layers_from_a_transformers_written_config():
    cfg = {k: v for k, v in FIXTURE_VERIFIER_CONFIG.items() if "global" not in k}
    cfg["per_layer_config"] = {"3": {"head_dim": 512, "num_key_value_heads": 1}}
    assert layers_from_hf_config({"text_config": cfg}) == layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)


def test_layers_from_the_real_fixture_config():
    build = pytest.importorskip("hyco_lab.fixtures.build")
    pytest.importorskip("transformers")
    cfg = build.verifier_config(build.FixtureOptions(), 4096).to_dict()
    assert layers_from_hf_config(cfg) == layers_from_hf_config(FIXTURE_VERIFIER_CONFIG)


def test_a_config_without_layer_types_is_a_config_error():
    from vllm_hyco.errors import ConfigError

    with pytest.raises(ConfigError):
        layers_from_hf_config({"hidden_size": 4})
