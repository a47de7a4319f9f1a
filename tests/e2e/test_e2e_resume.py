"""Resume on the real server (issue 6 item 4, docs/protocol.md section 3 "Resume"): a phone whose
connection is killed mid-round reconnects and finishes with no token lost; replays are byte-identical;
``need_seed`` replays carry a seed ``[max(0, t' - W), t')``; impossible or unknown resumes are refused.
Protocol version 2: every start and resume is answered by a ``session`` frame with the same schema hash,
which the next tree confirms; a version-1 phone gets ``unsupported_version`` in its own version.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from test_e2e_phone_support import (
    MODEL,
    KillingProxy,
    RawPhone,
    make_client,
    make_phone,
    phone_server,
    plain_greedy,
    resume_frame,
    start_frame,
    tree_frame,
)

from vllm_hyco.handoff.frames import encode_frame, frame_to_wire
from vllm_hyco.handoff.server_frames import ErrorFrame, FinalFrame, SessionFrame
from vllm_hyco.handoff.session_id import route_key

PROMPT = "And God said, Let there be"
MAX_TOKENS = 64
WINDOW = 128  # the fixtures' sliding window = the server's W


@pytest.fixture(scope="module")
def server(fixtures_dir):
    return phone_server(fixtures_dir)


@pytest.fixture(scope="module")
def tok(fixtures_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(fixtures_dir / "verifier"))


@pytest.fixture(scope="module")
def plain(server):
    return plain_greedy(server, [PROMPT], MAX_TOKENS)[PROMPT]


def test_killed_connections_lose_no_token(server, tok, plain):
    async def run():
        async with KillingProxy(server, kills=4, seed=3) as proxy:
            session = make_phone(tok.encode(PROMPT), PROMPT, MAX_TOKENS, plain[1], len(tok), seed=5, p_plant=0.3,
                                 request={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                          "temperature": 0.0, "ignore_eos": True})
            await make_client(proxy.base, max_retries=20).run(session)
            return session, proxy.cut

    session, cut = asyncio.run(run())
    assert cut >= 2 and session.resumes >= 1  # a cut before verdict 0 or after the last one needs no resume
    assert session.tokens == plain[1] and "".join(session.text_parts) == plain[0]


async def _resumed(phone: RawPhone, sid: str, last_round: int, need_seed: bool = False, schema_hash=None):
    """Send a resume; return its `session` frame (checked: same session, same schema) or the error."""
    await phone.send(resume_frame(sid, last_round, need_seed))
    ack = await phone.recv()
    if isinstance(ack, SessionFrame):
        assert ack.session_id == sid and (schema_hash is None or ack.schema_hash == schema_hash)
    return ack


def test_replays_seeds_and_refusals(server, tok, plain):
    ids = tok.encode(PROMPT)

    async def run():
        async with aiohttp.ClientSession() as http:
            async with RawPhone(http, server) as phone:
                await phone.send(start_frame(PROMPT, MAX_TOKENS))
                ack = await phone.recv()
                assert isinstance(ack, SessionFrame) and ack.last_round == -1 and route_key(ack.session_id) == "hyco"
                await phone.send(tree_frame(0, ids[-1], plain[1][:2]))  # with the schema hash (RawPhone)
                v0 = await phone.recv()
                assert v0.handoff is not None and v0.handoff.header.span_start == 0  # seed: prompt < W
                assert v0.handoff.header.root_position == len(ids) + len(v0.path)
                await phone.send(tree_frame(1, v0.bonus, plain[1][len(v0.tokens):len(v0.tokens) + 3]))
                v1, h1 = await phone.recv_verdict()
            sid, hash_ = ack.session_id, ack.schema_hash
            async with RawPhone(http, server) as phone:  # resume after verdict 0 only: replay of verdict 1
                again = await _resumed(phone, sid, 0, schema_hash=hash_)
                assert again.last_round == 1 and again.schema == ack.schema
                r1, rh1 = await phone.recv_verdict()
                assert r1 == v1 and rh1.header.span_start == h1.header.span_start
                await _resumed(phone, sid, 1, need_seed=True, schema_hash=hash_)  # a seed for the same verdict
                s1, sh1 = await phone.recv_verdict()
                t = sh1.header.root_position
                assert s1.round == 1 and sh1.header.span_start == max(0, t - WINDOW)
                assert sh1.k[0].shape[0] == t - sh1.header.span_start
                assert (sh1.k[0][-h1.k[0].shape[0]:] == h1.k[0]).all()  # the ring ends with round 1's rows
                err = await _resumed(phone, sid, 5)
                assert isinstance(err, ErrorFrame) and err.code == "bad_round" and err.fatal
                err = await _resumed(phone, "hyco." + "01" * 16, 0)
                assert isinstance(err, ErrorFrame) and err.code == "unknown_session" and err.fatal
                # finish the session on this connection, then resume it: the last verdict and `final`
                await _resumed(phone, sid, 1, schema_hash=hash_)
                await phone.recv_verdict()
                # the first tree after a session frame must confirm its schema (bytes: RawPhone would add it)
                await phone.send(encode_frame(tree_frame(2, v1.bonus, [])))
                err = await phone.recv()
                assert isinstance(err, ErrorFrame) and err.code == "missing_field" and not err.fatal
                done, rnd, root = list(v0.tokens) + list(v1.tokens), 2, v1.bonus
                while True:
                    await phone.send(tree_frame(rnd, root, plain[1][len(done):len(done) + 4]))
                    v, _ = await phone.recv_verdict()
                    done += list(v.tokens)
                    if v.finish_reason is not None:
                        break
                    rnd, root = rnd + 1, v.bonus
                final = await phone.recv()
                assert isinstance(final, FinalFrame) and final.completion_tokens == MAX_TOKENS
            assert done == plain[1]
            async with RawPhone(http, server) as phone:
                await _resumed(phone, sid, rnd - 1, schema_hash=hash_)
                rv, _ = await phone.recv_verdict()
                assert rv.round == rnd and rv.finish_reason == "length"
                assert isinstance(await phone.recv(), FinalFrame)

    asyncio.run(run())


def test_schema_mismatch_ends_the_session_and_version_1_phones_are_told_to_upgrade(server, tok):
    import msgpack

    ids = tok.encode(PROMPT)

    async def run():
        async with aiohttp.ClientSession() as http:
            async with RawPhone(http, server) as phone:
                # a version-1 phone: the answer is a version-1 error frame it can read
                await phone.send(msgpack.packb({**frame_to_wire(start_frame(PROMPT, 4)), "v": 1}))
                raw = msgpack.unpackb(await phone.recv_raw())
                assert raw["type"] == "error" and raw["v"] == 1 and raw["code"] == "unsupported_version"
                assert raw["fatal"] and "version 3" in raw["message"] and "upgrade" in raw["message"]
                # the same connection then opens a version-2 session; a wrong schema hash ends it
                await phone.send(start_frame(PROMPT, 4))
                ack = await phone.recv()
                assert isinstance(ack, SessionFrame)
                await phone.send(tree_frame(0, ids[-1], [], schema=bytes(8)))
                err = await phone.recv()
                assert isinstance(err, ErrorFrame) and err.code == "schema_mismatch" and err.fatal
            async with RawPhone(http, server) as phone:
                err = await _resumed(phone, ack.session_id, -1)
                assert isinstance(err, ErrorFrame) and err.code == "unknown_session"

    asyncio.run(run())


def test_a_phone_without_verdict_0_does_not_hold_its_session_until_the_idle_timeout(server, tok, plain):
    """A phone that leaves before its first verdict never learnt the session id, so nobody can resume the
    session: the server frees it (and its KV) when the socket drops. One whose verdict 0 reached the socket
    but was never read (the phone showed nothing after it) is kept only the short unconfirmed grace, not the
    idle timeout. A phone that did read verdict 0 and resumes keeps the usual resume semantics."""
    from test_e2e_phone_support import IDLE_TIMEOUT_S, hyco_stats, wait_drained

    from vllm_hyco.serving.table import UNCONFIRMED_GRACE_S

    grace = min(IDLE_TIMEOUT_S, UNCONFIRMED_GRACE_S)
    assert grace <= IDLE_TIMEOUT_S / 2
    ids = tok.encode(PROMPT)
    base = wait_drained(server)

    def held_for() -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < IDLE_TIMEOUT_S * 2:
            st = hyco_stats(server)
            if st["sessions"] == 0 and st["engine"]["live"] == 0:
                assert st["engine"]["kv_blocks_used"] <= base["engine"]["kv_blocks_used"]
                return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"session still held: {hyco_stats(server)}")

    async def leave(how: str):
        rounds = _rounds(server)
        async with aiohttp.ClientSession() as http, RawPhone(http, server) as phone:
            await phone.send(start_frame(PROMPT, MAX_TOKENS))
            await phone.recv()  # the session frame
            if how != "before_tree":  # round 0 in flight when the socket closes, or its verdict unread
                await phone.send(tree_frame(0, ids[-1], plain[1][:2]))
            if how == "verdict_unread":  # the server built verdict 0 (and writes it at once); never read
                while _rounds(server) == rounds:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)

    for how in ("before_tree", "round_in_flight"):
        asyncio.run(leave(how))
        assert held_for() < grace  # freed as the socket drops (plus the sweeper's polling)
    asyncio.run(leave("verdict_unread"))
    assert held_for() < IDLE_TIMEOUT_S * 0.9  # the unconfirmed grace, not the idle timeout

    async def resumable():
        async with aiohttp.ClientSession() as http:
            async with RawPhone(http, server) as phone:
                await phone.send(start_frame(PROMPT, MAX_TOKENS))
                ack = await phone.recv()  # the session frame names the session (protocol v2)
                await phone.send(tree_frame(0, ids[-1], plain[1][:2]))
                v0 = await phone.recv()
            async with RawPhone(http, server) as phone:
                assert isinstance(await _resumed(phone, ack.session_id, 0), SessionFrame)
                assert await phone.recv() == v0  # replayed byte-identical
            await asyncio.sleep(grace + 2.0)  # confirmed: held past the grace, for the idle timeout
            assert hyco_stats(server)["sessions"] == 1
            async with RawPhone(http, server) as phone:
                assert isinstance(await _resumed(phone, ack.session_id, 0), SessionFrame)
                assert await phone.recv() == v0
                await _finish(phone, v0, plain[1])  # rather than hold it until the idle timeout

    asyncio.run(resumable())
    wait_drained(server)


async def _finish(phone: RawPhone, v, reference: list[int]) -> None:
    """Drive a session to its end with chains planted from plain greedy (a few rounds) and check its text."""
    done, rnd = len(v.tokens), v.round + 1
    while v.finish_reason is None:
        await phone.send(tree_frame(rnd, v.bonus, reference[done:done + v.node_budget]))
        v = await phone.recv()
        assert list(v.tokens) == reference[done:done + len(v.tokens)], (rnd, v.tokens)
        done, rnd = done + len(v.tokens), rnd + 1
    assert done == len(reference) and isinstance(await phone.recv(), FinalFrame)


def _rounds(server: str) -> float:
    from test_e2e_phone_support import metric_values

    return metric_values(server, "vllm_hyco_rounds_total").get("", 0.0)
