"""Issue 6 on a real server (127.0.0.1, tiny fp32 fixtures, greedy exact mode): phone sessions through
``HycoClient`` / the reference phone stream exactly plain decoding; the official ``openai`` client streams
ordinary completions while 8 phone sessions run; the API key guards the route (401 + JSON at the
handshake); ``/metrics`` shows the HyCo series. One shared server (``test_e2e_phone_support``).
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest
from test_e2e_phone_support import (
    API_KEY,
    MAX_SESSIONS,
    MODEL,
    RawPhone,
    http_get,
    make_client,
    make_phone,
    metric_values,
    phone_server,
    plain_greedy,
    start_frame,
    tree_frame,
    wait_drained,
)

from vllm_hyco.handoff.server_frames import ErrorFrame, FinalFrame, SessionFrame, VerdictFrame

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "Blessed are the",
           "The LORD is my shepherd;", "For God so loved", "Jesus wept. And", "Let there be light:",
           "Thou shalt not", "And it came to pass"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(fixtures_dir):
    return phone_server(fixtures_dir)


@pytest.fixture(scope="module")
def tok(fixtures_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))


@pytest.fixture(scope="module")
def oai(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def plain(server):
    """Plain greedy decoding of every prompt through the OpenAI completions endpoint (the reference):
    ``{prompt: (text, token ids)}``."""
    return plain_greedy(server, PROMPTS, MAX_TOKENS)


def _phone(tok, prompt: str, reference: tuple[str, list[int]], seed: int, p_plant: float = 0.8):
    ids = tok.encode(prompt, add_special_tokens=True)
    target = reference[1]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return make_phone(ids, prompt, MAX_TOKENS, target, len(tok), seed=seed, p_plant=p_plant, request=body)


def test_phone_session_equals_plain_decoding(server, tok, plain):
    prompt = PROMPTS[0]
    session = _phone(tok, prompt, plain[prompt], seed=1)
    rounds = []
    result = asyncio.run(make_client(server).run(session, on_round=rounds.append))
    assert "".join(session.text_parts) == plain[prompt][0]
    assert session.tokens == plain[prompt][1]
    assert session.finish_reason == "length" and len(session.tokens) == MAX_TOKENS
    assert session.final is not None and session.final.completion_tokens == MAX_TOKENS
    assert session.final.rounds == len(rounds) and session.final.bytes_up > 0 and session.final.bytes_down > 0
    assert result.mat > 1.0  # the planted continuation was accepted in some rounds
    assert any(r.accepted >= 2 for r in rounds)


def test_random_trees_still_equal_plain(server, tok, plain):
    prompt = PROMPTS[1]
    session = _phone(tok, prompt, plain[prompt], seed=2, p_plant=0.0)
    asyncio.run(make_client(server).run(session))
    assert "".join(session.text_parts) == plain[prompt][0]


def test_chat_session_streams_chat_chunks(server, tok, oai):
    messages = [{"role": "user", "content": "Recite Genesis 1:1."}]
    ref = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].message.content
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    session = make_phone(ids, "", 24, tok.encode(ref, add_special_tokens=False), len(tok), seed=3,
                         endpoint="chat.completions", request=body)
    asyncio.run(make_client(server).run(session))
    assert "".join(session.text_parts) == ref


def test_openai_streams_while_eight_phones_run(server, tok, oai, plain):
    results: dict = {}

    def ordinary():
        pieces = []
        for chunk in oai.completions.create(model=MODEL, prompt="Thou shalt not", max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}):
            pieces.append(chunk.choices[0].text)
        results["stream"] = "".join(pieces)

    async def phones():
        sessions = [_phone(tok, p, plain[p], seed=10 + i) for i, p in enumerate(PROMPTS[1:9])]
        async with aiohttp.ClientSession() as http:
            client = make_client(server, http=http)
            await asyncio.gather(*(client.run(s) for s in sessions))
        return sessions

    thread = threading.Thread(target=ordinary)
    thread.start()
    sessions = asyncio.run(phones())
    thread.join(timeout=600)
    assert results["stream"] == plain["Thou shalt not"][0]
    for prompt, s in zip(PROMPTS[1:9], sessions):
        assert "".join(s.text_parts) == plain[prompt][0], prompt


def test_api_key_guards_the_route(server):
    async def handshake(headers):
        async with aiohttp.ClientSession() as http:
            try:
                async with http.ws_connect(f"{server.replace('http', 'ws')}/v1/hyco/session", headers=headers):
                    return 101, None
            except aiohttp.WSServerHandshakeError as e:
                return e.status, e.headers

    assert asyncio.run(handshake({}))[0] == 401
    assert asyncio.run(handshake({"Authorization": "Bearer wrong"}))[0] == 401
    assert asyncio.run(handshake({"Authorization": f"Bearer {API_KEY}"}))[0] == 101
    # the body of the refusal, read with a raw HTTP upgrade request
    import http.client

    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/hyco/session", headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                                     "Sec-WebSocket-Version": "13",
                                                     "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 401 and body["error"]["code"] == "unauthorized" and body["error"]["message"]


def test_metrics_show_hyco_sessions(server):
    status, _ = http_get(f"{server}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert status == 200
    assert sum(metric_values(server, "vllm_hyco_rounds_total").values()) > 0
    accepted = metric_values(server, "vllm_hyco_accepted_tokens_total")
    assert accepted and any('depth="1"' in k and 'source="chain"' in k for k in accepted)
    assert metric_values(server, "vllm_hyco_bytes_total")
    wait_drained(server)  # sessions dropped by earlier tests expire after the idle timeout
    assert metric_values(server, "vllm_hyco_parked_sessions") == {"": 0.0}
    assert sum(metric_values(server, "vllm_hyco_sessions_total").values()) > 0


def test_session_limit_refuses_and_closes(server, tok):
    """``max_sessions`` sessions open; one more start gets ``too_many_sessions`` (fatal) and a close; the
    others are unaffected and finish."""
    import time

    ids = tok.encode(PROMPTS[0])
    wait_drained(server)  # the limit counts every held session, also those dropped by earlier tests

    async def run():
        async with aiohttp.ClientSession() as http:
            phones = [RawPhone(http, server) for _ in range(MAX_SESSIONS)]
            for p in phones:
                await p.__aenter__()
                await p.send(start_frame(PROMPTS[0], max_tokens=1))
            deadline = time.monotonic() + 300
            while json.loads(http_get(f"{server}/v1/hyco/stats",
                                      headers={"Authorization": f"Bearer {API_KEY}"})[1])["sessions"] < MAX_SESSIONS:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
            async with RawPhone(http, server) as extra:
                await extra.send(start_frame(PROMPTS[0], max_tokens=1))
                err = await extra.recv()
                assert isinstance(err, ErrorFrame) and err.code == "too_many_sessions" and err.fatal
                with pytest.raises(ConnectionError):
                    await extra.recv(timeout=30)
            for p in phones:
                assert isinstance(await p.recv(), SessionFrame)
                await p.send(tree_frame(0, ids[-1], []))  # RawPhone adds the schema hash
            for p in phones:
                v = await p.recv()
                while isinstance(v, ErrorFrame) and v.code == "server_busy":  # more sessions than batch slots
                    await asyncio.sleep(0.05)
                    await p.send(tree_frame(0, ids[-1], []))
                    v = await p.recv()
                assert isinstance(v, VerdictFrame) and v.finish_reason == "length"
                assert isinstance(await p.recv(), FinalFrame)
                await p.__aexit__()

    asyncio.run(run())
