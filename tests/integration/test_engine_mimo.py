"""Issue 35 in-process: HyCo on the trained MiMo-shaped family (``MiMoForCausalLM``, its MTP layer owning its
KV; fp32), with the verifier folder as vLLM's MTP drafter for ordinary requests and server mode.

* Greedy sessions with trees planting plain greedy's continuation (1-5 nodes, plus a decoy) commit plain greedy's
  tokens; every hand-off carries h rows (``hidden``) of the root and the accepted path, round 0 a seed of every
  committed position.
* The h rows are the ring's: after a server-mode stretch the seed re-sends the positions earlier hand-offs
  carried, bit for bit (the worker's per-session ring, ``worker/hidden_rows.py``).
* Exact sampling (T = 1) stays lossless: the first two committed tokens of 2-level trees follow plain
  sampling's distribution (chi-square against plain samples, alpha 1e-3, ``tests/treedist.py``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

PROMPT = "And the LORD said unto Moses,"


@pytest.fixture(scope="module")
def family(mimo_family_dir) -> Path:
    return mimo_family_dir


@pytest.fixture(scope="module")
def llm(family):
    from conftest import _LLMFactory

    factory = _LLMFactory()
    yield factory(str(family / "verifier"), trust_remote_code=True,
                  speculative_config={"method": "hyco", "model": str(family / "verifier"), "num_speculative_tokens": 2,
                                      "budget_policy": "static"})  # every node verified: no timing-dependent cut
    factory.close_all()


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return llm.get_tokenizer()(PROMPT)["input_ids"]


def _rows(h) -> np.ndarray:
    return np.asarray(h.kv["hidden"].k)[:, 0, :]


def test_planted_greedy_trees_commit_plain_greedy_with_h_rows(llm, prompt_ids):
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    ref = list(llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(temperature=0, max_tokens=40,
                            ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
    hy, rng = HycoEngine(llm), random.Random(0)
    s = hy.open(prompt_token_ids=prompt_ids, temperature=0.0, max_tokens=40, ignore_eos=True)
    out, root, rnd, hidden = [], s.root, 0, llm.llm_engine.model_config.hf_config.hidden_size
    while True:
        nxt = ref[len(out):len(out) + rng.randint(1, 5)]
        v = hy.submit(s.sid, rnd, [root, *nxt, rng.randrange(3, 1000)], [-1, *range(len(nxt)), 0])
        if v.handoff is not None:
            h = v.handoff
            assert set(h.kv) == {"hidden"} and _rows(h).shape == (len(v.path_rows) + 1, hidden)
            assert (h.seed is not None) == (rnd == 0)
            if rnd == 0:
                assert (h.seed.start, h.seed.end) == (0, h.position + 1)
        out, root, rnd = out + v.committed, v.bonus, rnd + 1
        if v.finished:
            break
    assert out == ref and rnd < len(ref)  # planted paths were accepted


def test_a_seed_after_server_mode_resends_the_rows_of_earlier_rounds(llm, prompt_ids):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    hy = HycoEngine(llm)
    s = hy.open(prompt_token_ids=prompt_ids, temperature=0.0, max_tokens=40, ignore_eos=True)
    seen: dict[int, np.ndarray] = {}  # position -> the int8 h row a hand-off carried
    v = hy.submit(s.sid, 0, [s.root], [-1])
    seed = v.handoff.seed
    seen.update({seed.start + i: r for i, r in enumerate(np.asarray(seed.kv["hidden"].k)[:, 0, :])})
    v = hy.submit(s.sid, 1, [v.bonus], [-1])
    seen.update({v.handoff.start + i: r for i, r in enumerate(_rows(v.handoff))})
    hy.set_mode(s.sid, "server")
    hy.decode_server(s.sid, steps=3)
    info = hy.set_mode(s.sid, "phone")
    v = hy.submit(s.sid, info.expected_round, [info.root], [-1])
    seed = v.handoff.seed
    assert seed is not None and seed.start == 0 and seed.end == v.handoff.position + 1
    rows = np.asarray(seed.kv["hidden"].k)[:, 0, :]
    assert all(np.array_equal(rows[p], r) for p, r in seen.items()), "the ring lost a committed row"
    # the rings are the pool allocated at load (max_sessions x W x hidden): this session holds one slot until
    # its end reaches the worker
    st = _runner(llm).hyco
    pool, held = st.hidden_pool, len(st.hidden_pool.slot_of)
    hidden = llm.llm_engine.model_config.hf_config.hidden_size
    assert pool.rows.shape == (st.config.max_sessions, st.window, hidden) and held >= 1 and not pool.apart
    hy.close(s.sid)
    llm.generate([{"prompt_token_ids": prompt_ids}], use_tqdm=False)  # a step that carries the finished id
    assert len(pool.slot_of) < held and len(pool.slot_of) + len(pool.free_slots) == st.config.max_sessions


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def test_exact_sampling_on_trees_is_lossless(llm, prompt_ids):
    from treedist import exact_tree_distribution

    exact_tree_distribution(llm, prompt_ids, temperature=1.0, n_ref=600, n_hy=120).assert_lossless()
