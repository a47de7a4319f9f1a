"""The retrain command end to end on a seconds-long plan (slow: kept out of CI; the full plan's result
is checked by its metrics in docs/fixtures.md, not by bits)."""

from __future__ import annotations

import json

import pytest

from hyco_lab.fixtures import train, trained


@pytest.mark.slow
def test_quick_retrain_writes_a_shippable_family(tmp_path):
    out = tmp_path / "run"
    m = train.train_all(out, train.TrainPlan.quick())
    for key in ("verifier_val_loss", "slm_val_loss", "head_val"):
        assert key in m
    assert len(m["head_val"]["kl"]) == train.TrainPlan().head_depth
    manifest = trained.ship(out, tmp_path / "shipped")
    assert manifest["total_bytes"] <= trained.MAX_SHIPPED_BYTES
    assert trained.install(tmp_path / "fx", fp32=False, root=tmp_path / "shipped")
    cfg = json.loads((tmp_path / "fx" / "assistant" / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant"


def test_head_masks_follow_vllm_positions():
    masks = train.head_masks(6, window=3)
    full, swa = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    assert full[4].tolist() == [True] * 5 + [False]  # row p reads K/V at positions <= p
    assert swa[4].tolist() == [False, False, True, True, True, False]  # and the last `window` of them
