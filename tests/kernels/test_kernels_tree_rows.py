"""The GPU engine's tree rows (``kernels.tree_rows``) and block-major KV view, tested on CPU tensors.

Three computations of the same tree rows over one paged block-major cache (vLLM's Triton layout, random
K/V, non-contiguous blocks, a context across block boundaries and past the sliding window):

* ``paged_tree_rows_attention(..., backend="triton")``: the kernel the GPU backend launches (compiled on a
  GPU, ``TRITON_INTERPRET=1`` on CPU; skipped without either);
* the same function with ``backend="torch"`` (its twin);
* what the CPU engine's CPU_ATTN override computes: the committed prefix gathered through the KV view
  (only the window's tail), the step's fresh K/V rows appended, ``tree_attention_dense_ref``.

The step's K/V rows are written at their sequential slots through ``BlockMajorKVView.scatter`` (where
vLLM's writer puts them before attention), so the paged paths read them from the cache and the CPU
override's path takes them fresh. Also: the view's gather/scatter round trip, and compaction on the
block-major layout (``vllm_adapter.worker.tree_step.compact``, the engine's, and ``kernels.compact_kv``) against a
dense per-position reference. No vLLM import: the device machine (torch + Triton only) runs this file.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from kernel_support import DEVICE, TRITON_OK, needs_triton, random_tree
from tolerances import tol

from vllm_hyco.errors import HardwareUnsupportedError
from vllm_hyco.handoff import tree_contract
from vllm_hyco.kernels import (
    KernelInputError,
    compact_kv,
    compaction_moves,
    tree_attention_dense_ref,
)
from vllm_hyco.kernels.tree_attention import first_visible_key
from vllm_hyco.kernels.tree_rows import block_major_views, paged_tree_rows_attention, tree_rows_attention
from vllm_hyco.vllm_adapter.worker import handoff_step, tree_step
from vllm_hyco.vllm_adapter.worker.kv_view import BlockMajorKVView, slots_for_positions
from vllm_hyco.vllm_adapter.worker.layers import KVLayers
from vllm_hyco.vllm_adapter.worker.state import RunnerState
from vllm_hyco.vllm_adapter.worker.tree_plan import TreeRows, TreeStep


class PagedRequests:
    """Requests in one layer's paged cache (vLLM's logical [blocks, kv_heads, bs, 2 * D]), written through
    the block-major view; blocks drawn at random from a pool with spare blocks, never contiguous."""

    def __init__(self, context_lens, trees, hq, hkv, dim, block_size, dtype, seed=0, spare=5):
        self.gen = torch.Generator().manual_seed(seed)
        self.trees, self.context_lens = trees, list(context_lens)
        self.hq, self.hkv, self.dim, self.bs, self.dtype = hq, hkv, dim, block_size, dtype
        need = [-(-(t + len(p)) // block_size) for t, p in zip(context_lens, trees)]
        pool = list(range(sum(need) + spare))
        random.Random(seed).shuffle(pool)
        width = max(need)
        self.block_tables = torch.zeros(len(trees), width, dtype=torch.int32)
        for r, nb in enumerate(need):
            self.block_tables[r, :nb] = torch.tensor(pool[:nb], dtype=torch.int32)
            pool = pool[nb:]
        self.kv = torch.randn(len(need) and sum(need) + spare, hkv, block_size, 2 * dim,
                              generator=self.gen).to(dtype).to(DEVICE)
        self.view = BlockMajorKVView()
        self.fresh_k, self.fresh_v, self.q, self.masks, self.depths = [], [], [], [], []
        for r, (t, parents) in enumerate(zip(context_lens, trees)):
            n = len(parents)
            k = self._randn(n, hkv, dim)
            v = self._randn(n, hkv, dim)
            self.view.scatter(self.kv, self.slots(r, torch.arange(t, t + n)), k, v)  # vLLM's sequential slots
            self.fresh_k.append(k)
            self.fresh_v.append(v)
            self.q.append(self._randn(n, hq, dim))
            self.masks.append(torch.from_numpy(tree_contract.ancestor_mask(parents)))
            self.depths.append(torch.from_numpy(tree_contract.depths(parents)))

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype).to(DEVICE)

    def slots(self, r: int, positions: torch.Tensor) -> torch.Tensor:
        return slots_for_positions(self.block_tables[r].to(DEVICE), positions, self.bs)

    def caches(self):
        return block_major_views(self.kv, self.dim)

    def batched(self, backend, window, softcap):
        k_cache, v_cache = self.caches()
        return paged_tree_rows_attention(
            torch.cat(self.q), k_cache, v_cache, self.block_tables.to(DEVICE), self.context_lens,
            [len(p) for p in self.trees], torch.cat(self.masks).to(DEVICE), torch.cat(self.depths).to(DEVICE),
            1 / math.sqrt(self.dim), window, softcap, backend=backend)

    def cpu_override(self, r, window, softcap):
        """The CPU_ATTN override's computation (vllm_adapter/worker/cpu_attention.py), on this layout."""
        t = self.context_lens[r]
        lo = 0 if not window else max(0, t - window + 1)
        k_pre, v_pre = self.view.gather(self.kv, self.slots(r, torch.arange(lo, t)))
        return tree_attention_dense_ref(
            self.q[r], torch.cat([k_pre, self.fresh_k[r]]), torch.cat([v_pre, self.fresh_v[r]]), t - lo,
            self.masks[r].to(DEVICE), self.depths[r].to(DEVICE), 1 / math.sqrt(self.dim), sliding_window=window,
            softcap=softcap)


