"""The benchmark phone's multi-pass SLM wrapper on the toy SLM twin: a one-pass plan gives the drafter's own
rows; a row of a later pass gets the logits of the same tokens decoded causally; ``pure`` leaves the state
untouched; committed tokens the SLM missed are caught up. And the recording session / modelled device time."""

from __future__ import annotations

import typing

import numpy as np
import pytest
import torch
from tolerances import tol

from hyco_lab.bench import configs, phones
from mobile_client.drafters.base import HybridDrafter, SpecEdgeDrafter
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_slm_state_dict, toy_slm_spec
from mobile_client.tree import DraftTree, FrontierPlan

SPEC = toy_slm_spec()
SD = random_slm_state_dict(SPEC)
KEEP = list(range(SPEC.vocab))
CONTEXT = [5, 9, 17, 33, 2, 40]


def _slm(rows=phones.ROWS) -> SlmDrafter:
    d = SlmDrafter(SPEC, SD, KEEP, window=32, rows=rows)
    d.prefill(CONTEXT)
    return d


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b)),
                               **tol("slm_logits", torch.float32))


def test_one_pass_plan_equals_the_drafter():
    tree = DraftTree.make_dummy([7, 8, 9, 10], [-1, 0, 0, 1])
    plan = FrontierPlan((), (0, 1, 2, 3), tree.tokens, tree.parents)
    ref = _slm(32).forward_rows(plan).logprobs
    got = phones.MultiPassSlm(_slm()).forward_rows(plan).logprobs
    _close(got, ref)


def test_second_pass_rows_match_causal_decoding():
    tree = DraftTree.make_dummy([7, 8, 9, 10, 11], [-1, 0, 0, 1, 3])
    wrapper = phones.MultiPassSlm(_slm())
    wrapper.forward_rows(FrontierPlan((), (0, 1, 2), tree.tokens[:3], tree.parents[:3]))
    second = wrapper.forward_rows(FrontierPlan((), (4, 2), tree.tokens, tree.parents)).logprobs  # row 4: 7 8 10 11
    causal = _slm(32)
    causal.prefill([7, 8, 10])  # the committed context, then the path of row 4 before it
    want = causal.forward_rows(FrontierPlan((), (0,), (11,), (-1,))).logprobs
    _close(second[0], want[0])


def test_pure_keeps_state_and_catch_up_resyncs():
    slm = _slm()
    wrapper = phones.MultiPassSlm(slm, context=lambda: CONTEXT)
    rings = {k: (a.copy(), b.copy()) for k, (a, b) in slm.rings.items()}
    plan = FrontierPlan((40,), (0, 1), (7, 8), (-1, 0))  # a bet: 40 committed, then a tree at 7
    wrapper.pure(plan)
    assert slm.committed == len(CONTEXT) and all(np.array_equal(slm.rings[k][0], rings[k][0]) for k in rings)
    # the session committed [.., 40, 7] but the SLM saw only 5 tokens: the wrapper catches the 6th up first
    slm2 = SlmDrafter(SPEC, SD, KEEP, window=32, rows=phones.ROWS)
    slm2.prefill(CONTEXT[:4])
    w2 = phones.MultiPassSlm(slm2, context=lambda: CONTEXT + [7])
    got = w2.forward_rows(FrontierPlan((7,), (0,), (8,), (-1,))).logprobs
    ref = phones.MultiPassSlm(_slm()).forward_rows(FrontierPlan((7,), (0,), (8,), (-1,))).logprobs
    assert slm2.committed == len(CONTEXT) + 1 and got.shape == ref.shape
    _close(got, ref)


@pytest.mark.parametrize("drafter", ["specedge", "hybrid-2p"])
def test_multi_pass_trees_build(drafter):
    wrapper = phones.MultiPassSlm(_slm())
    d = SpecEdgeDrafter(wrapper, passes=4) if drafter == "specedge" else HybridDrafter(None, wrapper, two_pass=True)
    from mobile_client.drafters.base import DraftContext

    tree = d.propose(DraftContext(root=40), 32)
    assert 1 <= tree.num_nodes <= 32 and tree.tokens[0] == 40


def test_bench_client_models_device_time():
    class S:
        class P:
            round, proactive_hit, forward = 0, None, True

        _pending = P()
        bench_device_ms: typing.ClassVar[dict] = {}

    client = phones.bench_client_class()("http://127.0.0.1:1", config=configs.CONFIGS["hyco"], session=S())
    assert client.sim_draft_ms == configs.SLM_PASS_MS
    S.P.round = 3
    assert client.sim_draft_ms == configs.HYCO_ROUND_MS
    S.P.proactive_hit = True
    assert client.sim_draft_ms == 0.0 and S.bench_device_ms == {0: configs.SLM_PASS_MS, 3: 0.0}
    S.P.round, S.P.proactive_hit, S.P.forward = 0, None, False  # the root-only opening: nothing drafted
    assert client.sim_draft_ms == 0.0


def test_round_gate_holds_each_tree_until_every_active_phone_has_one():
    import asyncio

    async def scenario():
        gate, order = phones.RoundGate(), []

        async def phone(name, rounds, delay):
            for r in range(rounds):
                await asyncio.sleep(delay)  # drafting
                await gate.wait(name)
                order.append((name, r))
            gate.leave(name)

        for n in "abc":
            gate.join(n)
        await asyncio.gather(phone("a", 3, 0.0), phone("b", 2, 0.01), phone("c", 1, 0.02))
        return order, gate

    order, gate = asyncio.run(scenario())
    rounds = [sorted(n for n, r in order if r == k) for k in range(3)]
    assert rounds == [["a", "b", "c"], ["a", "b"], ["a"]]
    # every round's trees leave together: no phone's round k+1 before another's round k
    assert [r for _, r in order] == sorted(r for _, r in order)
    assert gate.opened == 3 and not gate.active and gate.waited_s["a"] > gate.waited_s["c"]


def test_round_gate_opens_when_the_last_waited_phone_leaves():
    import asyncio

    async def scenario():
        gate = phones.RoundGate()
        gate.join("a")
        gate.join("b")
        waiting = asyncio.ensure_future(gate.wait("a"))
        await asyncio.sleep(0)
        assert not waiting.done()
        gate.leave("b")  # b failed or finished without another tree
        await asyncio.wait_for(waiting, 1.0)
        return gate.opened

    assert asyncio.run(scenario()) == 1
