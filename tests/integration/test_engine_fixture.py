"""HyCo sessions on the project's fixture verifier (tokenizer, head_dim 256/512, k_eq_v full layer, MoE).

Greedy sessions must end exactly where plain vLLM ends, with the same text and finish_reason: EOS
falling inside an accepted path ("stop"), a stop string completed inside a path ("stop", text cut by
vLLM's detokenizer), and max_tokens ("length"). With the trained fixture weights two of the three
prompts end on EOS inside an accepted path and one on max_tokens.
"""

from __future__ import annotations

import random

import pytest

PROMPTS = ["def hello(world):", "import os\nimport sys\n", "class Foo(object):\n    "]


@pytest.fixture(scope="module")
def llm(fixtures_dir):
    from vllm import LLM

    engine = LLM(model=str(fixtures_dir / "verifier"), dtype="float32", max_model_len=1024, max_num_seqs=4,
                 enforce_eager=True, distributed_executor_backend="uni", seed=0,
                 speculative_config={"method": "hyco"})
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _run(hy, prompt_ids, ref_ids, rng, **fields):
    """Trees planting the reference continuation (chain of up to 5) plus a random sibling of the root."""
    s = hy.open(prompt_token_ids=prompt_ids, temperature=0.0, **fields)
    out, text, root, rnd = [], "", s.root, 0
    while True:
        nxt = ref_ids[len(out):len(out) + 5]
        toks, pars = [root] + nxt, [-1] + list(range(len(nxt)))
        decoy = rng.randrange(3, 1000)
        if not nxt or decoy != nxt[0]:
            toks, pars = toks + [decoy], pars + [0]
        v = hy.submit(s.sid, rnd, toks, pars)
        out, text, root, rnd = out + v.committed, text + v.text, v.bonus, rnd + 1
        if v.finished:
            return out, text, v.finish_reason


def test_eos_stop_strings_and_length_end_like_plain_vllm(llm):
    from vllm import SamplingParams

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    tok = llm.get_tokenizer()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": i} for i in ids],
                                                SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)]
    k = max(range(len(refs)), key=lambda j: len(refs[j].text))  # the longest answer holds a stop string
    assert len(refs[k].text) >= 14, [r.text for r in refs]
    stop = refs[k].text[10:14]
    stopped = llm.generate([{"prompt_token_ids": ids[k]}], SamplingParams(temperature=0, max_tokens=32, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    hy = HycoEngine(llm)
    rng = random.Random(0)
    for i, ref in zip(ids, refs):
        out, text, reason = _run(hy, i, list(ref.token_ids), rng, max_tokens=32)
        assert (out, text, reason) == (list(ref.token_ids), ref.text, ref.finish_reason)
    out, text, reason = _run(hy, ids[k], list(refs[k].token_ids), rng, max_tokens=32, stop=[stop])
    assert (text, reason) == (stopped.text, stopped.finish_reason) and reason == "stop"


def test_server_mode_needs_a_server_that_drafts(llm):
    """Without ``model`` the server has no MTP head to draft with: server mode is refused, typed, and the
    session keeps serving in phone mode."""
    from vllm_hyco.errors import SessionError
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    hy = HycoEngine(llm)
    s = hy.open(prompt_token_ids=[2, 17, 99, 5, 8], temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(SessionError) as err:
        hy.set_mode(s.sid, "server")
    assert err.value.code == "server_mode_unavailable" and "\"model\"" in str(err.value)
    v = hy.submit(s.sid, 0, [s.root, 7], [-1, 0])
    assert v.committed and hy._info(s.sid).mode == "phone"
    hy.close(s.sid)
