"""HyCo sessions inside a real vLLM 0.32 engine (CPU, tiny fp32 Gemma-4 MoE, in-process).

One engine for the module. Plain (non-session) greedy requests on the same engine are the reference:
they go through vLLM's stock scheduler, runner, sampler and CPU attention op (the override only touches
rows of trees). Trees plant the reference continuation in the chain, as a sibling, as an SLM-style
child, deep, or nowhere; the committed stream must equal the reference token for token.
"""

from __future__ import annotations

import gc
import json
import os
import random

import pytest
import torch

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")

VOCAB = 512
WINDOW = 32
BLOCK = 32
GEN = 64


def _build_tiny(out) -> str:
    """4 layers (S,S,S,F), head_dim 32 / global 64, k_eq_v, 4 experts top-2, window 32, fp32."""
    import transformers
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
        sliding_window=WINDOW, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=30.0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        max_position_embeddings=1024, tie_word_embeddings=True, architectures=["Gemma4ForCausalLM"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.Gemma4ForCausalLM(cfg).eval().to(torch.float32)
    model.save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))
    return str(out)


def tiny_hyco_llm(tmp_path_factory, name: str, **overrides):
    """Body of a module-scoped ``llm`` fixture (``yield from``): a HyCo engine on a fresh tiny model with
    these tests' defaults and ``overrides``, shut down when the module is done."""
    from vllm import LLM

    kwargs = dict(dtype="float32", max_model_len=512, max_num_seqs=16, enforce_eager=True,
                  distributed_executor_backend="uni", skip_tokenizer_init=True, block_size=BLOCK, seed=0,
                  enable_prefix_caching=False,
                  # whole trees: these tests plant paths at known depths; the adaptive budget, which may
                  # verify only a prefix, has its own tests (test_engine_budget.py)
                  speculative_config={"method": "hyco", "budget_policy": "static"})
    engine = LLM(model=_build_tiny(tmp_path_factory.mktemp(name)), **{**kwargs, **overrides})
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    yield from tiny_hyco_llm(tmp_path_factory, "tiny")


@pytest.fixture(scope="module")
def hy(llm):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    return HycoEngine(llm)


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2] + [rng.randrange(5, VOCAB) for _ in range(rng.randrange(3, 45))] for _ in range(n)]


