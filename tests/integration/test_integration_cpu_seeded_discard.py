"""vLLM 0.32 CPU: seeded requests under chunked prefill (vllm_hyco/vllm_adapter/patches/cpu_seeded_discard.py).

Plain vLLM (no speculative decoding), fp32, in-process, the random-weight fixtures: 8 seeded T = 1 prompts
with a 64-token step budget, so their prefills are chunked and the chunks' samples discarded. Stock vLLM
dies (``CPU Generator does not use offset``); patched, it must produce exactly the tokens of an unchunked
run, which is what vLLM's generator rewind is for.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_hyco.vllm_adapter.patches import cpu_seeded_discard

NUM_PROMPTS = 8
MAX_TOKENS = 12


def _generate(make_llm, fixtures_dir, budget: int | None) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"max_num_batched_tokens": budget, "enable_chunked_prefill": True} if budget else {}
    llm = make_llm(str(fixtures_dir / "verifier"), max_num_seqs=NUM_PROMPTS, max_model_len=256, **kw)
    prompts = [TokensPrompt(prompt_token_ids=[2] + [(37 * i + 11 * j) % 4000 + 23 for j in range(40)])
               for i in range(NUM_PROMPTS)]
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=100 + i, ignore_eos=True)
              for i in range(NUM_PROMPTS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    make_llm.close(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_stock_bookkeeping_still_rewinds_with_set_offset():
    """If this fails, vLLM changed how it undoes discarded draws: re-check the patch (its Removal note)."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patch = cpu_seeded_discard.PATCHES[1]
    stock = patch._original if patch.applied else GPUModelRunner._bookkeeping_sync
    assert "set_offset" in inspect.getsource(stock)


def test_chunked_seeded_prefill_runs_and_matches_the_unchunked_tokens(make_llm, fixtures_dir):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CUDA generators have offsets")
    assert cpu_seeded_discard.apply_if_cpu()  # the plugin applies it in every engine; idempotent
    chunked = _generate(make_llm, fixtures_dir, 64)  # 41-token prompts, 8 at a time: chunked
    whole = _generate(make_llm, fixtures_dir, None)
    assert all(len(ids) == MAX_TOKENS for ids in chunked)
    assert chunked == whole
