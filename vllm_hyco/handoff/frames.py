"""Frame envelope, encoding and decoding for both directions of the phone <-> server WebSocket.

Every frame is one binary WebSocket message holding one msgpack map whose first two keys are
``"type"`` (str) and ``"v"`` (the protocol version, int), followed by the frame's own fields
(``client_frames.py``, ``server_frames.py``; docs/protocol.md is the spec)::

    phone -> server:  start, tree, mode, ack, ping
    server -> phone:  session, verdict, handoff_chunk, error, final, mode, tokens, pong

Version 3 (this one) added server mode (``mode_frames.py``: a session's mode, the server's own tokens, the
credit window, a link probe) and the session's mode and committed count in ``session``, ``resume`` and
``final``. Version 2 moved the hand-off's self-describing header to the session's start (``session``
frame) and added the session id's routing key and the tree's optional node values. The ``error`` frame has
the same fields in every version, so a server answers a phone that speaks another version with an
``unsupported_version`` error in *that* version's envelope (:func:`reply_version`), and decoders accept
``error`` frames of every version in ``ERROR_FRAME_VERSIONS``.

Decoding validates everything and raises only FrameError or HandoffSchemaError (``vllm_hyco.errors``),
each with a stable ``code`` from ``limits.ERROR_CODES``.

>>> from vllm_hyco.handoff.client_frames import TreeFrame
>>> tree = TreeFrame.from_lists(round=1, tokens=[5, 6], parents=[-1, 0])
>>> decode_client_frame(encode_frame(tree)) == tree
True
"""

from __future__ import annotations

from typing import Any

from vllm_hyco.errors import FrameError
from vllm_hyco.handoff._fields import Fields, pack, unpack
from vllm_hyco.handoff.client_frames import StartFrame, TreeFrame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.mode_frames import AckFrame, ModeAckFrame, ModeFrame, PingFrame, PongFrame, TokensFrame
from vllm_hyco.handoff.schema import HandoffSpec
from vllm_hyco.handoff.server_frames import (
    ErrorFrame,
    FinalFrame,
    HandoffChunkFrame,
    SessionFrame,
    VerdictFrame,
)

PROTOCOL_VERSION = 3
SUPPORTED_PROTOCOL_VERSIONS = (3,)
ERROR_FRAME_VERSIONS = (1, 2, 3)  # versions whose `error` frame has this layout (type, v, code, message, ...)
UPGRADE_HINT = (
    "upgrade the phone app (hyco-mobile-client, or an app following docs/protocol.md) to a release that "
    "speaks HyCo protocol version 3"
)

ClientFrame = StartFrame | TreeFrame | ModeFrame | AckFrame | PingFrame
ServerFrame = (SessionFrame | VerdictFrame | HandoffChunkFrame | ErrorFrame | FinalFrame | ModeAckFrame | TokensFrame
               | PongFrame)
CLIENT_FRAMES = {cls.TYPE: cls for cls in (StartFrame, TreeFrame, ModeFrame, AckFrame, PingFrame)}
SERVER_FRAMES = {
    cls.TYPE: cls
    for cls in (SessionFrame, VerdictFrame, HandoffChunkFrame, ErrorFrame, FinalFrame, ModeAckFrame, TokensFrame,
                PongFrame)
}


def frame_to_wire(frame: ClientFrame | ServerFrame, version: int = PROTOCOL_VERSION) -> dict:
    return {"type": frame.TYPE, "v": version, **frame.to_wire()}


def encode_frame(frame: ClientFrame | ServerFrame, version: int = PROTOCOL_VERSION) -> bytes:
    """One frame -> the bytes of one binary WebSocket message (deterministic: same frame, same bytes).

    ``version`` other than PROTOCOL_VERSION only for an ``error`` frame answering a phone that speaks
    another version (:func:`reply_version`)."""
    if version != PROTOCOL_VERSION and (frame.TYPE != ErrorFrame.TYPE or version not in ERROR_FRAME_VERSIONS):
        raise ValueError(f"only error frames are encoded in versions {ERROR_FRAME_VERSIONS}, not {frame.TYPE}")
    return pack(frame_to_wire(frame, version))


def reply_version(data: Any) -> int:
    """The version to answer a (possibly undecodable) phone message in: the message's own ``v`` when it is
    one whose error frame we can write, else ours. Never raises."""
    try:
        obj = unpack(data, FrameError, DEFAULT_LIMITS.max_client_frame_bytes, "frame")
    except FrameError:
        return PROTOCOL_VERSION
    v = obj.get("v") if isinstance(obj, dict) else None
    return v if type(v) is int and v in ERROR_FRAME_VERSIONS else PROTOCOL_VERSION


def decode_client_frame(data: Any, limits: WireLimits = DEFAULT_LIMITS) -> ClientFrame:
    """What the server calls on each message from a phone."""
    f, ftype = _envelope(data, limits.max_client_frame_bytes, CLIENT_FRAMES, "phone -> server")
    return CLIENT_FRAMES[ftype].from_wire(f, limits)


def decode_server_frame(
    data: Any, limits: WireLimits = DEFAULT_LIMITS, schema: HandoffSpec | None = None
) -> ServerFrame:
    """What the phone calls on each message from the server; ``schema`` (the session's, from its
    ``session`` frame) reads inline hand-offs."""
    f, ftype = _envelope(data, limits.max_server_frame_bytes, SERVER_FRAMES, "server -> phone")
    if ftype == VerdictFrame.TYPE:
        return VerdictFrame.from_wire(f, limits, schema)
    return SERVER_FRAMES[ftype].from_wire(f, limits)


def _envelope(data: Any, max_bytes: int, allowed: dict, direction: str) -> tuple[Fields, str]:
    obj = unpack(data, FrameError, max_bytes, f"{direction} frame")
    f = Fields(obj, FrameError, f"{direction} frame")
    ftype = f.get("type", str)
    version = f.get("v", int)
    speaks_error = ftype == ErrorFrame.TYPE and allowed is SERVER_FRAMES and version in ERROR_FRAME_VERSIONS
    if version not in SUPPORTED_PROTOCOL_VERSIONS and not speaks_error:
        hint = f"; {UPGRADE_HINT}" if allowed is CLIENT_FRAMES and 0 < version < PROTOCOL_VERSION else ""
        raise FrameError(
            f"protocol version {version} is not supported: this side speaks HyCo protocol version "
            f"{PROTOCOL_VERSION} (supported: {list(SUPPORTED_PROTOCOL_VERSIONS)}){hint}",
            code="unsupported_version",
        )
    if ftype not in allowed:
        raise FrameError(
            f"{direction} frame type {ftype[:64]!r} is unknown; expected one of {sorted(allowed)}",
            code="unknown_type",
        )
    f.where = f"{ftype} frame"
    return f, ftype
