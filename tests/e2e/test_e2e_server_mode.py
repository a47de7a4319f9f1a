"""Issue 33 on a real server (the shared one, whose hyco spec has the family's MTP ``model``): server mode on
the wire. Greedy sessions that switch every round, that the rule moves mid-answer (and back), that drop and
resume mid-stretch, all commit plain greedy's tokens; a phone that stops acknowledging stops the server's
decoding within its credit window; bad mode frames get typed, non-fatal errors and the session goes on.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from test_e2e_phone_support import (
    MODEL,
    RawPhone,
    make_client,
    make_phone,
    metric_values,
    phone_server,
    plain_greedy,
    start_frame,
)

from mobile_client.mode_rule import Alternate, ModeRule, ModeRuleConfig, ServerOnly
from vllm_hyco.handoff.client_frames import ClientCapabilities, HycoOptions, ResumeRequest, StartFrame
from vllm_hyco.handoff.mode_frames import AckFrame, ModeAckFrame, ModeFrame, PingFrame, PongFrame, TokensFrame
from vllm_hyco.handoff.server_frames import ErrorFrame, FinalFrame, SessionFrame

PROMPTS = ["In the beginning God created", "And the LORD said unto Moses,", "Blessed are the"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(fixtures_dir):
    return phone_server(fixtures_dir)


@pytest.fixture(scope="module")
def tok(fixtures_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))


@pytest.fixture(scope="module")
def plain(server):
    return plain_greedy(server, PROMPTS, MAX_TOKENS)


def _session(tok, prompt, plain, seed=0):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return make_phone(tok.encode(prompt, add_special_tokens=True), prompt, MAX_TOKENS, plain[prompt][1], len(tok),
                      seed=seed, request=body)


def test_a_session_switched_every_round_is_plain_greedy(server, tok, plain):
    prompt = PROMPTS[0]
    session = _session(tok, prompt, plain)
    rounds = []
    client = make_client(server, mode_policy=Alternate(stretch_tokens=3), window=3)
    result = asyncio.run(client.run(session, rounds.append))
    assert result.token_ids == plain[prompt][1] and result.text == plain[prompt][0]
    modes = [r.mode for r in rounds]
    switches = sum(a != b for a, b in zip(modes, modes[1:]))
    assert switches >= 4, modes
    assert result.final is not None and 0 < result.final.server_tokens < MAX_TOKENS


def test_the_rule_moves_a_session_mid_answer_and_back(server, tok, plain):
    """The app's power flag drops after two phone rounds (server mode) and comes back after 8 server tokens
    (phone mode again, once the hysteresis window has passed): plain greedy's tokens throughout."""
    prompt = PROMPTS[1]
    state = {"ok": True, "server_tokens": 0}
    class PowerRule(ModeRule):  # the power flag alone: the shared server's cost figures are not this test's
        def observe_offer(self, offers_server, server_tps, *costs):
            super().observe_offer(offers_server, server_tps)

    rule = PowerRule(ModeRuleConfig(floor_tps=0.01, hold_s=0.0, min_rounds=1, window=4),
                     power_ok=lambda: state["ok"])
    rounds = []

    def on_round(r):
        rounds.append(r)
        if r.mode == "phone" and len(rounds) == 2:
            state["ok"] = False
        if r.mode == "server":
            state["server_tokens"] += r.committed
            state["ok"] = state["server_tokens"] >= 8

    session = _session(tok, prompt, plain)
    result = asyncio.run(make_client(server, mode_policy=rule).run(session, on_round))
    assert result.token_ids == plain[prompt][1] and result.text == plain[prompt][0]
    modes = [r.mode for r in rounds]
    assert modes[:2] == ["phone", "phone"] and "server" in modes and modes[-1] == "phone", modes
    assert rule.switches == 2, " ".join(modes)


async def _drain(phone: RawPhone, until, timeout: float = 60.0) -> list:
    frames = []
    while True:
        f = await asyncio.wait_for(phone.recv(), timeout)
        frames.append(f)
        if until(f):
            return frames


