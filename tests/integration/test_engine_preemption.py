"""vLLM preempts a HyCo session between its submit and its round (real vLLM 0.32 engine, CPU, tiny model).

A 36-block KV cache holds three parked sessions and two ordinary requests; when the three trees join
``running`` behind the ordinary requests, the blocks run out and vLLM preempts the last running request, a
session whose tree is submitted but not verified yet. vLLM frees its KV and re-prefills it later, in chunks
(``max_num_batched_tokens`` 64 < its prompt). Every chunk must stop before the root (only the tree's chunk
may pass it), then the tree is injected again and verified. Sessions must end greedy-exact or with a typed
code and no lost committed token; the ordinary requests must equal plain greedy; the engine keeps serving.
(Without the per-chunk cap the re-prefill computed the root as a prompt token and committed a wrong token.)
"""

from __future__ import annotations

import random

import pytest
from test_engine_sessions import VOCAB, _tree, tiny_hyco_llm

NUM_BLOCKS = 36
GEN = 40


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny_preempt", max_model_len=256, max_num_seqs=8,
                             num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=64)


def test_sessions_preempted_before_their_round_stay_exact_and_the_engine_keeps_serving(llm, monkeypatch):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    rng = random.Random(1)
    prompts = [[2] + [rng.randrange(5, VOCAB) for _ in range(n)] for n in (89, 60, 100, 20, 20, 30)]
    greedy = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    refs = [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    preempted = []  # (request id, session state or None) for every preemption
    real_preempt = sched._preempt_request

    def spy(request, *args, **kwargs):
        s = sched.hyco.sessions.by_req(request.request_id)
        preempted.append((request.request_id, s.state.value if s is not None else None))
        return real_preempt(request, *args, **kwargs)

    monkeypatch.setattr(sched, "_preempt_request", spy)
    hy = HycoEngine(llm)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=GEN, ignore_eos=True)
               for p in prompts[:3]]
    stream = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in (3, 4):  # ordinary requests, admitted before the trees join `running`
        hy.add_request(f"plain-{i}", {"prompt_token_ids": prompts[i]}, stream)
    hy.step()
    state = {h.sid: {"root": h.root, "out": [], "round": 0, "ref": refs[i]} for i, h in enumerate(handles)}
    ended = {}
    while state:
        batch = []
        for sid, st in state.items():
            shape = rng.choice(["chain", "deep", "slm"])
            toks, pars, _ = _tree(st["root"], st["ref"][len(st["out"]):], shape, rng)
            batch.append((sid, st["round"], toks, pars))
        for (sid, *_), v in zip(batch, hy.submit_many(batch, return_errors=True)):
            st = state[sid]
            if isinstance(v, Exception):  # ended by the engine (a parked session evicted for the queue head)
                assert v.code == "session_evicted", v
                ended[sid] = v.code
                del state[sid]
                continue
            st["out"] += v.committed
            assert st["out"] == st["ref"][:len(st["out"])], (sid, v.round, st["out"])  # no wrong token
            st["root"], st["round"] = v.bonus, st["round"] + 1
            if v.finished:
                ended[sid] = v.finish_reason
                assert v.finish_reason != "length" or st["out"] == st["ref"]
                del state[sid]
    assert any(s == "verifying" for _, s in preempted), preempted  # the case under test happened
    assert "length" in ended.values()
    streamed = {3: [], 4: []}
    for _ in range(400):
        for i in streamed:
            streamed[i] += [t for o in hy.take_outputs(f"plain-{i}") for t in o.outputs[0].token_ids]
        if not sched.running and not len(sched.waiting):
            break
        hy.step()
    assert streamed == {3: refs[3], 4: refs[4]}
    # The engine keeps serving: a new session and an ordinary request, then every block is back.
    s = hy.open(prompt_token_ids=prompts[5], temperature=0.0, max_tokens=GEN, ignore_eos=True)
    out, root, rnd = [], s.root, 0
    while True:
        toks = [root] + refs[5][len(out):len(out) + 8]
        v = hy.submit(s.sid, rnd, toks, list(range(-1, len(toks) - 1)))
        out, root, rnd = out + v.committed, v.bonus, rnd + 1
        if v.finished:
            break
    assert out == refs[5]
    plain = hy.run_plain("plain-after", {"prompt_token_ids": prompts[3]}, stream)
    assert [t for o in plain for t in o.outputs[0].token_ids] == refs[3]
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1  # block 0 is vLLM's null
