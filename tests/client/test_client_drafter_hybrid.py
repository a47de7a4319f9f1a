"""Our two drafters behind the tree builder's contracts (real: float torch on CPU).

``MtpDrafter`` as the ``ChainDrafter`` and ``SlmDrafter`` as the ``RowDrafter`` of
``mobile_client.drafters.base.HybridDrafter``: the first round is SLM-only (docs/decisions.md D2), later rounds
plant the MTP chain; the tree passes the server's validation; accepting a path moves the SLM's KV so that
the next round's logits equal a fresh drafter's that prefilled the committed text.
"""

from __future__ import annotations

import numpy as np
import torch

from mobile_client.drafters.base import ChainDrafter, DraftContext, HybridDrafter, RowDrafter
from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import (
    random_mtp_state_dict,
    random_slm_state_dict,
    toy_mtp_spec,
    toy_slm_spec,
)
from mobile_client.tree import DraftTree, frontier_plan
from vllm_hyco.handoff.tree_contract import validate_tree

W = 64


def _drafters():
    mspec, sspec = toy_mtp_spec(), toy_slm_spec(sliding_window=W // 2)
    keep = list(range(0, 512, 2)) + [1, 3]
    keep.sort()
    embed = torch.randn(mspec.vocab, mspec.backbone, generator=torch.Generator().manual_seed(0))
    mtp = MtpDrafter(
        mspec,
        keep,
        EmbedLut.from_embedding(embed, keep),
        torch_step(MtpHead.from_hf_state_dict(mspec, random_mtp_state_dict(mspec), keep)),
        window=W,
    )
    sd = random_slm_state_dict(sspec, seed=2)
    return mspec, sspec, keep, embed, mtp, sd


def test_drafters_fit_the_contracts_and_build_valid_trees():
    mspec, sspec, keep, embed, mtp, sd = _drafters()
    slm = SlmDrafter(sspec, sd, keep, window=W)
    assert isinstance(mtp, ChainDrafter) and isinstance(slm, RowDrafter)
    prompt = [5, 9, 13, 200, 17]
    slm.prefill(prompt[:-1])
    first = HybridDrafter(None, slm).propose(DraftContext(root=prompt[-1]), node_budget=32)
    tokens, parents = first.to_wire()
    validate_tree(tokens, parents, vocab_size=sspec.vocab, node_budget=32)
    assert len(tokens) == 33 and set(tokens[1:]) <= set(keep)

    rng = np.random.default_rng(0)
    t = len(prompt)
    rows = {
        k: (
            rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
            rng.standard_normal((t, a.kv_heads, a.head_dim)).astype(np.float32),
        )
        for k, a in mspec.attn.items()
    }
    mtp.apply_handoff(t, 0, rows)
    x_hat = np.concatenate([mtp.lut[3], rng.standard_normal(mspec.backbone)]).astype(np.float32)
    slm.accept([0])  # round 1 verdict: nothing accepted, the root is committed; bonus 21 is the new root
    hybrid = HybridDrafter(mtp, slm)
    tree = hybrid.propose(DraftContext(root=21, x_hat=x_hat), node_budget=32)
    tokens, parents = tree.to_wire()
    validate_tree(tokens, parents, vocab_size=sspec.vocab, node_budget=32)
    chain = list(hybrid.last_chain.chain)
    assert tokens[1] == chain[0] and parents[1] == 0  # the chain is planted first


def test_accept_then_catch_up_equals_fresh_prefill():
    _, sspec, keep, _, _, sd = _drafters()
    a = SlmDrafter(sspec, sd, keep, window=W)
    a.prefill([4, 8, 15, 16])
    tree = DraftTree.make_dummy([23, 42, 7, 99], [-1, 0, 1, 0])
    a.forward_rows(frontier_plan(tree))
    assert a.accept([0, 1, 2]) == 3  # root 23, path 42 -> 7 accepted; bonus 11
    nxt = DraftTree.make_dummy([11, 12], [-1, 0])
    out_a = a.forward_rows(frontier_plan(nxt))
    b = SlmDrafter(sspec, sd, keep, window=W)
    b.prefill([4, 8, 15, 16, 23, 42, 7])
    out_b = b.forward_rows(frontier_plan(nxt))
    np.testing.assert_allclose(out_a.logprobs, out_b.logprobs, atol=1e-5)
