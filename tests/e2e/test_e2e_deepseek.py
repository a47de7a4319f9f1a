"""Issue 35, the DeepSeek-V3 shape on a real server (127.0.0.1; random fp32 weights, MLA at ``kv_lora_rank`` 512 /
rope 64): ``vllm-hyco serve DIR --speculative-config hyco`` on vLLM's CPU build, where MLA turns chunked prefill
and prefix caching off and forces block size 16.

* A phone from a model bundle of this family (the verifier's config and the project's SLM, no scales) drafts
  SLM-only trees (no phone-sized MTP module: the paper's Appendix H) and commits plain greedy's tokens.
* A phone whose connection is cut mid-round, again and again, resumes and loses no token.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_e2e_phone_support import API_KEY, MODEL, KillingProxy, make_client, make_phone, plain_greedy

from mobile_client.bundle import load_bundle
from mobile_client.session import PhoneSession, SessionOptions

PROMPT = "And God said, Let there be"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(deepseek_dir):
    from hyco_lab.bench.server import BenchServer

    srv = BenchServer(deepseek_dir, json.dumps({"method": "hyco"}), max_num_seqs=8,
                      extra_args=["--served-model-name", MODEL, "--api-key", API_KEY], threads=None)
    with srv as running:  # __enter__ starts it
        yield running.url


@pytest.fixture(scope="module")
def tok(deepseek_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(deepseek_dir))


@pytest.fixture(scope="module")
def plain(server):
    return plain_greedy(server, [PROMPT], MAX_TOKENS)[PROMPT]


def test_a_bundle_of_this_family_drafts_slm_only_trees_and_equals_plain_greedy(server, deepseek_dir, fixtures_dir,
                                                                               tok, plain, tmp_path: Path):
    bundle_dir = tmp_path / "bundle"
    bundle_dir.mkdir()
    (bundle_dir / "verifier").symlink_to(deepseek_dir)
    (bundle_dir / "slm").symlink_to(fixtures_dir / "slm")
    bundle = load_bundle(bundle_dir)
    assert bundle.spec is None and bundle.drafter.mtp is None  # SLM-only: no scales, no phone MTP
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    session = PhoneSession(bundle.drafter, prompt_tokens=tok(PROMPT)["input_ids"], request=body,
                           endpoint="completions", options=SessionOptions(node_budget=32))
    asyncio.run(make_client(server).run(session))
    assert session.tokens == plain[1] and "".join(session.text_parts) == plain[0]


def test_killed_connections_lose_no_token_under_mla(server, tok, plain):
    async def run():
        async with KillingProxy(server, kills=3, seed=7) as proxy:
            session = make_phone(tok(PROMPT)["input_ids"], PROMPT, MAX_TOKENS, plain[1], len(tok), seed=3,
                                 p_plant=0.5, request={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0.0, "ignore_eos": True})
            await make_client(proxy.base, max_retries=20).run(session)
            return session, proxy.cut

    session, cut = asyncio.run(run())
    assert cut >= 2 and session.resumes >= 1
    assert session.tokens == plain[1] and "".join(session.text_parts) == plain[0]
