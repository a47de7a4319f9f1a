"""The confident-verifier experiment's data: deterministic, and its evaluation requests are held out."""

from __future__ import annotations

from hyco_lab.fixtures import kinds as confident  # the experiment's data (kinds.py)
from hyco_lab.fixtures.corpus import chat_sample


def test_pairs_are_deterministic_and_split_by_verse_and_kind():
    p = confident.pairs()
    train = {(ref, kind) for _, _, kind, ref in p["train"]}
    held = {(ref, kind) for _, _, kind, ref in p["heldout"]}
    assert not train & held
    refs = {ref for _, _, _, ref in p["train"]}
    assert all(r.startswith(confident.DOMAIN[0]) for r in refs)
    per_verse: dict[str, int] = {}
    for _, _, _, ref in p["train"]:
        per_verse[ref] = per_verse.get(ref, 0) + 1
    assert max(per_verse.values()) <= confident.TRAIN_KINDS_PER_VERSE


def test_eval_prompts_are_never_trained_and_disjoint_from_validation():
    train = set(confident.build_samples("train"))
    val = set(confident.build_samples("validation"))
    rows = confident.eval_prompts()
    assert len(rows) == 60 and rows == confident.eval_prompts()
    assert {r["kind"] for r in rows} == set(confident.KINDS)
    for r in rows:
        s = chat_sample(r["messages"][0]["content"], r["reference"])
        assert s not in train and s not in val
    val_refs = {ref for _, _, _, ref in confident._heldout_split()[0]}
    assert not val_refs & {r["source"] for r in rows}
    assert not train & val
