"""Proactive drafting on the real (torch) SLM Drafter: a reused proactive tree must not lose catch-up rows.

The proactive tree is drafted during the wait on a COPY of the SLM's state (``MultiPassSlm.pure``), before
the verdict, so reusing it runs no forward of the drafter: the committed tokens the SLM has no KV for
(the previous root and accepted path it did not compute) are still owed. ``PhoneSession`` keeps them as
catch-up rows for the next real forward (it used to drop them: the SLM ring then missed tokens and every
later row sat at a position shifted by their count). Checked here: the SLM's state after a reused
proactive round equals the state after the same verdicts drafted normally. Plus the SLM Drafter's
catch-up overflow (more owed rows than the static graph holds) equals committing them causally.
"""

from __future__ import annotations

import numpy as np
from test_client_session import SPEC, verdict

from mobile_client.baselines import proactive_draft
from mobile_client.drafters.base import SpecEdgeDrafter
from mobile_client.drafters.multipass import ROWS, MultiPassSlm
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_slm_state_dict, toy_slm_spec
from mobile_client.session import HycoPhoneDrafter, PhoneSession, SessionOptions
from mobile_client.tree import DraftTree, frontier_plan

SLM_SPEC = toy_slm_spec()
SD = random_slm_state_dict(SLM_SPEC, seed=5)
KEEP = list(range(SLM_SPEC.vocab))
PROMPT = [5, 9, 17, 33, 2, 40, 7, 11]
WINDOW = 32


def _phone(proactive: bool):
    slm = SlmDrafter(SLM_SPEC, SD, KEEP, window=WINDOW, rows=ROWS)
    rows = MultiPassSlm(slm)  # no context callable: the session alone must keep the SLM in step
    opts = SessionOptions(proactive=(lambda tree, catch_up=(): proactive_draft(tree, rows.pure, passes=2,
                                                                               catch_up=catch_up))
                          if proactive else None)
    drafter = HycoPhoneDrafter(SpecEdgeDrafter(rows, passes=2), slm=slm)
    session = PhoneSession(drafter, prompt_tokens=PROMPT, request={"prompt": PROMPT}, endpoint="completions",
                           spec=SPEC, options=opts)
    session.node_budget = opts.node_budget  # as the server's `session` frame grants it
    return session, slm


def _state(slm: SlmDrafter):
    return slm.committed, {k: v.copy() for k, v in slm.pos.items()}, \
        {j: (k.copy(), v.copy()) for j, (k, v) in slm.rings.items()}


def test_reused_proactive_round_leaves_the_slm_as_a_normal_round():
    pro, pro_slm = _phone(proactive=True)
    ref, ref_slm = _phone(proactive=False)
    root_pos = len(PROMPT) - 1
    t0 = pro.next_tree()
    assert ref.next_tree().tokens == t0.tokens  # same drafter, same state: the same round-0 tree
    pro.prepare_proactive()
    bet = pro._pending.prepared
    tree0 = pro._pending.tree
    path = tree0.path(bet.leaf_row)[1:]
    assert len(path) >= 1  # the bet accepts at least one node, so some rows are owed as catch-up
    pos1 = root_pos + len(path) + 1
    v0 = verdict(0, path, [*bet.path_tokens, bet.bonus], 0, pos1)
    pro.apply_verdict(v0)
    ref.apply_verdict(v0)
    owed, kept = pro.catch_up, pro_slm.committed
    assert owed == ref.catch_up and owed  # the SLM computed only the last pass's rows of tree 0

    t1 = pro.next_tree()  # the bet held: the prepared tree is sent, no forward of the drafter ran
    assert pro._pending.proactive_hit is True and t1.tokens[0] == bet.bonus
    assert pro.catch_up == owed  # still owed (they used to be dropped here)
    ref.next_tree()  # drafted normally: its forward commits the catch-up rows
    pro.prepare_proactive()  # the bet on the reused tree drafts after the owed rows (pure: state untouched)
    assert pro_slm.committed == kept == root_pos + 1 + len(path) - len(owed)
    miss = (pro._pending.prepared.bonus + 1) % SLM_SPEC.vocab
    v1 = verdict(1, [], [miss], pos1 - 1, pos1 + 1)  # nothing accepted: a miss for any bet
    pro.apply_verdict(v1)
    ref.apply_verdict(v1)
    assert pro.catch_up == (*owed, bet.bonus) and ref.catch_up == ()

    pro.next_tree()
    ref.next_tree()
    assert pro._pending.proactive_hit is False
    (n_pro, pos_pro, rings_pro), (n_ref, pos_ref, rings_ref) = _state(pro_slm), _state(ref_slm)
    assert n_pro == n_ref == pos1 + 1  # every committed token before the root, at its own position
    for kind in pos_ref:
        np.testing.assert_array_equal(pos_pro[kind], pos_ref[kind])
    for j in rings_ref:
        for a, b in zip(rings_pro[j], rings_ref[j]):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_catch_up_beyond_the_static_rows_is_committed_first():
    context = [3, 1, 4, 1, 5, 9, 2, 6]
    owed = [53, 58, 97, 93, 23, 84, 62, 64, 33, 83]  # more catch-up rows than fit next to the tree rows
    a = SlmDrafter(SLM_SPEC, SD, KEEP, window=WINDOW, rows=8)
    a.prefill(context)
    tree = DraftTree.make_dummy([27, 95, 2], [-1, 0, 1])
    out = a.forward_rows(frontier_plan(tree, catch_up=owed))
    assert out.logprobs.shape[0] == len(owed) + 3 and a.committed == len(context) + len(owed)
    b = SlmDrafter(SLM_SPEC, SD, KEEP, window=WINDOW, rows=32)
    b.prefill(context + owed)
    want = b.forward_rows(frontier_plan(tree))
    np.testing.assert_allclose(out.logprobs[len(owed):], want.logprobs, atol=1e-5)
    for j in a.rings:
        np.testing.assert_allclose(a.rings[j][0], b.rings[j][0], atol=1e-5)
