"""Phone-side inputs of the shipped (issue-18) family: the keep-set measurement and the QAT texts.

    python benchmarks/family_phone.py keepset FIXDIR [--prompts 200] [--out family_keepset.json]
    python benchmarks/family_phone.py qat-texts OUT.txt [--lines 16] [--per-line 4]

``keepset``: FR-Spec style keep sets (``mobile_client.keepset.build_keep_set``: the tokenizer's special and
byte tokens, then the most frequent tokens) counted on the family's *training* samples only
(``family.family_samples(...)("train")``: the trained requests and their chain-walk variants; the model
turns alone, and the whole samples), at several sizes, and their coverage of (a) the held-out prompts'
reference answers and (b) the tokens the verifier itself answers with on the held-out prompts
(``family.eval_prompts``, T = 1 / top-k 64 / top-p 0.95, transformers, fp32, seed 0, 64 tokens each).
FIXDIR is a fixtures root (``ensure_fixtures(...).root``: ``verifier/``, ``tokenizer/``).

``qat-texts``: the text file for ``python -m mobile_client.quant.qat --texts``: ``--lines`` lines, each the
model turns of ``--per-line`` consecutive training samples joined by a space (newlines folded, since the
hook reads one text per line). Training text only; the hook trains QAT on the first half of the lines and
evaluates on the second.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hyco_lab.fixtures import corpus, family, kinds
from hyco_lab.fixtures import train as tr
from mobile_client.keepset import build_keep_set, count_tokens, tokenizer_parts

MODEL_TURN = "<|turn>model\n"
END_TURN = "<turn|>"
SIZES = (600, 1000, 1345, 2000)  # 1,345 / 4,096 = the paper's 86,089 / 262,144


def training_answers() -> tuple[list[str], list[str]]:
    """(the family's training chat samples, their model turns), in the training order."""
    rows = family.family_samples(family.FamilyPlan(), tr.TrainPlan().seed)("train")
    return rows, [r.split(MODEL_TURN, 1)[1].split(END_TURN, 1)[0] for r in rows]


def verifier_answers(verifier_dir: Path, tok, prompts: list[dict], max_tokens: int = 64) -> list[list[int]]:
    """The verifier's T = 1 answer ids (prompt stripped) to each held-out prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).eval()
    users = [p["messages"][0]["content"] for p in prompts]
    heads = [tok(corpus.render_chat([{"role": "user", "content": u}], add_generation_prompt=True),
                 add_special_tokens=False).input_ids for u in users]
    out = []
    for seq in family.sample_answers(model, users, max_tokens, 64, seed=0, residual=0.0):
        cut = next(len(h) for h in heads if seq[: len(h)] == h)
        out.append(seq[cut:])
    return out


def keepset_report(fix: Path, n_prompts: int) -> dict:
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(fix / "tokenizer")
    special, byte, vocab = tokenizer_parts(tok)
    rows, answers = training_answers()
    prompts = family.eval_prompts(n_prompts)
    trained = {u for u, _, _, _ in kinds.pairs()["train"]}
    if any(p["messages"][0]["content"] in trained for p in prompts):
        raise SystemExit("a held-out prompt is a training request")

    def encode(texts):
        return [tok(t, add_special_tokens=False).input_ids for t in texts]

    t0 = time.perf_counter()
    said = verifier_answers(fix / "verifier", tok, prompts)
    counts = {"answers": count_tokens(encode(answers), vocab), "samples": count_tokens(encode(rows), vocab)}
    ref, heard = count_tokens(encode([p["reference"] for p in prompts]), vocab), count_tokens(said, vocab)
    out = {"vocab_size": vocab, "special": len(special), "byte": len(byte), "training_samples": len(rows),
           "held_out_prompts": len(prompts), "verifier_answer_tokens": int(heard.sum()),
           "verifier_answer_distinct": int((heard > 0).sum()), "seconds": 0.0, "keep_sets": []}
    for source, c in counts.items():
        out[f"distinct_in_{source}"] = int((c > 0).sum())
        for size in (*SIZES, vocab):
            ks = build_keep_set(c, size=size, vocab_size=vocab, special_ids=special, byte_ids=byte)
            out["keep_sets"].append({
                "counted_on": source, "size_target": size, "size": len(ks), "frequent": ks.meta["frequent"],
                "coverage_training": round(ks.meta["coverage"], 4), "coverage_reference": round(ks.coverage(ref), 4),
                "coverage_verifier": round(ks.coverage(heard), 4),
                "verifier_ids_missed": int(((heard > 0) & (ks.full_to_keep < 0)).sum()), "hash": ks.hash})
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def qat_texts(lines: int, per_line: int) -> list[str]:
    _, answers = training_answers()

    def one_line(s):
        return " ".join(s.split())

    return [" ".join(one_line(a) for a in answers[i * per_line : (i + 1) * per_line]) for i in range(lines)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/family_phone.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("keepset")
    k.add_argument("fixtures", type=Path)
    k.add_argument("--prompts", type=int, default=200)
    k.add_argument("--out", type=Path)
    q = sub.add_parser("qat-texts")
    q.add_argument("out", type=Path)
    q.add_argument("--lines", type=int, default=16)
    q.add_argument("--per-line", type=int, default=4)
    args = ap.parse_args(argv)
    if args.cmd == "keepset":
        rep = keepset_report(args.fixtures, args.prompts)
        text = json.dumps(rep, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    else:
        texts = qat_texts(args.lines, args.per_line)
        args.out.write_text("\n".join(texts) + "\n", encoding="utf-8")
        print(f"{len(texts)} lines, {sum(len(t) for t in texts)} characters -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
