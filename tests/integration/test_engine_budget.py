"""The adaptive node budget inside a real vLLM 0.32 engine (CPU, tiny fp32 Gemma-4 MoE, in-process).

The scheduler cuts each tree to the prefix its cost model says pays, before vLLM turns it into spec tokens.
Exact mode must stay lossless on cut trees: the committed stream equals plain vLLM greedy token for token
(the distribution side is tests/unit/test_budget_lossless.py). The step-cost model is fitted on the
engine's own measured steps; a frozen steep model forces cuts here so the test does not depend on timing.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("_engine_sessions", Path(__file__).with_name("test_engine_sessions.py"))
S = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(S)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from S.tiny_hyco_llm(tmp_path_factory, "tiny-budget", speculative_config={"method": "hyco"})  # adaptive


@pytest.fixture(scope="module")
def hy(llm):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    return HycoEngine(llm)


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _frozen(fixed_s: float, per_row_s: float):
    from vllm_hyco.spec_decode.budget import StepCostModel

    m = StepCostModel(min_steps=0)
    m.theta = np.array([fixed_s, per_row_s, 0.0, 0.0, 0.0, 0.0, 0.0]) * StepCostModel.SCALE
    m.steps, m.row_counts, m.rows_lo, m.rows_hi = 100, {1, 2, 3}, 1, 3
    m.observe = lambda *a, **k: False
    return m


def _run(hy, prompts, refs, shapes, seed):
    """Interleaved sessions sending 32-node trees; returns the verdicts. Asserts greedy identity."""
    rng = random.Random(seed)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=S.GEN, ignore_eos=True) for p in prompts]
    state = {h.sid: {"root": h.root, "out": [], "round": 0, "ref": r} for h, r in zip(handles, refs)}
    verdicts = []
    while state:
        batch = []
        for sid, st in state.items():
            toks, pars, _ = S._tree(st["root"], st["ref"][len(st["out"]):], rng.choice(shapes), rng)
            batch.append((sid, st["round"], toks, pars))
        for v in hy.submit_many(batch):
            st = state[v.sid]
            done = len(st["out"])
            assert v.committed == st["ref"][done:done + len(v.committed)], (v.sid, v.round, v.path_rows)
            st["out"] += v.committed
            st["root"], st["round"] = v.bonus, st["round"] + 1
            verdicts.append(v)
            if v.finished:
                assert state.pop(v.sid)["out"] == st["ref"]
    return verdicts


def test_the_cost_model_is_fitted_on_the_engines_own_steps(llm, hy):
    pol = _scheduler(llm).hyco.budget_policy
    assert pol.policy == "adaptive" and pol.cap == 32
    before = pol.cost.steps
    prompts = S._prompts(3, seed=21)
    refs = S._reference(llm, prompts, max_tokens=S.GEN)
    _run(hy, prompts, refs, ["chain", "deep"], seed=1)
    fit = pol.cost.snapshot()
    assert fit["steps"] > before + 10 and fit["ready"]
    assert all(np.isfinite([fit["fixed_ms"], fit["per_row_ms"], fit["per_krow_ctx_ms"]]))
    assert sum(r["n"] for r in pol.reliability()) > 0  # predictions were logged against outcomes


def test_cut_trees_reproduce_plain_greedy_and_the_verdict_grants_the_cut(llm, hy):
    sched = _scheduler(llm)
    pol = sched.hyco.budget_policy
    saved = pol.cost
    pol.cost = _frozen(0.002, 0.001)  # rows are expensive: short prefixes
    try:
        prompts = S._prompts(6, seed=22)
        refs = S._reference(llm, prompts)
        verdicts = _run(hy, prompts, refs, ["chain", "sibling", "slm", "deep", "nowhere"], seed=2)
    finally:
        pol.cost = saved
    live = [v for v in verdicts if not v.finished]
    assert live and all(v.stats["num_rows"] < 33 for v in verdicts)  # every tree was cut
    # the phone is told to draft the cut; after round 0 (the SLM's tree alone, D2) the cap
    assert all(v.node_budget == (32 if v.round == 0 else v.stats["num_rows"] - 1) for v in live)
    assert any(v.round > 0 for v in live)
    assert max(len(v.committed) for v in verdicts) > 1  # cut trees still accept paths


def test_static_policy_verifies_whole_trees_and_grants_the_cap(llm, hy):
    pol = _scheduler(llm).hyco.budget_policy
    saved = pol.cost, pol.policy
    pol.cost, pol.policy = _frozen(0.002, 0.001), "static"
    try:
        prompts = S._prompts(2, seed=23)
        refs = S._reference(llm, prompts, max_tokens=S.GEN)
        verdicts = _run(hy, prompts, refs, ["chain", "nowhere"], seed=3)
    finally:
        pol.cost, pol.policy = saved
    assert all(v.stats["num_rows"] == 33 for v in verdicts if not v.finished)
    assert all(v.node_budget == 32 for v in verdicts if not v.finished)


def test_the_floor_keeps_its_nodes_of_every_cut_tree_and_stays_greedy(llm, hy):
    """``budget_floor``: the cost that cuts trees short above keeps at least the floor's nodes of each tree
    (and grants them), and the committed stream is still plain greedy."""
    pol = _scheduler(llm).hyco.budget_policy
    saved = pol.cost, pol.floor
    pol.cost, pol.floor = _frozen(0.002, 0.001), 5
    try:
        prompts = S._prompts(3, seed=24)
        refs = S._reference(llm, prompts)
        verdicts = _run(hy, prompts, refs, ["chain", "sibling", "deep"], seed=4)
    finally:
        pol.cost, pol.floor = saved
    live = [v for v in verdicts if not v.finished and v.round > 0]
    assert live and all(6 <= v.stats["num_rows"] < 33 for v in live)  # cut, never below the floor
    assert all(v.node_budget == v.stats["num_rows"] - 1 for v in live)
