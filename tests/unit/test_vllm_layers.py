"""Layer discovery from what vLLM built (``vllm_adapter/worker/layers.py``) and the start-up refusals of the
configurations where the KV-capture hook cannot run (``vllm_adapter/expansion.check_capture``).

The forward contexts below mirror what vLLM 0.32 builds for the checkpoint-shaped fixture
(``tests/checkpoint_shaped.py``; the integration test checks the real engine's): attention layers named
``language_model.model.layers.{i}.self_attn.attn`` next to MoE runners, the last layers KV-shared.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from checkpoint_shaped import SHARED_TARGETS, attn, handoff_layers, owners

from vllm_hyco.errors import ConfigError, KVCaptureError
from vllm_hyco.models.gemma4 import GEMMA4
from vllm_hyco.vllm_adapter.api_server.expansion import expand_engine_args
from vllm_hyco.vllm_adapter.worker.layers import check_captured, discover


def _context(kv_shared: bool) -> dict[str, object]:
    ctx: dict[str, object] = {}
    for i in range(12):
        target = attn(SHARED_TARGETS[i]) if kv_shared and i in SHARED_TARGETS else None
        ctx[attn(i)] = SimpleNamespace(impl=object(), kv_cache=None, kv_sharing_target_layer_name=target,
                                       sliding_window=None if i in (5, 11) else 1024)
        ctx[f"language_model.model.layers.{i}.experts"] = SimpleNamespace(kv_cache=None)  # a MoE runner
    return ctx


def _handoff_ids(kv_shared: bool) -> dict[str, int]:
    """The Gemma 4 seam's hand-off layers of the checkpoint-shaped layout (12 layers, full at 5 and 11)."""
    cfg = {"model_type": "gemma4_text", "hidden_size": 64, "num_key_value_heads": 2, "head_dim": 32,
           "sliding_window": 1024, "num_kv_shared_layers": len(SHARED_TARGETS) if kv_shared else 0,
           "layer_types": ["full_attention" if i in (5, 11) else "sliding_attention" for i in range(12)]}
    return {layer.kind: layer.layer_id for layer in GEMMA4.handoff_layers(cfg)}


@pytest.mark.parametrize("kv_shared", [False, True])
def test_discover_owners_shared_and_handoff_layers(kv_shared):
    groups = [SimpleNamespace(layer_names=owners(kv_shared)[:3]), SimpleNamespace(layer_names=owners(kv_shared)[3:])]
    kv = discover(_context(kv_shared), groups, handoff=_handoff_ids(kv_shared))
    # the runner's copy of the groups also lists the KV-shared layers (in their target's group)
    assert discover(_context(kv_shared), [*groups, SimpleNamespace(layer_names=list(kv.shared))],
                    handoff=_handoff_ids(kv_shared)) == kv
    assert list(kv.owners) == owners(kv_shared)
    assert kv.handoff == handoff_layers(kv_shared)
    assert kv.shared == ({attn(i): attn(t) for i, t in SHARED_TARGETS.items()} if kv_shared else {})
    assert kv.kinds[attn(5)] == "full" and kv.kinds[attn(4)] == "sliding"


def test_discover_orders_by_layer_index_and_reads_triton_windows():
    ctx = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(
        impl=SimpleNamespace(sliding_window=(-1, -1) if i == 10 else (127, 0)), kv_cache=None)
        for i in (10, 2, 9)}
    kv = discover(ctx, handoff={"full": 10, "sliding": 9})
    assert kv.owners == tuple(f"model.layers.{i}.self_attn.attn" for i in (2, 9, 10))
    assert kv.handoff == {"full": "model.layers.10.self_attn.attn", "sliding": "model.layers.9.self_attn.attn"}
    # the kinds read from the windows must be the seam's: a layer of the other kind is refused by name
    with pytest.raises(ConfigError, match="hand-off layer 9 runs sliding attention"):
        discover(ctx, handoff={"full": 9})
    with pytest.raises(ConfigError, match="hand-off layer 4 is not among"):
        discover(ctx, handoff={"sliding": 4})


def test_discover_refuses_what_it_cannot_trust():
    with pytest.raises(ConfigError, match="no attention layer"):
        discover({"x.experts": SimpleNamespace()})
    ctx = _context(False)
    with pytest.raises(ConfigError, match="allocated KV caches"):
        discover(ctx, [SimpleNamespace(layer_names=owners(False)[:-1])])
    ctx[attn(3)].kv_sharing_target_layer_name = "language_model.model.layers.99.self_attn.attn"
    with pytest.raises(ConfigError, match="shares the KV"):
        discover(ctx)


def test_every_cache_owner_must_capture():
    kv = discover(_context(True))
    check_captured(owners(True), kv, "req-1")
    with pytest.raises(KVCaptureError, match=r"1 of 8 .*layers\.7\.self_attn\.attn") as info:
        check_captured([n for n in owners(True) if n != attn(7)], kv, "req-1")
    assert info.value.code == "kv_capture"
    # the causal model's guessed names match nothing of Gemma4ForConditionalGeneration
    with pytest.raises(KVCaptureError, match="8 of 8"):
        check_captured([f"model.layers.{i}.self_attn.attn" for i in range(12)], kv, "req-1")


def _args(**overrides):
    base = dict(speculative_config="hyco", tensor_parallel_size=1, pipeline_parallel_size=1,
                data_parallel_size=1, _api_process_count=1, async_scheduling=None, scheduler_cls=None,
                worker_cls="auto", additional_config={})
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("is_cpu, overrides, needle", [
    (False, {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 "),
    (False, {"kv_cache_dtype": "fp8_e5m2"}, "--kv-cache-dtype fp8_e5m2"),
    (True, {"kv_cache_dtype": "bfloat16"}, "--kv-cache-dtype bfloat16 is not supported on CPU"),
    (False, {"compilation_config": {"use_inductor_graph_partition": True}}, "use_inductor_graph_partition"),
    (False, {"compilation_config": SimpleNamespace(use_inductor_graph_partition=False, splitting_ops=[])},
     "vllm::unified_kv_cache_update, vllm::unified_attention_with_output among the compilation splitting_ops"),
    (False, {"compilation_config": '{"splitting_ops": ["vllm::unified_attention_with_output"]}'},
     "needs vllm::unified_kv_cache_update among"),
])
def test_capture_blocking_configs_refused_at_startup(is_cpu, overrides, needle):
    with pytest.raises(ConfigError) as info:
        expand_engine_args(_args(**overrides), is_cpu=is_cpu)
    assert needle in str(info.value)


@pytest.mark.parametrize("overrides", [
    {"kv_cache_dtype": "auto"},
    {"kv_cache_dtype": "bfloat16"},
    {"compilation_config": {"splitting_ops": ["vllm::unified_attention_with_output",
                                              "vllm::unified_kv_cache_update"]}},
    {"compilation_config": {"use_inductor_graph_partition": True}, "enforce_eager": True},
    {"compilation_config": {"mode": 3}},
])
def test_capturable_configs_accepted(overrides):
    args = _args(**overrides)
    expand_engine_args(args, is_cpu=False)
    assert args.worker_cls.endswith("HycoWorker")
