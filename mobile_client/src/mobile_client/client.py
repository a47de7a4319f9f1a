"""The phone's WebSocket client: runs a ``PhoneSession`` against ``/v1/hyco/session`` (docs/protocol.md).

One connection carries one session: ``start``, answered by ``session`` (the session id and the session's
hand-off schema, which the next tree confirms), then per round one ``tree`` up and one ``verdict`` down
(plus ``handoff_chunk`` frames when the hand-off is bigger than one chunk), then ``final``. Robustness:

* **Timeouts everywhere**: connecting, and every frame the phone waits for. A silent server is treated as a
  lost connection; when the retries run out the client raises ``PhoneTimeoutError``. It never hangs.
* **Reconnect and resume**: on a dropped connection (or a timeout) the client reconnects (presenting the
  session id's routing key as ``?route=`` so a proxy finds the replica) and sends a ``start`` with
  ``hyco.resume = {session_id, last_round, need_seed}``; the server answers ``session`` (the same schema
  hash, else ``schema_mismatch``) and replays its last verdict; the session ignores a replay of a round it
  already holds and resends the tree in flight. A verdict is applied only once it and its whole hand-off
  are in, so no committed token is lost or committed twice. Before verdict 0 the client starts over.
* **Failover**: when the server no longer holds the session (a resume or a tree answered
  ``unknown_session``: the replica that held it died or restarted, or it evicted the session), or when
  ``failover_after`` handshakes in a row fail at a proxy (HTTP 502/503/504: the session's replica is down),
  the client reopens the session from what it holds (``PhoneSession.reopen``: prompt + committed tokens as
  a new completions request, the tree in flight resent as round 0) on whichever replica the proxy picks;
  the text continues with no committed token lost or repeated. At most ``max_failovers`` per session.
* **A fresh seed after a lost state**: a broken chunked hand-off (``chunk_*``) or a malformed one
  (``bad_handoff``) reconnects with ``need_seed: true``; the replay then carries a seed hand-off.
* **Typed errors**: an ``error`` frame raises ``HycoServerError`` with the frame's ``code``, ``fatal`` and
  ``round`` (``server_busy`` is retried: the same tree is resent); a bad key raises it with code
  ``unauthorized`` (HTTP 401 at the handshake); the phone's own decoders raise ``FrameError`` /
  ``HandoffSchemaError`` with the protocol's codes (``layout_mismatch``, ``bad_verdict``, ...).

>>> ws_url("http://127.0.0.1:8000"), ws_url("https://h/v1/hyco/session")
('ws://127.0.0.1:8000/v1/hyco/session', 'wss://h/v1/hyco/session')
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from mobile_client.mode_rule import PhoneOnly
from mobile_client.session import PhoneSession, RoundStats, SessionResult
from vllm_hyco.errors import (
    ConnectionLostError,
    FrameError,
    HandoffSchemaError,
    HycoServerError,
    PhoneTimeoutError,
)
from vllm_hyco.handoff.chunks import HandoffAssembler
from vllm_hyco.handoff.frames import decode_server_frame, encode_frame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.mode_frames import ModeAckFrame, PingFrame, PongFrame, TokensFrame
from vllm_hyco.handoff.server_frames import ErrorFrame, FinalFrame, HandoffChunkFrame, SessionFrame, VerdictFrame
from vllm_hyco.handoff.session_id import ROUTE_QUERY_PARAM, route_key

SESSION_PATH = "/v1/hyco/session"
#: phone-side decode errors that a seed hand-off repairs (docs/protocol.md section 7, "phone" codes)
RESEED_CODES = frozenset({"chunk_missing", "chunk_duplicate", "chunk_out_of_order", "chunk_corrupt",
                          "bad_handoff"})
#: a switch the server refused for now: stay in the mode and let the policy ask again later
MODE_REFUSALS = frozenset({"server_mode_unavailable", "server_mode_full", "server_busy", "session_busy",
                           "mid_round", "phone_mode_unavailable"})
#: handshake answers of a proxy whose upstream (the session's replica) is gone
GATEWAY_STATUSES = frozenset({502, 503, 504})


def server_error(frame: ErrorFrame) -> HycoServerError:
    """The typed error an ``error`` frame from the server raises on the phone."""
    return HycoServerError(f"server error {frame.code}: {frame.message}", code=frame.code, fatal=frame.fatal,
                           round=frame.round)


class _Dropped(Exception):
    """Internal: the connection is unusable; reconnect (and resume) if retries are left."""

    def __init__(self, why: str, timeout: bool = False, gateway: bool = False):
        super().__init__(why)
        self.timeout, self.gateway = timeout, gateway


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0  # TCP + WebSocket handshake
    frame_s: float = 60.0  # each frame the phone waits for (a verdict includes the server's forward)
    close_s: float = 2.0  # closing handshake
    final_s: float = 5.0  # the `final` frame after the finishing verdict (only statistics are at stake)


def ws_url(server: str) -> str:
    """``http(s)://host:port[/...]`` or ``ws(s)://...`` -> the session route's WebSocket URL."""
    url = server.rstrip("/")
    for plain, secure in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(plain):
            url = secure + url[len(plain):]
    if not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url if url.endswith(SESSION_PATH) else url + SESSION_PATH


