"""KV compaction, hand-off capture, sampling and bad input for HyCo sessions (real vLLM 0.32 engine, CPU).

After several rounds of trees whose accepted rows are not contiguous, the paged cache of a session must
hold, in every layer, the K/V a fresh prefill of the committed text writes (a second session opened on
that text is the fresh prefill: it prefills all but its last token and parks), and the next round must
see the same logits. Contexts run past the sliding window (32) and across blocks (32).
"""

from __future__ import annotations

import gc
import logging
import random

import pytest
import torch

from test_engine_sessions import BLOCK, GEN, VOCAB, _build_tiny, _prompts, _reference, _tree
from tolerances import tol

log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM

    path = _build_tiny(tmp_path_factory.mktemp("tiny_kv"))
    engine = LLM(model=path, dtype="float32", max_model_len=512, max_num_seqs=16, enforce_eager=True,
                 distributed_executor_backend="uni", skip_tokenizer_init=True, block_size=BLOCK, seed=0,
                 enable_prefix_caching=False, speculative_config={"method": "hyco"})
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def hy(llm):
    from vllm_hyco.engine.api import HycoEngine

    runner = _runner(llm)
    runner._hyco_state()["debug_logits"] = True
    return HycoEngine(llm)


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


def _runner(llm):
    return _core(llm).model_executor.driver_worker.worker.model_runner


def _session_kv(llm, req_id: str, num_positions: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every cache-owning layer's K/V at positions [0, num_positions) of a request, via the KV view."""
    from vllm_hyco.engine.kv_view import cpu_kv_view, slots_for_positions

    core, runner = _core(llm), _runner(llm)
    block_ids = core.scheduler.kv_cache_manager.get_block_ids(req_id)
    ctx = runner.compilation_config.static_forward_context
    out = {}
    for g, group in enumerate(core.scheduler.kv_cache_config.kv_cache_groups):
        table = torch.tensor(block_ids[g], dtype=torch.int64)
        bs = group.kv_cache_spec.block_size
        window = getattr(group.kv_cache_spec, "sliding_window", None)
        lo = 0 if not window else max(0, num_positions - window)  # sliding groups free older blocks
        positions = torch.arange(lo, num_positions)
        for name in group.layer_names:
            layer = ctx[name]
            slots = slots_for_positions(table, positions, bs)
            out[name] = cpu_kv_view(layer.isa, layer.kv_cache).gather(layer.kv_cache, slots)
    return out


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def test_kv_after_rounds_equals_fresh_prefill(llm, hy):
    rng = random.Random(7)
    prompts = [[2] + [rng.randrange(5, VOCAB) for _ in range(n)] for n in (4, 30, 45)]
    refs = _reference(llm, prompts, max_tokens=100)
    handles = [hy.open(prompt_token_ids=p, temperature=0.0, max_tokens=100, ignore_eos=True) for p in prompts]
    outs = {h.sid: [] for h in handles}
    roots = {h.sid: h.root for h in handles}
    for rnd in range(5):  # interleaved sessions, non-contiguous accepted rows
        batch = []
        for h, ref in zip(handles, refs):
            toks, pars, _ = _tree(roots[h.sid], ref[len(outs[h.sid]):], rng.choice(["deep", "slm", "sibling"]), rng)
            batch.append((h.sid, rnd, toks, pars))
        for v in hy.submit_many(batch):
            outs[v.sid] += v.committed
            roots[v.sid] = v.bonus
    for h, p, ref in zip(handles, prompts, refs):
        text = p + outs[h.sid]
        assert outs[h.sid] == ref[:len(outs[h.sid])]
        fresh = hy.open(prompt_token_ids=text, temperature=0.0, max_tokens=100, ignore_eos=True)
        n = len(text) - 1
        got, want = _session_kv(llm, h.engine_req_id, n), _session_kv(llm, fresh.engine_req_id, n)
        for name in want:
            for a, b in zip(got[name], want[name]):
                torch.testing.assert_close(a, b, **tol("kv_engine_vs_prefill", torch.float32),
                                           msg=lambda m: f"{name} session {h.sid} len {n}: {m}")
        # the next round sees the same logits as a fresh prefill of the committed text
        toks, pars, _ = _tree(roots[h.sid], ref[len(outs[h.sid]):], "deep", rng)
        va, vb = hy.submit_many([(h.sid, 5, toks, pars), (fresh.sid, 0, toks, pars)])
        if va.committed != vb.committed:
            log.warning("greedy divergence; top-2 margin %.3g", _margin(vb.stats["logits"]))
        torch.testing.assert_close(va.stats["logits"], vb.stats["logits"],
                                   **tol("logits_engine_vs_prefill", torch.float32))
        assert va.committed == vb.committed
        hy.close(h.sid)
        hy.close(fresh.sid)
