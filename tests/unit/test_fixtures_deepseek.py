"""The DeepSeek-V3-shaped fixture (issue 35): its config loads as deepseek_v3 and its weights hold the MTP layer
under the names vLLM's ``deepseek_mtp`` loader reads."""

from __future__ import annotations

import json

import pytest

from hyco_lab.fixtures.deepseek import DeepseekOptions, build_deepseek, mtp_prefix, weight_shapes

MTP_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight",
             "embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight",
             "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
             "mlp.experts.0.gate_proj.weight")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_deepseek(tmp_path_factory.mktemp("deepseek") / "model", progress=False)


def test_config_is_deepseek_v3_with_mla_sizes_the_cpu_kernel_takes(built):
    raw = json.loads((built / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["model_type"] == "deepseek_v3"
    assert raw["kv_lora_rank"] + raw["qk_rope_head_dim"] == 576  # vLLM CPU_MLA's only head size
    assert raw["num_nextn_predict_layers"] == 1 and raw["n_shared_experts"] == 1
    assert (raw["topk_method"], raw["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert 0 < raw["first_k_dense_replace"] < raw["num_hidden_layers"]
    transformers = pytest.importorskip("transformers")
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(built), local_files_only=True)
    except ValueError:  # a transformers without deepseek_v3: the json checks above stand
        return
    assert cfg.model_type == "deepseek_v3" and cfg.kv_lora_rank == 512 and cfg.qk_rope_head_dim == 64
    assert cfg.vocab_size == json.loads((built / "fixture.json").read_text())["vocab_size"]


def test_weights_hold_the_mtp_layer_and_match_the_manifest(built):
    from safetensors import safe_open

    manifest = json.loads((built / "fixture.json").read_text())
    with safe_open(str(built / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shared_head = f.get_tensor(f"{mtp_prefix(DeepseekOptions())}shared_head.head.weight")
        lm_head = f.get_tensor("lm_head.weight")
        bias_dtype = f.get_tensor(f"{mtp_prefix(DeepseekOptions())}mlp.gate.e_score_correction_bias").dtype
    n = manifest["options"]["num_hidden_layers"]
    assert mtp_prefix(DeepseekOptions()) == f"model.layers.{n}."
    assert {f"model.layers.{n}.{part}" for part in MTP_PARTS} <= names
    assert not any(name.startswith(f"model.layers.{n + 1}.") for name in names)
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first_k_dense_replace: layer 0 is dense
    assert shared_head.equal(lm_head)  # vLLM shares the target's lm_head into shared_head.head anyway
    assert str(bias_dtype) == "torch.float32"
    assert names == set(weight_shapes(DeepseekOptions(), manifest["vocab_size"]))
    assert 0 < manifest["params"]["mtp"] < manifest["params"]["main"]
    assert len(manifest["weights_sha256"]) == 64


def test_unknown_option_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown DeepSeek fixture option"):
        build_deepseek(tmp_path, progress=False, kv_rank=3)
