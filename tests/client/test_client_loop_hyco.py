"""The phone loop with HyCo's own drafters (toy MTP head + toy SLM, random weights, float torch on CPU) and
with the SpecEdge-style baseline plus proactive drafting, against the FAKE server of test_client_loop.py
(a unit-test stand-in for the real endpoint; see that module's docstring).

Random-weight drafters rarely guess the toy verifier, so ``Grafted`` adds the verifier's own next tokens
to the HyCo tree (as nodes the SLM never computed, i.e. future catch-up rows): paths then run through
computed rows (root, MTP chain) and uncomputed ones, which exercises Algorithm 1 line 10 both ways.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_client_loop import PROMPT, SPEC, V, W, greedy, next_token, run, toy_scales

from mobile_client.baselines import proactive_draft
from mobile_client.drafters.base import HybridDrafter, SpecEdgeDrafter
from mobile_client.drafters.mtp import EmbedLut, MtpDrafter, MtpHead, torch_step
from mobile_client.drafters.slm import SlmDrafter
from mobile_client.drafters.spec import random_mtp_state_dict, random_slm_state_dict, toy_mtp_spec, toy_slm_spec
from mobile_client.session import HycoPhoneDrafter, PhoneSession, SessionOptions
from mobile_client.tree import DraftTree
from vllm_hyco.handoff import SessionFrame


def hyco_phone() -> tuple[HycoPhoneDrafter, MtpDrafter, SlmDrafter]:
    mspec, sspec = toy_mtp_spec(), toy_slm_spec()
    assert mspec.vocab == sspec.vocab == V and mspec.backbone == SPEC.hidden_size
    keep = list(range(V))
    head = MtpHead.from_hf_state_dict(mspec, random_mtp_state_dict(mspec, seed=1), keep)
    embed = torch.randn(V, mspec.backbone, generator=torch.Generator().manual_seed(2))
    mtp = MtpDrafter(mspec, keep, EmbedLut.from_embedding(embed, keep), torch_step(head), window=W)
    slm = SlmDrafter(sspec, random_slm_state_dict(sspec, seed=3), keep, window=W)
    return HycoPhoneDrafter(HybridDrafter(mtp, slm), slm=slm, mtp=mtp, scales=toy_scales()), mtp, slm


class Grafted:
    """HyCo's tree (node_budget - 3 nodes) plus the verifier's next 3 tokens grafted along the matching branch."""

    def __init__(self, inner: HycoPhoneDrafter, depth: int = 3):
        self.inner, self.depth, self.session = inner, depth, None
        for hook in ("prefill", "accept", "apply_handoff"):
            setattr(self, hook, getattr(inner, hook))

    def propose(self, context, node_budget):
        tree = self.inner.propose(context, max(node_budget - self.depth, 1))
        tokens, parents = list(tree.tokens), list(tree.parents)
        ctx = self.session.prompt_tokens + self.session.tokens  # committed, ending with the root
        node = 0
        for _ in range(min(self.depth, node_budget - (len(tokens) - 1))):
            y = next_token(ctx)
            kids = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == y]
            if kids:
                node = kids[0]
            else:
                tokens.append(y)
                parents.append(node)
                node = len(tokens) - 1
            ctx = ctx + [y]
        return DraftTree.make_dummy(tokens, parents, node_budget=node_budget)


def hyco_session(drafter, max_tokens, options=SessionOptions()):
    return PhoneSession(drafter, prompt_tokens=PROMPT, request={"prompt": PROMPT, "max_tokens": max_tokens},
                        endpoint="completions", spec=SPEC, options=options)


def _invariants(session, mtp, slm, seen):
    def check(stats):
        if session.finished:
            return
        # the SLM holds every committed token before the root except the catch-up rows (Alg. 1 line 10)
        assert slm.committed + len(session.catch_up) == session.position, stats
        # the MTP ring ends at the root: its query sits at root position - 1 (D1)
        assert mtp.t0 == session.position and mtp.ell == max(0, session.position - W), stats
        assert session.x_hat is not None and session.x_hat.shape == (2 * SPEC.hidden_size,)
        seen.append(stats)
    return check


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 700])
def test_hyco_drafters_exact_session(chunk_bytes):
    phone, mtp, slm = hyco_phone()
    drafter = Grafted(phone)
    session = hyco_session(drafter, max_tokens=24)
    drafter.session = session
    seen = []
    result, _ = _run_checked(session, {"chunk_bytes": chunk_bytes}, _invariants(session, mtp, slm, seen))
    assert result.token_ids == greedy(PROMPT, 24)
    assert sum(r.accepted for r in result.rounds) > 0 and len(seen) == len(result.rounds) - 1
    assert phone.drafter.last_chain.chain  # rounds after the first drafted with the MTP chain
    assert result.rounds[0].nodes <= 32 and all(r.nodes <= 32 for r in result.rounds)


def test_hyco_first_round_is_slm_only_from_prefilled_prompt():
    phone, mtp, slm = hyco_phone()
    session = hyco_session(phone, max_tokens=4)  # opening "slm", the default
    session.apply_session(SessionFrame("r1." + "0" * 32, -1, 32, SPEC))  # the server's answer to `start`
    frame = session.next_tree()
    assert frame.tokens[0] == PROMPT[-1] and slm.committed == len(PROMPT) - 1
    assert phone.drafter.last_chain.chain == () and set(frame.labels[1:]) == {3}  # SLM nodes only


def test_hyco_opens_with_the_root_alone_and_prefills_the_slm_during_the_wait():
    phone, mtp, slm = hyco_phone()
    session = hyco_session(phone, max_tokens=4, options=SessionOptions(opening="root"))
    session.apply_session(SessionFrame("r1." + "0" * 32, -1, 32, SPEC))
    frame = session.next_tree()
    assert list(frame.tokens) == [PROMPT[-1]] and list(frame.parents) == [-1] and slm.committed == 0
    assert session.wait_work
    session.prepare_proactive()  # what the client runs while the root is verified
    assert slm.committed == len(PROMPT) - 1 and not session.wait_work
    assert session.next_tree() is not None  # the tree in flight, resent unchanged
    assert session.tree_in_flight and slm.committed == len(PROMPT) - 1


def test_hyco_root_opening_drafts_round_one_from_the_seed_and_stays_exact():
    phone, mtp, slm = hyco_phone()
    session = hyco_session(phone, max_tokens=24, options=SessionOptions(opening="root"))
    seen = []
    result, _ = _run_checked(session, {}, _invariants(session, mtp, slm, seen))
    assert result.token_ids == greedy(PROMPT, 24)
    first, second = result.rounds[:2]
    assert (first.nodes, first.accepted, first.committed) == (0, 0, 1)  # the first token alone
    # round 1: the MTP chain drafted from the seed, as vLLM's first MTP step drafts from its prefill
    assert second.nodes > 0 and len(seen) == len(result.rounds) - 1
    assert phone.drafter.last_chain.chain


def test_corrupt_chunk_resumes_with_need_seed():
    phone, mtp, slm = hyco_phone()
    drafter = Grafted(phone)
    session = hyco_session(drafter, max_tokens=24)
    drafter.session = session
    seen = []
    result, server = _run_checked(session, {"chunk_bytes": 700, "corrupt": {2}},
                                  _invariants(session, mtp, slm, seen))
    assert result.token_ids == greedy(PROMPT, 24) and result.resumes == 1
    resume = [s.hyco.resume for s in server.starts if s.request is None]
    assert len(resume) == 1 and resume[0].need_seed and resume[0].last_round == 1
    # the seed refilled the MTP ring: the round after the resume saw W positions at once
    assert mtp.ell == max(0, session.position - W) or session.finished


def _run_checked(session, server_kw, on_round):
    import asyncio

    from test_client_loop import FakeHycoServer

    from mobile_client.client import HycoClient, Timeouts

    async def go():
        async with FakeHycoServer(**server_kw) as server:
            client = HycoClient(server.url, timeouts=Timeouts(5, 10, 1), retry_delay_s=0.001)
            return await client.run(session, on_round=on_round), server
    return asyncio.run(go())


def markov(ctx) -> int:
    return (ctx[-1] * 5 + 3) % V


def markov_slm(plan):
    """A pure SLM stand-in for the baselines: log q peaked (0.6) at the Markov verifier's next token."""
    lp = np.full((plan.num_rows, V), np.log(0.4 / (V - 1)))
    for i, tok in enumerate(plan.forward_tokens()):
        lp[i, markov([tok])] = np.log(0.6)
    return lp


