"""The benchmark's quality columns, the ε trade-off (paper Figure 3) and the fixed-tree replay in the report.

``python -m hyco_lab.bench.report OUT`` recomputes a finished run's metrics and quality and rewrites its report.
``quality_results(records, references)`` scores every configuration's answers of the main runs
(``hyco_lab.quality``: ROUGE-L F1, exact match, distinct-n, repetition) with paired bootstrap 95 %
intervals against Cloud+MTP (per question: the mean over runs; questions resampled, 2,000 resamples,
seed 0). ``eps_rows(results)`` lines up the ε sweep (HyCo's trees and SLM-only trees at each ε and exact)
with MAT and g; ``markdown`` / ``plot`` write them into ``report.md`` and ``eps_tradeoff.png``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hyco_lab import quality as Q
from hyco_lab.bench.configs import BenchConfig, select
from vllm_hyco.errors import ConfigError

BASELINE = "cloud-mtp"


def config_of(name: str) -> BenchConfig | None:
    """The configuration of a report row (``hyco-eps-E`` names registered on the way), None if unknown."""
    try:
        return select([name])[0]
    except ConfigError:
        return None


def _main_run_answers(records: list[dict]):
    """(config, run, prompt_id, text) of every answered request of the main runs (not the warm-up, sweep
    and TV passes, whose run numbers lie outside 0-99)."""
    for rec in records:
        if not 0 <= rec["run"] < 100:
            continue
        for r in rec["requests"]:
            if r.get("error") is None and r.get("text") is not None:
                yield rec["config"], rec["run"], r["prompt_id"], r["text"]


def quality_results(records: list[dict], references: dict[str, str], baseline: str = BASELINE,
                    resamples: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per configuration: mean ROUGE-L / exact match over questions, diversity over all answers, and
    paired bootstrap intervals of the per-question difference against ``baseline``."""
    answers: dict[str, dict[str, list[str]]] = {}
    for cfg, _run, qid, text in _main_run_answers(records):
        answers.setdefault(cfg, {}).setdefault(qid, []).append(text)
    scores = {c: Q.score_answers(a, references) for c, a in answers.items()}
    out: dict[str, dict[str, Any]] = {}
    for cfg, sc in scores.items():
        texts = [t for ts in answers[cfg].values() for t in ts]
        entry: dict[str, Any] = {
            "questions": len(sc), "answers": len(texts),
            "rouge_l": round(statistics.fmean(v["rouge_l"] for v in sc.values()), 4) if sc else None,
            "exact": round(statistics.fmean(v["exact"] for v in sc.values()), 4) if sc else None,
            "distinct_1": Q.distinct_n(texts, 1), "distinct_2": Q.distinct_n(texts, 2),
            "repetition_4": Q.repetition_rate(texts, 4),
            "novel_2": round(statistics.fmean(v["novel_2"] for v in sc.values()), 4) if sc else None}
        if cfg != baseline and baseline in scores:
            for metric in ("rouge_l", "exact", "repetition_4", "novel_2"):
                entry[f"delta_{metric}"] = Q.compare(sc, scores[baseline], metric, resamples=resamples, seed=seed)
        out[cfg] = entry
    return out


def same_config_noise(records: list[dict], references: dict[str, str], resamples: int = 2000,
                      seed: int = 0) -> dict[str, Any]:
    """The quality measures' null: every pair of runs of one configuration (disjoint seeds, so no true
    difference), one answer per question on each side, compared with the same paired bootstrap as the
    Δ columns. Per metric: the largest |Δ| over all pairs and how many pairs' intervals exclude zero. A
    configuration's Δ against Cloud+MTP within that spread is not a finding, whatever its interval says
    (novel-2 couples questions, so its interval is too narrow). Empty with fewer than two runs."""
    runs: dict[str, dict[int, dict[str, list[str]]]] = {}
    for cfg, run, qid, text in _main_run_answers(records):
        runs.setdefault(cfg, {}).setdefault(run, {})[qid] = [text]
    metrics = ("rouge_l", "repetition_4", "novel_2")
    pairs: list[dict[str, Any]] = []
    for cfg, by_run in runs.items():
        scored = {run: Q.score_answers(a, references) for run, a in sorted(by_run.items())}
        ids = sorted(scored)
        for i, ra in enumerate(ids):
            for rb in ids[i + 1:]:
                pairs.append({"config": cfg, "runs": [ra, rb],
                              **{m: Q.compare(scored[ra], scored[rb], m, resamples=resamples, seed=seed)
                                 for m in metrics}})
    if not pairs:
        return {}
    summary = {m: {"max_abs_diff": max(abs(p[m]["diff"]) for p in pairs if p[m]["diff"] is not None),
                   "excluding_zero": sum(bool(p[m]["excludes_zero"]) for p in pairs)} for m in metrics}
    return {"pairs": pairs, "summary": summary, "num_pairs": len(pairs)}