def _close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **tol("attention", dtype),
                               msg=lambda m: f"{m}\n{what}")


# context_lens, trees, hq, hkv, dim, block_size, window, softcap
CASES = {
    # Gemma-4 sliding-layer shape (D 256, GQA 2), context past the window and across 16-token blocks
    "sliding_d256_ctx150_win32_softcap": ([150], [random_tree(33, 1)], 4, 2, 256, 16, 32, 30.0),
    # a window shorter than the tree's depth: ancestors themselves fall out of the window
    "sliding_d256_win4_deep": ([70], [[-1] + list(range(12)) + random_tree(20, 5)[1:]], 2, 1, 256, 16, 4,
                               None),
    # Gemma-4 full-layer shape (D 512, GQA 4), context across 32-token blocks
    "full_d512_ctx95_gqa4": ([95], [random_tree(33, 2, reach=3)], 4, 1, 512, 32, None, None),
    # three trees in one launch: empty context, a block edge, a long one; GQA 3, softcap
    "three_trees_gqa3": ([0, 32, 211], [random_tree(9, 3), random_tree(33, 4), random_tree(17, 6)], 6, 2, 64,
                         16, 48, 20.0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_path_equals_cpu_override(name, dtype):
    ctx, trees, hq, hkv, dim, bs, window, cap = CASES[name]
    reqs = PagedRequests(ctx, trees, hq, hkv, dim, bs, dtype, seed=11)
    got = reqs.batched("torch", window, cap)
    want = torch.cat([reqs.cpu_override(r, window, cap) for r in range(len(trees))])
    _close(got, want, dtype, (name, dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_triton_path_equals_torch_path_and_cpu_override(name, dtype):
    ctx, trees, hq, hkv, dim, bs, window, cap = CASES[name]
    reqs = PagedRequests(ctx, trees, hq, hkv, dim, bs, dtype, seed=11)
    got = reqs.batched("triton", window, cap)
    _close(got, reqs.batched("torch", window, cap), dtype, (name, dtype, "vs torch path"))
    want = torch.cat([reqs.cpu_override(r, window, cap) for r in range(len(trees))])
    _close(got, want, dtype, (name, dtype, "vs CPU override"))


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if TRITON_OK else []))
def test_one_tree_call_equals_its_rows_of_the_batch(backend):
    ctx, trees, hq, hkv, dim, bs, window, cap = CASES["three_trees_gqa3"]
    reqs = PagedRequests(ctx, trees, hq, hkv, dim, bs, torch.float32, seed=3)
    batch = reqs.batched(backend, window, cap)
    k_cache, v_cache = reqs.caches()
    start = 0
    for r, parents in enumerate(trees):
        one = tree_rows_attention(reqs.q[r], k_cache, v_cache, reqs.block_tables[r].to(DEVICE), ctx[r],
                                  reqs.masks[r].to(DEVICE), reqs.depths[r].to(DEVICE), 1 / math.sqrt(dim), window,
                                  cap, backend=backend)
        _close(one, batch[start:start + len(parents)], torch.float32, ("tree", r))
        start += len(parents)


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if TRITON_OK else []))
def test_engine_step_metadata_gives_the_same_rows(backend):
    """The GPU backend's call: rows, masks, depths and prebuilt query_start_loc/seq_lens from a TreeStep."""
    ctx, trees, hq, hkv, dim, bs, window, cap = CASES["three_trees_gqa3"]
    reqs = PagedRequests(ctx, trees, hq, hkv, dim, bs, torch.float32, seed=5)
    plans, start = [], 0
    for r, parents in enumerate(trees):
        plans.append(TreeRows.build(req_id=str(r), batch_idx=r, q_start=start, num_rows=len(parents),
                                    context_len=ctx[r], round=1, tokens=list(range(len(parents))), parents=parents,
                                    eps=None))
        start += len(parents)
    step = TreeStep.build(plans, DEVICE)
    k_cache, v_cache = reqs.caches()
    got = paged_tree_rows_attention(
        torch.cat(reqs.q)[step.rows], k_cache, v_cache, reqs.block_tables.to(DEVICE)[step.batch_idx],
        step.context_lens, step.row_counts, step.masks, step.depths, 1 / math.sqrt(dim), window, cap,
        query_start_loc=step.query_start_loc, seq_lens=step.seq_lens, backend=backend)
    _close(got, reqs.batched(backend, window, cap), torch.float32, backend)