def _reference(llm, prompts, max_tokens=GEN) -> list[list[int]]:
    """Plain vLLM greedy. Only while no session is open: LLM.generate waits for every request."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _tree(root: int, greedy: list[int], shape: str, rng: random.Random, budget: int = 32):
    """(tokens, parents, planted depth): the greedy continuation planted according to ``shape``."""
    tokens, parents = [root], [-1]
    children: dict[int, set[int]] = {0: set()}

    def add(parent: int, tok: int) -> int:
        tokens.append(tok)
        parents.append(parent)
        children[parent].add(tok)
        children[len(tokens) - 1] = set()
        return len(tokens) - 1

    def wrong(parent: int, avoid: int | None) -> int:
        while True:
            tok = rng.randrange(3, VOCAB)
            if tok != avoid and tok not in children[parent]:
                return tok

    depth = {"chain": 4, "sibling": 3, "slm": 5, "deep": min(12, len(greedy) - 1), "nowhere": 0}[shape]
    depth = min(depth, len(greedy) - 1)
    node = 0
    for d in range(depth):
        if shape in ("sibling", "slm", "deep"):  # decoys first, so accepted rows are not contiguous
            for _ in range(rng.randrange(1, 3)):
                if len(tokens) < budget:
                    add(node, wrong(node, greedy[d]))
        if len(tokens) >= budget:
            depth = d
            break
        node = add(node, greedy[d])
    if shape == "nowhere":
        for _ in range(4):
            add(0, wrong(0, greedy[0]))
    while len(tokens) < budget + 1:  # fill with random nodes below random rows (never a greedy twin)
        p = rng.randrange(len(tokens))
        add(p, wrong(p, None if p not in _greedy_rows(tokens, parents, greedy) else
                     greedy[_depth(parents, p)]))
    return tokens, parents, depth


def _depth(parents, i):
    d = 0
    while parents[i] != -1:
        i, d = parents[i], d + 1
    return d


def _greedy_rows(tokens, parents, greedy) -> set[int]:
    rows = {0}
    for i in range(1, len(tokens)):
        d = _depth(parents, i)
        if parents[i] in rows and d - 1 < len(greedy) and tokens[i] == greedy[d - 1]:
            rows.add(i)
    return rows


def _run_sessions(hy, prompts, refs, shapes, seed=0):
    """Interleaved sessions (their trees share steps); returns the committed streams."""
    rng = random.Random(seed)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=GEN, ignore_eos=True) for p in prompts]
    state = {h.sid: {"root": h.root, "out": [], "round": 0, "ref": r} for h, r in zip(handles, refs)}
    while state:
        batch, planted = [], {}
        for sid, st in state.items():
            done = len(st["out"])
            shape = rng.choice(shapes)
            toks, pars, depth = _tree(st["root"], st["ref"][done:], shape, rng)
            batch.append((sid, st["round"], toks, pars))
            planted[sid] = depth
        for v in hy.submit_many(batch):
            st = state[v.sid]
            exp = st["ref"][len(st["out"]):len(st["out"]) + planted[v.sid] + 1]
            assert v.committed == exp, (v.sid, v.round, v.path_rows, v.committed, exp)
            st["out"] += v.committed
            st["root"], st["round"] = v.bonus, st["round"] + 1
            if v.finished:
                assert v.finish_reason == "length"
                refs_out = state.pop(v.sid)
                assert refs_out["out"] == refs_out["ref"]
    return True


def test_chain_trees_reproduce_plain_greedy(llm, hy):
    prompts = _prompts(2, seed=3)
    refs = _reference(llm, prompts)
    assert _run_sessions(hy, prompts, refs, shapes=["chain"])


def test_tree_shapes_reproduce_plain_greedy(llm, hy):
    prompts = _prompts(20, seed=5)
    refs = _reference(llm, prompts)
    for i in range(0, 20, 5):
        assert _run_sessions(hy, prompts[i:i + 5], refs[i:i + 5],
                             shapes=["chain", "sibling", "slm", "deep", "nowhere"], seed=i)


def test_eight_sessions_and_two_streaming_requests_share_the_engine(llm, hy):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    prompts = _prompts(10, seed=9)
    refs = _reference(llm, prompts, max_tokens=24)
    stream = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in (8, 9):  # ordinary streaming requests, queued before the sessions open
        hy.add_request(f"plain-{i}", {"prompt_token_ids": prompts[i]}, stream)
    rng = random.Random(4)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=24, ignore_eos=True) for p in prompts[:8]]
    state = {h.sid: [h.root, [], 0, refs[i]] for i, h in enumerate(handles)}
    while state:
        batch = []
        for sid, (root, out, rnd, ref) in state.items():
            toks, pars, _ = _tree(root, ref[len(out):], rng.choice(["chain", "deep", "nowhere"]), rng)
            batch.append((sid, rnd, toks, pars))
        for v in hy.submit_many(batch):
            st = state[v.sid]
            st[1] += v.committed
            st[0], st[2] = v.bonus, st[2] + 1
            if v.finished:
                assert st[1] == st[3]
                del state[v.sid]
    streamed = {}
    for _ in range(200):
        for i in (8, 9):
            for o in hy.take_outputs(f"plain-{i}"):
                streamed.setdefault(i, []).append(o)
        if all(i in streamed and streamed[i][-1].finished for i in (8, 9)):
            break
        hy.step()
    for i in (8, 9):
        chunks = streamed[i]
        assert len(chunks) > 1  # it streamed while the sessions ran
        assert [t for c in chunks for t in c.outputs[0].token_ids] == refs[i]


def test_max_tokens_inside_an_accepted_path_ends_like_plain_vllm(llm, hy):
    prompt = _prompts(1, seed=12)[0]
    ref, longer = _reference(llm, [prompt], max_tokens=7)[0], _reference(llm, [prompt], max_tokens=12)[0]
    s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=7, ignore_eos=True)
    v0 = hy.submit(s.sid, 0, [s.root] + ref[:4], [-1, 0, 1, 2, 3])  # commits 5
    v1 = hy.submit(s.sid, 1, [v0.bonus] + longer[5:10], [-1, 0, 1, 2, 3, 4])  # path of 5, only 2 allowed
    assert v0.committed + v1.committed == ref
    assert v1.finished and v1.finish_reason == "length"
    assert hy.close(s.sid) is False


def _sampled_chain(root: int, rng: random.Random, depth: int = 4):
    """A chain of random tokens, each 'drawn' from a q over 3 ids (the chain token among them), plus one
    deterministic sibling of the first node; returns tokens, parents, draft_q."""
    tokens, parents, q = [root], [-1], {}
    for _ in range(depth):
        ids = rng.sample(range(3, VOCAB), 3)
        tokens.append(ids[0])
        parents.append(len(tokens) - 2)
        q[len(tokens) - 1] = (ids, [rng.randrange(1, 100) for _ in ids])
    tokens.append(next(t for t in range(3, VOCAB) if t != tokens[1]))
    parents.append(0)
    return tokens, parents, q


def _run_sampled(hy, prompt, seed: int, send_q: bool = True, **fields) -> list[int]:
    rng = random.Random(seed)
    s = hy.open(prompt_token_ids=prompt, max_tokens=16, ignore_eos=True, seed=seed, **fields)
    out, root, rnd = [], s.root, 0
    while True:
        toks, pars, q = _sampled_chain(root, rng)
        v = hy.submit(s.sid, rnd, toks, pars, draft_q=q if send_q else None)
        out += v.committed
        root, rnd = v.bonus, rnd + 1
        if v.finished:
            return out


def test_sampled_drafts_keep_greedy_identity_and_seeded_sessions_reproduce(llm, hy):
    """draft_q changes nothing under greedy (p̃ is one-hot: the coupled sample is the argmax); a seeded
    sampled session with q on its chain commits the same tokens twice (the extra uniforms come from the
    session's generator); a malformed q is refused with ``bad_draft_q`` and the session goes on."""
    from vllm_hyco.errors import TreeValidationError

    prompt = _prompts(1, seed=21)[0]
    ref = _reference(llm, [prompt], max_tokens=16)[0]
    greedy = _run_sampled(hy, prompt, seed=3, temperature=0.0)
    assert greedy == ref
    a = _run_sampled(hy, prompt, seed=4, temperature=1.0, top_k=64, top_p=0.95)
    b = _run_sampled(hy, prompt, seed=4, temperature=1.0, top_k=64, top_p=0.95)
    assert a == b and len(a) == 16
    # the q reached the decision: the coupled draws (residual by the extra uniform) change the stream
    assert _run_sampled(hy, prompt, seed=4, send_q=False, temperature=1.0, top_k=64, top_p=0.95) != a
    s = hy.open(prompt_token_ids=prompt, max_tokens=4, ignore_eos=True, temperature=1.0, seed=5)
    toks, pars, q = _sampled_chain(s.root, random.Random(0))
    q[1] = ([toks[1] + 1], [1])  # the chain token is not among the ids it was drawn from
    with pytest.raises(TreeValidationError) as e:
        hy.submit(s.sid, 0, toks, pars, draft_q=q)
    assert e.value.code == "bad_draft_q"
    toks, pars, q = _sampled_chain(s.root, random.Random(0))
    assert hy.submit(s.sid, 0, toks, pars, draft_q=q).committed
