"""Server mode on the wire (docs/protocol.md sections 3 and 4.8-4.13): the service's half of a session's mode.

A phone session asks to move with a ``mode`` frame at a round boundary; the engine switches the request
(``EngineClient.set_mode``) and this module streams what it commits:

* **to server** (``mode {server, r, window}``): the answer is the server's ``mode`` frame of round r (the
  stretch), then a **streamer** task sends one ``tokens`` frame per batch of committed tokens (one engine step,
  or what arrived together) with no round trip. It keeps every frame the phone has not acknowledged
  (``ack {tokens}``): they are what a resume replays, and the **credit window**: when the phone holds back
  ``window`` tokens of acknowledgement, or its socket goes, the streamer parks the request in the engine
  (a switch to phone mode there) and takes it up again when credit comes back, so a phone that stops reading
  costs the server no decoding beyond the window (and one step in flight).
* **to phone** (``mode {phone, r}``): the streamer parks the request, sends every token committed up to the
  park, and stops; the answer is the server's ``mode`` frame naming round r + 1 and its root (the last
  committed token). The next tree is drafted SLM-only (the phone's MTP state is stale) and its verdict carries
  a seed hand-off (the window's K/V), as round 0's does.

An ε session's stretches are exact (vLLM's rejection sampler); the ``mode`` frame says so (``exact``).
Refusals are typed and change nothing: ``server_mode_unavailable`` (no MTP ``model``, or forbidden),
``server_mode_full``, ``server_busy``, ``session_busy``, ``mid_round`` (the round named is one whose tree was
already sent), ``wrong_mode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from vllm_hyco.engine_contract import SessionInfo
from vllm_hyco.errors import HycoError, WireError
from vllm_hyco.handoff.frames import encode_frame
from vllm_hyco.handoff.mode_frames import AckFrame, ModeAckFrame, ModeFrame, PongFrame, TokensFrame
from vllm_hyco.handoff.server_frames import openai_chunk
from vllm_hyco.serving.table import HeldSession

logger = logging.getLogger("vllm.hyco")

DEFAULT_WINDOW = 64  # tokens the server sends beyond the phone's last ack, unless the phone asks fewer
MAX_WINDOW = 1024
POLL_S = 0.05  # how often a streamer waiting for tokens looks at its session's state
DRAIN_TIMEOUT_S = 120.0  # a switch back waits this long for the tokens committed before the park
TPS_HALF_LIFE_S = 30.0
FINISHING = 1 << 62  # a switch back that found the request finished in the engine drains to its end
# the engine's refusals of a switch (engine_core/server_mode.py) -> the wire's code; the round and mode checks
# the service makes first leave the last four for a service bug
_ENGINE_REFUSALS = {code: code for code in ("server_mode_unavailable", "server_mode_full", "server_busy",
                                            "session_busy", "mid_round")} | {
    code: "wrong_mode" for code in ("stale_round", "future_round", "wrong_mode", "bad_mode")}


class ServerModeMixin:
    """HycoService's server-mode methods (``service.py`` holds the rest of the service)."""

    bridge: Any
    metrics: Any
    server_places: int  # sessions that may be in server mode at once; 0: this server does not offer it
    phone_mode: bool  # False: server_mode "only", every session runs in server mode

    # -- the switch -------------------------------------------------------------------------------------------
    async def set_mode(self, s: HeldSession, f: ModeFrame) -> list[bytes]:
        """Answer a ``mode`` frame: the frames to send (the server's ``mode`` frame; none when the stretch
        finished the session, whose ``tokens`` and ``final`` frames the streamer sent)."""
        if s.finished:
            raise self._refuse("the session is finished; send a new start", "bad_round", f.round)
        if f.mode == s.mode:
            if f.round != s.expected_round:
                raise self._refuse(f"the session is in {s.mode} mode at round {s.expected_round}, not {f.round}",
                                   "bad_round", f.round)
            return [s.mode_frame] if s.mode_frame is not None else []
        if f.mode == "server":
            async with s.lock:
                return await self._to_server(s, f)
        return await self._to_phone(s, f)

    async def _to_server(self, s: HeldSession, f: ModeFrame) -> list[bytes]:
        if f.round < s.expected_round:
            raise self._refuse(f"round {f.round}'s tree was already sent: ask for server mode at round "
                               f"{s.expected_round}, after its verdict", "mid_round", f.round)
        if f.round != s.expected_round:
            raise self._refuse(f"mode.round {f.round} is not the session's next round {s.expected_round}",
                               "bad_round", f.round)
        if self.server_places <= 0:
            raise self._refuse("this server does not draft for phones (its hyco spec has no MTP \"model\", or "
                               "server_mode is \"forbid\"): keep drafting on the phone", "server_mode_unavailable",
                               f.round)
        if await self._engine_mode(s, "server", f.round) is None:
            raise self._refuse("the session is finished; send a new start", "bad_round", f.round)
        s.mode, s.window = "server", min(f.window or DEFAULT_WINDOW, MAX_WINDOW)
        s.acked, s.stream, s.paused = s.completion_tokens, [], False
        s.stop_waiter = None
        s.stretch_t0, s.stretch_tokens = time.monotonic(), 0
        ack = ModeAckFrame("server", f.round, s.completion_tokens, None, 0, s.window, exact=True)
        s.mode_frame = encode_frame(ack)
        s.last_frames = [s.mode_frame]
        self.metrics.switches.labels(to="server").inc()
        self.metrics.server_sessions.inc()
        s.touch()
        return [s.mode_frame]

    async def _to_phone(self, s: HeldSession, f: ModeFrame) -> list[bytes]:
        if not self.phone_mode:
            raise self._refuse("this server drafts every session itself (server_mode \"only\"): stay in server mode",
                               "phone_mode_unavailable", f.round)
        if f.round != s.expected_round:
            raise self._refuse(f"the session's server-mode stretch is round {s.expected_round}; ask for phone mode "
                               f"at that round, not {f.round}", "bad_round", f.round)
        self.start_stream(s)  # the streamer parks the request and sends every token committed before the park
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        s.stop_waiter = waiter
        s.credit.set()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), DRAIN_TIMEOUT_S)
        finally:
            s.stop_waiter = None
        if s.finished:
            return []
        return self._phone_frames(s)

    def _phone_frames(self, s: HeldSession) -> list[bytes]:
        """After the request is parked and every token is sent: the ``mode`` frame of the next tree round."""
        s.mode = "phone"
        s.last_round = s.expected_round
        s.expected_round += 1
        s.seed_next = True  # the next verdict carries the window's K/V
        s.paused = False
        ack = ModeAckFrame("phone", s.expected_round, s.completion_tokens, s.root, s.node_budget, 0)
        s.mode_frame = encode_frame(ack)
        s.last_frames, s.stream = [s.mode_frame], []
        self.metrics.switches.labels(to="phone").inc()
        self.metrics.server_sessions.dec()
        s.touch()
        return [s.mode_frame]

    async def _engine_mode(self, s: HeldSession, mode: str, round_: int) -> SessionInfo | None:
        """Switch the engine's request; None when it has finished there (its last tokens are on their way:
        the streamer drains them and ends the session)."""
        try:
            info: SessionInfo = await self.bridge.set_mode(s.engine, mode, s.engine_round)
        except HycoError as e:
            if e.code in ("session_finished", "finished") and s.mode == "server":  # its end is on its way
                return None
            if e.code in _ENGINE_REFUSALS:
                raise self._refuse(str(e), _ENGINE_REFUSALS[e.code], round_) from None
            await self._engine_lost(s, e, round_)  # type: ignore[attr-defined]
            raise
        s.engine_round = info.expected_round
        if mode == "phone":
            s.root, s.root_position = info.root, info.root_position
            s.engine_committed = info.root_position + 1 - len(s.engine.prompt_ids)
        return info

    def _refuse(self, message: str, code: str, round_: int) -> WireError:
        self.metrics.mode_refusals.labels(code=code).inc()
        return WireError(message, code=code, fatal=False, round=round_)

    # -- acknowledgements and probes ------------------------------------------------------------------------
    def ack(self, s: HeldSession, f: AckFrame) -> None:
        """The phone holds ``f.tokens`` completion tokens: drop the frames it holds, open the window again.
        An ack in phone mode (one sent before a switch back arrived) is ignored."""
        if f.tokens > s.completion_tokens:
            raise WireError(f"ack.tokens {f.tokens} is more than the {s.completion_tokens} tokens sent",
                            code="bad_field_value", fatal=False)
        s.acknowledged = True  # the phone read the session's frames: it holds its id
        if f.tokens > s.acked:
            s.acked = f.tokens
            s.stream = [(end, data) for end, data in s.stream if end > f.tokens]
            s.credit.set()
        s.touch()

    def offers_server(self) -> bool:
        """The server would take a switch to server mode now (it drafts, allows it, and has a place)."""
        busy = sum(1 for x in self.table.sessions() if x.mode == "server" and not x.finished)  # type: ignore
        return busy < self.server_places

    def pong(self, nonce: int) -> bytes:
        return encode_frame(PongFrame(nonce, self.offers_server(), self.server_tps, self.phone_ms, self.server_ms))

    async def refresh_costs(self) -> None:
        """What a committed token costs the server in each mode lately (the engine's ledger,
        ``spec_decode.mode_cost``), for the ``session`` and ``pong`` frames; the sweeper calls this once a
        second while sessions are held and server mode is offered."""
        if self.server_places <= 0 or not self.table.sessions():  # type: ignore[attr-defined]
            return
        stats = await self.bridge.stats()  # type: ignore[attr-defined]
        self.phone_ms, self.server_ms = stats.phone_ms_per_token, stats.server_ms_per_token

    def note_owner(self, s: HeldSession) -> None:
        """The phone came back (resume) or left: a paused stretch looks at its credit again."""
        s.credit.set()

    # -- the streamer -----------------------------------------------------------------------------------------
    def start_stream(self, s: HeldSession) -> None:
        if s.mode == "server" and not s.finished and (s.streamer is None or s.streamer.done()):
            s.streamer = asyncio.get_running_loop().create_task(self._stream(s))

    async def _stream(self, s: HeldSession) -> None:
        try:
            await self._stream_loop(s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the session ends; its phone gets the error on its next frame
            logger.exception("HyCo server-mode stream of %s failed", s.sid)
            waiter = s.stop_waiter
            if waiter is not None and not waiter.done():
                waiter.set_exception(e if isinstance(e, WireError) else WireError(
                    f"server mode failed: {type(e).__name__}: {e}", code="internal_error"))

    async def _stream_loop(self, s: HeldSession) -> None:
        while True:
            waiter = s.stop_waiter
            if waiter is not None and s.stop_target is None:  # a switch back: park, then drain to the park
                try:
                    done = False
                    if not s.paused:
                        done = await self._engine_mode(s, "phone", s.expected_round) is None
                        s.paused = not done
                    s.stop_target = FINISHING if done else s.engine_committed
                except WireError as e:  # session_busy: the switch is refused, the stretch goes on
                    s.stop_waiter = None
                    waiter.set_exception(e)
                    continue
            if s.stop_target is not None and s.completion_tokens >= s.stop_target:
                s.stop_target = None
                if s.stop_waiter is not None and not s.stop_waiter.done():
                    s.stop_waiter.set_result(None)
                return
            if s.stop_target is None:
                await self._flow(s)
            d = await self.bridge.decoded(s.engine, POLL_S)
            if d is None:
                continue
            await self._emit(s, d)
            if s.finished:
                if s.stop_waiter is not None and not s.stop_waiter.done():
                    s.stop_waiter.set_result(None)
                return

    async def _flow(self, s: HeldSession) -> None:
        """Park the request when the phone's credit is used up or its socket is gone; take it up again when
        credit comes back. Tokens already committed keep arriving meanwhile (``decoded``)."""
        starved = s.owner is None or s.completion_tokens - s.acked >= s.window
        if starved and not s.paused and not s.engine_finished:
            try:
                info = await self._engine_mode(s, "phone", s.expected_round)
            except WireError as e:  # session_busy (re-prefilling after a preemption): look again soon
                logger.debug("HyCo pause of %s deferred: %s", s.sid, e)
                return
            if info is None:  # finished in the engine: its last tokens are on their way
                s.engine_finished = True
                return
            s.paused = True
            self.metrics.paused.inc()
        elif not starved and s.paused:
            await self._engine_mode(s, "server", s.expected_round)
            s.paused = False
        if s.paused and s.engine_committed <= s.completion_tokens and s.stop_waiter is None:
            s.credit.clear()
            with contextlib.suppress(asyncio.TimeoutError):  # all before the park is out: wait for credit
                await asyncio.wait_for(s.credit.wait(), 1.0)

    async def _emit(self, s: HeldSession, d: Any) -> None:
        finished = d.finish_reason is not None
        chunk = openai_chunk(s.kind, s.completion_id, self.bridge.model_name, d.text, d.finish_reason,
                             created=s.created)
        frame = encode_frame(TokensFrame(s.expected_round, s.completion_tokens, tuple(d.token_ids), chunk))
        n = len(d.token_ids)
        s.completion_tokens += n
        s.server_tokens += n
        s.stretch_tokens += n
        self.metrics.mode_tokens.labels(mode="server").inc(n)
        if d.token_ids:
            s.root, s.root_position = int(d.token_ids[-1]), s.root_position + n
        s.stream.append((s.completion_tokens, frame))
        frames = [frame]
        if finished:
            self._note_tps(s)
            self._finish(s, frames)  # type: ignore[attr-defined]
            self.metrics.server_sessions.dec()
        s.touch()
        owner = s.owner
        if owner is None:
            return
        try:
            for data in frames:
                await owner.send(data)
        except Exception as e:  # noqa: BLE001 - the phone is gone; the frames wait for its resume
            logger.debug("HyCo server-mode send to %s failed: %s", s.sid, e)
            if s.owner is owner:
                s.owner = None

    def _note_tps(self, s: HeldSession) -> None:
        dt = time.monotonic() - s.stretch_t0
        if s.stretch_tokens >= 8 and dt > 0:
            tps, w = s.stretch_tokens / dt, min(1.0, dt / TPS_HALF_LIFE_S)
            self.server_tps = tps if self.server_tps <= 0 else (1 - w) * self.server_tps + w * tps

    def replay_stream(self, s: HeldSession, held: int) -> list[bytes]:
        """A resume in server mode: the stretch's ``mode`` frame and every ``tokens`` frame the phone lacks
        (``held``: the completion tokens it holds)."""
        s.acked = max(s.acked, min(held, s.completion_tokens))
        out = [s.mode_frame] if s.mode_frame is not None else []
        return out + [data for end, data in s.stream if end > held]
