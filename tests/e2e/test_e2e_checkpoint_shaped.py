"""A whole HyCo session on the fixture shaped like the real Gemma 4 26B-A4B checkpoint, over the real server.

``vllm-hyco serve DIR/verifier --language-model-only`` (``Gemma4ForConditionalGeneration``, text model under
``language_model.``, 262,144-token vocabulary, 128 experts top-8; both variants: every layer owning its
KV cache, and KV-shared trailing layers) and phones whose drafters come from the same bundle
(``hyco-phone``'s ``load_bundle``: the MTP head on the hand-off rows + the SLM, flat hand-off scales).
Every round carries a hand-off the phone applies, and the committed text must be plain greedy decoding's. Random weights accept almost
nothing, so a second phone also grafts plain decoding's next tokens into its trees (deep acceptance).
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from checkpoint_shaped import bundle, start_server

from hyco_lab.bench.server import stop_process
from mobile_client.cli import load_bundle
from mobile_client.client import HycoClient, Timeouts
from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree

API_KEY = "hyco-shaped-key"
NAME = "shaped"
PROMPT = [2, 1427, 281, 2099, 430, 3304, 281, 814]  # "In the beginning God created the heaven"
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=[False, True], ids=["own-kv", "kv-shared"])
def served(request):
    """(base URL, bundle root, plain greedy token ids, text): one server per variant (every layer owns its
    KV cache / trailing layers share another layer's), one at a time."""
    root = bundle(request.param)
    base, proc, _ = start_server(root / "verifier", NAME, API_KEY)
    try:
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, timeout=300, max_retries=0)
        choice = oai.completions.create(model=NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
        yield base, root, list(choice.model_extra["token_ids"]), choice.text
    finally:
        stop_process(proc)


class Planted:
    """The bundle drafter's tree (budget - depth nodes) plus plain decoding's next ``depth`` tokens grafted
    along the matching branch: nodes the SLM never computed, so the phone catches them up."""

    def __init__(self, inner, target: list[int], depth: int = 4):
        self.inner, self.target, self.depth, self.session = inner, target, depth, None
        for hook in ("prefill", "accept", "apply_handoff"):
            setattr(self, hook, getattr(inner, hook))

    def propose(self, context, tree_budget):
        tree = self.inner.propose(context, max(tree_budget - self.depth, 1))
        tokens, parents = list(tree.tokens), list(tree.parents)
        done = len(self.session.tokens)
        node = 0
        for y in self.target[done:done + min(self.depth, tree_budget - (len(tokens) - 1))]:
            kids = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == y]
            if kids:
                node = kids[0]
            else:
                tokens.append(y)
                parents.append(node)
                node = len(tokens) - 1
        return DraftTree.make_dummy(tokens, parents, budget=tree_budget)


@pytest.mark.parametrize("planted", [False, True], ids=["bundle", "planted"])
def test_phone_session_with_bundle_drafters_equals_plain(served, planted):
    base, root, ref, ref_text = served
    phone = load_bundle(root)
    assert phone.drafter.mtp is not None, phone.notes  # the MTP chain runs: a hand-off every round
    drafter = Planted(phone.drafter, ref) if planted else phone.drafter
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    session = PhoneSession(drafter, prompt_tokens=PROMPT, request=body, endpoint="completions",
                           spec=phone.spec, options=SessionOptions(max_nodes=32, keep_set_hash=phone.keep_set_hash))
    if planted:
        drafter.session = session
    rounds = []
    client = HycoClient(base, API_KEY, timeouts=Timeouts(connect_s=60, frame_s=300, final_s=60), offload=False)
    asyncio.run(client.run(session, on_round=rounds.append))
    assert session.tokens == ref and "".join(session.text_parts) == ref_text
    assert session.finish_reason == "length" and session.final.rounds == len(rounds)
    # every round but the finishing one carried a hand-off that the phone applied (apply_verdict refuses a
    # verdict without one); the MTP head's ring now ends at the last root
    assert phone.drafter.mtp is not None and session.held_round == len(rounds) - 1
    if planted:
        assert max(r.accepted for r in rounds) >= 3
