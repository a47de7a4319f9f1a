"""Frame envelope, encoding and decoding for both directions of the phone <-> server WebSocket.

Every frame is one binary WebSocket message holding one msgpack map whose first two keys are
``"type"`` (str) and ``"v"`` (the protocol version, int), followed by the frame's own fields
(``client_frames.py``, ``server_frames.py``; docs/protocol.md is the spec)::

    phone -> server:  start, tree
    server -> phone:  verdict, handoff_chunk, error, final

Decoding validates everything and raises only FrameError or HandoffSchemaError (``vllm_hyco.errors``),
each with a stable ``code`` from ``limits.ERROR_CODES``.

>>> from vllm_hyco.handoff.client_frames import TreeFrame
>>> tree = TreeFrame.from_lists(round=1, tokens=[5, 6], parents=[-1, 0])
>>> decode_client_frame(encode_frame(tree)) == tree
True
"""

from __future__ import annotations

from vllm_hyco.errors import FrameError
from vllm_hyco.handoff._fields import Fields, pack, unpack
from vllm_hyco.handoff.client_frames import StartFrame, TreeFrame
from vllm_hyco.handoff.limits import DEFAULT_LIMITS, WireLimits
from vllm_hyco.handoff.schema import HandoffSpec
from vllm_hyco.handoff.server_frames import ErrorFrame, FinalFrame, HandoffChunkFrame, VerdictFrame

PROTOCOL_VERSION = 1
SUPPORTED_PROTOCOL_VERSIONS = (1,)

ClientFrame = StartFrame | TreeFrame
ServerFrame = VerdictFrame | HandoffChunkFrame | ErrorFrame | FinalFrame
CLIENT_FRAMES = {cls.TYPE: cls for cls in (StartFrame, TreeFrame)}
SERVER_FRAMES = {cls.TYPE: cls for cls in (VerdictFrame, HandoffChunkFrame, ErrorFrame, FinalFrame)}


def frame_to_wire(frame) -> dict:
    return {"type": frame.TYPE, "v": PROTOCOL_VERSION, **frame.to_wire()}


def encode_frame(frame: ClientFrame | ServerFrame) -> bytes:
    """One frame -> the bytes of one binary WebSocket message (deterministic: same frame, same bytes)."""
    return pack(frame_to_wire(frame))


def decode_client_frame(data, limits: WireLimits = DEFAULT_LIMITS) -> ClientFrame:
    """What the server calls on each message from a phone."""
    f, ftype = _envelope(data, limits.max_client_frame_bytes, CLIENT_FRAMES, "phone -> server")
    return CLIENT_FRAMES[ftype].from_wire(f, limits)


def decode_server_frame(
    data, limits: WireLimits = DEFAULT_LIMITS, expect: HandoffSpec | None = None
) -> ServerFrame:
    """What the phone calls on each message from the server; ``expect`` checks inline hand-offs."""
    f, ftype = _envelope(data, limits.max_server_frame_bytes, SERVER_FRAMES, "server -> phone")
    if ftype == VerdictFrame.TYPE:
        return VerdictFrame.from_wire(f, limits, expect)
    return SERVER_FRAMES[ftype].from_wire(f, limits)


def _envelope(data, max_bytes: int, allowed: dict, direction: str) -> tuple[Fields, str]:
    obj = unpack(data, FrameError, max_bytes, f"{direction} frame")
    f = Fields(obj, FrameError, f"{direction} frame")
    ftype = f.get("type", str)
    version = f.get("v", int)
    if version not in SUPPORTED_PROTOCOL_VERSIONS:
        raise FrameError(
            f"protocol version {version} is not supported (supported: {list(SUPPORTED_PROTOCOL_VERSIONS)})",
            code="unsupported_version",
        )
    if ftype not in allowed:
        raise FrameError(
            f"{direction} frame type {ftype[:64]!r} is unknown; expected one of {sorted(allowed)}",
            code="unknown_type",
        )
    f.where = f"{ftype} frame"
    return f, ftype
