"""The shipped trained checkpoints: manifest, install (bf16 and fp32), hand-off scales, report helpers."""

from __future__ import annotations

import json

import pytest
import torch

from hyco_lab.fixtures import report, train, trained
from vllm_hyco.errors import ConfigError

pytestmark = pytest.mark.skipif(not trained.available(), reason="no trained fixtures shipped")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained_fp32")
    assert trained.install(out, fp32=True)
    return out


def test_manifest_matches_and_fits_the_budget():
    manifest = trained.verify()
    assert manifest["total_bytes"] <= trained.MAX_SHIPPED_BYTES
    assert set(manifest["files"]) == set(trained._shipped_files(trained.TRAINED_DIR))


def test_verify_catches_an_edited_file(tmp_path):
    root = tmp_path / "trained"
    import shutil

    shutil.copytree(trained.TRAINED_DIR, root)
    metrics = root / "metrics.json"
    metrics.write_text(metrics.read_text() + " ")
    with pytest.raises(ConfigError, match="sha256"):
        trained.verify(root)


def test_install_fp32_loads_with_transformers(installed):
    import transformers

    for name in trained.MODELS:
        cfg = json.loads((installed / name / "config.json").read_text())
        assert cfg["dtype"] == "float32"
        assert (installed / name / "tokenizer.json").exists()
    v = transformers.Gemma4ForCausalLM.from_pretrained(str(installed / "verifier"))
    a = transformers.Gemma4AssistantForCausalLM.from_pretrained(str(installed / "assistant"))
    s = transformers.Gemma4ForCausalLM.from_pretrained(str(installed / "slm"))
    assert v.dtype == a.dtype == s.dtype == torch.float32
    assert v.config.enable_moe_block and v.config.attention_k_eq_v
    assert v.config.layer_types[-1] == "full_attention"
    assert a.config.backbone_hidden_size == v.config.hidden_size
    assert s.config.hidden_size_per_layer_input > 0 and s.config.num_kv_shared_layers > 0


def test_shipped_metrics_show_a_trained_family():
    m = json.loads((trained.TRAINED_DIR / "metrics.json").read_text())
    assert m["verifier_val_loss"] < 5.0  # random init is ln(4096) = 8.3
    assert m["slm_val_loss"] > m["verifier_val_loss"]  # the drafter is measurably weaker
    assert 0.2 < m["head_val"]["greedy_agreement"][0] < 0.95


def test_handoff_scales_load_and_match_the_verifier(installed):
    from transformers import AutoConfig

    from vllm_hyco.handoff.quant import load_scales

    scales = load_scales(installed / "handoff_scales.npz")
    cfg = AutoConfig.from_pretrained(str(installed / "verifier"))
    assert scales.e.shape == scales.h.shape == (cfg.hidden_size,)
    types = cfg.layer_types
    last = {t: max(i for i, x in enumerate(types) if x == t) for t in set(types)}
    assert [lid for lid, _, _ in scales.layers] == [last["sliding_attention"], last["full_attention"]]
    for lid, k, v in scales.layers:
        layer = cfg.per_layer_config[lid]
        assert k.shape == v.shape == (layer.num_key_value_heads, layer.head_dim)
    assert scales.layer(last["full_attention"])[0].shape[-1] == 512


def test_acceptance_summary_from_counts():
    r = report.acceptance_from_counts(10, [6, 3, 3, 0], 4)
    assert r["reach"] == [0.6, 0.3, 0.3, 0.0]
    assert r["conditional"] == [0.6, 0.5, 1.0, 0.0]
    assert r["mat"] == 2.2


def test_truncated_probs_is_top_k_then_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 100]))
    p = train.truncated_probs(logits, top_k=3, top_p=0.9)
    kept = p[0, :4] / 1.0
    # top-3 renormalized: 0.526, 0.316, 0.158 -> nucleus 0.9 keeps all three; token 3 dropped by top-k
    assert kept[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = train.truncated_probs(logits, top_k=64, top_p=0.7)
    assert (p[0] > 0).sum() == 2  # 0.5 < 0.7 <= 0.8
