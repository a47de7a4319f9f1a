"""Record/replay of tree-attention calls (what the GPU script uses to re-run the CPU engine's batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tolerances import tol

from vllm_hyco.kernels import HAS_TRITON, TreeAttentionMetadata, interpreting
from vllm_hyco.kernels.replay import (
    load_tree_attention_case,
    record_tree_attention_case,
    replay_tree_attention_case,
)

TRITON_OK = HAS_TRITON and (torch.cuda.is_available() or interpreting())
REPLAY_DIR = Path(__file__).resolve().parents[2] / "benchmarks/gpu/replay"
ENGINE_RECORDINGS = sorted(str(p) for p in REPLAY_DIR.glob("*.pt"))


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_record_is_compact_and_replays_exactly(tmp_path, k_eq_v):
    meta = TreeAttentionMetadata.make_dummy([40, 3], [[-1, 0, 0, 1, 1], 2], block_size=16, num_blocks=50)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(50, 16, 2, 32, generator=g)
    v = k if k_eq_v else torch.randn(50, 16, 2, 32, generator=g)
    q = torch.randn(7, 4, 32, generator=g)
    path = record_tree_attention_case(tmp_path / "case.pt", q, k, v, meta, 0.2, 8, None, note="unit")
    case = load_tree_attention_case(path)
    assert case["k_cache"].shape[0] == 4  # 3 + 1 blocks used, out of 50
    assert (case["v_cache"] is case["k_cache"]) == k_eq_v
    report = replay_tree_attention_case(path, backend="torch")
    assert report["max_abs_diff"] == 0.0 and report["finite"] and report["reqs"] == 2
    if TRITON_OK:
        report = replay_tree_attention_case(path, backend="triton")
        t = tol("attention", torch.float32)
        assert report["max_abs_diff"] <= t["atol"] + t["rtol"] * float(case["out"].abs().max())


def test_dense_calls_pack_into_one_paged_batch(tmp_path):
    """What the CPU engine records (dense twin calls, shortened prefixes) replays as one paged batch."""
    from vllm_hyco.handoff.tree_contract import ancestor_mask, depths
    from vllm_hyco.kernels import tree_attention_dense_ref
    from vllm_hyco.kernels.replay import record_dense_calls

    g = torch.Generator().manual_seed(1)
    calls = []
    for prefix, parents, share in ((20, [-1, 0, 1, 1], False), (37, [-1, 0], True),
                                   (3, [-1, 0, 0, 2, 3], False)):
        masks, row_depths = torch.from_numpy(ancestor_mask(parents)), torch.from_numpy(depths(parents))
        n = len(parents)
        q = torch.randn(n, 4, 32, generator=g)
        k = torch.randn(prefix + n, 2, 32, generator=g)
        v = k if share else torch.randn(prefix + n, 2, 32, generator=g)
        args = dict(q=q, k=k, v=v, prefix_len=prefix, ancestor_mask=masks, depths=row_depths, scale=0.3,
                    sliding_window=16, softcap=None)
        calls.append({**args, "out": tree_attention_dense_ref(**args)})
    path = record_dense_calls(tmp_path / "dense.pt", calls, block_size=16, note="unit")
    report = replay_tree_attention_case(path, backend="torch")
    t = tol("attention", torch.float32)
    assert report["reqs"] == 3 and report["max_abs_diff"] <= t["atol"]
    if TRITON_OK:
        report = replay_tree_attention_case(path, backend="triton")
        assert report["max_abs_diff"] <= t["atol"] + t["rtol"] * report["max_abs_out"]


@pytest.mark.parametrize("path", ENGINE_RECORDINGS, ids=lambda p: Path(p).name)
def test_committed_engine_recordings_replay(path):
    """The CPU engine's recorded tree batches (benchmarks/gpu/record_engine_cases.py) still replay."""
    t = tol("attention", torch.float32)
    for backend in ["torch"] + (["triton"] if TRITON_OK else []):
        report = replay_tree_attention_case(path, backend=backend)
        assert report["reqs"] >= 1 and report["finite"]
        assert report["max_abs_diff"] <= t["atol"] + t["rtol"] * report["max_abs_out"], (backend, report)