class HycoClient:
    """Runs phone sessions against one server.

    ``max_retries`` bounds the reconnects in a row without progress (any applied verdict resets the
    count); waits between them back off from ``retry_delay_s`` up to ``max_retry_delay_s``.
    ``max_failovers`` bounds the reopenings of one session on another replica (0: never; see the module
    docstring), ``failover_after`` the proxy gateway errors in a row that trigger one.
    ``offload`` runs drafting in a worker thread so several simulated phones share one event loop.
    Simulated phones (benchmarks, docs/decisions.md D8): ``sim_draft_ms`` pads each new tree's drafting to a
    modelled device time (the paper: 52.9 ms per round); ``sim_rtt_ms`` adds a modelled link round trip
    (half before each tree, half after each verdict). Both only delay; ``RoundStats`` keeps the measured
    draft time, and its wait time includes the modelled link.
    """

    def __init__(self, server: str, api_key: str | None = None, *, timeouts: Timeouts = Timeouts(),
                 limits: WireLimits = DEFAULT_LIMITS, max_retries: int = 8, retry_delay_s: float = 0.05,
                 max_retry_delay_s: float = 2.0, busy_retries: int = 50, offload: bool = True,
                 http: aiohttp.ClientSession | None = None, sim_draft_ms: float = 0.0,
                 sim_rtt_ms: float = 0.0, max_failovers: int = 2, failover_after: int = 2,
                 mode_policy=None, window: int = 64):
        self.url, self.api_key, self.timeouts, self.limits = ws_url(server), api_key, timeouts, limits
        self.max_retries, self.retry_delay_s = max_retries, retry_delay_s
        self.max_retry_delay_s = max_retry_delay_s
        self.busy_retries, self.offload, self._http = busy_retries, offload, http
        self.sim_draft_ms, self.sim_rtt_ms = sim_draft_ms, sim_rtt_ms
        self.max_failovers, self.failover_after = max_failovers, failover_after
        # which mode each round runs in (mobile_client.mode_rule): PhoneOnly (default), ServerOnly, ModeRule
        self.policy = mode_policy if mode_policy is not None else PhoneOnly()
        self.window = window  # server mode's credit window (tokens), unless the policy states one
        self._nonce = 0
        self._pings: dict[int, float] = {}
        self._last_ping = -float("inf")

    async def run(self, session: PhoneSession, on_round: Callable[[RoundStats], None] | None = None
                  ) -> SessionResult:
        """Drive ``session`` to its end (``final``) and return its result; raises typed errors only."""
        http = self._http or aiohttp.ClientSession()
        try:
            failures = gateway = 0
            while True:
                held = session.held_round
                try:
                    await self._connection(http, session, on_round)
                    return session.result()
                except HycoServerError as e:
                    if session.finished:  # only `final` was lost: every token is in
                        return session.result()
                    if e.code != "unknown_session" or not self._failover(session):
                        raise
                    failures = gateway = 0
                    continue
                except _Dropped as e:
                    if session.finished:  # only `final` was lost: every token is in
                        return session.result()
                    gateway = gateway + 1 if e.gateway and session.resumable else 0
                    if gateway >= self.failover_after and self._failover(session):
                        failures = gateway = 0
                        continue
                    failures = 1 if session.held_round != held else failures + 1
                    if failures > self.max_retries:
                        cls = PhoneTimeoutError if e.timeout else ConnectionLostError
                        raise cls(f"{e} ({self.max_retries} retries without progress; round "
                                  f"{session.round}, {len(session.tokens)} tokens committed)") from None
                    session.note_resume()
                    await asyncio.sleep(min(self.retry_delay_s * 2 ** (failures - 1), self.max_retry_delay_s))
        finally:
            if self._http is None:
                await http.close()

    def _failover(self, session: PhoneSession) -> bool:
        """Reopen ``session`` on another replica (from its prompt + committed tokens) if the policy allows."""
        if session.failovers >= self.max_failovers or not session.can_reopen():
            return False
        session.reopen()
        return True

    async def stream(self, session: PhoneSession) -> AsyncIterator[str]:
        """The committed text as it arrives (``async for text in client.stream(session)``); the result is
        ``session.result()`` afterwards, and errors are raised as ``run`` raises them."""
        queue: asyncio.Queue[str] = asyncio.Queue()
        outer = session.on_text

        def push(text: str) -> None:
            if outer is not None:
                outer(text)
            queue.put_nowait(text)

        session.on_text = push
        task = asyncio.create_task(self.run(session))
        try:
            while not (task.done() and queue.empty()):
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if get.done():
                    yield get.result()
                else:
                    get.cancel()
            task.result()
        finally:
            session.on_text = outer
            if not task.done():
                task.cancel()

    # -- one connection ------------------------------------------------------------------------------------
    async def _connection(self, http, session: PhoneSession, on_round) -> None:
        resuming = session.resumable
        ws = await self._connect(http, session, resuming)
        try:
            await self._send(ws, encode_frame(session.start_frame()))
            ack = await self._take_session(ws, session)
            if resuming and ack.last_round >= 0 and ack.mode == "phone":  # the server replays its last verdict
                await self._take_verdict(ws, session, time.perf_counter(), on_round)
            if ack.mode == "server":  # a resumed stretch, or a server that drafts every session (server_mode "only")
                session.mode = "server"
            # the link's round trip before the first tree, unless the server's offer already decided the mode
            probe = not resuming and session.round == 0 and self.policy.probe_s < float("inf")
            while not session.finished:
                if session.mode == "server":
                    await self._stretch(ws, session, on_round)
                    continue
                if not session.tree_in_flight and self.policy.decide("phone", time.perf_counter(),
                                                                     self._remaining(session)) == "server":
                    await self._switch(ws, session, "server")
                    continue
                if probe:
                    probe = False
                    await self._probe(ws, session)
                    continue
                t_draft, fresh = time.perf_counter(), not session.tree_in_flight
                frame = await self._call(session.next_tree)
                if fresh:
                    await self._simulate(self.sim_draft_ms - (time.perf_counter() - t_draft) * 1e3)
                t0 = time.perf_counter()
                offer_s = self.policy.offer_s  # the server's offer now, and the link's round trip
                if offer_s < float("inf") and t0 - self._last_ping >= offer_s:
                    await self._ping(ws)
                await self._simulate(self.sim_rtt_ms / 2)
                await self._send(ws, encode_frame(frame))
                prep = asyncio.create_task(self._call(session.prepare_proactive)) if session.wait_work else None
                try:
                    await self._take_verdict(ws, session, t0, on_round, prep)
                finally:
                    if prep is not None and not prep.done():
                        await prep
            session.final = await self._take_final(ws, session)
        finally:
            await self._close(ws)

    # -- server mode ---------------------------------------------------------------------------------------
    @staticmethod
    def _remaining(session: PhoneSession) -> int | None:
        limit = session.request.get("max_tokens") or session.request.get("max_completion_tokens")
        return None if not isinstance(limit, int) else max(0, limit - len(session.tokens))

    async def _ping(self, ws) -> None:
        self._nonce += 1
        self._pings[self._nonce] = self._last_ping = time.perf_counter()
        await self._send(ws, encode_frame(PingFrame(self._nonce)))

    def _tell(self, hook: str, *args) -> None:
        """Feed the mode policy a measurement, when it takes that kind (``mobile_client.mode_rule``)."""
        fn = getattr(self.policy, hook, None)
        if fn is not None:
            fn(*args)

    def _pong(self, frame: PongFrame) -> None:
        sent = self._pings.pop(frame.nonce, None)
        if sent is not None:
            self._tell("observe_rtt", time.perf_counter() - sent, time.perf_counter())
        self._offer(frame)

    def _offer(self, frame: PongFrame | SessionFrame) -> None:
        """The server's offer (``pong`` and ``session`` carry the same figures) to the mode policy."""
        self._tell("observe_offer", frame.offers_server, frame.server_tps, frame.phone_ms, frame.server_ms)

    async def _probe(self, ws, session: PhoneSession) -> None:
        await self._ping(ws)
        frame, _ = await self._recv(ws, session)
        if isinstance(frame, PongFrame):
            self._pong(frame)
        elif isinstance(frame, ErrorFrame):
            raise server_error(frame)

    async def _switch(self, ws, session: PhoneSession, mode: str) -> None:
        """Ask for server mode at the round boundary; a refusal leaves the session in phone mode."""
        window = getattr(getattr(self.policy, "cfg", None), "window", self.window)
        await self._send(ws, encode_frame(session.mode_frame(mode, window)))
        while True:
            frame, _ = await self._recv(ws, session)
            if isinstance(frame, PongFrame):
                self._pong(frame)
                continue
            if isinstance(frame, ErrorFrame):
                if not frame.fatal and frame.code in MODE_REFUSALS:
                    self._tell("refused", time.perf_counter())
                    return
                raise server_error(frame)
            if not isinstance(frame, ModeAckFrame):
                raise FrameError(f"expected the mode frame, got a {frame.TYPE} frame", code="unknown_type")
            session.apply_mode(frame)
            return

    async def _stretch(self, ws, session: PhoneSession, on_round) -> None:
        """A server-mode stretch: take the tokens frames (acknowledging each), probe the link, and ask for
        phone mode when the policy says so; returns when the session is back in phone mode or finished."""
        switching, last_ping, t_prev = False, time.perf_counter(), time.perf_counter()
        while session.mode == "server" and not session.finished:
            now = time.perf_counter()
            if now - last_ping >= self.policy.probe_s and not switching:
                await self._ping(ws)
                last_ping = now
            wait = min(self.timeouts.frame_s, max(0.01, last_ping + self.policy.probe_s - now))
            try:
                frame, n = await self._recv(ws, session, wait)
            except _Dropped as e:
                if not e.timeout or wait >= self.timeouts.frame_s:
                    raise
                continue
            if isinstance(frame, PongFrame):
                self._pong(frame)
            elif isinstance(frame, ErrorFrame):
                if not frame.fatal and frame.code in MODE_REFUSALS:  # the switch back must wait (session_busy)
                    switching = False
                    self._tell("refused", time.perf_counter())
                    continue
                raise server_error(frame)
            elif isinstance(frame, ModeAckFrame):
                session.apply_mode(frame)
            elif isinstance(frame, TokensFrame):
                stats = session.apply_tokens(frame, wait_ms=(now - t_prev) * 1e3, bytes_down=n)
                t_prev = time.perf_counter()
                if stats is not None:
                    self._tell("observe_tokens", stats.committed, t_prev)
                    if on_round is not None:
                        on_round(stats)
                if not session.finished:
                    await self._send(ws, encode_frame(session.ack_frame()))
            else:
                raise FrameError(f"a {frame.TYPE} frame arrived in server mode", code="bad_verdict")
            if not switching and not session.finished and session.mode == "server" and self.policy.decide(
                    "server", time.perf_counter(), self._remaining(session)) == "phone":
                await self._send(ws, encode_frame(session.mode_frame("phone")))
                switching = True

    async def _connect(self, http, session: PhoneSession, resuming: bool = False):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        url = self.url  # a resume names its replica by the session id's routing key (docs/protocol.md 3)
        if resuming:
            url = f"{url}?{ROUTE_QUERY_PARAM}={route_key(session.sid)}"
        try:
            return await asyncio.wait_for(
                http.ws_connect(url, headers=headers, max_msg_size=session.options.max_message_bytes,
                                timeout=aiohttp.ClientWSTimeout(ws_close=self.timeouts.close_s)),
                self.timeouts.connect_s)
        except aiohttp.WSServerHandshakeError as e:
            if e.status == 401:
                raise HycoServerError(f"the server refused the API key (HTTP 401 at the WebSocket handshake "
                                      f"to {self.url}); pass the server's --api-key",
                                      code="unauthorized") from None
            if e.status in (404, 405):
                raise HycoServerError(f"{self.url} has no HyCo session route (HTTP {e.status}); is the "
                                      f"server running with --speculative-config hyco?",
                                      code="no_route") from None
            raise _Dropped(f"handshake failed with HTTP {e.status}",
                           gateway=e.status in GATEWAY_STATUSES) from None
        except asyncio.TimeoutError:
            raise _Dropped(f"no WebSocket handshake from {self.url} in {self.timeouts.connect_s} s",
                           timeout=True) from None
        except (aiohttp.ClientError, OSError) as e:
            raise _Dropped(f"cannot connect to {self.url}: {e}") from None

    async def _close(self, ws) -> None:
        with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError, OSError):
            await asyncio.wait_for(ws.close(), self.timeouts.close_s)

    @staticmethod
    async def _simulate(ms: float) -> None:
        if ms > 0:
            await asyncio.sleep(ms / 1e3)

    async def _call(self, fn):
        return await asyncio.to_thread(fn) if self.offload else fn()

    async def _send(self, ws, data: bytes) -> None:
        try:
            await ws.send_bytes(data)
        except (aiohttp.ClientError, OSError, RuntimeError) as e:  # RuntimeError: closing transport
            raise _Dropped(f"send failed: {e}") from None

    async def _recv(self, ws, session: PhoneSession, timeout_s: float | None = None):
        """The next server frame and its size; decode errors pass through as FrameError/HandoffSchemaError."""
        timeout_s = self.timeouts.frame_s if timeout_s is None else timeout_s
        try:
            msg = await asyncio.wait_for(ws.receive(), timeout_s)
        except asyncio.TimeoutError:
            raise _Dropped(f"no frame from the server in {timeout_s} s", timeout=True) from None
        if msg.type == aiohttp.WSMsgType.BINARY:
            return decode_server_frame(msg.data, self.limits, schema=session.schema), len(msg.data)
        if msg.type == aiohttp.WSMsgType.TEXT:
            raise FrameError("the server sent a text message; frames are binary msgpack", code="bad_msgpack")
        raise _Dropped(f"connection closed ({msg.type.name}{': ' + str(msg.data) if msg.data else ''})")

    # -- frames in -----------------------------------------------------------------------------------------
    async def _take_session(self, ws, session: PhoneSession) -> SessionFrame:
        """The answer to ``start``: the ``session`` frame (checked and taken by the session), or an error."""
        frame, _ = await self._recv(ws, session)
        if isinstance(frame, ErrorFrame):
            raise server_error(frame)
        if not isinstance(frame, SessionFrame):
            raise FrameError(f"expected the session frame after start, got a {frame.TYPE} frame",
                             code="unknown_type")
        session.apply_session(frame)
        self._offer(frame)
        return frame

    async def _take_verdict(self, ws, session: PhoneSession, t0: float, on_round, prep=None) -> None:
        """Receive the verdict answering the tree in flight (or a replay), with its hand-off, and apply it.

        ``prep``: the proactive draft running during the wait; the verdict is applied after it ends."""
        nbytes, busy = 0, 0
        while True:
            try:
                frame, n = await self._recv(ws, session)
                nbytes += n
                if isinstance(frame, ErrorFrame):
                    if frame.code == "server_busy" and not frame.fatal and busy < self.busy_retries:
                        busy += 1
                        await asyncio.sleep(self.retry_delay_s)
                        await self._send(ws, encode_frame(session.next_tree()))
                        continue
                    raise server_error(frame)
                if isinstance(frame, PongFrame):
                    self._pong(frame)
                    continue
                if isinstance(frame, ModeAckFrame):  # a resume's replay of a switch back to phone mode
                    session.apply_mode(frame)
                    return
                if not isinstance(frame, VerdictFrame):
                    raise FrameError(f"expected a verdict, got a {frame.TYPE} frame", code="bad_verdict")
                session.resumable = True  # from here on a drop (even mid-chunks) resumes, last_round -1
                handoff = frame.handoff
                if frame.handoff_ref is not None:
                    handoff, more = await self._assemble(ws, session, frame)
                    nbytes += more
                await self._simulate(self.sim_rtt_ms / 2)
                wait_ms = (time.perf_counter() - t0) * 1e3
                if prep is not None:
                    await prep
                stats = session.apply_verdict(frame, handoff, wait_ms=wait_ms, bytes_down=nbytes)
            except (FrameError, HandoffSchemaError) as e:
                if e.code not in RESEED_CODES:
                    raise
                session.need_seed = True
                raise _Dropped(f"hand-off lost ({e.code}: {e}); resuming with need_seed") from None
            if stats is None:  # a replay of a round already held
                return
            # drafting as it took on the device: a simulated phone pads it to sim_draft_ms
            self._tell("observe_round", stats.committed, max(stats.draft_ms, self.sim_draft_ms) / 1e3,
                       stats.wait_ms / 1e3, time.perf_counter())
            if on_round is not None:
                on_round(stats)
            return

    async def _assemble(self, ws, session: PhoneSession, verdict: VerdictFrame):
        asm = HandoffAssembler(verdict.round, verdict.handoff_ref, self.limits)
        nbytes = 0
        while not asm.complete:
            frame, n = await self._recv(ws, session)
            nbytes += n
            if isinstance(frame, ErrorFrame):
                raise server_error(frame)
            if not isinstance(frame, HandoffChunkFrame):
                raise HandoffSchemaError(f"a {frame.TYPE} frame arrived while {verdict.handoff_ref.chunks} "
                                         f"hand-off chunks were expected", code="chunk_missing")
            asm.add(frame)
        return asm.payload(session.schema), nbytes

    async def _take_final(self, ws, session: PhoneSession) -> FinalFrame | None:
        try:
            frame, _ = await self._recv(ws, session, self.timeouts.final_s)
        except _Dropped:
            return None  # every token is committed; only the statistics are lost
        if isinstance(frame, ErrorFrame):
            raise server_error(frame)
        if not isinstance(frame, FinalFrame) or (session.sid is not None and frame.session_id != session.sid):
            raise FrameError(f"expected this session's final frame, got {frame.TYPE}", code="bad_verdict")
        return frame


def run_session(server: str, session: PhoneSession, api_key: str | None = None, **client_kw) -> SessionResult:
    """Synchronous convenience: ``asyncio.run(HycoClient(server, api_key, **client_kw).run(session))``."""
    return asyncio.run(HycoClient(server, api_key, **client_kw).run(session))
