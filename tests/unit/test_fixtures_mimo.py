"""The tiny MiMo-shaped fixture (``hyco_lab.fixtures.mimo``, issue 35): config, MTP weight names and shapes as
vLLM's ``mimo``/``mimo_mtp`` loaders read them, fingerprint. No engine; a build takes well under a second."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math

import pytest

from hyco_lab.fixtures.mimo import CONFIG_CODE_FILE, WEIGHTS_FILE, build_mimo, mtp_layer_params

MTP_TENSORS = {  # per MTP layer, as the HF checkpoint names them (vLLM's mapper adds mtp_block and the offset)
    "token_layernorm.weight": (256,), "hidden_layernorm.weight": (256,), "input_proj.weight": (256, 512),
    "final_layernorm.weight": (256,), "input_layernorm.weight": (256,), "post_attention_layernorm.weight": (256,),
    "self_attn.q_proj.weight": (256, 256), "self_attn.q_proj.bias": (256,),
    "self_attn.k_proj.weight": (128, 256), "self_attn.k_proj.bias": (128,),
    "self_attn.v_proj.weight": (128, 256), "self_attn.v_proj.bias": (128,),
    "self_attn.o_proj.weight": (256, 256),
    "mlp.gate_proj.weight": (512, 256), "mlp.up_proj.weight": (512, 256), "mlp.down_proj.weight": (256, 512),
}

MTP_ONLY = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")


def _shapes(folder) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def _config_class(folder):
    """The checkpoint's own ``MiMoConfig`` (its auto_map target), imported from the file, not the HF module cache."""
    spec = importlib.util.spec_from_file_location("configuration_mimo_fixture", folder / CONFIG_CODE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MiMoConfig


@pytest.fixture(scope="module")
def two_layers(tmp_path_factory):
    return build_mimo(tmp_path_factory.mktemp("mimo") / "m2", num_mtp_layers=2, progress=False)


def test_config_is_mimo_shaped_and_loads(two_layers):
    raw = json.loads((two_layers / "config.json").read_text())
    assert raw["architectures"] == ["MiMoForCausalLM"] and raw["model_type"] == "mimo"
    assert raw["auto_map"]["AutoConfig"] == "configuration_mimo.MiMoConfig"
    assert raw["max_position_embeddings"] >= 2048 and raw["tie_word_embeddings"] is False
    cfg = _config_class(two_layers).from_pretrained(str(two_layers))
    assert cfg.model_type == "mimo" and cfg.num_nextn_predict_layers == 2
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (256, 4, 4, 2, 64, 512)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(two_layers / "tokenizer.json")).get_vocab_size() == cfg.vocab_size
    gen = json.loads((two_layers / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (2, 1, 0)


def test_weights_hold_trunk_head_and_every_mtp_layer(two_layers):
    shapes = _shapes(two_layers)
    vocab = json.loads((two_layers / "config.json").read_text())["vocab_size"]
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (vocab, 256)
    block = {t: s for t, s in MTP_TENSORS.items() if t not in MTP_ONLY}
    assert {n: s for n, s in shapes.items() if n.startswith("model.layers.")} == {
        f"model.layers.{i}.{t}": s for i in range(4) for t, s in block.items()}
    for n in range(2):
        got = {k.split(f"model.mtp_layers.{n}.", 1)[1]: v for k, v in shapes.items()
               if k.startswith(f"model.mtp_layers.{n}.")}
        assert got == MTP_TENSORS
    assert not any(k.startswith("model.mtp_layers.2.") for k in shapes)
    cfg = json.loads((two_layers / "config.json").read_text())
    assert mtp_layer_params(cfg) == sum(math.prod(s) for s in MTP_TENSORS.values())


def test_manifest_fingerprint_and_shared_trunk(two_layers, tmp_path):
    from safetensors.torch import load_file

    manifest = json.loads((two_layers / "fixtures.json").read_text())
    assert manifest["sha256"][WEIGHTS_FILE] == hashlib.sha256((two_layers / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert manifest["options"]["num_mtp_layers"] == 2
    one = build_mimo(tmp_path / "m1", num_mtp_layers=1, progress=False)
    a, b = load_file(str(one / WEIGHTS_FILE)), load_file(str(two_layers / WEIGHTS_FILE))
    assert set(a) < set(b) and all((a[k] == b[k]).all() for k in a)  # same trunk and first MTP layer
    agree = load_file(str(build_mimo(tmp_path / "agree", agree=True, progress=False) / WEIGHTS_FILE))
    assert not agree["model.norm.weight"].any() and not agree["model.mtp_layers.0.final_layernorm.weight"].any()