def test_tree_rows_refuse_causal_rows_and_bad_counts():
    reqs = PagedRequests([20], [random_tree(5, 0)], 2, 1, 32, 16, torch.float32)
    k_cache, v_cache = reqs.caches()
    masks = reqs.masks[0].clone()
    masks[2] = 0
    with pytest.raises(KernelInputError, match="nonzero ancestor mask"):
        tree_rows_attention(reqs.q[0].cpu(), k_cache.cpu(), v_cache.cpu(), reqs.block_tables[0], 20, masks,
                            reqs.depths[0], 0.1)
    with pytest.raises(KernelInputError, match="one each per tree"):
        paged_tree_rows_attention(reqs.q[0], k_cache, v_cache, reqs.block_tables.to(DEVICE), [20, 3], [5],
                                  reqs.masks[0].to(DEVICE), reqs.depths[0].to(DEVICE), 0.1)
    with pytest.raises(KernelInputError, match="cache"):
        block_major_views(reqs.kv, 48)


# -- the block-major KV view -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_major_view_round_trip_and_triton_layout(dtype):
    """scatter then gather returns the rows; the rows land where the Triton layout reads them
    (``kv.transpose(1, 2).split(D, -1)[blk, off]``); every other slot is untouched."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(7, 3, 16, 2 * 64, generator=g).to(dtype).to(DEVICE)
    before = kv.clone()
    view = BlockMajorKVView("auto")
    slots = torch.tensor([0, 15, 16, 47, 50, 111], device=DEVICE)
    k = torch.randn(6, 3, 64, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(6, 3, 64, generator=g).to(dtype).to(DEVICE)
    view.scatter(kv, slots, k, v)
    k2, v2 = view.gather(kv, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    kc, vc = block_major_views(kv, 64)
    blk, off = slots // 16, slots % 16
    assert torch.equal(kc[blk, off], k) and torch.equal(vc[blk, off], v)
    touched = torch.zeros(7, 16, dtype=torch.bool, device=DEVICE)
    touched[blk, off] = True
    assert torch.equal(kv.transpose(1, 2)[~touched], before.transpose(1, 2)[~touched])


def test_block_major_view_refuses_quantized_caches():
    for dtype in ("fp8", "fp8_e4m3", "int8_per_token_head"):
        with pytest.raises(HardwareUnsupportedError, match="quantized"):
            BlockMajorKVView(dtype)
    BlockMajorKVView("bfloat16")


def _runner(groups: dict, t: int, n: int, window: int | None = None, scales: dict | None = None):
    """What ``vllm_adapter.worker.tree_step`` / ``handoff_step`` read from vLLM's runner (and its HyCo state,
    ``worker/state.py``), for one tree at batch row 0 (q_start 0):
    one KV group per layer, its slot mapping holding the sequential slots of positions t .. t + n - 1."""
    layers = {name: SimpleNamespace(kv_cache=g.kv, kv_cache_dtype="auto") for name, g in groups.items()}
    tables = [SimpleNamespace(slot_mapping=SimpleNamespace(gpu=g.slots(0, torch.arange(t, t + n))),
                              block_table=SimpleNamespace(gpu=g.block_tables.to(DEVICE)), block_size=g.bs)
              for g in groups.values()]
    # layers.discover's cache owners and hand-off layers, as the runner reads them once
    state = RunnerState(config=None, window=window or 0, scales=scales,
                        kv_layers=KVLayers(owners=tuple(groups), handoff={k: k for k in groups}))
    hidden = next(iter(groups.values())).dim
    return SimpleNamespace(
        hyco=state, device=torch.device(DEVICE),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1)),  # one TP rank
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[k]) for k in groups]),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        input_batch=SimpleNamespace(block_table=tables),
        model=SimpleNamespace(embed_input_ids=lambda ids: ids.float().unsqueeze(1).expand(-1, hidden)))


def _compact(runner, tr, path_rows):
    step = tree_step.StepTrees.build([tr], [0], DEVICE)
    verdict = SimpleNamespace(path_rows=torch.tensor([path_rows], dtype=torch.int64).view(1, -1).to(DEVICE),
                              num_accepted=torch.tensor([len(path_rows)], device=DEVICE),
                              bonus=torch.tensor([5], device=DEVICE))
    tree_step.compact(runner, step, verdict)
    return step, verdict


@pytest.mark.parametrize("path_rows", [[1, 2, 3], [2, 5, 11, 30], [], [7], [1, 4, 5, 9, 10, 20, 26, 32]])
def test_compaction_on_block_major_layout_equals_dense_reference(path_rows):
    """Two KV groups (sliding: bs 16, full: bs 32, different tables): ``tree_step.compact`` (the engine's
    compaction: ``kernels.compact_kv`` over vLLM's slot mapping) moves rows t + r_i to t + i; afterwards
    positions 0 .. t + d read the committed sequence (prefix, root, path) exactly, every other slot is
    unchanged, and ``kernels.compact_kv`` gives the same caches from the same moves."""
    parents = random_tree(33, 9)
    t, n = 75, 33
    groups = {"sliding": PagedRequests([t], [parents], 2, 2, 32, 16, torch.float32, seed=1),
              "full": PagedRequests([t], [parents], 2, 1, 64, 32, torch.float32, seed=2)}
    tr = TreeRows.build(req_id="s", batch_idx=0, q_start=0, num_rows=n, context_len=t, round=1,
                        tokens=list(range(n)), parents=parents, eps=None)
    dense, before = {}, {}
    for name, g in groups.items():
        positions = torch.arange(0, t + n)
        k_all, v_all = g.view.gather(g.kv, g.slots(0, positions))  # [t + n, H, D] dense per position
        keep = list(range(t + 1)) + [t + r for r in path_rows]
        dense[name] = (k_all[keep], v_all[keep])
        before[name] = g.kv.clone()
    _compact(_runner(groups, t, n), tr, path_rows)
    for name, g in groups.items():
        d = len(path_rows)
        k_got, v_got = g.view.gather(g.kv, g.slots(0, torch.arange(0, t + 1 + d)))
        torch.testing.assert_close(k_got, dense[name][0], **tol("kv_copy", torch.float32))
        torch.testing.assert_close(v_got, dense[name][1], **tol("kv_copy", torch.float32))
        # only the slots of positions t+1 .. t+d may change
        changed = (g.kv != before[name]).any(dim=-1).any(dim=1)  # [blocks, bs]
        allowed = torch.zeros_like(changed)
        s = g.slots(0, torch.arange(t + 1, t + 1 + d))
        allowed[s // g.bs, s % g.bs] = True
        assert not bool((changed & ~allowed).any())
        # the compaction kernel (twin here, Triton on GPU) on the same layout and moves
        ref = before[name].clone()
        src, dst, loc = compaction_moves(g.block_tables.to(DEVICE), g.bs, [t], [[0] + path_rows])
        compact_kv([ref.transpose(1, 2)], src.view(1, -1), dst.view(1, -1), loc, [0])
        assert torch.equal(ref, g.kv)


def test_handoff_gather_after_compaction_is_the_committed_rows_in_int8():
    """``handoff_step.handoff`` after ``tree_step.compact``: the root + path rows and round 0's seed (the last W
    committed positions) of both hand-off layers, read from the paged cache and quantized on the device,
    equal the int8 of the dense committed rows; h and e(bonus) are quantized with their scales."""
    from vllm_hyco.kernels import quantize_int8_ref

    parents, path_rows = random_tree(33, 4), [3, 9, 17]
    t, n, window = 41, 33, 24
    layers = {"full": PagedRequests([t], [parents], 2, 1, 64, 32, torch.float32, seed=6),
              "sliding": PagedRequests([t], [parents], 2, 2, 32, 16, torch.float32, seed=7)}
    gen = torch.Generator().manual_seed(3)
    scales = {"e": torch.rand(64, generator=gen).to(DEVICE) + 0.01,
              "h": torch.rand(64, generator=gen).to(DEVICE) + 0.01}
    for kind, g in layers.items():
        scales[kind] = (torch.rand(g.hkv, g.dim, generator=gen).to(DEVICE) * 0.05 + 0.005,
                        torch.rand(g.hkv, g.dim, generator=gen).to(DEVICE) * 0.05 + 0.005)
    tr = TreeRows.build(req_id="s", batch_idx=0, q_start=0, num_rows=n, context_len=t, round=0,
                        tokens=list(range(n)), parents=parents, eps=None)
    dense = {}
    for kind, g in layers.items():
        k_all, v_all = g.view.gather(g.kv, g.slots(0, torch.arange(0, t + n)))
        keep = list(range(t + 1)) + [t + r for r in path_rows]
        dense[kind] = (k_all[keep], v_all[keep])
    runner = _runner(layers, t, n, window, scales)
    step, verdict = _compact(runner, tr, path_rows)
    hidden = torch.randn(n, 64, generator=gen).to(DEVICE)
    dec = tree_step.StepDecision(verdict=verdict, path_rows=[path_rows], bonus=[5], hits=[0], samples=[[]])
    (h,) = handoff_step.handoff(runner, step, dec, hidden)
    committed = t + 1 + len(path_rows)
    assert (h.position, h.start) == (committed - 1, t)
    assert torch.equal(h.h, quantize_int8_ref(hidden[path_rows[-1]], scales["h"]).cpu())
    assert torch.equal(h.e_bonus, quantize_int8_ref(torch.full((64,), 5.0, device=DEVICE), scales["e"]).cpu())
    seed = h.seed
    assert (seed.start, seed.end) == (committed - window, committed)
    for kind in layers:
        ks, vs = scales[kind]
        for got, want, sc in ((h.kv[kind].k, dense[kind][0][t:], ks), (h.kv[kind].v, dense[kind][1][t:], vs),
                              (seed.kv[kind].k, dense[kind][0][committed - window:], ks),
                              (seed.kv[kind].v, dense[kind][1][committed - window:], vs)):
            assert got.device.type == "cpu" and got.dtype == torch.int8
            assert torch.equal(got, quantize_int8_ref(want, sc).cpu())


def test_tree_step_stacks_rows_in_tree_order():
    a = TreeRows.build(req_id="a", batch_idx=2, q_start=10, num_rows=3, context_len=40, round=0,
                       tokens=[1, 2, 3], parents=[-1, 0, 0], eps=None)
    b = TreeRows.build(req_id="b", batch_idx=0, q_start=0, num_rows=2, context_len=5, round=3,
                       tokens=[4, 5], parents=[-1, 0], eps=None)
    st = TreeStep.build([a, b], DEVICE)
    assert st.rows.tolist() == [10, 11, 12, 0, 1] and st.batch_idx.tolist() == [2, 0]
    assert st.masks.tolist() == [1, 3, 5, 1, 3] and st.depths.tolist() == [0, 1, 1, 0, 1]
    assert st.row_counts == [3, 2] and st.context_lens == [40, 5]
    assert st.query_start_loc.tolist() == [0, 3, 5] and st.seq_lens.tolist() == [43, 7]
    assert first_visible_key(40, a.depths, 8) == 33
