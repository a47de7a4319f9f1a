"""Issue 35: HyCo verifies trees on a DeepSeek-V3-shaped verifier (MLA, ``kv_lora_rank`` 512 / rope 64, MoE with
a shared expert and grouped routing, random fp32 weights) on vLLM's CPU build, in-process.

Trees with a decoy as the root's first child and plain greedy's continuation planted behind it (rows 2..) are
accepted at depth, so every accepted path is compacted through the latent cache (rows 2.. move to t + 1 ..),
and the session commits plain greedy's tokens. The tree rows run vLLM's MLA prefill path with the tree's mask
(``worker/cpu_mla.py``): the masked path runs in those steps, and without it (vLLM's causal mask over the tree
rows) the same trees commit other tokens, so the mask is what keeps them exact.

Slow tier: exact sampling on 2-level trees stays lossless through the masked MLA path (the first two committed
tokens follow plain sampling's distribution, chi-square against plain samples, alpha 1e-3,
``tests/treedist.py``), with the likeliest path behind 16 rejected decoys, so it is compacted from rows 17..
"""

from __future__ import annotations

import random

import pytest

PROMPTS = [[2, 17, 99, 5, 8, 40, 41], [2, 300, 301, 302, 7, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(deepseek_dir):
    from conftest import _LLMFactory

    factory = _LLMFactory()
    yield factory(str(deepseek_dir), speculative_config={"method": "hyco", "budget_policy": "static"},
                  max_logprobs=-1)  # the distribution test reads the whole vocabulary's logprobs
    factory.close_all()


@pytest.fixture
def masked(monkeypatch):
    """``{"calls": n}``: how many of vLLM's MLA prefill calls ran with a masked tree (the masked path)."""
    from vllm_hyco.vllm_adapter.worker import cpu_mla, tree_plan

    counts = {"calls": 0}
    ours = cpu_mla.HycoSDPAMLAPrefill.run_prefill_new_tokens

    def counted(self, *args, **kwargs):
        counts["calls"] += bool(tree_plan.masked_trees())
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(cpu_mla.HycoSDPAMLAPrefill, "run_prefill_new_tokens", counted)
    return counts


def _sessions(llm, refs):
    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    hy, rng, outs, paths = HycoEngine(llm), random.Random(0), [], []
    for prompt, ref in zip(PROMPTS, refs):
        s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        out, root, rnd = [], s.root, 0
        while True:
            nxt = ref[len(out):len(out) + rng.randint(1, 5)]
            toks = [root, rng.randrange(3, 1000), *nxt]  # the decoy first: the planted chain sits at rows 2..
            v = hy.submit(s.sid, rnd, toks, [-1, 0, 0, *range(2, 1 + len(nxt))])
            assert v.handoff is None or not v.handoff.kv  # no rows: its phones run no MTP head
            paths.append(list(v.path_rows))
            out, root, rnd = out + v.committed, v.bonus, rnd + 1
            if v.finished:
                break
        outs.append(out)
    return outs, paths


def test_mla_trees_are_masked_compacted_and_commit_plain_greedy(llm, masked, monkeypatch):
    from vllm import SamplingParams
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from vllm_hyco.vllm_adapter.worker import cpu_mla

    refs = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                   ignore_eos=True), use_tqdm=False)]
    outs, paths = _sessions(llm, refs)
    assert outs == refs and masked["calls"] > 0
    assert sum(1 for p in paths if len(p) >= 2 and p[0] == 2) >= 4, paths  # compacted paths, at depth

    # the control: vLLM's own (causal) mask over the same tree rows commits other tokens
    monkeypatch.setattr(cpu_mla.HycoSDPAMLAPrefill, "run_prefill_new_tokens",
                        CPUSDPAMLAPrefillBackend.run_prefill_new_tokens)
    assert _sessions(llm, refs)[0] != refs


@pytest.mark.slow
def test_exact_sampling_on_masked_mla_trees_is_lossless(llm, masked):
    """T = 0.1: the random weights leave the next token nearly uniform over the 4,096 ids at T = 1 (the top
    one holds ~0.08 %), so tree paths would almost never be taken; at 0.1 greedy's first step from
    ``PROMPTS[1]`` has its top token at 0.46 (the context is that prompt, cut 0). Exactness must preserve the
    sampled distribution at any temperature, and plain samples are drawn at the same one. The 16 decoys are
    there for the test's power: these weights barely attend (the logits follow the last token), so one sibling
    seen through a missing mask moves the next token's distribution too little for 240 sessions to tell; 16 of
    them do (by hand, with vLLM's causal mask over the tree rows: the second token's chi-square 77.8 and the
    pair's 59.2 against 26.3 and 20.8; 12.1 and 1.9 with the mask)."""
    from treedist import exact_tree_distribution

    decoys = 16
    dist = exact_tree_distribution(llm, PROMPTS[1], temperature=0.1, n_ref=1200, n_hy=240, decoys=decoys)
    dist.assert_lossless()
    assert masked["calls"] > 0
    assert any(p == [decoys + 1, decoys + 3] for p in dist.paths), dist.depths  # compacted from rows 17..
