"""The GPU tree-attention backend (vllm_adapter/worker/gpu_attention.py), our side of it, on the CPU build.

vLLM 0.32's Triton backend classes import on the CPU build, so the subclass is built here on CPU tensors.
The stock Triton forward and KV writer cannot run without a GPU; they are replaced by stubs (the forward
fills every row with a sentinel, the writer stores rows where vLLM's ``triton_reshape_and_cache_flash``
does). What is checked is our hook: exactly the tree rows are recomputed, by
``kernels.paged_tree_rows_attention``, with the step's plan and this layer's block-table rows, window,
softcap and scale; the other rows keep the stock output; the layer's write is recorded (no copy of the
rows). Also: registration over the static CUSTOM member, the start-up backend check, and the
GPU config expansion (attention backend CUSTOM, other backends refused).
"""

from __future__ import annotations

import math
import pickle
import random
from types import SimpleNamespace

import pytest
import torch
from tolerances import tol

pytest.importorskip("vllm.v1.attention.backends.triton_attn")

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

from vllm_hyco.errors import ConfigError, HardwareUnsupportedError
from vllm_hyco.kernels import tree_attention_dense_ref
from vllm_hyco.vllm_adapter.api_server.expansion import expand_engine_args
from vllm_hyco.vllm_adapter.worker import gpu_attention, tree_plan
from vllm_hyco.vllm_adapter.worker.kv_view import BlockMajorKVView, slots_for_positions
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows

SENTINEL = -7.0


def _tree(n, seed):
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, j - 5), j) for j in range(1, n)]


@pytest.fixture
def stub_stock(monkeypatch):
    """Stock forward -> sentinel rows; stock writer -> block-major scatter at slot_mapping."""
    calls = {"forward": 0, "write": 0}

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *a):
        calls["forward"] += 1
        return output.fill_(SENTINEL)

    def write(self, layer, key, value, kv_cache, slot_mapping):
        calls["write"] += 1
        BlockMajorKVView().scatter(kv_cache, slot_mapping, key, value)

    monkeypatch.setattr(TritonAttentionImpl, "forward", forward)
    monkeypatch.setattr(TritonAttentionImpl, "do_kv_cache_update", write)
    yield calls
    tree_plan.set_active_trees(None)


def _impl(hq, hkv, dim, window, softcap):
    return gpu_attention.HycoTritonAttentionImpl(hq, dim, 1 / math.sqrt(dim), hkv, None, window, "auto",
                                                 logits_soft_cap=softcap)


