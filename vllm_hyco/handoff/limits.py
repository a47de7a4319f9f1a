"""Wire limits (one frozen dataclass, passed in) and the table of error codes that go in error frames.

The decoders in this package enforce the structural limits; the endpoint enforces the session ones
(sessions per server, idle time) with the codes listed here, so a phone sees one code table
(docs/protocol.md, "Errors").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm_hyco.errors import ConfigError
from vllm_hyco.handoff.tree_contract import DEFAULT_NODE_BUDGET

AIOHTTP_DEFAULT_MAX_MSG = 4 * 1024 * 1024  # aiohttp ClientSession.ws_connect(max_msg_size=4 MiB)


@dataclass(frozen=True)
class WireLimits:
    """Structural limits every decoder checks. Defaults fit the paper's setting (B = 32, W = 1,024)."""

    max_nodes: int = DEFAULT_NODE_BUDGET  # draft nodes per tree, root excluded (tree_contract)
    max_client_frame_bytes: int = 1 << 20  # any phone -> server frame
    max_prompt_bytes: int = 768 << 10  # the msgpack-encoded OpenAI body inside `start`
    max_server_frame_bytes: int = AIOHTTP_DEFAULT_MAX_MSG  # any server -> phone frame
    chunk_bytes: int = 1 << 20  # hand-off bytes per handoff_chunk frame
    max_handoff_positions: int = 1024  # K/V positions in one hand-off (the ring size W)
    max_handoff_bytes: int = 64 << 20  # one encoded hand-off (a reassembled seed included)
    max_hidden_size: int = 65536
    max_layers: int = 16  # layers listed in a hand-off header
    max_kv_channels: int = 65536  # kv_heads * head_dim of one layer
    max_token_id: int = 2**31 - 1
    max_round: int = 2**31 - 1
    max_string_bytes: int = 64 << 10  # ids, messages and texts inside frames

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"WireLimits.{f.name} must be a positive int, got {value!r}")
        if self.max_nodes > 254:
            raise ConfigError(
                f"WireLimits.max_nodes={self.max_nodes}: parents travel as uint8 with 0xFF for "
                f"the root, so at most 254 nodes fit; lower it"
            )
        if self.chunk_bytes + 1024 > self.max_server_frame_bytes:
            raise ConfigError(
                f"WireLimits.chunk_bytes={self.chunk_bytes} leaves no room for the chunk frame's "
                f"own fields under max_server_frame_bytes={self.max_server_frame_bytes}; "
                f"use at most max_server_frame_bytes - 1024"
            )


DEFAULT_LIMITS = WireLimits()


# code -> (fatal by default, what it means / what to fix). Frame decoders raise FrameError or
# HandoffSchemaError with these codes; the endpoint sends them in error frames.
ERROR_CODES: dict[str, tuple[bool, str]] = {
    # framing (raised by vllm_hyco.handoff.frames)
    "bad_msgpack": (False, "the message is not one valid msgpack object; send one binary frame per message"),
    "frame_too_large": (False, "the frame is over the size limit; shorten the prompt or tree"),
    "bad_field_type": (False, "a field has the wrong msgpack type; see docs/protocol.md for its type"),
    "bad_field_value": (False, "a field's value is out of range or not an allowed value"),
    "missing_field": (False, "a required field is absent"),
    "unknown_field": (False, "a field this protocol version does not define; drop it or raise `v`"),
    "unknown_type": (False, "the frame's `type` is not one this direction accepts"),
    "unsupported_version": (True, "the frame's `v` is not a protocol version this server speaks"),
    "bad_request": (True, "the OpenAI body in `start` is malformed"),
    "request_too_large": (True, "the OpenAI body in `start` is over max_prompt_bytes"),
    "bad_hyco": (True, "the `hyco` object in `start` is malformed (mode, epsilon, capabilities, resume)"),
    "too_many_nodes": (False, "the tree has more nodes than the limit or the granted budget"),
    "bad_tokens": (False, "the tree's tokens field is not n+1 uint32 little-endian ids in range"),
    "bad_parents": (False, "parents must be n+1 bytes, 0xFF for the root, 0 <= parents[i] < i"),
    "bad_labels": (False, "labels must be n+1 bytes, 0 (root) for row 0, 1..4 for the others"),
    "bad_verdict": (True, "a verdict whose fields contradict each other"),
    # hand-off (raised by vllm_hyco.handoff.schema / chunks / quant)
    "bad_handoff": (True, "a malformed hand-off"),
    "handoff_version": (True, "the hand-off schema version is not one this side decodes"),
    "fingerprint_mismatch": (
        True,
        "server and phone run different models or scales; update the model bundle",
    ),
    "schema_mismatch": (True, "the tree's `schema` (or a resume's) is not this session's schema_hash"),
    "layout_mismatch": (True, "the hand-off's layer layout differs from the phone's model"),
    "scales_mismatch": (True, "the hand-off was quantized with other scales than the phone ships"),
    "bad_scales": (True, "a scales file or scale array is malformed"),
    "chunk_missing": (True, "a hand-off chunk never arrived; resume with need_seed"),
    "chunk_duplicate": (True, "a hand-off chunk arrived twice"),
    "chunk_out_of_order": (True, "hand-off chunks arrived out of order"),
    "chunk_corrupt": (True, "the reassembled hand-off's size or sha256 differs from the verdict's reference"),
    # session and transport (raised by the endpoint with SessionError / FrameError)
    "unauthorized": (True, "missing or wrong API key (HTTP 401 at the WebSocket handshake)"),
    "no_session": (False, "a tree arrived before `start` on this connection"),
    "unknown_session": (True, "resume names a session the server does not hold (expired or never existed)"),
    "bad_round": (False, "the tree's round is not the next round of the session"),
    "budget_exceeded": (False, "the tree has more nodes than the last verdict granted"),
    "too_many_sessions": (True, "the server holds its maximum number of sessions; retry later"),
    "idle_timeout": (True, "the session was idle past the timeout and was closed"),
    "bad_tree": (False, "the tree breaks a semantic rule (duplicate siblings, vocabulary, root token)"),
    "unsupported_field": (True, "a request field HyCo sessions cannot honour"),
    "server_busy": (False, "the server cannot take this round now; resend the same tree"),
    "internal_error": (True, "a server bug; the message says what failed"),
}
