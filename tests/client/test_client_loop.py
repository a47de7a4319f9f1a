"""The phone loop (client.py + session.py) over a real aiohttp WebSocket on 127.0.0.1 against a FAKE server.

The fake (``FakeHycoServer``) exists only as the other side of these unit tests (the real endpoint:
vllm_hyco/vllm_adapter/api_server/endpoint.py and the rest of vllm_hyco/vllm_adapter/): it speaks
docs/protocol.md's frames through ``vllm_hyco.handoff`` (the one wire-format owner), verifies trees with a toy
deterministic next-token function (greedy exact acceptance), sends dummy-pattern hand-offs of the right spans
(the seed chunked when it is bigger than its chunk size) and injects faults: dropped connections at chosen
points, server_busy, error frames, silence. Every test checks tokens exactly against plain greedy decoding of
the toy function.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

import numpy as np
import pytest
from aiohttp import WSMsgType, web

from mobile_client.client import ConnectionLostError, HycoClient, HycoServerError, PhoneTimeoutError, Timeouts
from mobile_client.session import PhoneSession, SessionOptions
from mobile_client.tree import DraftTree
from vllm_hyco.errors import FrameError, HandoffSchemaError
from vllm_hyco.handoff import (
    ErrorFrame,
    FinalFrame,
    HandoffPayload,
    HandoffScales,
    HandoffSpec,
    LayerSpec,
    SessionFrame,
    StartFrame,
    TreeFrame,
    VerdictFrame,
    WireLimits,
    decode_client_frame,
    encode_frame,
    openai_chunk,
    plan_handoff,
)

V = 512  # the toy vocabulary (= the toy drafters' vocabulary)
W = 32  # the fake server's seed window (the toy MTP ring)
LAYERS = (LayerSpec(2, "sliding", kv_heads=2, head_dim=32, window=16),
          LayerSpec(3, "full", kv_heads=1, head_dim=64, window=0, k_eq_v=True))
HIDDEN = 96  # = toy_mtp_spec().backbone


def toy_scales() -> HandoffScales:
    layers = tuple((lay.layer_id, np.full((lay.kv_heads, lay.head_dim), 0.02, np.float32),
                    np.full((lay.kv_heads, lay.head_dim), 0.03, np.float32)) for lay in LAYERS)
    return HandoffScales(np.full(HIDDEN, 0.01, np.float32), np.full(HIDDEN, 0.05, np.float32), layers, "toy")


SPEC = HandoffSpec.from_scales({"model_type": "toy"}, LAYERS, toy_scales())


def next_token(ctx) -> int:
    """The toy verifier's greedy next token."""
    return (ctx[-1] * 31 + ctx[-2] * 7 + len(ctx) * 3 + 1) % V


def greedy(prompt, n, fn=next_token) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(fn(ctx))
    return ctx[len(prompt):]


def text_of(tokens) -> str:
    return "".join(f"<{t}>" for t in tokens)


class OracleDrafter:
    """A test drafter that knows the toy verifier: a chain of ``depth`` nodes, wrong from depth ``miss``
    every third round, plus a wrong sibling under the root. It rebuilds the history from the session's
    hooks (``prefill`` and the catch-up tokens), so it drafts correctly only if the session is right."""

    def __init__(self, depth=5, miss=2):
        self.depth, self.miss, self.history, self.calls = depth, miss, [], 0

    def prefill(self, tokens):
        self.history = list(tokens)

    def propose(self, context, node_budget):
        self.history += list(context.catch_up)
        ctx = self.history + [context.root]
        tokens, parents = [context.root], [-1]
        for d in range(min(self.depth, node_budget - 1) if node_budget > 1 else 0):
            y = next_token(ctx)
            if self.calls % 3 == 2 and d >= self.miss:
                y = (y + 1) % V
            tokens.append(y)
            parents.append(len(tokens) - 2)
            ctx.append(y)
        if node_budget > len(tokens) - 1:  # a wrong sibling under the root
            sib = (next_token(self.history + [context.root]) + 2) % V
            tokens.append(sib)
            parents.append(0)
        self.calls += 1
        return DraftTree.make_dummy(tokens, parents, node_budget=node_budget)


class _State:
    def __init__(self, sid, prompt, max_tokens):
        self.sid, self.tokens, self.prompt_len, self.max_tokens = sid, list(prompt), len(prompt), max_tokens
        self.next_round, self.position, self.last_frames, self.last_round = 0, len(prompt) - 1, [], -1
        self.last_verdict_args = None
        self.confirmed = False  # a tree since the last session frame carried the schema hash


