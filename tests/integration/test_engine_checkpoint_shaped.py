"""HyCo sessions on the fixture shaped like the real Gemma 4 26B-A4B checkpoint (real vLLM 0.32 engine, CPU).

Both variants (``tests/checkpoint_shaped.py``), one engine each: ``Gemma4ForConditionalGeneration`` with
its text model under ``language_model.``, a 262,144-token vocabulary, 128 experts top-8, and a variant
whose last 4 layers own no cache (KV-shared). The hand-off and the compaction must find the layers vLLM
built (``vllm_adapter/worker/layers.py``), never the names a causal model would have. The first engine serves
the text model only (``language_model_only``); the KV-shared one loads the towers too (one image per
prompt allowed, ``skip_mm_profiling``: the CPU tests' torchvision stand-in cannot process the profiling
images), which keeps the same class and prefixes.

Random weights accept almost nothing, so the trees plant plain vLLM's greedy continuation (behind decoy
siblings, so accepted rows are not contiguous) at depths 0 to 11: every round commits exactly the greedy
tokens, every cache-owning layer wrote the tree rows, the int8 hand-off rows equal the quantized session cache in
the two hand-off layers, and after the rounds every layer's KV equals a fresh prefill of the text.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from checkpoint_shaped import LLM_KWARGS, SHARED_TARGETS, attn, bundle, handoff_layers, owners, torchvision_stand_in
from test_engine_kv import _plain_greedy, _runner, _session_kv
from tolerances import tol

DEPTHS = (0, 1, 2, 4, 7, 11)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "kv_shared"])
def shaped(request):
    """(llm, HycoEngine, kv_shared): one engine per variant, shut down before the next one starts."""
    from vllm import LLM

    from vllm_hyco.vllm_adapter.api_server.inprocess import HycoEngine

    kv_shared = request.param
    kwargs = dict(LLM_KWARGS)
    if kv_shared:  # the towers too
        kwargs.update(language_model_only=False, limit_mm_per_prompt={"image": 1, "video": 0, "audio": 0},
                      skip_mm_profiling=True)
    with torchvision_stand_in():
        # static budget: the trees plant paths at known depths (the adaptive policy would cut them)
        llm = LLM(model=str(bundle(kv_shared) / "verifier"),
                  speculative_config={"method": "hyco", "budget_policy": "static"}, **kwargs)
    yield llm, HycoEngine(llm), kv_shared
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_layers_are_the_ones_vllm_built(shaped):
    llm, _, kv_shared = shaped
    runner = _runner(llm)
    assert type(runner.model).__name__ == "Gemma4ForConditionalGeneration"
    if kv_shared:  # loaded with its vision tower
        assert type(runner.model.vision_tower).__name__ == "Gemma4VisionModel"
        assert sum(p.numel() for p in runner.model.vision_tower.parameters()) > 0
    rgroups = runner.kv_cache_config.kv_cache_groups  # the runner's copy also lists the KV-shared layers
    assert sorted(n for g in rgroups for n in g.layer_names) == sorted(attn(i) for i in range(12))
    text = runner.model_config.hf_text_config
    assert (runner.model_config.get_vocab_size(), text.num_experts, text.top_k_experts) == (262_144, 128, 8)
    from vllm_hyco.vllm_adapter.worker import tree_step

    kv = tree_step.kv_layers(runner)
    assert list(kv.owners) == owners(kv_shared)
    assert kv.shared == ({attn(i): attn(t) for i, t in SHARED_TARGETS.items()} if kv_shared else {})
    assert kv.handoff == handoff_layers(kv_shared)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    assert sorted(n for g in groups for n in g.layer_names) == sorted(owners(kv_shared))
    ctx = runner.compilation_config.static_forward_context
    assert ctx[attn(5)].impl.head_size == 512 and ctx[attn(0)].impl.head_size == 256
    assert ctx[attn(0)].sliding_window == 1024 and ctx[attn(5)].sliding_window is None


def test_deep_trees_commit_greedy_and_hand_off_at_every_depth(shaped, monkeypatch):
    from vllm_hyco.kernels import quantize_int8_ref
    from vllm_hyco.vllm_adapter.worker import runner as runner_mixin
    from vllm_hyco.vllm_adapter.worker.handoff_step import handoff_scales

    llm, hy, kv_shared = shaped
    captured: list[set[str]] = []
    real_check = runner_mixin.check_captured

    def recording_check(names, layers, req_id):
        captured.append(set(names))
        real_check(names, layers, req_id)

    monkeypatch.setattr(runner_mixin, "check_captured", recording_check)
    rng = random.Random(5)
    prompt = [2] + [rng.randrange(30, 4000) for _ in range(20)]
    ref = _plain_greedy(hy, prompt, sum(d + 1 for d in DEPTHS), f"ref-shaped-{kv_shared}")
    s = hy.open(prompt_token_ids=prompt, temperature=0.0, max_tokens=len(ref) + 8, ignore_eos=True)  # not finished
    out, root = [], s.root
    want_layers = handoff_layers(kv_shared)
    for rnd, depth in enumerate(DEPTHS):
        toks, pars = _planted(root, ref[len(out):], depth, rng)
        v = hy.submit(s.sid, rnd, toks, pars)
        assert len(v.path_rows) == depth and v.committed == ref[len(out):len(out) + depth + 1], rnd
        assert captured[-1] == set(owners(kv_shared)), rnd
        out += v.committed
        root = v.bonus
        h = v.handoff
        num_kv = len(prompt) + len(out) - 1  # positions with K/V: the bonus has none yet
        assert h.layers == want_layers and h.position == num_kv - 1 and h.start == num_kv - 1 - depth
        kv = _session_kv(llm, s.engine_req_id, num_kv)
        scales = handoff_scales(_runner(llm))
        for kind, name in want_layers.items():  # int8, quantized on the device from the compacted cache
            k, vv = kv[name]
            ks, vs = scales[kind]
            assert torch.equal(h.kv[kind].k, quantize_int8_ref(k[-(depth + 1):], ks)), (rnd, kind)
            assert torch.equal(h.kv[kind].v, quantize_int8_ref(vv[-(depth + 1):], vs)), (rnd, kind)
        assert (h.seed is not None) == (rnd == 0)
    assert out == ref
    # compaction moved every cache owner's rows: the cache equals a fresh prefill of the committed text
    text = prompt + out
    fresh = hy.open(prompt_token_ids=text, temperature=0.0, max_tokens=4, ignore_eos=True)
    n = len(text) - 1
    got, want = _session_kv(llm, s.engine_req_id, n), _session_kv(llm, fresh.engine_req_id, n)
    assert sorted(want) == sorted(owners(kv_shared))
    for name in want:
        for a, b in zip(got[name], want[name]):
            torch.testing.assert_close(a, b, **tol("kv_engine_vs_prefill_moe128", torch.float32),
                                       msg=lambda m, name=name: f"{name}: {m}")
    hy.close(s.sid)
    hy.close(fresh.sid)


def _planted(root: int, greedy: list[int], depth: int, rng: random.Random, rows: int = 33):
    """A tree accepting exactly ``depth`` nodes: greedy[:depth] as a chain, each behind a decoy sibling (so
    accepted rows are not contiguous), a wrong child under the chain's end, random filler elsewhere."""
    tokens, parents = [root], [-1]
    node = 0
    for d in range(depth):
        tokens += [greedy[d] ^ 1, greedy[d]]  # the decoy (another token) first
        parents += [node, node]
        node = len(tokens) - 1
    tokens.append(greedy[depth] ^ 1)  # never the greedy token: the path stops here
    parents.append(node)
    decoys = [i for i in range(1, len(tokens)) if i % 2 == 1 or i == len(tokens) - 1]
    while len(tokens) < rows:  # filler under the decoys only, distinct tokens (no duplicate siblings)
        tokens.append(5000 + len(tokens))
        parents.append(rng.choice(decoys))
    return tokens, parents


@pytest.mark.parametrize("kwargs, option", [
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"compilation_config": {"use_inductor_graph_partition": True}}, "use_inductor_graph_partition"),
    ({"compilation_config": {"splitting_ops": []}}, "splitting_ops"),
])
def test_llm_refuses_uncapturable_configs_before_the_engine_starts(kwargs, option):
    from vllm import LLM

    from vllm_hyco.errors import ConfigError

    with torchvision_stand_in(), pytest.raises(ConfigError, match=option):
        LLM(model=str(bundle(False) / "verifier"), speculative_config={"method": "hyco"},
            **{**LLM_KWARGS, "enforce_eager": False, **kwargs})
