"""Drafter contracts (mobile_client.drafters.base) driving the tree builders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mobile_client.baselines import specedge_tree
from mobile_client.drafters.base import (
    ChainDraft,
    ChainDrafter,
    DraftContext,
    Drafter,
    HybridDrafter,
    RowDrafter,
    RowLogprobs,
    SpecEdgeDrafter,
)
from mobile_client.tree import FrontierPlan, build_draft_tree

KEEP = np.arange(0, 400, 2, dtype=np.int64)  # a 200-token keep set of even ids


class FakeMtp:
    def __init__(self, chain, runner_ups):
        self.out = ChainDraft(tuple(chain), tuple(runner_ups))
        self.calls = 0

    def draft(self, x_hat):
        self.calls += 1
        return self.out


class FakeSlm:
    """Log q depends on the row's full path (so the first and second passes differ)."""

    keep_ids = KEEP

    def __init__(self):
        self.plans: list[FrontierPlan] = []

    def forward_rows(self, plan: FrontierPlan) -> RowLogprobs:
        self.plans.append(plan)
        rows = []
        for path in plan.row_paths():
            g = torch.Generator().manual_seed(sum((i + 1) * t for i, t in enumerate(path)) % (2**31))
            rows.append(torch.randn(len(KEEP), generator=g).mul(2).log_softmax(-1))
        return RowLogprobs(torch.stack(rows), KEEP)


def test_protocols_are_structural():
    assert isinstance(FakeMtp([1], []), ChainDrafter)
    assert isinstance(FakeSlm(), RowDrafter)
    assert isinstance(HybridDrafter(None, FakeSlm()), Drafter)
    assert isinstance(SpecEdgeDrafter(FakeSlm()), Drafter)


def test_mtp_drafter_fits_the_chain_protocol():
    mtp = pytest.importorskip("mobile_client.drafters.mtp")
    assert issubclass(mtp.MtpDrafter, ChainDrafter)


def test_hybrid_drafter_equals_build_draft_tree():
    chain, rus = [10, 12, 14, 16], [20, 12]  # the second runner-up equals its chain token: not planted
    slm = FakeSlm()
    tree = HybridDrafter(FakeMtp(chain, rus), slm).propose(DraftContext(root=4, x_hat=np.zeros(8)), 32)
    plan = slm.plans[0]
    assert plan.catch_up == () and plan.num_rows == 6
    lp_by_row = {r: slm.forward_rows(plan).logprobs[i] for i, r in enumerate(plan.rows)}
    insertion = torch.stack([lp_by_row[r] for r in range(6)])
    assert tree == build_draft_tree(4, chain, rus, insertion, keep_ids=KEEP)
    assert all(t % 2 == 0 for t in tree.tokens)


def test_catch_up_rows_reach_the_slm_and_get_no_candidates():
    slm = FakeSlm()
    ctx = DraftContext(root=4, catch_up=(30, 32), x_hat=np.zeros(8))
    tree = HybridDrafter(FakeMtp([10], []), slm).propose(ctx, 32)
    assert slm.plans[0].forward_tokens()[:3] == [30, 32, 4]
    assert tree.tokens[:2] == (4, 10)
    assert tree.parents.count(-1) == 1 and len(slm.plans[0].rows) == 2  # root and y1 get candidates


def test_first_round_is_slm_only():
    mtp = FakeMtp([10, 12], [20])
    tree = HybridDrafter(mtp, FakeSlm()).propose(DraftContext(root=4), 32)
    assert mtp.calls == 0
    assert set(tree.parents[1:]) <= {0} and tree.num_nodes == 32


def test_two_pass_runs_the_slm_over_the_nodes_just_added():
    slm = FakeSlm()
    one = HybridDrafter(FakeMtp([10, 12, 14, 16], [20, 22]), FakeSlm()).propose(
        DraftContext(root=4, x_hat=np.zeros(8)), 32)
    two = HybridDrafter(FakeMtp([10, 12, 14, 16], [20, 22]), slm, two_pass=True).propose(
        DraftContext(root=4, x_hat=np.zeros(8)), 32)
    assert len(slm.plans) == 2
    assert slm.plans[1].catch_up == ()
    assert set(slm.plans[1].rows) >= {r for r in range(7, len(slm.plans[1].tokens))}
    assert two.num_nodes == one.num_nodes == 32
    assert max(two.depths()) >= max(one.depths())


def test_budget_from_the_verdict():
    tree = HybridDrafter(FakeMtp([10, 12, 14, 16], [20, 22]), FakeSlm()).propose(
        DraftContext(root=4, x_hat=np.zeros(8)), 8)
    assert tree.num_nodes == 8 and tree.node_budget == 8 and tree.padded().tokens.shape == (9,)


def test_specedge_drafter_equals_specedge_tree():
    a = SpecEdgeDrafter(FakeSlm()).propose(DraftContext(root=4), 32)
    b = specedge_tree(4, FakeSlm().forward_rows)
    assert a == b and a.num_nodes == 32