class FakeHycoServer:
    """Fake of the server side of ``/v1/hyco/session`` (unit tests only; see the module docstring).

    Faults: ``drops`` = {(round, stage)} closes the connection once at that point, stage one of
    "on_tree" (tree lost), "before_verdict" (verdict computed, never sent), "mid_chunks" (verdict and one
    chunk sent), "after_verdict" (all sent, then closed); ``busy`` = rounds answered once with server_busy;
    ``silent`` = rounds never answered (once); ``error_at`` = {round: (code, fatal)}; ``corrupt`` = rounds
    whose last hand-off chunk arrives with a flipped byte (once). ``next_fn`` is the toy verifier. Like the
    real server it answers every start with a ``session`` frame and wants the schema hash in the next tree.
    """

    def __init__(self, *, api_key=None, chunk_bytes=1 << 20, budgets=None, drops=(), busy=(), silent=(),
                 error_at=None, rng_drop: float = 0.0, seed: int = 0, corrupt=(), next_fn=next_token,
                 spec=SPEC, version_1=False):
        self.version_1 = version_1  # answer like a server that speaks protocol version 1 only
        self.api_key, self.budgets = api_key, budgets or (lambda r: 32)
        self.limits = WireLimits(chunk_bytes=chunk_bytes)
        self.drops, self.busy, self.silent = set(drops), set(busy), set(silent)
        self.error_at, self.rng_drop, self.rng = dict(error_at or {}), rng_drop, random.Random(seed)
        self.corrupt, self.next_fn, self.spec = set(corrupt), next_fn, spec
        self.sessions: dict[str, _State] = {}
        self.routes: list[str | None] = []  # the handshake's ?route= of every connection
        self.connections = self.resumes = self.trees = 0
        self.starts: list[StartFrame] = []

    async def __aenter__(self):
        app = web.Application()
        app.router.add_get("/v1/hyco/session", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    def _fault(self, rnd, stage) -> bool:
        if (rnd, stage) in self.drops:
            self.drops.discard((rnd, stage))
            return True
        return self.rng_drop > 0 and self.rng.random() < self.rng_drop

    async def handle(self, request):
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"code": "unauthorized", "message": "bad key"}}, status=401)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.connections += 1
        self.routes.append(request.query.get("route"))
        state = None
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                break
            try:
                frame = decode_client_frame(msg.data, self.limits)
            except (FrameError, HandoffSchemaError) as e:
                await ws.send_bytes(encode_frame(ErrorFrame(e.code, str(e), False)))
                continue
            if isinstance(frame, StartFrame):
                state = await self._start(ws, frame)
            elif state is None:
                await ws.send_bytes(encode_frame(ErrorFrame("no_session", "send start first", False)))
            elif await self._tree(ws, state, frame) == "close":
                break
        await ws.close()
        return ws

    async def _start(self, ws, frame: StartFrame):
        self.starts.append(frame)
        if self.version_1:
            err = ErrorFrame("unsupported_version", "protocol version 2 is not supported (supported: [1])", True)
            await ws.send_bytes(encode_frame(err, version=1))
            return None
        if frame.request is not None:
            sid = "fake." + hashlib.sha256(str(len(self.sessions)).encode()).hexdigest()[:32]
            body = frame.request
            state = self.sessions[sid] = _State(sid, body["prompt"], body.get("max_tokens", 16))
            await ws.send_bytes(encode_frame(SessionFrame(sid, -1, 32, self.spec)))
            return state
        self.resumes += 1
        r = frame.hyco.resume
        state = self.sessions.get(r.session_id)
        if state is None:
            await ws.send_bytes(encode_frame(ErrorFrame("unknown_session", "no such session", True)))
            return None
        if r.last_round not in (state.last_round, state.last_round - 1):
            await ws.send_bytes(encode_frame(ErrorFrame("bad_round", f"last: {state.last_round}", True)))
            return None
        frames = state.last_frames
        if r.need_seed:
            frames = self._verdict_frames(state, *state.last_verdict_args, seed=True)
        state.confirmed = False
        budget = self.budgets(state.last_round) if state.last_round >= 0 else 32
        for f in [encode_frame(SessionFrame(state.sid, state.last_round, budget, self.spec)), *frames]:
            await ws.send_bytes(f)
        return state

    async def _tree(self, ws, state: _State, tree: TreeFrame):
        rnd = tree.round
        if tree.schema is not None and tree.schema != self.spec.schema_hash:
            await ws.send_bytes(encode_frame(ErrorFrame("schema_mismatch", "other schema", True, rnd)))
            return "close"
        if not state.confirmed and tree.schema is None:
            await ws.send_bytes(encode_frame(ErrorFrame("missing_field", "confirm the schema", False, rnd)))
            return None
        state.confirmed = True
        if rnd != state.next_round:
            await ws.send_bytes(encode_frame(ErrorFrame("bad_round", f"want {state.next_round}", False, rnd)))
            return None
        if tree.tokens[0] != state.tokens[-1]:
            await ws.send_bytes(encode_frame(ErrorFrame("bad_tree", "wrong root", False, rnd)))
            return None
        if tree.num_nodes > self.budgets(rnd - 1) if rnd else tree.num_nodes > 32:
            await ws.send_bytes(encode_frame(ErrorFrame("budget_exceeded", "too big", False, rnd)))
            return None
        if self._fault(rnd, "on_tree"):
            return "close"
        if rnd in self.busy:
            self.busy.discard(rnd)
            await ws.send_bytes(encode_frame(ErrorFrame("server_busy", "later", False, rnd)))
            return None
        if rnd in self.error_at:
            code, fatal = self.error_at.pop(rnd)
            await ws.send_bytes(encode_frame(ErrorFrame(code, "injected", fatal, rnd)))
            return "close" if fatal else None
        if rnd in self.silent:
            self.silent.discard(rnd)
            return None
        self.trees += 1
        path, committed = self._verify(state, tree)
        a = state.position
        state.tokens += committed
        state.position += len(path) + 1
        state.next_round, state.last_round = rnd + 1, rnd
        state.last_verdict_args = (rnd, path, committed, a)
        state.last_frames = self._verdict_frames(state, rnd, path, committed, a, seed=rnd == 0)
        if self._fault(rnd, "before_verdict"):
            return "close"
        for i, f in enumerate(state.last_frames):
            if i == 2 and self._fault(rnd, "mid_chunks"):
                return "close"
            if rnd in self.corrupt and i == len(state.last_frames) - 1 and i > 0:
                self.corrupt.discard(rnd)
                f = f[:-1] + bytes([f[-1] ^ 1])  # the chunk's data is its last field
            await ws.send_bytes(f)
        if self._fault(rnd, "after_verdict"):
            return "close"
        return None

    def _verify(self, state: _State, tree: TreeFrame):
        ctx, node, path = list(state.tokens), 0, []
        while True:
            y = self.next_fn(ctx)
            kids = [i for i in range(1, len(tree.tokens)) if tree.parents[i] == node and tree.tokens[i] == y]
            if not kids:
                break
            node = kids[0]
            path.append(node)
            ctx.append(y)
        committed = [tree.tokens[r] for r in path] + [y]
        left = state.max_tokens - (len(state.tokens) - state.prompt_len)
        return path, committed[:left]

    def _verdict_frames(self, state, rnd, path, committed, a, seed=False) -> list[bytes]:
        done = len(state.tokens) - state.prompt_len >= state.max_tokens
        chunk = openai_chunk("text_completion", "cmpl-fake", "toy", text_of(committed),
                             "length" if done else None, created=0)
        if done:
            v = VerdictFrame(rnd, tuple(path), tuple(committed), None, None, None, 0, chunk)
            final = FinalFrame(state.sid, state.prompt_len, len(state.tokens) - state.prompt_len, rnd + 1,
                               1.0, 0, 0)
            return [encode_frame(v), encode_frame(final)]
        root = a + len(path) + 1
        span = max(0, root - W) if seed else a
        payload = HandoffPayload.make_dummy(self.spec, span, root, committed[-1], salt=rnd)
        inline, ref, chunks = plan_handoff(payload, rnd, self.limits)
        v = VerdictFrame(rnd, tuple(path), tuple(committed), committed[-1], inline, ref,
                         self.budgets(rnd), chunk)
        return [encode_frame(v)] + [encode_frame(c) for c in chunks]


PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101, 102]


def make_session(drafter=None, max_tokens=40, **opts):
    request = {"prompt": PROMPT, "max_tokens": max_tokens}
    return PhoneSession(drafter or OracleDrafter(), prompt_tokens=PROMPT, request=request,
                        endpoint="completions", spec=SPEC, options=SessionOptions(**opts))


def run(server_kw, session, **client_kw):
    async def go():
        async with FakeHycoServer(**server_kw) as server:
            client_kw.setdefault("timeouts", Timeouts(connect_s=5, frame_s=5, close_s=1))
            client_kw.setdefault("retry_delay_s", 0.001)
            result = await HycoClient(server.url, **client_kw).run(session)
            return result, server
    return asyncio.run(go())


def test_exact_session_equals_greedy():
    session = make_session(max_tokens=40)
    streamed = []
    session.on_text = streamed.append
    result, server = run({}, session)
    assert result.token_ids == greedy(PROMPT, 40)
    assert result.text == text_of(greedy(PROMPT, 40)) == "".join(streamed)
    assert result.finish_reason == "length" and result.final is not None and result.resumes == 0
    assert all(r.accepted <= r.nodes for r in result.rounds)
    assert sum(r.committed for r in result.rounds) == 40
    assert max(r.accepted for r in result.rounds) == 5  # the oracle's full chain is taken
    assert result.rounds[0].bytes_down > result.rounds[1].bytes_down  # the seed (W positions) is bigger
    assert server.connections == 1


