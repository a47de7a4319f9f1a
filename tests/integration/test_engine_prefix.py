"""HyCo sessions with prefix caching and chunked prefill (real vLLM 0.32 engine, CPU, tiny fp32 model).

The prefill of a session runs in several chunks (max_num_batched_tokens 64 < prompt), and a second
session on the same prompt hits the prefix cache. The round-0 seed hand-off is gathered from the paged
cache, so both sessions must return the same seed and the same verdicts, equal to plain vLLM greedy.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine_sessions import VOCAB, _tree, tiny_hyco_llm
from tolerances import tol


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny_prefix", max_num_seqs=8, enable_prefix_caching=True,
                             max_num_batched_tokens=64)


def test_chunked_prefill_and_prefix_cached_sessions_share_seed_and_verdicts(llm):
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    rng = random.Random(21)
    prompt = [2] + [rng.randrange(5, VOCAB) for _ in range(149)]  # 150 tokens: 3 chunks of <= 64
    ref = list(llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40,
                            ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
    hy = HycoEngine(llm)
    a = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=40, ignore_eos=True)
    b = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=40, ignore_eos=True)  # prefix-cache hit
    core = llm.llm_engine.engine_core.engine_core
    full_group = len(core.scheduler.kv_cache_config.kv_cache_groups) - 1  # layer 3, full attention, block 32
    blocks_a = core.scheduler.kv_cache_manager.get_block_ids(a.engine_req_id)[full_group]
    blocks_b = core.scheduler.kv_cache_manager.get_block_ids(b.engine_req_id)[full_group]
    assert blocks_a[:4] == blocks_b[:4]  # b's prefill reused a's cached blocks
    roots, outs = {a.sid: a.root, b.sid: b.root}, {a.sid: [], b.sid: []}
    for rnd in range(4):
        toks, pars, _ = _tree(a.root if rnd == 0 else roots[a.sid], ref[len(outs[a.sid]):], "deep", rng)
        va, vb = hy.submit_many([(a.sid, rnd, toks, pars), (b.sid, rnd, toks, pars)])
        assert va.committed == vb.committed == ref[len(outs[a.sid]):len(outs[a.sid]) + len(va.committed)]
        if rnd == 0:
            sa, sb = va.handoff.seed, vb.handoff.seed
            assert (sa.start, sa.end) == (sb.start, sb.end) == (len(prompt) + len(va.committed) - 33,
                                                               len(prompt) + len(va.committed) - 1)
            for kind in ("full", "sliding"):
                for x, y in ((sa.kv[kind].k, sb.kv[kind].k), (sa.kv[kind].v, sb.kv[kind].v)):
                    torch.testing.assert_close(x, y, **tol("kv_engine_vs_prefill", torch.float32))
        for v in (va, vb):
            outs[v.sid] += v.committed
            roots[v.sid] = v.bonus
    assert outs[a.sid] == outs[b.sid] == ref[:len(outs[a.sid])]
    hy.close(a.sid)
    hy.close(b.sid)


def test_trees_cut_short_by_the_token_budget_still_verify(llm):
    """Two 33-row trees in one step of a 64-token budget: the second gets 31 rows, still a valid tree."""
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    rng = random.Random(33)
    prompts = [[2] + [rng.randrange(5, VOCAB) for _ in range(20)] for _ in range(2)]
    refs = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        use_tqdm=False)]
    hy = HycoEngine(llm)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=30, ignore_eos=True) for p in prompts]
    batch = []
    for h, ref in zip(handles, refs):
        toks, pars, depth = _tree(h.root, ref, "chain", rng)  # the planted chain sits in rows 1..4
        assert len(toks) == 33 and depth == 4
        batch.append((h.sid, 0, toks, pars))
    verdicts = hy.submit_many(batch)
    assert sorted(v.stats["num_rows"] for v in verdicts) == [31, 33]
    for v, ref in zip(verdicts, refs):
        assert v.committed == ref[:5]
    for h in handles:
        hy.close(h.sid)


def test_a_fully_cached_prompt_still_opens_a_session(llm):
    """129 tokens: everything but the root (128 = 2 x 64) is a prefix-cache hit for the second session."""
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    rng = random.Random(129)
    prompt = [2] + [rng.randrange(5, VOCAB) for _ in range(128)]
    ref = list(llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8,
                            ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
    hy = HycoEngine(llm)
    a = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    b = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=8, ignore_eos=True)
    toks, pars = [a.root] + ref[:4], [-1, 0, 1, 2, 3]
    va, vb = hy.submit_many([(a.sid, 0, toks, pars), (b.sid, 0, toks, pars)])
    assert va.committed == vb.committed == ref[:5]
    hy.close(a.sid)
    hy.close(b.sid)


@pytest.fixture(scope="module")
def small_llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny_small", max_model_len=256, max_num_seqs=8,
                             num_gpu_blocks_override=24)


def test_parked_sessions_yield_their_kv_to_a_waiting_request(small_llm):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_hyco.errors import SessionError
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    rng = random.Random(5)
    prompts = [[2] + [rng.randrange(5, VOCAB) for _ in range(89)] for _ in range(3)]
    hy = HycoEngine(small_llm)
    sched = small_llm.llm_engine.engine_core.engine_core.scheduler
    a = hy.open(prompt_token_ids=prompts[0], temperature=0.0, max_tokens=8, ignore_eos=True)
    b = hy.open(prompt_token_ids=prompts[1], temperature=0.0, max_tokens=8, ignore_eos=True)
    free_before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outs = hy.run_plain("plain", {"prompt_token_ids": prompts[2]}, params)  # does not fit beside both
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 4
    with pytest.raises(SessionError) as info:
        hy.submit(a.sid, 0, [a.root], [-1])  # the least recently used parked session was evicted
    assert info.value.code == "session_evicted"
    v = hy.submit(b.sid, 0, [b.root], [-1])  # the other one kept its KV and still verifies
    assert len(v.committed) == 1
    assert free_before < 24
    hy.close(b.sid)
