"""Paged tree attention: Triton kernel vs torch twin vs brute-force per-branch causal attention.

The brute force never looks at ancestor masks: it walks the parents list of each row, gathers that branch's
keys one by one through the block table, and runs plain causal softmax attention in float64. Triton cases
run compiled on a GPU and under TRITON_INTERPRET=1 on CPU; without either they skip (the twin still runs).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from kernel_support import DEVICE, needs_triton, random_tree
from tolerances import tol

from vllm_hyco.errors import TreeValidationError
from vllm_hyco.handoff.tree_contract import ancestor_mask
from vllm_hyco.kernels import (
    KernelInputError,
    TreeAttentionMetadata,
    tree_attention,
    tree_attention_dense_ref,
    tree_attention_ref,
)

TREES = {
    "root": [-1],
    "chain5": [-1, 0, 1, 2, 3],
    "star17": [-1] + [0] * 16,
    "hyco33": random_tree(33, 1),
    "bushy33": random_tree(33, 2, reach=3),
    "full64": random_tree(64, 3, reach=20),  # uses bit 63 (sign bit of the int64 mask)
}


def make_case(prefix_lens, rows, hq, hkv, dim, block_size, dtype, seed=0, k_eq_v=False, spare_blocks=3):
    """Caches in vLLM's Triton layout: [blocks, kv_heads, bs, 2 * D] storage viewed as [blocks, bs, H, D]."""
    meta = TreeAttentionMetadata.make_dummy(prefix_lens, rows, block_size, seed=seed)
    num_blocks = int(meta.block_table.max()) + 1 + spare_blocks
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, hkv, block_size, 2 * dim, generator=g).to(dtype)
    k_cache, v_cache = kv.transpose(1, 2).split(dim, dim=-1)
    if k_eq_v:
        v_cache = k_cache
    q = torch.randn(meta.depths.shape[0], hq, dim, generator=g).to(dtype)
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta.to(DEVICE)


