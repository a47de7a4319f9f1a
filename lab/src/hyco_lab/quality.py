"""Quality beside speed: the pure computations (no vLLM, no I/O, no timings).

* per answer: ROUGE-L F1 against the reference (the ``rouge-score`` package, Google's implementation),
  normalized exact match;
* per configuration: output diversity, ``distinct_n`` (unique / all word n-grams over the answers) and
  ``repetition_rate`` (share of an answer's word 4-grams that repeat an earlier 4-gram of the same answer);
* against the baseline: ``paired_bootstrap`` 95 % intervals of the mean per-question difference
  (question-level resampling, 2,000 resamples, fixed seed), as the paper's Table 2 does;
* distance from plain sampling: ``tv_per_position`` (total-variation distance of the token at each of the
  first positions, two sets of sampled continuations of the same prompts) and ``tv_noise_bound`` (the
  plain-vs-plain distance at the same sample size: the 95th percentile, over resampled pairs of plain
  sets of that size, of the largest per-position distance), and ``tv_check`` combining them.

    >>> exact_match("It is written in Genesis 1:3.", "it is written in genesis 1:3")
    1.0
    >>> distinct_n(["a b a b", "a b c"], 2), repetition_rate(["a b a b a b"], 2)
    (0.6, 0.6)
    >>> tv_distance([1, 1, 2, 2], [1, 2, 2, 2])
    0.25
"""

from __future__ import annotations

import functools
import re
import statistics
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

END = "<end>"  # the token "at" a position past a sequence's end
OTHER = "<other>"  # tokens plain sampling rarely drew (``common_tokens``)


def normalize(text: str) -> str:
    """Lower case, whitespace collapsed, surrounding punctuation and quotes dropped."""
    return re.sub(r"\s+", " ", text.lower()).strip().strip(" .,;:!?\"'").strip()


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize(prediction) == normalize(reference))


@functools.lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score's tokenizer: lower case, alphanumeric tokens).

    >>> round(rouge_l("the cat sat on the mat", "the cat lay on the mat"), 4)
    0.8333
    """
    return float(_scorer().score(reference, prediction)["rougeL"].fmeasure)


def _words(text: str) -> list[str]:
    return text.lower().split()


def _ngrams(seq: Sequence, n: int) -> list[tuple]:
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float | None:
    """Unique word n-grams / all word n-grams over every answer (None: no n-gram)."""
    grams = [g for t in texts for g in _ngrams(_words(t), n)]
    return round(len(set(grams)) / len(grams), 4) if grams else None


def repetition_rate(texts: Sequence[str], n: int = 4) -> float | None:
    """Share of each answer's word n-grams that repeat an earlier n-gram of the same answer (pooled)."""
    rep = total = 0
    for t in texts:
        seen: set = set()
        for g in _ngrams(_words(t), n):
            rep += g in seen
            total += 1
            seen.add(g)
    return round(rep / total, 4) if total else None


def score_answers(answers: Mapping[str, Sequence[str]], refs: Mapping[str, str]) -> dict[str, dict[str, float]]:
    """Per question (id -> its answers over runs, and its reference), averaged over its answers: ROUGE-L,
    exact match and the answer's own repetition-4 (``repetition_rate`` of the answer alone, 0 when it has
    no 4-gram), so that diversity, too, gets a paired interval; and ``novel_2`` (``novel_ngrams``)."""
    novel = novel_ngrams(answers, 2)
    out = {}
    for qid, texts in answers.items():
        if qid not in refs or not texts:
            continue
        out[qid] = {"rouge_l": statistics.fmean(rouge_l(t, refs[qid]) for t in texts),
                    "exact": statistics.fmean(exact_match(t, refs[qid]) for t in texts),
                    "repetition_4": statistics.fmean(repetition_rate([t], 4) or 0.0 for t in texts),
                    "novel_2": novel.get(qid, 0.0)}
    return out


