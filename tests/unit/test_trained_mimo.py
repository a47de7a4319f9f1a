"""The shipped trained MiMo-shaped family (issue 35, ``data/trained_mimo/``): its manifest, the folder
``python -m hyco_lab.fixtures DIR --shape mimo --weights trained`` materializes (a MiMo config with one MTP
layer, the trunk + MTP weights under the HF names, the family's SLM, the hand-off scales where the server
finds them) and the scales as ``load_scales`` reads them. No engine, no training; about a second."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hyco_lab.fixtures import trained
from hyco_lab.fixtures.__main__ import main as fixtures_main
from hyco_lab.fixtures.mimo import CONFIG_CODE_FILE, WEIGHTS_FILE, weight_shapes


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    out = tmp_path_factory.mktemp("mimo_trained")
    assert fixtures_main([str(out), "--shape", "mimo", "--weights", "trained", "--quiet"]) == 0
    return out


def test_manifest_matches_the_files_and_fits_the_budget():
    manifest = trained.verify(trained.TRAINED_MIMO_DIR, "mimo")
    assert set(manifest["files"]) == set(trained._shipped_files(family="mimo"))
    assert manifest["total_bytes"] == sum(e["bytes"] for e in manifest["files"].values())
    assert manifest["total_bytes"] <= 15 * 2**20
    for name, entry in manifest["files"].items():
        assert (trained.TRAINED_MIMO_DIR / name).stat().st_size == entry["bytes"]


def test_verify_catches_an_edited_file(tmp_path):
    import shutil

    from vllm_hyco.errors import ConfigError

    root = tmp_path / "trained_mimo"
    shutil.copytree(trained.TRAINED_MIMO_DIR, root)
    (root / "metrics.json").write_text((root / "metrics.json").read_text() + " ")
    with pytest.raises(ConfigError, match="sha256"):
        trained.verify(root, "mimo")


def test_materialized_config_is_mimo_with_one_mtp_layer(family):
    from safetensors import safe_open

    verifier = family / "verifier"
    raw = json.loads((verifier / "config.json").read_text())
    assert raw["architectures"] == ["MiMoForCausalLM"] and raw["model_type"] == "mimo"
    assert raw["num_nextn_predict_layers"] == 1 and raw["tie_word_embeddings"] is False
    spec = importlib.util.spec_from_file_location("configuration_mimo_trained", verifier / CONFIG_CODE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.MiMoConfig.from_pretrained(str(verifier))
    assert cfg.model_type == "mimo" and cfg.num_nextn_predict_layers == 1
    with safe_open(str(verifier / WEIGHTS_FILE), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == weight_shapes(raw)  # trunk, lm_head and model.mtp_layers.0.*, nothing else
    assert any(n.startswith("model.mtp_layers.0.") for n in shapes)
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(verifier / "tokenizer.json")).get_vocab_size() == raw["vocab_size"]
    gen = json.loads((verifier / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 6]  # <eos>, <turn|>
    slm = json.loads((family / "slm" / "config.json").read_text())
    assert slm["model_type"].startswith("gemma4") and (family / "slm" / "tokenizer.json").exists()
    assert (family / "metrics.json").exists()


def test_scales_load_and_are_found_next_to_the_verifier(family):
    import numpy as np

    from vllm_hyco.handoff.quant import load_scales
    from vllm_hyco.handoff.server_model import find_scales

    assert find_scales(family / "verifier") == family / "handoff_scales.npz"
    scales = load_scales(family / "handoff_scales.npz")
    hidden = json.loads((family / "verifier" / "config.json").read_text())["hidden_size"]
    assert scales.e.shape == scales.h.shape == (hidden,) and scales.layers == ()
    assert np.all(scales.e > 0) and np.all(scales.h > 0)
    meta = json.loads((family / "handoff_scales.json").read_text())
    assert meta["scales_id"] == scales.scales_id.hex() and meta["layers"] == {}