@pytest.mark.parametrize("window, softcap", [(None, None), (16, 25.0)])
def test_forward_hook_recomputes_exactly_the_tree_rows(stub_stock, monkeypatch, window, softcap):
    """Batch: decode row, tree A (33 rows), 4-row prefill chunk, tree B (9 rows); non-contiguous blocks."""
    hq, hkv, dim, bs = 4, 2, 64, 16
    impl = _impl(hq, hkv, dim, window, softcap)
    layer = SimpleNamespace(layer_name="model.layers.3.self_attn.attn", _k_scale_float=1.0, _v_scale_float=1.0)
    g = torch.Generator().manual_seed(0)
    counts, ctx = [1, 33, 4, 9], [40, 57, 10, 16]
    pa, pb = _tree(33, 1), _tree(9, 2)
    num_rows = sum(counts)
    table = torch.tensor([[3, 7, 8, 0, 0, 0], [9, 1, 12, 6, 10, 5], [2, 0, 0, 0, 0, 0], [14, 4, 0, 0, 0, 0]],
                         dtype=torch.int32)
    kv = torch.randn(16, hkv, bs, 2 * dim, generator=g)
    trees = [TreeRows.build(req_id="a", batch_idx=1, q_start=1, num_rows=33, context_len=57, round=2,
                            tokens=list(range(33)), parents=pa, eps=None),
             TreeRows.build(req_id="b", batch_idx=3, q_start=38, num_rows=9, context_len=16, round=0,
                            tokens=list(range(9)), parents=pb, eps=None)]
    tree_plan.set_active_trees(trees, "cpu")
    query = torch.randn(num_rows, hq, dim, generator=g)
    key = torch.randn(num_rows, hkv, dim, generator=g)
    value = torch.randn(num_rows, hkv, dim, generator=g)
    slot_mapping = torch.cat([slots_for_positions(table[b], torch.arange(ctx[b], ctx[b] + counts[b]), bs)
                              for b in range(4)])
    seen = []
    real = gpu_attention.paged_tree_rows_attention

    def spy(q, k_cache, v_cache, block_tables, context_lens, row_counts, masks, depths, scale, win, cap, **kw):
        seen.append({"q": q.clone(), "block_tables": block_tables.clone(), "context_lens": list(context_lens),
                     "row_counts": list(row_counts), "win": win, "cap": cap, "scale": scale,
                     "qsl": kw["query_start_loc"].tolist(), "seq": kw["seq_lens"].tolist()})
        return real(q, k_cache, v_cache, block_tables, context_lens, row_counts, masks, depths, scale, win, cap,
                    backend="torch", **kw)

    monkeypatch.setattr(gpu_attention, "paged_tree_rows_attention", spy)
    impl.do_kv_cache_update(layer, key, value, kv, slot_mapping)
    output = torch.empty(num_rows, hq, dim)
    meta = SimpleNamespace(block_table=table)
    out = impl.forward(layer, query, key, value, kv, meta, output)
    assert stub_stock == {"forward": 1, "write": 1} and len(seen) == 1
    call = seen[0]
    tree_rows = list(range(1, 34)) + list(range(38, 47))
    assert torch.equal(call["q"], query[tree_rows])
    assert torch.equal(call["block_tables"], table[[1, 3]])
    assert (call["context_lens"], call["row_counts"]) == ([57, 16], [33, 9])
    assert (call["qsl"], call["seq"]) == ([0, 33, 42], [90, 25])  # the step's prebuilt kernel metadata
    assert (call["win"], call["cap"], call["scale"]) == (window, softcap, impl.scale)
    other = [0, 34, 35, 36, 37]
    assert bool((out[other] == SENTINEL).all()) and not bool((out[tree_rows] == SENTINEL).any())
    # each tree's rows equal the CPU override's computation (prefix gathered + fresh K/V, dense twin)
    view = BlockMajorKVView()
    for tr in trees:
        t, b, rows = tr.context_len, tr.batch_idx, slice(tr.q_start, tr.q_start + tr.num_rows)
        lo = 0 if not window else max(0, t - window + 1)
        k_pre, v_pre = view.gather(kv, slots_for_positions(table[b], torch.arange(lo, t), bs))
        want = tree_attention_dense_ref(query[rows], torch.cat([k_pre, key[rows]]), torch.cat([v_pre, value[rows]]),
                                        t - lo, tr.masks, tr.depths, impl.scale, window, softcap)
        torch.testing.assert_close(out[rows], want, **tol("attention", torch.float32))
    # the write is recorded per layer and step, nothing is copied (compaction reads the paged cache)
    assert tree_plan.layers_written() == {layer.layer_name}


def test_no_tree_means_stock_only(stub_stock, monkeypatch):
    impl = _impl(2, 1, 32, None, None)
    monkeypatch.setattr(gpu_attention, "paged_tree_rows_attention", lambda *a, **k: pytest.fail("called"))
    layer = SimpleNamespace(layer_name="l0")
    out = impl.forward(layer, torch.randn(5, 2, 32), torch.randn(5, 1, 32), torch.randn(5, 1, 32),
                       torch.zeros(2, 1, 16, 64), SimpleNamespace(block_table=torch.zeros(1, 1)),
                       torch.empty(5, 2, 32))
    assert bool((out == SENTINEL).all())