def test_chunked_seed_is_reassembled():
    session = make_session(max_tokens=12)
    result, _ = run({"chunk_bytes": 1500}, session)
    assert result.token_ids == greedy(PROMPT, 12)


@pytest.mark.parametrize("stage", ["on_tree", "before_verdict", "mid_chunks", "after_verdict"])
@pytest.mark.parametrize("rnd", [0, 2])
def test_dropped_connection_resumes_without_losing_tokens(stage, rnd):
    session = make_session(max_tokens=30)
    result, server = run({"drops": {(rnd, stage)}, "chunk_bytes": 600}, session)
    assert result.token_ids == greedy(PROMPT, 30), (stage, rnd)
    assert result.resumes == 1 and server.connections == 2
    resumed = [s for s in server.starts if s.request is None]
    if rnd == 0 and stage in ("on_tree", "before_verdict"):
        assert not resumed  # no verdict 0 seen: the phone starts over
        assert server.routes == [None, None]
    else:
        assert len(resumed) == 1 and resumed[0].hyco.resume.last_round in (rnd - 1, rnd)
        assert server.routes == [None, "fake"]  # the resume presents the session id's routing key


def test_random_disconnects_finish_exactly():
    session = make_session(max_tokens=60)
    result, server = run({"rng_drop": 0.08, "seed": 3, "chunk_bytes": 1500}, session, max_retries=20)
    assert result.token_ids == greedy(PROMPT, 60)
    assert result.resumes >= 3 and server.connections == result.resumes + 1


def test_budget_from_verdict_is_respected():
    session = make_session(max_tokens=20)
    result, _ = run({"budgets": lambda r: 2 if r % 2 else 4}, session)
    assert result.token_ids == greedy(PROMPT, 20)
    assert [r.budget for r in result.rounds[:4]] == [4, 2, 4, 2]
    for prev, cur in zip(result.rounds, result.rounds[1:]):
        assert cur.nodes <= prev.budget


def test_server_busy_resends_same_tree():
    result, server = run({"busy": {1, 3}}, make_session(max_tokens=20))
    assert result.token_ids == greedy(PROMPT, 20) and result.resumes == 0


def test_silent_server_times_out_then_resumes():
    session = make_session(max_tokens=16)
    result, server = run({"silent": {2}}, session, timeouts=Timeouts(connect_s=2, frame_s=1.0, close_s=0.2))
    assert result.token_ids == greedy(PROMPT, 16) and result.resumes >= 1


def test_always_silent_server_raises_timeout():
    session = make_session(max_tokens=16)
    with pytest.raises(PhoneTimeoutError) as e:
        run({"silent": set(range(0, 1))}, session, max_retries=0,
            timeouts=Timeouts(connect_s=2, frame_s=0.2, close_s=0.2))
    assert e.value.code == "client_timeout"


@pytest.mark.parametrize("code,fatal", [("internal_error", True), ("bad_tree", False)])
def test_error_frames_raise_typed_errors(code, fatal):
    with pytest.raises(HycoServerError) as e:
        run({"error_at": {1: (code, fatal)}}, make_session(max_tokens=20))
    assert (e.value.code, e.value.fatal, e.value.round) == (code, fatal, 1)


def test_api_key_refused_at_handshake():
    with pytest.raises(HycoServerError) as e:
        run({"api_key": "k1"}, make_session(), api_key="wrong")
    assert e.value.code == "unauthorized"
    result, _ = run({"api_key": "k1"}, make_session(max_tokens=8), api_key="k1")
    assert result.token_ids == greedy(PROMPT, 8)


