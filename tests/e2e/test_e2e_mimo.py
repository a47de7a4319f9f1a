"""Issue 35, the MiMo shape end to end on a real server (127.0.0.1; the trained MiMo-shaped family, fp32,
``hyco_lab.fixtures.trained.install_mimo``): ``vllm-hyco serve DIR/verifier --speculative-config hyco`` with
the verifier folder as vLLM's MTP drafter for ordinary requests (``mimo_mtp``), and phones whose MTP Drafter
is the checkpoint's own MTP layer, its KV kept on the phone from the hand-off's h rows (schema 3,
``mobile_client.drafters.own_mtp``).

* Greedy exact sessions commit plain greedy's token ids and text (plain: the OpenAI completions route of the
  same server, which vLLM's MTP speculates), the MTP chain is drafted every round after the seed and some of
  it is accepted (MAT > 1), and every verdict carried the h rows.
* A phone bundle of another family (the Gemma-4 fixtures) is refused at the handshake, naming the model
  bundle, and the server keeps serving.
* With ``HYCO_PHONE_BUILD_MIMO`` set to ``python -m mobile_client.export.build OUT --fixtures FAMILY``'s OUT, a
  phone whose MTP layer runs the compiled step (``own_mtp_ctx.onnx`` on the x86 HTP emulator) commits plain
  greedy's tokens too.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from test_e2e_phone_support import API_KEY, MODEL, make_client, plain_greedy

from mobile_client.bundle import load_bundle
from mobile_client.session import PhoneSession, SessionOptions

MAX_TOKENS = 32
PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "The LORD is my shepherd;"]


@pytest.fixture(scope="module")
def family(mimo_family_dir) -> Path:
    return mimo_family_dir


@pytest.fixture(scope="module")
def server(family):
    from hyco_lab.bench.server import BenchServer

    spec = {"method": "hyco", "model": str(family / "verifier"), "num_speculative_tokens": 2}
    # BenchServer names the model hyco-bench; the last --served-model-name wins; it adds --trust-remote-code
    srv = BenchServer(family / "verifier", json.dumps(spec), max_num_seqs=8,
                      extra_args=["--served-model-name", MODEL, "--api-key", API_KEY], threads=None)
    with srv as running:  # __enter__ starts it
        yield running.url


@pytest.fixture(scope="module")
def tok(family):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(family / "verifier"), trust_remote_code=True)


@pytest.fixture(scope="module")
def plain(server):
    return plain_greedy(server, PROMPTS, MAX_TOKENS)


def _session(bundle_dir: Path, tok, prompt: str, backend: str = "torch", build: Path | None = None,
             opening: str = "slm") -> PhoneSession:
    bundle = load_bundle(bundle_dir, backend, build)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    session = PhoneSession(bundle.drafter, prompt_tokens=tok(prompt)["input_ids"], request=body,
                           endpoint="completions", spec=bundle.spec,
                           options=SessionOptions(node_budget=32, opening=opening))
    return session


def test_phone_sessions_with_the_own_kv_mtp_layer_equal_plain_greedy(server, family, tok, plain):
    chains, mats = [], []
    for i, prompt in enumerate(PROMPTS):
        opening = ("slm", "root")[i % 2]  # both round-0 openings (SessionOptions.opening)
        session = _session(family, tok, prompt, opening=opening)
        assert session.spec is not None and session.spec.version == 3  # h rows: hand-off schema 3
        hybrid = session.drafter.drafter
        drafted = []
        propose = hybrid.propose

        def spy(context, node_budget, propose=propose, drafted=drafted, hybrid=hybrid):
            tree = propose(context, node_budget)
            drafted.append(len(hybrid.last_chain.chain))
            return tree

        hybrid.propose = spy
        result = asyncio.run(make_client(server).run(session))
        assert session.tokens == plain[prompt][1] and "".join(session.text_parts) == plain[prompt][0]
        if opening == "root":  # round 0 the root alone, then K = 4 from the seed on
            assert result.rounds[0].nodes == 0 and drafted and all(n == 4 for n in drafted), drafted
        else:  # round 0 the SLM's alone, then K = 4
            assert drafted[0] == 0 and all(n == 4 for n in drafted[1:]), drafted
        chains.append(drafted)
        mats.append(result.mat)
    assert max(mats) > 1.0, mats


def test_a_bundle_of_another_family_is_refused_at_the_handshake(server, family, fixtures_dir, tok, plain):
    from vllm_hyco.errors import HycoServerError

    if not (fixtures_dir / "handoff_scales.npz").exists():
        pytest.skip("the Gemma-4 fixtures have no hand-off scales: their phone sends no fingerprint")
    with pytest.raises(HycoServerError) as err:
        asyncio.run(make_client(server).run(_session(fixtures_dir, tok, PROMPTS[0])))
    assert err.value.code == "fingerprint_mismatch" and "model bundle" in str(err.value)
    session = _session(family, tok, PROMPTS[1])  # the server goes on serving
    asyncio.run(make_client(server).run(session))
    assert session.tokens == plain[PROMPTS[1]][1]


@pytest.mark.skipif(not os.environ.get("HYCO_PHONE_BUILD_MIMO"),
                    reason="set HYCO_PHONE_BUILD_MIMO to the output of python -m mobile_client.export.build OUT "
                           "--fixtures FAMILY (the trained MiMo family)")
def test_a_phone_with_the_compiled_mtp_layer_equals_plain_greedy(server, family, tok, plain):
    """Both steps compiled (the SLM's and the MTP layer's contexts, on the x86 HTP emulator)."""
    session = _session(family, tok, PROMPTS[0], "compiled", Path(os.environ["HYCO_PHONE_BUILD_MIMO"]))
    assert session.drafter.mtp.step is not None  # the QNN context (x86: the HTP emulator), not the torch layer
    result = asyncio.run(make_client(server).run(session))
    assert session.tokens == plain[PROMPTS[0]][1] and result.mat > 1.0, result.mat