def test_tree_on_unsupported_layer_is_refused(stub_stock):
    tr = TreeRows.build(req_id="a", batch_idx=0, q_start=0, num_rows=2, context_len=3, round=0, tokens=[1, 2],
                        parents=[-1, 0], eps=None)
    tree_plan.set_active_trees([tr], "cpu")
    impl = gpu_attention.HycoTritonAttentionImpl(2, 32, 0.1, 1, None, None, "auto", sinks=torch.zeros(2))
    with pytest.raises(HardwareUnsupportedError, match="sinks"):
        impl.forward(SimpleNamespace(layer_name="l"), torch.randn(2, 2, 32), None, None, torch.zeros(1, 1, 16, 64),
                     SimpleNamespace(block_table=torch.zeros(1, 1, dtype=torch.int32)), torch.empty(2, 2, 32))


def test_registered_over_static_custom_member():
    gpu_attention.install()
    gpu_attention.install()  # idempotent
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is gpu_attention.HycoTritonAttentionBackend
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM  # what vLLM stores per layer
    assert pickle.loads(pickle.dumps(AttentionBackendEnum.CUSTOM)) is AttentionBackendEnum.CUSTOM
    assert cls.get_impl_cls() is gpu_attention.HycoTritonAttentionImpl
    assert cls.get_builder_cls()._cudagraph_support == AttentionCGSupport.NEVER
    assert cls.supports_head_size(256) and cls.supports_head_size(512)


def test_backend_check_names_the_wrong_layers():
    ours = SimpleNamespace(impl=_impl(2, 1, 32, None, None), kv_cache=[])
    theirs = SimpleNamespace(impl=object(), kv_cache=[], attn_backend=SimpleNamespace(__name__="FlashAttentionBackend"))
    gpu_attention.check_tree_backends({"a": ours, "b": ours, "moe": SimpleNamespace()})
    with pytest.raises(HardwareUnsupportedError, match="b: FlashAttentionBackend"):
        gpu_attention.check_tree_backends({"a": ours, "b": theirs})
    with pytest.raises(HardwareUnsupportedError, match="no attention layer"):
        gpu_attention.check_tree_backends({})


def _args(**overrides):
    base = {"speculative_config": "hyco", "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "data_parallel_size": 1, "_api_process_count": 1, "async_scheduling": None, "scheduler_cls": None,
            "worker_cls": "auto", "additional_config": {}, "attention_backend": None, "attention_config": None}
    return SimpleNamespace(**{**base, **overrides})


def test_expansion_selects_tree_attention_on_gpu_only():
    gpu, cpu = _args(), _args()
    expand_engine_args(gpu, is_cpu=False)
    expand_engine_args(cpu, is_cpu=True)
    assert gpu.attention_backend == "CUSTOM" and cpu.attention_backend is None
    for kept in (_args(attention_backend="custom"), _args(attention_config={"backend": "CUSTOM"})):
        expand_engine_args(kept, is_cpu=False)  # already ours: accepted, nothing added
    assert _args(attention_backend="auto").attention_backend == "auto"
    auto = _args(attention_backend="auto")
    expand_engine_args(auto, is_cpu=False)
    assert auto.attention_backend == "CUSTOM"
    for bad in (_args(attention_backend="FLASH_ATTN"), _args(attention_config={"backend": "TRITON_ATTN"}),
                _args(attention_backend=AttentionBackendEnum.FLEX_ATTENTION)):
        with pytest.raises(ConfigError, match="own attention backend"):
            expand_engine_args(bad, is_cpu=False)


def test_gpu_worker_refuses_the_v2_runner():
    from vllm_hyco.vllm_adapter.worker.gpu_worker import HycoWorker

    with pytest.raises(HardwareUnsupportedError, match="V1 GPU model runner"):
        HycoWorker._make_model_runner(SimpleNamespace(use_v2_model_runner=True))
