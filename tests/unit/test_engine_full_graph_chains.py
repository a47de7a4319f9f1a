"""``full_graph_chains`` (vllm_adapter/worker/graphs.py; GPU-unverified): the dispatcher's keys and choices, run on
vLLM's own CudagraphDispatcher code on the CPU build. Full graphs for steps of chains, ordinary requests or
both; piecewise for any step with a branching tree; the option refused where it cannot work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport  # noqa: E402

from vllm_hyco.config import HycoConfig  # noqa: E402
from vllm_hyco.errors import ConfigError  # noqa: E402
from vllm_hyco.vllm_adapter.api_server.expansion import check_full_graph_chains  # noqa: E402
from vllm_hyco.vllm_adapter.worker import gpu_attention, tree_plan  # noqa: E402
from vllm_hyco.vllm_adapter.worker.graphs import HycoCudagraphDispatcher  # noqa: E402
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows  # noqa: E402

SIZES = [1, 2, 4, 8, 16, 33, 66]  # past the decode length, multiples of it (as vLLM adjusts them for speculation)


def _dispatcher(mode: CUDAGraphMode, spec_tokens: int = 32) -> HycoCudagraphDispatcher:
    comp = SimpleNamespace(cudagraph_mode=mode, is_attention_compiled_piecewise=lambda: True, mode=None,
                           splitting_ops=[], max_cudagraph_capture_size=max(SIZES), cudagraph_capture_sizes=SIZES,
                           compile_sizes=None, cudagraph_specialize_lora=False)
    cfg = SimpleNamespace(compilation_config=comp, num_speculative_tokens=spec_tokens, lora_config=None,
                          scheduler_config=SimpleNamespace(max_num_seqs=16))
    d = HycoCudagraphDispatcher(cfg)
    d.initialize_cudagraph_keys(mode, uniform_decode_query_len=1 + spec_tokens)
    return d


def _tree(parents: list[int], q_start: int = 0) -> TreeRows:
    return TreeRows.build(req_id=f"r{q_start}", batch_idx=q_start, q_start=q_start, num_rows=len(parents),
                          context_len=9, round=1, tokens=list(range(5, 5 + len(parents))), parents=parents, eps=None)


@pytest.fixture(autouse=True)
def _no_trees():
    tree_plan.set_active_trees(None)
    yield
    tree_plan.set_active_trees(None)


def test_chain_steps_replay_full_graphs_and_branching_trees_piecewise():
    d = _dispatcher(CUDAGraphMode.FULL_AND_PIECEWISE)
    # no trees (ordinary requests): a mixed batch of 13 rows gets the full graph of 16
    mode, desc = d.dispatch(13)
    assert (mode, desc.num_tokens) == (CUDAGraphMode.FULL, 16)
    # two chains (4 and 3 nodes): full, and the step is marked so the hooks' write check is skipped
    tree_plan.set_active_trees([_tree([-1, 0, 1, 2, 3]), _tree([-1, 0, 1, 2], q_start=5)])
    mode, _ = d.dispatch(9)
    assert mode == CUDAGraphMode.FULL and tree_plan.full_graph_step()
    # a chain beside a branching tree: piecewise (the tree's rows need the eager hook), not marked
    tree_plan.set_active_trees([_tree([-1, 0, 1, 2, 3]), _tree([-1, 0, 0, 1], q_start=5)])
    mode, desc = d.dispatch(9)
    assert mode == CUDAGraphMode.PIECEWISE and desc.num_tokens == 16 and not tree_plan.full_graph_step()


def test_without_full_graph_support_nothing_is_added():
    # vLLM resolves FULL_AND_PIECEWISE to PIECEWISE when the builder declares NEVER (the default)
    d = _dispatcher(CUDAGraphMode.PIECEWISE)
    assert not d.cudagraph_keys[CUDAGraphMode.FULL]
    tree_plan.set_active_trees([_tree([-1, 0, 1])])
    assert d.dispatch(3)[0] == CUDAGraphMode.PIECEWISE and not tree_plan.full_graph_step()


def test_a_branching_step_can_never_be_marked_full():
    tree_plan.set_active_trees([_tree([-1, 0, 0])])
    with pytest.raises(RuntimeError, match="branching tree"):
        tree_plan.note_full_graph()


def test_the_builder_declares_full_graph_support_only_with_the_option():
    try:
        gpu_attention.install(full_graph_chains=True)
        assert gpu_attention.HycoTritonAttentionMetadataBuilder._cudagraph_support == AttentionCGSupport.ALWAYS
    finally:
        gpu_attention.install()
    assert gpu_attention.HycoTritonAttentionMetadataBuilder._cudagraph_support == AttentionCGSupport.NEVER


@pytest.mark.parametrize("is_cpu, args, needle", [
    (True, {}, "CPU build"),
    (False, {"enforce_eager": True}, "--enforce-eager"),
    (False, {"compilation_config": {"cudagraph_mode": "PIECEWISE"}}, "FULL_AND_PIECEWISE"),
])
def test_the_option_is_refused_where_it_cannot_work(is_cpu, args, needle):
    with pytest.raises(ConfigError, match=needle):
        check_full_graph_chains(HycoConfig(full_graph_chains=True), SimpleNamespace(**args), is_cpu=is_cpu)
    check_full_graph_chains(HycoConfig(), SimpleNamespace(**args), is_cpu=is_cpu)  # off: nothing to check
    check_full_graph_chains(HycoConfig(full_graph_chains=True), SimpleNamespace(), is_cpu=False)
    with pytest.raises(ConfigError, match="full_graph_chains"):
        HycoConfig(full_graph_chains="yes")  # type: ignore[arg-type]