def eps_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per configuration with HyCo's tree (``hybrid``) or the SLM-only tree (``specedge``) that ran,
    exact or at some ε: MAT, g ratio and quality. Greedy drafts only (the paper's trees): a configuration with
    sampled drafts has another proposal and is in the main tables, not on this curve."""
    rows = []
    summary, qual = results.get("summary", {}), results.get("quality", {})
    for name, entry in summary.items():
        cfg = config_of(name)
        tree = {"hybrid": "hyco", "specedge": "specedge"}.get(cfg.drafter if cfg else None)
        if tree is None or getattr(cfg, "draft_sampling", "greedy") != "greedy":
            continue
        s, q = entry.get("spread", {}), qual.get(name, {})
        rows.append({"tree": tree, "config": name, "epsilon": cfg.epsilon,
                     "mat": s.get("mat", {}).get("mean"), "g_ratio": s.get("g_ratio", {}).get("mean"),
                     "rouge_l": q.get("rouge_l"), "exact": q.get("exact"),
                     "delta_rouge_l": q.get("delta_rouge_l"), "delta_exact": q.get("delta_exact"),
                     "delta_repetition_4": q.get("delta_repetition_4"), "delta_novel_2": q.get("delta_novel_2"),
                     "novel_2": q.get("novel_2"),
                     "distinct_2": q.get("distinct_2"), "repetition_4": q.get("repetition_4")})
    rows.sort(key=lambda r: (r["tree"], -(r["epsilon"] or 1.0)))
    return rows


def _ci(d: dict | None, scale: float = 100.0) -> str:
    if not d or d.get("diff") is None:
        return "–"
    star = " *" if d.get("excludes_zero") else ""
    return f"{scale * d['diff']:+.1f} [{scale * d['lo']:+.1f}, {scale * d['hi']:+.1f}]{star}"


def _num(x, nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(results: dict[str, Any]) -> list[str]:
    qual = results.get("quality")
    if not qual:
        return []
    out = ["## Quality beside speed", "",
           (f"Per configuration, on {max(e['questions'] for e in qual.values())} held-out requests with "
            f"reference answers (`{results['env'].get('prompt_set')}`), every run's answer scored: ROUGE-L F1 "
            "(rouge-score) and exact match, x100, per question averaged over runs; Δ against Cloud+MTP with a "
            "paired bootstrap 95 % interval (questions resampled, 2,000 resamples, seed 0; * the interval "
            "excludes zero). Diversity over all answers: distinct-1/2 (unique / all word n-grams) and "
            "repetition-4, the share of 4-grams that repeat an earlier one in the same answer (pooled; its Δ "
            "is on the per-answer rate, x100). novel-2: per question, the share of its answers' word bigrams that no "
            "other question's answer contains (answers collapsing toward one phrasing lower it), with its paired "
            "Δ (x100)."), "",
           ("| configuration | ROUGE-L | Δ ROUGE-L [95 % CI] | exact | Δ exact [95 % CI] | distinct-1 | distinct-2 "
            "| novel-2 | Δ novel-2 [95 % CI] | repetition-4 | Δ repetition-4 [95 % CI] | questions |"),
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in qual.items():
        cfg = config_of(name)
        label = cfg.label if cfg is not None else name
        out.append(f"| {label} | {_num(100 * e['rouge_l'] if e['rouge_l'] is not None else None, 1)} | "
                   f"{_ci(e.get('delta_rouge_l'))} | {_num(100 * e['exact'] if e['exact'] is not None else None, 1)} | "
                   f"{_ci(e.get('delta_exact'))} | {_num(e['distinct_1'])} | {_num(e['distinct_2'])} | "
                   f"{_num(e.get('novel_2'))} | {_ci(e.get('delta_novel_2'))} | "
                   f"{_num(e['repetition_4'])} | {_ci(e.get('delta_repetition_4'))} | {e['questions']} |")
    noise = results.get("quality_noise") or {}
    if noise.get("summary"):
        sm = noise["summary"]
        out += ["", (f"Same-configuration noise (`quality_noise`): {noise['num_pairs']} pairs of runs of one "
                     "configuration (disjoint seeds, one answer per question each), the same paired bootstrap. "
                     "Largest |Δ| x100 and pairs whose interval excludes zero: "
                     + "; ".join(f"{m.replace('_', '-')} {100 * sm[m]['max_abs_diff']:.1f} "
                                 f"({sm[m]['excluding_zero']})" for m in ("rouge_l", "novel_2", "repetition_4"))
                     + ". A Δ against Cloud+MTP within that spread is not a finding, whatever its interval says.")]
    rows = eps_rows(results)
    if len(rows) > 2:
        out += ["", "## ε trade-off (paper Figure 3): HyCo's trees and SLM-only trees (SpecEdge-ε)", "",
                ("| tree | ε | MAT | g ratio | ROUGE-L | Δ ROUGE-L [95 % CI] | exact | Δ exact [95 % CI] | distinct-2 "
                 "| novel-2 | Δ novel-2 [95 % CI] | repetition-4 | Δ repetition-4 [95 % CI] |"),
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['tree']} | {r['epsilon'] if r['epsilon'] is not None else 'exact'} | "
                       f"{_num(r['mat'], 2)} | {_num(r['g_ratio'])} | "
                       f"{_num(100 * r['rouge_l'] if r['rouge_l'] is not None else None, 1)} | "
                       f"{_ci(r['delta_rouge_l'])} | {_num(100 * r['exact'] if r['exact'] is not None else None, 1)} | "
                       f"{_ci(r['delta_exact'])} | {_num(r['distinct_2'])} | {_num(r['novel_2'])} | "
                       f"{_ci(r['delta_novel_2'])} | "
                       f"{_num(r['repetition_4'])} | "
                       f"{_ci(r['delta_repetition_4'])} |")
    rep = results.get("replay")
    if rep:
        out += ["", "## Fixed-tree replay (paper §3.5)", "", rep.get("note", ""),
                (f"Logged paths: MAT {rep.get('logged_mat', 0):.3f} (path + bonus per round); exact re-decision "
                 f"gives the logged path in {100 * rep.get('exact_same_path', 0):.1f} % of rounds."), "",
                "| ε | MAT on the logged trees | threshold-only accepted share: chain / runner-up / SLM |",
                "|---|---|---|"]
        for e in rep["by_epsilon"]:
            src = e.get("threshold_only_share", {})
            out.append(f"| {e['epsilon']} | {e['mat']:.3f} | {src.get('chain', 0):.2f} / "
                       f"{src.get('runner_up', 0):.2f} / {src.get('slm', 0):.2f} |")
    tv = results.get("tv")
    if tv:
        out += ["", "## Distance from plain sampling", "", tv.get("note", ""), "",
                "| configuration | prompt | TV per position | plain vs plain | noise bound | flagged |",
                "|---|---|---|---|---|---|"]
        for r in tv["rows"]:
            out.append(f"| {r['config']} | {r['prompt']} | {', '.join(f'{x:.3f}' for x in r['tv'])} | "
                       f"{', '.join(f'{x:.3f}' for x in r['plain_vs_plain'])} | {r['bound']:.3f} | "
                       f"{'yes' if r['flagged'] else 'no'} |")
    return out + [""]


def plot(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """eps_tradeoff.png: MAT and g ratio against novel-2 (the quality measure that separates ε from exact
    here; ROUGE-L barely moves) per tree, labelled with ε (skipped without matplotlib or with fewer than three
    sweep points)."""
    rows = [r for r in eps_rows(results) if r["novel_2"] is not None]
    if len(rows) < 3:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = ((axes[0], "mat", "MAT (tokens per round)"), (axes[1], "g_ratio", "g ratio vs Cloud+MTP (CPU)"))
    for ax, key, label in panels:
        for tree, marker in (("hyco", "o"), ("specedge", "s")):
            pts = [r for r in rows if r["tree"] == tree and r[key] is not None]
            if not pts:
                continue
            ax.plot([100 * r["novel_2"] for r in pts], [r[key] for r in pts], marker=marker, label=tree)
            for r in pts:
                ax.annotate("exact" if r["epsilon"] is None else f"ε={r['epsilon']}",
                            (100 * r["novel_2"], r[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        base = results.get("quality", {}).get(BASELINE, {}).get("novel_2")
        if base is not None:
            ax.axvline(100 * base, ls="--", c="grey", lw=1, label="Cloud+MTP")
        ax.set_xlabel("novel-2 x100: answers' own bigrams (higher: more diverse)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle("ε trade-off: speed against quality (paper Figure 3)")
    fig.tight_layout()
    path = out_dir / "eps_tradeoff.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
