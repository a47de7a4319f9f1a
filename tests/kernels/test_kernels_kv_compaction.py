"""KV compaction: Triton kernel vs torch twin vs a brute force that copies one move at a time in order."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_support import DEVICE, TRITON_OK
from tolerances import tol

from vllm_hyco.kernels import KernelInputError, compact_kv, compaction_moves
from vllm_hyco.kernels.kv_compaction import check_compaction_moves

BACKENDS = ["torch"] + (["triton"] if TRITON_OK else [])


def random_accepts(n_rows: int, rng: random.Random) -> list[int]:
    """Root plus an increasing subset of the tree rows (a path is always increasing)."""
    k = rng.randint(0, min(n_rows - 1, 8))
    return [0] + sorted(rng.sample(range(1, n_rows), k))


def gemma_like_caches(dtype, num_blocks=(10, 6)):
    """Two KV groups: sliding layers (bs 16, [B, N, H, 2D] via transpose, HND storage) and a full layer
    (bs 8, k_eq_v-style single cache [B, N, H, D]) plus a 3-D cache [B, N, W]."""
    g = torch.Generator().manual_seed(0)
    nb0, nb1 = num_blocks
    sliding = [torch.randn(nb0, 2, 16, 2 * 32, generator=g).to(dtype).transpose(1, 2) for _ in range(2)]
    full = [torch.randn(nb1, 8, 1, 64, generator=g).to(dtype), torch.randn(nb1, 8, 24, generator=g).to(dtype)]
    return [c.to(DEVICE) for c in sliding + full], [0, 0, 1, 1]


def brute_force(caches, src, dst, loc, groups):
    out = [c.clone() for c in caches]
    for c, grp in zip(out, groups):
        bs = c.shape[1]
        for r in range(len(loc) - 1):
            for m in range(loc[r], loc[r + 1]):
                s, d = int(src[grp, m]), int(dst[grp, m])
                if s >= 0 and d >= 0:
                    c[d // bs, d % bs] = c[s // bs, s % bs].clone()
    return out


def build_moves(seed, num_reqs=3):
    rng = random.Random(seed)
    prefix = [rng.randint(0, 40) for _ in range(num_reqs)]
    n_rows = [rng.randint(1, 33) for _ in range(num_reqs)]
    accepted = [random_accepts(n, rng) for n in n_rows]
    tables, per_group = [], []
    for bs, _total in ((16, 10), (8, 6 * 8 // 8)):
        need = [-(-(t + n) // bs) for t, n in zip(prefix, n_rows)]
        pool = list(range(sum(need)))
        rng.shuffle(pool)
        bt = torch.zeros(num_reqs, max(need), dtype=torch.int32)
        for r, k in enumerate(need):
            bt[r, :k] = torch.tensor(pool[:k])
            pool = pool[k:]
        tables.append((bt, bs, sum(need)))
        per_group.append(compaction_moves(bt, bs, prefix, accepted))
    src = torch.stack([m[0] for m in per_group])
    dst = torch.stack([m[1] for m in per_group])
    assert torch.equal(per_group[0][2], per_group[1][2])
    return src, dst, per_group[0][2], [t[2] for t in tables]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_compaction_matches_sequential_copies(backend, dtype, seed):
    src, dst, loc, blocks = build_moves(seed)
    check_compaction_moves(src, dst, loc)
    caches, groups = gemma_like_caches(dtype, num_blocks=(blocks[0] + 1, blocks[1] + 1))
    want = brute_force(caches, src, dst, loc.tolist(), groups)
    compact_kv(caches, src.to(DEVICE), dst.to(DEVICE), loc.to(DEVICE), groups, backend=backend)
    for i, (a, b) in enumerate(zip(caches, want)):
        torch.testing.assert_close(a, b, **tol("kv_copy", dtype), msg=lambda m, i=i: f"{m}\nlayer {i} seed {seed}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_chain_and_padding(backend):
    """Rows 0, 1, 3, 4, 6: row 3 moves onto slot 2 whose own row is dropped, row 4 onto 3 after 3 moved."""
    bt = torch.tensor([[1, 0]], dtype=torch.int32)
    src, dst, loc = compaction_moves(bt, 4, [1], [[0, 1, 3, 4, 6]])
    src = torch.cat([src, torch.tensor([-1])])  # a padding move
    dst = torch.cat([dst, torch.tensor([-1])])
    loc = torch.tensor([0, 6], dtype=torch.int32)
    cache = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3).to(DEVICE)
    before = cache.clone()
    compact_kv([cache], src.to(DEVICE), dst.to(DEVICE), loc.to(DEVICE), backend=backend)
    idx_to_slot = lambda i: [4, 5, 6, 7, 0, 1, 2, 3][i]  # noqa: E731
    for i, row in enumerate([0, 1, 3, 4, 6]):
        s, d = idx_to_slot(1 + row), idx_to_slot(1 + i)
        assert torch.equal(cache.view(8, 3)[d], before.view(8, 3)[s])


def test_check_compaction_moves_rejects_read_after_write():
    src = torch.tensor([5, 3])
    dst = torch.tensor([3, 4])  # move 1 reads slot 3 that move 0 wrote
    with pytest.raises(KernelInputError):
        check_compaction_moves(src, dst, None)
    with pytest.raises(KernelInputError):
        check_compaction_moves(torch.tensor([5, 9]), torch.tensor([4, 5]), torch.tensor([0, 1, 2]))
    with pytest.raises(KernelInputError):
        compaction_moves(torch.zeros(1, 2, dtype=torch.int32), 4, [0], [[0, 3, 2]])
