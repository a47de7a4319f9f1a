"""Shared piece of the in-process exact-mode distribution tests (no tests here): the same 2-level tree submitted
through ``HycoEngine`` for many seeded sessions, the first committed tokens compared by chi-square against plain
vLLM samples (``test_engine_mimo.py``, ``test_engine_deepseek.py``).

:func:`exact_tree_distribution` picks a context whose next token is likely but not certain (plain greedy's
continuation up to the first step whose top token holds 0.3-0.8 at the request's temperature), so the tree's
paths are taken and its siblings matter; draws ``n_ref`` plain samples of ``length`` tokens from it (seeds
``ref_seed + i``); builds one tree from them (after ``decoys`` unlikely tokens, the likeliest first token and
the runner-up as the root's children, the two likeliest second tokens after the likeliest first one under
it); submits it in ``n_hy`` sessions (seeds ``0 .. n_hy - 1``; a root-only round after it where the tree
committed fewer than ``length`` tokens); and tests the first two tokens' marginals and their pairs (alpha 1e-3,
bins with expected count < 5 merged, ``tests/unit/distcheck.py``), skipping a key that leaves under two bins
after merging.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_UNIT = str(Path(__file__).resolve().parent / "unit")
if _UNIT not in sys.path:
    sys.path.insert(0, _UNIT)
from distcheck import chi_square  # noqa: E402


@dataclass
class TreeDist:
    """What one run of :func:`exact_tree_distribution` saw."""

    context: list[int]  # the prompt and plain greedy's continuation up to the cut
    cut: int  # how many greedy tokens were appended
    top_prob: float  # the top token's probability after the context, at the request's temperature
    tokens: list[int]  # the tree's tokens below the root (rows 1..; row 0 is each session's root)
    parents: list[int]  # every row's parent, the root's -1 first
    tests: list[tuple[str, float, float]]  # (key, statistic, critical value) of every chi-square test run
    paths: list[list[int]]  # each session's accepted tree rows below the root, round 0

    @property
    def depths(self) -> Counter:
        return Counter(len(p) for p in self.paths)

    def assert_lossless(self, min_tests: int = 2) -> None:
        """Every test passes, at least ``min_tests`` ran, and the tree's paths were taken to depth 2."""
        assert all(stat < crit for _, stat, crit in self.tests), self.tests
        assert len(self.tests) >= min_tests, self.tests
        assert self.depths[1] + self.depths[2] > 0 and self.depths[2] > 0, self.depths


def _top_prob(logprobs: dict, temperature: float, full: bool) -> float:
    """The top token's probability at ``temperature`` from one step's raw logprobs (the whole vocabulary's
    where ``full``; at T = 1 the top one's alone is enough)."""
    lp = np.fromiter((x.logprob for x in logprobs.values()), dtype=np.float64)
    if not full:
        return float(np.exp(lp.max()))
    z = lp / temperature
    return float(1.0 / np.exp(z - z.max()).sum())


def exact_tree_distribution(llm, prompt_ids, *, temperature: float = 1.0, n_ref: int = 600, n_hy: int = 120,
                            length: int = 2, greedy_steps: int = 24, ref_seed: int = 20_000,
                            decoys: int = 0) -> TreeDist:
    """Run the distribution check on ``llm`` (a HyCo engine) from ``prompt_ids``; assert nothing (see
    :meth:`TreeDist.assert_lossless`).

    ``temperature`` != 1 needs the whole vocabulary's logprobs to find the cut (the engine built with
    ``max_logprobs=-1``). ``decoys`` puts that many tokens no plain sample began with (seeded) as the root's
    first children, before the likeliest first token and the runner-up: the likeliest path then sits at rows
    ``decoys + 1 ..`` (compacted when accepted) and, without the tree's mask, would attend to every decoy."""
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    full = temperature != 1.0
    greedy = llm.generate([{"prompt_token_ids": list(prompt_ids)}],
                          SamplingParams(temperature=0, max_tokens=greedy_steps, logprobs=-1 if full else 1,
                                         ignore_eos=True), use_tqdm=False)[0].outputs[0]
    probs_at = [_top_prob(lp, temperature, full) for lp in greedy.logprobs]
    cut = next((i for i, p in enumerate(probs_at) if 0.3 <= p <= 0.8), None)
    assert cut is not None, f"no greedy step's top token holds 0.3-0.8 at T = {temperature}: {probs_at}"
    context = list(prompt_ids) + list(greedy.token_ids[:cut])
    sampling = dict(temperature=temperature, max_tokens=length, ignore_eos=True)
    ref = llm.generate([{"prompt_token_ids": context}] * n_ref,
                       [SamplingParams(seed=ref_seed + i, **sampling) for i in range(n_ref)], use_tqdm=False)
    ref_ids = [tuple(o.outputs[0].token_ids) for o in ref]
    top = [t for t, _ in Counter(r[0] for r in ref_ids).most_common(2)]
    second = [t for t, _ in Counter(r[1] for r in ref_ids if r[0] == top[0]).most_common(2)]
    assert len(top) == 2 and len(second) == 2, (
        f"the context is too certain for a 2-level tree: {len(top)} distinct first token(s) and {len(second)} "
        f"distinct second token(s) after {top[0]} in {n_ref} reference samples (pick a less certain context "
        "or a higher temperature)")
    drawn = {r[0] for r in ref_ids}
    pool = [t for t in range(3, llm.llm_engine.model_config.get_vocab_size()) if t not in drawn] if decoys else []
    lure = random.Random(0).sample(pool, decoys)
    tokens = [*lure, top[0], top[1], *second]
    parents = [-1, *[0] * decoys, 0, 0, decoys + 1, decoys + 1]
    hy = HycoEngine(llm)
    got, paths = [], []
    for i in range(n_hy):  # the same 2-level tree every time: the likeliest tokens, so paths are accepted
        s = hy.open(prompt_token_ids=context, seed=i, **sampling)
        v = hy.submit(s.sid, 0, [s.root, *tokens], parents)
        paths.append(list(v.path_rows))
        out = list(v.committed)
        if len(out) < length:
            out += hy.submit(s.sid, 1, [v.bonus], [-1]).committed
        got.append(tuple(out[:length]))
    tests = []
    for name, key in (("first", lambda r: r[0]), ("second", lambda r: r[1]), ("pair", lambda r: r[:2])):
        cells = sorted({key(r) for r in ref_ids} | {key(g) for g in got})
        index = {c: k for k, c in enumerate(cells)}
        probs = np.bincount([index[key(r)] for r in ref_ids], minlength=len(cells)) / n_ref
        observed = np.bincount([index[key(g)] for g in got], minlength=len(cells)).astype(float)
        big = probs * n_hy >= 5
        if big.sum() < 1 or probs[~big].sum() * n_hy < 5:  # under two bins after merging: nothing to test
            continue
        stat, crit = chi_square(observed, probs + 1e-12)
        tests.append((name, stat, crit))
    return TreeDist(context=context, cut=cut, top_prob=probs_at[cut], tokens=tokens, parents=parents, tests=tests,
                    paths=paths)