class MarkovSlm:
    forward_rows = staticmethod(markov_slm)


@pytest.mark.parametrize("proactive", [False, True])
def test_specedge_baseline_with_proactive_drafting(proactive):
    drafter = SpecEdgeDrafter(MarkovSlm(), passes=2)
    opts = SessionOptions(proactive=(lambda tree: proactive_draft(tree, markov_slm, passes=2)) if proactive
                          else None)
    session = PhoneSession(drafter, prompt_tokens=PROMPT, request={"prompt": PROMPT, "max_tokens": 30},
                           endpoint="completions", spec=SPEC, options=opts)
    result, _ = run({"next_fn": markov}, session)
    assert result.token_ids == greedy(PROMPT, 30, markov)
    hits = [r.proactive_hit for r in result.rounds]
    if proactive:
        assert hits[0] is False and any(hits[1:])  # round 0 has no bet; the Markov bets then hit
        assert all(r.draft_ms >= 0 for r in result.rounds)
    else:
        assert set(hits) == {None}


def test_hyco_phone_restored_after_a_crash_with_a_tree_in_flight():
    """A fresh HyCo phone (empty SLM and MTP rings) takes over from a snapshot: the SLM is prefilled with
    the committed context, the lost tree's path becomes catch-up rows, the seed refills the MTP ring."""
    import asyncio
    import json

    from test_client_loop import FakeHycoServer

    from mobile_client.client import HycoClient, PhoneTimeoutError, Timeouts

    async def go():
        async with FakeHycoServer(chunk_bytes=700, silent={3}) as server:
            kw = dict(timeouts=Timeouts(5, 1.5, 0.5), retry_delay_s=0.001)
            phone, _, _ = hyco_phone()
            drafter = Grafted(phone)
            first = drafter.session = hyco_session(drafter, max_tokens=24)
            with pytest.raises(PhoneTimeoutError):
                await HycoClient(server.url, max_retries=0, **kw).run(first)
            snap = json.loads(json.dumps(first.snapshot()))
            phone2, mtp2, slm2 = hyco_phone()
            drafter2 = Grafted(phone2)
            again = drafter2.session = PhoneSession.restore(drafter2, snap, spec=SPEC)
            seen = []
            return await HycoClient(server.url, **kw).run(again, _invariants(again, mtp2, slm2, seen)), seen
    result, seen = asyncio.run(go())
    assert result.token_ids == greedy(PROMPT, 24)
    assert result.rounds[0].round == 3 and len(seen) == len(result.rounds) - 1
