"""Failover on the phone side (client.py + session.py) against the fake server of ``test_client_loop``: a
server that lost its sessions (a replica restarted, or another replica behind a proxy) answers the resume
with ``unknown_session``; the client reopens the session from the prompt + committed tokens and the tokens
continue exactly as plain greedy decoding, none lost or repeated. A proxy whose upstream is gone (HTTP 502
at the handshake) triggers the same after ``failover_after`` tries. The reconnect carries the routing key.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from test_client_loop import PROMPT, FakeHycoServer, greedy, make_session, text_of

from mobile_client.client import HycoClient, HycoServerError, Timeouts


class ForgetfulServer(FakeHycoServer):
    """Closes the connection after the verdict of each round in ``forget_at`` and forgets every session
    (a replica that died and came back empty); with ``gateway_errors`` it first answers that many
    handshakes that carry a routing key with HTTP 502 (a proxy whose upstream is down). ``routes`` (the
    base class's) records every handshake's ``?route=``."""

    def __init__(self, *, forget_at=(), gateway_errors: int = 0, **kw):
        super().__init__(**kw)
        self.forget_at, self.gateway_errors = set(forget_at), gateway_errors

    async def handle(self, request):
        if request.query.get("route") is not None and self.gateway_errors > 0:
            self.gateway_errors -= 1
            self.routes.append(request.query.get("route"))
            return web.Response(status=502, text="bad gateway")
        return await super().handle(request)

    async def _tree(self, ws, state, tree):
        out = await super()._tree(ws, state, tree)
        if tree.round in self.forget_at and state.last_round == tree.round:
            self.forget_at.discard(tree.round)
            self.sessions.clear()
            return "close"
        return out


def _run(session, **server_kw):
    async def go():
        async with ForgetfulServer(**server_kw) as server:
            client = HycoClient(server.url, timeouts=Timeouts(connect_s=5, frame_s=5, close_s=1),
                                retry_delay_s=0.001)
            return await client.run(session), server
    return asyncio.run(go())


@pytest.mark.parametrize("rounds", [{0}, {2}, {1, 2}])
def test_unknown_session_reopens_with_the_committed_tokens(rounds):
    session = make_session(max_tokens=30)
    streamed = []
    session.on_text = streamed.append
    result, server = _run(session, forget_at=rounds)
    assert result.token_ids == greedy(PROMPT, 30)  # nothing lost, nothing repeated
    assert result.text == text_of(greedy(PROMPT, 30)) == "".join(streamed)
    assert session.failovers == len(rounds) and result.finish_reason == "length"
    fresh = [s for s in server.starts if s.request is not None]
    assert len(fresh) == 1 + len(rounds)
    for start in fresh[1:]:  # prompt + every token committed before, and the rest of max_tokens
        done = len(start.request["prompt"]) - len(PROMPT)
        assert start.request["prompt"] == PROMPT + greedy(PROMPT, done)
        assert start.request["max_tokens"] == 30 - done and done > 0
    assert "fake" in server.routes  # the resumes carried the routing key


def test_proxy_gateway_errors_trigger_a_failover():
    session = make_session(max_tokens=24)
    result, server = _run(session, forget_at={1}, gateway_errors=5)
    assert result.token_ids == greedy(PROMPT, 24)
    assert session.failovers == 1
    # two 502s on the resume (failover_after=2), then a new session without a routing key
    assert server.routes == [None, "fake", "fake", None]


def test_failover_is_bounded():
    session = make_session(max_tokens=40)
    with pytest.raises(HycoServerError) as e:
        _run(session, forget_at={0, 1, 2, 3})
    assert e.value.code == "unknown_session" and session.failovers == 2  # HycoClient(max_failovers=2)
    assert session.tokens == greedy(PROMPT, len(session.tokens))


def test_reopen_builds_a_completions_continuation_of_a_chat_session():
    from test_client_loop import OracleDrafter

    from mobile_client.session import PhoneSession

    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10, "min_tokens": 4,
            "temperature": 0.0, "stop": ["\n"]}
    s = PhoneSession(OracleDrafter(), prompt_tokens=PROMPT, request=body, endpoint="chat.completions")
    s.tokens = [5, 6, 7]
    s.reopen()
    assert s.endpoint == "completions" and s.sid is None and s.round == 0
    assert s.request == {"prompt": PROMPT + [5, 6, 7], "max_tokens": 7, "min_tokens": 1, "temperature": 0.0,
                         "stop": ["\n"]}
    s.tokens += [8, 9]
    s.reopen()  # counts from the last reopen
    assert s.request["max_tokens"] == 5 and s.request["prompt"] == PROMPT + [5, 6, 7, 8, 9]
    s.tokens += [1, 2, 3, 4, 5]
    assert not s.can_reopen()