def test_drop_and_resume_mid_stretch_loses_nothing(server, tok, plain):
    prompt = PROMPTS[2]

    async def go():
        async with aiohttp.ClientSession() as http:
            async with RawPhone(http, server) as a:
                await a.send(start_frame(prompt, max_tokens=MAX_TOKENS))
                ack = await a.recv()
                assert isinstance(ack, SessionFrame) and ack.mode == "phone" and ack.offers_server
                await a.send(ModeFrame("server", 0, window=6))
                got = await _drain(a, lambda f: isinstance(f, TokensFrame) and f.offset + len(f.tokens) >= 4)
                assert isinstance(got[0], ModeAckFrame) and got[0].mode == "server" and got[0].exact
                held = [t for f in got if isinstance(f, TokensFrame) for t in f.tokens]
                sid = ack.session_id
            # the socket is gone mid-stretch: the server parks the session; a resume replays what is missing
            async with RawPhone(http, server) as b:
                caps = ClientCapabilities()
                await b.send(StartFrame("completions", None, HycoOptions(
                    "exact", None, caps, resume=ResumeRequest(sid, -1, False, len(held)))))
                again = await b.recv()
                assert isinstance(again, SessionFrame) and again.mode == "server" and again.tokens >= len(held)
                tokens = list(held)
                while True:
                    f = await asyncio.wait_for(b.recv(), 60)
                    if isinstance(f, TokensFrame):
                        assert f.offset == len(tokens)
                        tokens += f.tokens
                        await b.send(AckFrame(len(tokens)))
                    if isinstance(f, FinalFrame):
                        assert f.server_tokens == MAX_TOKENS
                        return tokens

    assert asyncio.run(go()) == plain[prompt][1]


def test_a_phone_that_stops_reading_stops_the_decoding(server, tok, plain):
    window = 6

    async def go():
        async with aiohttp.ClientSession() as http, RawPhone(http, server) as a:
            await a.send(start_frame(PROMPTS[0], max_tokens=400))
            await a.recv()
            paused = sum(metric_values(server, "vllm_hyco_server_mode_paused_total").values())
            await a.send(ModeFrame("server", 0, window=window))
            sent = 0
            try:
                while True:
                    f = await asyncio.wait_for(a.recv(), 3.0)
                    if isinstance(f, TokensFrame):
                        sent += len(f.tokens)
            except asyncio.TimeoutError:
                pass
            # the window, plus what the steps in flight when it ran out had committed
            assert window <= sent <= window + 2 * 5, sent
            assert sum(metric_values(server, "vllm_hyco_server_mode_paused_total").values()) > paused
            await a.send(AckFrame(sent))  # credit again: the stretch goes on
            f = await asyncio.wait_for(a.recv(), 60)
            assert isinstance(f, TokensFrame) and f.offset == sent
            await a.send(ModeFrame("phone", 0))
            back = await _drain(a, lambda f: isinstance(f, ModeAckFrame))
            assert back[-1].mode == "phone" and back[-1].round == 1 and back[-1].node_budget >= 1

    asyncio.run(go())


def test_bad_mode_frames_get_typed_errors_and_the_session_goes_on(server, tok, plain):
    prompt = PROMPTS[0]

    async def go():
        async with aiohttp.ClientSession() as http, RawPhone(http, server) as a:
            await a.send(start_frame(prompt, max_tokens=8))
            await a.recv()
            await a.send(ModeFrame("server", 3))  # a round ahead
            e = await a.recv()
            assert isinstance(e, ErrorFrame) and e.code == "bad_round" and not e.fatal
            raw = bytearray(await _raw_mode(b"turbo"))
            await a.ws.send_bytes(bytes(raw))
            e = await a.recv()
            assert isinstance(e, ErrorFrame) and e.code == "bad_field_value" and "phone" in e.message
            await a.send(PingFrame(7))
            pong = await a.recv()
            assert isinstance(pong, PongFrame) and pong.nonce == 7 and pong.offers_server
            await a.send(ModeFrame("server", 0, window=64))
            assert isinstance(await a.recv(), ModeAckFrame)
            from test_e2e_phone_support import tree_frame

            await a.send(tree_frame(0, 5))  # a tree in server mode
            frames = await _drain(a, lambda f: isinstance(f, (ErrorFrame, FinalFrame)))
            errs = [f for f in frames if isinstance(f, ErrorFrame)]
            assert errs and errs[0].code == "wrong_mode" and not errs[0].fatal
            if not isinstance(frames[-1], FinalFrame):
                await _drain(a, lambda f: isinstance(f, FinalFrame))

    asyncio.run(go())


async def _raw_mode(mode: bytes) -> bytes:
    import msgpack

    return msgpack.packb({"type": "mode", "v": 3, "mode": mode.decode(), "round": 0})


def test_server_only_sessions_and_mode_metrics(server, tok, plain):
    prompt = PROMPTS[2]
    key = '{mode="server"}'
    before = metric_values(server, "vllm_hyco_mode_tokens_total").get(key, 0.0)
    result = asyncio.run(make_client(server, mode_policy=ServerOnly()).run(_session(tok, prompt, plain)))
    assert result.token_ids == plain[prompt][1]
    assert all(r.mode == "server" for r in result.rounds) and result.final.server_tokens == MAX_TOKENS
    assert metric_values(server, "vllm_hyco_mode_tokens_total")[key] >= before + MAX_TOKENS
