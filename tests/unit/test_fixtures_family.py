"""The issue-18 family recipe's pure parts (training itself is slow and never runs in CI)."""

from __future__ import annotations

import torch
from hyco_lab.fixtures import confident, family


def test_noisy_inputs_keep_controls_and_rate():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(23, 4096, (8, 256))
    x[:, 10] = 6  # <turn|>: a control token is never replaced
    y = family.noisy_inputs(x, 0.1, gen)
    changed = (y != x).float().mean().item()
    assert 0.05 < changed < 0.12  # a draw can hit a token equal to the one it replaces
    assert torch.equal(y[:, 0], x[:, 0]) and torch.equal(y[:, 10], x[:, 10])
    assert bool(torch.isin(y, x).all())  # replacements come from the same batch's text
    assert torch.equal(family.noisy_inputs(x, 0.0, gen), x)


def test_self_sample_prompts_are_trained_requests_only():
    held = {u for u, _, _, _ in confident.pairs()["heldout"]}
    trained = {u for u, _, _, _ in confident.pairs()["train"]}
    prompts = family.training_prompts(500)
    assert len(prompts) == 500 and set(prompts) <= trained
    assert not set(prompts) & (held - trained)  # a held-out request is never answered for the head


def test_diversity_and_blocks():
    d = family.diversity([[1, 2, 3, 1, 2, 3, 1, 2, 3], [4, 5]])
    assert d["distinct_1"] == round(5 / 11, 4) and d["repetition_4"] == 0.5 and d["answers"] == 2
    assert family.to_blocks([[1, 2, 3], [4, 5, 6, 7]], 3).tolist() == [[1, 2, 3], [4, 5, 6]]