def test_unreachable_server_raises_connection_lost():
    async def go():
        client = HycoClient("http://127.0.0.1:9", max_retries=1, retry_delay_s=0.001,
                            timeouts=Timeouts(connect_s=1, frame_s=1, close_s=0.2))
        return await client.run(make_session())
    with pytest.raises(ConnectionLostError):
        asyncio.run(go())


def test_layout_mismatch_is_fatal():
    other = HandoffSpec(SPEC.fingerprint, HIDDEN, (LAYERS[0],), SPEC.scales_id)
    session = PhoneSession(OracleDrafter(), prompt_tokens=PROMPT, request={"prompt": PROMPT},
                           endpoint="completions", spec=other)
    with pytest.raises(HandoffSchemaError) as e:
        run({}, session)
    assert e.value.code == "layout_mismatch"


def test_simulated_device_and_link_times_only_delay():
    result, _ = run({}, make_session(max_tokens=10), sim_draft_ms=20, sim_rtt_ms=30)
    assert result.token_ids == greedy(PROMPT, 10)
    # a lower bound set by asyncio.sleep, not a measured speed: the modelled round trip is in the wait
    assert all(r.wait_ms >= 29 for r in result.rounds)


@pytest.mark.parametrize("stop_at,in_flight", [(0, False), (3, False), (3, True)])
def test_app_restart_restores_from_snapshot_with_a_fresh_seed(stop_at, in_flight):
    """The phone's process dies after round ``stop_at`` (with tree ``stop_at + 1`` in flight, unanswered, or
    not): the app rebuilds the session from its snapshot with a fresh drafter, resumes with need_seed, and
    finishes exactly."""
    import json

    class Crash(Exception):
        pass

    def crash_after(stats):
        if stats.round == stop_at and not in_flight:
            raise Crash

    async def go():
        silent = {stop_at + 1} if in_flight else set()
        async with FakeHycoServer(chunk_bytes=600, silent=silent) as server:
            frame_s = 1.5 if in_flight else 10.0  # only the silent round may time out
            kw = dict(timeouts=Timeouts(connect_s=5, frame_s=frame_s, close_s=0.5), retry_delay_s=0.001)
            first = make_session(max_tokens=30)
            with pytest.raises(PhoneTimeoutError if in_flight else Crash):
                await HycoClient(server.url, max_retries=0, **kw).run(first, on_round=crash_after)
            snap = json.loads(json.dumps(first.snapshot()))
            assert (snap["pending"] is not None) == in_flight
            again = PhoneSession.restore(OracleDrafter(), snap, spec=SPEC)
            return await HycoClient(server.url, **kw).run(again), server
    result, server = asyncio.run(go())
    assert result.token_ids == greedy(PROMPT, 30) and result.text == text_of(greedy(PROMPT, 30))
    resume = [s.hyco.resume for s in server.starts if s.request is None]
    assert len(resume) == 1 and resume[0].need_seed and resume[0].last_round == stop_at
    assert result.rounds[0].round == stop_at + 1


def test_stream_yields_the_text_as_it_commits():
    async def go():
        async with FakeHycoServer() as server:
            session = make_session(max_tokens=20)
            client = HycoClient(server.url, timeouts=Timeouts(5, 5, 1))
            return [t async for t in client.stream(session)], session.result()
    parts, result = asyncio.run(go())
    assert "".join(parts) == text_of(greedy(PROMPT, 20)) == result.text and len(parts) == len(result.rounds)


def test_stream_raises_what_run_raises():
    async def go():
        async with FakeHycoServer(error_at={1: ("internal_error", True)}) as server:
            client = HycoClient(server.url, timeouts=Timeouts(5, 5, 1))
            parts = []
            with pytest.raises(HycoServerError):
                async for t in client.stream(make_session(max_tokens=20)):
                    parts.append(t)
            return parts
    assert len(asyncio.run(go())) == 1  # round 0's text came before the error


def test_a_version_1_server_answer_is_a_typed_error():
    with pytest.raises(HycoServerError) as e:
        run({"version_1": True}, make_session(max_tokens=8))
    assert e.value.code == "unsupported_version" and e.value.fatal and "supported: [1]" in str(e.value)


def test_the_phone_confirms_the_schema_after_every_session_frame():
    """The fake refuses an unconfirmed first tree (``missing_field``): finishing exactly through drops and
    resumes means the phone sent the hash after every ``session`` frame."""
    session = make_session(max_tokens=40)
    result, server = run({"drops": {(1, "after_verdict"), (3, "before_verdict")}}, session)
    assert result.token_ids == greedy(PROMPT, 40) and result.resumes == 2 and session.schema == SPEC
