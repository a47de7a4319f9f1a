"""How far a second draw of Cloud+MTP sits from its first: the yardstick for Table 2's quality deltas.

    python -m hyco_lab.bench --configs cloud-mtp --prompt-set family --prompts 100 --runs 6 --phones 4 \
        --max-tokens 32 --link lte --replay "" --out benchmarks/results/cpu-second-draw
    python benchmarks/second_draw.py benchmarks/results/cpu benchmarks/results/cpu-second-draw

Table 2 compares each configuration's 3 runs (seeds 1000·run + i, runs 0-2) with Cloud+MTP's. The three
phone configurations share one random stream for the first answer token (the server's round 0), so they
are one draw against one draw. Here Cloud+MTP is run 6 times with the same seeds: runs 0-2 reproduce
Table 2's Cloud+MTP answers, runs 3-5 (seeds 3000+) are a second draw with disjoint seeds. The second draw
is scored against the first exactly as Table 2 scores a configuration (``quality.compare``, ROUGE-L, paired
bootstrap over questions, 2,000 resamples, seed 0), beside Table 2's own deltas. Also counted: how many
answers to the "Where is it written" requests (kind ``locate``) start with "It" ("It is written in
Genesis ..."), the token that moves ROUGE-L most on this family. Writes ``second_draw.json`` into the
second folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from hyco_lab import quality as Q
from hyco_lab.bench import qreport
from hyco_lab.bench.__main__ import prompts_by_id

TABLE2_CONFIGS = ("cloud-mtp-prob", "specedge", "hyco-exact", "hyco-exact-prob")


def answers(records: list[dict], config: str, runs: tuple[int, ...]) -> dict[str, list[str]]:
    """question id -> the answers of ``config`` in ``runs`` (the main runs' answered requests, as Table 2
    scores them: ``qreport._main_run_answers``)."""
    out: dict[str, list[str]] = {}
    for cfg, run, qid, text in qreport._main_run_answers(records):
        if cfg == config and run in runs:
            out.setdefault(qid, []).append(text)
    return out


def mean_rouge_l(scores: dict[str, dict[str, float]]) -> float:
    return round(statistics.fmean(v["rouge_l"] for v in scores.values()), 4)


def first_word_count(ans: dict[str, list[str]], kinds: dict[str, str], kind: str, word: str) -> list[int]:
    texts = [t for q, ts in ans.items() if kinds[q] == kind for t in ts]
    return [sum((t.split() or [""])[0] == word for t in texts), len(texts)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table2", type=Path, help="the Table-2 run folder (records.json)")
    ap.add_argument("second", type=Path, help="the 6-run Cloud+MTP folder (records.json)")
    args = ap.parse_args(argv)
    t2 = json.loads((args.table2 / "records.json").read_text())
    d2 = json.loads((args.second / "records.json").read_text())
    base = answers(t2, "cloud-mtp", (0, 1, 2))
    prompts = {p["id"]: p for p in prompts_by_id(sorted(base))}
    refs = {q: p["reference"] for q, p in prompts.items()}
    kinds = {q: p["kind"] for q, p in prompts.items()}
    arms = {"cloud-mtp, second draw (runs 3-5)": answers(d2, "cloud-mtp", (3, 4, 5)),
            "cloud-mtp, this run's runs 0-2": answers(d2, "cloud-mtp", (0, 1, 2))}
    arms.update({f"{c} (Table 2)": answers(t2, c, (0, 1, 2)) for c in TABLE2_CONFIGS})
    base_scores = Q.score_answers(base, refs)
    out = {"baseline": "cloud-mtp, Table 2 runs 0-2", "rouge_l": mean_rouge_l(base_scores),
           "locate_starts_with_It": first_word_count(base, kinds, "locate", "It"), "arms": {}}
    print(f"baseline: Cloud+MTP, Table 2 runs 0-2: ROUGE-L {100 * out['rouge_l']:.1f}, "
          f"locate answers starting 'It' {out['locate_starts_with_It'][0]}/{out['locate_starts_with_It'][1]}")
    print("| arm | ROUGE-L | Δ ROUGE-L [95 % CI] | locate answers starting 'It' |\n|---|---|---|---|")
    for name, ans in arms.items():
        sc = Q.score_answers(ans, refs)
        d = Q.compare(sc, base_scores, "rouge_l")
        its = first_word_count(ans, kinds, "locate", "It")
        mean = mean_rouge_l(sc)
        out["arms"][name] = {"rouge_l": mean, "delta_rouge_l": d, "locate_starts_with_It": its}
        star = " *" if d["excludes_zero"] else ""
        print(f"| {name} | {100 * mean:.1f} | {100 * d['diff']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}]"
              f"{star} | {its[0]}/{its[1]} |")
    (args.second / "second_draw.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
