"""The fixture family loads offline with transformers and has the shapes the project relies on."""

from __future__ import annotations

import json

import pytest


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_verifier_is_26b_a4b_shaped(fixtures_dir):
    cfg = _config(fixtures_dir / "verifier")
    assert cfg["model_type"] == "gemma4_text" and cfg["architectures"] == ["Gemma4ForCausalLM"]
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    assert all(cfg["per_layer_config"][str(i)]["head_dim"] == 512 for i in full)
    assert cfg["attention_k_eq_v"] and cfg["enable_moe_block"] and cfg["num_experts"] > cfg["top_k_experts"]
    assert cfg["sliding_window"] == 128 and cfg["dtype"] == "float32"


def test_assistant_reads_the_verifier(fixtures_dir):
    cfg, ver = _config(fixtures_dir / "assistant"), _config(fixtures_dir / "verifier")
    assert cfg["model_type"] == "gemma4_assistant" and cfg["backbone_hidden_size"] == ver["hidden_size"]
    text = cfg["text_config"]
    assert text["num_kv_shared_layers"] == text["num_hidden_layers"]
    assert set(text["layer_types"]) == {"sliding_attention", "full_attention"}


def test_slm_is_e2b_shaped(fixtures_dir):
    cfg = _config(fixtures_dir / "slm")
    assert cfg["hidden_size_per_layer_input"] > 0 and cfg["num_kv_shared_layers"] > 0
    assert cfg["sliding_window"] == 128


def test_tokenizer_offline_with_chat_template(fixtures_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixtures_dir / "tokenizer"))
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<eos>", "<bos>", "<unk>"]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"
    assert tok("x").input_ids[0] == 2  # <bos> prepended like Gemma


def test_models_load_and_generate(fixtures_dir):
    import torch
    from transformers import AutoModelForCausalLM, Gemma4AssistantForCausalLM

    ids = torch.tensor([[2, 10, 20, 30]])
    for name in ("verifier", "slm"):
        model = AutoModelForCausalLM.from_pretrained(str(fixtures_dir / name))
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # no early end of turn
        assert out.shape == (1, 8)
    assert Gemma4AssistantForCausalLM.from_pretrained(str(fixtures_dir / "assistant")) is not None


def test_build_is_deterministic_and_options_checked(tmp_path):
    from hyco_lab.fixtures import build_fixtures
    from vllm_hyco.errors import ConfigError

    small = dict(weights="random", verifier_hidden=64, verifier_intermediate=64, verifier_moe_intermediate=32,
                 assistant_hidden=32, assistant_intermediate=32, slm_hidden=32, slm_intermediate=32,
                 progress=False)
    a = json.loads(build_fixtures(tmp_path / "a", **small).manifest.read_text())
    b = json.loads(build_fixtures(tmp_path / "b", **small).manifest.read_text())
    assert a["fingerprints"] == b["fingerprints"]
    with pytest.raises(ConfigError, match="unknown fixture option"):
        build_fixtures(tmp_path / "c", verifier_hiden=3)
