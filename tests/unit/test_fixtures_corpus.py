"""The shipped corpus, prompt sets and tokenizer: deterministic, held out, loadable offline."""

from __future__ import annotations

import json

import pytest

from hyco_lab.fixtures import corpus
from hyco_lab.fixtures import tokenizer as tk
from vllm_hyco.errors import ConfigError


def test_corpus_is_the_whole_kjv():
    verses = corpus.load_verses()
    assert len(verses) == 31102
    assert verses[0].ref == "Genesis 1:1"
    assert verses[-1].ref == "Revelation 22:21"
    assert len({v.book for v in verses}) == 66


def test_split_is_by_chapter_and_disjoint():
    train = {(c[0].book, c[0].chapter) for c in corpus.chapters("train")}
    val = {(c[0].book, c[0].chapter) for c in corpus.chapters("validation")}
    assert not train & val
    assert 0.03 < len(val) / (len(train) + len(val)) < 0.08
    with pytest.raises(ConfigError):
        corpus.chapters("test")


def test_samples_are_deterministic_chat_turns():
    a = corpus.build_samples("validation")
    assert a == corpus.build_samples("validation")
    assert all(s.startswith("<bos><|turn>user\n") and s.endswith("<turn|>\n") for s in a)
    assert all("<|turn>model\n" in s for s in a)


def test_prompt_sets_are_shipped_held_out_and_regenerable():
    val_refs = {(c[0].book, c[0].chapter) for c in corpus.chapters("validation")}
    fresh = corpus.make_prompt_sets()
    for name, size in (("uc_val", 60), ("bench", 400)):
        rows = corpus.eval_prompts(name)
        assert len(rows) == size
        assert json.dumps(rows) == json.dumps(fresh[name])
        assert all(r["messages"][0]["role"] == "user" for r in rows)
    assert not {r["id"] for r in fresh["uc_val"]} & {r["id"] for r in fresh["bench"]}
    val_names = {f"{b} {c}" for b, c in val_refs}
    for name in ("uc_val", "bench"):
        assert all(r["source"] in val_names for r in corpus.eval_prompts(name))


def test_tokenizer_layout_and_chat_template_offline():
    tok = tk.load_tokenizer()
    assert len(tok) == tk.VOCAB_SIZE
    ids = tok.convert_tokens_to_ids(list(tk.SPECIAL_TOKENS))
    assert ids == list(range(len(tk.SPECIAL_TOKENS)))
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok("In the beginning").input_ids[0] == tk.BOS_ID
    msgs = [{"role": "user", "content": "Recite John 3:16."}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == corpus.render_chat(msgs, add_generation_prompt=True)
    enc = tok(text, add_special_tokens=False).input_ids
    assert enc.count(tk.BOS_ID) == 1 and enc[0] == tk.BOS_ID
    line = "And God said, Let there be light: and there was light."
    assert tok.decode(tok(line, add_special_tokens=False).input_ids) == line


def test_tokenizer_retrain_is_identical(tmp_path):
    tk.train_tokenizer(tmp_path)
    for name in tk.TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (tk.TOKENIZER_DIR / name).read_bytes(), name