def brute_force(q, k_cache, v_cache, meta, rows, scale, window, softcap):
    """float64, one row and one head at a time, over the keys of that row's branch."""
    qsl, seq, bt = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_table.tolist()
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, spec in enumerate(rows):
        n = qsl[r + 1] - qsl[r]
        t = seq[r] - n
        parents = spec if isinstance(spec, list) else [j - 1 for j in range(n)]
        depth = [0] * n
        for j in range(1, n):
            depth[j] = depth[parents[j]] + 1 if isinstance(spec, list) else j
        for j in range(n):
            branch, a = [], j
            while a >= 0:
                branch.append(a)
                a = parents[a] if isinstance(spec, list) else (a - 1)
            idx = list(range(t)) + [t + i for i in sorted(branch)]
            pos = list(range(t)) + [t + depth[i] for i in sorted(branch)]
            row_pos = t + depth[j]
            keep = [i for i, p in zip(idx, pos) if not window or p > row_pos - window]
            blk = torch.tensor([bt[r][i // bs] for i in keep])
            off = torch.tensor([i % bs for i in keep])
            k = k_cache[blk, off].double().cpu()  # [keys, hkv, D]
            v = v_cache[blk, off].double().cpu()
            for h in range(q.shape[1]):
                s = (k[:, h // (q.shape[1] // hkv)] @ q[qsl[r] + j, h].double().cpu()) * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                out[qsl[r] + j, h] = torch.softmax(s, 0) @ v[:, h // (q.shape[1] // hkv)]
    return out


def _assert_close(actual, expected, op, dtype, params):
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **tol(op, dtype),
                               msg=lambda m: f"{m}\nparams: {params}")


# (prefix_lens, rows, hq, hkv, dim, block_size, window, softcap, k_eq_v)
TWIN_CASES = {
    "root_ctx0": ([0], [TREES["root"]], 1, 1, 64, 16, None, None, False),
    "chain_ctx15": ([15], [TREES["chain5"]], 2, 1, 64, 16, None, None, False),
    "star_ctx16": ([16], [TREES["star17"]], 4, 2, 64, 16, None, None, False),
    "hyco33_ctx17_gqa3": ([17], [TREES["hyco33"]], 6, 2, 64, 16, None, None, False),
    "hyco33_ctx100_win8": ([100], [TREES["hyco33"]], 4, 1, 64, 16, 8, None, False),
    "bushy33_win1": ([40], [TREES["bushy33"]], 2, 2, 64, 16, 1, None, False),
    "bushy33_win_edge": ([31], [TREES["bushy33"]], 2, 1, 64, 16, 33, None, False),
    "full64_bit63": ([5], [TREES["full64"]], 2, 1, 32, 16, None, None, False),
    "softcap": ([50], [TREES["hyco33"]], 2, 1, 64, 32, None, 5.0, False),
    "mixed_batch": ([70, 3, 0, 20, 9], [TREES["hyco33"], 1, 21, TREES["chain5"], 0], 4, 2, 64, 16, 16, None,
                    False),
    "d256_sliding": ([80], [TREES["hyco33"]], 4, 2, 256, 16, 32, None, False),
    "d512_k_eq_v": ([65], [TREES["hyco33"]], 2, 1, 512, 32, None, None, True),
}


@pytest.mark.parametrize("name", list(TWIN_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_twin_matches_brute_force(name, dtype):
    prefix, rows, hq, hkv, dim, bs, window, cap, k_eq_v = TWIN_CASES[name]
    q, kc, vc, meta = make_case(prefix, rows, hq, hkv, dim, bs, dtype, seed=7, k_eq_v=k_eq_v)
    scale = 1 / math.sqrt(dim)
    got = tree_attention_ref(q, kc, vc, meta, scale, window, cap)
    want = brute_force(q, kc, vc, meta, rows, scale, window, cap)
    _assert_close(got, want, "attention", dtype, (name, dtype))


def test_chain_tree_equals_causal_rows():
    """A chain drafted as a tree is an ordinary causal block (positions and masks agree)."""
    q, kc, vc, meta_tree = make_case([37], [TREES["chain5"]], 4, 2, 64, 16, torch.float32, seed=3)
    meta_causal = TreeAttentionMetadata.make_dummy([37], [5], 16, seed=3)
    for window in (None, 3):
        a = tree_attention_ref(q, kc, vc, meta_tree, 0.125, window)
        b = tree_attention_ref(q, kc, vc, meta_causal.to(DEVICE), 0.125, window)
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_dense_ref_is_the_paged_twin_on_gathered_kv():
    q, kc, vc, meta = make_case([21], [TREES["hyco33"]], 2, 1, 64, 16, torch.float32, seed=4)
    idx = torch.arange(int(meta.seq_lens[0]))
    blocks = meta.block_table[0].long().cpu()[idx // 16]
    k, v = kc.cpu()[blocks, idx % 16], vc.cpu()[blocks, idx % 16]
    dense = tree_attention_dense_ref(q.cpu(), k, v, 21, meta.ancestor_mask.cpu(), meta.depths.cpu(), 0.1, 9)
    paged = tree_attention_ref(q, kc, vc, meta, 0.1, 9)  # gathers only the window's keys
    torch.testing.assert_close(dense, paged.cpu(), **tol("attention", torch.float32))


def test_metadata_make_dummy_worked_example():
    m = TreeAttentionMetadata.make_dummy([3, 5], [[-1, 0, 0, 1], 2], block_size=4)
    assert m.ancestor_mask.tolist() == [1, 3, 5, 11, 0, 0]
    assert m.depths.tolist() == [0, 1, 1, 2, 0, 1]
    assert m.query_start_loc.tolist() == [0, 4, 6]
    assert m.seq_lens.tolist() == [7, 7]
    assert sorted(m.block_table.flatten().tolist()) == [0, 1, 2, 3]


def test_bad_trees_and_shapes_raise():
    with pytest.raises(TreeValidationError):
        ancestor_mask([0, 0])
    with pytest.raises(TreeValidationError):
        ancestor_mask([-1, 1])
    with pytest.raises(TreeValidationError):
        ancestor_mask(random_tree(65, 0))
    with pytest.raises(TreeValidationError):
        TreeAttentionMetadata.make_dummy([3], [[-1, 1]], block_size=4)
    q, kc, vc, meta = make_case([4], [TREES["chain5"]], 3, 2, 64, 16, torch.float32)
    with pytest.raises(KernelInputError):
        tree_attention(q, kc, vc, meta, 0.1, backend="torch")
    with pytest.raises(KernelInputError):
        tree_attention(q, kc, vc, meta, 0.1, backend="fast")


# (prefix_lens, rows, hq, hkv, dim, block_size, window, softcap, k_eq_v, dtype)
KERNEL_CASES = {
    "root_ctx0_f32": ([0], [TREES["root"]], 1, 1, 64, 16, None, None, False, torch.float32),
    "chain_ctx15_f16": ([15], [TREES["chain5"]], 2, 1, 64, 16, None, None, False, torch.float16),
    "star_ctx16_f32": ([16], [TREES["star17"]], 4, 2, 64, 16, None, None, False, torch.float32),
    "hyco33_ctx17_gqa3_f32": ([17], [TREES["hyco33"]], 6, 2, 64, 16, None, None, False, torch.float32),
    "hyco33_ctx17_gqa3_f16": ([17], [TREES["hyco33"]], 6, 2, 64, 16, None, None, False, torch.float16),
    "hyco33_ctx129_win8_f32": ([129], [TREES["hyco33"]], 4, 1, 64, 16, 8, None, False, torch.float32),
    "hyco33_ctx200_win64_f16": ([200], [TREES["hyco33"]], 2, 1, 64, 16, 64, None, False, torch.float16),
    "bushy33_win1_f32": ([40], [TREES["bushy33"]], 2, 2, 64, 16, 1, None, False, torch.float32),
    "bushy33_win_edge_f16": ([31], [TREES["bushy33"]], 2, 1, 64, 16, 33, None, False, torch.float16),
    "full64_bit63_f32": ([5], [TREES["full64"]], 2, 1, 32, 16, None, None, False, torch.float32),
    "softcap_f32": ([50], [TREES["hyco33"]], 2, 1, 64, 32, None, 5.0, False, torch.float32),
    "softcap_win_f16": ([90], [TREES["bushy33"]], 2, 1, 64, 16, 20, 30.0, False, torch.float16),
    "mixed_batch_f32": ([70, 3, 0, 20, 9], [TREES["hyco33"], 1, 21, TREES["chain5"], 0], 4, 2, 64, 16, 16,
                        None, False, torch.float32),
    "mixed_batch_f16": ([33, 64, 1], [TREES["star17"], 40, TREES["hyco33"]], 2, 1, 64, 16, None, None, False,
                        torch.float16),
    "batch_var_trees_f32": ([10, 47, 300], [TREES["chain5"], TREES["hyco33"], TREES["root"]], 2, 1, 64, 32,
                            None, None, False, torch.float32),
    "d256_sliding_f32": ([80], [TREES["hyco33"]], 4, 2, 256, 16, 32, None, False, torch.float32),
    "d256_sliding_f16": ([40], [TREES["chain5"]], 2, 1, 256, 16, 16, None, False, torch.float16),
    "d512_k_eq_v_f32": ([65], [TREES["hyco33"]], 2, 1, 512, 32, None, None, True, torch.float32),
    "d512_k_eq_v_f16": ([20], [TREES["chain5"]], 2, 1, 512, 16, None, None, True, torch.float16),
    "d48_padded_f32": ([19], [TREES["star17"]], 2, 1, 48, 16, None, None, False, torch.float32),
    "bf16_upcast": ([45], [TREES["hyco33"]], 4, 2, 64, 16, 16, None, False, torch.bfloat16),
}


@needs_triton
@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_twin_and_brute_force(name):
    prefix, rows, hq, hkv, dim, bs, window, cap, k_eq_v, dtype = KERNEL_CASES[name]
    q, kc, vc, meta = make_case(prefix, rows, hq, hkv, dim, bs, dtype, seed=11, k_eq_v=k_eq_v)
    scale = 1 / math.sqrt(dim)
    out = torch.full_like(q, float("nan"))
    got = tree_attention(q, kc, vc, meta, scale, window, cap, out=out, backend="triton")
    assert got is out
    twin = tree_attention(q, kc, vc, meta, scale, window, cap, backend="torch")
    _assert_close(got, twin, "attention", dtype, (name, "kernel vs twin"))
    _assert_close(got, brute_force(q, kc, vc, meta, rows, scale, window, cap), "attention", dtype,
                  (name, "kernel vs brute force"))


def _random_batch(seed: int):
    rng = random.Random(seed)
    num = rng.randint(1, 4)
    prefix = [rng.choice([0, 1, 15, 16, 17, rng.randint(0, 300)]) for _ in range(num)]
    rows = [random_tree(rng.randint(1, 33), seed * 10 + i, reach=rng.randint(1, 8)) if rng.random() < 0.7
            else rng.randint(0, 24) for i in range(num)]
    hkv = rng.choice([1, 2])
    hq = hkv * rng.choice([1, 2, 3, 4])
    window = rng.choice([None, None, 1, 5, 32, 64])
    cap = rng.choice([None, None, 20.0])
    return prefix, rows, hq, hkv, rng.choice([32, 64]), rng.choice([16, 32]), window, cap


@needs_triton
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_random_batches(seed, dtype):
    prefix, rows, hq, hkv, dim, bs, window, cap = _random_batch(seed)
    q, kc, vc, meta = make_case(prefix, rows, hq, hkv, dim, bs, dtype, seed=seed)
    got = tree_attention(q, kc, vc, meta, 0.2, window, cap, backend="triton")
    want = brute_force(q, kc, vc, meta, rows, 0.2, window, cap)
    _assert_close(got, want, "attention", dtype, (seed, prefix, rows, hq, hkv, dim, bs, window, cap))


def test_dense_ref_on_window_keys_only():
    """The CPU engine may gather only the keys inside the window (key_offset); dropping more is an error."""
    from vllm_hyco.kernels.tree_attention import first_visible_key

    q, kc, vc, meta = make_case([90], [TREES["bushy33"]], 2, 1, 64, 16, torch.float32, seed=5)
    idx = torch.arange(int(meta.seq_lens[0]))
    blocks = meta.block_table[0].long().cpu()[idx // 16]
    k, v = kc.cpu()[blocks, idx % 16], vc.cpu()[blocks, idx % 16]
    masks, depths = meta.ancestor_mask.cpu(), meta.depths.cpu()
    first = first_visible_key(90, depths, 12)
    assert first == 90 - 12 + 1
    full = tree_attention_dense_ref(q.cpu(), k, v, 90, masks, depths, 0.1, 12)
    part = tree_attention_dense_ref(q.cpu(), k[first:], v[first:], 90, masks, depths, 0.1, 12,
                                    key_offset=first)
    torch.testing.assert_close(part, full, **tol("attention", torch.float32))
    with pytest.raises(KernelInputError):
        tree_attention_dense_ref(q.cpu(), k[first + 1:], v[first + 1:], 90, masks, depths, 0.1, 12,
                                 key_offset=first + 1)


@needs_triton
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("name", ["mixed_batch_f32", "hyco33_ctx200_win64_f16", "d512_k_eq_v_f32",
                                  "d48_padded_f32"])
def test_kernel_split_k_matches_twin(name, splits):
    """Flash-decoding splits (the GPU picks them by SM count): empty splits and windows included."""
    from vllm_hyco.kernels.tree_attention import tree_attention_triton

    prefix, rows, hq, hkv, dim, bs, window, cap, k_eq_v, dtype = KERNEL_CASES[name]
    q, kc, vc, meta = make_case(prefix, rows, hq, hkv, dim, bs, dtype, seed=13, k_eq_v=k_eq_v)
    got = tree_attention_triton(q, kc, vc, meta, 0.1, window, cap, num_splits=splits)
    twin = tree_attention_ref(q, kc, vc, meta, 0.1, window, cap)
    _assert_close(got, twin, "attention", dtype, (name, splits))


def test_from_vllm_defaults_to_causal_rows():
    dummy = TreeAttentionMetadata.make_dummy([4, 0, 9], [3, 1, 5], block_size=8)
    meta = TreeAttentionMetadata.from_vllm(dummy.query_start_loc, dummy.seq_lens, dummy.block_table,
                                           dummy.max_query_len, dummy.max_seq_len, num_rows=9)
    assert meta.depths.tolist() == dummy.depths.tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    assert meta.ancestor_mask.tolist() == [0] * 9
