"""One phone connection on ``WS /v1/hyco/session`` (Starlette WebSocket; docs/protocol.md sections 1-3, 7).

The loop reads one binary message at a time, decodes it with the wire owner
(``vllm_hyco.handoff.decode_client_frame``, which raises only typed errors) and hands it to
:class:`~vllm_hyco.serving.service.HycoService`. Every violation after the handshake gets an ``error``
frame with a code and a message; the connection is closed only after ``too_many_sessions``,
``idle_timeout`` and ``internal_error``. A frame of another protocol version gets ``unsupported_version``
in that version's envelope when it has one (a version-1 phone can read it: it says what to upgrade). A phone
that disappears leaves its session in the table for resume (``idle_timeout_s``); nothing it committed is
lost.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm_hyco.errors import FrameError, HandoffSchemaError, WireError
from vllm_hyco.handoff.client_frames import StartFrame
from vllm_hyco.handoff.frames import PROTOCOL_VERSION, decode_client_frame, encode_frame, reply_version
from vllm_hyco.handoff.mode_frames import AckFrame, ModeFrame, PingFrame
from vllm_hyco.handoff.server_frames import ErrorFrame
from vllm_hyco.serving.service import HycoService
from vllm_hyco.serving.table import HeldSession

logger = logging.getLogger("vllm.hyco")


class _Gone(Exception):
    """The socket is closed; stop the loop."""


class PhoneConnection:
    def __init__(self, ws: Any, service: HycoService):
        self.ws, self.service = ws, service
        self.session: HeldSession | None = None
        self.metrics = service.metrics
        self._send_lock = asyncio.Lock()  # the receive loop and a server-mode streamer both send

    async def run(self) -> None:
        await self.ws.accept()
        self.service.ensure_sweeper()
        try:
            while True:
                data = await self._receive()
                if data is None:
                    return
                try:
                    await self._handle(data)
                except WireError as e:
                    await self._error(e)
                    if e.closes:
                        await self._close(1008 if e.code != "internal_error" else 1011)
                        return
        except _Gone:
            return
        except Exception as e:
            logger.exception("HyCo connection failed")
            try:
                await self._error(WireError(f"the server failed: {type(e).__name__}: {e}", code="internal_error"))
                await self._close(1011)
            except _Gone:
                pass
        finally:
            await self._leave()

    # -- socket -----------------------------------------------------------------------------------------
    async def _receive(self) -> bytes | None:
        try:
            msg = await asyncio.wait_for(self.ws.receive(), self.service.table.idle_timeout_s)
        except asyncio.TimeoutError:
            await self._error(WireError(f"no frame for {self.service.table.idle_timeout_s:g} s; the connection "
                                        f"is closed (a session can be resumed until its own idle timeout)",
                                        code="idle_timeout"))
            await self._close(1008)
            return None
        except Exception:  # noqa: BLE001 - receive after a close
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        data = msg.get("bytes")
        if data is None:
            text = msg.get("text") or ""
            self._count_up(len(text.encode()))
            await self._error(WireError("text messages are not frames: send one binary msgpack frame per "
                                        "message", code="bad_msgpack"))
            return b""
        self._count_up(len(data))
        if not data:
            await self._error(WireError("an empty message is not a frame: send one msgpack map per binary "
                                        "message", code="bad_msgpack"))
        return data

    async def send(self, data: bytes) -> None:
        """Send one frame (a server-mode streamer calls it); raises when the socket is gone."""
        await self._send(data)

    async def _send(self, data: bytes) -> None:
        try:
            async with self._send_lock:
                await self.ws.send_bytes(data)
        except Exception as e:  # noqa: BLE001 - the phone is gone; its session waits for a resume
            raise _Gone(str(e)) from None
        self.metrics.bytes.labels(direction="down").inc(len(data))
        if self.session is not None:
            self.session.bytes_down += len(data)

    async def _error(self, e: WireError) -> None:
        self.metrics.errors.labels(code=e.code).inc()
        version = getattr(e, "reply_version", PROTOCOL_VERSION)
        await self._send(encode_frame(ErrorFrame(e.code, str(e)[:4096], e.fatal, e.round), version))

    async def _close(self, code: int) -> None:
        try:
            await self.ws.close(code=code)
        except Exception as e:  # noqa: BLE001 - already closed
            logger.debug("HyCo close: %s", e)

    def _count_up(self, n: int) -> None:
        self.metrics.bytes.labels(direction="up").inc(n)
        if self.session is not None:
            self.session.bytes_up += n

    def _detach(self) -> HeldSession | None:
        s, self.session = self.session, None
        if s is not None and s.owner is self:
            s.owner = None
            s.touch()
            s.left_at = s.last_active
            return s
        return None

    async def _leave(self) -> None:
        """The socket is gone. A session none of whose verdicts reached the phone cannot be resumed (the
        phone never got its id, docs/protocol.md section 3): free it now instead of at the idle timeout. One
        whose verdict reached the socket but that the phone never acknowledged waits only the table's
        ``unconfirmed_grace_s`` for a resume."""
        s = self._detach()
        if s is not None:
            self.service.note_owner(s)  # a server-mode stretch parks until the phone is back
        if s is not None and not s.delivered and not s.finished:
            await self.service.drop(s)

    # -- frames -----------------------------------------------------------------------------------------
    async def _handle(self, data: bytes) -> None:
        if not data:
            return
        try:
            frame = decode_client_frame(data, self.service.limits)
        except (FrameError, HandoffSchemaError) as e:
            err = WireError(str(e), code=e.code)
            if e.code == "unsupported_version":  # answer in the phone's own version when we can
                err.reply_version = reply_version(data)
            raise err from None
        if isinstance(frame, StartFrame):
            await self._start(frame, len(data))
            return
        if isinstance(frame, PingFrame):  # a link probe: answered at once, with or without a session
            await self._send(self.service.pong(frame.nonce))
            return
        s = self.session
        if s is None or s.owner is not self:
            self.session = None
            raise WireError(f"a {frame.TYPE} frame arrived before `start` on this connection (or the session was "
                            f"resumed elsewhere); send start first", code="no_session", fatal=False,
                            round=getattr(frame, "round", None))
        if isinstance(frame, AckFrame):
            self.service.ack(s, frame)
            return
        if isinstance(frame, ModeFrame):
            for out in await self.service.set_mode(s, frame):
                await self._send(out)
                s.delivered = True  # the mode frame names the session's state: resumable from here on
            self.service.start_stream(s)  # after the `mode` frame: the stretch's tokens follow it
            if s.finished:
                self._detach()
            return
        for out in await self.service.tree(s, frame):
            await self._send(out)
            s.delivered = True  # the verdict (the first frame) names the session: resumable from here on
        if s.finished:
            self._detach()

    async def _start(self, frame: StartFrame, nbytes: int) -> None:
        await self._leave()  # one session per connection: a new start leaves the old one resumable
        if frame.hyco.resume is None:
            s, frames = await self.service.open(frame, owner=self)
            self.session = s
            s.bytes_up += nbytes
            for out in frames:  # the session frame (and, with server_mode "only", the stretch's mode frame)
                await self._send(out)
            if len(frames) > 1:
                s.delivered = True
            self.service.start_stream(s)
            return
        s, frames = await self.service.resume(frame, owner=self)
        self.session = s
        s.left_at = None
        s.bytes_up += nbytes
        for out in frames:
            await self._send(out)
        s.delivered = s.delivered or len(frames) > 1  # more than the session frame: a verdict
        if s.finished:
            self._detach()
        else:
            self.service.start_stream(s)  # a resumed server-mode stretch streams on
