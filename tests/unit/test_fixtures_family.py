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


def test_chain_counts_walks_and_ceiling():
    import random

    from hyco_lab.fixtures import chain as mc

    seqs = [[10, 11, 12, 13], [10, 11, 14, 15], [20, 11, 12, 16]]
    ch = mc.Chain.build(seqs, order=2, weights=(0.0, 0.25, 0.75))
    p = ch.probs([10, 11])  # order 2 after (10, 11): 12 or 14; order 1 after 11: 12 (2/3) or 14 (1/3)
    assert abs(p[12] - (0.75 * 0.5 + 0.25 * 2 / 3)) < 1e-9 and abs(sum(p.values()) - 1) < 1e-9
    assert ch.probs([99, 11]) == ch.probs([11])  # an unseen order-2 context passes its weight down
    walk = ch.walk([10, 11], random.Random(0))
    assert walk[:2] == [10, 11] and mc.END not in walk and all(t in {10, 11, 12, 13, 14, 15, 16} for t in walk)
    det = mc.Chain.build([[1, 2, 3, 4, 5]], order=1, weights=(0.0, 1.0))  # one continuation everywhere
    assert mc.spec_stats(det, [[1]], n=5)["conditional"][0] == 1.0
    assert mc.walk_stats(det, [[1]], n=5)["argmax_mass"] == 1.0


def test_chain_answers_replace_verse_text_only():
    import random

    plan = family.FamilyPlan()
    ch, verse_ids = family.domain_chain(plan)
    u, a, kind, ref = next(p for p in confident.pairs()["train"] if p[2] == "what_says")
    out = family.chain_answer(a, ref, ch, verse_ids, plan.chain_start, random.Random(0))
    prefix = a.split(": ", 1)[0] + ": "
    assert out.startswith(prefix)  # "Genesis C:V says: " kept, the verse replaced by a walk from its start
    verse = a[len(prefix):]
    assert out[len(prefix):].split()[0] == verse.split()[0]
    samples = family.family_samples(dataclasses_replace(plan, chain_copies=1))
    held = {u for u, _, _, _ in confident.pairs()["heldout"]} - {u for u, _, _, _ in confident.pairs()["train"]}
    users = {s.split("user\n", 1)[1].split("<turn|>", 1)[0] for s in samples("train")}
    assert users <= {u for u, _, _, _ in confident.pairs()["train"]} and not users & held


def dataclasses_replace(plan, **kw):
    import dataclasses

    return dataclasses.replace(plan, **kw)


def test_head_trained_on_head_depth_steps_and_evaluated_at_four(tmp_path, monkeypatch):
    """``head_depth`` sets the draft steps the head is distilled on; the metrics still score all four
    steps vLLM drafts (the shipped head is trained on three, docs/fixtures.md)."""
    from hyco_lab.fixtures import train as tr

    depths = []
    real = tr.head_losses
    monkeypatch.setattr(tr, "head_losses", lambda *a, **k: depths.append(a[3]) or real(*a, **k))
    fplan = dataclasses_replace(family.FamilyPlan.quick(), head_depth=2)
    m = family.train_family(tmp_path / "run", fplan, dataclasses_replace(tr.TrainPlan.quick(), threads=1))
    assert depths and set(depths) == {2}
    assert m["plan"]["head_depth"] == 2 and m["family_plan"]["head_depth"] == 2
    assert len(m["head_val"]["greedy_agreement"]) == len(m["head_self_heldout"]["kl"]) == 4
    assert family.FamilyPlan().head_depth == 3
