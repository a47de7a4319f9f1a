"""Fuzzing the session route of a real server (issue 6): >= 10,000 random and mutated frames (bad msgpack,
wrong types, huge arrays, bad parents, wrong rounds, unknown sessions, text and oversized messages) plus
handshakes without or with a wrong API key. The server never dies, answers every frame with exactly one
``error`` frame (a protocol code, a message, never ``internal_error``) or the handshake with 401, and a
well-behaved phone session running at the same time finishes with plain greedy decoding's text.

``start`` frames that are well-formed msgpack but that vLLM's own validation rejects (:data:`INVALID_STARTS`:
negative temperature, ``top_k`` -2, a prompt longer than the context, ids outside the vocabulary, another
model, ``n`` > 1, bad ``stop`` types...) get the client code the OpenAI routes would give (400-class, the
field named in the message), never ``internal_error``; edge values vLLM accepts (``top_k`` 0, ``max_tokens``
beyond the context, which is cut to the room left as the OpenAI routes do) open a session that verifies.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import msgpack
import pytest
from test_e2e_phone_support import (
    API_KEY,
    MODEL,
    RawPhone,
    http_get,
    make_client,
    make_phone,
    phone_server,
    start_frame,
    tree_frame,
)

from vllm_hyco.errors import HycoError
from vllm_hyco.handoff.client_frames import StartFrame
from vllm_hyco.handoff.frames import decode_client_frame, encode_frame, frame_to_wire
from vllm_hyco.handoff.limits import ERROR_CODES
from vllm_hyco.handoff.server_frames import ErrorFrame, SessionFrame, VerdictFrame

PROMPT = "And the LORD spake unto Moses, saying,"
MAX_TOKENS = 32
FRAMES_NO_SESSION = 9000  # on connections without a session
FRAMES_IN_SESSION = 1200  # trees that break a rule, on a connection whose session stays alive
BATCH = 300
SERVER_CODES = set(ERROR_CODES) - {"bad_verdict", "bad_handoff", "layout_mismatch", "scales_mismatch",
                                   "chunk_missing", "chunk_duplicate", "chunk_out_of_order", "chunk_corrupt"}
TEXT = object()  # marker: send as a text message
# OpenAI-body overrides of a valid completions `start` -> (code, field named in the message)
INVALID_STARTS = [
    ({"temperature": -1.0}, "bad_request", "temperature"),
    ({"temperature": "hot"}, "bad_request", "temperature"),
    ({"temperature": float("nan")}, "bad_request", "temperature"),
    ({"top_k": -2}, "bad_request", "top_k"),
    ({"top_k": 1.5}, "bad_request", "top_k"),
    ({"top_p": 0.0}, "bad_request", "top_p"),
    ({"top_p": 1.5}, "bad_request", "top_p"),
    ({"max_tokens": 0}, "bad_request", "max_tokens"),
    ({"max_tokens": -5}, "bad_request", "max_tokens"),
    ({"max_tokens": "8"}, "bad_request", "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": None}, "bad_request", "max_tokens"),
    ({"min_tokens": 50, "max_tokens": 8}, "bad_request", "min_tokens"),
    ({"min_tokens": -1}, "bad_request", "min_tokens"),
    ({"stop": 5}, "bad_request", "stop"),
    ({"stop": [1, 2]}, "bad_request", "stop"),
    ({"stop": [""]}, "bad_request", "stop"),
    ({"seed": "x"}, "bad_request", "seed"),
    ({"seed": 1.5}, "bad_request", "seed"),
    ({"ignore_eos": "yes"}, "bad_request", "ignore_eos"),
    ({"n": 2}, "unsupported_field", "n"),
    ({"n": 0}, "bad_request", "n"),
    ({"model": "gpt-4"}, "model_not_found", "model"),
    ({"logprobs": 3}, "unsupported_field", "logprobs"),
    ({"presence_penalty": 0.5}, "unsupported_field", "presence_penalty"),
    ({"prompt": "and " * 2000}, "bad_request", "prompt"),  # longer than the 1,024-token context
    ({"prompt": list(range(5, 1500))}, "bad_request", "prompt"),
    ({"prompt": [2, 5, 1 << 20]}, "bad_request", "prompt"),  # an id outside the vocabulary
    ({"prompt": [2, -1, 5]}, "bad_request", "prompt"),
    ({"prompt": [5]}, "bad_request", "prompt"),  # a session needs a root and one token before it
]
VALID_EDGES = [{"top_k": 0}, {"top_k": -1}, {"max_tokens": 1 << 40}, {"stop": "never-seen"},
               {"max_completion_tokens": 4, "max_tokens": None}, {"seed": -3, "temperature": 0.7}]


@pytest.fixture(scope="module")
def server(fixtures_dir):
    return phone_server(fixtures_dir)


def _random_obj(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return rng.randint(-(1 << 40), 1 << 40)
    if kind == 1:
        return rng.random() * 1e6
    if kind == 2:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randrange(5))]
    keys = ["type", "v", "round", "tokens", "parents", "labels", "endpoint", "request", "hyco", "x"]
    return {rng.choice(keys): _random_obj(rng, depth + 1) for _ in range(rng.randrange(6))}


def _valid_wires(rng: random.Random) -> list[dict]:
    tree = tree_frame(rng.randrange(4), rng.randrange(4096), [rng.randrange(4096) for _ in range(5)],
                      labels=[0, 1, 1, 2, 3, 4])
    from test_e2e_phone_support import resume_frame

    sid = "hyco." + rng.randbytes(16).hex()  # a well-formed id nobody holds
    return [frame_to_wire(tree), frame_to_wire(resume_frame(sid, rng.randrange(-1, 3))),
            frame_to_wire(start_frame(PROMPT))]


def _mutate_wire(rng: random.Random, wire: dict):
    w = dict(wire)
    op = rng.randrange(9)
    key = rng.choice(list(w))
    if op == 0:
        w.pop(key)
    elif op == 1:
        w[key] = _random_obj(rng)
    elif op == 2:
        w["unknown_" + str(rng.randrange(9))] = 1
    elif op == 3:
        w["v"] = rng.choice([0, 1, 3, -1, "2", None])  # 1: answered in a version-1 error frame
    elif op == 4 and "tokens" in w:  # huge arrays
        w["tokens"] = rng.randbytes(rng.choice([4 * 40, 4 * 300, 4 * 60000]))
        w["parents"] = bytes([255] + [0] * (len(w["tokens"]) // 4 - 1))
    elif op == 5 and "parents" in w:  # bad parents
        p = bytearray(w["parents"])
        p[rng.randrange(len(p))] = rng.randrange(256)
        w["parents"] = bytes(p)
    elif op == 6 and "request" in w:  # a broken OpenAI body
        w["request"] = rng.choice([{}, {"prompt": ""}, {"prompt": 5}, {"messages": []}, [1], "x",
                                   {"prompt": "x", "logit_bias": {"1": 2}}])
    elif op == 7:
        w["type"] = rng.choice(["verdict", "final", "", "TREE", 7])
    else:
        w[key] = [w[key]] * rng.randrange(1, 4000)
    return w


def _fuzz_frame(rng: random.Random, valid: list[dict]):
    """One frame that the server must refuse on a connection without a session, or None."""
    kind = rng.randrange(10)
    if kind == 0:
        data = rng.randbytes(rng.randrange(0, 300))
    elif kind == 1:
        data = msgpack.packb(_random_obj(rng), use_bin_type=True)
    elif kind == 2:
        data = bytearray(msgpack.packb(rng.choice(valid), use_bin_type=True))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data[: rng.randrange(1, len(data) + 1)])
    elif kind == 3:
        return TEXT
    elif kind == 4:  # well-formed: a resume of a session nobody holds, or a tree without a session
        data = msgpack.packb(valid[rng.randrange(2)], use_bin_type=True)
    else:
        data = msgpack.packb(_mutate_wire(rng, rng.choice(valid)), use_bin_type=True)
    try:
        frame = decode_client_frame(data)
    except HycoError:
        return data
    if isinstance(frame, StartFrame) and frame.hyco.resume is None:
        return None  # a valid new session: not a fuzz frame
    return data


async def _exchange(phone: RawPhone, frames: list) -> list[ErrorFrame]:
    for f in frames:
        if f is TEXT:
            await phone.ws.send_str("{\"type\": \"tree\"}")
        else:
            await phone.send(f)
    out = []
    for _ in frames:
        reply = await phone.recv(timeout=120)
        assert isinstance(reply, ErrorFrame), reply
        out.append(reply)
    return out


async def _no_session_fuzz(http, server: str, seed: int, count: int) -> dict[str, int]:
    rng, codes = random.Random(seed), {}
    valid = _valid_wires(rng)
    sent = 0
    while sent < count:
        async with RawPhone(http, server) as phone:
            for _ in range(5):
                batch = [f for f in (_fuzz_frame(rng, valid) for _ in range(BATCH)) if f is not None]
                if rng.random() < 0.1:
                    batch.append(b"\x93" + b"\x00" * ((1 << 20) + 10))  # over max_client_frame_bytes
                for e in await _exchange(phone, batch):
                    assert e.code in SERVER_CODES and e.code != "internal_error" and e.message, e
                    codes[e.code] = codes.get(e.code, 0) + 1
                sent += len(batch)
                valid = _valid_wires(rng)
    return codes


def _bad_tree(rng: random.Random, root: int, expected_round: int, schema: bytes) -> tuple[bytes, set[str]]:
    kind = rng.randrange(6)
    nodes = [rng.randrange(4096) for _ in range(rng.randrange(1, 10))]
    s = {"schema": schema}  # every tree confirms the session's schema hash
    if kind == 0:  # wrong round
        rnd = rng.choice([expected_round + 1, expected_round + 7, max(0, expected_round - 1) + 100])
        return encode_frame(tree_frame(rnd, root, nodes, **s)), {"bad_round"}
    if kind == 1:  # wrong root
        return encode_frame(tree_frame(expected_round, (root + 1) % 4096, nodes, **s)), {"bad_tree"}
    if kind == 2:  # duplicate siblings
        return encode_frame(tree_frame(expected_round, root, [7, 7], [-1, 0, 0], **s)), {"bad_tree"}
    if kind == 3:  # token outside the vocabulary
        return encode_frame(tree_frame(expected_round, root, [1 << 20], **s)), {"bad_tree"}
    if kind == 4:  # over the node limit
        return encode_frame(tree_frame(expected_round, root, list(range(40)), **s)), {"too_many_nodes"}
    wire = frame_to_wire(tree_frame(expected_round, root, nodes, **s))  # a parent after its child
    p = bytearray(wire["parents"])
    p[-1] = len(p) - 1
    wire["parents"] = bytes(p)
    return msgpack.packb(wire, use_bin_type=True), {"bad_parents"}


async def _in_session_fuzz(http, server: str, tok, seed: int) -> int:
    rng = random.Random(seed)
    ids = tok.encode(PROMPT)
    async with RawPhone(http, server) as phone:
        await phone.send(start_frame(PROMPT, 4))
        ack = await phone.recv()
        assert isinstance(ack, SessionFrame)
        sent = 0
        while sent < FRAMES_IN_SESSION:
            batch = [_bad_tree(rng, ids[-1], 0, ack.schema_hash) for _ in range(BATCH)]
            replies = await _exchange(phone, [b for b, _ in batch])
            for (_, want), e in zip(batch, replies):
                assert e.code in want and not e.fatal, (e, want)
            sent += len(batch)
        await phone.send(tree_frame(0, ids[-1], []))  # the session survived every refusal
        assert isinstance(await phone.recv(), VerdictFrame)
    return sent


def _start(overrides: dict) -> bytes:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    body.update(overrides)
    wire = frame_to_wire(start_frame(PROMPT))
    wire["request"] = {k: v for k, v in body.items() if v is not None}
    return msgpack.packb(wire, use_bin_type=True)


async def _invalid_starts(http, server: str, tok) -> dict[str, int]:
    """Every INVALID_STARTS body gets its client code, naming the field, on a connection that stays open;
    every VALID_EDGES body opens a session that verifies round 0."""
    codes: dict[str, int] = {}
    async with RawPhone(http, server) as phone:
        for _ in range(3):
            for overrides, code, name in INVALID_STARTS:
                await phone.send(_start(overrides))
                e = await phone.recv(timeout=120)
                assert isinstance(e, ErrorFrame) and e.code == code and e.fatal, (overrides, e)
                assert name in e.message and ERROR_CODES[code].side == "client", (overrides, e)
                codes[code] = codes.get(code, 0) + 1
        for overrides in VALID_EDGES:
            await phone.send(_start(overrides))
            ack = await phone.recv(timeout=120)  # protocol v2: the session frame comes first
            assert isinstance(ack, SessionFrame), (overrides, ack)
            prompt = overrides.get("prompt", PROMPT)
            await phone.send(tree_frame(0, tok.encode(prompt)[-1], []))
            v = await phone.recv(timeout=120)
            assert isinstance(v, VerdictFrame), (overrides, v)
            while True:  # drain the round's hand-off chunks and a `final`, if any
                try:
                    await phone.recv(timeout=0.5)
                except asyncio.TimeoutError:
                    break
    return codes


async def _bad_keys(server: str, count: int) -> int:
    refused = 0
    async with aiohttp.ClientSession() as http:
        for i in range(count):
            headers = {} if i % 2 else {"Authorization": f"Bearer wrong-{i}"}
            try:
                async with http.ws_connect(f"{server.replace('http', 'ws', 1)}/v1/hyco/session", headers=headers):
                    pass
            except aiohttp.WSServerHandshakeError as e:
                refused += e.status == 401
    return refused


def test_fuzz_frames_while_a_phone_decodes(server, fixtures_dir):
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))
    oai = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, timeout=300, max_retries=0)
    ref = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                 extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]

    async def run():
        session = make_phone(tok.encode(PROMPT), PROMPT, MAX_TOKENS, ref.model_extra["token_ids"], len(tok),
                             seed=9, request={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                              "temperature": 0.0, "ignore_eos": True})
        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(
                _no_session_fuzz(http, server, 1, FRAMES_NO_SESSION // 2),
                _no_session_fuzz(http, server, 2, FRAMES_NO_SESSION // 2),
                _in_session_fuzz(http, server, tok, 3), _bad_keys(server, 40),
                _invalid_starts(http, server, tok), make_client(server, http=http).run(session))
        return session, results

    session, (codes_a, codes_b, in_session, refused, invalid, _) = asyncio.run(run())
    codes = {k: codes_a.get(k, 0) + codes_b.get(k, 0) for k in set(codes_a) | set(codes_b)}
    total = sum(codes.values()) + in_session
    print(f"fuzz: {total} frames refused, codes {sorted(codes.items())}, {refused} handshakes refused, "
          f"invalid starts {sorted(invalid.items())}")
    assert sum(invalid.values()) == 3 * len(INVALID_STARTS)
    assert total >= 10_000 and refused == 40
    assert {"bad_msgpack", "bad_field_type", "unknown_field", "unknown_session", "no_session",
            "frame_too_large", "unsupported_version"} <= set(codes)
    assert "".join(session.text_parts) == ref.text
    assert http_get(f"{server}/health")[0] == 200