def novel_ngrams(answers: Mapping[str, Sequence[str]], n: int = 2) -> dict[str, float]:
    """Per question: the share of its answers' word n-grams (with multiplicity) that no other question's
    answer of the same configuration contains. The per-question face of distinct-n over all answers: when
    answers collapse toward one phrasing (a lossy rule committing the verifier's argmax), answers to
    different questions share n-grams and this falls; being per question, it gets a paired interval.

    >>> r = novel_ngrams({"a": ["x y z"], "b": ["x y w"]})
    >>> r["a"], r["b"]
    (0.5, 0.5)
    """
    grams = {q: [g for t in texts for g in _ngrams(_words(t), n)] for q, texts in answers.items()}
    seen_in: Counter = Counter(g for gs in grams.values() for g in set(gs))
    return {q: (sum(seen_in[g] == 1 for g in gs) / len(gs) if gs else 0.0) for q, gs in grams.items()}


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """Mean of a - b over paired questions with a percentile bootstrap interval (questions resampled).

    >>> r = paired_bootstrap([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    >>> r["diff"], r["lo"], r["hi"], r["excludes_zero"]
    (1.0, 1.0, 1.0, True)
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.size == 0:
        return {"diff": None, "lo": None, "hi": None, "n": 0, "excludes_zero": None}
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, d.size, size=(resamples, d.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"diff": round(float(d.mean()), 4), "lo": round(float(lo), 4), "hi": round(float(hi), 4),
            "n": int(d.size), "excludes_zero": bool(lo > 0 or hi < 0)}


def compare(scores: Mapping[str, Mapping[str, float]], base: Mapping[str, Mapping[str, float]],
            metric: str, **kw) -> dict:
    """``paired_bootstrap`` of one metric on the questions both configurations answered."""
    common = sorted(set(scores) & set(base))
    return paired_bootstrap([scores[q][metric] for q in common], [base[q][metric] for q in common], **kw)


# -- distance from plain sampling ----------------------------------------------------------------------
def tv_distance(xs: Sequence[Hashable], ys: Sequence[Hashable]) -> float:
    """Total-variation distance between the empirical distributions of two samples."""
    cx, cy = Counter(xs), Counter(ys)
    nx, ny = len(xs), len(ys)
    return round(0.5 * sum(abs(cx[k] / nx - cy[k] / ny) for k in set(cx) | set(cy)), 6)


def _at(seq: Sequence, j: int, keep: Sequence[set] | None = None):
    tok = seq[j] if j < len(seq) else END
    return tok if keep is None or tok in keep[j] else OTHER


def common_tokens(plain: Sequence[Sequence[Hashable]], positions: int, min_count: int = 5) -> list[set]:
    """Per position, the tokens plain sampling drew at least ``min_count`` times; the rest are pooled into
    one ``OTHER`` category, so the rare tail (mostly sampling noise at these sizes) does not dominate TV."""
    return [{t for t, c in Counter(_at(s, j) for s in plain).items() if c >= min_count}
            for j in range(positions)]


def tv_per_position(a: Sequence[Sequence[Hashable]], b: Sequence[Sequence[Hashable]], positions: int,
                    keep: Sequence[set] | None = None) -> list[float]:
    """TV of the token at positions 0 .. positions-1 between two sets of sampled sequences (one prompt);
    with ``keep`` (``common_tokens``), tokens outside a position's set count as one category."""
    return [tv_distance([_at(s, j, keep) for s in a], [_at(s, j, keep) for s in b]) for j in range(positions)]


def tv_noise_bound(plain: Sequence[Sequence[Hashable]], n: int, positions: int, *, keep=None, reps: int = 200,
                   q: float = 0.95, seed: int = 0) -> float:
    """The plain-vs-plain noise bound at sample size ``n``: the ``q`` quantile over ``reps`` pairs of
    ``n`` sequences each, drawn with replacement from ``plain``, of the largest per-position TV."""
    rng = np.random.default_rng(seed)
    plain = list(plain)
    maxes = []
    for _ in range(reps):
        i, j = rng.integers(0, len(plain), size=n), rng.integers(0, len(plain), size=n)
        maxes.append(max(tv_per_position([plain[k] for k in i], [plain[k] for k in j], positions, keep)))
    return round(float(np.quantile(maxes, q)), 6)


def tv_check(plain_a: Sequence[Sequence[Hashable]], plain_b: Sequence[Sequence[Hashable]],
             config: Sequence[Sequence[Hashable]], positions: int, min_count: int = 5, **kw) -> dict:
    """One prompt: per-position TV of ``config`` against plain set A, plain-vs-plain TV (B against A),
    the resampled bound (from A and B pooled, at the config's size) and ``flagged``: the config's largest
    per-position TV above the bound. Tokens plain sampling drew fewer than ``min_count`` times (A and B
    pooled) count as one category."""
    pooled = list(plain_a) + list(plain_b)
    keep = common_tokens(pooled, positions, min_count)
    tv = tv_per_position(config, plain_a, positions, keep)
    bound = tv_noise_bound(pooled, len(config), positions, keep=keep, **kw)
    return {"tv": tv, "plain_vs_plain": tv_per_position(plain_b, plain_a, positions, keep), "bound": bound,
            "n": len(config), "flagged": max(tv) > bound}
